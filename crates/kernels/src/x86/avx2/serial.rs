//! AVX2 versions of the serial-sum kernels of [`crate::serial`]: eight (or
//! four times eight) running f32 sums side by side, one per lane, each with
//! exactly the scalar reference's multiplies and adds in its order, so every
//! lane is bitwise its scalar sum. Integer block sums (Q8_0) are exact in any
//! order.

use std::arch::x86_64::*;

use super::{load_f32x8, store_f32x8};
use crate::q8_0::QK8_0;
use crate::serial::{Q8Row, LANES, Q8_0X8_BLOCK};

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

/// [`crate::serial::dot_q8_0x8_f32s_ref`] for `N` activation rows. Per
/// block the group's quants are made signed again and their absolute values
/// taken once for the `N` rows (four registers of two slices: rows `4h..4h+4`
/// of slice `k`, eight bytes each); per row and slice the activations' eight
/// bytes are broadcast, and `maddubs` of `|w|` against them signed by `w`
/// (|w| <= 128 and |x| <= 127 never saturate) leaves each row's two 4-byte
/// sums in its own pair of lanes. Folding the pairs gives the eight rows'
/// exact integer sums; then per lane `acc += (d_w·d_x)·isum`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q8_0x8_n<const N: usize>(group: &[u8], x: &[Q8Row<'_>], out: &mut [[f32; LANES]]) {
    let ones = _mm256_set1_epi16(1);
    let offset = _mm256_set1_epi8(0x80u8 as i8);
    let mut acc = [_mm256_setzero_ps(); N];
    for (b, blk) in group.chunks_exact(Q8_0X8_BLOCK).enumerate() {
        let scales = load_f16x8(&blk[..2 * LANES]);
        let w: [__m256i; 8] =
            std::array::from_fn(|i| _mm256_xor_si256(load32(&blk[2 * LANES + 32 * i..]), offset));
        let aw: [__m256i; 8] = std::array::from_fn(|i| _mm256_sign_epi8(w[i], w[i]));
        for j in 0..N {
            let q: &[u8] = bytemuck::cast_slice(&x[j].qs[b * QK8_0..(b + 1) * QK8_0]);
            let mut s = [_mm256_setzero_si256(); 2];
            for k in 0..4 {
                let xb =
                    _mm256_set1_epi64x(i64::from_le_bytes(q[8 * k..8 * k + 8].try_into().unwrap()));
                for (h, s) in s.iter_mut().enumerate() {
                    let i = 2 * k + h;
                    let p = _mm256_maddubs_epi16(aw[i], _mm256_sign_epi8(xb, w[i]));
                    *s = _mm256_add_epi32(*s, _mm256_madd_epi16(p, ones));
                }
            }
            // Lanes 2r and 2r + 1 of s[h] are row 4h + r's two sums: fold them
            // into the even lanes, then gather rows 0..8 in order.
            let f = s.map(|s| _mm256_castsi256_ps(_mm256_add_epi32(s, _mm256_srli_epi64::<32>(s))));
            // Per 128-bit lane: rows (0, 1, 4, 5), then (2, 3, 6, 7).
            let m = _mm256_castps_si256(_mm256_shuffle_ps::<0x88>(f[0], f[1]));
            let isum = _mm256_cvtepi32_ps(_mm256_permute4x64_epi64::<0xD8>(m));
            let t = _mm256_mul_ps(_mm256_mul_ps(scales, _mm256_set1_ps(x[j].d[b])), isum);
            acc[j] = _mm256_add_ps(acc[j], t);
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        store_f32x8(o, a);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q8_0x8_f32s(group: &[u8], x: &[Q8Row<'_>], out: &mut [[f32; LANES]]) {
    match x.len() {
        1 => dot_q8_0x8_n::<1>(group, x, out),
        2 => dot_q8_0x8_n::<2>(group, x, out),
        3 => dot_q8_0x8_n::<3>(group, x, out),
        4 => dot_q8_0x8_n::<4>(group, x, out),
        _ => {}
    }
}

/// [`crate::serial::axpy_ref`]: eight elements at a time, the same multiply
/// and add per element.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn axpy(w: f32, x: &[f32], out: &mut [f32]) {
    let wv = _mm256_set1_ps(w);
    let n8 = x.len() / LANES * LANES;
    for (o, v) in out[..n8]
        .chunks_exact_mut(LANES)
        .zip(x[..n8].chunks_exact(LANES))
    {
        let r = _mm256_add_ps(load_f32x8(o), _mm256_mul_ps(wv, load_f32x8(v)));
        store_f32x8(o, r);
    }
    crate::serial::axpy_ref(w, &x[n8..], &mut out[n8..]);
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
