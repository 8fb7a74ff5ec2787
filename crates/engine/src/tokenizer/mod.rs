//! Tokenizers built from GGUF metadata, token-for-token identical to llama.cpp
//! (src/llama-vocab.cpp, src/unicode.cpp).
//!
//! A [`Tokenizer`] is a token table (`vocab`: texts, attributes, special ids, the
//! end-of-generation set, precomputed pieces) plus one vocabulary model. Encoding
//! first cuts literal special-token texts out of the input (`special`), then hands
//! each raw-text fragment to the model. Supported so far:
//!
//! | `tokenizer.ggml.model` | `tokenizer.ggml.pre` | model |
//! |---|---|---|
//! | `gpt2` | `smollm`, `joyai-llm` | byte-level BPE (`bpe`, pre-tokenizers in `pretokenize`), e.g. SmolLM2, DeepSeek V4 |
//! | `llama` | not read (llama.cpp ignores it too) | SentencePiece-style merges by score with byte fallback (`spm`), e.g. Gemma 3 |
//!
//! Decoding concatenates per-token pieces; it does not strip a leading BOS, nor the
//! space an SPM `add_space_prefix` puts in front, nor clean up spaces the way
//! `llama_detokenize` can be asked to.

mod bpe;
mod pretokenize;
mod segments;
mod special;
mod spm;
mod stream;
mod vocab;

#[cfg(test)]
mod tests;

use ds4_gguf::{Gguf, GgufError};

pub use segments::Segment;
pub use stream::StreamDecoder;

use bpe::Bpe;
use special::Fragment;
use spm::Spm;
use vocab::Vocab;

const KEY_MODEL: &str = "tokenizer.ggml.model";

/// Why a GGUF's tokenizer metadata cannot be used. Every variant names the key or the
/// token at fault.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A required key is missing or has the wrong type.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{key} = {value:?} is not supported (supported: {supported})")]
    Unsupported {
        key: &'static str,
        value: String,
        supported: &'static str,
    },
    #[error("tokenizer.ggml.tokens has {n} entries (expected 1 to 2^31-1)")]
    VocabSize { n: usize },
    #[error("{key} has {len} entries, but tokenizer.ggml.tokens has {n_vocab}")]
    LengthMismatch {
        key: &'static str,
        len: usize,
        n_vocab: usize,
    },
    #[error("tokenizer.ggml.token_type[{id}] = {value} is not a token type (0..=6)")]
    BadTokenType { id: u32, value: i64 },
    #[error("tokenizer.ggml.tokens: {text:?} is both token {first} and token {second}")]
    DuplicateToken {
        text: String,
        first: u32,
        second: u32,
    },
    #[error("tokenizer.ggml.merges[{rank}] = {merge:?}: {why}")]
    BadMerge {
        rank: usize,
        merge: String,
        why: &'static str,
    },
    #[error("{key} = {id} is out of range (n_vocab = {n_vocab})")]
    SpecialIdOutOfRange {
        key: &'static str,
        id: u64,
        n_vocab: u32,
    },
    #[error("{add_key} is true, but {id_key} is not set")]
    AddWithoutId {
        add_key: &'static str,
        id_key: &'static str,
    },
    #[error("token {id} {text:?} has type byte but is not of the form <0xXX>")]
    BadByteToken { id: u32, text: String },
    #[error("tokenizer.ggml.tokens has no byte token {text:?} (SPM byte fallback needs all 256)")]
    MissingByteToken { text: String },
    #[error("tokenizer.ggml.scores[{id}] is NaN")]
    NanScore { id: u32 },
}

/// The vocabulary model that turns raw text into tokens.
enum Model {
    /// Byte-level BPE (`gpt2`).
    Bpe(Bpe),
    /// SentencePiece-style merges by score, with byte fallback (`llama`).
    Spm(Spm),
}

/// A tokenizer loaded from GGUF metadata. Immutable; share it freely.
pub struct Tokenizer {
    vocab: Vocab,
    model: Model,
}

impl Tokenizer {
    /// Reads and validates the `tokenizer.ggml.*` metadata of `g`.
    pub fn from_gguf(g: &Gguf) -> Result<Self, TokenizerError> {
        let name = g.get_str(KEY_MODEL)?;
        let (vocab, model) = match name {
            "gpt2" => {
                let vocab = Vocab::from_gguf(g, &Bpe::DEFAULTS, Bpe::normal_piece)?;
                let bpe = Bpe::from_gguf(g, &vocab)?;
                (vocab, Model::Bpe(bpe))
            }
            "llama" => {
                let vocab = Vocab::from_gguf(g, &Spm::DEFAULTS, Spm::normal_piece)?;
                let spm = Spm::from_gguf(g, &vocab)?;
                (vocab, Model::Spm(spm))
            }
            _ => {
                return Err(TokenizerError::Unsupported {
                    key: KEY_MODEL,
                    value: name.to_owned(),
                    supported: "gpt2, llama",
                })
            }
        };
        Ok(Tokenizer { vocab, model })
    }

    /// Tokenizes `text`. `add_special` adds BOS/EOS where the GGUF asks for them
    /// (`tokenizer.ggml.add_bos_token` / `add_eos_token`); `parse_special` turns
    /// literal control-token texts such as `<|im_start|>` into their ids (user-defined
    /// tokens are matched either way, as in llama.cpp).
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        let v = &self.vocab;
        if add_special && v.add_bos {
            out.extend(v.bos());
        }
        self.encode_into(text, parse_special, true, &mut out);
        if add_special && v.add_eos {
            out.extend(v.eos());
        }
        out
    }

    /// Appends the tokens of `text` (no BOS/EOS), special texts parsed as
    /// [`Tokenizer::encode`] says.
    /// Appends `text`'s tokens. `after_special`: whether it starts the text or
    /// follows a special token, where SPM puts its space prefix.
    fn encode_into(
        &self,
        text: &str,
        parse_special: bool,
        mut after_special: bool,
        out: &mut Vec<u32>,
    ) {
        for frag in self.vocab.specials.partition(text, parse_special) {
            match frag {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(range) => {
                    match &self.model {
                        Model::Bpe(bpe) => bpe.encode(&text[range], out),
                        Model::Spm(spm) => {
                            spm.encode(&self.vocab, &text[range], after_special, out)
                        }
                    }
                    after_special = false;
                }
            }
        }
    }

    /// Tokenizes `text` with the vocabulary model alone: no special-token text
    /// is recognized, not even a user-defined one, and nothing is added (the
    /// DeepSeek V4 reference engine's `bpe_tokenize_text`).
    pub fn encode_plain(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        match &self.model {
            Model::Bpe(bpe) => bpe.encode(text, &mut out),
            Model::Spm(spm) => spm.encode(&self.vocab, text, true, &mut out),
        }
        out
    }

    /// Concatenated pieces of `ids` (see [`Tokenizer::token_piece`]). The bytes need
    /// not be valid UTF-8 when `ids` ends inside a character.
    pub fn decode(&self, ids: &[u32], render_special: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            out.extend_from_slice(self.token_piece(id, render_special));
        }
        out
    }

    /// The text of a prompt's ids: their pieces with special tokens rendered, but
    /// without the BOS that [`encode`](Self::encode) with `add_special` puts first
    /// (it is not in the prompt's text). Encoding this text that way gives `ids`
    /// back for a prompt that was tokenized that way, so it is the text a
    /// checkpoint of these ids is found by.
    pub fn prompt_text(&self, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for (i, &id) in ids.iter().enumerate() {
            out.extend_from_slice(self.prompt_piece(i, id));
        }
        out
    }

    /// What token `id` at index `i` of a prompt's ids adds to
    /// [`prompt_text`](Self::prompt_text): nothing for the added BOS, its piece
    /// otherwise.
    pub fn prompt_piece(&self, i: usize, id: u32) -> &[u8] {
        if i == 0 && self.vocab.add_bos && self.vocab.bos() == Some(id) {
            return &[];
        }
        self.token_piece(id, true)
    }

    /// The bytes token `id` stands for. Control and unknown tokens render as their
    /// text only when `render_special`; user-defined tokens always do. Ids outside
    /// the vocabulary render as nothing.
    pub fn token_piece(&self, id: u32, render_special: bool) -> &[u8] {
        self.vocab.piece(id, render_special)
    }

    /// Number of tokens (ids are `0..n_vocab`).
    pub fn n_vocab(&self) -> usize {
        self.vocab.n_vocab() as usize
    }

    pub fn bos(&self) -> Option<u32> {
        self.vocab.bos()
    }

    pub fn eos(&self) -> Option<u32> {
        self.vocab.eos()
    }

    /// Whether generating `id` ends the turn (llama.cpp `llama_vocab_is_eog`).
    pub fn is_eog(&self, id: u32) -> bool {
        self.vocab.is_eog(id)
    }

    /// All end-of-generation ids, sorted.
    pub fn eog_ids(&self) -> &[u32] {
        self.vocab.eog()
    }

    /// The id of the token whose (stored) text is exactly `text`, e.g. `<|im_end|>`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.token_id(text)
    }
}
