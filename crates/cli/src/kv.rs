//! `ds4 kv`: inspect and maintain the disk checkpoint store.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use ds4_kvstore::{now_unix, EntryInfo, Store, StoreConfig};

#[derive(Args, Clone, Debug)]
pub struct KvCommand {
    /// Checkpoint directory (default: $DS4_HOME/kv).
    #[arg(long, value_name = "DIR", global = true)]
    pub kv_disk_dir: Option<PathBuf>,
    #[command(subcommand)]
    pub action: KvAction,
}

#[derive(Subcommand, Clone, Debug)]
pub enum KvAction {
    /// List checkpoints, lowest eviction score first (the next to go).
    Ls,
    /// Print one checkpoint's header and rendered text.
    Show {
        /// The file's SHA-1 name, or a unique prefix of it.
        hash: String,
    },
    /// Read every checkpoint in full and check sizes and checksums (changes
    /// nothing on disk).
    Verify {
        /// Delete the files that fail, and stale temp files of dead writers.
        #[arg(long)]
        fix: bool,
    },
    /// Delete one checkpoint.
    Rm {
        /// The file's SHA-1 name, or a unique prefix of it.
        hash: String,
    },
    /// Delete every checkpoint (other files in the directory are left alone).
    Clear,
}

pub fn run(cmd: &KvCommand) -> Result<()> {
    let dir = match &cmd.kv_disk_dir {
        Some(d) => d.clone(),
        None => crate::models::ds4_home()?.join("kv"),
    };
    // Inspecting changes nothing on disk (no temp file removed, no directory
    // created); a huge budget: maintenance never evicts either.
    let inspect = matches!(
        cmd.action,
        KvAction::Ls | KvAction::Show { .. } | KvAction::Verify { fix: false }
    );
    let config = StoreConfig {
        budget_bytes: u64::MAX,
        read_only: inspect,
        ..StoreConfig::default()
    };
    let store = Store::open(&dir, config).with_context(|| format!("opening {}", dir.display()))?;
    for n in store.drain_notices() {
        eprintln!("{n}");
    }
    match &cmd.action {
        KvAction::Ls => ls(&store),
        KvAction::Show { hash } => show(&store, hash),
        KvAction::Verify { fix } => {
            let r = store.verify(*fix)?;
            for (path, defect) in &r.bad {
                println!("BAD  {}: {defect}", path.display());
            }
            for (path, e) in &r.unreadable {
                println!("UNREADABLE  {}: {e}", path.display());
            }
            for path in &r.removed {
                println!("removed {}", path.display());
            }
            println!(
                "{} checked, {} ok, {} bad, {} unreadable",
                r.checked,
                r.ok,
                r.bad.len(),
                r.unreadable.len()
            );
            if !r.bad.is_empty() && !fix {
                bail!(
                    "{} damaged checkpoint(s); `ds4 kv verify --fix` deletes them",
                    r.bad.len()
                );
            }
            Ok(())
        }
        KvAction::Rm { hash } => {
            let e = find(&store, hash)?;
            store.remove(&e.hash)?;
            println!("removed {}", e.path.display());
            Ok(())
        }
        KvAction::Clear => {
            let n = store.clear()?;
            println!("removed {n} checkpoint(s) from {}", dir.display());
            Ok(())
        }
    }
}

fn ls(store: &Store) -> Result<()> {
    let entries = store.entries()?;
    let now = now_unix();
    println!(
        "{:<12} {:>7} {:<9} {:>5} {:>10} {:>9} {:>6}  text",
        "hash", "tokens", "reason", "hits", "score", "size", "age"
    );
    for e in &entries {
        println!(
            "{:<12} {:>7} {:<9} {:>5} {:>10.3e} {:>9} {:>6}  {}",
            &e.hash[..12],
            e.header.tokens,
            e.header.reason.as_str(),
            e.header.hits,
            e.score,
            human_bytes(e.file_bytes),
            human_age(now.saturating_sub(e.header.created)),
            e.excerpt.escape_debug()
        );
    }
    let total: u64 = entries.iter().map(|e| e.file_bytes).sum();
    println!(
        "{} checkpoint(s), {} in {}",
        entries.len(),
        human_bytes(total),
        store.dir().display()
    );
    Ok(())
}

fn show(store: &Store, hash: &str) -> Result<()> {
    let e = find(store, hash)?;
    let h = &e.header;
    println!("file        {}", e.path.display());
    println!("reason      {}", h.reason.as_str());
    println!("tokens      {}", h.tokens);
    println!("context     {}", h.n_ctx);
    println!("hits        {}", h.hits);
    println!("score       {:.4e}", e.score);
    println!(
        "created     {} ({} ago)",
        h.created,
        human_age(now_unix().saturating_sub(h.created))
    );
    println!("last used   {}", h.last_used);
    println!("text        {} bytes", h.text_bytes);
    println!("payload     {} bytes", h.payload_bytes);
    println!("sections    {} bytes", h.sections_bytes);
    println!("model fp    {}", hex(&h.model.model_fp));
    println!("quant fp    {}", hex(&h.model.quant_fp));
    println!("---- text ----");
    let text = read_text(&e.path, h.text_bytes)?;
    println!("{}", String::from_utf8_lossy(&text));
    Ok(())
}

/// The rendered text of a checkpoint file: the bytes right after the fixed header.
fn read_text(path: &std::path::Path, len: u64) -> Result<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    f.seek(SeekFrom::Start(ds4_kvstore::HEADER_LEN as u64))?;
    let mut text = Vec::new();
    f.take(len).read_to_end(&mut text)?;
    Ok(text)
}

fn find(store: &Store, prefix: &str) -> Result<EntryInfo> {
    let prefix = prefix.trim_end_matches(".kv").to_ascii_lowercase();
    if prefix.is_empty() {
        bail!("give a checkpoint hash (see `ds4 kv ls`)");
    }
    let mut hits: Vec<EntryInfo> = store
        .entries()?
        .into_iter()
        .filter(|e| e.hash.starts_with(&prefix))
        .collect();
    match hits.len() {
        0 => bail!(
            "no checkpoint matches {prefix:?} in {}",
            store.dir().display()
        ),
        1 => Ok(hits.remove(0)),
        n => bail!("{n} checkpoints match {prefix:?}; give more digits"),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn human_bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.1} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}

fn human_age(s: u64) -> String {
    match s {
        s if s >= 86400 => format!("{}d", s / 86400),
        s if s >= 3600 => format!("{}h", s / 3600),
        s if s >= 60 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}
