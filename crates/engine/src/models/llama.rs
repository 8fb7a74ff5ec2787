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

use super::transformer::{self, embed, output_head, CoreLayer, Head, Pass, Rows};
use super::{Bound, Family, FamilyEntry, Scratch, SeqStep};
use crate::error::Result;
use crate::kv_type::KvType;
use crate::ops::{swiglu, Precision, Rope};
use crate::state::{KvLayerSpec, KvState, SeqState};
use crate::weights::{Binder, HParams, Weights};

pub(crate) const ENTRY: FamilyEntry = FamilyEntry {
    name: "llama",
    arch: "llama",
    payload_id: 1,
    bind: LlamaWeights::bind,
    n_ctx_train_default: None,
};

pub(crate) struct LlamaWeights {
    head: Head,
    layers: Vec<CoreLayer>,
}

impl LlamaWeights {
    /// The weights and the fast path's packed copies their `TensorRef`s index.
    fn bind(g: &Gguf, hp: &HParams) -> Result<Bound> {
        let mut b = Binder::new(g);
        let head = Head::bind(&mut b, hp)?;
        let layers = (0..hp.n_layer)
            .map(|il| CoreLayer::bind(&mut b, hp, il))
            .collect::<Result<Vec<_>>>()?;
        let f2 = b.finish(ENTRY.name)?;
        Ok((Box::new(LlamaWeights { head, layers }), f2))
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
        embed(&p, &self.head, seqs, &mut r.x[..nt * hp.n_embd]);
        r.fill_angles(0, seqs, hp.rope_base, hp.n_rot, |s| s.scaling);
        let scale = 1.0 / (hp.head_dim as f32).sqrt();
        for (il, lw) in self.layers.iter().enumerate() {
            p.norm(r, &lw.attn_norm);
            p.qkv(r, lw.qkv());
            p.rope_qk(r, 0, Rope::rotate);
            p.attention(r, seqs, il, scale, &lw.wo);
            p.residual(r, false, None);
            p.norm(r, &lw.ffn_norm);
            p.ffn(r, lw.ffn(), swiglu);
            p.residual(r, true, None);
        }
        transformer::advance(seqs);
        output_head(&p, r, seqs, &self.head);
    }
}
