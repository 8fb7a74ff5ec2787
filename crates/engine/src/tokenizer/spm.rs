//! SentencePiece-style vocabularies (`tokenizer.ggml.model = llama`, e.g. Gemma): the
//! score-ordered bigram merge of llama.cpp's `llm_tokenizer_spm_session`
//! (src/llama-vocab.cpp) with byte fallback.
//!
//! A raw-text fragment has its spaces escaped to U+2581 `▁`; when
//! `tokenizer.ggml.add_space_prefix` is set (llama.cpp's default for this model), a
//! fragment that starts the input or follows a special token gets one `▁` in front.
//! The text starts as one symbol per character. Of all adjacent pairs whose
//! concatenation is a token, the pair whose token scores highest merges first (ties:
//! the leftmost), until no pair is a token. A symbol left over that is not a token is
//! emitted as the `<0xXX>` tokens of its UTF-8 bytes.
//!
//! llama.cpp keeps a `rev_merge` map to re-split a final symbol that is not a token.
//! It never applies to valid UTF-8: a pair is only queued when its concatenation is a
//! token, so every merged symbol is one, and a single character never equals the text
//! of a two-symbol pair. Inputs here are `&str`, so it is left out.
//!
//! Deliberate differences: a vocabulary without a byte token for some byte fails at
//! load (llama.cpp throws only when a text needs it); a NaN score fails at load, and
//! `-0.0` is read as `0.0` (equal under llama.cpp's `<`, not under a total order).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use ds4_gguf::{Gguf, GgufError, Value};

use super::vocab::{get_flag, Defaults, Vocab};
use super::TokenizerError;

const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";

/// What a space becomes before the merge, and what a normal token's `▁` renders as.
const ESCAPED_SPACE: char = '\u{2581}';

pub(crate) struct Spm {
    /// Score of every token (`tokenizer.ggml.scores`, 0 when absent).
    scores: Vec<f32>,
    /// The `<0xXX>` token of every byte.
    byte_token: [u32; 256],
    add_space_prefix: bool,
}

impl Spm {
    /// llama.cpp's defaults for SPM vocabularies: BOS 1, EOS 2, UNK 0, BOS added.
    pub(crate) const DEFAULTS: Defaults = Defaults {
        bos: Some(1),
        eos: Some(2),
        unk: Some(0),
        add_bos: true,
    };

    pub(crate) fn from_gguf(g: &Gguf, vocab: &Vocab) -> Result<Self, TokenizerError> {
        let scores = read_scores(g, vocab.n_vocab() as usize)?;
        let mut byte_token = [0; 256];
        for (b, slot) in byte_token.iter_mut().enumerate() {
            // llama.cpp `byte_to_token`: `<0xXX>` in upper-case hex, else the byte itself.
            let text = format!("<0x{b:02X}>");
            *slot = vocab
                .token_id(&text)
                .or_else(|| {
                    // Only an ASCII byte is a whole UTF-8 text on its own.
                    let c = char::from(b as u8);
                    c.is_ascii()
                        .then(|| vocab.token_id(c.encode_utf8(&mut [0; 4])))
                        .flatten()
                })
                .ok_or(TokenizerError::MissingByteToken { text })?;
        }
        Ok(Spm {
            scores,
            byte_token,
            add_space_prefix: get_flag(g, KEY_ADD_SPACE_PREFIX)?.unwrap_or(true),
        })
    }

    /// Bytes of a normal token's piece: its text with `▁` turned back into spaces.
    pub(crate) fn normal_piece(text: &str, out: &mut Vec<u8>) {
        let mut parts = text.split(ESCAPED_SPACE);
        if let Some(first) = parts.next() {
            out.extend_from_slice(first.as_bytes());
        }
        for part in parts {
            out.push(b' ');
            out.extend_from_slice(part.as_bytes());
        }
    }

    /// Appends the tokens of a raw-text fragment (no special tokens in it).
    /// `after_special`: the fragment starts the input or follows a special token.
    pub(crate) fn encode(
        &self,
        vocab: &Vocab,
        text: &str,
        after_special: bool,
        out: &mut Vec<u32>,
    ) {
        let mut s = String::with_capacity(text.len() + text.len() / 2 + 3);
        if self.add_space_prefix && after_special {
            s.push(ESCAPED_SPACE);
        }
        for c in text.chars() {
            s.push(if c == ' ' { ESCAPED_SPACE } else { c });
        }
        if s.is_empty() {
            return;
        }

        let mut w = Merge {
            text: &s,
            syms: Vec::with_capacity(s.len()),
            heap: BinaryHeap::new(),
        };
        let n = s.chars().count();
        for (i, (start, c)) in s.char_indices().enumerate() {
            w.syms.push(Sym {
                start: start as u32,
                len: c.len_utf8() as u32,
                prev: i as i32 - 1,
                next: if i + 1 == n { -1 } else { i as i32 + 1 },
                id: None,
            });
        }
        for i in 1..n {
            self.try_add_bigram(vocab, &mut w, i as i32 - 1, i as i32);
        }
        while let Some(b) = w.heap.pop() {
            let (l, r) = (b.left as usize, b.right as usize);
            let (ls, rs) = (w.syms[l], w.syms[r]);
            // Stale: a side was merged away or grew since the push. Symbols only grow,
            // so the total length tells (llama.cpp's own check).
            if ls.len == 0 || rs.len == 0 || ls.len + rs.len != b.size {
                continue;
            }
            w.syms[l].len += rs.len;
            w.syms[l].id = Some(b.id);
            w.syms[l].next = rs.next;
            w.syms[r].len = 0;
            if rs.next >= 0 {
                w.syms[rs.next as usize].prev = l as i32;
            }
            self.try_add_bigram(vocab, &mut w, ls.prev, l as i32);
            self.try_add_bigram(vocab, &mut w, l as i32, rs.next);
        }

        let mut i = 0i32;
        while i >= 0 {
            let sym = w.syms[i as usize];
            let text = w.sym_text(sym, 0);
            match sym.id.or_else(|| vocab.token_id(text)) {
                Some(id) => out.push(id),
                None => out.extend(text.bytes().map(|b| self.byte_token[usize::from(b)])),
            }
            i = sym.next;
        }
    }

    /// Queues the merge of symbols `left` and `right` (adjacent) if their concatenation
    /// is a token.
    fn try_add_bigram(&self, vocab: &Vocab, w: &mut Merge, left: i32, right: i32) {
        if left < 0 || right < 0 {
            return;
        }
        let (ls, rs) = (w.syms[left as usize], w.syms[right as usize]);
        let size = ls.len + rs.len;
        if let Some(id) = vocab.token_id(w.sym_text(ls, rs.len)) {
            w.heap.push(Bigram {
                score: self.scores[id as usize],
                left: left as u32,
                right: right as u32,
                size,
                id,
            });
        }
    }
}

/// `tokenizer.ggml.scores`: f32 or i32 values, one per token; all 0 when absent.
fn read_scores(g: &Gguf, n_vocab: usize) -> Result<Vec<f32>, TokenizerError> {
    let Some(v) = g.get(KEY_SCORES) else {
        return Ok(vec![0.0; n_vocab]);
    };
    let wrong = |found: &Value| GgufError::WrongValueType {
        key: KEY_SCORES.into(),
        expected: "array of f32 or i32",
        found: found.value_type().name(),
    };
    let items = v.as_array().ok_or_else(|| wrong(v))?;
    if items.len() != n_vocab {
        return Err(TokenizerError::LengthMismatch {
            key: KEY_SCORES,
            len: items.len(),
            n_vocab,
        });
    }
    items
        .iter()
        .enumerate()
        .map(|(id, item)| {
            let score = match *item {
                Value::F32(x) => x,
                Value::I32(x) => x as f32,
                _ => return Err(wrong(item).into()),
            };
            if score.is_nan() {
                return Err(TokenizerError::NanScore { id: id as u32 });
            }
            // `+ 0.0` folds -0.0 into 0.0 so that the total order below ties them.
            Ok(score + 0.0)
        })
        .collect()
}

/// A run of characters of the escaped text; `len == 0` once merged into its left.
#[derive(Clone, Copy)]
struct Sym {
    start: u32,
    len: u32,
    prev: i32,
    next: i32,
    /// The token of a merged symbol; a single character is looked up at the end.
    id: Option<u32>,
}

/// A candidate merge, ordered as llama.cpp's `llm_bigram_spm::comparator`: the higher
/// score first, then the leftmost. Scores are never NaN.
#[derive(Clone, Copy)]
struct Bigram {
    score: f32,
    left: u32,
    right: u32,
    size: u32,
    id: u32,
}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Bigram {}

/// The state of one fragment's merge.
struct Merge<'a> {
    text: &'a str,
    syms: Vec<Sym>,
    heap: BinaryHeap<Bigram>,
}

impl Merge<'_> {
    /// The text of `sym` extended by `extra` bytes (the symbol after it).
    fn sym_text(&self, sym: Sym, extra: u32) -> &str {
        let start = sym.start as usize;
        &self.text[start..start + (sym.len + extra) as usize]
    }
}

#[cfg(test)]
mod tests {
    use ds4_gguf::{GgufError, Value, ValueType};

    use super::super::tests::{
        build, build_with, build_without, err_text, ints, strs, BYTE, CONTROL, NORMAL, UNKNOWN,
        USER,
    };
    use super::super::{StreamDecoder, Tokenizer, TokenizerError};

    /// Special tokens, then the 256 byte tokens (ids 6..=261), then these normal
    /// tokens with their scores.
    const SPECIALS: &[(&str, i32)] = &[
        ("<pad>", CONTROL),
        ("<eos>", CONTROL),
        ("<bos>", CONTROL),
        ("<unk>", UNKNOWN),
        ("<ctrl>", CONTROL),
        ("<u>", USER),
    ];
    const FIRST_BYTE: u32 = 6;
    const NORMALS: &[(&str, f32)] = &[
        ("a", -1.0),
        ("b", -1.0),
        ("c", -1.0),
        ("▁", -1.0),
        ("▁▁", -3.0),
        ("ab", -5.0),
        ("bc", -4.0),
        ("aa", -2.0),
        ("▁a", -2.0),
    ];

    fn floats(items: &[f32]) -> Value {
        Value::Array {
            elem: ValueType::F32,
            items: items.iter().map(|&x| Value::F32(x)).collect(),
        }
    }

    /// The synthetic vocabulary: texts, types and scores.
    fn table() -> (Vec<String>, Vec<i32>, Vec<f32>) {
        let mut texts: Vec<String> = SPECIALS.iter().map(|t| t.0.to_owned()).collect();
        let mut types: Vec<i32> = SPECIALS.iter().map(|t| t.1).collect();
        let mut scores = vec![-1000.0; SPECIALS.len()];
        for b in 0..=255u8 {
            texts.push(format!("<0x{b:02X}>"));
            types.push(BYTE);
            scores.push(0.0);
        }
        for &(text, score) in NORMALS {
            texts.push(text.to_owned());
            types.push(NORMAL);
            scores.push(score);
        }
        (texts, types, scores)
    }

    fn kv_of(texts: &[String], types: &[i32], scores: Value) -> Vec<(&'static str, Value)> {
        let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
        vec![
            ("tokenizer.ggml.model", Value::String("llama".into())),
            ("tokenizer.ggml.tokens", strs(&texts)),
            ("tokenizer.ggml.token_type", ints(types)),
            ("tokenizer.ggml.scores", scores),
            ("tokenizer.ggml.bos_token_id", Value::U32(2)),
            ("tokenizer.ggml.eos_token_id", Value::U32(1)),
            ("tokenizer.ggml.add_space_prefix", Value::Bool(false)),
        ]
    }

    fn base() -> Vec<(&'static str, Value)> {
        let (texts, types, scores) = table();
        kv_of(&texts, &types, floats(&scores))
    }

    fn with(key: &'static str, value: Value) -> Result<Tokenizer, TokenizerError> {
        build_with(base(), key, value)
    }

    fn tok() -> Tokenizer {
        build(&base()).expect("tiny SPM tokenizer")
    }

    fn byte(b: u8) -> u32 {
        FIRST_BYTE + u32::from(b)
    }

    #[test]
    fn empty_text() {
        let t = tok();
        assert_eq!(t.encode("", false, true), []);
        // BOS is added by default for SPM, even to an empty text.
        assert_eq!(t.encode("", true, true), [2]);
    }

    #[test]
    fn spaces_are_escaped_and_merged() {
        let t = tok();
        let id = |s: &str| t.token_id(s).unwrap();
        assert_eq!(t.encode(" ", false, false), [id("▁")]);
        // Equal scores: the leftmost pair merges first.
        assert_eq!(t.encode("   ", false, false), [id("▁▁"), id("▁")]);
        assert_eq!(t.encode(" a", false, false), [id("▁a")]);
        assert_eq!(t.decode(&t.encode("a  a ", false, false), false), b"a  a ");
    }

    #[test]
    fn higher_score_merges_first_then_leftmost() {
        let t = tok();
        let id = |s: &str| t.token_id(s).unwrap();
        // "bc" (-4) beats "ab" (-5) although "ab" is further left.
        assert_eq!(t.encode("abc", false, false), [id("a"), id("bc")]);
        assert_eq!(t.encode("aaa", false, false), [id("aa"), id("a")]);
        assert_eq!(t.encode("aaaa", false, false), [id("aa"), id("aa")]);
    }

    #[test]
    fn minus_zero_ties_with_zero() {
        // llama.cpp compares scores with `<`: -0.0 and 0.0 tie, so the leftmost wins.
        let (texts, types, mut scores) = table();
        let at = |s: &str| texts.iter().position(|t| t == s).unwrap();
        scores[at("ab")] = -0.0;
        scores[at("bc")] = 0.0;
        let t = build(&kv_of(&texts, &types, floats(&scores))).unwrap();
        let id = |s: &str| t.token_id(s).unwrap();
        assert_eq!(t.encode("abc", false, false), [id("ab"), id("c")]);
    }

    #[test]
    fn unknown_characters_fall_back_to_bytes() {
        let t = tok();
        let a = t.token_id("a").unwrap();
        assert_eq!(t.encode("z", false, false), [byte(b'z')]);
        assert_eq!(
            t.encode("a€", false, false),
            [a, byte(0xE2), byte(0x82), byte(0xAC)]
        );
        // Decoding gives the bytes back; streamed, the character comes out whole.
        let ids = t.encode("€a", false, false);
        assert_eq!(t.decode(&ids, false), "€a".as_bytes());
        let mut stream = StreamDecoder::new();
        let out: Vec<String> = ids
            .iter()
            .map(|&id| stream.push(t.token_piece(id, false)).to_owned())
            .collect();
        assert_eq!(out, ["", "", "€", "a"]);
    }

    #[test]
    fn special_token_in_the_middle() {
        let t = tok();
        let a = t.token_id("a").unwrap();
        let b = t.token_id("b").unwrap();
        assert_eq!(t.encode("a<ctrl>b", false, true), [a, 4, b]);
        // Without parse_special the control text is raw text; none of its characters
        // but 'c' is a token.
        let bytes = |s: &str| s.bytes().map(byte).collect::<Vec<_>>();
        let mut want = vec![a];
        want.extend(bytes("<"));
        want.push(t.token_id("c").unwrap());
        want.extend(bytes("trl>"));
        want.push(b);
        assert_eq!(t.encode("a<ctrl>b", false, false), want);
        // User-defined tokens are matched either way.
        assert_eq!(t.encode("a<u>b", false, false), [a, 5, b]);
        assert_eq!(t.decode(&[a, 4, 5, b], true), b"a<ctrl><u>b");
        assert_eq!(t.decode(&[a, 4, 5, b], false), b"a<u>b");
    }

    #[test]
    fn space_prefix_at_the_start_and_after_special_tokens() {
        let t = with("tokenizer.ggml.add_space_prefix", Value::Bool(true)).unwrap();
        let sa = t.token_id("▁a").unwrap();
        assert_eq!(t.encode("a", false, false), [sa]);
        assert_eq!(t.encode("a", true, false), [2, sa]);
        assert_eq!(t.encode("a<ctrl>a<u>a", false, true), [sa, 4, sa, 5, sa]);
        assert_eq!(t.encode("", false, false), []);
        // The key defaults to true for SPM.
        let t = build_without(base(), "tokenizer.ggml.add_space_prefix").unwrap();
        assert_eq!(t.encode("a", false, false), [sa]);
    }

    #[test]
    fn defaults_and_end_of_generation() {
        let t = tok();
        assert_eq!((t.bos(), t.eos()), (Some(2), Some(1)));
        assert_eq!(t.eog_ids(), [1]);
        // llama.cpp's SPM defaults: BOS 1, EOS 2.
        let kv: Vec<_> = base()
            .into_iter()
            .filter(|(k, _)| !k.ends_with("_token_id"))
            .collect();
        let t = build(&kv).unwrap();
        assert_eq!((t.bos(), t.eos()), (Some(1), Some(2)));
        let t = with("tokenizer.ggml.add_bos_token", Value::Bool(false)).unwrap();
        assert_eq!(t.encode("a", true, true), [t.token_id("a").unwrap()]);
    }

    #[test]
    fn scores_may_be_integers_or_absent() {
        let (texts, types, scores) = table();
        let int_scores: Vec<i32> = scores.iter().map(|&s| s as i32).collect();
        let t = build(&kv_of(&texts, &types, ints(&int_scores))).unwrap();
        let id = |s: &str| t.token_id(s).unwrap();
        assert_eq!(t.encode("abc", false, false), [id("a"), id("bc")]);
        // Without scores every pair ties: leftmost first.
        let t = build_without(base(), "tokenizer.ggml.scores").unwrap();
        assert_eq!(t.encode("abc", false, false), [id("ab"), id("c")]);
    }

    #[test]
    fn malformed_vocabularies_fail_at_load() {
        let (texts, types, mut scores) = table();
        let e = err_text(with("tokenizer.ggml.scores", floats(&[0.0; 3])));
        assert!(e.contains("tokenizer.ggml.scores has 3 entries"), "{e}");
        let e = err_text(with("tokenizer.ggml.scores", strs(&vec!["x"; texts.len()])));
        assert!(
            e.contains("tokenizer.ggml.scores") && e.contains("f32"),
            "{e}"
        );
        assert!(matches!(
            with("tokenizer.ggml.scores", Value::F32(0.0)),
            Err(TokenizerError::Gguf(GgufError::WrongValueType { .. }))
        ));
        scores[7] = f32::NAN;
        let e = err_text(build(&kv_of(&texts, &types, floats(&scores))));
        assert!(e.contains("tokenizer.ggml.scores[7] is NaN"), "{e}");
        // A byte without its <0xXX> token (only ASCII may fall back to the byte itself).
        let (mut texts, mut types) = (texts, types);
        let scores = floats(&table().2);
        let e_id = byte(0xE2) as usize;
        (texts[e_id], types[e_id]) = ("x".into(), NORMAL);
        let e = err_text(build(&kv_of(&texts, &types, scores.clone())));
        assert!(e.contains("no byte token \"<0xE2>\""), "{e}");
        (texts[e_id], types[e_id]) = ("<0xE2>".into(), BYTE);
        let z_id = byte(b'z') as usize;
        (texts[z_id], types[z_id]) = ("z".into(), NORMAL);
        let t = build(&kv_of(&texts, &types, scores)).unwrap();
        assert_eq!(t.encode("z", false, false), [z_id as u32]);
    }
}
