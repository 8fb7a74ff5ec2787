//! AVX2 versions of the K-quant kernels (Q4_K, Q6_K): dequantization and the
//! dot products against Q8_K activations, bit-identical to the scalar
//! references in [`crate::q4_k`] and [`crate::q6_k`]; and the Q2_K and
//! IQ2_XXS dots of DeepSeek V4's routed experts ([`crate::q2_k`],
//! [`crate::iq2_xxs`]).
//!
//! The dot products keep the references' eight integer lanes, lane `l` summing
//! the elements `i ≡ l (mod 8)` of a super-block: 16 products of 4- or 6-bit
//! quants and i8 activations are formed in i16 (|q·y| <= 32·128, and two or four
//! of them with the same lane still fit), then widened so that i16 lane `k` of
//! each 128-bit half lands in i32 lane `k`. Integer sums are exact in any order;
//! the float steps are the references' own, lane for lane.

use std::arch::x86_64::*;

use super::{bytes_from_bits, f16x2_to_f32, split_nibbles, store_f32x8, widen8};
use crate::iq2_xxs::{words, BlockIQ2_XXS, Iq2Decoded, IQ2XXS_GRID, KSIGNS_IQ2XS};
use crate::q2_k::BlockQ2_K;
use crate::q4_k::{get_scale_min_k4, BlockQ4_K};
use crate::q6_k::BlockQ6_K;
use crate::q8_k::BlockQ8_K;
use crate::QK_K;

/// Loads 32 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load32<T: bytemuck::Pod>(b: &[T]) -> __m256i {
    let b: &[u8; 32] = bytemuck::cast_slice(b)[..32].try_into().unwrap();
    // SAFETY: `b` is 32 readable bytes; `loadu` has no alignment requirement.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

/// The two 16-element halves of `a·y` (32 quants, unsigned or signed, against 32
/// i8 activations), exact in i16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn products16<const SIGNED: bool>(a: __m256i, y: __m256i) -> [__m256i; 2] {
    let widen = |v: __m128i| {
        if SIGNED {
            _mm256_cvtepi8_epi16(v)
        } else {
            _mm256_cvtepu8_epi16(v)
        }
    };
    let (a0, a1) = (
        widen(_mm256_castsi256_si128(a)),
        widen(_mm256_extracti128_si256::<1>(a)),
    );
    let (y0, y1) = (
        _mm256_cvtepi8_epi16(_mm256_castsi256_si128(y)),
        _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(y)),
    );
    [_mm256_mullo_epi16(a0, y0), _mm256_mullo_epi16(a1, y1)]
}

/// 16 i16 values (elements `e..e + 16` of a super-block, `e` a multiple of 8)
/// summed into eight i32 lanes by element index mod 8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn lanes_mod8(p: __m256i) -> __m256i {
    _mm256_add_epi32(
        _mm256_cvtepi16_epi32(_mm256_castsi256_si128(p)),
        _mm256_cvtepi16_epi32(_mm256_extracti128_si256::<1>(p)),
    )
}

/// [`crate::q4_k::dequantize_row`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dequant_q4_k(x: &[BlockQ4_K], y: &mut [f32]) {
    let low = _mm256_set1_epi32(0x0F);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_K)) {
        let dm = f16x2_to_f32(b.d, b.dmin);
        let (d, min) = (_mm_cvtss_f32(dm), _mm_cvtss_f32(_mm_movehdup_ps(dm)));
        for (c, (q, y)) in
            b.qs.chunks_exact(32)
                .zip(y.chunks_exact_mut(64))
                .enumerate()
        {
            let (sc1, m1) = get_scale_min_k4(2 * c, &b.scales);
            let (sc2, m2) = get_scale_min_k4(2 * c + 1, &b.scales);
            let (d1, m1) = (
                _mm256_set1_ps(d * sc1 as f32),
                _mm256_set1_ps(min * m1 as f32),
            );
            let (d2, m2) = (
                _mm256_set1_ps(d * sc2 as f32),
                _mm256_set1_ps(min * m2 as f32),
            );
            let q = load32(q);
            let (ylo, yhi) = y.split_at_mut(32);
            for k in 0..4 {
                let v = widen8::<false>(q, k);
                let lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
                let hi = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(v));
                store_f32x8(&mut ylo[8 * k..], _mm256_sub_ps(_mm256_mul_ps(d1, lo), m1));
                store_f32x8(&mut yhi[8 * k..], _mm256_sub_ps(_mm256_mul_ps(d2, hi), m2));
            }
        }
    }
}

/// [`crate::q4_k::vec_dot_q4_K_q8_K`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q4_k_q8_k(x: &[BlockQ4_K], y: &[BlockQ8_K]) -> f32 {
    let mut sums = _mm256_setzero_ps();
    let mut sumf = 0.0f32;
    for (bx, by) in x.iter().zip(y) {
        let mut scales = [0i32; 8];
        let mut mins = [0i32; 8];
        for j in 0..8 {
            let (sc, m) = get_scale_min_k4(j, &bx.scales);
            (scales[j], mins[j]) = (sc as i32, m as i32);
        }
        let sumi: i32 = by
            .bsums
            .iter()
            .enumerate()
            .map(|(j, &s)| s as i32 * mins[j / 2])
            .sum();
        let mut aux = _mm256_setzero_si256();
        for (c, q) in bx.qs.chunks_exact(32).enumerate() {
            let q = load32(q);
            for (h, a) in split_nibbles(q).into_iter().enumerate() {
                let j = 2 * c + h;
                let [p0, p1] = products16::<false>(a, load32(&by.qs[32 * j..]));
                // Two products per i16 lane: |sum| <= 2·15·128.
                let s = lanes_mod8(_mm256_add_epi16(p0, p1));
                aux = _mm256_add_epi32(aux, _mm256_mullo_epi32(s, _mm256_set1_epi32(scales[j])));
            }
        }
        let dm = f16x2_to_f32(bx.d, bx.dmin);
        let d = _mm_cvtss_f32(dm) * by.d;
        sums = _mm256_add_ps(
            sums,
            _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(aux)),
        );
        let dmin = _mm_cvtss_f32(_mm_movehdup_ps(dm)) * by.d;
        sumf -= dmin * sumi as f32;
    }
    let mut lanes = [0.0f32; 8];
    store_f32x8(&mut lanes, sums);
    for s in lanes {
        sumf += s;
    }
    sumf
}

/// The 256 quants of a Q6_K block minus 32, in element order (the layout of
/// [`crate::q6_k`]: per half `h`, `ql[64h..]` holds elements `l` and `l + 32` in
/// its low nibbles and `l + 64`, `l + 96` in its high ones, `qh[32h + l]` their
/// top two bits in bit pairs 0, 1, 2, 3).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_q6_k(b: &BlockQ6_K, out: &mut [i8; QK_K]) {
    let (low, two) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3));
    for h in 0..2 {
        let ql0 = load32(&b.ql[64 * h..]);
        let ql1 = load32(&b.ql[64 * h + 32..]);
        let qh = load32(&b.qh[32 * h..]);
        // 16-bit shifts move bits across the bytes of a pair; the masks after
        // them keep only each byte's own.
        let top = |shift: __m128i| {
            _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srl_epi16(qh, shift), two))
        };
        let nib_hi = |v: __m256i| _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
        let parts = [
            _mm256_or_si256(_mm256_and_si256(ql0, low), top(_mm_cvtsi32_si128(0))),
            _mm256_or_si256(_mm256_and_si256(ql1, low), top(_mm_cvtsi32_si128(2))),
            _mm256_or_si256(nib_hi(ql0), top(_mm_cvtsi32_si128(4))),
            _mm256_or_si256(nib_hi(ql1), top(_mm_cvtsi32_si128(6))),
        ];
        for (k, v) in parts.into_iter().enumerate() {
            let v = _mm256_sub_epi8(v, _mm256_set1_epi8(32));
            let dst: &mut [i8; 32] = (&mut out[128 * h + 32 * k..][..32]).try_into().unwrap();
            // SAFETY: `dst` is 32 writable bytes; `storeu` is unaligned.
            unsafe { _mm256_storeu_si256(dst.as_mut_ptr().cast(), v) };
        }
    }
}

/// [`crate::q6_k::dequantize_row`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dequant_q6_k(x: &[BlockQ6_K], y: &mut [f32]) {
    let mut q = [0i8; QK_K];
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_K)) {
        let d = _mm_cvtss_f32(f16x2_to_f32(b.d, [0; 2]));
        unpack_q6_k(b, &mut q);
        for (g, (q, y)) in q.chunks_exact(32).zip(y.chunks_exact_mut(32)).enumerate() {
            let q = load32(q);
            for k in 0..4 {
                let scale = _mm256_set1_ps(d * b.scales[(32 * g + 8 * k) / 16] as f32);
                let v = _mm256_cvtepi32_ps(widen8::<true>(q, k));
                store_f32x8(&mut y[8 * k..], _mm256_mul_ps(scale, v));
            }
        }
    }
}

/// [`crate::q6_k::vec_dot_q6_K_q8_K`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q6_k_q8_k(x: &[BlockQ6_K], y: &[BlockQ8_K]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut sums = _mm256_setzero_ps();
    for (bx, by) in x.iter().zip(y) {
        unpack_q6_k(bx, &mut q);
        let mut aux = _mm256_setzero_si256();
        for g in 0..8 {
            let p = products16::<true>(load32(&q[32 * g..]), load32(&by.qs[32 * g..]));
            for (k, p) in p.into_iter().enumerate() {
                let scale = _mm256_set1_epi32(bx.scales[2 * g + k] as i32);
                aux = _mm256_add_epi32(aux, _mm256_mullo_epi32(lanes_mod8(p), scale));
            }
        }
        let d = _mm_cvtss_f32(f16x2_to_f32(bx.d, [0; 2])) * by.d;
        sums = _mm256_add_ps(
            sums,
            _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(aux)),
        );
    }
    let mut lanes = [0.0f32; 8];
    store_f32x8(&mut lanes, sums);
    let mut sumf = 0.0f32;
    for s in lanes {
        sumf += s;
    }
    sumf
}

/// [`crate::q2_k::vec_dot_q2_K_q8_K`]: per 32 quants (two sub-blocks) one
/// `maddubs` of the 2-bit values against the activations (|pair| <= 2·3·128)
/// and one `madd` with the two sub-block scales, summed in i32 (exact); the
/// min term and the float step are the reference's.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q2_k_q8_k(x: &[BlockQ2_K], y: &[BlockQ8_K]) -> f32 {
    let m3 = _mm256_set1_epi8(3);
    let mut sumf = 0.0f32;
    for (bx, by) in x.iter().zip(y) {
        let summs: i32 = by
            .bsums
            .iter()
            .zip(&bx.scales)
            .map(|(&s, &sc)| s as i32 * (sc >> 4) as i32)
            .sum();
        let mut acc = _mm256_setzero_si256();
        for h in 0..2 {
            let q = load32(&bx.qs[32 * h..32 * (h + 1)]);
            for k in 0..4 {
                let qk = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * k as i32)), m3);
                let at = 128 * h + 32 * k;
                let y8 = load32(&by.qs[at..at + 32]);
                let s0 = (bx.scales[at / 16] & 0xF) as i16;
                let s1 = (bx.scales[at / 16 + 1] & 0xF) as i16;
                let sc = _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(qk, y8), sc));
            }
        }
        let mut lanes = [0i32; 8];
        // SAFETY: `lanes` is 32 writable bytes; `storeu` has no alignment requirement.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), acc) };
        let isum: i32 = lanes.iter().sum();
        let dall = by.d * crate::f16::fp16_to_fp32(bx.d);
        let dmin = by.d * crate::f16::fp16_to_fp32(bx.dmin);
        sumf += dall * isum as f32 - dmin * summs as f32;
    }
    sumf
}

/// [`crate::iq2_xxs::vec_dot_iq2_xxs_q8_K`]: per sub-block the 32 grid bytes
/// (unsigned, <= 43) against the activations with the pattern's signs applied
/// (`sign_epi8`), one `maddubs` (|pair| <= 2·43·127) and one `madd`, times the
/// sub-block scale `2s + 1`, summed in i32 (exact); the float step is the
/// reference's.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_iq2_xxs_q8_k(x: &[BlockIQ2_XXS], y: &[BlockQ8_K]) -> f32 {
    let ones = _mm256_set1_epi16(1);
    let one8 = _mm256_set1_epi8(1);
    let mut sumf = 0.0f32;
    for (bx, by) in x.iter().zip(y) {
        let mut acc = _mm256_setzero_si256();
        for ib in 0..8 {
            let (a, b) = words(bx, ib);
            let g = |k: u32| IQ2XXS_GRID[((a >> (8 * k)) & 0xFF) as usize] as i64;
            let grid = _mm256_set_epi64x(g(3), g(2), g(1), g(0));
            let signs = u32::from_le_bytes(std::array::from_fn(|k| {
                KSIGNS_IQ2XS[((b >> (7 * k)) & 127) as usize]
            }));
            let sign = _mm256_or_si256(bytes_from_bits(signs), one8);
            let y8 = _mm256_sign_epi8(load32(&by.qs[32 * ib..32 * (ib + 1)]), sign);
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(grid, y8), ones);
            let ls = _mm256_set1_epi32(2 * (b >> 28) as i32 + 1);
            acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(p, ls));
        }
        let mut lanes = [0i32; 8];
        // SAFETY: `lanes` is 32 writable bytes; `storeu` has no alignment requirement.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), acc) };
        let bsum: i32 = lanes.iter().sum();
        let d = crate::f16::fp16_to_fp32(bx.d) * by.d;
        sumf += d * bsum as f32;
    }
    0.125 * sumf
}

/// [`crate::iq2_xxs::dot_decoded_q8_K_ref`]: per sub-block one `maddubs` of
/// `|w|` (<= 43) against the activations signed by `w` and one `madd` with
/// the sub-block scale, summed in i32 (exact).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_iq2_decoded_q8_k(x: &Iq2Decoded, y: &[BlockQ8_K]) -> f32 {
    let mut sumf = 0.0f32;
    for (b, by) in y.iter().enumerate() {
        let mut acc = _mm256_setzero_si256();
        for ib in 0..8 {
            let at = b * QK_K + 32 * ib;
            let w = load32(&x.w[at..at + 32]);
            let y8 = load32(&by.qs[32 * ib..32 * (ib + 1)]);
            let prod = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(y8, w));
            acc = _mm256_add_epi32(
                acc,
                _mm256_madd_epi16(prod, _mm256_set1_epi16(x.ls[8 * b + ib])),
            );
        }
        let mut lanes = [0i32; 8];
        // SAFETY: `lanes` is 32 writable bytes; `storeu` has no alignment requirement.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), acc) };
        let bsum: i32 = lanes.iter().sum();
        sumf += x.d[b] * by.d * bsum as f32;
    }
    0.125 * sumf
}
