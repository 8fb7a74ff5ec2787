//! The session payload: a session's exact state as bytes, for the checkpoint store.
//!
//! Little-endian, version 1:
//!
//! | field | type |
//! | --- | --- |
//! | magic `DS4S` | 4 bytes |
//! | payload version | u32 = 1 |
//! | family | u32 (1 = llama) |
//! | n_layer, n_head_kv, head_dim, n_vocab | u32 each |
//! | context size of the writer | u32 |
//! | token count T | u32 |
//! | K/V element type | u32 (0 = f32, 1 = f16) |
//! | tokens | u32 × T |
//! | next-token logits | f32 × n_vocab |
//! | per layer: K then V | f32 or f16 × n_head_kv × T × head_dim each, positions in logical order |
//!
//! A payload loads only into a session of the same K/V element type
//! ([`EngineError::KvTypeMismatch`]): the values were rounded when stored, so
//! converting would not give the state the other type's session computes.
//!
//! Written and read through caller-supplied buffered streams in large chunks; never
//! mapped. A reader consumes exactly the bytes it expects and rejects anything else.

use std::io::{Read, Write};

use crate::error::{EngineError, Result};
use crate::model::HParams;
use crate::session::KvType;

pub const PAYLOAD_MAGIC: [u8; 4] = *b"DS4S";
pub const PAYLOAD_VERSION: u32 = 1;
const FAMILY_LLAMA: u32 = 1;
const HEADER_WORDS: usize = 10;
/// Bytes converted per write or read call.
const CHUNK: usize = 1 << 20;

/// The fixed part of a payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PayloadHeader {
    pub n_layer: u32,
    pub n_head_kv: u32,
    pub head_dim: u32,
    pub n_vocab: u32,
    pub n_ctx: u32,
    pub n_tokens: u32,
    pub kv_type: KvType,
}

impl PayloadHeader {
    pub(crate) fn for_model(hp: &HParams, n_ctx: usize, n_tokens: usize, kv_type: KvType) -> Self {
        PayloadHeader {
            n_layer: hp.n_layer as u32,
            n_head_kv: hp.n_head_kv as u32,
            head_dim: hp.head_dim as u32,
            n_vocab: hp.n_vocab as u32,
            n_ctx: n_ctx as u32,
            n_tokens: n_tokens as u32,
            kv_type,
        }
    }

    /// Total payload bytes for this header.
    pub fn payload_bytes(&self) -> u64 {
        let t = u64::from(self.n_tokens);
        let state =
            2 * u64::from(self.n_layer) * u64::from(self.n_head_kv) * t * u64::from(self.head_dim);
        let elem = self.kv_type.bytes() as u64;
        4 + 4 * HEADER_WORDS as u64 + 4 * t + 4 * u64::from(self.n_vocab) + elem * state
    }

    pub(crate) fn write(&self, w: &mut impl Write) -> Result<()> {
        let words = [
            PAYLOAD_VERSION,
            FAMILY_LLAMA,
            self.n_layer,
            self.n_head_kv,
            self.head_dim,
            self.n_vocab,
            self.n_ctx,
            self.n_tokens,
            self.kv_type.code(),
        ];
        w.write_all(&PAYLOAD_MAGIC).map_err(io)?;
        for x in words {
            w.write_all(&x.to_le_bytes()).map_err(io)?;
        }
        // Reserved word, keeps the header a round 44 bytes.
        w.write_all(&0u32.to_le_bytes()).map_err(io)
    }

    /// Reads a header and checks that it describes a state of this model family
    /// and shape, with K/V stored as `kv_type`.
    pub(crate) fn read(r: &mut impl Read, hp: &HParams, kv_type: KvType) -> Result<Self> {
        let mut magic = [0u8; 4];
        read_exact(r, &mut magic, "magic")?;
        if magic != PAYLOAD_MAGIC {
            return Err(bad(format!("magic {magic:02x?}, expected \"DS4S\"")));
        }
        let mut words = [0u32; HEADER_WORDS];
        for (i, w) in words.iter_mut().enumerate() {
            let mut b = [0u8; 4];
            read_exact(r, &mut b, "header")?;
            *w = u32::from_le_bytes(b);
            if i == 0 && *w != PAYLOAD_VERSION {
                return Err(bad(format!(
                    "version {w}, this build reads {PAYLOAD_VERSION}"
                )));
            }
        }
        let [_, family, n_layer, n_head_kv, head_dim, n_vocab, n_ctx, n_tokens, dtype, _] = words;
        if family != FAMILY_LLAMA {
            return Err(bad(format!(
                "family {family} is not llama ({FAMILY_LLAMA})"
            )));
        }
        let Some(found) = KvType::from_code(dtype) else {
            return Err(bad(format!(
                "K/V element type {dtype} (this build stores f32 = 0, f16 = 1)"
            )));
        };
        if found != kv_type {
            return Err(EngineError::KvTypeMismatch {
                payload: found,
                session: kv_type,
            });
        }
        let h = PayloadHeader {
            n_layer,
            n_head_kv,
            head_dim,
            n_vocab,
            n_ctx,
            n_tokens,
            kv_type,
        };
        let mine = PayloadHeader::for_model(hp, n_ctx as usize, n_tokens as usize, kv_type);
        if h != mine {
            return Err(bad(format!(
                "shape (layers {n_layer}, kv heads {n_head_kv}, head dim {head_dim}, vocab {n_vocab}) \
                 differs from the model's ({}, {}, {}, {})",
                mine.n_layer, mine.n_head_kv, mine.head_dim, mine.n_vocab
            )));
        }
        Ok(h)
    }
}

pub(crate) fn bad(reason: String) -> EngineError {
    EngineError::Payload { reason }
}

fn io(e: std::io::Error) -> EngineError {
    EngineError::PayloadIo(e)
}

fn read_exact(r: &mut impl Read, buf: &mut [u8], what: &str) -> Result<()> {
    r.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => bad(format!("truncated in the {what}")),
        _ => io(e),
    })
}

pub(crate) fn write_u32s(w: &mut impl Write, xs: &[u32]) -> Result<()> {
    write_pod(w, xs)
}

pub(crate) fn write_f32s(w: &mut impl Write, xs: &[f32]) -> Result<()> {
    write_pod(w, xs)
}

pub(crate) fn write_pod<T: bytemuck::Pod + ToLe>(w: &mut impl Write, xs: &[T]) -> Result<()> {
    if cfg!(target_endian = "little") {
        for c in bytemuck::cast_slice::<T, u8>(xs).chunks(CHUNK) {
            w.write_all(c).map_err(io)?;
        }
        return Ok(());
    }
    let mut buf = Vec::with_capacity(CHUNK);
    for c in xs.chunks(CHUNK / size_of::<T>()) {
        buf.clear();
        c.iter().for_each(|x| x.put_le(&mut buf));
        w.write_all(&buf).map_err(io)?;
    }
    Ok(())
}

pub(crate) fn read_u32s(r: &mut impl Read, out: &mut [u32], what: &str) -> Result<()> {
    read_pod(r, out, what)
}

pub(crate) fn read_f32s(r: &mut impl Read, out: &mut [f32], what: &str) -> Result<()> {
    read_pod(r, out, what)
}

pub(crate) fn read_pod<T: bytemuck::Pod + ToLe>(
    r: &mut impl Read,
    out: &mut [T],
    what: &str,
) -> Result<()> {
    for c in bytemuck::cast_slice_mut::<T, u8>(out).chunks_mut(CHUNK) {
        read_exact(r, c, what)?;
    }
    if cfg!(target_endian = "big") {
        out.iter_mut().for_each(|x| *x = x.le_to_native());
    }
    Ok(())
}

/// Little-endian conversion of the element types a payload holds.
pub(crate) trait ToLe: Copy {
    fn put_le(self, buf: &mut Vec<u8>);
    fn le_to_native(self) -> Self;
}

impl ToLe for u32 {
    fn put_le(self, buf: &mut Vec<u8>) {
        buf.extend_from_slice(&self.to_le_bytes())
    }
    fn le_to_native(self) -> Self {
        u32::from_le(self)
    }
}

/// f16 bits.
impl ToLe for u16 {
    fn put_le(self, buf: &mut Vec<u8>) {
        buf.extend_from_slice(&self.to_le_bytes())
    }
    fn le_to_native(self) -> Self {
        u16::from_le(self)
    }
}

impl ToLe for f32 {
    fn put_le(self, buf: &mut Vec<u8>) {
        buf.extend_from_slice(&self.to_le_bytes())
    }
    fn le_to_native(self) -> Self {
        f32::from_bits(u32::from_le(self.to_bits()))
    }
}

/// Fails unless `r` is at its end: a payload has no trailing bytes.
pub(crate) fn expect_end(r: &mut impl Read) -> Result<()> {
    let mut b = [0u8; 1];
    match r.read(&mut b) {
        Ok(0) => Ok(()),
        Ok(_) => Err(bad("trailing bytes after the state".into())),
        Err(e) => Err(io(e)),
    }
}
