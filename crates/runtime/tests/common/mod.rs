//! What the runtime's tests share: a greedy job and the collection of its
//! events.

#![allow(dead_code)]

use ds4_engine::SamplerConfig;
use ds4_runtime::{Event, FinishReason, Job, TokenLimit, Usage};
use tokio::sync::mpsc;

/// A greedy job for `prompt` (tokenized as `ids`) of at most `max_tokens`,
/// with the conversation's `affinity` keys and cache `breakpoints`, and the
/// receiver of its events.
pub fn greedy_job(
    prompt: &str,
    ids: Vec<u32>,
    max_tokens: usize,
    affinity: &[&str],
    breakpoints: Vec<usize>,
) -> (Job, mpsc::Receiver<Event>) {
    let (tx, rx) = mpsc::channel(1024);
    let job = Job {
        id: format!("job-{prompt:.10}"),
        route: "test".into(),
        prompt: prompt.into(),
        ids,
        sampling: SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        },
        limit: TokenLimit::Requested(max_tokens),
        stop: vec![],
        affinity: affinity.iter().map(|s| s.to_string()).collect(),
        breakpoints,
        gate: None,
        turn_save: None,
        logprobs: None,
        prompt_logprobs: None,
        meta: serde_json::Value::Null,
        events: tx,
    };
    (job, rx)
}

/// Collects a job's events: its text, finish and usage.
pub fn collect(mut rx: mpsc::Receiver<Event>) -> (String, FinishReason, Usage) {
    let mut text = String::new();
    while let Some(e) = rx.blocking_recv() {
        match e {
            Event::Text(t) => text.push_str(&t),
            Event::Done { finish, usage } => return (text, finish, usage),
            Event::Failed(e) => panic!("job failed: {e}"),
            Event::Started(_)
            | Event::Progress { .. }
            | Event::Logprobs(_)
            | Event::PromptLogprobs(_) => {}
        }
    }
    panic!("no Done event")
}
