//! A loaded model: the mapped GGUF, its hyper-parameters, the tokenizer and the
//! family's validated tensor binding. Loading checks every tensor's name, type and
//! shape up front so a wrong file fails here, not in the middle of a forward pass.

use std::path::Path;

use ds4_gguf::{Gguf, TensorInfo};
use ds4_kernels::act16::F2Matrix;
use ds4_kernels::matmul::WeightMatrix;
use ds4_kernels::WeightFormat;

use crate::error::{EngineError, Result};
use crate::models::llama::LlamaWeights;
use crate::tokenizer::Tokenizer;

/// Hyper-parameters shared by the transformer families, in llama.cpp's vocabulary.
#[derive(Clone, Debug, PartialEq)]
pub struct HParams {
    pub arch: String,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    pub n_rot: usize,
}

impl HParams {
    pub fn n_embd_q(&self) -> usize {
        self.n_head * self.head_dim
    }

    pub fn n_embd_kv(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    fn from_gguf(g: &Gguf, n_vocab: usize) -> Result<Self> {
        let arch = g.get_str("general.architecture")?.to_string();
        if arch != "llama" {
            return Err(EngineError::UnsupportedArchitecture(arch));
        }
        let int = |name: &str| -> Result<usize> {
            let key = format!("{arch}.{name}");
            let v = g.get_u64(&key)?;
            usize::try_from(v)
                .ok()
                .filter(|&v| v > 0)
                .ok_or_else(|| bad(&key, format!("{v} is not a positive size")))
        };
        let n_embd = int("embedding_length")?;
        let n_head = int("attention.head_count")?;
        let n_head_kv = int("attention.head_count_kv")?;
        let head_dim = match g.get(&format!("{arch}.attention.key_length")) {
            Some(_) => int("attention.key_length")?,
            None => n_embd / n_head,
        };
        let n_rot = match g.get(&format!("{arch}.rope.dimension_count")) {
            Some(_) => int("rope.dimension_count")?,
            None => head_dim,
        };
        let rope_base = match g.get(&format!("{arch}.rope.freq_base")) {
            Some(_) => g.get_f64(&format!("{arch}.rope.freq_base"))? as f32,
            None => 10_000.0,
        };
        let hp = HParams {
            n_vocab,
            n_ctx_train: int("context_length")?,
            n_embd,
            n_layer: int("block_count")?,
            n_head,
            n_head_kv,
            head_dim,
            n_ff: int("feed_forward_length")?,
            rms_eps: g.get_f64(&format!("{arch}.attention.layer_norm_rms_epsilon"))? as f32,
            rope_base,
            n_rot,
            arch,
        };
        if !hp.n_head.is_multiple_of(hp.n_head_kv) {
            return Err(bad(
                "attention.head_count_kv",
                format!("{} does not divide head_count {}", hp.n_head_kv, hp.n_head),
            ));
        }
        if hp.n_rot > hp.head_dim || !hp.n_rot.is_multiple_of(2) {
            return Err(bad(
                "rope.dimension_count",
                format!(
                    "{} must be even and at most the head size {}",
                    hp.n_rot, hp.head_dim
                ),
            ));
        }
        if !(hp.rms_eps > 0.0 && hp.rope_base > 0.0) {
            return Err(bad(
                "attention.layer_norm_rms_epsilon / rope.freq_base",
                "must be positive".into(),
            ));
        }
        Ok(hp)
    }
}

fn bad(key: &str, reason: String) -> EngineError {
    EngineError::BadHyperParameter {
        key: key.to_string(),
        reason,
    }
}

/// Where a weight lives in the mapping, validated at load.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TensorRef {
    pub fmt: WeightFormat,
    pub n_in: usize,
    pub n_out: usize,
    pub start: usize,
    pub len: usize,
    /// Index of its F2 layout (Q4_1 and Q8_0) in the model's packed copies.
    pub f2: Option<usize>,
}

/// Checks a tensor's presence, shape and type while binding a family's layout, and
/// remembers which tensors were bound so leftovers can be reported.
/// Also packs every Q4_1 and Q8_0 matrix into the layout the fast path runs
/// ([`WeightMatrix::pack_f2`]): a copy the size of those tensors, so the fast
/// path never reads the mapped blocks, whose pages are then dropped from the
/// resident set (the other precisions and the embedding lookup fault back in
/// what they read).
pub(crate) struct Binder<'g> {
    g: &'g Gguf,
    bound: Vec<bool>,
    f2: Vec<F2Matrix>,
}

impl<'g> Binder<'g> {
    pub fn new(g: &'g Gguf) -> Self {
        Binder {
            bound: vec![false; g.tensors.len()],
            g,
            f2: Vec::new(),
        }
    }

    fn info(&mut self, name: &str, dims: &[usize]) -> Result<&'g TensorInfo> {
        let idx = self
            .g
            .tensors
            .iter()
            .position(|t| t.name == name)
            .ok_or_else(|| EngineError::MissingTensor { name: name.into() })?;
        let t = &self.g.tensors[idx];
        let expected: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        if t.dims != expected {
            return Err(EngineError::WrongShape {
                name: name.into(),
                expected,
                found: t.dims.clone(),
            });
        }
        self.bound[idx] = true;
        Ok(t)
    }

    /// A matrix of `n_out` rows of `n_in` in any format the kernels run.
    pub fn matrix(&mut self, name: &str, n_in: usize, n_out: usize) -> Result<TensorRef> {
        let data_offset = self.g.data_offset;
        let t = self.info(name, &[n_in, n_out])?;
        let fmt = WeightFormat::from_ggml_type(t.ty.id()).ok_or_else(|| EngineError::WrongType {
            name: name.into(),
            expected: "a format the kernels support (f32, f16, bf16, q4_0, q4_1, q5_0, q8_0, q4_K, q6_K)",
            found: t.ty.name().into(),
        })?;
        let (start, len) = ((data_offset + t.offset) as usize, t.n_bytes as usize);
        let f2 = WeightMatrix::new(fmt, n_in, n_out, &self.g.bytes()[start..start + len])
            .ok_or_else(|| EngineError::WrongType {
                name: name.into(),
                expected: "a type whose blocks divide its rows",
                found: format!("{} in rows of {n_in}", fmt.name()),
            })?
            .pack_f2()
            .map(|packed| {
                self.f2.push(packed);
                self.g.evict(start..start + len);
                self.f2.len() - 1
            });
        Ok(TensorRef {
            fmt,
            n_in,
            n_out,
            start,
            len,
            f2,
        })
    }

    /// A vector of `n` f32 values (norm weights), copied out of the mapping.
    pub fn f32_vector(&mut self, name: &str, n: usize) -> Result<Vec<f32>> {
        let g = self.g;
        let t = self.info(name, &[n])?;
        if t.ty != ds4_gguf::GgmlType::F32 {
            return Err(EngineError::WrongType {
                name: name.into(),
                expected: "f32",
                found: t.ty.name().into(),
            });
        }
        Ok(g.data_of(t)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// Whether the file has a tensor called `name`.
    pub fn has(&self, name: &str) -> bool {
        self.g.tensor_info(name).is_some()
    }

    /// Fails on the first tensor no binding asked for; otherwise hands over the
    /// packed copies the bound [`TensorRef`]s index.
    pub fn finish(self, family: &'static str) -> Result<Vec<F2Matrix>> {
        match self.bound.iter().position(|b| !b) {
            Some(i) => Err(EngineError::UnexpectedTensor {
                name: self.g.tensors[i].name.clone(),
                family,
            }),
            None => Ok(self.f2),
        }
    }
}

/// What a checkpoint must match to be loaded into a model: 16 bytes naming the
/// architecture, hyper-parameters, tokenizer, model identity and tensor shapes, and
/// 8 bytes naming the quantization (tensor types), which may differ between
/// checkpoints of the same model unless the operator forbids it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    pub model: [u8; 16],
    pub quant: [u8; 8],
}

impl Fingerprint {
    fn of(g: &Gguf, arch: &str) -> Self {
        use xxhash_rust::xxh3::Xxh3;
        const IDENTITY: &[&str] = &[
            "general.architecture",
            "general.name",
            "general.basename",
            "general.finetune",
            "general.size_label",
            "general.version",
        ];
        let mut model = Xxh3::new();
        let arch_prefix = format!("{arch}.");
        for (k, v) in &g.metadata {
            let counts = IDENTITY.contains(&k.as_str())
                || k.starts_with(&arch_prefix)
                || (k.starts_with("tokenizer.") && k != "tokenizer.chat_template");
            if counts {
                model.update(k.as_bytes());
                model.update(format!("{v:?}").as_bytes());
            }
        }
        let mut quant = Xxh3::new();
        for t in &g.tensors {
            model.update(t.name.as_bytes());
            for d in &t.dims {
                model.update(&d.to_le_bytes());
            }
            quant.update(t.name.as_bytes());
            quant.update(&t.ty.id().to_le_bytes());
        }
        Fingerprint {
            model: model.digest128().to_le_bytes(),
            quant: quant.digest().to_le_bytes(),
        }
    }
}

/// A model ready to run.
pub struct Model {
    gguf: Gguf,
    pub hparams: HParams,
    pub tokenizer: Tokenizer,
    pub fingerprint: Fingerprint,
    pub(crate) weights: LlamaWeights,
    /// The fast path's copies of the Q4_1 and Q8_0 matrices ([`TensorRef::f2`]).
    f2: Vec<F2Matrix>,
}

impl Model {
    /// Maps and validates the GGUF at `path`.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_gguf(Gguf::open(path)?)
    }

    pub fn from_gguf(gguf: Gguf) -> Result<Self> {
        let tokenizer = Tokenizer::from_gguf(&gguf)?;
        let n_vocab = tokenizer.n_vocab();
        let hparams = HParams::from_gguf(&gguf, n_vocab)?;
        if let Some(v) = gguf.get(&format!("{}.vocab_size", hparams.arch)) {
            if v.as_u64() != Some(n_vocab as u64) {
                return Err(bad(
                    "vocab_size",
                    format!("{v:?} disagrees with the tokenizer's {n_vocab} tokens"),
                ));
            }
        }
        let (weights, f2) = LlamaWeights::bind(&gguf, &hparams)?;
        let fingerprint = Fingerprint::of(&gguf, &hparams.arch);
        Ok(Model {
            gguf,
            hparams,
            tokenizer,
            fingerprint,
            weights,
            f2,
        })
    }

    pub fn gguf(&self) -> &Gguf {
        &self.gguf
    }

    /// The chat template shipped in the GGUF, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.gguf
            .get("tokenizer.chat_template")
            .and_then(|v| v.as_str())
    }

    pub(crate) fn matrix(&self, t: &TensorRef) -> WeightMatrix<'_> {
        WeightMatrix {
            fmt: t.fmt,
            n_in: t.n_in,
            n_out: t.n_out,
            data: &self.gguf.bytes()[t.start..t.start + t.len],
            f2: t.f2.map(|i| &self.f2[i]),
        }
    }
}
