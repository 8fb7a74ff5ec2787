//! Matrix products of a weight matrix with a batch of activation rows, split over
//! the thread pool by weight rows. Each thread walks its rows once and reuses each
//! row across every token of the batch, so prefill reads the weights once per chunk.

use std::cell::RefCell;

use crate::act16::{Act16, F2Kind, F2Layout, F2Matrix, SubQ4K, SubQ6K};
use crate::pool::ThreadPool;
use crate::q4_1::BlockQ4_1;
use crate::q5_0::BlockQ5_0;
use crate::q8_0::BlockQ8_0;
#[cfg(test)]
use crate::vec_dot;
use crate::{dequantize_row, vec_dot_rows, QuantizedActivations, WeightFormat};

/// A row-major weight matrix of `n_out` rows of `n_in` elements in one format:
/// ggml's `[n_in, n_out]` tensor; for Q4_1, Q8_0 and Q5_0 also the copy laid out for
/// [`matmul_fast`] (see [`WeightMatrix::pack_f2`]).
#[derive(Clone, Copy, Debug)]
pub struct WeightMatrix<'a> {
    pub fmt: WeightFormat,
    pub n_in: usize,
    pub n_out: usize,
    pub data: &'a [u8],
    pub f2: Option<&'a F2Matrix>,
}

impl<'a> WeightMatrix<'a> {
    /// Checks that `data` holds exactly `n_out` rows of `n_in` elements.
    pub fn new(fmt: WeightFormat, n_in: usize, n_out: usize, data: &'a [u8]) -> Option<Self> {
        let row = fmt.row_bytes(n_in)?;
        (row.checked_mul(n_out)? == data.len()).then_some(WeightMatrix {
            fmt,
            n_in,
            n_out,
            data,
            f2: None,
        })
    }

    /// The layout [`matmul_fast`] runs a Q4_1, Q8_0, Q5_0, Q4_K or Q6_K matrix
    /// from (order F2, [`F2Matrix`]): built once, at load, and attached by
    /// [`Self::with_f2`]. Q4_1 and Q8_0 blocks keep their bytes; Q5_0 blocks
    /// too on a tier that runs them fast, else they become the Q8_0 blocks
    /// holding exactly their values (the same results, from 1.55 times the
    /// bytes); Q4_K and Q6_K as their sub-blocks of 32 with f32 scales
    /// ([`SubQ4K`], [`SubQ6K`]: 1.33 and 1.52 times their bytes). Q4_1 and
    /// Q8_0 rows in pairs on a tier whose decode tile reads them so. `None` for the other
    /// formats, which it runs from `data`.
    pub fn pack_f2(&self) -> Option<F2Matrix> {
        let nb = self.n_in / crate::act16::QK_ACT16;
        let data = self.data;
        // The kind is the one decision (per format, and Q5_0's per tier).
        Some(match (f2_kind(self.fmt)?, self.fmt) {
            (F2Kind::Q4_1, _) if crate::kernels().f2_pairs => {
                F2Matrix::pack_pairs::<BlockQ4_1>(cast_rows(self, data), nb)
            }
            (F2Kind::Q4_1, _) => F2Matrix::pack::<BlockQ4_1>(cast_rows(self, data), nb),
            (F2Kind::Q8_0, WeightFormat::Q5_0) => {
                F2Matrix::pack(&crate::q5_0::to_q8_0(cast_rows(self, data)), nb)
            }
            (F2Kind::Q8_0, WeightFormat::Q8_0) if crate::kernels().f2_pairs => {
                F2Matrix::pack_pairs::<BlockQ8_0>(cast_rows(self, data), nb)
            }
            (F2Kind::Q8_0, _) => F2Matrix::pack::<BlockQ8_0>(cast_rows(self, data), nb),
            (F2Kind::Q5_0, _) if crate::kernels().f2_pairs => {
                F2Matrix::pack_pairs::<BlockQ5_0>(cast_rows(self, data), nb)
            }
            (F2Kind::Q5_0, _) => F2Matrix::pack::<BlockQ5_0>(cast_rows(self, data), nb),
            (F2Kind::Q4K, _) => F2Matrix::pack(&SubQ4K::from_q4_k(cast_rows(self, data)), nb),
            (F2Kind::Q6K, _) => F2Matrix::pack(&SubQ6K::from_q6_k(cast_rows(self, data)), nb),
        })
    }

    /// This matrix with its F2 layout attached.
    ///
    /// # Panics
    /// If `f2` has another shape or format (it was packed from another matrix).
    pub fn with_f2(self, f2: &'a F2Matrix) -> Self {
        assert!(
            f2.n_rows() == self.n_out
                && f2.blocks_per_row() * crate::act16::QK_ACT16 == self.n_in
                && Some(f2.kind()) == f2_kind(self.fmt),
            "F2 layout of another matrix"
        );
        WeightMatrix {
            f2: Some(f2),
            ..self
        }
    }

    fn row_bytes(&self) -> usize {
        self.data.len() / self.n_out
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }
}

/// A pointer to the output that threads write at disjoint indices.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: every thread writes a disjoint set of indices (its own weight rows of each
// token), and `ThreadPool::run` returns only after all threads are done.
unsafe impl Sync for OutPtr {}
// SAFETY: as above.
unsafe impl Send for OutPtr {}

impl OutPtr {
    /// # Safety
    /// `i` is in bounds of the output and no other thread writes index `i`.
    pub(crate) unsafe fn write(self, i: usize, v: f32) {
        // SAFETY: guaranteed by the caller.
        unsafe { *self.0.add(i) = v }
    }

    /// # Safety
    /// `start..start + len` is in bounds of the output and no other thread writes
    /// those indices while the slice lives.
    pub(crate) unsafe fn slice<'a>(self, start: usize, len: usize) -> &'a mut [f32] {
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

/// Weight rows [`matmul`] runs against every token before moving on: 64 rows of a
/// few hundred bytes stay in L1 while the tokens of a batch reuse them.
const ROW_BLOCK: usize = 64;

/// `out[t * n_out + r] = w.row(r) · act.row(t)` for every token `t` of `act`, with
/// activations already converted to `w.fmt.activation_format()`: each value is
/// exactly [`crate::vec_dot`] of its row and token, however many threads and tokens.
/// Q4_1 rows with their packed layout (row after row) go through
/// [`crate::q8_matvec::gemm_q4_1_q8_0_f2`] for any number of tokens; without it
/// (or with rows in pairs, which it does not read),
/// several tokens through the batched [`crate::q8_matvec::gemm_q4_1_q8_0`]
/// (weights unpacked once for all tokens); otherwise blocks of [`ROW_BLOCK`] rows
/// meet every token.
pub fn matmul(
    pool: &ThreadPool,
    w: &WeightMatrix<'_>,
    act: &QuantizedActivations,
    out: &mut [f32],
) {
    let n_tokens = act.rows();
    assert_eq!(act.n(), w.n_in, "activation row length");
    assert_eq!(out.len(), n_tokens * w.n_out, "output size");
    let ptr = OutPtr(out.as_mut_ptr());
    let rb = w.row_bytes();
    let units = RowUnits::new(w.n_out, n_tokens, pool.n_threads());
    pool.run_dynamic(units.count, &|u| {
        let rows = units.rows(u);
        if let (Some(f2), Some(y)) = (
            w.f2.filter(|f2| w.fmt == WeightFormat::Q4_1 && f2.layout() == F2Layout::Rows),
            act.q8_0_blocks(),
        ) {
            if !rows.is_empty() {
                batched_rows(w, n_tokens, rows.clone(), ptr, |local| {
                    crate::q8_matvec::gemm_q4_1_q8_0_f2(f2.rows(rows), y, local)
                });
            }
            return;
        }
        if n_tokens > 1 {
            if let (WeightFormat::Q4_1, Some(y)) = (w.fmt, act.q8_0_blocks()) {
                let data = &w.data[rows.start * rb..rows.end * rb];
                let nb = w.n_in / crate::q8_0::QK8_0;
                batched_rows(w, n_tokens, rows, ptr, |local| {
                    crate::q8_matvec::gemm_q4_1_q8_0(cast_rows(w, data), y, nb, local)
                });
                return;
            }
        }
        for r0 in rows.clone().step_by(ROW_BLOCK) {
            let r1 = (r0 + ROW_BLOCK).min(rows.end);
            for t in 0..n_tokens {
                // SAFETY: rows r0..r1 of token t lie inside the output (r1 <= n_out,
                // t < n_tokens) and belong to this unit alone (`RowUnits`).
                let o = unsafe { ptr.slice(t * w.n_out + r0, r1 - r0) };
                vec_dot_rows(w.fmt, w.n_in, &w.data[r0 * rb..r1 * rb], act.row(t), o);
            }
        }
    });
}

/// Units of work the matmuls hand to the pool ([`ThreadPool::run_dynamic`]): runs
/// of rows. A batch of tokens is cut into about [`UNITS_PER_THREAD`] units per
/// thread, so a thread that finishes early (or one the host delays) costs the
/// others at most one unit's wait. A single token (decode) takes one unit per
/// thread: its rows stream from memory, and every unit start is a stream the
/// prefetcher has not caught up with (8 units per thread measured slower: tg128
/// 95-105 against 109-134 t/s).
#[derive(Clone, Copy, Debug)]
struct RowUnits {
    n_rows: usize,
    per_unit: usize,
    count: usize,
}

/// See [`RowUnits`]. Against a fixed split of rows on a shared 2-core VM, where
/// one core is often slower than the other: batched products 0-25% faster.
const UNITS_PER_THREAD: usize = 8;
/// Rows per unit are a multiple of this: whole tiles of the decode and prefill
/// kernels (4 rows and 2 rows).
const UNIT_ROWS_ALIGN: usize = 4;

impl RowUnits {
    fn new(n_rows: usize, n_tokens: usize, n_threads: usize) -> Self {
        let units = match (n_threads, n_tokens) {
            (1, _) => 1,
            (_, 1) => n_threads,
            _ => n_threads * UNITS_PER_THREAD,
        };
        let per_unit = n_rows
            .div_ceil(units)
            .next_multiple_of(UNIT_ROWS_ALIGN)
            .max(UNIT_ROWS_ALIGN);
        RowUnits {
            n_rows,
            per_unit,
            count: n_rows.div_ceil(per_unit),
        }
    }

    /// The rows of unit `u` (`u < count`).
    fn rows(&self, u: usize) -> std::ops::Range<usize> {
        u * self.per_unit..((u + 1) * self.per_unit).min(self.n_rows)
    }
}

/// Runs `product`, which fills `out[t * rows.len() + r]` for this thread's rows
/// `rows` of `w` and every token, and puts each token's values in place (row
/// `rows.start + r` of token `t` of `ptr`'s output of `n_tokens · w.n_out`).
/// One token, or every row (one thread), writes in place; more tokens of some
/// rows go through a per-thread buffer.
fn batched_rows(
    w: &WeightMatrix<'_>,
    n_tokens: usize,
    rows: std::ops::Range<usize>,
    ptr: OutPtr,
    product: impl FnOnce(&mut [f32]),
) {
    if n_tokens == 1 || rows.len() == w.n_out {
        // SAFETY: the rows lie inside the output (rows.end <= n_out; all of
        // them for more than one token) and belong to this unit of work alone
        // (`RowUnits`).
        return product(unsafe { ptr.slice(rows.start, n_tokens * rows.len()) });
    }
    ROW_SCRATCH.with_borrow_mut(|local| {
        // Grown, never shrunk: the product writes every value, and a vector
        // shrunk for a smaller unit and grown back for the next wrote zeros over
        // the difference (1% of Gemma 3's prefill in memset).
        let len = n_tokens * rows.len();
        if local.len() < len {
            local.resize(len, 0.0);
        }
        let local = &mut local[..len];
        product(local);
        for (t, lt) in local.chunks_exact(rows.len()).enumerate() {
            prefetch_for_write(
                ptr.0.wrapping_add((t + COPY_AHEAD) * w.n_out + rows.start),
                rows.len(),
            );
            // SAFETY: this unit's rows of token t lie inside the output and
            // belong to this unit alone (`RowUnits`).
            let o = unsafe { ptr.slice(t * w.n_out + rows.start, rows.len()) };
            o.copy_from_slice(lt);
        }
    });
}

/// Tokens ahead of the copy whose output lines [`batched_rows`] requests: the
/// copy's stores missed in cache on every line (each token's rows of a unit
/// are a few lines of a different output row), and one miss at a time made
/// it 5.3% of a 2-thread SmolLM2 pp512 on the Emerald Rapids VM; requested
/// ahead, 1.6% (with 2% in the requests), pp512 1-3% faster.
const COPY_AHEAD: usize = 4;

/// Asks for the cache lines of `len` values from `p` (lines no other core holds
/// come in exclusive, so the stores that follow need no further request). A
/// hint: never faults, whatever `p` (which `wrapping_add` may have formed past
/// the end).
#[inline]
fn prefetch_for_write(p: *mut f32, len: usize) {
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, len);
    #[cfg(target_arch = "x86_64")]
    for l in (0..len).step_by(16) {
        // SAFETY: a prefetch never faults, on any address.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                p.wrapping_add(l).cast(),
            )
        };
    }
}

thread_local! {
    static ROW_SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The 16-bit activations of the current [`matmul_fast`] call.
    static ACT16: RefCell<Act16> = RefCell::new(Act16::default());
    /// A panel of [`PANEL`] dequantized weight rows for [`matmul_fast`].
    static PANEL_SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Weight rows dequantized together by the batched [`matmul_fast`]: 18 rows of up
/// to a few thousand elements stay in L2 while every token of the batch uses them.
const PANEL: usize = 18;
/// The register tile [`matmul_fast`] uses: 3 rows x 3 tokens (9 accumulators, 3
/// weight vectors and one activation vector fit AVX2's 16 registers; 4 x 3 spills
/// and runs at half the speed).
const GEMM_ROWS: usize = 3;
const GEMM_TOKENS: usize = 3;
const _: () =
    assert!(GEMM_ROWS <= crate::fast::TILE_ROWS && GEMM_TOKENS <= crate::fast::TILE_TOKENS);

/// Most matrices one [`matmul_fast`] call takes.
pub const MAX_FUSED: usize = 4;

/// Decodes one row for order F1 (exactly, [`crate::dequantize_row`]).
fn dequant_fast(fmt: WeightFormat, row: &[u8], out: &mut [f32]) {
    if let Err(e) = dequantize_row(fmt, row, out) {
        panic!("matmul_fast: {e}");
    }
}

/// `outs[i][t * n_out + r] = w_i.row(r) · x_t` for every matrix `ws[i]` (all taking
/// rows of the same length) and every token `t` of `x`, in the fast path's fixed
/// orders: Q4_1, Q8_0 and Q5_0 rows against the activations rounded to 16 bits (order
/// F2, [`crate::act16`]), every other format dequantized exactly and dotted in
/// f32 with fused multiply-adds (order F1, [`crate::fast`]). Each (row, token)
/// has one order however many tokens there are, so a batch gives bit for bit
/// what the tokens one at a time give.
///
/// The activations are rounded once, on the calling thread; then one pool
/// dispatch for all the matrices, each matrix's rows cut into units of work
/// ([`RowUnits`]) that the threads take as they come free.
/// Order F1 with several tokens: each thread dequantizes panels of [`PANEL`]
/// rows once and runs register tiles of 3 rows × 3 tokens over them.
///
/// # Panics
/// If more than [`MAX_FUSED`] matrices are given, their row lengths differ, or an
/// output does not hold `n_tokens * n_out` values.
pub fn matmul_fast(
    pool: &ThreadPool,
    ws: &[&WeightMatrix<'_>],
    x: &[f32],
    outs: &mut [&mut [f32]],
) {
    assert!(
        ws.len() <= MAX_FUSED && ws.len() == outs.len(),
        "matrix count"
    );
    let Some(n_in) = ws.first().map(|w| w.n_in) else {
        return;
    };
    assert!(ws.iter().all(|w| w.n_in == n_in), "row lengths differ");
    assert!(
        n_in > 0 && x.len().is_multiple_of(n_in),
        "activation length"
    );
    let n_tok = x.len() / n_in;
    let mut ptrs = [OutPtr(std::ptr::null_mut()); MAX_FUSED];
    for ((p, w), out) in ptrs.iter_mut().zip(ws).zip(outs.iter_mut()) {
        assert_eq!(out.len(), n_tok * w.n_out, "output size");
        assert!(
            !uses_act16(w.fmt) || w.f2.is_some(),
            "matmul_fast: a {} matrix without its F2 layout (WeightMatrix::pack_f2)",
            w.fmt.name()
        );
        *p = OutPtr(out.as_mut_ptr());
    }
    let n_threads = pool.n_threads();
    let mut units = [RowUnits::new(0, 1, 1); MAX_FUSED];
    for (u, w) in units.iter_mut().zip(ws) {
        *u = RowUnits::new(w.n_out, n_tok, n_threads);
    }
    let n_units = units[..ws.len()].iter().map(|u| u.count).sum();
    ACT16.with_borrow_mut(|acts| {
        if ws.iter().any(|w| uses_act16(w.fmt)) {
            acts.quantize(x, n_in);
        }
        let acts = &*acts;
        pool.run_dynamic(n_units, &|mut unit| {
            for ((w, &out), units) in ws.iter().zip(&ptrs).zip(&units) {
                if unit >= units.count {
                    unit -= units.count;
                    continue;
                }
                let rows = units.rows(unit);
                if uses_act16(w.fmt) {
                    act16_rows(w, acts, rows, out);
                } else if n_tok == 1 {
                    matvec_rows(w, x, rows, out);
                } else {
                    gemm_panels(w, x, n_tok, rows, out);
                }
                return;
            }
        });
    });
}

/// The blocks [`WeightMatrix::pack_f2`] lays `fmt` out as, if it packs it.
fn f2_kind(fmt: WeightFormat) -> Option<F2Kind> {
    match fmt {
        WeightFormat::Q4_1 => Some(F2Kind::Q4_1),
        WeightFormat::Q5_0 if crate::kernels().q5_0_native => Some(F2Kind::Q5_0),
        WeightFormat::Q8_0 | WeightFormat::Q5_0 => Some(F2Kind::Q8_0),
        WeightFormat::Q4_K => Some(F2Kind::Q4K),
        WeightFormat::Q6_K => Some(F2Kind::Q6K),
        _ => None,
    }
}

/// Whether [`matmul_fast`] runs `fmt` in order F2 (16-bit activations).
fn uses_act16(fmt: WeightFormat) -> bool {
    f2_kind(fmt).is_some()
}

/// Rows `rows` of a matrix `w` that runs in order F2 (with its F2 layout)
/// against every token of `acts`.
fn act16_rows(w: &WeightMatrix<'_>, acts: &Act16, rows: std::ops::Range<usize>, out: OutPtr) {
    let Some(f2) = w.f2.filter(|_| !rows.is_empty()) else {
        return;
    };
    batched_rows(w, acts.rows(), rows.clone(), out, |local| match f2.kind() {
        F2Kind::Q4_1 => crate::act16::gemm_q4_1(f2.rows(rows), acts, local),
        F2Kind::Q8_0 => crate::act16::gemm_q8_0(f2.rows(rows), acts, local),
        F2Kind::Q5_0 => crate::act16::gemm_q5_0(f2.rows(rows), acts, local),
        F2Kind::Q4K => crate::act16::gemm_q4_k(f2.rows(rows), acts, local),
        F2Kind::Q6K => crate::act16::gemm_q6_k(f2.rows(rows), acts, local),
    });
}

/// Rows `rows` of `w` (order F1) times the single token `x`.
fn matvec_rows(w: &WeightMatrix<'_>, x: &[f32], rows: std::ops::Range<usize>, out: OutPtr) {
    if rows.is_empty() {
        return;
    }
    let rb = w.row_bytes();
    let data = &w.data[rows.start * rb..rows.end * rb];
    // SAFETY: `rows` lies within `0..n_out` (the output holds n_out values for the
    // one token) and belongs to this unit of work alone (`RowUnits`), so the slice is
    // in bounds and no other thread touches it until `run` returns.
    let out = unsafe { out.slice(rows.start, rows.len()) };
    ROW_SCRATCH.with_borrow_mut(|scratch| {
        scratch.resize(w.n_in, 0.0);
        for (row, o) in data.chunks_exact(rb).zip(out.iter_mut()) {
            dequant_fast(w.fmt, row, scratch);
            *o = crate::fast::dot_fma1(scratch, x);
        }
    })
}

fn cast_rows<'a, T: bytemuck::Pod>(w: &WeightMatrix<'_>, data: &'a [u8]) -> &'a [T] {
    crate::cast_blocks(w.fmt.name(), data).unwrap_or_else(|e| panic!("matmul: {e}"))
}

/// Rows `rows` of `w`, in panels of [`PANEL`], times the `n_tok` tokens of `x`.
fn gemm_panels(
    w: &WeightMatrix<'_>,
    x: &[f32],
    n_tok: usize,
    rows: std::ops::Range<usize>,
    out: OutPtr,
) {
    use crate::fast::gemm_tile;
    let k = w.n_in;
    PANEL_SCRATCH.with_borrow_mut(|pack| {
        pack.resize(PANEL * k, 0.0);
        let mut tile_out = [0.0f32; GEMM_ROWS * GEMM_TOKENS];
        for r0 in rows.clone().step_by(PANEL) {
            let nr = PANEL.min(rows.end - r0);
            for i in 0..nr {
                dequant_fast(w.fmt, w.row(r0 + i), &mut pack[i * k..(i + 1) * k]);
            }
            for t0 in (0..n_tok).step_by(GEMM_TOKENS) {
                let nt = GEMM_TOKENS.min(n_tok - t0);
                let xs = &x[t0 * k..(t0 + nt) * k];
                for g0 in (0..nr).step_by(GEMM_ROWS) {
                    let ng = GEMM_ROWS.min(nr - g0);
                    let o = &mut tile_out[..ng * nt];
                    gemm_tile(&pack[g0 * k..(g0 + ng) * k], xs, k, o);
                    for t in 0..nt {
                        for r in 0..ng {
                            // SAFETY: token t0 + t < n_tok and row r0 + g0 + r < n_out,
                            // so the index is in bounds; the row is in this unit of
                            // work alone.
                            unsafe { out.write((t0 + t) * w.n_out + r0 + g0 + r, o[t * ng + r]) };
                        }
                    }
                }
            }
        }
    });
}

/// How [`matmul_f32`] sums a dequantized row against f32 activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum F32Dot {
    /// [`crate::f32::vec_dot_f32`]: the fixed 8-lane order of the scalar reference.
    Reference,
    /// [`crate::f32::vec_dot_f32_fused`]: the fastest order the CPU offers, with
    /// fused multiply-adds where present.
    Fused,
}

/// Every weight row is dequantized exactly and dotted with the f32 activations `x`
/// (`n_tokens` rows of `n_in`): no activation rounding at all.
pub fn matmul_f32(
    pool: &ThreadPool,
    w: &WeightMatrix<'_>,
    x: &[f32],
    out: &mut [f32],
    dot: F32Dot,
) {
    let dot_fn = match dot {
        F32Dot::Reference => crate::f32::vec_dot_f32,
        F32Dot::Fused => crate::f32::vec_dot_f32_fused,
    };
    assert_eq!(x.len() % w.n_in, 0, "activation length");
    let n_tokens = x.len() / w.n_in;
    assert_eq!(out.len(), n_tokens * w.n_out, "output size");
    let ptr = OutPtr(out.as_mut_ptr());
    let units = RowUnits::new(w.n_out, n_tokens, pool.n_threads());
    pool.run_dynamic(units.count, &|u| {
        ROW_SCRATCH.with_borrow_mut(|scratch| {
            scratch.resize(w.n_in, 0.0);
            for r in units.rows(u) {
                if let Err(e) = dequantize_row(w.fmt, w.row(r), scratch) {
                    panic!("matmul_f32: {e}");
                }
                for (t, xt) in x.chunks_exact(w.n_in).enumerate() {
                    let v = dot_fn(scratch, xt);
                    // SAFETY: in bounds as above; row r belongs to this unit alone.
                    unsafe { ptr.write(t * w.n_out + r, v) };
                }
            }
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::XorShift;
    use crate::{quantize_row, ActivationFormat};

    fn random_matrix(fmt: WeightFormat, n_in: usize, n_out: usize, rng: &mut XorShift) -> Vec<u8> {
        let rb = fmt.row_bytes(n_in).unwrap();
        let mut data = vec![0u8; rb * n_out];
        for r in 0..n_out {
            let x: Vec<f32> = (0..n_in).map(|_| rng.uniform(-1.0, 1.0)).collect();
            quantize_row(fmt, &x, &mut data[r * rb..(r + 1) * rb]).unwrap();
        }
        data
    }

    #[test]
    fn matmul_equals_per_row_dots_on_any_thread_count() {
        let mut rng = XorShift::new(7);
        for fmt in [
            WeightFormat::Q4_1,
            WeightFormat::Q8_0,
            WeightFormat::Q4_K,
            WeightFormat::F32,
        ] {
            let (n_in, n_out, n_tok) = (512, 37, 3);
            let data = random_matrix(fmt, n_in, n_out, &mut rng);
            let w = WeightMatrix::new(fmt, n_in, n_out, &data).unwrap();
            let x: Vec<f32> = (0..n_in * n_tok).map(|_| rng.uniform(-2.0, 2.0)).collect();
            let act = QuantizedActivations::quantize(fmt.activation_format(), &x, n_in).unwrap();
            let want: Vec<f32> = (0..n_tok)
                .flat_map(|t| (0..n_out).map(move |r| (t, r)))
                .map(|(t, r)| vec_dot(fmt, n_in, w.row(r), act.row(t)))
                .collect();
            for threads in [1, 2, 3] {
                let pool = ThreadPool::new(threads);
                let mut out = vec![f32::NAN; n_tok * n_out];
                matmul(&pool, &w, &act, &mut out);
                assert_eq!(out, want, "{} on {threads} threads", fmt.name());
                let mut exact = vec![f32::NAN; n_tok * n_out];
                matmul_f32(&pool, &w, &x, &mut exact, F32Dot::Reference);
                let mut deq = vec![0f32; n_in];
                for t in 0..n_tok {
                    for r in 0..n_out {
                        dequantize_row(fmt, w.row(r), &mut deq).unwrap();
                        let xt = &x[t * n_in..(t + 1) * n_in];
                        let d: f64 = deq.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                        let got = exact[t * n_out + r] as f64;
                        assert!((got - d).abs() <= 1e-4 * (1.0 + d.abs()), "{got} vs {d}");
                    }
                }
            }
            assert_eq!(
                fmt.activation_format() == ActivationFormat::F32,
                fmt == WeightFormat::F32
            );
        }
    }

    /// The fast product of a batch is, bit for bit, the product of each token alone
    /// (what chunked prefill = token-by-token decoding rests on), on any thread
    /// count, for every format; and it is close to the f64 product.
    #[test]
    fn matmul_fast_is_batch_invariant_and_accurate() {
        fn attach<'a>(w: WeightMatrix<'a>, f2: Option<&'a F2Matrix>) -> WeightMatrix<'a> {
            match f2 {
                Some(f2) => w.with_f2(f2),
                None => w,
            }
        }
        let mut rng = XorShift::new(8);
        for fmt in WeightFormat::ALL {
            let (n_in, n_tok) = (512, 7);
            let data_a = random_matrix(fmt, n_in, 37, &mut rng);
            let data_b = random_matrix(fmt, n_in, 5, &mut rng);
            let wa = WeightMatrix::new(fmt, n_in, 37, &data_a).unwrap();
            let wb = WeightMatrix::new(fmt, n_in, 5, &data_b).unwrap();
            let (fa, fb) = (wa.pack_f2(), wb.pack_f2());
            assert_eq!(fa.is_some(), uses_act16(fmt), "{}", fmt.name());
            let (wa, wb) = (attach(wa, fa.as_ref()), attach(wb, fb.as_ref()));
            let x: Vec<f32> = (0..n_in * n_tok).map(|_| rng.uniform(-2.0, 2.0)).collect();
            let mut single_a = vec![f32::NAN; n_tok * 37];
            let mut single_b = vec![f32::NAN; n_tok * 5];
            let one = ThreadPool::new(1);
            for t in 0..n_tok {
                matmul_fast(
                    &one,
                    &[&wa, &wb],
                    &x[t * n_in..(t + 1) * n_in],
                    &mut [
                        &mut single_a[t * 37..(t + 1) * 37],
                        &mut single_b[t * 5..(t + 1) * 5],
                    ],
                );
            }
            let mut deq = vec![0f32; n_in];
            for t in 0..n_tok {
                let xt = &x[t * n_in..(t + 1) * n_in];
                // Order F2's rounding moves each activation by at most half a step
                // of its block (amax / ACT16_MAX).
                let half_step: Vec<f64> = xt
                    .chunks_exact(32)
                    .flat_map(|b| {
                        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
                        let h = if uses_act16(fmt) {
                            0.51 * amax / crate::act16::ACT16_MAX as f64
                        } else {
                            0.0
                        };
                        std::iter::repeat_n(h, 32)
                    })
                    .collect();
                for r in 0..37 {
                    dequantize_row(fmt, wa.row(r), &mut deq).unwrap();
                    let d: f64 = deq.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let rounding: f64 = deq
                        .iter()
                        .zip(&half_step)
                        .map(|(&a, h)| a.abs() as f64 * h)
                        .sum();
                    let got = single_a[t * 37 + r] as f64;
                    let bound = rounding + 1e-4 * (1.0 + d.abs());
                    assert!((got - d).abs() <= bound, "{}: {got} vs {d}", fmt.name());
                }
            }
            for threads in [1, 2, 3] {
                let pool = ThreadPool::new(threads);
                for n in [2, 3, 4, 7] {
                    let mut a = vec![f32::NAN; n * 37];
                    let mut b = vec![f32::NAN; n * 5];
                    matmul_fast(&pool, &[&wa, &wb], &x[..n * n_in], &mut [&mut a, &mut b]);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&a),
                        bits(&single_a[..n * 37]),
                        "{} {n} tokens",
                        fmt.name()
                    );
                    assert_eq!(
                        bits(&b),
                        bits(&single_b[..n * 5]),
                        "{} {n} tokens",
                        fmt.name()
                    );
                }
            }
        }
    }

    #[test]
    fn weight_matrix_checks_its_size() {
        assert!(WeightMatrix::new(WeightFormat::Q4_1, 64, 2, &[0; 80]).is_some());
        assert!(WeightMatrix::new(WeightFormat::Q4_1, 64, 2, &[0; 79]).is_none());
        assert!(WeightMatrix::new(WeightFormat::Q4_1, 63, 2, &[0; 80]).is_none());
    }

    #[test]
    #[should_panic(expected = "without its F2 layout")]
    fn matmul_fast_refuses_a_q4_1_matrix_without_its_f2_layout() {
        let w = WeightMatrix::new(WeightFormat::Q4_1, 64, 2, &[0; 80]).unwrap();
        matmul_fast(&ThreadPool::new(1), &[&w], &[0.5; 64], &mut [&mut [0.0; 2]]);
    }

    #[test]
    #[should_panic(expected = "F2 layout of another matrix")]
    fn with_f2_refuses_another_matrix_layout() {
        let q8 = WeightMatrix::new(WeightFormat::Q8_0, 64, 2, &[0; 136]).unwrap();
        let q4 = WeightMatrix::new(WeightFormat::Q4_1, 64, 2, &[0; 80]).unwrap();
        let packed = q8.pack_f2().unwrap();
        let _ = q8.with_f2(&packed);
        let _ = q4.with_f2(&packed);
    }
}
