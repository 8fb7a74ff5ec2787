//! `ds4 bench`: throughput measurements on a fixed text.
//!
//! Three modes: the context sweep (default; CSV and an optional SVG plot), a
//! llama-bench style summary (`--summary`), and prefix reuse (`--prefix-reuse`).

mod plot;
mod prefix_reuse;
mod sessions;
mod summary;
mod sweep;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use ds4_engine::sampler::argmax;
use ds4_engine::{Model, Session, SessionOptions, ThreadPool};

use crate::ModelArgs;

/// The sweep's, the summary's and `ds4 perplexity`'s text: a public-domain novel (see bench/README.md).
pub(crate) const BOOK_TEXT: &str = include_str!("../../../../bench/pride_and_prejudice.txt");

#[derive(Args, Clone, Debug)]
#[command(after_help = "Modes: the context sweep (default) prints CSV \
    ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes; --summary \
    prints pp/tg t/s like llama-bench; --prefix-reuse compares cold prefill with a \
    checkpoint restore. The sweep and the summary size the session to the benchmark \
    and ignore --ctx.")]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    /// Text to benchmark on, tokenized and repeated as needed (default:
    /// bench/pride_and_prejudice.txt; with --prefix-reuse bench/carrow_point.txt).
    #[arg(long, value_name = "FILE")]
    pub prompt_file: Option<PathBuf>,

    /// First context frontier in tokens.
    #[arg(long, default_value_t = 2048, value_name = "N", help_heading = "Context sweep (default mode)",
          value_parser = positive,
          conflicts_with_all = ["summary", "prefix_reuse", "sessions"])]
    pub ctx_start: usize,
    /// Last context frontier in tokens (beyond the model's trained context, the
    /// session is RoPE-scaled: see --rope-scaling).
    #[arg(long, default_value_t = 8192, value_name = "N", help_heading = "Context sweep (default mode)",
          conflicts_with_all = ["summary", "prefix_reuse", "sessions"])]
    pub ctx_max: usize,
    /// Add N tokens from one frontier to the next [default: 2048].
    #[arg(long, value_name = "N", help_heading = "Context sweep (default mode)",
          value_parser = positive,
          conflicts_with_all = ["step_mul", "summary", "prefix_reuse", "sessions"])]
    pub step_incr: Option<usize>,
    /// Multiply the frontier by F (> 1) from one to the next (geometric).
    #[arg(long, value_name = "F", help_heading = "Context sweep (default mode)",
          conflicts_with_all = ["summary", "prefix_reuse", "sessions"])]
    pub step_mul: Option<f64>,
    /// Greedy tokens generated at each frontier (the state is restored after);
    /// with --sessions, by each client.
    #[arg(long, default_value_t = 64, value_name = "N", help_heading = "Context sweep (default mode)",
          value_parser = positive,
          conflicts_with_all = ["summary", "prefix_reuse"])]
    pub gen_tokens: usize,
    /// Also write the CSV to FILE.
    #[arg(long, value_name = "FILE", help_heading = "Context sweep (default mode)",
          conflicts_with_all = ["summary", "prefix_reuse", "sessions"])]
    pub csv: Option<PathBuf>,
    /// Write an SVG plot of prefill and generation t/s against context.
    #[arg(long, value_name = "FILE.svg", help_heading = "Context sweep (default mode)",
          conflicts_with_all = ["summary", "prefix_reuse", "sessions"])]
    pub plot: Option<PathBuf>,
    /// Print the generated token ids of each frontier to stderr.
    #[arg(long, help_heading = "Context sweep (default mode)",
          conflicts_with_all = ["summary", "prefix_reuse", "sessions"])]
    pub print_tokens: bool,

    /// Prefill and generation t/s, mean ± sd, like llama-bench.
    #[arg(long, help_heading = "Summary", conflicts_with = "prefix_reuse")]
    pub summary: bool,
    /// Prompt tokens of the prefill test ppN (0 skips it).
    #[arg(
        short = 'p',
        long = "pp",
        default_value_t = 512,
        value_name = "N",
        help_heading = "Summary",
        requires = "summary"
    )]
    pub pp: usize,
    /// Tokens of the generation test tgN, from an empty context (0 skips it).
    #[arg(
        short = 'n',
        long = "tg",
        default_value_t = 128,
        value_name = "N",
        help_heading = "Summary",
        requires = "summary"
    )]
    pub tg: usize,
    /// Timed repetitions of each test (after one warm-up run).
    #[arg(short = 'r', long, default_value_t = 3, value_name = "R", help_heading = "Summary",
          value_parser = positive,
          requires = "summary")]
    pub repetitions: usize,
    /// Print JSON instead of the table.
    #[arg(long, help_heading = "Summary", requires = "summary")]
    pub json: bool,

    /// Cold prefill vs checkpoint write and restore.
    #[arg(long, help_heading = "Prefix reuse")]
    pub prefix_reuse: bool,
    /// Prompt length in tokens.
    #[arg(
        long,
        default_value_t = 4096,
        value_name = "N",
        help_heading = "Prefix reuse",
        requires = "prefix_reuse"
    )]
    pub prompt_tokens: usize,
    /// Checkpoint directory (default: a fresh temporary one, removed after).
    #[arg(
        long,
        value_name = "DIR",
        help_heading = "Prefix reuse",
        requires = "prefix_reuse"
    )]
    pub kv_disk_dir: Option<PathBuf>,

    /// Concurrent sessions: N slots of the session runtime (as `ds4 serve
    /// --batched-session N`) under concurrent clients with a shared and a
    /// private prompt each; --gen-tokens tokens each.
    #[arg(long, value_name = "N", help_heading = "Sessions", value_parser = positive,
          conflicts_with_all = ["summary", "prefix_reuse", "sessions"])]
    pub sessions: Option<usize>,
    /// Concurrent clients [default: one per session].
    #[arg(long, value_name = "M", help_heading = "Sessions", value_parser = positive,
          requires = "sessions")]
    pub clients: Option<usize>,
    /// Prompt tokens every client shares (a system prompt and tool list).
    #[arg(
        long,
        default_value_t = 2048,
        value_name = "N",
        help_heading = "Sessions",
        requires = "sessions"
    )]
    pub shared_tokens: usize,
    /// Prompt tokens of each client's own after the shared ones.
    #[arg(
        long,
        default_value_t = 256,
        value_name = "N",
        help_heading = "Sessions",
        requires = "sessions"
    )]
    pub private_tokens: usize,
    /// Cold prompt tokens prefilled on one slot while another decodes (the
    /// decoder's inter-token gaps are reported); 0 skips the test.
    #[arg(
        long,
        default_value_t = 6144,
        value_name = "N",
        help_heading = "Sessions",
        requires = "sessions"
    )]
    pub stall_prefill: usize,
    /// Tokens a prefilling slot feeds per step while another decodes: `auto`
    /// or a number (as `ds4 serve --mixed-prefill-quantum`: `auto` runs a long
    /// prompt on half the threads beside the decoders).
    #[arg(
        long,
        default_value = "auto",
        value_name = "auto|N",
        help_heading = "Sessions",
        requires = "sessions"
    )]
    pub mixed_prefill_quantum: ds4_runtime::PrefillQuantum,
    /// Draft tokens a decoding step may carry (as `ds4 serve --draft-max`;
    /// 0: no speculative decoding).
    #[arg(
        long,
        default_value_t = ds4_runtime::DRAFT_MAX,
        value_name = "N",
        help_heading = "Sessions",
        requires = "sessions",
        value_parser = crate::serve::draft_tokens
    )]
    pub draft_max: usize,
}

/// A token or repetition count of at least 1.
fn positive(s: &str) -> Result<usize, String> {
    match s.parse() {
        Ok(0) => Err("must be at least 1".to_string()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{e}")),
    }
}

pub fn run(a: &BenchArgs) -> Result<()> {
    if let Some(n) = a.sessions {
        sessions::run(a, n)
    } else if a.prefix_reuse {
        prefix_reuse::run(a)
    } else if a.summary {
        summary::run(a)
    } else {
        sweep::run(a)
    }
}

/// A loaded model with the thread pool every session of one benchmark shares.
struct Bench {
    model: Arc<Model>,
    pool: Arc<ThreadPool>,
    threads: usize,
    path: PathBuf,
}

impl Bench {
    fn load(a: &ModelArgs) -> Result<Bench> {
        let path = crate::models::resolve(a.model.as_deref())?;
        let model = Arc::new(a.load_model(&path)?);
        let threads = crate::generate::thread_count(a);
        Ok(Bench {
            model,
            pool: Arc::new(ThreadPool::new(threads)),
            threads,
            path,
        })
    }

    /// A session of `n_ctx` positions (refused beyond the RoPE bound).
    fn session(&self, a: &ModelArgs, n_ctx: usize) -> Result<Session> {
        let opts = SessionOptions {
            n_ctx,
            prefill_chunk: a.prefill_chunk,
            precision: a.precision(),
            kv_type: a.kv_type(),
        };
        Session::try_new(Arc::clone(&self.model), Arc::clone(&self.pool), &opts)
            .with_context(|| format!("a benchmark session of {n_ctx} positions"))
    }

    fn file_name(&self) -> String {
        self.path.file_name().map_or_else(
            || self.path.display().to_string(),
            |f| f.to_string_lossy().into_owned(),
        )
    }

    /// The first `n` tokens of the text, repeated from its start as often as needed.
    fn tokens(&self, prompt_file: Option<&Path>, default: &str, n: usize) -> Result<Vec<u32>> {
        let text = match prompt_file {
            Some(f) => {
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?
            }
            None => default.to_string(),
        };
        let unit = self.model.tokenizer.encode(&text, false, false);
        if unit.is_empty() {
            bail!("the benchmark text is empty");
        }
        Ok(unit.iter().copied().cycle().take(n).collect())
    }
}

/// Runs `n` decode steps starting with `first`, each next token the argmax of the
/// logits (never stopping at end-of-text); returns the tokens fed and the seconds.
fn decode_greedy(session: &mut Session, first: u32, n: usize) -> Result<(Vec<u32>, f64)> {
    let mut fed = Vec::with_capacity(n);
    let mut next = first;
    let t = Instant::now();
    for _ in 0..n {
        session.decode_step(next)?;
        fed.push(next);
        next = argmax(session.logits()?);
    }
    Ok((fed, t.elapsed().as_secs_f64()))
}
