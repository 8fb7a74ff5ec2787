//! The `deepseek4` family: DeepSeek V4 Flash as the original engine
//! (antirez/ds4, its CPU path) runs it, for any size of the layout (the real
//! 43-layer model and the tiny synthetic one of the tests). Math and formats:
//! `shared/docs/ds4-architecture.md`.
//!
//! Per token: the embedding starts four hyper-connection (HC) streams. Each
//! layer's attention and FFN sublayer reduces them to one input (HC pre: an
//! unweighted RMSNorm of the four streams, a 24-row F16 projection, sigmoid
//! weights, post gates and a 4x4 combine matrix made doubly stochastic by
//! Sinkhorn rounds) and writes its output back into all four (HC post).
//! Attention: low-rank queries (Q8_0 down, RMSNorm, Q8_0 up, RMSNorm per head),
//! one 512-wide K/V row that is both key and value, RoPE on the last 64 dims
//! of every head (base 10000 on the two dense layers; base 160000 with YaRN
//! x16 on compressed layers), FP8 round trip of the other dims, a learned sink
//! per head in the softmax denominator, inverse RoPE on the output, and a
//! grouped low-rank output projection. The raw window holds the last 128 rows;
//! compressed layers also attend to pooled rows: ratio 4 (two overlapping
//! lanes, with a lightning indexer picking the top-k rows by Hadamard+FP4
//! queries) or ratio 128. FFN: a router scoring sqrt(softplus(logit)) (the
//! first layers choose experts from a token-id table instead, the others by
//! top-k with a selection-only bias), IQ2_XXS gate/up and Q2_K down experts on
//! Q8_K activations, x1.5 and clamp at 10, plus a Q8_0 shared expert. The
//! output head reduces the streams with sigmoid weights, RMSNorm, Q8_0.
//!
//! Every operation is evaluated in the reference's order, with its rounding
//! points (Q8_0 activations with f32 block scales, f16 rounding of stored
//! rows, the float sums of its scalar loops, its libm calls), so the tests
//! compare logits with the reference's strict build to the last bits. A
//! forward call runs layer by layer over all its tokens (the reference's
//! layer-major prefill): projections batched over the tokens, the compressor
//! state advanced token by token, attention per token over the state as it
//! stood at that token. Each token's result is what decoding it alone gives,
//! so prefill, decoding and batches agree bitwise.
//!
//! State: [`CompressedState`] (`state/compressed.rs`), whose payload is the
//! original engine's "DSV4" layout.
//!
//! Limits: routed experts must be IQ2_XXS (gate, up) and Q2_K (down), as on
//! the reference's CPU path (its Q4_K experts run on GPUs only); four HC
//! streams; an indexer head of 128; no multi-token-prediction head.

use std::ops::Range;

use ds4_gguf::{GgmlType, Gguf};
use ds4_kernels::f16::{fp16_to_fp32, fp32_to_fp16};
use ds4_kernels::iq2_xxs::BlockIQ2_XXS;
use ds4_kernels::pool::ThreadPool;
use ds4_kernels::q2_k::BlockQ2_K;
use ds4_kernels::q8_0::QK8_0;
use ds4_kernels::q8_k::{self, BlockQ8_K};
use ds4_kernels::qat;
use ds4_kernels::serial::{
    dots16_serial, dots8_serial, matmul_experts, matmul_experts_iq2_xxs, matmul_f16_serial,
    matmul_q8_0_f32s, wsum16_serial, F16x8, Q8Acts, Q8_0x16, DOTS16_CHAINS, HEADS, LANES,
};
use ds4_kernels::QK_K;

use super::{state_of, Bound, Family, FamilyEntry, LogitsOut, Scratch, SeqStep};
use crate::error::{EngineError, Result};
use crate::kv_type::KvType;
use crate::ops::Precision;
use crate::state::{CompLayer, CompressedSpec, CompressedState, SeqState};
use crate::weights::{Binder, HParams, Weights};

pub(crate) const ENTRY: FamilyEntry = FamilyEntry {
    name: "deepseek4",
    arch: "deepseek4",
    payload_id: 3,
    bind: DeepSeek4::bind,
    // DeepSeek V4's context; the files carry `context_length` only as information.
    n_ctx_train_default: Some(1 << 20),
};

/// Hyper-connection streams (the reference hard-codes 4).
const N_HC: usize = 4;
/// HC control values: 4 pre weights, 4 post gates, the 4x4 combine matrix.
const HC_MIX: usize = 2 * N_HC + N_HC * N_HC;
/// Width of an indexer row (the reference's Hadamard is 128 wide).
const INDEX_DIM: usize = qat::HADAMARD_N;
/// The reference's "minus infinity" and its "masked" threshold.
const NEG_INF: f32 = -1.0e30;
/// The smallest sum the routed weights are normalized by (2^-14).
const MIN_WEIGHT_SUM: f32 = 6.103_515_6e-5;

fn bad(key: &str, reason: impl Into<String>) -> EngineError {
    EngineError::BadHyperParameter {
        key: format!("deepseek4.{key}"),
        reason: reason.into(),
    }
}

/// The layout's sizes and constants, from the file's metadata.
#[derive(Clone, Debug)]
struct Dims {
    n_embd: usize,
    n_vocab: usize,
    n_head: usize,
    head_dim: usize,
    n_rot: usize,
    n_lora_q: usize,
    n_lora_o: usize,
    n_out_group: usize,
    n_expert: usize,
    n_expert_used: usize,
    n_ff_exp: usize,
    n_hash_layer: usize,
    window: usize,
    n_index_head: usize,
    index_top_k: usize,
    sinkhorn_iters: usize,
    rms_eps: f32,
    hc_eps: f32,
    expert_weight_scale: f32,
    swiglu_clamp: f32,
    ratios: Vec<usize>,
}

impl Dims {
    fn from_gguf(g: &Gguf, hp: &HParams) -> Result<Self> {
        let int = |k: &str| -> Result<usize> {
            let key = format!("deepseek4.{k}");
            let v = g.get_u64(&key)?;
            usize::try_from(v).map_err(|_| bad(k, format!("{v} is not a size")))
        };
        let float = |k: &str| -> Result<f32> { Ok(g.get_f64(&format!("deepseek4.{k}"))? as f32) };
        let d = Dims {
            n_embd: hp.n_embd,
            n_vocab: hp.n_vocab,
            n_head: hp.n_head,
            head_dim: hp.head_dim,
            n_rot: hp.n_rot,
            n_lora_q: int("attention.q_lora_rank")?,
            n_lora_o: int("attention.output_lora_rank")?,
            n_out_group: int("attention.output_group_count")?,
            n_expert: int("expert_count")?,
            n_expert_used: int("expert_used_count")?,
            n_ff_exp: int("expert_feed_forward_length")?,
            n_hash_layer: int("hash_layer_count")?,
            window: int("attention.sliding_window")?,
            n_index_head: int("attention.indexer.head_count")?,
            index_top_k: int("attention.indexer.top_k")?,
            sinkhorn_iters: int("hyper_connection.sinkhorn_iterations")?,
            rms_eps: hp.rms_eps,
            hc_eps: float("hyper_connection.epsilon")?,
            expert_weight_scale: float("expert_weights_scale")?,
            swiglu_clamp: g
                .get("deepseek4.swiglu_clamp_exp")
                .and_then(|v| v.as_array())
                .and_then(|a| a.first())
                .and_then(|v| v.as_f64())
                .ok_or_else(|| bad("swiglu_clamp_exp", "missing, or not an array of floats"))?
                as f32,
            ratios: g
                .get_i64_array("deepseek4.attention.compress_ratios")?
                .into_iter()
                .take(hp.n_layer)
                .map(|r| usize::try_from(r).unwrap_or(usize::MAX))
                .collect(),
        };
        d.check(g, hp)?;
        Ok(d)
    }

    /// What the graph assumes and the metadata could contradict.
    fn check(&self, g: &Gguf, hp: &HParams) -> Result<()> {
        let need = |ok: bool, key: &str, why: String| if ok { Ok(()) } else { Err(bad(key, why)) };
        need(
            hp.n_head_kv == 1,
            "attention.head_count_kv",
            "one K/V head (K = V)".into(),
        )?;
        if let Some(v) = g.get("deepseek4.attention.value_length") {
            need(
                v.as_u64() == Some(self.head_dim as u64),
                "attention.value_length",
                format!(
                    "{v:?}: values are the keys, so it must be key_length {}",
                    self.head_dim
                ),
            )?;
        }
        need(
            g.get_u64("deepseek4.hyper_connection.count")? == N_HC as u64,
            "hyper_connection.count",
            format!("the graph has {N_HC} streams"),
        )?;
        need(
            g.get_u64("deepseek4.attention.indexer.key_length")? == INDEX_DIM as u64,
            "attention.indexer.key_length",
            format!("the indexer's Hadamard transform is {INDEX_DIM} wide"),
        )?;
        need(
            self.n_rot.is_multiple_of(2) && self.n_rot <= INDEX_DIM && self.head_dim > self.n_rot,
            "rope.dimension_count",
            format!(
                "{}: even, at most {INDEX_DIM} and below the head size",
                self.n_rot
            ),
        )?;
        need(
            (self.head_dim - self.n_rot).is_multiple_of(qat::FP8_BLOCK),
            "attention.key_length",
            format!(
                "{}: its non-rotary part must be whole FP8 blocks of 64",
                self.head_dim
            ),
        )?;
        need(
            self.n_embd.is_multiple_of(QK_K) && self.n_ff_exp.is_multiple_of(QK_K),
            "embedding_length",
            format!(
                "{} and expert FFN {}: multiples of {QK_K} (Q8_K blocks)",
                self.n_embd, self.n_ff_exp
            ),
        )?;
        need(
            self.n_out_group > 0 && self.n_head.is_multiple_of(self.n_out_group),
            "attention.output_group_count",
            format!("{} must divide the {} heads", self.n_out_group, self.n_head),
        )?;
        need(
            (1..=self.n_expert).contains(&self.n_expert_used),
            "expert_used_count",
            format!("{} of {} experts", self.n_expert_used, self.n_expert),
        )?;
        need(
            self.n_hash_layer <= hp.n_layer && self.window > 0 && self.index_top_k > 0,
            "hash_layer_count",
            "hash layers within the model, a window and a top-k".into(),
        )?;
        need(
            self.n_head.is_multiple_of(HEADS) && self.n_index_head.is_multiple_of(LANES),
            "attention.head_count",
            format!(
                "{} heads and {} indexer heads: multiples of {HEADS} and {LANES} (the kernels run that many heads side by side)",
                self.n_head, self.n_index_head
            ),
        )?;
        need(
            self.n_index_head > 0 && self.sinkhorn_iters > 0,
            "attention.indexer.head_count",
            "indexer heads and Sinkhorn rounds".into(),
        )?;
        need(
            self.ratios.len() == hp.n_layer,
            "attention.compress_ratios",
            format!("{} entries for {} layers", self.ratios.len(), hp.n_layer),
        )?;
        for (il, &r) in self.ratios.iter().enumerate() {
            let want = match il {
                0 | 1 => 0,
                _ if il.is_multiple_of(2) => 4,
                _ => 128,
            };
            need(
                r == want,
                "attention.compress_ratios",
                format!("layer {il}: ratio {r}, the layout has {want}"),
            )?;
        }
        need(
            g.get_bool("deepseek4.expert_weights_norm").unwrap_or(true),
            "expert_weights_norm",
            "the routed weights are always normalized".into(),
        )?;
        Ok(())
    }
}

/// RoPE on the last `n_rot` dims of each head, adjacent pairs, as the
/// reference computes it in f32 (`rope_tail_ext_inplace`): the angle of pair
/// `k` at position `p` is `p·θ^k` by repeated f32 products (`θ = base^(-2/n_rot)`),
/// under YaRN blended between that and `p·θ^k / factor` by the ramp between
/// the correction dims; `cos` and `sin` are times a magnitude the reference
/// cancels on purpose (`m = (1/(1 + 0.1 ln f))·(1 + 0.1 ln f)`, one ulp from 1).
#[derive(Clone, Debug)]
struct TailRope {
    n_rot: usize,
    theta_scale: f32,
    freq_scale: f32,
    /// YaRN's correction dims, when on.
    yarn: Option<[f32; 2]>,
    mscale: f32,
}

impl TailRope {
    /// Unscaled RoPE of `base` (the dense layers).
    fn plain(base: f32, n_rot: usize) -> Self {
        TailRope {
            n_rot,
            theta_scale: base.powf(-2.0 / n_rot as f32),
            freq_scale: 1.0,
            yarn: None,
            mscale: 1.0,
        }
    }

    /// YaRN x`factor` over `n_ctx_orig` positions (the compressed layers).
    fn yarn(base: f32, n_rot: usize, factor: f32, n_ctx_orig: f32, beta: [f32; 2]) -> Self {
        let freq_scale = 1.0 / factor;
        let corr_dim = |b: f32| {
            n_rot as f32 * (n_ctx_orig / (b * 2.0 * std::f32::consts::PI)).ln() / (2.0 * base.ln())
        };
        let low = corr_dim(beta[0]).floor().max(0.0);
        let high = corr_dim(beta[1]).ceil().min((n_rot - 1) as f32);
        let boost = 1.0 + 0.1 * (1.0 / freq_scale).ln();
        let attn_factor = 1.0 / boost;
        TailRope {
            n_rot,
            theta_scale: base.powf(-2.0 / n_rot as f32),
            freq_scale,
            yarn: Some([low, high]),
            mscale: attn_factor * boost,
        }
    }

    /// `(cos, sin)` of every pair at `pos`.
    fn table(&self, pos: usize, out: &mut [(f32, f32)]) {
        let mut theta_extrap = pos as f32;
        for (k, o) in out.iter_mut().enumerate().take(self.n_rot / 2) {
            let theta_interp = self.freq_scale * theta_extrap;
            let theta = match self.yarn {
                Some([low, high]) => {
                    let y = (k as f32 - low) / (high - low).max(0.001);
                    let ramp = 1.0 - y.clamp(0.0, 1.0);
                    theta_interp * (1.0 - ramp) + theta_extrap * ramp
                }
                None => theta_interp,
            };
            *o = (theta.cos() * self.mscale, theta.sin() * self.mscale);
            theta_extrap *= self.theta_scale;
        }
    }

    /// Rotates the tail of every `head_dim`-wide head of `x` (inverse: by `-θ`).
    fn rotate(&self, x: &mut [f32], head_dim: usize, table: &[(f32, f32)], inverse: bool) {
        let n_nope = head_dim - self.n_rot;
        for head in x.chunks_exact_mut(head_dim) {
            for (pair, &(c, s)) in head[n_nope..].chunks_exact_mut(2).zip(table) {
                let s = if inverse { -s } else { s };
                let (x0, x1) = (pair[0], pair[1]);
                pair[0] = x0 * c - x1 * s;
                pair[1] = x0 * s + x1 * c;
            }
        }
    }
}

/// `1/(1 + e^-x)` as the HC split writes it.
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The overflow-safe sigmoid of the rest of the reference (the same value).
fn sigmoid_stable(x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

fn silu(x: f32) -> f32 {
    x * sigmoid_stable(x)
}

fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else if x < -20.0 {
        x.exp()
    } else {
        x.exp().ln_1p()
    }
}

/// RMSNorm as the reference computes it: the mean square in f64, then
/// `1/sqrt(ms + eps)` in f32; `x·s`, times `w` when given.
fn rms_norm(x: &[f32], w: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let scale = 1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt();
    match w {
        Some(w) => {
            for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
                *o = v * scale * g;
            }
        }
        None => {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = v * scale;
            }
        }
    }
}

/// Rounds to f16 and back (how rows are stored).
fn round16(x: &mut [f32]) {
    x.iter_mut()
        .for_each(|v| *v = fp16_to_fp32(fp32_to_fp16(*v)));
}

/// One hyper-connection control: `fn` (F16, `HC_MIX` rows of `N_HC·n_embd`),
/// the three scales (pre, post, combine) and the 24 biases.
struct HcWeights {
    fn_: F16x8,
    scale: [f32; 3],
    base: Vec<f32>,
}

/// A compressor: `kv` and `gate` (F16, `coff·dim` rows of `n_embd`), the
/// position embedding added to the scores (`ratio` rows of `coff·dim`), and
/// the RMSNorm of the pooled row.
struct Compressor {
    ape: Range<usize>,
    kv: F16x8,
    gate: F16x8,
    norm: Vec<f32>,
    /// Width of the emitted rows (head dim, or the indexer's 128).
    dim: usize,
}

struct Indexer {
    /// F16, `n_index_head·128` rows of `n_lora_q`.
    q_b: F16x8,
    /// F16, `n_index_head` rows of `n_embd`.
    proj: F16x8,
    comp: Compressor,
}

struct LayerWeights {
    ratio: usize,
    hc_attn: HcWeights,
    attn_norm: Vec<f32>,
    /// Q8_0: `n_lora_q` rows of `n_embd`.
    q_a: Q8_0x16,
    q_a_norm: Vec<f32>,
    /// Q8_0: `n_head·head_dim` rows of `n_lora_q`.
    q_b: Q8_0x16,
    /// Q8_0: `head_dim` rows of `n_embd`.
    kv: Q8_0x16,
    kv_norm: Vec<f32>,
    sinks: Vec<f32>,
    /// Q8_0: `n_out_group·n_lora_o` rows of one group's heads.
    out_a: Q8_0x16,
    /// Q8_0: `n_embd` rows of `n_out_group·n_lora_o`.
    out_b: Q8_0x16,
    comp: Option<Compressor>,
    index: Option<Indexer>,
    hc_ffn: HcWeights,
    ffn_norm: Vec<f32>,
    /// F16 router: `n_expert` rows of `n_embd`.
    gate_inp: F16x8,
    /// Added to the scores for the choice only.
    probs_bias: Option<Vec<f32>>,
    /// IQ2_XXS, per expert `n_ff_exp` rows of `n_embd`.
    gate_exps: Range<usize>,
    up_exps: Range<usize>,
    /// Q2_K, per expert `n_embd` rows of `n_ff_exp`.
    down_exps: Range<usize>,
    /// Q8_0 shared expert.
    sh_gate: Q8_0x16,
    sh_up: Q8_0x16,
    sh_down: Q8_0x16,
    /// Hash routing: the experts of each token id.
    tid2eid: Option<Vec<u32>>,
}

pub(crate) struct DeepSeek4 {
    d: Dims,
    tok_embd: Range<usize>,
    out_hc_fn: F16x8,
    out_hc_scale: f32,
    out_hc_base: Vec<f32>,
    output_norm: Vec<f32>,
    /// Q8_0: `n_vocab` rows of `n_embd`.
    output: Q8_0x16,
    layers: Vec<LayerWeights>,
    /// RoPE of the dense layers and of the compressed ones.
    rope_dense: TailRope,
    rope_comp: TailRope,
}

impl DeepSeek4 {
    fn bind(g: &Gguf, hp: &HParams) -> Result<Bound> {
        let d = Dims::from_gguf(g, hp)?;
        let float = |k: &str| -> Result<f32> { Ok(g.get_f64(&format!("deepseek4.{k}"))? as f32) };
        let rope_dense = TailRope::plain(hp.rope_base, d.n_rot);
        let rope_comp = TailRope::yarn(
            float("attention.compress_rope_freq_base")?,
            d.n_rot,
            float("rope.scaling.factor")?,
            g.get_u64("deepseek4.rope.scaling.original_context_length")? as f32,
            [
                float("rope.scaling.yarn_beta_fast")?,
                float("rope.scaling.yarn_beta_slow")?,
            ],
        );
        let mut b = Binder::new(g);
        // Matrices are regrouped for the lanes-over-rows kernels once; their
        // mapped pages then leave the resident set.
        let q8 = |b: &mut Binder<'_>, name: &str, n_in: usize, n_out: usize| -> Result<Q8_0x16> {
            let r = b.tensor(name, &[n_in, n_out], GgmlType::Q8_0)?;
            let packed = Q8_0x16::pack(blocks(&g.bytes()[r.clone()]), n_in / QK8_0);
            g.evict(r);
            Ok(packed)
        };
        let f16 = |b: &mut Binder<'_>, name: &str, n_in: usize, n_out: usize| -> Result<F16x8> {
            let r = b.tensor(name, &[n_in, n_out], GgmlType::F16)?;
            let packed = F16x8::pack(&g.bytes()[r.clone()], n_in);
            g.evict(r);
            Ok(packed)
        };
        let (e, hd) = (d.n_embd, d.head_dim);
        let hc_dim = N_HC * e;
        let tok_embd = b.tensor("token_embd.weight", &[e, d.n_vocab], GgmlType::F16)?;
        let out_hc_base = b.f32_vector("output_hc_base.weight", N_HC)?;
        let out_hc_fn = f16(&mut b, "output_hc_fn.weight", hc_dim, N_HC)?;
        let out_hc_scale = b.f32_vector("output_hc_scale.weight", 1)?[0];
        let output_norm = b.f32_vector("output_norm.weight", e)?;
        let output = q8(&mut b, "output.weight", e, d.n_vocab)?;
        let mut layers = Vec::with_capacity(hp.n_layer);
        for (il, &ratio) in d.ratios.iter().enumerate() {
            let n = |s: &str| format!("blk.{il}.{s}");
            let hc = |b: &mut Binder<'_>, which: &str| -> Result<HcWeights> {
                let scale = b.f32_vector(&n(&format!("hc_{which}_scale.weight")), 3)?;
                Ok(HcWeights {
                    fn_: f16(b, &n(&format!("hc_{which}_fn.weight")), hc_dim, HC_MIX)?,
                    scale: [scale[0], scale[1], scale[2]],
                    base: b.f32_vector(&n(&format!("hc_{which}_base.weight")), HC_MIX)?,
                })
            };
            let hc_attn = hc(&mut b, "attn")?;
            let compressor = |b: &mut Binder<'_>, prefix: &str, dim: usize| -> Result<Compressor> {
                let coff = if ratio == 4 { 2 } else { 1 };
                Ok(Compressor {
                    ape: b.tensor(
                        &n(&format!("{prefix}_ape.weight")),
                        &[coff * dim, ratio],
                        GgmlType::F16,
                    )?,
                    kv: f16(b, &n(&format!("{prefix}_kv.weight")), e, coff * dim)?,
                    gate: f16(b, &n(&format!("{prefix}_gate.weight")), e, coff * dim)?,
                    norm: b.f32_vector(&n(&format!("{prefix}_norm.weight")), dim)?,
                    dim,
                })
            };
            let group_in = hd * (d.n_head / d.n_out_group);
            let attn_norm = b.f32_vector(&n("attn_norm.weight"), e)?;
            let q_a = q8(&mut b, &n("attn_q_a.weight"), e, d.n_lora_q)?;
            let q_a_norm = b.f32_vector(&n("attn_q_a_norm.weight"), d.n_lora_q)?;
            let q_b = q8(&mut b, &n("attn_q_b.weight"), d.n_lora_q, d.n_head * hd)?;
            let kv = q8(&mut b, &n("attn_kv.weight"), e, hd)?;
            let kv_norm = b.f32_vector(&n("attn_kv_a_norm.weight"), hd)?;
            let sinks = b.f32_vector(&n("attn_sinks.weight"), d.n_head)?;
            let n_low = d.n_out_group * d.n_lora_o;
            let out_a = q8(&mut b, &n("attn_output_a.weight"), group_in, n_low)?;
            let out_b = q8(&mut b, &n("attn_output_b.weight"), n_low, e)?;
            let comp = (ratio != 0)
                .then(|| compressor(&mut b, "attn_compressor", hd))
                .transpose()?;
            let index = (ratio == 4)
                .then(|| -> Result<Indexer> {
                    Ok(Indexer {
                        q_b: f16(
                            &mut b,
                            &n("indexer.attn_q_b.weight"),
                            d.n_lora_q,
                            d.n_index_head * INDEX_DIM,
                        )?,
                        proj: f16(&mut b, &n("indexer.proj.weight"), e, d.n_index_head)?,
                        comp: compressor(&mut b, "indexer_compressor", INDEX_DIM)?,
                    })
                })
                .transpose()?;
            let hc_ffn = hc(&mut b, "ffn")?;
            let ffn_norm = b.f32_vector(&n("ffn_norm.weight"), e)?;
            let gate_inp = f16(&mut b, &n("ffn_gate_inp.weight"), e, d.n_expert)?;
            // Hash-routed layers never use a selection bias, even where the file has one.
            let probs_bias = b
                .has(&n("exp_probs_b.bias"))
                .then(|| b.f32_vector(&n("exp_probs_b.bias"), d.n_expert))
                .transpose()?
                .filter(|_| il >= d.n_hash_layer);
            let exps = [e, d.n_ff_exp, d.n_expert];
            let gate_exps = b.tensor(&n("ffn_gate_exps.weight"), &exps, GgmlType::IQ2_XXS)?;
            let up_exps = b.tensor(&n("ffn_up_exps.weight"), &exps, GgmlType::IQ2_XXS)?;
            let down_exps = b.tensor(
                &n("ffn_down_exps.weight"),
                &[d.n_ff_exp, e, d.n_expert],
                GgmlType::Q2_K,
            )?;
            let sh_gate = q8(&mut b, &n("ffn_gate_shexp.weight"), e, d.n_ff_exp)?;
            let sh_up = q8(&mut b, &n("ffn_up_shexp.weight"), e, d.n_ff_exp)?;
            let sh_down = q8(&mut b, &n("ffn_down_shexp.weight"), d.n_ff_exp, e)?;
            let tid2eid = (il < d.n_hash_layer)
                .then(|| -> Result<Vec<u32>> {
                    let name = n("ffn_gate_tid2eid.weight");
                    let r = b.tensor(&name, &[d.n_expert_used, d.n_vocab], GgmlType::I32)?;
                    g.bytes()[r]
                        .chunks_exact(4)
                        .map(|c| {
                            let v = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                            usize::try_from(v)
                                .ok()
                                .filter(|&v| v < d.n_expert)
                                .map(|v| v as u32)
                                .ok_or_else(|| {
                                    bad("expert_count", format!("{name} routes to expert {v}"))
                                })
                        })
                        .collect()
                })
                .transpose()?;
            layers.push(LayerWeights {
                ratio,
                hc_attn,
                attn_norm,
                q_a,
                q_a_norm,
                q_b,
                kv,
                kv_norm,
                sinks,
                out_a,
                out_b,
                comp,
                index,
                hc_ffn,
                ffn_norm,
                gate_inp,
                probs_bias,
                gate_exps,
                up_exps,
                down_exps,
                sh_gate,
                sh_up,
                sh_down,
                tid2eid,
            });
        }
        let f2 = b.finish(ENTRY.name)?;
        let model = DeepSeek4 {
            d,
            tok_embd,
            out_hc_fn,
            out_hc_scale,
            out_hc_base,
            output_norm,
            output,
            layers,
            rope_dense,
            rope_comp,
        };
        Ok((Box::new(model), f2))
    }

    fn spec(&self) -> CompressedSpec {
        CompressedSpec {
            ratios: self.d.ratios.clone(),
            head_dim: self.d.head_dim,
            index_dim: INDEX_DIM,
            window: self.d.window,
        }
    }
}

/// Named intermediates of a forward call of at most `max_rows` tokens (the
/// rows of all its sequences back to back).
struct Rows {
    /// Position and token id of every row.
    pos: Vec<usize>,
    ids: Vec<u32>,
    /// The four HC streams of every row, and the next ones.
    hc: Vec<f32>,
    hc_next: Vec<f32>,
    /// HC pre: the streams' RMSNorm, the controls (4 pre weights, 4 post
    /// gates, the combine matrix, once split).
    flat: Vec<f32>,
    ctl: Vec<f32>,
    /// The sublayer input and its RMSNorm.
    cur: Vec<f32>,
    norm: Vec<f32>,
    /// Attention.
    qa: Vec<f32>,
    qn: Vec<f32>,
    q: Vec<f32>,
    kv_raw: Vec<f32>,
    kv: Vec<f32>,
    /// `(cos, sin)` per row and pair, for the layer being run.
    rope: Vec<(f32, f32)>,
    /// Compressor projections (attention, indexer): kv and score per row.
    ckv: Vec<f32>,
    csc: Vec<f32>,
    ikv: Vec<f32>,
    isc: Vec<f32>,
    /// Compressed rows each row's query sees (after its own push), and the
    /// indexer's choice where it chose (sorted row indices).
    n_comp: Vec<usize>,
    visible: Vec<Vec<u32>>,
    iq: Vec<f32>,
    iw: Vec<f32>,
    heads: Vec<f32>,
    low: Vec<f32>,
    attn_out: Vec<f32>,
    /// FFN.
    router: Vec<f32>,
    sel: Vec<u32>,
    weight: Vec<f32>,
    xq: Vec<BlockQ8_K>,
    gate: Vec<f32>,
    up: Vec<f32>,
    midq: Vec<BlockQ8_K>,
    down: Vec<f32>,
    moe: Vec<f32>,
    sh_gate: Vec<f32>,
    sh_up: Vec<f32>,
    sh_out: Vec<f32>,
    acts: Q8Acts,
    /// Logits of the rows asked for, before they are handed out.
    logits: Vec<f32>,
}

impl Rows {
    fn new(d: &Dims, max_rows: usize) -> Self {
        let t = max_rows;
        let z = |n: usize| vec![0.0f32; t * n];
        let q_dim = d.n_head * d.head_dim;
        let k = d.n_expert_used;
        Rows {
            pos: vec![0; t],
            ids: vec![0; t],
            hc: z(N_HC * d.n_embd),
            hc_next: z(N_HC * d.n_embd),
            flat: z(N_HC * d.n_embd),
            ctl: z(HC_MIX),
            cur: z(d.n_embd),
            norm: z(d.n_embd),
            qa: z(d.n_lora_q),
            qn: z(d.n_lora_q),
            q: z(q_dim),
            kv_raw: z(d.head_dim),
            kv: z(d.head_dim),
            rope: vec![(0.0, 0.0); t * d.n_rot / 2],
            ckv: z(2 * d.head_dim),
            csc: z(2 * d.head_dim),
            ikv: z(2 * INDEX_DIM),
            isc: z(2 * INDEX_DIM),
            n_comp: vec![0; t],
            visible: vec![Vec::new(); t],
            iq: z(d.n_index_head * INDEX_DIM),
            iw: z(d.n_index_head),
            heads: z(q_dim),
            low: z(d.n_out_group * d.n_lora_o),
            attn_out: z(d.n_embd),
            router: z(d.n_expert),
            sel: vec![0; t * k],
            weight: z(k),
            xq: vec![BlockQ8_K::ZERO; t * d.n_embd / QK_K],
            gate: z(k * d.n_ff_exp),
            up: z(k * d.n_ff_exp),
            midq: vec![BlockQ8_K::ZERO; t * k * d.n_ff_exp / QK_K],
            down: z(k * d.n_embd),
            moe: z(d.n_embd),
            sh_gate: z(d.n_ff_exp),
            sh_up: z(d.n_ff_exp),
            sh_out: z(d.n_embd),
            acts: Default::default(),
            logits: Vec::new(),
        }
    }
}

/// Views mapped bytes as blocks; the sizes were checked when the tensors were bound.
fn blocks<B: bytemuck::Pod>(bytes: &[u8]) -> &[B] {
    bytemuck::try_cast_slice(bytes).expect("tensor sizes are checked at load")
}

/// HC split (`hc_split_sinkhorn_one`): `ctl` holds the 24 projected values on
/// entry, and on return the 4 pre weights, the 4 post gates and the combine
/// matrix `c[src + 4·dst]` after the Sinkhorn rounds.
fn hc_split(ctl: &mut [f32], w: &HcWeights, iters: usize, eps: f32) {
    let (mix, base) = (ctl.to_vec(), &w.base);
    for i in 0..N_HC {
        ctl[i] = sigmoid(mix[i] * w.scale[0] + base[i]) + eps;
        let o = N_HC + i;
        ctl[o] = 2.0 / (1.0 + (-(mix[o] * w.scale[1] + base[o])).exp());
    }
    let c = &mut ctl[2 * N_HC..];
    for dst in 0..N_HC {
        let row = dst * N_HC..(dst + 1) * N_HC;
        let mut max = NEG_INF;
        for idx in row.clone() {
            let v = mix[2 * N_HC + idx] * w.scale[2] + base[2 * N_HC + idx];
            c[idx] = v;
            if v > max {
                max = v;
            }
        }
        let mut sum = 0.0f32;
        for v in &mut c[row.clone()] {
            *v = (*v - max).exp();
            sum += *v;
        }
        let inv = 1.0 / sum;
        c[row].iter_mut().for_each(|v| *v = *v * inv + eps);
    }
    let normalize_cols = |c: &mut [f32]| {
        for src in 0..N_HC {
            let sum = (0..N_HC).fold(0.0f32, |s, dst| s + c[src + N_HC * dst]);
            let inv = 1.0 / (sum + eps);
            (0..N_HC).for_each(|dst| c[src + N_HC * dst] *= inv);
        }
    };
    normalize_cols(c);
    for _ in 1..iters {
        for dst in 0..N_HC {
            let row = &mut c[dst * N_HC..(dst + 1) * N_HC];
            let sum = row.iter().fold(0.0f32, |s, &v| s + v);
            let inv = 1.0 / (sum + eps);
            row.iter_mut().for_each(|v| *v *= inv);
        }
        normalize_cols(c);
    }
}

/// `out[d] = Σ_h x[h][d]·w[h]` in stream order.
fn hc_weighted_sum(x: &[f32], w: &[f32], out: &mut [f32]) {
    let n = out.len();
    for (d, o) in out.iter_mut().enumerate() {
        let mut acc = 0.0f32;
        for (h, &wh) in w.iter().enumerate().take(N_HC) {
            acc += x[h * n + d] * wh;
        }
        *o = acc;
    }
}

/// HC post: `out[dst] = block·post[dst] + Σ_src c[dst + 4·src]·x[src]`.
fn hc_post(block: &[f32], x: &[f32], ctl: &[f32], out: &mut [f32]) {
    let n = block.len();
    let (post, comb) = (&ctl[N_HC..2 * N_HC], &ctl[2 * N_HC..]);
    for dst in 0..N_HC {
        for d in 0..n {
            let mut acc = block[d] * post[dst];
            for src in 0..N_HC {
                acc += comb[dst + src * N_HC] * x[src * n + d];
            }
            out[dst * n + d] = acc;
        }
    }
}

/// `topk_desc`: the `k` largest scores, descending, ties to the lower index.
fn top_k_desc(score: &[f32], k: usize, idx: &mut [u32]) {
    let mut filled = 0;
    for (i, &s) in score.iter().enumerate() {
        let at = (0..k).find(|&j| j >= filled || s > score[idx[j] as usize]);
        if let Some(j) = at {
            let end = filled.min(k - 1);
            idx.copy_within(j..end, j + 1);
            idx[j] = i as u32;
            filled = (filled + 1).min(k);
        }
    }
}

impl Family for DeepSeek4 {
    fn entry(&self) -> &'static FamilyEntry {
        &ENTRY
    }

    /// A [`CompressedState`]; the K/V type does not apply (rows are f16-rounded
    /// values kept as f32, as the reference keeps them).
    fn new_state(
        &self,
        _hp: &HParams,
        n_ctx: usize,
        max_step: usize,
        _kv_type: KvType,
    ) -> Box<dyn SeqState> {
        Box::new(CompressedState::new(
            &self.spec(),
            n_ctx,
            max_step,
            self.d.n_vocab,
        ))
    }

    fn new_scratch(&self, _hp: &HParams, max_rows: usize) -> Scratch {
        Scratch::new(max_rows, Rows::new(&self.d, max_rows))
    }

    fn forward(
        &self,
        model: &Weights,
        pool: &ThreadPool,
        _precision: Precision,
        scratch: &mut Scratch,
        seqs: &mut [SeqStep<'_>],
    ) {
        let r = scratch.get::<Rows>();
        let bytes = model.gguf().bytes();
        let nt = self.rows_of(seqs, r);
        self.embed(bytes, nt, r);
        for (il, lw) in self.layers.iter().enumerate() {
            self.attention(bytes, pool, il, lw, nt, r, seqs);
            self.ffn(bytes, pool, lw, nt, r);
        }
        for s in seqs.iter_mut() {
            let n = s.tokens.len();
            state_of::<CompressedState>(&mut *s.state).advance(n);
        }
        self.output_head(pool, r, seqs);
    }
}

impl DeepSeek4 {
    /// Fills every row's position and token; returns the row count.
    fn rows_of(&self, seqs: &mut [SeqStep<'_>], r: &mut Rows) -> usize {
        let mut t = 0;
        for s in seqs.iter_mut() {
            let pos0 = s.state.len();
            for (i, &id) in s.tokens.iter().enumerate() {
                r.pos[t] = pos0 + i;
                r.ids[t] = id;
                t += 1;
            }
        }
        t
    }

    /// The embedding row of every token, copied into all four HC streams.
    fn embed(&self, bytes: &[u8], nt: usize, r: &mut Rows) {
        let e = self.d.n_embd;
        let table = &bytes[self.tok_embd.clone()];
        for t in 0..nt {
            let id = r.ids[t] as usize;
            let src = &table[2 * e * id..2 * e * (id + 1)];
            let hc = &mut r.hc[t * N_HC * e..(t + 1) * N_HC * e];
            ds4_kernels::f16::dequantize_row(src, &mut hc[..e]);
            let (first, rest) = hc.split_at_mut(e);
            rest.chunks_exact_mut(e)
                .for_each(|s| s.copy_from_slice(first));
        }
    }

    /// HC pre of every row (`hc_pre_from_state_one`): `r.cur` gets the sublayer
    /// input, `r.ctl` the split controls; then `r.norm` its RMSNorm with `norm_w`.
    fn hc_pre(&self, pool: &ThreadPool, w: &HcWeights, norm_w: &[f32], nt: usize, r: &mut Rows) {
        let (e, eps) = (self.d.n_embd, self.d.rms_eps);
        let hc_dim = N_HC * e;
        let hc = &r.hc[..nt * hc_dim];
        pool.for_each_row_block_mut(&mut r.flat[..nt * hc_dim], hc_dim, &|first, rows| {
            for (i, row) in rows.chunks_exact_mut(hc_dim).enumerate() {
                let t = first + i;
                rms_norm(&hc[t * hc_dim..(t + 1) * hc_dim], None, eps, row);
            }
        });
        matmul_f16_serial(
            pool,
            &w.fn_,
            &r.flat[..nt * hc_dim],
            &mut r.ctl[..nt * HC_MIX],
        );
        let (iters, hc_eps) = (self.d.sinkhorn_iters, self.d.hc_eps);
        for ctl in r.ctl[..nt * HC_MIX].chunks_exact_mut(HC_MIX) {
            hc_split(ctl, w, iters, hc_eps);
        }
        let ctl = &r.ctl[..nt * HC_MIX];
        pool.for_each_row_block_mut(&mut r.cur[..nt * e], e, &|first, rows| {
            for (i, row) in rows.chunks_exact_mut(e).enumerate() {
                let t = first + i;
                hc_weighted_sum(
                    &hc[t * hc_dim..(t + 1) * hc_dim],
                    &ctl[t * HC_MIX..t * HC_MIX + N_HC],
                    row,
                );
            }
        });
        let cur = &r.cur[..nt * e];
        pool.for_each_row_block_mut(&mut r.norm[..nt * e], e, &|first, rows| {
            for (i, row) in rows.chunks_exact_mut(e).enumerate() {
                let t = first + i;
                rms_norm(&cur[t * e..(t + 1) * e], Some(norm_w), eps, row);
            }
        });
    }

    /// HC post of every row with the sublayer output `block`; the streams move on.
    fn hc_post(&self, pool: &ThreadPool, block: &[f32], nt: usize, r: &mut Rows) {
        let e = self.d.n_embd;
        let hc_dim = N_HC * e;
        let (hc, ctl) = (&r.hc[..nt * hc_dim], &r.ctl[..nt * HC_MIX]);
        pool.for_each_row_block_mut(&mut r.hc_next[..nt * hc_dim], hc_dim, &|first, rows| {
            for (i, row) in rows.chunks_exact_mut(hc_dim).enumerate() {
                let t = first + i;
                hc_post(
                    &block[t * e..(t + 1) * e],
                    &hc[t * hc_dim..(t + 1) * hc_dim],
                    &ctl[t * HC_MIX..(t + 1) * HC_MIX],
                    row,
                );
            }
        });
        std::mem::swap(&mut r.hc, &mut r.hc_next);
    }

    /// `out = W·x` for Q8_0 `W` (in `groups` column groups) with `x` rounded
    /// to Q8_0 blocks with f32 scales.
    fn q8_matmul(
        pool: &ThreadPool,
        acts: &mut Q8Acts,
        w: &Q8_0x16,
        groups: usize,
        x: &[f32],
        out: &mut [f32],
    ) {
        acts.quantize(pool, x);
        matmul_q8_0_f32s(pool, w, groups, acts, out);
    }

    fn rope_of(&self, ratio: usize) -> &TailRope {
        if ratio == 0 {
            &self.rope_dense
        } else {
            &self.rope_comp
        }
    }

    /// The attention sublayer of layer `il` for every row.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        bytes: &[u8],
        pool: &ThreadPool,
        il: usize,
        lw: &LayerWeights,
        nt: usize,
        r: &mut Rows,
        seqs: &mut [SeqStep<'_>],
    ) {
        let d = &self.d;
        let (e, hd, eps) = (d.n_embd, d.head_dim, d.rms_eps);
        let q_dim = d.n_head * hd;
        self.hc_pre(pool, &lw.hc_attn, &lw.attn_norm, nt, r);
        let norm = &r.norm[..nt * e];
        // Low-rank queries, one RMSNorm per head; the K/V row from the same
        // rounded input.
        Self::q8_matmul(
            pool,
            &mut r.acts,
            &lw.q_a,
            1,
            norm,
            &mut r.qa[..nt * d.n_lora_q],
        );
        matmul_q8_0_f32s(pool, &lw.kv, 1, &r.acts, &mut r.kv_raw[..nt * hd]);
        let qa = &r.qa[..nt * d.n_lora_q];
        pool.for_each_row_block_mut(&mut r.qn[..nt * d.n_lora_q], d.n_lora_q, &|first, rows| {
            for (i, qn) in rows.chunks_exact_mut(d.n_lora_q).enumerate() {
                let t = first + i;
                rms_norm(
                    &qa[t * d.n_lora_q..(t + 1) * d.n_lora_q],
                    Some(&lw.q_a_norm),
                    eps,
                    qn,
                );
            }
        });
        Self::q8_matmul(
            pool,
            &mut r.acts,
            &lw.q_b,
            1,
            &r.qn[..nt * d.n_lora_q],
            &mut r.q[..nt * q_dim],
        );
        pool.for_each_row_block_mut(&mut r.q[..nt * q_dim], hd, &|_, rows| {
            for head in rows.chunks_exact_mut(hd) {
                let h = head.to_vec();
                rms_norm(&h, None, eps, head);
            }
        });
        // RoPE at each row's position, FP8 round trip of the K/V row.
        let rope = self.rope_of(lw.ratio);
        let n_pairs = d.n_rot / 2;
        let pos = &r.pos[..nt];
        for (t, table) in r.rope[..nt * n_pairs].chunks_exact_mut(n_pairs).enumerate() {
            rope.table(pos[t], table);
        }
        let tables = &r.rope[..nt * n_pairs];
        pool.for_each_row_block_mut(&mut r.q[..nt * q_dim], q_dim, &|first, rows| {
            for (i, q) in rows.chunks_exact_mut(q_dim).enumerate() {
                let t = first + i;
                rope.rotate(q, hd, &tables[t * n_pairs..(t + 1) * n_pairs], false);
            }
        });
        let kv_raw = &r.kv_raw[..nt * hd];
        pool.for_each_row_block_mut(&mut r.kv[..nt * hd], hd, &|first, rows| {
            for (i, kv) in rows.chunks_exact_mut(hd).enumerate() {
                let t = first + i;
                rms_norm(&kv_raw[t * hd..(t + 1) * hd], Some(&lw.kv_norm), eps, kv);
                rope.rotate(kv, hd, &tables[t * n_pairs..(t + 1) * n_pairs], false);
                qat::fp8_kv_round_trip(kv, d.n_rot);
            }
        });
        // Compressor projections of every row, then the state token by token.
        if let Some(c) = &lw.comp {
            let width = if lw.ratio == 4 { 2 * c.dim } else { c.dim };
            matmul_f16_serial(pool, &c.kv, norm, &mut r.ckv[..nt * width]);
            matmul_f16_serial(pool, &c.gate, norm, &mut r.csc[..nt * width]);
        }
        if let Some(ix) = &lw.index {
            let width = 2 * INDEX_DIM;
            matmul_f16_serial(pool, &ix.comp.kv, norm, &mut r.ikv[..nt * width]);
            matmul_f16_serial(pool, &ix.comp.gate, norm, &mut r.isc[..nt * width]);
        }
        let mut t = 0;
        for s in seqs.iter_mut() {
            let st = state_of::<CompressedState>(&mut *s.state);
            let raw_rows = st.raw_rows();
            let l = st.layer_mut(il);
            for _ in 0..s.tokens.len() {
                let p = r.pos[t];
                let row = p % raw_rows;
                let raw = &mut l.raw[row * hd..(row + 1) * hd];
                raw.copy_from_slice(&r.kv[t * hd..(t + 1) * hd]);
                round16(raw);
                if let Some(c) = &lw.comp {
                    self.compressor_step(bytes, c, lw.ratio, &r.ckv, &r.csc, t, p, l, false);
                }
                if let Some(ix) = &lw.index {
                    self.compressor_step(bytes, &ix.comp, 4, &r.ikv, &r.isc, t, p, l, true);
                }
                r.n_comp[t] = l.n_comp;
                t += 1;
            }
        }
        if let Some(ix) = &lw.index {
            self.indexer(pool, ix, nt, r, seqs, il);
        }
        // Attention of every row's heads, eight at a time, over the state as it
        // stood at that row.
        let mut t0 = 0;
        for s in seqs.iter_mut() {
            let n = s.tokens.len();
            let st = state_of::<CompressedState>(&mut *s.state);
            let raw_rows = st.raw_rows();
            let l = &*st.layer_mut(il);
            let (q, pos, n_comp, visible) = (&r.q, &r.pos, &r.n_comp, &r.visible);
            let heads = &mut r.heads[t0 * q_dim..(t0 + n) * q_dim];
            let seen = |t: usize| RowsSeen {
                raw: &l.raw,
                raw_rows,
                comp: &l.comp,
                n_comp: n_comp[t],
                visible: (lw.ratio == 4 && n_comp[t] > d.index_top_k).then(|| &visible[t][..]),
            };
            let groups = d.n_head / HEADS;
            pool.for_each_row_block_mut(heads, HEADS * hd, &|first, rows| {
                for (i, out) in rows.chunks_exact_mut(HEADS * hd).enumerate() {
                    let (t, h) = (t0 + (first + i) / groups, HEADS * ((first + i) % groups));
                    self.attend_heads16(
                        &q[t * q_dim + h * hd..t * q_dim + (h + HEADS) * hd],
                        &lw.sinks[h..h + HEADS],
                        pos[t],
                        &seen(t),
                        out,
                    );
                }
            });
            t0 += n;
        }
        let tables = &r.rope[..nt * n_pairs];
        pool.for_each_row_block_mut(&mut r.heads[..nt * q_dim], q_dim, &|first, rows| {
            for (i, heads) in rows.chunks_exact_mut(q_dim).enumerate() {
                let t = first + i;
                rope.rotate(heads, hd, &tables[t * n_pairs..(t + 1) * n_pairs], true);
            }
        });
        // Grouped low-rank output.
        let n_low = d.n_out_group * d.n_lora_o;
        Self::q8_matmul(
            pool,
            &mut r.acts,
            &lw.out_a,
            d.n_out_group,
            &r.heads[..nt * q_dim],
            &mut r.low[..nt * n_low],
        );
        Self::q8_matmul(
            pool,
            &mut r.acts,
            &lw.out_b,
            1,
            &r.low[..nt * n_low],
            &mut r.attn_out[..nt * e],
        );
        let block = std::mem::take(&mut r.attn_out);
        self.hc_post(pool, &block, nt, r);
        r.attn_out = block;
    }
}

/// What one query reads: the raw ring and the compressed rows it sees.
struct RowsSeen<'a> {
    raw: &'a [f32],
    raw_rows: usize,
    comp: &'a [f32],
    n_comp: usize,
    /// The indexer's choice among the compressed rows (sorted), when it chose.
    visible: Option<&'a [u32]>,
}

impl RowsSeen<'_> {
    /// The rows a query at `pos` reads, in the reference's order: the raw
    /// window (oldest first), then the visible compressed rows.
    fn rows(&self, pos: usize, window: usize, hd: usize) -> Vec<&[f32]> {
        let first = (pos + 1).saturating_sub(window);
        let raw = |p: usize| {
            let row = p % self.raw_rows;
            &self.raw[row * hd..(row + 1) * hd]
        };
        let comp = |c: usize| &self.comp[c * hd..(c + 1) * hd];
        match self.visible {
            Some(v) => (first..=pos)
                .map(raw)
                .chain(v.iter().map(|&c| comp(c as usize)))
                .collect(),
            None => (first..=pos)
                .map(raw)
                .chain((0..self.n_comp).map(comp))
                .collect(),
        }
    }
}

impl DeepSeek4 {
    /// One compressor's step for row `t` at position `pos`
    /// (`compressor_decode_one`): its projected kv and score (plus the
    /// position embedding) go into the frontier; at the window's last position
    /// the window is pooled (a softmax over the scores per dimension, ratio 4
    /// over its previous window's lane too), normalized, rotated to the
    /// window's first position, rounded (FP8, or Hadamard+FP4 for the indexer)
    /// and appended in f16 precision.
    #[allow(clippy::too_many_arguments)]
    fn compressor_step(
        &self,
        bytes: &[u8],
        c: &Compressor,
        ratio: usize,
        kv_all: &[f32],
        sc_all: &[f32],
        t: usize,
        pos: usize,
        l: &mut CompLayer,
        index: bool,
    ) {
        let dim = c.dim;
        let width = if ratio == 4 { 2 * dim } else { dim };
        let pos_mod = pos % ratio;
        let row = if ratio == 4 { ratio + pos_mod } else { pos_mod };
        let (state_kv, state_sc) = if index {
            (&mut l.index_kv, &mut l.index_score)
        } else {
            (&mut l.kv, &mut l.score)
        };
        state_kv[row * width..(row + 1) * width]
            .copy_from_slice(&kv_all[t * width..(t + 1) * width]);
        let ape = &bytes[c.ape.clone()][2 * width * pos_mod..2 * width * (pos_mod + 1)];
        for ((s, &v), a) in state_sc[row * width..(row + 1) * width]
            .iter_mut()
            .zip(&sc_all[t * width..(t + 1) * width])
            .zip(ape.chunks_exact(2))
        {
            *s = v + fp16_to_fp32([a[0], a[1]]);
        }
        if !(pos + 1).is_multiple_of(ratio) {
            return;
        }
        let mut pooled = vec![0.0f32; dim];
        for (j, out) in pooled.iter_mut().enumerate() {
            // Candidates (score, kv): ratio 4 takes lane A of rows 0..4 and lane B of rows 4..8, interleaved.
            let cand = |r: usize, lane_b: bool| {
                let i = if lane_b {
                    (ratio + r) * width + dim + j
                } else {
                    r * width + j
                };
                (state_sc[i], state_kv[i])
            };
            let mut max = NEG_INF;
            for r in 0..ratio {
                if ratio == 4 {
                    max = max.max(cand(r, false).0).max(cand(r, true).0);
                } else {
                    max = max.max(cand(r, false).0);
                }
            }
            if max <= NEG_INF * 0.5 {
                *out = 0.0;
                continue;
            }
            let (mut denom, mut sum) = (0.0f32, 0.0f32);
            for r in 0..ratio {
                if ratio == 4 {
                    let ((sp, kp), (sc, kc)) = (cand(r, false), cand(r, true));
                    let (wp, wc) = ((sp - max).exp(), (sc - max).exp());
                    denom += wp + wc;
                    sum += wp * kp;
                    sum += wc * kc;
                } else {
                    let (s, k) = cand(r, false);
                    let w = (s - max).exp();
                    denom += w;
                    sum += w * k;
                }
            }
            *out = if denom > 0.0 { sum / denom } else { 0.0 };
        }
        let mut out = vec![0.0f32; dim];
        rms_norm(&pooled, Some(&c.norm), self.d.rms_eps, &mut out);
        let rope = self.rope_of(ratio);
        let mut table = vec![(0.0, 0.0); self.d.n_rot / 2];
        rope.table(pos + 1 - ratio, &mut table);
        rope.rotate(&mut out, dim, &table, false);
        if index {
            qat::indexer_round_trip(&mut out);
        } else {
            qat::fp8_kv_round_trip(&mut out, self.d.n_rot);
        }
        round16(&mut out);
        let (rows, n) = if index {
            (&mut l.index, &mut l.n_index)
        } else {
            (&mut l.comp, &mut l.n_comp)
        };
        rows[*n * dim..(*n + 1) * dim].copy_from_slice(&out);
        *n += 1;
        if ratio == 4 {
            // The current window becomes the previous one.
            let (kv_prev, kv_cur) = state_kv.split_at_mut(ratio * width);
            kv_prev.copy_from_slice(kv_cur);
            let (sc_prev, sc_cur) = state_sc.split_at_mut(ratio * width);
            sc_prev.copy_from_slice(sc_cur);
        }
    }

    /// The lightning indexer of a ratio-4 layer: for every row that sees more
    /// compressed rows than the top-k, its queries (Hadamard+FP4 after RoPE)
    /// score each indexer row as `Σ_h w_h·max(0, q_h·k)`, and the top-k rows
    /// (ties to the lower index) become the rows its attention reads.
    #[allow(clippy::too_many_arguments)]
    fn indexer(
        &self,
        pool: &ThreadPool,
        ix: &Indexer,
        nt: usize,
        r: &mut Rows,
        seqs: &mut [SeqStep<'_>],
        il: usize,
    ) {
        let d = &self.d;
        let (ih, top_k) = (d.n_index_head, d.index_top_k);
        if !r.n_comp[..nt].iter().any(|&n| n > top_k) {
            return;
        }
        let iq_dim = ih * INDEX_DIM;
        let (qn, norm) = (&r.qn[..nt * d.n_lora_q], &r.norm[..nt * d.n_embd]);
        matmul_f16_serial(pool, &ix.q_b, qn, &mut r.iq[..nt * iq_dim]);
        matmul_f16_serial(pool, &ix.proj, norm, &mut r.iw[..nt * ih]);
        let rope = &self.rope_comp;
        let n_pairs = d.n_rot / 2;
        let (n_comp, tables) = (&r.n_comp[..nt], &r.rope[..nt * n_pairs]);
        pool.for_each_row_block_mut(&mut r.iq[..nt * iq_dim], iq_dim, &|first, rows| {
            for (i, q) in rows.chunks_exact_mut(iq_dim).enumerate() {
                let t = first + i;
                if n_comp[t] > top_k {
                    rope.rotate(q, INDEX_DIM, &tables[t * n_pairs..(t + 1) * n_pairs], false);
                    q.chunks_exact_mut(INDEX_DIM)
                        .for_each(qat::indexer_round_trip);
                }
            }
        });
        let scale = 1.0 / ((INDEX_DIM * ih) as f32).sqrt();
        let mut t0 = 0;
        for s in seqs.iter_mut() {
            let n = s.tokens.len();
            let st = state_of::<CompressedState>(&mut *s.state);
            let l = &*st.layer_mut(il);
            let (iq, iw) = (&r.iq, &r.iw);
            pool.for_each_chunk_mut(&mut r.visible[t0..t0 + n], 1, &|i, v| {
                let t = t0 + i;
                let n_comp = n_comp[t];
                if n_comp <= top_k {
                    return;
                }
                let w: Vec<f32> = iw[t * ih..(t + 1) * ih]
                    .iter()
                    .map(|&v| v * scale)
                    .collect();
                let q = &iq[t * iq_dim..(t + 1) * iq_dim];
                let scores = index_scores(q, &w, &l.index[..n_comp * INDEX_DIM]);
                let mut allowed = vec![false; n_comp];
                for _ in 0..top_k {
                    let mut best = 0;
                    let mut best_score = NEG_INF;
                    for (c, &sc) in scores.iter().enumerate() {
                        if !allowed[c] && sc > best_score {
                            best = c;
                            best_score = sc;
                        }
                    }
                    allowed[best] = true;
                }
                let v = &mut v[0];
                v.clear();
                v.extend((0..n_comp as u32).filter(|&c| allowed[c as usize]));
            });
            t0 += n;
        }
    }

    /// Sixteen heads' attention (`layer_attention_mixed_one`): scores of the
    /// raw window (oldest first) then of the visible compressed rows, the sink
    /// in the denominator only, values summed in that order. `q` and `out`
    /// hold the heads back to back; their scores run as sixteen serial sums
    /// side by side ([`dots16_serial`]), their values as sixteen weighted sums
    /// of the same rows ([`wsum16_serial`]), every head's sums in the
    /// reference's order.
    fn attend_heads16(
        &self,
        q: &[f32],
        sinks: &[f32],
        pos: usize,
        seen: &RowsSeen<'_>,
        out: &mut [f32],
    ) {
        let hd = self.d.head_dim;
        let kq_scale = 1.0 / (hd as f32).sqrt();
        let rows = seen.rows(pos, self.d.window, hd);
        let q_t = transpose(q, hd, HEADS);
        // scores[k][h], then the weights in their place.
        let mut scores = vec![[0.0f32; HEADS]; rows.len()];
        for (keys, sc) in rows
            .chunks(DOTS16_CHAINS)
            .zip(scores.chunks_mut(DOTS16_CHAINS))
        {
            dots16_serial(&q_t, keys, sc);
            sc.iter_mut().flatten().for_each(|s| *s *= kq_scale);
        }
        // Per head: the max over the sink and the scores, then the weights
        // and their sum in row order.
        let max: [f32; HEADS] = std::array::from_fn(|h| {
            scores
                .iter()
                .fold(sinks[h], |m, s| if s[h] > m { s[h] } else { m })
        });
        let mut denom: [f32; HEADS] = std::array::from_fn(|h| (sinks[h] - max[h]).exp());
        for s in scores.iter_mut() {
            for (h, s) in s.iter_mut().enumerate() {
                *s = (*s - max[h]).exp();
                denom[h] += *s;
            }
        }
        wsum16_serial(&scores, &rows, out);
        for (out, denom) in out.chunks_exact_mut(hd).zip(denom) {
            let inv = 1.0 / denom;
            out.iter_mut().for_each(|o| *o *= inv);
        }
    }
}

/// The indexer's score of every compressed row `c` of `keys` for one query
/// (`q`: its heads back to back, `w`: their weights):
/// `Σ_h max(k_c·q_h, 0)·w_h`, heads in order, each dot the reference's
/// serial sum (eight heads side by side).
fn index_scores(q: &[f32], w: &[f32], keys: &[f32]) -> Vec<f32> {
    let ih = w.len();
    let n_comp = keys.len() / INDEX_DIM;
    // dots[c * ih + h] = k_c · q_h
    let mut dots = vec![0.0f32; n_comp * ih];
    let keys: Vec<&[f32]> = keys.chunks_exact(INDEX_DIM).collect();
    for g in 0..ih / LANES {
        let q_t = transpose(
            &q[g * LANES * INDEX_DIM..(g + 1) * LANES * INDEX_DIM],
            INDEX_DIM,
            LANES,
        );
        for (c0, keys) in (0..).step_by(4).zip(keys.chunks(4)) {
            let mut v = [[0.0f32; LANES]; 4];
            dots8_serial(&q_t, keys, &mut v[..keys.len()]);
            for (j, v) in v[..keys.len()].iter().enumerate() {
                dots[(c0 + j) * ih + g * LANES..(c0 + j) * ih + (g + 1) * LANES].copy_from_slice(v);
            }
        }
    }
    dots.chunks_exact(ih)
        .map(|dh| {
            let mut s = 0.0f32;
            for (&dot, &wh) in dh.iter().zip(w) {
                s += if dot < 0.0 { 0.0 } else { dot } * wh;
            }
            s
        })
        .collect()
}

/// `lanes` vectors of `n` (back to back) transposed: element `i` of vector
/// `l` at `i·lanes + l`, the layout of [`dots8_serial`] and [`dots16_serial`].
fn transpose(v: &[f32], n: usize, lanes: usize) -> Vec<f32> {
    let mut t = vec![0.0f32; lanes * n];
    for (l, row) in v.chunks_exact(n).enumerate() {
        for (i, &x) in row.iter().enumerate() {
            t[i * lanes + l] = x;
        }
    }
    t
}

impl DeepSeek4 {
    /// The FFN sublayer for every row: routed experts and the shared expert.
    fn ffn(&self, bytes: &[u8], pool: &ThreadPool, lw: &LayerWeights, nt: usize, r: &mut Rows) {
        let d = &self.d;
        let (e, k, ff) = (d.n_embd, d.n_expert_used, d.n_ff_exp);
        self.hc_pre(pool, &lw.hc_ffn, &lw.ffn_norm, nt, r);
        let norm = &r.norm[..nt * e];
        // Router: sqrt(softplus(logit)); hash-routed layers take the token's table row.
        matmul_f16_serial(pool, &lw.gate_inp, norm, &mut r.router[..nt * d.n_expert]);
        for t in 0..nt {
            let probs: Vec<f32> = r.router[t * d.n_expert..(t + 1) * d.n_expert]
                .iter()
                .map(|&l| softplus(l).sqrt())
                .collect();
            let sel = &mut r.sel[t * k..(t + 1) * k];
            match &lw.tid2eid {
                Some(table) => {
                    let id = r.ids[t] as usize;
                    sel.copy_from_slice(&table[id * k..(id + 1) * k]);
                }
                None => {
                    let choice: Vec<f32> = match &lw.probs_bias {
                        Some(b) => probs.iter().zip(b).map(|(&p, &b)| p + b).collect(),
                        None => probs.clone(),
                    };
                    top_k_desc(&choice, k, sel);
                }
            }
            let weight = &mut r.weight[t * k..(t + 1) * k];
            let mut sum = 0.0f32;
            for (w, &s) in weight.iter_mut().zip(sel.iter()) {
                *w = probs[s as usize];
                sum += *w;
            }
            let sum = sum.max(MIN_WEIGHT_SUM);
            weight
                .iter_mut()
                .for_each(|w| *w = *w / sum * d.expert_weight_scale);
        }
        // Routed experts: IQ2_XXS gate and up on the Q8_K input, clamp, SwiGLU
        // times the router weight, Q2_K down on the Q8_K mid, summed in slot order.
        let nb = e / QK_K;
        q8_k::quantize_row_ref(norm, &mut r.xq[..nt * nb]);
        let (sel, xq) = (&r.sel[..nt * k], &r.xq[..nt * nb]);
        let gate_exps = blocks::<BlockIQ2_XXS>(&bytes[lw.gate_exps.clone()]);
        let up_exps = blocks::<BlockIQ2_XXS>(&bytes[lw.up_exps.clone()]);
        for (exps, out) in [(gate_exps, &mut r.gate), (up_exps, &mut r.up)] {
            matmul_experts_iq2_xxs(pool, exps, ff, nb, sel, xq, k, &mut out[..nt * k * ff]);
        }
        let clamp = d.swiglu_clamp;
        let weight = &r.weight[..nt * k];
        let up = &r.up[..nt * k * ff];
        pool.for_each_row_block_mut(&mut r.gate[..nt * k * ff], ff, &|first, rows| {
            for (i, g) in rows.chunks_exact_mut(ff).enumerate() {
                let p = first + i;
                for (g, &u) in g.iter_mut().zip(&up[p * ff..(p + 1) * ff]) {
                    let (mut gv, mut uv) = (*g, u);
                    if clamp > 1.0e-6 {
                        gv = gv.min(clamp);
                        uv = uv.clamp(-clamp, clamp);
                    }
                    *g = silu(gv) * uv * weight[p];
                }
            }
        });
        let nb_ff = ff / QK_K;
        q8_k::quantize_row_ref(&r.gate[..nt * k * ff], &mut r.midq[..nt * k * nb_ff]);
        let down_exps = blocks::<BlockQ2_K>(&bytes[lw.down_exps.clone()]);
        matmul_experts(
            pool,
            down_exps,
            e,
            nb_ff,
            sel,
            &r.midq[..nt * k * nb_ff],
            1,
            ds4_kernels::vec_dot_q2_k_q8_k,
            &mut r.down[..nt * k * e],
        );
        for (moe, down) in r.moe[..nt * e]
            .chunks_exact_mut(e)
            .zip(r.down.chunks_exact(k * e))
        {
            for (j, m) in moe.iter_mut().enumerate() {
                let mut acc = 0.0f32;
                for slot in 0..k {
                    acc += down[slot * e + j];
                }
                *m = acc;
            }
        }
        // Shared expert.
        let norm = &r.norm[..nt * e];
        Self::q8_matmul(
            pool,
            &mut r.acts,
            &lw.sh_gate,
            1,
            norm,
            &mut r.sh_gate[..nt * ff],
        );
        matmul_q8_0_f32s(pool, &lw.sh_up, 1, &r.acts, &mut r.sh_up[..nt * ff]);
        for (g, &u) in r.sh_gate[..nt * ff].iter_mut().zip(&r.sh_up[..nt * ff]) {
            *g = silu(*g) * u;
        }
        Self::q8_matmul(
            pool,
            &mut r.acts,
            &lw.sh_down,
            1,
            &r.sh_gate[..nt * ff],
            &mut r.sh_out[..nt * e],
        );
        for (m, &s) in r.moe[..nt * e].iter_mut().zip(&r.sh_out[..nt * e]) {
            *m += s;
        }
        let block = std::mem::take(&mut r.moe);
        self.hc_post(pool, &block, nt, r);
        r.moe = block;
    }

    /// The output head for the rows each sequence wants logits for: the HC
    /// streams reduced by sigmoid weights, RMSNorm, the Q8_0 projection.
    fn output_head(&self, pool: &ThreadPool, r: &mut Rows, seqs: &mut [SeqStep<'_>]) {
        let d = &self.d;
        let (e, eps) = (d.n_embd, d.rms_eps);
        let hc_dim = N_HC * e;
        let mut wanted = Vec::new();
        let mut t0 = 0;
        for s in seqs.iter() {
            let n = s.tokens.len();
            match s.logits {
                LogitsOut::Last(_) => wanted.push(t0 + n - 1),
                LogitsOut::All(_) => wanted.extend(t0..t0 + n),
            }
            t0 += n;
        }
        let nw = wanted.len();
        for (i, &t) in wanted.iter().enumerate() {
            rms_norm(
                &r.hc[t * hc_dim..(t + 1) * hc_dim],
                None,
                eps,
                &mut r.flat[i * hc_dim..(i + 1) * hc_dim],
            );
        }
        let mut pre = vec![0.0f32; nw * N_HC];
        matmul_f16_serial(pool, &self.out_hc_fn, &r.flat[..nw * hc_dim], &mut pre);
        for (i, &t) in wanted.iter().enumerate() {
            let w: Vec<f32> = pre[i * N_HC..(i + 1) * N_HC]
                .iter()
                .zip(&self.out_hc_base)
                .map(|(&p, &b)| sigmoid_stable(p * self.out_hc_scale + b) + d.hc_eps)
                .collect();
            hc_weighted_sum(
                &r.hc[t * hc_dim..(t + 1) * hc_dim],
                &w,
                &mut r.cur[i * e..(i + 1) * e],
            );
            let cur = r.cur[i * e..(i + 1) * e].to_vec();
            rms_norm(
                &cur,
                Some(&self.output_norm),
                eps,
                &mut r.norm[i * e..(i + 1) * e],
            );
        }
        r.logits.resize(nw * d.n_vocab, 0.0);
        Self::q8_matmul(
            pool,
            &mut r.acts,
            &self.output,
            1,
            &r.norm[..nw * e],
            &mut r.logits,
        );
        let mut at = 0;
        for s in seqs.iter_mut() {
            let out = match &mut s.logits {
                LogitsOut::Last(o) => &mut **o,
                LogitsOut::All(o) => &mut **o,
            };
            let n = out.len();
            out.copy_from_slice(&r.logits[at..at + n]);
            at += n;
        }
    }
}
