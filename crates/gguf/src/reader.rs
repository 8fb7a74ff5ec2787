//! GGUF reader: parses the header, metadata and tensor directory of a memory-mapped
//! file and hands out bounds-checked, zero-copy views of tensor data.
//!
//! Every length read from the file is checked against the bytes that remain before
//! anything is allocated, so a corrupt count yields `CountTooLarge`, not an abort.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use crate::digest::FileIdentity;
use crate::error::{GgufError, Result};
use crate::types::GgmlType;
use crate::value::{Value, ValueType};

pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_DIMS: u32 = 4;
/// Nested arrays deeper than this are rejected: no real file needs them and the
/// limit keeps recursion bounded on hostile input.
const MAX_ARRAY_DEPTH: usize = 8;

/// One entry of the tensor directory.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous (row) dimension.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset relative to the start of the data section.
    pub offset: u64,
    /// Size of the tensor's data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

enum Backing {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file. Tensor data stays in the mapping until asked for.
pub struct Gguf {
    backing: Backing,
    path: Option<PathBuf>,
    /// The opened file's identity (the digest cache's key).
    identity: Option<FileIdentity>,
    pub version: u32,
    pub alignment: u64,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    metadata_index: HashMap<String, usize>,
    pub tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    /// Absolute offset of the data section.
    pub data_offset: u64,
}

impl Gguf {
    /// Memory-maps and parses `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        // Of the file opened, not of whatever the path names later.
        let identity = FileIdentity::of(&file.metadata().map_err(io)?);
        // SAFETY: the mapping is read-only and private to this process; GGUF files are
        // not modified while a model is loaded (the same contract llama.cpp relies on).
        // Every access goes through bounds checks against the mapping's length.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let mut g = Self::parse(Backing::Mmap(map))?;
        g.path = Some(path.to_path_buf());
        g.identity = Some(identity);
        Ok(g)
    }

    /// Parses a GGUF image held in memory (tests, tools).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::parse(Backing::Owned(bytes))
    }

    /// The file this was opened from, if any.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The identity of the file this was opened from, if any.
    pub fn identity(&self) -> Option<FileIdentity> {
        self.identity
    }

    /// The whole file image.
    pub fn bytes(&self) -> &[u8] {
        self.backing.bytes()
    }

    /// Drops the mapped pages holding `range` of the image from this process's
    /// resident memory, for data that has been copied elsewhere. The bytes stay
    /// readable: a later read faults them back in from the file (usually from the
    /// page cache). An in-memory image, or a range outside the image, is left as is.
    pub fn evict(&self, range: std::ops::Range<usize>) {
        #[cfg(unix)]
        if let Backing::Mmap(m) = &self.backing {
            if range.start < range.end && range.end <= m.len() {
                // SAFETY: the mapping is private, read-only and never written, so
                // MADV_DONTNEED drops only clean pages, and a later access reads
                // the same bytes back from the file (under `open`'s contract that
                // the file is not modified while mapped). It is a hint: failure
                // changes nothing.
                let _ = unsafe {
                    m.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        range.start,
                        range.len(),
                    )
                };
            }
        }
    }

    fn parse(backing: Backing) -> Result<Self> {
        let bytes = backing.bytes();
        let mut r = Cursor { bytes, pos: 0 };
        let magic: [u8; 4] = r.take(4, "magic")?.try_into().unwrap_or([0; 4]);
        if magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = r.u32("version")?;
        if version != 2 && version != 3 {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        // A key/value pair is at least 8 (key length) + 4 (type) + 1 bytes.
        r.check_count("metadata count", n_kv, 13)?;
        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut metadata_index = HashMap::with_capacity(n_kv as usize);
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key #{i}"))?;
            let type_id = r.u32(&format!("type of metadata {key:?}"))?;
            let value = r.value(type_id, &format!("metadata {key:?}"), 0)?;
            if metadata_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::DuplicateKey { key });
            }
            metadata.push((key, value));
        }

        let alignment = match metadata_index.get("general.alignment") {
            Some(&i) => {
                let a = metadata[i].1.as_u64().ok_or(GgufError::WrongValueType {
                    key: "general.alignment".into(),
                    expected: "unsigned integer",
                    found: metadata[i].1.value_type().name(),
                })?;
                if a == 0 || !a.is_power_of_two() {
                    return Err(GgufError::BadAlignment(a));
                }
                a
            }
            None => DEFAULT_ALIGNMENT,
        };

        // A tensor info is at least 8 (name length) + 4 + 8 + 4 + 8 bytes.
        r.check_count("tensor count", n_tensors, 32)?;
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut tensor_index = HashMap::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = r.string(&format!("tensor #{i} name"))?;
            let n_dims = r.u32(&format!("tensor {name:?} n_dims"))?;
            if n_dims > MAX_DIMS {
                return Err(GgufError::TooManyDims { name, n_dims });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for d in 0..n_dims {
                dims.push(r.u64(&format!("tensor {name:?} dim {d}"))?);
            }
            let type_id = r.u32(&format!("tensor {name:?} type"))?;
            let ty = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType {
                name: name.clone(),
                type_id,
            })?;
            let offset = r.u64(&format!("tensor {name:?} offset"))?;
            let n_bytes = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|_| {
                    dims.first()
                        .is_none_or(|&d0| d0 % ty.block_size() as u64 == 0)
                })
                .and_then(|n| ty.bytes_for(n))
                .ok_or_else(|| GgufError::BadShape {
                    name: name.clone(),
                    dims: dims.clone(),
                    ty,
                })?;
            if offset % alignment != 0 {
                return Err(GgufError::MisalignedTensor {
                    name,
                    offset,
                    alignment,
                });
            }
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(GgufError::DuplicateTensor { name });
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
                n_bytes,
            });
        }

        let data_offset = (r.pos as u64).div_ceil(alignment) * alignment;
        let file_len = bytes.len() as u64;
        for t in &tensors {
            let end = data_offset
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(t.n_bytes));
            if end.is_none_or(|e| e > file_len) {
                return Err(GgufError::TensorOutOfBounds {
                    name: t.name.clone(),
                    offset: data_offset.saturating_add(t.offset),
                    len: t.n_bytes,
                    file_len,
                });
            }
        }

        Ok(Gguf {
            backing,
            path: None,
            identity: None,
            version,
            alignment,
            metadata,
            metadata_index,
            tensors,
            tensor_index,
            data_offset,
        })
    }

    /// The value of metadata `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey { key: key.into() })
    }

    fn wrong(key: &str, expected: &'static str, v: &Value) -> GgufError {
        GgufError::WrongValueType {
            key: key.into(),
            expected,
            found: v.value_type().name(),
        }
    }

    /// A required non-negative integer of any width.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let v = self.require(key)?;
        v.as_u64()
            .ok_or_else(|| Self::wrong(key, "unsigned integer", v))
    }

    /// A required float (f32 or f64).
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        let v = self.require(key)?;
        v.as_f64().ok_or_else(|| Self::wrong(key, "float", v))
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| Self::wrong(key, "string", v))
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| Self::wrong(key, "bool", v))
    }

    /// A required array whose elements are all strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let v = self.require(key)?;
        let items = v
            .as_array()
            .ok_or_else(|| Self::wrong(key, "array of strings", v))?;
        items
            .iter()
            .map(|it| {
                it.as_str()
                    .ok_or_else(|| Self::wrong(key, "array of strings", it))
            })
            .collect()
    }

    /// A required array whose elements are all integers.
    pub fn get_i64_array(&self, key: &str) -> Result<Vec<i64>> {
        let v = self.require(key)?;
        let items = v
            .as_array()
            .ok_or_else(|| Self::wrong(key, "array of integers", v))?;
        items
            .iter()
            .map(|it| {
                it.as_i64()
                    .ok_or_else(|| Self::wrong(key, "array of integers", it))
            })
            .collect()
    }

    /// Directory entry of tensor `name`.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// Zero-copy view of tensor `name`'s data (bounds were checked at parse time).
    pub fn tensor_data(&self, name: &str) -> Result<&[u8]> {
        let t = self
            .tensor_info(name)
            .ok_or_else(|| GgufError::MissingTensor { name: name.into() })?;
        Ok(self.data_of(t))
    }

    /// Zero-copy view of the data of a directory entry of this file.
    pub fn data_of(&self, t: &TensorInfo) -> &[u8] {
        // Offsets and lengths were validated against the file length in `parse`, and
        // the directory is immutable afterwards.
        let start = (self.data_offset + t.offset) as usize;
        &self.bytes()[start..start + t.n_bytes as usize]
    }
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what.to_string(),
                offset: self.pos as u64,
                need: n,
                file_len: self.bytes.len() as u64,
            });
        }
        let s = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn check_count(&self, what: &str, count: u64, min_each: u64) -> Result<()> {
        if count
            .checked_mul(min_each)
            .is_none_or(|n| n > self.remaining())
        {
            return Err(GgufError::CountTooLarge {
                what: what.to_string(),
                count,
                remaining: self.remaining(),
            });
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let s = self.take(len, what)?;
        String::from_utf8(s.to_vec()).map_err(|_| GgufError::InvalidUtf8 { what: what.into() })
    }

    fn value(&mut self, type_id: u32, what: &str, depth: usize) -> Result<Value> {
        let ty = ValueType::from_id(type_id).ok_or_else(|| GgufError::InvalidValueType {
            what: what.into(),
            type_id,
        })?;
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array(what)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(what)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => Value::U32(self.u32(what)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::Bool => Value::Bool(self.array::<1>(what)?[0] != 0),
            ValueType::String => Value::String(self.string(what)?),
            ValueType::U64 => Value::U64(self.u64(what)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::InvalidValueType {
                        what: format!("{what} (arrays nested deeper than {MAX_ARRAY_DEPTH})"),
                        type_id,
                    });
                }
                let elem_id = self.u32(&format!("{what} element type"))?;
                let elem =
                    ValueType::from_id(elem_id).ok_or_else(|| GgufError::InvalidValueType {
                        what: format!("{what} element type"),
                        type_id: elem_id,
                    })?;
                let count = self.u64(&format!("{what} length"))?;
                self.check_count(&format!("{what} length"), count, elem.min_encoded_len())?;
                let mut items = Vec::with_capacity(count as usize);
                // Elements share the array's name in errors: formatting a per-element
                // name up front would cost more than parsing a 262k-entry vocabulary.
                for _ in 0..count {
                    items.push(self.value(elem_id, what, depth + 1)?);
                }
                Value::Array { elem, items }
            }
        })
    }
}
