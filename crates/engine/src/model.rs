//! A loaded model: the mapped GGUF, its hyper-parameters, the tokenizer and the
//! family's validated tensor binding. Loading checks every tensor's name, type and
//! shape up front so a wrong file fails here, not in the middle of a forward pass.

use std::path::Path;

use ds4_gguf::{DigestOptions, Gguf};

use crate::error::Result;
use crate::kv_type::KvType;
use crate::models::{self, Family};
use crate::rope::{ModelRope, RopeRequest, RopeScaling};
use crate::tokenizer::Tokenizer;
use crate::weights::{bad, HParams, Weights};

/// What a checkpoint must match to be loaded into a model: 16 bytes naming the
/// architecture, hyper-parameters, tokenizer, model identity and tensor shapes,
/// 8 bytes naming the quantization (tensor types), which may differ between
/// checkpoints of the same model unless the operator forbids it, and 16 bytes
/// naming the tensor data itself ([`Gguf::data_digest`]), which must match
/// within one quantization.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    pub model: [u8; 16],
    pub quant: [u8; 8],
    pub weights: [u8; 16],
}

impl Fingerprint {
    fn of(g: &Gguf, arch: &str, weights: [u8; 16]) -> Self {
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
            weights,
        }
    }
}

/// A model ready to run.
pub struct Model {
    /// The mapped file, its hyper-parameters and the bound matrices' copies.
    pub(crate) weights: Weights,
    pub tokenizer: Tokenizer,
    pub fingerprint: Fingerprint,
    /// The family's bound weights and forward pass.
    pub(crate) family: Box<dyn Family>,
    /// The operator's RoPE scaling request, which every session resolves for its
    /// context ([`RopeRequest::resolve`]).
    rope_request: RopeRequest,
}

impl Model {
    /// Maps and validates the GGUF at `path`, hashing its tensor data.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        Self::load_with(path, &DigestOptions::default())
    }

    /// [`Model::load`], with the tensor data's digest taken from (and kept in) a
    /// cache and its progress reported, as `digest` says.
    pub fn load_with(path: impl AsRef<Path>, digest: &DigestOptions<'_>) -> Result<Self> {
        Self::from_gguf_with(Gguf::open(path)?, digest)
    }

    /// Dispatches on `general.architecture` to the family registry; an
    /// architecture no family runs fails here, listing the ones that do.
    pub fn from_gguf(gguf: Gguf) -> Result<Self> {
        Self::from_gguf_with(gguf, &DigestOptions::default())
    }

    fn from_gguf_with(gguf: Gguf, digest: &DigestOptions<'_>) -> Result<Self> {
        let arch = gguf.get_str("general.architecture")?;
        let entry = models::entry_for(arch)?;
        let tokenizer = Tokenizer::from_gguf(&gguf)?;
        let n_vocab = tokenizer.n_vocab();
        let hparams = HParams::from_gguf(&gguf, entry.arch, n_vocab, entry.n_ctx_train_default)?;
        if let Some(v) = gguf.get(&format!("{}.vocab_size", hparams.arch)) {
            if v.as_u64() != Some(n_vocab as u64) {
                return Err(bad(
                    "vocab_size",
                    format!("{v:?} disagrees with the tokenizer's {n_vocab} tokens"),
                ));
            }
        }
        let (family, f2) = (entry.bind)(&gguf, &hparams)?;
        // After binding, so a wrong file fails before its data is read.
        let fingerprint = Fingerprint::of(&gguf, &hparams.arch, gguf.data_digest(digest));
        Ok(Model {
            weights: Weights::new(gguf, hparams, f2),
            tokenizer,
            fingerprint,
            family,
            rope_request: RopeRequest::default(),
        })
    }

    /// Sets the RoPE scaling request of the sessions created after this
    /// (`--rope-scaling`, `--rope-scale`); refuses an invalid one.
    pub fn set_rope_request(&mut self, req: RopeRequest) -> Result<()> {
        req.validate()?;
        self.rope_request = req;
        Ok(())
    }

    pub fn rope_request(&self) -> RopeRequest {
        self.rope_request
    }

    /// The RoPE scaling a session of `n_ctx` positions runs with, or why that
    /// context is refused ([`RopeRequest::resolve_checked`]).
    pub fn rope_scaling_for(&self, n_ctx: usize) -> Result<RopeScaling> {
        self.rope_request.resolve_checked(self.model_rope(), n_ctx)
    }

    /// The family's name (`llama`, `gemma3`).
    pub fn family_name(&self) -> &'static str {
        self.family.entry().name
    }

    /// What the file says of its positions, for resolving a RoPE scaling.
    pub(crate) fn model_rope(&self) -> ModelRope {
        ModelRope {
            file: self.hparams().rope_scaling,
            n_ctx_train: self.hparams().n_ctx_train,
        }
    }

    pub fn hparams(&self) -> &HParams {
        &self.weights.hparams
    }

    pub fn gguf(&self) -> &Gguf {
        self.weights.gguf()
    }

    /// The chat template shipped in the GGUF, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.gguf()
            .get("tokenizer.chat_template")
            .and_then(|v| v.as_str())
    }
}

impl KvType {
    /// The fingerprint checkpoints of a session of this K/V type on `model` are
    /// filed under ([`crate::Session::state_fingerprint`]).
    pub fn state_fingerprint(self, model: &Fingerprint) -> [u8; 16] {
        match self {
            KvType::F32 => model.model,
            KvType::F16 => {
                let mut h = xxhash_rust::xxh3::Xxh3::new();
                h.update(&model.model);
                h.update(b"ds4 kv-type f16");
                h.digest128().to_le_bytes()
            }
        }
    }
}
