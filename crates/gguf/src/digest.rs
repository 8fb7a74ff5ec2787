//! A digest of a GGUF's tensor data, and a cache of digests keyed by the file's
//! identity, so that what a checkpoint was computed with can name the weights
//! themselves, not only their layout, without hashing tens of gigabytes at
//! every start.
//!
//! The digest is XXH3-128 over the 16-byte XXH3-128 digests of the data section
//! (everything from the data offset to the end of the image, so every tensor's
//! bytes and the padding between them) cut into chunks of [`CHUNK`] bytes, after
//! the section's length. The chunks are hashed by several threads; the result
//! does not depend on how many. XXH3 runs at memory speed, so a file read from
//! the page cache costs a fraction of a second per gigabyte per thread, a cold
//! one what the disk takes to read it.
//!
//! The cache holds one small file per (device, inode) under its directory,
//! naming the file's size, modification time and change time with the digest.
//! A lookup uses the entry only when all five match the opened file; anything
//! that rewrites the file changes its modification or change time (the change
//! time cannot be set back without changing the clock), so it is hashed again.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use xxhash_rust::xxh3::{xxh3_128, Xxh3};

use crate::Gguf;

/// Bytes per hashed chunk.
pub const CHUNK: usize = 64 << 20;

const CACHE_MAGIC: &str = "ds4 tensor-data digest v1";

/// A file as the OS identifies it, taken from the opened file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileIdentity {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    /// Modification and change times, nanoseconds since the Unix epoch.
    pub mtime_ns: i128,
    pub ctime_ns: i128,
}

impl FileIdentity {
    pub fn of(meta: &fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
        FileIdentity {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: ns(meta.mtime(), meta.mtime_nsec()),
            ctime_ns: ns(meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// What computing a digest reports.
#[derive(Debug)]
pub enum DigestEvent<'a> {
    /// The cache had it: the file's identity matched its entry.
    Cached,
    /// Hashing: `done` of `total` bytes.
    Progress { done: u64, total: u64 },
    /// Hashed `bytes` in `seconds` (and cached, when a cache is set).
    Hashed { bytes: u64, seconds: f64 },
    /// The cache could not be read or written; the digest is right anyway.
    CacheFailed(&'a io::Error),
}

/// How [`Gguf::data_digest`] runs.
pub struct DigestOptions<'a> {
    /// Where digests are cached (`$DS4_HOME/fingerprints` for the CLI); `None`
    /// hashes every time.
    pub cache_dir: Option<PathBuf>,
    /// Hashing threads (at least 1).
    pub threads: usize,
    pub events: &'a (dyn Fn(DigestEvent<'_>) + Sync),
}

impl Default for DigestOptions<'_> {
    fn default() -> Self {
        DigestOptions {
            cache_dir: None,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            events: &|_| {},
        }
    }
}

impl Gguf {
    /// The digest of the tensor data (see the module doc), from the cache when
    /// the opened file's identity matches an entry there.
    pub fn data_digest(&self, opts: &DigestOptions<'_>) -> [u8; 16] {
        let cache = opts.cache_dir.as_deref().zip(self.identity());
        if let Some((dir, id)) = cache {
            match read_entry(dir, &id) {
                Ok(Some(d)) => {
                    (opts.events)(DigestEvent::Cached);
                    return d;
                }
                Ok(None) => {}
                Err(e) => (opts.events)(DigestEvent::CacheFailed(&e)),
            }
        }
        let t = Instant::now();
        let data = self.bytes().get(self.data_offset as usize..).unwrap_or(&[]);
        let digest = self.hash_chunks(data, opts);
        (opts.events)(DigestEvent::Hashed {
            bytes: data.len() as u64,
            seconds: t.elapsed().as_secs_f64(),
        });
        if let Some((dir, id)) = cache {
            if let Err(e) = write_entry(dir, &id, &digest) {
                (opts.events)(DigestEvent::CacheFailed(&e));
            }
        }
        digest
    }

    fn hash_chunks(&self, data: &[u8], opts: &DigestOptions<'_>) -> [u8; 16] {
        let done = AtomicU64::new(0);
        let total = data.len() as u64;
        hash_data(data, CHUNK, opts.threads, |start, len| {
            // Hashed pages need not stay resident: the model reads what it
            // needs when it binds and runs.
            let at = self.data_offset as usize + start;
            self.evict(at..at + len);
            let d = done.fetch_add(len as u64, Ordering::Relaxed) + len as u64;
            (opts.events)(DigestEvent::Progress { done: d, total });
        })
    }
}

/// The digest of `data` in chunks of `chunk` bytes hashed by `threads` threads
/// (the result does not depend on how many); `hashed(start, len)` is called
/// after each chunk.
fn hash_data(
    data: &[u8],
    chunk: usize,
    threads: usize,
    hashed: impl Fn(usize, usize) + Sync,
) -> [u8; 16] {
    let n_chunks = data.len().div_ceil(chunk);
    let next = AtomicUsize::new(0);
    let mut digests = vec![[0u8; 16]; n_chunks];
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads.clamp(1, n_chunks.max(1)))
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let start = i * chunk;
                        if start >= data.len() {
                            return mine;
                        }
                        let part = &data[start..(start + chunk).min(data.len())];
                        mine.push((i, xxh3_128(part).to_le_bytes()));
                        hashed(start, part.len());
                    }
                })
            })
            .collect();
        for w in workers {
            // The loop cannot panic (its slicing is bounded above); were it to,
            // its chunks would stay zero and the digest would differ.
            if let Ok(mine) = w.join() {
                for (i, d) in mine {
                    digests[i] = d;
                }
            }
        }
    });
    let mut all = Xxh3::new();
    all.update(&(data.len() as u64).to_le_bytes());
    for d in &digests {
        all.update(d);
    }
    all.digest128().to_le_bytes()
}

/// The cache entry's path for a file identity.
fn entry_path(dir: &Path, id: &FileIdentity) -> PathBuf {
    dir.join(format!("{:x}-{:x}.digest", id.dev, id.ino))
}

fn entry_text(id: &FileIdentity, digest: &[u8; 16]) -> String {
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{CACHE_MAGIC}\nsize {} mtime_ns {} ctime_ns {}\n{hex}\n",
        id.size, id.mtime_ns, id.ctime_ns
    )
}

/// The cached digest of `id`, `None` when there is no entry or it is stale.
fn read_entry(dir: &Path, id: &FileIdentity) -> io::Result<Option<[u8; 16]>> {
    let text = match fs::read_to_string(entry_path(dir, id)) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let expected = entry_text(id, &[0; 16]);
    let mut lines = text.lines();
    let mut want = expected.lines();
    if lines.next() != want.next() || lines.next() != want.next() {
        return Ok(None);
    }
    let hex = lines.next().unwrap_or("");
    let mut digest = [0u8; 16];
    for (i, b) in digest.iter_mut().enumerate() {
        match hex.get(2 * i..2 * i + 2).map(|h| u8::from_str_radix(h, 16)) {
            Some(Ok(v)) => *b = v,
            _ => return Ok(None),
        }
    }
    Ok((hex.len() == 32).then_some(digest))
}

/// Writes the entry atomically (a temp file renamed over it).
fn write_entry(dir: &Path, id: &FileIdentity, digest: &[u8; 16]) -> io::Result<()> {
    fs::create_dir_all(dir)?;
    let path = entry_path(dir, id);
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    fs::write(&tmp, entry_text(id, digest))?;
    fs::rename(&tmp, &path).inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GgmlType, GgufWriter, Value};
    use std::sync::Mutex;

    #[test]
    fn the_digest_does_not_depend_on_threads_and_sees_every_byte() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let one = hash_data(&data, 1000, 1, |_, _| {});
        for threads in [2, 3, 16] {
            assert_eq!(hash_data(&data, 1000, threads, |_, _| {}), one);
        }
        let seen = Mutex::new(0);
        hash_data(&data, 999, 4, |_, len| *seen.lock().unwrap() += len);
        assert_eq!(*seen.lock().unwrap(), data.len());
        for at in [0, 999, 5000, 9999] {
            let mut other = data.clone();
            other[at] ^= 1;
            assert_ne!(hash_data(&other, 1000, 2, |_, _| {}), one, "byte {at}");
        }
        assert_ne!(hash_data(&data[..9999], 1000, 2, |_, _| {}), one);
        assert_ne!(hash_data(&[], 1000, 2, |_, _| {}), one);
    }

    fn write_model(path: &Path, fill: u8) {
        let mut w = GgufWriter::new();
        w.add_kv("general.architecture", Value::String("llama".into()));
        w.add_tensor("t", &[64], GgmlType::F32, vec![fill; 256])
            .unwrap();
        fs::write(path, w.to_bytes().unwrap()).unwrap();
    }

    /// Hashed once, then taken from the cache while the file is unchanged;
    /// a rewritten file (same size) is hashed again.
    #[test]
    fn the_cache_follows_the_file() {
        let dir = std::env::temp_dir().join(format!("ds4-digest-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let model = dir.join("m.gguf");
        write_model(&model, 1);
        let log = Mutex::new(Vec::new());
        let events = |e: DigestEvent<'_>| {
            log.lock().unwrap().push(match e {
                DigestEvent::Cached => "cached",
                DigestEvent::Hashed { .. } => "hashed",
                DigestEvent::Progress { .. } => "progress",
                DigestEvent::CacheFailed(_) => "failed",
            })
        };
        let opts = DigestOptions {
            cache_dir: Some(dir.join("cache")),
            threads: 2,
            events: &events,
        };
        let first = Gguf::open(&model).unwrap().data_digest(&opts);
        assert_eq!(*log.lock().unwrap(), ["progress", "hashed"]);
        assert_eq!(Gguf::open(&model).unwrap().data_digest(&opts), first);
        assert_eq!(log.lock().unwrap().last(), Some(&"cached"));
        std::thread::sleep(std::time::Duration::from_millis(20));
        write_model(&model, 2);
        log.lock().unwrap().clear();
        let changed = Gguf::open(&model).unwrap().data_digest(&opts);
        assert_ne!(changed, first);
        assert_eq!(*log.lock().unwrap(), ["progress", "hashed"]);
        // Without a cache, or from memory: the same digest.
        let plain = Gguf::open(&model)
            .unwrap()
            .data_digest(&DigestOptions::default());
        assert_eq!(plain, changed);
        let bytes = fs::read(&model).unwrap();
        assert_eq!(
            Gguf::from_bytes(bytes)
                .unwrap()
                .data_digest(&DigestOptions::default()),
            changed
        );
        // A damaged entry is ignored.
        for entry in fs::read_dir(dir.join("cache")).unwrap() {
            fs::write(entry.unwrap().path(), "garbage").unwrap();
        }
        log.lock().unwrap().clear();
        assert_eq!(Gguf::open(&model).unwrap().data_digest(&opts), changed);
        assert_eq!(*log.lock().unwrap(), ["progress", "hashed"]);
        fs::remove_dir_all(&dir).unwrap();
    }
}
