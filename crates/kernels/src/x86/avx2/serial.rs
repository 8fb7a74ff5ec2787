//! AVX2 versions of the serial-sum kernels of [`crate::serial`]: eight (or
//! four times eight) running f32 sums side by side, one per lane, each with
//! exactly the scalar reference's multiplies and adds in its order, so every
//! lane is bitwise its scalar sum. Integer block sums (Q8_0) are exact in any
//! order.

use std::arch::x86_64::*;

use super::{hsum_8x8, load_f32x8, store_f32x8};
use crate::q8_0::QK8_0;
use crate::serial::{LANES, Q8_0X8_BLOCK};

/// Loads 32 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load32(b: &[u8]) -> __m256i {
    let b: &[u8; 32] = b[..32].try_into().unwrap();
    // SAFETY: `b` is 32 readable bytes; `loadu` has no alignment requirement.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

/// Eight f16 values widened to f32 (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load_f16x8<T: bytemuck::Pod>(h: &[T]) -> __m256 {
    let b: &[u8; 16] = bytemuck::cast_slice(h)[..16].try_into().unwrap();
    // SAFETY: `b` is 16 readable bytes; `loadu` has no alignment requirement.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(b.as_ptr().cast()) })
}

/// [`crate::serial::dot_q8_0x8_f32s_ref`] for `N` activation rows: per
/// block, each weight vector is loaded once for the `N` rows; per row the
/// eight rows' exact integer sums (`maddubs` of `|w|` against the
/// activations signed by `w`: |w| <= 128 and |x| <= 127 never saturate),
/// then per lane `acc += (d_w·d_x)·isum`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q8_0x8_n<const N: usize>(
    group: &[u8],
    qs: &[&[i8]],
    d: &[&[f32]],
    out: &mut [[f32; LANES]],
) {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); N];
    for (b, blk) in group.chunks_exact(Q8_0X8_BLOCK).enumerate() {
        let scales = load_f16x8(&blk[..2 * LANES]);
        let a: [__m256i; N] = std::array::from_fn(|j| {
            load32(bytemuck::cast_slice(&qs[j][b * QK8_0..(b + 1) * QK8_0]))
        });
        let mut p = [[_mm256_setzero_si256(); LANES]; N];
        for l in 0..LANES {
            let w = load32(&blk[2 * LANES + QK8_0 * l..]);
            let aw = _mm256_sign_epi8(w, w);
            for j in 0..N {
                let prod = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(a[j], w));
                p[j][l] = _mm256_madd_epi16(prod, ones);
            }
        }
        for j in 0..N {
            let isum = _mm256_cvtepi32_ps(hsum_8x8(&p[j]));
            let t = _mm256_mul_ps(_mm256_mul_ps(scales, _mm256_set1_ps(d[j][b])), isum);
            acc[j] = _mm256_add_ps(acc[j], t);
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        store_f32x8(o, a);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q8_0x8_f32s(group: &[u8], qs: &[&[i8]], d: &[&[f32]], out: &mut [[f32; LANES]]) {
    match qs.len() {
        1 => dot_q8_0x8_n::<1>(group, qs, d, out),
        2 => dot_q8_0x8_n::<2>(group, qs, d, out),
        3 => dot_q8_0x8_n::<3>(group, qs, d, out),
        4 => dot_q8_0x8_n::<4>(group, qs, d, out),
        _ => {}
    }
}

/// [`crate::serial::dots_f16x8_serial_ref`] with `N` chains.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dots_f16x8_n<const N: usize>(w: &[&[u16]], x: &[&[f32]], out: &mut [[f32; LANES]]) {
    let n = x[0].len();
    let mut acc = [_mm256_setzero_ps(); N];
    for i in 0..n {
        for j in 0..N {
            let wv = load_f16x8(&w[j][i * LANES..(i + 1) * LANES]);
            acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(wv, _mm256_set1_ps(x[j][i])));
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        store_f32x8(o, a);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dots_f16x8_serial(w: &[&[u16]], x: &[&[f32]], out: &mut [[f32; LANES]]) {
    match x.len() {
        1 => dots_f16x8_n::<1>(w, x, out),
        2 => dots_f16x8_n::<2>(w, x, out),
        3 => dots_f16x8_n::<3>(w, x, out),
        4 => dots_f16x8_n::<4>(w, x, out),
        _ => {}
    }
}

/// [`crate::serial::dots8_serial_ref`] with `N` rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dots8_n<const N: usize>(a: &[f32], b: &[&[f32]], out: &mut [[f32; LANES]]) {
    let n = b[0].len();
    let mut acc = [_mm256_setzero_ps(); N];
    for i in 0..n {
        let av = load_f32x8(&a[i * LANES..]);
        for j in 0..N {
            acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(av, _mm256_set1_ps(b[j][i])));
        }
    }
    for (o, v) in out.iter_mut().zip(acc) {
        store_f32x8(o, v);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dots8_serial(a: &[f32], b: &[&[f32]], out: &mut [[f32; LANES]]) {
    match b.len() {
        1 => dots8_n::<1>(a, b, out),
        2 => dots8_n::<2>(a, b, out),
        3 => dots8_n::<3>(a, b, out),
        4 => dots8_n::<4>(a, b, out),
        _ => {}
    }
}
