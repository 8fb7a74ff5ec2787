//! Q5_0 (ggml type 6): blocks of 32 weights, one f16 scale `d` and 5-bit
//! quants `q`; weight value `(q - 16)·d`. Scalar reference (AVX2 versions: `x86/avx2.rs`).
//!
//! The low 4 bits are packed like Q4_0 (low nibble element `j`, high nibble
//! `j + 16`); bit 4 of element `i` is bit `i` of the little-endian u32 `qh`.
//! Follows ggml's `block_q5_0`, `dequantize_row_q5_0`, `quantize_row_q5_0_ref`
//! and `ggml_vec_dot_q5_0_q8_0_generic`.

use bytemuck::{Pod, Zeroable};

use crate::f16::{fp16_to_fp32, fp32_to_fp16};
use crate::q8_0::BlockQ8_0;
use crate::KernelError;

/// Weights per block (ggml `QK5_0`).
pub const QK5_0: usize = 32;

/// ggml `block_q5_0`: 22 bytes, alignment 1.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ5_0 {
    /// Scale, f16 little-endian.
    pub d: [u8; 2],
    /// Fifth bits, a little-endian u32: bit i belongs to element i.
    pub qh: [u8; 4],
    /// Low nibbles: low = element j, high = element j + 16.
    pub qs: [u8; QK5_0 / 2],
}

const _: () = assert!(size_of::<BlockQ5_0>() == 22);
const _: () = assert!(align_of::<BlockQ5_0>() == 1);

/// Views encoded weight bytes (any alignment) as blocks.
pub fn blocks(bytes: &[u8]) -> Result<&[BlockQ5_0], KernelError> {
    crate::cast_blocks("q5_0", bytes)
}

/// The two 5-bit quants (minus 16) held at position `j` of a block:
/// elements `j` and `j + 16`.
#[inline]
fn quants(b: &BlockQ5_0, qh: u32, j: usize) -> (i32, i32) {
    let xh0 = ((qh >> j) << 4) & 0x10;
    let xh1 = (qh >> (j + 12)) & 0x10;
    let x0 = ((b.qs[j] & 0x0F) as u32 | xh0) as i32 - 16;
    let x1 = ((b.qs[j] >> 4) as u32 | xh1) as i32 - 16;
    (x0, x1)
}

/// ggml `dequantize_row_q5_0`: `y = (q - 16)·d`.
///
/// # Panics
/// If `y.len() != QK5_0 * x.len()`.
pub fn dequantize_row(x: &[BlockQ5_0], y: &mut [f32]) {
    assert_eq!(y.len(), x.len() * QK5_0, "q5_0 dequantize_row lengths");
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK5_0)) {
        let d = fp16_to_fp32(b.d);
        let qh = u32::from_le_bytes(b.qh);
        for j in 0..QK5_0 / 2 {
            let (x0, x1) = quants(b, qh, j);
            y[j] = x0 as f32 * d;
            y[j + QK5_0 / 2] = x1 as f32 * d;
        }
    }
}

/// The same values as Q8_0 blocks, exactly: a Q5_0 element is `d·(q - 16)`
/// with `q - 16` in `-16..=15`, which a Q8_0 block of the same f16 `d` holds
/// as its quant (the tests check the fast path's Q5_0 products against the
/// Q8_0 ones on these blocks).
pub fn to_q8_0(x: &[BlockQ5_0]) -> Vec<BlockQ8_0> {
    x.iter()
        .map(|b| {
            let qh = u32::from_le_bytes(b.qh);
            let mut qs = [0i8; QK5_0];
            for j in 0..QK5_0 / 2 {
                let (x0, x1) = quants(b, qh, j);
                (qs[j], qs[j + QK5_0 / 2]) = (x0 as i8, x1 as i8);
            }
            BlockQ8_0 { d: b.d, qs }
        })
        .collect()
}

/// ggml `quantize_row_q5_0_ref`: `d = max/-16` for the signed value of largest
/// magnitude, `q = min(31, trunc(x/d + 16.5))`.
///
/// # Panics
/// If `x.len() != QK5_0 * y.len()`.
pub fn quantize_row_ref(x: &[f32], y: &mut [BlockQ5_0]) {
    assert_eq!(x.len(), y.len() * QK5_0, "q5_0 quantize_row_ref lengths");
    for (x, b) in x.chunks_exact(QK5_0).zip(y) {
        let mut amax = 0.0f32;
        let mut max = 0.0f32;
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = fp32_to_fp16(d);
        let mut qh = 0u32;
        for j in 0..QK5_0 / 2 {
            let xi0 = ((x[j] * id + 16.5) as i8).min(31) as u8;
            let xi1 = ((x[j + QK5_0 / 2] * id + 16.5) as i8).min(31) as u8;
            b.qs[j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4);
            qh |= (((xi0 & 0x10) >> 4) as u32) << j;
            qh |= (((xi1 & 0x10) >> 4) as u32) << (j + QK5_0 / 2);
        }
        b.qh = qh.to_le_bytes();
    }
}

/// ggml `ggml_vec_dot_q5_0_q8_0_generic`: per block the exact integer sum
/// `sumi = Σ (q - 16)·q8`, then `sumf += (dx·dy)·sumi` in f32, blocks in order.
///
/// # Panics
/// If the block counts differ.
pub fn vec_dot_q5_0_q8_0(x: &[BlockQ5_0], y: &[BlockQ8_0]) -> f32 {
    assert_eq!(x.len(), y.len(), "vec_dot_q5_0_q8_0 block counts");
    let mut sumf = 0.0f32;
    for (bx, by) in x.iter().zip(y) {
        let qh = u32::from_le_bytes(bx.qh);
        let mut sumi0 = 0i32;
        let mut sumi1 = 0i32;
        for j in 0..QK5_0 / 2 {
            let (x0, x1) = quants(bx, qh, j);
            sumi0 += x0 * by.qs[j] as i32;
            sumi1 += x1 * by.qs[j + QK5_0 / 2] as i32;
        }
        let sumi = sumi0 + sumi1;
        sumf += (fp16_to_fp32(bx.d) * fp16_to_fp32(by.d)) * sumi as f32;
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
        // d = 0.5. Element i has quant i (0..31): low nibbles i & 15, fifth bit set for i >= 16.
        let mut b = BlockQ5_0 {
            d: 0x3800u16.to_le_bytes(),
            qh: 0xFFFF_0000u32.to_le_bytes(),
            qs: [0; 16],
        };
        for (j, q) in b.qs.iter_mut().enumerate() {
            *q = j as u8 | ((j as u8) << 4);
        }
        let mut y = [0.0; QK5_0];
        dequantize_row(&[b], &mut y);
        for (i, &v) in y.iter().enumerate() {
            assert_eq!(v, (i as f32 - 16.0) * 0.5, "element {i}");
        }
        // Flip only the fifth bit of element 3 (bit 3, in qh[0]): 3 → 19.
        b.qh = 0xFFFF_0008u32.to_le_bytes();
        dequantize_row(&[b], &mut y);
        assert_eq!(y[3], 1.5);
        // And clear element 17's (bit 17, in qh[2]): 17 → 1.
        b.qh = 0xFFFD_0000u32.to_le_bytes();
        dequantize_row(&[b], &mut y);
        assert_eq!(y[17], -7.5);
    }

    /// The Q8_0 copy holds the same values (every quant, every scale) and gives
    /// the same Q8_0-activation dot products, bit for bit.
    #[test]
    fn q8_0_copy_is_exact() {
        let mut rng = XorShift::new(52);
        let n = QK5_0 * 96;
        let mut b = vec![BlockQ5_0::zeroed(); n / QK5_0];
        quantize_row_ref(&rng.vec_weights(n, 0.05), &mut b);
        // Every quant value, including the extremes, appears.
        b[0].qs = std::array::from_fn(|j| j as u8 | ((j as u8) << 4));
        b[0].qh = 0xFFFF_0000u32.to_le_bytes();
        let q8 = to_q8_0(&b);
        let (mut y5, mut y8) = (vec![0.0; n], vec![0.0; n]);
        dequantize_row(&b, &mut y5);
        q8_0::dequantize_row(&q8, &mut y8);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&y5), bits(&y8));
        let mut act = vec![BlockQ8_0::ZERO; n / QK8_0];
        q8_0::quantize_row_ref(&rng.vec_uniform(n, -3.0, 3.0), &mut act);
        assert_eq!(
            vec_dot_q5_0_q8_0(&b, &act).to_bits(),
            q8_0::vec_dot_q8_0_q8_0(&q8, &act).to_bits()
        );
    }

    #[test]
    fn quantize_round_trips_a_grid_exactly() {
        // Values on the grid (q - 16)·d with d = -0.25 (max = 4 maps to q = 0) round-trip exactly.
        let x: Vec<f32> = (0..QK5_0).map(|i| (i as f32 - 16.0) * -0.25).collect();
        let mut b = [BlockQ5_0::zeroed()];
        quantize_row_ref(&x, &mut b);
        assert_eq!(fp16_to_fp32(b[0].d), -0.25);
        let mut y = [0.0; QK5_0];
        dequantize_row(&b, &mut y);
        assert_eq!(&y[..], &x[..]);
    }

    /// |x - y| <= |d|/2 + 16·|d|·2^-11 for q < 31; the clamped q = 31 (the value
    /// opposite the max) is within |d| + the same.
    #[test]
    fn round_trip_error_bound() {
        let mut rng = XorShift::new(50);
        let nb = 256;
        let x = rng.vec_weights(QK5_0 * nb, 0.05);
        let mut b = vec![BlockQ5_0::zeroed(); nb];
        quantize_row_ref(&x, &mut b);
        let mut y = vec![0.0; x.len()];
        dequantize_row(&b, &mut y);
        check_close("q5_0 round trip", &y, &x, |i| {
            let blk = &b[i / QK5_0];
            let j = i % QK5_0;
            let (x0, x1) = quants(blk, u32::from_le_bytes(blk.qh), j % 16);
            let q = if j < 16 { x0 } else { x1 } + 16;
            let step = if q == 31 { 1.0 } else { 0.5 };
            fp16_to_fp32(blk.d).abs() * (step + 16.0 * 2f32.powi(-11)) + 1e-7
        });
    }

    #[test]
    fn dot_matches_f64_dot_of_dequantized() {
        let mut rng = XorShift::new(51);
        let n = QK5_0 * 64;
        let w = rng.vec_weights(n, 0.02);
        let x = rng.vec_uniform(n, -4.0, 4.0);
        let mut bw = vec![BlockQ5_0::zeroed(); n / QK5_0];
        let mut bx = vec![BlockQ8_0::ZERO; n / QK8_0];
        quantize_row_ref(&w, &mut bw);
        q8_0::quantize_row_ref(&x, &mut bx);
        let (mut wd, mut xd) = (vec![0.0; n], vec![0.0; n]);
        dequantize_row(&bw, &mut wd);
        q8_0::dequantize_row(&bx, &mut xd);
        let want = dot_f64(&wd, &xd);
        let scale: f64 = wd.iter().zip(&xd).map(|(a, b)| (a * b).abs() as f64).sum();
        let got = vec_dot_q5_0_q8_0(&bw, &bx) as f64;
        assert!((got - want).abs() <= 1e-6 * scale, "got {got}, want {want}");
    }
}
