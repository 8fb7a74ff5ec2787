//! What the runtime reports besides each job's own events, for whoever runs it
//! to render: the server logs, traces and counts them, `ds4 chat` and the agent
//! show them. Library code prints nothing.

use std::path::PathBuf;
use std::sync::Arc;

use ds4_kvstore::SaveReason;

use crate::job::{CacheSource, Divergence, FinishReason};
use crate::plan::Weighed;

/// One thing that happened.
#[derive(Clone, Debug)]
pub enum Notice {
    /// A job was given a slot, and what its reuse plan decided.
    Planned(Box<Planned>),
    /// A job ended (finished, cancelled or failed after it started).
    Finished(Box<Finished>),
    /// A job was refused before it started (it does not fit the context, its
    /// prompt is empty).
    Refused {
        job: String,
        route: String,
        prompt: String,
        error: String,
    },
    /// A checkpoint was written.
    Saved {
        slot: usize,
        tokens: usize,
        reason: SaveReason,
        file_bytes: u64,
        save_ms: f64,
        path: PathBuf,
    },
    /// A save was not made (it would not fit the budget, or an equal one exists).
    SaveSkipped {
        slot: usize,
        tokens: usize,
        why: String,
    },
    /// A save failed (a full disk, permissions); serving goes on.
    SaveFailed {
        slot: usize,
        tokens: usize,
        reason: SaveReason,
        error: String,
    },
    /// A checkpoint was loaded.
    Restored {
        slot: usize,
        tokens: usize,
        text_bytes: usize,
        load_ms: f64,
        path: PathBuf,
    },
    /// A checkpoint that matched failed to load (damaged, truncated): the
    /// request runs without it.
    LoadFailed { path: Option<PathBuf>, why: String },
    /// A checkpoint whose text matched is not for these sessions (the other K/V
    /// type, other weights): never loaded.
    Skipped {
        path: PathBuf,
        tokens: usize,
        why: String,
    },
    /// A notice of the checkpoint store itself (an eviction, a skipped file).
    Store(String),
}

/// A job's slot and reuse plan.
#[derive(Clone, Debug)]
pub struct Planned {
    pub job: String,
    pub slot: usize,
    pub source: CacheSource,
    pub reused: usize,
    /// Tokens of the loaded checkpoint dropped to reach the shared prefix.
    pub cut: usize,
    pub prompt_tokens: usize,
    /// The checkpoint restored or saved while planning, if any.
    pub checkpoint: Option<PathBuf>,
    pub miss: Option<Box<Divergence>>,
    /// The disk checkpoints weighed (load against prefill) and what became
    /// of each.
    pub weighed: Vec<Weighed>,
    /// Seconds the job waited for a slot.
    pub queue_s: f64,
}

/// How a job ended, with what its trace and metrics record.
#[derive(Clone, Debug)]
pub struct Finished {
    pub job: String,
    pub route: String,
    pub prompt: String,
    /// The job's `meta`, as given.
    pub meta: serde_json::Value,
    pub slot: usize,
    pub prompt_tokens: usize,
    pub source: CacheSource,
    pub reused: usize,
    pub cut: usize,
    pub checkpoint: Option<PathBuf>,
    pub checkpointed: usize,
    pub prefill_s: f64,
    pub decode_s: f64,
    pub queue_s: f64,
    pub generated: usize,
    pub generated_text: String,
    /// Draft tokens its steps carried ([`ds4_engine::speculate`]), and how
    /// many of them were kept.
    pub drafted: usize,
    pub accepted: usize,
    pub finish: FinishReason,
    /// Why a cancelled job was cut short (the client went away, the server is
    /// shutting down); `None` otherwise.
    pub cancelled: Option<&'static str>,
    /// `held` when a grammar held the output, `lazy-unused` when its trigger
    /// never came; `None` without one.
    pub grammar: Option<&'static str>,
    pub grammar_dropped: Option<String>,
    pub grammar_wound_down: bool,
    pub mask_s: f64,
    /// The engine error that ended it, if one did.
    pub error: Option<String>,
}

/// Where notices go: called on the engine thread, so it must be quick.
pub type NoticeSink = Arc<dyn Fn(Notice) + Send + Sync>;

/// A sink that drops everything.
pub fn discard() -> NoticeSink {
    Arc::new(|_| {})
}

/// The one-line log form of each notice (what `ds4 serve` and `ds4 chat` print).
impl std::fmt::Display for Notice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Notice::Planned(p) => write!(
                f,
                "slot {}: cache={} reused={}{} prompt={} queued={:.2}s",
                p.slot,
                p.source.as_str(),
                p.reused,
                cut(p.cut),
                p.prompt_tokens,
                p.queue_s
            ),
            Notice::Finished(r) => write!(
                f,
                "request: cache={} reused={}{} prompt={} prefill={:.2}s generated={}{} decode={:.2}s finish={}{} slot={}{}",
                r.source.as_str(),
                r.reused,
                cut(r.cut),
                r.prompt_tokens,
                r.prefill_s,
                r.generated,
                match r.drafted {
                    0 => String::new(),
                    d => format!(" drafted={d} accepted={}", r.accepted),
                },
                r.decode_s,
                r.finish.as_str(),
                r.cancelled.map_or(String::new(), |why| format!(" ({why})")),
                r.slot,
                r.error.as_ref().map_or(String::new(), |e| format!(" error={e}"))
            ),
            Notice::Refused { job, error, .. } => write!(f, "request {job} refused: {error}"),
            Notice::Saved {
                tokens,
                reason,
                file_bytes,
                save_ms,
                path,
                ..
            } => write!(
                f,
                "kv cache stored tokens={tokens} reason={} size={:.1} MiB save={save_ms:.0} ms file={}",
                reason.as_str(),
                *file_bytes as f64 / (1 << 20) as f64,
                path.display()
            ),
            Notice::SaveSkipped { tokens, why, .. } => {
                write!(f, "kv cache save skipped tokens={tokens}: {why}")
            }
            Notice::SaveFailed {
                tokens,
                reason,
                error,
                ..
            } => write!(
                f,
                "kv cache save failed tokens={tokens} reason={}: {error}",
                reason.as_str()
            ),
            Notice::Restored {
                tokens,
                text_bytes,
                load_ms,
                path,
                ..
            } => write!(
                f,
                "kv cache hit: restored {tokens} tokens ({text_bytes} bytes of text) in {load_ms:.0} ms from {}",
                path.display()
            ),
            Notice::LoadFailed { path: Some(p), why } => {
                write!(f, "kv cache load failed file={}: {why}", p.display())
            }
            Notice::LoadFailed { path: None, why } => write!(f, "kv cache load failed: {why}"),
            Notice::Skipped { path, tokens, why } => {
                write!(f, "kv cache: not loading {} ({tokens} tokens): {why}", path.display())
            }
            Notice::Store(s) => f.write_str(s),
        }
    }
}

/// ` cut=N` when a checkpoint was cut back, else nothing.
fn cut(n: usize) -> String {
    if n > 0 {
        format!(" cut={n}")
    } else {
        String::new()
    }
}
