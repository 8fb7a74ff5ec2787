//! The scheduler in process (no HTTP), on the real default model: greedy output
//! batched over slots equals each request alone; slot choice (the slot holding
//! the prefix, affinity, the least valuable with an evict save); queueing and
//! its bound; cancellation leaves a consistent slot; a long prefill yields to
//! decoding slots, mixed into their steps or in the prefill lane.

mod common;

use std::sync::{Arc, Mutex, OnceLock};

use common::{collect, greedy_job};
use ds4_engine::{KvType, Model, Precision, Session, SessionOptions, ThreadPool};
use ds4_kvstore::{SaveReason, Store, StoreConfig};
use ds4_runtime::{
    CacheSource, Event, FinishReason, Notice, Persist, Runtime, RuntimeConfig, SubmitError,
};
use tokio::sync::mpsc;

fn model() -> Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    Arc::clone(M.get_or_init(|| {
        Arc::new(Model::load(ds4_testdata::model_path(ds4_testdata::SMOLLM2)).unwrap())
    }))
}

fn sessions(n: usize, pool: &Arc<ThreadPool>) -> Vec<Session> {
    let opts = SessionOptions {
        n_ctx: 2048,
        prefill_chunk: 64,
        precision: Precision::Fast,
        kv_type: KvType::F16,
    };
    (0..n)
        .map(|_| Session::new(model(), Arc::clone(pool), &opts))
        .collect()
}

struct Rt {
    rt: Option<Runtime>,
    notices: Arc<Mutex<Vec<Notice>>>,
}

impl Rt {
    fn start(slots: usize, store: Option<&std::path::Path>, cfg: RuntimeConfig) -> Rt {
        let pool = Arc::new(ThreadPool::new(2));
        let sessions = sessions(slots, &pool);
        let notices = Arc::new(Mutex::new(Vec::new()));
        let sink = {
            let n = Arc::clone(&notices);
            Arc::new(move |x: Notice| n.lock().unwrap().push(x))
        };
        let persist = store.map(|dir| {
            let cfg = StoreConfig {
                policy: ds4_kvstore::SavePolicy {
                    min_tokens: 16,
                    ..Default::default()
                },
                ..Default::default()
            };
            Persist::new(
                Store::open(dir, cfg).unwrap(),
                &sessions[0],
                None,
                sink.clone(),
            )
        });
        Rt {
            rt: Some(Runtime::start(sessions, pool, persist, cfg, sink)),
            notices,
        }
    }

    fn submit(&self, prompt: &str, max_tokens: usize, affinity: &[&str]) -> mpsc::Receiver<Event> {
        self.try_submit(prompt, max_tokens, affinity).unwrap()
    }

    fn try_submit(
        &self,
        prompt: &str,
        max_tokens: usize,
        affinity: &[&str],
    ) -> Result<mpsc::Receiver<Event>, SubmitError> {
        self.submit_job(prompt, max_tokens, affinity, None)
    }

    fn submit_job(
        &self,
        prompt: &str,
        max_tokens: usize,
        affinity: &[&str],
        turn_save: Option<SaveReason>,
    ) -> Result<mpsc::Receiver<Event>, SubmitError> {
        let ids = model().tokenizer.encode(prompt, true, true);
        let (mut job, rx) = greedy_job(prompt, ids, max_tokens, affinity, vec![]);
        job.turn_save = turn_save;
        self.rt.as_ref().unwrap().handle.submit(job).map(|()| rx)
    }

    /// Waits (at most a minute) until `n` saves of `reason` were made.
    fn wait_for_saves(&self, reason: SaveReason, n: usize) {
        let t = std::time::Instant::now();
        while self.saves(reason) < n {
            assert!(
                t.elapsed().as_secs() < 60,
                "{} of {n} {reason} saves: {:?}",
                self.saves(reason),
                self.notices.lock().unwrap()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    fn saves(&self, reason: SaveReason) -> usize {
        self.notices
            .lock()
            .unwrap()
            .iter()
            .filter(|n| matches!(n, Notice::Saved { reason: r, .. } if *r == reason))
            .count()
    }
}

impl Drop for Rt {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.handle.begin_shutdown();
            rt.join();
        }
    }
}

fn chat(user: &str) -> String {
    format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
}

const QUESTIONS: [&str; 4] = [
    "What is the capital of France?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "What is 2 + 2?",
];

#[test]
fn batched_slots_give_each_request_its_solo_greedy_answer() {
    let solo: Vec<String> = {
        let rt = Rt::start(1, None, RuntimeConfig::default());
        QUESTIONS
            .iter()
            .map(|q| collect(rt.submit(&chat(q), 24, &[])).0)
            .collect()
    };
    let rt = Rt::start(4, None, RuntimeConfig::default());
    let rxs: Vec<_> = QUESTIONS
        .iter()
        .map(|q| rt.submit(&chat(q), 24, &[]))
        .collect();
    let mut slots = Vec::new();
    for (rx, want) in rxs.into_iter().zip(&solo) {
        let (text, _, usage) = collect(rx);
        assert_eq!(&text, want);
        slots.push(usage.slot);
    }
    slots.sort();
    slots.dedup();
    assert_eq!(slots.len(), 4, "four slots ran them: {slots:?}");
}

#[test]
fn a_continued_conversation_returns_to_its_slot_and_an_unrelated_one_takes_an_empty_slot() {
    let rt = Rt::start(3, None, RuntimeConfig::default());
    let first = chat("Tell me a short story about a lighthouse keeper and his cat.");
    let (a, _, u1) = collect(rt.submit(&first, 20, &[]));
    // Another conversation: an empty slot, not the first one's.
    let (_, _, u2) = collect(rt.submit(&chat("Name three colors."), 8, &[]));
    assert_ne!(u2.slot, u1.slot);
    // The first one continues: back to its slot, reusing its tokens.
    let second = format!(
        "{first}{a}<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"
    );
    let (_, _, u3) = collect(rt.submit(&second, 8, &[]));
    assert_eq!(u3.slot, u1.slot);
    assert!(
        matches!(
            u3.cache_source,
            CacheSource::MemoryToken | CacheSource::MemoryText
        ),
        "{:?}",
        u3.cache_source
    );
    assert!(u3.cached_tokens > 20, "{}", u3.cached_tokens);
    // A short request sharing nothing, with the first conversation's key, goes
    // where that conversation is when nothing holds a prefix of it.
    let (_, _, u4) = collect(rt.submit("Hello", 2, &["conv-1"]));
    let (_, _, u5) = collect(rt.submit("Hi there", 2, &["conv-1"]));
    assert_eq!(u4.slot, u5.slot, "affinity keeps a key's requests together");
}

#[test]
fn the_least_valuable_slot_is_evicted_with_a_save() {
    let dir = std::env::temp_dir().join(format!("ds4-rt-evict-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let rt = Rt::start(2, Some(&dir), RuntimeConfig::default());
    let long = chat(&"The lighthouse stood on the rocks above the harbour. ".repeat(12));
    let (_, _, u1) = collect(rt.submit(&long, 4, &[]));
    let (_, _, u2) = collect(rt.submit(&chat("Name three colors."), 4, &[]));
    assert_ne!(u1.slot, u2.slot);
    // A third conversation: both slots hold one; the shorter is replaced, and
    // saved first.
    let (_, _, u3) = collect(rt.submit(&chat("What is the capital of Italy?"), 4, &[]));
    assert_eq!(u3.slot, u2.slot, "the slot with fewer tokens is replaced");
    assert_eq!(rt.saves(SaveReason::Evict), 1);
    // The long one is still live.
    let (_, _, u4) = collect(rt.submit(&long, 4, &[]));
    assert_eq!(u4.slot, u1.slot);
    assert_eq!(u4.cache_source, CacheSource::MemoryToken);
    drop(rt);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn jobs_queue_for_a_busy_slot_and_a_full_queue_refuses() {
    let rt = Rt::start(
        1,
        None,
        RuntimeConfig {
            queue_max: 2,
            ..Default::default()
        },
    );
    let rxs: Vec<_> = QUESTIONS[..2]
        .iter()
        .map(|q| rt.submit(&chat(q), 16, &[]))
        .collect();
    // The engine may already hold one; push until the queue refuses.
    let mut refused = false;
    let mut more = Vec::new();
    for q in QUESTIONS.iter().cycle().take(8) {
        match rt.try_submit(&chat(q), 16, &[]) {
            Ok(rx) => more.push(rx),
            Err(e) => {
                assert_eq!(e, SubmitError::QueueFull);
                refused = true;
                break;
            }
        }
    }
    assert!(refused, "the queue never filled");
    for rx in rxs.into_iter().chain(more) {
        let (_, _, u) = collect(rx);
        assert_eq!(u.slot, 0);
    }
}

#[test]
fn a_client_that_leaves_frees_its_slot_in_a_consistent_state() {
    let rt = Rt::start(1, None, RuntimeConfig::default());
    let mut rx = rt.submit(&chat("Write a long story about the sea."), 200, &[]);
    // Read a few events, then leave.
    let mut texts = 0;
    while let Some(e) = rx.blocking_recv() {
        if matches!(e, Event::Text(_)) {
            texts += 1;
            if texts == 3 {
                break;
            }
        }
    }
    drop(rx);
    // The slot serves the next request, exactly as a fresh run does.
    let (text, finish, _) = collect(rt.submit(&chat("What is 2 + 2?"), 12, &[]));
    let fresh = Rt::start(1, None, RuntimeConfig::default());
    let (want, _, _) = collect(fresh.submit(&chat("What is 2 + 2?"), 12, &[]));
    assert_eq!(text, want);
    assert_ne!(finish, FinishReason::Cancelled);
}

fn long_prompt() -> String {
    chat(&"The harbour was quiet that night, and the keeper watched the sea. ".repeat(100))
}

/// Waits for the first token of a job.
fn first_text(rx: &mut mpsc::Receiver<Event>) {
    while let Some(e) = rx.blocking_recv() {
        if matches!(e, Event::Text(_)) {
            return;
        }
    }
    panic!("the job ended without a token");
}

/// While one slot prefills a long cold prompt, another slot's tokens keep
/// coming: the short job (24 tokens) finishes while the long one (~1,400
/// prompt tokens) is still prefilling, mixed into the decode steps 32 tokens
/// at a time or (`auto` on two threads) in the prefill lane on one thread
/// while the decoder steps on the other; either way the long job's answer is
/// its solo one.
#[test]
fn a_long_prefill_yields_to_a_decoding_slot() {
    let solo = {
        let rt = Rt::start(1, None, RuntimeConfig::default());
        collect(rt.submit(&long_prompt(), 4, &[])).0
    };
    for quantum in [
        ds4_runtime::PrefillQuantum::Fixed(32),
        ds4_runtime::PrefillQuantum::Auto,
    ] {
        let rt = Rt::start(
            2,
            None,
            RuntimeConfig {
                prefill_quantum: quantum,
                ..Default::default()
            },
        );
        let mut short = rt.submit(&chat("Name three colors."), 24, &[]);
        // The short job is decoding before the long one arrives.
        first_text(&mut short);
        let mut long = rt.submit(&long_prompt(), 4, &[]);
        let (_, _, us) = collect(short);
        let mut long_started_generating = false;
        while let Ok(e) = long.try_recv() {
            if matches!(e, Event::Text(_) | Event::Done { .. }) {
                long_started_generating = true;
            }
        }
        assert!(
            !long_started_generating,
            "{quantum}: the short job waited for the long prefill"
        );
        let (text, _, ul) = collect(long);
        assert!(ul.prompt_tokens > 1000, "{}", ul.prompt_tokens);
        assert_ne!(us.slot, ul.slot);
        assert_eq!(text, solo, "{quantum}");
    }
}

/// A job that scores its prompt gets the log-probability of every token
/// after the first, bit for bit what a lone session's all-logits prefill
/// gives, with its alternatives, all before its first token; prefilled in the
/// lane beside a decoding slot, in capped steps. It takes the slot that holds
/// least, so a conversation it does not continue keeps its state, and it
/// answers as the plain job does.
#[test]
fn a_scored_prompt_gets_each_token_logprob_and_leaves_other_conversations_alone() {
    let prompt = chat(&"The keeper counted the waves breaking on the rocks. ".repeat(14));
    let ids = model().tokenizer.encode(&prompt, true, true);
    assert!(ids.len() > 130, "{}", ids.len());
    let mut want = Vec::new();
    let mut alone = sessions(1, &Arc::new(ThreadPool::new(2))).remove(0);
    alone
        .prefill_with_logits(&ids, |i, row| {
            if let Some(&next) = ids.get(i + 1) {
                let norm = ds4_engine::sampler::LogNorm::of(row);
                want.push(norm.logprob(row[next as usize]).to_bits());
            }
        })
        .unwrap();
    let rt = Rt::start(3, None, RuntimeConfig::default());
    let story = chat("Tell me a short story about a lighthouse keeper and his cat.");
    let (told, _, u_story) = collect(rt.submit(&story, 12, &[]));
    let mut busy = rt.submit(&chat("Name three colors."), 48, &[]);
    first_text(&mut busy);
    let (mut job, mut rx) = greedy_job(&prompt, ids.clone(), 4, &[], vec![]);
    job.prompt_logprobs = Some(3);
    rt.rt.as_ref().unwrap().handle.submit(job).unwrap();
    let (mut got, mut text, mut usage) = (Vec::new(), String::new(), None);
    while let Some(e) = rx.blocking_recv() {
        match e {
            Event::PromptLogprobs(l) => {
                assert!(text.is_empty(), "a prompt score after the answer began");
                got.extend(l);
            }
            Event::Text(t) => text.push_str(&t),
            Event::Done { usage: u, .. } => usage = Some(u),
            Event::Failed(e) => panic!("{e}"),
            _ => {}
        }
    }
    let usage = usage.unwrap();
    assert_eq!(usage.cached_tokens, 0);
    assert_ne!(usage.slot, u_story.slot, "it took the story's slot");
    assert_eq!(got.len(), ids.len() - 1);
    for (i, l) in got.iter().enumerate() {
        assert_eq!(l.chosen.id, ids[i + 1], "token {}", i + 1);
        assert_eq!(l.chosen.logprob.to_bits(), want[i], "token {}", i + 1);
        assert_eq!(l.top.len(), 3);
        assert!(l.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
        assert!(l.chosen.logprob <= l.top[0].logprob);
    }
    collect(busy);
    let (plain, _, _) = collect(rt.submit(&prompt, 4, &[]));
    assert_eq!(text, plain);
    let next = format!(
        "{story}{told}<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"
    );
    let (_, _, u) = collect(rt.submit(&next, 2, &[]));
    assert_eq!(u.slot, u_story.slot);
    assert!(
        u.cached_tokens > 20,
        "{:?} {}",
        u.cache_source,
        u.cached_tokens
    );
}

/// Scores `prompt` with `top` alternatives (one token generated): its prompt
/// tokens' log-probabilities and usage.
fn score(rt: &Rt, prompt: &str, top: usize) -> (Vec<ds4_runtime::Logprobs>, ds4_runtime::Usage) {
    let ids = model().tokenizer.encode(prompt, true, true);
    let (mut job, mut rx) = greedy_job(prompt, ids, 1, &[], vec![]);
    job.prompt_logprobs = Some(top);
    rt.rt.as_ref().unwrap().handle.submit(job).unwrap();
    let mut got = Vec::new();
    while let Some(e) = rx.blocking_recv() {
        match e {
            Event::PromptLogprobs(l) => got.extend(l),
            Event::Done { usage, .. } => return (got, usage),
            Event::Failed(e) => panic!("{e}"),
            _ => {}
        }
    }
    panic!("no Done event")
}

/// A scored prompt sharing a context with the last one scored on a slot (a
/// harness scoring several continuations of one question) takes the
/// context's scores and state from it and prefills only the rest: every
/// number and alternative as scored cold, bit for bit. A prompt wanting more
/// alternatives than were kept is scored cold; fewer are cut from more.
#[test]
fn a_scored_prompt_reuses_the_scores_of_a_shared_context() {
    let ctx = chat(&"The keeper counted the waves breaking on the rocks. ".repeat(10));
    let [a, b] = ["The answer is the sea.", "The answer is a ship."].map(|e| format!("{ctx}{e}"));
    let cold = |p: &str, top| score(&Rt::start(1, None, RuntimeConfig::default()), p, top).0;
    let rt = Rt::start(2, None, RuntimeConfig::default());
    let (_, ua) = score(&rt, &a, 3);
    assert_eq!(ua.cached_tokens, 0);
    let (got, ub) = score(&rt, &b, 2);
    assert_eq!(ub.slot, ua.slot);
    assert!(
        ub.cached_tokens > 100 && ub.cached_tokens < ub.prompt_tokens,
        "{} of {}",
        ub.cached_tokens,
        ub.prompt_tokens
    );
    assert_eq!(got.len(), ub.prompt_tokens - 1);
    assert!(got == cold(&b, 2), "reused scores differ from cold ones");
    // The same prompt again: all of it from the record.
    let (again, u) = score(&rt, &b, 2);
    assert_eq!(u.cached_tokens, u.prompt_tokens);
    assert!(again == got);
    // More alternatives than the record keeps: cold.
    let (more, u) = score(&rt, &b, 4);
    assert_eq!(u.cached_tokens, 0);
    assert!(more == cold(&b, 4));
}

/// Three jobs on three slots at once: a long prompt, the same again (which
/// waits for the first one's prefill and starts from a copy of it, reusing
/// it whole) and `third`. Their text, finish and usage, each on its own slot.
fn same_twice_then(third: &str) -> [(String, ds4_runtime::FinishReason, ds4_runtime::Usage); 3] {
    let story = "The harbour was quiet that night, and the keeper watched the sea. ".repeat(60);
    let same = chat(&story);
    let rt = Rt::start(3, None, RuntimeConfig::default());
    let rxs = [
        rt.submit(&same, 6, &[]),
        rt.submit(&same, 6, &[]),
        rt.submit(third, 6, &[]),
    ];
    let jobs = rxs.map(collect);
    let b = &jobs[1].2;
    assert_eq!(b.cached_tokens, b.prompt_tokens, "{:?}", b.cache_source);
    let mut slots = jobs.each_ref().map(|j| j.2.slot);
    slots.sort();
    assert_eq!(slots, [0, 1, 2]);
    jobs
}

/// Jobs sharing a prompt being prefilled start from a copy of it: the same
/// prompt reuses all of it, a diverging one the shared part, and every
/// answer is its solo one.
#[test]
fn jobs_sharing_a_prompt_being_prefilled_start_from_a_copy_of_it() {
    let story = "The harbour was quiet that night, and the keeper watched the sea. ".repeat(60);
    let same = chat(&story);
    let other = chat(&format!("{story}Then a ship appeared."));
    let solo: Vec<String> = {
        let rt = Rt::start(1, None, RuntimeConfig::default());
        [&same, &other]
            .iter()
            .map(|p| collect(rt.submit(p, 6, &[])).0)
            .collect()
    };
    let [a, b, c] = same_twice_then(&other);
    assert_eq!(a.0, solo[0]);
    assert_eq!(b.0, solo[0]);
    assert_eq!(c.0, solo[1]);
    assert_eq!(a.2.cached_tokens, 0);
    assert!(a.2.prompt_tokens > 800, "{}", a.2.prompt_tokens);
    assert!(
        c.2.cached_tokens > 800,
        "{:?} {}",
        c.2.cache_source,
        c.2.cached_tokens
    );
}

/// A job waiting for a prompt being prefilled holds up no one behind it: an
/// unrelated job starts on a free slot at once (one idle slot stays kept for
/// the waiting job's fork), and the waiting job still starts from a copy.
#[test]
fn jobs_behind_one_waiting_for_a_prefill_start_on_free_slots() {
    let [_, b, c] = same_twice_then(&chat("What is 2 + 2?"));
    // B waited for A's prefill (about a second on two threads); C did not.
    assert!(
        c.2.queue_s * 4.0 < b.2.queue_s,
        "C queued {:.3} s, B {:.3} s",
        c.2.queue_s,
        b.2.queue_s
    );
}

/// A client that leaves while its prompt is in the prefill lane: the slot
/// gets its session back, ends the job, and serves the same prompt next
/// exactly as a fresh run does (from what the lane had prefilled).
#[test]
fn a_client_that_leaves_during_a_lane_prefill_leaves_its_slot_consistent() {
    let solo = {
        let rt = Rt::start(1, None, RuntimeConfig::default());
        collect(rt.submit(&long_prompt(), 8, &[])).0
    };
    let rt = Rt::start(2, None, RuntimeConfig::default());
    let mut decoder = rt.submit(&chat("Write a long story about the sea."), 120, &[]);
    first_text(&mut decoder);
    let mut long = rt.submit(&long_prompt(), 8, &[]);
    // Some prompt tokens in (the lane reports each chunk), then leave.
    while let Some(e) = long.blocking_recv() {
        if matches!(e, Event::Progress { .. }) {
            break;
        }
    }
    drop(long);
    collect(decoder);
    let (text, finish, u) = collect(rt.submit(&long_prompt(), 8, &[]));
    assert_eq!(text, solo);
    assert_ne!(finish, FinishReason::Cancelled);
    assert!(u.cached_tokens > 0, "nothing of the first prefill was kept");
}

/// A request that shares a long prefix (a system prompt) with a slot's
/// conversation but not the rest starts from a copy of that slot's state in
/// another slot: it reuses the prefix, and the conversation stays live.
#[test]
fn a_shared_prefix_is_forked_into_another_slot() {
    let rt = Rt::start(2, None, RuntimeConfig::default());
    let system = "You are a careful assistant for a lighthouse keeper. ".repeat(8);
    let turn = |user: &str| {
        format!(
            "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        )
    };
    let first = turn("Name a colour.");
    let (a, _, u1) = collect(rt.submit(&first, 8, &[]));
    let (_, _, u2) = collect(rt.submit(&turn("Name a fruit."), 4, &[]));
    assert_ne!(u2.slot, u1.slot, "the conversation's slot is not cut back");
    assert_eq!(u2.cache_source, CacheSource::MemoryToken);
    assert!(u2.cached_tokens >= 64, "{} reused", u2.cached_tokens);
    let second = format!(
        "{first}{a}<|im_end|>\n<|im_start|>user\nAnother one.<|im_end|>\n<|im_start|>assistant\n"
    );
    let (_, _, u3) = collect(rt.submit(&second, 4, &[]));
    assert_eq!(u3.slot, u1.slot);
    assert!(u3.cached_tokens >= u1.prompt_tokens, "{:?}", u3);
}

/// A conversation saved at its turn end (`Job::turn_save`) comes back from
/// disk in a slot that holds only its start (the agent's system prompt): the
/// longer checkpoint beats the live prefix; a job of limit 0 only positions
/// the slot.
#[test]
fn a_turn_end_checkpoint_beats_a_live_prefix_of_it() {
    let dir = std::env::temp_dir().join(format!("ds4-rt-turn-save-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let rt = Rt::start(1, Some(&dir), RuntimeConfig::default());
    let system = format!(
        "<|im_start|>system\n{}<|im_end|>\n",
        "You are a careful assistant for a lighthouse keeper. ".repeat(8)
    );
    let submit = |prompt: &str, max_tokens, save| {
        collect(rt.submit_job(prompt, max_tokens, &[], save).unwrap())
    };
    let first =
        format!("{system}<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n");
    let (a, finish, _) = submit(&first, 8, Some(SaveReason::AgentSession));
    rt.wait_for_saves(SaveReason::AgentSession, 1);
    // The slot goes back to the system prompt alone: nothing generated.
    let (text, _, u) = submit(&system, 0, Some(SaveReason::AgentSystem));
    assert_eq!((text.as_str(), u.completion_tokens), ("", 0));
    rt.wait_for_saves(SaveReason::AgentSystem, 1);
    let end = if finish == FinishReason::Stop {
        "<|im_end|>"
    } else {
        ""
    };
    let next = format!(
        "{first}{a}{end}\n<|im_start|>user\nAnother one.<|im_end|>\n<|im_start|>assistant\n"
    );
    let (_, _, u) = submit(&next, 4, Some(SaveReason::AgentSession));
    assert_eq!(u.cache_source, CacheSource::DiskText, "{u:?}");
    assert!(u.cached_tokens > u.prompt_tokens - 16, "{u:?}");
    // The conversation's next turn end, written after the system prompt's
    // save on this slot, supersedes no anchor: the agent-system file stays.
    rt.wait_for_saves(SaveReason::AgentSession, 2);
    let store = Store::open(&dir, StoreConfig::default()).unwrap();
    let reasons: Vec<SaveReason> = store
        .entries()
        .unwrap()
        .into_iter()
        .map(|e| e.header.reason)
        .collect();
    assert!(reasons.contains(&SaveReason::AgentSystem), "{reasons:?}");
    drop(rt);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Each turn end is saved in the background: a second runtime on the same
/// store (what a restart after `kill -9` finds) continues the conversation
/// from the whole of it, prompt and answer; the next turn's save supersedes
/// the previous one (one file per conversation), and a turn that follows at
/// once waits for its conversation's save and continues from memory.
#[test]
fn turn_ends_are_saved_in_the_background_and_serve_a_restart() {
    let dir = std::env::temp_dir().join(format!("ds4-sched-turn-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let turn_end = Some(SaveReason::TurnEnd);
    let rt = Rt::start(2, Some(&dir), RuntimeConfig::default());
    let p1 = format!(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{}",
        chat("Tell me about the history of Paris in a few sentences.")
    );
    let (r1, _, u1) = collect(rt.submit_job(&p1, 24, &[], turn_end).unwrap());
    let held1 = u1.prompt_tokens + u1.completion_tokens;
    // The same request again at once (a retry): it shares all its prompt
    // with the conversation being saved, so it waits for it and reuses it
    // rather than starting cold on the other, empty slot.
    let (_, _, again) = collect(rt.submit_job(&p1, 4, &[], None).unwrap());
    assert_eq!(again.cache_source, CacheSource::MemoryToken, "{again:?}");
    assert_eq!(again.cached_tokens, u1.prompt_tokens, "{again:?}");
    rt.wait_for_saves(SaveReason::TurnEnd, 1);

    // The restart: nothing but what is on disk.
    let p2 = format!("{p1}{r1}<|im_end|>\n{}", chat("And of Lyon?"));
    {
        let other = Rt::start(1, Some(&dir), RuntimeConfig::default());
        // (Fewer tokens than the turn below, so its shutdown save is another file.)
        let (_, _, u) = collect(other.submit_job(&p2, 4, &[], None).unwrap());
        assert_eq!(u.cache_source, CacheSource::DiskText, "{u:?}");
        assert!(
            u.cached_tokens + 1 >= held1,
            "restored {} of the {held1} tokens of the first turn",
            u.cached_tokens
        );
    }

    // The next turn, sent the moment the first answer ended, continues from
    // the live slot; its save replaces the first one.
    let (r2, _, u2) = collect(rt.submit_job(&p2, 8, &[], turn_end).unwrap());
    assert!(
        matches!(
            u2.cache_source,
            CacheSource::MemoryToken | CacheSource::MemoryText
        ),
        "{u2:?}"
    );
    assert!(u2.cached_tokens + 1 >= held1, "{u2:?}");
    let p3 = format!("{p2}{r2}<|im_end|>\n{}", chat("Thanks."));
    let (_, _, u3) = collect(rt.submit_job(&p3, 4, &[], turn_end).unwrap());
    assert!(
        matches!(
            u3.cache_source,
            CacheSource::MemoryToken | CacheSource::MemoryText
        ),
        "a turn that waited for its conversation's save: {u3:?}"
    );
    rt.wait_for_saves(SaveReason::TurnEnd, 3);
    let store = Store::open(&dir, StoreConfig::default()).unwrap();
    let turn_ends = store
        .entries()
        .unwrap()
        .into_iter()
        .filter(|e| e.header.reason == SaveReason::TurnEnd)
        .count();
    assert_eq!(turn_ends, 1, "one turn-end file per conversation");
    drop(rt);
    let _ = std::fs::remove_dir_all(&dir);
}
