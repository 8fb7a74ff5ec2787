//! F32 (ggml type 0): little-endian IEEE binary32. Scalar reference, no SIMD
//! (the AVX2 [`vec_dot_f32`] is in `x86/avx2.rs`).
//!
//! Also home of the f32 dot product every float path ends in. Its summation
//! order is part of the spec, so that a SIMD kernel doing the same
//! (8 lanes, separate multiply and add, same reduction) can be tested for
//! exact equality:
//!
//! 1. 8 independent accumulators `acc[l]`; element `i` is added to
//!    `acc[i % 8]` as `acc[l] = acc[l] + (x[i] * y[i])` (two roundings, no FMA),
//!    in increasing `i`. The tail (`n % 8` elements) continues the same rule.
//! 2. The lanes are reduced as `((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7))`,
//!    the order of an AVX 256→128→64→32 horizontal sum.
//!
//! ggml differs here: its generic `ggml_vec_dot_f32` accumulates in double and
//! its SIMD versions use a build-dependent number of accumulators.

/// Number of accumulators in the float dot products.
const LANES: usize = 8;

/// Decodes little-endian f32 bytes (any alignment).
///
/// # Panics
/// If `row.len() != 4 * out.len()`.
pub fn dequantize_row(row: &[u8], out: &mut [f32]) {
    assert_eq!(row.len(), 4 * out.len(), "f32 row bytes vs output length");
    for (y, b) in out.iter_mut().zip(row.chunks_exact(4)) {
        *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// Encodes `x` as little-endian f32 bytes.
///
/// # Panics
/// If `out.len() != 4 * x.len()`.
pub fn quantize_row_ref(x: &[f32], out: &mut [u8]) {
    assert_eq!(out.len(), 4 * x.len(), "f32 row bytes vs input length");
    for (b, v) in out.chunks_exact_mut(4).zip(x) {
        b.copy_from_slice(&v.to_le_bytes());
    }
}

/// `Σ x[i]·y[i]` in the module's documented 8-lane order, by the selected
/// kernel tier (see the crate docs); bit-identical to [`vec_dot_f32_ref`].
///
/// # Panics
/// If the lengths differ.
#[inline]
pub fn vec_dot_f32(x: &[f32], y: &[f32]) -> f32 {
    (crate::kernels().vec_dot_f32)(x, y)
}

/// `Σ x[i]·y[i]` in the fastest order the selected tier offers, with fused
/// multiply-adds where the CPU has them. Deterministic for a given tier, but
/// the tiers differ in the last bits: scalar is [`vec_dot_f32_ref`]; AVX2
/// (and AVX-512, which runs the same kernel) is described in `x86/avx2.rs`
/// (`dot_f32_fused`).
///
/// # Panics
/// If the lengths differ.
#[inline]
pub fn vec_dot_f32_fused(x: &[f32], y: &[f32]) -> f32 {
    (crate::kernels().vec_dot_f32_fused)(x, y)
}

/// [`vec_dot_f32`], scalar reference.
///
/// # Panics
/// If the lengths differ.
pub fn vec_dot_f32_ref(x: &[f32], y: &[f32]) -> f32 {
    assert_eq!(x.len(), y.len(), "vec_dot_f32 lengths");
    let mut acc = [0.0f32; LANES];
    let xc = x.chunks_exact(LANES);
    let yc = y.chunks_exact(LANES);
    let (xt, yt) = (xc.remainder(), yc.remainder());
    for (xs, ys) in xc.zip(yc) {
        for ((a, &xv), &yv) in acc.iter_mut().zip(xs).zip(ys) {
            *a += xv * yv;
        }
    }
    for ((a, &xv), &yv) in acc.iter_mut().zip(xt).zip(yt) {
        *a += xv * yv;
    }
    reduce_lanes(&acc)
}

/// F32 weights stored as little-endian bytes (any alignment) · f32
/// activations, in the same order as [`vec_dot_f32`].
///
/// # Panics
/// If `w.len() != 4 * y.len()`.
pub fn vec_dot_f32_le(w: &[u8], y: &[f32]) -> f32 {
    assert_eq!(w.len(), 4 * y.len(), "vec_dot_f32_le lengths");
    dot_lanes(w.chunks_exact(4), y, |b| {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    })
}

/// The shared 8-lane loop for weights that need decoding (f32 bytes, f16, bf16):
/// `w` yields one encoded weight per item, `decode` turns it into f32.
pub(crate) fn dot_lanes<'a>(
    w: impl Iterator<Item = &'a [u8]>,
    y: &[f32],
    decode: impl Fn(&[u8]) -> f32,
) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (i, (wb, &yv)) in w.zip(y).enumerate() {
        acc[i % LANES] += decode(wb) * yv;
    }
    reduce_lanes(&acc)
}

/// The fixed lane reduction, see the module docs.
pub(crate) fn reduce_lanes(acc: &[f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// `Σ x[i]·y[i]` as one running f32 sum in increasing `i` (two roundings per
/// element, no FMA): the order of the DeepSeek V4 reference engine's
/// `dot_f32` (attention scores, indexer scores).
///
/// # Panics
/// If the lengths differ.
pub fn dot_serial(x: &[f32], y: &[f32]) -> f32 {
    assert_eq!(x.len(), y.len(), "dot_serial lengths");
    let mut acc = 0.0f32;
    for (&a, &b) in x.iter().zip(y) {
        acc += a * b;
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{dot_f64, XorShift};

    #[test]
    fn bytes_round_trip_exactly() {
        let x = [
            0.0,
            -0.0,
            1.5,
            -3.25e-20,
            f32::MAX,
            f32::MIN_POSITIVE / 4.0,
            f32::INFINITY,
        ];
        let mut bytes = [0u8; 28];
        quantize_row_ref(&x, &mut bytes);
        assert_eq!(&bytes[8..12], &1.5f32.to_le_bytes());
        let mut y = [0.0; 7];
        dequantize_row(&bytes, &mut y);
        for (a, b) in x.iter().zip(&y) {
            assert_eq!(a.to_bits(), b.to_bits());
        }
    }

    /// The documented order, spelled out one element at a time.
    fn dot_spec(x: &[f32], y: &[f32]) -> f32 {
        let mut acc = [0.0f32; 8];
        for i in 0..x.len() {
            let p = x[i] * y[i];
            acc[i % 8] += p;
        }
        let lo = (acc[0] + acc[4]) + (acc[2] + acc[6]);
        let hi = (acc[1] + acc[5]) + (acc[3] + acc[7]);
        lo + hi
    }

    #[test]
    fn dot_follows_the_documented_order_bit_for_bit() {
        let mut rng = XorShift::new(1);
        for n in [0, 1, 7, 8, 9, 13, 64, 100, 4099] {
            let x = rng.vec_uniform(n, -1.0, 1.0);
            let y = rng.vec_uniform(n, -1e3, 1e3);
            let want = dot_spec(&x, &y);
            assert_eq!(vec_dot_f32(&x, &y).to_bits(), want.to_bits(), "n={n}");
            let mut w = vec![0u8; 4 * n];
            quantize_row_ref(&x, &mut w);
            assert_eq!(
                vec_dot_f32_le(&w, &y).to_bits(),
                want.to_bits(),
                "n={n} (bytes)"
            );
        }
    }

    #[test]
    fn dot_is_close_to_f64() {
        let mut rng = XorShift::new(2);
        let n = 4096;
        let x = rng.vec_uniform(n, -1.0, 1.0);
        let y = rng.vec_uniform(n, -1.0, 1.0);
        let scale: f64 = x.iter().zip(&y).map(|(a, b)| (a * b).abs() as f64).sum();
        let err = (vec_dot_f32(&x, &y) as f64 - dot_f64(&x, &y)).abs();
        // 8 lanes of ~512 sequential adds: error well under n/8 · 2^-24 relative.
        assert!(err <= 1e-5 * scale, "err {err}, scale {scale}");
    }

    #[test]
    fn tail_elements_use_the_low_lanes() {
        // Element 8 (the tail of n = 9) shares lane 0 with element 0:
        // lane0 = 1e8 + 1 rounds to 1e8, lane4 = -1e8, so the sum is 0.
        // A sequential sum would give 1.
        let mut x = [0.0f32; 9];
        x[0] = 1e8;
        x[4] = -1e8;
        x[8] = 1.0;
        let y = [1.0f32; 9];
        assert_eq!(vec_dot_f32(&x, &y), 0.0);
        let mut w = [0u8; 36];
        quantize_row_ref(&x, &mut w);
        assert_eq!(vec_dot_f32_le(&w, &y), 0.0);
    }
}
