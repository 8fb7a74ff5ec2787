//! Flags of the disk checkpoint store, shared by the commands that keep sessions.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use ds4_kvstore::{SavePolicy, Store, StoreConfig};

/// Disk checkpoint flags (names as in the original system).
#[derive(Args, Clone, Debug)]
pub struct KvArgs {
    /// Directory of the disk checkpoint store (created 0700).
    #[arg(long, value_name = "DIR")]
    pub kv_disk_dir: Option<PathBuf>,
    /// Run without the disk checkpoint store.
    #[arg(long, conflicts_with = "kv_disk_dir")]
    pub no_kv_disk: bool,
    /// Byte budget of the store in MiB.
    #[arg(long, default_value_t = 4096)]
    pub kv_disk_space_mb: u64,
    /// Never save or load checkpoints shorter than this.
    #[arg(long, default_value_t = 512)]
    pub kv_cache_min_tokens: usize,
    /// Cold-save first prompts up to this many tokens (0 disables cold saves).
    #[arg(long, default_value_t = 30000)]
    pub kv_cache_cold_max_tokens: usize,
    /// Continued saves every this many tokens, rounded up to the alignment (0 disables).
    #[arg(long, default_value_t = 10000)]
    pub kv_cache_continued_interval_tokens: usize,
    /// Tail tokens dropped before a cold save boundary.
    #[arg(long, default_value_t = 32)]
    pub kv_cache_boundary_trim_tokens: usize,
    /// Cold saves and the continued step align down to this many tokens (0: none).
    #[arg(long, default_value_t = 2048)]
    pub kv_cache_boundary_align_tokens: usize,
    /// Refuse checkpoints written by another quantization of the same model.
    #[arg(long)]
    pub kv_cache_reject_different_quant: bool,
}

impl KvArgs {
    pub fn config(&self) -> Result<StoreConfig> {
        let policy = SavePolicy {
            min_tokens: self.kv_cache_min_tokens,
            cold_max_tokens: self.kv_cache_cold_max_tokens,
            trim_tokens: self.kv_cache_boundary_trim_tokens,
            align_tokens: self.kv_cache_boundary_align_tokens,
            continued_interval: self.kv_cache_continued_interval_tokens,
        };
        anyhow::ensure!(
            policy.cold_max_tokens == 0 || policy.cold_max_tokens >= policy.min_tokens,
            "--kv-cache-cold-max-tokens must be 0 or at least --kv-cache-min-tokens"
        );
        Ok(StoreConfig {
            budget_bytes: self.kv_disk_space_mb.saturating_mul(1 << 20),
            policy,
            reject_different_quant: self.kv_cache_reject_different_quant,
            ..StoreConfig::default()
        })
    }

    /// Opens the store at `--kv-disk-dir`, else at `default_dir` if given; none
    /// with `--no-kv-disk`.
    pub fn open(&self, default_dir: Option<PathBuf>) -> Result<Option<Store>> {
        if self.no_kv_disk {
            return Ok(None);
        }
        let Some(dir) = self.kv_disk_dir.clone().or(default_dir) else {
            return Ok(None);
        };
        let config = self.config()?;
        let store = Store::open(&dir, config.clone())
            .with_context(|| format!("opening {}", dir.display()))?;
        let p = config.policy;
        eprintln!(
            "KV disk cache {} (budget={} MiB, cross-quant={}, min={}, cold_max={}, continued={}, trim={}, align={})",
            dir.display(),
            self.kv_disk_space_mb,
            if config.reject_different_quant { "reject" } else { "accept" },
            p.min_tokens,
            p.cold_max_tokens,
            p.continued_step(),
            p.trim_tokens,
            p.align_tokens
        );
        // What opening found (damaged files skipped, stale temp files).
        for n in store.drain_notices() {
            eprintln!("{n}");
        }
        Ok(Some(store))
    }
}
