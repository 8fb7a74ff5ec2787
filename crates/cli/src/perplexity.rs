//! `ds4 perplexity`: the perplexity of a text, computed as llama.cpp's
//! `llama-perplexity` does. The text is tokenized once (with BOS where the model
//! adds one) and cut into chunks of `--ctx` tokens; each chunk runs in a fresh
//! session (its first token replaced by BOS where the model adds one), and only
//! the second half is scored: the logits at positions `ctx/2 .. ctx-2` against the
//! tokens that follow them, so every scored token has at least `ctx/2` tokens of
//! context. The estimate is `exp(mean NLL)`, its error `ppl · sd(NLL) / sqrt(n-1)`.
//! The text is never repeated: chunks beyond its end are not run.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use ds4_engine::{Session, SessionOptions, ThreadPool};

use crate::bench::BOOK_TEXT;
use crate::ModelArgs;

#[derive(Args, Clone, Debug)]
pub struct PerplexityArgs {
    /// Chunk size is --ctx; RoPE scaling follows it (--rope-scaling, --rope-scale).
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text to score (default: the compiled-in bench/pride_and_prejudice.txt).
    #[arg(long, value_name = "FILE")]
    pub prompt_file: Option<PathBuf>,
    /// Score at most K chunks of --ctx tokens (default: every whole chunk the text holds).
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..))]
    pub chunks: Option<u64>,
}

/// Running sums of the negative log-likelihoods.
#[derive(Default)]
struct Nll {
    count: usize,
    sum: f64,
    sum2: f64,
}

impl Nll {
    fn add(&mut self, logits: &[f32], target: u32) {
        let nll = -log_prob(logits, target as usize);
        self.count += 1;
        self.sum += nll;
        self.sum2 += nll * nll;
    }

    /// `(ppl, ±)`, llama.cpp's estimate.
    fn estimate(&self) -> (f64, f64) {
        let n = self.count as f64;
        let mean = self.sum / n;
        let ppl = mean.exp();
        if self.count < 2 {
            return (ppl, f64::NAN);
        }
        let var = (self.sum2 / n - mean * mean).max(0.0);
        (ppl, ppl * (var / (n - 1.0)).sqrt())
    }
}

/// `log softmax(logits)[target]`, the sum of exponentials in f64 (as llama.cpp).
fn log_prob(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    f64::from(logits[target] - max) - z.ln()
}

pub fn run(a: &PerplexityArgs) -> Result<()> {
    let n_ctx = a.model.ctx;
    if n_ctx < 4 {
        bail!("--ctx {n_ctx}: a chunk needs at least 4 tokens");
    }
    let path = crate::models::resolve(a.model.model.as_deref())?;
    let model = Arc::new(a.model.load_model(&path)?);
    let threads = crate::generate::thread_count(&a.model);
    let opts = SessionOptions {
        n_ctx,
        prefill_chunk: a.model.prefill_chunk,
        precision: a.model.precision(),
        kv_type: a.model.kv_type(),
    };
    let mut session = Session::try_new(
        Arc::clone(&model),
        Arc::new(ThreadPool::new(threads)),
        &opts,
    )
    .with_context(|| format!("--ctx {n_ctx}"))?;

    let text = match &a.prompt_file {
        Some(f) => {
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?
        }
        None => BOOK_TEXT.to_string(),
    };
    let tok = &model.tokenizer;
    let tokens = tok.encode(&text, true, false);
    // The model adds BOS exactly when encoding nothing gives it.
    let bos = tok
        .bos()
        .filter(|&b| tok.encode("", true, false).first() == Some(&b));
    let whole = tokens.len() / n_ctx;
    let n_chunks = a.chunks.map_or(whole, |k| {
        whole.min(usize::try_from(k).unwrap_or(usize::MAX))
    });
    if n_chunks == 0 {
        bail!(
            "the text has {} tokens, less than one chunk of --ctx {n_ctx}",
            tokens.len()
        );
    }
    let first = n_ctx / 2;
    let per_chunk = n_ctx - 1 - first;
    eprintln!(
        "perplexity: {} ({} tokens), {n_chunks} of {whole} chunks of {n_ctx} tokens, {per_chunk} scored each; \
         trained context {}, RoPE scaling {}; {threads} threads, {} precision, {} K/V",
        a.prompt_file
            .as_ref()
            .map_or_else(|| "bench/pride_and_prejudice.txt".to_string(), |p| p.display().to_string()),
        tokens.len(),
        model.hparams().n_ctx_train,
        session.rope_scaling(),
        crate::generate::precision_name(a.model.precision()),
        a.model.kv_type().name(),
    );

    let run_per_chunk = (n_ctx - 1) as u64;
    let bar = indicatif::ProgressBar::new(run_per_chunk * n_chunks as u64).with_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} tokens, {per_sec}, eta {eta} {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let t0 = Instant::now();
    let mut nll = Nll::default();
    let mut per_chunk_ppl = Vec::with_capacity(n_chunks);
    for c in 0..n_chunks {
        let mut chunk = tokens[c * n_ctx..(c + 1) * n_ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        session.reset();
        let base = c as u64 * run_per_chunk;
        session.prefill_with_progress(&chunk[..first], |done, _| {
            bar.set_position(base + done as u64)
        })?;
        let mut this = Nll::default();
        session.prefill_with_logits(&chunk[first..n_ctx - 1], |i, logits| {
            let target = chunk[first + i + 1];
            nll.add(logits, target);
            this.add(logits, target);
            bar.set_position(base + (first + i + 1) as u64);
        })?;
        per_chunk_ppl.push(this.estimate().0);
        let (ppl, err) = nll.estimate();
        bar.set_message(format!("ppl {ppl:.4} ± {err:.4}"));
    }
    bar.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    let (ppl, err) = nll.estimate();
    let mut out = std::io::stdout().lock();
    let chunks: Vec<String> = per_chunk_ppl
        .iter()
        .enumerate()
        .map(|(i, p)| format!("[{}]{p:.4}", i + 1))
        .collect();
    writeln!(out, "{}", chunks.join(","))?;
    writeln!(
        out,
        "Final estimate: PPL = {ppl:.4} +/- {err:.5} (ctx {n_ctx}, RoPE scaling {}, {} tokens scored in {n_chunks} chunks, {secs:.1} s, {:.1} t/s)",
        session.rope_scaling(),
        nll.count,
        (run_per_chunk as f64 * n_chunks as f64) / secs,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_prob_and_estimate_by_hand() {
        // Uniform over 4: log(1/4).
        let lp = log_prob(&[1.0, 1.0, 1.0, 1.0], 2);
        assert!((lp - 0.25f64.ln()).abs() < 1e-12);
        // Two tokens with NLL 1 and 3: mean 2, sd 1 (population), err = e^2 · 1 / 1.
        let mut n = Nll::default();
        for v in [1.0, 3.0] {
            n.count += 1;
            n.sum += v;
            n.sum2 += v * v;
        }
        let (ppl, err) = n.estimate();
        assert!((ppl - 2f64.exp()).abs() < 1e-12);
        assert!((err - 2f64.exp()).abs() < 1e-12);
    }
}
