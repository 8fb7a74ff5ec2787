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

use super::transformer::{self, embed, output_head, CoreLayer, Head, Pass, Rows};
use super::{Bound, Family, FamilyEntry, Scratch, SeqStep};
use crate::error::{EngineError, Result};
use crate::kv_type::KvType;
use crate::ops::{geglu, Precision, Rope};
use crate::rope::RopeScaling;
use crate::state::{KvLayerSpec, KvState, SeqState};
use crate::weights::{Binder, HParams, Weights};

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
    core: CoreLayer,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    post_attn_norm: Vec<f32>,
    post_ffw_norm: Vec<f32>,
}

pub(crate) struct Gemma3 {
    head: Head,
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
        let head = Head::bind(&mut b, hp)?;
        let (n_embd, hd) = (hp.n_embd, hp.head_dim);
        let layers = (0..hp.n_layer)
            .map(|il| {
                let name = |t: &str| format!("blk.{il}.{t}.weight");
                Ok(LayerWeights {
                    core: CoreLayer::bind(&mut b, hp, il)?,
                    q_norm: b.f32_vector(&name("attn_q_norm"), hd)?,
                    k_norm: b.f32_vector(&name("attn_k_norm"), hd)?,
                    post_attn_norm: b.f32_vector(&name("post_attention_norm"), n_embd)?,
                    post_ffw_norm: b.f32_vector(&name("post_ffw_norm"), n_embd)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let f2 = b.finish(ENTRY.name)?;
        let model = Gemma3 {
            head,
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
        model: &Weights,
        pool: &ThreadPool,
        precision: Precision,
        scratch: &mut Scratch,
        seqs: &mut [SeqStep<'_>],
    ) {
        let hp = &model.hparams;
        let r = scratch.get::<Rows>();
        let p = Pass::new(model, pool, precision, seqs);
        let nt = p.nt;
        let n_embd = hp.n_embd;
        let x = &mut r.x[..nt * n_embd];
        embed(&p, &self.head, seqs, x);
        let embd_scale = (n_embd as f32).sqrt();
        pool.for_each_row_block_mut(x, n_embd, &|_, rows| {
            rows.iter_mut().for_each(|v| *v *= embd_scale);
        });
        r.fill_angles(LOCAL, seqs, ROPE_BASE_SWA, hp.n_rot, |_| RopeScaling::NONE);
        r.fill_angles(GLOBAL, seqs, hp.rope_base, hp.n_rot, |s| s.scaling);
        for (il, lw) in self.layers.iter().enumerate() {
            p.norm(r, &lw.core.attn_norm);
            p.qkv(r, lw.core.qkv());
            p.norm_heads(r, &lw.q_norm, &lw.k_norm);
            let table = if Gemma3::is_local(il) { LOCAL } else { GLOBAL };
            p.rope_qk(r, table, Rope::rotate_neox);
            p.attention(r, seqs, il, self.attn_scale, &lw.core.wo);
            p.residual(r, false, Some(&lw.post_attn_norm));
            p.norm(r, &lw.core.ffn_norm);
            p.ffn(r, lw.core.ffn(), geglu);
            p.residual(r, true, Some(&lw.post_ffw_norm));
        }
        transformer::advance(seqs);
        output_head(&p, r, seqs, &self.head);
    }
}
