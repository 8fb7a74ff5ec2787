//! What the API dialects share: the internal request every dialect parses into, and
//! the [`Dialect`] trait each wire format implements (response body, SSE events,
//! error shape).

use axum::http::StatusCode;
use axum::response::sse::Event as SseEvent;
use axum::response::Response;
use ds4_chat::Message;
use ds4_engine::SamplerConfig;
use serde_json::Value;

use crate::worker::{FinishReason, Usage};

/// A request in the engine's terms.
#[derive(Debug)]
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
}

#[derive(Debug)]
pub enum Input {
    /// A conversation, rendered with the model's chat template.
    Messages(Vec<Message>),
    /// A raw prompt (legacy completions).
    Raw(String),
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

/// A wire format: OpenAI chat, OpenAI completions, Anthropic messages, Responses.
pub trait Dialect: Send + Sync + 'static {
    /// Prefix of response ids (`chatcmpl`, `cmpl`, `msg`, `resp`).
    fn id_prefix(&self) -> &'static str;
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
    /// The non-streaming response body.
    fn complete(&self, g: &Gen, text: &str, finish: FinishReason, usage: &Usage) -> Value;
    /// Events before the first text (`started` has the prompt and cached counts).
    fn stream_start(&self, g: &Gen, started: &Usage) -> Vec<SseEvent>;
    fn stream_text(&self, g: &Gen, text: &str) -> Vec<SseEvent>;
    /// Events after the last text; `text` is the whole output.
    fn stream_end(
        &self,
        g: &Gen,
        text: &str,
        finish: FinishReason,
        usage: &Usage,
        include_usage: bool,
    ) -> Vec<SseEvent>;
    /// An error after the stream started.
    fn stream_error(&self, g: &Gen, message: &str) -> Vec<SseEvent>;
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
