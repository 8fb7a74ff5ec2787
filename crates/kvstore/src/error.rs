//! Errors and file defects. A [`Defect`] is a fact about one file (why it is never
//! loaded); a [`KvError`] is what an operation returns. Both carry the facts an operator
//! needs to act on a log line.

use std::io;
use std::path::PathBuf;

use crate::format::{FORMAT_VERSION, HEADER_LEN};

/// Why a file in the store directory is not a usable checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Defect {
    #[error("empty file (0 bytes)")]
    Empty,
    #[error("file has {len} bytes, shorter than the {HEADER_LEN}-byte header")]
    ShortHeader { len: u64 },
    #[error("bad magic {found:02x?}, expected \"KVC\"")]
    BadMagic { found: [u8; 3] },
    #[error("unsupported format version {found} (this build reads version {FORMAT_VERSION})")]
    UnsupportedVersion { found: u8 },
    #[error("header checksum mismatch (stored {stored:016x}, computed {computed:016x})")]
    HeaderChecksum { stored: u64, computed: u64 },
    #[error("invalid header field {field} = {value}")]
    BadField { field: &'static str, value: u64 },
    #[error("file is {actual} bytes but its header describes {expected} bytes")]
    SizeMismatch { actual: u64, expected: u64 },
    #[error("stored text does not hash to the file name (its SHA-1 is {computed})")]
    TextHash { computed: String },
    #[error("body checksum mismatch (stored {stored:016x}, computed {computed:016x})")]
    BodyChecksum { stored: u64, computed: u64 },
    #[error("malformed extension section at byte {offset} of the section area: {detail}")]
    BadSections { offset: u64, detail: &'static str },
    #[error("not a regular file")]
    NotRegularFile,
    #[error("name is not <40 lowercase hex digits>.kv; ignored")]
    UnrecognizedName,
}

/// Errors from store operations. None of them leaves a half-written file behind or
/// poisons the store: the caller logs and carries on (a failed save means no
/// checkpoint; a failed load means a cold prefill).
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error("kv store: {op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The file is damaged; the store has marked it skipped.
    #[error("kv file {}: {defect}", path.display())]
    Corrupt { path: PathBuf, defect: Defect },
    /// The file on disk is valid but no longer satisfies the lookup (another process
    /// replaced it between `lookup` and `load`).
    #[error("kv file {}: no longer matches the lookup: {what}", path.display())]
    Changed { path: PathBuf, what: &'static str },
    /// The stored text hashes like the prompt prefix but differs byte-wise (a SHA-1
    /// collision, or the caller passed another prompt than the one it looked up).
    #[error("kv file {}: stored text does not share the expected prefix with the prompt", path.display())]
    PrefixMismatch { path: PathBuf },
    #[error("invalid kv store request: {0}")]
    InvalidRequest(String),
}

impl KvError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> KvError {
        KvError::Io {
            op,
            path: path.into(),
            source,
        }
    }

    /// The file's defect, when the error is a damaged file.
    pub fn defect(&self) -> Option<&Defect> {
        match self {
            KvError::Corrupt { defect, .. } => Some(defect),
            _ => None,
        }
    }

    /// The underlying I/O error kind, when the error is an I/O failure.
    pub fn io_kind(&self) -> Option<io::ErrorKind> {
        match self {
            KvError::Io { source, .. } => Some(source.kind()),
            _ => None,
        }
    }
}
