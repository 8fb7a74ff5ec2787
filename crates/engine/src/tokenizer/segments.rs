//! Prompts from two sources, and what text-keyed reuse may do with them.
//!
//! A chat prompt is a template's own markup, whose literal control-token texts
//! (`<|im_start|>`) are control tokens, around content (messages, tool schemas,
//! tool results), which is text whatever it spells: a message that types
//! `<|im_end|>` must not close its own turn. [`Tokenizer::encode_segments`]
//! encodes such a prompt: control tokens are only what markup spells by itself;
//! everything between them is encoded as one text run, exactly as `encode`
//! encodes the text between special tokens (user-defined tokens still match
//! anywhere, as they do without `parse_special`). A prompt whose content spells
//! no control token therefore gets the tokens `encode(text, .., true)` gives.
//!
//! The same bytes can now be one control token or several text tokens, so a
//! match by text alone (a live session's text or a checkpoint's being a prefix
//! of a prompt) could pair a prompt with tokens that read its bytes otherwise.
//! [`Tokenizer::continuation`] is where such a reuse is decided: the held tokens
//! must have their control tokens exactly where the prompt's own tokens do
//! (same ids, same byte offsets) and none may straddle the cut; the rest is
//! encoded with the prompt's control tokens and no others.
//!
//! [`Tokenizer::min_tokens`] bounds a text's token count from below without
//! encoding it, so a prompt that cannot fit a context is refused for the price
//! of one pass over its bytes. Several bytes can be one token, never one byte
//! several tokens (a byte-level vocabulary covers each byte exactly once, and
//! SPM's byte fallback too), so the bound divides the bytes by the longest
//! token piece (81 bytes for SmolLM2). Bytes a BPE vocabulary has no token for
//! are dropped by encoding and do not count: a text of them alone is zero
//! tokens.

use std::ops::Range;

use super::special::Fragment;
use super::{Model, Tokenizer};

/// A piece of a prompt and how the special-token texts in it are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Segment<'a> {
    /// A template's own text: the special-token texts it spells are control
    /// tokens.
    Markup(&'a str),
    /// Content: text, whatever it spells.
    Text(&'a str),
}

impl Tokenizer {
    /// Tokenizes a prompt made of `segments` (see [`Segment`]); `add_special`
    /// adds BOS/EOS as [`Tokenizer::encode`] does.
    pub fn encode_segments(&self, segments: &[Segment<'_>], add_special: bool) -> Vec<u32> {
        let len = segments.iter().map(|s| s.text().len()).sum();
        let mut text = String::with_capacity(len);
        let mut controls = Vec::new();
        for s in segments {
            if let Segment::Markup(m) = s {
                let at = text.len();
                controls.extend(
                    self.controls_in(m)
                        .into_iter()
                        .map(|(r, id)| (r.start + at..r.end + at, id)),
                );
            }
            text.push_str(s.text());
        }
        let mut out = Vec::with_capacity(len / 3 + 2);
        let v = &self.vocab;
        if add_special && v.add_bos {
            out.extend(v.bos());
        }
        self.encode_around(&text, &controls, true, &mut out);
        if add_special && v.add_eos {
            out.extend(v.eos());
        }
        out
    }

    /// The tokens that extend `held` (e.g. a live session's, or a restored
    /// checkpoint's) to the text of `own` (a prompt's own tokens), or `None`
    /// when they must not: `held`'s text is not a prefix of `own`'s ending on a
    /// character boundary, or the two disagree on which bytes are control tokens
    /// up to the cut, or a control token of `own` straddles it. The rest is
    /// encoded with `own`'s control tokens and no others.
    pub fn continuation(&self, held: &[u32], own: &[u32]) -> Option<Vec<u32>> {
        let own_text = self.decode(own, true);
        let held_text = self.decode(held, true);
        if !own_text.starts_with(&held_text) {
            return None;
        }
        let cut = held_text.len();
        let own_controls = self.control_spans(own);
        let before = own_controls.partition_point(|(r, _)| r.start < cut);
        if own_controls[..before]
            .last()
            .is_some_and(|(r, _)| r.end > cut)
            || self.control_spans(held) != own_controls[..before]
        {
            return None;
        }
        let rest = std::str::from_utf8(&own_text[cut..]).ok()?;
        let later: Vec<_> = own_controls[before..]
            .iter()
            .map(|(r, id)| (r.start - cut..r.end - cut, *id))
            .collect();
        let mut out = Vec::new();
        let after_special = held.last().is_none_or(|&id| self.vocab.is_control(id));
        self.encode_around(rest, &later, after_special, &mut out);
        Some(out)
    }

    /// A lower bound on the number of tokens `text` encodes to, without
    /// encoding it: every byte the vocabulary model keeps is in exactly one
    /// token, and no token's piece is longer than the longest.
    pub fn min_tokens(&self, text: &str) -> usize {
        let kept = match &self.model {
            Model::Bpe(bpe) => bpe.kept_bytes(text),
            // Byte fallback covers every byte (a vocabulary without all 256
            // byte tokens fails to load).
            Model::Spm(_) => text.len(),
        };
        kept.div_ceil(self.longest_piece().max(1))
    }

    /// The longest token piece, in bytes: no token stands for more text.
    pub fn longest_piece(&self) -> usize {
        self.vocab.max_piece_len()
    }

    /// The control tokens `markup` spells, with their byte ranges in it.
    fn controls_in(&self, markup: &str) -> Vec<(Range<usize>, u32)> {
        let mut at = 0;
        let mut spans = Vec::new();
        for frag in self.vocab.specials.partition(markup, true) {
            match frag {
                Fragment::Text(r) => at = r.end,
                Fragment::Token(id) => {
                    let end = at + self.token_piece(id, true).len();
                    if self.vocab.is_control(id) {
                        spans.push((at..end, id));
                    }
                    at = end;
                }
            }
        }
        spans
    }

    /// The control tokens of `ids` with the byte ranges of their text in
    /// `decode(ids, true)`.
    fn control_spans(&self, ids: &[u32]) -> Vec<(Range<usize>, u32)> {
        let mut at = 0;
        let mut spans = Vec::new();
        for &id in ids {
            let len = self.token_piece(id, true).len();
            if self.vocab.is_control(id) {
                spans.push((at..at + len, id));
            }
            at += len;
        }
        spans
    }

    /// Appends `text` encoded with exactly the control tokens `controls` (in
    /// order, inside `text`) and the runs between them as text; `after_special`:
    /// whether `text` starts a prompt or follows a special token (SPM's space
    /// prefix).
    fn encode_around(
        &self,
        text: &str,
        controls: &[(Range<usize>, u32)],
        after_special: bool,
        out: &mut Vec<u32>,
    ) {
        let mut at = 0;
        let mut after = after_special;
        for (r, id) in controls {
            self.encode_into(&text[at..r.start], false, after, out);
            out.push(*id);
            at = r.end;
            after = true;
        }
        self.encode_into(&text[at..], false, after, out);
    }
}

impl<'a> Segment<'a> {
    /// The segment's text.
    pub fn text(&self) -> &'a str {
        match *self {
            Segment::Markup(s) | Segment::Text(s) => s,
        }
    }
}
