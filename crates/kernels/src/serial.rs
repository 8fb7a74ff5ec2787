//! Matrix products whose every output is one serial sum in a reference
//! engine's order: the DeepSeek V4 family's products. Each value is bitwise
//! its scalar dot ([`q8_0::vec_dot_q8_0_f32_scales`], [`f16::dot_f16_serial`],
//! [`crate::f32::dot_serial`], the K-quant dots) whatever the thread count,
//! the kernel tier and the number of tokens a call carries.
//!
//! A serial sum cannot be split across SIMD lanes, but eight of them can run
//! side by side, one per lane: the kernels take weights regrouped by sixteen
//! or eight rows ([`Q8_0x16`], [`F16x8`], both built once at load), or eight query
//! heads transposed (`dots8_serial`), and keep every lane's multiplies and
//! adds exactly the scalar's.
//!
//! - [`matmul_q8_0_f32s`]: Q8_0 weights against activations rounded to Q8_0
//!   blocks with f32 scales ([`Q8Acts`]), optionally in column groups (the
//!   grouped low-rank output: row group `g` reads columns `g·n_in..`).
//! - [`matmul_f16_serial`]: F16 weights against f32 activations.
//! - [`matmul_experts`]: per (token, slot) pair the rows of the expert the
//!   pair selected, against Q8_K activations (routed experts);
//!   [`matmul_experts_iq2_xxs`] groups the pairs by expert and decodes each
//!   IQ2_XXS row once for all the pairs that chose it.
//! - [`dots8_serial`]: eight transposed vectors against up to four rows
//!   (indexer scores); [`dots16_serial`] and [`wsum16_serial`]: sixteen
//!   query heads' scores against up to eight rows, and their weighted sums
//!   of the rows (attention).
//!
//! Products run over the thread pool by blocks of weight rows; each thread
//! walks its rows once for every token.

use crate::iq2_xxs::{BlockIQ2_XXS, Iq2Decoded};
use crate::matmul::OutPtr;
use crate::pool::ThreadPool;
use crate::q8_0::{self, BlockQ8_0, QK8_0};
use crate::q8_k::BlockQ8_K;
use crate::{f16, kernels};

/// Rows per group of the regrouped layouts (one per SIMD lane).
pub const LANES: usize = 8;
/// Rows per group of the Q8_0 layout ([`Q8_0x16`]): one per 32-bit lane of
/// a 512-bit register.
pub const Q8_ROWS: usize = 16;
/// Bytes of one block of a [`Q8_0x16`] group: sixteen f16 scales, sixteen
/// blocks of quants.
pub const Q8_0X16_BLOCK: usize = Q8_ROWS * 2 + Q8_ROWS * QK8_0;

/// Rows of activations rounded to Q8_0 blocks with f32 scales
/// ([`q8_0::quantize_row_f32_scales`]), back to back, with each block's sum of
/// quants (the offset correction of the integer kernels, see [`Q8_0x16`]).
#[derive(Clone, Debug, Default)]
pub struct Q8Acts {
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    pub sums: Vec<i32>,
}

impl Q8Acts {
    /// Rounds `x` (a whole number of 32-blocks; the rows back to back),
    /// reusing the buffers; the blocks are shared out over the pool (each
    /// block's values depend on that block alone).
    ///
    /// # Panics
    /// If `x.len()` is not a multiple of 32.
    pub fn quantize(&mut self, pool: &ThreadPool, x: &[f32]) {
        assert!(x.len().is_multiple_of(QK8_0), "Q8Acts: {} values", x.len());
        let nb = x.len() / QK8_0;
        self.qs.resize(x.len(), 0);
        self.d.resize(nb, 0.0);
        self.sums.resize(nb, 0);
        let block = |b: usize| &x[b * QK8_0..(b + 1) * QK8_0];
        pool.for_each_row_block_mut(&mut self.d, 1, &|first, d| {
            for (i, d) in d.iter_mut().enumerate() {
                *d = q8_0::f32_scale(block(first + i));
            }
        });
        let d = &self.d;
        pool.for_each_row_block_mut(&mut self.qs, QK8_0, &|first, qs| {
            for (i, q) in qs.chunks_exact_mut(QK8_0).enumerate() {
                q8_0::quantize_block_f32_scale(block(first + i), d[first + i], q);
            }
        });
        let qs = &self.qs;
        pool.for_each_row_block_mut(&mut self.sums, 1, &|first, sums| {
            for (i, s) in sums.iter_mut().enumerate() {
                let b = first + i;
                *s = qs[b * QK8_0..(b + 1) * QK8_0]
                    .iter()
                    .map(|&q| i32::from(q))
                    .sum();
            }
        });
    }

    /// Values `at..at + n` (whole blocks) of the rows.
    pub fn row(&self, at: usize, n: usize) -> Q8Row<'_> {
        let b = at / QK8_0..(at + n) / QK8_0;
        Q8Row {
            qs: &self.qs[at..at + n],
            d: &self.d[b.clone()],
            sums: &self.sums[b],
        }
    }
}

/// One activation row of [`Q8Acts`]: its quants, block scales and block sums.
#[derive(Clone, Copy, Debug)]
pub struct Q8Row<'a> {
    pub qs: &'a [i8],
    pub d: &'a [f32],
    pub sums: &'a [i32],
}

/// Q8_0 rows regrouped by sixteen: per group (the last padded with zero
/// rows), per block `b`, the sixteen rows' f16 scales of block `b`, then
/// their quants as eight slices of sixteen (bytes `4k..4k + 4` of rows 0..16
/// for `k` in 0..8), each stored offset by 128 (`q ^ 0x80`, the unsigned
/// byte `q + 128`). One 64-byte slice then holds four bytes of every row, one
/// row per 32-bit lane, so `vpdpbusd` (unsigned times signed) against the
/// activations' bytes `4k..4k + 4` broadcast adds to each row's integer sum
/// in its own lane (minus `128·Σx`, known per activation block); the AVX2
/// kernel takes each slice as two halves of eight rows and undoes the offset
/// once per block for all the tokens it carries.
#[derive(Clone, Debug)]
pub struct Q8_0x16 {
    data: Vec<u8>,
    n_rows: usize,
    nb: usize,
}

/// Quant bytes of one row in one slice of a [`Q8_0x16`] block.
pub const Q8_0X16_SLICE: usize = 4;

impl Q8_0x16 {
    /// Regroups `n_rows` rows of `nb` blocks.
    ///
    /// # Panics
    /// If `rows.len() != n_rows * nb`.
    pub fn pack(rows: &[BlockQ8_0], nb: usize) -> Self {
        assert!(nb > 0 && rows.len().is_multiple_of(nb), "Q8_0x16 rows");
        let n_rows = rows.len() / nb;
        let groups = n_rows.div_ceil(Q8_ROWS);
        let mut data = vec![0u8; groups * nb * Q8_0X16_BLOCK];
        // Padding rows are zero quants: 0x80 offset.
        for blk in data.chunks_exact_mut(Q8_0X16_BLOCK) {
            blk[2 * Q8_ROWS..].fill(0x80);
        }
        for (r, row) in rows.chunks_exact(nb).enumerate() {
            let (g, l) = (r / Q8_ROWS, r % Q8_ROWS);
            for (b, blk) in row.iter().enumerate() {
                let at = (g * nb + b) * Q8_0X16_BLOCK;
                data[at + 2 * l..at + 2 * l + 2].copy_from_slice(&blk.d);
                for (k, q) in blk.qs.chunks_exact(Q8_0X16_SLICE).enumerate() {
                    let to = at + 2 * Q8_ROWS + (k * Q8_ROWS + l) * Q8_0X16_SLICE;
                    for (o, &q) in data[to..to + Q8_0X16_SLICE].iter_mut().zip(q) {
                        *o = q as u8 ^ 0x80;
                    }
                }
            }
        }
        Q8_0x16 { data, n_rows, nb }
    }

    pub fn n_rows(&self) -> usize {
        self.n_rows
    }

    /// Blocks per row.
    pub fn blocks(&self) -> usize {
        self.nb
    }

    /// Group `g`: rows `16g..16g+16`.
    pub fn group(&self, g: usize) -> &[u8] {
        let len = self.nb * Q8_0X16_BLOCK;
        &self.data[g * len..(g + 1) * len]
    }

    /// Memory held, in bytes.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }
}

/// Row `l` of a [`Q8_0x16`] group block, as the GGUF block it was packed from.
pub fn q8_0x16_row_block(blk: &[u8], l: usize) -> BlockQ8_0 {
    BlockQ8_0 {
        d: [blk[2 * l], blk[2 * l + 1]],
        qs: std::array::from_fn(|i| {
            let (k, j) = (i / Q8_0X16_SLICE, i % Q8_0X16_SLICE);
            (blk[2 * Q8_ROWS + (k * Q8_ROWS + l) * Q8_0X16_SLICE + j] ^ 0x80) as i8
        }),
    }
}

/// Lane `l` of a [`Q8_0x16`] group against up to four activation rows, each
/// lane [`q8_0::vec_dot_q8_0_f32_scales`] of row `l`: the scalar reference of
/// the tier kernel.
pub fn dot_q8_0x16_f32s_ref(group: &[u8], x: &[Q8Row<'_>], out: &mut [[f32; Q8_ROWS]]) {
    for (x, out) in x.iter().zip(out.iter_mut()) {
        let nb = x.d.len();
        assert!(
            group.len() == nb * Q8_0X16_BLOCK && x.qs.len() == nb * QK8_0 && x.sums.len() == nb,
            "dot_q8_0x16_f32s lengths"
        );
        for (l, o) in out.iter_mut().enumerate() {
            let row: Vec<BlockQ8_0> = group
                .chunks_exact(Q8_0X16_BLOCK)
                .map(|blk| q8_0x16_row_block(blk, l))
                .collect();
            *o = q8_0::vec_dot_q8_0_f32_scales(&row, x.qs, x.d);
        }
    }
}

/// F16 rows regrouped by eight: per group (the last padded with zero rows),
/// per column `i`, the eight rows' values at `i`.
#[derive(Clone, Debug)]
pub struct F16x8 {
    data: Vec<u16>,
    n_rows: usize,
    n_in: usize,
}

impl F16x8 {
    /// Regroups rows of `n_in` little-endian f16 values.
    ///
    /// # Panics
    /// If `rows` is not a whole number of rows.
    pub fn pack(rows: &[u8], n_in: usize) -> Self {
        assert!(
            n_in > 0 && rows.len().is_multiple_of(2 * n_in),
            "F16x8 rows"
        );
        let n_rows = rows.len() / (2 * n_in);
        let groups = n_rows.div_ceil(LANES);
        let mut data = vec![0u16; groups * n_in * LANES];
        for (r, row) in rows.chunks_exact(2 * n_in).enumerate() {
            let (g, l) = (r / LANES, r % LANES);
            for (i, v) in row.chunks_exact(2).enumerate() {
                data[(g * n_in + i) * LANES + l] = u16::from_le_bytes([v[0], v[1]]);
            }
        }
        F16x8 { data, n_rows, n_in }
    }

    pub fn n_rows(&self) -> usize {
        self.n_rows
    }

    pub fn n_in(&self) -> usize {
        self.n_in
    }

    /// Group `g`: rows `8g..8g+8`, `n_in x 8` values.
    pub fn group(&self, g: usize) -> &[u16] {
        let len = self.n_in * LANES;
        &self.data[g * len..(g + 1) * len]
    }

    /// Memory held, in bytes.
    pub fn bytes(&self) -> usize {
        2 * self.data.len()
    }
}

/// The most tokens one [`dots_f16x8_serial_ref`] call takes.
pub const F16X8_CHAINS: usize = 8;

/// Up to [`F16X8_CHAINS`] independent lanes-of-eight serial sums of one
/// group of eight rows: chain `j` is `out[j][l] = Σ_i w[i·8 + l]·x[j][i]` (a
/// running f32 sum in increasing `i`, each lane [`f16::dot_f16_serial`] of
/// its row against token `j`). The scalar reference of the tier kernel.
pub fn dots_f16x8_serial_ref(w: &[u16], x: &[&[f32]], out: &mut [[f32; LANES]]) {
    for (x, out) in x.iter().zip(out.iter_mut()) {
        assert_eq!(w.len(), LANES * x.len(), "dots_f16x8_serial lengths");
        for (l, o) in out.iter_mut().enumerate() {
            let row: Vec<u8> = (0..x.len())
                .flat_map(|i| w[i * LANES + l].to_le_bytes())
                .collect();
            *o = f16::dot_f16_serial(&row, x);
        }
    }
}

/// [`dots_f16x8_serial_ref`] on f32 vectors: chain `j` is
/// `out[j][l] = Σ_i a[i·8 + l]·b[j][i]` serially (eight transposed vectors,
/// such as query heads, against up to four rows).
pub fn dots8_serial_ref(a: &[f32], b: &[&[f32]], out: &mut [[f32; LANES]]) {
    dots_transposed_ref(a, b, out)
}

/// `L` transposed vectors (`a`: `n x L`) against rows `b`: chain `j` is
/// `out[j][l] = Σ_i a[i·L + l]·b[j][i]`, a running f32 sum in increasing `i`
/// (the definition of [`dots8_serial_ref`] and [`dots16_serial_ref`]).
fn dots_transposed_ref<const L: usize>(a: &[f32], b: &[&[f32]], out: &mut [[f32; L]]) {
    for (b, out) in b.iter().zip(out.iter_mut()) {
        assert_eq!(a.len(), L * b.len(), "dots_serial lengths");
        for (l, o) in out.iter_mut().enumerate() {
            let mut acc = 0.0f32;
            for (i, &v) in b.iter().enumerate() {
                acc += a[i * L + l] * v;
            }
            *o = acc;
        }
    }
}

/// [`dots8_serial_ref`] by the selected tier: eight transposed vectors `a`
/// (`n x 8`) against up to four rows of `n`.
///
/// # Panics
/// If the lengths disagree or more than four rows are given.
pub fn dots8_serial(a: &[f32], b: &[&[f32]], out: &mut [[f32; LANES]]) {
    assert!(
        b.len() <= 4 && b.len() == out.len(),
        "dots8_serial: 1 to 4 rows"
    );
    (kernels().dots8_serial)(a, b, out)
}

/// Query heads one attention step of the deepseek4 kernels takes
/// ([`dots16_serial`], [`wsum16_serial`]): one per lane of a 512-bit register.
pub const HEADS: usize = 16;
/// The most rows one [`dots16_serial`] call takes.
pub const DOTS16_CHAINS: usize = 8;

/// [`dots8_serial_ref`] for sixteen transposed vectors (`a`: `n x 16`, such
/// as query heads) against up to [`DOTS16_CHAINS`] rows: chain `j` is
/// `out[j][l] = Σ_i a[i·16 + l]·b[j][i]`, a running f32 sum in increasing `i`.
pub fn dots16_serial_ref(a: &[f32], b: &[&[f32]], out: &mut [[f32; HEADS]]) {
    dots_transposed_ref(a, b, out)
}

/// [`dots16_serial_ref`] by the selected tier.
///
/// # Panics
/// If the lengths disagree or more than [`DOTS16_CHAINS`] rows are given.
pub fn dots16_serial(a: &[f32], b: &[&[f32]], out: &mut [[f32; HEADS]]) {
    check_dots16(a, b, out.len());
    (kernels().dots16_serial)(a, b, out)
}

/// Sixteen weighted sums of the same rows (attention's values for sixteen
/// heads): `out[h·n + d] = Σ_k w[k][h]·rows[k][d]`, each element one running
/// f32 sum from `+0` in increasing `k` (a rounded multiply, then a rounded
/// add), `n` the row length.
pub fn wsum16_serial_ref(w: &[[f32; HEADS]], rows: &[&[f32]], out: &mut [f32]) {
    let n = check_wsum16(w, rows, out);
    wsum16_from(w, rows, out, n, 0);
}

/// Elements `from..n` of every head of [`wsum16_serial_ref`], in its order
/// (the reference from 0, the tier kernels' tail from their last full step).
pub(crate) fn wsum16_from(
    w: &[[f32; HEADS]],
    rows: &[&[f32]],
    out: &mut [f32],
    n: usize,
    from: usize,
) {
    for (h, o) in out.chunks_exact_mut(n).enumerate() {
        for (d, o) in o.iter_mut().enumerate().skip(from) {
            let mut acc = 0.0f32;
            for (wk, row) in w.iter().zip(rows) {
                acc += wk[h] * row[d];
            }
            *o = acc;
        }
    }
}

/// Checks the shapes of a weighted sum; returns the row length.
pub(crate) fn check_wsum16(w: &[[f32; HEADS]], rows: &[&[f32]], out: &[f32]) -> usize {
    let n = out.len() / HEADS;
    assert!(
        out.len() == HEADS * n && w.len() == rows.len() && rows.iter().all(|r| r.len() == n),
        "wsum16_serial lengths"
    );
    n
}

/// [`wsum16_serial_ref`] by the selected tier.
///
/// # Panics
/// If the lengths disagree.
pub fn wsum16_serial(w: &[[f32; HEADS]], rows: &[&[f32]], out: &mut [f32]) {
    (kernels().wsum16_serial)(w, rows, out)
}

/// Checks the shapes of [`dots16_serial`].
pub(crate) fn check_dots16(a: &[f32], b: &[&[f32]], out_len: usize) {
    assert!(
        b.len() <= DOTS16_CHAINS
            && out_len == b.len()
            && b.iter().all(|b| a.len() == HEADS * b.len()),
        "dots16_serial lengths"
    );
}

/// Weight rows per unit of work: enough units for the pool to balance, a
/// multiple of the kernel's `group` rows, never more than 64.
fn rows_per_unit(pool: &ThreadPool, n_rows: usize, group: usize) -> usize {
    n_rows
        .div_ceil(8 * pool.n_threads())
        .next_multiple_of(group)
        .clamp(group, 64)
}

/// `out[t·n_out + r] = vec_dot_q8_0_f32_scales(w row r, token t's columns
/// g·n_in..(g+1)·n_in)` where `g = r / (n_out / groups)`, each token's
/// activation row `groups · n_in` long.
///
/// # Panics
/// If the sizes disagree, or a column group is not a whole number of sixteen rows.
pub fn matmul_q8_0_f32s(
    pool: &ThreadPool,
    w: &Q8_0x16,
    groups: usize,
    acts: &Q8Acts,
    out: &mut [f32],
) {
    let (nb, n_out) = (w.nb, w.n_rows);
    let n_in = nb * QK8_0;
    let row_len = groups * n_in;
    let n_tok = acts.qs.len() / row_len;
    assert!(
        groups > 0
            && n_out.is_multiple_of(groups)
            && (groups == 1 || (n_out / groups).is_multiple_of(Q8_ROWS))
            && acts.qs.len() == n_tok * row_len
            && out.len() == n_tok * n_out,
        "matmul_q8_0_f32s sizes"
    );
    let per_group = n_out / groups;
    let dot = kernels().dot_q8_0x16_f32s;
    let per = rows_per_unit(pool, n_out, Q8_ROWS);
    let ptr = OutPtr(out.as_mut_ptr());
    pool.run_dynamic(n_out.div_ceil(per), &|u| {
        for g in (u * per..((u + 1) * per).min(n_out)).step_by(Q8_ROWS) {
            let wg = w.group(g / Q8_ROWS);
            let col = (g / per_group) * n_in;
            // Four tokens at a time share each load of the group's weights
            // (`v` is set up once: the kernel overwrites what it returns).
            let mut v = [[0.0f32; Q8_ROWS]; 4];
            for t0 in (0..n_tok).step_by(4) {
                let tn = (n_tok - t0).min(4);
                let at = |t: usize| t * row_len + col;
                let x: [Q8Row<'_>; 4] =
                    std::array::from_fn(|j| acts.row(at(t0 + j.min(tn - 1)), n_in));
                dot(wg, &x[..tn], &mut v[..tn]);
                let rows = (n_out - g).min(Q8_ROWS);
                for (j, v) in v[..tn].iter().enumerate() {
                    // SAFETY: rows g..g+16 of each token are written by this unit
                    // only, and (t0 + j) * n_out + g + rows <= out.len() (checked above).
                    unsafe { ptr.slice((t0 + j) * n_out + g, rows) }.copy_from_slice(&v[..rows]);
                }
            }
        }
    });
}

/// `out[t·n_out + r] = dot_f16_serial(w row r, x row t)`.
///
/// # Panics
/// If the sizes disagree.
pub fn matmul_f16_serial(pool: &ThreadPool, w: &F16x8, x: &[f32], out: &mut [f32]) {
    let (n_in, n_out) = (w.n_in, w.n_rows);
    assert!(x.len().is_multiple_of(n_in), "matmul_f16_serial input");
    let n_tok = x.len() / n_in;
    assert_eq!(out.len(), n_tok * n_out, "matmul_f16_serial output");
    let dots = kernels().dots_f16x8_serial;
    let per = rows_per_unit(pool, n_out, LANES);
    let ptr = OutPtr(out.as_mut_ptr());
    pool.run_dynamic(n_out.div_ceil(per), &|u| {
        for g in (u * per..((u + 1) * per).min(n_out)).step_by(LANES) {
            let wg = w.group(g / LANES);
            // Eight tokens at a time: independent chains that share each
            // widened weight vector (a chain's adds wait on each other).
            let mut v = [[0.0f32; LANES]; F16X8_CHAINS];
            for t0 in (0..n_tok).step_by(F16X8_CHAINS) {
                let tn = (n_tok - t0).min(F16X8_CHAINS);
                let xs: [&[f32]; F16X8_CHAINS] = std::array::from_fn(|j| {
                    let t = t0 + j.min(tn - 1);
                    &x[t * n_in..(t + 1) * n_in]
                });
                dots(wg, &xs[..tn], &mut v[..tn]);
                let rows = (n_out - g).min(LANES);
                for (j, v) in v[..tn].iter().enumerate() {
                    // SAFETY: as in `matmul_q8_0_f32s`.
                    unsafe { ptr.slice((t0 + j) * n_out + g, rows) }.copy_from_slice(&v[..rows]);
                }
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
    let per = rows_per_unit(pool, rows * n_pairs, LANES).min(rows);
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

/// [`matmul_experts`] for IQ2_XXS experts, the same values: the pairs are
/// grouped by expert, and a row of an expert several pairs chose is decoded
/// once ([`Iq2Decoded`]) for all of them (a prefill chunk's tokens share
/// experts: 256 tokens on 16 experts put about 96 pairs on each).
///
/// # Panics
/// As [`matmul_experts`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_experts_iq2_xxs(
    pool: &ThreadPool,
    exps: &[BlockIQ2_XXS],
    rows: usize,
    blocks: usize,
    sel: &[u32],
    acts: &[BlockQ8_K],
    acts_per: usize,
    out: &mut [f32],
) {
    let n_pairs = sel.len();
    let per_expert = rows * blocks;
    let n_exp = exps.len() / per_expert.max(1);
    assert!(
        blocks > 0
            && exps.len() == n_exp * per_expert
            && acts.len() == n_pairs.div_ceil(acts_per) * blocks
            && out.len() == n_pairs * rows
            && sel.iter().all(|&e| (e as usize) < n_exp),
        "matmul_experts_iq2_xxs sizes"
    );
    let mut pairs: Vec<Vec<usize>> = vec![Vec::new(); n_exp];
    for (p, &e) in sel.iter().enumerate() {
        pairs[e as usize].push(p);
    }
    let used: Vec<usize> = (0..n_exp).filter(|&e| !pairs[e].is_empty()).collect();
    let per = rows_per_unit(pool, rows * used.len(), LANES).min(rows);
    let units_per_expert = rows.div_ceil(per);
    let (k, ptr) = (kernels(), OutPtr(out.as_mut_ptr()));
    pool.run_dynamic(used.len() * units_per_expert, &|u| {
        let e = used[u / units_per_expert];
        let b = u % units_per_expert;
        let mut dec = Iq2Decoded::default();
        for r in b * per..((b + 1) * per).min(rows) {
            let w = &exps[e * per_expert + r * blocks..e * per_expert + (r + 1) * blocks];
            let act = |p: usize| &acts[(p / acts_per) * blocks..(p / acts_per + 1) * blocks];
            if let [p] = pairs[e][..] {
                // SAFETY: (pair, row) is written by this unit only, within `out`.
                unsafe { ptr.write(p * rows + r, (k.vec_dot_iq2_xxs_q8_k)(w, act(p))) };
                continue;
            }
            dec.decode(w);
            for &p in &pairs[e] {
                // SAFETY: as above.
                unsafe { ptr.write(p * rows + r, (k.dot_iq2_decoded_q8_k)(&dec, act(p))) };
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shared out over threads, the rounding is the row function's, block
    /// for block, with each block's sum of quants.
    #[test]
    fn q8_acts_on_a_pool_match_the_row_rounding() {
        let x: Vec<f32> = (0..64 * QK8_0)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 0.013 * (1 + i % 5) as f32)
            .collect();
        let mut qs = vec![0i8; x.len()];
        let mut d = vec![0.0f32; x.len() / QK8_0];
        q8_0::quantize_row_f32_scales(&x, &mut qs, &mut d);
        let sums: Vec<i32> = qs
            .chunks_exact(QK8_0)
            .map(|b| b.iter().map(|&q| i32::from(q)).sum())
            .collect();
        for threads in [1, 2, 3] {
            let mut a = Q8Acts::default();
            a.quantize(&ThreadPool::new(threads), &x);
            assert_eq!(
                (&a.qs, &a.d, &a.sums),
                (&qs, &d, &sums),
                "{threads} threads"
            );
        }
    }
}
