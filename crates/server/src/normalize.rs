//! Prompt normalisation: agents inject volatile bytes into otherwise identical
//! prompts (Claude Code's per-request `cch=` billing nonce in the system prompt).
//! One changed byte early in a long prompt defeats prefix reuse, so matches of
//! these patterns are removed from message text before rendering.

use ds4_chat::{Message, Role};
use regex::Regex;

/// Claude Code's billing nonce (`cch=1f3a9;`), removed by default.
pub const DEFAULT_PATTERNS: &[&str] = &[r"\bcch=[0-9A-Za-z]+;?"];

#[derive(Clone, Debug, Default)]
pub struct Normalizer {
    patterns: Vec<Regex>,
}

impl Normalizer {
    /// The default patterns plus `extra` (each a regex whose matches are removed).
    pub fn new(extra: &[String]) -> Result<Self, regex::Error> {
        let patterns = DEFAULT_PATTERNS
            .iter()
            .map(|p| p.to_string())
            .chain(extra.iter().cloned())
            .map(|p| Regex::new(&p))
            .collect::<Result<_, _>>()?;
        Ok(Normalizer { patterns })
    }

    /// A normaliser that changes nothing (`--no-normalize-prompts`).
    pub fn off() -> Self {
        Normalizer::default()
    }

    /// Removes the volatile bytes from system and user text (assistant output and
    /// tool results are the model's and the tools' own words: left alone).
    /// Returns how many matches were removed.
    pub fn apply(&self, messages: &mut [Message]) -> usize {
        let mut removed = 0;
        for m in messages
            .iter_mut()
            .filter(|m| matches!(m.role, Role::System | Role::User))
        {
            for re in &self.patterns {
                let n = re.find_iter(&m.content).count();
                if n > 0 {
                    removed += n;
                    m.content = re.replace_all(&m.content, "").into_owned();
                }
            }
        }
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_billing_nonce_and_configured_patterns_are_removed() {
        let n = Normalizer::new(&[r"request-id: [0-9a-f-]+\n".to_string()]).unwrap();
        let mut a = vec![
            Message::new(
                Role::System,
                "cc_version=2.0.14; cc_entrypoint=cli; cch=9f2c1;\nYou are Claude Code.",
            ),
            Message::new(Role::User, "request-id: 1234-ab\nhi"),
            Message::new(Role::Assistant, "cch=1"),
        ];
        let mut b = a.clone();
        b[0].content = b[0].content.replace("9f2c1", "00ab3");
        b[1].content = b[1].content.replace("1234-ab", "99-ff");
        assert_eq!(n.apply(&mut a), 2);
        n.apply(&mut b);
        assert_eq!(a, b);
        assert_eq!(
            a[0].content,
            "cc_version=2.0.14; cc_entrypoint=cli; \nYou are Claude Code."
        );
        assert_eq!(a[2].content, "cch=1", "assistant text is left alone");

        let mut c = vec![Message::new(Role::System, "cch=9f2c1;")];
        assert_eq!(Normalizer::off().apply(&mut c), 0);
        assert_eq!(c[0].content, "cch=9f2c1;");
        assert!(Normalizer::new(&["(".to_string()]).is_err());
    }
}
