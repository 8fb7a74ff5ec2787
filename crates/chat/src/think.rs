//! Thinking modes (system spec §5): whether the assistant turn opens with hidden
//! reasoning, how a request chooses the mode, and how generated text splits into
//! reasoning and answer.

use thiserror::Error;

/// How the assistant turn is prompted (see the system spec §5.1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ThinkMode {
    /// Direct answer.
    #[default]
    None,
    /// Normal thinking.
    High,
    /// Maximum effort (families that have it; otherwise treated as `High`).
    Max,
}

/// Below this context size Think Max falls back to High (§5.2): the long
/// deliberations it asks for would not fit.
pub const THINK_MAX_MIN_CTX: usize = 393_216;

/// Inserted right after BOS in Think Max mode (§5.3).
pub const THINK_MAX_PREFIX: &str = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n\
You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n\
Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\
\n";

/// A reasoning effort name outside §5.4 (the server answers 400).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("unknown reasoning effort {0:?}")]
pub struct UnknownEffort(pub String);

impl ThinkMode {
    /// Whether the turn opens with `<think>`.
    pub fn is_thinking(self) -> bool {
        self != ThinkMode::None
    }

    /// The mode an effort name asks for (§5.4). JSON `null` means "no change" and
    /// is the caller's `None`.
    pub fn from_effort(name: &str) -> Result<ThinkMode, UnknownEffort> {
        match name {
            "max" => Ok(ThinkMode::Max),
            "xhigh" | "high" | "medium" | "low" | "minimal" => Ok(ThinkMode::High),
            "none" => Ok(ThinkMode::None),
            _ => Err(UnknownEffort(name.to_string())),
        }
    }

    /// Context gating (§5.2): Max becomes High when `n_ctx < THINK_MAX_MIN_CTX`.
    pub fn for_context(self, n_ctx: usize) -> ThinkMode {
        match self {
            ThinkMode::Max if n_ctx < THINK_MAX_MIN_CTX => ThinkMode::High,
            mode => mode,
        }
    }
}

/// A request's enable/disable control (§5.5), as the dialect parser saw it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ThinkControl {
    /// No control field: the model alias decides, else thinking is on.
    #[default]
    Absent,
    /// A control field that does not decide: `thinking: null`, Anthropic
    /// `{"type":"adaptive"}`, a Responses `reasoning.effort` other than `none`.
    /// Thinking stays on, and the alias fallback is skipped (the C server's
    /// "null counts as seen" quirk).
    Present,
    Enabled,
    Disabled,
}

/// What a request says about thinking, in any dialect (§5.5).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThinkRequest<'a> {
    pub control: ThinkControl,
    /// The parsed effort (`reasoning_effort`, `output_config.effort`,
    /// `reasoning.effort`); `None` when absent or null.
    pub effort: Option<ThinkMode>,
    /// The request's `model` string.
    pub model: &'a str,
}

impl ThinkRequest<'_> {
    /// The mode for a context of `n_ctx` tokens: off when disabled or effort is
    /// `none`; Max when effort is `max`; else High; then context gating.
    pub fn resolve(&self, n_ctx: usize) -> ThinkMode {
        let enabled = match self.control {
            ThinkControl::Enabled | ThinkControl::Present => true,
            ThinkControl::Disabled => false,
            ThinkControl::Absent => match self.model {
                "deepseek-chat" => false,
                // `deepseek-reasoner` and any other model string: the default.
                _ => true,
            },
        };
        let mode = match self.effort {
            _ if !enabled => ThinkMode::None,
            Some(ThinkMode::None) => ThinkMode::None,
            Some(ThinkMode::Max) => ThinkMode::Max,
            Some(ThinkMode::High) | None => ThinkMode::High,
        };
        mode.for_context(n_ctx)
    }
}

const THINK_OPEN: &str = "<think>";
/// Closes the reasoning block.
pub const THINK_CLOSE: &str = "</think>";

/// Generated text the splitter is sure of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ThinkEvent {
    Reasoning(String),
    Content(String),
}

/// The authoritative split of a whole turn (§5.6).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ThinkSplit {
    /// Text before the first `</think>`; `None` when there was none.
    pub reasoning: Option<String>,
    pub content: String,
}

/// Splits generated text into reasoning and content as it streams (§5.6). In a
/// thinking turn the text starts inside the think block (the prompt ended with
/// `<think>`); an optional leading `<think>` is dropped, text up to the first
/// `</think>` is reasoning and the rest is content. A tail that may be the start
/// of `<think>` or `</think>` is held until it is not.
///
/// A stream cannot take text back, so while no `</think>` has come the text is
/// reported as reasoning, and at finish a held partial `</think>` is flushed as
/// reasoning too. The split [`ThinkSplitter::finish`] returns follows §5.6 instead:
/// without `</think>` the whole text is content (how the C server answers a
/// length-truncated thinking turn when not streaming).
#[derive(Clone, Debug)]
pub struct ThinkSplitter {
    thinking: bool,
    /// The whole turn so far.
    text: String,
    /// Where reasoning starts, once a leading `<think>` is ruled in or out.
    reasoning_start: Option<usize>,
    /// Offset of the first `</think>`, once seen.
    close_at: Option<usize>,
    /// Bytes of `text` reported.
    emitted: usize,
}

impl ThinkSplitter {
    /// A splitter for one turn generated in `mode`; without thinking all text is
    /// content.
    pub fn new(mode: ThinkMode) -> Self {
        ThinkSplitter {
            thinking: mode.is_thinking(),
            text: String::new(),
            reasoning_start: None,
            close_at: None,
            emitted: 0,
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<ThinkEvent> {
        self.text.push_str(text);
        self.advance(false)
    }

    /// End of generation: flushes held text and returns the authoritative split.
    pub fn finish(&mut self) -> (Vec<ThinkEvent>, ThinkSplit) {
        let events = self.advance(true);
        let split = match (self.thinking, self.reasoning_start, self.close_at) {
            (true, Some(start), Some(close)) => ThinkSplit {
                reasoning: Some(self.text[start..close].to_string()),
                content: self.text[close + THINK_CLOSE.len()..].to_string(),
            },
            (true, Some(start), None) => ThinkSplit {
                reasoning: None,
                content: self.text[start..].to_string(),
            },
            _ => ThinkSplit {
                reasoning: None,
                content: self.text.clone(),
            },
        };
        (events, split)
    }

    fn advance(&mut self, eof: bool) -> Vec<ThinkEvent> {
        let mut events = Vec::new();
        if self.thinking && self.close_at.is_none() {
            let Some(start) = self.reasoning_start(eof) else {
                return events;
            };
            self.emitted = self.emitted.max(start);
            match self.text[self.emitted..].find(THINK_CLOSE) {
                Some(at) => {
                    let close = self.emitted + at;
                    self.emit(close, ThinkEvent::Reasoning, &mut events);
                    self.close_at = Some(close);
                    self.emitted = close + THINK_CLOSE.len();
                }
                None => {
                    let held = if eof {
                        0
                    } else {
                        partial_suffix(&self.text, THINK_CLOSE)
                    };
                    self.emit(self.text.len() - held, ThinkEvent::Reasoning, &mut events);
                    return events;
                }
            }
        }
        self.emit(self.text.len(), ThinkEvent::Content, &mut events);
        events
    }

    /// Decides once whether the turn starts with `<think>`; `None` while the text
    /// is still a proper prefix of it.
    fn reasoning_start(&mut self, eof: bool) -> Option<usize> {
        if self.reasoning_start.is_none() {
            if self.text.starts_with(THINK_OPEN) {
                self.reasoning_start = Some(THINK_OPEN.len());
            } else if eof || !THINK_OPEN.starts_with(self.text.as_str()) {
                self.reasoning_start = Some(0);
            }
        }
        self.reasoning_start
    }

    fn emit(&mut self, limit: usize, kind: fn(String) -> ThinkEvent, events: &mut Vec<ThinkEvent>) {
        if limit > self.emitted {
            events.push(kind(self.text[self.emitted..limit].to_string()));
            self.emitted = limit;
        }
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `tag`.
fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&k| tag.get(..k).is_some_and(|prefix| text.ends_with(prefix)))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn effort_names() {
        assert_eq!(ThinkMode::from_effort("max"), Ok(ThinkMode::Max));
        for name in ["xhigh", "high", "medium", "low", "minimal"] {
            assert_eq!(ThinkMode::from_effort(name), Ok(ThinkMode::High));
        }
        assert_eq!(ThinkMode::from_effort("none"), Ok(ThinkMode::None));
        assert_eq!(
            ThinkMode::from_effort("High"),
            Err(UnknownEffort("High".into()))
        );
    }

    #[test]
    fn max_needs_a_large_context() {
        assert_eq!(ThinkMode::Max.for_context(393_215), ThinkMode::High);
        assert_eq!(ThinkMode::Max.for_context(393_216), ThinkMode::Max);
        assert_eq!(ThinkMode::None.for_context(0), ThinkMode::None);
        assert_eq!(ThinkMode::High.for_context(0), ThinkMode::High);
    }

    #[test]
    fn request_resolution_follows_the_dialect_rule() {
        const BIG: usize = 1 << 20;
        let req = |control, effort, model| ThinkRequest {
            control,
            effort,
            model,
        };
        use ThinkControl::*;
        // Default is thinking; the alias decides only without a control.
        assert_eq!(req(Absent, None, "ds4").resolve(BIG), ThinkMode::High);
        assert_eq!(
            req(Absent, None, "deepseek-chat").resolve(BIG),
            ThinkMode::None
        );
        assert_eq!(
            req(Absent, None, "deepseek-reasoner").resolve(BIG),
            ThinkMode::High
        );
        // reasoning_effort is no control: deepseek-chat stays non-thinking.
        let high = Some(ThinkMode::High);
        assert_eq!(
            req(Absent, high, "deepseek-chat").resolve(BIG),
            ThinkMode::None
        );
        // `thinking: null` counts as seen, so the alias is ignored.
        assert_eq!(
            req(Present, None, "deepseek-chat").resolve(BIG),
            ThinkMode::High
        );
        assert_eq!(
            req(Enabled, None, "deepseek-chat").resolve(BIG),
            ThinkMode::High
        );
        assert_eq!(
            req(Disabled, Some(ThinkMode::Max), "ds4").resolve(BIG),
            ThinkMode::None
        );
        // Effort none always disables; max survives only a large context.
        assert_eq!(
            req(Enabled, Some(ThinkMode::None), "ds4").resolve(BIG),
            ThinkMode::None
        );
        assert_eq!(
            req(Enabled, Some(ThinkMode::Max), "ds4").resolve(BIG),
            ThinkMode::Max
        );
        assert_eq!(
            req(Absent, Some(ThinkMode::Max), "ds4").resolve(4096),
            ThinkMode::High
        );
    }

    /// Runs a splitter over `chunks`; adjacent events of one kind merged.
    fn split(mode: ThinkMode, chunks: &[&str]) -> (Vec<ThinkEvent>, ThinkSplit) {
        let mut splitter = ThinkSplitter::new(mode);
        let mut events = Vec::new();
        for chunk in chunks {
            events.extend(splitter.push(chunk));
        }
        let (tail, whole) = splitter.finish();
        events.extend(tail);
        let mut merged: Vec<ThinkEvent> = Vec::new();
        for event in events {
            match (merged.last_mut(), event) {
                (Some(ThinkEvent::Reasoning(a)), ThinkEvent::Reasoning(b))
                | (Some(ThinkEvent::Content(a)), ThinkEvent::Content(b)) => a.push_str(&b),
                (_, event) => merged.push(event),
            }
        }
        (merged, whole)
    }

    fn reasoning(text: &str) -> ThinkEvent {
        ThinkEvent::Reasoning(text.into())
    }

    fn content(text: &str) -> ThinkEvent {
        ThinkEvent::Content(text.into())
    }

    #[test]
    fn splits_at_the_first_close() {
        let (events, whole) = split(
            ThinkMode::High,
            &["<think>plan a</th", "ink>answer </think> x"],
        );
        assert_eq!(
            events,
            vec![reasoning("plan a"), content("answer </think> x")]
        );
        assert_eq!(
            whole,
            ThinkSplit {
                reasoning: Some("plan a".into()),
                content: "answer </think> x".into()
            }
        );
    }

    #[test]
    fn partial_tags_are_held_until_decided() {
        let mut splitter = ThinkSplitter::new(ThinkMode::Max);
        assert_eq!(splitter.push("<thi"), vec![]);
        assert_eq!(splitter.push("nk>a</"), vec![reasoning("a")]);
        assert_eq!(splitter.push("b"), vec![reasoning("</b")]);
        assert_eq!(splitter.push("</think"), vec![]);
        assert_eq!(splitter.push(">"), vec![]);
        assert_eq!(splitter.push("c"), vec![content("c")]);
    }

    #[test]
    fn no_close_streams_reasoning_but_the_whole_turn_is_content() {
        let (events, whole) = split(ThinkMode::High, &["<think>cut off </th"]);
        assert_eq!(events, vec![reasoning("cut off </th")]);
        assert_eq!(
            whole,
            ThinkSplit {
                reasoning: None,
                content: "cut off </th".into()
            }
        );
        // A turn that stops inside a leading `<think>` is not a think block.
        let (events, whole) = split(ThinkMode::High, &["<th"]);
        assert_eq!(events, vec![reasoning("<th")]);
        assert_eq!(whole.content, "<th");
    }

    #[test]
    fn non_thinking_turns_are_all_content() {
        let (events, whole) = split(ThinkMode::None, &["<think>a</think>b"]);
        assert_eq!(events, vec![content("<think>a</think>b")]);
        assert_eq!(whole.reasoning, None);
        assert_eq!(whole.content, "<think>a</think>b");
    }

    #[test]
    fn chunking_does_not_change_the_split() {
        for text in [
            "<think>ünï </thinking> </think>",
            "reason without open tag</think>\n\nanswer",
            "<think></think>",
            "no close at all <",
        ] {
            let want = split(ThinkMode::High, &[text]);
            let by_char: Vec<&str> = text
                .char_indices()
                .map(|(i, c)| &text[i..i + c.len_utf8()])
                .collect();
            assert_eq!(split(ThinkMode::High, &by_char), want, "{text:?}");
            for cut in (1..text.len()).filter(|&i| text.is_char_boundary(i)) {
                assert_eq!(split(ThinkMode::High, &[&text[..cut], &text[cut..]]), want);
            }
        }
    }
}
