//! The CPU work between a parsed request and the engine, done on a blocking
//! thread so that neither the async threads nor the engine wait for it: the
//! prompt rendered (the template's markup apart from content, which is text
//! whatever it spells), a prompt that cannot fit refused from its size before
//! it is tokenized (`Tokenizer::min_tokens`), then tokenized and refused
//! exactly, and its grammar compiled.

use ds4_chat::tools::{ToolChoice, ToolParser};
use ds4_chat::{Message, Prompt, RenderOptions, Role, ThinkMode};
use ds4_engine::tokenizer::Segment;
use ds4_engine::Tokenizer;
use serde_json::json;

use crate::dialect::{Input, Request};
use crate::state::AppState;
use ds4_runtime::ReplayStats;
use ds4_runtime::{CallPlan, Gate, GateError, GrammarPlan, Overflow, TokenLimit};

/// A request ready for the engine.
pub(crate) struct Prepared {
    /// The rendered prompt's text and its tokens.
    pub prompt: String,
    pub ids: Vec<u32>,
    /// How the output is read back: tool calls when tools are active.
    pub parser: Option<Box<dyn ToolParser>>,
    /// The forced opening of a tool call the prompt ends with, if any.
    pub forced: Option<String>,
    /// The thinking mode the prompt was rendered in.
    pub think: ThinkMode,
    pub replay: ReplayStats,
    /// Byte offsets of the client's cache breakpoints in `prompt`.
    pub breakpoints: Vec<usize>,
    pub gate: Option<Gate>,
}

/// Why a request does not reach the engine (each a 400).
#[derive(Debug, PartialEq)]
pub(crate) enum Refusal {
    Invalid(String),
    /// The prompt (and `max_tokens`) cannot fit the context.
    Overflow(Overflow),
    /// A structured-output schema the grammar engine cannot use.
    Schema(String),
}

/// Renders, bounds, tokenizes and compiles `p` (see the module doc); `id` names
/// the request in the trace.
pub(crate) fn prepare(st: &AppState, p: &mut Request, id: &str) -> Result<Prepared, Refusal> {
    let n_vocab = st.model.tokenizer.n_vocab();
    in_vocab(
        "logit_bias",
        p.sampling.logit_bias.iter().map(|&(t, _)| t),
        n_vocab,
    )?;
    if let Input::Tokens(ids) = &p.input {
        in_vocab("prompt", ids.iter().copied(), n_vocab)?;
    }
    let r = render(st, p).map_err(|m| Refusal::Invalid(m.into()))?;
    let limit = TokenLimit::of(p.max_tokens, st.cfg.default_max_tokens);
    let n_ctx = st.cfg.n_ctx;
    let tok = &st.model.tokenizer;
    let ids = match &p.input {
        // Token ids are run as given (the text is what they decode to).
        Input::Tokens(ids) => ids.clone(),
        _ => {
            let at_least = tok.min_tokens(r.prompt.as_str());
            limit.allowed(at_least, n_ctx).map_err(|o| {
                Refusal::Overflow(Overflow {
                    at_least: true,
                    ..o
                })
            })?;
            encode_prompt(tok, &r.prompt)
        }
    };
    limit.allowed(ids.len(), n_ctx).map_err(Refusal::Overflow)?;
    let gate = match r.grammar {
        Some(plan) => compile(st, id, plan).map_err(Refusal::Schema)?,
        None => None,
    };
    Ok(Prepared {
        prompt: r.prompt.into(),
        ids,
        parser: r.parser,
        forced: r.forced,
        think: r.think,
        replay: r.replay,
        breakpoints: r.breakpoints,
        gate,
    })
}

/// Refuses the first of `ids` (the request's `field`) outside a vocabulary of
/// `n_vocab` tokens.
fn in_vocab(
    field: &str,
    mut ids: impl Iterator<Item = u32>,
    n_vocab: usize,
) -> Result<(), Refusal> {
    match ids.find(|&id| id as usize >= n_vocab) {
        Some(id) => Err(Refusal::Invalid(format!(
            "{field}: token {id} is outside the vocabulary ({n_vocab} tokens)"
        ))),
        None => Ok(()),
    }
}

/// The tokens a count (`/v1/messages/count_tokens`) reports: the rendered
/// prompt's, as `prepare` tokenizes it.
pub(crate) fn count_tokens(st: &AppState, mut p: Request) -> Result<usize, Refusal> {
    let r = render(st, &mut p).map_err(|m| Refusal::Invalid(m.into()))?;
    Ok(encode_prompt(&st.model.tokenizer, &r.prompt).len())
}

/// The text of the prompt `p` renders to (`/apply-template`): what `prepare`
/// tokenizes, as text.
pub(crate) fn prompt_text(st: &AppState, mut p: Request) -> Result<String, Refusal> {
    let r = render(st, &mut p).map_err(|m| Refusal::Invalid(m.into()))?;
    Ok(r.prompt.as_str().to_string())
}

/// A rendered prompt's tokens (BOS/EOS as the model adds them): control tokens
/// only where its markup spells them.
pub fn encode_prompt(tok: &Tokenizer, prompt: &Prompt) -> Vec<u32> {
    let segments: Vec<Segment> = prompt
        .parts()
        .map(|(s, markup)| match markup {
            true => Segment::Markup(s),
            false => Segment::Text(s),
        })
        .collect();
    tok.encode_segments(&segments, true)
}

/// A request rendered for the engine.
pub(crate) struct Rendered {
    pub prompt: Prompt,
    /// How the output is read back: tool calls when tools are active.
    pub parser: Option<Box<dyn ToolParser>>,
    /// The forced opening of a tool call the prompt ends with, if any.
    pub forced: Option<String>,
    /// The thinking mode the prompt was rendered in.
    pub think: ThinkMode,
    pub replay: ReplayStats,
    /// Byte offsets of the client's cache breakpoints in `prompt`.
    pub breakpoints: Vec<usize>,
    pub grammar: Option<GrammarPlan>,
}

/// A raw prompt: the client's own markup, its special-token texts control
/// tokens (docs/API.md).
fn raw(text: &str, agent: &crate::dialect::AgentOptions) -> Rendered {
    let mut prompt = Prompt::new();
    prompt.markup(text);
    Rendered {
        prompt,
        parser: None,
        forced: None,
        think: ThinkMode::None,
        replay: ReplayStats::default(),
        breakpoints: vec![],
        grammar: json_plan(agent),
    }
}

/// Renders a request: a raw prompt as is, messages (normalised, with remembered
/// tool-call text attached) with the model's chat template.
fn render(st: &AppState, p: &mut Request) -> Result<Rendered, &'static str> {
    let (messages, t) = match (&mut p.input, &st.template) {
        (Input::Raw(s), _) => return Ok(raw(s, &p.agent)),
        (Input::Tokens(ids), _) => {
            let text = st.model.tokenizer.prompt_text(ids);
            return Ok(raw(&String::from_utf8_lossy(&text), &p.agent));
        }
        (Input::Messages(m), Some(t)) => (m, t),
        (Input::Messages(_), None) => {
            return Err("this model has no chat template; use /v1/completions")
        }
    };
    st.normalizer.apply(messages);
    if st.cfg.tool_first && p.agent.tool_choice == ToolChoice::Auto && opens_user_turn(messages) {
        p.agent.tool_choice = ToolChoice::Required;
    }
    let replay = st.tool_memory.attach(messages);
    let think = if t.supports_thinking() {
        p.agent.think.for_context(st.cfg.n_ctx)
    } else {
        ThinkMode::None
    };
    let tools = p.agent.active_tools();
    let mut prompt = t.render(
        messages,
        &RenderOptions {
            tools,
            think,
            add_generation_prompt: true,
        },
    );
    let syntax = t.tool_syntax();
    let calls = CallPlan::new(
        syntax,
        tools,
        &p.agent.tool_choice,
        think,
        !p.agent.single_call,
    );
    let forced = calls.forced;
    // A breakpoint is the end of its message: where rendering the conversation up
    // to it ends, when that is a prefix of the prompt (append-only templates).
    let breakpoints = p
        .agent
        .cache_breakpoints
        .iter()
        .filter_map(|&i| {
            let upto = messages.get(..=i)?;
            let prefix = t.render(
                upto,
                &RenderOptions {
                    tools,
                    think,
                    add_generation_prompt: false,
                },
            );
            prompt
                .as_str()
                .starts_with(prefix.as_str())
                .then_some(prefix.len())
        })
        .collect();
    if let Some(f) = &forced {
        prompt.markup(f);
    }
    // A forced call first, then structured output, then a call the model may open.
    let grammar = match calls.grammar {
        Some(g @ GrammarPlan::ForcedCall(_)) => Some(g),
        Some(g @ GrammarPlan::Call { .. }) if p.agent.json_schema.is_none() => Some(g),
        _ => json_plan(&p.agent),
    };
    Ok(Rendered {
        prompt,
        breakpoints,
        grammar,
        parser: (!tools.is_empty()).then(|| syntax.parser(tools)),
        forced,
        think,
        replay,
    })
}

/// Structured output's plan: one JSON value valid against the request's schema.
fn json_plan(agent: &crate::dialect::AgentOptions) -> Option<GrammarPlan> {
    let schema = agent.json_schema.as_ref()?;
    Some(GrammarPlan::Json(format!(
        "start: {}",
        ds4_chat::tools::json_rule(schema)
    )))
}

/// Compiles a request's grammar plan. A tool-call grammar that does not compile
/// (a schema the engine cannot hold) leaves the call unconstrained — parsed as
/// before, with a trace note; a structured-output schema that does not compile
/// is the client's to fix (400).
fn compile(st: &AppState, id: &str, plan: GrammarPlan) -> Result<Option<Gate>, String> {
    match ds4_runtime::compile(st.grammar.as_ref().map_err(String::as_str), &plan) {
        Ok(gate) => Ok(Some(gate)),
        Err(e) if matches!(plan, GrammarPlan::Json(_)) => Err(match e {
            GateError::NoVocab(why) => {
                format!("structured output is not available for this model: {why}")
            }
            GateError::Grammar(e) => e.to_string(),
        }),
        Err(GateError::NoVocab(_)) => Ok(None),
        Err(e) => {
            if let Some(t) = &st.trace {
                t.write(json!({ "event": "grammar_unusable", "id": id, "error": e.to_string() }));
            }
            Ok(None)
        }
    }
}

/// Whether `messages` open a user turn: a user message since the last assistant
/// message, and no tool result (the first request of a task, not the one that
/// brings a call's result back). `--tool-first` forces a call on those.
fn opens_user_turn(messages: &[Message]) -> bool {
    let since = messages
        .iter()
        .rposition(|m| m.role == Role::Assistant)
        .map_or(messages, |i| &messages[i + 1..]);
    since.iter().any(|m| m.role == Role::User) && !since.iter().any(|m| m.role == Role::Tool)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_turn_opens_until_a_tool_result_comes_back() {
        let m = |role| Message::new(role, "x");
        use Role::*;
        assert!(opens_user_turn(&[m(System), m(User)]));
        assert!(opens_user_turn(&[m(User), m(Assistant), m(User)]));
        assert!(opens_user_turn(&[m(System), m(User), m(System)]));
        // The call's result is back: the model answers freely.
        assert!(!opens_user_turn(&[m(User), m(Assistant), m(Tool)]));
        assert!(!opens_user_turn(&[m(User), m(Assistant), m(Tool), m(User)]));
        assert!(!opens_user_turn(&[m(User), m(Assistant)]));
        assert!(!opens_user_turn(&[m(System)]));
        assert!(!opens_user_turn(&[]));
    }
}
