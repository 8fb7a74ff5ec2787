//! Q4_0 (ggml type 2): blocks of 32 weights, one f16 scale `d` and 4-bit
//! quants `q`; weight value `(q - 8)·d`. Scalar reference (AVX2 versions: `x86/avx2.rs`).
//!
//! Nibble order (ggml): byte `qs[j]` holds element `j` in its low nibble and
//! element `j + 16` in its high nibble. Follows ggml's `block_q4_0`,
//! `dequantize_row_q4_0`, `quantize_row_q4_0_ref` and
//! `ggml_vec_dot_q4_0_q8_0_generic`.

use bytemuck::{Pod, Zeroable};

use crate::f16::{fp16_to_fp32, fp32_to_fp16};
use crate::q8_0::BlockQ8_0;
use crate::KernelError;

/// Weights per block (ggml `QK4_0`).
pub const QK4_0: usize = 32;

/// ggml `block_q4_0`: 18 bytes, alignment 1.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ4_0 {
    /// Scale, f16 little-endian.
    pub d: [u8; 2],
    /// Nibbles: low = element j, high = element j + 16.
    pub qs: [u8; QK4_0 / 2],
}

const _: () = assert!(size_of::<BlockQ4_0>() == 18);
const _: () = assert!(align_of::<BlockQ4_0>() == 1);

/// Views encoded weight bytes (any alignment) as blocks.
pub fn blocks(bytes: &[u8]) -> Result<&[BlockQ4_0], KernelError> {
    crate::cast_blocks("q4_0", bytes)
}

/// ggml `dequantize_row_q4_0`: `y = (q - 8)·d`.
///
/// # Panics
/// If `y.len() != QK4_0 * x.len()`.
pub fn dequantize_row(x: &[BlockQ4_0], y: &mut [f32]) {
    assert_eq!(y.len(), x.len() * QK4_0, "q4_0 dequantize_row lengths");
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK4_0)) {
        let d = fp16_to_fp32(b.d);
        let (lo, hi) = y.split_at_mut(QK4_0 / 2);
        for ((&q, y0), y1) in b.qs.iter().zip(lo).zip(hi) {
            *y0 = ((q & 0x0F) as i32 - 8) as f32 * d;
            *y1 = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }
}

/// ggml `quantize_row_q4_0_ref`: `d = max/-8` where `max` is the signed value
/// of largest magnitude (so it maps to q = 0 exactly), `q = min(15, trunc(x/d + 8.5))`.
/// The opposite extreme maps to +8 and is clamped to 7.
///
/// # Panics
/// If `x.len() != QK4_0 * y.len()`.
pub fn quantize_row_ref(x: &[f32], y: &mut [BlockQ4_0]) {
    assert_eq!(x.len(), y.len() * QK4_0, "q4_0 quantize_row_ref lengths");
    for (x, b) in x.chunks_exact(QK4_0).zip(y) {
        let mut amax = 0.0f32;
        let mut max = 0.0f32;
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = fp32_to_fp16(d);
        let (lo, hi) = x.split_at(QK4_0 / 2);
        for ((q, &x0), &x1) in b.qs.iter_mut().zip(lo).zip(hi) {
            let xi0 = ((x0 * id + 8.5) as i8).min(15) as u8;
            let xi1 = ((x1 * id + 8.5) as i8).min(15) as u8;
            *q = xi0 | (xi1 << 4);
        }
    }
}

/// ggml `ggml_vec_dot_q4_0_q8_0_generic`: per block the exact integer sum
/// `sumi = Σ (q - 8)·q8`, then `sumf += (sumi·dx)·dy` in f32, blocks in order.
///
/// # Panics
/// If the block counts differ.
pub fn vec_dot_q4_0_q8_0(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32 {
    assert_eq!(x.len(), y.len(), "vec_dot_q4_0_q8_0 block counts");
    let mut sumf = 0.0f32;
    for (bx, by) in x.iter().zip(y) {
        let (ylo, yhi) = by.qs.split_at(QK4_0 / 2);
        let mut sumi0 = 0i32;
        let mut sumi1 = 0i32;
        for ((&q, &y0), &y1) in bx.qs.iter().zip(ylo).zip(yhi) {
            sumi0 += ((q & 0x0F) as i32 - 8) * y0 as i32;
            sumi1 += ((q >> 4) as i32 - 8) * y1 as i32;
        }
        let sumi = sumi0 + sumi1;
        sumf += sumi as f32 * fp16_to_fp32(bx.d) * fp16_to_fp32(by.d);
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
        // d = -0.25; qs[j] = j (low) | (15 - j) << 4 (high).
        let mut b = BlockQ4_0 {
            d: 0xb400u16.to_le_bytes(),
            qs: [0; 16],
        };
        for (j, q) in b.qs.iter_mut().enumerate() {
            *q = j as u8 | ((15 - j as u8) << 4);
        }
        let mut y = [0.0; QK4_0];
        dequantize_row(&[b], &mut y);
        for j in 0..16 {
            assert_eq!(y[j], (j as f32 - 8.0) * -0.25, "low nibble {j}");
            assert_eq!(y[j + 16], (7.0 - j as f32) * -0.25, "high nibble {j}");
        }
        assert_eq!(y[0], 2.0);
        assert_eq!(y[16], -1.75);
    }

    #[test]
    fn quantize_maps_the_signed_max_to_zero_and_clamps_the_other_end() {
        let mut x = [0.0f32; QK4_0];
        x[0] = -4.0; // largest magnitude, negative → d = 0.5
        x[1] = 4.0; // maps to +8 → clamped to q = 15 (value 3.5)
        x[2] = 0.26; // 0.52 + 8.5 → trunc 9
        x[17] = -0.76; // -1.52 + 8.5 = 6.98 → 6
        let mut b = [BlockQ4_0::zeroed()];
        quantize_row_ref(&x, &mut b);
        assert_eq!(fp16_to_fp32(b[0].d), 0.5);
        assert_eq!(b[0].qs[0] & 0xF, 0);
        assert_eq!(b[0].qs[1] & 0xF, 15);
        assert_eq!(b[0].qs[2] & 0xF, 9);
        assert_eq!(b[0].qs[1] >> 4, 6);
        assert_eq!(b[0].qs[5], 8 | (8 << 4)); // zeros
    }

    /// |x - y| <= |d|/2 + 8·|d|·2^-11 (f16 scale rounding) for q < 15;
    /// the clamped q = 15 (the value opposite the max) is within |d| + the same.
    #[test]
    fn round_trip_error_bound() {
        let mut rng = XorShift::new(30);
        let nb = 256;
        let x = rng.vec_weights(QK4_0 * nb, 0.05);
        let mut b = vec![BlockQ4_0::zeroed(); nb];
        quantize_row_ref(&x, &mut b);
        let mut y = vec![0.0; x.len()];
        dequantize_row(&b, &mut y);
        check_close("q4_0 round trip", &y, &x, |i| {
            let blk = &b[i / QK4_0];
            let j = i % QK4_0;
            let q = if j < 16 {
                blk.qs[j] & 0xF
            } else {
                blk.qs[j - 16] >> 4
            };
            let d = fp16_to_fp32(blk.d).abs();
            let step = if q == 15 { 1.0 } else { 0.5 };
            d * (step + 8.0 * 2f32.powi(-11)) + 1e-7
        });
    }

    #[test]
    fn dot_matches_f64_dot_of_dequantized() {
        let mut rng = XorShift::new(31);
        let n = QK4_0 * 64;
        let w = rng.vec_weights(n, 0.02);
        let x = rng.vec_uniform(n, -4.0, 4.0);
        let mut bw = vec![BlockQ4_0::zeroed(); n / QK4_0];
        let mut bx = vec![BlockQ8_0::ZERO; n / QK8_0];
        quantize_row_ref(&w, &mut bw);
        q8_0::quantize_row_ref(&x, &mut bx);
        let (mut wd, mut xd) = (vec![0.0; n], vec![0.0; n]);
        dequantize_row(&bw, &mut wd);
        q8_0::dequantize_row(&bx, &mut xd);
        let want = dot_f64(&wd, &xd);
        let scale: f64 = wd.iter().zip(&xd).map(|(a, b)| (a * b).abs() as f64).sum();
        let got = vec_dot_q4_0_q8_0(&bw, &bx) as f64;
        assert!((got - want).abs() <= 1e-6 * scale, "got {got}, want {want}");
    }

    #[test]
    fn blocks_rejects_partial_blocks() {
        assert_eq!(blocks(&[0; 36]).map(<[_]>::len), Ok(2));
        assert_eq!(
            blocks(&[0; 37]),
            Err(KernelError::ByteLength {
                format: "q4_0",
                len: 37,
                block_bytes: 18
            })
        );
    }
}
