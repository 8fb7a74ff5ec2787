//! The token table shared by every vocabulary model: token texts and attributes,
//! special token ids, the end-of-generation set, and the decoded piece of every token.
//!
//! Loading follows `llama_vocab::impl::load` (src/llama-vocab.cpp) step by step, with
//! its text-based fix-ups of special tokens, because those decide which tokens are
//! matched as specials and which ones stop generation. Where llama.cpp depends on the
//! iteration order of an `unordered_map` ("first token whose text matches"), this
//! module takes the lowest id.

use ds4_gguf::Gguf;

use super::special::SpecialMatcher;
use super::TokenizerError;

const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const KEY_ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";

/// Token attributes, the bit values of llama.cpp's `llama_token_attr`. A token can
/// carry several: load-time fix-ups OR `CONTROL` into a token's type.
pub(crate) mod attr {
    pub const UNKNOWN: u16 = 1 << 0;
    pub const UNUSED: u16 = 1 << 1;
    pub const NORMAL: u16 = 1 << 2;
    pub const CONTROL: u16 = 1 << 3;
    pub const USER_DEFINED: u16 = 1 << 4;
    pub const BYTE: u16 = 1 << 5;
}

/// `tokenizer.ggml.token_type` value to attribute (llama.cpp `LLAMA_TOKEN_TYPE_*`).
fn attr_of_type(t: i64) -> Option<u16> {
    Some(match t {
        0 => 0, // undefined
        1 => attr::NORMAL,
        2 => attr::UNKNOWN,
        3 => attr::CONTROL,
        4 => attr::USER_DEFINED,
        5 => attr::UNUSED,
        6 => attr::BYTE,
        _ => return None,
    })
}

/// What a vocabulary model assumes when the GGUF does not say: special token ids, and
/// whether BOS is added (`tokenizer.ggml.add_bos_token`).
pub(crate) struct Defaults {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub unk: Option<u32>,
    pub add_bos: bool,
}

/// An optional boolean key: `None` when absent, an error when of another type.
pub(crate) fn get_flag(g: &Gguf, key: &str) -> Result<Option<bool>, TokenizerError> {
    Ok(match g.get(key) {
        Some(_) => Some(g.get_bool(key)?),
        None => None,
    })
}

/// Special token ids (llama.cpp `special_*_id`).
#[derive(Clone, Copy, Debug, Default)]
struct SpecialIds {
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    eom: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    fim_pre: Option<u32>,
    fim_suf: Option<u32>,
    fim_mid: Option<u32>,
    fim_pad: Option<u32>,
    fim_rep: Option<u32>,
    fim_sep: Option<u32>,
}

type Slot = fn(&mut SpecialIds) -> &mut Option<u32>;

/// The id keys llama.cpp reads, in its order: the deprecated prefix/suffix/middle keys
/// come last and override the fim_* ones.
const SPECIAL_KEYS: [(&str, Slot); 15] = [
    (KEY_BOS, |s| &mut s.bos),
    (KEY_EOS, |s| &mut s.eos),
    ("tokenizer.ggml.eot_token_id", |s| &mut s.eot),
    ("tokenizer.ggml.eom_token_id", |s| &mut s.eom),
    ("tokenizer.ggml.unknown_token_id", |s| &mut s.unk),
    ("tokenizer.ggml.padding_token_id", |s| &mut s.pad),
    ("tokenizer.ggml.fim_pre_token_id", |s| &mut s.fim_pre),
    ("tokenizer.ggml.fim_suf_token_id", |s| &mut s.fim_suf),
    ("tokenizer.ggml.fim_mid_token_id", |s| &mut s.fim_mid),
    ("tokenizer.ggml.fim_pad_token_id", |s| &mut s.fim_pad),
    ("tokenizer.ggml.fim_rep_token_id", |s| &mut s.fim_rep),
    ("tokenizer.ggml.fim_sep_token_id", |s| &mut s.fim_sep),
    ("tokenizer.ggml.prefix_token_id", |s| &mut s.fim_pre),
    ("tokenizer.ggml.suffix_token_id", |s| &mut s.fim_suf),
    ("tokenizer.ggml.middle_token_id", |s| &mut s.fim_mid),
];

// Texts llama.cpp recognises when the GGUF has no id for the role
// (`llama_vocab::impl::load`, "auto-detect special tokens by text").
const DEEPSEEK_EOS: &str = "<\u{FF5C}end\u{2581}of\u{2581}sentence\u{FF5C}>";
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    DEEPSEEK_EOS,
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<\u{FF5C}fim\u{2581}begin\u{FF5C}>",
    "<PRE>",
    "\u{2581}<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<\u{FF5C}fim\u{2581}hole\u{FF5C}>",
    "<SUF>",
    "\u{2581}<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<\u{FF5C}fim\u{2581}end\u{FF5C}>",
    "<MID>",
    "\u{2581}<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];
/// Tokens that end generation, whatever their role.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    DEEPSEEK_EOS,
    "[e~[",
];
/// DeepSeek V4's markup tokens, always rendered (see `render_deepseek4_markup`).
const DEEPSEEK4_MARKUP: [&str; 3] = ["<think>", "</think>", "\u{FF5C}DSML\u{FF5C}"];

/// gpt-oss tokens llama.cpp always renders (forced to user-defined).
const ALWAYS_RENDERED_TEXTS: &[&str] =
    &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// Token texts in one arena, with an open-addressing index from text to id: one
/// allocation instead of two per token, and a cheap hash (loading does ~200k lookups).
struct TokenTable {
    arena: String,
    /// `arena[off[id]..off[id + 1]]` is the text of `id`.
    off: Vec<u32>,
    /// Ids by hash slot, `EMPTY_SLOT` where free; length a power of two > 2 n_vocab.
    slots: Vec<u32>,
}

const EMPTY_SLOT: u32 = u32::MAX;

/// A multiply-rotate hash over 8-byte words (FxHash-like), plus a final fold so the
/// low bits used for the slot index depend on the whole input.
fn hash_text(b: &[u8]) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let mut h = b.len() as u64;
    let mut words = b.chunks_exact(8);
    for w in &mut words {
        let mut x = [0u8; 8];
        x.copy_from_slice(w);
        h = (h.rotate_left(5) ^ u64::from_le_bytes(x)).wrapping_mul(K);
    }
    let rest = words.remainder();
    if !rest.is_empty() {
        let mut x = [0u8; 8];
        x[..rest.len()].copy_from_slice(rest);
        h = (h.rotate_left(5) ^ u64::from_le_bytes(x)).wrapping_mul(K);
    }
    h ^ (h >> 29) ^ (h >> 47)
}

impl TokenTable {
    fn with_capacity(n: usize, n_bytes: usize) -> Self {
        TokenTable {
            arena: String::with_capacity(n_bytes),
            off: {
                let mut off = Vec::with_capacity(n + 1);
                off.push(0);
                off
            },
            slots: vec![EMPTY_SLOT; (2 * n + 1).next_power_of_two()],
        }
    }

    fn len(&self) -> usize {
        self.off.len() - 1
    }

    fn text(&self, id: u32) -> &str {
        &self.arena[self.off[id as usize] as usize..self.off[id as usize + 1] as usize]
    }

    /// The slot holding `text`, or the free slot where it would go.
    fn find_slot(&self, text: &str) -> usize {
        let mask = self.slots.len() - 1;
        let mut i = hash_text(text.as_bytes()) as usize & mask;
        loop {
            let id = self.slots[i];
            if id == EMPTY_SLOT || self.text(id) == text {
                return i;
            }
            i = (i + 1) & mask;
        }
    }

    fn get(&self, text: &str) -> Option<u32> {
        let id = self.slots[self.find_slot(text)];
        (id != EMPTY_SLOT).then_some(id)
    }

    /// Appends a token; `Err(first id)` if the text is already there. The caller
    /// keeps the total arena size within u32.
    fn push(&mut self, text: &str) -> Result<u32, u32> {
        let slot = self.find_slot(text);
        if self.slots[slot] != EMPTY_SLOT {
            return Err(self.slots[slot]);
        }
        let id = self.len() as u32;
        self.arena.push_str(text);
        self.off.push(self.arena.len() as u32);
        self.slots[slot] = id;
        Ok(id)
    }
}

pub(crate) struct Vocab {
    table: TokenTable,
    attrs: Vec<u16>,
    special: SpecialIds,
    pub(crate) add_bos: bool,
    pub(crate) add_eos: bool,
    /// End-of-generation ids, sorted.
    eog: Vec<u32>,
    /// Piece bytes of every token rendered with specials, `piece_off[id]..piece_off[id+1]`.
    pieces: Vec<u8>,
    piece_off: Vec<u32>,
    /// The longest piece, in bytes.
    max_piece_len: usize,
    pub(crate) specials: SpecialMatcher,
}

impl Vocab {
    /// Reads the token table. `normal_piece` renders a normal token's text as bytes
    /// (the model decides: byte-level BPE maps characters back to bytes).
    pub(crate) fn from_gguf(
        g: &Gguf,
        defaults: &Defaults,
        normal_piece: fn(&str, &mut Vec<u8>),
    ) -> Result<Self, TokenizerError> {
        let tokens = g.get_str_array(KEY_TOKENS)?;
        let n_vocab = tokens.len();
        if n_vocab == 0 || n_vocab > i32::MAX as usize {
            return Err(TokenizerError::VocabSize { n: n_vocab });
        }
        let types = g.get_i64_array(KEY_TOKEN_TYPE)?;
        if types.len() != n_vocab {
            return Err(TokenizerError::LengthMismatch {
                key: KEY_TOKEN_TYPE,
                len: types.len(),
                n_vocab,
            });
        }

        let n_bytes: usize = tokens.iter().map(|t| t.len().max(20)).sum();
        if n_bytes > u32::MAX as usize {
            return Err(TokenizerError::VocabSize { n: n_vocab });
        }
        let mut table = TokenTable::with_capacity(n_vocab, n_bytes);
        let mut attrs = Vec::with_capacity(n_vocab);
        for (i, (&text, &ty)) in tokens.iter().zip(&types).enumerate() {
            let id = i as u32;
            // llama.cpp renames empty tokens so that they stay distinct.
            let renamed: String;
            let text = if text.is_empty() {
                renamed = format!("[EMPTY_{id}]");
                renamed.as_str()
            } else {
                text
            };
            table
                .push(text)
                .map_err(|first| TokenizerError::DuplicateToken {
                    text: text.to_owned(),
                    first,
                    second: id,
                })?;
            attrs.push(attr_of_type(ty).ok_or(TokenizerError::BadTokenType { id, value: ty })?);
        }

        let mut v = Vocab {
            table,
            attrs,
            special: SpecialIds::default(),
            add_bos: false,
            add_eos: false,
            eog: Vec::new(),
            pieces: Vec::new(),
            piece_off: Vec::new(),
            max_piece_len: 0,
            specials: SpecialMatcher::default(),
        };
        v.read_special_ids(g, defaults)?;
        v.detect_special_tokens();
        if g.get("tokenizer.ggml.pre").and_then(|p| p.as_str()) == Some("joyai-llm") {
            v.render_deepseek4_markup();
        }
        v.specials = SpecialMatcher::new(
            (0..v.n_vocab()).map(|id| (v.table.text(id), v.attrs[id as usize])),
        );
        v.build_pieces(normal_piece)?;
        Ok(v)
    }

    fn read_special_ids(&mut self, g: &Gguf, defaults: &Defaults) -> Result<(), TokenizerError> {
        let n_vocab = self.n_vocab();
        // A default outside the vocabulary is disabled (llama.cpp warns and sets NULL).
        let in_range = |id: Option<u32>| id.filter(|&id| id < n_vocab);
        let mut s = SpecialIds {
            bos: in_range(defaults.bos),
            eos: in_range(defaults.eos),
            unk: in_range(defaults.unk),
            ..SpecialIds::default()
        };
        for (key, slot) in SPECIAL_KEYS {
            if g.get(key).is_none() {
                continue;
            }
            let id = g.get_u64(key)?;
            if id >= u64::from(n_vocab) {
                return Err(TokenizerError::SpecialIdOutOfRange { key, id, n_vocab });
            }
            *slot(&mut s) = Some(id as u32);
        }
        self.special = s;

        // No model supported so far adds EOS unless the GGUF says so.
        self.add_bos = get_flag(g, KEY_ADD_BOS)?.unwrap_or(defaults.add_bos);
        self.add_eos = get_flag(g, KEY_ADD_EOS)?.unwrap_or(false);
        if self.add_bos && s.bos.is_none() {
            return Err(TokenizerError::AddWithoutId {
                add_key: KEY_ADD_BOS,
                id_key: KEY_BOS,
            });
        }
        if self.add_eos && s.eos.is_none() {
            return Err(TokenizerError::AddWithoutId {
                add_key: KEY_ADD_EOS,
                id_key: KEY_EOS,
            });
        }
        Ok(())
    }

    /// llama.cpp's text-based fix-ups, in its order: fill unset roles by token text,
    /// force every such token to control type, collect the end-of-generation set.
    fn detect_special_tokens(&mut self) {
        let mut s = self.special;
        let roles: [(&mut Option<u32>, &[&str]); 8] = [
            (&mut s.eot, EOT_TEXTS),
            (&mut s.eom, EOM_TEXTS),
            (&mut s.fim_pre, FIM_PRE_TEXTS),
            (&mut s.fim_suf, FIM_SUF_TEXTS),
            (&mut s.fim_mid, FIM_MID_TEXTS),
            (&mut s.fim_pad, FIM_PAD_TEXTS),
            (&mut s.fim_rep, FIM_REP_TEXTS),
            (&mut s.fim_sep, FIM_SEP_TEXTS),
        ];
        for (slot, texts) in roles {
            if slot.is_some() {
                continue;
            }
            if let Some(id) = self.lowest_id_of(texts) {
                *slot = Some(id);
                self.attrs[id as usize] |= attr::CONTROL;
            }
        }
        self.special = s;

        let mut eog: Vec<u32> = [s.fim_pad, s.fim_rep, s.fim_sep]
            .into_iter()
            .flatten()
            .collect();
        for &text in EOG_TEXTS {
            if let Some(id) = self.token_id(text) {
                eog.push(id);
                self.attrs[id as usize] |= attr::CONTROL;
            }
        }
        for &text in ALWAYS_RENDERED_TEXTS {
            if let Some(id) = self.token_id(text) {
                self.attrs[id as usize] = attr::USER_DEFINED;
            }
        }
        eog.extend([s.eos, s.eot, s.eom].into_iter().flatten());
        eog.sort_unstable();
        eog.dedup();

        // gpt-oss / solar-open: "<|end|>" separates messages there, it does not end
        // generation; llama.cpp detects those vocabularies by their other EOG tokens.
        let has = |eog: &[u32], t: &str| eog.iter().any(|&id| self.table.text(id) == t);
        let has_call = has(&eog, "<|call|>") || has(&eog, "<|calls|>");
        // llama.cpp: (return && call && end) || (call && flush && end).
        if has(&eog, "<|end|>") && has_call && (has(&eog, "<|return|>") || has(&eog, "<|flush|>")) {
            eog.retain(|&id| {
                let keep = self.table.text(id) != "<|end|>";
                if !keep {
                    self.attrs[id as usize] = attr::USER_DEFINED;
                }
                keep
            });
        }
        // gemma4 / paddleocr: "</s>" is an ordinary token when "<|tool_response>" exists.
        if has(&eog, "<|tool_response>") && has(&eog, "</s>") {
            eog.retain(|&id| {
                let keep = self.table.text(id) != "</s>";
                if !keep {
                    self.attrs[id as usize] = attr::NORMAL;
                }
                keep
            });
        }
        self.eog = eog;
    }

    /// DeepSeek V4 (`joyai-llm`): the thinking tags and the DSML marker are
    /// text the model writes and the server reads (the original engine prints
    /// them; the official tokenizer marks them `special: false`), so they are
    /// user-defined whatever type the file gives them (the real vocabulary
    /// already does; a synthetic one may call them control).
    fn render_deepseek4_markup(&mut self) {
        for text in DEEPSEEK4_MARKUP {
            if let Some(id) = self.token_id(text) {
                self.attrs[id as usize] = attr::USER_DEFINED;
            }
        }
    }

    fn lowest_id_of(&self, texts: &[&str]) -> Option<u32> {
        texts.iter().filter_map(|t| self.token_id(t)).min()
    }

    /// Precomputes every token's piece as llama.cpp's `token_to_piece(.., special=true)`
    /// renders it (its `cache_token_to_piece`).
    fn build_pieces(&mut self, normal_piece: fn(&str, &mut Vec<u8>)) -> Result<(), TokenizerError> {
        let n = self.table.len();
        let mut pieces = Vec::with_capacity(self.table.arena.len());
        let mut off = Vec::with_capacity(n + 1);
        off.push(0u32);
        for (i, &a) in self.attrs.iter().enumerate() {
            let text = self.table.text(i as u32);
            if a & (attr::UNKNOWN | attr::CONTROL | attr::USER_DEFINED) != 0 {
                pieces.extend_from_slice(text.as_bytes());
            } else if a & attr::NORMAL != 0 {
                normal_piece(text, &mut pieces);
            } else if a & attr::BYTE != 0 {
                let byte = parse_byte_token(text).ok_or_else(|| TokenizerError::BadByteToken {
                    id: i as u32,
                    text: text.to_string(),
                })?;
                pieces.push(byte);
            }
            // Undefined and unused tokens render as nothing.
            let end = u32::try_from(pieces.len()).map_err(|_| TokenizerError::VocabSize { n })?;
            off.push(end);
        }
        self.max_piece_len = off
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0);
        self.pieces = pieces;
        self.piece_off = off;
        Ok(())
    }

    pub(crate) fn n_vocab(&self) -> u32 {
        self.table.len() as u32
    }

    pub(crate) fn token_id(&self, text: &str) -> Option<u32> {
        self.table.get(text)
    }

    pub(crate) fn bos(&self) -> Option<u32> {
        self.special.bos
    }

    pub(crate) fn eos(&self) -> Option<u32> {
        self.special.eos
    }

    pub(crate) fn eog(&self) -> &[u32] {
        &self.eog
    }

    pub(crate) fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// Whether `id` is a control (or unknown) token: one that only a parse with
    /// specials produces from text, and that renders only on request.
    pub(crate) fn is_control(&self, id: u32) -> bool {
        self.attrs
            .get(id as usize)
            .is_some_and(|a| a & (attr::UNKNOWN | attr::CONTROL) != 0)
    }

    /// The longest piece of any token, in bytes.
    pub(crate) fn max_piece_len(&self) -> usize {
        self.max_piece_len
    }

    /// The piece of `id`; control and unknown tokens are empty unless `render_special`.
    /// Out-of-range ids render as nothing.
    pub(crate) fn piece(&self, id: u32, render_special: bool) -> &[u8] {
        if id as usize >= self.attrs.len() || (!render_special && self.is_control(id)) {
            return &[];
        }
        let (start, end) = (self.piece_off[id as usize], self.piece_off[id as usize + 1]);
        &self.pieces[start as usize..end as usize]
    }
}

/// `<0xXX>` to its byte.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}
