//! Shapes the generated text of one assistant turn into what a caller shows
//! or sends (the server's dialects, the agent): visible text, reasoning, and
//! tool calls with fresh ids. Tool calls are parsed incrementally by the
//! family's syntax; the final parse is authoritative and agrees with what was
//! streamed (calls are streamed whole, never taken back).

use crate::think::{ThinkEvent, ThinkSplitter};
use crate::tools::{ParsedTurn, ToolEvent, ToolParser};
use crate::ThinkMode;

/// Where a shaper's call ids come from (the server's are unguessable, the
/// agent's count up).
pub type NewId = Box<dyn FnMut() -> String + Send>;

/// A tool call as the client sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallOut {
    pub id: String,
    pub name: String,
    /// Compact JSON object text.
    pub arguments: String,
}

/// A piece of the turn, in generation order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Text(String),
    /// The `index`-th call of the turn.
    Call(usize, CallOut),
}

/// The whole turn, after generation ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Turn {
    pub reasoning: String,
    pub content: String,
    pub calls: Vec<CallOut>,
    /// The exact generated text after `content` when there are calls (what the
    /// exact-replay memory keeps).
    pub calls_raw: String,
    /// Why a call-looking block was returned as text, if one was.
    pub malformed: Option<String>,
}

impl Turn {
    /// A turn that is only text.
    pub fn text(content: impl Into<String>) -> Self {
        Turn {
            content: content.into(),
            ..Turn::default()
        }
    }
}

pub struct Shaper {
    think: Option<ThinkSplitter>,
    tools: Option<Box<dyn ToolParser>>,
    new_id: NewId,
    calls: Vec<CallOut>,
    /// Visible text when no tool parser keeps it.
    text: String,
    malformed: Option<String>,
}

impl Shaper {
    /// A shaper for a turn rendered in `think` mode, parsing tool calls with
    /// `tools` when tools are active. `forced` is text the prompt already ends
    /// with (a forced call's opening), parsed before the output. Each call
    /// gets its id from `new_id`.
    pub fn new(
        think: ThinkMode,
        tools: Option<Box<dyn ToolParser>>,
        forced: Option<&str>,
        new_id: NewId,
    ) -> Self {
        let mut shaper = Shaper {
            think: think.is_thinking().then(|| ThinkSplitter::new(think)),
            tools,
            new_id,
            calls: vec![],
            text: String::new(),
            malformed: None,
        };
        if let Some(f) = forced {
            // Prompt text, not output: an opening (after an empty reasoning
            // block in thinking mode) can't complete a call, so nothing is shown.
            shaper.push(f);
        }
        shaper
    }

    /// A shaper that passes text through (raw completions).
    pub fn plain() -> Self {
        Shaper::new(ThinkMode::None, None, None, Box::new(String::new))
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let events = match &mut self.think {
            Some(t) => t.push(text),
            None => vec![ThinkEvent::Content(text.to_string())],
        };
        self.after_think(events)
    }

    fn after_think(&mut self, events: Vec<ThinkEvent>) -> Vec<Piece> {
        let mut out = Vec::new();
        for e in events {
            match e {
                ThinkEvent::Reasoning(r) if !r.is_empty() => out.push(Piece::Reasoning(r)),
                ThinkEvent::Reasoning(_) => {}
                ThinkEvent::Content(c) => match &mut self.tools {
                    Some(p) => {
                        let events = p.push(&c);
                        out.extend(self.after_tools(events));
                    }
                    None if c.is_empty() => {}
                    None => {
                        self.text.push_str(&c);
                        out.push(Piece::Text(c));
                    }
                },
            }
        }
        out
    }

    fn after_tools(&mut self, events: Vec<ToolEvent>) -> Vec<Piece> {
        let mut out = Vec::new();
        for e in events {
            match e {
                ToolEvent::Text(t) if !t.is_empty() => out.push(Piece::Text(t)),
                ToolEvent::Text(_) => {}
                ToolEvent::Call(c) => {
                    let call = CallOut {
                        id: (self.new_id)(),
                        name: c.name,
                        arguments: c.arguments,
                    };
                    self.calls.push(call.clone());
                    out.push(Piece::Call(self.calls.len() - 1, call));
                }
                ToolEvent::Malformed { reason } => self.malformed = Some(reason),
            }
        }
        out
    }

    /// Ends the turn: the last pieces and the whole turn.
    pub fn finish(mut self) -> (Vec<Piece>, Turn) {
        let mut pieces = Vec::new();
        let mut split = None;
        if let Some(mut t) = self.think.take() {
            let (events, s) = t.finish();
            pieces = self.after_think(events);
            split = Some(s);
        }
        let mut turn = match self.tools.take() {
            None => Turn::text(std::mem::take(&mut self.text)),
            Some(mut parser) => {
                let (events, parsed) = parser.finish();
                pieces.extend(self.after_tools(events));
                self.turn_from(parsed)
            }
        };
        if let Some(s) = split {
            match s.reasoning {
                Some(r) => turn.reasoning = r,
                // The think block never closed: all of it is the answer, and no
                // call inside it is executable (system spec §5.6, §7.4).
                None => turn = Turn::text(s.content),
            }
        }
        (pieces, turn)
    }

    /// The final parse is authoritative; ids come from the streamed calls,
    /// which the parser contract makes the same calls in the same order.
    fn turn_from(&mut self, parsed: ParsedTurn) -> Turn {
        let calls = parsed
            .calls
            .into_iter()
            .enumerate()
            .map(|(i, c)| CallOut {
                id: match self.calls.get(i) {
                    Some(s) => s.id.clone(),
                    None => (self.new_id)(),
                },
                name: c.name,
                arguments: c.arguments,
            })
            .collect();
        Turn {
            reasoning: String::new(),
            content: parsed.content,
            calls,
            calls_raw: parsed.calls_raw,
            malformed: parsed.malformed.or_else(|| self.malformed.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::{Dsml, ToolSyntax};
    use crate::{ToolCall, ToolChoice, ToolSpec};

    fn ids(prefix: &'static str) -> NewId {
        let mut n = 0;
        Box::new(move || {
            n += 1;
            format!("{prefix}{n}")
        })
    }

    fn tools() -> Vec<ToolSpec> {
        vec![ToolSpec {
            name: "ls".into(),
            description: String::new(),
            parameters: r#"{"type":"object"}"#.into(),
            raw: r#"{"name":"ls","input_schema":{"type":"object"}}"#.into(),
        }]
    }

    /// Feeds `text` in chunks of `n` bytes (on char boundaries).
    fn shape(mut s: Shaper, text: &str, n: usize) -> (Vec<Piece>, Turn) {
        let mut pieces = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let mut cut = n.min(rest.len());
            while !rest.is_char_boundary(cut) {
                cut += 1;
            }
            pieces.extend(s.push(&rest[..cut]));
            rest = &rest[cut..];
        }
        let (tail, turn) = s.finish();
        pieces.extend(tail);
        (pieces, turn)
    }

    #[test]
    fn reasoning_text_and_calls_come_apart_with_ids() {
        let calls = Dsml.render_calls(&[ToolCall {
            id: String::new(),
            name: "ls".into(),
            arguments: r#"{"dir":"/tmp"}"#.into(),
        }]);
        let text = format!("<think>look first</think>Listing.{calls}");
        for n in [1, 3, 7, 1000] {
            let shaper = Shaper::new(
                ThinkMode::High,
                Some(Dsml.parser(&tools())),
                None,
                ids("call_"),
            );
            let (pieces, turn) = shape(shaper, &text, n);
            let reasoning: String = pieces
                .iter()
                .filter_map(|p| match p {
                    Piece::Reasoning(r) => Some(r.as_str()),
                    _ => None,
                })
                .collect();
            let visible: String = pieces
                .iter()
                .filter_map(|p| match p {
                    Piece::Text(t) => Some(t.as_str()),
                    _ => None,
                })
                .collect();
            let streamed: Vec<&CallOut> = pieces
                .iter()
                .filter_map(|p| match p {
                    Piece::Call(_, c) => Some(c),
                    _ => None,
                })
                .collect();
            assert_eq!(
                (reasoning.as_str(), visible.as_str()),
                ("look first", "Listing.")
            );
            assert_eq!(turn.reasoning, "look first");
            assert_eq!(turn.content, "Listing.");
            assert_eq!(turn.calls.len(), 1);
            assert_eq!(
                streamed,
                vec![&turn.calls[0]],
                "streamed ids are the final ids"
            );
            assert_eq!(turn.calls[0].arguments, r#"{"dir":"/tmp"}"#);
            assert!(turn.calls[0].id.starts_with("call_"));
            assert_eq!(turn.calls_raw, calls);
        }
    }

    #[test]
    fn an_unclosed_think_block_is_all_answer_and_calls_in_it_do_not_run() {
        let text = "<think>maybe <｜DSML｜tool_calls></｜DSML｜tool_calls>";
        let shaper = Shaper::new(
            ThinkMode::High,
            Some(Dsml.parser(&tools())),
            None,
            ids("call_"),
        );
        let (_, turn) = shape(shaper, text, 4);
        assert!(turn.calls.is_empty());
        assert_eq!(turn.reasoning, "");
        assert!(turn.content.contains("tool_calls"));
    }

    #[test]
    fn a_forced_opening_is_parsed_before_the_output() {
        let forced = Dsml.forced_prefix(&ToolChoice::Named("ls".into())).unwrap();
        let rest = "<｜DSML｜parameter name=\"dir\" string=\"true\">/</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        let shaper = Shaper::new(
            ThinkMode::None,
            Some(Dsml.parser(&tools())),
            Some(&forced),
            ids("toolu_"),
        );
        let (pieces, turn) = shape(shaper, rest, 5);
        assert!(pieces.iter().all(|p| matches!(p, Piece::Call(..))));
        assert_eq!(turn.calls[0].name, "ls");
        assert!(turn.calls[0].id.starts_with("toolu_"));
        assert_eq!(turn.calls_raw, format!("{forced}{rest}"));

        let (pieces, turn) = shape(Shaper::plain(), "just text", 2);
        assert_eq!(turn, Turn::text("just text"));
        assert_eq!(pieces.len(), 5);
    }
}
