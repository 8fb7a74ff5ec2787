//! The Anthropic Messages dialect: `POST /v1/messages` and
//! `POST /v1/messages/count_tokens`. Requests are parsed into a [`Request`];
//! responses, SSE events and errors are built in Anthropic's shapes.
//!
//! Text, tool use (`tool_use` / `tool_result` blocks, `tool_choice`) and thinking
//! controls; images and documents are refused with a 400 that says so. Decided on
//! purpose:
//! * `stop_reason` is `end_turn` for a matched stop sequence too, and
//!   `stop_sequence` is always `null`: the worker reports one `Stop` for both.
//! * `thinking` blocks of earlier turns are kept as the message's reasoning (the
//!   family's template decides whether to render it); `redacted_thinking` is
//!   dropped.
//! * `cache_control` on a block marks the end of its message (or of the system
//!   prompt) as a checkpoint boundary.
//! * Hosted server tools (web search, …) are not ours to run: they are skipped.
//! * `system` parts that are empty or start with `x-anthropic-` (Claude Code's
//!   per-request billing header) are dropped so they do not break prefix reuse;
//!   the rest are joined with `"\n"` (as the original ds4 does).
//! * A final assistant message (Anthropic's "prefill") is refused: the chat
//!   template can only close it and open a new turn, which is not what it means.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ds4_chat::think::ThinkControl;
use ds4_chat::{Message, Role, ToolCall, ToolChoice};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::dialect::{
    named, think_control, think_mode, AgentOptions, BadRequest, Dialect, ErrorKind, Gen, Input,
    Request, SamplingFields,
};
use crate::prepare::{self, Refusal};
use crate::relay;
use crate::state::{cpu, AppState};
use ds4_chat::turn::{CallOut, Piece, Turn};
use ds4_runtime::{FinishReason, Overflow, Usage};

#[derive(Deserialize)]
struct Body {
    model: Option<String>,
    messages: Option<Vec<WireMessage>>,
    system: Option<Value>,
    max_tokens: Option<u64>,
    #[serde(flatten)]
    sampling: SamplingFields,
    stop_sequences: Option<Vec<String>>,
    stream: Option<bool>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    thinking: Option<Value>,
    output_config: Option<OutputConfig>,
    output_format: Option<Value>,
    reasoning_effort: Option<String>,
    metadata: Option<Metadata>,
}

#[derive(Deserialize)]
struct Metadata {
    /// Claude Code sends its user, account and session ids here.
    user_id: Option<String>,
}

#[derive(Deserialize)]
struct OutputConfig {
    effort: Option<String>,
}

#[derive(Deserialize)]
struct WireMessage {
    role: String,
    content: Value,
}

/// Parses a `/v1/messages` body (`max_tokens` required, as Anthropic requires it).
pub fn parse_messages(body: &[u8]) -> Result<Request, BadRequest> {
    parse(body, true)
}

/// Parses a `/v1/messages/count_tokens` body (no `max_tokens`).
pub fn parse_count_tokens(body: &[u8]) -> Result<Request, BadRequest> {
    parse(body, false)
}

fn parse(body: &[u8], need_max_tokens: bool) -> Result<Request, BadRequest> {
    let b: Body = serde_json::from_slice(body)
        .map_err(|e| BadRequest::new(format!("invalid JSON request: {e}"), None))?;
    let tools = crate::tooling::parse_tools(b.tools.as_ref())
        .map_err(|m| BadRequest::new(format!("tools: {m}"), Some("tools")))?;
    let control = match &b.thinking {
        Some(t) => think_control(t, "thinking")?,
        None => ThinkControl::Absent,
    };
    let effort = b
        .output_config
        .and_then(|o| o.effort)
        .or(b.reasoning_effort);
    let think = think_mode(
        control,
        effort.as_deref(),
        b.model.as_deref(),
        "output_config",
    )?;
    let max_tokens = match b.max_tokens {
        None if need_max_tokens => {
            return Err(BadRequest::new(
                "max_tokens: field required",
                Some("max_tokens"),
            ))
        }
        Some(0) => {
            return Err(BadRequest::new(
                "max_tokens: must be at least 1",
                Some("max_tokens"),
            ))
        }
        n => n.map(|n| n as usize),
    };
    let sampling = b.sampling.config(1.0)?;
    b.sampling.choices(1)?;
    let stop = b.stop_sequences.unwrap_or_default();
    if stop.iter().any(String::is_empty) {
        return Err(BadRequest::new(
            "stop_sequences: must not contain empty strings",
            Some("stop_sequences"),
        ));
    }

    let msgs = b
        .messages
        .ok_or_else(|| BadRequest::new("messages: field required", Some("messages")))?;
    if msgs.is_empty() {
        return Err(BadRequest::new(
            "messages: at least one message is required",
            Some("messages"),
        ));
    }
    let mut out = Vec::with_capacity(msgs.len() + 1);
    let mut breakpoints = Vec::new();
    // Tools render into the system prompt: a breakpoint on them ends there too.
    let system_marked = b.system.as_ref().is_some_and(has_cache_control)
        || b.tools.as_ref().is_some_and(has_cache_control);
    if let Some(s) = system_text(b.system)? {
        out.push(Message::new(Role::System, s));
        if system_marked {
            breakpoints.push(0);
        }
    }
    let last = msgs.len() - 1;
    for (i, m) in msgs.into_iter().enumerate() {
        let marked = has_cache_control(&m.content);
        match m.role.as_str() {
            "user" => out.extend(user_messages(m.content, i)?),
            "assistant" if i == last => {
                return Err(BadRequest::new(
                    format!(
                        "messages.{i}: a final assistant message (prefill) is not supported yet"
                    ),
                    Some("messages"),
                ))
            }
            "assistant" => out.push(assistant_message(m.content, i)?),
            // Claude Code sends one after the first user turn (the agent and
            // skill lists): a system turn where it stands.
            "system" => out.push(system_message(m.content, i)?),
            other => {
                return Err(BadRequest::new(
                    format!(
                        "messages.{i}.role: unknown role {other:?} (user, assistant or system)"
                    ),
                    Some("messages"),
                ))
            }
        };
        if marked {
            breakpoints.push(out.len() - 1);
        }
    }
    let agent = AgentOptions {
        tools,
        tool_choice: tool_choice(b.tool_choice.as_ref())?,
        think,
        cache_breakpoints: breakpoints,
        affinity: b
            .metadata
            .and_then(|m| m.user_id)
            .map(|u| format!("user:{u}"))
            .into_iter()
            .collect(),
        json_schema: crate::dialect::json_format(b.output_format.as_ref(), "output_format")?,
        single_call: b
            .tool_choice
            .as_ref()
            .and_then(|c| c.get("disable_parallel_tool_use"))
            .and_then(Value::as_bool)
            .unwrap_or(false),
    };
    agent.validate()?;
    Ok(Request {
        model: b.model,
        input: Input::Messages(out),
        sampling,
        max_tokens,
        stop,
        stream: b.stream.unwrap_or(false),
        include_usage: false,
        logprobs: None,
        echo: false,
        n: 1,
        batch: vec![],
        agent,
    })
}

/// Anthropic `tool_choice`: `{"type": "auto" | "any" | "none" | "tool", "name"}`.
fn tool_choice(v: Option<&Value>) -> Result<ToolChoice, BadRequest> {
    let bad = |m: &str| BadRequest::new(format!("tool_choice: {m}"), Some("tool_choice"));
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(ToolChoice::Auto);
    };
    Ok(match v.get("type").and_then(Value::as_str) {
        Some("auto") => ToolChoice::Auto,
        Some("any") => ToolChoice::Required,
        Some("none") => ToolChoice::None,
        Some("tool") => match v.get("name").and_then(Value::as_str) {
            Some(n) => ToolChoice::Named(n.to_string()),
            None => return Err(bad("type \"tool\" needs a string `name`")),
        },
        _ => return Err(bad("`type` must be auto, any, tool or none")),
    })
}

/// Whether a content value (or any of its blocks) carries `cache_control`.
fn has_cache_control(v: &Value) -> bool {
    match v {
        Value::Array(blocks) => blocks
            .iter()
            .any(|b| b.get("cache_control").is_some_and(|c| !c.is_null())),
        _ => false,
    }
}

/// The system prompt: a string, null, or an array of text blocks (bare strings
/// accepted). Empty and `x-anthropic-` parts are dropped, the rest joined by
/// `"\n"` unless the text so far already ends with one.
fn system_text(v: Option<Value>) -> Result<Option<String>, BadRequest> {
    let bad = |m: String| BadRequest::new(m, Some("system"));
    let parts = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(a)) => a
            .into_iter()
            .enumerate()
            .map(|(j, b)| match b {
                Value::String(s) => Ok(s),
                b if b.get("type").and_then(Value::as_str) == Some("text") => {
                    match b.get("text").and_then(Value::as_str) {
                        Some(t) => Ok(t.to_string()),
                        None => Err(bad(format!("system.{j}.text: a string is required"))),
                    }
                }
                _ => Err(bad(format!(
                    "system.{j}: only text blocks are supported in the system prompt"
                ))),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(bad(
                "system: must be a string or an array of text blocks".into()
            ))
        }
    };
    let mut out = String::new();
    for p in parts {
        if p.is_empty() || p.starts_with("x-anthropic-") {
            continue;
        }
        if !out.is_empty() && !out.ends_with('\n') {
            out.push('\n');
        }
        out.push_str(&p);
    }
    Ok((!out.is_empty()).then_some(out))
}

/// The blocks of a message's `content`: a string is one text block.
fn blocks(v: Value, i: usize) -> Result<Vec<Value>, BadRequest> {
    match v {
        Value::String(s) => Ok(vec![json!({ "type": "text", "text": s })]),
        Value::Null => Ok(vec![]),
        Value::Array(a) => Ok(a),
        _ => Err(BadRequest::new(
            format!("messages.{i}.content: must be a string or an array of content blocks"),
            Some("messages"),
        )),
    }
}

/// A block's `type`, refusing what no message may hold.
fn block_type(b: &Value, i: usize, j: usize) -> Result<String, BadRequest> {
    let bad = |m: String| BadRequest::new(m, Some("messages"));
    match b.get("type").and_then(Value::as_str) {
        Some(ty @ ("image" | "document")) => Err(bad(format!(
            "messages.{i}.content.{j}: {ty} blocks are not supported (text only)"
        ))),
        Some(ty) => Ok(ty.to_string()),
        None if b.is_string() => Ok("text".into()),
        None => Err(bad(format!(
            "messages.{i}.content.{j}.type: a string is required"
        ))),
    }
}

/// A string field of block `j` of message `i`.
fn text_field<'a>(b: &'a Value, field: &str, i: usize, j: usize) -> Result<&'a str, BadRequest> {
    if let Value::String(s) = b {
        return Ok(s);
    }
    b.get(field).and_then(Value::as_str).ok_or_else(|| {
        BadRequest::new(
            format!("messages.{i}.content.{j}.{field}: a string is required"),
            Some("messages"),
        )
    })
}

/// A user message: its `tool_result` blocks become tool messages (first, as
/// Anthropic requires them first), its text blocks one user message.
fn user_messages(content: Value, i: usize) -> Result<Vec<Message>, BadRequest> {
    let mut out = Vec::new();
    let mut text = String::new();
    let mut has_text = false;
    for (j, b) in blocks(content, i)?.into_iter().enumerate() {
        match block_type(&b, i, j)?.as_str() {
            "text" => {
                text.push_str(text_field(&b, "text", i, j)?);
                has_text = true;
            }
            "tool_result" => {
                let id = text_field(&b, "tool_use_id", i, j)?.to_string();
                let mut result = String::new();
                for (k, part) in blocks(b.get("content").cloned().unwrap_or(Value::Null), i)?
                    .iter()
                    .enumerate()
                {
                    match part.get("type").and_then(Value::as_str) {
                        Some("text") | None => result.push_str(text_field(part, "text", i, j)?),
                        Some(ty) => {
                            return Err(BadRequest::new(
                                format!("messages.{i}.content.{j}.content.{k}: {ty} blocks are not supported in tool results (text only)"),
                                Some("messages"),
                            ))
                        }
                    }
                }
                let mut m = Message::new(Role::Tool, result);
                m.tool_call_id = Some(id);
                out.push(m);
            }
            ty => {
                return Err(BadRequest::new(
                    format!(
                        "messages.{i}.content.{j}: {ty} blocks are not supported in user messages"
                    ),
                    Some("messages"),
                ))
            }
        }
    }
    if has_text || out.is_empty() {
        out.push(Message::new(Role::User, text));
    }
    Ok(out)
}

/// A system message inside `messages`: its text blocks, concatenated as a user
/// message's are.
fn system_message(content: Value, i: usize) -> Result<Message, BadRequest> {
    let mut text = String::new();
    for (j, b) in blocks(content, i)?.into_iter().enumerate() {
        match block_type(&b, i, j)?.as_str() {
            "text" => text.push_str(text_field(&b, "text", i, j)?),
            ty => {
                return Err(BadRequest::new(
                    format!(
                        "messages.{i}.content.{j}: {ty} blocks are not supported in system messages (text only)"
                    ),
                    Some("messages"),
                ))
            }
        }
    }
    Ok(Message::new(Role::System, text))
}

/// An assistant message: text, thinking (kept as reasoning) and tool calls.
fn assistant_message(content: Value, i: usize) -> Result<Message, BadRequest> {
    let mut m = Message::new(Role::Assistant, "");
    for (j, b) in blocks(content, i)?.into_iter().enumerate() {
        match block_type(&b, i, j)?.as_str() {
            "text" => m.content.push_str(text_field(&b, "text", i, j)?),
            "thinking" => {
                let t = text_field(&b, "thinking", i, j)?;
                m.reasoning.get_or_insert_with(String::new).push_str(t);
            }
            "redacted_thinking" => {}
            "tool_use" => m.tool_calls.push(ToolCall {
                id: text_field(&b, "id", i, j)?.to_string(),
                name: text_field(&b, "name", i, j)?.to_string(),
                arguments: b.get("input").map_or_else(|| "{}".into(), Value::to_string),
            }),
            ty => {
                return Err(BadRequest::new(
                    format!(
                    "messages.{i}.content.{j}: {ty} blocks are not supported in assistant messages"
                ),
                    Some("messages"),
                ))
            }
        }
    }
    Ok(m)
}

/// Anthropic's usage object. The prompt splits into three disjoint parts: tokens
/// reused from memory or disk (`cache_read_input_tokens`), tokens this request
/// wrote to a disk checkpoint (`cache_creation_input_tokens`), and the rest
/// (`input_tokens`). The worker counts a checkpoint at its full length, which can
/// include reused tokens or count a prefix twice (cold and continued save in one
/// prefill), so the creation count is clamped to what was not reused.
pub fn usage_json(u: &Usage) -> Value {
    let read = u.cached_tokens.min(u.prompt_tokens);
    let created = u.checkpointed_tokens.min(u.prompt_tokens - read);
    json!({
        "input_tokens": u.prompt_tokens - read - created,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": read,
        "output_tokens": u.completion_tokens,
    })
}

fn stop_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "end_turn",
        FinishReason::Length | FinishReason::Cancelled => "max_tokens",
        FinishReason::ContextFull => "model_context_window_exceeded",
        FinishReason::ToolCalls => "tool_use",
    }
}

/// Anthropic ids read `msg_…`; the runner names responses `PREFIX-` and 32
/// random hex digits.
fn message_id(g: &Gen) -> String {
    g.id.replacen('-', "_", 1)
}

/// Anthropic's error body. A 413 is its own type there (`request_too_large`).
pub fn error_body(status: StatusCode, message: &str, kind: ErrorKind) -> Value {
    let ty = match kind {
        _ if status == StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        ErrorKind::InvalidRequest | ErrorKind::ContextLength => "invalid_request_error",
        ErrorKind::Authentication => "authentication_error",
        ErrorKind::Forbidden => "permission_error",
        ErrorKind::NotFound => "not_found_error",
        ErrorKind::Overloaded => "overloaded_error",
        ErrorKind::Server => "api_error",
    };
    json!({ "type": "error", "error": { "type": ty, "message": message } })
}

/// A tool call's arguments as the `input` object (`{}` if they are not one).
fn input_json(c: &CallOut) -> Value {
    serde_json::from_str::<Value>(&c.arguments)
        .ok()
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}))
}

/// The content block a stream has open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Open {
    Thinking,
    Text,
}

#[derive(Debug, Default)]
struct Blocks {
    /// Index of the next content block.
    next: usize,
    open: Option<Open>,
}

/// The Anthropic Messages wire format of one request (a stream numbers its
/// content blocks).
#[derive(Debug, Default)]
pub struct Anthropic {
    blocks: Blocks,
}

impl Blocks {
    /// Closes the open block (a thinking block gets its signature first).
    fn close(&mut self, g: &Gen, out: &mut Vec<SseEvent>) {
        let b = self;
        let Some(open) = b.open.take() else { return };
        let index = b.next - 1;
        if open == Open::Thinking {
            out.push(named(
                "content_block_delta",
                &json!({ "type": "content_block_delta", "index": index,
                         "delta": { "type": "signature_delta", "signature": message_id(g) } }),
            ));
        }
        out.push(named(
            "content_block_stop",
            &json!({ "type": "content_block_stop", "index": index }),
        ));
    }

    /// Opens a block of `kind` unless it is the open one; returns its index.
    fn open(&mut self, g: &Gen, kind: Open, out: &mut Vec<SseEvent>) -> usize {
        if self.open == Some(kind) {
            return self.next - 1;
        }
        self.close(g, out);
        let b = self;
        let block = match kind {
            Open::Thinking => json!({ "type": "thinking", "thinking": "" }),
            Open::Text => json!({ "type": "text", "text": "" }),
        };
        out.push(named(
            "content_block_start",
            &json!({ "type": "content_block_start", "index": b.next, "content_block": block }),
        ));
        b.open = Some(kind);
        b.next += 1;
        b.next - 1
    }
}

impl Dialect for Anthropic {
    fn id_prefix(&self) -> &'static str {
        "msg"
    }

    fn call_id_prefix(&self) -> &'static str {
        "toolu_"
    }

    fn error(&self, status: StatusCode, message: &str, kind: ErrorKind) -> Response {
        (status, Json(error_body(status, message, kind))).into_response()
    }

    /// Anthropic's own wording, which Claude Code parses: the second form makes it
    /// retry with a `max_tokens` that fits, the first makes it compact.
    fn overflow_message(&self, o: &Overflow) -> String {
        match o.max_tokens {
            None => format!(
                "prompt is too long: {} tokens > {} maximum",
                o.prompt_tokens,
                o.n_ctx.saturating_sub(1)
            ),
            Some(m) => format!(
                "input length and `max_tokens` exceed context limit: {} + {m} > {}, decrease input length or `max_tokens` and try again",
                o.prompt_tokens, o.n_ctx
            ),
        }
    }

    fn complete(&mut self, g: &Gen, turn: &Turn, finish: FinishReason, u: &Usage) -> Value {
        let mut content = Vec::new();
        if !turn.reasoning.is_empty() {
            content.push(json!({ "type": "thinking", "thinking": turn.reasoning, "signature": message_id(g) }));
        }
        if !turn.content.is_empty() || turn.calls.is_empty() {
            content.push(json!({ "type": "text", "text": turn.content }));
        }
        for c in &turn.calls {
            content.push(
                json!({ "type": "tool_use", "id": c.id, "name": c.name, "input": input_json(c) }),
            );
        }
        json!({
            "id": message_id(g), "type": "message", "role": "assistant", "model": g.model,
            "content": content,
            "stop_reason": stop_reason(finish), "stop_sequence": null,
            "usage": usage_json(u),
        })
    }

    fn stream_start(&mut self, g: &Gen, started: &Usage) -> Vec<SseEvent> {
        let message = json!({
            "id": message_id(g), "type": "message", "role": "assistant", "model": g.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": usage_json(started),
        });
        vec![
            named(
                "message_start",
                &json!({ "type": "message_start", "message": message }),
            ),
            named("ping", &json!({ "type": "ping" })),
        ]
    }

    fn stream_piece(&mut self, g: &Gen, piece: &Piece) -> Vec<SseEvent> {
        let mut out = Vec::new();
        let b = &mut self.blocks;
        match piece {
            Piece::Reasoning(t) => {
                let index = b.open(g, Open::Thinking, &mut out);
                out.push(named(
                    "content_block_delta",
                    &json!({ "type": "content_block_delta", "index": index,
                             "delta": { "type": "thinking_delta", "thinking": t } }),
                ));
            }
            Piece::Text(t) => {
                let index = b.open(g, Open::Text, &mut out);
                out.push(named(
                    "content_block_delta",
                    &json!({ "type": "content_block_delta", "index": index,
                             "delta": { "type": "text_delta", "text": t } }),
                ));
            }
            Piece::Call(_, c) => {
                b.close(g, &mut out);
                let index = b.next;
                b.next += 1;
                out.push(named(
                    "content_block_start",
                    &json!({ "type": "content_block_start", "index": index,
                             "content_block": { "type": "tool_use", "id": c.id, "name": c.name, "input": {} } }),
                ));
                out.push(named(
                    "content_block_delta",
                    &json!({ "type": "content_block_delta", "index": index,
                             "delta": { "type": "input_json_delta", "partial_json": c.arguments } }),
                ));
                out.push(named(
                    "content_block_stop",
                    &json!({ "type": "content_block_stop", "index": index }),
                ));
            }
        }
        out
    }

    /// `message_delta` carries the whole final usage (as Anthropic's does today):
    /// the checkpoint writes are only known after the prefill, so the
    /// `message_start` usage has `cache_creation_input_tokens` 0.
    fn stream_end(
        &mut self,
        g: &Gen,
        _turn: &Turn,
        finish: FinishReason,
        u: &Usage,
        _include_usage: bool,
    ) -> Vec<SseEvent> {
        let mut out = Vec::new();
        let b = &mut self.blocks;
        if b.next == 0 {
            // An empty answer still has its (empty) text block.
            b.open(g, Open::Text, &mut out);
        }
        b.close(g, &mut out);
        out.push(named(
            "message_delta",
            &json!({ "type": "message_delta",
                     "delta": { "stop_reason": stop_reason(finish), "stop_sequence": null },
                     "usage": usage_json(u) }),
        ));
        out.push(named("message_stop", &json!({ "type": "message_stop" })));
        out
    }

    fn stream_error(&mut self, _g: &Gen, message: &str) -> Vec<SseEvent> {
        vec![named(
            "error",
            &error_body(
                StatusCode::INTERNAL_SERVER_ERROR,
                message,
                ErrorKind::Server,
            ),
        )]
    }
}

/// `POST /v1/messages`.
pub(crate) async fn messages(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let d: Box<dyn Dialect> = Box::new(Anthropic::default());
    match cpu(&st, move |_| parse_messages(&body)).await {
        Ok(p) => relay::run(st, p, d).await,
        Err(e) => d.bad_request(e),
    }
}

/// `POST /v1/messages/count_tokens`: the tokens of the rendered prompt, tokenized
/// as a cold prompt is.
pub(crate) async fn count_tokens(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let d = Anthropic::default();
    let counted = cpu(&st, move |st| {
        let p = parse_count_tokens(&body).map_err(|e| Refusal::Invalid(e.message))?;
        prepare::count_tokens(st, p)
    })
    .await;
    match counted {
        Ok(n) => Json(json!({ "input_tokens": n })).into_response(),
        Err(r) => relay::refuse(&d, r),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_runtime::CacheSource;

    fn bad(b: &str) -> String {
        parse_messages(b.as_bytes()).unwrap_err().message
    }

    #[test]
    fn requests_map_to_messages_with_the_system_first() {
        let p = parse_messages(
            br#"{"model":"claude-x","max_tokens":7,"temperature":0,"top_p":0.5,"top_k":3,
            "stop_sequences":["END"],"stream":true,"metadata":{"user_id":"u"},"whatever":1,
            "thinking":{"type":"disabled"},"tools":[],
            "system":[{"type":"text","text":"x-anthropic-billing-header: cc=1"},
                      {"type":"text","text":"Be brief.","cache_control":{"type":"ephemeral"}},
                      "Be kind.",{"type":"text","text":""}],
            "messages":[{"role":"user","content":"hi"},
              {"role":"assistant","content":[{"type":"thinking","thinking":"hm","signature":"s"},
                                             {"type":"text","text":"he"},{"type":"text","text":"llo"}]},
              {"role":"user","content":[{"type":"text","text":"a"},"b"]}]}"#,
        )
        .unwrap();
        let Input::Messages(m) = &p.input else {
            panic!()
        };
        assert_eq!(
            m,
            &[
                Message::new(Role::System, "Be brief.\nBe kind."),
                Message::new(Role::User, "hi"),
                Message {
                    reasoning: Some("hm".into()),
                    ..Message::new(Role::Assistant, "hello")
                },
                Message::new(Role::User, "ab"),
            ]
        );
        assert_eq!(p.model.as_deref(), Some("claude-x"));
        assert_eq!(
            (p.max_tokens, p.stop.clone(), p.stream, p.include_usage),
            (Some(7), vec!["END".to_string()], true, false)
        );
        assert_eq!(
            (p.sampling.temperature, p.sampling.top_p, p.sampling.top_k),
            (0.0, 0.5, 3)
        );

        // No system: none is added (the template adds its default).
        let p = parse_messages(
            br#"{"max_tokens":1,"system":"","messages":[{"role":"user","content":"x"}]}"#,
        )
        .unwrap();
        assert!(matches!(&p.input, Input::Messages(m) if m.len() == 1 && m[0].role == Role::User));
        assert!(!p.stream);
    }

    /// Claude Code 2.1's first request: a system message after the first user
    /// turn (the agent and skill lists), kept where it stands.
    #[test]
    fn system_messages_stand_where_they_are_sent() {
        let p = parse_messages(
            br#"{"max_tokens":9,"system":[{"type":"text","text":"top"}],
            "messages":[{"role":"user","content":"hi"},
              {"role":"system","content":"agents: a, b"},
              {"role":"assistant","content":"ok"},
              {"role":"system","content":[{"type":"text","text":"x"},{"type":"text","text":"y","cache_control":{"type":"ephemeral"}}]},
              {"role":"user","content":"go"}]}"#,
        )
        .unwrap();
        let Input::Messages(m) = &p.input else {
            panic!()
        };
        assert_eq!(
            m,
            &[
                Message::new(Role::System, "top"),
                Message::new(Role::User, "hi"),
                Message::new(Role::System, "agents: a, b"),
                Message::new(Role::Assistant, "ok"),
                Message::new(Role::System, "xy"),
                Message::new(Role::User, "go"),
            ]
        );
        assert_eq!(p.agent.cache_breakpoints, vec![4]);

        let fixture = std::fs::read(ds4_testdata::vectors_dir(
            "clients/claude-code-2.1.197-messages.json",
        ))
        .unwrap();
        let p = parse_messages(&fixture).unwrap();
        let Input::Messages(m) = &p.input else {
            panic!()
        };
        let roles: Vec<Role> = m.iter().map(|m| m.role).collect();
        assert_eq!(roles, [Role::System, Role::User, Role::System]);
        assert!(m[2]
            .content
            .starts_with("Available agent types for the Agent tool:"));
        assert_eq!(p.agent.tools.len(), 26);
        assert_eq!(p.max_tokens, Some(32000));
    }

    #[test]
    fn overflows_are_worded_as_anthropic_words_them() {
        let d = Anthropic::default();
        let prompt_only = Overflow {
            prompt_tokens: 21400,
            at_least: false,
            max_tokens: None,
            n_ctx: 8192,
        };
        assert_eq!(
            d.overflow_message(&prompt_only),
            "prompt is too long: 21400 tokens > 8191 maximum"
        );
        let with_limit = Overflow {
            max_tokens: Some(32000),
            n_ctx: 32768,
            ..prompt_only
        };
        assert_eq!(
            d.overflow_message(&with_limit),
            "input length and `max_tokens` exceed context limit: 21400 + 32000 > 32768, decrease input length or `max_tokens` and try again"
        );
        assert_eq!(
            stop_reason(FinishReason::ContextFull),
            "model_context_window_exceeded"
        );
    }

    #[test]
    fn tool_use_and_results_become_calls_and_tool_messages() {
        let p = parse_messages(
            br#"{"max_tokens":9,"tool_choice":{"type":"tool","name":"ls"},
            "thinking":{"type":"disabled"},
            "tools":[{"name":"ls","description":"list","input_schema":{"type":"object","properties":{"dir":{"type":"string"}}},
                      "cache_control":{"type":"ephemeral"}},
                     {"type":"web_search_20250305","name":"web_search","max_uses":2}],
            "system":[{"type":"text","text":"sys","cache_control":{"type":"ephemeral"}}],
            "messages":[{"role":"user","content":"list /"},
              {"role":"assistant","content":[{"type":"text","text":"Sure."},
                 {"type":"tool_use","id":"toolu_1","name":"ls","input":{"dir":"/","all":true}}]},
              {"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1",
                 "content":[{"type":"text","text":"bin\netc"}]},{"type":"text","text":"and?",
                 "cache_control":{"type":"ephemeral"}}]}]}"#,
        )
        .unwrap();
        let Input::Messages(m) = &p.input else {
            panic!()
        };
        assert_eq!(m.len(), 5);
        assert_eq!(
            m[2].tool_calls,
            vec![ToolCall {
                id: "toolu_1".into(),
                name: "ls".into(),
                arguments: r#"{"dir":"/","all":true}"#.into()
            }]
        );
        assert_eq!((m[2].content.as_str(), m[3].role), ("Sure.", Role::Tool));
        assert_eq!(
            (m[3].content.as_str(), m[3].tool_call_id.as_deref()),
            ("bin\netc", Some("toolu_1"))
        );
        assert_eq!(m[4], Message::new(Role::User, "and?"));
        let a = &p.agent;
        assert_eq!(a.tools.len(), 1, "the hosted web search tool is skipped");
        assert_eq!(a.tool_choice, ToolChoice::Named("ls".into()));
        assert_eq!(a.think, ds4_chat::ThinkMode::None);
        assert_eq!(a.cache_breakpoints, vec![0, 4]);
    }

    #[test]
    fn thinking_then_text_then_a_call_are_numbered_blocks() {
        let mut d = Anthropic::default();
        let g = gen();
        let call = CallOut {
            id: "toolu_1".into(),
            name: "ls".into(),
            arguments: r#"{"d":1}"#.into(),
        };
        let mut evs = Vec::new();
        for p in [
            Piece::Reasoning("hm".into()),
            Piece::Text("Sure.".into()),
            Piece::Call(0, call.clone()),
        ] {
            evs.extend(d.stream_piece(&g, &p));
        }
        evs.extend(d.stream_end(
            &g,
            &Turn::default(),
            FinishReason::ToolCalls,
            &usage(1, 0, 0),
            false,
        ));
        let text: Vec<String> = evs.iter().map(|e| format!("{e:?}")).collect();
        let joined = text.join("\n");
        let order = [
            r#"\"type\":\"thinking\""#,
            "thinking_delta",
            "signature_delta",
            r#"\"index\":1,\"content_block\":{\"type\":\"text\""#,
            "text_delta",
            "tool_use",
            "input_json_delta",
            r#"\"stop_reason\":\"tool_use\""#,
        ];
        let mut from = 0;
        for needle in order {
            let at = joined[from..]
                .find(needle)
                .unwrap_or_else(|| panic!("{needle} after {from}: {joined}"));
            from += at;
        }
        let v = d.complete(
            &g,
            &Turn {
                reasoning: "hm".into(),
                content: "Sure.".into(),
                calls: vec![call],
                ..Turn::default()
            },
            FinishReason::ToolCalls,
            &usage(1, 0, 0),
        );
        assert_eq!(
            v["content"][0],
            json!({"type":"thinking","thinking":"hm","signature":"msg_7"})
        );
        assert_eq!(v["content"][2]["input"], json!({"d":1}));
        assert_eq!(v["stop_reason"], "tool_use");
    }

    #[test]
    fn count_tokens_needs_no_max_tokens() {
        let p = parse_count_tokens(br#"{"messages":[{"role":"user","content":"x"}]}"#).unwrap();
        assert_eq!(p.max_tokens, None);
        assert_eq!(
            bad(r#"{"messages":[{"role":"user","content":"x"}]}"#),
            "max_tokens: field required"
        );
    }

    #[test]
    fn what_we_cannot_do_is_refused_precisely() {
        let user = |content: &str| {
            format!(r#"{{"max_tokens":5,"messages":[{{"role":"user","content":{content}}}]}}"#)
        };
        assert!(bad("{").starts_with("invalid JSON request"));
        assert!(bad(r#"{"max_tokens":"9","messages":[]}"#).contains("invalid type"));
        assert!(bad(r#"{"max_tokens":-1,"messages":[]}"#).contains("invalid value"));
        assert!(bad(r#"{"max_tokens":1,"messages":[{"content":"x"}]}"#)
            .contains("missing field `role`"));
        assert_eq!(bad(r#"{"max_tokens":1}"#), "messages: field required");
        assert!(bad(r#"{"max_tokens":1,"messages":[]}"#).contains("at least one"));
        assert!(bad(r#"{"max_tokens":0,"messages":[]}"#).contains("at least 1"));
        assert_eq!(
            bad(&user(r#"[{"type":"image","source":{}}]"#)),
            "messages.0.content.0: image blocks are not supported (text only)"
        );
        assert!(
            bad(&user(r#"[{"type":"text","text":"a"},{"type":"document"}]"#))
                .starts_with("messages.0.content.1: document blocks are not supported")
        );
        assert!(bad(&user(r#"[{"type":"tool_result","content":"x"}]"#))
            .contains("messages.0.content.0.tool_use_id: a string is required"));
        assert!(bad(&user(
            r#"[{"type":"tool_result","tool_use_id":"t","content":[{"type":"image"}]}]"#
        ))
        .contains("not supported in tool results"));
        assert!(bad(&user(
            r#"[{"type":"tool_use","id":"t","name":"f","input":{}}]"#
        ))
        .contains("tool_use blocks are not supported in user messages"));
        assert!(bad(&user(r#"[{"type":"text"}]"#)).contains("content.0.text"));
        assert!(bad(&user(r#"[{"text":"x"}]"#)).contains("content.0.type"));
        assert!(bad(&user("5")).contains("must be a string or an array"));
        assert!(
            bad(r#"{"max_tokens":1,"messages":[{"role":"tool","content":"x"}]}"#)
                .contains("unknown role \"tool\"")
        );
        assert!(bad(
            r#"{"max_tokens":1,"messages":[{"role":"user","content":"x"},{"role":"system","content":[{"type":"tool_use","id":"t","name":"f","input":{}}]}]}"#
        )
        .contains("not supported in system messages"));
        assert!(bad(
            r#"{"max_tokens":1,"messages":[{"role":"user","content":"x"},{"role":"assistant","content":"{"}]}"#
        )
        .contains("prefill"));
        assert!(bad(
            r#"{"max_tokens":1,"tools":[{"input_schema":{}}],"messages":[{"role":"user","content":"x"}]}"#
        )
        .starts_with("tools: tools[0]: a non-empty string `name` is required"));
        assert!(bad(
            r#"{"max_tokens":1,"tool_choice":{"type":"tool","name":"g"},"tools":[{"name":"f","input_schema":{}}],"messages":[{"role":"user","content":"x"}]}"#
        )
        .contains("unknown tool \"g\""));
        assert!(bad(
            r#"{"max_tokens":1,"tool_choice":{"type":"any"},"messages":[{"role":"user","content":"x"}]}"#
        )
        .contains("no tools were given"));
        assert!(bad(
            r#"{"max_tokens":1,"thinking":{"type":"sometimes"},"messages":[{"role":"user","content":"x"}]}"#
        )
        .contains("thinking.type"));
        assert!(bad(
            r#"{"max_tokens":1,"output_config":{"effort":"huge"},"messages":[{"role":"user","content":"x"}]}"#
        )
        .contains("unknown reasoning effort"));
        assert!(bad(
            r#"{"max_tokens":1,"temperature":1.5,"messages":[{"role":"user","content":"x"}]}"#
        )
        .starts_with("temperature"));
        assert!(bad(
            r#"{"max_tokens":1,"stop_sequences":"x","messages":[{"role":"user","content":"x"}]}"#
        )
        .contains("invalid type"));
        assert!(bad(
            r#"{"max_tokens":1,"stop_sequences":[""],"messages":[{"role":"user","content":"x"}]}"#
        )
        .starts_with("stop_sequences"));
        assert!(bad(r#"{"max_tokens":1,"system":[{"type":"image"}],"messages":[{"role":"user","content":"x"}]}"#)
            .starts_with("system.0"));
    }

    fn usage(prompt: usize, cached: usize, checkpointed: usize) -> Usage {
        Usage {
            prompt_tokens: prompt,
            cached_tokens: cached,
            checkpointed_tokens: checkpointed,
            completion_tokens: 9,
            cache_source: CacheSource::None,
            cut_tokens: 0,
            miss: None,
            slot: 0,
            queue_s: 0.0,
        }
    }

    #[test]
    fn usage_splits_the_prompt_into_read_created_and_the_rest() {
        let parts = |u: &Usage| {
            let v = usage_json(u);
            (
                v["input_tokens"].as_u64().unwrap(),
                v["cache_read_input_tokens"].as_u64().unwrap(),
                v["cache_creation_input_tokens"].as_u64().unwrap(),
                v["output_tokens"].as_u64().unwrap(),
            )
        };
        assert_eq!(parts(&usage(100, 0, 0)), (100, 0, 0, 9));
        assert_eq!(parts(&usage(100, 0, 96)), (4, 0, 96, 9));
        assert_eq!(parts(&usage(100, 60, 0)), (40, 60, 0, 9));
        // A checkpoint counted at full length (reused prefix included) is clamped.
        assert_eq!(parts(&usage(100, 60, 100)), (0, 60, 40, 9));
        assert_eq!(parts(&usage(100, 0, 180)), (0, 0, 100, 9));
        assert_eq!(parts(&usage(10, 20, 0)), (0, 10, 0, 9));
    }

    fn gen() -> Gen {
        Gen {
            id: "msg-7".into(),
            created: 1,
            model: "m".into(),
        }
    }

    #[test]
    fn responses_have_anthropic_shapes() {
        let v = Anthropic::default().complete(
            &gen(),
            &Turn::text("Paris."),
            FinishReason::Length,
            &usage(10, 4, 0),
        );
        assert_eq!(
            v,
            json!({
                "id": "msg_7", "type": "message", "role": "assistant", "model": "m",
                "content": [{ "type": "text", "text": "Paris." }],
                "stop_reason": "max_tokens", "stop_sequence": null,
                "usage": { "input_tokens": 6, "cache_read_input_tokens": 4,
                           "cache_creation_input_tokens": 0, "output_tokens": 9 },
            })
        );
        assert_eq!(
            Anthropic::default().complete(
                &gen(),
                &Turn::default(),
                FinishReason::Stop,
                &usage(1, 0, 0)
            )["stop_reason"],
            "end_turn"
        );
        assert_eq!(
            error_body(StatusCode::BAD_REQUEST, "nope", ErrorKind::ContextLength),
            json!({ "type": "error", "error": { "type": "invalid_request_error", "message": "nope" } })
        );
        let ty = |s: StatusCode, k| error_body(s, "", k)["error"]["type"].clone();
        assert_eq!(
            ty(StatusCode::UNAUTHORIZED, ErrorKind::Authentication),
            "authentication_error"
        );
        assert_eq!(
            ty(StatusCode::NOT_FOUND, ErrorKind::NotFound),
            "not_found_error"
        );
        assert_eq!(
            ty(StatusCode::SERVICE_UNAVAILABLE, ErrorKind::Overloaded),
            "overloaded_error"
        );
        assert_eq!(
            ty(StatusCode::INTERNAL_SERVER_ERROR, ErrorKind::Server),
            "api_error"
        );
        assert_eq!(
            ty(StatusCode::PAYLOAD_TOO_LARGE, ErrorKind::InvalidRequest),
            "request_too_large"
        );
    }
}
