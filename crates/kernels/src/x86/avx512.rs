//! AVX-512 (F/BW/VL/VNNI) kernels, called only after runtime detection (see
//! [`super::avx512()`]). Every entry is bit-identical to its scalar reference,
//! as the AVX2 tier's are: the orders those references define are built on
//! 8-lane accumulators, so the 512-bit kernels hold two independent 8-lane
//! accumulators per register (two tokens or two rows of the 16-bit-activation
//! products) or widen what has no lane structure (attention's V accumulation
//! runs over the head dimension, whose lanes are independent).
//!
//! Entries that gain nothing from 512 bits are the AVX2 tier's own functions
//! (which this tier may call: it is only handed out where the AVX2 tier's
//! features are present too); the table says why for each group.

use std::arch::x86_64::*;

use crate::q4_1::BlockQ4_1;
use crate::q8_0::BlockQ8_0;
use crate::Kernels;

use super::avx2;

mod act16;
mod attn;
mod fast;
mod q8;
mod serial;

/// The AVX-512 tier.
pub(super) static KERNELS: Kernels = Kernels {
    tier: "avx512",
    // Q5_0's fifth bits are one mask register, so its blocks run as fast as
    // Q8_0's (prefill) or read 35% fewer bytes (decode; Gemma 3 tg128 +5-12%).
    q5_0_native: true,
    // A row pair's Q4_1 or Q8_0 block is one load and three operations to
    // widen, and its scales one broadcast (see act16/pairs.rs).
    f2_pairs: true,
    // Order F2 (the fast path's Q4_1/Q8_0 products) and its activation rounding.
    quantize_act16: act16::quantize_act16,
    gemm_q4_1_act16: act16::gemm_act16::<BlockQ4_1>,
    gemm_q8_0_act16: act16::gemm_act16::<BlockQ8_0>,
    gemm_q5_0_act16: act16::gemm_act16::<crate::q5_0::BlockQ5_0>,
    gemm_q4_k_act16: act16::gemm_act16::<crate::act16::SubQ4K>,
    gemm_q6_k_act16: act16::gemm_act16::<crate::act16::SubQ6K>,
    // Attention, and order F1's tiles.
    attn_group_f32: avx2::attn_group::<f32, attn::Avx512Attn>,
    attn_group_f16: avx2::attn_group::<u16, attn::Avx512Attn>,
    exp_inplace: attn::exp_inplace,
    widen_f16: fast::widen_f16,
    gemm_tile: fast::gemm_tile,
    // The Q8 path's Q4_1 rows from the packed layout (what the engine runs).
    gemm_q4_1_q8_0_f2: q8::gemm_q4_1_q8_0_f2,
    // The AVX2 tier's: the Q8 path from GGUF blocks (the engine packs its Q4_1
    // matrices) and over Q8_0 rows (no VNNI version written yet).
    matvec_q4_1_q8_0: avx2::matvec_q4_1_q8_0,
    gemm_q4_1_q8_0: avx2::gemm_q4_1_q8_0,
    matvec_q8_0_q8_0: avx2::matvec_q8_0_q8_0,
    // The AVX2 tier's: single-row Q8 dots, whose serial sum in block order
    // bounds them; the K-quant dots, whose integer lanes by element index mod 8
    // `vpdpbusd`'s groups of four bytes do not keep.
    vec_dot_q4_0_q8_0: avx2::vec_dot_q4_0_q8_0,
    vec_dot_q4_1_q8_0: avx2::vec_dot_q4_1_q8_0,
    vec_dot_q5_0_q8_0: avx2::vec_dot_q5_0_q8_0,
    vec_dot_q8_0_q8_0: avx2::vec_dot_q8_0_q8_0,
    vec_dot_q4_k_q8_k: avx2::vec_dot_q4_k_q8_k,
    vec_dot_q6_k_q8_k: avx2::vec_dot_q6_k_q8_k,
    // The AVX2 tier's: f32 dots whose order is one 8-lane dependency chain (the
    // fused dot's order is the AVX2 one, so the two tiers agree on it).
    vec_dot_f32: avx2::vec_dot_f32,
    vec_dot_f32_fused: avx2::vec_dot_f32_fused,
    dot_fma1: avx2::dot_fma1,
    // The AVX2 tier's: conversions bound by their stores (16-wide Q8_0 and Q4_1
    // dequantizers measured the same on Zen 5), and Q8_0 activation rounding
    // (under 0.5% of a matmul).
    dequantize_row_q4_0: avx2::dequantize_row_q4_0,
    dequantize_row_q4_1: avx2::dequantize_row_q4_1,
    dequantize_row_q5_0: avx2::dequantize_row_q5_0,
    dequantize_row_q8_0: avx2::dequantize_row_q8_0,
    dequantize_row_q4_k: avx2::dequantize_row_q4_k,
    dequantize_row_q6_k: avx2::dequantize_row_q6_k,
    dequantize_row_f16: avx2::dequantize_row_f16,
    dequantize_row_bf16: avx2::dequantize_row_bf16,
    quantize_row_q8_0: avx2::quantize_row_q8_0,
    // The deepseek4 products: the Q8_0 rows' exact block sums by VNNI, and
    // attention's sixteen heads in the lanes of one register.
    dot_q8_0x16_f32s: serial::dot_q8_0x16_f32s,
    dots16_serial: serial::dots16_serial,
    wsum16_serial: serial::wsum16_serial,
    // The AVX2 tier's: the other deepseek4 products, whose serial per-row sums
    // (the reference engine's order) leave nothing for wider registers to split.
    vec_dot_q2_k_q8_k: avx2::vec_dot_q2_k_q8_k,
    vec_dot_iq2_xxs_q8_k: avx2::vec_dot_iq2_xxs_q8_k,
    dot_iq2_decoded_q8_k: avx2::dot_iq2_decoded_q8_k,
    dots_f16x8_serial: avx2::dots_f16x8_serial,
    dots8_serial: avx2::dots8_serial,
};

// ---- helpers shared by the submodules -----------------------------------------

/// `out[2i + h] = reduce_lanes(half h of a[i]) · scale` (the lane reduction of
/// [`crate::f32`]), eight registers (sixteen accumulators) at a time through
/// one transposed horizontal sum; a last group is padded with zeros.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn reduce_pairs(a: &[__m512], scale: f32, out: &mut [f32]) {
    debug_assert!(out.len() == 2 * a.len());
    // Position i of the final register holds accumulator 4·(i % 4) + i / 4.
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (a, out) in a.chunks(8).zip(out.chunks_mut(16)) {
        let mut r = [_mm512_setzero_ps(); 8];
        r[..a.len()].copy_from_slice(a);
        // Each 128-bit lane of u_i is one accumulator's [a0+a4, a1+a5, a2+a6,
        // a3+a7]: accumulators 4i..4i + 4.
        let u: [__m512; 4] = std::array::from_fn(|i| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(r[2 * i], r[2 * i + 1]),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(r[2 * i], r[2 * i + 1]),
            )
        });
        // Lane k: [y0, y1] of accumulators k and 4 + k (c), 8 + k and 12 + k (d),
        // with y0 = (a0+a4)+(a2+a6) and y1 = (a1+a5)+(a3+a7).
        let c = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(u[0], u[1]),
            _mm512_shuffle_ps::<0xEE>(u[0], u[1]),
        );
        let d = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(u[2], u[3]),
            _mm512_shuffle_ps::<0xEE>(u[2], u[3]),
        );
        // Lane k: y0 + y1 of accumulators k, 4 + k, 8 + k, 12 + k.
        let z = _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(c, d),
            _mm512_shuffle_ps::<0xDD>(c, d),
        );
        let sums = _mm512_mul_ps(_mm512_permutexvar_ps(order, z), _mm512_set1_ps(scale));
        let mut lanes = [0.0f32; 16];
        // SAFETY: `lanes` is 16 writable f32s; `storeu` has no alignment requirement.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), sums) };
        out.copy_from_slice(&lanes[..out.len()]);
    }
}
