//! Matrix products whose every output is one serial sum in a reference
//! engine's order, split over the thread pool by weight rows (each thread
//! walks its rows once for every token): the DeepSeek V4 family's products.
//! Each value is bitwise its scalar dot ([`q8_0::vec_dot_q8_0_f32_scales`],
//! [`f16::dot_f16_serial`], the K-quant dots), whatever the thread count and
//! however many tokens a call carries.
//!
//! - [`matmul_q8_0_f32s`]: Q8_0 weights against activations rounded to Q8_0
//!   blocks with f32 scales ([`Q8Acts`]), optionally in groups (the grouped
//!   low-rank output: row group `g` reads columns `g·n_in..` of each token).
//! - [`matmul_f16_serial`]: F16 weights against f32 activations.
//! - [`matmul_experts`]: per (token, slot) pair the rows of the expert the
//!   pair selected, against Q8_K activations (routed experts).

use crate::f16;
use crate::matmul::OutPtr;
use crate::pool::ThreadPool;
use crate::q8_0::{self, BlockQ8_0, QK8_0};
use crate::q8_k::BlockQ8_K;

/// Rows of activations rounded to Q8_0 blocks with f32 scales
/// ([`q8_0::quantize_row_f32_scales`]), back to back.
#[derive(Clone, Debug, Default)]
pub struct Q8Acts {
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
}

impl Q8Acts {
    /// Rounds `x` (a whole number of 32-blocks; the rows back to back),
    /// reusing the buffers.
    ///
    /// # Panics
    /// If `x.len()` is not a multiple of 32.
    pub fn quantize(&mut self, x: &[f32]) {
        assert!(x.len().is_multiple_of(QK8_0), "Q8Acts: {} values", x.len());
        self.qs.resize(x.len(), 0);
        self.d.resize(x.len() / QK8_0, 0.0);
        q8_0::quantize_row_f32_scales(x, &mut self.qs, &mut self.d);
    }
}

/// Weight rows per unit of work: enough units for the pool to balance,
/// never more than 64 rows.
fn rows_per_unit(pool: &ThreadPool, n_rows: usize) -> usize {
    n_rows.div_ceil(8 * pool.n_threads()).clamp(1, 64)
}

/// Calls `f(rows, out)` for blocks of consecutive weight rows over the pool;
/// `f` writes `out[t * n_out + r]` for its rows `r` and every token `t`.
fn over_rows(
    pool: &ThreadPool,
    n_out: usize,
    out: &mut [f32],
    f: &(dyn Fn(std::ops::Range<usize>, OutPtr) + Sync),
) {
    let per = rows_per_unit(pool, n_out);
    let ptr = OutPtr(out.as_mut_ptr());
    pool.run_dynamic(n_out.div_ceil(per), &|u| {
        let rows = u * per..((u + 1) * per).min(n_out);
        f(rows, ptr);
    });
}

/// `out[t·n_out + r] = vec_dot_q8_0_f32_scales(w row r, token t's columns
/// g·n_in..(g+1)·n_in)` where `g = r / (n_out / groups)`: rows of `n_in`
/// (`w.len() · 32 / n_in` of them), each token's activation row
/// `groups · n_in` long.
///
/// # Panics
/// If the sizes disagree.
pub fn matmul_q8_0_f32s(
    pool: &ThreadPool,
    w: &[BlockQ8_0],
    n_in: usize,
    groups: usize,
    acts: &Q8Acts,
    out: &mut [f32],
) {
    let nb = n_in / QK8_0;
    assert!(n_in.is_multiple_of(QK8_0) && nb > 0 && w.len().is_multiple_of(nb));
    let n_out = w.len() / nb;
    let row_len = groups * n_in;
    let n_tok = acts.qs.len() / row_len;
    assert!(
        groups > 0
            && n_out.is_multiple_of(groups)
            && acts.qs.len() == n_tok * row_len
            && out.len() == n_tok * n_out,
        "matmul_q8_0_f32s sizes"
    );
    let per_group = n_out / groups;
    over_rows(pool, n_out, out, &|rows, ptr| {
        for r in rows {
            let wr = &w[r * nb..(r + 1) * nb];
            let col = (r / per_group) * n_in;
            for t in 0..n_tok {
                let a = t * row_len + col;
                let v = q8_0::vec_dot_q8_0_f32_scales(
                    wr,
                    &acts.qs[a..a + n_in],
                    &acts.d[a / QK8_0..(a + n_in) / QK8_0],
                );
                // SAFETY: row r of each token is written by this unit only, and
                // t * n_out + r < out.len() (checked above).
                unsafe { ptr.write(t * n_out + r, v) };
            }
        }
    });
}

/// `out[t·n_out + r] = dot_f16_serial(w row r, x row t)`: F16 rows of `n_in`
/// (little-endian bytes), f32 activation rows of `n_in`.
///
/// # Panics
/// If the sizes disagree.
pub fn matmul_f16_serial(pool: &ThreadPool, w: &[u8], n_in: usize, x: &[f32], out: &mut [f32]) {
    let row_bytes = 2 * n_in;
    assert!(n_in > 0 && w.len().is_multiple_of(row_bytes) && x.len().is_multiple_of(n_in));
    let n_out = w.len() / row_bytes;
    let n_tok = x.len() / n_in;
    assert_eq!(out.len(), n_tok * n_out, "matmul_f16_serial output");
    over_rows(pool, n_out, out, &|rows, ptr| {
        for r in rows {
            let wr = &w[r * row_bytes..(r + 1) * row_bytes];
            for (t, xt) in x.chunks_exact(n_in).enumerate() {
                let v = f16::dot_f16_serial(wr, xt);
                // SAFETY: as in `matmul_q8_0_f32s`.
                unsafe { ptr.write(t * n_out + r, v) };
            }
        }
    });
}

/// For every pair `p` (a token's slot): `out[p·rows + r] = dot(expert
/// sel[p]'s row r, acts of pair p / acts_per)`, the experts' rows of
/// `blocks` blocks back to back in `exps` (`rows` rows per expert), each
/// activation row `blocks` Q8_K blocks. `acts_per` is how many consecutive
/// pairs share one activation row (a token's slots share its input).
///
/// # Panics
/// If the sizes disagree or a selected expert is out of range.
#[allow(clippy::too_many_arguments)]
pub fn matmul_experts<B: Sync>(
    pool: &ThreadPool,
    exps: &[B],
    rows: usize,
    blocks: usize,
    sel: &[u32],
    acts: &[BlockQ8_K],
    acts_per: usize,
    dot: fn(&[B], &[BlockQ8_K]) -> f32,
    out: &mut [f32],
) {
    let n_pairs = sel.len();
    let per_expert = rows * blocks;
    assert!(
        blocks > 0
            && exps.len().is_multiple_of(per_expert)
            && acts.len() == n_pairs.div_ceil(acts_per) * blocks
            && out.len() == n_pairs * rows
            && sel.iter().all(|&e| (e as usize) < exps.len() / per_expert),
        "matmul_experts sizes"
    );
    let per = rows_per_unit(pool, rows * n_pairs).min(rows);
    let units_per_pair = rows.div_ceil(per);
    let ptr = OutPtr(out.as_mut_ptr());
    pool.run_dynamic(n_pairs * units_per_pair, &|u| {
        let (p, b) = (u / units_per_pair, u % units_per_pair);
        let e = sel[p] as usize;
        let a = &acts[(p / acts_per) * blocks..(p / acts_per + 1) * blocks];
        for r in b * per..((b + 1) * per).min(rows) {
            let w = &exps[e * per_expert + r * blocks..e * per_expert + (r + 1) * blocks];
            // SAFETY: (pair, row) is written by this unit only, within `out`.
            unsafe { ptr.write(p * rows + r, dot(w, a)) };
        }
    });
}
