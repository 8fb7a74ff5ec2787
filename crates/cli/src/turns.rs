//! One job's events as `ds4 chat` and `ds4 agent` show them: a progress bar
//! while the prompt prefills, the text as it streams, and the outcome with
//! its timings; and the words for where a turn's reused state came from.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use ds4_runtime::{CacheSource, Event, FinishReason, JobError, Usage};
use tokio::sync::mpsc;

/// A progress bar for a prefill of `total` tokens.
pub fn prefill_bar(total: usize) -> indicatif::ProgressBar {
    indicatif::ProgressBar::new(total as u64).with_style(
        indicatif::ProgressStyle::with_template(
            "prefill {bar:40} {pos}/{len} tokens, {per_sec}, eta {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    )
}

/// How a job ended.
pub enum Outcome {
    Done {
        usage: Usage,
        finish: FinishReason,
        /// Seconds to the first text (the prefill), and in all.
        prefill_s: f64,
        total_s: f64,
    },
    Failed(JobError),
    /// Stopped by an interrupt; the receiver is dropped, which cancels the job
    /// at the runtime's next step (the slot keeps what it fed).
    Interrupted,
}

/// Receives a job's events until it ends: a bar (on stderr) for a prefill
/// of at least `bar_from` tokens (`None`: never), each text piece to
/// `on_text`. `interrupts` counts Ctrl-C: one past its baseline (the count
/// when the user sent the message) stops it.
pub fn stream(
    mut rx: mpsc::Receiver<Event>,
    bar_from: Option<usize>,
    interrupts: Option<(&AtomicUsize, usize)>,
    mut on_text: impl FnMut(&str) -> Result<()>,
) -> Result<Outcome> {
    let t = Instant::now();
    let mut bar: Option<indicatif::ProgressBar> = None;
    let mut first_text = None;
    let outcome = loop {
        if interrupts.is_some_and(|(i, seen)| i.load(Ordering::Acquire) != seen) {
            break Outcome::Interrupted;
        }
        let e = match interrupts {
            // Polled so that an interrupt is seen between events.
            Some(_) => match rx.try_recv() {
                Ok(e) => e,
                Err(mpsc::error::TryRecvError::Empty) => {
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
                Err(mpsc::error::TryRecvError::Disconnected) => break Outcome::Interrupted,
            },
            None => match rx.blocking_recv() {
                Some(e) => e,
                None => break Outcome::Interrupted,
            },
        };
        match e {
            Event::Started(_) | Event::Logprobs(_) | Event::PromptLogprobs(_) => {}
            Event::Progress { prefilled, total } => {
                if bar_from.is_some_and(|from| total >= from) {
                    bar.get_or_insert_with(|| prefill_bar(total))
                        .set_position(prefilled as u64);
                }
            }
            Event::Text(piece) => {
                if let Some(b) = bar.take() {
                    b.finish_and_clear();
                }
                first_text.get_or_insert_with(|| t.elapsed().as_secs_f64());
                on_text(&piece)?;
            }
            Event::Done { usage, finish } => {
                let total_s = t.elapsed().as_secs_f64();
                break Outcome::Done {
                    usage,
                    finish,
                    prefill_s: first_text.unwrap_or(total_s),
                    total_s,
                };
            }
            Event::Failed(e) => break Outcome::Failed(e),
        }
    };
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(outcome)
}

/// Where a turn's reused state came from, in words.
pub fn source_words(usage: &Usage) -> String {
    match usage.cache_source {
        CacheSource::MemoryToken | CacheSource::MemoryText => "live session".to_string(),
        CacheSource::DiskText => format!("restored {} tokens from disk", usage.cached_tokens),
        CacheSource::DiskTextPartial => format!(
            "restored {} tokens from disk (a checkpoint cut back by {})",
            usage.cached_tokens, usage.cut_tokens
        ),
        CacheSource::None => "nothing reused".to_string(),
    }
}
