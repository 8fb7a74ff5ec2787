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
//! features are present too); each says why below.

use crate::q4_1::BlockQ4_1;
use crate::q8_0::BlockQ8_0;
use crate::Kernels;

use super::avx2;

mod act16;
mod attn;

/// The AVX-512 tier.
pub(super) static KERNELS: Kernels = Kernels {
    tier: "avx512",
    vec_dot_q4_0_q8_0: avx2::vec_dot_q4_0_q8_0,
    vec_dot_q4_1_q8_0: avx2::vec_dot_q4_1_q8_0,
    vec_dot_q5_0_q8_0: avx2::vec_dot_q5_0_q8_0,
    vec_dot_q8_0_q8_0: avx2::vec_dot_q8_0_q8_0,
    vec_dot_f32: avx2::vec_dot_f32,
    vec_dot_f32_fused: avx2::vec_dot_f32_fused,
    dequantize_row_q4_1: avx2::dequantize_row_q4_1,
    dequantize_row_q8_0: avx2::dequantize_row_q8_0,
    quantize_row_q8_0: avx2::quantize_row_q8_0,
    dot_fma1: avx2::dot_fma1,
    matvec_q4_1_q8_0: avx2::matvec_q4_1_q8_0,
    matvec_q8_0_q8_0: avx2::matvec_q8_0_q8_0,
    gemm_q4_1_q8_0: avx2::gemm_q4_1_q8_0,
    gemm_q4_1_q8_0_f2: avx2::gemm_q4_1_q8_0_f2,
    gemm_tile: avx2::gemm_tile,
    exp_inplace: avx2::exp_inplace,
    attn_group_f32: attn::attn_group_checked::<f32>,
    attn_group_f16: attn::attn_group_checked::<u16>,
    widen_f16: avx2::widen_f16,
    quantize_act16: act16::quantize_act16,
    gemm_q4_1_act16: act16::gemm_act16::<BlockQ4_1>,
    gemm_q8_0_act16: act16::gemm_act16::<BlockQ8_0>,
    vec_dot_q4_k_q8_k: avx2::vec_dot_q4_k_q8_k,
    vec_dot_q6_k_q8_k: avx2::vec_dot_q6_k_q8_k,
    dequantize_row_q4_k: avx2::dequantize_row_q4_k,
    dequantize_row_q6_k: avx2::dequantize_row_q6_k,
    dequantize_row_q4_0: avx2::dequantize_row_q4_0,
    dequantize_row_q5_0: avx2::dequantize_row_q5_0,
    dequantize_row_f16: avx2::dequantize_row_f16,
    dequantize_row_bf16: avx2::dequantize_row_bf16,
};
