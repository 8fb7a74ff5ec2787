//! Q4_1 (ggml type 3): blocks of 32 weights, f16 scale `d`, f16 offset `m`
//! and 4-bit quants `q`; weight value `q·d + m`. Scalar reference, no SIMD.
//!
//! Nibble order as Q4_0 (low nibble element `j`, high nibble `j + 16`).
//! Follows ggml's `block_q4_1`, `dequantize_row_q4_1` and
//! `quantize_row_q4_1_ref`.
//!
//! Differs from ggml on purpose: ggml dots Q4_1 with Q8_1 activations, whose
//! blocks carry `s = f16(d8·Σq8)` for the offset term. We dot with Q8_0 (one
//! activation format for all 32-wide weights) and compute the offset term as
//! `m · (d8·Σq8)` in f32 from the quants; it is not rounded to f16, so it is
//! slightly more accurate than ggml's.

use bytemuck::{Pod, Zeroable};

use crate::f16::{fp16_to_fp32, fp32_to_fp16};
use crate::q8_0::BlockQ8_0;
use crate::KernelError;

/// Weights per block (ggml `QK4_1`).
pub const QK4_1: usize = 32;

/// ggml `block_q4_1`: 20 bytes, alignment 1.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ4_1 {
    /// Scale, f16 little-endian.
    pub d: [u8; 2],
    /// Offset (the block minimum), f16 little-endian.
    pub m: [u8; 2],
    /// Nibbles: low = element j, high = element j + 16.
    pub qs: [u8; QK4_1 / 2],
}

const _: () = assert!(size_of::<BlockQ4_1>() == 20);
const _: () = assert!(align_of::<BlockQ4_1>() == 1);

/// Views encoded weight bytes (any alignment) as blocks.
pub fn blocks(bytes: &[u8]) -> Result<&[BlockQ4_1], KernelError> {
    crate::cast_blocks("q4_1", bytes)
}

/// ggml `dequantize_row_q4_1`: `y = q·d + m` (f32 multiply, then f32 add).
///
/// # Panics
/// If `y.len() != QK4_1 * x.len()`.
pub fn dequantize_row(x: &[BlockQ4_1], y: &mut [f32]) {
    assert_eq!(y.len(), x.len() * QK4_1, "q4_1 dequantize_row lengths");
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK4_1)) {
        let d = fp16_to_fp32(b.d);
        let m = fp16_to_fp32(b.m);
        let (lo, hi) = y.split_at_mut(QK4_1 / 2);
        for ((&q, y0), y1) in b.qs.iter().zip(lo).zip(hi) {
            *y0 = (q & 0x0F) as f32 * d + m;
            *y1 = (q >> 4) as f32 * d + m;
        }
    }
}

/// ggml `quantize_row_q4_1_ref`: `d = (max - min)/15`, `m = min`,
/// `q = min(15, trunc((x - min)/d + 0.5))` with the unrounded `1/d`.
///
/// # Panics
/// If `x.len() != QK4_1 * y.len()`.
pub fn quantize_row_ref(x: &[f32], y: &mut [BlockQ4_1]) {
    assert_eq!(x.len(), y.len() * QK4_1, "q4_1 quantize_row_ref lengths");
    for (x, b) in x.chunks_exact(QK4_1).zip(y) {
        let mut min = f32::MAX;
        let mut max = -f32::MAX;
        for &v in x {
            if v < min {
                min = v;
            }
            if v > max {
                max = v;
            }
        }
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = fp32_to_fp16(d);
        b.m = fp32_to_fp16(min);
        let (lo, hi) = x.split_at(QK4_1 / 2);
        for ((q, &x0), &x1) in b.qs.iter_mut().zip(lo).zip(hi) {
            let xi0 = (((x0 - min) * id + 0.5) as i8).min(15) as u8;
            let xi1 = (((x1 - min) * id + 0.5) as i8).min(15) as u8;
            *q = xi0 | (xi1 << 4);
        }
    }
}

/// Q4_1 · Q8_0 (see the module docs for how this differs from ggml's Q4_1 · Q8_1).
/// Per block: exact integer sums `sumi = Σ q·q8` and `sum8 = Σ q8`, then
/// `sumf += (dx·dy)·sumi + m·(sum8·dy)` in f32, blocks in order.
///
/// # Panics
/// If the block counts differ.
pub fn vec_dot_q4_1_q8_0(x: &[BlockQ4_1], y: &[BlockQ8_0]) -> f32 {
    assert_eq!(x.len(), y.len(), "vec_dot_q4_1_q8_0 block counts");
    let mut sumf = 0.0f32;
    for (bx, by) in x.iter().zip(y) {
        let (ylo, yhi) = by.qs.split_at(QK4_1 / 2);
        let mut sumi0 = 0i32;
        let mut sumi1 = 0i32;
        for ((&q, &y0), &y1) in bx.qs.iter().zip(ylo).zip(yhi) {
            sumi0 += (q & 0x0F) as i32 * y0 as i32;
            sumi1 += (q >> 4) as i32 * y1 as i32;
        }
        let sumi = sumi0 + sumi1;
        let sum8: i32 = by.qs.iter().map(|&v| v as i32).sum();
        let dy = fp16_to_fp32(by.d);
        let s = sum8 as f32 * dy;
        sumf += (fp16_to_fp32(bx.d) * dy) * sumi as f32 + fp16_to_fp32(bx.m) * s;
    }
    sumf
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::q8_0::{self, QK8_0};
    use crate::testing::{check_close, dot_f64, XorShift};

    #[test]
    fn hand_built_block_dequantizes_exactly() {
        // d = 0.125, m = -1; qs[j] = j | (15 - j) << 4.
        let mut b = BlockQ4_1 {
            d: 0x3000u16.to_le_bytes(),
            m: 0xbc00u16.to_le_bytes(),
            qs: [0; 16],
        };
        for (j, q) in b.qs.iter_mut().enumerate() {
            *q = j as u8 | ((15 - j as u8) << 4);
        }
        let mut y = [0.0; QK4_1];
        dequantize_row(&[b], &mut y);
        for j in 0..16 {
            assert_eq!(y[j], j as f32 * 0.125 - 1.0, "low nibble {j}");
            assert_eq!(y[j + 16], (15 - j) as f32 * 0.125 - 1.0, "high nibble {j}");
        }
        assert_eq!(y[0], -1.0);
        assert_eq!(y[16], 0.875);
    }

    #[test]
    fn quantize_spans_min_to_max() {
        let mut x = [0.52f32; QK4_1];
        x[3] = -1.0; // min
        x[20] = 2.0; // max → d = 0.2
        let mut b = [BlockQ4_1::zeroed()];
        quantize_row_ref(&x, &mut b);
        assert_eq!(fp16_to_fp32(b[0].m), -1.0);
        assert_eq!(b[0].d, fp32_to_fp16(0.2));
        assert_eq!(b[0].qs[3] & 0xF, 0);
        assert_eq!(b[0].qs[4] >> 4, 15); // element 20
        assert_eq!(b[0].qs[0] & 0xF, 8); // (0.52 + 1)/0.2 = 7.6 → trunc(8.1) = 8
                                         // Constant block: d = 0, every q = 0, value = m.
        quantize_row_ref(&[0.3; QK4_1], &mut b);
        let mut y = [0.0; QK4_1];
        dequantize_row(&b, &mut y);
        assert!(y.iter().all(|&v| v == fp16_to_fp32(fp32_to_fp16(0.3))));
    }

    /// q is round-to-nearest of (x - min)/d in [0, 15] (no clamping), so
    /// |x - y| <= d/2 + 15·d·2^-11 + |min|·2^-11 (f16 rounding of d and m) + slack.
    #[test]
    fn round_trip_error_bound() {
        let mut rng = XorShift::new(40);
        let nb = 256;
        let x = rng.vec_weights(QK4_1 * nb, 0.05);
        let mut b = vec![BlockQ4_1::zeroed(); nb];
        quantize_row_ref(&x, &mut b);
        let mut y = vec![0.0; x.len()];
        dequantize_row(&b, &mut y);
        check_close("q4_1 round trip", &y, &x, |i| {
            let blk = &b[i / QK4_1];
            let d = fp16_to_fp32(blk.d).abs();
            let m = fp16_to_fp32(blk.m).abs();
            d * (0.5 + 15.0 * 2f32.powi(-11)) + m * 2f32.powi(-11) + 1e-6
        });
    }

    #[test]
    fn dot_matches_f64_dot_of_dequantized() {
        let mut rng = XorShift::new(41);
        let n = QK4_1 * 64;
        let w = rng.vec_weights(n, 0.02);
        let x = rng.vec_uniform(n, -4.0, 4.0);
        let mut bw = vec![BlockQ4_1::zeroed(); n / QK4_1];
        let mut bx = vec![BlockQ8_0::ZERO; n / QK8_0];
        quantize_row_ref(&w, &mut bw);
        q8_0::quantize_row_ref(&x, &mut bx);
        let (mut wd, mut xd) = (vec![0.0; n], vec![0.0; n]);
        dequantize_row(&bw, &mut wd);
        q8_0::dequantize_row(&bx, &mut xd);
        let want = dot_f64(&wd, &xd);
        let scale: f64 = wd.iter().zip(&xd).map(|(a, b)| (a * b).abs() as f64).sum();
        let got = vec_dot_q4_1_q8_0(&bw, &bx) as f64;
        assert!((got - want).abs() <= 1e-6 * scale, "got {got}, want {want}");
    }
}
