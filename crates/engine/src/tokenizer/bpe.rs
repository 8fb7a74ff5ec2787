//! Byte-level BPE (`tokenizer.ggml.model = gpt2`): GPT-2's byte-to-unicode mapping,
//! the merge table, and the rank-ordered merge loop of llama.cpp's
//! `llm_tokenizer_bpe_session::tokenize` (src/llama-vocab.cpp).
//!
//! A word from the pre-tokenizer starts as one symbol per byte (the token of that
//! byte's mapped character). The pair with the lowest merge rank is merged first; ties
//! go to the leftmost pair. Pairs are keyed on token ids, not strings: this is
//! equivalent to llama.cpp's string keys because loading checks that both halves of
//! every merge, and their concatenation, are tokens.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use ds4_gguf::Gguf;

use super::pretokenize::{self, PreType};
use super::vocab::{Defaults, Vocab};
use super::TokenizerError;

const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_PRE: &str = "tokenizer.ggml.pre";

/// No token for this symbol.
const NONE: u32 = u32::MAX;

/// GPT-2's `bytes_to_unicode`: printable Latin-1 bytes map to themselves, the other
/// 68 bytes (0x00..=0x20, 0x7F..=0xA0, 0xAD) to U+0100.. in byte order.
const BYTE_CHARS: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut n = 0;
    let mut b = 0;
    while b < 256 {
        if is_self_mapped(b as u8) {
            t[b] = b as u32;
        } else {
            t[b] = 0x100 + n;
            n += 1;
        }
        b += 1;
    }
    t
};

/// Number of code points the byte map uses above U+00FF.
const N_SHIFTED: usize = 68;

/// The inverse of [`BYTE_CHARS`] for U+0100..U+0143.
const SHIFTED_BYTES: [u8; N_SHIFTED] = {
    let mut t = [0u8; N_SHIFTED];
    let mut b = 0;
    while b < 256 {
        if BYTE_CHARS[b] >= 0x100 {
            t[(BYTE_CHARS[b] - 0x100) as usize] = b as u8;
        }
        b += 1;
    }
    t
};

const fn is_self_mapped(b: u8) -> bool {
    matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF)
}

fn byte_to_char(b: u8) -> char {
    // Every entry of BYTE_CHARS is below U+0144, a valid scalar value.
    char::from_u32(BYTE_CHARS[usize::from(b)]).unwrap_or(char::REPLACEMENT_CHARACTER)
}

/// The inverse of [`byte_to_char`].
fn char_to_byte(c: char) -> Option<u8> {
    let cp = c as u32;
    if cp < 0x100 {
        let b = cp as u8;
        return is_self_mapped(b).then_some(b);
    }
    SHIFTED_BYTES.get((cp - 0x100) as usize).copied()
}

/// A merge: the rank (index in `tokenizer.ggml.merges`) and the token it produces.
#[derive(Clone, Copy)]
struct Merge {
    rank: u32,
    merged: u32,
}

/// Hasher for the (left id, right id) pair packed in a u64: a multiply-xorshift mix,
/// much cheaper than SipHash on the hot path of the merge loop.
#[derive(Default)]
struct PairHasher(u64);

impl Hasher for PairHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.0 ^ u64::from(b));
        }
    }
    fn write_u64(&mut self, x: u64) {
        let h = (x ^ self.0).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 29);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

type PairMap = HashMap<u64, Merge, BuildHasherDefault<PairHasher>>;

fn pair_key(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

pub(crate) struct Bpe {
    pre: PreType,
    /// Token of each byte's mapped character, or NONE.
    byte_token: [u32; 256],
    merges: PairMap,
}

impl Bpe {
    /// llama.cpp's defaults for BPE vocabularies: BOS = EOS = 11 (when in range).
    pub(crate) const DEFAULTS: Defaults = Defaults {
        bos: Some(11),
        eos: Some(11),
        unk: None,
        add_bos: false,
    };

    pub(crate) fn from_gguf(g: &Gguf, vocab: &Vocab) -> Result<Self, TokenizerError> {
        let pre_name = g.get_str(KEY_PRE)?;
        let pre = PreType::from_gguf_name(pre_name).ok_or_else(|| TokenizerError::Unsupported {
            key: KEY_PRE,
            value: pre_name.to_owned(),
            supported: PreType::SUPPORTED,
        })?;

        let mut byte_token = [NONE; 256];
        let mut buf = [0u8; 4];
        for (b, slot) in byte_token.iter_mut().enumerate() {
            let s = byte_to_char(b as u8).encode_utf8(&mut buf);
            *slot = vocab.token_id(s).unwrap_or(NONE);
        }

        let lines = g.get_str_array(KEY_MERGES)?;
        let mut merges = PairMap::with_capacity_and_hasher(lines.len(), Default::default());
        let mut joined = String::new();
        for (rank, &line) in lines.iter().enumerate() {
            let malformed = |why: &'static str| TokenizerError::BadMerge {
                rank,
                merge: line.to_owned(),
                why,
            };
            // llama.cpp: `word.find(' ', 1)`, the first space after the first byte.
            let pos = line
                .bytes()
                .skip(1)
                .position(|b| b == b' ')
                .map(|p| p + 1)
                .ok_or_else(|| malformed("no space separating the two halves"))?;
            let (left, right) = (&line[..pos], &line[pos + 1..]);
            let left_id = vocab
                .token_id(left)
                .ok_or_else(|| malformed("left half is not a token"))?;
            let right_id = vocab
                .token_id(right)
                .ok_or_else(|| malformed("right half is not a token"))?;
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            let merged = vocab
                .token_id(&joined)
                .ok_or_else(|| malformed("the merged text is not a token"))?;
            let rank = u32::try_from(rank).map_err(|_| malformed("rank does not fit in u32"))?;
            // A repeated pair keeps its first (lowest) rank, like std::map::emplace.
            merges
                .entry(pair_key(left_id, right_id))
                .or_insert(Merge { rank, merged });
        }
        Ok(Bpe {
            pre,
            byte_token,
            merges,
        })
    }

    /// Bytes of a normal token's piece: each character mapped back to its byte
    /// (llama.cpp `llama_decode_text`). A character outside the byte map renders as
    /// `[UNK_BYTE_0x<utf8 hex><token text>]`, llama.cpp's exact fallback text.
    pub(crate) fn normal_piece(text: &str, out: &mut Vec<u8>) {
        for c in text.chars() {
            match char_to_byte(c) {
                Some(b) => out.push(b),
                None => {
                    out.extend_from_slice(b"[UNK_BYTE_0x");
                    let mut buf = [0u8; 4];
                    for b in c.encode_utf8(&mut buf).bytes() {
                        out.extend_from_slice(format!("{b:02x}").as_bytes());
                    }
                    out.extend_from_slice(text.as_bytes());
                    out.push(b']');
                }
            }
        }
    }

    /// How many bytes of `text` end up in a token: all but those whose byte has
    /// no token (SmolLM2 has none for six control characters and the lead
    /// bytes 0xF1 and 0xF2), which encoding drops.
    pub(crate) fn kept_bytes(&self, text: &str) -> usize {
        text.bytes()
            .filter(|&b| self.byte_token[usize::from(b)] != NONE)
            .count()
    }

    /// Appends the tokens of a raw text fragment (no special tokens in it).
    pub(crate) fn encode(&self, text: &str, out: &mut Vec<u32>) {
        let mut work = MergeWork::default();
        for word in pretokenize::split(self.pre, text) {
            self.encode_word(text[word].as_bytes(), &mut work, out);
        }
    }

    fn encode_word(&self, word: &[u8], w: &mut MergeWork, out: &mut Vec<u32>) {
        if let [b] = word {
            push_known(self.byte_token[usize::from(*b)], out);
            return;
        }
        w.syms.clear();
        w.heap.clear();
        let n = word.len();
        for (i, &b) in word.iter().enumerate() {
            w.syms.push(Sym {
                id: self.byte_token[usize::from(b)],
                prev: i as i32 - 1,
                next: if i + 1 == n { -1 } else { i as i32 + 1 },
                alive: true,
            });
        }
        for i in 1..n {
            self.add_pair(w, i - 1, i);
        }
        while let Some(Reverse(p)) = w.heap.pop() {
            let (l, r) = (p.left as usize, p.right as usize);
            // Skip stale pairs: a side was merged away or grew since the push.
            let (ls, rs) = (w.syms[l], w.syms[r]);
            if !ls.alive || !rs.alive || ls.id != p.left_id || rs.id != p.right_id {
                continue;
            }
            w.syms[l].id = p.merged;
            w.syms[l].next = rs.next;
            w.syms[r].alive = false;
            if rs.next >= 0 {
                w.syms[rs.next as usize].prev = l as i32;
            }
            if ls.prev >= 0 {
                self.add_pair(w, ls.prev as usize, l);
            }
            if rs.next >= 0 {
                self.add_pair(w, l, rs.next as usize);
            }
        }
        let mut i = 0i32;
        while i >= 0 {
            let s = w.syms[i as usize];
            push_known(s.id, out);
            i = s.next;
        }
    }

    fn add_pair(&self, w: &mut MergeWork, left: usize, right: usize) {
        let (left_id, right_id) = (w.syms[left].id, w.syms[right].id);
        if left_id == NONE || right_id == NONE {
            return;
        }
        if let Some(m) = self.merges.get(&pair_key(left_id, right_id)) {
            w.heap.push(Reverse(Pair {
                rank: m.rank,
                left: left as u32,
                right: right as u32,
                left_id,
                right_id,
                merged: m.merged,
            }));
        }
    }
}

/// A symbol without a token is dropped, as in llama.cpp: its fallback looks up each
/// byte of the mapped character on its own, which never names a token (a lone ASCII
/// character is the symbol itself, a lone byte >= 0x80 is not valid UTF-8).
fn push_known(id: u32, out: &mut Vec<u32>) {
    if id != NONE {
        out.push(id);
    }
}

#[derive(Clone, Copy)]
struct Sym {
    id: u32,
    prev: i32,
    next: i32,
    alive: bool,
}

/// A candidate merge; ordered by rank, then by left position (llama.cpp's
/// `llm_bigram_bpe::comparator`), the remaining fields only break exact ties.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Pair {
    rank: u32,
    left: u32,
    right: u32,
    left_id: u32,
    right_id: u32,
    merged: u32,
}

#[derive(Default)]
struct MergeWork {
    syms: Vec<Sym>,
    heap: BinaryHeap<Reverse<Pair>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_gpt2() {
        assert_eq!(byte_to_char(b'!'), '!');
        assert_eq!(byte_to_char(b' '), 'Ġ'); // U+0120
        assert_eq!(byte_to_char(b'\n'), 'Ċ'); // U+010A
        assert_eq!(byte_to_char(0x00), '\u{100}');
        assert_eq!(byte_to_char(0x7F), '\u{121}');
        assert_eq!(byte_to_char(0xAD), '\u{143}');
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(byte_to_char(b)), Some(b));
        }
        assert_eq!(char_to_byte('\u{144}'), None);
        assert_eq!(char_to_byte('€'), None);
    }

    #[test]
    fn normal_piece_fallback_text() {
        let mut out = Vec::new();
        Bpe::normal_piece("ĠHi", &mut out);
        assert_eq!(out, b" Hi");
        out.clear();
        Bpe::normal_piece("a€", &mut out);
        assert_eq!(out, "a[UNK_BYTE_0xe282aca€]".as_bytes());
    }
}
