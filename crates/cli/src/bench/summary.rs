//! `ds4 bench --summary`: llama-bench's two standard tests, ppN (prefill N prompt
//! tokens into an empty context) and tgN (N single-token decode steps from an
//! empty context), each run once to warm up and then R times, reported as t/s
//! mean ± sample standard deviation. The JSON field names follow llama-bench's
//! (`n_prompt`, `n_gen`, `avg_ts`, `stddev_ts`, `samples_ts`).

use std::time::Instant;

use anyhow::{ensure, Result};
use ds4_engine::Session;
use serde::Serialize;

use super::{decode_greedy, Bench, BenchArgs, BOOK_TEXT};
use crate::generate::precision_name;

#[derive(Serialize)]
struct Summary {
    model: String,
    threads: usize,
    kernel_tier: &'static str,
    precision: &'static str,
    kv_type: &'static str,
    results: Vec<TestResult>,
}

#[derive(Serialize)]
struct TestResult {
    test: String,
    n_prompt: usize,
    n_gen: usize,
    avg_ts: f64,
    stddev_ts: f64,
    samples_ts: Vec<f64>,
}

impl TestResult {
    fn new(test: String, n_prompt: usize, n_gen: usize, samples_ts: Vec<f64>) -> Self {
        let (avg_ts, stddev_ts) = mean_sd(&samples_ts);
        TestResult {
            test,
            n_prompt,
            n_gen,
            avg_ts,
            stddev_ts,
            samples_ts,
        }
    }
}

/// Mean and sample standard deviation (0 for a single sample), as llama-bench.
fn mean_sd(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 {
        return (mean, 0.0);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

pub fn run(a: &BenchArgs) -> Result<()> {
    ensure!(a.pp > 0 || a.tg > 0, "nothing to run: -p and -n are both 0");
    let bench = Bench::load(&a.model)?;
    let ids = bench.tokens(a.prompt_file.as_deref(), BOOK_TEXT, a.pp.max(1))?;
    let mut session = bench.session(&a.model, a.pp.max(a.tg))?;
    let mut results = Vec::new();
    if a.pp > 0 {
        let mut prefill = |s: &mut Session| -> Result<f64> {
            s.reset();
            let t = Instant::now();
            s.prefill(&ids[..a.pp])?;
            Ok(a.pp as f64 / t.elapsed().as_secs_f64())
        };
        let samples = run_repeated(&mut session, a.repetitions, &mut prefill)?;
        results.push(TestResult::new(format!("pp{}", a.pp), a.pp, 0, samples));
    }
    if a.tg > 0 {
        let mut generate = |s: &mut Session| -> Result<f64> {
            s.reset();
            let (fed, secs) = decode_greedy(s, ids[0], a.tg)?;
            Ok(fed.len() as f64 / secs)
        };
        let samples = run_repeated(&mut session, a.repetitions, &mut generate)?;
        results.push(TestResult::new(format!("tg{}", a.tg), 0, a.tg, samples));
    }
    let summary = Summary {
        model: bench.file_name(),
        threads: bench.threads,
        kernel_tier: ds4_engine::kernel_tier(),
        precision: precision_name(a.model.precision()),
        kv_type: a.model.kv_type().name(),
        results,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print_table(&summary);
    }
    Ok(())
}

/// One untimed warm-up run, then `reps` measured ones.
fn run_repeated(
    session: &mut Session,
    reps: usize,
    test: &mut dyn FnMut(&mut Session) -> Result<f64>,
) -> Result<Vec<f64>> {
    test(session)?;
    (0..reps).map(|_| test(session)).collect()
}

fn print_table(s: &Summary) {
    println!("| model | threads | kernels | precision | K/V | test | t/s |");
    println!("| --- | ---: | --- | --- | --- | ---: | ---: |");
    for r in &s.results {
        println!(
            "| {} | {} | {} | {} | {} | {} | {:.2} ± {:.2} |",
            s.model,
            s.threads,
            s.kernel_tier,
            s.precision,
            s.kv_type,
            r.test,
            r.avg_ts,
            r.stddev_ts
        );
    }
}

#[cfg(test)]
mod tests {
    use super::mean_sd;

    #[test]
    fn mean_and_sample_standard_deviation() {
        assert_eq!(mean_sd(&[5.0]), (5.0, 0.0));
        let (m, sd) = mean_sd(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        assert_eq!(m, 5.0);
        assert!((sd - 2.138_089_935).abs() < 1e-6, "{sd}");
    }
}
