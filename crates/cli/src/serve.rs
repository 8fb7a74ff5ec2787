//! `ds4 serve`: the HTTP server on the default model, with the disk checkpoint store
//! on by default.

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ds4_kvstore::Store;
use ds4_runtime::{Persist, Runtime, RuntimeConfig, ToolMemory};
use ds4_server::metrics::Metrics;
use ds4_server::trace::Trace;
use ds4_server::{default_body_limit, router, ConnEvent, Limits, ServerConfig};

use crate::generate::{load, Loaded};
use crate::kvargs::KvArgs;
use crate::ModelArgs;

#[derive(Args, Clone, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub kv: KvArgs,
    /// Address to listen on (loopback unless you mean otherwise).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require this key as `Authorization: Bearer KEY` or `x-api-key: KEY`.
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Send CORS headers (any origin).
    #[arg(long)]
    pub cors: bool,
    /// Requests waiting for a slot (every slot busy) before new ones get 503
    /// with Retry-After.
    #[arg(long, default_value_t = 16)]
    pub queue_max: usize,
    /// Largest accepted request body, in bytes (413 above it). Default: what a
    /// full context can need, 6 bytes of JSON for each byte of --ctx tokens of
    /// the longest token (at least 1 MiB; 1.9 MiB at --ctx 4096 with SmolLM2).
    #[arg(long, value_name = "BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Seconds a request's headers may take from their first byte (slow
    /// clients are closed).
    #[arg(long, default_value_t = 10.0, value_name = "SECS", value_parser = positive_secs)]
    pub header_timeout: f64,
    /// Seconds a request's body may take to arrive (408 after).
    #[arg(long, default_value_t = 60.0, value_name = "SECS", value_parser = positive_secs)]
    pub body_timeout: f64,
    /// Seconds a kept-alive connection may stay idle between requests.
    #[arg(long, default_value_t = 30.0, value_name = "SECS", value_parser = positive_secs)]
    pub idle_timeout: f64,
    /// Seconds a response may stay unwritable (the client stopped reading)
    /// before its connection is closed and its generation stopped.
    #[arg(long, default_value_t = 60.0, value_name = "SECS", value_parser = positive_secs)]
    pub send_timeout: f64,
    /// Open connections at most; past it new ones get 503 and are closed.
    #[arg(long, default_value_t = 256, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
    /// When listening on loopback, also answer requests whose Host header names
    /// HOST (any port). Other names than loopback ones get 403, so a web page
    /// cannot reach the server by rebinding its own DNS name (repeatable).
    #[arg(long, value_name = "HOST")]
    pub allowed_host: Vec<String>,
    /// Tokens generated when a request sets no limit.
    #[arg(short = 'n', long = "tokens", default_value_t = 2048)]
    pub default_max_tokens: usize,
    /// Write one JSON line per request and per cache decision to FILE (0600).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// In the trace, show prompts only as SHA-1 and length.
    #[arg(long, requires = "trace")]
    pub trace_redact: bool,
    /// Render resent tool calls canonically instead of from the exact text the
    /// model sampled (for comparison: resent history then misses the cache).
    #[arg(long)]
    pub disable_exact_tool_replay: bool,
    /// Tool-call ids remembered for exact replay (least recently used evicted).
    #[arg(long, default_value_t = 100_000, value_name = "N")]
    pub tool_memory_max_ids: usize,
    /// Keep prompts byte-for-byte: do not remove volatile client bytes (Claude
    /// Code's `cch=` billing nonce, --normalize-regex patterns) before rendering.
    #[arg(long)]
    pub no_normalize_prompts: bool,
    /// Also remove matches of this regex from system and user text before
    /// rendering (repeatable).
    #[arg(long, value_name = "REGEX", conflicts_with = "no_normalize_prompts")]
    pub normalize_regex: Vec<String>,
    /// Sessions kept at once (slots), each of --ctx tokens: a request goes to
    /// the slot holding the longest reusable prefix of it, else to the slot its
    /// conversation's keys name, else to the least valuable one. The default
    /// serves a conversation, two parallel subagents and side requests (titles,
    /// quota checks) without evicting the conversation. Busy slots advance
    /// together in one batched forward pass.
    #[arg(long = "batched-session", default_value_t = 4, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub slots: u32,
    /// Answer the first request of each user turn with a tool call when the
    /// client offers tools and leaves `tool_choice` auto (as if `required`: the
    /// model picks the tool and its arguments, held to the call grammar); the
    /// request that brings the result back is answered freely. For models too
    /// small to open a call on their own (the agent-client tests use it).
    #[arg(long)]
    pub tool_first: bool,
    /// How a prompt prefills while other slots generate: `auto` (with two
    /// threads or more, a long prompt runs in whole chunks on half of them,
    /// beside the generating slots on the rest; a short one, or any with one
    /// thread, joins their steps with as many tokens as keep a step within 2.5
    /// times theirs, as measured) or a number (that many prompt tokens join
    /// each of their steps: a long cold prompt delays their tokens by one such
    /// step). With nothing generating it runs whole --prefill-chunk steps on
    /// every thread.
    #[arg(long, default_value = "auto", value_name = "auto|TOKENS")]
    pub mixed_prefill_quantum: ds4_runtime::PrefillQuantum,
    /// Speculative decoding by prompt lookup: each step may carry up to this
    /// many draft tokens, the tokens that followed the latest earlier
    /// occurrence of the last few (an answer that copies its context: a file
    /// being edited, a tool's output). The output is exactly the output
    /// without drafts; 0 turns it off.
    #[arg(long, default_value_t = ds4_runtime::DRAFT_MAX, value_name = "TOKENS",
          value_parser = draft_tokens)]
    pub draft_max: usize,
}

pub fn run(a: &ServeArgs) -> Result<()> {
    let Loaded {
        model,
        session,
        path,
    } = load(&a.model)?;
    let store = a.kv.open(Some(crate::models::ds4_home()?.join("kv")))?;
    // A second handle on the store: the HTTP side looks up tool-call ids in it.
    let lookup = match &store {
        Some(s) => Some(Store::open(s.dir(), s.config().clone())?),
        None => None,
    };
    let max_ids = if a.disable_exact_tool_replay {
        0
    } else {
        a.tool_memory_max_ids
    };
    let tool_memory = Arc::new(ToolMemory::new(max_ids, lookup));
    // Stored responses beside the checkpoints (in memory without a store).
    let conversations = Arc::new(
        ds4_runtime::Conversations::open(
            store.as_ref().map(|s| s.dir().join("responses")).as_deref(),
        )
        .context("opening the stored responses")?,
    );
    let metrics = Arc::new(Metrics::default());
    let trace = match &a.trace {
        Some(f) => Some(Arc::new(
            Trace::create(f, a.trace_redact)
                .with_context(|| format!("creating the trace file {}", f.display()))?,
        )),
        None => None,
    };
    let notices = ds4_server::notices::sink(Arc::clone(&metrics), trace.clone());
    let persist = store.map(|s| {
        Persist::new(
            s,
            &session,
            Some(Arc::clone(&tool_memory)),
            Arc::clone(&notices),
        )
    });
    let n_ctx = session.n_ctx();
    let pool = Arc::clone(session.pool());
    let mut sessions = vec![session];
    while sessions.len() < a.slots as usize {
        let s = sessions[0].sibling(n_ctx);
        sessions.push(s);
    }
    let per_slot = sessions[0].state_memory_bytes();
    eprintln!(
        "ds4 serve: {} slots of {n_ctx} tokens: {:.0} MiB of K/V each, {:.0} MiB in all (pages are \
         taken as they are written)",
        sessions.len(),
        per_slot as f64 / (1 << 20) as f64,
        (per_slot * sessions.len() as u64) as f64 / (1 << 20) as f64
    );
    let runtime = Runtime::start(
        sessions,
        pool,
        persist,
        RuntimeConfig {
            prefill_quantum: a.mixed_prefill_quantum,
            queue_max: a.queue_max,
            draft_max: a.draft_max,
        },
        notices,
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let addr = format!("{}:{}", a.host, a.port);
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(&addr))
        .with_context(|| format!("listening on {addr}"))?;
    let local = listener.local_addr()?;
    let loopback = local.ip().is_loopback();
    if !loopback && !a.allowed_host.is_empty() {
        eprintln!("ds4 serve: --allowed-host has no effect: {local} is not loopback, every Host is answered");
    }
    let cfg = ServerConfig {
        api_key: a.api_key.clone(),
        cors: a.cors,
        max_body_bytes: a.max_body_bytes,
        body_timeout: Duration::from_secs_f64(a.body_timeout),
        allowed_hosts: loopback.then(|| a.allowed_host.clone()),
        default_max_tokens: a.default_max_tokens,
        model_name: path
            .file_stem()
            .map_or_else(|| "ds4".into(), |s| s.to_string_lossy().into_owned()),
        normalize: (!a.no_normalize_prompts).then(|| a.normalize_regex.clone()),
        n_ctx,
        tool_first: a.tool_first,
    };
    let max_body = cfg
        .max_body_bytes
        .unwrap_or_else(|| default_body_limit(&model.tokenizer, n_ctx));
    let app = router(
        cfg,
        runtime.handle.clone(),
        model,
        Arc::clone(&metrics),
        tool_memory,
        conversations,
        trace,
    )
    .context("invalid --normalize-regex pattern")?;
    let limits = Limits {
        max_connections: a.max_connections as usize,
        idle: Duration::from_secs_f64(a.idle_timeout),
        header: Duration::from_secs_f64(a.header_timeout),
        send: Duration::from_secs_f64(a.send_timeout),
    };
    eprintln!(
        "ds4 serve: bodies up to {max_body} bytes; at most {} connections; timeouts: headers {} s, \
         bodies {} s, idle {} s, send {} s",
        limits.max_connections, a.header_timeout, a.body_timeout, a.idle_timeout, a.send_timeout
    );
    let handle = runtime.handle.clone();
    rt.block_on(async move {
        eprintln!("ds4 serve: listening on http://{local}");
        let shutdown = async move {
            wait_for_signal().await;
            eprintln!("ds4 serve: shutting down (finishing in-flight requests, then saving)");
            handle.begin_shutdown();
        };
        let report = move |e: ConnEvent| match e {
            ConnEvent::Refused { open } => {
                // One line per hundred: a flood must not flood the log too.
                if metrics.connection_refused() % 100 == 1 {
                    eprintln!("ds4 serve: refusing connections: {open} open (--max-connections)");
                }
            }
            ConnEvent::AcceptFailed(e) => eprintln!("ds4 serve: accept failed: {e}"),
        };
        ds4_server::serve(listener, app, limits, report, shutdown)
            .await
            .context("serving")
    })?;
    drop(rt);
    runtime.join();
    eprintln!("ds4 serve: stopped");
    Ok(())
}

/// A timeout flag: a positive, finite number of seconds.
fn positive_secs(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() && v < 1e9 => Ok(v),
        _ => Err(format!("{s:?} is not a positive number of seconds")),
    }
}

/// A number of draft tokens a step can carry (`ds4_engine::speculate::MAX_DRAFT`).
pub fn draft_tokens(s: &str) -> Result<usize, String> {
    use ds4_engine::speculate::MAX_DRAFT;
    match s.parse::<usize>() {
        Ok(v) if v <= MAX_DRAFT => Ok(v),
        _ => Err(format!(
            "{s:?} is not a number of draft tokens from 0 to {MAX_DRAFT}"
        )),
    }
}

async fn wait_for_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}
