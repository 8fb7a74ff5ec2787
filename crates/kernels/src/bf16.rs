//! BF16 (ggml type 30): little-endian bfloat16, the top half of an f32.
//! Scalar reference (the AVX2 tier has its own `dequantize_row`, in `x86/avx2.rs`).
//!
//! Differs from ggml on purpose: ggml dots BF16 weights with activations
//! rounded to BF16 (`vec_dot_type = BF16`); [`vec_dot_bf16_f32`] keeps the
//! activations in f32.

use crate::f32::dot_lanes;

/// ggml `GGML_BF16_TO_FP32`: exact widening (`bits << 16`).
#[inline]
pub fn bf16_to_fp32(h: [u8; 2]) -> f32 {
    f32::from_bits((u16::from_le_bytes(h) as u32) << 16)
}

/// ggml `GGML_FP32_TO_BF16` (`ggml_compute_fp32_to_bf16`): round to nearest
/// even; NaNs are kept and made quiet; subnormals are rounded, not flushed.
#[inline]
pub fn fp32_to_bf16(x: f32) -> [u8; 2] {
    let u = x.to_bits();
    let bits = if (u & 0x7fff_ffff) > 0x7f80_0000 {
        ((u >> 16) | 64) as u16
    } else {
        (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
    };
    bits.to_le_bytes()
}

/// Decodes little-endian bf16 bytes (any alignment).
///
/// # Panics
/// If `row.len() != 2 * out.len()`.
pub fn dequantize_row(row: &[u8], out: &mut [f32]) {
    assert_eq!(row.len(), 2 * out.len(), "bf16 row bytes vs output length");
    for (y, b) in out.iter_mut().zip(row.chunks_exact(2)) {
        *y = bf16_to_fp32([b[0], b[1]]);
    }
}

/// Encodes `x` as little-endian bf16 bytes.
///
/// # Panics
/// If `out.len() != 2 * x.len()`.
pub fn quantize_row_ref(x: &[f32], out: &mut [u8]) {
    assert_eq!(out.len(), 2 * x.len(), "bf16 row bytes vs input length");
    for (b, &v) in out.chunks_exact_mut(2).zip(x) {
        b.copy_from_slice(&fp32_to_bf16(v));
    }
}

/// BF16 weights (little-endian bytes, any alignment) · f32 activations, in
/// the 8-lane order of [`crate::f32::vec_dot_f32`].
///
/// # Panics
/// If `w.len() != 2 * y.len()`.
pub fn vec_dot_bf16_f32(w: &[u8], y: &[f32]) -> f32 {
    assert_eq!(w.len(), 2 * y.len(), "vec_dot_bf16_f32 lengths");
    dot_lanes(w.chunks_exact(2), y, |b| bf16_to_fp32([b[0], b[1]]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::f32::vec_dot_f32;
    use crate::testing::{check_close, XorShift};

    #[test]
    fn known_bit_patterns() {
        let cases: [(u16, f32); 5] = [
            (0x0000, 0.0),
            (0x3f80, 1.0),
            (0xc000, -2.0),
            (0x3f00, 0.5),
            (0x7f80, f32::INFINITY),
        ];
        for (bits, v) in cases {
            assert_eq!(bf16_to_fp32(bits.to_le_bytes()), v, "{bits:#06x}");
            assert_eq!(fp32_to_bf16(v), bits.to_le_bytes(), "{v}");
        }
        // Ties to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 → 1.
        assert_eq!(fp32_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80u16.to_le_bytes());
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 → up.
        assert_eq!(
            fp32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)),
            0x3f82u16.to_le_bytes()
        );
        // A signalling NaN comes back quiet.
        assert_eq!(
            fp32_to_bf16(f32::from_bits(0x7f80_0001)),
            0x7fc0u16.to_le_bytes()
        );
        // Largest finite f32 rounds up to infinity.
        assert_eq!(fp32_to_bf16(f32::MAX), 0x7f80u16.to_le_bytes());
    }

    /// Round trip: relative error <= 2^-8 (half an ulp of an 8-bit significand).
    #[test]
    fn round_trip_error_is_half_an_ulp() {
        let mut rng = XorShift::new(5);
        let x = rng.vec_uniform(4096, -100.0, 100.0);
        let mut bytes = vec![0u8; 2 * x.len()];
        quantize_row_ref(&x, &mut bytes);
        let mut y = vec![0.0; x.len()];
        dequantize_row(&bytes, &mut y);
        check_close("bf16 round trip", &y, &x, |i| x[i].abs() * 2f32.powi(-8));
    }

    #[test]
    fn dot_equals_f32_dot_of_widened_weights() {
        let mut rng = XorShift::new(6);
        for n in [3, 64, 1001] {
            let w = rng.vec_uniform(n, -1.0, 1.0);
            let y = rng.vec_uniform(n, -1.0, 1.0);
            let mut bytes = vec![0u8; 2 * n];
            quantize_row_ref(&w, &mut bytes);
            let mut wd = vec![0.0; n];
            dequantize_row(&bytes, &mut wd);
            assert_eq!(
                vec_dot_bf16_f32(&bytes, &y).to_bits(),
                vec_dot_f32(&wd, &y).to_bits()
            );
        }
    }
}
