//! The HTTP side: routes, API key, CORS, JSON and SSE responses. Handlers parse a
//! dialect, render the prompt, queue a job for the engine worker and relay its
//! events; a client that goes away drops the event channel, which the worker sees
//! at its next token.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ds4_chat::ChatMl;
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::openai::{self, BadRequest, Input, Kind, Parsed};
use crate::worker::{Event, Job, JobError, SubmitError, Usage, WorkerHandle};

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub api_key: Option<String>,
    pub cors: bool,
    pub max_body_bytes: usize,
    /// Generation limit when a request gives none.
    pub default_max_tokens: usize,
    /// The id `/v1/models` lists and responses echo by default.
    pub model_name: String,
}

struct AppState {
    cfg: ServerConfig,
    worker: WorkerHandle,
    template: Option<ChatMl>,
    next_id: AtomicU64,
}

/// Builds the router over a running worker.
pub fn router(cfg: ServerConfig, worker: WorkerHandle, template: Option<ChatMl>) -> Router {
    let max_body = cfg.max_body_bytes;
    let state = Arc::new(AppState {
        cfg,
        worker,
        template,
        next_id: AtomicU64::new(1),
    });
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body))
        .layer(middleware::from_fn_with_state(Arc::clone(&state), guard))
        .with_state(state)
}

fn error(
    status: StatusCode,
    message: &str,
    kind: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> Response {
    (status, Json(openai::error_body(message, kind, param, code))).into_response()
}

fn bad_request(e: BadRequest) -> Response {
    error(
        StatusCode::BAD_REQUEST,
        &e.message,
        "invalid_request_error",
        e.param,
        e.code,
    )
}

async fn not_found(req: Request) -> Response {
    let msg = format!("unknown endpoint {} {}", req.method(), req.uri().path());
    error(StatusCode::NOT_FOUND, &msg, "not_found_error", None, None)
}

async fn method_not_allowed(req: Request) -> Response {
    let msg = format!(
        "method {} is not allowed on {}",
        req.method(),
        req.uri().path()
    );
    error(
        StatusCode::METHOD_NOT_ALLOWED,
        &msg,
        "invalid_request_error",
        None,
        None,
    )
}

/// API key check, CORS headers and preflight, and OpenAI-shaped errors for
/// oversized bodies.
async fn guard(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if req.method() == Method::OPTIONS {
        let mut r = StatusCode::NO_CONTENT.into_response();
        if st.cfg.cors {
            add_cors(r.headers_mut());
        }
        return r;
    }
    if let Some(key) = &st.cfg.api_key {
        let h = req.headers();
        let bearer = h
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let x_api_key = h.get("x-api-key").and_then(|v| v.to_str().ok());
        if bearer != Some(key.as_str()) && x_api_key != Some(key.as_str()) {
            let mut r = error(
                StatusCode::UNAUTHORIZED,
                "invalid or missing API key (send `Authorization: Bearer KEY` or `x-api-key: KEY`)",
                "authentication_error",
                None,
                Some("invalid_api_key"),
            );
            if st.cfg.cors {
                add_cors(r.headers_mut());
            }
            return r;
        }
    }
    let mut r = next.run(req).await;
    if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
        let msg = format!(
            "request body is larger than --max-body-bytes ({})",
            st.cfg.max_body_bytes
        );
        r = error(
            StatusCode::PAYLOAD_TOO_LARGE,
            &msg,
            "invalid_request_error",
            None,
            None,
        );
    }
    if st.cfg.cors {
        add_cors(r.headers_mut());
    }
    r
}

fn add_cors(h: &mut HeaderMap) {
    h.insert("access-control-allow-origin", HeaderValue::from_static("*"));
    h.insert(
        "access-control-allow-methods",
        HeaderValue::from_static("GET, POST, OPTIONS"),
    );
    h.insert(
        "access-control-allow-headers",
        HeaderValue::from_static("*"),
    );
}

async fn health(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({ "status": "ok", "queue_depth": st.worker.queue_depth() }))
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{ "id": st.cfg.model_name, "object": "model", "created": 0, "owned_by": "ds4" }],
    }))
}

async fn chat_completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    match openai::parse_chat(&body) {
        Ok(p) => run(st, p, Kind::Chat).await,
        Err(e) => bad_request(e),
    }
}

async fn completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    match openai::parse_completion(&body) {
        Ok(p) => run(st, p, Kind::Completion).await,
        Err(e) => bad_request(e),
    }
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn job_error(e: &JobError) -> Response {
    match e {
        JobError::ContextLength { .. } => error(
            StatusCode::BAD_REQUEST,
            &e.to_string(),
            "invalid_request_error",
            Some("messages"),
            Some("context_length_exceeded"),
        ),
        JobError::EmptyPrompt => error(
            StatusCode::BAD_REQUEST,
            &e.to_string(),
            "invalid_request_error",
            None,
            None,
        ),
        JobError::Engine(_) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            &e.to_string(),
            "server_error",
            None,
            None,
        ),
    }
}

async fn run(st: Arc<AppState>, p: Parsed, kind: Kind) -> Response {
    let prompt = match (&p.input, &st.template) {
        (Input::Raw(s), _) => s.clone(),
        (Input::Messages(m), Some(t)) => t.render(m, true),
        (Input::Messages(_), None) => {
            return bad_request(BadRequest {
                message: "this model has no chat template; use /v1/completions".into(),
                param: None,
                code: None,
            })
        }
    };
    let (tx, mut rx) = mpsc::channel(256);
    let job = Job {
        prompt,
        sampling: p.sampling.clone(),
        max_tokens: p.max_tokens.unwrap_or(st.cfg.default_max_tokens),
        stop: p.stop.clone(),
        events: tx,
    };
    match st.worker.submit(job) {
        Ok(()) => {}
        Err(SubmitError::QueueFull) => {
            let mut r = error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the request queue is full (--queue-max); retry shortly",
                "server_error",
                None,
                Some("queue_full"),
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            return r;
        }
        Err(SubmitError::ShuttingDown) => {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server shutting down",
                "server_error",
                None,
                None,
            )
        }
    }
    let model_name = p.model.clone().unwrap_or_else(|| st.cfg.model_name.clone());
    let prefix = if kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    let id = format!("{prefix}-{}", st.next_id.fetch_add(1, Ordering::Relaxed));
    let created = now();

    if !p.stream {
        let mut text = String::new();
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Started { .. } => {}
                Event::Text(t) => text.push_str(&t),
                Event::Done { finish, usage } => {
                    let body =
                        openai::response(kind, &id, created, &model_name, &text, finish, &usage);
                    let mut r = Json(body).into_response();
                    cache_header(&mut r, &usage);
                    return r;
                }
                Event::Failed(e) => return job_error(&e),
            }
        }
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the engine stopped",
            "server_error",
            None,
            None,
        );
    }

    // Streaming: wait for the start (or an early failure, answered as plain JSON),
    // then relay. Keep-alive comments cover long prefills.
    let first = rx.recv().await;
    let usage_hint = match first {
        Some(Event::Started {
            prompt_tokens,
            cached_tokens,
            cache_source,
        }) => Usage {
            prompt_tokens,
            cached_tokens,
            checkpointed_tokens: 0,
            completion_tokens: 0,
            cache_source,
        },
        Some(Event::Failed(e)) => return job_error(&e),
        _ => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the engine stopped",
                "server_error",
                None,
                None,
            )
        }
    };
    let opener = openai::chunk(kind, &id, created, &model_name, None, None);
    let head = stream::iter(if kind == Kind::Chat {
        vec![opener]
    } else {
        vec![]
    });
    let model = model_name;
    let include_usage = p.include_usage;
    let body = stream::unfold((rx, false), move |(mut rx, done)| {
        let (id, model) = (id.clone(), model.clone());
        async move {
            if done {
                return None;
            }
            match rx.recv().await {
                Some(Event::Text(t)) => Some((
                    vec![openai::chunk(kind, &id, created, &model, Some(&t), None)],
                    (rx, false),
                )),
                Some(Event::Done { finish, usage }) => {
                    let mut out = vec![openai::chunk(
                        kind,
                        &id,
                        created,
                        &model,
                        None,
                        Some(finish),
                    )];
                    if include_usage {
                        out.push(openai::usage_chunk(kind, &id, created, &model, &usage));
                    }
                    Some((out, (rx, true)))
                }
                Some(Event::Failed(e)) => Some((
                    vec![openai::error_body(
                        &e.to_string(),
                        "server_error",
                        None,
                        None,
                    )],
                    (rx, true),
                )),
                Some(Event::Started { .. }) | None => None,
            }
        }
    })
    .flat_map(stream::iter);
    let events = head
        .chain(body)
        .map(|v| Ok::<_, Infallible>(SseEvent::default().data(v.to_string())))
        .chain(stream::once(async {
            Ok(SseEvent::default().data("[DONE]"))
        }));
    let mut r = sse(events).into_response();
    cache_header(&mut r, &usage_hint);
    r
}

fn sse(
    events: impl Stream<Item = Result<SseEvent, Infallible>> + Send + 'static,
) -> impl IntoResponse {
    Sse::new(events).keep_alive(
        KeepAlive::new()
            .interval(Duration::from_secs(5))
            .text("keep-alive"),
    )
}

/// `x-ds4-cache: SOURCE; reused=N; prompt=M`, for clients and operators.
fn cache_header(r: &mut Response, u: &Usage) {
    let v = format!(
        "{}; reused={}; prompt={}",
        u.cache_source.as_str(),
        u.cached_tokens,
        u.prompt_tokens
    );
    if let Ok(v) = HeaderValue::from_str(&v) {
        r.headers_mut().insert("x-ds4-cache", v);
    }
}
