//! What the API dialects share: the internal request every dialect parses into, and
//! the [`Dialect`] trait each wire format implements (response body, SSE events,
//! error shape).

use axum::http::StatusCode;
use axum::response::sse::Event as SseEvent;
use axum::response::Response;
use ds4_chat::think::{ThinkControl, ThinkRequest};
use ds4_chat::{Message, ThinkMode, ToolChoice, ToolSpec};
use ds4_engine::SamplerConfig;
use serde_json::Value;

use ds4_chat::turn::{Piece, Turn};
use ds4_runtime::{FinishReason, Overflow, Usage};

/// A request in the engine's terms.
#[derive(Clone, Debug)]
pub struct Request {
    /// The `model` the client asked for, echoed back; `None` echoes the served one.
    pub model: Option<String>,
    pub input: Input,
    pub sampling: SamplerConfig,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub stream: bool,
    /// OpenAI `stream_options.include_usage`.
    pub include_usage: bool,
    /// Each generated token's log-probability with this many alternatives
    /// (OpenAI `logprobs` / `top_logprobs`).
    pub logprobs: Option<usize>,
    /// Legacy completions' `echo`: the answer starts with the prompt, and
    /// with `logprobs` the prompt's tokens are scored too.
    pub echo: bool,
    /// Choices per prompt (OpenAI `n`), each sampled with its own seed.
    pub n: usize,
    /// A legacy completion's further prompts (a batch), each answered as its
    /// own choices after `input`'s.
    pub batch: Vec<Input>,
    pub agent: AgentOptions,
}

/// What agent clients add to a chat request: tools, thinking, cache hints.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgentOptions {
    pub tools: Vec<ToolSpec>,
    pub tool_choice: ToolChoice,
    /// The thinking mode the request asked for, before context gating (the
    /// family may not have one).
    pub think: ThinkMode,
    /// Anthropic `cache_control` breakpoints: the index of the message whose end
    /// is a boundary worth a checkpoint (the system prompt is message 0).
    pub cache_breakpoints: Vec<usize>,
    /// Keys of the conversation the request continues that its body names
    /// (OpenAI `prompt_cache_key`, Anthropic `metadata.user_id`, which holds
    /// Claude Code's session id): requests sharing one go to the same slot
    /// when no slot holds a prefix of them.
    pub affinity: Vec<String>,
    /// The client allows only one call per turn (OpenAI
    /// `parallel_tool_calls: false`, Anthropic `disable_parallel_tool_use`).
    pub single_call: bool,
    /// Structured output (`response_format`, Responses `text.format`,
    /// Anthropic `output_format`): the answer is JSON valid against this schema.
    pub json_schema: Option<Value>,
}

impl AgentOptions {
    /// Checks `tool_choice` against the offered tools.
    pub fn validate(&self) -> Result<(), BadRequest> {
        match &self.tool_choice {
            ToolChoice::Required if self.tools.is_empty() => Err(BadRequest::new(
                "tool_choice requires a tool call but no tools were given",
                Some("tool_choice"),
            )),
            ToolChoice::Named(n) if !self.tools.iter().any(|t| &t.name == n) => {
                Err(BadRequest::new(
                    format!("tool_choice names an unknown tool {n:?}"),
                    Some("tool_choice"),
                ))
            }
            _ => Ok(()),
        }
    }

    /// The tools the prompt offers (none when `tool_choice` is none).
    pub fn active_tools(&self) -> &[ToolSpec] {
        match self.tool_choice {
            ToolChoice::None => &[],
            _ => &self.tools,
        }
    }
}

/// A structured-output setting: OpenAI chat's `response_format`
/// (`{"type": "json_schema", "json_schema": {"schema": ...}}`), the Responses
/// API's `text.format` and Anthropic's `output_format` (the schema at the top
/// level), or `json_object` (any object). `text` and null mean none.
pub fn json_format(v: Option<&Value>, param: &'static str) -> Result<Option<Value>, BadRequest> {
    let bad = |m: String| BadRequest::new(m, Some(param));
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(serde_json::json!({ "type": "object" }))),
        Some("json_schema") => {
            let schema = v
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .or_else(|| v.get("schema"));
            match schema {
                Some(s @ Value::Object(_)) => Ok(Some(s.clone())),
                Some(_) => Err(bad(format!("{param}: the schema must be a JSON object"))),
                None => Err(bad(format!("{param}: json_schema needs a `schema`"))),
            }
        }
        Some(other) => Err(bad(format!(
            "{param}: type {other:?} is not supported (text, json_object, json_schema)"
        ))),
        None => Err(bad(format!("{param}: a string `type` is required"))),
    }
}

#[derive(Clone, Debug)]
pub enum Input {
    /// A conversation, rendered with the model's chat template.
    Messages(Vec<Message>),
    /// A raw prompt (legacy completions).
    Raw(String),
    /// A legacy completion's prompt as token ids, run as given.
    Tokens(Vec<u32>),
}

/// A request the server refuses (400), with the parameter at fault.
#[derive(Debug, PartialEq)]
pub struct BadRequest {
    pub message: String,
    pub param: Option<&'static str>,
}

impl BadRequest {
    pub fn new(message: impl Into<String>, param: Option<&'static str>) -> Self {
        BadRequest {
            message: message.into(),
            param,
        }
    }
}

/// Error classes, which each dialect names its own way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidRequest,
    ContextLength,
    Authentication,
    /// Refused whoever asks (a `Host` this server does not answer).
    Forbidden,
    NotFound,
    Overloaded,
    Server,
}

/// Identity of one response.
#[derive(Debug)]
pub struct Gen {
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// The sampling fields, read and checked the same way on every route (each
/// dialect's body flattens this in): `temperature` (0 to the dialect's
/// maximum: Anthropic's API stops at 1, OpenAI's at 2), `top_p` in (0, 1],
/// `top_k`, `min_p` in [0, 1], `seed` (an unsigned integer) and `n` (up to
/// the dialect's most: 1 but on OpenAI's chat and completions).
#[derive(Debug, Default, serde::Deserialize)]
pub struct SamplingFields {
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u64>,
    min_p: Option<f32>,
    seed: Option<u64>,
    n: Option<u64>,
}

/// Sampling defaults when a request leaves them out (see docs/API.md).
pub fn default_sampling() -> SamplerConfig {
    SamplerConfig {
        temperature: 0.2,
        top_k: 40,
        top_p: 0.9,
        min_p: 0.05,
        seed: 0,
        logit_bias: Vec::new(),
    }
}

impl SamplingFields {
    /// The server's defaults with the request's fields applied; the seed is
    /// the clock's when the request gives none.
    pub fn config(&self, max_temperature: f32) -> Result<SamplerConfig, BadRequest> {
        let mut s = default_sampling();
        if let Some(t) = self.temperature {
            if !(0.0..=max_temperature).contains(&t) {
                return Err(BadRequest::new(
                    format!("temperature must be between 0 and {max_temperature}"),
                    Some("temperature"),
                ));
            }
            s.temperature = t;
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(BadRequest::new("top_p must be in (0, 1]", Some("top_p")));
            }
            s.top_p = p;
        }
        if let Some(k) = self.top_k {
            s.top_k = usize::try_from(k).unwrap_or(usize::MAX);
        }
        if let Some(m) = self.min_p {
            if !(0.0..=1.0).contains(&m) {
                return Err(BadRequest::new("min_p must be in [0, 1]", Some("min_p")));
            }
            s.min_p = m;
        }
        s.seed = self.seed.unwrap_or_else(clock_seed);
        Ok(s)
    }

    /// `n`: choices per prompt, 1 when absent, at most `max`.
    pub fn choices(&self, max: usize) -> Result<usize, BadRequest> {
        match self.n.map(|n| usize::try_from(n).unwrap_or(usize::MAX)) {
            None => Ok(1),
            Some(n) if (1..=max).contains(&n) => Ok(n),
            Some(_) if max == 1 => Err(BadRequest::new("only n = 1 is supported", Some("n"))),
            Some(_) => Err(BadRequest::new(
                format!("n must be from 1 to {max}"),
                Some("n"),
            )),
        }
    }
}

/// The thinking mode a request asks for (system spec §5.4–5.5), before context
/// gating: `control` as the dialect saw it, `effort` an effort name, the model
/// string for the `deepseek-chat` / `deepseek-reasoner` alias rule.
pub fn think_mode(
    control: ThinkControl,
    effort: Option<&str>,
    model: Option<&str>,
    param: &'static str,
) -> Result<ThinkMode, BadRequest> {
    let effort = effort
        .map(ThinkMode::from_effort)
        .transpose()
        .map_err(|e| {
            BadRequest::new(
                format!("{e} (none, minimal, low, medium, high, xhigh, max)"),
                Some(param),
            )
        })?;
    let request = ThinkRequest {
        control,
        effort,
        model: model.unwrap_or(""),
    };
    Ok(request.resolve(usize::MAX))
}

/// An on/off thinking control: `true`/`false`, null, or `{"type": "enabled" |
/// "disabled" | "adaptive"}` (other keys such as `budget_tokens` ignored).
pub fn think_control(v: &Value, param: &'static str) -> Result<ThinkControl, BadRequest> {
    match v {
        Value::Null => Ok(ThinkControl::Present),
        Value::Bool(true) => Ok(ThinkControl::Enabled),
        Value::Bool(false) => Ok(ThinkControl::Disabled),
        Value::Object(o) => match o.get("type").and_then(Value::as_str) {
            Some("enabled") => Ok(ThinkControl::Enabled),
            Some("adaptive") => Ok(ThinkControl::Present),
            Some("disabled") => Ok(ThinkControl::Disabled),
            _ => Err(BadRequest::new(
                format!("{param}.type must be \"enabled\", \"disabled\" or \"adaptive\""),
                Some(param),
            )),
        },
        _ => Err(BadRequest::new(
            format!("{param} must be a boolean or an object with a `type`"),
            Some(param),
        )),
    }
}

/// A wire format: OpenAI chat, OpenAI completions, Anthropic messages, Responses.
/// One value per request: a stream's encoder owns its state (block and event
/// numbering, what was streamed), so the methods that produce the body or the
/// stream take `&mut self`.
pub trait Dialect: Send + Sync + 'static {
    /// Prefix of response ids (`chatcmpl`, `cmpl`, `msg`, `resp`).
    fn id_prefix(&self) -> &'static str;
    /// Prefix of tool-call ids.
    fn call_id_prefix(&self) -> &'static str {
        "call_"
    }
    /// An error response in this dialect's JSON shape.
    fn error(&self, status: StatusCode, message: &str, kind: ErrorKind) -> Response;
    /// A 400 for a request that failed to parse.
    fn bad_request(&self, e: BadRequest) -> Response {
        self.error(
            StatusCode::BAD_REQUEST,
            &e.message,
            ErrorKind::InvalidRequest,
        )
    }
    /// The message of a request that does not fit the context, in the words
    /// this dialect's clients look for: OpenAI's (with the code
    /// `context_length_exceeded`, which Codex and opencode act on) unless the
    /// dialect says otherwise.
    fn overflow_message(&self, o: &Overflow) -> String {
        let at_least = if o.at_least { "at least " } else { "" };
        match o.max_tokens {
            None => format!(
                "This model's maximum context length is {} tokens. However, your messages resulted in {at_least}{} tokens. Please reduce the length of the messages.",
                o.n_ctx, o.prompt_tokens
            ),
            Some(m) => format!(
                "This model's maximum context length is {} tokens. However, you requested {at_least}{} tokens ({at_least}{} in the messages, {m} in the completion). Please reduce the length of the messages or completion.",
                o.n_ctx,
                o.prompt_tokens + m,
                o.prompt_tokens
            ),
        }
    }
    /// The log-probabilities of generated tokens (the request asked for
    /// them), given before the text they make: the dialect puts them in its
    /// next chunk, or in the whole body. Dialects without them pass them over.
    fn logprobs(&mut self, _l: Vec<ds4_runtime::Logprobs>) {}
    /// The prompt's text, to start the answer with (legacy completions'
    /// `echo`), and when its tokens are scored, the text of its first, which
    /// nothing scores (the others come as [`logprobs`](Self::logprobs)).
    fn echo(&mut self, _prompt: &str, _unscored_first: Option<Vec<u8>>) {}
    /// The non-streaming response body.
    fn complete(&mut self, g: &Gen, turn: &Turn, finish: FinishReason, usage: &Usage) -> Value;
    /// Events before the first piece (`started` has the prompt and cached counts).
    fn stream_start(&mut self, g: &Gen, started: &Usage) -> Vec<SseEvent>;
    /// Events of one piece of the turn (the dialect tracks its open blocks).
    fn stream_piece(&mut self, g: &Gen, piece: &Piece) -> Vec<SseEvent>;
    /// Events after the last piece; `turn` is the whole output.
    fn stream_end(
        &mut self,
        g: &Gen,
        turn: &Turn,
        finish: FinishReason,
        usage: &Usage,
        include_usage: bool,
    ) -> Vec<SseEvent>;
    /// An error after the stream started.
    fn stream_error(&mut self, g: &Gen, message: &str) -> Vec<SseEvent>;
}

/// A JSON `data:` event.
pub fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

/// A named event (`event: NAME`) with a JSON `data:` line.
pub fn named(name: &str, v: &Value) -> SseEvent {
    SseEvent::default().event(name).data(v.to_string())
}

/// A sampling seed for requests that give none: the clock, so two requests differ.
pub fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}
