//! The HTTP side: the router (each route's handler lives with its dialect and
//! runs through `relay::run`; llama.cpp's tokenizer routes in `native`), the
//! admission layer in front of it, the body cap, and the read-only routes
//! (models, health, slots, metrics).

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request as HttpRequest, State};
use axum::http::{header, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ds4_engine::Model;
use ds4_runtime::{RuntimeHandle, ToolMemory};
use serde_json::{json, Value};

use crate::admit::dialect_for_path;
use crate::dialect::ErrorKind;
use crate::metrics::Metrics;
use crate::normalize::Normalizer;
use crate::openai::{chat_completions, completions};
use crate::state::{AppState, ServerConfig};
use crate::trace::Trace;

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
        .route("/tokenize", post(crate::native::tokenize))
        .route("/detokenize", post(crate::native::detokenize))
        .route("/apply-template", post(crate::native::apply_template))
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
    let hp = st.model.hparams();
    Json(json!({
        "object": "list",
        "data": [{
            "id": st.cfg.model_name, "object": "model", "created": 0, "owned_by": "ds4",
            "meta": { "arch": hp.arch, "n_vocab": hp.n_vocab, "n_ctx_train": hp.n_ctx_train, "n_embd": hp.n_embd },
        }],
    }))
}

#[cfg(test)]
mod tests {
    // Here, above every dialect: the same sampling fields checked by each.
    /// One field, one check, on every route: what chat refuses, Anthropic and
    /// Responses refuse too (they used to ignore `min_p`, `n` and `seed`).
    #[test]
    fn sampling_fields_are_checked_alike_on_every_route() {
        let chat = |extra: &str| {
            crate::openai::parse_chat(
                format!(r#"{{"messages":[{{"role":"user","content":"x"}}]{extra}}}"#).as_bytes(),
            )
            .err()
        };
        let completion = |extra: &str| {
            crate::openai::parse_completion(format!(r#"{{"prompt":"x"{extra}}}"#).as_bytes()).err()
        };
        let messages = |extra: &str| {
            crate::anthropic::parse_messages(
                format!(
                    r#"{{"max_tokens":5,"messages":[{{"role":"user","content":"x"}}]{extra}}}"#
                )
                .as_bytes(),
            )
            .err()
        };
        let responses = |extra: &str| {
            crate::responses::parse(format!(r#"{{"input":"x"{extra}}}"#).as_bytes()).err()
        };
        type Parse<'a> = &'a dyn Fn(&str) -> Option<crate::dialect::BadRequest>;
        let routes: [(&str, Parse); 4] = [
            ("chat", &chat),
            ("completions", &completion),
            ("messages", &messages),
            ("responses", &responses),
        ];
        for (route, parse) in routes {
            for (extra, names) in [
                (r#","min_p":5"#, "min_p"),
                (r#","n":17"#, "n"),
                (r#","top_p":0"#, "top_p"),
                (r#","seed":1e30"#, "seed"),
                (r#","seed":-1"#, "seed"),
                (r#","top_k":"many""#, "top_k"),
            ] {
                let e = parse(extra).unwrap_or_else(|| panic!("{route} accepted {extra}"));
                assert!(
                    e.param == Some(names) || e.message.contains("invalid"),
                    "{route} {extra}: {e:?}"
                );
            }
            for ok in [r#","min_p":0.1,"n":1,"seed":7,"top_k":5,"top_p":0.5"#, ""] {
                assert_eq!(parse(ok), None, "{route} refused {ok}");
            }
        }
    }
}
