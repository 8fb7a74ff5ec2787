//! `ds4 serve`: the HTTP server agents talk to. The async side (axum) parses
//! dialects and streams responses; one engine worker thread owns the live session
//! and decides, per request, how much state to reuse (live tokens, live text, disk
//! checkpoint) before prefilling the rest.

mod admit;
pub mod anthropic;
pub mod conn;
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

pub use conn::{serve, ConnEvent, Limits};
pub use http::{default_body_limit, router, ServerConfig};
pub use worker::{CacheSource, Worker, WorkerHandle};
