//! The fast f32 path (`Precision::Fast`): weights decoded to f32 and dotted with
//! f32 activations using fused multiply-adds, in one fixed order that every tier
//! and every batch size reproduces bit for bit. These scalar functions are that
//! order's definition; the AVX2 versions (`x86/avx2.rs`) are tested equal to them
//! bit for bit (`tier_parity.rs`), and the batched product (`matmul::matmul_fast`)
//! gives exactly what the single-token one does, so chunked prefill and
//! token-by-token decoding agree bitwise.
//!
//! The order ("F1"):
//! 1. Weight values: Q4_1 `w = fma(q, d, m)` (one rounding, where
//!    [`crate::q4_1::dequantize_row`] rounds twice); Q8_0 `w = q·d` (exact: an 8-bit
//!    integer times an f16 fits in f32's mantissa); every other format its exact
//!    [`crate::dequantize_row`].
//! 2. One accumulator of 8 lanes: `acc[i % 8] = fma(w[i], x[i], acc[i % 8])` for `i`
//!    in increasing order (the `n % 8` tail continues the same rule).
//! 3. The lane reduction of [`crate::f32`] (`reduce_lanes`), which is the order of an
//!    AVX 256→128→64→32 horizontal sum.
//!
//! A single accumulator per (row, token) is what lets a register-tiled product keep
//! many (row, token) pairs in flight; the single-token kernels get their
//! instruction-level parallelism from several rows at once instead.
//!
//! `f32::mul_add` is a correctly rounded fused multiply-add on every target (a
//! library call where the CPU has none), so the scalar tier computes the same bits
//! as the FMA hardware does.

use crate::f16::fp16_to_fp32;
use crate::f32::reduce_lanes;
use crate::q4_1::{BlockQ4_1, QK4_1};
use crate::q8_0::{BlockQ8_0, QK8_0};

const LANES: usize = 8;

/// Q4_1 weights for the fast path: `w = fma(q, d, m)`.
///
/// # Panics
/// If `y.len() != QK4_1 * x.len()`.
pub fn dequantize_row_q4_1_fma_ref(x: &[BlockQ4_1], y: &mut [f32]) {
    assert_eq!(y.len(), x.len() * QK4_1, "q4_1 dequantize lengths");
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK4_1)) {
        let d = fp16_to_fp32(b.d);
        let m = fp16_to_fp32(b.m);
        let (lo, hi) = y.split_at_mut(QK4_1 / 2);
        for ((&q, y0), y1) in b.qs.iter().zip(lo).zip(hi) {
            *y0 = ((q & 0x0F) as f32).mul_add(d, m);
            *y1 = ((q >> 4) as f32).mul_add(d, m);
        }
    }
}

/// [`dequantize_row_q4_1_fma_ref`] by the selected tier.
pub fn dequantize_row_q4_1_fma(x: &[BlockQ4_1], y: &mut [f32]) {
    (crate::kernels().dequantize_row_q4_1_fma)(x, y)
}

/// Order F1 (see the module docs), scalar reference.
///
/// # Panics
/// If the lengths differ.
pub fn dot_fma1_ref(w: &[f32], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_fma1 lengths");
    let mut acc = [0.0f32; LANES];
    for (i, (&a, &b)) in w.iter().zip(x).enumerate() {
        acc[i % LANES] = a.mul_add(b, acc[i % LANES]);
    }
    reduce_lanes(&acc)
}

/// Order F1 by the selected tier; bit-identical to [`dot_fma1_ref`].
#[inline]
pub fn dot_fma1(w: &[f32], x: &[f32]) -> f32 {
    (crate::kernels().dot_fma1)(w, x)
}

/// `out[r] = Σ w_r[i]·x[i]` over the `out.len()` Q4_1 rows held back to back in `w`,
/// in order F1 with `w = fma(q, d, m)`: the weights are never stored.
///
/// # Panics
/// If `w` does not hold `out.len()` rows of `x.len()` elements.
pub fn matvec_q4_1_ref(w: &[BlockQ4_1], x: &[f32], out: &mut [f32]) {
    let nb = check_matvec(w.len(), QK4_1, x.len(), out.len());
    for (r, o) in out.iter_mut().enumerate() {
        let mut acc = [0.0f32; LANES];
        for (b, xb) in w[r * nb..(r + 1) * nb].iter().zip(x.chunks_exact(QK4_1)) {
            let (d, m) = (fp16_to_fp32(b.d), fp16_to_fp32(b.m));
            for (j, &xv) in xb.iter().enumerate() {
                let q = if j < QK4_1 / 2 {
                    b.qs[j] & 0x0F
                } else {
                    b.qs[j - QK4_1 / 2] >> 4
                };
                let wv = (q as f32).mul_add(d, m);
                acc[j % LANES] = wv.mul_add(xv, acc[j % LANES]);
            }
        }
        *o = reduce_lanes(&acc);
    }
}

/// Like [`matvec_q4_1_ref`] for Q8_0 rows (`w = q·d`).
///
/// # Panics
/// If `w` does not hold `out.len()` rows of `x.len()` elements.
pub fn matvec_q8_0_ref(w: &[BlockQ8_0], x: &[f32], out: &mut [f32]) {
    let nb = check_matvec(w.len(), QK8_0, x.len(), out.len());
    for (r, o) in out.iter_mut().enumerate() {
        let mut acc = [0.0f32; LANES];
        for (b, xb) in w[r * nb..(r + 1) * nb].iter().zip(x.chunks_exact(QK8_0)) {
            let d = fp16_to_fp32(b.d);
            for (j, (&q, &xv)) in b.qs.iter().zip(xb).enumerate() {
                acc[j % LANES] = (q as f32 * d).mul_add(xv, acc[j % LANES]);
            }
        }
        *o = reduce_lanes(&acc);
    }
}

/// Checks the shapes of a fused matvec; returns the blocks per row.
pub(crate) fn check_matvec(n_blocks: usize, block: usize, n_in: usize, n_out: usize) -> usize {
    assert!(
        n_in.is_multiple_of(block),
        "row length {n_in} is not a multiple of {block}"
    );
    let nb = n_in / block;
    assert_eq!(n_blocks, nb * n_out, "matvec: weight blocks vs rows");
    nb
}

/// The most rows and tokens one [`gemm_tile`] call takes.
pub const TILE_ROWS: usize = 4;
pub const TILE_TOKENS: usize = 3;

/// A register tile of the batched product: `out[t * rows + r] = dot_fma1(w_r, x_t)`
/// for the `rows` rows of `k` f32 weights in `w` and the `toks` activation rows of
/// `k` in `x`, `rows <= TILE_ROWS`, `toks <= TILE_TOKENS`. Scalar reference.
///
/// # Panics
/// On a shape mismatch.
pub fn gemm_tile_ref(w: &[f32], x: &[f32], k: usize, out: &mut [f32]) {
    let (rows, toks) = check_tile(w.len(), x.len(), k, out.len());
    for t in 0..toks {
        for r in 0..rows {
            out[t * rows + r] = dot_fma1_ref(&w[r * k..(r + 1) * k], &x[t * k..(t + 1) * k]);
        }
    }
}

/// [`gemm_tile_ref`] by the selected tier, bit for bit.
#[inline]
pub fn gemm_tile(w: &[f32], x: &[f32], k: usize, out: &mut [f32]) {
    (crate::kernels().gemm_tile)(w, x, k, out)
}

/// Checks a tile's shapes; returns (rows, tokens).
pub(crate) fn check_tile(w: usize, x: usize, k: usize, out: usize) -> (usize, usize) {
    assert!(k > 0, "gemm tile: k = 0");
    let (rows, toks) = (w / k, x / k);
    assert!(
        w == rows * k && x == toks * k && (1..=TILE_ROWS).contains(&rows),
        "gemm tile: {w} weights, {x} activations, k = {k}"
    );
    assert!(
        (1..=TILE_TOKENS).contains(&toks) && out == rows * toks,
        "gemm tile: {toks} tokens, output {out}"
    );
    (rows, toks)
}

/// [`matvec_q4_1_ref`] by the selected tier.
#[inline]
pub fn matvec_q4_1(w: &[BlockQ4_1], x: &[f32], out: &mut [f32]) {
    (crate::kernels().matvec_q4_1)(w, x, out)
}

/// [`matvec_q8_0_ref`] by the selected tier.
#[inline]
pub fn matvec_q8_0(w: &[BlockQ8_0], x: &[f32], out: &mut [f32]) {
    (crate::kernels().matvec_q8_0)(w, x, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{dot_f64, XorShift};

    #[test]
    fn dot_fma1_follows_its_order_and_is_accurate() {
        let mut rng = XorShift::new(5);
        for n in [0, 1, 7, 8, 9, 64, 100, 577] {
            let w = rng.vec_uniform(n, -1.0, 1.0);
            let x = rng.vec_uniform(n, -2.0, 2.0);
            let mut acc = [0.0f32; 8];
            for i in 0..n {
                acc[i % 8] = w[i].mul_add(x[i], acc[i % 8]);
            }
            let lo = (acc[0] + acc[4]) + (acc[2] + acc[6]);
            let hi = (acc[1] + acc[5]) + (acc[3] + acc[7]);
            assert_eq!(dot_fma1_ref(&w, &x).to_bits(), (lo + hi).to_bits(), "n={n}");
            let scale: f64 = w.iter().zip(&x).map(|(a, b)| (a * b).abs() as f64).sum();
            let err = (dot_fma1_ref(&w, &x) as f64 - dot_f64(&w, &x)).abs();
            assert!(err <= 1e-5 * scale + 1e-30, "n={n}: err {err}");
        }
    }

    #[test]
    fn q4_1_fma_dequant_is_within_one_rounding_of_the_reference() {
        let mut rng = XorShift::new(6);
        let x = rng.vec_weights(QK4_1 * 64, 0.05);
        let mut b = vec![
            BlockQ4_1 {
                d: [0; 2],
                m: [0; 2],
                qs: [0; 16]
            };
            64
        ];
        crate::q4_1::quantize_row_ref(&x, &mut b);
        let (mut a, mut r) = (vec![0.0; x.len()], vec![0.0; x.len()]);
        dequantize_row_q4_1_fma_ref(&b, &mut a);
        crate::q4_1::dequantize_row(&b, &mut r);
        for (a, r) in a.iter().zip(&r) {
            assert!(
                (a - r).abs() <= 2.0 * f32::EPSILON * r.abs().max(1e-6),
                "{a} vs {r}"
            );
        }
    }
}
