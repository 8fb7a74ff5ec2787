//! The Anthropic Messages dialect: `POST /v1/messages` and
//! `POST /v1/messages/count_tokens`. Requests are parsed into a [`Request`];
//! responses, SSE events and errors are built in Anthropic's shapes.
//!
//! Text only for now: tool use, extended thinking, images and documents are refused
//! with a 400 that says so. Decided on purpose:
//! * `stop_reason` is `end_turn` for a matched stop sequence too, and
//!   `stop_sequence` is always `null`: the worker reports one `Stop` for both.
//! * `thinking` / `redacted_thinking` blocks of earlier turns are dropped, as
//!   Anthropic's API drops them from the context.
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
use ds4_chat::{Message, Role};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::dialect::{named, BadRequest, Dialect, ErrorKind, Gen, Input, Request};
use crate::http::{self, AppState};
use crate::openai::default_sampling;
use crate::worker::{FinishReason, Usage};

#[derive(Deserialize)]
struct Body {
    model: Option<String>,
    messages: Option<Vec<WireMessage>>,
    system: Option<Value>,
    max_tokens: Option<u64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u64>,
    stop_sequences: Option<Vec<String>>,
    stream: Option<bool>,
    tools: Option<Vec<Value>>,
    thinking: Option<Value>,
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
    if b.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(BadRequest::new(
            "tools: tool use is not supported yet",
            Some("tools"),
        ));
    }
    match &b.thinking {
        None | Some(Value::Null) => {}
        Some(t) if t.get("type").and_then(Value::as_str) == Some("disabled") => {}
        Some(_) => {
            return Err(BadRequest::new(
                "thinking: thinking is not supported yet (omit it or send {\"type\":\"disabled\"})",
                Some("thinking"),
            ))
        }
    }
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
    let mut sampling = default_sampling();
    if let Some(t) = b.temperature {
        if !(0.0..=1.0).contains(&t) {
            return Err(BadRequest::new(
                "temperature: must be between 0 and 1",
                Some("temperature"),
            ));
        }
        sampling.temperature = t;
    }
    if let Some(p) = b.top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(BadRequest::new("top_p: must be in (0, 1]", Some("top_p")));
        }
        sampling.top_p = p;
    }
    if let Some(k) = b.top_k {
        sampling.top_k = k as usize;
    }
    sampling.seed = crate::dialect::clock_seed();
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
    if let Some(s) = system_text(b.system)? {
        out.push(Message::new(Role::System, s));
    }
    let last = msgs.len() - 1;
    for (i, m) in msgs.into_iter().enumerate() {
        let role = match m.role.as_str() {
            "user" => Role::User,
            "assistant" if i == last => {
                return Err(BadRequest::new(
                    format!(
                        "messages.{i}: a final assistant message (prefill) is not supported yet"
                    ),
                    Some("messages"),
                ))
            }
            "assistant" => Role::Assistant,
            other => {
                return Err(BadRequest::new(
                    format!(
                        "messages.{i}.role: unknown role {other:?} (user or assistant; \
                         the system prompt goes in the top-level `system`)"
                    ),
                    Some("messages"),
                ))
            }
        };
        out.push(Message::new(role, content_text(m.content, i)?));
    }
    Ok(Request {
        model: b.model,
        input: Input::Messages(out),
        sampling,
        max_tokens,
        stop,
        stream: b.stream.unwrap_or(false),
        include_usage: false,
    })
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

/// Text of message `i`'s `content`: a string, or the concatenated `text` blocks.
fn content_text(v: Value, i: usize) -> Result<String, BadRequest> {
    let bad = |m: String| BadRequest::new(m, Some("messages"));
    let blocks = match v {
        Value::String(s) => return Ok(s),
        Value::Null => return Ok(String::new()),
        Value::Array(a) => a,
        _ => {
            return Err(bad(format!(
                "messages.{i}.content: must be a string or an array of content blocks"
            )))
        }
    };
    let mut out = String::new();
    for (j, b) in blocks.into_iter().enumerate() {
        if let Value::String(s) = &b {
            out.push_str(s);
            continue;
        }
        match b.get("type").and_then(Value::as_str) {
            Some("text") => match b.get("text").and_then(Value::as_str) {
                Some(t) => out.push_str(t),
                None => {
                    return Err(bad(format!(
                        "messages.{i}.content.{j}.text: a string is required"
                    )))
                }
            },
            Some("thinking" | "redacted_thinking") => {}
            Some(ty @ ("image" | "document")) => {
                return Err(bad(format!(
                    "messages.{i}.content.{j}: {ty} blocks are not supported (text only)"
                )))
            }
            Some(ty @ ("tool_use" | "tool_result")) => {
                return Err(bad(format!(
                    "messages.{i}.content.{j}: {ty} blocks are not supported yet (no tool use)"
                )))
            }
            Some(ty) => {
                return Err(bad(format!(
                    "messages.{i}.content.{j}: {ty} blocks are not supported"
                )))
            }
            None => {
                return Err(bad(format!(
                    "messages.{i}.content.{j}.type: a string is required"
                )))
            }
        }
    }
    Ok(out)
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
        FinishReason::Length => "max_tokens",
    }
}

/// Anthropic ids read `msg_…`; the runner names responses `PREFIX-N`.
fn message_id(g: &Gen) -> String {
    g.id.replacen('-', "_", 1)
}

/// Anthropic's error body. A 413 is its own type there (`request_too_large`).
pub fn error_body(status: StatusCode, message: &str, kind: ErrorKind) -> Value {
    let ty = match kind {
        _ if status == StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        ErrorKind::InvalidRequest | ErrorKind::ContextLength => "invalid_request_error",
        ErrorKind::Authentication => "authentication_error",
        ErrorKind::NotFound => "not_found_error",
        ErrorKind::Overloaded => "overloaded_error",
        ErrorKind::Server => "api_error",
    };
    json!({ "type": "error", "error": { "type": ty, "message": message } })
}

/// The Anthropic Messages wire format.
pub struct Anthropic;

impl Dialect for Anthropic {
    fn id_prefix(&self) -> &'static str {
        "msg"
    }

    fn error(&self, status: StatusCode, message: &str, kind: ErrorKind) -> Response {
        (status, Json(error_body(status, message, kind))).into_response()
    }

    fn complete(&self, g: &Gen, text: &str, finish: FinishReason, u: &Usage) -> Value {
        json!({
            "id": message_id(g), "type": "message", "role": "assistant", "model": g.model,
            "content": [{ "type": "text", "text": text }],
            "stop_reason": stop_reason(finish), "stop_sequence": null,
            "usage": usage_json(u),
        })
    }

    fn stream_start(&self, g: &Gen, started: &Usage) -> Vec<SseEvent> {
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
            named(
                "content_block_start",
                &json!({ "type": "content_block_start", "index": 0,
                         "content_block": { "type": "text", "text": "" } }),
            ),
            named("ping", &json!({ "type": "ping" })),
        ]
    }

    fn stream_text(&self, _g: &Gen, text: &str) -> Vec<SseEvent> {
        vec![named(
            "content_block_delta",
            &json!({ "type": "content_block_delta", "index": 0,
                     "delta": { "type": "text_delta", "text": text } }),
        )]
    }

    /// `message_delta` carries the whole final usage (as Anthropic's does today):
    /// the checkpoint writes are only known after the prefill, so the
    /// `message_start` usage has `cache_creation_input_tokens` 0.
    fn stream_end(
        &self,
        _g: &Gen,
        _text: &str,
        finish: FinishReason,
        u: &Usage,
        _include_usage: bool,
    ) -> Vec<SseEvent> {
        vec![
            named(
                "content_block_stop",
                &json!({ "type": "content_block_stop", "index": 0 }),
            ),
            named(
                "message_delta",
                &json!({ "type": "message_delta",
                         "delta": { "stop_reason": stop_reason(finish), "stop_sequence": null },
                         "usage": usage_json(u) }),
            ),
            named("message_stop", &json!({ "type": "message_stop" })),
        ]
    }

    fn stream_error(&self, _g: &Gen, message: &str) -> Vec<SseEvent> {
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
    let d: Arc<dyn Dialect> = Arc::new(Anthropic);
    match parse_messages(&body) {
        Ok(p) => http::run(st, p, d).await,
        Err(e) => d.bad_request(e),
    }
}

/// `POST /v1/messages/count_tokens`: the tokens of the rendered prompt, tokenized
/// as the worker tokenizes a cold prompt.
pub(crate) async fn count_tokens(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let d = Anthropic;
    let p = match parse_count_tokens(&body) {
        Ok(p) => p,
        Err(e) => return d.bad_request(e),
    };
    let prompt = match http::render(&st, &p.input) {
        Ok(s) => s,
        Err(msg) => return d.error(StatusCode::BAD_REQUEST, msg, ErrorKind::InvalidRequest),
    };
    // Tokenizing a long conversation is CPU work: keep it off the async threads.
    let model = Arc::clone(&st.model);
    match tokio::task::spawn_blocking(move || model.tokenizer.encode(&prompt, true, true).len())
        .await
    {
        Ok(n) => Json(json!({ "input_tokens": n })).into_response(),
        Err(e) => d.error(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("tokenizer failed: {e}"),
            ErrorKind::Server,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::CacheSource;

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
                Message::new(Role::Assistant, "hello"),
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
        assert!(bad(&user(
            r#"[{"type":"tool_result","tool_use_id":"t","content":"x"}]"#
        ))
        .contains("tool_result blocks are not supported yet"));
        assert!(bad(&user(r#"[{"type":"text"}]"#)).contains("content.0.text"));
        assert!(bad(&user(r#"[{"text":"x"}]"#)).contains("content.0.type"));
        assert!(bad(&user("5")).contains("must be a string or an array"));
        assert!(bad(
            r#"{"max_tokens":1,"messages":[{"role":"user","content":"x"},
                {"role":"assistant","content":[{"type":"tool_use","id":"t","name":"f","input":{}}]},
                {"role":"user","content":"y"}]}"#
        )
        .contains("messages.1.content.0: tool_use blocks"));
        assert!(
            bad(r#"{"max_tokens":1,"messages":[{"role":"system","content":"x"}]}"#)
                .contains("unknown role \"system\"")
        );
        assert!(bad(
            r#"{"max_tokens":1,"messages":[{"role":"user","content":"x"},{"role":"assistant","content":"{"}]}"#
        )
        .contains("prefill"));
        assert!(bad(
            r#"{"max_tokens":1,"tools":[{"name":"f","input_schema":{}}],"messages":[{"role":"user","content":"x"}]}"#
        )
        .starts_with("tools: tool use is not supported yet"));
        assert!(bad(
            r#"{"max_tokens":1,"thinking":{"type":"enabled","budget_tokens":1024},"messages":[{"role":"user","content":"x"}]}"#
        )
        .contains("thinking is not supported yet"));
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
        let v = Anthropic.complete(&gen(), "Paris.", FinishReason::Length, &usage(10, 4, 0));
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
            Anthropic.complete(&gen(), "", FinishReason::Stop, &usage(1, 0, 0))["stop_reason"],
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
