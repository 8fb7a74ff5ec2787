//! [`HugeBuf`]: an owned slice whose large instances live in an anonymous
//! mapping the kernel is asked to back with transparent huge pages.
//!
//! Why: decode streams every weight matrix (and, at long contexts, the K/V
//! cache) from memory once per token. On 4 KiB pages Gemma 3's 178 MB output
//! head is 43,000 pages, each a TLB miss and a page walk in the middle of the
//! stream; on 2 MiB pages it is 85. Where THP is `madvise` only (the Debian
//! default, and these VMs) a plain `Vec` never gets huge pages. Measured on a
//! Zen 4 VM, one thread, the 640x262144 Q8_0 head in pairs (`bench_pairs`,
//! best of each, back to back): 10.3 ms a token on small pages, 9.4 on huge
//! ones; Gemma 3's whole decode at one thread, 5 alternating runs, median
//! 53.1 -> 59.2 t/s with the attention change beside it. The advice is a hint:
//! a kernel without THP, or one out of huge pages, gives small pages and the
//! same results.

use std::fmt;
use std::ops::{Deref, DerefMut};

use bytemuck::Pod;

/// Buffers at least this large are mapped (and advised); smaller ones, which
/// no huge page would cover, stay on the heap.
const MAPPED_BYTES: usize = 2 << 20;

/// An owned `[T]`, zero-initialized or copied from a slice; see the module.
pub struct HugeBuf<T: Pod> {
    storage: Storage<T>,
}

enum Storage<T> {
    Heap(Vec<T>),
    Mapped { map: memmap2::MmapMut, len: usize },
}

impl<T: Pod> HugeBuf<T> {
    /// `len` zeros. A mapped buffer's pages cost nothing until written.
    ///
    /// # Panics
    /// If the memory cannot be had (as a `Vec` would abort).
    pub fn zeroed(len: usize) -> Self {
        let bytes = len
            .checked_mul(size_of::<T>())
            .expect("HugeBuf: size overflows");
        if bytes < MAPPED_BYTES {
            return HugeBuf {
                storage: Storage::Heap(vec![T::zeroed(); len]),
            };
        }
        let map = memmap2::MmapMut::map_anon(bytes)
            .unwrap_or_else(|e| panic!("HugeBuf: cannot map {bytes} bytes: {e}"));
        #[cfg(target_os = "linux")]
        {
            // A hint only: without THP the pages are small and nothing else
            // changes.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        HugeBuf {
            storage: Storage::Mapped { map, len },
        }
    }

    /// A copy of `src`.
    pub fn from_slice(src: &[T]) -> Self {
        let mut buf = Self::zeroed(src.len());
        buf.copy_from_slice(src);
        buf
    }

    /// `v`'s values: the `Vec` itself where small, else a mapped copy.
    pub fn from_vec(v: Vec<T>) -> Self {
        if size_of_val(&v[..]) < MAPPED_BYTES {
            return HugeBuf {
                storage: Storage::Heap(v),
            };
        }
        Self::from_slice(&v)
    }
}

impl<T: Pod> Deref for HugeBuf<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.storage {
            Storage::Heap(v) => v,
            // A mapping is page-aligned, so aligned for any `T`.
            Storage::Mapped { map, len } => &bytemuck::cast_slice(&map[..])[..*len],
        }
    }
}

impl<T: Pod> DerefMut for HugeBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.storage {
            Storage::Heap(v) => v,
            Storage::Mapped { map, len } => &mut bytemuck::cast_slice_mut(&mut map[..])[..*len],
        }
    }
}

impl<T: Pod> Clone for HugeBuf<T> {
    fn clone(&self) -> Self {
        Self::from_slice(self)
    }
}

impl<T: Pod> fmt::Debug for HugeBuf<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mapped = matches!(self.storage, Storage::Mapped { .. });
        f.debug_struct("HugeBuf")
            .field("len", &self.len())
            .field("mapped", &mapped)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_mapped_buffers_hold_what_was_written() {
        for len in [
            0,
            1,
            1000,
            MAPPED_BYTES / 4 - 1,
            MAPPED_BYTES / 4,
            3 * MAPPED_BYTES / 4 + 5,
        ] {
            let mut b = HugeBuf::<u32>::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0), "{len} zeros");
            for (i, x) in b.iter_mut().enumerate() {
                *x = i as u32 ^ 0x5a5a;
            }
            let c = b.clone();
            assert!(c.iter().enumerate().all(|(i, &x)| x == i as u32 ^ 0x5a5a));
            let d = HugeBuf::from_slice(&c[..len / 2]);
            assert_eq!(&d[..], &c[..len / 2]);
            let e = HugeBuf::from_vec(c.to_vec());
            assert_eq!(&e[..], &c[..]);
            assert_eq!(format!("{e:?}"), format!("{b:?}"));
            let mapped = format!("{b:?}").contains("mapped: true");
            assert_eq!(mapped, len * 4 >= MAPPED_BYTES, "{len}: {b:?}");
        }
    }
}
