//! `ds4 bench --prefix-reuse`: what a checkpoint buys. Prefills a long prompt cold,
//! writes it to the disk store, restores it into a fresh session, and compares.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use ds4_engine::{Session, SessionOptions, ThreadPool};
use ds4_kvstore::{Payload, SaveOutcome, SaveReason, SaveRequest, Store, StoreConfig};

use super::{Bench, BenchArgs};

/// The default text here: an original story (public domain / CC0).
const STORY_TEXT: &str = include_str!("../../../../bench/carrow_point.txt");

pub fn run(a: &BenchArgs) -> Result<()> {
    let bench = Bench::load(&a.model)?;
    let ids = bench.tokens(a.prompt_file.as_deref(), STORY_TEXT, a.prompt_tokens)?;
    let n_ctx = a.model.ctx.max(ids.len() + 1);
    bench.model.rope_scaling_for(n_ctx)?;
    let threads = bench.threads;
    let opts = SessionOptions {
        n_ctx,
        prefill_chunk: a.model.prefill_chunk,
        precision: a.model.precision(),
        kv_type: a.model.kv_type(),
    };
    let (dir, temporary) = match &a.kv_disk_dir {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("ds4-bench-kv-{}", std::process::id())),
            true,
        ),
    };
    let result = measure(&bench.model, &bench.pool, &opts, &ids, &dir);
    if temporary {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let m = result?;
    let n = ids.len() as f64;
    println!("model            {}", bench.path.display());
    println!("threads          {threads}");
    println!("prompt tokens    {}", ids.len());
    println!(
        "cold prefill     {:.3} s ({:.1} t/s)",
        m.cold_s,
        n / m.cold_s
    );
    println!(
        "checkpoint write {:.3} s ({:.1} MiB, fsync included)",
        m.write_s,
        m.file_bytes as f64 / (1 << 20) as f64
    );
    println!(
        "restore          {:.3} s (lookup + read + verify + load)",
        m.restore_s
    );
    println!("bytes per token  {:.0}", m.file_bytes as f64 / n);
    println!(
        "restore / cold   {:.4} ({:.0}x faster)",
        m.restore_s / m.cold_s,
        m.cold_s / m.restore_s
    );
    println!("logits after restore are bitwise identical to the cold session's: yes");
    Ok(())
}

struct Measured {
    cold_s: f64,
    write_s: f64,
    restore_s: f64,
    file_bytes: u64,
}

fn measure(
    model: &Arc<ds4_engine::Model>,
    pool: &Arc<ThreadPool>,
    opts: &SessionOptions,
    ids: &[u32],
    dir: &std::path::Path,
) -> Result<Measured> {
    let mut cold = Session::new(Arc::clone(model), Arc::clone(pool), opts);
    let bar = indicatif::ProgressBar::new(ids.len() as u64);
    let t = Instant::now();
    cold.prefill_with_progress(ids, |done, _| bar.set_position(done as u64))?;
    let cold_s = t.elapsed().as_secs_f64();
    bar.finish_and_clear();

    let store = Store::open(
        dir,
        StoreConfig {
            budget_bytes: u64::MAX,
            ..StoreConfig::default()
        },
    )?;
    let text = model.tokenizer.prompt_text(cold.tokens());
    let id = ds4_runtime::model_id(&cold);
    let t = Instant::now();
    let mut write = |w: &mut dyn std::io::Write| {
        let mut w = std::io::BufWriter::with_capacity(1 << 20, w);
        cold.save_payload(&mut w).map_err(std::io::Error::other)
    };
    let outcome = store.save(SaveRequest {
        text: &text,
        payload: Payload::Stream {
            estimated_bytes: cold.payload_bytes(),
            write: &mut write,
        },
        reason: SaveReason::Cold,
        tokens: ids.len() as u32,
        n_ctx: opts.n_ctx as u32,
        model: id,
        ext_flags: 0,
        sections: &[],
    })?;
    let write_s = t.elapsed().as_secs_f64();
    let file_bytes = match outcome {
        SaveOutcome::Saved { file_bytes, .. } => file_bytes,
        other => bail!("the checkpoint was not written: {other:?}"),
    };

    let mut warm = Session::new(Arc::clone(model), Arc::clone(pool), opts);
    let t = Instant::now();
    let cand = store
        .lookup(&text, &id, opts.n_ctx as u32)?
        .context("the checkpoint just written was not found")?;
    let loaded = store.load(&cand, &text)?;
    warm.load_payload(&mut loaded.payload.as_slice())?;
    let restore_s = t.elapsed().as_secs_f64();
    let same = cold
        .logits()?
        .iter()
        .zip(warm.logits()?)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    ensure!(
        same && warm.tokens() == cold.tokens(),
        "restored state differs from the cold one"
    );
    Ok(Measured {
        cold_s,
        write_s,
        restore_s,
        file_bytes,
    })
}
