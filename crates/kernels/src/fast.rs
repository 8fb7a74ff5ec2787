//! The fast path's f32 order ("F1", `Precision::Fast`) for the weight formats
//! other than Q4_1 and Q8_0 (those take 16-bit activations, order F2 of
//! [`crate::act16`]): weights dequantized exactly and dotted with f32
//! activations using fused multiply-adds, in one fixed order that every tier and
//! every batch size reproduces bit for bit. These scalar functions are that
//! order's definition; the AVX2 and AVX-512 versions (`x86/avx2.rs`,
//! `x86/avx512/fast.rs`) are tested equal to them bit for bit
//! (`tier_parity.rs`), and the batched product (`matmul::matmul_fast`)
//! gives exactly what the single-token one does, so chunked prefill and
//! token-by-token decoding agree bitwise. Attention scores use the same order.
//!
//! The order:
//! 1. Weight values: the format's exact [`crate::dequantize_row`].
//! 2. One accumulator of 8 lanes: `acc[i % 8] = fma(w[i], x[i], acc[i % 8])` for `i`
//!    in increasing order (the `n % 8` tail continues the same rule).
//! 3. The lane reduction of [`crate::f32`] (`reduce_lanes`), which is the order of an
//!    AVX 256→128→64→32 horizontal sum.
//!
//! A single accumulator per (row, token) is what lets a register-tiled product keep
//! many (row, token) pairs in flight.
//!
//! `f32::mul_add` is a correctly rounded fused multiply-add on every target (a
//! library call where the CPU has none), so the scalar tier computes the same bits
//! as the FMA hardware does.

use crate::f32::reduce_lanes;

const LANES: usize = 8;

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
}
