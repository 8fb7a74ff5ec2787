//! `ds4 serve`: the HTTP server agents talk to. The async side (axum) parses
//! dialects, prepares prompts and streams responses; the session runtime
//! (`ds4_runtime`: slots, the reuse plan, checkpoints) runs the jobs.

mod admit;
pub mod anthropic;
pub mod conn;
pub mod dialect;
pub mod http;
pub mod metrics;
mod native;
pub mod normalize;
pub mod notices;
pub mod openai;
pub mod prepare;
mod relay;
pub mod responses;
mod state;
pub mod tooling;
pub mod trace;

pub use conn::{serve, ConnEvent, Limits};
pub use http::{default_body_limit, router};
pub use state::ServerConfig;
