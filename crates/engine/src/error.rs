//! Engine errors. Loading errors name the tensor or key and what was expected, so a
//! wrong or damaged model fails at load time with one precise line.

use ds4_gguf::GgufError;

use crate::tokenizer::TokenizerError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] TokenizerError),
    #[error("unsupported architecture {arch:?} (this build runs: {supported})")]
    UnsupportedArchitecture { arch: String, supported: String },
    #[error("hyper-parameter {key}: {reason}")]
    BadHyperParameter { key: String, reason: String },
    #[error("tensor {name:?} is missing")]
    MissingTensor { name: String },
    #[error("tensor {name:?} has shape {found:?}, expected {expected:?}")]
    WrongShape {
        name: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
    #[error("tensor {name:?} has type {found}, expected {expected}")]
    WrongType {
        name: String,
        expected: &'static str,
        found: String,
    },
    #[error("tensor {name:?} is not part of the {family} layout")]
    UnexpectedTensor { name: String, family: &'static str },
    #[error("context is full: {needed} tokens needed, the context holds {n_ctx}")]
    ContextFull { needed: usize, n_ctx: usize },
    #[error("token id {id} is outside the vocabulary ({n_vocab} tokens)")]
    TokenOutOfRange { id: u32, n_vocab: usize },
    #[error("no logits yet: prefill at least one token first")]
    NoLogits,
    #[error("cannot rewind to {to} tokens: the session holds {len}")]
    RewindBeyondEnd { to: usize, len: usize },
    #[error(
        "cannot cut the session back to {to} of its {len} tokens: its sliding-window \
         layers no longer hold the rows that position reads (restore a snapshot or prefill again)"
    )]
    CannotCutBack { to: usize, len: usize },
    #[error("cannot keep {n} tokens of a {step}-token step: {why}")]
    KeepVerified {
        n: usize,
        step: usize,
        why: &'static str,
    },
    #[error("batch: {reason}")]
    Batch { reason: String },
    #[error("session payload holds {payload} K/V; this session stores {session} (--kv-type)")]
    KvTypeMismatch {
        payload: crate::kv_type::KvType,
        session: crate::kv_type::KvType,
    },
    #[error("RoPE scaling: {reason}")]
    BadRopeScaling { reason: String },
    #[error(
        "a context of {n_ctx} tokens is beyond {max}: the model was trained on {n_ctx_train}, \
         and without a RoPE scale factor F covering it (F x trained context >= the context, \
         --rope-scale) a session may be at most 4x that"
    )]
    ContextBeyondRope {
        n_ctx: usize,
        n_ctx_train: usize,
        max: usize,
    },
    #[error("session payload: {reason}")]
    Payload { reason: String },
    #[error("prefill cancelled after {done} of {total} tokens")]
    Cancelled { done: usize, total: usize },
    #[error("session payload I/O: {0}")]
    PayloadIo(#[source] std::io::Error),
}

pub type Result<T> = std::result::Result<T, EngineError>;
