//! A rendered prompt that remembers which of its bytes the template wrote.
//!
//! Only the template's own markup may produce control tokens: content (message
//! text, reasoning, tool schemas, calls and results) is text whatever it spells,
//! so a message that types `<|im_end|>` cannot close its turn and fake another.
//! The tokenizer reads the parts accordingly (`Tokenizer::encode_segments`).

use std::ops::Range;

/// Prompt text in order, with the byte ranges of template markup.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Prompt {
    text: String,
    /// Markup byte ranges, ascending; adjacent pushes are merged.
    markup: Vec<Range<usize>>,
}

impl Prompt {
    pub fn new() -> Self {
        Prompt::default()
    }

    /// Appends the template's own text (its special-token texts are control
    /// tokens).
    pub fn markup(&mut self, s: &str) {
        let (start, end) = (self.text.len(), self.text.len() + s.len());
        self.text.push_str(s);
        match self.markup.last_mut() {
            Some(last) if last.end == start => last.end = end,
            _ if s.is_empty() => {}
            _ => self.markup.push(start..end),
        }
    }

    /// Appends content (text, whatever it spells).
    pub fn content(&mut self, s: &str) {
        self.text.push_str(s);
    }

    /// The whole text.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    pub fn len(&self) -> usize {
        self.text.len()
    }

    pub fn is_empty(&self) -> bool {
        self.text.is_empty()
    }

    /// The first `end` bytes (a character boundary), markup kept as markup.
    ///
    /// # Panics
    /// When `end` is past the text or not on a character boundary.
    pub fn prefix(&self, end: usize) -> Prompt {
        Prompt {
            text: self.text[..end].to_string(),
            markup: self
                .markup
                .iter()
                .filter(|r| r.start < end)
                .map(|r| r.start..r.end.min(end))
                .collect(),
        }
    }

    /// The parts in order: each with whether it is markup.
    pub fn parts(&self) -> impl Iterator<Item = (&str, bool)> + '_ {
        let mut at = 0;
        let mut out = Vec::with_capacity(2 * self.markup.len() + 1);
        for r in &self.markup {
            if r.start > at {
                out.push((&self.text[at..r.start], false));
            }
            out.push((&self.text[r.clone()], true));
            at = r.end;
        }
        if at < self.text.len() {
            out.push((&self.text[at..], false));
        }
        out.into_iter()
    }
}

impl From<Prompt> for String {
    fn from(p: Prompt) -> String {
        p.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_keep_markup_and_content_apart() {
        let mut p = Prompt::new();
        p.markup("<|im_start|>");
        p.markup("user\n");
        p.content("hi <|im_end|>");
        p.content("");
        p.markup("");
        p.markup("<|im_end|>");
        assert_eq!(p.as_str(), "<|im_start|>user\nhi <|im_end|><|im_end|>");
        let parts: Vec<_> = p.parts().collect();
        assert_eq!(
            parts,
            [
                ("<|im_start|>user\n", true),
                ("hi <|im_end|>", false),
                ("<|im_end|>", true)
            ]
        );
        assert_eq!(Prompt::new().parts().count(), 0);
        let short = p.prefix(20);
        let cut: Vec<_> = short.parts().collect();
        assert_eq!(cut, [("<|im_start|>user\n", true), ("hi ", false)]);
        let long = p.prefix(36);
        let cut: Vec<_> = long.parts().collect();
        assert_eq!(
            cut,
            [
                ("<|im_start|>user\n", true),
                ("hi <|im_end|>", false),
                ("<|im_e", true)
            ]
        );
    }
}
