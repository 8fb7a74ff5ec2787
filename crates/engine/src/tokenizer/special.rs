//! Special-token partitioning: cuts literal special-token texts out of the input
//! before the vocabulary model sees it (llama.cpp `tokenizer_st_partition`).
//!
//! llama.cpp's semantics, reproduced exactly:
//! - candidates are the control, user-defined and unknown tokens; with
//!   `parse_special = false` control and unknown tokens are skipped, but user-defined
//!   tokens are still matched (as Hugging Face tokenizers do with added tokens);
//! - the candidates are tried one after the other, longest text first; each one
//!   claims all its leftmost non-overlapping occurrences inside the text that earlier
//!   candidates left unclaimed. A shorter token can therefore never cut into a longer
//!   one, even where the longer one starts later.
//!
//! Instead of one substring search per candidate (thousands for Gemma), one trie walk
//! over the text finds every occurrence of every candidate; the occurrences are then
//! accepted in (candidate order, position) order, an occurrence being accepted when
//! none of its bytes is claimed yet. That yields the same partition.
//!
//! Not reproduced: llama.cpp orders candidates of equal length with `std::sort`, which
//! is not stable; here ties go to the lower id. It only matters for two equal-length
//! special texts that overlap in the input. The LSTRIP/RSTRIP attributes (set by
//! llama.cpp only for phi-3, jina and modern-bert models) are not supported.

use std::ops::Range;

use super::vocab::attr;

/// A piece of the input: raw text for the model, or a special token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Fragment {
    Text(Range<usize>),
    Token(u32),
}

const NO_TOKEN: u32 = u32::MAX;

#[derive(Default)]
struct Node {
    /// Children by next byte, sorted.
    edges: Vec<(u8, u32)>,
    /// Token whose text ends here, or NO_TOKEN.
    token: u32,
    /// Priority of that token: its index in llama.cpp's candidate order.
    rank: u32,
    /// Matched only when parsing specials (control and unknown tokens).
    needs_parse_special: bool,
}

/// A trie over the texts of all special-token candidates.
#[derive(Default)]
pub(crate) struct SpecialMatcher {
    nodes: Vec<Node>,
    /// Trie node reached by each first byte (0 = none; node 0 is the root).
    first: Vec<u32>,
}

impl SpecialMatcher {
    /// Builds the matcher from every token's (text, attributes), in id order.
    pub(crate) fn new<'a>(tokens: impl Iterator<Item = (&'a str, u16)>) -> Self {
        let mut order: Vec<(u32, &str, u16)> = tokens
            .enumerate()
            .filter(|(_, (_, a))| a & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0)
            .map(|(id, (text, a))| (id as u32, text, a))
            .collect();
        // Longest first; the stable sort keeps ties in id order.
        order.sort_by_key(|&(_, text, _)| std::cmp::Reverse(text.len()));

        let mut m = SpecialMatcher {
            nodes: vec![Node::default()],
            first: vec![0; 256],
        };
        m.nodes[0].token = NO_TOKEN;
        for (rank, &(id, text, a)) in order.iter().enumerate() {
            let mut node = 0usize;
            for &b in text.as_bytes() {
                node = m.child_or_insert(node, b);
            }
            let n = &mut m.nodes[node];
            // Token texts are unique, so a node ends at most one token.
            n.token = id;
            n.rank = rank as u32;
            n.needs_parse_special = a & (attr::CONTROL | attr::UNKNOWN) != 0;
        }
        for &(b, child) in &m.nodes[0].edges {
            m.first[usize::from(b)] = child;
        }
        m
    }

    fn child_or_insert(&mut self, node: usize, b: u8) -> usize {
        match self.nodes[node].edges.binary_search_by_key(&b, |e| e.0) {
            Ok(i) => self.nodes[node].edges[i].1 as usize,
            Err(i) => {
                let child = self.nodes.len();
                self.nodes.push(Node {
                    token: NO_TOKEN,
                    ..Node::default()
                });
                self.nodes[node].edges.insert(i, (b, child as u32));
                child
            }
        }
    }

    fn child(&self, node: usize, b: u8) -> Option<usize> {
        let edges = &self.nodes[node].edges;
        edges
            .binary_search_by_key(&b, |e| e.0)
            .ok()
            .map(|i| edges[i].1 as usize)
    }

    /// Splits `text` into raw-text and special-token fragments. An empty text gives
    /// no fragment at all.
    pub(crate) fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        let bytes = text.as_bytes();
        // (rank, start, end, id) of every occurrence of every candidate.
        let mut hits: Vec<(u32, usize, usize, u32)> = Vec::new();
        for start in 0..bytes.len() {
            let mut node = self.first[usize::from(bytes[start])] as usize;
            let mut end = start + 1;
            while node != 0 {
                let n = &self.nodes[node];
                if n.token != NO_TOKEN && (parse_special || !n.needs_parse_special) {
                    hits.push((n.rank, start, end, n.token));
                }
                match bytes.get(end).and_then(|&b| self.child(node, b)) {
                    Some(next) => {
                        node = next;
                        end += 1;
                    }
                    None => break,
                }
            }
        }
        if hits.is_empty() {
            return if text.is_empty() {
                Vec::new()
            } else {
                vec![Fragment::Text(0..text.len())]
            };
        }

        hits.sort_unstable();
        let mut claimed = vec![false; bytes.len()];
        let mut accepted: Vec<(usize, usize, u32)> = Vec::new();
        for (_, start, end, id) in hits {
            if claimed[start..end].iter().all(|&c| !c) {
                claimed[start..end].fill(true);
                accepted.push((start, end, id));
            }
        }
        accepted.sort_unstable();

        let mut frags = Vec::with_capacity(2 * accepted.len() + 1);
        let mut at = 0;
        for (start, end, id) in accepted {
            if start > at {
                frags.push(Fragment::Text(at..start));
            }
            frags.push(Fragment::Token(id));
            at = end;
        }
        if at < text.len() {
            frags.push(Fragment::Text(at..text.len()));
        }
        frags
    }
}

#[cfg(test)]
mod tests {
    use super::Fragment::{Text, Token};
    use super::*;

    fn matcher(specials: &[(&str, u16)]) -> SpecialMatcher {
        let normal = [("a", attr::NORMAL), ("b", attr::NORMAL)];
        SpecialMatcher::new(normal.iter().chain(specials).copied())
    }

    #[test]
    fn control_only_with_parse_special_user_defined_always() {
        let m = matcher(&[("<c>", attr::CONTROL), ("<u>", attr::USER_DEFINED)]);
        assert_eq!(
            m.partition("x<c>y<u>", true),
            [Text(0..1), Token(2), Text(4..5), Token(3)]
        );
        assert_eq!(m.partition("x<c>y<u>", false), [Text(0..5), Token(3)]);
        assert_eq!(m.partition("", true), []);
        assert_eq!(m.partition("plain", true), [Text(0..5)]);
    }

    #[test]
    fn longer_tokens_claim_first_even_when_later() {
        // "bcd" (longer) wins over "ab" although "ab" starts first.
        let m = matcher(&[("ab", attr::CONTROL), ("bcd", attr::CONTROL)]);
        assert_eq!(m.partition("abcd", true), [Text(0..1), Token(3)]);
        // Without the overlap both match.
        assert_eq!(
            m.partition("ab bcd", true),
            [Token(2), Text(2..3), Token(3)]
        );
    }

    #[test]
    fn occurrences_do_not_overlap() {
        let m = matcher(&[("aa", attr::CONTROL)]);
        assert_eq!(m.partition("aaa", true), [Token(2), Text(2..3)]);
        assert_eq!(m.partition("aaaa", true), [Token(2), Token(2)]);
    }

    #[test]
    fn prefix_tokens() {
        let m = matcher(&[("<|im", attr::CONTROL), ("<|im_start|>", attr::CONTROL)]);
        assert_eq!(m.partition("<|im_start|><|im", true), [Token(3), Token(2)]);
        assert_eq!(m.partition("<|im_start", true), [Token(2), Text(4..10)]);
    }
}
