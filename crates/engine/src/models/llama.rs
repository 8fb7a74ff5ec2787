//! The `llama` family (SmolLM2 and other llama-architecture GGUFs): RMSNorm, RoPE
//! on adjacent pairs, grouped-query attention, SwiGLU feed-forward, output tied to
//! the token embedding when the file has no `output.weight`.
//!
//! Tensor layout, validated at load (ggml dims, contiguous first):
//! `token_embd.weight [n_embd, n_vocab]`, `output_norm.weight [n_embd]`,
//! optional `output.weight [n_embd, n_vocab]`, and per layer `blk.{il}.`
//! `attn_norm [n_embd]`, `attn_q [n_embd, n_head*hd]`, `attn_k`/`attn_v
//! [n_embd, n_head_kv*hd]`, `attn_output [n_head*hd, n_embd]`, `ffn_norm [n_embd]`,
//! `ffn_gate`/`ffn_up [n_embd, n_ff]`, `ffn_down [n_ff, n_embd]`.

use ds4_gguf::Gguf;
use ds4_kernels::act16::F2Matrix;
use ds4_kernels::attn::AsF32Rows;
use ds4_kernels::pool::ThreadPool;

use crate::error::Result;
use crate::model::{Binder, HParams, Model, TensorRef};
use crate::ops::{
    add_rows, attention, project, rms_norm, rms_norm_rows, swiglu, Activations, Precision, Rope,
};
use crate::payload;
use crate::session::KvType;

pub(crate) struct LayerWeights {
    attn_norm: Vec<f32>,
    wq: TensorRef,
    wk: TensorRef,
    wv: TensorRef,
    wo: TensorRef,
    ffn_norm: Vec<f32>,
    w_gate: TensorRef,
    w_up: TensorRef,
    w_down: TensorRef,
}

pub(crate) struct LlamaWeights {
    tok_embd: TensorRef,
    output_norm: Vec<f32>,
    output: TensorRef,
    layers: Vec<LayerWeights>,
}

impl LlamaWeights {
    /// The weights and the fast path's packed copies their `TensorRef`s index.
    pub fn bind(g: &Gguf, hp: &HParams) -> Result<(Self, Vec<F2Matrix>)> {
        let mut b = Binder::new(g);
        let (n_embd, n_q, n_kv) = (hp.n_embd, hp.n_embd_q(), hp.n_embd_kv());
        let tok_embd = b.matrix("token_embd.weight", n_embd, hp.n_vocab)?;
        let output = if b.has("output.weight") {
            b.matrix("output.weight", n_embd, hp.n_vocab)?
        } else {
            tok_embd
        };
        let output_norm = b.f32_vector("output_norm.weight", n_embd)?;
        let layers = (0..hp.n_layer)
            .map(|il| {
                let p = format!("blk.{il}.");
                Ok(LayerWeights {
                    attn_norm: b.f32_vector(&format!("{p}attn_norm.weight"), n_embd)?,
                    wq: b.matrix(&format!("{p}attn_q.weight"), n_embd, n_q)?,
                    wk: b.matrix(&format!("{p}attn_k.weight"), n_embd, n_kv)?,
                    wv: b.matrix(&format!("{p}attn_v.weight"), n_embd, n_kv)?,
                    wo: b.matrix(&format!("{p}attn_output.weight"), n_q, n_embd)?,
                    ffn_norm: b.f32_vector(&format!("{p}ffn_norm.weight"), n_embd)?,
                    w_gate: b.matrix(&format!("{p}ffn_gate.weight"), n_embd, hp.n_ff)?,
                    w_up: b.matrix(&format!("{p}ffn_up.weight"), n_embd, hp.n_ff)?,
                    w_down: b.matrix(&format!("{p}ffn_down.weight"), hp.n_ff, n_embd)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let f2 = b.finish("llama")?;
        let weights = LlamaWeights {
            tok_embd,
            output_norm,
            output,
            layers,
        };
        Ok((weights, f2))
    }
}

/// K and V rows of one element type.
pub(crate) struct KvRows<T> {
    pub k: Vec<T>,
    pub v: Vec<T>,
}

/// The K/V cache in its element type.
pub(crate) enum KvCache {
    F32(KvRows<f32>),
    /// f16 bits.
    F16(KvRows<u16>),
}

/// Per-layer K and V rows: `[n_layer][n_head_kv][n_ctx][head_dim]`, so one head's
/// history is contiguous for attention; f32, or f16 (rounded when stored).
pub(crate) struct LlamaState {
    pub n_ctx: usize,
    pub kv: KvCache,
}

impl LlamaState {
    pub fn new(hp: &HParams, n_ctx: usize, kv_type: KvType) -> Self {
        let n = hp.n_layer * hp.n_embd_kv() * n_ctx;
        let kv = match kv_type {
            KvType::F32 => KvCache::F32(KvRows {
                k: vec![0.0; n],
                v: vec![0.0; n],
            }),
            KvType::F16 => KvCache::F16(KvRows {
                k: vec![0; n],
                v: vec![0; n],
            }),
        };
        LlamaState { n_ctx, kv }
    }

    pub fn kv_type(&self) -> KvType {
        match self.kv {
            KvCache::F32(_) => KvType::F32,
            KvCache::F16(_) => KvType::F16,
        }
    }

    fn layer_stride(&self, hp: &HParams) -> usize {
        hp.n_embd_kv() * self.n_ctx
    }

    /// For every (layer, K then V, kv head) in payload order: whether it is V, and
    /// the range of its first `n_tokens` rows.
    fn rows(
        &self,
        hp: &HParams,
        n_tokens: usize,
    ) -> impl Iterator<Item = (bool, std::ops::Range<usize>)> {
        let (head_stride, len, heads) = (
            self.n_ctx * hp.head_dim,
            n_tokens * hp.head_dim,
            hp.n_head_kv,
        );
        (0..hp.n_layer).flat_map(move |il| {
            [false, true].into_iter().flat_map(move |is_v| {
                (0..heads).map(move |h| {
                    let start = (il * heads + h) * head_stride;
                    (is_v, start..start + len)
                })
            })
        })
    }

    /// Writes the K/V rows of positions `0..n_tokens` in logical order.
    pub fn write_rows(
        &self,
        hp: &HParams,
        n_tokens: usize,
        w: &mut impl std::io::Write,
    ) -> Result<()> {
        for (is_v, r) in self.rows(hp, n_tokens) {
            match &self.kv {
                KvCache::F32(c) => payload::write_pod(w, if is_v { &c.v[r] } else { &c.k[r] })?,
                KvCache::F16(c) => payload::write_pod(w, if is_v { &c.v[r] } else { &c.k[r] })?,
            }
        }
        Ok(())
    }

    /// Reads what [`write_rows`](Self::write_rows) wrote.
    pub fn read_rows(
        &mut self,
        hp: &HParams,
        n_tokens: usize,
        r: &mut impl std::io::Read,
    ) -> Result<()> {
        let rows: Vec<_> = self.rows(hp, n_tokens).collect();
        for (is_v, range) in rows {
            match &mut self.kv {
                KvCache::F32(c) => {
                    let cache = if is_v { &mut c.v } else { &mut c.k };
                    payload::read_pod(r, &mut cache[range], "K/V rows")?;
                }
                KvCache::F16(c) => {
                    let cache = if is_v { &mut c.v } else { &mut c.k };
                    payload::read_pod(r, &mut cache[range], "K/V rows")?;
                }
            }
        }
        Ok(())
    }
}

/// Named intermediates of one forward chunk, sized for `max_batch` tokens.
pub(crate) struct Scratch {
    pub max_batch: usize,
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    attn_out: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    ffn_out: Vec<f32>,
    /// RoPE `(sin, cos)` per token and pair, computed once per forward.
    rope: Vec<(f32, f32)>,
    acts: Activations,
}

impl Scratch {
    pub fn new(hp: &HParams, max_batch: usize) -> Self {
        let b = max_batch;
        Scratch {
            max_batch,
            x: vec![0.0; b * hp.n_embd],
            xn: vec![0.0; b * hp.n_embd],
            q: vec![0.0; b * hp.n_embd_q()],
            k: vec![0.0; b * hp.n_embd_kv()],
            v: vec![0.0; b * hp.n_embd_kv()],
            att: vec![0.0; b * hp.n_embd_q()],
            attn_out: vec![0.0; b * hp.n_embd],
            gate: vec![0.0; b * hp.n_ff],
            up: vec![0.0; b * hp.n_ff],
            ffn_out: vec![0.0; b * hp.n_embd],
            rope: vec![(0.0, 0.0); b * hp.n_rot / 2],
            acts: Activations::new(b * hp.n_ff.max(hp.n_embd_q()).max(hp.n_embd)),
        }
    }
}

/// Where a forward pass writes next-token logits.
pub(crate) enum LogitsOut<'a> {
    /// The last token's (`n_vocab`).
    Last(&'a mut [f32]),
    /// Every token's, row after row (`tokens.len() * n_vocab`). Each row is
    /// bitwise the row [`Last`](Self::Last) gives for that token.
    All(&'a mut [f32]),
}

/// Runs `tokens` (at most `scratch.max_batch`, already validated against the
/// vocabulary and context) at positions `pos0..` with the session's RoPE tables,
/// appending their K/V to `state` and writing next-token logits to `logits`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    model: &Model,
    rope: &Rope,
    state: &mut LlamaState,
    s: &mut Scratch,
    pool: &ThreadPool,
    precision: Precision,
    tokens: &[u32],
    pos0: usize,
    logits: LogitsOut<'_>,
) {
    let hp = &model.hparams;
    let w = &model.weights;
    let nt = tokens.len();
    let (n_embd, n_q, n_kv, hd) = (hp.n_embd, hp.n_embd_q(), hp.n_embd_kv(), hp.head_dim);
    let x = &mut s.x[..nt * n_embd];
    let embd = model.matrix(&w.tok_embd);
    for (t, &id) in tokens.iter().enumerate() {
        let row = embd.row(id as usize);
        if let Err(e) =
            ds4_kernels::dequantize_row(embd.fmt, row, &mut x[t * n_embd..(t + 1) * n_embd])
        {
            panic!("embedding rows are validated at load: {e}");
        }
    }

    let n_pairs = rope.n_pairs();
    let angles = &mut s.rope[..nt * n_pairs];
    for (t, a) in angles.chunks_exact_mut(n_pairs.max(1)).enumerate() {
        rope.angles(pos0 + t, a);
    }
    let stride = state.layer_stride(hp);
    for (il, lw) in w.layers.iter().enumerate() {
        let xn = &mut s.xn[..nt * n_embd];
        rms_norm_rows(pool, x, &lw.attn_norm, hp.rms_eps, xn);
        let (q, k, v) = (
            &mut s.q[..nt * n_q],
            &mut s.k[..nt * n_kv],
            &mut s.v[..nt * n_kv],
        );
        project(
            pool,
            precision,
            &mut s.acts,
            xn,
            &[
                &model.matrix(&lw.wq),
                &model.matrix(&lw.wk),
                &model.matrix(&lw.wv),
            ],
            &mut [&mut *q, &mut *k, &mut *v],
        );
        let angles = &s.rope[..nt * n_pairs];
        for (rows, n) in [(&mut *q, n_q), (&mut *k, n_kv)] {
            pool.for_each_row_block_mut(rows, n, &|first, rows| {
                for (t, row) in (first..).zip(rows.chunks_exact_mut(n)) {
                    Rope::rotate(row, hd, &angles[t * n_pairs..(t + 1) * n_pairs]);
                }
            });
        }
        let att = &mut s.att[..nt * n_q];
        let layer = il * stride..(il + 1) * stride;
        let (n_ctx, at) = (state.n_ctx, (pos0, hp.n_head, hp.n_head_kv, hd));
        match &mut state.kv {
            KvCache::F32(c) => store_and_attend(pool, c, layer, n_ctx, at, q, k, v, att),
            KvCache::F16(c) => store_and_attend(pool, c, layer, n_ctx, at, q, k, v, att),
        }
        let attn_out = &mut s.attn_out[..nt * n_embd];
        project(
            pool,
            precision,
            &mut s.acts,
            att,
            &[&model.matrix(&lw.wo)],
            &mut [&mut *attn_out],
        );
        add_rows(pool, x, attn_out, n_embd);

        rms_norm_rows(pool, x, &lw.ffn_norm, hp.rms_eps, xn);
        let (gate, up) = (&mut s.gate[..nt * hp.n_ff], &mut s.up[..nt * hp.n_ff]);
        project(
            pool,
            precision,
            &mut s.acts,
            xn,
            &[&model.matrix(&lw.w_gate), &model.matrix(&lw.w_up)],
            &mut [&mut *gate, &mut *up],
        );
        let up = &*up;
        pool.for_each_row_block_mut(gate, hp.n_ff, &|first, rows| {
            swiglu(rows, &up[first * hp.n_ff..][..rows.len()]);
        });
        let ffn_out = &mut s.ffn_out[..nt * n_embd];
        project(
            pool,
            precision,
            &mut s.acts,
            gate,
            &[&model.matrix(&lw.w_down)],
            &mut [&mut *ffn_out],
        );
        add_rows(pool, x, ffn_out, n_embd);
    }

    let (rows, out) = match logits {
        LogitsOut::Last(out) => (&x[(nt - 1) * n_embd..nt * n_embd], out),
        LogitsOut::All(out) => (&x[..], out),
    };
    let xn = &mut s.xn[..rows.len()];
    if rows.len() == n_embd {
        rms_norm(rows, &w.output_norm, hp.rms_eps, xn);
    } else {
        rms_norm_rows(pool, rows, &w.output_norm, hp.rms_eps, xn);
    }
    project(
        pool,
        precision,
        &mut s.acts,
        xn,
        &[&model.matrix(&w.output)],
        &mut [out],
    );
}

/// Stores the new K/V rows of positions `pos0..` into one layer's cache (rounded to
/// the element type), then runs attention over it.
#[allow(clippy::too_many_arguments)]
fn store_and_attend<T: AsF32Rows>(
    pool: &ThreadPool,
    c: &mut KvRows<T>,
    layer: std::ops::Range<usize>,
    n_ctx: usize,
    (pos0, n_head, n_head_kv, hd): (usize, usize, usize, usize),
    q: &[f32],
    k: &[f32],
    v: &[f32],
    att: &mut [f32],
) {
    let n_kv = n_head_kv * hd;
    let (k_layer, v_layer) = (&mut c.k[layer.clone()], &mut c.v[layer]);
    for t in 0..k.len() / n_kv {
        for h in 0..n_head_kv {
            let dst = (h * n_ctx + pos0 + t) * hd;
            let src = t * n_kv + h * hd;
            for (d, &x) in k_layer[dst..dst + hd].iter_mut().zip(&k[src..src + hd]) {
                *d = T::narrow(x);
            }
            for (d, &x) in v_layer[dst..dst + hd].iter_mut().zip(&v[src..src + hd]) {
                *d = T::narrow(x);
            }
        }
    }
    attention(
        pool, q, k_layer, v_layer, n_ctx, n_head, n_head_kv, hd, pos0, att,
    );
}
