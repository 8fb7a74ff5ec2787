//! The session payload: a session's exact state as bytes, for the checkpoint store.
//!
//! Little-endian, version 2 (payloads describe their family and state):
//!
//! | field | type |
//! | --- | --- |
//! | magic `DS4S` | 4 bytes |
//! | payload version | u32 = 2 |
//! | family | u32 (the registry's payload id: 1 = llama, 2 = gemma3) |
//! | n_vocab | u32 |
//! | context size of the writer | u32 |
//! | token count T | u32 |
//! | reserved | u32 = 0 |
//! | tokens | u32 × T |
//! | next-token logits | f32 × n_vocab |
//! | state | the family's state: a descriptor, then its rows in logical order (`state/`) |
//!
//! Version 1, written before families existed (llama only), is still read: ten
//! header words (version 1, family 1, n_layer, n_head_kv, head_dim, n_vocab,
//! n_ctx, T, K/V element type 0 = f32 / 1 = f16, reserved), tokens, logits, then
//! per layer K then V, each `n_head_kv × T × head_dim` in position order.
//!
//! A payload loads only into a session of the same family, vocabulary, state
//! layout and K/V element type ([`EngineError::KvTypeMismatch`]): values were
//! rounded when stored, so converting would not give the state the other type's
//! session computes.
//!
//! Written and read through caller-supplied buffered streams in large chunks; never
//! mapped. A reader consumes exactly the bytes it expects and rejects anything else.

use std::io::{Read, Write};

use crate::error::{EngineError, Result};

pub const PAYLOAD_MAGIC: [u8; 4] = *b"DS4S";
/// The version this build writes.
pub const PAYLOAD_VERSION: u32 = 2;
/// Header words after the magic, by version.
const HEADER_WORDS_V1: usize = 10;
const HEADER_WORDS_V2: usize = 6;
/// Bytes converted per write or read call.
const CHUNK: usize = 1 << 20;

/// The K/V shape a version-1 payload declares in its header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PayloadV1Shape {
    pub n_layer: u32,
    pub n_head_kv: u32,
    pub head_dim: u32,
    /// The K/V element type code (0 = f32, 1 = f16).
    pub kv_type: u32,
}

/// The fixed part of a payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PayloadHeader {
    pub version: u32,
    /// The family's payload id.
    pub family: u32,
    pub n_vocab: u32,
    /// The writer's context size.
    pub n_ctx: u32,
    pub n_tokens: u32,
    /// Version 1 only.
    pub v1: Option<PayloadV1Shape>,
}

impl PayloadHeader {
    /// Bytes of a version-2 header.
    pub const BYTES: u64 = 4 + 4 * HEADER_WORDS_V2 as u64;

    pub(crate) fn write(&self, w: &mut (impl Write + ?Sized)) -> Result<()> {
        w.write_all(&PAYLOAD_MAGIC).map_err(io)?;
        let words = [
            PAYLOAD_VERSION,
            self.family,
            self.n_vocab,
            self.n_ctx,
            self.n_tokens,
            0,
        ];
        write_pod(w, &words)
    }

    /// Reads a header of either version.
    pub(crate) fn read(r: &mut (impl Read + ?Sized)) -> Result<Self> {
        let mut magic = [0u8; 4];
        read_exact(r, &mut magic, "magic")?;
        if magic != PAYLOAD_MAGIC {
            return Err(bad(format!("magic {magic:02x?}, expected \"DS4S\"")));
        }
        let mut version = [0u32; 1];
        read_pod(r, &mut version, "header")?;
        match version[0] {
            1 => {
                let mut w = [0u32; HEADER_WORDS_V1 - 1];
                read_pod(r, &mut w, "header")?;
                let [family, n_layer, n_head_kv, head_dim, n_vocab, n_ctx, n_tokens, kv_type, _] =
                    w;
                Ok(PayloadHeader {
                    version: 1,
                    family,
                    n_vocab,
                    n_ctx,
                    n_tokens,
                    v1: Some(PayloadV1Shape {
                        n_layer,
                        n_head_kv,
                        head_dim,
                        kv_type,
                    }),
                })
            }
            2 => {
                let mut w = [0u32; HEADER_WORDS_V2 - 1];
                read_pod(r, &mut w, "header")?;
                let [family, n_vocab, n_ctx, n_tokens, _] = w;
                Ok(PayloadHeader {
                    version: 2,
                    family,
                    n_vocab,
                    n_ctx,
                    n_tokens,
                    v1: None,
                })
            }
            v => Err(bad(format!(
                "version {v}, this build reads 1 and {PAYLOAD_VERSION}"
            ))),
        }
    }
}

pub(crate) fn bad(reason: String) -> EngineError {
    EngineError::Payload { reason }
}

fn io(e: std::io::Error) -> EngineError {
    EngineError::PayloadIo(e)
}

fn read_exact(r: &mut (impl Read + ?Sized), buf: &mut [u8], what: &str) -> Result<()> {
    r.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => bad(format!("truncated in the {what}")),
        _ => io(e),
    })
}

pub(crate) fn write_u32s(w: &mut (impl Write + ?Sized), xs: &[u32]) -> Result<()> {
    write_pod(w, xs)
}

pub(crate) fn write_f32s(w: &mut (impl Write + ?Sized), xs: &[f32]) -> Result<()> {
    write_pod(w, xs)
}

pub(crate) fn write_pod<T: bytemuck::Pod + ToLe>(
    w: &mut (impl Write + ?Sized),
    xs: &[T],
) -> Result<()> {
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

pub(crate) fn read_u32s(r: &mut (impl Read + ?Sized), out: &mut [u32], what: &str) -> Result<()> {
    read_pod(r, out, what)
}

pub(crate) fn read_f32s(r: &mut (impl Read + ?Sized), out: &mut [f32], what: &str) -> Result<()> {
    read_pod(r, out, what)
}

pub(crate) fn read_pod<T: bytemuck::Pod + ToLe>(
    r: &mut (impl Read + ?Sized),
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
pub(crate) fn expect_end(r: &mut (impl Read + ?Sized)) -> Result<()> {
    let mut b = [0u8; 1];
    match r.read(&mut b) {
        Ok(0) => Ok(()),
        Ok(_) => Err(bad("trailing bytes after the state".into())),
        Err(e) => Err(io(e)),
    }
}

/// Reads and drops `n` bytes (rows a state cannot hold), failing like a
/// truncated read when the stream ends first.
pub(crate) fn skip(r: &mut (impl Read + ?Sized), n: u64, what: &str) -> Result<()> {
    let mut left = n;
    let mut buf = [0u8; 8192];
    while left > 0 {
        let take = left.min(buf.len() as u64) as usize;
        read_exact(r, &mut buf[..take], what)?;
        left -= take as u64;
    }
    Ok(())
}
