//! The OpenAI dialects: `/v1/chat/completions` and the legacy `/v1/completions`.
//! Requests are parsed into a [`Request`]; responses and SSE chunks are built in
//! OpenAI's shapes, usage included.

mod choices;

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
    data, think_control, think_mode, AgentOptions, BadRequest, Dialect, ErrorKind, Gen, Input,
    Request, SamplingFields,
};
use crate::relay::run;
use crate::state::{cpu, AppState};
use ds4_chat::turn::{CallOut, Piece, Turn};
use ds4_runtime::{FinishReason, Logprobs, TokenLogprob, Usage};

#[derive(Deserialize)]
struct Common {
    model: Option<String>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    #[serde(flatten)]
    sampling: SamplingFields,
    stop: Option<Value>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    logit_bias: Option<Value>,
    logprobs: Option<Value>,
    top_logprobs: Option<Value>,
    audio: Option<Value>,
    modalities: Option<Value>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    functions: Option<Value>,
    response_format: Option<Value>,
    thinking: Option<Value>,
    think: Option<Value>,
    reasoning_effort: Option<String>,
    prompt_cache_key: Option<String>,
    parallel_tool_calls: Option<bool>,
}

#[derive(Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
struct ChatBody {
    #[serde(flatten)]
    common: Common,
    messages: Option<Vec<ChatMessage>>,
}

#[derive(Deserialize)]
struct ChatMessage {
    role: Option<String>,
    content: Option<Value>,
    tool_calls: Option<Vec<WireCall>>,
    tool_call_id: Option<String>,
    name: Option<String>,
    reasoning_content: Option<String>,
}

#[derive(Deserialize)]
struct WireCall {
    id: Option<String>,
    function: WireFunction,
}

#[derive(Deserialize)]
struct WireFunction {
    name: String,
    /// A JSON string, as OpenAI sends it (an object is accepted too).
    arguments: Option<Value>,
}

#[derive(Deserialize)]
struct CompletionBody {
    #[serde(flatten)]
    common: Common,
    prompt: Option<Value>,
    echo: Option<bool>,
    suffix: Option<Value>,
    best_of: Option<Value>,
}

pub(crate) fn parse_json<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, BadRequest> {
    serde_json::from_slice(body)
        .map_err(|e| BadRequest::new(format!("invalid JSON request: {e}"), None))
}

/// OpenAI's `logit_bias`, an object from token ids (decimal strings) to a
/// bias from -100 to 100, or llama.cpp's list of `[id, bias]` pairs; `false`
/// as a bias bans the token (llama.cpp's reading). Whether each id is in the
/// vocabulary is checked when the prompt is prepared.
fn logit_bias(v: Option<&Value>) -> Result<Vec<(u32, f32)>, BadRequest> {
    let bad = |m: String| BadRequest::new(format!("logit_bias: {m}"), Some("logit_bias"));
    let id_of = |v: &Value| -> Result<u32, BadRequest> {
        let id = match v {
            Value::String(s) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => {
                s.parse().ok()
            }
            Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
            _ => None,
        };
        id.ok_or_else(|| bad(format!("{v} is not a token id")))
    };
    let bias_of = |id: u32, v: &Value| -> Result<f32, BadRequest> {
        match v {
            Value::Bool(false) => Ok(f32::NEG_INFINITY),
            Value::Number(n) => match n.as_f64() {
                Some(b) if (-100.0..=100.0).contains(&b) => Ok(b as f32),
                _ => Err(bad(format!(
                    "the bias of token {id} is {n}, outside -100..100"
                ))),
            },
            _ => Err(bad(format!(
                "the bias of token {id} must be a number from -100 to 100 (or false to ban it)"
            ))),
        }
    };
    let entries: Vec<(u32, &Value)> = match v {
        None | Some(Value::Null) => return Ok(vec![]),
        Some(Value::Object(o)) => o
            .iter()
            .map(|(k, b)| Ok((id_of(&Value::String(k.clone()))?, b)))
            .collect::<Result<_, BadRequest>>()?,
        Some(Value::Array(a)) => a
            .iter()
            .map(|pair| match pair.as_array().map(Vec::as_slice) {
                Some([id, b]) => Ok((id_of(id)?, b)),
                _ => Err(bad(format!("{pair} is not an [id, bias] pair"))),
            })
            .collect::<Result<_, BadRequest>>()?,
        Some(_) => {
            return Err(bad(
                "must be an object from token ids to biases (or a list of [id, bias] pairs)".into(),
            ))
        }
    };
    let mut out: Vec<(u32, f32)> = Vec::with_capacity(entries.len());
    for (id, b) in entries {
        if out.iter().any(|&(seen, _)| seen == id) {
            return Err(bad(format!("token {id} is given twice")));
        }
        out.push((id, bias_of(id, b)?));
    }
    Ok(out)
}

/// Most alternatives a token's log-probability comes with (OpenAI's limit).
const MAX_TOP_LOGPROBS: u64 = 20;

/// The alternatives per token the request asks log-probabilities with: chat
/// takes `logprobs: true` and `top_logprobs` (0-20, only with `logprobs`),
/// completions `logprobs: N` (0-20, OpenAI's limit being 5).
fn logprobs(kind: Kind, c: &Common) -> Result<Option<usize>, BadRequest> {
    let count = |v: &Value, name: &'static str| match v.as_u64() {
        Some(n) if n <= MAX_TOP_LOGPROBS => Ok(n as usize),
        _ => Err(BadRequest::new(
            format!("{name} must be an integer from 0 to {MAX_TOP_LOGPROBS}"),
            Some(name),
        )),
    };
    let top = c.top_logprobs.as_ref().filter(|v| !v.is_null());
    match (kind, c.logprobs.as_ref().filter(|v| !v.is_null())) {
        (Kind::Chat, Some(Value::Bool(true))) => Ok(Some(match top {
            Some(t) => count(t, "top_logprobs")?,
            None => 0,
        })),
        (Kind::Chat, None | Some(Value::Bool(false))) => match top {
            Some(_) => Err(BadRequest::new(
                "top_logprobs needs logprobs set to true",
                Some("top_logprobs"),
            )),
            None => Ok(None),
        },
        (Kind::Chat, Some(_)) => Err(BadRequest::new(
            "logprobs must be true or false",
            Some("logprobs"),
        )),
        (Kind::Completion, Some(v)) => count(v, "logprobs").map(Some),
        (Kind::Completion, None) => Ok(None),
    }
}

/// Most choices one request asks for (`n`, per prompt).
const MAX_N: usize = 16;
/// Most choices one request gets in all (a completion's prompts times `n`).
const MAX_CHOICES: usize = 128;

fn common(c: Common, kind: Kind) -> Result<Request, BadRequest> {
    let mut sampling = c.sampling.config(2.0)?;
    let n = c.sampling.choices(MAX_N)?;
    sampling.logit_bias = logit_bias(c.logit_bias.as_ref())?;
    let logprobs = logprobs(kind, &c)?;
    if c.audio.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(BadRequest::new(
            "audio output is not supported",
            Some("audio"),
        ));
    }
    if let Some(m) = &c.modalities {
        if m.as_array()
            .is_some_and(|a| a.iter().any(|x| x.as_str() != Some("text")))
        {
            return Err(BadRequest::new(
                "only text output is supported",
                Some("modalities"),
            ));
        }
    }
    if c.functions.as_ref().is_some_and(|t| !t.is_null()) {
        return Err(BadRequest::new(
            "the legacy `functions` parameter is not supported; send `tools`",
            Some("functions"),
        ));
    }
    let stop = match c.stop {
        None | Some(Value::Null) => vec![],
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(a)) => a
            .into_iter()
            .map(|v| match v {
                Value::String(s) => Ok(s),
                _ => Err(BadRequest::new(
                    "stop must be a string or an array of strings",
                    Some("stop"),
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(BadRequest::new(
                "stop must be a string or an array of strings",
                Some("stop"),
            ))
        }
    };
    let max_tokens = c.max_completion_tokens.or(c.max_tokens).map(|n| n as usize);
    let tools = crate::tooling::parse_tools(c.tools.as_ref())
        .map_err(|m| BadRequest::new(m, Some("tools")))?;
    let control = match (&c.thinking, &c.think) {
        (Some(t), _) => think_control(t, "thinking")?,
        (None, Some(t)) => think_control(t, "think")?,
        (None, None) => ThinkControl::Absent,
    };
    let agent = AgentOptions {
        tools,
        tool_choice: tool_choice(c.tool_choice.as_ref())?,
        think: think_mode(
            control,
            c.reasoning_effort.as_deref(),
            c.model.as_deref(),
            "reasoning_effort",
        )?,
        cache_breakpoints: vec![],
        affinity: c
            .prompt_cache_key
            .map(|k| format!("key:{k}"))
            .into_iter()
            .collect(),
        json_schema: crate::dialect::json_format(c.response_format.as_ref(), "response_format")?,
        single_call: c.parallel_tool_calls == Some(false),
    };
    agent.validate()?;
    Ok(Request {
        model: c.model,
        input: Input::Raw(String::new()),
        sampling,
        max_tokens,
        stop,
        stream: c.stream.unwrap_or(false),
        include_usage: c
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        logprobs,
        echo: false,
        n,
        batch: vec![],
        agent,
    })
}

/// OpenAI `tool_choice`: "auto" | "none" | "required" | `{"type": "function",
/// "function": {"name": ...}}` (Responses puts `name` at the top level).
pub fn tool_choice(v: Option<&Value>) -> Result<ToolChoice, BadRequest> {
    let bad = || {
        BadRequest::new(
            "tool_choice must be \"auto\", \"none\", \"required\" or {\"type\":\"function\",\"function\":{\"name\":...}}",
            Some("tool_choice"),
        )
    };
    Ok(match v {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            _ => return Err(bad()),
        },
        Some(o) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .or_else(|| o.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(bad)?;
            ToolChoice::Named(name.to_string())
        }
    })
}

/// Arguments as JSON text: OpenAI sends a string; an object is serialised.
fn arguments_text(v: Option<Value>) -> String {
    match v {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s,
        Some(other) => other.to_string(),
    }
}

/// Text of a message `content`: a string, null, or an array of text parts.
fn content_text(v: Option<Value>, i: usize) -> Result<String, BadRequest> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
                    Some("text") | None => match p.get("text").and_then(Value::as_str) {
                        Some(t) => out.push_str(t),
                        None => {
                            return Err(BadRequest::new(
                                format!("messages[{i}].content: a text part needs a string `text`"),
                                Some("messages"),
                            ))
                        }
                    },
                    Some(other) => {
                        return Err(BadRequest::new(
                            format!(
                            "messages[{i}].content: {other} parts are not supported (text only)"
                        ),
                            Some("messages"),
                        ))
                    }
                }
            }
            Ok(out)
        }
        Some(_) => Err(BadRequest::new(
            format!("messages[{i}].content must be a string or an array of content parts"),
            Some("messages"),
        )),
    }
}

pub fn parse_chat(body: &[u8]) -> Result<Request, BadRequest> {
    let b: ChatBody = parse_json(body)?;
    let mut p = common(b.common, Kind::Chat)?;
    let msgs = b
        .messages
        .ok_or_else(|| BadRequest::new("missing `messages`", Some("messages")))?;
    if msgs.is_empty() {
        return Err(BadRequest::new("`messages` is empty", Some("messages")));
    }
    let mut out = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.into_iter().enumerate() {
        let role = match m.role.as_deref().unwrap_or("user") {
            "system" | "developer" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "tool" | "function" => Role::Tool,
            other => {
                return Err(BadRequest::new(
                    format!(
                    "messages[{i}]: unknown role {other:?} (system, developer, user, assistant)"
                ),
                    Some("messages"),
                ))
            }
        };
        let mut msg = Message::new(role, content_text(m.content, i)?);
        if role == Role::Assistant {
            msg.reasoning = m.reasoning_content.filter(|r| !r.is_empty());
            msg.tool_calls = m
                .tool_calls
                .unwrap_or_default()
                .into_iter()
                .enumerate()
                .map(|(j, c)| ToolCall {
                    id: c.id.unwrap_or_else(|| format!("call_{i}_{j}")),
                    name: c.function.name,
                    arguments: arguments_text(c.function.arguments),
                })
                .collect();
        }
        if role == Role::Tool {
            msg.tool_call_id = m.tool_call_id;
            msg.name = m.name;
        }
        out.push(msg);
    }
    p.input = Input::Messages(out);
    Ok(p)
}

pub fn parse_completion(body: &[u8]) -> Result<Request, BadRequest> {
    let b: CompletionBody = parse_json(body)?;
    let mut p = common(b.common, Kind::Completion)?;
    if !p.agent.tools.is_empty() {
        return Err(BadRequest::new(
            "tools need a chat endpoint (/v1/chat/completions)",
            Some("tools"),
        ));
    }
    let mut prompts = completion_prompts(b.prompt)?.into_iter();
    p.input = prompts
        .next()
        .ok_or_else(|| BadRequest::new("prompt is empty", Some("prompt")))?;
    p.batch = prompts.collect();
    if (p.batch.len() + 1) * p.n > MAX_CHOICES {
        return Err(BadRequest::new(
            format!("at most {MAX_CHOICES} choices per request (prompts times n)"),
            Some("prompt"),
        ));
    }
    p.echo = b.echo.unwrap_or(false);
    // Both would change what the answer is; ignoring them would answer
    // another request.
    if b.suffix.as_ref().is_some_and(|v| !v.is_null() && v != "") {
        return Err(BadRequest::new(
            "suffix (insertion) is not supported",
            Some("suffix"),
        ));
    }
    if let Some(v) = b.best_of.filter(|v| !v.is_null()) {
        if v.as_u64() != Some(p.n as u64) {
            return Err(BadRequest::new(
                "best_of is supported only equal to n (every choice is returned)",
                Some("best_of"),
            ));
        }
    }
    Ok(p)
}

/// A completion's prompts: a string or a list of token ids, or a list of
/// those (a batch, each prompt its own choices).
fn completion_prompts(v: Option<Value>) -> Result<Vec<Input>, BadRequest> {
    let bad = |m: &str| BadRequest::new(m, Some("prompt"));
    match v {
        None | Some(Value::Null) => Err(bad("missing `prompt`")),
        Some(Value::Array(a)) if a.first().is_some_and(|x| x.is_string() || x.is_array()) => {
            a.into_iter().map(one_prompt).collect()
        }
        Some(v) => Ok(vec![one_prompt(v)?]),
    }
}

/// One prompt of a completion: a string or a list of token ids.
fn one_prompt(v: Value) -> Result<Input, BadRequest> {
    let bad = |m: &str| BadRequest::new(m, Some("prompt"));
    match v {
        Value::String(s) if s.is_empty() => Err(bad("prompt is empty")),
        Value::String(s) => Ok(Input::Raw(s)),
        Value::Array(a) if a.is_empty() => Err(bad("prompt is empty")),
        Value::Array(a) => a
            .iter()
            .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
            .collect::<Option<Vec<u32>>>()
            .map(Input::Tokens)
            .ok_or_else(|| bad("prompt token ids must be integers from 0 up")),
        _ => Err(bad(
            "prompt must be a string or a list of token ids, or a list of those",
        )),
    }
}

pub fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": u.cached_tokens },
    })
}

/// Which OpenAI endpoint a response is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

/// The OpenAI wire format of one endpoint, with the log-probabilities given
/// and not yet sent.
pub struct OpenAi {
    kind: Kind,
    logprobs: Vec<Logprobs>,
    /// Characters of the token texts already sent (a completion chunk's
    /// `text_offset` counts from the start of the output).
    sent_chars: usize,
    /// The prompt, not yet sent, that the output starts with (`echo`).
    echo: Option<String>,
    /// The text of the prompt's first token, not yet sent, when the prompt
    /// is scored: its log-probability is `null`.
    unscored_first: Option<Vec<u8>>,
}

impl OpenAi {
    pub fn new(kind: Kind) -> Self {
        OpenAi {
            kind,
            logprobs: Vec::new(),
            sent_chars: 0,
            echo: None,
            unscored_first: None,
        }
    }

    /// The text the output goes on with: the echoed prompt first.
    fn text_after_echo(&mut self, text: &str) -> String {
        match self.echo.take() {
            Some(prompt) => prompt + text,
            None => text.to_string(),
        }
    }

    /// The stream's last chunk before `[DONE]` (`include_usage`): no
    /// choices, the usage.
    fn usage_chunk(&self, g: &Gen, u: &Usage) -> Value {
        json!({ "id": g.id, "object": self.object(true), "created": g.created, "model": g.model,
                "choices": [], "usage": usage_json(u) })
    }

    fn object(&self, streaming: bool) -> &'static str {
        match (self.kind, streaming) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    /// One streaming chunk with a chat `delta` (completions read its
    /// `content`), carrying the log-probabilities given since the last.
    pub fn chunk(&mut self, g: &Gen, delta: Value, finish: Option<FinishReason>) -> Value {
        let finish = finish.map(FinishReason::as_str);
        let logprobs = self.take_logprobs();
        let choice = match self.kind {
            Kind::Chat => {
                json!({ "index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish })
            }
            Kind::Completion => {
                let text = delta.get("content").and_then(Value::as_str).unwrap_or("");
                let text = self.text_after_echo(text);
                json!({ "index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish })
            }
        };
        json!({ "id": g.id, "object": self.object(true), "created": g.created, "model": g.model, "choices": [choice] })
    }

    /// The log-probabilities given and not yet sent, in this endpoint's
    /// shape (`null` when there are none): chat's `content` list of tokens
    /// with their bytes and alternatives, or the legacy completion's parallel
    /// lists with each token's character offset in the output.
    /// The first prompt token of an echo with scores (see
    /// [`Dialect::echo`]) has a `null` log-probability and no alternatives.
    fn take_logprobs(&mut self) -> Value {
        if self.logprobs.is_empty() && self.unscored_first.is_none() {
            return Value::Null;
        }
        let given = std::mem::take(&mut self.logprobs);
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        match self.kind {
            Kind::Chat => json!({ "content": logprob_entries(&given), "refusal": null }),
            Kind::Completion => {
                let first = self
                    .unscored_first
                    .take()
                    .map(|b| (text(&b), Value::Null, Value::Null));
                let scored = given.iter().map(|l| {
                    let top = l.top.iter().map(|t| (text(&t.bytes), json!(t.logprob)));
                    (
                        text(&l.chosen.bytes),
                        json!(l.chosen.logprob),
                        Value::Object(top.collect()),
                    )
                });
                let (mut tokens, mut logprobs, mut tops, mut offsets) =
                    (vec![], vec![], vec![], vec![]);
                for (token, logprob, top) in first.into_iter().chain(scored) {
                    offsets.push(self.sent_chars);
                    self.sent_chars += token.chars().count();
                    tokens.push(token);
                    logprobs.push(logprob);
                    tops.push(top);
                }
                json!({ "tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets })
            }
        }
    }
}

/// Tokens' log-probabilities as chat and the Responses API give them: each
/// token's text, log-probability and bytes, with its alternatives alike.
pub(crate) fn logprob_entries(given: &[Logprobs]) -> Vec<Value> {
    let entry = |t: &TokenLogprob| json!({ "token": String::from_utf8_lossy(&t.bytes), "logprob": t.logprob, "bytes": t.bytes });
    given
        .iter()
        .map(|l| {
            let mut e = entry(&l.chosen);
            e["top_logprobs"] = l.top.iter().map(entry).collect();
            e
        })
        .collect()
}

fn call_json(c: &CallOut) -> Value {
    json!({ "id": c.id, "type": "function", "function": { "name": c.name, "arguments": c.arguments } })
}

/// The chat delta of one piece of the turn.
fn piece_delta(p: &Piece) -> Value {
    match p {
        Piece::Reasoning(t) => json!({ "reasoning_content": t }),
        Piece::Text(t) => json!({ "content": t }),
        Piece::Call(i, c) => {
            let mut call = call_json(c);
            call["index"] = json!(i);
            json!({ "tool_calls": [call] })
        }
    }
}

/// OpenAI's error body.
pub fn error_body(message: &str, kind: ErrorKind, param: Option<&str>) -> Value {
    let (ty, code) = match kind {
        ErrorKind::InvalidRequest => ("invalid_request_error", None),
        ErrorKind::ContextLength => ("invalid_request_error", Some("context_length_exceeded")),
        ErrorKind::Authentication => ("authentication_error", Some("invalid_api_key")),
        ErrorKind::Forbidden => ("permission_error", None),
        ErrorKind::NotFound => ("not_found_error", None),
        ErrorKind::Overloaded => ("server_error", Some("overloaded")),
        ErrorKind::Server => ("server_error", None),
    };
    json!({ "error": { "message": message, "type": ty, "param": param, "code": code } })
}

/// An error in OpenAI's shape (also the Responses API's).
pub fn error_response(status: StatusCode, message: &str, kind: ErrorKind) -> Response {
    (status, Json(error_body(message, kind, None))).into_response()
}

/// A 400 in OpenAI's shape, naming the parameter at fault.
pub fn bad_request_response(e: BadRequest) -> Response {
    let body = error_body(&e.message, ErrorKind::InvalidRequest, e.param);
    (StatusCode::BAD_REQUEST, Json(body)).into_response()
}

impl Dialect for OpenAi {
    fn id_prefix(&self) -> &'static str {
        match self.kind {
            Kind::Chat => "chatcmpl",
            Kind::Completion => "cmpl",
        }
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

    fn echo(&mut self, prompt: &str, unscored_first: Option<Vec<u8>>) {
        self.echo = Some(prompt.to_string());
        self.unscored_first = unscored_first;
    }

    fn complete(&mut self, g: &Gen, turn: &Turn, finish: FinishReason, u: &Usage) -> Value {
        let logprobs = self.take_logprobs();
        let choice = match self.kind {
            Kind::Chat => {
                let mut message = json!({ "role": "assistant", "content": turn.content });
                if turn.content.is_empty() && !turn.calls.is_empty() {
                    message["content"] = Value::Null;
                }
                if !turn.reasoning.is_empty() {
                    message["reasoning_content"] = json!(turn.reasoning);
                }
                if !turn.calls.is_empty() {
                    message["tool_calls"] = turn.calls.iter().map(call_json).collect();
                }
                json!({ "index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish.as_str() })
            }
            Kind::Completion => {
                let text = self.text_after_echo(&turn.content);
                json!({ "index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish.as_str() })
            }
        };
        json!({ "id": g.id, "object": self.object(false), "created": g.created, "model": g.model,
                "choices": [choice], "usage": usage_json(u) })
    }

    fn stream_start(&mut self, g: &Gen, _started: &Usage) -> Vec<SseEvent> {
        match self.kind {
            Kind::Chat => vec![data(&self.chunk(
                g,
                json!({ "role": "assistant", "content": "" }),
                None,
            ))],
            Kind::Completion => vec![],
        }
    }

    fn stream_piece(&mut self, g: &Gen, piece: &Piece) -> Vec<SseEvent> {
        vec![data(&self.chunk(g, piece_delta(piece), None))]
    }

    fn stream_end(
        &mut self,
        g: &Gen,
        _turn: &Turn,
        finish: FinishReason,
        u: &Usage,
        include_usage: bool,
    ) -> Vec<SseEvent> {
        let mut out = vec![data(&self.chunk(g, json!({}), Some(finish)))];
        if include_usage {
            out.push(data(&self.usage_chunk(g, u)));
        }
        out.push(SseEvent::default().data("[DONE]"));
        out
    }

    fn stream_error(&mut self, _g: &Gen, message: &str) -> Vec<SseEvent> {
        vec![
            data(&error_body(message, ErrorKind::Server, None)),
            SseEvent::default().data("[DONE]"),
        ]
    }
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let d: Box<dyn Dialect> = Box::new(OpenAi::new(Kind::Chat));
    match cpu(&st, move |_| parse_chat(&body)).await {
        Ok(p) if p.n > 1 => choices::run(st, p, Kind::Chat).await,
        Ok(p) => run(st, p, d).await,
        Err(e) => d.bad_request(e),
    }
}

/// `POST /v1/completions`.
pub(crate) async fn completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let d: Box<dyn Dialect> = Box::new(OpenAi::new(Kind::Completion));
    match cpu(&st, move |_| parse_completion(&body)).await {
        Ok(p) if p.n > 1 || !p.batch.is_empty() => choices::run(st, p, Kind::Completion).await,
        Ok(p) => run(st, p, d).await,
        Err(e) => d.bad_request(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_requests_parse_leniently_and_refuse_what_we_cannot_do() {
        let p = parse_chat(
            br#"{"model":"m","messages":[{"role":"developer","content":"sys"},
            {"role":"user","content":[{"type":"text","text":"a"},{"text":"b"}]},{"content":null}],
            "max_completion_tokens":7,"stop":"END","temperature":0,"stream":true,
            "stream_options":{"include_usage":true},"user":"x","metadata":{"k":1},"n":1}"#,
        )
        .unwrap();
        let Input::Messages(m) = &p.input else {
            panic!()
        };
        assert_eq!(m[0], Message::new(Role::System, "sys"));
        assert_eq!(m[1], Message::new(Role::User, "ab"));
        assert_eq!(m[2], Message::new(Role::User, ""));
        assert_eq!(
            (p.max_tokens, p.stop.clone(), p.stream, p.include_usage),
            (Some(7), vec!["END".into()], true, true)
        );
        assert_eq!(p.sampling.temperature, 0.0);

        let bad = |b: &str| parse_chat(b.as_bytes()).unwrap_err().message;
        assert!(bad("{").starts_with("invalid JSON request"));
        assert!(bad(r#"{"messages":"hi"}"#).starts_with("invalid JSON request"));
        assert!(
            bad(r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":"9"}"#)
                .contains("invalid type")
        );
        assert_eq!(bad(r#"{}"#), "missing `messages`");
        assert_eq!(bad(r#"{"messages":[]}"#), "`messages` is empty");
        assert!(bad(r#"{"messages":[{"role":"wizard","content":"x"}]}"#)
            .contains("unknown role \"wizard\""));
        assert_eq!(
            bad(r#"{"messages":[{"content":"x"}],"n":17}"#),
            "n must be from 1 to 16"
        );
        for (bias, why) in [
            (r#"{"x":1}"#, r#""x" is not a token id"#),
            (r#"{"-5":1}"#, "is not a token id"),
            (
                r#"{"5":101}"#,
                "the bias of token 5 is 101, outside -100..100",
            ),
            (r#"{"5":"1"}"#, "must be a number from -100 to 100"),
            (r#"{"5":true}"#, "must be a number"),
            (r#"{"5":1,"05":2}"#, "token 5 is given twice"),
            (r#"[[5]]"#, "[5] is not an [id, bias] pair"),
            (r#"[["Hello",1]]"#, r#""Hello" is not a token id"#),
            (r#"[[4294967296,1]]"#, "is not a token id"),
            (r#""5""#, "must be an object"),
        ] {
            let body = format!(r#"{{"messages":[{{"content":"x"}}],"logit_bias":{bias}}}"#);
            let m = bad(&body);
            assert!(
                m.starts_with("logit_bias: ") && m.contains(why),
                "{bias}: {m}"
            );
        }
        let bias = |b: &str| {
            let body = format!(r#"{{"messages":[{{"content":"x"}}],"logit_bias":{b}}}"#);
            parse_chat(body.as_bytes()).unwrap().sampling.logit_bias
        };
        assert_eq!(bias(r#"{"5":-1.5,"7":100}"#), [(5, -1.5), (7, 100.0)]);
        assert_eq!(
            bias(r#"[[5,false],["9",-100]]"#),
            [(5, f32::NEG_INFINITY), (9, -100.0)]
        );
        assert_eq!(bias("{}"), []);
        assert_eq!(bias("null"), []);
        assert!(
            bad(r#"{"messages":[{"content":[{"type":"image_url","image_url":{}}]}]}"#)
                .contains("image_url parts")
        );
        assert!(bad(r#"{"messages":[{"content":"x"}],"temperature":3}"#).contains("temperature"));
        assert!(bad(r#"{"messages":[{"content":"x"}],"stop":[1]}"#).contains("stop"));
    }

    #[test]
    fn completions_take_one_prompt_of_text_or_token_ids() {
        let p = parse_completion(br#"{"prompt":["Once"],"max_tokens":3}"#).unwrap();
        assert!(matches!(p.input, Input::Raw(ref s) if s == "Once"));
        assert!(!p.echo);
        for ids in [r#"[1,2,4294967295]"#, r#"[[1,2,4294967295]]"#] {
            let p =
                parse_completion(format!(r#"{{"prompt":{ids},"echo":true}}"#).as_bytes()).unwrap();
            assert!(matches!(p.input, Input::Tokens(ref t) if t == &[1, 2, u32::MAX]));
            assert!(p.echo && p.batch.is_empty() && p.n == 1);
        }
        // A batch: the first prompt and the rest, text and ids mixed.
        let p = parse_completion(br#"{"prompt":["a",[7],"b"],"n":2}"#).unwrap();
        assert!(matches!(p.input, Input::Raw(ref s) if s == "a"));
        assert!(
            matches!(p.batch[..], [Input::Tokens(ref t), Input::Raw(ref s)] if t == &[7] && s == "b")
        );
        assert_eq!(p.n, 2);
        let many = format!(r#"{{"prompt":[{}],"n":2}}"#, vec![r#""a""#; 65].join(","));
        assert_eq!(
            parse_completion(many.as_bytes()).unwrap_err().param,
            Some("prompt")
        );
        for bad in [
            r#""""#,
            r#"["a",""]"#,
            r#"[[1],[]]"#,
            r#"["a",[-1]]"#,
            r#"[]"#,
            r#"[[]]"#,
            r#"[1,-2]"#,
            r#"[1.5]"#,
            r#"[4294967296]"#,
            r#"[["a"]]"#,
            r#"[null]"#,
            r#"{"a":1}"#,
            r#"null"#,
        ] {
            let e = parse_completion(format!(r#"{{"prompt":{bad}}}"#).as_bytes()).unwrap_err();
            assert_eq!(e.param, Some("prompt"), "{bad}: {e:?}");
        }
        assert!(parse_completion(br#"{"prompt":"x","echo":1}"#).is_err());
        for (extra, param) in [
            (r#""suffix":" end""#, "suffix"),
            (r#""best_of":2"#, "best_of"),
            (r#""best_of":2,"n":3"#, "best_of"),
            (r#""best_of":"2""#, "best_of"),
        ] {
            let body = format!(r#"{{"prompt":"x",{extra}}}"#);
            let e = parse_completion(body.as_bytes()).unwrap_err();
            assert_eq!(e.param, Some(param), "{extra}: {e:?}");
        }
        for ok in [
            r#""suffix":"""#,
            r#""suffix":null"#,
            r#""best_of":1"#,
            r#""best_of":2,"n":2"#,
        ] {
            let body = format!(r#"{{"prompt":"x",{ok}}}"#);
            assert!(parse_completion(body.as_bytes()).is_ok(), "{ok}");
        }
    }

    #[test]
    fn an_echo_leads_the_text_and_its_first_token_is_unscored() {
        let g = Gen {
            id: "cmpl-1".into(),
            created: 0,
            model: "m".into(),
        };
        let scored = |id: u32, text: &str, logprob: f32| Logprobs {
            chosen: TokenLogprob {
                id,
                bytes: text.into(),
                logprob,
            },
            top: vec![TokenLogprob {
                id: 9,
                bytes: "z".into(),
                logprob: -0.5,
            }],
        };
        let mut d = OpenAi::new(Kind::Completion);
        d.echo("ab", Some(b"a".to_vec()));
        d.logprobs(vec![scored(2, "b", -1.0)]);
        d.logprobs(vec![scored(3, "c", -2.0)]);
        let c = d.chunk(&g, json!({ "content": "c" }), None);
        let choice = &c["choices"][0];
        assert_eq!(choice["text"], "abc");
        assert_eq!(choice["logprobs"]["tokens"], json!(["a", "b", "c"]));
        assert_eq!(
            choice["logprobs"]["token_logprobs"],
            json!([null, -1.0, -2.0])
        );
        assert_eq!(
            choice["logprobs"]["top_logprobs"],
            json!([null, {"z": -0.5}, {"z": -0.5}])
        );
        assert_eq!(choice["logprobs"]["text_offset"], json!([0, 1, 2]));
        // Once: the next chunk carries neither again.
        d.logprobs(vec![scored(4, "d", -3.0)]);
        let c = d.chunk(&g, json!({ "content": "d" }), None);
        assert_eq!(c["choices"][0]["text"], "d");
        assert_eq!(c["choices"][0]["logprobs"]["text_offset"], json!([3]));
    }

    #[test]
    fn chunks_have_openai_shapes() {
        let g = Gen {
            id: "id".into(),
            created: 1,
            model: "m".into(),
        };
        let mut chat = OpenAi::new(Kind::Chat);
        let c = chat.chunk(&g, piece_delta(&Piece::Text("hi".into())), None);
        assert_eq!(c["choices"][0]["delta"]["content"], "hi");
        assert!(c["choices"][0]["finish_reason"].is_null());
        let call = CallOut {
            id: "call_1".into(),
            name: "f".into(),
            arguments: r#"{"a":1}"#.into(),
        };
        let c = chat.chunk(&g, piece_delta(&Piece::Call(0, call)), None);
        assert_eq!(
            c["choices"][0]["delta"]["tool_calls"][0],
            json!({"index":0,"id":"call_1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}})
        );
        let c =
            OpenAi::new(Kind::Completion).chunk(&g, piece_delta(&Piece::Text("yo".into())), None);
        assert_eq!(c["choices"][0]["text"], "yo");
        let c = chat.chunk(&g, json!({}), Some(FinishReason::Length));
        assert_eq!(
            (
                c["choices"][0]["delta"].clone(),
                c["choices"][0]["finish_reason"].clone()
            ),
            (json!({}), json!("length"))
        );
    }

    #[test]
    fn overflows_carry_openais_wording_and_code() {
        use ds4_runtime::Overflow;
        let d = OpenAi::new(Kind::Chat);
        let o = Overflow {
            prompt_tokens: 9000,
            at_least: false,
            max_tokens: None,
            n_ctx: 8192,
        };
        assert!(d
            .overflow_message(&o)
            .starts_with("This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens."));
        let o = Overflow {
            prompt_tokens: 7000,
            at_least: false,
            max_tokens: Some(2000),
            ..o
        };
        assert!(d
            .overflow_message(&o)
            .contains("you requested 9000 tokens (7000 in the messages, 2000 in the completion)"));
        assert_eq!(
            error_body("m", ErrorKind::ContextLength, None)["error"]["code"],
            "context_length_exceeded"
        );
    }
}
