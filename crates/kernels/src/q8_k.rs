//! Q8_K (ggml type 15): the activation format for the K-quant weights.
//! Super-blocks of 256 values, one f32 scale `d`, 256 signed 8-bit quants and
//! the sums of each group of 16 quants (`bsums`, used for the K-quant `min`
//! terms). Scalar reference, no SIMD.
//!
//! Only ever produced by us (never read from a file), so the block keeps its
//! natural alignment of 4. Follows ggml's `block_q8_K`,
//! `quantize_row_q8_K_ref` and `dequantize_row_q8_K`.

use bytemuck::{Pod, Zeroable};

use crate::{nearest_int, QK_K};

/// ggml `block_q8_K`: 292 bytes, alignment 4.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ8_K {
    /// Scale (f32, not f16).
    pub d: f32,
    /// Quants, in [-127, 127] when produced by [`quantize_row_ref`].
    pub qs: [i8; QK_K],
    /// `bsums[j] = Σ qs[16j..16j+16]`.
    pub bsums: [i16; QK_K / 16],
}

const _: () = assert!(size_of::<BlockQ8_K>() == 4 + QK_K + 2 * (QK_K / 16));

impl BlockQ8_K {
    /// The all-zero block (d = 0).
    pub const ZERO: Self = Self {
        d: 0.0,
        qs: [0; QK_K],
        bsums: [0; QK_K / 16],
    };
}

/// ggml `quantize_row_q8_K_ref`: with `max` the signed value of largest
/// magnitude, `iscale = -127/max`, `q = min(127, nearest_int(iscale·x))`
/// (ties to even), `d = 1/iscale`, and `bsums` per 16. An all-zero block gets
/// `d = 0` and zero quants and sums (ggml leaves its `bsums` untouched there).
///
/// # Panics
/// If `x.len() != QK_K * y.len()`.
pub fn quantize_row_ref(x: &[f32], y: &mut [BlockQ8_K]) {
    assert_eq!(x.len(), y.len() * QK_K, "q8_K quantize_row_ref lengths");
    for (x, b) in x.chunks_exact(QK_K).zip(y) {
        let mut max = 0.0f32;
        let mut amax = 0.0f32;
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *b = BlockQ8_K::ZERO;
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (s, q) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            *s = q.iter().map(|&v| v as i16).sum();
        }
        b.d = 1.0 / iscale;
    }
}

/// ggml `dequantize_row_q8_K`: `y = d·qs`.
///
/// # Panics
/// If `y.len() != QK_K * x.len()`.
pub fn dequantize_row(x: &[BlockQ8_K], y: &mut [f32]) {
    assert_eq!(y.len(), x.len() * QK_K, "q8_K dequantize_row lengths");
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_K)) {
        for (y, &q) in y.iter_mut().zip(&b.qs) {
            *y = b.d * q as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check_close, XorShift};

    #[test]
    fn quantize_uses_the_signed_max_and_fills_bsums() {
        let mut x = [0.0f32; QK_K];
        x[0] = 1.0;
        x[5] = -2.54; // largest magnitude: iscale = 50, d = 0.02
        x[17] = 0.01; // ≈ 0.5: whatever nearest_int says
        x[18] = 0.034; // 1.7 → 2
        x[255] = 2.54; // → 127 (the +127 side is reachable, nothing is clamped)
        let mut b = [BlockQ8_K::ZERO];
        quantize_row_ref(&x, &mut b);
        let b = &b[0];
        assert_eq!(b.d, 1.0 / (-127.0f32 / -2.54));
        assert_eq!(b.qs[0], 50);
        assert_eq!(b.qs[5], -127);
        assert_eq!(b.qs[17], nearest_int(0.01 * (-127.0f32 / -2.54)) as i8);
        assert_eq!(b.qs[18], 2);
        assert_eq!(b.qs[255], 127);
        assert_eq!(b.bsums[0], 50 - 127);
        assert_eq!(b.bsums[1], b.qs[17] as i16 + 2);
        assert_eq!(b.bsums[15], 127);
        for (j, s) in b.bsums.iter().enumerate() {
            let want: i16 = b.qs[16 * j..16 * j + 16].iter().map(|&q| q as i16).sum();
            assert_eq!(*s, want, "bsums[{j}]");
        }
        // All zero → d = 0 and everything zero, even over a dirty block.
        let mut dirty = [BlockQ8_K {
            d: 3.0,
            qs: [7; QK_K],
            bsums: [112; 16],
        }];
        quantize_row_ref(&[0.0; QK_K], &mut dirty);
        assert_eq!(dirty[0], BlockQ8_K::ZERO);
    }

    /// |x - y| <= d/2 plus float slack (the scale is kept in f32).
    #[test]
    fn round_trip_error_bound() {
        let mut rng = XorShift::new(60);
        let nb = 32;
        let x = rng.vec_uniform(QK_K * nb, -3.0, 3.0);
        let mut b = vec![BlockQ8_K::ZERO; nb];
        quantize_row_ref(&x, &mut b);
        let mut y = vec![0.0; x.len()];
        dequantize_row(&b, &mut y);
        check_close("q8_K round trip", &y, &x, |i| {
            let d = b[i / QK_K].d.abs();
            d * (0.5 + 1e-4)
        });
    }
}
