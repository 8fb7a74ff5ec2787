//! F16 (ggml type 1): little-endian IEEE binary16. Scalar reference (the AVX2
//! tier has its own `dequantize_row`, in `x86/avx2.rs`).
//!
//! Also the f16 scale fields of every quantized block (`d`, `m`, `dmin`),
//! which are stored as `[u8; 2]` and read with [`fp16_to_fp32`].
//!
//! Differs from ggml on purpose: ggml dots F16 weights with activations
//! rounded to F16 (`vec_dot_type = F16`); [`vec_dot_f16_f32`] keeps the
//! activations in f32 (more accurate, no activation conversion pass).

use crate::f32::dot_lanes;

/// ggml `GGML_FP16_TO_FP32`: exact widening of a little-endian f16.
#[inline]
pub fn fp16_to_fp32(h: [u8; 2]) -> f32 {
    half::f16::from_le_bytes(h).to_f32()
}

/// ggml `GGML_FP32_TO_FP16`: round to nearest even (what F16C `vcvtps2ph`
/// with mode 0 and ggml's software fallback both do), little-endian.
#[inline]
pub fn fp32_to_fp16(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_le_bytes()
}

/// Decodes little-endian f16 bytes (any alignment).
///
/// # Panics
/// If `row.len() != 2 * out.len()`.
pub fn dequantize_row(row: &[u8], out: &mut [f32]) {
    assert_eq!(row.len(), 2 * out.len(), "f16 row bytes vs output length");
    for (y, b) in out.iter_mut().zip(row.chunks_exact(2)) {
        *y = fp16_to_fp32([b[0], b[1]]);
    }
}

/// Encodes `x` as little-endian f16 bytes.
///
/// # Panics
/// If `out.len() != 2 * x.len()`.
pub fn quantize_row_ref(x: &[f32], out: &mut [u8]) {
    assert_eq!(out.len(), 2 * x.len(), "f16 row bytes vs input length");
    for (b, &v) in out.chunks_exact_mut(2).zip(x) {
        b.copy_from_slice(&fp32_to_fp16(v));
    }
}

/// F16 weights (little-endian bytes, any alignment) · f32 activations: each
/// weight is widened exactly, then summed in the 8-lane order of
/// [`crate::f32::vec_dot_f32`].
///
/// # Panics
/// If `w.len() != 2 * y.len()`.
pub fn vec_dot_f16_f32(w: &[u8], y: &[f32]) -> f32 {
    assert_eq!(w.len(), 2 * y.len(), "vec_dot_f16_f32 lengths");
    dot_lanes(w.chunks_exact(2), y, |b| fp16_to_fp32([b[0], b[1]]))
}

/// F16 weights (little-endian bytes) · f32 activations as one running f32
/// sum in increasing `i` (`acc += w[i]·y[i]`, no FMA): the DeepSeek V4
/// reference engine's `dot_f16_row`.
///
/// # Panics
/// If `w.len() != 2 * y.len()`.
pub fn dot_f16_serial(w: &[u8], y: &[f32]) -> f32 {
    assert_eq!(w.len(), 2 * y.len(), "dot_f16_serial lengths");
    let mut acc = 0.0f32;
    for (b, &v) in w.chunks_exact(2).zip(y) {
        acc += fp16_to_fp32([b[0], b[1]]) * v;
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::f32::vec_dot_f32;
    use crate::testing::{check_close, XorShift};

    #[test]
    fn known_bit_patterns() {
        let cases: [(u16, f32); 8] = [
            (0x0000, 0.0),
            (0x3c00, 1.0),
            (0xc000, -2.0),
            (0x3555, 0.333_251_95),
            (0x7bff, 65504.0),
            (0x0001, 5.960_464_5e-8), // smallest subnormal, 2^-24
            (0x0400, 6.103_515_6e-5), // smallest normal, 2^-14
            (0x3800, 0.5),
        ];
        for (bits, v) in cases {
            assert_eq!(fp16_to_fp32(bits.to_le_bytes()), v, "{bits:#06x}");
            assert_eq!(fp32_to_fp16(v), bits.to_le_bytes(), "{v}");
        }
        // Ties round to even: 1 + 2^-11 is halfway between 1 and 1 + 2^-10.
        assert_eq!(fp32_to_fp16(1.0 + 2f32.powi(-11)), 0x3c00u16.to_le_bytes());
        assert_eq!(
            fp32_to_fp16(1.0 + 3.0 * 2f32.powi(-11)),
            0x3c02u16.to_le_bytes()
        );
        assert_eq!(fp32_to_fp16(1e6), 0x7c00u16.to_le_bytes()); // overflow → inf
    }

    /// Round trip: relative error <= 2^-11 in the normal range.
    #[test]
    fn round_trip_error_is_half_an_ulp() {
        let mut rng = XorShift::new(3);
        let x = rng.vec_uniform(4096, -100.0, 100.0);
        let mut bytes = vec![0u8; 2 * x.len()];
        quantize_row_ref(&x, &mut bytes);
        let mut y = vec![0.0; x.len()];
        dequantize_row(&bytes, &mut y);
        check_close("f16 round trip", &y, &x, |i| {
            x[i].abs() * 2f32.powi(-11) + 2f32.powi(-25)
        });
    }

    #[test]
    fn dot_equals_f32_dot_of_widened_weights() {
        let mut rng = XorShift::new(4);
        for n in [5, 64, 1003] {
            let w = rng.vec_uniform(n, -1.0, 1.0);
            let y = rng.vec_uniform(n, -1.0, 1.0);
            let mut bytes = vec![0u8; 2 * n];
            quantize_row_ref(&w, &mut bytes);
            let mut wd = vec![0.0; n];
            dequantize_row(&bytes, &mut wd);
            assert_eq!(
                vec_dot_f16_f32(&bytes, &y).to_bits(),
                vec_dot_f32(&wd, &y).to_bits()
            );
        }
    }
}
