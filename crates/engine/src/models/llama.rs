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
use ds4_kernels::pool::ThreadPool;

use super::transformer::{self, attend_layer, embed, output_head, Rows};
use super::{Bound, Family, FamilyEntry, Scratch, SeqStep};
use crate::error::Result;
use crate::model::{Binder, HParams, Model, TensorRef};
use crate::ops::{add_rows, project, rms_norm_rows, swiglu, Precision, Rope};
use crate::session::KvType;
use crate::state::{KvLayerSpec, KvState, SeqState};

pub(crate) const ENTRY: FamilyEntry = FamilyEntry {
    name: "llama",
    arch: "llama",
    payload_id: 1,
    bind: LlamaWeights::bind,
    n_ctx_train_default: None,
};

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
    fn bind(g: &Gguf, hp: &HParams) -> Result<Bound> {
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
        let f2 = b.finish(ENTRY.name)?;
        let weights = LlamaWeights {
            tok_embd,
            output_norm,
            output,
            layers,
        };
        Ok((Box::new(weights), f2))
    }
}

impl Family for LlamaWeights {
    fn entry(&self) -> &'static FamilyEntry {
        &ENTRY
    }

    /// Dense K/V on every layer.
    fn new_state(
        &self,
        hp: &HParams,
        n_ctx: usize,
        max_step: usize,
        kv_type: KvType,
    ) -> Box<dyn SeqState> {
        let spec = KvLayerSpec {
            n_head_kv: hp.n_head_kv,
            head_dim: hp.head_dim,
            window: None,
        };
        Box::new(KvState::new(
            &vec![spec; hp.n_layer],
            n_ctx,
            max_step,
            kv_type,
        ))
    }

    fn new_scratch(&self, hp: &HParams, max_rows: usize) -> Scratch {
        Scratch::new(max_rows, Rows::new(hp, max_rows, 1))
    }

    fn forward(
        &self,
        model: &Model,
        pool: &ThreadPool,
        precision: Precision,
        scratch: &mut Scratch,
        seqs: &mut [SeqStep<'_>],
    ) {
        forward(self, model, pool, precision, scratch.get::<Rows>(), seqs);
    }
}

/// Runs every sequence's tokens after its state (see [`Family::forward`]).
fn forward(
    w: &LlamaWeights,
    model: &Model,
    pool: &ThreadPool,
    precision: Precision,
    s: &mut Rows,
    seqs: &mut [SeqStep<'_>],
) {
    let hp = &model.hparams;
    let (_, nt) = transformer::offsets(seqs);
    let (n_embd, n_q, n_kv, hd) = (hp.n_embd, hp.n_embd_q(), hp.n_embd_kv(), hp.head_dim);
    let x = &mut s.x[..nt * n_embd];
    embed(&model.matrix(&w.tok_embd), seqs, n_embd, x);
    s.fill_angles(0, seqs, hp.rope_base, hp.n_rot, |s| s.scaling);
    let n_pairs = hp.n_rot / 2;
    let scale = 1.0 / (hd as f32).sqrt();
    for (il, lw) in w.layers.iter().enumerate() {
        let x = &mut s.x[..nt * n_embd];
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
        let angles = &s.angles[0][..nt * n_pairs];
        for (rows, n) in [(&mut *q, n_q), (&mut *k, n_kv)] {
            pool.for_each_row_block_mut(rows, n, &|first, rows| {
                for (t, row) in (first..).zip(rows.chunks_exact_mut(n)) {
                    Rope::rotate(row, hd, &angles[t * n_pairs..(t + 1) * n_pairs]);
                }
            });
        }
        let att = &mut s.att[..nt * n_q];
        attend_layer(
            pool,
            seqs,
            il,
            (hp.n_head, hp.n_head_kv, hd),
            scale,
            q,
            (k, v),
            att,
        );
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
    transformer::advance(seqs);
    output_head(
        pool,
        precision,
        s,
        seqs,
        (&w.output_norm, hp.rms_eps),
        &model.matrix(&w.output),
    );
}
