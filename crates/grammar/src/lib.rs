//! Constrained decoding. A [`Vocab`] is a model's vocabulary as the grammar
//! engine (llguidance) sees it: every token's bytes in a trie, control tokens
//! behind a marker byte so that no text can spell them, and the end-of-turn
//! token as the one that closes a finished grammar. A [`Constraint`] is one
//! request's grammar (Lark, with `%json` for JSON Schema) running beside the
//! sampler: before each draw it masks the logits of every token the grammar
//! cannot take next, after it the drawn token is committed.
//!
//! Grammars are text: the chat crate writes each family's tool-call grammar and
//! the server the `response_format` ones, so nothing above this crate needs to
//! know the engine.

use std::sync::Arc;

use ds4_engine::Model;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{self, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};

#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The grammar (or a JSON schema in it) does not compile.
    #[error("the grammar does not compile: {0}")]
    Compile(String),
    /// The grammar cannot take a token it was given (a caller's bug, or text
    /// that was generated before the constraint started).
    #[error("the grammar refused the output: {0}")]
    Refused(String),
    #[error("the vocabulary cannot be used for constrained decoding: {0}")]
    Vocab(String),
}

/// The model's tokenizer as llguidance's `TokenizerEnv`.
struct Env {
    trie: TokTrie,
    model: Arc<Model>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Text as text: control-token spellings in it are not control tokens.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<toktrie::TokenId> {
        self.model
            .tokenizer
            .encode(&String::from_utf8_lossy(s), false, false)
    }
}

/// A model's vocabulary prepared for grammars; build once per model (it walks
/// every token), share it between requests.
#[derive(Clone)]
pub struct Vocab {
    factory: Arc<ParserFactory>,
    n_vocab: usize,
    closers: Arc<[u8]>,
    end_of_turn: u32,
}

/// How strongly a token's first byte closes what is open, for winding down
/// (0: not at all). A quote first: inside a string only it ends the string
/// (`}` and `]` there are text); then the ends of objects and arrays; then the
/// newline before a call's closing tag; last a comma, which ends a number or a
/// value when the object still owes a required key (without it a number could
/// run on digit by digit to the limit).
fn closer_rank(word: &[u8]) -> u8 {
    match word.first() {
        Some(b'"') => 1,
        Some(b'}' | b']') => 2,
        Some(b'\n') => 3,
        Some(b',') => 4,
        _ => 0,
    }
}

impl std::fmt::Debug for Vocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocab")
            .field("n_vocab", &self.n_vocab)
            .finish()
    }
}

impl Vocab {
    /// `end_of_turn` is the token a finished grammar allows (and only it): the
    /// template's end of the assistant turn, which also ends the generation.
    pub fn new(model: Arc<Model>, end_of_turn: u32) -> Result<Self, GrammarError> {
        let tokenizer = &model.tokenizer;
        let n_vocab = tokenizer.n_vocab();
        if end_of_turn as usize >= n_vocab {
            return Err(GrammarError::Vocab(format!(
                "end-of-turn token {end_of_turn} is outside the vocabulary of {n_vocab}"
            )));
        }
        let words: Vec<Vec<u8>> = (0..n_vocab as u32)
            .map(|id| {
                let text = tokenizer.token_piece(id, false);
                let spelled = tokenizer.token_piece(id, true);
                if text.is_empty() && !spelled.is_empty() {
                    // A control token: reachable only through the marker byte,
                    // which no UTF-8 text contains.
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(spelled);
                    w
                } else {
                    text.to_vec()
                }
            })
            .collect();
        if let Some(id) = words.iter().position(|w| w.len() > u8::MAX as usize) {
            return Err(GrammarError::Vocab(format!(
                "token {id} is {} bytes long (255 at most)",
                words[id].len()
            )));
        }
        let closers: Arc<[u8]> = words.iter().map(|w| closer_rank(w)).collect();
        let mut info = TokRxInfo::new(n_vocab as u32, end_of_turn);
        info.tok_end_of_turn = Some(end_of_turn);
        info.tok_bos = tokenizer.bos();
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(Env { trie, model });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Vocab(e.to_string()))?;
        // Library code reports through its callers, never on stderr.
        factory.quiet();
        Ok(Vocab {
            factory: Arc::new(factory),
            n_vocab,
            closers,
            end_of_turn,
        })
    }

    /// A constraint that holds the output to the Lark grammar `lark`.
    pub fn constraint(&self, lark: &str) -> Result<Constraint, GrammarError> {
        let grammar = TopLevelGrammar::from_lark(lark.to_string());
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError::Compile(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Compile(e));
        }
        Ok(Constraint {
            matcher,
            n_vocab: self.n_vocab,
            closers: Arc::clone(&self.closers),
            end_of_turn: self.end_of_turn,
        })
    }
}

/// One generation's grammar state.
pub struct Constraint {
    matcher: Matcher,
    n_vocab: usize,
    closers: Arc<[u8]>,
    end_of_turn: u32,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Constraint {
    /// Sets the logit of every token the grammar cannot take next to -inf
    /// (tokens past the vocabulary too); once the grammar is complete only the
    /// end-of-turn token is left.
    ///
    /// `wind_down` (the token budget is nearly spent, or the output loops): the
    /// end of turn alone when the grammar may end here; else only the allowed
    /// tokens of the best closing rank (a quote, then `}` / `]`, then a
    /// newline, then a comma; see [`closer_rank`]), so open strings, arrays and objects close
    /// as soon as the grammar lets them and the output still parses. Where none
    /// can come next (a required key, a number's first digit) the plain mask
    /// stands.
    pub fn mask(&mut self, logits: &mut [f32], wind_down: bool) -> Result<(), GrammarError> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Refused(e.to_string()))?;
        if allowed.is_zero() {
            return Err(GrammarError::Refused("no token can continue".into()));
        }
        let ok = |id: usize| id < self.n_vocab && allowed.is_allowed(id as u32);
        if wind_down && ok(self.end_of_turn as usize) {
            for (id, l) in logits.iter_mut().enumerate() {
                if id != self.end_of_turn as usize {
                    *l = f32::NEG_INFINITY;
                }
            }
            return Ok(());
        }
        let rank = if wind_down {
            (0..self.n_vocab)
                .filter(|&id| self.closers[id] > 0 && ok(id))
                .map(|id| self.closers[id])
                .min()
        } else {
            None
        };
        for (id, l) in logits.iter_mut().enumerate() {
            if !ok(id) || rank.is_some_and(|r| self.closers[id] != r) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advances the grammar by the tokens that were generated.
    pub fn commit(&mut self, tokens: &[u32]) -> Result<(), GrammarError> {
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher
            .consume_tokens(tokens)
            .map_err(|e| GrammarError::Refused(e.to_string()))
    }

    /// The tokens the grammar forces next whatever the model prefers (a
    /// schema's fixed keys and punctuation, a tool's name once its start
    /// settles it, a call's closing markup), split as the tokenizer splits
    /// them: a draft that the model keeps unless it spells the same bytes
    /// with other tokens. Empty where the next token is free or the grammar
    /// has stopped.
    pub fn forced(&mut self) -> Vec<u32> {
        match self.matcher.is_stopped() {
            true => vec![],
            false => self.matcher.compute_ff_tokens(),
        }
    }

    /// Whether the output so far is a complete sentence of the grammar.
    pub fn is_complete(&mut self) -> bool {
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }
}

#[cfg(test)]
mod tests;
