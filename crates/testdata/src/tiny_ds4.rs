//! The tiny synthetic DeepSeek V4 Flash model (`tiny_ds4.gguf`) the
//! `deepseek4` family is tested with, written by Rust code that produces the
//! same bytes as `shared/tools/make_tiny_ds4.py` (138,719,008 bytes, SHA-256
//! [`TINY_DS4_SHA256`], the checksum in `tests/vectors/ds4-tiny/README.md`),
//! so CI needs neither Python nor a download.
//!
//! Everything is a pure function of the seed and the tensor name:
//! - a counter-based splitmix64 stream per name, seeded with
//!   `fnv1a64("{seed}:{name}")`, output `k` (from 0) being
//!   `mix(seed + (k + 1)·0x9E3779B97F4A7C15)`;
//! - uniforms `(out >> 11)·2^-53`, normals by Box–Muller over pairs of
//!   uniforms (`sqrt(-2·ln_1p(-u0))·cos(2π·u1)`), in f64, then rounded once
//!   to f32 or f16; Q8_0 tensors go through ggml's reference quantizer from f32;
//! - Q2_K and IQ2_XXS expert blocks drawn directly from the stream (valid by
//!   construction), the hash-routing table by partial Fisher–Yates shuffles;
//! - a byte-level BPE vocabulary learned greedily on a fixed corpus.
//!
//! The script's numpy evaluates `log1p` with its own SIMD code, which can
//! differ from the platform's `ln_1p` by an ulp in f64; the values are then
//! rounded to f32 or f16, so that never shows (the checksum is checked).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use ds4_gguf::{GgmlType, GgufWriter, Value, ValueType};
use ds4_kernels::iq2_xxs::IQ2XXS_GRID;
use ds4_kernels::q8_0::{self, BlockQ8_0};
use sha2::{Digest, Sha256};

/// The file name under `$DS4_HOME/models`.
pub const TINY_DS4_FILE: &str = "tiny_ds4.gguf";
/// Its size in bytes.
pub const TINY_DS4_SIZE: u64 = 138_719_008;
/// Its SHA-256, as recorded with the reference vectors.
pub const TINY_DS4_SHA256: &str =
    "8f46119d1a583e1bbf008da634c91265277f1492a09de4c4bf924eeaa6550094";
/// The seed the vectors were made with.
pub const DEFAULT_SEED: u64 = 20_260_529;

const N_LAYER: usize = 6;
const N_EMBD: usize = 256;
const N_VOCAB: usize = 512;
const N_HEAD: usize = 16;
const N_HEAD_DIM: usize = 512;
const N_ROT: usize = 64;
const N_OUT_GROUP: usize = 8;
const N_LORA_Q: usize = 1024;
const N_LORA_O: usize = 1024;
const N_EXPERT: usize = 16;
const N_EXPERT_USED: usize = 6;
const N_FF_EXP: usize = 256;
const N_HASH_LAYER: usize = 3;
const N_SWA: usize = 128;
const N_INDEXER_HEAD: usize = 8;
const N_INDEXER_HEAD_DIM: usize = 128;
const N_INDEXER_TOP_K: usize = 32;
const N_HC: usize = 4;
const N_HC_SINKHORN_ITER: usize = 20;
const QK_K: usize = 256;

/// The special tokens, the last ids of the vocabulary.
pub const SPECIAL_TOKENS: [&str; 7] = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
];

const TOKENIZER_CORPUS: &str = "\
At first light the harbor smelled of rope, rain, and cedar smoke. The archivist
wrote notes in brown ink, never black, because black ink made old ledgers look
like court summonses. You are a careful assistant. Read the story, remember the
assignments, and answer the final task exactly. The quick brown fox jumps over
the lazy dog while the weather turns and the tide comes in. People speak, walk,
remember, repair things, argue about weather, and sometimes receive a private
assignment number written out in words. What is the capital of France? Paris is
the capital of France, and Rome is the capital of Italy. Count from one to ten:
one, two, three, four, five, six, seven, eight, nine, ten.
def main():
    for i in range(10):
        print(\"hello world\", i)
    return 0
int main(void) { return printf(\"%d\\n\", 42); }
The model reads the prompt, thinks, and then answers the question in English.
";

/// `$DS4_HOME/models/tiny_ds4.gguf`, written by [`write_tiny_ds4`] the first
/// time and checked against [`TINY_DS4_SHA256`] once per process.
///
/// # Panics
/// If it cannot be written, or its bytes are not the recorded ones.
pub fn tiny_ds4_path() -> PathBuf {
    static CHECKED: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    CHECKED
        .get_or_init(|| {
            let path = crate::models_dir().join(TINY_DS4_FILE);
            if !path.is_file() {
                write_tiny_ds4(&path).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
            }
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let got = hex(&Sha256::digest(&bytes));
            assert_eq!(
                got,
                TINY_DS4_SHA256,
                "{} is not the tiny model of the reference vectors; remove it to have it written again",
                path.display()
            );
            path
        })
        .clone()
}

/// Writes the model to `path` (through a temporary file in the same folder and
/// a rename, so concurrent writers never expose a partial file).
pub fn write_tiny_ds4(path: &Path) -> std::io::Result<()> {
    let bytes = tiny_ds4_bytes(DEFAULT_SEED).map_err(std::io::Error::other)?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("gguf.tmp.{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The GGUF image for `seed` (the reference model is [`DEFAULT_SEED`]).
pub fn tiny_ds4_bytes(seed: u64) -> Result<Vec<u8>, ds4_gguf::GgufError> {
    let tensors = build_tensors(seed);
    let (tokens, merges) = build_tokenizer();
    let mut w = GgufWriter::new();
    let s = |v: &str| Value::String(v.to_string());
    w.add_kv("general.architecture", s("deepseek4"));
    w.add_kv("general.name", s("ds4-tiny-oracle"));
    w.add_kv("general.alignment", Value::U32(32));
    w.add_kv("ds4_tiny.seed_lo", Value::U32(seed as u32));
    let u32s: [(&str, usize); 23] = [
        ("block_count", N_LAYER),
        ("embedding_length", N_EMBD),
        ("vocab_size", N_VOCAB),
        ("attention.head_count", N_HEAD),
        ("attention.head_count_kv", 1),
        ("attention.key_length", N_HEAD_DIM),
        ("attention.value_length", N_HEAD_DIM),
        ("rope.dimension_count", N_ROT),
        ("attention.q_lora_rank", N_LORA_Q),
        ("attention.output_lora_rank", N_LORA_O),
        ("attention.output_group_count", N_OUT_GROUP),
        ("expert_count", N_EXPERT),
        ("expert_used_count", N_EXPERT_USED),
        ("expert_feed_forward_length", N_FF_EXP),
        ("expert_shared_count", 1),
        ("hash_layer_count", N_HASH_LAYER),
        ("attention.sliding_window", N_SWA),
        ("attention.indexer.head_count", N_INDEXER_HEAD),
        ("attention.indexer.key_length", N_INDEXER_HEAD_DIM),
        ("attention.indexer.top_k", N_INDEXER_TOP_K),
        ("hyper_connection.count", N_HC),
        ("hyper_connection.sinkhorn_iterations", N_HC_SINKHORN_ITER),
        ("rope.scaling.original_context_length", 65536),
    ];
    for (k, v) in u32s {
        w.add_kv(format!("deepseek4.{k}"), Value::U32(v as u32));
    }
    let f32s: [(&str, f32); 8] = [
        ("rope.freq_base", 10000.0),
        ("rope.scaling.factor", 16.0),
        ("rope.scaling.yarn_beta_fast", 32.0),
        ("rope.scaling.yarn_beta_slow", 1.0),
        ("attention.compress_rope_freq_base", 160000.0),
        ("expert_weights_scale", 1.5),
        ("attention.layer_norm_rms_epsilon", 1.0e-6),
        ("hyper_connection.epsilon", 1.0e-6),
    ];
    for (k, v) in f32s {
        w.add_kv(format!("deepseek4.{k}"), Value::F32(v));
    }
    w.add_kv("deepseek4.expert_weights_norm", Value::Bool(true));
    let array = |elem, items| Value::Array { elem, items };
    w.add_kv(
        "deepseek4.attention.compress_ratios",
        array(
            ValueType::U32,
            (0..N_LAYER)
                .map(|il| Value::U32(compress_ratio(il) as u32))
                .collect(),
        ),
    );
    w.add_kv(
        "deepseek4.swiglu_clamp_exp",
        array(ValueType::F32, vec![Value::F32(10.0); N_LAYER]),
    );
    w.add_kv("tokenizer.ggml.model", s("gpt2"));
    w.add_kv("tokenizer.ggml.pre", s("joyai-llm"));
    let token_type: Vec<Value> = (0..N_VOCAB)
        .map(|i| {
            Value::I32(if i < N_VOCAB - SPECIAL_TOKENS.len() {
                1
            } else {
                3
            })
        })
        .collect();
    w.add_kv(
        "tokenizer.ggml.tokens",
        array(ValueType::String, tokens.iter().map(|t| s(t)).collect()),
    );
    w.add_kv(
        "tokenizer.ggml.merges",
        array(ValueType::String, merges.iter().map(|t| s(t)).collect()),
    );
    w.add_kv(
        "tokenizer.ggml.token_type",
        array(ValueType::I32, token_type),
    );
    let id = |t: &str| tokens.iter().position(|x| x == t).unwrap_or(0) as u32;
    w.add_kv(
        "tokenizer.ggml.bos_token_id",
        Value::U32(id(SPECIAL_TOKENS[0])),
    );
    w.add_kv(
        "tokenizer.ggml.eos_token_id",
        Value::U32(id(SPECIAL_TOKENS[1])),
    );
    for t in tensors {
        w.add_tensor(t.name, &t.dims, t.ty, t.data)?;
    }
    w.to_bytes()
}

/// `ds4_layer_compress_ratio`: two dense layers, then 4 and 128 alternating.
fn compress_ratio(il: usize) -> usize {
    match il {
        0 | 1 => 0,
        _ if il.is_multiple_of(2) => 4,
        _ => 128,
    }
}

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

fn fnv1a64(s: &str) -> u64 {
    s.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01B3)
    })
}

/// The splitmix64 stream of one tensor name.
struct Stream(u64);

impl Stream {
    fn new(seed: u64, name: &str) -> Self {
        Stream(fnv1a64(&format!("{seed}:{name}")))
    }

    fn u64s(&self, n: usize) -> Vec<u64> {
        (1..=n as u64)
            .map(|k| {
                let mut z = self.0.wrapping_add(k.wrapping_mul(GAMMA));
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^ (z >> 31)
            })
            .collect()
    }

    fn uniforms(&self, n: usize) -> Vec<f64> {
        self.u64s(n).into_iter().map(unit).collect()
    }

    fn normals(&self, n: usize) -> Vec<f64> {
        let u = self.uniforms(2 * n);
        u.chunks_exact(2)
            .map(|p| (-2.0 * (-p[0]).ln_1p()).sqrt() * (2.0 * std::f64::consts::PI * p[1]).cos())
            .collect()
    }
}

/// f64 to f16 bits rounded once, to nearest even (what numpy's
/// `astype(float16)` does; `half`'s conversion rounds through f32 first). Finite
/// inputs only; overflow gives infinity.
fn f64_to_f16(x: f64) -> u16 {
    let sign = if x.is_sign_negative() { 0x8000 } else { 0 };
    let a = x.abs();
    let mag = if a < 2f64.powi(-14) {
        (a * 2f64.powi(24)).round_ties_even() as u16
    } else {
        let e = a.log2().floor() as i32;
        // log2 may land one off at a power of two: fix the binade exactly.
        let e = if a < 2f64.powi(e) {
            e - 1
        } else if a >= 2f64.powi(e + 1) {
            e + 1
        } else {
            e
        };
        if e > 15 {
            0x7C00
        } else {
            let n = (a * 2f64.powi(10 - e)).round_ties_even() as u32;
            (((e + 15) as u32) << 10)
                .saturating_add(n - 1024)
                .min(0x7C00) as u16
        }
    };
    sign | mag
}

fn unit(x: u64) -> f64 {
    (x >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0)
}

struct Tensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: Vec<u8>,
}

struct Builder {
    seed: u64,
    tensors: Vec<Tensor>,
}

impl Builder {
    fn stream(&self, name: &str) -> Stream {
        Stream::new(self.seed, name)
    }

    fn normal(&self, name: &str, dims: &[usize], std: f64, mean: f64) -> Vec<f64> {
        let n = dims.iter().product();
        self.stream(name)
            .normals(n)
            .into_iter()
            .map(|z| z * std + mean)
            .collect()
    }

    fn push(&mut self, name: &str, dims: &[usize], ty: GgmlType, data: Vec<u8>) {
        self.tensors.push(Tensor {
            name: name.to_string(),
            dims: dims.iter().map(|&d| d as u64).collect(),
            ty,
            data,
        });
    }

    fn f32s(&mut self, name: &str, values: &[f64]) {
        let data = values
            .iter()
            .flat_map(|&v| (v as f32).to_le_bytes())
            .collect();
        self.push(name, &[values.len()], GgmlType::F32, data);
    }

    fn f32_normal(&mut self, name: &str, dims: &[usize], std: f64, mean: f64) {
        let x = self.normal(name, dims, std, mean);
        let data = x.iter().flat_map(|&v| (v as f32).to_le_bytes()).collect();
        self.push(name, dims, GgmlType::F32, data);
    }

    fn f16_normal(&mut self, name: &str, dims: &[usize], std: f64) {
        let x = self.normal(name, dims, std, 0.0);
        let data = x
            .iter()
            .flat_map(|&v| f64_to_f16(v).to_le_bytes())
            .collect();
        self.push(name, dims, GgmlType::F16, data);
    }

    /// Rows (of `dims[0]`) scaled by `row_scale` before rounding to f32.
    fn q8_0_normal(
        &mut self,
        name: &str,
        dims: &[usize],
        std: f64,
        row_scale: Option<(usize, f64)>,
    ) {
        let mut x = self.normal(name, dims, std, 0.0);
        if let Some((row, f)) = row_scale {
            x[row * dims[0]..(row + 1) * dims[0]]
                .iter_mut()
                .for_each(|v| *v *= f);
        }
        let x: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        let mut blocks = vec![BlockQ8_0::ZERO; x.len() / q8_0::QK8_0];
        q8_0::quantize_row_ref(&x, &mut blocks);
        let data = blocks.iter().flat_map(q8_0_bytes).collect();
        self.push(name, dims, GgmlType::Q8_0, data);
    }

    /// Q2_K blocks (scales, qs, d, dmin): per block one word for `d`, 16 for
    /// the scales (`sc` in 4..16, min nibble = scale nibble, so a weight is
    /// `d·sc·(q - 1.5)`), 64 for the quant bytes.
    fn q2_k(&mut self, name: &str, dims: &[usize], sigma: f64) {
        let nb = dims.iter().product::<usize>() / QK_K;
        let r = self.stream(name).u64s(nb * 81);
        let esc2 = (4..16u32).map(|s| (s * s) as f64).sum::<f64>() / 12.0;
        let mut data = Vec::with_capacity(nb * 84);
        for r in r.chunks_exact(81) {
            let d = (sigma / (esc2 * 1.25).sqrt()) * (0.75 + 0.5 * unit(r[0]));
            let d16 = half::f16::from_bits(f64_to_f16(d));
            let dmin16 = half::f16::from_f32(d16.to_f32() * 1.5);
            data.extend(r[1..17].iter().map(|&w| {
                let sc = 4 + (w % 12) as u8;
                sc | (sc << 4)
            }));
            data.extend(r[17..81].iter().map(|&w| w as u8));
            data.extend_from_slice(&d16.to_le_bytes());
            data.extend_from_slice(&dmin16.to_le_bytes());
        }
        self.push(name, dims, GgmlType::Q2_K, data);
    }

    /// IQ2_XXS blocks: one word for `d`, then per sub-block four grid indices,
    /// four 7-bit sign patterns and a scale in 3..13.
    fn iq2_xxs(&mut self, name: &str, dims: &[usize], sigma: f64) {
        let nb = dims.iter().product::<usize>() / QK_K;
        let r = self.stream(name).u64s(nb * 73);
        let grid_sq = IQ2XXS_GRID
            .iter()
            .flat_map(|g| g.to_le_bytes())
            .map(|b| (b as f64) * (b as f64))
            .sum::<f64>()
            / (256.0 * 8.0);
        let e_s2 = (3..13)
            .map(|s| (0.5 + s as f64) * (0.5 + s as f64))
            .sum::<f64>()
            / 10.0;
        let mut data = Vec::with_capacity(nb * 66);
        for r in r.chunks_exact(73) {
            let d = sigma / (grid_sq * e_s2 * 0.0625).sqrt() * (0.75 + 0.5 * unit(r[0]));
            data.extend_from_slice(&f64_to_f16(d).to_le_bytes());
            for sub in r[1..].chunks_exact(9) {
                data.extend(sub[..4].iter().map(|&w| w as u8));
                let signs = sub[4..8]
                    .iter()
                    .enumerate()
                    .fold(0u32, |acc, (g, &w)| acc | (((w & 0x7F) as u32) << (7 * g)));
                let packed = signs | ((3 + (sub[8] % 10) as u32) << 28);
                data.extend_from_slice(&packed.to_le_bytes());
            }
        }
        self.push(name, dims, GgmlType::IQ2_XXS, data);
    }

    /// Per token, `N_EXPERT_USED` distinct experts by a partial Fisher–Yates shuffle.
    fn tid2eid(&mut self, name: &str) {
        let r = self.stream(name).u64s(N_VOCAB * N_EXPERT_USED);
        let mut data = Vec::with_capacity(N_VOCAB * N_EXPERT_USED * 4);
        for r in r.chunks_exact(N_EXPERT_USED) {
            let mut perm: Vec<i32> = (0..N_EXPERT as i32).collect();
            for (j, &w) in r.iter().enumerate() {
                let k = j + (w % (N_EXPERT - j) as u64) as usize;
                perm.swap(j, k);
            }
            data.extend(perm[..N_EXPERT_USED].iter().flat_map(|v| v.to_le_bytes()));
        }
        self.push(name, &[N_EXPERT_USED, N_VOCAB], GgmlType::I32, data);
    }
}

/// A block's 34 bytes as ggml lays them out.
fn q8_0_bytes(b: &BlockQ8_0) -> Vec<u8> {
    let mut v = b.d.to_vec();
    v.extend(b.qs.iter().map(|&q| q as u8));
    v
}

fn build_tensors(seed: u64) -> Vec<Tensor> {
    let (e, v, h, hd) = (N_EMBD, N_VOCAB, N_HEAD, N_HEAD_DIM);
    let hc_dim = e * N_HC;
    let hc_mix = 2 * N_HC + N_HC * N_HC;
    let q_dim = h * hd;
    let inv = |n: usize| 1.0 / (n as f64).sqrt();
    let mut b = Builder {
        seed,
        tensors: Vec::new(),
    };
    b.f16_normal("token_embd.weight", &[e, v], 1.0);
    b.f32_normal("output_hc_base.weight", &[N_HC], 0.5, 0.0);
    b.f16_normal("output_hc_fn.weight", &[hc_dim, N_HC], inv(hc_dim));
    b.f32s("output_hc_scale.weight", &[1.0]);
    b.f32_normal("output_norm.weight", &[e], 0.1, 1.0);
    // The EOS row of the head is damped (x0.25) so greedy runs go on.
    let eos_id = v - SPECIAL_TOKENS.len() + 1;
    b.q8_0_normal("output.weight", &[e, v], 3.0 * inv(e), Some((eos_id, 0.25)));
    for il in 0..N_LAYER {
        let p = |s: &str| format!("blk.{il}.{s}");
        let ratio = compress_ratio(il);
        let hc_scale = |b: &Builder, name: &str| -> Vec<f64> {
            b.stream(name)
                .uniforms(3)
                .into_iter()
                .map(|u| 0.75 + 0.5 * u)
                .collect()
        };
        b.f16_normal(&p("hc_attn_fn.weight"), &[hc_dim, hc_mix], inv(hc_dim));
        let sc = hc_scale(&b, &p("hc_attn_scale.weight"));
        b.f32s(&p("hc_attn_scale.weight"), &sc);
        b.f32_normal(&p("hc_attn_base.weight"), &[hc_mix], 0.5, 0.0);
        b.f32_normal(&p("attn_norm.weight"), &[e], 0.1, 1.0);
        b.q8_0_normal(&p("attn_q_a.weight"), &[e, N_LORA_Q], inv(e), None);
        b.f32_normal(&p("attn_q_a_norm.weight"), &[N_LORA_Q], 0.1, 1.0);
        b.q8_0_normal(
            &p("attn_q_b.weight"),
            &[N_LORA_Q, q_dim],
            inv(N_LORA_Q),
            None,
        );
        b.q8_0_normal(&p("attn_kv.weight"), &[e, hd], inv(e), None);
        b.f32_normal(&p("attn_kv_a_norm.weight"), &[hd], 0.1, 1.0);
        b.f32_normal(&p("attn_sinks.weight"), &[h], 1.0, 0.0);
        let group_in = hd * (h / N_OUT_GROUP);
        b.q8_0_normal(
            &p("attn_output_a.weight"),
            &[group_in, N_OUT_GROUP * N_LORA_O],
            inv(group_in),
            None,
        );
        b.q8_0_normal(
            &p("attn_output_b.weight"),
            &[N_OUT_GROUP * N_LORA_O, e],
            inv(N_OUT_GROUP * N_LORA_O),
            None,
        );
        if ratio != 0 {
            let cw = if ratio == 4 { 2 * hd } else { hd };
            b.f16_normal(&p("attn_compressor_ape.weight"), &[cw, ratio], 0.5);
            b.f16_normal(&p("attn_compressor_kv.weight"), &[e, cw], inv(e));
            b.f16_normal(&p("attn_compressor_gate.weight"), &[e, cw], inv(e));
            b.f32_normal(&p("attn_compressor_norm.weight"), &[hd], 0.1, 1.0);
        }
        if ratio == 4 {
            let iw = 2 * N_INDEXER_HEAD_DIM;
            b.f16_normal(
                &p("indexer.attn_q_b.weight"),
                &[N_LORA_Q, N_INDEXER_HEAD * N_INDEXER_HEAD_DIM],
                inv(N_LORA_Q),
            );
            b.f16_normal(&p("indexer.proj.weight"), &[e, N_INDEXER_HEAD], inv(e));
            b.f16_normal(&p("indexer_compressor_ape.weight"), &[iw, ratio], 0.5);
            b.f16_normal(&p("indexer_compressor_kv.weight"), &[e, iw], inv(e));
            b.f16_normal(&p("indexer_compressor_gate.weight"), &[e, iw], inv(e));
            b.f32_normal(
                &p("indexer_compressor_norm.weight"),
                &[N_INDEXER_HEAD_DIM],
                0.1,
                1.0,
            );
        }
        b.f16_normal(&p("hc_ffn_fn.weight"), &[hc_dim, hc_mix], inv(hc_dim));
        let sc = hc_scale(&b, &p("hc_ffn_scale.weight"));
        b.f32s(&p("hc_ffn_scale.weight"), &sc);
        b.f32_normal(&p("hc_ffn_base.weight"), &[hc_mix], 0.5, 0.0);
        b.f32_normal(&p("ffn_norm.weight"), &[e], 0.1, 1.0);
        b.f16_normal(&p("ffn_gate_inp.weight"), &[e, N_EXPERT], inv(e));
        if il >= N_HASH_LAYER {
            b.f32_normal(&p("exp_probs_b.bias"), &[N_EXPERT], 0.1, 0.0);
        }
        b.iq2_xxs(&p("ffn_gate_exps.weight"), &[e, N_FF_EXP, N_EXPERT], inv(e));
        b.iq2_xxs(&p("ffn_up_exps.weight"), &[e, N_FF_EXP, N_EXPERT], inv(e));
        b.q2_k(
            &p("ffn_down_exps.weight"),
            &[N_FF_EXP, e, N_EXPERT],
            inv(N_FF_EXP),
        );
        b.q8_0_normal(&p("ffn_gate_shexp.weight"), &[e, N_FF_EXP], inv(e), None);
        b.q8_0_normal(&p("ffn_up_shexp.weight"), &[e, N_FF_EXP], inv(e), None);
        b.q8_0_normal(
            &p("ffn_down_shexp.weight"),
            &[N_FF_EXP, e],
            inv(N_FF_EXP),
            None,
        );
        if il < N_HASH_LAYER {
            b.tid2eid(&p("ffn_gate_tid2eid.weight"));
        }
    }
    b.tensors
}

/// GPT-2's byte-to-code-point table: printable bytes map to themselves, the
/// other 68 to U+0100.. in byte order.
fn bytes_to_unicode() -> [char; 256] {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut out = ['\0'; 256];
    let mut n = 0;
    for b in 0..256u32 {
        out[b as usize] = if printable(b) {
            char::from_u32(b).unwrap_or('\0')
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\0')
        };
    }
    out
}

/// The corpus split as `re.findall(r" ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+|\s+")`.
fn corpus_pieces(text: &str) -> Vec<&str> {
    let b = text.as_bytes();
    let is_space = |c: u8| matches!(c, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c);
    let is_other = |c: u8| !is_space(c) && !c.is_ascii_alphanumeric();
    let run = |mut i: usize, max: usize, f: &dyn Fn(u8) -> bool| {
        let start = i;
        while i < b.len() && i - start < max && f(b[i]) {
            i += 1;
        }
        i
    };
    let mut pieces = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let space = usize::from(b[i] == b' ');
        let classes: [(&dyn Fn(u8) -> bool, usize); 3] = [
            (&|c: u8| c.is_ascii_alphabetic(), usize::MAX),
            (&|c: u8| c.is_ascii_digit(), 3),
            (&is_other, usize::MAX),
        ];
        let mut end = None;
        for (f, max) in classes {
            for lead in [space, 0] {
                let e = run(i + lead, max, f);
                if e > i + lead {
                    end = Some(e);
                    break;
                }
            }
            if end.is_some() {
                break;
            }
        }
        let end = end.unwrap_or_else(|| run(i, usize::MAX, &is_space));
        pieces.push(&text[i..end]);
        i = end;
    }
    pieces
}

/// The vocabulary and merges: the 256 byte tokens, greedily learned merges
/// (most frequent pair first, ties to the smallest pair), the special tokens.
fn build_tokenizer() -> (Vec<String>, Vec<String>) {
    let b2u = bytes_to_unicode();
    let mut tokens: Vec<String> = b2u.iter().map(|c| c.to_string()).collect();
    let n_merge_tokens = N_VOCAB - 256 - SPECIAL_TOKENS.len();
    let mut words: HashMap<Vec<String>, usize> = HashMap::new();
    for p in corpus_pieces(TOKENIZER_CORPUS) {
        let sym = p.bytes().map(|b| b2u[b as usize].to_string()).collect();
        *words.entry(sym).or_insert(0) += 1;
    }
    let mut merges = Vec::new();
    let mut new_tokens: Vec<String> = Vec::new();
    while new_tokens.len() < n_merge_tokens {
        let mut counts: HashMap<(&str, &str), usize> = HashMap::new();
        for (w, c) in &words {
            for pair in w.windows(2) {
                *counts.entry((&pair[0], &pair[1])).or_insert(0) += c;
            }
        }
        let Some((best, _)) = counts
            .into_iter()
            .min_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)))
        else {
            break;
        };
        let (l, r) = (best.0.to_string(), best.1.to_string());
        let merged = format!("{l}{r}");
        merges.push(format!("{l} {r}"));
        if !tokens.contains(&merged) && !new_tokens.contains(&merged) {
            new_tokens.push(merged.clone());
        }
        let mut next: HashMap<Vec<String>, usize> = HashMap::new();
        for (w, c) in words {
            let mut out = Vec::with_capacity(w.len());
            let mut i = 0;
            while i < w.len() {
                if i + 1 < w.len() && w[i] == l && w[i + 1] == r {
                    out.push(merged.clone());
                    i += 2;
                } else {
                    out.push(w[i].clone());
                    i += 1;
                }
            }
            *next.entry(out).or_insert(0) += c;
        }
        words = next;
    }
    tokens.extend(new_tokens);
    tokens.extend(SPECIAL_TOKENS.iter().map(|s| s.to_string()));
    (tokens, merges)
}
