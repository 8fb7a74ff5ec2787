//! Speculative decoding (prompt-lookup drafts), per family: the text, the
//! finish, the token log-probabilities and their alternatives are exactly
//! those of the same jobs without drafts — greedy and sampled with a seed,
//! with a stop sequence, each decoding alone (where drafts are made) and
//! both side by side (where they are not, until one is left) — and on a
//! prompt that repeats itself the real models' drafts are mostly kept.

mod common;
#[path = "../../engine/tests/families/mod.rs"]
mod families;

use std::sync::{Arc, Mutex};

use common::greedy_job;
use ds4_engine::{KvType, Precision, SamplerConfig, Session, SessionOptions, ThreadPool};
use ds4_runtime::{Event, FinishReason, Logprobs, Notice, Runtime, RuntimeConfig};
use families::Family;
use tokio::sync::mpsc;

/// What a job gave: its text, finish, and every generated token's
/// log-probability with its alternatives.
#[derive(Debug, PartialEq)]
struct Answer {
    text: String,
    finish: FinishReason,
    logprobs: Vec<Logprobs>,
}

fn answer(mut rx: mpsc::Receiver<Event>) -> Answer {
    let (mut text, mut logprobs) = (String::new(), Vec::new());
    while let Some(e) = rx.blocking_recv() {
        match e {
            Event::Text(t) => text.push_str(&t),
            Event::Logprobs(l) => logprobs.extend(l),
            Event::Done { finish, .. } => {
                return Answer {
                    text,
                    finish,
                    logprobs,
                }
            }
            Event::Failed(e) => panic!("job failed: {e}"),
            _ => {}
        }
    }
    panic!("no Done event")
}

/// One job: `ids`, `max_tokens`, sampled at `temperature` with `seed` (0:
/// greedy), three alternatives per token, ending at `stop`.
struct Spec {
    temperature: f32,
    seed: u64,
    stop: Vec<String>,
}

/// Runs `specs` on `ids` on a runtime of two slots with `draft_max`, all
/// submitted at once (`together`) or each after the last is done: each
/// job's answer, and the drafted and kept totals.
fn run(
    f: &Family,
    ids: &[u32],
    specs: &[Spec],
    draft_max: usize,
    together: bool,
) -> (Vec<Answer>, usize, usize) {
    let model = families::model(f);
    let pool = Arc::new(ThreadPool::new(2));
    let opts = SessionOptions {
        n_ctx: 2048,
        prefill_chunk: 64,
        precision: Precision::Fast,
        kv_type: KvType::F16,
    };
    let sessions = (0..2)
        .map(|_| Session::new(Arc::clone(&model), Arc::clone(&pool), &opts))
        .collect();
    let notices = Arc::new(Mutex::new(Vec::new()));
    let sink = {
        let n = Arc::clone(&notices);
        Arc::new(move |x: Notice| n.lock().unwrap().push(x))
    };
    let cfg = RuntimeConfig {
        draft_max,
        ..RuntimeConfig::default()
    };
    let rt = Runtime::start(sessions, pool, None, cfg, sink);
    let prompt = String::from_utf8_lossy(&model.tokenizer.prompt_text(ids)).into_owned();
    let mut answers = Vec::new();
    let receivers: Vec<_> = specs
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            let (mut job, rx) = greedy_job(&prompt, ids.to_vec(), 48, &[&format!("c{i}")], vec![]);
            job.sampling = SamplerConfig {
                temperature: s.temperature,
                seed: s.seed,
                ..SamplerConfig::default()
            };
            job.logprobs = Some(3);
            job.stop = s.stop.clone();
            rt.handle.submit(job).unwrap();
            match together {
                true => Some(rx),
                false => {
                    answers.push(answer(rx));
                    None
                }
            }
        })
        .collect();
    answers.extend(receivers.into_iter().map(answer));
    rt.handle.begin_shutdown();
    rt.join();
    let (mut drafted, mut accepted) = (0, 0);
    for n in notices.lock().unwrap().iter() {
        if let Notice::Finished(r) = n {
            assert!(r.error.is_none(), "{:?}", r.error);
            drafted += r.drafted;
            accepted += r.accepted;
        }
    }
    (answers, drafted, accepted)
}

/// A prompt that repeats a passage of itself: past the repeat's start, a
/// model goes on by copying, the case drafts are for.
fn repeating_prompt(f: &Family) -> Vec<u32> {
    let p = families::long_prompt(f);
    let mut ids = p[..240].to_vec();
    ids.extend_from_slice(&p[80..120]);
    ids
}

fn drafts_never_change_an_answer(f: &Family) {
    let ids = repeating_prompt(f);
    let specs = |stop: Vec<String>| {
        vec![
            Spec {
                temperature: 0.0,
                seed: 0,
                stop: stop.clone(),
            },
            Spec {
                temperature: 0.9,
                seed: 7,
                stop,
            },
        ]
    };
    let (plain, none, _) = run(f, &ids, &specs(vec![]), 0, false);
    assert_eq!(none, 0, "drafted with --draft-max 0");
    let (drafted, n, kept) = run(f, &ids, &specs(vec![]), 7, false);
    assert_eq!(plain, drafted, "{}: drafts changed an answer", f.name);
    let (side_by_side, _, _) = run(f, &ids, &specs(vec![]), 7, true);
    assert_eq!(
        plain, side_by_side,
        "{}: drafts changed a batched answer",
        f.name
    );
    assert!(kept <= n);
    if f.name != "deepseek4" {
        // The tiny synthetic model copies nothing; the real ones copy the
        // passage and keep most of what they are offered.
        assert!(
            kept * 2 > n && kept >= 12,
            "{}: {kept} of {n} draft tokens kept",
            f.name
        );
    }
    // A stop sequence in the middle of the greedy answer ends both alike.
    let text = &plain[0].text;
    let stop = text
        .char_indices()
        .map(|(i, _)| i)
        .find(|&i| i >= text.len() / 2 && text.is_char_boundary(i + 3.min(text.len() - i)))
        .map(|i| text[i..(i + 3).min(text.len())].to_string());
    if let Some(stop) = stop.filter(|s| !s.trim().is_empty()) {
        let (plain, _, _) = run(f, &ids, &specs(vec![stop.clone()]), 0, false);
        let (drafted, _, _) = run(f, &ids, &specs(vec![stop.clone()]), 7, false);
        assert_eq!(plain[0].finish, FinishReason::Stop, "{stop:?}");
        assert_eq!(
            plain, drafted,
            "{}: drafts changed a stopped answer",
            f.name
        );
    }
}

for_each_family!(drafts_never_change_an_answer);
