//! The DeepSeek V4 serial sums on AVX-512 VNNI (see [`crate::serial`]): each
//! row's float sum stays one chain in block order, as in the reference; what
//! the wider tier speeds up is the exact integer part of each Q8_0 block and
//! the element-wise weighted sums.

use std::arch::x86_64::*;

use crate::q8_0::QK8_0;
use crate::serial::{Q8Row, LANES, Q8_0X8_BLOCK};

/// 64 bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn load64(b: &[u8]) -> __m512i {
    let b: &[u8; 64] = b[..64].try_into().unwrap();
    // SAFETY: `b` is 64 readable bytes; `loadu` has no alignment requirement.
    unsafe { _mm512_loadu_si512(b.as_ptr().cast()) }
}

/// [`crate::serial::dot_q8_0x8_f32s_ref`] for `N` activation rows. A block of
/// the group is four 64-byte slices, each eight rows' bytes `8k..8k + 8`,
/// offset by 128 ([`crate::serial::Q8_0x8`]); `vpdpbusd` of a slice (unsigned)
/// against the row's bytes `8k..8k + 8` broadcast (signed) adds each row's two
/// 4-byte sums to its lanes `2r, 2r + 1`. Starting from `-128·Σx` in the even
/// lanes (the offset's share, one value per activation block) and folding each lane pair gives the
/// eight exact integer sums in the even lanes; the float terms
/// `(d_w·d_x)·isum` and the running sums are formed there (the odd lanes carry
/// values nobody reads), as the scalar loop does per row.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn dot_q8_0x8_n<const N: usize>(group: &[u8], x: &[Q8Row<'_>], out: &mut [[f32; LANES]]) {
    let mut acc = [_mm512_setzero_ps(); N];
    for (b, blk) in group.chunks_exact(Q8_0X8_BLOCK).enumerate() {
        // The eight f16 scales, each in both lanes of its row (exact widening).
        let h: &[u8; 16] = blk[..2 * LANES].try_into().unwrap();
        // SAFETY: `h` is 16 readable bytes; `loadu` has no alignment requirement.
        let h = _mm256_cvtepu16_epi32(unsafe { _mm_loadu_si128(h.as_ptr().cast()) });
        let scales = _mm512_cvtph_ps(_mm256_or_si256(h, _mm256_slli_epi32::<16>(h)));
        let w: [__m512i; 4] = std::array::from_fn(|k| load64(&blk[2 * LANES + 64 * k..]));
        for j in 0..N {
            let q: &[u8] = bytemuck::cast_slice(&x[j].qs[b * QK8_0..(b + 1) * QK8_0]);
            let xb: [__m512i; 4] = std::array::from_fn(|k| {
                _mm512_set1_epi64(i64::from_le_bytes(q[8 * k..8 * k + 8].try_into().unwrap()))
            });
            // Two chains, for latency; the integer sums are exact in any order.
            // The offset's share goes into the even lane of each row's pair.
            let offset = _mm512_set1_epi64(i64::from((-128 * x[j].sums[b]) as u32));
            let s0 = _mm512_dpbusd_epi32(offset, w[0], xb[0]);
            let s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], xb[1]);
            let s0 = _mm512_dpbusd_epi32(s0, w[2], xb[2]);
            let s1 = _mm512_dpbusd_epi32(s1, w[3], xb[3]);
            let s = _mm512_add_epi32(s0, s1);
            let isum = _mm512_cvtepi32_ps(_mm512_add_epi32(s, _mm512_srli_epi64::<32>(s)));
            let t = _mm512_mul_ps(_mm512_mul_ps(scales, _mm512_set1_ps(x[j].d[b])), isum);
            acc[j] = _mm512_add_ps(acc[j], t);
        }
    }
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    for (o, a) in out.iter_mut().zip(acc) {
        let v = _mm512_castps512_ps256(_mm512_permutexvar_ps(even, a));
        // SAFETY: `o` is 8 writable f32s; `storeu` has no alignment requirement.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), v) };
    }
}

/// The table entry: [`super::super::avx2::check_q8_0x8`]'s checks, then the
/// kernel for the row count.
pub(super) fn dot_q8_0x8_f32s(group: &[u8], x: &[Q8Row<'_>], out: &mut [[f32; LANES]]) {
    super::super::avx2::check_q8_0x8(group, x, out.len());
    // SAFETY: this tier's table is handed out only after its features were
    // detected (see `super::super::avx512()`).
    unsafe {
        match x.len() {
            1 => dot_q8_0x8_n::<1>(group, x, out),
            2 => dot_q8_0x8_n::<2>(group, x, out),
            3 => dot_q8_0x8_n::<3>(group, x, out),
            4 => dot_q8_0x8_n::<4>(group, x, out),
            _ => {}
        }
    }
}

/// [`crate::serial::axpy_ref`], sixteen elements at a time (the same multiply
/// and add per element).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn axpy16(w: f32, x: &[f32], out: &mut [f32]) {
    let wv = _mm512_set1_ps(w);
    let n16 = x.len() / 16 * 16;
    for (o, v) in out[..n16]
        .chunks_exact_mut(16)
        .zip(x[..n16].chunks_exact(16))
    {
        // SAFETY: `o` and `v` are 16 f32s each; `loadu`/`storeu` are unaligned.
        unsafe {
            let r = _mm512_add_ps(
                _mm512_loadu_ps(o.as_ptr()),
                _mm512_mul_ps(wv, _mm512_loadu_ps(v.as_ptr())),
            );
            _mm512_storeu_ps(o.as_mut_ptr(), r);
        }
    }
    crate::serial::axpy_ref(w, &x[n16..], &mut out[n16..]);
}

pub(super) fn axpy(w: f32, x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "axpy lengths");
    // SAFETY: as in `dot_q8_0x8_f32s`.
    unsafe { axpy16(w, x, out) }
}
