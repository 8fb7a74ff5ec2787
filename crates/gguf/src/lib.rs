//! GGUF: the model file format of the ggml ecosystem. This crate reads it (memory
//! mapped, zero-copy tensor views, every metadata type, versions 2 and 3) and writes
//! it (version 3). Untrusted input never panics: every failure is a [`GgufError`]
//! that names the field or tensor at fault.

mod digest;
mod error;
mod reader;
mod types;
mod value;
mod writer;

pub use digest::{DigestEvent, DigestOptions, FileIdentity, CHUNK as DIGEST_CHUNK};
pub use error::{GgufError, Result};
pub use reader::{Gguf, TensorInfo, DEFAULT_ALIGNMENT, GGUF_MAGIC};
pub use types::GgmlType;
pub use value::{Value, ValueType};
pub use writer::GgufWriter;

#[cfg(test)]
mod tests;
