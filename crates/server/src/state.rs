//! What every request handler shares: the server's settings, the state the
//! router holds (`AppState`), the request-scoped values the admission layer
//! sets (route, session keys), and the pool of CPU permits for request work.

use std::sync::Arc;
use std::time::Duration;

use ds4_chat::Template;
use ds4_engine::Model;
use ds4_runtime::{RuntimeHandle, ToolMemory};

use crate::metrics::Metrics;
use crate::normalize::Normalizer;
use crate::trace::Trace;

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub api_key: Option<String>,
    pub cors: bool,
    /// The largest request body; `None`: the context's default
    /// (`default_body_limit`).
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
    pub(crate) cpu_slots: tokio::sync::Semaphore,
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
