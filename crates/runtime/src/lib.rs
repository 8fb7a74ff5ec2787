//! The session runtime that the server, `ds4 chat` and the agent all run on, in
//! process and without HTTP: a [`Job`] (a rendered, tokenized prompt and its
//! generation parameters) goes to one of N slots (sessions), is positioned at
//! the longest reusable prefix (the reuse plan: memory-token, memory-text,
//! disk-text, disk-text-partial, none, with the explanation of a miss and the
//! weighing of disk loads), prefilled in steps that
//! yield to decoding slots, and generated under its sampler, stop sequences and
//! grammar, every busy slot advancing in one batched forward pass per step.
//! Checkpoints are saved by the store's policy (cold, continued, client
//! breakpoints, evict, shutdown). Everything it has to say goes out as
//! [`Event`]s (per job) and [`Notice`]s (for logs, traces and metrics); it
//! prints nothing.

mod constrain;
mod conversations;
mod generation;
mod job;
mod lane;
mod notice;
mod persist;
mod plan;
mod saver;
mod scheduler;
mod template;
mod tool_memory;

pub use constrain::{compile, vocab_for, CallPlan, GateError, GrammarPlan};
pub use conversations::{
    ConversationError, Conversations, MAX_CONVERSATIONS, MAX_CONVERSATION_BYTES,
};
pub use job::{
    tokens_within, CacheSource, Divergence, Event, FinishReason, Gate, Job, JobError, Logprobs,
    Overflow, SubmitError, TokenLimit, TokenLogprob, Usage,
};
pub use notice::{discard, Finished, Notice, NoticeSink, Planned};
pub use persist::{model_id, Offers, Persist, Rates, Restored, StoreUsage, Writer};
pub use plan::{Verdict, Weighed};
pub use scheduler::{
    PrefillQuantum, Runtime, RuntimeConfig, RuntimeHandle, SlotInfo, DRAFT_MAX, STALL_FACTOR,
};
pub use template::template_for;
pub use tool_memory::{ReplayStats, ToolMemory, SECTION_TOOL_IDS};
