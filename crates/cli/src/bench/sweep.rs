//! The context sweep: one session walks a fixed token sequence to growing
//! frontiers; at each it prefills only the new interval, then generates greedily
//! from a snapshot and restores it, so every frontier continues the same sequence.

use std::io::Write;

use anyhow::{bail, ensure, Context, Result};
use ds4_engine::sampler::argmax;
use ds4_engine::Session;

use super::{decode_greedy, plot, Bench, BenchArgs, BOOK_TEXT};

pub const CSV_HEADER: &str =
    "ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes";

/// Intervals at least this long get a progress bar.
const PROGRESS_MIN_TOKENS: usize = 1024;

/// One frontier's measurements: a CSV row.
pub struct Row {
    pub ctx_tokens: usize,
    pub prefill_tokens: usize,
    pub prefill_tps: f64,
    pub gen_tokens: usize,
    pub gen_tps: f64,
    /// The session's payload at the frontier (`Session::payload_bytes`): the f32 K
    /// and V rows of every position, plus the token ids, the next-token logits
    /// and a 44-byte header (under 0.3 MB for SmolLM2; the rest is K/V).
    pub kvcache_bytes: u64,
}

impl Row {
    fn csv(&self) -> String {
        format!(
            "{},{},{:.2},{},{:.2},{}",
            self.ctx_tokens,
            self.prefill_tokens,
            self.prefill_tps,
            self.gen_tokens,
            self.gen_tps,
            self.kvcache_bytes
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Step {
    Add(usize),
    Mul(f64),
}

/// The frontiers from `start` to `max`, `max` always included as the last one.
fn frontiers(start: usize, max: usize, step: Step) -> Vec<usize> {
    let mut out = Vec::new();
    let mut f = start;
    while f < max {
        out.push(f);
        f = match step {
            Step::Add(n) => f + n,
            // At least one token further, so that small frontiers still advance.
            Step::Mul(m) => ((f as f64 * m).ceil() as usize).max(f + 1),
        };
    }
    out.push(max);
    out
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let step = match (a.step_incr, a.step_mul) {
        (_, Some(m)) if m.is_finite() && m > 1.0 => Step::Mul(m),
        (_, Some(m)) => bail!("--step-mul must be above 1, got {m}"),
        (n, None) => Step::Add(n.unwrap_or(2048)),
    };
    ensure!(
        a.ctx_start <= a.ctx_max,
        "--ctx-start {} is beyond --ctx-max {}",
        a.ctx_start,
        a.ctx_max
    );
    let bench = Bench::load(&a.model)?;
    let ids = bench.tokens(a.prompt_file.as_deref(), BOOK_TEXT, a.ctx_max)?;
    // Room for the generation at the last frontier, which may run past ctx-max.
    let mut session = bench.session(&a.model, a.ctx_max + a.gen_tokens)?;
    let frontiers = frontiers(a.ctx_start, a.ctx_max, step);
    eprintln!(
        "bench: {}, {} threads, {} kernels, {} precision, {} K/V, RoPE scaling {}; frontiers {frontiers:?}",
        bench.file_name(),
        bench.threads,
        ds4_engine::kernel_tier(),
        crate::generate::precision_name(a.model.precision()),
        a.model.kv_type().name(),
        session.rope_scaling(),
    );

    let mut csv = format!("{CSV_HEADER}\n");
    let mut out = std::io::stdout().lock();
    writeln!(out, "{CSV_HEADER}")?;
    let mut rows = Vec::new();
    for frontier in frontiers {
        let row = measure_frontier(&mut session, &ids, frontier, a)?;
        // Streamed row by row: a long sweep shows its results as it goes.
        writeln!(out, "{}", row.csv())?;
        out.flush()?;
        csv.push_str(&row.csv());
        csv.push('\n');
        rows.push(row);
    }
    if let Some(file) = &a.csv {
        std::fs::write(file, &csv).with_context(|| format!("writing {}", file.display()))?;
    }
    if let Some(file) = &a.plot {
        let title = format!(
            "ds4 bench: {}, {} threads",
            bench.file_name(),
            bench.threads
        );
        std::fs::write(file, plot::svg(&title, &rows))
            .with_context(|| format!("writing {}", file.display()))?;
    }
    Ok(())
}

/// Prefills `ids` up to `frontier`, then generates from a snapshot and restores it.
fn measure_frontier(
    session: &mut Session,
    ids: &[u32],
    frontier: usize,
    a: &BenchArgs,
) -> Result<Row> {
    let interval = &ids[session.tokens().len()..frontier];
    let t = std::time::Instant::now();
    if interval.len() >= PROGRESS_MIN_TOKENS {
        let bar = indicatif::ProgressBar::new(interval.len() as u64).with_style(
            indicatif::ProgressStyle::with_template(
                "prefill to {msg} {bar:40} {pos}/{len} tokens, {per_sec}, eta {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_message(frontier.to_string());
        session.prefill_with_progress(interval, |done, _| bar.set_position(done as u64))?;
        bar.finish_and_clear();
    } else {
        session.prefill(interval)?;
    }
    let prefill_s = t.elapsed().as_secs_f64();

    let snapshot = session.snapshot()?;
    let kvcache_bytes = session.payload_bytes();
    let first = argmax(session.logits()?);
    let (generated, gen_s) = decode_greedy(session, first, a.gen_tokens)?;
    session.restore(&snapshot)?;
    if a.print_tokens {
        let list: Vec<String> = generated.iter().map(u32::to_string).collect();
        eprintln!("tokens at {frontier}: {}", list.join(" "));
    }
    Ok(Row {
        ctx_tokens: frontier,
        prefill_tokens: interval.len(),
        prefill_tps: interval.len() as f64 / prefill_s,
        gen_tokens: generated.len(),
        gen_tps: generated.len() as f64 / gen_s,
        kvcache_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frontiers_step_by_increment_and_end_at_max() {
        assert_eq!(
            frontiers(2048, 8192, Step::Add(2048)),
            [2048, 4096, 6144, 8192]
        );
        assert_eq!(frontiers(100, 250, Step::Add(100)), [100, 200, 250]);
        assert_eq!(frontiers(64, 64, Step::Add(64)), [64]);
    }

    #[test]
    fn frontiers_step_geometrically() {
        assert_eq!(
            frontiers(1024, 8192, Step::Mul(2.0)),
            [1024, 2048, 4096, 8192]
        );
        assert_eq!(
            frontiers(1000, 5000, Step::Mul(1.5)),
            [1000, 1500, 2250, 3375, 5000]
        );
        // A factor too small to move a small frontier still advances by one.
        assert_eq!(frontiers(1, 3, Step::Mul(1.01)), [1, 2, 3]);
    }
}
