//! The `gemma3` family (Gemma 3 text models, e.g. gemma-3-270m): the embedding
//! scaled by `sqrt(n_embd)`, RMSNorm before and after both the attention and the
//! feed-forward block, RMSNorm of every query and key head (QK-norm), RoPE on
//! halves of each head (NeoX order), grouped-query attention where five of
//! every six layers see a sliding window of the last `sliding_window` positions
//! (RoPE base 10000, unscaled) and the sixth sees everything (the file's base,
//! and the session's RoPE scaling), GeGLU feed-forward (tanh GELU), output tied
//! to the token embedding. Facts as llama.cpp b11434 runs them
//! (`llama_model::load_hparams`, `llm_build_gemma3`): the window pattern (6),
//! the local base and the attention scale (`1/sqrt(head_dim)`; the 62-layer 27B
//! uses `1/sqrt(n_embd / n_head)`) are not in the GGUF.
//!
//! Tensor layout, validated at load (ggml dims, contiguous first):
//! `token_embd.weight [n_embd, n_vocab]`, `output_norm.weight [n_embd]`,
//! optional `output.weight [n_embd, n_vocab]`, and per layer `blk.{il}.`
//! `attn_norm [n_embd]`, `attn_q [n_embd, n_head*hd]`, `attn_k`/`attn_v
//! [n_embd, n_head_kv*hd]`, `attn_q_norm`/`attn_k_norm [hd]`, `attn_output
//! [n_head*hd, n_embd]`, `post_attention_norm [n_embd]`, `ffn_norm [n_embd]`,
//! `ffn_gate`/`ffn_up [n_embd, n_ff]`, `ffn_down [n_ff, n_embd]`,
//! `post_ffw_norm [n_embd]`.
//!
//! State: dense K/V on the global layers, a ring of the window (plus one
//! forward call's tokens) on the local ones (`state/kv.rs`), so a long context
//! costs the memory and attention time of its three global layers in eighteen.

use ds4_gguf::Gguf;
use ds4_kernels::pool::ThreadPool;

use super::transformer::{self, attend_layer, embed, output_head, Rows};
use super::{Bound, Family, FamilyEntry, Scratch, SeqStep};
use crate::error::{EngineError, Result};
use crate::model::{Binder, HParams, Model, TensorRef};
use crate::ops::{add_rows, geglu, project, rms_norm_rows, rms_norm_rows_inplace, Precision, Rope};
use crate::rope::RopeScaling;
use crate::session::KvType;
use crate::state::{KvLayerSpec, KvState, SeqState};

pub(crate) const ENTRY: FamilyEntry = FamilyEntry {
    name: "gemma3",
    arch: "gemma3",
    payload_id: 2,
    bind: Gemma3::bind,
    n_ctx_train_default: None,
};

/// Every `SWA_PATTERN`-th layer (the last of each group) is global.
const SWA_PATTERN: usize = 6;
/// RoPE base of the sliding-window layers.
const ROPE_BASE_SWA: f32 = 10_000.0;
/// Angle tables: local layers, then global ones.
const LOCAL: usize = 0;
const GLOBAL: usize = 1;

struct LayerWeights {
    attn_norm: Vec<f32>,
    wq: TensorRef,
    wk: TensorRef,
    wv: TensorRef,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    wo: TensorRef,
    post_attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    w_gate: TensorRef,
    w_up: TensorRef,
    w_down: TensorRef,
    post_ffw_norm: Vec<f32>,
}

pub(crate) struct Gemma3 {
    tok_embd: TensorRef,
    output_norm: Vec<f32>,
    output: TensorRef,
    layers: Vec<LayerWeights>,
    /// `gemma3.attention.sliding_window`.
    window: usize,
    /// What query-key products are multiplied by.
    attn_scale: f32,
}

impl Gemma3 {
    fn is_local(il: usize) -> bool {
        il % SWA_PATTERN < SWA_PATTERN - 1
    }

    fn bind(g: &Gguf, hp: &HParams) -> Result<Bound> {
        let key = "gemma3.attention.sliding_window";
        let window = g
            .get_u64(key)
            .ok()
            .and_then(|w| usize::try_from(w).ok())
            .filter(|&w| w > 0)
            .ok_or_else(|| EngineError::BadHyperParameter {
                key: key.into(),
                reason: "missing, or not a positive size".into(),
            })?;
        if let Some(v) = g.get("gemma3.attention.value_length") {
            if v.as_u64() != Some(hp.head_dim as u64) {
                return Err(EngineError::BadHyperParameter {
                    key: "gemma3.attention.value_length".into(),
                    reason: format!(
                        "{v:?}: this family needs it equal to key_length {}",
                        hp.head_dim
                    ),
                });
            }
        }
        if hp.n_rot != hp.head_dim {
            return Err(EngineError::BadHyperParameter {
                key: "gemma3.rope.dimension_count".into(),
                reason: format!(
                    "{}: this family rotates whole heads ({})",
                    hp.n_rot, hp.head_dim
                ),
            });
        }
        let attn_scale = if hp.n_layer == 62 {
            1.0 / ((hp.n_embd / hp.n_head) as f32).sqrt()
        } else {
            1.0 / (hp.head_dim as f32).sqrt()
        };
        let mut b = Binder::new(g);
        let (n_embd, n_q, n_kv, hd) = (hp.n_embd, hp.n_embd_q(), hp.n_embd_kv(), hp.head_dim);
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
                    q_norm: b.f32_vector(&format!("{p}attn_q_norm.weight"), hd)?,
                    k_norm: b.f32_vector(&format!("{p}attn_k_norm.weight"), hd)?,
                    wo: b.matrix(&format!("{p}attn_output.weight"), n_q, n_embd)?,
                    post_attn_norm: b
                        .f32_vector(&format!("{p}post_attention_norm.weight"), n_embd)?,
                    ffn_norm: b.f32_vector(&format!("{p}ffn_norm.weight"), n_embd)?,
                    w_gate: b.matrix(&format!("{p}ffn_gate.weight"), n_embd, hp.n_ff)?,
                    w_up: b.matrix(&format!("{p}ffn_up.weight"), n_embd, hp.n_ff)?,
                    w_down: b.matrix(&format!("{p}ffn_down.weight"), hp.n_ff, n_embd)?,
                    post_ffw_norm: b.f32_vector(&format!("{p}post_ffw_norm.weight"), n_embd)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let f2 = b.finish(ENTRY.name)?;
        let model = Gemma3 {
            tok_embd,
            output_norm,
            output,
            layers,
            window,
            attn_scale,
        };
        Ok((Box::new(model), f2))
    }
}

impl Family for Gemma3 {
    fn entry(&self) -> &'static FamilyEntry {
        &ENTRY
    }

    /// Dense K/V on the global layers, a sliding-window ring on the local ones.
    fn new_state(
        &self,
        hp: &HParams,
        n_ctx: usize,
        max_step: usize,
        kv_type: KvType,
    ) -> Box<dyn SeqState> {
        let specs: Vec<KvLayerSpec> = (0..hp.n_layer)
            .map(|il| KvLayerSpec {
                n_head_kv: hp.n_head_kv,
                head_dim: hp.head_dim,
                window: Self::is_local(il).then_some(self.window),
            })
            .collect();
        Box::new(KvState::new(&specs, n_ctx, max_step, kv_type))
    }

    fn new_scratch(&self, hp: &HParams, max_rows: usize) -> Scratch {
        Scratch::new(max_rows, Rows::new(hp, max_rows, 2))
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
    w: &Gemma3,
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
    let embd_scale = (n_embd as f32).sqrt();
    pool.for_each_row_block_mut(x, n_embd, &|_, rows| {
        rows.iter_mut().for_each(|v| *v *= embd_scale);
    });
    s.fill_angles(LOCAL, seqs, ROPE_BASE_SWA, hp.n_rot, |_| RopeScaling::NONE);
    s.fill_angles(GLOBAL, seqs, hp.rope_base, hp.n_rot, |s| s.scaling);
    let n_pairs = hp.n_rot / 2;
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
        let table = if Gemma3::is_local(il) { LOCAL } else { GLOBAL };
        let angles = &s.angles[table][..nt * n_pairs];
        for (rows, n, norm) in [(&mut *q, n_q, &lw.q_norm), (&mut *k, n_kv, &lw.k_norm)] {
            rms_norm_rows_inplace(pool, rows, norm, hp.rms_eps);
            pool.for_each_row_block_mut(rows, n, &|first, rows| {
                for (t, row) in (first..).zip(rows.chunks_exact_mut(n)) {
                    Rope::rotate_neox(row, hd, &angles[t * n_pairs..(t + 1) * n_pairs]);
                }
            });
        }
        let att = &mut s.att[..nt * n_q];
        attend_layer(
            pool,
            seqs,
            il,
            (hp.n_head, hp.n_head_kv, hd),
            w.attn_scale,
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
        rms_norm_rows_inplace(pool, attn_out, &lw.post_attn_norm, hp.rms_eps);
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
            geglu(rows, &up[first * hp.n_ff..][..rows.len()]);
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
        rms_norm_rows_inplace(pool, ffn_out, &lw.post_ffw_norm, hp.rms_eps);
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
