//! The checkpoint file format: the fixed 128-byte header, save reasons, fingerprints,
//! extension sections and the two checksums. Pure encode/decode, no I/O; the layout
//! table lives in the crate documentation.

use sha1::{Digest, Sha1};
use xxhash_rust::xxh3::xxh3_64;

use crate::error::Defect;

/// First three bytes of every checkpoint file.
pub const MAGIC: [u8; 3] = *b"KVC";
/// Format version written and accepted by this build. Version 1 was the original C
/// system's 52-byte header; it is rejected, never misread.
pub const FORMAT_VERSION: u8 = 2;
/// Size of the fixed header; the rendered text starts at this offset.
pub const HEADER_LEN: usize = 128;
/// Extension flag bit 0: a tool-id map section follows the payload. The flags are the
/// caller's business; the store writes and returns them verbatim.
pub const EXT_TOOL_ID_MAP: u32 = 1 << 0;

/// Offset of the in-place-updated tail: hits (u32), last_used (u64), header checksum
/// (u64). Contiguous so one positioned write of [`USAGE_LEN`] bytes updates all three.
pub(crate) const USAGE_OFFSET: usize = 108;
pub(crate) const USAGE_LEN: usize = HEADER_LEN - USAGE_OFFSET;
const HEADER_SUM_OFFSET: usize = 120;
/// Size of one section record's own header: kind (u32) + len (u64).
pub(crate) const SECTION_HEADER_LEN: u64 = 12;

/// Why a checkpoint was written. Anchors (cold, evict, shutdown) weigh double in
/// eviction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum SaveReason {
    Unknown = 0,
    Cold = 1,
    Continued = 2,
    Evict = 3,
    Shutdown = 4,
    AgentSystem = 5,
    AgentSession = 6,
    /// A client's cache breakpoint (Anthropic `cache_control`): an anchor.
    ClientHint = 7,
    /// The whole conversation at the end of a turn (prompt and answer), saved
    /// in the background so a crash loses at most the turn in flight.
    TurnEnd = 8,
}

impl SaveReason {
    pub fn from_u8(v: u8) -> Option<SaveReason> {
        Some(match v {
            0 => SaveReason::Unknown,
            1 => SaveReason::Cold,
            2 => SaveReason::Continued,
            3 => SaveReason::Evict,
            4 => SaveReason::Shutdown,
            5 => SaveReason::AgentSystem,
            6 => SaveReason::AgentSession,
            7 => SaveReason::ClientHint,
            8 => SaveReason::TurnEnd,
            _ => return None,
        })
    }

    /// The name used in log lines and `ds4 kv ls`.
    pub fn as_str(self) -> &'static str {
        match self {
            SaveReason::Unknown => "unknown",
            SaveReason::Cold => "cold",
            SaveReason::Continued => "continued",
            SaveReason::Evict => "evict",
            SaveReason::Shutdown => "shutdown",
            SaveReason::AgentSystem => "agent-system",
            SaveReason::AgentSession => "agent-session",
            SaveReason::ClientHint => "client-hint",
            SaveReason::TurnEnd => "turn-end",
        }
    }

    /// Anchor reasons count x2 in the eviction score.
    pub fn is_anchor(self) -> bool {
        matches!(
            self,
            SaveReason::Cold | SaveReason::Evict | SaveReason::Shutdown | SaveReason::ClientHint
        )
    }

    /// A point on a conversation's way (a continued save, a turn end, an agent
    /// session): once a later checkpoint of the same model extends its text,
    /// the longer one serves that conversation and this one only a branch, so
    /// it counts less in the eviction score.
    pub fn is_waypoint(self) -> bool {
        matches!(
            self,
            SaveReason::Continued | SaveReason::TurnEnd | SaveReason::AgentSession
        )
    }
}

impl std::fmt::Display for SaveReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Identity of the model that wrote a payload. `model_fp` covers the family and shape
/// (architecture metadata + tensor directory); `quant_fp` the quantization mix;
/// `weights_fp` the tensor data. Two quantizations of one model have equal
/// `model_fp` and different `quant_fp`; two files of one quantization with
/// other tensor data differ only in `weights_fp`. Files written before the
/// weights were recorded read it as zeros.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ModelId {
    pub model_fp: [u8; 16],
    pub quant_fp: [u8; 8],
    pub weights_fp: [u8; 16],
}

/// Why a checkpoint does not serve a session ([`ModelId`] and context size).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mismatch {
    /// Another model (architecture, tokenizer, tensor shapes), or a state
    /// saved differently (the K/V type and RoPE scaling are folded into
    /// `model_fp`).
    Model,
    /// The same layout and quantization with other tensor data: another or a
    /// modified model file.
    Weights,
    /// Written before checkpoints recorded the tensor data.
    WeightsUnknown,
    /// Another quantization, refused by `reject_different_quant`.
    Quant,
    /// Saved by a session with a larger context.
    Context,
}

impl Mismatch {
    /// Of a checkpoint written by `saved` (at context `saved_ctx`) for a
    /// session of `model` (context `n_ctx`); quantizations may differ unless
    /// `reject_different_quant`, and within one quantization the weights must
    /// be the same.
    pub fn of(
        saved: &ModelId,
        saved_ctx: u32,
        model: &ModelId,
        n_ctx: u32,
        reject_different_quant: bool,
    ) -> Option<Mismatch> {
        if saved.model_fp != model.model_fp {
            return Some(Mismatch::Model);
        }
        if saved.quant_fp != model.quant_fp {
            if reject_different_quant {
                return Some(Mismatch::Quant);
            }
        } else if saved.weights_fp == [0; 16] {
            return Some(Mismatch::WeightsUnknown);
        } else if saved.weights_fp != model.weights_fp {
            return Some(Mismatch::Weights);
        }
        (saved_ctx > n_ctx).then_some(Mismatch::Context)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Mismatch::Model => {
                "model fingerprint differs (another model, K/V type or RoPE scaling)"
            }
            Mismatch::Weights => {
                "weights differ: saved by a model file with the same layout and quantization \
                 but other tensor data (another or a modified file)"
            }
            Mismatch::WeightsUnknown => {
                "saved before checkpoints recorded the model's weights, so they cannot be matched"
            }
            Mismatch::Quant => "quant fingerprint differs (--kv-cache-reject-different-quant)",
            Mismatch::Context => "saved with a larger context than the session's",
        }
    }
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One opaque extension record stored after the payload.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Section {
    pub kind: u32,
    pub bytes: Vec<u8>,
}

/// The decoded fixed header. `encode` computes the header checksum; `decode` verifies
/// it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub reason: SaveReason,
    pub ext_flags: u32,
    /// Token count of the cached prefix; never 0.
    pub tokens: u32,
    /// Context size of the session that wrote the file; it loads only into sessions
    /// with a context at least this large.
    pub n_ctx: u32,
    pub created: u64,
    pub text_bytes: u64,
    pub payload_bytes: u64,
    /// Total size of the section area (records included).
    pub sections_bytes: u64,
    pub model: ModelId,
    /// XXH3-64 of text ‖ payload ‖ section area.
    pub body_checksum: u64,
    pub hits: u32,
    pub last_used: u64,
}

impl Header {
    /// Total file size this header describes, or `None` on overflow.
    pub fn file_bytes(&self) -> Option<u64> {
        (HEADER_LEN as u64)
            .checked_add(self.text_bytes)?
            .checked_add(self.payload_bytes)?
            .checked_add(self.sections_bytes)
    }

    /// `last_used`, or `created` for a file never used.
    pub fn used_at(&self) -> u64 {
        if self.last_used != 0 {
            self.last_used
        } else {
            self.created
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..3].copy_from_slice(&MAGIC);
        b[3] = FORMAT_VERSION;
        b[4] = self.reason as u8;
        // 5..8 reserved
        b[8..12].copy_from_slice(&self.ext_flags.to_le_bytes());
        b[12..16].copy_from_slice(&self.tokens.to_le_bytes());
        b[16..20].copy_from_slice(&self.n_ctx.to_le_bytes());
        // 20..24 reserved
        b[24..32].copy_from_slice(&self.created.to_le_bytes());
        b[32..40].copy_from_slice(&self.text_bytes.to_le_bytes());
        b[40..48].copy_from_slice(&self.payload_bytes.to_le_bytes());
        b[48..56].copy_from_slice(&self.sections_bytes.to_le_bytes());
        b[56..72].copy_from_slice(&self.model.model_fp);
        b[72..80].copy_from_slice(&self.model.quant_fp);
        b[80..88].copy_from_slice(&self.body_checksum.to_le_bytes());
        b[88..104].copy_from_slice(&self.model.weights_fp);
        // 104..108 reserved
        b[108..112].copy_from_slice(&self.hits.to_le_bytes());
        b[112..120].copy_from_slice(&self.last_used.to_le_bytes());
        let sum = xxh3_64(&b[..HEADER_SUM_OFFSET]);
        b[HEADER_SUM_OFFSET..].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Decode and validate a header. `bytes` is what could be read from the start of
    /// the file (fewer than [`HEADER_LEN`] bytes means the file is too short).
    pub fn decode(bytes: &[u8]) -> Result<Header, Defect> {
        if bytes.is_empty() {
            return Err(Defect::Empty);
        }
        if bytes.len() < HEADER_LEN {
            return Err(Defect::ShortHeader {
                len: bytes.len() as u64,
            });
        }
        let b = &bytes[..HEADER_LEN];
        if b[0..3] != MAGIC {
            return Err(Defect::BadMagic {
                found: [b[0], b[1], b[2]],
            });
        }
        if b[3] != FORMAT_VERSION {
            return Err(Defect::UnsupportedVersion { found: b[3] });
        }
        let stored = u64_at(b, HEADER_SUM_OFFSET);
        let computed = xxh3_64(&b[..HEADER_SUM_OFFSET]);
        if stored != computed {
            return Err(Defect::HeaderChecksum { stored, computed });
        }
        let reason = SaveReason::from_u8(b[4]).ok_or(Defect::BadField {
            field: "reason",
            value: u64::from(b[4]),
        })?;
        let mut model = ModelId::default();
        model.model_fp.copy_from_slice(&b[56..72]);
        model.quant_fp.copy_from_slice(&b[72..80]);
        model.weights_fp.copy_from_slice(&b[88..104]);
        let h = Header {
            reason,
            ext_flags: u32_at(b, 8),
            tokens: u32_at(b, 12),
            n_ctx: u32_at(b, 16),
            created: u64_at(b, 24),
            text_bytes: u64_at(b, 32),
            payload_bytes: u64_at(b, 40),
            sections_bytes: u64_at(b, 48),
            model,
            body_checksum: u64_at(b, 80),
            hits: u32_at(b, 108),
            last_used: u64_at(b, 112),
        };
        if h.tokens == 0 {
            return Err(Defect::BadField {
                field: "tokens",
                value: 0,
            });
        }
        if h.n_ctx < h.tokens {
            return Err(Defect::BadField {
                field: "n_ctx (smaller than tokens)",
                value: u64::from(h.n_ctx),
            });
        }
        if h.file_bytes().is_none() {
            return Err(Defect::BadField {
                field: "text+payload+sections bytes (overflow)",
                value: h.sections_bytes,
            });
        }
        Ok(h)
    }

    /// The bytes at [`USAGE_OFFSET`] after setting hits and last-used: what the
    /// in-place update writes (hits, last_used, header checksum).
    pub(crate) fn usage_tail(&self) -> [u8; USAGE_LEN] {
        let full = self.encode();
        let mut t = [0u8; USAGE_LEN];
        t.copy_from_slice(&full[USAGE_OFFSET..]);
        t
    }
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().expect("8 bytes"))
}

/// Size of the section area for these sections.
pub fn sections_len(sections: &[Section]) -> u64 {
    sections
        .iter()
        .map(|s| SECTION_HEADER_LEN + s.bytes.len() as u64)
        .sum()
}

/// Serialize sections as `(kind u32, len u64, bytes)` records.
pub fn encode_sections(sections: &[Section]) -> Vec<u8> {
    let mut out = Vec::with_capacity(sections_len(sections) as usize);
    for s in sections {
        out.extend_from_slice(&s.kind.to_le_bytes());
        out.extend_from_slice(&(s.bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(&s.bytes);
    }
    out
}

/// Parse a section area; the records must fill it exactly.
pub fn decode_sections(area: &[u8]) -> Result<Vec<Section>, Defect> {
    let mut out = Vec::new();
    let mut pos = 0usize;
    while pos < area.len() {
        let rest = &area[pos..];
        if rest.len() < SECTION_HEADER_LEN as usize {
            return Err(Defect::BadSections {
                offset: pos as u64,
                detail: "record header cut short",
            });
        }
        let kind = u32_at(rest, 0);
        let len = u64_at(rest, 4);
        let body = &rest[SECTION_HEADER_LEN as usize..];
        if len > body.len() as u64 {
            return Err(Defect::BadSections {
                offset: pos as u64,
                detail: "record length runs past the section area",
            });
        }
        out.push(Section {
            kind,
            bytes: body[..len as usize].to_vec(),
        });
        pos += SECTION_HEADER_LEN as usize + len as usize;
    }
    Ok(out)
}

/// SHA-1 of the rendered text: the file's identity.
pub fn text_hash(text: &[u8]) -> [u8; 20] {
    Sha1::digest(text).into()
}

/// `<40 lowercase hex>.kv` for this text.
pub fn file_name_for(text: &[u8]) -> String {
    format!("{}.kv", hex(&text_hash(text)))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 15)] as char);
    }
    s
}

/// The 40-hex-digit stem of a checkpoint file name, if `name` is exactly
/// `<40 lowercase hex>.kv`.
pub(crate) fn parse_checkpoint_name(name: &str) -> Option<[u8; 20]> {
    let stem = name.strip_suffix(".kv")?;
    parse_hash(stem)
}

/// Parse 40 lowercase hex digits.
pub(crate) fn parse_hash(stem: &str) -> Option<[u8; 20]> {
    let b = stem.as_bytes();
    if b.len() != 40 {
        return None;
    }
    let nib = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; 20];
    for (i, o) in out.iter_mut().enumerate() {
        *o = (nib(b[2 * i])? << 4) | nib(b[2 * i + 1])?;
    }
    Some(out)
}

/// If `name` is one of our temp files, `<40 lowercase hex>.kv.tmp.<pid>`, its pid.
/// Other `*.tmp.*` names are not ours to delete.
pub(crate) fn parse_temp_name(name: &str) -> Option<u32> {
    let (base, pid) = name.rsplit_once(".tmp.")?;
    parse_checkpoint_name(base)?;
    if pid.is_empty() || !pid.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Header {
        Header {
            reason: SaveReason::Continued,
            ext_flags: EXT_TOOL_ID_MAP,
            tokens: 10240,
            hits: 7,
            n_ctx: 32768,
            created: 1_700_000_000,
            last_used: 1_700_000_500,
            text_bytes: 40_000,
            payload_bytes: 123_456_789,
            sections_bytes: 99,
            model: ModelId {
                model_fp: [0xab; 16],
                quant_fp: [0xcd; 8],
                weights_fp: [0xef; 16],
            },
            body_checksum: 0x0123_4567_89ab_cdef,
        }
    }

    #[test]
    fn header_round_trip() {
        let h = sample();
        let b = h.encode();
        assert_eq!(&b[0..4], b"KVC\x02");
        assert_eq!(Header::decode(&b), Ok(h.clone()));
        // Reserved bytes are zero.
        assert!(b[5..8]
            .iter()
            .chain(&b[20..24])
            .chain(&b[104..108])
            .all(|&x| x == 0));
        assert_eq!(&b[88..104], &[0xef; 16]);
        // The usage tail is exactly the header's last 20 bytes.
        assert_eq!(h.usage_tail()[..], b[USAGE_OFFSET..]);
    }

    #[test]
    fn header_every_single_byte_flip_is_rejected() {
        let b = sample().encode();
        for i in 0..HEADER_LEN {
            for bit in 0..8 {
                let mut c = b;
                c[i] ^= 1 << bit;
                let err = Header::decode(&c).expect_err("flip must be detected");
                match i {
                    0..=2 => assert!(matches!(err, Defect::BadMagic { .. }), "{i}: {err}"),
                    3 => assert!(matches!(err, Defect::UnsupportedVersion { .. }), "{err}"),
                    _ => assert!(matches!(err, Defect::HeaderChecksum { .. }), "{i}: {err}"),
                }
            }
        }
    }

    #[test]
    fn sections_round_trip_and_malformed() {
        let s = vec![
            Section {
                kind: 1,
                bytes: b"tool map".to_vec(),
            },
            Section {
                kind: 7,
                bytes: vec![],
            },
        ];
        let area = encode_sections(&s);
        assert_eq!(area.len() as u64, sections_len(&s));
        assert_eq!(decode_sections(&area).unwrap(), s);
        let boundary = SECTION_HEADER_LEN as usize + 8; // end of the first record
        for cut in 1..area.len() {
            let r = decode_sections(&area[..cut]);
            if cut == boundary {
                assert_eq!(r.unwrap(), s[..1]);
            } else {
                assert!(r.is_err(), "cut {cut}");
            }
        }
    }

    #[test]
    fn sha1_vector_and_names() {
        assert_eq!(
            hex(&text_hash(b"abc")),
            "a9993e364706816aba3e25717850c26c9cd0d89d"
        );
        let n = file_name_for(b"abc");
        assert_eq!(parse_checkpoint_name(&n), Some(text_hash(b"abc")));
        assert_eq!(
            parse_checkpoint_name("A9993E364706816ABA3E25717850C26C9CD0D89D.kv"),
            None
        );
        assert_eq!(parse_checkpoint_name("a9993e.kv"), None);
        assert_eq!(parse_temp_name(&format!("{n}.tmp.1234")), Some(1234));
        assert_eq!(parse_temp_name(&format!("{n}.tmp.")), None);
        assert_eq!(parse_temp_name(&n), None);
        assert_eq!(parse_temp_name("notes.txt.tmp.1234"), None);
    }
}
