//! Typed errors of the GGUF reader and writer. Every variant names the field or
//! tensor at fault so a user can tell a truncated download from a foreign format.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {0} (this reader handles versions 2 and 3)")]
    UnsupportedVersion(u32),
    #[error("truncated GGUF: {what} needs {need} bytes at offset {offset}, file has {file_len}")]
    Truncated {
        what: String,
        offset: u64,
        need: u64,
        file_len: u64,
    },
    #[error("{what}: invalid metadata value type {type_id}")]
    InvalidValueType { what: String, type_id: u32 },
    #[error("{what}: string is not valid UTF-8")]
    InvalidUtf8 { what: String },
    #[error("{what}: count {count} cannot fit in the {remaining} bytes left in the file")]
    CountTooLarge {
        what: String,
        count: u64,
        remaining: u64,
    },
    #[error("metadata key {key:?} appears twice")]
    DuplicateKey { key: String },
    #[error("tensor {name:?} appears twice")]
    DuplicateTensor { name: String },
    #[error("tensor {name:?}: unknown ggml type id {type_id}")]
    UnknownTensorType { name: String, type_id: u32 },
    #[error("tensor {name:?}: {n_dims} dimensions (at most 4 are allowed)")]
    TooManyDims { name: String, n_dims: u32 },
    #[error("tensor {name:?}: shape {dims:?} is not a whole number of {ty} blocks or overflows")]
    BadShape {
        name: String,
        dims: Vec<u64>,
        ty: crate::GgmlType,
    },
    #[error("tensor {name:?}: offset {offset} is not a multiple of the alignment {alignment}")]
    MisalignedTensor {
        name: String,
        offset: u64,
        alignment: u64,
    },
    #[error(
        "tensor {name:?}: data [{offset}, {offset}+{len}) lies outside the file ({file_len} bytes)"
    )]
    TensorOutOfBounds {
        name: String,
        offset: u64,
        len: u64,
        file_len: u64,
    },
    #[error("general.alignment = {0} is not a power of two")]
    BadAlignment(u64),
    #[error("metadata key {key:?} is missing")]
    MissingKey { key: String },
    #[error("metadata key {key:?}: expected {expected}, found {found}")]
    WrongValueType {
        key: String,
        expected: &'static str,
        found: &'static str,
    },
    #[error("tensor {name:?} is missing")]
    MissingTensor { name: String },
    #[error("writer: {0}")]
    Writer(String),
}

pub type Result<T> = std::result::Result<T, GgufError>;
