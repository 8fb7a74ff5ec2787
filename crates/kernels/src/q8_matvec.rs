//! Matrix-vector products against 8-bit activations (`Precision::Q8`, llama.cpp's
//! CPU numerics): `out[r] = vec_dot(w_r, y)` for rows held back to back, each row
//! exactly the scalar dot product of its format ([`crate::q4_1::vec_dot_q4_1_q8_0`],
//! [`crate::q8_0::vec_dot_q8_0_q8_0`]). These loops are the references; the fast
//! tiers (`x86/avx2.rs`; `x86/avx512/q8.rs` for packed Q4_1 rows) run several
//! rows at once, sharing each activation block and its per-block terms between
//! them, and are tested equal bit for bit (`tier_parity.rs`).

use crate::act16::F2Rows;
use crate::q4_1::{vec_dot_q4_1_q8_0, BlockQ4_1};
use crate::q8_0::{vec_dot_q8_0_q8_0, BlockQ8_0};

/// Checks the shapes of a product against activation blocks `y`; returns the
/// blocks per row.
///
/// # Panics
/// If `w` does not hold `n_out` rows of `y.len()` blocks.
pub(crate) fn check_rows(w_blocks: usize, y_blocks: usize, n_out: usize) -> usize {
    assert_eq!(
        w_blocks,
        y_blocks * n_out,
        "q8 matvec: {w_blocks} weight blocks for {n_out} rows of {y_blocks}"
    );
    y_blocks
}

/// `out[r] = vec_dot_q4_1_q8_0(w_r, y)`, scalar reference.
///
/// # Panics
/// If `w` does not hold `out.len()` rows of `y.len()` blocks.
pub fn matvec_q4_1_q8_0_ref(w: &[BlockQ4_1], y: &[BlockQ8_0], out: &mut [f32]) {
    let nb = check_rows(w.len(), y.len(), out.len());
    if nb == 0 {
        out.fill(0.0);
        return;
    }
    for (row, o) in w.chunks_exact(nb).zip(out.iter_mut()) {
        *o = vec_dot_q4_1_q8_0(row, y);
    }
}

/// `out[r] = vec_dot_q8_0_q8_0(w_r, y)`, scalar reference.
///
/// # Panics
/// If `w` does not hold `out.len()` rows of `y.len()` blocks.
pub fn matvec_q8_0_q8_0_ref(w: &[BlockQ8_0], y: &[BlockQ8_0], out: &mut [f32]) {
    let nb = check_rows(w.len(), y.len(), out.len());
    if nb == 0 {
        out.fill(0.0);
        return;
    }
    for (row, o) in w.chunks_exact(nb).zip(out.iter_mut()) {
        *o = vec_dot_q8_0_q8_0(row, y);
    }
}

/// [`matvec_q4_1_q8_0_ref`] by the selected tier, bit for bit.
#[inline]
pub fn matvec_q4_1_q8_0(w: &[BlockQ4_1], y: &[BlockQ8_0], out: &mut [f32]) {
    (crate::kernels().matvec_q4_1_q8_0)(w, y, out)
}

/// [`matvec_q8_0_q8_0_ref`] by the selected tier, bit for bit.
#[inline]
pub fn matvec_q8_0_q8_0(w: &[BlockQ8_0], y: &[BlockQ8_0], out: &mut [f32]) {
    (crate::kernels().matvec_q8_0_q8_0)(w, y, out)
}

/// Checks the shapes of a product of `w` (rows of `nb` blocks) with `y` (tokens of
/// `nb` blocks) into `out` (`tokens × rows`).
///
/// # Panics
/// If the lengths do not fit those shapes.
pub(crate) fn check_gemm(w_blocks: usize, y_blocks: usize, nb: usize, out_len: usize) {
    let ok = match (w_blocks.checked_div(nb), y_blocks.checked_div(nb)) {
        (Some(rows), Some(toks)) => {
            rows * nb == w_blocks && toks * nb == y_blocks && rows * toks == out_len
        }
        _ => w_blocks == 0 && y_blocks == 0 && out_len == 0,
    };
    assert!(
        ok,
        "q8 gemm: {w_blocks} weight and {y_blocks} activation blocks of rows of {nb} \
         for {out_len} outputs"
    );
}

/// `out[t·rows + r] = vec_dot_q4_1_q8_0(w_r, y_t)` for the rows of `w` and the
/// tokens of `y` (each `nb` blocks), scalar reference.
///
/// # Panics
/// If the shapes do not fit (see [`check_gemm`]).
pub fn gemm_q4_1_q8_0_ref(w: &[BlockQ4_1], y: &[BlockQ8_0], nb: usize, out: &mut [f32]) {
    check_gemm(w.len(), y.len(), nb, out.len());
    let n_rows = w.len().checked_div(nb).unwrap_or(0);
    if n_rows == 0 {
        return;
    }
    for (yt, ot) in y.chunks_exact(nb).zip(out.chunks_exact_mut(n_rows)) {
        matvec_q4_1_q8_0_ref(w, yt, ot);
    }
}

/// [`gemm_q4_1_q8_0_ref`] by the selected tier, bit for bit.
#[inline]
pub fn gemm_q4_1_q8_0(w: &[BlockQ4_1], y: &[BlockQ8_0], nb: usize, out: &mut [f32]) {
    (crate::kernels().gemm_q4_1_q8_0)(w, y, nb, out)
}

/// Checks a product of packed rows `w` with `y` (tokens of `w`'s blocks per row)
/// into `out` (`tokens × rows`); returns the blocks per row.
///
/// # Panics
/// If the lengths do not fit those shapes.
pub(crate) fn check_gemm_f2(w: &F2Rows<'_, BlockQ4_1>, y: &[BlockQ8_0], out_len: usize) -> usize {
    check_gemm(w.nb * w.n_rows, y.len(), w.nb, out_len);
    w.nb
}

/// [`gemm_q4_1_q8_0_ref`] on rows packed as [`crate::act16::F2Matrix`] (the same
/// blocks, read back out of the layout): the scalar tier's entry.
///
/// # Panics
/// As [`gemm_q4_1_q8_0_ref`].
pub fn gemm_q4_1_q8_0_f2_ref(w: F2Rows<'_, BlockQ4_1>, y: &[BlockQ8_0], out: &mut [f32]) {
    let nb = check_gemm_f2(&w, y, out.len());
    let blocks: Vec<BlockQ4_1> = (0..w.n_rows)
        .flat_map(|r| (0..nb).map(move |b| w.block(r, b)))
        .collect();
    gemm_q4_1_q8_0_ref(&blocks, y, nb, out)
}

/// [`gemm_q4_1_q8_0_f2_ref`] by the selected tier, bit for bit: what the Q8 path
/// runs a Q4_1 matrix with its packed layout through, any number of tokens.
#[inline]
pub fn gemm_q4_1_q8_0_f2(w: F2Rows<'_, BlockQ4_1>, y: &[BlockQ8_0], out: &mut [f32]) {
    (crate::kernels().gemm_q4_1_q8_0_f2)(w, y, out)
}
