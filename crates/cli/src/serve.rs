//! `ds4 serve`: the HTTP server on the default model, with the disk checkpoint store
//! on by default.

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::sync::Arc;

use ds4_kvstore::Store;
use ds4_server::metrics::Metrics;
use ds4_server::persist::Persist;
use ds4_server::tooling::ToolMemory;
use ds4_server::trace::Trace;
use ds4_server::{router, ServerConfig, Worker};

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
    /// Requests waiting for the engine before new ones get 503.
    #[arg(long, default_value_t = 16)]
    pub queue_max: usize,
    /// Largest accepted request body.
    #[arg(long, default_value_t = 64 << 20)]
    pub max_body_bytes: usize,
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
    /// Context of the side slot that serves short requests sharing nothing with
    /// the live conversation (title generation, quota checks), so they do not
    /// evict it; 0 disables the side slot.
    #[arg(long, default_value_t = 4096, value_name = "TOKENS")]
    pub side_ctx: usize,
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
    let persist = store.map(|s| {
        let mut p = Persist::new(s, &session);
        p.tool_memory = Some(Arc::clone(&tool_memory));
        p
    });
    let metrics = Arc::new(Metrics::default());
    let trace = match &a.trace {
        Some(f) => Some(Arc::new(
            Trace::create(f, a.trace_redact)
                .with_context(|| format!("creating the trace file {}", f.display()))?,
        )),
        None => None,
    };
    let n_ctx = session.n_ctx();
    let worker = Worker::start(
        session,
        persist,
        a.side_ctx,
        a.queue_max,
        Arc::clone(&metrics),
        trace.clone(),
    );
    let cfg = ServerConfig {
        api_key: a.api_key.clone(),
        cors: a.cors,
        max_body_bytes: a.max_body_bytes,
        default_max_tokens: a.default_max_tokens,
        model_name: path
            .file_stem()
            .map_or_else(|| "ds4".into(), |s| s.to_string_lossy().into_owned()),
        normalize: (!a.no_normalize_prompts).then(|| a.normalize_regex.clone()),
        n_ctx,
    };
    let app = router(
        cfg,
        worker.handle.clone(),
        model,
        metrics,
        tool_memory,
        trace,
    )
    .context("invalid --normalize-regex pattern")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let handle = worker.handle.clone();
    rt.block_on(async move {
        let addr = format!("{}:{}", a.host, a.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("listening on {addr}"))?;
        eprintln!("ds4 serve: listening on http://{}", listener.local_addr()?);
        let shutdown = async move {
            wait_for_signal().await;
            eprintln!("ds4 serve: shutting down (finishing in-flight requests, then saving)");
            handle.begin_shutdown();
        };
        ds4_server::serve(listener, app, shutdown)
            .await
            .context("serving")
    })?;
    drop(rt);
    worker.join();
    eprintln!("ds4 serve: stopped");
    Ok(())
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
