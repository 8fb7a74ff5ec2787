//! The slots and their scheduler: one engine thread owns N sessions (slots),
//! gives each queued job a slot, and advances every busy slot in one forward
//! pass per step over the multi-sequence interface (`ds4_engine::Batch`: each
//! weight matrix read once for all rows). A decoding slot feeds one token per
//! step; a prefilling slot feeds a quantum of its prompt while others decode
//! (so a long cold prompt never stalls another slot's stream for more than one
//! quantum), or a whole chunk when nothing decodes. Under the automatic
//! quantum with two threads or more, a prompt longer than a quantum goes to the
//! prefill lane instead (`crate::lane`): whole chunks on half the threads while
//! the decoders step on the others. Each sequence's results are
//! bitwise what it gets alone, so batching never changes an answer.
//!
//! Slot choice for a job, among idle slots: the one holding the longest
//! reusable prefix of it (tokens, then rendered text); else one that ran a job
//! with one of its affinity keys (the conversation it continues); else the
//! least valuable one (empty first, then the fewest tokens, the longest idle),
//! whose state is saved first (reason `evict`) when it is worth keeping. With
//! every slot busy, jobs wait in a bounded queue, first come first served.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use ds4_engine::speculate::{Drafter, StepCosts};
use ds4_engine::{Batch, EngineError, Sampler, Session, ThreadPool};
use ds4_kvstore::SaveReason;

use crate::generation::{Generation, Next};
use crate::job::{Event, FinishReason, Job, JobError, Logprobs, SubmitError, Usage};
use crate::lane::{Chunk, Lane, Prefilled, Taken};
use crate::notice::{Finished, Notice, NoticeSink, Planned};
use crate::persist::{Persist, StoreUsage};
use crate::plan::{plan, Held, Plan};
use crate::saver::{Lend, Returned, Saver, TurnFile};

/// Reusable tokens that make a slot the place for a job even when the job
/// replaces the rest of what it holds (a shared system prompt and tool list,
/// not a chance common start).
const REUSE_MIN_TOKENS: usize = 64;
/// Affinity keys a slot remembers.
const MAX_SLOT_KEYS: usize = 64;

/// How many prompt tokens a prefilling slot feeds per step while another
/// slot decodes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PrefillQuantum {
    /// This many.
    Fixed(usize),
    /// As many as keep a step within [`STALL_FACTOR`] times a step of the
    /// decoding slots alone, as measured (at least one): the decoders'
    /// streams slow by that factor at most, whatever the machine and model.
    /// With two threads or more a longer prompt runs in the prefill lane.
    Auto,
}

impl std::str::FromStr for PrefillQuantum {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(PrefillQuantum::Auto),
            n => match n.parse::<usize>() {
                Ok(n) if n > 0 => Ok(PrefillQuantum::Fixed(n)),
                _ => Err(format!("{n:?} is neither `auto` nor a positive number")),
            },
        }
    }
}

impl std::fmt::Display for PrefillQuantum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PrefillQuantum::Fixed(n) => write!(f, "{n}"),
            PrefillQuantum::Auto => f.write_str("auto"),
        }
    }
}

/// What a step carrying prefill tokens may cost next to a step of the
/// decoding slots alone, under [`PrefillQuantum::Auto`].
pub const STALL_FACTOR: f64 = 2.5;

/// How the runtime runs.
#[derive(Clone, Debug)]
pub struct RuntimeConfig {
    /// Tokens a prefilling slot feeds per step while another slot decodes.
    pub prefill_quantum: PrefillQuantum,
    /// Jobs that may wait for a slot when every slot is busy; past it
    /// `submit` refuses ([`SubmitError::QueueFull`]).
    pub queue_max: usize,
    /// Most draft tokens a decoding step carries beside its own
    /// ([`ds4_engine::speculate`]; 0: no speculation).
    pub draft_max: usize,
}

/// The default [`RuntimeConfig::draft_max`]: a step of 8 tokens still runs
/// the products' decode tiles, which read each weight once for all of them.
pub const DRAFT_MAX: usize = 7;

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            prefill_quantum: PrefillQuantum::Auto,
            queue_max: 64,
            draft_max: DRAFT_MAX,
        }
    }
}

/// What a slot is doing, for `/slots` and `/metrics`.
#[derive(Clone, Debug, PartialEq)]
pub struct SlotInfo {
    pub id: usize,
    pub busy: bool,
    /// Tokens its session holds.
    pub tokens: usize,
    pub n_ctx: usize,
    /// SHA-1 of the text its tokens stand for (what checkpoints are named by).
    pub text_sha1: [u8; 20],
    /// Seconds since its last job ended (0 while busy).
    pub idle_s: f64,
    /// Bytes its state holds in memory.
    pub state_bytes: u64,
}

struct Shared {
    stopping: AtomicBool,
    /// Jobs waiting or running.
    depth: AtomicUsize,
    /// The most jobs waiting or running: the slots plus the queue.
    capacity: usize,
    slots: Mutex<Vec<(SlotInfo, Instant)>>,
    /// Affinity keys learned after a job (the ids of the tool calls it
    /// returned), for the engine to add to the slot that ran it.
    tags: Mutex<Vec<(usize, Vec<String>)>>,
    /// The store's usage after the last job or save.
    store: Mutex<Option<StoreUsage>>,
}

/// Submits jobs to the runtime; cheap to clone.
#[derive(Clone)]
pub struct RuntimeHandle {
    tx: mpsc::SyncSender<(Job, Instant)>,
    shared: Arc<Shared>,
}

impl RuntimeHandle {
    /// Queues `job`; its events arrive on its channel.
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        self.try_submit(job).map_err(|(e, _)| e)
    }

    /// Like [`submit`](Self::submit), but a job not queued comes back with
    /// the reason, to be submitted again later (a request's several choices
    /// wait for their own to finish when the queue is full).
    pub fn try_submit(&self, job: Job) -> Result<(), (SubmitError, Box<Job>)> {
        if self.shared.stopping.load(Ordering::Acquire) {
            return Err((SubmitError::ShuttingDown, Box::new(job)));
        }
        let taken = self.shared.depth.fetch_add(1, Ordering::AcqRel);
        if taken >= self.shared.capacity {
            self.shared.depth.fetch_sub(1, Ordering::AcqRel);
            return Err((SubmitError::QueueFull, Box::new(job)));
        }
        match self.tx.try_send((job, Instant::now())) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.shared.depth.fetch_sub(1, Ordering::AcqRel);
                Err(match e {
                    mpsc::TrySendError::Full((job, _)) => (SubmitError::QueueFull, Box::new(job)),
                    mpsc::TrySendError::Disconnected((job, _)) => {
                        (SubmitError::ShuttingDown, Box::new(job))
                    }
                })
            }
        }
    }

    /// Jobs waiting or running.
    pub fn queue_depth(&self) -> usize {
        self.shared.depth.load(Ordering::Acquire)
    }

    /// Every slot's state now.
    pub fn slots(&self) -> Vec<SlotInfo> {
        let slots = self.shared.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots
            .iter()
            .map(|(info, used)| SlotInfo {
                idle_s: if info.busy {
                    0.0
                } else {
                    used.elapsed().as_secs_f64()
                },
                ..info.clone()
            })
            .collect()
    }

    /// Adds affinity keys to slot `slot` (a conversation's next request will
    /// name them: the ids of tool calls it returned).
    pub fn tag(&self, slot: usize, keys: Vec<String>) {
        if !keys.is_empty() {
            let mut tags = self.shared.tags.lock().unwrap_or_else(|e| e.into_inner());
            tags.push((slot, keys));
        }
    }

    /// The checkpoint store's files, bytes, evictions and failed saves, as of
    /// the last job (`None` without a store).
    pub fn store_usage(&self) -> Option<StoreUsage> {
        *self.shared.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops new jobs; running ones end at their next token, waiting ones are
    /// cancelled.
    pub fn begin_shutdown(&self) {
        self.shared.stopping.store(true, Ordering::Release);
    }
}

/// The engine thread; `join` waits for it to finish and save.
pub struct Runtime {
    pub handle: RuntimeHandle,
    thread: std::thread::JoinHandle<()>,
}

impl Runtime {
    /// Starts the engine thread on `sessions` (the slots: sessions of one model,
    /// one context size), with `persist` for disk checkpoints.
    ///
    /// # Panics
    /// When `sessions` is empty.
    pub fn start(
        sessions: Vec<Session>,
        pool: Arc<ThreadPool>,
        persist: Option<Persist>,
        cfg: RuntimeConfig,
        notices: NoticeSink,
    ) -> Self {
        assert!(!sessions.is_empty(), "a runtime needs at least one slot");
        let model = Arc::clone(sessions[0].model());
        let max_step = sessions.iter().map(Session::max_step).max().unwrap_or(1);
        let threads = pool.n_threads();
        let split = (cfg.prefill_quantum == PrefillQuantum::Auto && threads >= 2).then(|| {
            let lane = threads / 2;
            (Arc::new(ThreadPool::new(threads - lane)), lane)
        });
        let batch = Batch::new(Arc::clone(&model), pool, sessions.len() * max_step);
        let capacity = sessions.len() + cfg.queue_max;
        let (tx, rx) = mpsc::sync_channel(capacity);
        let now = Instant::now();
        let shared = Arc::new(Shared {
            stopping: AtomicBool::new(false),
            depth: AtomicUsize::new(0),
            capacity,
            slots: Mutex::new(
                sessions
                    .iter()
                    .enumerate()
                    .map(|(id, s)| (slot_info(id, s, false), now))
                    .collect(),
            ),
            tags: Mutex::new(Vec::new()),
            store: Mutex::new(persist.as_ref().map(Persist::store_usage)),
        });
        let handle = RuntimeHandle {
            tx,
            shared: Arc::clone(&shared),
        };
        let slots = sessions
            .into_iter()
            .enumerate()
            .map(|(id, session)| Slot {
                id,
                session,
                lent: None,
                in_lane: None,
                turn_file: None,
                run: None,
                keys: VecDeque::new(),
                frontier: 0,
                last_used: now,
                scored: ScoredPrompt::default(),
            })
            .collect();
        let thread = std::thread::Builder::new()
            .name("ds4-engine".into())
            .spawn(move || {
                let saver = persist.as_ref().map(|p| Saver::start(p.writer()));
                let split = split.map(|(decode_pool, lane)| Split {
                    lane: Lane::start(model, lane, max_step),
                    decode_pool,
                });
                let mut engine = Engine {
                    slots,
                    batch,
                    persist,
                    saver,
                    waiting: VecDeque::new(),
                    shared,
                    notices,
                    quantum: cfg.prefill_quantum,
                    draft_max: cfg.draft_max,
                    step_costs: StepCosts::new(cfg.draft_max + 1),
                    pace: Pace::default(),
                    split,
                };
                engine.run(rx);
            })
            .expect("spawning the engine thread");
        Runtime { handle, thread }
    }

    /// Waits for the engine to drain (after every handle is dropped) and save.
    pub fn join(self) {
        let Runtime { handle, thread } = self;
        drop(handle);
        let _ = thread.join();
    }
}

fn slot_info(id: usize, s: &Session, busy: bool) -> SlotInfo {
    SlotInfo {
        id,
        busy,
        tokens: s.tokens().len(),
        n_ctx: s.n_ctx(),
        text_sha1: ds4_kvstore::text_hash(&s.model().tokenizer.prompt_text(s.tokens())),
        idle_s: 0.0,
        state_bytes: s.state_memory_bytes(),
    }
}

struct Slot {
    id: usize,
    /// A placeholder while the session is lent to the saver.
    session: Session,
    /// The tokens and context of the session lent to the saver (its turn
    /// end being written); the slot is not idle until it comes back.
    lent: Option<(Vec<u32>, usize)>,
    /// The context of the session lent to the prefill lane (a placeholder
    /// is here meanwhile); the slot's run waits for it.
    in_lane: Option<usize>,
    /// Its conversation's last turn-end checkpoint.
    turn_file: Option<TurnFile>,
    run: Option<Box<Run>>,
    /// Affinity keys of the jobs it ran, newest last.
    keys: VecDeque<String>,
    /// The session's last continued-save frontier.
    frontier: usize,
    last_used: Instant,
    /// The log-probabilities of the last prompt scored here.
    scored: ScoredPrompt,
}

/// A scored prompt's tokens and the log-probabilities of those after the
/// first (entry `i` is token `i + 1`'s, given the tokens before it), with
/// `top` alternatives each. They depend on nothing but the tokens, so they
/// serve any later prompt that shares a prefix with both them and the
/// session's state, whatever ran on the slot in between: a harness scoring
/// several continuations of one context prefills the context once.
#[derive(Default)]
struct ScoredPrompt {
    tokens: Vec<u32>,
    top: usize,
    entries: Vec<Logprobs>,
}

impl ScoredPrompt {
    /// How many of `ids` a scoring job with `top` alternatives can take from
    /// `session`'s state and this record: tokens both begin with, that the
    /// record scored (all of them but the last), where the state can be cut.
    fn reusable(&self, session: &Session, ids: &[u32], top: usize) -> usize {
        if self.top < top {
            return 0;
        }
        let k = shared_prefix(session.tokens(), ids)
            .min(shared_prefix(&self.tokens, ids))
            .min(self.entries.len() + 1);
        match k >= 2 && session.can_rewind(k) {
            true => k,
            false => 0,
        }
    }
}

/// A job on a slot.
struct Run {
    job: Job,
    plan: Plan,
    /// Save points left in the prefill, in order.
    cuts: VecDeque<(usize, SaveReason)>,
    max_tokens: usize,
    /// Set once the prefill is done.
    gen: Option<Generation>,
    /// The token the next step feeds, and whether the job ends after it.
    pending: Option<(u32, Option<FinishReason>)>,
    /// The draft the next step feeds after the pending token.
    draft: Vec<u32>,
    drafter: Drafter,
    queue_s: f64,
    started: Instant,
    prefill_s: f64,
    saved_before: usize,
}

impl Run {
    fn usage(&self, slot: usize, checkpointed: usize) -> Usage {
        Usage {
            prompt_tokens: self.plan.ids.len(),
            cached_tokens: self.plan.reused,
            checkpointed_tokens: checkpointed,
            completion_tokens: self.gen.as_ref().map_or(0, |g| g.generated),
            cache_source: self.plan.source,
            cut_tokens: self.plan.cut,
            miss: self.plan.miss.clone(),
            slot,
            queue_s: self.queue_s,
        }
    }

    fn cancelled(&self, stopping: bool) -> bool {
        stopping || self.job.events.is_closed()
    }
}

struct Engine {
    slots: Vec<Slot>,
    batch: Batch,
    persist: Option<Persist>,
    /// Writes turn ends off this thread (with a store).
    saver: Option<Saver>,
    waiting: VecDeque<(Job, Instant)>,
    shared: Arc<Shared>,
    notices: NoticeSink,
    quantum: PrefillQuantum,
    draft_max: usize,
    /// What a lone decoder's steps cost by their tokens (drafts' worth).
    step_costs: StepCosts,
    pace: Pace,
    /// Under [`PrefillQuantum::Auto`] with two threads or more: the prefill
    /// lane and the threads the decoders step on while it runs.
    split: Option<Split>,
}

/// The threads split between a long prefill and the decoders.
struct Split {
    lane: Lane,
    decode_pool: Arc<ThreadPool>,
}

/// The quantum of [`PrefillQuantum::Auto`], from measured step costs: a
/// step of decoding slots alone, and each step with prompt tokens beside
/// them. A step's cost grows less than in proportion to its prompt tokens
/// (one token beside a decoder costs most of a decode step's matrix reads,
/// the next ones little), so the quantum is found by trying: it grows while
/// such steps stay within [`STALL_FACTOR`] times a decode step and shrinks in
/// proportion when one does not.
#[derive(Default)]
struct Pace {
    decode_s: Option<f64>,
    /// Prompt tokens the next step with decoders may carry (0: not yet set).
    quantum: f64,
}

impl Pace {
    /// A step took `secs` with `prefill` prompt tokens beside its decoders.
    fn note(&mut self, secs: f64, decoding: bool, prefill: usize) {
        if !(decoding && secs.is_finite() && secs > 0.0) {
            return;
        }
        match (prefill, self.decode_s) {
            // Moved a fifth of the way: a noisy step does not decide.
            (0, d) => self.decode_s = Some(d.map_or(secs, |d| d + (secs - d) / 5.0)),
            (n, Some(d)) => {
                let budget = STALL_FACTOR * d;
                let n = n as f64;
                self.quantum = if secs <= budget {
                    (n * 1.25).max(n + 1.0)
                } else {
                    (n * budget / secs).max(1.0)
                };
            }
            (_, None) => {}
        }
    }

    /// Prompt tokens a step with decoders may carry, 1 to `max`.
    fn quantum(&self, max: usize) -> usize {
        (self.quantum as usize).clamp(1, max)
    }
}

/// The slot a job goes to, and the slot whose state it starts from when that
/// is another one.
#[derive(Clone, Copy, Debug)]
struct Choice {
    slot: usize,
    fork_from: Option<usize>,
    /// Save the slot's state first: the job replaces or cuts back a
    /// conversation whatever memory offers it.
    save_first: bool,
}

/// What a job that cannot start yet waits for ([`Engine::choose`]).
enum Wait {
    /// A prompt a busy slot is prefilling, to be forked from it into an idle
    /// slot the moment that is done.
    Prefill,
    /// A slot: any, or the one saving its conversation.
    Slot,
}

/// What one slot feeds in a step.
enum Feed {
    /// Prompt tokens `from..to` of its plan.
    Prefill(usize, usize),
    /// The token it chose last step, and its draft.
    Decode,
}

impl Engine {
    fn run(&mut self, rx: mpsc::Receiver<(Job, Instant)>) {
        loop {
            while let Some(r) = self.saver.as_ref().and_then(Saver::try_take) {
                self.take_back(r);
            }
            self.take_lane(std::time::Duration::ZERO);
            let idle = self.slots.iter().all(|s| s.run.is_none()) && self.waiting.is_empty();
            if idle {
                match rx.recv() {
                    Ok(j) => self.waiting.push_back(j),
                    Err(_) => break,
                }
            }
            while let Ok(j) = rx.try_recv() {
                self.waiting.push_back(j);
            }
            if self.shared.stopping.load(Ordering::Acquire) {
                while let Some((job, _)) = self.waiting.pop_front() {
                    let _ = job.events.blocking_send(Event::Failed(JobError::Cancelled));
                    self.shared.depth.fetch_sub(1, Ordering::AcqRel);
                }
            }
            self.apply_tags();
            self.assign_waiting();
            if self
                .slots
                .iter()
                .any(|s| s.run.is_some() && s.in_lane.is_none())
            {
                self.step();
            } else if self.split.as_ref().is_some_and(|s| s.lane.busy().is_some()) {
                // Only the lane works: wait for it, a little at a time, so a
                // new job is taken meanwhile.
                self.take_lane(std::time::Duration::from_millis(2));
            } else if !self.waiting.is_empty() {
                // Nothing runs and the first waiting job waits for a lent
                // conversation: wait for a save to end.
                match self.saver.as_ref().and_then(Saver::take) {
                    Some(r) => self.take_back(r),
                    None => self.lent_lost(),
                }
            }
        }
        if let Some(saver) = &mut self.saver {
            for r in saver.finish() {
                self.take_back(r);
            }
        }
        for i in 0..self.slots.len() {
            let slot = &self.slots[i];
            if let Some(p) = &mut self.persist {
                p.save(slot.id, &slot.session, SaveReason::Shutdown);
            }
        }
    }

    /// Adds the keys handed in by [`RuntimeHandle::tag`] to their slots.
    fn apply_tags(&mut self) {
        let tags = std::mem::take(&mut *self.shared.tags.lock().unwrap_or_else(|e| e.into_inner()));
        for (slot, keys) in tags {
            if let Some(s) = self.slots.get_mut(slot) {
                remember_keys(s, keys);
            }
        }
    }

    /// Gives waiting jobs idle slots, first come first served.
    fn assign_waiting(&mut self) {
        // A job waiting for a prompt being prefilled keeps an idle slot for
        // its fork; the jobs behind it may start on the others, rather than
        // waiting behind it for that prefill.
        let mut kept = 0;
        let mut i = 0;
        while i < self.waiting.len() {
            let idle = self
                .slots
                .iter()
                .filter(|s| s.run.is_none() && s.lent.is_none())
                .count();
            if idle <= kept {
                return;
            }
            match self.choose(&self.waiting[i].0) {
                Ok(choice) => {
                    let (job, queued) = self.waiting.remove(i).expect("a waiting job");
                    self.prepare_slot(choice);
                    self.start_job(choice.slot, job, queued);
                }
                Err(Wait::Prefill) => {
                    kept += 1;
                    i += 1;
                }
                Err(Wait::Slot) => i += 1,
            }
        }
    }

    /// The idle slot for `job`, if any is idle, in this order:
    /// 1. one whose whole state is a prefix of the job (it continues there),
    ///    the longest;
    /// 2. one that ran a job with one of its affinity keys;
    /// 3. one that shares a prefix worth having ([`REUSE_MIN_TOKENS`], or half
    ///    of a shorter request) but holds more: its state is copied into the least valuable other idle slot
    ///    and cut back there, so the conversation it holds stays live — when
    ///    that slot holds less than the cut would lose; otherwise it is cut
    ///    back itself, saved first;
    /// 4. the least valuable one: empty first, then the fewest tokens, the
    ///    longest idle.
    ///
    /// Before those: a job that scores its prompt takes the one whose last
    /// scored prompt serves it most, else the least valuable one; a job sharing more with a prompt being prefilled than any idle
    /// slot holds waits for it, then forks from it (see the loop below); a
    /// job sharing more with a conversation being saved waits for it.
    ///
    /// A job that cannot start yet gets what it waits for.
    fn choose(&self, job: &Job) -> Result<Choice, Wait> {
        let idle = || {
            self.slots
                .iter()
                .filter(|s| s.run.is_none() && s.lent.is_none())
        };
        let least_valuable = |except: Option<usize>| {
            idle()
                .filter(|s| Some(s.id) != except)
                .min_by_key(|s| (s.session.tokens().len(), s.last_used))
                .map(|s| s.id)
        };
        let at = |slot| Choice {
            slot,
            fork_from: None,
            save_first: false,
        };
        if let Some(top) = job.prompt_logprobs {
            // The slot whose scored prompt serves the most of it, else the
            // one that holds least.
            let best = idle()
                .map(|s| (s.scored.reusable(&s.session, &job.ids, top), s.id))
                .filter(|&(k, _)| k > 0)
                .max();
            return best
                .map(|(_, id)| id)
                .or_else(|| least_valuable(None))
                .map(at)
                .ok_or(Wait::Slot);
        }
        // What each idle slot holds of the job: (slot, reusable tokens, tokens
        // it holds beyond them), computed once.
        let reuses: Vec<(&Slot, usize, usize)> = idle()
            .map(|s| {
                let reused = Held::of(&s.session, &job.ids).tokens(&s.session);
                (s, reused, s.session.tokens().len() - reused)
            })
            .collect();
        // A shared prefix worth a slot: a system prompt and tool list, not a
        // chance common start.
        let worth = REUSE_MIN_TOKENS.min(job.ids.len().div_ceil(2)).max(1);
        // A job that shares more with a conversation whose turn end is being
        // saved than with any idle slot (its next turn, a retry, an edited
        // reply), or that carries its keys, waits for it rather than
        // starting elsewhere from less.
        let idle_best = reuses.iter().map(|&(_, r, _)| r).max().unwrap_or(0);
        // A prompt another job is prefilling now, of which this one shares
        // more than any idle slot holds (a request's several choices, agents
        // sent out together with one system prompt and tool list): it waits
        // for that prefill rather than paying for the shared part again
        // beside it — unless that prefill has far more left than it saves
        // (below) — and starts from a copy of it the moment it is done.
        for s in self.slots.iter().filter(|s| s.lent.is_none()) {
            let Some(r) = &s.run else { continue };
            let shared = shared_prefix(&r.plan.ids, &job.ids);
            if shared < worth || shared <= idle_best {
                continue;
            }
            let held = s.session.tokens().len();
            let just_prefilled = s.in_lane.is_none() && r.gen.is_some() && held == r.plan.ids.len();
            if just_prefilled {
                return least_valuable(None)
                    .map(|slot| Choice {
                        slot,
                        fork_from: Some(s.id),
                        save_first: false,
                    })
                    .ok_or(Wait::Prefill);
            }
            // Started now, it would prefill all of its tokens beside that
            // prefill, sharing the threads; waiting, the rest of that prefill
            // and then its own part. Waiting is quicker unless that prefill has
            // much more left than this job has tokens (a short job sharing a
            // system prompt with a long cold one).
            let left = r.plan.ids.len() - held;
            if r.gen.is_none() && left < job.ids.len() + shared {
                return Err(Wait::Prefill);
            }
        }
        let waits_for_lent = self.slots.iter().any(|s| {
            s.lent.as_ref().is_some_and(|(tokens, _)| {
                let shared = shared_prefix(tokens, &job.ids);
                shared >= worth && shared > idle_best
            }) || (s.lent.is_some() && job.affinity.iter().any(|k| s.keys.contains(k)))
        });
        if waits_for_lent || reuses.is_empty() {
            return Err(Wait::Slot);
        }
        let longest = |keep: &dyn Fn(usize, usize) -> bool| {
            reuses
                .iter()
                .filter(|&&(_, reused, lost)| keep(reused, lost))
                .max_by_key(|&&(s, reused, _)| (reused, std::cmp::Reverse(s.id)))
                .copied()
        };
        if let Some((s, _, _)) = longest(&|reused, lost| reused > 0 && lost == 0) {
            return Ok(at(s.id));
        }
        if let Some(s) = idle().find(|s| job.affinity.iter().any(|k| s.keys.contains(k))) {
            return Ok(at(s.id));
        }
        if let Some((s, _, lost)) = longest(&|reused, _| reused >= worth) {
            // Fork when what the cut would lose is worth more than what the
            // copy replaces.
            let fork_to =
                least_valuable(Some(s.id)).filter(|&o| self.slots[o].session.tokens().len() < lost);
            return Ok(match fork_to {
                Some(other) => Choice {
                    slot: other,
                    fork_from: Some(s.id),
                    save_first: true,
                },
                None => Choice {
                    save_first: true,
                    ..at(s.id)
                },
            });
        }
        least_valuable(None).map(at).ok_or(Wait::Slot)
    }

    /// Before a job takes a slot: the state the choice replaces or cuts back is
    /// saved (reason `evict`; `Persist::save` skips one too short to keep),
    /// and a fork copies the source slot's state in.
    fn prepare_slot(&mut self, c: Choice) {
        if c.save_first {
            if let Some(p) = &mut self.persist {
                let t = &self.slots[c.slot];
                p.save(t.id, &t.session, SaveReason::Evict);
            }
        }
        if let Some(from) = c.fork_from {
            self.copy_state(from, c.slot);
        }
    }

    /// Copies slot `from`'s session state into slot `to`.
    fn copy_state(&mut self, from: usize, to: usize) {
        let (snap, frontier) = (
            self.slots[from].session.snapshot(),
            self.slots[from].frontier,
        );
        let target = &mut self.slots[to];
        match snap.and_then(|snap| target.session.restore(&snap)) {
            Ok(()) => target.frontier = frontier,
            Err(e) => {
                target.session.reset();
                (self.notices)(Notice::Store(format!(
                    "slot {to}: copying slot {from}'s state failed: {e}"
                )));
            }
        }
    }

    /// Plans `job` on slot `i` and starts its prefill.
    fn start_job(&mut self, i: usize, mut job: Job, queued: Instant) {
        let queue_s = queued.elapsed().as_secs_f64();
        let started = Instant::now();
        let slot = &mut self.slots[i];
        remember_keys(slot, std::mem::take(&mut job.affinity));
        let fail = |this: &mut Self, job: Job, e: JobError| {
            (this.notices)(Notice::Refused {
                job: job.id.clone(),
                route: job.route.clone(),
                prompt: job.prompt.clone(),
                error: e.to_string(),
            });
            let _ = job.events.blocking_send(Event::Failed(e));
            this.shared.depth.fetch_sub(1, Ordering::AcqRel);
        };
        if job.prompt.is_empty() || job.ids.is_empty() {
            return fail(self, job, JobError::EmptyPrompt);
        }
        let saved_before = self.persist.as_ref().map_or(0, Persist::saved_tokens);
        let ids = std::mem::take(&mut job.ids);
        let scoring = job.prompt_logprobs.is_some();
        let plan = match job.prompt_logprobs {
            Some(top) => {
                let k = slot.scored.reusable(&slot.session, &ids, top);
                Plan::scored(ids, k)
            }
            None => plan(
                slot.id,
                &mut slot.session,
                self.persist.as_mut(),
                &job.prompt,
                ids,
            ),
        };
        if matches!(
            plan.source,
            crate::job::CacheSource::DiskText | crate::job::CacheSource::DiskTextPartial
        ) {
            slot.frontier = plan.reused;
        } else if plan.reused == 0 {
            slot.frontier = 0;
        }
        let max_tokens = match job.limit.allowed(plan.ids.len(), slot.session.n_ctx()) {
            Ok(m) => m,
            Err(o) => return fail(self, job, JobError::ContextLength(o)),
        };
        // Memory reuse and a partial checkpoint need the session cut back to
        // the shared prefix (a rewind recomputes one token; `plan` checked
        // that it can).
        if slot.session.tokens().len() > plan.reused {
            if let Err(e) = slot.session.rewind(plan.reused) {
                return fail(self, job, engine(e));
            }
        }
        (self.notices)(Notice::Planned(Box::new(Planned {
            job: job.id.clone(),
            slot: slot.id,
            source: plan.source,
            reused: plan.reused,
            cut: plan.cut,
            prompt_tokens: plan.ids.len(),
            checkpoint: plan.checkpoint.clone(),
            miss: plan.miss.clone(),
            weighed: plan.weighed.clone(),
            queue_s,
        })));
        if job.events.is_closed() {
            // The client left while the job was queued: skip the prefill.
            self.shared.depth.fetch_sub(1, Ordering::AcqRel);
            return;
        }
        let hints: Vec<usize> = match &self.persist {
            Some(_) => {
                let tok = &slot.session.model().tokenizer;
                job.breakpoints
                    .iter()
                    .map(|&b| {
                        crate::job::tokens_within(&plan.ids, b, |i, id| {
                            tok.prompt_piece(i, id).len()
                        })
                    })
                    .collect()
            }
            None => vec![],
        };
        let start = slot.session.tokens().len();
        slot.session.keep_step_logits(scoring);
        let cuts = match &self.persist {
            Some(_) if scoring => vec![],
            Some(p) => p.cuts(
                start,
                plan.ids.len() - start,
                plan.source == crate::job::CacheSource::None,
                &hints,
                slot.frontier,
            ),
            None => vec![],
        };
        let run = Box::new(Run {
            job,
            plan,
            cuts: cuts.into(),
            max_tokens,
            gen: None,
            pending: None,
            draft: Vec::new(),
            drafter: Drafter::new(self.draft_max),
            queue_s,
            started,
            prefill_s: 0.0,
            saved_before,
        });
        let _ = run
            .job
            .events
            .blocking_send(Event::Started(run.usage(slot.id, 0)));
        if let Some(top) = run.job.prompt_logprobs {
            let taken = take_scored(slot, &run.plan.ids, top);
            if !taken.is_empty()
                && run
                    .job
                    .events
                    .blocking_send(Event::PromptLogprobs(taken))
                    .is_err()
            {
                // The client left: nothing more to do for it.
                slot.run = Some(run);
                return self.finish(i, FinishReason::Cancelled, None);
            }
        }
        let ready = slot.session.tokens().len() == run.plan.ids.len();
        slot.run = Some(run);
        self.publish(i);
        if ready {
            // Memory held the whole prompt: nothing to prefill.
            self.begin_generation(i);
        }
    }

    /// One forward pass over every busy slot, then what each does with it.
    fn step(&mut self) {
        let stopping = self.shared.stopping.load(Ordering::Acquire);
        for i in 0..self.slots.len() {
            let slot = &self.slots[i];
            let cancel =
                slot.in_lane.is_none() && slot.run.as_ref().is_some_and(|r| r.cancelled(stopping));
            if cancel {
                self.finish(i, FinishReason::Cancelled, None);
            }
        }
        let n_decoding = self
            .slots
            .iter()
            .filter(|s| s.run.as_ref().is_some_and(|r| r.pending.is_some()))
            .count();
        let decoding = n_decoding > 0;
        let mut rows_left = self.batch.max_rows();
        let mut feeds: Vec<(usize, Feed)> = Vec::new();
        // Drafts only for a slot decoding alone: a step of several decoders
        // already reads each weight once for all of them, and a draft's rows
        // both cost more there and stop them sharing the attention over a
        // common prefix (`ds4 bench --sessions 2`, warm: 267-280 t/s in all
        // without drafts, 234-241 with).
        let mut draft_rows = match n_decoding {
            1 => self.draft_max.min(rows_left.saturating_sub(1)),
            _ => 0,
        };
        for s in &mut self.slots {
            let Some(r) = &mut s.run else { continue };
            if r.pending.is_some() {
                r.draft.truncate(draft_rows);
                draft_rows -= r.draft.len();
                feeds.push((s.id, Feed::Decode));
                rows_left = rows_left.saturating_sub(1 + r.draft.len());
            }
        }
        let mut lane_free = self.split.as_ref().is_some_and(|s| s.lane.busy().is_none());
        let mut to_lane = None;
        for s in &self.slots {
            let Some(r) = s.run.as_ref().filter(|r| r.pending.is_none()) else {
                continue;
            };
            if s.in_lane.is_some() {
                continue;
            }
            let from = s.session.tokens().len();
            let to_cut = r.cuts.front().map_or(r.plan.ids.len(), |c| c.0);
            let budget = match (decoding, self.quantum) {
                (false, _) => s.session.max_step(),
                (true, PrefillQuantum::Fixed(n)) => n,
                (true, PrefillQuantum::Auto) => self.pace.quantum(s.session.max_step()),
            };
            if decoding && lane_free && to_cut - from > budget {
                // More than a step's share: the lane takes it, a chunk at a
                // time, beside the decoders.
                to_lane = Some((s.id, from, (to_cut - from).min(s.session.max_step())));
                lane_free = false;
                continue;
            }
            let n = (to_cut - from)
                .min(budget)
                .min(s.session.max_step())
                .min(rows_left);
            if n > 0 {
                feeds.push((s.id, Feed::Prefill(from, from + n)));
                rows_left -= n;
            }
        }
        if let Some((i, from, n)) = to_lane {
            self.lend_to_lane(i, from, n);
        }
        if feeds.is_empty() {
            return;
        }
        let split = self.split.as_ref().filter(|s| s.lane.busy().is_some());
        let decode_pool = split.map(|s| Arc::clone(&s.decode_pool));
        let t = Instant::now();
        let decoded: Vec<Vec<u32>> = feeds
            .iter()
            .map(|(i, f)| match (f, self.slots[*i].run.as_deref()) {
                (Feed::Decode, Some(r)) => {
                    let first = r.pending.map(|(t, _)| t).into_iter();
                    first.chain(r.draft.iter().copied()).collect()
                }
                _ => vec![],
            })
            .collect();
        let result = {
            let mut steps: Vec<(&mut Session, &[u32])> = Vec::with_capacity(feeds.len());
            let mut slots: Vec<Option<&mut Slot>> = self.slots.iter_mut().map(Some).collect();
            for ((i, f), fed) in feeds.iter().zip(&decoded) {
                let Some(slot) = slots[*i].take() else {
                    continue;
                };
                let Slot { session, run, .. } = slot;
                let Some(run) = run.as_deref() else { continue };
                let tokens: &[u32] = match f {
                    Feed::Decode => fed,
                    Feed::Prefill(a, b) => &run.plan.ids[*a..*b],
                };
                steps.push((session, tokens));
            }
            match &decode_pool {
                Some(pool) => self.batch.forward_on(pool, &mut steps),
                None => self.batch.forward(&mut steps),
            }
        };
        let elapsed = t.elapsed().as_secs_f64();
        let prefilled: usize = feeds
            .iter()
            .map(|(_, f)| match f {
                Feed::Prefill(a, b) => b - a,
                Feed::Decode => 0,
            })
            .sum();
        if decode_pool.is_none() {
            // Steps on a share of the threads say nothing of a whole step.
            self.pace.note(elapsed, decoding, prefilled);
            if let ([(_, Feed::Decode)], [fed]) = (&feeds[..], &decoded[..]) {
                self.step_costs.note(fed.len(), elapsed);
            }
        }
        if let Err(e) = result {
            for (i, _) in &feeds {
                self.finish(*i, FinishReason::Stop, Some(e.to_string()));
            }
            return;
        }
        for ((i, f), fed) in feeds.into_iter().zip(decoded) {
            match f {
                Feed::Prefill(..) => self.after_prefill(i, elapsed),
                Feed::Decode => self.after_decode(i, fed.len()),
            }
        }
    }

    /// Lends slot `i`'s session to the prefill lane for its prompt tokens
    /// `from..from + n`.
    fn lend_to_lane(&mut self, i: usize, from: usize, n: usize) {
        let Some(split) = &mut self.split else {
            return;
        };
        let slot = &mut self.slots[i];
        let Some(run) = slot.run.as_deref() else {
            return;
        };
        let tokens = run.plan.ids[from..from + n].to_vec();
        let n_ctx = slot.session.n_ctx();
        let placeholder = slot.session.sibling(1);
        let session = std::mem::replace(&mut slot.session, placeholder);
        slot.in_lane = Some(n_ctx);
        if let Err(undone) = split.lane.lend(Chunk {
            slot: i,
            session,
            tokens,
        }) {
            self.prefilled(*undone);
        }
    }

    /// Takes back the lane's chunk once it is done (waiting up to `wait`).
    fn take_lane(&mut self, wait: std::time::Duration) {
        let Some(split) = &mut self.split else {
            return;
        };
        match split.lane.take(wait) {
            Taken::Pending => {}
            Taken::Done(p) => self.prefilled(*p),
            Taken::Lost(i) => {
                let slot = &mut self.slots[i];
                let n_ctx = slot.in_lane.take().unwrap_or(1);
                slot.session = slot.session.sibling(n_ctx);
                self.split = None;
                let e = "the prefill thread failed; its conversation was lost".to_string();
                self.finish(i, FinishReason::Stop, Some(e));
            }
        }
    }

    /// A chunk is back from the lane: the slot holds its session again and
    /// goes on as after any prefill step.
    fn prefilled(&mut self, p: Prefilled) {
        let slot = &mut self.slots[p.slot];
        slot.session = p.session;
        slot.in_lane = None;
        match p.result {
            Ok(()) => self.after_prefill(p.slot, p.secs),
            Err(e) => self.finish(p.slot, FinishReason::Stop, Some(e.to_string())),
        }
    }

    /// A slot fed prompt tokens: a save where one is due; at the prompt's end,
    /// its first token.
    fn after_prefill(&mut self, i: usize, elapsed: f64) {
        let slot = &mut self.slots[i];
        let Some(run) = slot.run.as_deref_mut() else {
            return;
        };
        run.prefill_s += elapsed;
        let len = slot.session.tokens().len();
        if let Some(top) = run.job.prompt_logprobs {
            let scored = score_step(&slot.session, &run.plan.ids, top);
            slot.scored.entries.extend(scored.iter().cloned());
            let sent = scored.is_empty()
                || run
                    .job
                    .events
                    .blocking_send(Event::PromptLogprobs(scored))
                    .is_ok();
            if !sent {
                return self.finish(i, FinishReason::Cancelled, None);
            }
        }
        let _ = run.job.events.try_send(Event::Progress {
            prefilled: len - run.plan.reused,
            total: run.plan.ids.len() - run.plan.reused,
        });
        if let Some(&(at, reason)) = run.cuts.front() {
            if at == len {
                run.cuts.pop_front();
                if let Some(p) = &mut self.persist {
                    p.save(slot.id, &slot.session, reason);
                }
                if reason == SaveReason::Continued {
                    slot.frontier = at;
                }
            }
        }
        if len == run.plan.ids.len() {
            self.begin_generation(i);
        }
    }

    /// Slot `i`'s prompt is all in its session: its generation starts with the
    /// first token.
    fn begin_generation(&mut self, i: usize) {
        let slot = &mut self.slots[i];
        let Some(run) = slot.run.as_deref_mut() else {
            return;
        };
        if let Some(p) = self
            .persist
            .as_mut()
            .filter(|_| run.job.prompt_logprobs.is_none())
        {
            // What this prefill cost is what the next plan weighs a load
            // against (a scored prompt's shorter steps and output rows would
            // overstate it).
            p.note_prefill(run.plan.ids.len() - run.plan.reused, run.prefill_s);
        }
        // A draft's step needs each row's logits (and takes fewer tokens).
        slot.session.keep_step_logits(self.draft_max > 0);
        let job = &mut run.job;
        run.gen = Some(Generation::new(
            Sampler::new(job.sampling.clone()),
            job.stop.clone(),
            job.gate.take(),
            job.limit,
            run.max_tokens,
            job.logprobs,
        ));
        self.choose_next(i);
    }

    /// A slot fed the token it chose (and `fed - 1` draft tokens after it):
    /// the draft verified, a continued save where one is due, then the next
    /// token, or the end of the job.
    fn after_decode(&mut self, i: usize, fed: usize) {
        if fed > 1 {
            return self.verify(i, fed);
        }
        self.continued_save(i);
        let Some(run) = self.slots[i].run.as_deref_mut() else {
            return;
        };
        if let Some((_, Some(finish))) = run.pending.take() {
            self.finish(i, finish, None);
            return;
        }
        self.choose_next(i);
    }

    /// Slot `i` fed its token and a draft (`fed` tokens in all, each row's
    /// logits kept): each row is sampled as that token alone would have been,
    /// the draft kept while the sampled token is the drafted one, and the
    /// session cut back after the last kept token, whose row is then the
    /// next-token logits. The output is the output without a draft.
    fn verify(&mut self, i: usize, fed: usize) {
        let slot = &mut self.slots[i];
        let Slot { session, run, .. } = slot;
        let Some(run) = run.as_deref_mut() else {
            return;
        };
        let (Some(g), Some(_)) = (run.gen.as_mut(), run.pending.take()) else {
            return;
        };
        let draft = std::mem::take(&mut run.draft);
        let model = Arc::clone(session.model());
        let n_vocab = model.hparams().n_vocab;
        let rows = session.step_logits();
        let mut outcome = Next::Finish(FinishReason::Stop);
        let mut kept = fed;
        for (j, row) in rows.chunks_exact(n_vocab).take(fed).enumerate() {
            let next = g.step(row, &model.tokenizer, &run.job.events);
            let drafted = draft.get(j).copied();
            match next {
                Next::Feed(t) if Some(t) == drafted => continue,
                // The draft holds the token it ends on: it is in the state.
                Next::FeedAndFinish(t, f) if Some(t) == drafted => {
                    (kept, outcome) = (j + 2, Next::Finish(f));
                }
                next => (kept, outcome) = (j + 1, next),
            }
            break;
        }
        run.drafter.record(draft.len(), kept - 1);
        if let Err(e) = session.keep_verified(fed, kept) {
            return self.finish(i, FinishReason::Stop, Some(e.to_string()));
        }
        self.continued_save(i);
        self.apply_next(i, outcome);
    }

    /// A continued save of slot `i`'s session where one is due.
    fn continued_save(&mut self, i: usize) {
        let slot = &mut self.slots[i];
        let len = slot.session.tokens().len();
        if let Some(p) = &mut self.persist {
            if p.continued_due(slot.frontier, len) {
                p.save(slot.id, &slot.session, SaveReason::Continued);
                slot.frontier = len;
            }
        }
    }

    /// Samples slot `i`'s next token from its logits.
    fn choose_next(&mut self, i: usize) {
        let slot = &mut self.slots[i];
        let Some(run) = slot.run.as_deref_mut() else {
            return;
        };
        let model = Arc::clone(slot.session.model());
        let next = match (slot.session.logits(), run.gen.as_mut()) {
            (Ok(logits), Some(g)) => g.step(logits, &model.tokenizer, &run.job.events),
            (Err(e), _) => {
                let e = e.to_string();
                return self.finish(i, FinishReason::Stop, Some(e));
            }
            (_, None) => return,
        };
        self.apply_next(i, next);
    }

    /// What slot `i` does after choosing `next`: feeds it next step (with a
    /// draft after it where one is found), or ends.
    fn apply_next(&mut self, i: usize, next: Next) {
        let slot = &mut self.slots[i];
        let Some(run) = slot.run.as_deref_mut() else {
            return;
        };
        match next {
            Next::Feed(t) => {
                run.pending = Some((t, None));
                // A kept draft token is a generated one: none past the limit.
                let left = run
                    .gen
                    .as_ref()
                    .map_or(0, |g| run.max_tokens.saturating_sub(g.generated));
                let room = slot.session.max_draft(self.draft_max.min(left));
                // What a grammar forces is drafted first: kept unless the
                // model spells it with other tokens.
                let forced = match (room, run.gen.as_mut()) {
                    (1.., Some(g)) => g.guard.forced(),
                    _ => vec![],
                };
                run.draft = match forced.is_empty() {
                    true => run
                        .drafter
                        .propose(slot.session.tokens(), t, room, &self.step_costs),
                    false => run.drafter.propose_forced(t, forced, room),
                };
            }
            Next::FeedAndFinish(t, f) => {
                if slot.session.tokens().len() < slot.session.n_ctx() {
                    run.pending = Some((t, Some(f)));
                } else {
                    self.finish(i, f, None);
                }
            }
            Next::Finish(f) => self.finish(i, f, None),
        }
    }

    /// Ends slot `i`'s job: what was held back, `Done` (or `Failed` when it
    /// never started generating), its notice; the slot becomes idle.
    fn finish(&mut self, i: usize, finish: FinishReason, error: Option<String>) {
        let slot = &mut self.slots[i];
        let Some(mut run) = slot.run.take() else {
            return;
        };
        // A draft's or a scored prompt's rows of logits are not kept idle.
        slot.session.keep_step_logits(false);
        slot.last_used = Instant::now();
        let checkpointed = self
            .persist
            .as_ref()
            .map_or(0, |p| p.saved_tokens() - run.saved_before);
        let events = run.job.events.clone();
        let decode_s = run
            .gen
            .as_ref()
            .map_or(0.0, |g| g.started.elapsed().as_secs_f64());
        if run.prefill_s == 0.0 && run.gen.is_none() {
            run.prefill_s = run.started.elapsed().as_secs_f64();
        }
        // What was held back goes out first; the notice, the slot's state and
        // the depth are settled before the client hears the end, so whoever
        // reads metrics or `/slots` after a response sees it counted.
        if let (Some(g), None) = (&mut run.gen, &error) {
            g.finish(finish, &events);
        }
        let (generated, text, grammar, dropped, wound, mask_s) = match &run.gen {
            Some(g) => (
                g.generated,
                g.output.clone(),
                g.guard.gate.as_ref().map(|gate| {
                    if gate.trigger.is_some() && !g.guard.active {
                        "lazy-unused"
                    } else {
                        "held"
                    }
                }),
                g.guard.dropped.clone(),
                g.guard.winding_down,
                g.guard.mask_s,
            ),
            None => (0, String::new(), None, None, false, 0.0),
        };
        let last = match (run.gen.is_some(), &error) {
            (_, Some(e)) => Event::Failed(JobError::Engine(e.clone())),
            (false, None) => Event::Failed(JobError::Cancelled),
            (true, None) => Event::Done {
                finish,
                usage: run.usage(slot.id, checkpointed),
            },
        };
        let run = *run;
        let final_reason = if run.gen.is_none() {
            FinishReason::Cancelled
        } else {
            finish
        };
        // A scored prompt is one of many an evaluation sends: not kept.
        let turn_save = run
            .job
            .turn_save
            .filter(|_| run.job.prompt_logprobs.is_none());
        let saved_turn = error.is_none() && final_reason != FinishReason::Cancelled;
        (self.notices)(Notice::Finished(Box::new(Finished {
            job: run.job.id,
            route: run.job.route,
            prompt: run.job.prompt,
            meta: run.job.meta,
            slot: slot.id,
            prompt_tokens: run.plan.ids.len(),
            source: run.plan.source,
            reused: run.plan.reused,
            cut: run.plan.cut,
            checkpoint: run.plan.checkpoint,
            checkpointed,
            prefill_s: run.prefill_s,
            decode_s,
            queue_s: run.queue_s,
            generated,
            generated_text: text,
            drafted: run.drafter.drafted,
            accepted: run.drafter.accepted,
            finish: final_reason,
            cancelled: (final_reason == FinishReason::Cancelled).then(|| {
                if self.shared.stopping.load(Ordering::Acquire) {
                    "the server is shutting down"
                } else {
                    "the client went away"
                }
            }),
            grammar,
            grammar_dropped: dropped,
            grammar_wound_down: wound,
            mask_s,
            error,
        })));
        self.shared.depth.fetch_sub(1, Ordering::AcqRel);
        self.publish(i);
        let _ = events.blocking_send(last);
        if let Some(reason) = turn_save.filter(|_| saved_turn) {
            self.lend(i, reason);
        }
    }

    /// Lends slot `i`'s session to the saver to write its turn end.
    fn lend(&mut self, i: usize, reason: SaveReason) {
        let (Some(saver), Some(p)) = (&self.saver, &self.persist) else {
            return;
        };
        let slot = &mut self.slots[i];
        if slot.session.tokens().len() < p.min_tokens() {
            return;
        }
        let text = slot
            .session
            .model()
            .tokenizer
            .prompt_text(slot.session.tokens());
        let placeholder = slot.session.sibling(1);
        let session = std::mem::replace(&mut slot.session, placeholder);
        slot.lent = Some((session.tokens().to_vec(), session.n_ctx()));
        let lend = Lend {
            slot: i,
            session,
            reason,
            text,
            previous: slot.turn_file.take(),
        };
        if let Err(r) = saver.lend(lend) {
            self.take_back(*r);
        }
    }

    /// A lent session is back: the slot holds it again.
    fn take_back(&mut self, r: Returned) {
        let slot = &mut self.slots[r.slot];
        slot.session = r.session;
        slot.lent = None;
        slot.turn_file = r.saved;
    }

    /// The saver is gone with sessions lent (it panicked): their slots start
    /// over empty rather than wait forever.
    fn lent_lost(&mut self) {
        for slot in self.slots.iter_mut() {
            let Some((_, n_ctx)) = slot.lent.take() else {
                continue;
            };
            slot.session = slot.session.sibling(n_ctx);
            (self.notices)(Notice::Store(format!(
                "slot {}: its conversation was lost while saving its turn end",
                slot.id
            )));
        }
        self.saver = None;
    }

    /// Updates slot `i`'s public state, and the store's.
    fn publish(&self, i: usize) {
        let s = &self.slots[i];
        let info = slot_info(s.id, &s.session, s.run.is_some());
        self.shared.slots.lock().unwrap_or_else(|e| e.into_inner())[i] = (info, s.last_used);
        if let Some(p) = &self.persist {
            *self.shared.store.lock().unwrap_or_else(|e| e.into_inner()) = Some(p.store_usage());
        }
    }
}

/// The log-probabilities of the prompt tokens that `session`'s last step
/// scored (each row scores the token after it; the first token has none and
/// the last row's is the first generated one), with `top` alternatives.
fn score_step(session: &Session, ids: &[u32], top: usize) -> Vec<Logprobs> {
    let tok = &session.model().tokenizer;
    let n_vocab = session.model().hparams().n_vocab;
    let rows = session.step_logits();
    let first = session.tokens().len() - rows.len() / n_vocab;
    rows.chunks_exact(n_vocab)
        .zip(ids.get(first + 1..).unwrap_or_default())
        .map(|(row, &id)| crate::generation::score(row, id, top, tok))
        .collect()
}

/// A scoring job's start on `slot`, whose session holds the first `k` of
/// `ids` (reused from its record, or none): the record becomes this prompt's,
/// keeping the reused tokens' entries (cut to `top` alternatives), and the
/// `k`th token is scored from the session's logits; returns what that gives
/// the client now (the prefill scores the rest).
fn take_scored(slot: &mut Slot, ids: &[u32], top: usize) -> Vec<Logprobs> {
    let k = slot.session.tokens().len();
    let mut entries = std::mem::take(&mut slot.scored.entries);
    entries.truncate(k.saturating_sub(1));
    for e in &mut entries {
        e.top.truncate(top);
    }
    if let (Some(&next), Ok(logits)) = (ids.get(k).filter(|_| k > 0), slot.session.logits()) {
        let tok = &slot.session.model().tokenizer;
        entries.push(crate::generation::score(logits, next, top, tok));
    }
    slot.scored = ScoredPrompt {
        tokens: ids.to_vec(),
        top,
        entries: entries.clone(),
    };
    entries
}

/// Tokens `a` and `b` begin with alike.
fn shared_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Adds affinity keys to a slot, forgetting its oldest past [`MAX_SLOT_KEYS`].
fn remember_keys(slot: &mut Slot, keys: Vec<String>) {
    for k in keys {
        if !slot.keys.contains(&k) {
            if slot.keys.len() == MAX_SLOT_KEYS {
                slot.keys.pop_front();
            }
            slot.keys.push_back(k);
        }
    }
}

fn engine(e: EngineError) -> JobError {
    JobError::Engine(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The automatic quantum grows while steps with prompt tokens stay
    /// within [`STALL_FACTOR`] times a decode step and shrinks in proportion
    /// past it; one token until a decode step is measured, at most the
    /// step's size.
    #[test]
    fn the_automatic_quantum_follows_measured_costs() {
        let mut p = Pace::default();
        assert_eq!(p.quantum(256), 1);
        p.note(0.012, true, 4);
        assert_eq!(p.quantum(256), 1, "no decode step measured yet");
        p.note(0.004, true, 0);
        // Within the budget (10 ms): it grows, by at least one token.
        p.note(0.005, true, 1);
        assert_eq!(p.quantum(256), 2);
        p.note(0.006, true, 8);
        assert_eq!(p.quantum(256), 10);
        // Twice the budget: half as many.
        p.note(0.020, true, 10);
        assert_eq!(p.quantum(256), 5);
        // Prefill-only steps say nothing about the mix.
        p.note(1.0, false, 256);
        assert_eq!(p.quantum(256), 5);
        // Cheap prompt tokens: capped at the step's size.
        p.note(0.0041, true, 100);
        assert_eq!(p.quantum(64), 64);
        assert!("auto".parse::<PrefillQuantum>() == Ok(PrefillQuantum::Auto));
        assert!("32".parse::<PrefillQuantum>() == Ok(PrefillQuantum::Fixed(32)));
        assert!("0".parse::<PrefillQuantum>().is_err() && "x".parse::<PrefillQuantum>().is_err());
    }
}
