//! The inference engine: tokenizers, model families (one module per family and a
//! registry), per-sequence state behind one trait, the session (exact tokens,
//! state, next-token logits), a forward pass over several sessions at once, and
//! the sampler. It knows nothing of HTTP or of the checkpoint store.

mod batch;
mod error;
mod kv_type;
mod model;
mod models;
pub mod ops;
mod payload;
pub mod rope;
pub mod sampler;
mod session;
pub mod speculate;
mod state;
pub mod tokenizer;
mod weights;

pub use batch::Batch;
pub use ds4_gguf::{DigestEvent, DigestOptions};
pub use ds4_kernels::pool::{default_threads, ThreadPool};
pub use ds4_kernels::{available_kernel_tiers, kernel_tier, requested_kernel_tier};
pub use error::{EngineError, Result};
pub use kv_type::KvType;
pub use model::{Fingerprint, Model};
pub use models::supported_architectures;
pub use ops::Precision;
pub use payload::{PayloadHeader, PayloadV1Shape, PAYLOAD_MAGIC, PAYLOAD_VERSION};
pub use rope::{RopeRequest, RopeScaling, RopeScalingType};
pub use sampler::{Sampler, SamplerConfig};
pub use session::{Session, SessionOptions, Snapshot};
pub use tokenizer::Tokenizer;
pub use weights::HParams;
