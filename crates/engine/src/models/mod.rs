//! Model families, one module each (hyper-parameters, tensor binding with
//! validation, forward pass), and the registry that maps a GGUF's
//! `general.architecture` to one.
//!
//! Adding a family is one module implementing [`Family`] plus one line in
//! [`FAMILIES`]; `Session`, the payload codec and the server do not change. A
//! family's forward pass runs a batch of sequences at once ([`SeqStep`]), each
//! with its own state, so every weight matrix is read once for all their rows.

pub mod deepseek4;
pub mod gemma3;
pub mod llama;
mod transformer;

use std::any::Any;

use ds4_gguf::Gguf;
use ds4_kernels::act16::F2Matrix;
use ds4_kernels::pool::ThreadPool;

use crate::error::{EngineError, Result};
use crate::kv_type::KvType;
use crate::ops::Precision;
use crate::rope::RopeScaling;
use crate::state::SeqState;
use crate::weights::{HParams, Weights};

/// What binding a family gives: its weights and forward pass, and the fast
/// path's packed copies its tensors index.
pub(crate) type Bound = (Box<dyn Family>, Vec<F2Matrix>);

/// One registry entry.
pub(crate) struct FamilyEntry {
    /// The family's name (what `ds4 info` and errors print).
    pub name: &'static str,
    /// The GGUF `general.architecture` it runs.
    pub arch: &'static str,
    /// What session payloads record (never reused for another family).
    pub payload_id: u32,
    /// Validates the family's hyper-parameters and exact tensor inventory and
    /// binds the weights; returns the fast path's packed copies the bound
    /// tensors index.
    pub bind: fn(&Gguf, &HParams) -> Result<Bound>,
    /// The trained context when the file does not say (`{arch}.context_length`
    /// absent); `None`: the key is required.
    pub n_ctx_train_default: Option<usize>,
}

/// Every family this build runs.
pub(crate) const FAMILIES: &[FamilyEntry] = &[llama::ENTRY, gemma3::ENTRY, deepseek4::ENTRY];

/// The GGUF architectures this build runs, in registry order.
pub fn supported_architectures() -> impl Iterator<Item = &'static str> {
    FAMILIES.iter().map(|f| f.arch)
}

/// The entry for `arch`, or an error listing the supported ones.
pub(crate) fn entry_for(arch: &str) -> Result<&'static FamilyEntry> {
    FAMILIES
        .iter()
        .find(|f| f.arch == arch)
        .ok_or_else(|| EngineError::UnsupportedArchitecture {
            arch: arch.to_string(),
            supported: supported_architectures().collect::<Vec<_>>().join(", "),
        })
}

/// A family's bound weights and what it does with them.
pub(crate) trait Family: Send + Sync {
    fn entry(&self) -> &'static FamilyEntry;

    /// A fresh state for one sequence of `n_ctx` positions whose forward calls
    /// append at most `max_step` tokens.
    fn new_state(
        &self,
        hp: &HParams,
        n_ctx: usize,
        max_step: usize,
        kv_type: KvType,
    ) -> Box<dyn SeqState>;

    /// Intermediates for forward calls of at most `max_rows` tokens in all.
    fn new_scratch(&self, hp: &HParams, max_rows: usize) -> Scratch;

    /// Runs every sequence's new tokens (at most the scratch's rows in all; each
    /// within its state's `max_step` and context, ids within the vocabulary: the
    /// caller validated them) after what its state holds, appending to the
    /// state and writing next-token logits. Each sequence's results are bitwise
    /// what it gets run alone.
    fn forward(
        &self,
        model: &Weights,
        pool: &ThreadPool,
        precision: Precision,
        scratch: &mut Scratch,
        seqs: &mut [SeqStep<'_>],
    );
}

/// One sequence of a forward call.
pub(crate) struct SeqStep<'a> {
    /// The state the family created; positions `state.len()..` are appended.
    pub state: &'a mut dyn SeqState,
    pub tokens: &'a [u32],
    /// The sequence's RoPE scaling (resolved for its context).
    pub scaling: RopeScaling,
    pub logits: LogitsOut<'a>,
    /// A decoding sequence whose first `len` positions hold bitwise the rows
    /// of the sequence at index `leader` of the same call (checked by the
    /// caller): attention may read those from the leader's state.
    pub share: Option<Share>,
}

/// See [`SeqStep::share`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Share {
    pub leader: usize,
    pub len: usize,
}

/// Where a forward pass writes a sequence's next-token logits.
pub(crate) enum LogitsOut<'a> {
    /// The last token's (`n_vocab`).
    Last(&'a mut [f32]),
    /// Every token's, row after row (`tokens.len() * n_vocab`). Each row is
    /// bitwise the row [`Last`](Self::Last) gives for that token.
    All(&'a mut [f32]),
}

/// A family's forward intermediates, type-erased so that `Session` holds one
/// without knowing the family.
pub(crate) struct Scratch {
    max_rows: usize,
    inner: Box<dyn Any + Send>,
}

impl Scratch {
    pub fn new<T: Any + Send>(max_rows: usize, inner: T) -> Self {
        Scratch {
            max_rows,
            inner: Box::new(inner),
        }
    }

    /// Most tokens (over all sequences) one forward call may run.
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// The family's own intermediates.
    ///
    /// # Panics
    /// When the scratch was made by another family (a caller's bug).
    pub fn get<T: Any>(&mut self) -> &mut T {
        self.inner
            .downcast_mut()
            .expect("scratch made by the same family")
    }
}

/// Downcasts a sequence's state to the family's type.
///
/// # Panics
/// When the state was made by another family (a caller's bug).
pub(crate) fn state_of<T: Any>(state: &mut dyn SeqState) -> &mut T {
    state
        .as_any_mut()
        .downcast_mut()
        .expect("state made by the same family")
}
