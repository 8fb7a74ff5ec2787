//! AVX2 versions of the serial-sum kernels of [`crate::serial`]: eight (or
//! four times eight) running f32 sums side by side, one per lane, each with
//! exactly the scalar reference's multiplies and adds in its order, so every
//! lane is bitwise its scalar sum. Integer block sums (Q8_0) are exact in any
//! order.

use std::arch::x86_64::*;

use super::{load_f32x8, store_f32x8};
use crate::q8_0::QK8_0;
use crate::serial::{Q8Row, HEADS, LANES, Q8_0X16_BLOCK, Q8_ROWS};

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

/// [`crate::serial::dot_q8_0x16_f32s_ref`] for `N` activation rows, one
/// half of the group (rows `8h..8h + 8`, the bytes `32h..32h + 32` of each
/// slice) at a time. Per block the half's quants are made signed again and
/// their absolute values taken once for the `N` rows; per row and slice the
/// activations' four bytes are broadcast, and `maddubs` of `|w|` against them
/// signed by `w` (|w| <= 128 and |x| <= 127 never saturate), summed in pairs
/// by `madd`, adds each row's 4-byte sum to its own lane: the eight rows'
/// exact integer sums; then per lane `acc += (d_w·d_x)·isum`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q8_0x16_n<const N: usize>(group: &[u8], x: &[Q8Row<'_>], out: &mut [[f32; Q8_ROWS]]) {
    let ones = _mm256_set1_epi16(1);
    let offset = _mm256_set1_epi8(0x80u8 as i8);
    for h in 0..2 {
        let mut acc = [_mm256_setzero_ps(); N];
        for (b, blk) in group.chunks_exact(Q8_0X16_BLOCK).enumerate() {
            let scales = load_f16x8(&blk[2 * LANES * h..2 * LANES * (h + 1)]);
            let w: [__m256i; 8] = std::array::from_fn(|k| {
                _mm256_xor_si256(load32(&blk[2 * Q8_ROWS + 64 * k + 32 * h..]), offset)
            });
            let aw: [__m256i; 8] = std::array::from_fn(|k| _mm256_sign_epi8(w[k], w[k]));
            for j in 0..N {
                let q: &[u8] = bytemuck::cast_slice(&x[j].qs[b * QK8_0..(b + 1) * QK8_0]);
                let mut s = [_mm256_setzero_si256(); 2];
                for k in 0..8 {
                    let xb = _mm256_set1_epi32(i32::from_le_bytes(
                        q[4 * k..4 * k + 4].try_into().unwrap(),
                    ));
                    let p = _mm256_maddubs_epi16(aw[k], _mm256_sign_epi8(xb, w[k]));
                    s[k % 2] = _mm256_add_epi32(s[k % 2], _mm256_madd_epi16(p, ones));
                }
                let isum = _mm256_cvtepi32_ps(_mm256_add_epi32(s[0], s[1]));
                let t = _mm256_mul_ps(_mm256_mul_ps(scales, _mm256_set1_ps(x[j].d[b])), isum);
                acc[j] = _mm256_add_ps(acc[j], t);
            }
        }
        for (o, a) in out.iter_mut().zip(acc) {
            store_f32x8(&mut o[LANES * h..LANES * (h + 1)], a);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q8_0x16_f32s(group: &[u8], x: &[Q8Row<'_>], out: &mut [[f32; Q8_ROWS]]) {
    super::super::dispatch_chains!(dot_q8_0x16_n, x.len(), 4, (group, x, out))
}

/// [`crate::serial::dots_f16x8_serial_ref`] with `N` chains.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dots_f16x8_n<const N: usize>(w: &[u16], x: &[&[f32]], out: &mut [[f32; LANES]]) {
    let n = x[0].len();
    let x: [&[f32]; N] = std::array::from_fn(|j| &x[j][..n]);
    let mut acc = [_mm256_setzero_ps(); N];
    for (i, w) in w[..n * LANES].chunks_exact(LANES).enumerate() {
        let wv = load_f16x8(w);
        for j in 0..N {
            acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(wv, _mm256_set1_ps(x[j][i])));
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        store_f32x8(o, a);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dots_f16x8_serial(w: &[u16], x: &[&[f32]], out: &mut [[f32; LANES]]) {
    super::super::dispatch_chains!(dots_f16x8_n, x.len(), 8, (w, x, out))
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
    super::super::dispatch_chains!(dots8_n, b.len(), 4, (a, b, out))
}

/// [`crate::serial::dots16_serial_ref`] with `N` rows, eight heads at a time.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dots16_n<const N: usize>(a: &[f32], b: &[&[f32]], out: &mut [[f32; HEADS]]) {
    let n = b[0].len();
    let b: [&[f32]; N] = std::array::from_fn(|j| &b[j][..n]);
    for h in 0..HEADS / LANES {
        let mut acc = [_mm256_setzero_ps(); N];
        for i in 0..n {
            let av = load_f32x8(&a[i * HEADS + LANES * h..]);
            for j in 0..N {
                acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(av, _mm256_set1_ps(b[j][i])));
            }
        }
        for (o, v) in out.iter_mut().zip(acc) {
            store_f32x8(&mut o[LANES * h..], v);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dots16_serial(a: &[f32], b: &[&[f32]], out: &mut [[f32; HEADS]]) {
    super::super::dispatch_chains!(dots16_n, b.len(), 8, (a, b, out))
}

/// [`crate::serial::wsum16_serial_ref`] for rows of `n`: per eight heads and
/// eight elements, eight running sums in registers over all the rows (the
/// rows in order, so each element keeps the reference's chain); the `n % 8`
/// tail element by element in the same order.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn wsum16_serial(w: &[[f32; HEADS]], rows: &[&[f32]], out: &mut [f32], n: usize) {
    let n8 = n / LANES * LANES;
    for h0 in (0..HEADS).step_by(LANES) {
        for d in (0..n8).step_by(LANES) {
            let mut acc = [_mm256_setzero_ps(); LANES];
            for (wk, row) in w.iter().zip(rows) {
                let v = load_f32x8(&row[d..]);
                for (l, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(_mm256_set1_ps(wk[h0 + l]), v));
                }
            }
            for (l, a) in acc.into_iter().enumerate() {
                store_f32x8(&mut out[(h0 + l) * n + d..], a);
            }
        }
    }
    crate::serial::wsum16_from(w, rows, out, n, n8);
}
