//! What the families bind and read: the hyper-parameters, the weight
//! matrices' places in the mapped GGUF (with the fast path's packed copies),
//! and the binder that validates them at load. Below [`crate::models`], which
//! runs on it, and [`crate::model`], which owns it.

use ds4_gguf::{GgmlType, Gguf, TensorInfo};
use ds4_kernels::act16::F2Matrix;
use ds4_kernels::matmul::WeightMatrix;
use ds4_kernels::WeightFormat;

use crate::error::{EngineError, Result};
use crate::rope::{RopeScaling, RopeScalingType};

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
    /// The scaling the file declares (`rope.scaling.type`, `.factor`,
    /// `.original_context_length`, or the older `rope.scale_linear`);
    /// [`RopeScaling::NONE`] when it declares none.
    pub rope_scaling: RopeScaling,
}

impl HParams {
    pub fn n_embd_q(&self) -> usize {
        self.n_head * self.head_dim
    }

    pub fn n_embd_kv(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// The hyper-parameters every family reads (`{arch}.*` keys); a family
    /// checks its own extra ones when it binds. `context_length` may be absent
    /// where the family names a default (`n_ctx_train_default`);
    /// `feed_forward_length` may be absent in a mixture-of-experts file, which
    /// then gives `expert_feed_forward_length`.
    pub(crate) fn from_gguf(
        g: &Gguf,
        arch: &str,
        n_vocab: usize,
        n_ctx_train_default: Option<usize>,
    ) -> Result<Self> {
        let arch = arch.to_string();
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
        let has = |name: &str| g.get(&format!("{arch}.{name}")).is_some();
        let n_ctx_train = match n_ctx_train_default {
            Some(n) if !has("context_length") => n,
            _ => int("context_length")?,
        };
        let n_ff = if has("feed_forward_length") || !has("expert_feed_forward_length") {
            int("feed_forward_length")?
        } else {
            int("expert_feed_forward_length")?
        };
        let rope_scaling = rope_scaling_of(g, &arch, n_ctx_train)?;
        let hp = HParams {
            n_vocab,
            n_ctx_train,
            n_embd,
            n_layer: int("block_count")?,
            n_head,
            n_head_kv,
            head_dim,
            n_ff,
            rms_eps: g.get_f64(&format!("{arch}.attention.layer_norm_rms_epsilon"))? as f32,
            rope_base,
            n_rot,
            rope_scaling,
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

/// The RoPE scaling a GGUF declares, [`RopeScaling::NONE`] when it declares none.
fn rope_scaling_of(g: &Gguf, arch: &str, n_ctx_train: usize) -> Result<RopeScaling> {
    let key = |k: &str| format!("{arch}.rope.{k}");
    let float = |k: &str| -> Result<Option<f32>> {
        match g.get(&key(k)) {
            Some(_) => Ok(Some(g.get_f64(&key(k))? as f32)),
            None => Ok(None),
        }
    };
    let kind = match g.get(&key("scaling.type")) {
        Some(_) => {
            let name = g.get_str(&key("scaling.type"))?;
            Some(
                name.parse::<RopeScalingType>()
                    .map_err(|e| bad(&key("scaling.type"), e))?,
            )
        }
        None => None,
    };
    let (kind, factor) = match (kind, float("scaling.factor")?, float("scale_linear")?) {
        (Some(k), Some(f), _) => (k, f),
        // llama.cpp reads a missing or zero factor as no scaling.
        (Some(_), None, _) => (RopeScalingType::None, 1.0),
        (None, _, Some(f)) => (RopeScalingType::Linear, f),
        (None, _, None) => (RopeScalingType::None, 1.0),
    };
    if kind == RopeScalingType::None || factor == 0.0 {
        return Ok(RopeScaling::NONE);
    }
    let n_ctx_orig = match g.get(&key("scaling.original_context_length")) {
        Some(_) => match usize::try_from(g.get_u64(&key("scaling.original_context_length"))?) {
            Ok(n) if n > 0 => n,
            _ => {
                return Err(bad(
                    &key("scaling.original_context_length"),
                    "must be a positive size".into(),
                ))
            }
        },
        None => n_ctx_train,
    };
    RopeScaling::new(kind, factor, n_ctx_orig)
        .map_err(|e| bad(&key("scaling.factor"), e.to_string()))
}

pub(crate) fn bad(key: &str, reason: String) -> EngineError {
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
    /// Index of its F2 layout (Q4_1, Q8_0, Q5_0, Q4_K, Q6_K) in the model's
    /// packed copies.
    pub f2: Option<usize>,
}

/// Checks a tensor's presence, shape and type while binding a family's layout, and
/// remembers which tensors were bound so leftovers can be reported.
/// Also packs every Q4_1, Q8_0, Q5_0, Q4_K and Q6_K matrix into the layout the
/// fast path runs ([`WeightMatrix::pack_f2`]): a copy the size of those tensors
/// (Q5_0 as Q8_0 where the kernel tier runs it so, the K-quants with f32
/// scales: 1.3-1.55 times), so the fast
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

    /// The bytes (as a range of the mapping) of a tensor of exactly `dims` and
    /// type `ty`, for layouts [`matrix`](Self::matrix) does not describe (3-D
    /// expert stacks, integer tables, formats the family's own kernels run),
    /// never packed.
    pub fn tensor(
        &mut self,
        name: &str,
        dims: &[usize],
        ty: GgmlType,
    ) -> Result<std::ops::Range<usize>> {
        let data_offset = self.g.data_offset;
        let t = self.info(name, dims)?;
        if t.ty != ty {
            return Err(EngineError::WrongType {
                name: name.into(),
                expected: ty.name(),
                found: t.ty.name().into(),
            });
        }
        let start = (data_offset + t.offset) as usize;
        Ok(start..start + t.n_bytes as usize)
    }

    /// A vector of `n` f32 values (norm weights), copied out of the mapping.
    pub fn f32_vector(&mut self, name: &str, n: usize) -> Result<Vec<f32>> {
        let g = self.g;
        let t = self.info(name, &[n])?;
        if t.ty != GgmlType::F32 {
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

/// A model's mapped GGUF, its hyper-parameters and the fast path's copies of
/// its matrices ([`TensorRef::f2`]): what a family's forward pass reads.
pub(crate) struct Weights {
    gguf: Gguf,
    pub hparams: HParams,
    f2: Vec<F2Matrix>,
}

impl Weights {
    pub(crate) fn new(gguf: Gguf, hparams: HParams, f2: Vec<F2Matrix>) -> Self {
        Weights { gguf, hparams, f2 }
    }

    pub(crate) fn gguf(&self) -> &Gguf {
        &self.gguf
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
