//! The engine worker: one thread that owns the live session and runs requests one
//! at a time, outside the async runtime. For each request it picks the cheapest
//! state to start from — the live session's token prefix (`memory-token`), the live
//! session's rendered text (`memory-text`), a disk checkpoint (`disk-text`), or
//! nothing (`none`) — prefills only the rest, and streams the generated text back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use ds4_engine::tokenizer::StreamDecoder;
use ds4_engine::{EngineError, Sampler, SamplerConfig, Session};
use ds4_kvstore::SaveReason;
use tokio::sync::mpsc as tmpsc;

use crate::metrics::{JobStats, Metrics};
use crate::persist::Persist;
use crate::trace::Trace;
use serde_json::json;

/// Where a request's reused state came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheSource {
    MemoryToken,
    MemoryText,
    DiskText,
    None,
}

impl CacheSource {
    pub fn as_str(self) -> &'static str {
        match self {
            CacheSource::MemoryToken => "memory-token",
            CacheSource::MemoryText => "memory-text",
            CacheSource::DiskText => "disk-text",
            CacheSource::None => "none",
        }
    }
}

/// One generation request, already rendered to prompt text.
pub struct Job {
    /// Response id, for the trace.
    pub id: String,
    /// The HTTP route it came in on, for the trace.
    pub route: String,
    pub prompt: String,
    pub sampling: SamplerConfig,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// How the request's history tool calls were rendered, for the trace.
    pub replay: crate::tooling::ReplayStats,
    /// OpenAI `prompt_cache_key`: requests with one key stay on one slot.
    pub cache_key: Option<String>,
    /// Byte offsets in `prompt` of client cache breakpoints (Anthropic
    /// `cache_control`), checkpointed when the prefill passes them.
    pub breakpoints: Vec<usize>,
    pub events: tmpsc::Sender<Event>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    /// The turn ended with tool calls (decided from the parsed output, not by the
    /// worker).
    ToolCalls,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// Tokens of this request written to a checkpoint (cold or continued saves).
    pub checkpointed_tokens: usize,
    pub completion_tokens: usize,
    pub cache_source: CacheSource,
    /// Set when a candidate state offered more than was reused: why.
    pub miss: Option<Box<Divergence>>,
}

/// Where a prompt first differs from the text of the best reuse candidate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Divergence {
    /// `memory` (the live session) or `disk` (the checkpoint sharing the most).
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

/// How many of `ids` (whose text lengths `piece_len` gives) lie wholly within
/// the first `bytes` bytes of their text.
pub fn tokens_within(ids: &[u32], bytes: usize, piece_len: impl Fn(u32) -> usize) -> usize {
    let mut end = 0;
    ids.iter()
        .take_while(|&&id| {
            end += piece_len(id);
            end <= bytes
        })
        .count()
}

impl Divergence {
    /// Compares `prompt` (tokenized as `ids`, piece lengths from `piece_len`) with
    /// a candidate's text.
    pub fn find(
        candidate: &'static str,
        offered_tokens: usize,
        prompt: &[u8],
        text: &[u8],
        ids: &[u32],
        piece_len: impl Fn(u32) -> usize,
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

/// What the worker reports, in order: `Started`, any number of `Text`, then `Done`
/// or `Failed`.
#[derive(Clone, Debug)]
pub enum Event {
    /// The prompt and reuse counts (nothing generated or checkpointed yet).
    Started(Usage),
    Text(String),
    Done {
        finish: FinishReason,
        usage: Usage,
    },
    Failed(JobError),
}

#[derive(Clone, Debug, thiserror::Error)]
pub enum JobError {
    #[error("this model's maximum context length is {n_ctx} tokens; the request needs {needed} (prompt {prompt_tokens} + at least 1 generated)")]
    ContextLength {
        n_ctx: usize,
        needed: usize,
        prompt_tokens: usize,
    },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("engine error: {0}")]
    Engine(String),
    #[error("the request was cancelled (the server is shutting down or the client left)")]
    Cancelled,
}

/// Submits jobs to the worker thread.
#[derive(Clone)]
pub struct WorkerHandle {
    tx: mpsc::SyncSender<Job>,
    depth: Arc<AtomicUsize>,
    stopping: Arc<AtomicBool>,
}

/// Why a job was not queued.
#[derive(Debug, PartialEq, Eq)]
pub enum SubmitError {
    QueueFull,
    ShuttingDown,
}

impl WorkerHandle {
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        if self.stopping.load(Ordering::Acquire) {
            return Err(SubmitError::ShuttingDown);
        }
        self.depth.fetch_add(1, Ordering::AcqRel);
        match self.tx.try_send(job) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.depth.fetch_sub(1, Ordering::AcqRel);
                Err(match e {
                    mpsc::TrySendError::Full(_) => SubmitError::QueueFull,
                    mpsc::TrySendError::Disconnected(_) => SubmitError::ShuttingDown,
                })
            }
        }
    }

    /// Jobs queued or running.
    pub fn queue_depth(&self) -> usize {
        self.depth.load(Ordering::Acquire)
    }

    /// Stops new jobs and makes the running one end at its next token.
    pub fn begin_shutdown(&self) {
        self.stopping.store(true, Ordering::Release);
    }
}

/// The worker thread; `join` waits for it to finish the queue and save.
pub struct Worker {
    pub handle: WorkerHandle,
    thread: std::thread::JoinHandle<()>,
}

impl Worker {
    /// Starts the worker on `session`, with `persist` for disk checkpoints and a
    /// side slot of `side_ctx` tokens (0: none) for short unrelated requests.
    pub fn start(
        session: Session,
        persist: Option<Persist>,
        side_ctx: usize,
        queue_max: usize,
        metrics: Arc<Metrics>,
        trace: Option<Arc<Trace>>,
    ) -> Self {
        let (tx, rx) = mpsc::sync_channel::<Job>(queue_max.max(1));
        let depth = Arc::new(AtomicUsize::new(0));
        let stopping = Arc::new(AtomicBool::new(false));
        let handle = WorkerHandle {
            tx,
            depth: Arc::clone(&depth),
            stopping: Arc::clone(&stopping),
        };
        let thread = std::thread::Builder::new()
            .name("ds4-engine".into())
            .spawn(move || {
                let mut state = WorkerState {
                    session,
                    side: None,
                    side_ctx,
                    slot_keys: HashMap::new(),
                    persist,
                    stopping,
                    metrics,
                    trace,
                };
                while let Ok(job) = rx.recv() {
                    state.run(job);
                    depth.fetch_sub(1, Ordering::AcqRel);
                }
                state.shutdown_save();
            })
            .expect("spawning the engine thread");
        Worker { handle, thread }
    }

    /// Waits for the worker to drain (after every handle is dropped) and save.
    pub fn join(self) {
        let Worker { handle, thread } = self;
        drop(handle);
        let _ = thread.join();
    }
}

/// Which session a job runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    /// The live conversation, checkpointed to disk.
    Main,
    /// Short requests that share nothing with the main conversation (title
    /// generation, quota checks): served here so the main state stays live.
    Side,
}

/// Keys remembered for `prompt_cache_key` slot affinity.
const MAX_SLOT_KEYS: usize = 4096;

/// The main session is worth protecting from a short unrelated request once it
/// holds this many tokens.
const PROTECT_MIN_TOKENS: usize = 64;

struct WorkerState {
    /// The session the running job uses (the main one between jobs).
    session: Session,
    /// The other slot while a side job runs; the side session between jobs.
    side: Option<Session>,
    side_ctx: usize,
    slot_keys: HashMap<String, Slot>,
    persist: Option<Persist>,
    stopping: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
    trace: Option<Arc<Trace>>,
}

/// What a session holds of a prompt.
struct Held {
    /// Its tokens that are a prefix of the prompt's tokens.
    by_token: usize,
    /// When all its tokens are not, but their text is a prefix of the prompt:
    /// that text's length in bytes.
    by_text: Option<usize>,
}

impl Held {
    fn of(session: &Session, prompt: &str, ids: &[u32]) -> Held {
        let live = session.tokens();
        let by_token = live.iter().zip(ids).take_while(|(a, b)| a == b).count();
        let by_text = (by_token < live.len())
            .then(|| session.model().tokenizer.decode(live, true))
            .filter(|text| {
                prompt.as_bytes().starts_with(text) && prompt.is_char_boundary(text.len())
            })
            .map(|text| text.len());
        Held { by_token, by_text }
    }

    /// Tokens reusable from the session.
    fn tokens(&self, session: &Session) -> usize {
        match self.by_text {
            Some(_) => session.tokens().len(),
            None => self.by_token,
        }
    }
}

impl WorkerState {
    /// The slot for `job`: its key's slot; else the main session when it shares
    /// enough; else the side one when the request is short and either continues
    /// a side conversation or would evict a main one worth keeping.
    fn choose_slot(&mut self, job: &Job, ids: &[u32]) -> Slot {
        if self.side_ctx == 0 {
            return Slot::Main;
        }
        let fits = ids.len() + job.max_tokens.min(self.side_ctx / 4) < self.side_ctx;
        if let Some(slot) = job.cache_key.as_ref().and_then(|k| self.slot_keys.get(k)) {
            return if fits { *slot } else { Slot::Main };
        }
        if !fits {
            return Slot::Main;
        }
        let main = Held::of(&self.session, &job.prompt, ids).tokens(&self.session);
        if main >= PROTECT_MIN_TOKENS {
            return Slot::Main;
        }
        let side = self
            .side
            .as_ref()
            .map_or(0, |s| Held::of(s, &job.prompt, ids).tokens(s));
        if side > main || self.session.tokens().len() >= PROTECT_MIN_TOKENS {
            Slot::Side
        } else {
            Slot::Main
        }
    }

    fn run(&mut self, job: Job) {
        // Tokenized once: the slot choice and the reuse plan both need it.
        let ids = self
            .session
            .model()
            .tokenizer
            .encode(&job.prompt, true, true);
        let slot = self.choose_slot(&job, &ids);
        if let Some(k) = &job.cache_key {
            if self.slot_keys.len() >= MAX_SLOT_KEYS && !self.slot_keys.contains_key(k) {
                self.slot_keys.clear();
            }
            self.slot_keys.insert(k.clone(), slot);
        }
        if slot == Slot::Side {
            // Swap the side session in, and keep its short requests out of the
            // checkpoint store.
            let side = match self.side.take() {
                Some(s) => s,
                None => self.session.sibling(self.side_ctx),
            };
            self.side = Some(std::mem::replace(&mut self.session, side));
            let persist = self.persist.take();
            self.run_on_slot(&job, ids, slot);
            self.persist = persist;
            if let Some(main) = self.side.take() {
                self.side = Some(std::mem::replace(&mut self.session, main));
            }
        } else {
            self.run_on_slot(&job, ids, slot);
        }
    }

    fn run_on_slot(&mut self, job: &Job, ids: Vec<u32>, slot: Slot) {
        if let Some(t) = &self.trace {
            let slot = if slot == Slot::Side { "side" } else { "main" };
            t.write(json!({ "event": "slot", "id": job.id, "slot": slot }));
        }
        if let Err(e) = self.generate(job, ids) {
            if let Some(t) = &self.trace {
                t.write(json!({
                    "event": "request", "id": job.id, "route": job.route,
                    "prompt": t.prompt(&job.prompt), "error": e.to_string(),
                }));
            }
            let _ = job.events.blocking_send(Event::Failed(e));
        }
        if let Some(p) = &self.persist {
            let (files, bytes, evictions) = p.store_usage();
            self.metrics.store(files, bytes, evictions);
        }
    }

    fn shutdown_save(&mut self) {
        if let Some(p) = &mut self.persist {
            p.save(&self.session, SaveReason::Shutdown);
        }
    }

    /// Positions the session at the longest reusable prefix of `prompt` (whose
    /// own tokens are `ids`) and returns the full token sequence of the request,
    /// how many of them are reused, and the source of the reuse.
    fn plan(&mut self, prompt: &str, ids: Vec<u32>) -> (Vec<u32>, usize, CacheSource) {
        let model = Arc::clone(self.session.model());
        let tok = &model.tokenizer;
        let live = self.session.tokens().to_vec();
        let held = Held::of(&self.session, prompt, &ids);
        let by_token = held.by_token;
        if let Some(text_len) = held.by_text {
            // The live tokens represent a prefix of the text but are not the
            // prompt's own tokenization: keep them all, tokenize only the rest.
            let mut full = live;
            let n = full.len();
            full.extend(tok.encode(&prompt[text_len..], false, true));
            return (full, n, CacheSource::MemoryText);
        }
        let Some(p) = &mut self.persist else {
            let source = if by_token > 0 {
                CacheSource::MemoryToken
            } else {
                CacheSource::None
            };
            return (ids, by_token, source);
        };
        if by_token >= p.min_tokens() {
            return (ids, by_token, CacheSource::MemoryToken);
        }
        // Little or nothing in memory: save the live state this request replaces,
        // then look on disk. (A short memory prefix is re-prefilled on a miss.)
        if live.len() > by_token {
            p.save(&self.session, SaveReason::Evict);
        }
        self.session.reset();
        let covered = p.restore(&mut self.session, prompt.as_bytes());
        if covered > 0 && prompt.is_char_boundary(covered) {
            let mut full = self.session.tokens().to_vec();
            let n = full.len();
            full.extend(tok.encode(&prompt[covered..], false, true));
            return (full, n, CacheSource::DiskText);
        }
        self.session.reset();
        (ids, 0, CacheSource::None)
    }

    fn generate(&mut self, job: &Job, ids: Vec<u32>) -> Result<(), JobError> {
        if job.prompt.is_empty() {
            return Err(JobError::EmptyPrompt);
        }
        if let Some(p) = &mut self.persist {
            p.last_file = None;
        }
        let live = self.session.tokens().to_vec();
        let (ids, reused, source) = self.plan(&job.prompt, ids);
        let tok = &self.session.model().tokenizer;
        let piece_len = |id: u32| tok.decode(&[id], true).len();
        let mut miss = (reused < live.len()).then(|| {
            Divergence::find(
                "memory",
                live.len(),
                job.prompt.as_bytes(),
                &tok.decode(&live, true),
                &ids,
                piece_len,
            )
        });
        // When memory did not deliver, a checkpoint may have offered more.
        if matches!(source, CacheSource::None | CacheSource::DiskText) {
            let near = self
                .persist
                .as_ref()
                .and_then(|p| p.nearest_miss(job.prompt.as_bytes(), self.session.n_ctx()));
            if let Some(n) = near {
                let d = Divergence::find(
                    "disk",
                    n.tokens as usize,
                    job.prompt.as_bytes(),
                    &n.text,
                    &ids,
                    piece_len,
                );
                if d.token > reused && miss.as_ref().is_none_or(|m| d.token > m.token) {
                    miss = Some(d);
                }
            }
        }
        let miss = miss.map(Box::new);
        let checkpoint = self.persist.as_ref().and_then(|p| p.last_file.clone());
        if let Some(t) = &self.trace {
            t.write(json!({
                "event": "cache", "id": job.id, "cache_source": source.as_str(), "reused_tokens": reused,
                "prompt_tokens": ids.len(),
                "checkpoint_file": checkpoint.as_ref().map(|f| f.display().to_string()),
                "miss": miss.as_ref().map(|m| m.describe()),
            }));
        }
        let n_ctx = self.session.n_ctx();
        if ids.len() + 1 > n_ctx {
            return Err(JobError::ContextLength {
                n_ctx,
                needed: ids.len() + 1,
                prompt_tokens: ids.len(),
            });
        }
        // Memory reuse may need the live session cut back to the shared prefix (a
        // rewind recomputes one token, never a prefill of the whole prompt).
        if self.session.tokens().len() > reused {
            self.session.rewind(reused).map_err(engine)?;
        }
        if job.events.is_closed() {
            // The client left while the job was queued: skip the prefill.
            return Ok(());
        }
        let _ = job.events.blocking_send(Event::Started(Usage {
            prompt_tokens: ids.len(),
            cached_tokens: reused,
            checkpointed_tokens: 0,
            completion_tokens: 0,
            cache_source: source,
            miss: miss.clone(),
        }));
        let t0 = Instant::now();
        let model_for_hints = Arc::clone(self.session.model());
        let suffix = &ids[self.session.tokens().len()..];
        let saved_before = self.persist.as_ref().map_or(0, |p| p.saved_tokens());
        // Prefill stops between chunks when the client has gone or the server is
        // stopping; the session keeps what was prefilled.
        let (stopping, events) = (Arc::clone(&self.stopping), job.events.clone());
        let mut prefill = move |s: &mut Session, t: &[u32]| {
            let done = s.prefill_while(t, |_, _| {
                !stopping.load(Ordering::Acquire) && !events.is_closed()
            })?;
            if done < t.len() {
                return Err(EngineError::Cancelled {
                    done,
                    total: t.len(),
                });
            }
            Ok(())
        };
        let hints: Vec<usize> = if self.persist.is_some() {
            let tok = &model_for_hints.tokenizer;
            job.breakpoints
                .iter()
                .map(|&b| tokens_within(&ids, b, |id| tok.decode(&[id], true).len()))
                .collect()
        } else {
            vec![]
        };
        match &mut self.persist {
            Some(p) => p.prefill(
                &mut self.session,
                suffix,
                source == CacheSource::None,
                &hints,
                &mut prefill,
            ),
            None => prefill(&mut self.session, suffix),
        }
        .map_err(|e| match e {
            EngineError::Cancelled { .. } => JobError::Cancelled,
            e => engine(e),
        })?;
        let checkpointed = self.persist.as_ref().map_or(0, |p| p.saved_tokens()) - saved_before;
        let prefill_s = t0.elapsed().as_secs_f64();

        let model = Arc::clone(self.session.model());
        let tok = &model.tokenizer;
        let mut sampler = Sampler::new(job.sampling.clone());
        let mut stream = StreamDecoder::default();
        let mut stops = StopMatcher::new(&job.stop);
        let mut generated = 0;
        let mut output = String::new();
        let mut finish = FinishReason::Length;
        let t1 = Instant::now();
        while generated < job.max_tokens && self.session.tokens().len() < n_ctx {
            if self.stopping.load(Ordering::Acquire) || job.events.is_closed() {
                break;
            }
            let next = sampler.sample(self.session.logits().map_err(engine)?);
            generated += 1;
            if tok.is_eog(next) {
                finish = FinishReason::Stop;
                // Keep the end-of-turn token: the next turn's prompt renders it.
                self.session.decode_step(next).map_err(engine)?;
                break;
            }
            let text = stream.push(tok.token_piece(next, false)).to_string();
            self.session.decode_step(next).map_err(engine)?;
            if let Some(p) = &mut self.persist {
                p.after_decode(&self.session);
            }
            let (emit, stopped) = stops.push(&text);
            output.push_str(&emit);
            if !emit.is_empty() && job.events.blocking_send(Event::Text(emit)).is_err() {
                break;
            }
            if stopped {
                finish = FinishReason::Stop;
                break;
            }
        }
        let tail = stops.finish(stream.finish());
        output.push_str(&tail);
        if !tail.is_empty() {
            let _ = job.events.blocking_send(Event::Text(tail));
        }
        let decode_s = t1.elapsed().as_secs_f64();
        self.metrics.job(&JobStats {
            prompt_tokens: ids.len(),
            cached_tokens: reused,
            generated_tokens: generated,
            prefill_s,
            decode_s,
            source,
        });
        if let Some(t) = &self.trace {
            t.write(json!({
                "event": "request", "id": job.id, "route": job.route, "prompt": t.prompt(&job.prompt),
                "prompt_tokens": ids.len(), "cache_source": source.as_str(), "reused_tokens": reused,
                "checkpoint_file": checkpoint.as_ref().map(|f| f.display().to_string()),
                "prefilled_tokens": ids.len() - reused, "checkpointed_tokens": checkpointed,
                "prefill_s": prefill_s, "decode_s": decode_s, "generated_tokens": generated,
                "generated_text": output, "finish_reason": finish.as_str(),
                "tool_replay": { "exact": job.replay.exact, "canonical": job.replay.canonical },
            }));
        }
        eprintln!(
            "request: cache={} reused={reused} prompt={} prefill={:.2}s generated={generated} decode={:.2}s finish={}",
            source.as_str(),
            ids.len(),
            prefill_s,
            decode_s,
            finish.as_str()
        );
        let _ = job.events.blocking_send(Event::Done {
            finish,
            usage: Usage {
                prompt_tokens: ids.len(),
                cached_tokens: reused,
                checkpointed_tokens: checkpointed,
                completion_tokens: generated,
                cache_source: source,
                miss,
            },
        });
        Ok(())
    }
}

fn engine(e: EngineError) -> JobError {
    JobError::Engine(e.to_string())
}

/// Holds back text that might be the start of a stop sequence, and cuts the output
/// at the first complete one.
struct StopMatcher<'a> {
    stops: &'a [String],
    pending: String,
}

impl<'a> StopMatcher<'a> {
    fn new(stops: &'a [String]) -> Self {
        StopMatcher {
            stops,
            pending: String::new(),
        }
    }

    /// Adds generated text; returns what can be emitted and whether a stop sequence
    /// was hit (the stop itself and anything after it are dropped).
    fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Keep the longest suffix that is a proper prefix of some stop sequence.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&k| s.is_char_boundary(k))
                    .map(move |k| &s[..k])
            })
            .filter(|p| self.pending.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    fn finish(&mut self, tail: &str) -> String {
        let (mut out, stopped) = self.push(tail);
        if !stopped {
            out.push_str(&std::mem::take(&mut self.pending));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_sequences_cut_and_hold_back() {
        let stops = vec!["END".to_string(), "\n\n".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("Hello E"), ("Hello ".to_string(), false));
        assert_eq!(m.push("N"), (String::new(), false));
        assert_eq!(m.push("Dx"), (String::new(), true));
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("a\n"), ("a".to_string(), false));
        assert_eq!(m.finish("b"), "\nb");
        let none: Vec<String> = vec![];
        let mut m = StopMatcher::new(&none);
        assert_eq!(m.push("xyz"), ("xyz".to_string(), false));
    }
}
