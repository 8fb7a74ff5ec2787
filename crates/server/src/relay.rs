//! The handler glue every route shares: a parsed request is prepared off the
//! async threads, queued on the runtime as a `Job`, and its events relayed as
//! one JSON body or as SSE in the request's dialect; a client that goes away
//! drops the event channel, which the runtime notices at its next token.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use ds4_chat::turn::{Shaper, Turn};
use ds4_chat::ThinkMode;
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::json;
use tokio::sync::mpsc;

use crate::dialect::{Dialect, ErrorKind, Gen, Input, Request};
use crate::prepare::{prepare, Refusal};
use crate::state::{cpu, AppState, ROUTE, SESSION_KEYS};
use ds4_runtime::{Event, FinishReason, Job, JobError, SubmitError, TokenLimit, Usage};

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
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
pub(crate) fn job_error(d: &dyn Dialect, e: &JobError) -> Response {
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

/// A request's job, ready to submit, with what reads its events back.
pub(crate) struct Queued {
    pub job: Job,
    pub rx: mpsc::Receiver<Event>,
    pub shaper: Shaper,
}

/// Renders and tokenizes `p` off the async threads and builds its job (named
/// `id`), telling `d` what the answer starts with; a refusal is the response.
pub(crate) async fn queue(
    st: &Arc<AppState>,
    p: Request,
    d: &mut dyn Dialect,
    id: &str,
) -> Result<(Request, Queued), Response> {
    let job_id = id.to_string();
    let (p, prepared) = cpu(st, move |st| {
        let mut p = p;
        let r = prepare(st, &mut p, &job_id);
        (p, r)
    })
    .await;
    let r = prepared.map_err(|refusal| refuse(d, refusal))?;
    if p.logprobs.is_some() && (r.think != ThinkMode::None || r.parser.is_some()) {
        // The tokens would be those of the thinking and the calls' markup
        // too, which the answer's content does not show.
        return Err(d.bad_request(crate::dialect::BadRequest::new(
            "logprobs are only given for plain answers: not with tools or thinking",
            Some("logprobs"),
        )));
    }
    let mut sampling = p.sampling.clone();
    if r.think != ThinkMode::None {
        // Thinking runs with the family's own sampling (system spec §6.2);
        // the request's seed and bias still apply.
        sampling = ds4_engine::SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.05,
            ..sampling
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
    let scored = p.echo && p.logprobs.is_some();
    if p.echo {
        let first = r.ids.first().filter(|_| scored);
        let first = first.map(|&id| st.model.tokenizer.prompt_piece(0, id).to_vec());
        d.echo(&r.prompt, first);
    }
    let (tx, rx) = mpsc::channel(256);
    let job = Job {
        id: id.to_string(),
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
        logprobs: p.logprobs,
        prompt_logprobs: p.logprobs.filter(|_| scored),
        meta: json!({ "tool_replay": { "exact": r.replay.exact, "canonical": r.replay.canonical } }),
        events: tx,
    };
    Ok((p, Queued { job, rx, shaper }))
}

/// The 503 a job the runtime did not take gets.
pub(crate) fn not_queued(d: &dyn Dialect, e: SubmitError) -> Response {
    match e {
        SubmitError::QueueFull => {
            let mut r = d.error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the request queue is full (--queue-max); retry shortly",
                ErrorKind::Overloaded,
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            r
        }
        SubmitError::ShuttingDown => d.error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server shutting down",
            ErrorKind::Overloaded,
        ),
    }
}

/// A response's identity: a random id (not a per-process counter: ids do not
/// reveal how many requests the server has served, nor repeat after a
/// restart), the time, the model named.
pub(crate) fn identity(st: &AppState, d: &dyn Dialect, p: &Request) -> Gen {
    Gen {
        id: crate::tooling::random_id(&format!("{}-", d.id_prefix())),
        created: now(),
        model: p.model.clone().unwrap_or_else(|| st.cfg.model_name.clone()),
    }
}

/// Runs a parsed request of any dialect: renders the prompt, queues the job and
/// answers in the dialect's JSON or SSE shape.
pub(crate) async fn run(st: Arc<AppState>, p: Request, mut d: Box<dyn Dialect>) -> Response {
    let g = Arc::new(identity(&st, d.as_ref(), &p));
    let (
        p,
        Queued {
            job,
            mut rx,
            shaper,
        },
    ) = match queue(&st, p, d.as_mut(), &g.id).await {
        Ok(q) => q,
        Err(r) => return r,
    };
    if let Err(e) = st.runtime.submit(job) {
        return not_queued(d.as_ref(), e);
    }

    if !p.stream {
        let mut shaper = shaper;
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Started(_) | Event::Progress { .. } => {}
                Event::Logprobs(l) | Event::PromptLogprobs(l) => d.logprobs(l),
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
    // The dialect (the stream's encoder) travels with the stream's state.
    let body = stream::unfold(Some((rx, shaper, d)), move |state| {
        let (g, st) = (Arc::clone(&g), Arc::clone(&st));
        async move {
            let (mut rx, mut shaper, mut d) = state?;
            let out = match rx.recv().await {
                Some(Event::Progress { .. }) => return Some((vec![], Some((rx, shaper, d)))),
                Some(Event::Logprobs(l) | Event::PromptLogprobs(l)) => {
                    d.logprobs(l);
                    return Some((vec![], Some((rx, shaper, d))));
                }
                Some(Event::Text(t)) => {
                    let events = shaper
                        .push(&t)
                        .iter()
                        .flat_map(|piece| d.stream_piece(&g, piece))
                        .collect();
                    return Some((events, Some((rx, shaper, d))));
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
pub(crate) fn cut_short(finish: FinishReason) -> FinishReason {
    match finish {
        FinishReason::Cancelled => FinishReason::Length,
        f => f,
    }
}

/// Bookkeeping at the end of a turn: notes a call that degraded to text,
/// remembers the exact text of its tool calls, and returns the finish reason the
/// client sees.
pub(crate) fn end_turn(
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

pub(crate) fn sse(
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
pub(crate) fn cache_header(r: &mut Response, u: &Usage) {
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
