//! The OpenAI Responses dialect, `POST /v1/responses`: text in, one assistant
//! message out, as a response object or the typed SSE events the official SDKs
//! consume (`response.created` … `response.completed`).
//!
//! Stateful where asked: a response with `store` (true unless `false`, as
//! OpenAI's default) keeps its conversation — the input messages (not the
//! `instructions`, which the API does not carry over) and its answer — in the
//! runtime's [`Conversations`], durably beside the checkpoint store; a request
//! with `previous_response_id` sends only its new input and continues that
//! conversation (restored from disk after a restart: the turn-end checkpoint
//! serves its state). An unknown or expired id is a 404
//! `previous_response_not_found`. `conversation`, `background` and
//! `item_reference` items are refused (clients replay the full input). Function tools
//! (`tools`, `tool_choice`, `function_call` / `function_call_output` items) are
//! supported; hosted tools are skipped. `reasoning.effort` selects the thinking
//! mode; `reasoning` input items are dropped (the family re-renders what it keeps).

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::Event as SseEvent;
use axum::response::Response;
use ds4_chat::{Message, Role};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::dialect::{
    named, think_mode, AgentOptions, BadRequest, Dialect, ErrorKind, Gen, Input, Request,
    SamplingFields,
};
use crate::openai::{bad_request_response, error_response, tool_choice};
use crate::relay::run;
use crate::state::AppState;
use ds4_chat::turn::{CallOut, Piece, Turn};
use ds4_chat::ToolCall;
use ds4_runtime::{Conversations, FinishReason, Logprobs, Usage};

/// The request fields we read. `metadata`, `user`, `parallel_tool_calls` and
/// `truncation` are type-checked and otherwise ignored (the response object
/// echoes `metadata`, `user`, `parallel_tool_calls` and `store`, and states
/// `truncation: "disabled"`, which is what happens). Fields
/// not listed (`include`, `service_tier`, …) are ignored.
#[derive(Deserialize)]
struct Body {
    model: Option<String>,
    input: Option<Value>,
    instructions: Option<String>,
    max_output_tokens: Option<u64>,
    #[serde(flatten)]
    sampling: SamplingFields,
    stream: Option<bool>,
    store: Option<bool>,
    metadata: Option<Value>,
    user: Option<String>,
    parallel_tool_calls: Option<bool>,
    #[allow(dead_code)]
    truncation: Option<String>,
    previous_response_id: Option<String>,
    conversation: Option<Value>,
    background: Option<bool>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    reasoning: Option<Reasoning>,
    text: Option<TextConfig>,
    top_logprobs: Option<u64>,
    include: Option<Value>,
    prompt_cache_key: Option<String>,
}

#[derive(Deserialize)]
struct Reasoning {
    effort: Option<String>,
    summary: Option<String>,
}

#[derive(Deserialize)]
struct TextConfig {
    format: Option<Value>,
}

/// Request parameters a response object echoes back (OpenAI returns them in
/// every response object, streamed or not).
#[derive(Debug, Default)]
struct Echo {
    instructions: Option<String>,
    max_output_tokens: Option<u64>,
    temperature: f32,
    top_p: f32,
    top_logprobs: usize,
    metadata: Value,
    user: Option<String>,
    parallel_tool_calls: bool,
    tool_choice: Value,
    reasoning_effort: Option<String>,
    /// `reasoning.summary` auto / concise / detailed: reasoning is returned as a
    /// `reasoning` item with a summary text.
    reasoning_summary: Option<String>,
    /// The `tools` array as the client sent it.
    tools: Value,
    /// `text.format` as sent (`{"type": "text"}` when absent).
    text_format: Value,
    /// Functions declared inside `namespace` tools, and their namespace: a call
    /// to one names it (`"namespace"` on the `function_call` item).
    namespaces: HashMap<String, String>,
}

/// The Responses wire format of one request. It is built per request: it echoes
/// that request's parameters and numbers that stream's events.
#[derive(Debug, Default)]
pub struct Responses {
    echo: Echo,
    /// The stored response this one continues.
    previous: Option<String>,
    /// Whether this response is kept (`store`).
    store: bool,
    /// Where this response's conversation is kept when it is stored, and its
    /// messages before the answer (without the instructions).
    record: Option<(Arc<Conversations>, Vec<Message>)>,
    /// `sequence_number` of the next SSE event.
    seq: u64,
    /// The text streamed so far, for the `response.failed` object.
    streamed: String,
    /// The reasoning streamed so far (`Some` once its item opened) and whether
    /// its item is closed.
    reasoning: (Option<String>, bool),
    /// Log-probabilities given and not yet sent, and those of the text so far
    /// (in OpenAI's shape).
    logprobs: Vec<Logprobs>,
    text_logprobs: Vec<Value>,
}

fn bad(message: impl Into<String>, param: &'static str) -> BadRequest {
    BadRequest::new(message, Some(param))
}

/// The alternatives per token the request asks log-probabilities with:
/// `include` naming `message.output_text.logprobs` (with `top_logprobs`
/// alternatives, 0-20), or `top_logprobs` above 0 alone.
fn logprobs(top: Option<u64>, include: Option<&Value>) -> Result<Option<usize>, BadRequest> {
    let top = match top {
        Some(n) if n > 20 => {
            return Err(bad(
                "top_logprobs must be an integer from 0 to 20",
                "top_logprobs",
            ))
        }
        t => t.unwrap_or(0) as usize,
    };
    let included = match include {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => a
            .iter()
            .any(|v| v.as_str() == Some("message.output_text.logprobs")),
        Some(_) => return Err(bad("include must be an array of strings", "include")),
    };
    Ok((included || top > 0).then_some(top))
}

/// Parses a `/v1/responses` body into the engine request and the dialect that
/// will answer it.
pub fn parse(body: &[u8]) -> Result<(Request, Responses), BadRequest> {
    let b: Body = serde_json::from_slice(body)
        .map_err(|e| BadRequest::new(format!("invalid JSON request: {e}"), None))?;
    if b.conversation.as_ref().is_some_and(|c| !c.is_null()) {
        return Err(bad(
            "conversation is not supported: this server keeps no conversations; replay the full input instead",
            "conversation",
        ));
    }
    if b.background == Some(true) {
        return Err(bad(
            "background mode is not supported (it needs stored responses)",
            "background",
        ));
    }
    let tools = crate::tooling::parse_tools(b.tools.as_ref()).map_err(|m| bad(m, "tools"))?;
    let text_format = b.text.and_then(|t| t.format).filter(|f| !f.is_null());
    let (effort, summary) = match b.reasoning {
        Some(r) => (r.effort, r.summary),
        None => (None, None),
    };
    let summary = match summary.as_deref() {
        None | Some("auto" | "concise" | "detailed") => summary,
        Some(other) => {
            return Err(bad(
                format!("reasoning.summary must be auto, concise or detailed, not {other:?}"),
                "reasoning",
            ))
        }
    };
    // A reasoning effort is the Responses API's thinking control.
    let control = match effort.as_deref() {
        None => ds4_chat::think::ThinkControl::Absent,
        Some("none") => ds4_chat::think::ThinkControl::Disabled,
        Some(_) => ds4_chat::think::ThinkControl::Present,
    };
    let agent = AgentOptions {
        tools,
        tool_choice: tool_choice(b.tool_choice.as_ref())?,
        think: think_mode(control, effort.as_deref(), b.model.as_deref(), "reasoning")?,
        cache_breakpoints: vec![],
        affinity: b
            .prompt_cache_key
            .map(|k| format!("key:{k}"))
            .into_iter()
            .collect(),
        json_schema: crate::dialect::json_format(text_format.as_ref(), "text.format")?,
        single_call: b.parallel_tool_calls == Some(false),
    };
    agent.validate()?;
    let logprobs = logprobs(b.top_logprobs, b.include.as_ref())?;

    let sampling = b.sampling.config(2.0)?;
    b.sampling.choices(1)?;
    if b.max_output_tokens == Some(0) {
        return Err(bad(
            "max_output_tokens must be at least 1",
            "max_output_tokens",
        ));
    }

    let mut messages = Vec::new();
    match b.input {
        None | Some(Value::Null) => return Err(bad("missing `input`", "input")),
        Some(Value::String(s)) => messages.push(Message::new(Role::User, s)),
        Some(Value::Array(items)) => {
            if items.is_empty() {
                return Err(bad("`input` is empty", "input"));
            }
            for (i, item) in items.iter().enumerate() {
                input_item(&mut messages, item, i)?;
            }
        }
        Some(_) => {
            return Err(bad(
                "input must be a string or an array of input items",
                "input",
            ))
        }
    }

    let echo = Echo {
        instructions: b.instructions,
        max_output_tokens: b.max_output_tokens,
        temperature: sampling.temperature,
        top_p: sampling.top_p,
        top_logprobs: logprobs.unwrap_or(0),
        metadata: b.metadata.filter(|m| !m.is_null()).unwrap_or(json!({})),
        user: b.user,
        parallel_tool_calls: b.parallel_tool_calls.unwrap_or(true),
        tool_choice: b
            .tool_choice
            .filter(|t| !t.is_null())
            .unwrap_or(json!("auto")),
        reasoning_effort: effort,
        reasoning_summary: summary,
        namespaces: crate::tooling::namespaces(b.tools.as_ref()),
        tools: b.tools.filter(|t| !t.is_null()).unwrap_or(json!([])),
        text_format: text_format.unwrap_or(json!({ "type": "text" })),
    };
    // The instructions lead the prompt; a stored conversation keeps only the
    // messages after them (`attach` puts the one continued between).
    if let Some(s) = echo.instructions.as_deref().filter(|s| !s.is_empty()) {
        messages.insert(0, Message::new(Role::System, s));
    }
    let request = Request {
        model: b.model,
        input: Input::Messages(messages),
        sampling,
        max_tokens: b.max_output_tokens.map(|n| n as usize),
        stop: vec![],
        stream: b.stream.unwrap_or(false),
        include_usage: true,
        logprobs,
        echo: false,
        n: 1,
        batch: vec![],
        agent,
    };
    let mut dialect = Responses::new(echo);
    dialect.previous = b.previous_response_id;
    dialect.store = b.store.unwrap_or(true);
    Ok((request, dialect))
}

/// Why a request that parsed cannot run.
pub(crate) enum Refusal {
    Bad(BadRequest),
    /// `previous_response_id` names no kept response.
    UnknownPrevious(String),
}

impl From<BadRequest> for Refusal {
    fn from(e: BadRequest) -> Self {
        Refusal::Bad(e)
    }
}

/// Puts the conversation `previous_response_id` names before the request's
/// input, and keeps what this response's stored conversation will hold.
fn attach(
    conversations: &Arc<Conversations>,
    request: &mut Request,
    dialect: &mut Responses,
) -> Result<(), Refusal> {
    let Input::Messages(messages) = &mut request.input else {
        return Ok(());
    };
    let lead = usize::from(
        dialect
            .echo
            .instructions
            .as_deref()
            .is_some_and(|s| !s.is_empty()),
    );
    if let Some(id) = &dialect.previous {
        let before = conversations
            .get(id)
            .map_err(|e| Refusal::Bad(bad(e.to_string(), "previous_response_id")))?
            .ok_or_else(|| Refusal::UnknownPrevious(id.clone()))?;
        messages.splice(lead..lead, before);
    }
    if dialect.store {
        dialect.record = Some((Arc::clone(conversations), messages[lead..].to_vec()));
    }
    Ok(())
}

/// A string field of input item `i`.
fn item_str<'a>(
    obj: &'a serde_json::Map<String, Value>,
    field: &str,
    i: usize,
) -> Result<&'a str, BadRequest> {
    obj.get(field)
        .and_then(Value::as_str)
        .ok_or_else(|| bad(format!("input[{i}].{field} must be a string"), "input"))
}

/// Appends one `input` item: a message (`type` "message" or absent), a
/// `function_call` (joined to the assistant turn it belongs to), a
/// `function_call_output` (a tool result), or a `reasoning` item (dropped).
fn input_item(out: &mut Vec<Message>, item: &Value, i: usize) -> Result<(), BadRequest> {
    let Some(obj) = item.as_object() else {
        return Err(bad(format!("input[{i}] must be an object"), "input"));
    };
    match obj.get("type").map(|t| t.as_str()) {
        None | Some(Some("message")) => {}
        Some(Some("function_call")) => {
            let call = ToolCall {
                id: item_str(obj, "call_id", i)?.to_string(),
                name: item_str(obj, "name", i)?.to_string(),
                arguments: item_str(obj, "arguments", i)?.to_string(),
            };
            match out.last_mut() {
                Some(m) if m.role == Role::Assistant => m.tool_calls.push(call),
                _ => {
                    let mut m = Message::new(Role::Assistant, "");
                    m.tool_calls.push(call);
                    out.push(m);
                }
            }
            return Ok(());
        }
        Some(Some("function_call_output")) => {
            let output = match obj.get("output") {
                Some(Value::String(s)) => s.clone(),
                other => content_text(other, i)?,
            };
            let mut m = Message::new(Role::Tool, output);
            // Codex also sends outputs that answer no call (its goal tools add
            // one with `name` and `namespace` but no `call_id`): a result
            // without an id, rendered as any other.
            m.tool_call_id = match obj.get("call_id") {
                None => None,
                Some(_) => Some(item_str(obj, "call_id", i)?.to_string()),
            };
            out.push(m);
            return Ok(());
        }
        Some(Some("reasoning")) => return Ok(()),
        Some(Some("item_reference")) => {
            return Err(bad(
                format!("input[{i}]: item_reference is not supported: this server keeps no items; replay the full input instead"),
                "input",
            ))
        }
        Some(Some(ty)) => {
            return Err(bad(
                format!("input[{i}]: {ty} items are not supported (messages, function calls and their outputs)"),
                "input",
            ))
        }
        Some(None) => return Err(bad(format!("input[{i}].type must be a string"), "input")),
    }
    let role = match obj.get("role").map(|r| r.as_str()) {
        None | Some(Some("user")) => Role::User,
        Some(Some("assistant")) => Role::Assistant,
        Some(Some("system" | "developer")) => Role::System,
        Some(Some(other)) => {
            return Err(bad(
                format!("input[{i}]: unknown role {other:?} (user, assistant, system, developer)"),
                "input",
            ))
        }
        Some(None) => return Err(bad(format!("input[{i}].role must be a string"), "input")),
    };
    out.push(Message::new(role, content_text(obj.get("content"), i)?));
    Ok(())
}

/// Text of an item's `content`: a string, or an array of text parts.
fn content_text(v: Option<&Value>, i: usize) -> Result<String, BadRequest> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for (j, p) in parts.iter().enumerate() {
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => {
                        match p.get("text").and_then(Value::as_str) {
                            Some(t) => out.push_str(t),
                            None => {
                                return Err(bad(
                                    format!(
                                    "input[{i}].content[{j}]: a text part needs a string `text`"
                                ),
                                    "input",
                                ))
                            }
                        }
                    }
                    Some(other) => {
                        return Err(bad(
                            format!(
                            "input[{i}].content[{j}]: {other} parts are not supported (text only)"
                        ),
                            "input",
                        ))
                    }
                    None => {
                        return Err(bad(
                            format!(
                                "input[{i}].content[{j}] must be an object with a string `type`"
                            ),
                            "input",
                        ))
                    }
                }
            }
            Ok(out)
        }
        Some(_) => Err(bad(
            format!("input[{i}].content must be a string or an array of content parts"),
            "input",
        )),
    }
}

/// `POST /v1/responses`.
pub(crate) async fn create(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let conversations = Arc::clone(&st.conversations);
    let parsed = crate::state::cpu(&st, move |_| {
        let (mut p, mut d) = parse(&body)?;
        attach(&conversations, &mut p, &mut d)?;
        Ok((p, d))
    })
    .await;
    match parsed {
        Ok((p, d)) => run(st, p, Box::new(d)).await,
        Err(Refusal::Bad(e)) => Responses::default().bad_request(e),
        Err(Refusal::UnknownPrevious(id)) => {
            let body = json!({ "error": {
                "message": format!("Previous response with id '{id}' not found."),
                "type": "invalid_request_error",
                "param": "previous_response_id",
                "code": "previous_response_not_found",
            }});
            axum::response::IntoResponse::into_response((StatusCode::NOT_FOUND, axum::Json(body)))
        }
    }
}

/// Response usage (`cached_tokens` is the prefix reused from the live session
/// or a disk checkpoint; there are no reasoning tokens).
pub fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": { "cached_tokens": u.cached_tokens },
        "output_tokens": u.completion_tokens,
        "output_tokens_details": { "reasoning_tokens": 0 },
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// An `f32` parameter as the number the client wrote (`0.9`, not
/// `0.8999999761581421`).
fn short_float(x: f32) -> Value {
    x.to_string()
        .parse::<f64>()
        .map_or(Value::Null, |f| json!(f))
}

/// `resp_X` and `msg_X` from the runner's `resp-X` (X: 32 random hex digits).
fn ids(g: &Gen) -> (String, String) {
    let n = g.id.rsplit('-').next().unwrap_or(&g.id);
    (format!("resp_{n}"), format!("msg_{n}"))
}

/// `rs_N`: the reasoning item's id.
fn reasoning_id(g: &Gen) -> String {
    format!("rs_{}", g.id.rsplit('-').next().unwrap_or(&g.id))
}

/// A `reasoning` output item with one summary text.
fn reasoning_item(g: &Gen, text: Option<&str>) -> Value {
    let summary = match text {
        Some(t) => json!([{ "type": "summary_text", "text": t }]),
        None => json!([]),
    };
    json!({ "type": "reasoning", "id": reasoning_id(g), "summary": summary })
}

/// An `output_text` part with the log-probabilities of its tokens (when the
/// request asked for them).
fn output_text(text: &str, logprobs: &[Value]) -> Value {
    json!({ "type": "output_text", "text": text, "annotations": [], "logprobs": logprobs })
}

/// The assistant message item; `text: None` gives the empty item that opens a
/// stream.
fn message_item(id: &str, status: &str, text: Option<&str>, logprobs: &[Value]) -> Value {
    let content = match text {
        Some(t) => json!([output_text(t, logprobs)]),
        None => json!([]),
    };
    json!({ "type": "message", "id": id, "status": status, "role": "assistant", "content": content })
}

/// A `function_call` output item (`arguments` empty while it streams), with the
/// `namespace` of a function declared in one.
fn call_item(c: &CallOut, status: &str, arguments: &str, ns: &HashMap<String, String>) -> Value {
    let mut item = json!({ "type": "function_call", "id": call_item_id(c), "call_id": c.id,
                           "name": c.name, "arguments": arguments, "status": status });
    if let Some(ns) = ns.get(&c.name) {
        item["namespace"] = json!(ns);
    }
    item
}

/// The item id of a call: `fc_` and the hex of its call id (stable per call).
fn call_item_id(c: &CallOut) -> String {
    format!("fc_{}", c.id.trim_start_matches("call_"))
}

/// The output items of a finished turn: the message (output index 0, opened
/// before the first token), the reasoning when asked for, then the calls.
fn output_items(
    g: &Gen,
    summary: bool,
    item_status: &str,
    (turn, logprobs): (&Turn, &[Value]),
    ns: &HashMap<String, String>,
) -> Vec<Value> {
    let mut items = vec![message_item(
        &ids(g).1,
        item_status,
        Some(&turn.content),
        logprobs,
    )];
    if summary && !turn.reasoning.is_empty() {
        items.push(reasoning_item(g, Some(&turn.reasoning)));
    }
    items.extend(
        turn.calls
            .iter()
            .map(|c| call_item(c, "completed", &c.arguments, ns)),
    );
    items
}

/// Item status and response status of a finished generation.
fn statuses(finish: FinishReason) -> (&'static str, &'static str, Value) {
    match finish {
        FinishReason::Stop | FinishReason::ToolCalls => ("completed", "completed", Value::Null),
        FinishReason::Length | FinishReason::ContextFull | FinishReason::Cancelled => (
            "incomplete",
            "incomplete",
            json!({ "reason": "max_output_tokens" }),
        ),
    }
}

impl Responses {
    fn new(echo: Echo) -> Self {
        Responses {
            echo,
            ..Responses::default()
        }
    }

    /// The entries of the log-probabilities given since the last call, kept
    /// with the text's.
    fn take_logprobs(&mut self) -> Vec<Value> {
        let entries = crate::openai::logprob_entries(&std::mem::take(&mut self.logprobs));
        self.text_logprobs.extend(entries.iter().cloned());
        entries
    }

    /// Keeps a stored response's conversation: its messages and its answer
    /// (a failure is logged; the response itself is unaffected).
    fn remember(&self, g: &Gen, turn: &Turn, finish: FinishReason) {
        let Some((conversations, messages)) = &self.record else {
            return;
        };
        if finish == FinishReason::Cancelled {
            return;
        }
        let mut answer = Message::new(Role::Assistant, turn.content.clone());
        answer.reasoning = (!turn.reasoning.is_empty()).then(|| turn.reasoning.clone());
        answer.tool_calls = turn
            .calls
            .iter()
            .map(|c| ToolCall {
                id: c.id.clone(),
                name: c.name.clone(),
                arguments: c.arguments.clone(),
            })
            .collect();
        let mut all = messages.clone();
        all.push(answer);
        if let Err(e) = conversations.put(&ids(g).0, &all) {
            eprintln!("ds4 serve: response {} not stored: {e}", ids(g).0);
        }
    }

    /// A response object. `usage` is null until the end.
    fn object(
        &self,
        g: &Gen,
        status: &str,
        output: Vec<Value>,
        usage: Option<&Usage>,
        incomplete: Value,
        error: Value,
    ) -> Value {
        let e = &self.echo;
        json!({
            "id": ids(g).0,
            "object": "response",
            "created_at": g.created,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": e.instructions,
            "max_output_tokens": e.max_output_tokens,
            "model": g.model,
            "output": output,
            "parallel_tool_calls": e.parallel_tool_calls,
            "previous_response_id": self.previous,
            "reasoning": { "effort": e.reasoning_effort, "summary": e.reasoning_summary },
            "store": self.store,
            "temperature": short_float(e.temperature),
            "text": { "format": e.text_format },
            "tool_choice": e.tool_choice,
            "tools": e.tools,
            "top_logprobs": e.top_logprobs,
            "top_p": short_float(e.top_p),
            "truncation": "disabled",
            "usage": usage.map(usage_json),
            "user": e.user,
            "metadata": e.metadata,
        })
    }

    /// An event payload carrying its `type` and the next `sequence_number`.
    fn event(&mut self, ty: &'static str, mut v: Value) -> (&'static str, Value) {
        v["type"] = json!(ty);
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        (ty, v)
    }

    /// `response.created` … `response.content_part.added`: the message item is
    /// opened before the first token, so an empty answer still has one.
    fn start_events(&mut self, g: &Gen) -> Vec<(&'static str, Value)> {
        let msg_id = ids(g).1;
        let r = self.object(g, "in_progress", vec![], None, Value::Null, Value::Null);
        vec![
            self.event("response.created", json!({ "response": r })),
            self.event("response.in_progress", json!({ "response": r })),
            self.event(
                "response.output_item.added",
                json!({ "output_index": 0, "item": message_item(&msg_id, "in_progress", None, &[]) }),
            ),
            self.event(
                "response.content_part.added",
                json!({ "item_id": msg_id, "output_index": 0, "content_index": 0, "part": output_text("", &[]) }),
            ),
        ]
    }

    fn text_events(&mut self, g: &Gen, text: &str) -> Vec<(&'static str, Value)> {
        if text.is_empty() {
            return vec![];
        }
        self.streamed.push_str(text);
        let logprobs = self.take_logprobs();
        vec![self.event(
            "response.output_text.delta",
            json!({ "item_id": ids(g).1, "output_index": 0, "content_index": 0, "delta": text, "logprobs": logprobs }),
        )]
    }

    /// The events of the `index`-th call: its item, its arguments, done. Calls
    /// follow the message item (output index 0).
    fn call_events(&mut self, g: &Gen, index: usize, c: &CallOut) -> Vec<(&'static str, Value)> {
        let mut out = self.close_reasoning(g);
        let had_reasoning = self.reasoning.0.is_some();
        let output_index = index + 1 + usize::from(had_reasoning);
        let item_id = call_item_id(c);
        out.extend([
            self.event(
                "response.output_item.added",
                json!({ "output_index": output_index, "item": call_item(c, "in_progress", "", &self.echo.namespaces) }),
            ),
            self.event(
                "response.function_call_arguments.delta",
                json!({ "item_id": item_id, "output_index": output_index, "delta": c.arguments }),
            ),
            self.event(
                "response.function_call_arguments.done",
                json!({ "item_id": item_id, "output_index": output_index, "arguments": c.arguments }),
            ),
            self.event(
                "response.output_item.done",
                json!({ "output_index": output_index, "item": call_item(c, "completed", &c.arguments, &self.echo.namespaces) }),
            ),
        ]);
        out
    }

    /// The events of a reasoning piece (only with a summary opt-in): the item
    /// (output index 1) opens with the first one.
    fn reasoning_events(&mut self, g: &Gen, text: &str) -> Vec<(&'static str, Value)> {
        if self.echo.reasoning_summary.is_none() {
            return vec![];
        }
        let id = reasoning_id(g);
        let mut out = Vec::new();
        if self.reasoning.0.is_none() {
            self.reasoning.0 = Some(String::new());
            out.push(self.event(
                "response.output_item.added",
                json!({ "output_index": 1, "item": reasoning_item(g, None) }),
            ));
            out.push(self.event(
                "response.reasoning_summary_part.added",
                json!({ "item_id": id, "output_index": 1, "summary_index": 0,
                        "part": { "type": "summary_text", "text": "" } }),
            ));
        }
        if let Some(all) = &mut self.reasoning.0 {
            all.push_str(text);
        }
        out.push(self.event(
            "response.reasoning_summary_text.delta",
            json!({ "item_id": id, "output_index": 1, "summary_index": 0, "delta": text }),
        ));
        out
    }

    /// Closes the reasoning item if one is open (when the answer or a call starts).
    fn close_reasoning(&mut self, g: &Gen) -> Vec<(&'static str, Value)> {
        let text = match &self.reasoning {
            (Some(t), false) => t.clone(),
            _ => return vec![],
        };
        self.reasoning.1 = true;
        let id = reasoning_id(g);
        vec![
            self.event(
                "response.reasoning_summary_text.done",
                json!({ "item_id": id, "output_index": 1, "summary_index": 0, "text": text }),
            ),
            self.event(
                "response.reasoning_summary_part.done",
                json!({ "item_id": id, "output_index": 1, "summary_index": 0,
                        "part": { "type": "summary_text", "text": text } }),
            ),
            self.event(
                "response.output_item.done",
                json!({ "output_index": 1, "item": reasoning_item(g, Some(&text)) }),
            ),
        ]
    }

    /// The closing events of the message item, then `response.completed`, or
    /// `response.incomplete` when the output limit cut the answer.
    fn end_events(
        &mut self,
        g: &Gen,
        turn: &Turn,
        finish: FinishReason,
        u: &Usage,
    ) -> Vec<(&'static str, Value)> {
        let msg_id = ids(g).1;
        let text = turn.content.as_str();
        let (item_status, status, incomplete) = statuses(finish);
        self.take_logprobs();
        let logprobs = self.text_logprobs.clone();
        let item = message_item(&msg_id, item_status, Some(text), &logprobs);
        let terminal = match finish {
            FinishReason::Stop | FinishReason::ToolCalls => "response.completed",
            FinishReason::Length | FinishReason::ContextFull | FinishReason::Cancelled => {
                "response.incomplete"
            }
        };
        let r = self.object(
            g,
            status,
            output_items(
                g,
                self.echo.reasoning_summary.is_some(),
                item_status,
                (turn, &logprobs),
                &self.echo.namespaces,
            ),
            Some(u),
            incomplete,
            Value::Null,
        );
        let mut out = self.close_reasoning(g);
        out.extend([
            self.event(
                "response.output_text.done",
                json!({ "item_id": msg_id, "output_index": 0, "content_index": 0, "text": text, "logprobs": logprobs }),
            ),
            self.event(
                "response.content_part.done",
                json!({ "item_id": msg_id, "output_index": 0, "content_index": 0, "part": output_text(text, &logprobs) }),
            ),
            self.event(
                "response.output_item.done",
                json!({ "output_index": 0, "item": item }),
            ),
            self.event(terminal, json!({ "response": r })),
        ]);
        out
    }

    /// `error`, then `response.failed` with the text streamed so far: how
    /// OpenAI ends a stream that fails after it started.
    fn error_events(&mut self, g: &Gen, message: &str) -> Vec<(&'static str, Value)> {
        let text = self.streamed.clone();
        let item = message_item(&ids(g).1, "incomplete", Some(&text), &self.text_logprobs);
        let error = json!({ "code": "server_error", "message": message });
        let r = self.object(g, "failed", vec![item], None, Value::Null, error);
        vec![
            self.event(
                "error",
                json!({ "code": "server_error", "message": message, "param": null }),
            ),
            self.event("response.failed", json!({ "response": r })),
        ]
    }
}

/// `event: NAME` + `data: JSON`, as the SDKs read them.
fn sse(events: Vec<(&'static str, Value)>) -> Vec<SseEvent> {
    events.iter().map(|(name, v)| named(name, v)).collect()
}

impl Dialect for Responses {
    fn id_prefix(&self) -> &'static str {
        "resp"
    }

    fn error(&self, status: StatusCode, message: &str, kind: ErrorKind) -> Response {
        error_response(status, message, kind)
    }

    fn bad_request(&self, e: BadRequest) -> Response {
        bad_request_response(e)
    }

    fn logprobs(&mut self, l: Vec<Logprobs>) {
        self.logprobs.extend(l);
    }

    fn complete(&mut self, g: &Gen, turn: &Turn, finish: FinishReason, u: &Usage) -> Value {
        self.remember(g, turn, finish);
        let (item_status, status, incomplete) = statuses(finish);
        self.take_logprobs();
        let items = output_items(
            g,
            self.echo.reasoning_summary.is_some(),
            item_status,
            (turn, &self.text_logprobs),
            &self.echo.namespaces,
        );
        self.object(g, status, items, Some(u), incomplete, Value::Null)
    }

    fn stream_start(&mut self, g: &Gen, _started: &Usage) -> Vec<SseEvent> {
        sse(self.start_events(g))
    }

    /// Reasoning is streamed only on a summary opt-in (`reasoning.summary`).
    fn stream_piece(&mut self, g: &Gen, piece: &Piece) -> Vec<SseEvent> {
        match piece {
            Piece::Reasoning(t) => sse(self.reasoning_events(g, t)),
            Piece::Text(t) => {
                let mut events = self.close_reasoning(g);
                events.extend(self.text_events(g, t));
                sse(events)
            }
            Piece::Call(i, c) => sse(self.call_events(g, *i, c)),
        }
    }

    fn stream_end(
        &mut self,
        g: &Gen,
        turn: &Turn,
        finish: FinishReason,
        u: &Usage,
        _include_usage: bool,
    ) -> Vec<SseEvent> {
        self.remember(g, turn, finish);
        sse(self.end_events(g, turn, finish, u))
    }

    fn stream_error(&mut self, g: &Gen, message: &str) -> Vec<SseEvent> {
        sse(self.error_events(g, message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_runtime::CacheSource;

    fn messages(p: &Request) -> &[Message] {
        match &p.input {
            Input::Messages(m) => m,
            Input::Raw(_) | Input::Tokens(_) => panic!("raw input"),
        }
    }

    #[test]
    fn logprobs_are_asked_by_include_or_top_logprobs() {
        let lp = |b: &str| parse(b.as_bytes()).unwrap().0.logprobs;
        assert_eq!(lp(r#"{"input":"x"}"#), None);
        assert_eq!(
            lp(r#"{"input":"x","include":["reasoning.encrypted_content"]}"#),
            None
        );
        assert_eq!(
            lp(r#"{"input":"x","include":["message.output_text.logprobs"]}"#),
            Some(0)
        );
        assert_eq!(
            lp(r#"{"input":"x","include":["message.output_text.logprobs"],"top_logprobs":3}"#),
            Some(3)
        );
        assert_eq!(lp(r#"{"input":"x","top_logprobs":2}"#), Some(2));
        assert_eq!(lp(r#"{"input":"x","top_logprobs":0}"#), None);
    }

    #[test]
    fn input_forms_and_instructions_become_messages() {
        let (p, d) = parse(br#"{"model":"m","input":"hi","instructions":"be brief","max_output_tokens":9,
            "temperature":0,"top_p":0.5,"stream":true,"store":true,"metadata":{"k":"v"},"user":"u",
            "parallel_tool_calls":false,"truncation":"auto","tools":[],"tool_choice":"auto",
            "reasoning":{"effort":"minimal","summary":"auto"},"text":{"format":{"type":"text"},"verbosity":"low"},
            "include":["reasoning.encrypted_content"],"prompt_cache_key":"x"}"#)
        .unwrap();
        assert_eq!(
            messages(&p),
            [
                Message::new(Role::System, "be brief"),
                Message::new(Role::User, "hi")
            ]
        );
        assert_eq!(
            (p.model.as_deref(), p.max_tokens, p.stream),
            (Some("m"), Some(9), true)
        );
        assert_eq!((p.sampling.temperature, p.sampling.top_p), (0.0, 0.5));
        assert_eq!(d.echo.metadata, json!({"k":"v"}));
        assert!(!d.echo.parallel_tool_calls);

        let (p, _) = parse(
            br#"{"input":[
            {"role":"developer","content":"sys"},
            {"type":"message","role":"user","content":[{"type":"input_text","text":"a"},{"type":"text","text":"b"}]},
            {"type":"message","role":"assistant","id":"msg_1","status":"completed",
             "content":[{"type":"output_text","text":"c","annotations":[]}]},
            {"content":"d"}],"reasoning":null,"instructions":""}"#,
        )
        .unwrap();
        assert_eq!(
            messages(&p),
            [
                Message::new(Role::System, "sys"),
                Message::new(Role::User, "ab"),
                Message::new(Role::Assistant, "c"),
                Message::new(Role::User, "d"),
            ]
        );
        assert_eq!((p.max_tokens, p.stream, p.stop.len()), (None, false, 0));
        assert_eq!(
            p.sampling.temperature,
            crate::dialect::default_sampling().temperature
        );
    }

    #[test]
    fn an_output_that_answers_no_call_is_a_tool_result_without_an_id() {
        // Codex 0.171.0 after a `create_goal` call: the call's output, then
        // an output of its own with `name` and `namespace` and no `call_id`.
        let (p, _) = parse(
            br#"{"input":[{"role":"user","content":"go"},
            {"type":"function_call","call_id":"call_1","name":"create_goal","arguments":"{}"},
            {"type":"function_call_output","call_id":"call_1","output":"{\"goal\":1}"},
            {"type":"function_call_output","id":"fco_2","name":"goal_objective","namespace":"agent","output":"ship it"}]}"#,
        )
        .unwrap();
        let m = messages(&p);
        assert_eq!(m.len(), 4);
        assert_eq!(m[2].tool_call_id.as_deref(), Some("call_1"));
        assert_eq!(
            (m[3].role, m[3].tool_call_id.as_deref()),
            (Role::Tool, None)
        );
        assert_eq!(m[3].content, "ship it");
    }

    #[test]
    fn function_calls_join_their_assistant_turn_and_outputs_are_tool_messages() {
        let (p, _) = parse(
            br#"{"input":[{"role":"user","content":"ls"},
            {"type":"reasoning","id":"rs_1","summary":[]},
            {"type":"message","role":"assistant","content":[{"type":"output_text","text":"ok"}]},
            {"type":"function_call","call_id":"call_1","name":"ls","arguments":"{\"d\":1}"},
            {"type":"function_call","call_id":"call_2","name":"ls","arguments":"{}"},
            {"type":"function_call_output","call_id":"call_1","output":"a"},
            {"type":"function_call_output","call_id":"call_2","output":[{"type":"input_text","text":"b"}]}],
            "tools":[{"type":"function","name":"ls","parameters":{"type":"object"}},{"type":"web_search"}],
            "tool_choice":{"type":"function","name":"ls"},"reasoning":{"effort":"none"},
            "prompt_cache_key":"k"}"#,
        )
        .unwrap();
        let m = messages(&p);
        assert_eq!(m.len(), 4);
        assert_eq!(m[1].content, "ok");
        assert_eq!(
            m[1].tool_calls
                .iter()
                .map(|c| c.id.as_str())
                .collect::<Vec<_>>(),
            ["call_1", "call_2"]
        );
        assert_eq!(
            (m[2].role, m[2].tool_call_id.as_deref()),
            (Role::Tool, Some("call_1"))
        );
        assert_eq!(m[3].content, "b");
        assert_eq!(p.agent.tools.len(), 1);
        assert_eq!(
            p.agent.tool_choice,
            ds4_chat::ToolChoice::Named("ls".into())
        );
        assert_eq!(p.agent.think, ds4_chat::ThinkMode::None);
        assert_eq!(p.agent.affinity, ["key:k"]);
    }

    #[test]
    fn what_we_cannot_do_is_refused_with_the_parameter_at_fault() {
        let bad = |b: &str| parse(b.as_bytes()).unwrap_err();
        let msg = |b: &str| bad(b).message;

        assert!(msg("{").starts_with("invalid JSON request"));
        assert!(msg(r#"{"input":"x","max_output_tokens":"9"}"#).contains("invalid type"));
        assert!(msg(r#"{"input":"x","temperature":"hot"}"#).contains("invalid type"));
        assert!(msg(r#"{"input":"x","tools":{}}"#).contains("tools must be an array"));
        assert!(msg(r#"{"input":"x","reasoning":"high"}"#).contains("invalid type"));
        assert!(msg(r#"{"input":"x","max_output_tokens":-1}"#).contains("invalid value"));

        let cases: &[(&str, &str, &str)] = &[
            (r#"{}"#, "input", "missing `input`"),
            (r#"{"input":[]}"#, "input", "`input` is empty"),
            (r#"{"input":5}"#, "input", "a string or an array"),
            (r#"{"input":["x"]}"#, "input", "input[0] must be an object"),
            (
                r#"{"input":[{"role":"user","content":[{"type":"input_image","image_url":"u"}]}]}"#,
                "input",
                "input[0].content[0]: input_image parts are not supported",
            ),
            (
                r#"{"input":[{"role":"user","content":[{"type":"input_file","file_id":"f"}]}]}"#,
                "input",
                "input_file parts",
            ),
            (
                r#"{"input":[{"role":"user","content":[{"type":"input_text"}]}]}"#,
                "input",
                "needs a string `text`",
            ),
            (
                r#"{"input":[{"role":"user","content":7}]}"#,
                "input",
                "content must be a string or an array",
            ),
            (
                r#"{"input":[{"role":"tool","content":"x"}]}"#,
                "input",
                "unknown role \"tool\"",
            ),
            (
                r#"{"input":[{"type":"function_call","name":"f","arguments":"{}"}]}"#,
                "input",
                "input[0].call_id must be a string",
            ),
            (
                r#"{"input":[{"type":"function_call_output","call_id":7,"output":"x"}]}"#,
                "input",
                "input[0].call_id must be a string",
            ),
            (
                r#"{"input":[{"type":"function_call_output","call_id":"c","output":7}]}"#,
                "input",
                "content must be a string or an array",
            ),
            (
                r#"{"input":[{"type":"web_search_call","id":"w"}]}"#,
                "input",
                "input[0]: web_search_call items are not supported",
            ),
            (
                r#"{"input":[{"type":"item_reference","id":"msg_1"}]}"#,
                "input",
                "replay the full input",
            ),
            (
                r#"{"input":"x","conversation":"conv_1"}"#,
                "conversation",
                "replay the full input",
            ),
            (
                r#"{"input":"x","background":true}"#,
                "background",
                "background",
            ),
            (
                r#"{"input":"x","tools":[{"type":"function","parameters":{}}]}"#,
                "tools",
                "tools[0]: a non-empty string `name` is required",
            ),
            (
                r#"{"input":"x","tool_choice":"required"}"#,
                "tool_choice",
                "no tools were given",
            ),
            (
                r#"{"input":"x","tools":[{"type":"function","name":"f"}],"tool_choice":{"type":"function","name":"g"}}"#,
                "tool_choice",
                "unknown tool \"g\"",
            ),
            (
                r#"{"input":"x","tool_choice":"sometimes"}"#,
                "tool_choice",
                "tool_choice must be",
            ),
            (
                r#"{"input":"x","reasoning":{"effort":"enormous"}}"#,
                "reasoning",
                "unknown reasoning effort",
            ),
            (
                r#"{"input":"x","text":{"format":{"type":"xml"}}}"#,
                "text.format",
                "type \"xml\" is not supported",
            ),
            (
                r#"{"input":"x","text":{"format":{"type":"json_schema","name":"n","schema":5}}}"#,
                "text.format",
                "the schema must be a JSON object",
            ),
            (
                r#"{"input":"x","top_logprobs":21}"#,
                "top_logprobs",
                "top_logprobs must be an integer from 0 to 20",
            ),
            (
                r#"{"input":"x","include":"message.output_text.logprobs"}"#,
                "include",
                "include must be an array of strings",
            ),
            (
                r#"{"input":"x","temperature":3}"#,
                "temperature",
                "between 0 and 2",
            ),
            (r#"{"input":"x","top_p":0}"#, "top_p", "top_p"),
            (
                r#"{"input":"x","max_output_tokens":0}"#,
                "max_output_tokens",
                "at least 1",
            ),
        ];
        for (body, param, text) in cases {
            let e = bad(body);
            assert_eq!(e.param, Some(*param), "{body}: {e:?}");
            assert!(
                e.message.contains(text),
                "{body}: {:?} lacks {text:?}",
                e.message
            );
        }
    }

    fn gen() -> Gen {
        Gen {
            id: "resp-7".into(),
            created: 100,
            model: "m".into(),
        }
    }

    fn usage() -> Usage {
        Usage {
            prompt_tokens: 10,
            cached_tokens: 4,
            checkpointed_tokens: 0,
            completion_tokens: 3,
            cache_source: CacheSource::MemoryToken,
            cut_tokens: 0,
            miss: None,
            slot: 0,
            queue_s: 0.0,
        }
    }

    #[test]
    fn response_objects_have_openai_shapes() {
        let (_, mut d) = parse(br#"{"input":"x","max_output_tokens":3,"temperature":0}"#).unwrap();
        let v = d.complete(&gen(), &Turn::text("Paris"), FinishReason::Stop, &usage());
        assert_eq!(
            (
                &v["id"],
                &v["object"],
                &v["created_at"],
                &v["status"],
                &v["model"]
            ),
            (
                &json!("resp_7"),
                &json!("response"),
                &json!(100),
                &json!("completed"),
                &json!("m")
            )
        );
        assert!(v["incomplete_details"].is_null() && v["error"].is_null());
        assert_eq!(
            v["output"],
            json!([{"type":"message","id":"msg_7","status":"completed","role":"assistant",
                    "content":[{"type":"output_text","text":"Paris","annotations":[],"logprobs":[]}]}])
        );
        assert_eq!(
            v["usage"],
            json!({"input_tokens":10,"input_tokens_details":{"cached_tokens":4},"output_tokens":3,
                   "output_tokens_details":{"reasoning_tokens":0},"total_tokens":13})
        );
        assert_eq!(
            (&v["max_output_tokens"], &v["temperature"]),
            (&json!(3), &json!(0.0))
        );
        // Stored unless `store: false`, as OpenAI's default.
        assert_eq!((&v["tools"], &v["store"]), (&json!([]), &json!(true)));
        let (_, mut unstored) = parse(br#"{"input":"x","store":false}"#).unwrap();
        let v = unstored.complete(&gen(), &Turn::text("Paris"), FinishReason::Stop, &usage());
        assert_eq!(v["store"], false);
        assert_eq!(v["top_p"], json!(0.9));

        let v = d.complete(&gen(), &Turn::text("Pa"), FinishReason::Length, &usage());
        assert_eq!(v["status"], "incomplete");
        assert_eq!(
            v["incomplete_details"],
            json!({"reason":"max_output_tokens"})
        );
        assert_eq!(v["output"][0]["status"], "incomplete");
    }

    #[test]
    fn reasoning_is_an_item_only_on_a_summary_opt_in_and_calls_follow_it() {
        let call = CallOut {
            id: "call_ab".into(),
            name: "ls".into(),
            arguments: "{}".into(),
        };
        let turn = Turn {
            reasoning: "hm ok".into(),
            content: "Hi".into(),
            calls: vec![call.clone()],
            ..Turn::default()
        };
        let g = gen();
        let (_, mut plain) = parse(br#"{"input":"x","reasoning":{"effort":"high"}}"#).unwrap();
        assert!(plain.reasoning_events(&g, "hm").is_empty());
        let v = plain.complete(&g, &turn, FinishReason::ToolCalls, &usage());
        assert_eq!(v["output"].as_array().unwrap().len(), 2, "{v}");

        let (_, mut d) =
            parse(br#"{"input":"x","reasoning":{"effort":"high","summary":"auto"}}"#).unwrap();
        let mut evs = d.reasoning_events(&g, "hm");
        evs.extend(d.reasoning_events(&g, " ok"));
        evs.extend(d.call_events(&g, 0, &call));
        evs.extend(d.end_events(&g, &turn, FinishReason::ToolCalls, &usage()));
        let at = |name: &str| {
            evs.iter()
                .filter(|(n, _)| *n == name)
                .map(|(_, v)| v["output_index"].clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            at("response.reasoning_summary_text.delta"),
            [json!(1), json!(1)]
        );
        assert_eq!(
            at("response.reasoning_summary_text.done").len(),
            1,
            "closed once"
        );
        assert_eq!(at("response.output_item.added"), [json!(1), json!(2)]);
        let done = evs
            .iter()
            .find(|(n, _)| *n == "response.reasoning_summary_text.done")
            .unwrap();
        assert_eq!(done.1["text"], "hm ok");
        let v = d.complete(&g, &turn, FinishReason::ToolCalls, &usage());
        let types: Vec<_> = v["output"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["type"].clone())
            .collect();
        assert_eq!(
            types,
            [json!("message"), json!("reasoning"), json!("function_call")]
        );
        assert_eq!(v["output"][1]["summary"][0]["text"], "hm ok");
        assert!(parse(br#"{"input":"x","reasoning":{"summary":"long"}}"#).is_err());
    }

    #[test]
    fn stream_events_come_in_sdk_order_and_number_themselves() {
        let (_, mut d) = parse(br#"{"input":"x","stream":true}"#).unwrap();
        let g = gen();
        let mut evs = d.start_events(&g);
        evs.extend(d.text_events(&g, "Pa"));
        evs.extend(d.text_events(&g, ""));
        evs.extend(d.text_events(&g, "ris"));
        evs.extend(d.end_events(&g, &Turn::text("Paris"), FinishReason::Stop, &usage()));
        let names: Vec<_> = evs.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (i, (n, v)) in evs.iter().enumerate() {
            assert_eq!((&v["type"], &v["sequence_number"]), (&json!(n), &json!(i)));
        }
        assert_eq!(evs[0].1["response"]["status"], "in_progress");
        assert!(evs[0].1["response"]["usage"].is_null());
        assert_eq!(evs[2].1["item"]["content"], json!([]));
        assert_eq!(
            (&evs[5].1["item_id"], &evs[5].1["delta"]),
            (&json!("msg_7"), &json!("ris"))
        );
        assert_eq!(evs[6].1["text"], "Paris");
        assert_eq!(evs[8].1["item"]["status"], "completed");
        assert_eq!(
            evs[9].1["response"],
            d.complete(&g, &Turn::text("Paris"), FinishReason::Stop, &usage())
        );

        let (_, mut d) = parse(br#"{"input":"x"}"#).unwrap();
        let end = d.end_events(&g, &Turn::text("Pa"), FinishReason::Length, &usage());
        assert_eq!(end[3].0, "response.incomplete");
        assert_eq!(
            end[3].1["response"]["incomplete_details"]["reason"],
            "max_output_tokens"
        );

        let (_, mut d) = parse(br#"{"input":"x"}"#).unwrap();
        d.start_events(&g);
        d.text_events(&g, "Pa");
        let err = d.error_events(&g, "engine error: boom");
        assert_eq!((err[0].0, err[1].0), ("error", "response.failed"));
        assert_eq!(
            (
                &err[0].1["code"],
                &err[0].1["message"],
                &err[0].1["sequence_number"]
            ),
            (
                &json!("server_error"),
                &json!("engine error: boom"),
                &json!(5)
            )
        );
        let r = &err[1].1["response"];
        assert_eq!(
            (&r["status"], &r["error"]["code"]),
            (&json!("failed"), &json!("server_error"))
        );
        assert_eq!(r["output"][0]["content"][0]["text"], "Pa");
    }

    /// Codex 0.171's first request: its `namespace` tool's functions join the
    /// flat list, the echo shows the nine tools it sent, and a call to a
    /// namespaced function names its namespace.
    #[test]
    fn codex_namespace_tools_are_flattened_and_echoed() {
        let body = std::fs::read(ds4_testdata::vectors_dir(
            "clients/codex-0.171.0-responses.json",
        ))
        .unwrap();
        let (p, mut d) = parse(&body).unwrap();
        let names: Vec<&str> = p.agent.tools.iter().map(|t| t.name.as_str()).collect();
        for want in ["exec_command", "close_agent", "spawn_agent", "update_goal"] {
            assert!(names.contains(&want), "{want} not in {names:?}");
        }
        assert!(!names.contains(&"multi_agent_v1"), "{names:?}");
        assert_eq!(d.echo.tools.as_array().map(Vec::len), Some(9));
        assert_eq!(
            d.echo.namespaces.get("close_agent").map(String::as_str),
            Some("multi_agent_v1")
        );
        let call = |name: &str| CallOut {
            id: "call_1".into(),
            name: name.into(),
            arguments: "{}".into(),
        };
        let g = gen();
        let v = d.complete(
            &g,
            &Turn {
                calls: vec![call("close_agent"), call("exec_command")],
                ..Turn::default()
            },
            FinishReason::ToolCalls,
            &usage(),
        );
        assert_eq!(v["output"][1]["namespace"], "multi_agent_v1");
        assert_eq!(v["output"][2].get("namespace"), None);
        assert_eq!(v["tools"].as_array().map(Vec::len), Some(9));
    }

    /// `previous_response_id` puts the stored conversation after the new
    /// instructions and before the new input; the response then stores the
    /// whole of it with its answer; an unknown id is refused as such.
    #[test]
    fn a_previous_response_is_spliced_between_the_instructions_and_the_input() {
        let conv = Arc::new(Conversations::open(None).unwrap());
        let (mut p, mut d) = parse(br#"{"input":"first","instructions":"Be brief."}"#).unwrap();
        assert!(attach(&conv, &mut p, &mut d).is_ok());
        d.complete(&gen(), &Turn::text("one"), FinishReason::Stop, &usage());
        let stored = conv.get("resp_7").unwrap().unwrap();
        assert_eq!(
            stored,
            [
                Message::new(Role::User, "first"),
                Message::new(Role::Assistant, "one")
            ]
        );

        let (mut p, mut d) = parse(
            br#"{"input":"second","instructions":"Be kind.","previous_response_id":"resp_7"}"#,
        )
        .unwrap();
        assert!(attach(&conv, &mut p, &mut d).is_ok());
        let roles: Vec<(Role, &str)> = messages(&p)
            .iter()
            .map(|m| (m.role, m.content.as_str()))
            .collect();
        assert_eq!(
            roles,
            [
                (Role::System, "Be kind."),
                (Role::User, "first"),
                (Role::Assistant, "one"),
                (Role::User, "second"),
            ]
        );
        let v = d.complete(&gen(), &Turn::text("two"), FinishReason::Stop, &usage());
        assert_eq!(v["previous_response_id"], "resp_7");
        assert_eq!(
            conv.get("resp_7").unwrap().unwrap().len(),
            4,
            "replaced by the continuation"
        );

        let (mut p, mut d) = parse(br#"{"input":"x","previous_response_id":"resp_404"}"#).unwrap();
        assert!(matches!(
            attach(&conv, &mut p, &mut d),
            Err(Refusal::UnknownPrevious(id)) if id == "resp_404"
        ));
    }
}
