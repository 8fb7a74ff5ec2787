//! The inference engine: tokenizers, model families (one module per family), the
//! session (exact tokens, per-layer state, next-token logits) and the sampler.
//! It knows nothing of HTTP or of the checkpoint store.

mod error;
mod model;
mod models;
pub mod ops;
mod payload;
pub mod rope;
pub mod sampler;
mod session;
pub mod tokenizer;

pub use ds4_gguf::{DigestEvent, DigestOptions};
pub use ds4_kernels::pool::{default_threads, ThreadPool};
pub use ds4_kernels::{available_kernel_tiers, kernel_tier, requested_kernel_tier};
pub use error::{EngineError, Result};
pub use model::{Fingerprint, HParams, Model};
pub use ops::Precision;
pub use payload::{PayloadHeader, PAYLOAD_MAGIC, PAYLOAD_VERSION};
pub use rope::{RopeRequest, RopeScaling, RopeScalingType};
pub use sampler::{Sampler, SamplerConfig};
pub use session::{KvType, Session, SessionOptions, Snapshot};
pub use tokenizer::Tokenizer;
