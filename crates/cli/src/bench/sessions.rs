//! `ds4 bench --sessions N`: the runtime's slots under concurrent clients, in
//! process (no HTTP). Clients share a long prefix and each has a private part;
//! they run alone (the single-session baseline), then all at once (cold: the
//! shared prefix is prefilled once and forked), then all at once again (warm:
//! each slot holds its conversation). Last, one client decodes while another
//! prefills a long cold prompt: how much that prefill stretches its
//! inter-token gaps.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use ds4_engine::SamplerConfig;
use ds4_runtime::{Event, Job, Runtime, RuntimeConfig, RuntimeHandle, TokenLimit};
use tokio::sync::mpsc;

use super::{Bench, BenchArgs, BOOK_TEXT};

/// Tokens of each turn of the prefill-stall test's decoder.
const STALL_TURN: usize = 128;

/// Whether a client hangs up, given its tokens' arrival times so far.
type Until<'a> = dyn Fn(&[f64]) -> bool + 'a;

/// What one client saw of its request.
struct Timeline {
    client: usize,
    slot: usize,
    source: &'static str,
    prompt: usize,
    reused: usize,
    queue_s: f64,
    /// Seconds from submission to the first token.
    ttft_s: f64,
    /// Arrival time of every token's text, from submission.
    tokens: Vec<f64>,
}

impl Timeline {
    fn decode_tps(&self) -> Option<f64> {
        let (first, last) = (self.tokens.first()?, self.tokens.last()?);
        (self.tokens.len() > 1 && last > first)
            .then(|| (self.tokens.len() - 1) as f64 / (last - first))
    }
}

pub fn run(a: &BenchArgs, slots: usize) -> Result<()> {
    let bench = Bench::load(&a.model)?;
    let clients = a.clients.unwrap_or(slots);
    let (shared, private, gen) = (a.shared_tokens, a.private_tokens, a.gen_tokens);
    let book = bench.tokens(
        a.prompt_file.as_deref(),
        BOOK_TEXT,
        shared + private * clients + a.stall_prefill + 1,
    )?;
    let prompt_of = |c: usize| -> Vec<u32> {
        let mut ids = book[..shared].to_vec();
        ids.extend_from_slice(&book[shared + c * private..shared + (c + 1) * private]);
        ids
    };
    // The cold prompt comes from the end of the text: it shares no prefix
    // with the clients' (unless the text had to repeat to make it).
    let cold: Vec<u32> = book[book.len() - a.stall_prefill..].to_vec();
    let n_ctx = a
        .model
        .ctx
        .max(shared + private + gen + 1)
        .max(a.stall_prefill + 1);
    bench.model.rope_scaling_for(n_ctx)?;
    let first = bench.session(&a.model, n_ctx)?;
    let per_slot = first.state_memory_bytes();
    let mut sessions = vec![first];
    while sessions.len() < slots {
        let s = sessions[0].sibling(n_ctx);
        sessions.push(s);
    }
    println!("model            {}", bench.path.display());
    println!("threads          {}", bench.threads);
    println!(
        "slots            {slots} of {n_ctx} tokens ({:.0} MiB of state each)",
        per_slot as f64 / (1 << 20) as f64
    );
    println!(
        "clients          {clients}: {shared} shared + {private} private prompt tokens, {gen} generated"
    );
    let runtime = Runtime::start(
        sessions,
        Arc::clone(&bench.pool),
        None,
        RuntimeConfig {
            prefill_quantum: a.mixed_prefill_quantum,
            queue_max: clients.max(64),
            draft_max: a.draft_max,
        },
        ds4_runtime::discard(),
    );
    let h = runtime.handle.clone();
    let text =
        |ids: &[u32]| String::from_utf8_lossy(&bench.model.tokenizer.prompt_text(ids)).into_owned();
    let result = (|| -> Result<()> {
        let solo = round(&h, &[(0, text(&prompt_of(0)), prompt_of(0))], gen)?;
        let single = solo[0]
            .decode_tps()
            .context("the single session generated fewer than two tokens")?;
        let all: Vec<(usize, String, Vec<u32>)> = (0..clients)
            .map(|c| (c, text(&prompt_of(c)), prompt_of(c)))
            .collect();
        let cold_round = round(&h, &all, gen)?;
        report("alone (client 0)", &solo, single);
        report("all at once, cold", &cold_round, single);
        let warm_round = round(&h, &all, gen)?;
        report("all at once, warm", &warm_round, single);
        if a.stall_prefill > 0 {
            ensure!(slots >= 2, "the prefill-stall test needs two slots");
            stall(
                &h,
                &text(&book[..64]),
                book[..64].to_vec(),
                &text(&cold),
                cold,
            )?;
        }
        Ok(())
    })();
    // The runtime stops once every handle is gone.
    drop(h);
    runtime.handle.begin_shutdown();
    runtime.join();
    result
}

/// Submits every `(client, prompt, ids)` at once and waits for all of them.
fn round(
    h: &RuntimeHandle,
    prompts: &[(usize, String, Vec<u32>)],
    gen: usize,
) -> Result<Vec<Timeline>> {
    let t0 = Instant::now();
    let receivers = prompts
        .iter()
        .map(|(c, prompt, ids)| {
            let rx = submit(
                h,
                format!("bench-{c}"),
                prompt,
                ids.clone(),
                TokenLimit::Requested(gen),
            )?;
            Ok((*c, rx))
        })
        .collect::<Result<Vec<_>>>()?;
    let threads: Vec<_> = receivers
        .into_iter()
        .map(|(c, rx)| std::thread::spawn(move || follow(c, rx, t0, None)))
        .collect();
    threads
        .into_iter()
        .map(|t| {
            t.join()
                .map_err(|_| anyhow::anyhow!("a client thread panicked"))?
        })
        .collect()
}

fn submit(
    h: &RuntimeHandle,
    id: String,
    prompt: &str,
    ids: Vec<u32>,
    limit: TokenLimit,
) -> Result<mpsc::Receiver<Event>> {
    let (tx, rx) = mpsc::channel(4096);
    h.submit(Job {
        id,
        route: "bench".into(),
        prompt: prompt.to_string(),
        ids,
        // Greedy on a novel's text: end-of-text is rare, and each token is
        // counted as it arrives, so an early stop only shortens the sample.
        sampling: SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        },
        limit,
        stop: vec![],
        affinity: vec![],
        breakpoints: vec![],
        gate: None,
        turn_save: Some(ds4_kvstore::SaveReason::TurnEnd),
        logprobs: None,
        prompt_logprobs: None,
        meta: serde_json::Value::Null,
        events: tx,
    })
    .map_err(|e| anyhow::anyhow!("submitting a benchmark job: {e}"))?;
    Ok(rx)
}

/// Reads a job's events to the end (or until `until` returns true after a
/// token, when the receiver is dropped: the runtime cancels the job).
fn follow(
    client: usize,
    mut rx: mpsc::Receiver<Event>,
    t0: Instant,
    until: Option<&Until<'_>>,
) -> Result<Timeline> {
    let mut t = Timeline {
        client,
        slot: 0,
        source: "none",
        prompt: 0,
        reused: 0,
        queue_s: 0.0,
        ttft_s: 0.0,
        tokens: vec![],
    };
    while let Some(e) = rx.blocking_recv() {
        match e {
            Event::Started(u) | Event::Done { usage: u, .. } => {
                t.slot = u.slot;
                t.source = u.cache_source.as_str();
                t.prompt = u.prompt_tokens;
                t.reused = u.cached_tokens;
                t.queue_s = u.queue_s;
            }
            Event::Text(_) => {
                t.tokens.push(t0.elapsed().as_secs_f64());
                if until.is_some_and(|stop| stop(&t.tokens)) {
                    break;
                }
            }
            Event::Progress { .. } | Event::Logprobs(_) | Event::PromptLogprobs(_) => {}
            Event::Failed(e) => bail!("client {client}: {e}"),
        }
    }
    t.ttft_s = t.tokens.first().copied().unwrap_or(f64::NAN);
    Ok(t)
}

/// Prints one round: a line per client, then the aggregate.
fn report(title: &str, round: &[Timeline], single: f64) {
    println!();
    println!("{title}");
    println!("client  slot  cache         prompt  reused  queue_s  ttft_s  tokens  decode_t/s");
    for t in round {
        println!(
            "{:>6}  {:>4}  {:<12}  {:>6}  {:>6}  {:>7.2}  {:>6.2}  {:>6}  {:>10}",
            t.client,
            t.slot,
            t.source,
            t.prompt,
            t.reused,
            t.queue_s,
            t.ttft_s,
            t.tokens.len(),
            t.decode_tps().map_or("-".into(), |r| format!("{r:.1}"))
        );
    }
    let ttfts: Vec<f64> = round.iter().map(|t| t.ttft_s).collect();
    let queue: Vec<f64> = round.iter().map(|t| t.queue_s).collect();
    // Decode throughput of the round: every token after each client's first,
    // over the span from the earliest first token to the latest last one.
    let start = round
        .iter()
        .filter_map(|t| t.tokens.first())
        .fold(f64::MAX, |a, &b| a.min(b));
    let end = round
        .iter()
        .filter_map(|t| t.tokens.last())
        .fold(0.0f64, |a, &b| a.max(b));
    let decoded: usize = round.iter().map(|t| t.tokens.len().saturating_sub(1)).sum();
    let aggregate = decoded as f64 / (end - start).max(f64::EPSILON);
    let mut mix: Vec<(&str, usize)> = vec![];
    for t in round {
        match mix.iter_mut().find(|(s, _)| *s == t.source) {
            Some((_, n)) => *n += 1,
            None => mix.push((t.source, 1)),
        }
    }
    let mix: Vec<String> = mix.iter().map(|(s, n)| format!("{s} {n}")).collect();
    println!(
        "aggregate decode {aggregate:.1} t/s ({:.2}x one session alone, {single:.1} t/s); TTFT p50 {:.2} s p99 {:.2} s; queue wait p50 {:.2} s max {:.2} s; cache: {}",
        aggregate / single,
        percentile(&ttfts, 0.5),
        percentile(&ttfts, 0.99),
        percentile(&queue, 0.5),
        percentile(&queue, 1.0),
        mix.join(", ")
    );
}

/// One client decodes turns of [`STALL_TURN`] tokens from a short prompt, one
/// after another: two alone (its idle gaps), then a cold prompt arrives on
/// another slot; the gaps inside its turns until that prompt's first token are
/// the ones the prefill stretched. Turns of a fixed length keep the decoder's
/// own context (what its steps cost) the same alone and beside the prefill.
fn stall(
    h: &RuntimeHandle,
    short: &str,
    short_ids: Vec<u32>,
    cold: &str,
    cold_ids: Vec<u32>,
) -> Result<()> {
    const IDLE_TURNS: usize = 2;
    let n_cold = cold_ids.len();
    let t0 = Instant::now();
    let (started_tx, started_rx) = std::sync::mpsc::channel::<f64>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<f64>();
    let decoder_h = h.clone();
    let short = short.to_string();
    let decoder = std::thread::spawn(move || -> Result<Vec<Timeline>> {
        let mut turns = Vec::new();
        let cold_done = std::cell::Cell::new(None::<f64>);
        // Hang up a few tokens past the cold prompt's first.
        let until = |tokens: &[f64]| {
            if cold_done.get().is_none() {
                cold_done.set(done_rx.try_recv().ok());
            }
            cold_done
                .get()
                .is_some_and(|d| tokens.last().is_some_and(|&l| l > d + 0.2))
        };
        while cold_done.get().is_none() {
            let rx = submit(
                &decoder_h,
                format!("bench-decoder-{}", turns.len()),
                &short,
                short_ids.clone(),
                TokenLimit::Requested(STALL_TURN),
            )?;
            turns.push(follow(0, rx, t0, Some(&until))?);
            if turns.len() == IDLE_TURNS {
                let _ = started_tx.send(t0.elapsed().as_secs_f64());
            }
        }
        Ok(turns)
    });
    let submitted = started_rx
        .recv_timeout(Duration::from_secs(600))
        .context("the decoding client never finished its idle turns")?;
    let cold_rx = submit(
        h,
        "bench-cold".into(),
        cold,
        cold_ids,
        TokenLimit::Requested(1),
    )?;
    let cold_t = follow(1, cold_rx, t0, None)?;
    let first = cold_t
        .tokens
        .first()
        .copied()
        .context("the cold prompt produced no token")?;
    let _ = done_tx.send(first);
    let turns = decoder
        .join()
        .map_err(|_| anyhow::anyhow!("the decoding thread panicked"))??;
    let gaps = |from: f64, to: f64| -> Vec<f64> {
        turns
            .iter()
            .flat_map(|t| t.tokens.windows(2))
            .filter(|w| w[0] >= from && w[1] <= to)
            .map(|w| w[1] - w[0])
            .collect()
    };
    let idle = gaps(0.0, submitted);
    let during = gaps(submitted, first);
    ensure!(
        !during.is_empty(),
        "no token was decoded during the cold prefill"
    );
    println!();
    println!("one slot decoding while another prefills {n_cold} tokens cold");
    println!(
        "cold prefill     {:.2} s to its first token ({:.0} t/s, shared with the decoder)",
        first - submitted,
        n_cold as f64 / (first - submitted)
    );
    println!(
        "decoder gaps     alone p50 {:.1} ms p99 {:.1} ms ({} gaps); during the prefill p50 {:.1} ms p99 {:.1} ms ({} gaps)",
        percentile(&idle, 0.5) * 1e3,
        percentile(&idle, 0.99) * 1e3,
        idle.len(),
        percentile(&during, 0.5) * 1e3,
        percentile(&during, 0.99) * 1e3,
        during.len()
    );
    println!(
        "gap p99 during / alone: {:.2}x the p99, {:.2}x the p50",
        percentile(&during, 0.99) / percentile(&idle, 0.99),
        percentile(&during, 0.99) / percentile(&idle, 0.5)
    );
    Ok(())
}

/// The `q` quantile (nearest rank) of `xs`; NaN when empty.
fn percentile(xs: &[f64], q: f64) -> f64 {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}
