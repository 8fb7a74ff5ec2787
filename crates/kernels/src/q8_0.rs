//! Q8_0 (ggml type 8): blocks of 32 values, one f16 scale `d` and 32 signed
//! 8-bit quants; value `i` is `qs[i]·d`. Scalar reference, no SIMD.
//!
//! Used both as a weight format and as the activation format for the 32-wide
//! weight formats (Q4_0, Q4_1, Q5_0, Q8_0). Follows ggml's `block_q8_0`,
//! `dequantize_row_q8_0`, `quantize_row_q8_0_ref` and
//! `ggml_vec_dot_q8_0_q8_0_generic`; and the DeepSeek V4 reference engine's
//! activations with f32 block scales and their dot product
//! ([`quantize_row_f32_scales`], [`vec_dot_q8_0_f32_scales`]).

use bytemuck::{Pod, Zeroable};

use crate::f16::{fp16_to_fp32, fp32_to_fp16};
use crate::KernelError;

/// Values per block (ggml `QK8_0`).
pub const QK8_0: usize = 32;

/// ggml `block_q8_0`: 34 bytes, alignment 1.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ8_0 {
    /// Scale, f16 little-endian.
    pub d: [u8; 2],
    /// Quants.
    pub qs: [i8; QK8_0],
}

const _: () = assert!(size_of::<BlockQ8_0>() == 34);
const _: () = assert!(align_of::<BlockQ8_0>() == 1);

impl BlockQ8_0 {
    /// The all-zero block (d = 0).
    pub const ZERO: Self = Self {
        d: [0; 2],
        qs: [0; QK8_0],
    };
}

/// Views encoded weight bytes (any alignment) as blocks.
pub fn blocks(bytes: &[u8]) -> Result<&[BlockQ8_0], KernelError> {
    crate::cast_blocks("q8_0", bytes)
}

/// ggml `dequantize_row_q8_0`: `y = qs·d`.
///
/// # Panics
/// If `y.len() != QK8_0 * x.len()`.
pub fn dequantize_row(x: &[BlockQ8_0], y: &mut [f32]) {
    assert_eq!(y.len(), x.len() * QK8_0, "q8_0 dequantize_row lengths");
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK8_0)) {
        let d = fp16_to_fp32(b.d);
        for (y, &q) in y.iter_mut().zip(&b.qs) {
            *y = q as f32 * d;
        }
    }
}

/// ggml `quantize_row_q8_0_ref`: `d = amax/127` (stored as f16), quants
/// `round(x/d)` with ties away from zero, computed with the unrounded `1/d`.
///
/// # Panics
/// If `x.len() != QK8_0 * y.len()`.
pub fn quantize_row_ref(x: &[f32], y: &mut [BlockQ8_0]) {
    assert_eq!(x.len(), y.len() * QK8_0, "q8_0 quantize_row_ref lengths");
    for (x, b) in x.chunks_exact(QK8_0).zip(y) {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = fp32_to_fp16(d);
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = (v * id).round() as i8;
        }
    }
}

/// ggml `ggml_vec_dot_q8_0_q8_0_generic`: per block an exact integer sum
/// `sumi = Σ x.qs·y.qs`, then `sumf += sumi · (dx·dy)` in f32, blocks in order.
///
/// # Panics
/// If the block counts differ.
pub fn vec_dot_q8_0_q8_0(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> f32 {
    assert_eq!(x.len(), y.len(), "vec_dot_q8_0_q8_0 block counts");
    let mut sumf = 0.0f32;
    for (bx, by) in x.iter().zip(y) {
        let sumi: i32 = bx
            .qs
            .iter()
            .zip(&by.qs)
            .map(|(&a, &b)| a as i32 * b as i32)
            .sum();
        sumf += sumi as f32 * (fp16_to_fp32(bx.d) * fp16_to_fp32(by.d));
    }
    sumf
}

/// The DeepSeek V4 reference engine's Q8_0 activations
/// (`quantize_q8_0_activation`): per block of 32, `d = amax/127` kept in
/// f32 (not rounded to f16, unlike [`quantize_row_ref`]) and quants
/// `x·(1/d)` rounded to nearest, ties to even (`lrintf`), clamped to
/// [-128, 127]; `1/d` is 0 for an all-zero block.
///
/// # Panics
/// If `x.len() != qs.len()` or `x.len() != QK8_0 * d.len()`.
pub fn quantize_row_f32_scales(x: &[f32], qs: &mut [i8], d: &mut [f32]) {
    assert!(
        x.len() == qs.len() && x.len() == d.len() * QK8_0,
        "q8_0 quantize_row_f32_scales lengths"
    );
    for ((x, q), d) in x.chunks_exact(QK8_0).zip(qs.chunks_exact_mut(QK8_0)).zip(d) {
        *d = f32_scale(x);
        quantize_block_f32_scale(x, *d, q);
    }
}

/// The f32 scale [`quantize_row_f32_scales`] gives one block: its largest
/// magnitude over 127.
pub fn f32_scale(x: &[f32]) -> f32 {
    let amax = x
        .iter()
        .fold(0.0f32, |m, v| if v.abs() > m { v.abs() } else { m });
    amax / 127.0
}

/// One block's quants at scale `d` ([`f32_scale`]), as in
/// [`quantize_row_f32_scales`].
pub fn quantize_block_f32_scale(x: &[f32], d: f32, q: &mut [i8]) {
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (q, &v) in q.iter_mut().zip(x) {
        // |v·id| <= 127 (plus rounding) for finite inputs, well within
        // `nearest_int`'s range; ties to even, like `lrintf`.
        *q = crate::nearest_int(v * id).clamp(-128, 127) as i8;
    }
}

/// Q8_0 weights · activations of [`quantize_row_f32_scales`], in the DeepSeek
/// V4 reference engine's order (`dot_q8_0_row`): per block an exact integer
/// sum `isum`, then `acc += (f16(w.d)·d[b])·isum` in f32, blocks in order.
///
/// # Panics
/// If the lengths disagree.
pub fn vec_dot_q8_0_f32_scales(w: &[BlockQ8_0], qs: &[i8], d: &[f32]) -> f32 {
    assert!(
        w.len() == d.len() && qs.len() == d.len() * QK8_0,
        "vec_dot_q8_0_f32_scales lengths"
    );
    let mut acc = 0.0f32;
    for ((bw, q), &dy) in w.iter().zip(qs.chunks_exact(QK8_0)).zip(d) {
        let isum: i32 = bw
            .qs
            .iter()
            .zip(q)
            .map(|(&a, &b)| a as i32 * b as i32)
            .sum();
        acc += fp16_to_fp32(bw.d) * dy * isum as f32;
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check_close, dot_f64, XorShift};

    #[test]
    fn hand_built_block_dequantizes_exactly() {
        let mut b = BlockQ8_0::ZERO;
        b.d = 0x3800u16.to_le_bytes(); // 0.5
        for (i, q) in b.qs.iter_mut().enumerate() {
            *q = (i as i32 * 8 - 127) as i8; // -127, -119, ..., 121
        }
        let mut y = [0.0; QK8_0];
        dequantize_row(&[b], &mut y);
        for (i, &v) in y.iter().enumerate() {
            assert_eq!(v, (i as f32 * 8.0 - 127.0) * 0.5, "element {i}");
        }
    }

    #[test]
    fn quantize_picks_amax_over_127_and_rounds_half_away_from_zero() {
        // amax = 127 → d = 1 exactly, so quants are round(x).
        let mut x = [0.0f32; QK8_0];
        x[0] = -127.0;
        x[1] = 2.5;
        x[2] = -2.5;
        x[3] = 0.49;
        x[4] = 126.5;
        let mut b = [BlockQ8_0::ZERO];
        quantize_row_ref(&x, &mut b);
        assert_eq!(fp16_to_fp32(b[0].d), 1.0);
        assert_eq!(&b[0].qs[..5], &[-127, 3, -3, 0, 127]);
        // An all-zero block gives d = 0 and zero quants.
        quantize_row_ref(&[0.0; QK8_0], &mut b);
        assert_eq!(b[0], BlockQ8_0::ZERO);
    }

    /// |x - y| <= d/2 (rounding) + 127·|d - f16(d)| (the stored scale is
    /// rounded to f16, relative error <= 2^-11) + float slack.
    #[test]
    fn round_trip_error_bound() {
        let mut rng = XorShift::new(20);
        let x = rng.vec_weights(QK8_0 * 128, 0.05);
        let mut b = vec![BlockQ8_0::ZERO; 128];
        quantize_row_ref(&x, &mut b);
        let mut y = vec![0.0; x.len()];
        dequantize_row(&b, &mut y);
        let amax: Vec<f32> = x
            .chunks(QK8_0)
            .map(|c| c.iter().fold(0.0f32, |m, v| m.max(v.abs())))
            .collect();
        check_close("q8_0 round trip", &y, &x, |i| {
            let d = amax[i / QK8_0] / 127.0;
            d * (0.5 + 127.0 * 2f32.powi(-11)) + 1e-7
        });
    }

    #[test]
    fn dot_matches_f64_dot_of_dequantized() {
        let mut rng = XorShift::new(21);
        let n = QK8_0 * 64;
        let w = rng.vec_weights(n, 0.02);
        let x = rng.vec_uniform(n, -4.0, 4.0);
        let mut bw = vec![BlockQ8_0::ZERO; n / QK8_0];
        let mut bx = bw.clone();
        quantize_row_ref(&w, &mut bw);
        quantize_row_ref(&x, &mut bx);
        let (mut wd, mut xd) = (vec![0.0; n], vec![0.0; n]);
        dequantize_row(&bw, &mut wd);
        dequantize_row(&bx, &mut xd);
        let want = dot_f64(&wd, &xd);
        let scale: f64 = wd.iter().zip(&xd).map(|(a, b)| (a * b).abs() as f64).sum();
        let got = vec_dot_q8_0_q8_0(&bw, &bx) as f64;
        assert!((got - want).abs() <= 1e-6 * scale, "got {got}, want {want}");
    }

    /// The block-level formula on a tiny case computed by hand.
    #[test]
    fn dot_of_hand_built_blocks() {
        let mut a = BlockQ8_0::ZERO;
        let mut b = BlockQ8_0::ZERO;
        a.d = 0x4000u16.to_le_bytes(); // 2
        b.d = 0x3400u16.to_le_bytes(); // 0.25
        a.qs[0] = 3;
        b.qs[0] = -5;
        a.qs[31] = 127;
        b.qs[31] = 127;
        // (3·-5 + 127·127) · (2·0.25) = 16114 · 0.5
        assert_eq!(vec_dot_q8_0_q8_0(&[a, a], &[b, b]), 2.0 * 8057.0);
    }

    #[test]
    fn f32_scale_activations_round_ties_to_even_and_keep_the_scale() {
        let mut x = [0.0f32; QK8_0];
        x[0] = 127.0; // d = 1 exactly
        x[1] = 2.5;
        x[2] = -3.5;
        x[3] = 0.5;
        let (mut q, mut d) = ([0i8; QK8_0], [0.0f32; 1]);
        quantize_row_f32_scales(&x, &mut q, &mut d);
        assert_eq!(d[0], 1.0);
        assert_eq!(&q[..4], &[127, 2, -4, 0]);
        quantize_row_f32_scales(&[0.0; QK8_0], &mut q, &mut d);
        assert_eq!((d[0], q), (0.0, [0; QK8_0]));
        // d stays f32: 1/3 would round to f16.
        let x: Vec<f32> = (0..QK8_0).map(|i| i as f32 / 93.0).collect();
        quantize_row_f32_scales(&x, &mut q, &mut d);
        assert_eq!(d[0], (31.0f32 / 93.0) / 127.0);
    }

    #[test]
    fn f32_scale_dot_sums_blocks_in_order() {
        let mut rng = XorShift::new(5);
        let n = 4 * QK8_0;
        let w: Vec<f32> = (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let a: Vec<f32> = (0..n).map(|_| rng.uniform(-2.0, 2.0)).collect();
        let mut wb = vec![BlockQ8_0::ZERO; 4];
        quantize_row_ref(&w, &mut wb);
        let (mut q, mut d) = (vec![0i8; n], vec![0.0f32; 4]);
        quantize_row_f32_scales(&a, &mut q, &mut d);
        let mut want = 0.0f32;
        for b in 0..4 {
            let isum: i32 = (0..QK8_0)
                .map(|j| wb[b].qs[j] as i32 * q[b * QK8_0 + j] as i32)
                .sum();
            want += fp16_to_fp32(wb[b].d) * d[b] * isum as f32;
        }
        assert_eq!(
            vec_dot_q8_0_f32_scales(&wb, &q, &d).to_bits(),
            want.to_bits()
        );
    }
}
