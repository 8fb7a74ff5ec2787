//! `ds4 run` and `ds4 chat`: load a model, prefill, generate, print.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use ds4_chat::{Message, RenderOptions, Role};
use ds4_engine::sampler::{argmax, log_softmax, top_k};
use ds4_engine::tokenizer::StreamDecoder;
use ds4_engine::{
    DigestEvent, DigestOptions, KvType, Model, Precision, RopeRequest, Sampler, SamplerConfig,
    Session, SessionOptions, ThreadPool,
};
use serde::Serialize;

use crate::kvargs::KvArgs;
use crate::turns::Outcome;
use crate::{models, ModelArgs};
use ds4_runtime::{Job, Notice, NoticeSink, Persist, Runtime, RuntimeConfig, TokenLimit};
use ds4_server::prepare::encode_prompt;

#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Temperature; 0 = greedy. The default (and --top-p's) follows the SmolLM2
    /// model card: small models ramble at llama.cpp's usual 0.8.
    #[arg(long = "temp", default_value_t = 0.2)]
    pub temperature: f32,
    /// Nucleus sampling threshold (1 disables).
    #[arg(long, default_value_t = 0.9)]
    pub top_p: f32,
    /// Keep only the K most likely tokens (0 disables).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Drop tokens less likely than this fraction of the best (0 disables).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Random seed (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Maximum tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 256)]
    pub n_predict: usize,
}

impl SamplingArgs {
    pub fn config(&self) -> SamplerConfig {
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        });
        SamplerConfig {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed,
            logit_bias: Vec::new(),
        }
    }
}

#[derive(Args, Clone, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Prompt text (special tokens such as <|im_start|> are parsed).
    #[arg(short = 'p', long, conflicts_with_all = ["prompt_file", "prompt_ids"])]
    pub prompt: Option<String>,
    /// Read the prompt text from a file.
    #[arg(long, value_name = "FILE", conflicts_with = "prompt_ids")]
    pub prompt_file: Option<PathBuf>,
    /// A JSON array of token ids used instead of prompt text.
    #[arg(long, value_name = "FILE")]
    pub prompt_ids: Option<PathBuf>,
    /// Print the prompt's token ids and pieces, then exit.
    #[arg(long)]
    pub dump_tokens: bool,
    /// Write the greedy continuation (or the forced one) with the top-k
    /// log-probabilities of every step as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub dump_logprobs: Option<PathBuf>,
    /// How many log-probabilities per step --dump-logprobs records.
    #[arg(long, default_value_t = 5)]
    pub logprobs_top_k: usize,
    /// A JSON array of token ids fed instead of sampled ones (one step each).
    #[arg(long, value_name = "FILE")]
    pub teacher_force: Option<PathBuf>,
}

#[derive(Args, Clone, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// System message (default: the model template's own, if it has one).
    #[arg(long, conflicts_with = "system_file")]
    pub system: Option<String>,
    /// Read the system message from a file.
    #[arg(long, value_name = "FILE")]
    pub system_file: Option<PathBuf>,
    #[command(flatten)]
    pub kv: KvArgs,
}

pub struct Loaded {
    pub model: Arc<Model>,
    pub session: Session,
    pub path: PathBuf,
}

pub fn load(a: &ModelArgs) -> Result<Loaded> {
    let path = models::resolve(a.model.as_deref())?;
    let t = Instant::now();
    let model = Arc::new(a.load_model(&path)?);
    let threads = thread_count(a);
    let opts = SessionOptions {
        n_ctx: a.ctx,
        prefill_chunk: a.prefill_chunk,
        precision: a.precision(),
        kv_type: a.kv_type(),
    };
    let session = Session::try_new(
        Arc::clone(&model),
        Arc::new(ThreadPool::new(threads)),
        &opts,
    )
    .with_context(|| format!("--ctx {}", a.ctx))?;
    let hp = model.hparams();
    eprintln!(
        "loaded {} ({}, {} layers, {} embd, {} vocab) in {:.2} s; ctx {} (trained {}, RoPE scaling {}), {} threads, {} path, {} kernels",
        path.file_name().map_or_else(
            || path.display().to_string(),
            |f| f.to_string_lossy().into_owned()
        ),
        hp.arch,
        hp.n_layer,
        hp.n_embd,
        hp.n_vocab,
        t.elapsed().as_secs_f64(),
        a.ctx,
        hp.n_ctx_train,
        session.rope_scaling(),
        threads,
        precision_name(a.precision()),
        ds4_engine::kernel_tier(),
    );
    Ok(Loaded {
        model,
        session,
        path,
    })
}

/// `--threads`, else one per physical core.
pub fn thread_count(a: &ModelArgs) -> usize {
    a.threads.unwrap_or_else(ds4_engine::default_threads)
}

impl ModelArgs {
    /// Loads the model at `path` with the RoPE scaling request of
    /// `--rope-scaling` / `--rope-scale`.
    pub fn load_model(&self, path: &Path) -> Result<Model> {
        let mut model = load_hashed(path)?;
        model
            .set_rope_request(RopeRequest {
                kind: self.rope_scaling,
                factor: self.rope_scale,
                attn_temperature: self.yarn_attn_temperature.then_some(true),
            })
            .context("--rope-scaling / --rope-scale")?;
        Ok(model)
    }

    pub fn precision(&self) -> Precision {
        match (self.exact, self.q8_activations) {
            (true, _) => Precision::Exact,
            (false, true) => Precision::Q8,
            (false, false) => Precision::Fast,
        }
    }

    /// `--kv-type`, else f32 for the exact path (the accuracy reference) and f16
    /// for the others.
    pub fn kv_type(&self) -> KvType {
        self.kv_type
            .unwrap_or(if self.exact { KvType::F32 } else { KvType::F16 })
    }
}

/// Loads the model at `path`, its tensor data's digest (the checkpoints'
/// weights fingerprint) cached under `$DS4_HOME/fingerprints` by the file's
/// identity; hashing a file of 1 GiB or more shows a progress bar.
fn load_hashed(path: &Path) -> Result<Model> {
    const SHOW_FROM: u64 = 1 << 30;
    let bar: Mutex<Option<indicatif::ProgressBar>> = Mutex::new(None);
    let events = |e: DigestEvent<'_>| {
        let mut bar = bar.lock().unwrap_or_else(|e| e.into_inner());
        match e {
            DigestEvent::Progress { done, total } if total >= SHOW_FROM => {
                let b = bar.get_or_insert_with(|| {
                    indicatif::ProgressBar::new(total).with_style(
                        indicatif::ProgressStyle::with_template(
                            "hashing the weights (once per file) {bar:40} {bytes}/{total_bytes}, {bytes_per_sec}, eta {eta}",
                        )
                        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
                    )
                });
                b.set_position(done);
            }
            DigestEvent::Hashed { bytes, seconds } if bytes >= SHOW_FROM => {
                if let Some(b) = bar.take() {
                    b.finish_and_clear();
                }
                eprintln!(
                    "hashed {:.1} GiB of weights in {seconds:.1} s (cached: later starts skip this)",
                    bytes as f64 / (1u64 << 30) as f64
                );
            }
            DigestEvent::CacheFailed(e) => {
                eprintln!("weights fingerprint cache not used: {e}")
            }
            _ => {}
        }
    };
    let opts = DigestOptions {
        cache_dir: Some(models::ds4_home()?.join("fingerprints")),
        events: &events,
        ..DigestOptions::default()
    };
    Model::load_with(path, &opts).with_context(|| format!("loading {}", path.display()))
}

pub fn precision_name(p: Precision) -> &'static str {
    match p {
        Precision::Fast => "fast",
        Precision::Exact => "exact",
        Precision::Q8 => "q8",
    }
}

/// Prefills, drawing a progress bar on a terminal for prompts long enough to wait on.
fn prefill_with_bar(session: &mut Session, ids: &[u32]) -> Result<(), ds4_engine::EngineError> {
    if ids.len() < 1024 {
        return session.prefill(ids);
    }
    let bar = crate::turns::prefill_bar(ids.len());
    let r = session.prefill_with_progress(ids, |done, _| bar.set_position(done as u64));
    bar.finish_and_clear();
    r
}

fn read_ids(path: &Path) -> Result<Vec<u32>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("{}: expected a JSON array of token ids", path.display()))
}

#[derive(Serialize)]
struct TopEntry {
    token_id: u32,
    text: String,
    logprob: f32,
}

#[derive(Serialize)]
struct Step {
    token_id: u32,
    text: String,
    logprob: f32,
    top: Vec<TopEntry>,
}

#[derive(Serialize)]
struct LogprobDump {
    model: String,
    precision: &'static str,
    mode: &'static str,
    prompt_token_ids: Vec<u32>,
    steps: Vec<Step>,
}

pub fn run(a: &RunArgs) -> Result<()> {
    let Loaded {
        model,
        mut session,
        path,
    } = load(&a.model)?;
    let tok = &model.tokenizer;
    let prompt_ids = if let Some(p) = &a.prompt_ids {
        read_ids(p)?
    } else {
        let text = match (&a.prompt, &a.prompt_file) {
            (Some(p), _) => p.clone(),
            (None, Some(f)) => {
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?
            }
            (None, None) => {
                bail!("give a prompt with -p TEXT, --prompt-file FILE or --prompt-ids FILE")
            }
        };
        tok.encode(&text, true, true)
    };
    if a.dump_tokens {
        for &id in &prompt_ids {
            let piece = tok.token_piece(id, true);
            println!("{id:>7} {:?}", String::from_utf8_lossy(piece));
        }
        println!("{} tokens", prompt_ids.len());
        return Ok(());
    }
    if prompt_ids.is_empty() {
        bail!("the prompt is empty");
    }
    let forced = a.teacher_force.as_deref().map(read_ids).transpose()?;

    let t0 = Instant::now();
    prefill_with_bar(&mut session, &prompt_ids)?;
    let prefill_s = t0.elapsed().as_secs_f64();

    let mut sampler = Sampler::new(if a.dump_logprobs.is_some() {
        SamplerConfig {
            temperature: 0.0,
            ..a.sampling.config()
        }
    } else {
        a.sampling.config()
    });
    let n_steps = forced.as_ref().map_or(a.sampling.n_predict, Vec::len);
    let mut steps = Vec::new();
    let mut stream = StreamDecoder::default();
    let mut out = std::io::stdout().lock();
    let t1 = Instant::now();
    let mut n_decoded = 0;
    for i in 0..n_steps {
        let logits = session.logits()?;
        let next = match &forced {
            Some(f) => f[i],
            None => sampler.sample(logits),
        };
        if a.dump_logprobs.is_some() {
            let lp = log_softmax(logits);
            let piece = |id: u32| String::from_utf8_lossy(tok.token_piece(id, true)).into_owned();
            steps.push(Step {
                token_id: next,
                text: piece(next),
                logprob: lp.get(next as usize).copied().unwrap_or(f32::NEG_INFINITY),
                top: top_k(&lp, a.logprobs_top_k)
                    .into_iter()
                    .map(|(id, logprob)| TopEntry {
                        token_id: id,
                        text: piece(id),
                        logprob,
                    })
                    .collect(),
            });
            debug_assert!(forced.is_some() || next == argmax(logits));
        }
        let text = stream.push(tok.token_piece(next, false));
        out.write_all(text.as_bytes())?;
        out.flush()?;
        if forced.is_none() && tok.is_eog(next) {
            break;
        }
        if i + 1 == n_steps {
            break;
        }
        session.decode_step(next)?;
        n_decoded += 1;
    }
    writeln!(out, "{}", stream.finish())?;
    let decode_s = t1.elapsed().as_secs_f64();
    eprintln!(
        "prefill: {} tokens in {:.3} s ({:.1} t/s); decode: {} tokens in {:.3} s ({:.1} t/s)",
        prompt_ids.len(),
        prefill_s,
        prompt_ids.len() as f64 / prefill_s,
        n_decoded,
        decode_s,
        n_decoded as f64 / decode_s.max(1e-9),
    );
    if let Some(file) = &a.dump_logprobs {
        let dump = LogprobDump {
            model: path
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default(),
            precision: precision_name(a.model.precision()),
            mode: if forced.is_some() {
                "teacher-forced"
            } else {
                "greedy"
            },
            prompt_token_ids: prompt_ids,
            steps,
        };
        std::fs::write(file, serde_json::to_vec_pretty(&dump)?)
            .with_context(|| format!("writing {}", file.display()))?;
    }
    Ok(())
}

pub fn chat(a: &ChatArgs) -> Result<()> {
    let Loaded { model, session, .. } = load(&a.model)?;
    let tok = &model.tokenizer;
    let template = ds4_runtime::template_for(&model)
        .context("this model has no chat template ds4 renders (ChatML, or its family's own); use `ds4 run` for raw prompts")?;
    let system = match (&a.system, &a.system_file) {
        (Some(s), _) => Some(s.clone()),
        (None, Some(f)) => {
            Some(std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?)
        }
        (None, None) => None,
    };
    // Store and runtime notices go to stderr, a line each.
    let notices: NoticeSink = Arc::new(|n: Notice| {
        if !matches!(n, Notice::Planned(_) | Notice::Finished(_)) {
            eprintln!("{n}");
        }
    });
    let persist =
        a.kv.open(None)?
            .map(|store| Persist::new(store, &session, None, Arc::clone(&notices)));
    let pool = Arc::clone(session.pool());
    let runtime = Runtime::start(
        vec![session],
        pool,
        persist,
        RuntimeConfig::default(),
        notices,
    );
    let mut sampling = a.sampling.config();
    let mut history: Vec<Message> = system
        .into_iter()
        .map(|s| Message::new(Role::System, s))
        .collect();
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    eprintln!("type a message; /reset clears the conversation, /exit quits");
    loop {
        write!(out, "> ")?;
        out.flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                history.retain(|m| m.role == Role::System);
                eprintln!("(conversation cleared)");
                continue;
            }
            _ => {}
        }
        history.push(Message::new(Role::User, line));
        let prompt = template.render(
            &history,
            &RenderOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        );
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        let job = Job {
            id: format!("chat-{}", history.len()),
            route: "chat".into(),
            ids: encode_prompt(tok, &prompt),
            prompt: prompt.into(),
            sampling: sampling.clone(),
            limit: TokenLimit::Default(a.sampling.n_predict),
            stop: vec![],
            affinity: vec![],
            breakpoints: vec![],
            gate: None,
            turn_save: Some(ds4_kvstore::SaveReason::TurnEnd),
            logprobs: None,
            prompt_logprobs: None,
            meta: serde_json::Value::Null,
            events: tx,
        };
        // Each turn draws from its own stream of the seed.
        sampling.seed = sampling.seed.wrapping_add(1);
        runtime
            .handle
            .submit(job)
            .map_err(|e| anyhow::anyhow!("the runtime refused the turn: {e:?}"))?;
        let mut reply = String::new();
        let outcome = crate::turns::stream(rx, Some(1024), None, |piece| {
            write!(out, "{piece}")?;
            out.flush()?;
            reply.push_str(piece);
            Ok(())
        })?;
        writeln!(out)?;
        match outcome {
            Outcome::Done {
                usage,
                prefill_s,
                total_s,
                ..
            } => {
                history.push(Message::new(Role::Assistant, reply));
                let decode_s = (total_s - prefill_s).max(1e-9);
                eprintln!(
                    "[{}; prefilled {} tokens in {prefill_s:.2} s; {} generated at {:.1} t/s; {} in context]",
                    crate::turns::source_words(&usage),
                    usage.prompt_tokens - usage.cached_tokens,
                    usage.completion_tokens,
                    usage.completion_tokens.saturating_sub(1) as f64 / decode_s,
                    usage.prompt_tokens + usage.completion_tokens,
                );
            }
            Outcome::Failed(e) => {
                history.pop();
                eprintln!("error: {e}");
            }
            Outcome::Interrupted => bail!("the runtime stopped"),
        }
    }
    runtime.join();
    Ok(())
}
