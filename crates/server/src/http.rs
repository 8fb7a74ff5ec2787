//! The HTTP side: routes, API key, CORS, and the generic request runner. Handlers
//! parse a dialect, render the prompt, queue a job for the engine worker and relay
//! its events as JSON or SSE in the dialect's shape; a client that goes away drops
//! the event channel, which the worker notices at its next token.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request as HttpRequest, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ds4_chat::{Template, ThinkMode};
use ds4_engine::Model;
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::dialect::{Dialect, ErrorKind, Gen, Input, Request};
use crate::metrics::Metrics;
use crate::normalize::Normalizer;
use crate::openai::{self, Kind, OpenAi};
use crate::prepare::{prepare, Refusal};
use crate::trace::Trace;
use ds4_chat::turn::{Shaper, Turn};
use ds4_runtime::ToolMemory;
use ds4_runtime::{
    Event, FinishReason, Job, JobError, RuntimeHandle, SubmitError, TokenLimit, Usage,
};

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub api_key: Option<String>,
    pub cors: bool,
    /// The largest request body; `None`: [`default_body_limit`] of the context.
    pub max_body_bytes: Option<usize>,
    /// Time allowed to receive a request's body.
    pub body_timeout: Duration,
    /// `Some` when the server listens on loopback: the `Host` names it answers
    /// besides loopback ones (`--allowed-host`); `None`: any Host.
    pub allowed_hosts: Option<Vec<String>>,
    /// Generation limit when a request gives none.
    pub default_max_tokens: usize,
    /// The id `/v1/models` lists and responses echo by default.
    pub model_name: String,
    /// Extra normalisation patterns (`--normalize-regex`); `None` turns
    /// normalisation off (`--no-normalize-prompts`).
    pub normalize: Option<Vec<String>>,
    /// The session's context size (thinking modes are gated on it).
    pub n_ctx: usize,
    /// `--tool-first`: a request that opens a user turn (a user message and no
    /// tool result since the last assistant message) with tools offered and
    /// `tool_choice` auto is answered with a call, as if `required`.
    pub tool_first: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            api_key: None,
            cors: false,
            max_body_bytes: None,
            body_timeout: Duration::from_secs(60),
            allowed_hosts: Some(vec![]),
            default_max_tokens: 512,
            model_name: "ds4".into(),
            normalize: Some(vec![]),
            n_ctx: 8192,
            tool_first: false,
        }
    }
}

pub(crate) struct AppState {
    pub cfg: ServerConfig,
    /// The body cap in force (the setting, or the context's default).
    pub max_body_bytes: usize,
    pub runtime: RuntimeHandle,
    /// The served model, for tokenizing on the HTTP side (token counts).
    pub model: Arc<Model>,
    pub template: Option<Box<dyn Template>>,
    /// The vocabulary for constrained decoding, or why there is none.
    pub grammar: Result<ds4_grammar::Vocab, String>,
    pub metrics: Arc<Metrics>,
    pub tool_memory: Arc<ToolMemory>,
    /// Stored Responses conversations (`previous_response_id`).
    pub conversations: Arc<ds4_runtime::Conversations>,
    pub trace: Option<Arc<Trace>>,
    pub normalizer: Normalizer,
    /// Permits for request CPU work ([`cpu`]): one per core.
    cpu_slots: tokio::sync::Semaphore,
}

/// The default body cap: six bytes of JSON (a `\u0000` escape) for every byte
/// a full context can hold (`n_ctx` tokens of the longest piece), at least 1
/// MiB. A body is read whole before anything else, so this is what one request
/// can make the server hold: 1.9 MiB at 4096 tokens of SmolLM2 (81-byte longest
/// token), 15.2 MiB at 32768.
pub fn default_body_limit(tok: &ds4_engine::Tokenizer, n_ctx: usize) -> usize {
    n_ctx
        .saturating_mul(tok.longest_piece())
        .saturating_mul(6)
        .max(1 << 20)
}

/// Builds the router over a running worker of `model`; `tool_memory` is shared
/// with the worker's checkpoints, `conversations` keeps stored responses.
/// Fails only on an invalid normalisation pattern.
pub fn router(
    cfg: ServerConfig,
    runtime: RuntimeHandle,
    model: Arc<Model>,
    metrics: Arc<Metrics>,
    tool_memory: Arc<ToolMemory>,
    conversations: Arc<ds4_runtime::Conversations>,
    trace: Option<Arc<Trace>>,
) -> Result<Router, regex::Error> {
    let max_body = cfg
        .max_body_bytes
        .unwrap_or_else(|| default_body_limit(&model.tokenizer, cfg.n_ctx));
    let template = ds4_runtime::template_for(&model);
    let grammar = ds4_runtime::vocab_for(&model, template.as_deref());
    let normalizer = match &cfg.normalize {
        Some(extra) => Normalizer::new(extra)?,
        None => Normalizer::off(),
    };
    let state = Arc::new(AppState {
        cfg,
        max_body_bytes: max_body,
        runtime,
        model,
        template,
        grammar,
        metrics,
        tool_memory,
        conversations,
        trace,
        normalizer,
        cpu_slots: tokio::sync::Semaphore::new(
            std::thread::available_parallelism().map_or(2, |n| n.get()),
        ),
    });
    Ok(Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(crate::anthropic::messages))
        .route(
            "/v1/messages/count_tokens",
            post(crate::anthropic::count_tokens),
        )
        .route("/v1/responses", post(crate::responses::create))
        .route("/v1/models", get(models))
        .route("/", get(root))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/slots", get(slots))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body))
        .layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            crate::admit::guard,
        ))
        .with_state(state))
}

/// The dialect whose error shape answers a request to `path` that no handler
/// parsed (authentication, body size, unknown routes).
pub(crate) fn dialect_for_path(path: &str) -> Arc<dyn Dialect> {
    if path.starts_with("/v1/messages") {
        return Arc::new(crate::anthropic::Anthropic::default());
    }
    Arc::new(OpenAi(Kind::Chat))
}

async fn not_found(req: HttpRequest) -> Response {
    let msg = format!("unknown endpoint {} {}", req.method(), req.uri().path());
    dialect_for_path(req.uri().path()).error(StatusCode::NOT_FOUND, &msg, ErrorKind::NotFound)
}

async fn method_not_allowed(req: HttpRequest) -> Response {
    let msg = format!(
        "method {} is not allowed on {}",
        req.method(),
        req.uri().path()
    );
    dialect_for_path(req.uri().path()).error(
        StatusCode::METHOD_NOT_ALLOWED,
        &msg,
        ErrorKind::InvalidRequest,
    )
}

tokio::task_local! {
    /// The path of the request a handler is serving, for the trace.
    pub(crate) static ROUTE: String;
    /// The session ids its headers name (opencode's `x-session-affinity` and
    /// `x-session-id`, Codex's `session_id`), as affinity keys.
    pub(crate) static SESSION_KEYS: Vec<String>;
}

/// The affinity keys of a request's headers ([`SESSION_KEYS`]).
pub(crate) fn session_keys(h: &axum::http::HeaderMap) -> Vec<String> {
    ["x-session-affinity", "x-session-id", "session_id"]
        .iter()
        .filter_map(|name| h.get(*name)?.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 256)
        .map(|v| format!("session:{v}"))
        .collect()
}

async fn metrics_text(State(st): State<Arc<AppState>>) -> Response {
    if let Some(u) = st.runtime.store_usage() {
        st.metrics.store(&u);
    }
    let body = st
        .metrics
        .render(st.runtime.queue_depth(), &st.runtime.slots());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

/// `GET /slots`: each slot's state (busy, tokens held, the SHA-1 of the text
/// they stand for, idle seconds, state bytes).
async fn slots(State(st): State<Arc<AppState>>) -> Json<Value> {
    let slots: Vec<Value> = st
        .runtime
        .slots()
        .iter()
        .map(|s| {
            json!({
                "id": s.id, "busy": s.busy, "tokens": s.tokens, "n_ctx": s.n_ctx,
                "text_sha1": s.text_sha1.iter().map(|b| format!("{b:02x}")).collect::<String>(),
                "idle_s": s.idle_s, "state_bytes": s.state_bytes,
            })
        })
        .collect();
    Json(json!({ "slots": slots, "queue_depth": st.runtime.queue_depth() }))
}

/// `GET /` and `HEAD /` (Claude Code's connectivity check before a session).
async fn root(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({ "name": "ds4", "model": st.cfg.model_name, "status": "ok" }))
}

async fn health(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({ "status": "ok", "queue_depth": st.runtime.queue_depth() }))
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    let hp = &st.model.hparams;
    Json(json!({
        "object": "list",
        "data": [{
            "id": st.cfg.model_name, "object": "model", "created": 0, "owned_by": "ds4",
            "meta": { "arch": hp.arch, "n_vocab": hp.n_vocab, "n_ctx_train": hp.n_ctx_train, "n_embd": hp.n_embd },
        }],
    }))
}

async fn chat_completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let d: Arc<dyn Dialect> = Arc::new(OpenAi(Kind::Chat));
    match cpu(&st, move |_| openai::parse_chat(&body)).await {
        Ok(p) => run(st, p, d).await,
        Err(e) => d.bad_request(e),
    }
}

async fn completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let d: Arc<dyn Dialect> = Arc::new(OpenAi(Kind::Completion));
    match cpu(&st, move |_| openai::parse_completion(&body)).await {
        Ok(p) => run(st, p, d).await,
        Err(e) => d.bad_request(e),
    }
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Runs CPU work of a request (parsing, rendering, tokenizing, compiling a
/// grammar) on a blocking thread, at most one per core at a time, so that
/// neither the async threads nor the engine wait for it. A panic in `f`
/// propagates as if it had run here.
pub(crate) async fn cpu<T: Send + 'static>(
    st: &Arc<AppState>,
    f: impl FnOnce(&AppState) -> T + Send + 'static,
) -> T {
    let _slot = st.cpu_slots.acquire().await;
    let st = Arc::clone(st);
    match tokio::task::spawn_blocking(move || f(&st)).await {
        Ok(v) => v,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// The 400 a refused request gets, in the dialect's shape.
pub(crate) fn refuse(d: &dyn Dialect, r: Refusal) -> Response {
    match r {
        Refusal::Invalid(m) => d.error(StatusCode::BAD_REQUEST, &m, ErrorKind::InvalidRequest),
        Refusal::Overflow(o) => job_error(d, &JobError::ContextLength(o)),
        Refusal::Schema(m) => d.bad_request(crate::dialect::BadRequest::new(
            format!("the output schema cannot be used: {m}"),
            None,
        )),
    }
}

/// The error response a job failure turns into, in the dialect's shape.
fn job_error(d: &dyn Dialect, e: &JobError) -> Response {
    let (status, kind) = match e {
        JobError::ContextLength(o) => {
            return d.error(
                StatusCode::BAD_REQUEST,
                &d.overflow_message(o),
                ErrorKind::ContextLength,
            )
        }
        JobError::EmptyPrompt => (StatusCode::BAD_REQUEST, ErrorKind::InvalidRequest),
        JobError::Engine(_) => (StatusCode::INTERNAL_SERVER_ERROR, ErrorKind::Server),
        JobError::Cancelled => (StatusCode::SERVICE_UNAVAILABLE, ErrorKind::Overloaded),
    };
    d.error(status, &e.to_string(), kind)
}

/// Runs a parsed request of any dialect: renders the prompt, queues the job and
/// answers in the dialect's JSON or SSE shape.
pub(crate) async fn run(st: Arc<AppState>, p: Request, d: Arc<dyn Dialect>) -> Response {
    // Random, not a per-process counter: ids do not reveal how many requests
    // the server has served, nor repeat after a restart.
    let id = crate::tooling::random_id(&format!("{}-", d.id_prefix()));
    let job_id = id.clone();
    let (p, prepared) = cpu(&st, move |st| {
        let mut p = p;
        let r = prepare(st, &mut p, &job_id);
        (p, r)
    })
    .await;
    let r = match prepared {
        Ok(r) => r,
        Err(refusal) => return refuse(d.as_ref(), refusal),
    };
    let mut sampling = p.sampling.clone();
    if r.think != ThinkMode::None {
        // Thinking runs with the family's own sampling (system spec §6.2).
        sampling = ds4_engine::SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.05,
            seed: sampling.seed,
        };
    }
    let shaper = {
        let prefix = d.call_id_prefix();
        Shaper::new(
            r.think,
            r.parser,
            r.forced.as_deref(),
            Box::new(move || crate::tooling::random_id(prefix)),
        )
    };
    let (tx, mut rx) = mpsc::channel(256);
    let job = Job {
        id: id.clone(),
        route: ROUTE.try_with(Clone::clone).unwrap_or_default(),
        prompt: r.prompt,
        ids: r.ids,
        sampling,
        limit: TokenLimit::of(p.max_tokens, st.cfg.default_max_tokens),
        stop: p.stop.clone(),
        affinity: affinity(&p),
        breakpoints: r.breakpoints,
        gate: r.gate,
        turn_save: Some(ds4_kvstore::SaveReason::TurnEnd),
        meta: json!({ "tool_replay": { "exact": r.replay.exact, "canonical": r.replay.canonical } }),
        events: tx,
    };
    match st.runtime.submit(job) {
        Ok(()) => {}
        Err(SubmitError::QueueFull) => {
            let mut r = d.error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the request queue is full (--queue-max); retry shortly",
                ErrorKind::Overloaded,
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            return r;
        }
        Err(SubmitError::ShuttingDown) => {
            return d.error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server shutting down",
                ErrorKind::Overloaded,
            )
        }
    }
    let g = Arc::new(Gen {
        id,
        created: now(),
        model: p.model.clone().unwrap_or_else(|| st.cfg.model_name.clone()),
    });

    if !p.stream {
        let mut shaper = shaper;
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Started(_) | Event::Progress { .. } => {}
                Event::Text(t) => {
                    shaper.push(&t);
                }
                Event::Done { finish, usage } => {
                    let finish = cut_short(finish);
                    let (_, turn) = shaper.finish();
                    let finish = end_turn(&st, &g, &turn, finish, &usage);
                    let mut r = Json(d.complete(&g, &turn, finish, &usage)).into_response();
                    cache_header(&mut r, &usage);
                    return r;
                }
                Event::Failed(e) => return job_error(d.as_ref(), &e),
            }
        }
        return d.error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the engine stopped",
            ErrorKind::Server,
        );
    }

    // Streaming: wait for the start (an early failure is answered as plain JSON),
    // then relay. The start comes before the prefill, so the headers go out early
    // and keep-alive comments cover a long prefill.
    let started = match rx.recv().await {
        Some(Event::Started(usage)) => usage,
        Some(Event::Failed(e)) => return job_error(d.as_ref(), &e),
        _ => {
            return d.error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the engine stopped",
                ErrorKind::Server,
            )
        }
    };
    let head = stream::iter(d.stream_start(&g, &started));
    let include_usage = p.include_usage;
    let body = stream::unfold(Some((rx, shaper)), move |state| {
        let (d, g, st) = (Arc::clone(&d), Arc::clone(&g), Arc::clone(&st));
        async move {
            let (mut rx, mut shaper) = state?;
            let out = match rx.recv().await {
                Some(Event::Progress { .. }) => return Some((vec![], Some((rx, shaper)))),
                Some(Event::Text(t)) => {
                    let events = shaper
                        .push(&t)
                        .iter()
                        .flat_map(|piece| d.stream_piece(&g, piece))
                        .collect();
                    return Some((events, Some((rx, shaper))));
                }
                Some(Event::Done { finish, usage }) => {
                    let finish = cut_short(finish);
                    let (pieces, turn) = shaper.finish();
                    let finish = end_turn(&st, &g, &turn, finish, &usage);
                    let mut events: Vec<SseEvent> = pieces
                        .iter()
                        .flat_map(|piece| d.stream_piece(&g, piece))
                        .collect();
                    events.extend(d.stream_end(&g, &turn, finish, &usage, include_usage));
                    events
                }
                Some(Event::Failed(e)) => d.stream_error(&g, &e.to_string()),
                Some(Event::Started(_)) | None => d.stream_error(&g, "the engine stopped"),
            };
            Some((out, None))
        }
    })
    .flat_map(stream::iter);
    let mut r = sse(head.chain(body).map(Ok::<_, Infallible>)).into_response();
    cache_header(&mut r, &started);
    r
}

/// The keys of the conversation `p` continues: its body's, its headers', and
/// the ids of the tool calls its history replays.
fn affinity(p: &Request) -> Vec<String> {
    let mut keys = p.agent.affinity.clone();
    keys.extend(SESSION_KEYS.try_with(Clone::clone).unwrap_or_default());
    if let Input::Messages(messages) = &p.input {
        keys.extend(
            messages
                .iter()
                .flat_map(|m| &m.tool_calls)
                .map(|c| format!("call:{}", c.id)),
        );
    }
    keys
}

/// A job the runtime ended early (the server is stopping) reads as one cut at
/// its limit: the dialects have no word for a cancellation.
fn cut_short(finish: FinishReason) -> FinishReason {
    match finish {
        FinishReason::Cancelled => FinishReason::Length,
        f => f,
    }
}

/// Bookkeeping at the end of a turn: notes a call that degraded to text,
/// remembers the exact text of its tool calls, and returns the finish reason the
/// client sees.
fn end_turn(
    st: &AppState,
    g: &Gen,
    turn: &Turn,
    finish: FinishReason,
    usage: &Usage,
) -> FinishReason {
    if let Some(reason) = &turn.malformed {
        eprintln!(
            "request {}: a malformed tool call was returned as text: {reason}",
            g.id
        );
        if let Some(t) = &st.trace {
            t.write(json!({ "event": "tool_call_malformed", "id": g.id, "reason": reason }));
        }
    }
    if turn.calls.is_empty() {
        return finish;
    }
    let ids: Vec<String> = turn.calls.iter().map(|c| c.id.clone()).collect();
    st.tool_memory.remember(&ids, &turn.calls_raw);
    // The next request replays these calls: it continues this slot's
    // conversation.
    st.runtime.tag(
        usage.slot,
        ids.iter().map(|id| format!("call:{id}")).collect(),
    );
    FinishReason::ToolCalls
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

/// `x-ds4-cache: SOURCE; reused=N; prompt=M` (with `; cut=K` when a
/// `disk-text-partial` checkpoint was cut back by K tokens), for clients and
/// operators, and when a candidate offered more than was reused, where the prompt diverged from
/// it (`; candidate=memory; offered=K; diverge_byte=B; diverge_token=T;
/// prompt_bytes="..."; candidate_bytes="..."`, escaped to ASCII).
fn cache_header(r: &mut Response, u: &Usage) {
    let mut v = format!(
        "{}; reused={}; prompt={}",
        u.cache_source.as_str(),
        u.cached_tokens,
        u.prompt_tokens
    );
    if u.cut_tokens > 0 {
        v.push_str(&format!("; cut={}", u.cut_tokens));
    }
    if let Some(m) = &u.miss {
        v.push_str("; ");
        v.push_str(&m.describe());
    }
    if let Ok(v) = HeaderValue::from_str(&v) {
        r.headers_mut().insert("x-ds4-cache", v);
    }
}
