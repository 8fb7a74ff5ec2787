//! `ds4 serve`: the HTTP server agents talk to. The async side (axum) parses
//! dialects and streams responses; one engine worker thread owns the live session
//! and decides, per request, how much state to reuse (live tokens, live text, disk
//! checkpoint) before prefilling the rest.

pub mod anthropic;
pub mod dialect;
pub mod http;
pub mod metrics;
pub mod normalize;
pub mod openai;
pub mod persist;
pub mod prepare;
pub mod responses;
pub mod tooling;
pub mod trace;
pub mod turn;
pub mod worker;

use std::future::Future;

pub use http::{router, ServerConfig};
pub use worker::{CacheSource, Worker, WorkerHandle};

/// Serves `app` on `listener` until `shutdown` resolves, then stops accepting and
/// lets in-flight responses finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}
