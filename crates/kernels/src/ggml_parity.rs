//! Bit-exactness against ggml itself. Test builds only.
//!
//! The golden values below were produced by ggml's own reference code
//! (`quantize_row_*_ref`, `dequantize_row_*`, `quantize_row_q8_K_ref` from
//! `ggml-quants.c` and the `ggml_vec_dot_*_generic` functions from
//! `ggml-cpu/quants.c`), compiled with `gcc -O2 -ffp-contract=off`, on exactly
//! the input [`inputs`] generates. They are FNV-1a hashes of the encoded
//! blocks and of the dequantized f32 rows, and the f32 bits of the dot
//! products. A mismatch means our reference kernels no longer match ggml bit
//! for bit. (Built with FMA contraction, ggml's quantizers give the same bytes
//! on this input; its dot products then differ in the last bits.)

use crate::f16::fp32_to_fp16;
use crate::testing::XorShift;
use crate::{
    dequantize_row, quantize_row, vec_dot, ActivationFormat, ActivationRow, QuantizedActivations,
    WeightFormat,
};

const N: usize = 8192;

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|f| f.to_le_bytes()).collect()
}

/// Weights with four magnitudes (0.02, 1, 1e-4, 30 per 1024), ~1% outliers,
/// an all-zero super-block, a constant super-block and an all-zero 32-block;
/// activations uniform in [-3, 3).
fn inputs() -> (Vec<f32>, Vec<f32>, XorShift) {
    let mut rng = XorShift::new(2024);
    let mut w: Vec<f32> = (0..N)
        .map(|i| {
            let g: f32 = (0..4).map(|_| rng.next_f32()).sum::<f32>() - 2.0;
            let s = if rng.next_u64().is_multiple_of(97) {
                8.0
            } else {
                1.7
            };
            let block_scale = [0.02f32, 1.0, 1e-4, 30.0][(i / 1024) % 4];
            g * s * block_scale
        })
        .collect();
    w[256..512].fill(0.0);
    w[512..768].fill(-0.3);
    w[1024..1056].fill(0.0);
    let x: Vec<f32> = (0..N).map(|_| rng.next_f32() * 6.0 - 3.0).collect();
    (w, x, rng)
}

#[test]
fn quantize_and_dequantize_match_ggml_bit_for_bit() {
    // (format, hash of quantize_row_*_ref output, hash of dequantize_row_* output)
    let golden = [
        (
            WeightFormat::Q4_0,
            0x2007_a787_d3f7_fe30,
            0xbca9_8dcb_fe61_865d,
        ),
        (
            WeightFormat::Q4_1,
            0x8f2a_4851_1ec1_080d,
            0x17ab_a08c_68e8_d58c,
        ),
        (
            WeightFormat::Q5_0,
            0x781c_002d_1392_bc25,
            0x6672_dc9b_ec13_6ce0,
        ),
        (
            WeightFormat::Q8_0,
            0xa991_9471_d00e_17d2,
            0xbf93_9aea_2d02_14cd,
        ),
        (
            WeightFormat::Q4_K,
            0xab5b_3e9c_8739_1258,
            0xd5ed_1748_421f_02c2,
        ),
        (
            WeightFormat::Q6_K,
            0xe599_51ef_8294_104a,
            0x58df_dbe1_5ac5_4d0d,
        ),
    ];
    let (w, _, _) = inputs();
    for (fmt, want_q, want_y) in golden {
        let mut row = vec![0u8; fmt.row_bytes(N).unwrap()];
        quantize_row(fmt, &w, &mut row).unwrap();
        assert_eq!(fnv1a(&row), want_q, "{} quantize", fmt.name());
        let mut y = vec![0.0; N];
        dequantize_row(fmt, &row, &mut y).unwrap();
        assert_eq!(fnv1a(&f32_bytes(&y)), want_y, "{} dequantize", fmt.name());
    }
}

#[test]
fn activation_quantizers_match_ggml_bit_for_bit() {
    let (_, x, _) = inputs();
    let a = QuantizedActivations::quantize(ActivationFormat::Q8_0, &x, N).unwrap();
    let ActivationRow::Q8_0(b) = a.row(0) else {
        unreachable!()
    };
    assert_eq!(
        fnv1a(bytemuck::cast_slice(b)),
        0xa7d3_8337_8057_811d,
        "q8_0"
    );
    let a = QuantizedActivations::quantize(ActivationFormat::Q8_K, &x, N).unwrap();
    let ActivationRow::Q8_K(b) = a.row(0) else {
        unreachable!()
    };
    // block_q8_K is { float d; int8_t qs[256]; int16_t bsums[16]; } with no padding.
    assert_eq!(
        fnv1a(bytemuck::cast_slice(b)),
        0xf774_3113_7d23_4746,
        "q8_K"
    );
}

#[test]
fn dot_products_match_ggml_generic_bit_for_bit() {
    let (w, x, mut rng) = inputs();
    let q8_0 = QuantizedActivations::quantize(ActivationFormat::Q8_0, &x, N).unwrap();
    let q8_k = QuantizedActivations::quantize(ActivationFormat::Q8_K, &x, N).unwrap();
    let mut dots = Vec::new();
    for fmt in [
        WeightFormat::Q4_0,
        WeightFormat::Q5_0,
        WeightFormat::Q8_0,
        WeightFormat::Q4_K,
        WeightFormat::Q6_K,
    ] {
        let mut row = vec![0u8; fmt.row_bytes(N).unwrap()];
        quantize_row(fmt, &w, &mut row).unwrap();
        let act = if fmt.activation_format() == ActivationFormat::Q8_K {
            &q8_k
        } else {
            &q8_0
        };
        dots.push(vec_dot(fmt, N, &row, act.row(0)));
    }
    // Random bytes as K-quant weights (every scale/min/level pattern), finite f16 scales.
    let nb = N / 256;
    let mut q4k = vec![0u8; nb * 144];
    let mut q6k = vec![0u8; nb * 210];
    for b in q4k.iter_mut().chain(q6k.iter_mut()) {
        *b = rng.byte();
    }
    for i in 0..nb {
        q4k[i * 144..i * 144 + 2].copy_from_slice(&fp32_to_fp16(rng.next_f32() * 0.01));
        q4k[i * 144 + 2..i * 144 + 4].copy_from_slice(&fp32_to_fp16(rng.next_f32() * 0.01));
        q6k[i * 210 + 208..i * 210 + 210]
            .copy_from_slice(&fp32_to_fp16(rng.next_f32() * 0.02 - 0.01));
    }
    dots.push(vec_dot(WeightFormat::Q4_K, N, &q4k, q8_k.row(0)));
    dots.push(vec_dot(WeightFormat::Q6_K, N, &q6k, q8_k.row(0)));
    let bits: Vec<u32> = dots.iter().map(|d| d.to_bits()).collect();
    // q4_0·q8_0, q5_0·q8_0, q8_0·q8_0, q4_K·q8_K, q6_K·q8_K, random q4_K·q8_K, random q6_K·q8_K
    assert_eq!(
        bits,
        [0xc5ad6f89, 0xc5b3706a, 0xc5aff4df, 0xc5ad5ea6, 0xc5b11cee, 0x43d50f82, 0xc42bb780],
        "{dots:?}"
    );
}
