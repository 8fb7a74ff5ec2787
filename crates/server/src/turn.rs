//! Shapes the generated text of one assistant turn into what the dialects send:
//! visible text, reasoning, and tool calls with fresh ids. Tool calls are parsed
//! incrementally by the family's syntax; the final parse is authoritative and
//! agrees with what was streamed (calls are streamed whole, never taken back).

use ds4_chat::tools::{ParsedTurn, ToolEvent, ToolParser};

use crate::tooling::new_call_id;

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
    tools: Option<Box<dyn ToolParser>>,
    id_prefix: &'static str,
    calls: Vec<CallOut>,
    text: String,
    malformed: Option<String>,
}

impl Shaper {
    /// A shaper for plain text (no tools offered, or a raw completion).
    pub fn plain() -> Self {
        Shaper {
            tools: None,
            id_prefix: "",
            calls: vec![],
            text: String::new(),
            malformed: None,
        }
    }

    /// A shaper that parses tool calls with `parser`. `forced` is text the prompt
    /// already ends with (a forced call's opening), parsed before the output.
    pub fn with_tools(
        mut parser: Box<dyn ToolParser>,
        forced: Option<&str>,
        id_prefix: &'static str,
    ) -> Self {
        let mut s = Shaper::plain();
        s.id_prefix = id_prefix;
        if let Some(f) = forced {
            // The opening can't complete a call, so nothing comes out yet.
            let early = parser.push(f);
            debug_assert!(early.iter().all(|e| !matches!(e, ToolEvent::Call(_))));
        }
        s.tools = Some(parser);
        s
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        match &mut self.tools {
            None => {
                self.text.push_str(text);
                vec![Piece::Text(text.to_string())]
            }
            Some(p) => {
                let events = p.push(text);
                self.pieces(events)
            }
        }
    }

    fn pieces(&mut self, events: Vec<ToolEvent>) -> Vec<Piece> {
        let mut out = Vec::new();
        for e in events {
            match e {
                ToolEvent::Text(t) if !t.is_empty() => out.push(Piece::Text(t)),
                ToolEvent::Text(_) => {}
                ToolEvent::Call(c) => {
                    let call = CallOut {
                        id: new_call_id(self.id_prefix),
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
        let Some(mut parser) = self.tools.take() else {
            let turn = Turn {
                content: std::mem::take(&mut self.text),
                ..Turn::default()
            };
            return (vec![], turn);
        };
        let (events, parsed) = parser.finish();
        let pieces = self.pieces(events);
        let ParsedTurn {
            content,
            calls,
            calls_raw,
            malformed,
        } = parsed;
        // The final parse is authoritative; ids come from the streamed calls,
        // which the parser contract makes the same calls in the same order.
        let calls = calls
            .into_iter()
            .enumerate()
            .map(|(i, c)| CallOut {
                id: self
                    .calls
                    .get(i)
                    .map_or_else(|| new_call_id(self.id_prefix), |s| s.id.clone()),
                name: c.name,
                arguments: c.arguments,
            })
            .collect();
        let turn = Turn {
            reasoning: String::new(),
            content,
            calls,
            calls_raw,
            malformed: malformed.or(self.malformed),
        };
        (pieces, turn)
    }
}
