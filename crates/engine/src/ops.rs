//! The blocks the transformer families share: RMSNorm, rotary embeddings, causal
//! attention over a per-head K/V cache, SwiGLU, and projection through a weight
//! matrix in either precision.

use ds4_kernels::attn::{attn_group, exp_inplace, exp_ref, AsF32Rows, Running};
use ds4_kernels::matmul::{matmul, matmul_f32, matmul_fast, F32Dot, WeightMatrix};
use ds4_kernels::pool::ThreadPool;
use ds4_kernels::{ActivationFormat, QuantizedActivations};

use crate::rope::RopeScaling;

/// How matrix products treat activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    /// Against Q4_1, Q8_0, Q5_0, Q4_K and Q6_K weights, activations rounded to 16-bit blocks and
    /// integer dot products (`ds4_kernels::act16`, order F2: an error of at most
    /// 1/65534 of each block's largest value); against other formats, f32
    /// activations and weights dotted with fused multiply-adds
    /// (`ds4_kernels::fast`, order F1). One fixed order per format that batched
    /// and single-token products share.
    #[default]
    Fast,
    /// Weights dequantized exactly and dotted with f32 activations in the scalar
    /// reference order: what the golden vectors' `f32_reference/` files compute.
    Exact,
    /// Activations rounded to 8-bit blocks (Q8_0 / Q8_K) and integer dot products,
    /// as llama.cpp's CPU path does (its numerics, its 0.1-1 nat scatter).
    Q8,
}

/// `out = x / rms(x) * w` over each row of `w.len()` elements. The mean of squares
/// is accumulated in f64, as ggml does.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for (xg, og) in x.chunks(n * NORM_ROWS).zip(out.chunks_mut(n * NORM_ROWS)) {
        let scales = norm_scales(xg, n, eps);
        for ((xr, or), scale) in xg.chunks_exact(n).zip(og.chunks_exact_mut(n)).zip(scales) {
            for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
                *o = v * scale * g;
            }
        }
    }
}

/// [`rms_norm`] in place.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    for group in x.chunks_mut(n * NORM_ROWS) {
        let scales = norm_scales(group, n, eps);
        for (row, scale) in group.chunks_exact_mut(n).zip(scales) {
            for (v, &g) in row.iter_mut().zip(w) {
                *v = *v * scale * g;
            }
        }
    }
}

/// Rows whose sums of squares [`norm_scales`] runs side by side.
const NORM_ROWS: usize = 8;

/// `1 / rms` of each row of `n` in `group` (at most [`NORM_ROWS`] rows; the
/// rest of the array unused). Each row's squares are summed in element order,
/// one dependent f64 addition after another; a whole group's chains are
/// interleaved so that the additions of different rows overlap (the same sums,
/// so the same bits, as row by row). Zen 5, Gemma 3 pp512 on one thread: row
/// by row the norms were 3.8% of the time, a latency-bound chain per row.
fn norm_scales(group: &[f32], n: usize, eps: f32) -> [f32; NORM_ROWS] {
    let rows = group.len() / n;
    let mut ss = [0f64; NORM_ROWS];
    if rows == NORM_ROWS {
        for i in 0..n {
            for (r, ss) in ss.iter_mut().enumerate() {
                let v = f64::from(group[r * n + i]);
                *ss += v * v;
            }
        }
    } else {
        for (row, ss) in group.chunks_exact(n).zip(&mut ss) {
            *ss = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        }
    }
    ss.map(|ss| (1.0 / (ss / n as f64 + f64::from(eps)).sqrt()) as f32)
}

/// [`rms_norm`] of each token's row of `x` into `out`, the rows shared out to the
/// pool (each row's arithmetic is the same wherever it runs).
pub fn rms_norm_rows(pool: &ThreadPool, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    pool.for_each_row_block_mut(out, n, &|first, rows| {
        rms_norm(&x[first * n..][..rows.len()], w, eps, rows);
    });
}

/// [`rms_norm`] in place over rows of `w.len()`, shared out to the pool: the same
/// arithmetic, so the same bits (Gemma 3's QK-norm and post-norms).
pub fn rms_norm_rows_inplace(pool: &ThreadPool, x: &mut [f32], w: &[f32], eps: f32) {
    pool.for_each_row_block_mut(x, w.len(), &|_, rows| rms_norm_inplace(rows, w, eps));
}

/// `x += y`, rows of `n` shared out to the pool.
pub fn add_rows(pool: &ThreadPool, x: &mut [f32], y: &[f32], n: usize) {
    pool.for_each_row_block_mut(x, n, &|first, rows| {
        for (xi, &yi) in rows.iter_mut().zip(&y[first * n..]) {
            *xi += yi;
        }
    });
}

/// Rotary position embedding tables: `inv_freq[i] = base^(-2i / n_rot)`, and for
/// a scaled session ([`RopeScaling`]) each pair's angle multiplier and the
/// magnitude scale of the rotated values.
pub struct Rope {
    inv_freq: Vec<f64>,
    /// Per pair: what `pos·inv_freq` is multiplied by (1 without scaling).
    angle_mul: Vec<f64>,
    /// What `sin` and `cos` are multiplied by (1 except under YaRN).
    mscale: f64,
    scaling: RopeScaling,
}

impl Rope {
    pub fn new(base: f32, n_rot: usize) -> Self {
        Self::scaled(base, n_rot, RopeScaling::NONE)
    }

    /// The tables under `scaling`. Without scaling the multipliers are exactly 1,
    /// so the angles are bitwise those of [`new`](Self::new) before scaling existed.
    pub fn scaled(base: f32, n_rot: usize, scaling: RopeScaling) -> Self {
        let inv_freq = (0..n_rot / 2)
            .map(|i| f64::from(base).powf(-2.0 * i as f64 / n_rot as f64))
            .collect();
        Rope {
            inv_freq,
            angle_mul: scaling.angle_multipliers(base, n_rot),
            mscale: scaling.mscale(),
            scaling,
        }
    }

    pub fn scaling(&self) -> RopeScaling {
        self.scaling
    }

    /// Rotates adjacent pairs `(2i, 2i+1)` of the first `n_rot` dims of every head
    /// (ggml's "normal" mode, which GGUF llama weights are permuted for).
    pub fn apply_interleaved(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        let mut sc = vec![(0.0, 0.0); self.inv_freq.len()];
        self.angles(pos, &mut sc);
        Self::rotate(x, head_dim, &sc);
    }

    /// Pairs pulled out of the head loop: `n_rot / 2` per position.
    pub fn n_pairs(&self) -> usize {
        self.inv_freq.len()
    }

    /// `(sin, cos)` of every pair's angle at `pos` (computed in f64, rounded to
    /// f32), for [`rotate`](Self::rotate): once per position, shared by every head
    /// and layer.
    /// Under scaling, the angle is `pos·inv_freq·multiplier` and both values are
    /// multiplied by the magnitude scale before rounding (ggml's `rope_yarn`).
    pub fn angles(&self, pos: usize, out: &mut [(f32, f32)]) {
        let ms = self.mscale;
        for ((o, &f), &m) in out.iter_mut().zip(&self.inv_freq).zip(&self.angle_mul) {
            let (s, c) = (pos as f64 * f * m).sin_cos();
            *o = ((s * ms) as f32, (c * ms) as f32);
        }
    }

    /// Rotates pairs `(i, i + n_rot/2)` of every head with precomputed angles
    /// (ggml's NeoX mode, which Gemma uses).
    pub fn rotate_neox(x: &mut [f32], head_dim: usize, sc: &[(f32, f32)]) {
        let half = sc.len();
        for head in x.chunks_exact_mut(head_dim) {
            for (i, &(s, c)) in sc.iter().enumerate() {
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * c - b * s;
                head[i + half] = a * s + b * c;
            }
        }
    }

    /// [`apply_interleaved`](Self::apply_interleaved) with precomputed angles.
    pub fn rotate(x: &mut [f32], head_dim: usize, sc: &[(f32, f32)]) {
        for head in x.chunks_exact_mut(head_dim) {
            for (i, &(s, c)) in sc.iter().enumerate() {
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * c - b * s;
                head[2 * i + 1] = a * s + b * c;
            }
        }
    }
}

/// `gelu(gate) * up` with GELU's tanh form (ggml's `gelu`), in place in `gate`.
/// `0.5·x·(1 + tanh(u))` with `u = sqrt(2/π)·(x + 0.044715·x³)` is computed as
/// its equal `x / (1 + e^(-2u))` ([`sigmoid_gated`]) instead of libm's `tanhf`,
/// with no cancellation near `tanh = -1`. (llama.cpp reads GELU from an f16
/// table instead; the golden vectors' `f32_reference/` carry that as up to
/// ~0.01 nat.)
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    const TWO_SQRT_2_OVER_PI: f32 = 2.0 * 0.797_884_6;
    const GELU_COEF_A: f32 = 0.044_715;
    sigmoid_gated(gate, up, |x| {
        -TWO_SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)
    });
}

/// `silu(gate) * up`, in place in `gate`: `x / (1 + e^(-x))`
/// ([`sigmoid_gated`]; libm's scalar `expf` was 5% of a SmolLM2 prefill).
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    sigmoid_gated(gate, up, |x| -x);
}

/// `gate[i] = x / (1 + e^(exponent(x))) · up[i]` for `x = gate[i]`: one
/// [`exp_inplace`] (the kernels' SIMD `exp`, within 2 ulp) per element, 64
/// at a time.
fn sigmoid_gated(gate: &mut [f32], up: &[f32], exponent: impl Fn(f32) -> f32) {
    let mut e = [0.0f32; 64];
    for (g, u) in gate.chunks_mut(64).zip(up.chunks(64)) {
        let e = &mut e[..g.len()];
        for (e, &x) in e.iter_mut().zip(g.iter()) {
            *e = exponent(x);
        }
        exp_inplace(e);
        for ((g, &e), &u) in g.iter_mut().zip(e.iter()).zip(u) {
            *g = *g / (1.0 + e) * u;
        }
    }
}

/// Activation buffers for each activation format, reused across matmuls.
pub struct Activations {
    q8_0: QuantizedActivations,
    q8_k: QuantizedActivations,
    f32: QuantizedActivations,
}

impl Activations {
    pub fn new(max_elements: usize) -> Self {
        Activations {
            q8_0: QuantizedActivations::new(ActivationFormat::Q8_0, max_elements),
            q8_k: QuantizedActivations::new(ActivationFormat::Q8_K, max_elements),
            f32: QuantizedActivations::new(ActivationFormat::F32, max_elements),
        }
    }

    fn slot(&mut self, f: ActivationFormat) -> &mut QuantizedActivations {
        match f {
            ActivationFormat::Q8_0 => &mut self.q8_0,
            ActivationFormat::Q8_K => &mut self.q8_k,
            ActivationFormat::F32 => &mut self.f32,
        }
    }
}

/// Projects `x` (rows of `n_in`) through every matrix in `ws`, writing `outs[i]`.
/// With 8-bit activations `x` is converted once per activation format the matrices
/// need, however many matrices share it.
pub fn project(
    pool: &ThreadPool,
    precision: Precision,
    acts: &mut Activations,
    x: &[f32],
    ws: &[&WeightMatrix<'_>],
    outs: &mut [&mut [f32]],
) {
    match precision {
        Precision::Fast => matmul_fast(pool, ws, x, outs),
        Precision::Exact => {
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                matmul_f32(pool, w, x, out, F32Dot::Reference);
            }
        }
        Precision::Q8 => {
            let mut filled: [Option<ActivationFormat>; 3] = [None; 3];
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                let f = w.fmt.activation_format();
                if !filled.contains(&Some(f)) {
                    if let Err(e) = acts.slot(f).requantize(x, w.n_in) {
                        panic!("activation length is validated at load: {e}");
                    }
                    if let Some(free) = filled.iter_mut().find(|s| s.is_none()) {
                        *free = Some(f);
                    }
                }
                matmul(pool, w, acts.slot(f), out);
            }
        }
    }
}

/// Positions per attention tile (and the unit of a ring's length): one tile of K and V rows (2 x 16 KiB at head_dim
/// 64) stays in L1 while every query of a block uses it.
pub const ATTN_TILE: usize = 64;
/// Query tokens per work item.
const ATTN_TOKEN_BLOCK: usize = 16;
/// Positions per attention segment (a multiple of [`ATTN_TILE`]). A query's keys are
/// cut at absolute multiples of this; each segment is its own online softmax and
/// the segments' partial results are merged in order. Work items are (kv head,
/// token block, segment), so a single decoded token's long history is spread over
/// the threads, and a batch computes exactly the same partials and merges.
pub(crate) const ATTN_SEG: usize = 256;
const _: () = assert!(ATTN_SEG.is_multiple_of(ATTN_TILE));
/// Runs of consecutive work items per thread (the threads take runs as they
/// come free). Item by item, two threads read alternate segments, and each
/// thread's prefetch past its segment's end fetched the other's rows while its
/// own next segment started cold: one decoded token over K/V that stream from
/// memory ran at 1 thread's speed on 2 (Zen 5, 131072 positions of SmolLM2's
/// heads: 3.5-4.0 ms a layer item by item, 2.0-2.3 ms in runs).
const ATTN_RUNS_PER_THREAD: usize = 4;

/// Where one layer's K/V rows of a sequence live and which of them a query sees.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnLayout {
    /// Rows per KV head: position `p` is stored at row `p % rows`. A dense cache
    /// has a row for every position of the context (no wrap); a sliding-window
    /// ring has fewer, a multiple of [`ATTN_TILE`], so no tile wraps.
    pub rows: usize,
    /// A query at position `p` sees positions `p + 1 - window ..= p` (llama.cpp's
    /// standard sliding window); `None`: every position `0..=p`.
    pub window: Option<usize>,
    /// What a query-key dot product is multiplied by.
    pub scale: f32,
}

impl AttnLayout {
    /// Every position, scaled by `1/sqrt(head_dim)`, rows for `n_ctx` positions.
    pub fn dense(n_ctx: usize, head_dim: usize) -> Self {
        AttnLayout {
            rows: n_ctx,
            window: None,
            scale: 1.0 / (head_dim as f32).sqrt(),
        }
    }

    /// The first position the query at `pos` sees.
    fn first_seen(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// Causal attention for a batch of query rows at positions `pos0..pos0 + n_tokens`.
///
/// `q` is `[n_tokens][n_head][head_dim]`; `k_cache`/`v_cache` are
/// `[n_head_kv][layout.rows][head_dim]` (f32, or f16 bits) and already hold every
/// position a query sees, each at row `position % rows`. Output like `q`.
///
/// Work items are (kv head, block of query tokens, segment of [`ATTN_SEG`]
/// positions), handed to the threads in runs of consecutive segments
/// ([`ATTN_RUNS_PER_THREAD`]); an item walks its segment in tiles of [`ATTN_TILE`] positions with
/// an online softmax, so each K/V tile is read once for all the queries of the
/// block and of the head group. Each query's segments are then merged in segment
/// order. Segments and tiles sit at fixed absolute positions, a query's first
/// tile is cut at the first position it sees, and each query's arithmetic is the
/// same however the tokens are batched, so chunked prefill and token-by-token
/// decoding agree bit for bit. Under a sliding window only the segments the
/// batch's windows reach are items, so a long context costs what its window
/// does. A tile step is `ds4_kernels::attn::attn_group`: one token's heads of a
/// KV head's group at once, sharing every K/V load (SIMD scores, exp and V
/// accumulation, equal bit for bit to the scalar reference of each query alone);
/// a block of several tokens widens f16 tiles once, a single token reads them
/// directly (both exact).
#[allow(clippy::too_many_arguments)]
pub fn attention<T: AsF32Rows>(
    pool: &ThreadPool,
    q: &[f32],
    k_cache: &[T],
    v_cache: &[T],
    layout: AttnLayout,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    pos0: usize,
    out: &mut [f32],
) {
    let n_tokens = q.len() / (n_head * head_dim);
    let end = pos0 + n_tokens;
    assert!(
        layout.rows >= end || layout.rows.is_multiple_of(ATTN_TILE),
        "a ring of {} rows would wrap inside a tile",
        layout.rows
    );
    let group = n_head / n_head_kv;
    let n_blocks = n_tokens.div_ceil(ATTN_TOKEN_BLOCK);
    let seg0 = layout.first_seen(pos0) / ATTN_SEG;
    let n_seg = end.div_ceil(ATTN_SEG) - seg0;
    // Queries per item: a block's tokens (no more than the call has: one for
    // decode) times the group's heads.
    let bq = ATTN_TOKEN_BLOCK.min(n_tokens) * group;
    // Per item: each query's unnormalized output, then each query's (max, sum).
    let item_len = bq * (head_dim + 2);
    let head_rows = layout.rows * head_dim;
    ATTN_OUT.with_borrow_mut(|scratch| {
        // Items in runs of consecutive segments of one (kv head, token block).
        let n_items = n_head_kv * n_blocks * n_seg;
        let attend_item = |item: usize, o: &mut [f32]| {
            let seg = seg0 + item % n_seg;
            let (kvh, tb) = (item / n_seg / n_blocks, item / n_seg % n_blocks);
            let t0 = tb * ATTN_TOKEN_BLOCK;
            let t1 = (t0 + ATTN_TOKEN_BLOCK).min(n_tokens);
            let p0 = (seg * ATTN_SEG).max(layout.first_seen(pos0 + t0) / ATTN_TILE * ATTN_TILE);
            let p1 = (seg * ATTN_SEG + ATTN_SEG).min(pos0 + t1);
            let ks = &k_cache[kvh * head_rows..][..head_rows];
            let vs = &v_cache[kvh * head_rows..][..head_rows];
            attend_block(
                q,
                (ks, vs),
                (t0, t1),
                (kvh, group, n_head, head_dim),
                pos0,
                (p0, p1),
                layout,
                o,
            );
        };
        run_items(pool, scratch, n_items, item_len, &attend_item);
        let scratch = &scratch[..n_items * item_len];
        for t in 0..n_tokens {
            let (tb, ti) = (t / ATTN_TOKEN_BLOCK, t % ATTN_TOKEN_BLOCK);
            for kvh in 0..n_head_kv {
                for g in 0..group {
                    let qi = ti * group + g;
                    let dst = &mut out[(t * n_head + kvh * group + g) * head_dim..][..head_dim];
                    let items = &scratch[(kvh * n_blocks + tb) * n_seg * item_len..];
                    merge_segments(items, item_len, item_len, n_seg, bq, qi, head_dim, dst);
                }
            }
        }
    });
}

/// Runs `attend_item(i, out)` for items `0..n_items` on the pool's threads, in
/// runs of consecutive items, each writing its `item_len` floats of `scratch`.
fn run_items(
    pool: &ThreadPool,
    scratch: &mut Vec<f32>,
    n_items: usize,
    item_len: usize,
    attend_item: &(dyn Fn(usize, &mut [f32]) + Sync),
) {
    let run = n_items
        .div_ceil(pool.n_threads() * ATTN_RUNS_PER_THREAD)
        .max(1);
    // Padded to whole runs, the padding's items skipped. Grown, never shrunk:
    // layers of one model differ (Gemma 3's global layers have 60 times the
    // segments of its local ones), and a shrunk vector grown back writes zeros
    // over all of it (7.9 MB per global layer per decoded token at 30k, 4% of
    // decode time).
    let padded = n_items.next_multiple_of(run) * item_len;
    if scratch.len() < padded {
        scratch.resize(padded, 0.0);
    }
    pool.for_each_chunk_mut(&mut scratch[..padded], run * item_len, &|r, items| {
        for (i, o) in items.chunks_exact_mut(item_len).enumerate() {
            if r * run + i < n_items {
                attend_item(r * run + i, o);
            }
        }
    });
}

/// One decoding sequence of [`attention_shared`]: its token's query `q` at
/// position `pos`, its own K/V cache (as [`attention`] takes it), and how many
/// leading positions (whole segments) it reads from the shared cache instead,
/// whose rows there are bitwise its own.
pub struct SharedQuery<'a, T> {
    pub q: &'a [f32],
    pub kv: (&'a [T], &'a [T]),
    pub pos: usize,
    pub shared: usize,
}

/// [`attention`] for several decoding sequences (one token each) of a dense
/// layer at once, whose first positions hold the same rows: each segment of
/// the shared cache is read once, by one thread, for every sequence that
/// shares it (the copies in their own caches are not read), so N sequences
/// forked from one long prompt read its K/V once rather than N times. Each
/// query's items are those [`attention`] makes for it alone, computed by the
/// same code over the same bits and merged in the same order: every output
/// is bitwise what it gets alone. Outputs like `attention`'s, one per query.
#[allow(clippy::too_many_arguments)]
pub fn attention_shared<T: AsF32Rows>(
    pool: &ThreadPool,
    shared_kv: (&[T], &[T]),
    queries: &[SharedQuery<'_, T>],
    layout: AttnLayout,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    outs: &mut [&mut [f32]],
) {
    let n_q = queries.len();
    assert_eq!(outs.len(), n_q);
    assert!(
        layout.window.is_none(),
        "shared rows are read on dense layers"
    );
    for q in queries {
        assert!(q.pos < layout.rows && q.shared.is_multiple_of(ATTN_SEG) && q.shared <= q.pos);
        assert_eq!(q.q.len(), n_head * head_dim, "one token per sequence");
    }
    let group = n_head / n_head_kv;
    let n_seg = queries
        .iter()
        .map(|q| q.pos / ATTN_SEG + 1)
        .max()
        .unwrap_or(0);
    let item_len = group * (head_dim + 2);
    let head_rows = layout.rows * head_dim;
    // Items ordered (kv head, segment, sequence): a thread's run walks every
    // sequence over one shared segment while its rows are in cache.
    let n_items = n_head_kv * n_seg * n_q;
    ATTN_OUT.with_borrow_mut(|scratch| {
        let attend_item = |item: usize, o: &mut [f32]| {
            let (kvh, seg, qs) = (item / n_q / n_seg, item / n_q % n_seg, item % n_q);
            let query = &queries[qs];
            let (k, v) = if (seg + 1) * ATTN_SEG <= query.shared {
                shared_kv
            } else {
                query.kv
            };
            // Past the query's position the item is empty: (-inf, 0), skipped
            // by the merge, as `attention` alone makes no item there.
            let p0 = seg * ATTN_SEG;
            let p1 = (p0 + ATTN_SEG).min(query.pos + 1).max(p0);
            attend_block(
                query.q,
                (
                    &k[kvh * head_rows..][..head_rows],
                    &v[kvh * head_rows..][..head_rows],
                ),
                (0, 1),
                (kvh, group, n_head, head_dim),
                query.pos,
                (p0, p1),
                layout,
                o,
            );
        };
        run_items(pool, scratch, n_items, item_len, &attend_item);
        for (qs, out) in outs.iter_mut().enumerate() {
            for kvh in 0..n_head_kv {
                let items = &scratch[(kvh * n_seg * n_q + qs) * item_len..];
                for g in 0..group {
                    let dst = &mut out[(kvh * group + g) * head_dim..][..head_dim];
                    merge_segments(
                        items,
                        item_len,
                        n_q * item_len,
                        n_seg,
                        group,
                        g,
                        head_dim,
                        dst,
                    );
                }
            }
        }
    });
}

/// Merges query `qi`'s partial results over the `n_seg` items starting at `items`
/// (`stride` apart), in segment order, and normalizes: the softmax-weighted sum
/// of V rows.
#[allow(clippy::too_many_arguments)]
fn merge_segments(
    items: &[f32],
    item_len: usize,
    stride: usize,
    n_seg: usize,
    bq: usize,
    qi: usize,
    head_dim: usize,
    dst: &mut [f32],
) {
    let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
    for seg in 0..n_seg {
        let it = &items[seg * stride..][..item_len];
        let (ms, ls) = (it[bq * head_dim + 2 * qi], it[bq * head_dim + 2 * qi + 1]);
        if ms == f32::NEG_INFINITY {
            continue;
        }
        let acc = &it[qi * head_dim..(qi + 1) * head_dim];
        if m == f32::NEG_INFINITY {
            (m, l) = (ms, ls);
            dst.copy_from_slice(acc);
            continue;
        }
        let mn = m.max(ms);
        let (a, b) = (exp_ref(m - mn), exp_ref(ms - mn));
        l = l * a + ls * b;
        for (d, &s) in dst.iter_mut().zip(acc) {
            *d = *d * a + s * b;
        }
        m = mn;
    }
    let inv = 1.0 / l;
    dst.iter_mut().for_each(|a| *a *= inv);
}

/// One work item: queries `t0..t1` of the heads of kv head `kvh` over positions
/// `p0..p1` (one segment, its start raised to the tile of the first position the
/// block sees). Writes `o` as `[token in block][head in group][head_dim]`
/// unnormalized outputs followed by each query's `(max, sum)`; a query that sees
/// no position of the segment gets `(-inf, 0)`.
#[allow(clippy::too_many_arguments)]
fn attend_block<T: AsF32Rows>(
    q: &[f32],
    (ks, vs): (&[T], &[T]),
    (t0, t1): (usize, usize),
    (kvh, group, n_head, head_dim): (usize, usize, usize, usize),
    pos0: usize,
    (p0, p1): (usize, usize),
    layout: AttnLayout,
    o: &mut [f32],
) {
    let n_q = (t1 - t0) * group;
    let bq = o.len() / (head_dim + 2);
    let (acc_all, ml) = o.split_at_mut(bq * head_dim);
    ATTN_STATE.with_borrow_mut(|st| {
        let AttnState {
            running,
            scores,
            k_buf,
            v_buf,
        } = st;
        running.clear();
        running.resize(n_q, Running::default());
        acc_all[..n_q * head_dim].fill(0.0);
        scores.resize(group * ATTN_TILE, 0.0);
        for tile in (p0..p1).step_by(ATTN_TILE) {
            // Every query's tile ends at or before `tile_end` (`p1` is the block's
            // causal limit, and segments are whole tiles). A tile's rows are
            // contiguous: the ring's length is a multiple of the tile's.
            let tile_end = (tile + ATTN_TILE).min(p1);
            let row0 = (tile % layout.rows) * head_dim;
            let n_rows = (tile_end - tile) * head_dim;
            let (ks, vs) = (&ks[row0..row0 + n_rows], &vs[row0..row0 + n_rows]);
            // A block of several tokens widens an f16 tile once for all of them; a
            // single token's heads read it directly (the same bits either way).
            let widened = (t1 - t0 > 1).then(|| {
                (
                    T::as_f32_rows(ks, k_buf) as &[f32],
                    T::as_f32_rows(vs, v_buf) as &[f32],
                )
            });
            for t in t0..t1 {
                let limit = pos0 + t + 1;
                let first = layout.first_seen(pos0 + t).max(tile);
                let last = (tile + ATTN_TILE).min(limit);
                if first >= last {
                    continue;
                }
                let seen = (first - tile) * head_dim..(last - tile) * head_dim;
                // The group's heads are adjacent in `q` and in the block's outputs.
                let qi = (t - t0) * group;
                let qv = &q[(t * n_head + kvh * group) * head_dim..][..group * head_dim];
                let acc = &mut acc_all[qi * head_dim..(qi + group) * head_dim];
                let run = &mut running[qi..qi + group];
                let scale = layout.scale;
                // A single token reads the tile once, from memory: the kernel
                // then requests the next tile's rows as it goes.
                match widened {
                    Some((kt, vt)) => attn_group(
                        qv,
                        &kt[seen.clone()],
                        &vt[seen],
                        scale,
                        run,
                        acc,
                        scores,
                        false,
                    ),
                    None => attn_group(
                        qv,
                        &ks[seen.clone()],
                        &vs[seen],
                        scale,
                        run,
                        acc,
                        scores,
                        true,
                    ),
                }
            }
        }
        for (qi, r) in running.iter().enumerate() {
            ml[2 * qi] = r.m;
            ml[2 * qi + 1] = r.l;
        }
    });
}

/// Per-thread attention scratch: each query's running (max, sum), one tile's
/// scores, and one tile of K and V rows widened to f32 (f16 caches only).
#[derive(Default)]
struct AttnState {
    running: Vec<Running>,
    scores: Vec<f32>,
    k_buf: Vec<f32>,
    v_buf: Vec<f32>,
}

thread_local! {
    /// Per-item attention output, reused across calls (the decode loop allocates
    /// nothing once it has run).
    static ATTN_OUT: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    static ATTN_STATE: std::cell::RefCell<AttnState> =
        std::cell::RefCell::new(AttnState::default());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_definition() {
        let x = [1.0f32, -2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 2.0];
        let w = [1.0f32, 0.5, 2.0, 1.0];
        let mut out = [0f32; 8];
        rms_norm(&x, &w, 1e-6, &mut out);
        let r0 = ((1.0 + 4.0 + 9.0 + 16.0) / 4.0f64 + 1e-6).sqrt();
        let want0 = [1.0 / r0, -2.0 * 0.5 / r0, 3.0 * 2.0 / r0, 4.0 / r0];
        for (g, w) in out[..4].iter().zip(want0) {
            assert!((f64::from(*g) - w).abs() < 1e-6);
        }
        let r1 = (4.0 / 4.0f64 + 1e-6).sqrt();
        assert!((f64::from(out[7]) - 2.0 / r1).abs() < 1e-6);
        assert_eq!(out[4], 0.0);
    }

    /// Rows normalized side by side give each row the bits it gets alone (its
    /// squares summed in element order), for every count of rows around the
    /// group size and rows of wildly different magnitudes.
    #[test]
    fn rms_norm_rows_side_by_side_equal_one_by_one() {
        let n = 37;
        let mut x = 7u32;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        };
        let w: Vec<f32> = (0..n)
            .map(|_| (rnd() % 1000) as f32 / 500.0 - 1.0)
            .collect();
        for rows in [1, 2, 7, 8, 9, 16, 17, 23] {
            let data: Vec<f32> = (0..rows * n)
                .map(|i| {
                    let m = ((rnd() % 20000) as f32 - 10000.0) / 777.0;
                    m * [1e-3f32, 1.0, 3e4][i / n % 3]
                })
                .collect();
            let mut all = vec![0f32; data.len()];
            rms_norm(&data, &w, 1e-6, &mut all);
            let mut inplace = data.clone();
            rms_norm_inplace(&mut inplace, &w, 1e-6);
            assert!(
                inplace
                    .iter()
                    .zip(&all)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{rows} rows: in place"
            );
            for (r, got) in all.chunks_exact(n).enumerate() {
                let row = &data[r * n..][..n];
                let ss: f64 = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
                let scale = (1.0 / (ss / n as f64 + f64::from(1e-6f32)).sqrt()) as f32;
                let want: Vec<u32> = row
                    .iter()
                    .zip(&w)
                    .map(|(&v, &g)| (v * scale * g).to_bits())
                    .collect();
                let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, want, "{rows} rows: row {r}");
            }
        }
    }

    /// `gated(gate, up)` against `act(x)·up` in f64, over more than one chunk
    /// of 64 with a short last one, saturating inputs and both zeros.
    fn check_gated(gated: fn(&mut [f32], &[f32]), act: impl Fn(f64) -> f64) {
        let xs: Vec<f32> = (-400..=400)
            .map(|i| i as f32 * 0.05)
            .chain([-90.0, 90.0, 0.0, -0.0])
            .collect();
        let mut g = xs.clone();
        let up: Vec<f32> = xs.iter().map(|x| 1.0 + 0.25 * x.sin()).collect();
        gated(&mut g, &up);
        for ((&x, &got), &u) in xs.iter().zip(&g).zip(&up) {
            let want = act(f64::from(x)) * f64::from(u);
            assert!(
                (f64::from(got) - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "x {x}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn geglu_is_the_tanh_gelu_times_up() {
        check_gated(geglu, |x| {
            let t = ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh();
            0.5 * x * (1.0 + t)
        });
    }

    #[test]
    fn swiglu_is_silu_times_up() {
        check_gated(swiglu, |x| x / (1.0 + (-x).exp()));
    }

    #[test]
    fn rope_rotates_pairs_and_preserves_norm() {
        let rope = Rope::new(10_000.0, 4);
        let mut x = [1.0f32, 0.0, 0.0, 1.0];
        rope.apply_interleaved(&mut x, 4, 0);
        assert_eq!(x, [1.0, 0.0, 0.0, 1.0], "position 0 is the identity");
        rope.apply_interleaved(&mut x, 4, 3);
        // Pair 0 turns by 3 rad, pair 1 by 3 * 10000^(-1/2) rad.
        assert!((x[0] - 3f32.cos()).abs() < 1e-6 && (x[1] - 3f32.sin()).abs() < 1e-6);
        let a = 3.0f64 * 0.01;
        assert!(
            (f64::from(x[2]) + a.sin()).abs() < 1e-6 && (f64::from(x[3]) - a.cos()).abs() < 1e-6
        );
    }

    #[test]
    fn scaled_rope_angles_by_hand() {
        use crate::rope::RopeScalingType;
        // SmolLM2's RoPE (64 dims, base 1e5) at YaRN x4 over 8192 positions:
        // pair 0 keeps its angle (pos rad), pair 31 (slow) turns by pos·inv_freq/4,
        // pair 15 by pos·inv_freq·0.625; with the attention temperature every
        // value is scaled by 1 + 0.1·ln 4.
        let y = RopeScaling::new(RopeScalingType::Yarn, 4.0, 8192)
            .unwrap()
            .with_attn_temperature(true);
        let rope = Rope::scaled(100_000.0, 64, y);
        let mut sc = vec![(0.0, 0.0); 32];
        let pos = 1000usize;
        rope.angles(pos, &mut sc);
        let ms = 1.0 + 0.1 * 4f64.ln();
        let inv = |i: usize| 100_000f64.powf(-2.0 * i as f64 / 64.0);
        for (i, mul) in [(0, 1.0), (10, 1.0), (15, 0.625), (20, 0.25), (31, 0.25)] {
            let a = pos as f64 * inv(i) * mul;
            let (s, c) = sc[i];
            assert!((f64::from(s) - a.sin() * ms).abs() < 1e-6, "pair {i} sin");
            assert!((f64::from(c) - a.cos() * ms).abs() < 1e-6, "pair {i} cos");
        }
        // Linear x2: every angle halved, magnitude 1.
        let l = RopeScaling::new(RopeScalingType::Linear, 2.0, 8192).unwrap();
        Rope::scaled(100_000.0, 64, l).angles(pos, &mut sc);
        for (i, &(s, c)) in sc.iter().enumerate() {
            let a = pos as f64 * inv(i) * 0.5;
            assert!((f64::from(s) - a.sin()).abs() < 1e-6 && (f64::from(c) - a.cos()).abs() < 1e-6);
        }
        // No scaling: bitwise the unscaled tables.
        let (mut a, mut b) = (vec![(0.0, 0.0); 32], vec![(0.0, 0.0); 32]);
        for pos in [0, 1, 777, 8191, 30000] {
            Rope::new(100_000.0, 64).angles(pos, &mut a);
            Rope::scaled(100_000.0, 64, RopeScaling::NONE).angles(pos, &mut b);
            for ((s, c), (f, g)) in a.iter().zip(&b) {
                assert_eq!((s.to_bits(), c.to_bits()), (f.to_bits(), g.to_bits()));
            }
            for (i, &(s, c)) in a.iter().enumerate() {
                let (ws, wc) = (pos as f64 * inv(i)).sin_cos();
                assert_eq!((s, c), (ws as f32, wc as f32), "pos {pos} pair {i}");
            }
        }
    }

    #[test]
    fn attention_is_causal_softmax_over_cache() {
        // One kv head shared by two query heads, head_dim 2, three positions.
        let (n_ctx, hd) = (4, 2);
        let mut k = vec![0f32; n_ctx * hd];
        let mut v = vec![0f32; n_ctx * hd];
        k[..6].copy_from_slice(&[1.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
        v[..6].copy_from_slice(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let q = [1.0f32, 0.0, 0.0, 2.0, 1.0, 1.0, 0.0, 0.0];
        let mut out = vec![0f32; 8];
        let pool = ThreadPool::new(2);
        attention(
            &pool,
            &q,
            &k,
            &v,
            AttnLayout::dense(n_ctx, hd),
            2,
            1,
            hd,
            1,
            &mut out,
        );
        let s = 1.0 / 2f64.sqrt();
        let expect = |scores: &[f64]| {
            let m = scores.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            let vs = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]];
            [0, 1].map(|d| e.iter().zip(vs).map(|(p, v)| p / z * v[d]).sum::<f64>())
        };
        // Token 0 sits at position 1: sees positions 0 and 1.
        let t0h0 = expect(&[s, 0.0]);
        let t0h1 = expect(&[0.0, 2.0 * s]);
        // Token 1 at position 2 sees all three.
        let t1h0 = expect(&[s, s, 2.0 * s]);
        let t1h1 = expect(&[0.0, 0.0, 0.0]);
        let want = [t0h0, t0h1, t1h0, t1h1].concat();
        for (g, w) in out.iter().zip(want) {
            assert!((f64::from(*g) - w).abs() < 1e-5, "{out:?}");
        }
    }

    /// Decoding queries over caches whose first segments are copies of one
    /// shared cache (and whose later rows differ): each output is bitwise what
    /// `attention` gives it alone over its own cache, with shares of 0, 1 or 2
    /// segments, positions inside and past them, f32 and f16 rows, 1 or 2 threads.
    #[test]
    fn shared_attention_equals_each_query_alone() {
        let (n_ctx, hd, n_head, n_kv) = (900, 8, 6, 2);
        let mut seed = 7u64;
        let mut rnd = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
        };
        let cache = |rnd: &mut dyn FnMut() -> f32| -> Vec<f32> {
            (0..n_kv * n_ctx * hd).map(|_| rnd()).collect()
        };
        let (k0, v0) = (cache(&mut rnd), cache(&mut rnd));
        // (position, shared positions): the leader reads its own rows.
        let cases = [
            (800, 0),
            (300, 256),
            (700, 512),
            (512, 512),
            (256, 256),
            (40, 0),
        ];
        let caches: Vec<(Vec<f32>, Vec<f32>)> = cases
            .iter()
            .map(|&(_, shared)| {
                let (mut k, mut v) = (cache(&mut rnd), cache(&mut rnd));
                for h in 0..n_kv {
                    let rows = h * n_ctx * hd..(h * n_ctx + shared) * hd;
                    k[rows.clone()].copy_from_slice(&k0[rows.clone()]);
                    v[rows.clone()].copy_from_slice(&v0[rows]);
                }
                (k, v)
            })
            .collect();
        let qs: Vec<Vec<f32>> = cases
            .iter()
            .map(|_| (0..n_head * hd).map(|_| rnd()).collect())
            .collect();
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let f16 = |x: &[f32]| {
            x.iter()
                .map(|&f| <u16 as ds4_kernels::attn::KvElem>::narrow(f))
                .collect::<Vec<u16>>()
        };
        let caches16: Vec<(Vec<u16>, Vec<u16>)> =
            caches.iter().map(|(k, v)| (f16(k), f16(v))).collect();
        let (k016, v016) = (f16(&k0), f16(&v0));
        fn check<T: AsF32Rows>(
            pool: &ThreadPool,
            shared: (&[T], &[T]),
            caches: &[(Vec<T>, Vec<T>)],
            qs: &[Vec<f32>],
            cases: &[(usize, usize)],
            (n_ctx, hd, n_head, n_kv): (usize, usize, usize, usize),
            bits: &dyn Fn(&[f32]) -> Vec<u32>,
        ) {
            let layout = AttnLayout::dense(n_ctx, hd);
            let queries: Vec<SharedQuery<'_, T>> = cases
                .iter()
                .zip(caches)
                .zip(qs)
                .map(|((&(pos, shared), (k, v)), q)| SharedQuery {
                    q,
                    kv: (k, v),
                    pos,
                    shared,
                })
                .collect();
            let mut outs = vec![vec![0f32; n_head * hd]; cases.len()];
            let mut refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
            attention_shared(pool, shared, &queries, layout, n_head, n_kv, hd, &mut refs);
            for (i, (&(pos, _), (k, v))) in cases.iter().zip(caches).enumerate() {
                let mut alone = vec![0f32; n_head * hd];
                attention(
                    pool, &qs[i], k, v, layout, n_head, n_kv, hd, pos, &mut alone,
                );
                assert_eq!(bits(&outs[i]), bits(&alone), "query {i}");
            }
        }
        let shape = (n_ctx, hd, n_head, n_kv);
        for threads in [1, 2] {
            let pool = ThreadPool::new(threads);
            check(&pool, (&k0, &v0), &caches, &qs, &cases, shape, &bits);
            check(&pool, (&k016, &v016), &caches16, &qs, &cases, shape, &bits);
        }
    }

    /// Over several segments: close to an f64 softmax, and a batch of queries gives
    /// bit for bit what the same queries give one at a time, on 1 or 2 threads;
    /// the batch again after them (the per-item scratch reused at another
    /// size, holding the single tokens' leftovers) gives the same bits.
    #[test]
    fn attention_over_segments_is_accurate_and_batch_invariant() {
        let (n_ctx, hd, n_head, n_kv) = (700, 8, 4, 2);
        let mut seed = 1u64;
        let mut rnd = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
        };
        let k: Vec<f32> = (0..n_kv * n_ctx * hd).map(|_| rnd()).collect();
        let v: Vec<f32> = (0..n_kv * n_ctx * hd).map(|_| rnd()).collect();
        let (pos0, n_tok) = (600, 40);
        let q: Vec<f32> = (0..n_tok * n_head * hd).map(|_| rnd()).collect();
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for threads in [1, 2] {
            let pool = ThreadPool::new(threads);
            let layout = AttnLayout::dense(n_ctx, hd);
            let run = |q: &[f32], pos0: usize, out: &mut [f32]| {
                attention(&pool, q, &k, &v, layout, n_head, n_kv, hd, pos0, out)
            };
            let mut batch = vec![0f32; q.len()];
            run(&q, pos0, &mut batch);
            let row = n_head * hd;
            for t in 0..n_tok {
                let mut one = vec![0f32; row];
                let qt = &q[t * row..(t + 1) * row];
                run(qt, pos0 + t, &mut one);
                assert_eq!(
                    bits(&one),
                    bits(&batch[t * row..(t + 1) * row]),
                    "token {t}"
                );
                for h in 0..n_head {
                    let kvh = h / (n_head / n_kv);
                    let qv = &qt[h * hd..(h + 1) * hd];
                    let n_pos = pos0 + t + 1;
                    let sc: Vec<f64> = (0..n_pos)
                        .map(|p| {
                            let kr = &k[(kvh * n_ctx + p) * hd..][..hd];
                            qv.iter()
                                .zip(kr)
                                .map(|(&a, &b)| a as f64 * b as f64)
                                .sum::<f64>()
                                / (hd as f64).sqrt()
                        })
                        .collect();
                    let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = sc.iter().map(|s| (s - mx).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for d in 0..hd {
                        let want: f64 = (0..n_pos)
                            .map(|p| e[p] / z * v[(kvh * n_ctx + p) * hd + d] as f64)
                            .sum();
                        let got = batch[t * row + h * hd + d] as f64;
                        assert!(
                            (got - want).abs() < 1e-5,
                            "t {t} h {h} d {d}: {got} vs {want}"
                        );
                    }
                }
            }
            let mut again = vec![0f32; q.len()];
            run(&q, pos0, &mut again);
            assert_eq!(bits(&again), bits(&batch), "the batch after single tokens");
        }
    }

    /// Attention timings: SmolLM2's heads (9 over 3 kv heads of 64), one token
    /// at 6144 positions and a 64-token prefill block at 4096, f32 and f16
    /// K/V; and f16 K/V that streams from memory as a long decode's does (one
    /// token over 131072 positions of SmolLM2's heads, over 16384 and 65536 of
    /// Gemma 3's global layer, 4 over 1 of 256): K/V on huge pages as a
    /// session's, and the caches flushed before each repetition by reading 256
    /// MiB, as the step's weights do between two layers' attention. Without the
    /// flush the last level cache held part of the rows: Zen 5, 2 threads,
    /// Gemma 3's layer at 16384 positions 217 us warm, 380-500 flushed (40 GB/s;
    /// plain loads read 46-48 here):
    /// `cargo test --release -p ds4-engine --lib -- --ignored --nocapture bench_attention`.
    #[test]
    #[ignore]
    fn bench_attention() {
        struct Shape {
            n_head: usize,
            n_kv: usize,
            hd: usize,
            n_ctx: usize,
            cases: &'static [(usize, usize)],
            /// Whether each repetition starts with the caches flushed.
            cold: bool,
        }
        const SMOL: Shape = Shape {
            n_head: 9,
            n_kv: 3,
            hd: 64,
            n_ctx: 8192,
            cases: &[(1, 6143), (64, 4096)],
            cold: false,
        };
        const SMOL_LONG: Shape = Shape {
            n_ctx: 131072,
            cases: &[(1, 131071)],
            cold: true,
            ..SMOL
        };
        const GEMMA_GLOBAL: Shape = Shape {
            n_head: 4,
            n_kv: 1,
            hd: 256,
            n_ctx: 65536,
            cases: &[(1, 16383), (1, 65535)],
            cold: true,
        };
        fn run<T: AsF32Rows>(name: &str, threads: usize, elem: fn(f32) -> T, shape: &Shape) {
            let Shape {
                n_head,
                n_kv,
                hd,
                n_ctx,
                cases,
                cold,
            } = *shape;
            let mut x = 1u32;
            let mut rnd = || {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x as f32 / u32::MAX as f32) * 2.0 - 1.0
            };
            let mut rows = || {
                let rows: Vec<T> = (0..n_kv * n_ctx * hd).map(|_| elem(rnd())).collect();
                ds4_kernels::huge::HugeBuf::from_vec(rows)
            };
            let (k, v) = (rows(), rows());
            let flush = vec![1u8; if cold { 256 << 20 } else { 0 }];
            let pool = ThreadPool::new(threads);
            for &(n_tok, pos0) in cases {
                let q: Vec<f32> = (0..n_tok * n_head * hd).map(|_| rnd()).collect();
                let mut out = vec![0f32; q.len()];
                let reps = 400 / n_tok.min(20);
                attention(
                    &pool,
                    &q,
                    &k,
                    &v,
                    AttnLayout::dense(n_ctx, hd),
                    n_head,
                    n_kv,
                    hd,
                    pos0,
                    &mut out,
                );
                // The fastest repetition: the least disturbed by other work.
                let per = (0..reps)
                    .map(|_| {
                        let read: u64 = flush.iter().step_by(64).map(|&b| u64::from(b)).sum();
                        std::hint::black_box(read);
                        let t = std::time::Instant::now();
                        attention(
                            &pool,
                            &q,
                            &k,
                            &v,
                            AttnLayout::dense(n_ctx, hd),
                            n_head,
                            n_kv,
                            hd,
                            pos0,
                            &mut out,
                        );
                        t.elapsed().as_secs_f64()
                    })
                    .fold(f64::INFINITY, f64::min);
                let pairs = (n_tok * n_head * (pos0 + n_tok / 2)) as f64;
                println!(
                    "{name} [{n_head}/{n_kv}x{hd}] {threads}t {n_tok} tok at {pos0}: {:.1} us per layer, {:.2} ns per (query, position)",
                    per * 1e6,
                    per * 1e9 / pairs
                );
            }
        }
        let f16 = <u16 as ds4_kernels::attn::KvElem>::narrow;
        for threads in [1, 2] {
            run::<f32>("f32", threads, |x| x, &SMOL);
            run::<u16>("f16", threads, f16, &SMOL);
            run::<u16>("f16", threads, f16, &SMOL_LONG);
            run::<u16>("f16", threads, f16, &GEMMA_GLOBAL);
        }
    }
}
