//! Q2_K (ggml type 10): super-blocks of 256 weights in 16 sub-blocks of 16.
//! Each sub-block `s` has a 4-bit scale (`scales[s] & 15`) and a 4-bit min
//! (`scales[s] >> 4`); the super-block has f16 `d` and `dmin`. Weight value:
//! `d·sc·q - dmin·m` with 2-bit `q`. Scalar reference (AVX2 dot:
//! `x86/avx2/kquants.rs`).
//!
//! Layout (ggml): `qs` is 2 chunks of 32 bytes; byte `l` of chunk `h` holds,
//! in bit pairs `2k..2k+2`, the quant of element `128h + 32k + l`. Used by
//! DeepSeek V4's routed-expert down projections. Follows ggml's `block_q2_K`,
//! `dequantize_row_q2_K` and `ggml_vec_dot_q2_K_q8_K_generic` (which the
//! DeepSeek V4 reference engine's scalar dot repeats operation for operation).

use bytemuck::{Pod, Zeroable};

use crate::f16::fp16_to_fp32;
use crate::q8_k::BlockQ8_K;
use crate::{KernelError, QK_K};

/// ggml `block_q2_K`: 84 bytes, alignment 1.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ2_K {
    /// Per sub-block: scale in the low nibble, min in the high nibble.
    pub scales: [u8; QK_K / 16],
    /// 2-bit quants, four per byte.
    pub qs: [u8; QK_K / 4],
    /// Super-block scale for the sub-block scales, f16 little-endian.
    pub d: [u8; 2],
    /// Super-block scale for the sub-block mins, f16 little-endian.
    pub dmin: [u8; 2],
}

const _: () = assert!(size_of::<BlockQ2_K>() == 84);
const _: () = assert!(align_of::<BlockQ2_K>() == 1);

/// Views encoded weight bytes (any alignment) as blocks.
pub fn blocks(bytes: &[u8]) -> Result<&[BlockQ2_K], KernelError> {
    crate::cast_blocks("q2_K", bytes)
}

/// The 2-bit quant of element `j` (0..256) of a block.
#[inline]
pub fn quant(b: &BlockQ2_K, j: usize) -> u8 {
    (b.qs[32 * (j / 128) + j % 32] >> (2 * ((j % 128) / 32))) & 3
}

/// ggml `dequantize_row_q2_K`: per sub-block `dl = d·sc`, `ml = dmin·m`,
/// `y = dl·q - ml`.
///
/// # Panics
/// If `y.len() != QK_K * x.len()`.
pub fn dequantize_row(x: &[BlockQ2_K], y: &mut [f32]) {
    assert_eq!(y.len(), x.len() * QK_K, "q2_K dequantize_row lengths");
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_K)) {
        let d = fp16_to_fp32(b.d);
        let min = fp16_to_fp32(b.dmin);
        for (j, y) in y.iter_mut().enumerate() {
            let sc = b.scales[j / 16];
            let dl = d * (sc & 0xF) as f32;
            let ml = min * (sc >> 4) as f32;
            *y = dl * quant(b, j) as f32 - ml;
        }
    }
}

/// ggml `ggml_vec_dot_q2_K_q8_K_generic`: per super-block an exact integer
/// sum `isum = Σ_s sc[s]·Σ_{j∈s} q(j)·q8(j)` and min sum
/// `summs = Σ_s bsums[s]·m[s]`, then
/// `sumf += (y.d·d)·isum - (y.d·dmin)·summs` in f32, super-blocks in order.
///
/// # Panics
/// If the block counts differ.
#[allow(non_snake_case)]
pub fn vec_dot_q2_K_q8_K(x: &[BlockQ2_K], y: &[BlockQ8_K]) -> f32 {
    assert_eq!(x.len(), y.len(), "vec_dot_q2_K_q8_K block counts");
    let mut sumf = 0.0f32;
    for (bx, by) in x.iter().zip(y) {
        let summs: i32 = by
            .bsums
            .iter()
            .zip(&bx.scales)
            .map(|(&s, &sc)| s as i32 * (sc >> 4) as i32)
            .sum();
        let mut isum = 0i32;
        for (s, q8) in by.qs.chunks_exact(16).enumerate() {
            let dot: i32 = q8
                .iter()
                .enumerate()
                .map(|(l, &v)| quant(bx, 16 * s + l) as i32 * v as i32)
                .sum();
            isum += (bx.scales[s] & 0xF) as i32 * dot;
        }
        let dall = by.d * fp16_to_fp32(bx.d);
        let dmin = by.d * fp16_to_fp32(bx.dmin);
        sumf += dall * isum as f32 - dmin * summs as f32;
    }
    sumf
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::f16::fp32_to_fp16;
    use crate::q8_k;
    use crate::testing::{check_close, dot_f64, XorShift};

    fn random_block(rng: &mut XorShift) -> BlockQ2_K {
        let mut b = BlockQ2_K::zeroed();
        b.scales.iter_mut().for_each(|v| *v = rng.byte());
        b.qs.iter_mut().for_each(|v| *v = rng.byte());
        b.d = fp32_to_fp16(0.01 + 0.01 * rng.next_f32());
        b.dmin = fp32_to_fp16(0.005 * rng.next_f32());
        b
    }

    #[test]
    fn dequantize_follows_the_layout() {
        let mut b = BlockQ2_K::zeroed();
        b.d = fp32_to_fp16(0.5);
        b.dmin = fp32_to_fp16(0.25);
        // Element 128 + 32·2 + 5 = 197: chunk 1, byte 5, bits 4..6; sub-block 12.
        b.qs[32 + 5] = 0b11 << 4;
        b.scales[12] = 3 | (2 << 4);
        let mut y = [0.0f32; QK_K];
        dequantize_row(&[b], &mut y);
        assert_eq!(y[197], 0.5 * 3.0 * 3.0 - 0.25 * 2.0);
        assert_eq!(y[196], -0.5, "a zero quant leaves the min");
        assert_eq!(y[0], 0.0);
    }

    #[test]
    fn dot_matches_dequantized_f64() {
        let mut rng = XorShift::new(7);
        for nb in [1, 2, 5] {
            let x: Vec<BlockQ2_K> = (0..nb).map(|_| random_block(&mut rng)).collect();
            let a: Vec<f32> = (0..nb * QK_K).map(|_| rng.next_f32() * 2.0 - 1.0).collect();
            let mut y = vec![BlockQ8_K::ZERO; nb];
            q8_k::quantize_row_ref(&a, &mut y);
            let mut wx = vec![0.0; nb * QK_K];
            let mut ya = vec![0.0; nb * QK_K];
            dequantize_row(&x, &mut wx);
            q8_k::dequantize_row(&y, &mut ya);
            let want = dot_f64(&wx, &ya);
            let scale: f64 = wx.iter().zip(&ya).map(|(a, b)| (a * b).abs() as f64).sum();
            let tol = (1e-5 * scale) as f32;
            check_close(
                "q2_K·q8_K",
                &[vec_dot_q2_K_q8_K(&x, &y)],
                &[want as f32],
                |_| tol,
            );
        }
    }
}
