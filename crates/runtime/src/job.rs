//! What a caller hands the runtime and what it gets back: a [`Job`] (a rendered,
//! tokenized prompt with its generation parameters and the keys of the
//! conversation it continues), the [`Event`]s of its generation, and the types
//! those carry (limits, finish reasons, usage with its cache source, the
//! explanation of a reuse miss).

use ds4_engine::SamplerConfig;
use ds4_grammar::Constraint;
use tokio::sync::mpsc;

/// Where a request's reused state came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheSource {
    /// A live slot's tokens are a prefix of the prompt's (cut back to it).
    MemoryToken,
    /// A live slot's text is a prefix of the prompt's, tokenized differently.
    MemoryText,
    /// A disk checkpoint's text is a prefix of the prompt's.
    DiskText,
    /// A disk checkpoint shares a prefix with the prompt and was cut back to
    /// its last token inside it.
    DiskTextPartial,
    None,
}

impl CacheSource {
    pub fn as_str(self) -> &'static str {
        match self {
            CacheSource::MemoryToken => "memory-token",
            CacheSource::MemoryText => "memory-text",
            CacheSource::DiskText => "disk-text",
            CacheSource::DiskTextPartial => "disk-text-partial",
            CacheSource::None => "none",
        }
    }
}

/// A grammar the output is held to: from the first generated token (a forced
/// tool call, structured output), or from the moment the model writes
/// `trigger` (the opening of a tool call) on its own.
pub struct Gate {
    pub constraint: Constraint,
    pub trigger: Option<&'static str>,
}

/// One generation request, rendered and tokenized by the caller.
pub struct Job {
    /// The caller's name for it (a response id), for notices.
    pub id: String,
    /// Where it came from (an HTTP route, `chat`), for notices.
    pub route: String,
    /// The rendered prompt.
    pub prompt: String,
    /// The prompt's own tokens (control tokens only where its markup has them).
    pub ids: Vec<u32>,
    pub sampling: SamplerConfig,
    pub limit: TokenLimit,
    pub stop: Vec<String>,
    /// Keys of the conversation this request continues (`prompt_cache_key`,
    /// session headers, a previous response id, replayed tool-call ids): a
    /// slot that ran a job with one of them is preferred when no slot holds a
    /// reusable prefix.
    pub affinity: Vec<String>,
    /// Byte offsets in `prompt` of client cache breakpoints (Anthropic
    /// `cache_control`), checkpointed when the prefill passes them.
    pub breakpoints: Vec<usize>,
    /// The grammar the output is held to, if any.
    pub gate: Option<Gate>,
    /// Save the slot's whole state once the job is done (its turn end: the
    /// prompt and the answer) under this reason — `turn-end` for a server
    /// conversation, `agent-session` for the agent — so that a crash after
    /// the response loses nothing of it. The save runs on a thread of its
    /// own after the last event: it never delays this response nor another
    /// slot's token. A cancelled or failed job is not saved.
    pub turn_save: Option<ds4_kvstore::SaveReason>,
    /// Report each generated token's log-probability with this many
    /// alternatives ([`Event::Logprobs`]).
    pub logprobs: Option<usize>,
    /// Score the prompt's own tokens, each with this many alternatives
    /// ([`Event::PromptLogprobs`]; legacy completions' `echo` with
    /// `logprobs`, how evaluation harnesses score a continuation). Every
    /// token needs the logits before it, so such a job reuses only what a
    /// slot's last scored prompt shares with it (those tokens' scores are
    /// kept with the slot); the rest is prefilled in shorter steps, and the
    /// prompt is not saved.
    pub prompt_logprobs: Option<usize>,
    /// Opaque fields the caller wants in this job's notices (its trace).
    pub meta: serde_json::Value,
    pub events: mpsc::Sender<Event>,
}

/// How many tokens a job may generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenLimit {
    /// The client's own limit (`max_tokens`): the prompt plus this must fit the
    /// context, or the request is refused with the numbers, so the client can
    /// lower it or compact its history (Claude Code does either from
    /// Anthropic's wording) instead of having it cut silently.
    Requested(usize),
    /// The server's default (`--tokens`) for a request that sets none: cut to
    /// what the context has left.
    Default(usize),
}

impl TokenLimit {
    /// The client's `max_tokens`, else the server's default.
    pub fn of(requested: Option<usize>, default: usize) -> Self {
        match requested {
            Some(m) => TokenLimit::Requested(m),
            None => TokenLimit::Default(default),
        }
    }

    /// The most tokens this limit lets a prompt of `prompt_tokens` generate in
    /// a context of `n_ctx`, or why the request cannot run there.
    pub fn allowed(self, prompt_tokens: usize, n_ctx: usize) -> Result<usize, Overflow> {
        let overflow = |max_tokens| Overflow {
            prompt_tokens,
            at_least: false,
            max_tokens,
            n_ctx,
        };
        if prompt_tokens + 1 > n_ctx {
            return Err(overflow(None));
        }
        match self {
            TokenLimit::Requested(m) if prompt_tokens + m > n_ctx => Err(overflow(Some(m))),
            TokenLimit::Requested(m) => Ok(m),
            TokenLimit::Default(m) => Ok(m.min(n_ctx - prompt_tokens)),
        }
    }

    /// The number of tokens asked for (requested or default).
    pub fn tokens(self) -> usize {
        match self {
            TokenLimit::Requested(m) | TokenLimit::Default(m) => m,
        }
    }
}

/// A request that does not fit the context: the prompt alone (`max_tokens`
/// `None`), or the prompt plus the client's `max_tokens`. Each dialect words it
/// the way its clients recognise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Overflow {
    pub prompt_tokens: usize,
    /// `prompt_tokens` is a lower bound: the prompt was refused from its size,
    /// before it was tokenized.
    pub at_least: bool,
    pub max_tokens: Option<usize>,
    pub n_ctx: usize,
}

impl std::fmt::Display for Overflow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at_least = if self.at_least { "at least " } else { "" };
        match self.max_tokens {
            None => write!(
                f,
                "the prompt is {at_least}{} tokens; this model's context of {} tokens leaves no room to generate",
                self.prompt_tokens, self.n_ctx
            ),
            Some(m) => write!(
                f,
                "the prompt ({at_least}{} tokens) plus max_tokens ({m}) exceed this model's context of {} tokens",
                self.prompt_tokens, self.n_ctx
            ),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    /// The generation limit was reached.
    Length,
    /// The context filled up before the limit (Anthropic's
    /// `model_context_window_exceeded`; `length` in the OpenAI dialects).
    ContextFull,
    /// The turn ended with tool calls (decided from the parsed output by the
    /// caller, not by the runtime).
    ToolCalls,
    /// The client went away or the runtime is stopping.
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length | FinishReason::ContextFull => "length",
            FinishReason::ToolCalls => "tool_calls",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// Tokens of this request written to a checkpoint (cold or continued saves).
    pub checkpointed_tokens: usize,
    pub completion_tokens: usize,
    pub cache_source: CacheSource,
    /// Tokens of the reused state dropped to reach the shared prefix (a
    /// `disk-text-partial` checkpoint cut back; 0 otherwise).
    pub cut_tokens: usize,
    /// Set when a candidate state offered more than was reused: why.
    pub miss: Option<Box<Divergence>>,
    /// The slot that ran it.
    pub slot: usize,
    /// Seconds it waited for a slot.
    pub queue_s: f64,
}

/// Where a prompt first differs from the text of the best reuse candidate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Divergence {
    /// `memory` (a live slot) or `disk` (the checkpoint sharing the most).
    pub candidate: &'static str,
    /// Tokens the candidate holds.
    pub offered_tokens: usize,
    /// Byte offset of the first difference in the rendered prompt.
    pub byte: usize,
    /// Prompt tokens wholly before that byte.
    pub token: usize,
    /// Up to 40 bytes of each side from the difference, escaped to ASCII.
    pub prompt_bytes: String,
    pub candidate_bytes: String,
}

/// How many of `ids` (the length of the piece at each index from `piece_len`)
/// lie wholly within the first `bytes` bytes of their text.
pub fn tokens_within(ids: &[u32], bytes: usize, piece_len: impl Fn(usize, u32) -> usize) -> usize {
    let mut end = 0;
    ids.iter()
        .enumerate()
        .take_while(|&(i, &id)| {
            end += piece_len(i, id);
            end <= bytes
        })
        .count()
}

impl Divergence {
    /// Compares `prompt` (tokenized as `ids`, the length of the piece at each
    /// index from `piece_len`) with a candidate's text.
    pub fn find(
        candidate: &'static str,
        offered_tokens: usize,
        prompt: &[u8],
        text: &[u8],
        ids: &[u32],
        piece_len: impl Fn(usize, u32) -> usize,
    ) -> Self {
        let byte = prompt.iter().zip(text).take_while(|(a, b)| a == b).count();
        let token = tokens_within(ids, byte, piece_len);
        let excerpt = |b: &[u8]| {
            let tail = &b[byte.min(b.len())..];
            String::from_utf8_lossy(&tail[..tail.len().min(40)])
                .escape_default()
                .to_string()
        };
        Divergence {
            candidate,
            offered_tokens,
            byte,
            token,
            prompt_bytes: excerpt(prompt),
            candidate_bytes: excerpt(text),
        }
    }

    /// The header / trace form: `candidate=memory; offered=N; diverge_byte=B; ...`.
    pub fn describe(&self) -> String {
        format!(
            "candidate={}; offered={}; diverge_byte={}; diverge_token={}; prompt_bytes=\"{}\"; candidate_bytes=\"{}\"",
            self.candidate, self.offered_tokens, self.byte, self.token, self.prompt_bytes, self.candidate_bytes
        )
    }
}

/// A token and its log-probability under the model (the raw logits' log
/// softmax: before any bias, grammar mask, filter or temperature).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    /// Its text, control tokens spelled out (a piece of a UTF-8 character is
    /// only part of one).
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

/// A generated token's log-probability and its likeliest alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct Logprobs {
    pub chosen: TokenLogprob,
    /// The [`Job::logprobs`] likeliest tokens, best first.
    pub top: Vec<TokenLogprob>,
}

/// What the runtime reports for a job, in order: `Started`, the prompt's
/// `PromptLogprobs` when the job scores it, any number of `Text` (when the
/// job asks for them, `Logprobs` go just before the text they complete),
/// then `Done` or `Failed`.
#[derive(Clone, Debug)]
pub enum Event {
    /// The prompt and reuse counts (nothing generated or checkpointed yet).
    Started(Usage),
    /// Prompt tokens prefilled so far of those not reused (sent when the
    /// channel has room; for progress bars and keep-alives).
    Progress {
        prefilled: usize,
        total: usize,
    },
    /// Generated tokens whose text is now all emitted: with the `Text` that
    /// follows, or already (a token whose text is empty, the first bytes of
    /// a character the next token completes, goes with the one before). Those
    /// a stop sequence removed are never sent.
    Logprobs(Vec<Logprobs>),
    /// The prompt's tokens from the second on (the first has nothing before
    /// it), in order over one or more events, all before the first
    /// generated token's: for a job with [`Job::prompt_logprobs`].
    PromptLogprobs(Vec<Logprobs>),
    Text(String),
    Done {
        finish: FinishReason,
        usage: Usage,
    },
    Failed(JobError),
}

#[derive(Clone, Debug, thiserror::Error)]
pub enum JobError {
    #[error("{0}")]
    ContextLength(Overflow),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("engine error: {0}")]
    Engine(String),
    #[error("the request was cancelled (the server is shutting down or the client left)")]
    Cancelled,
}

/// Why a job was not queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// Every slot is busy and the queue is full: retry later.
    #[error("every slot is busy and the queue is full")]
    QueueFull,
    #[error("the runtime is shutting down")]
    ShuttingDown,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_requested_limit_must_fit_and_a_default_one_is_cut() {
        let over = |prompt_tokens, max_tokens| Overflow {
            prompt_tokens,
            at_least: false,
            max_tokens,
            n_ctx: 100,
        };
        assert_eq!(TokenLimit::Requested(10).allowed(90, 100), Ok(10));
        assert_eq!(
            TokenLimit::Requested(11).allowed(90, 100),
            Err(over(90, Some(11)))
        );
        assert_eq!(TokenLimit::Default(50).allowed(90, 100), Ok(10));
        assert_eq!(TokenLimit::Default(5).allowed(90, 100), Ok(5));
        for limit in [TokenLimit::Requested(1), TokenLimit::Default(1)] {
            assert_eq!(limit.allowed(99, 100), Ok(1));
            assert_eq!(limit.allowed(100, 100), Err(over(100, None)));
        }
    }
}
