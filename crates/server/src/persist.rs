//! Sessions and the disk checkpoint store: restore the longest saved prefix of a
//! rendered prompt, prefill the rest while saving at the policy's boundaries (cold
//! and continued saves cut the prefill where a save is due; the live session is
//! never rewound to make one), and save on eviction and shutdown.

use std::time::Instant;

use ds4_engine::{EngineError, KvType, Session};
use std::sync::Arc;

use ds4_kvstore::{
    ModelId, Notice, Payload, SaveOutcome, SavePolicy, SaveReason, SaveRequest, Store,
    EXT_TOOL_ID_MAP,
};

use crate::tooling::ToolMemory;

/// Prints and clears the store's pending notices (one line each, on stderr) and
/// returns how many were evictions.
pub fn report_notices(store: &Store) -> u64 {
    let mut evictions = 0;
    for n in store.drain_notices() {
        evictions += u64::from(matches!(n, Notice::Evicted(_)));
        eprintln!("{n}");
    }
    evictions
}

/// What the store holds and what this process's saves did to it (`/metrics`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreUsage {
    pub files: usize,
    pub bytes: u64,
    /// Checkpoints evicted by this process's saves.
    pub evictions: u64,
    /// Saves that failed (a full disk, permissions, I/O errors).
    pub save_failures: u64,
}

/// How a caller runs one stretch of prefill (with or without a progress bar).
pub type PrefillFn<'a> = dyn FnMut(&mut Session, &[u32]) -> Result<(), EngineError> + 'a;

/// A live session's link to the store.
pub struct Persist {
    pub store: Store,
    model: ModelId,
    /// Last continued-save frontier of the live session.
    continued_frontier: usize,
    /// Tokens written by successful saves so far (per-request differences feed
    /// Anthropic's `cache_creation_input_tokens`).
    saved_tokens: usize,
    /// Checkpoints evicted by this process's saves.
    evictions: u64,
    /// Saves that failed (full disk, permissions, I/O errors).
    save_failures: u64,
    /// The file of the last checkpoint restored or saved, for the trace.
    pub last_file: Option<std::path::PathBuf>,
    /// Exact tool-call text saved with checkpoints and reloaded on a hit.
    pub tool_memory: Option<Arc<ToolMemory>>,
    /// The session's K/V type, and the identity of checkpoints of the other type.
    kv_type: KvType,
    other_kv: (KvType, ModelId),
    /// Restores that missed although a checkpoint of the other K/V type matched.
    pub kv_type_skips: u64,
}

/// What `session`'s checkpoints are filed under: its state fingerprint (the
/// model's layout, folded with the K/V type and RoPE scaling, so an f16
/// checkpoint never serves an f32 session nor the reverse), the quantization
/// and the weights.
pub fn model_id(session: &Session) -> ModelId {
    let fp = session.model().fingerprint;
    ModelId {
        model_fp: session.state_fingerprint(),
        quant_fp: fp.quant,
        weights_fp: fp.weights,
    }
}

impl Persist {
    pub fn new(store: Store, session: &Session) -> Self {
        let fp = session.model().fingerprint;
        let other = match session.kv_type() {
            KvType::F32 => KvType::F16,
            KvType::F16 => KvType::F32,
        };
        let model = model_id(session);
        Persist {
            store,
            model,
            continued_frontier: 0,
            saved_tokens: 0,
            evictions: 0,
            save_failures: 0,
            last_file: None,
            tool_memory: None,
            kv_type: session.kv_type(),
            other_kv: (
                other,
                ModelId {
                    // The same RoPE scaling as this session's, so the notice
                    // names only checkpoints that differ in the K/V type.
                    model_fp: session
                        .rope_scaling()
                        .fold_fingerprint(other.state_fingerprint(&fp)),
                    ..model
                },
            ),
            kv_type_skips: 0,
        }
    }

    /// Checkpoints shorter than this are neither saved nor loaded.
    pub fn min_tokens(&self) -> usize {
        self.policy().min_tokens.max(1)
    }

    /// Tokens written by successful saves since this was created.
    pub fn saved_tokens(&self) -> usize {
        self.saved_tokens
    }

    /// What the store holds, and what this process's saves did to it.
    pub fn store_usage(&self) -> StoreUsage {
        let (files, bytes) = self.store.usage();
        StoreUsage {
            files,
            bytes,
            evictions: self.evictions,
            save_failures: self.save_failures,
        }
    }

    pub fn policy(&self) -> SavePolicy {
        *self.store.policy()
    }

    /// The checkpoint that shares the most of `prompt` without being a prefix of
    /// it (for explaining a miss); store failures count as none.
    pub fn nearest_miss(&self, prompt: &[u8], n_ctx: usize) -> Option<ds4_kvstore::NearMiss> {
        self.store
            .nearest_miss(prompt, &self.model, n_ctx as u32)
            .ok()
            .flatten()
    }

    /// Loads the longest checkpoint that is a prefix of `prompt` into the (empty)
    /// session and returns the number of prompt bytes it covers (0 on a miss or on
    /// any failure, which is reported and leaves the session empty).
    pub fn restore(&mut self, session: &mut Session, prompt: &[u8]) -> usize {
        self.continued_frontier = 0;
        let t = Instant::now();
        let cand = match self
            .store
            .lookup(prompt, &self.model, session.n_ctx() as u32)
        {
            Ok(Some(c)) if c.header.tokens as usize >= self.policy().min_tokens => c,
            Ok(_) => {
                self.explain_miss(prompt, session.n_ctx());
                return 0;
            }
            Err(e) => {
                eprintln!("kv cache lookup failed: {e}");
                return 0;
            }
        };
        let loaded = match self.store.load(&cand, prompt) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("kv cache load failed: {e}");
                report_notices(&self.store);
                return 0;
            }
        };
        if let Err(e) = session.load_payload(&mut loaded.payload.as_slice()) {
            eprintln!("kv cache load failed file={}: {e}", cand.path.display());
            return 0;
        }
        if session.tokens().len() != loaded.header.tokens as usize {
            eprintln!(
                "kv cache load failed file={}: header says {} tokens, payload holds {}",
                cand.path.display(),
                loaded.header.tokens,
                session.tokens().len()
            );
            session.reset();
            return 0;
        }
        self.continued_frontier = session.tokens().len();
        self.last_file = Some(cand.path.clone());
        if let Some(m) = &self.tool_memory {
            for s in &loaded.sections {
                if s.kind == crate::tooling::SECTION_TOOL_IDS {
                    m.load_section(&s.bytes);
                }
            }
        }
        eprintln!(
            "kv cache hit: restored {} tokens ({} bytes of text) in {:.0} ms from {}",
            session.tokens().len(),
            loaded.text.len(),
            t.elapsed().as_secs_f64() * 1e3,
            cand.path.display()
        );
        loaded.text.len()
    }

    /// After a miss: says which checkpoint would have served the prompt and why
    /// it was not loaded — saved by other weights, before weights were
    /// recorded, with the other K/V type (its rows were rounded differently),
    /// another model or a larger context.
    fn explain_miss(&mut self, prompt: &[u8], n_ctx: usize) {
        let Ok(Some((path, h, why))) = self.store.lookup_refused(prompt, &self.model, n_ctx as u32)
        else {
            return;
        };
        if (h.tokens as usize) < self.policy().min_tokens {
            return;
        }
        let (other, id) = self.other_kv;
        if h.model.model_fp == id.model_fp {
            self.kv_type_skips += 1;
            eprintln!(
                "kv cache: skipped {} ({} tokens): saved with {other} K/V, this session \
                 stores {} (--kv-type)",
                path.display(),
                h.tokens,
                self.kv_type
            );
        } else {
            eprintln!(
                "kv cache: not loading {} ({} tokens, its text is a prefix of the prompt): {why}",
                path.display(),
                h.tokens
            );
        }
    }

    /// Prefills `ids` onto the session, stopping where a cold save (when
    /// `cold_prompt`, i.e. nothing was reused), a continued save or a client's
    /// cache breakpoint (`hints`: prompt token counts, trimmed and aligned like a
    /// cold save) is due and saving there. Save failures are reported and
    /// skipped; prefill errors are returned.
    pub fn prefill(
        &mut self,
        session: &mut Session,
        ids: &[u32],
        cold_prompt: bool,
        hints: &[usize],
        prefill: &mut PrefillFn<'_>,
    ) -> Result<(), EngineError> {
        let policy = self.policy();
        let start = session.tokens().len();
        let mut cuts: Vec<(usize, SaveReason)> = Vec::new();
        if cold_prompt && start == 0 {
            if let Some(c) = policy.cold_save_len(ids.len()) {
                cuts.push((c, SaveReason::Cold));
            }
        }
        for &h in hints {
            if let Some(at) = policy.cold_save_len(h) {
                if at > start && at <= start + ids.len() && !cuts.iter().any(|&(c, _)| c == at) {
                    cuts.push((at, SaveReason::ClientHint));
                }
            }
        }
        let mut f = self.continued_frontier;
        while let Some(next) = policy.next_continued_frontier(f) {
            if next > start + ids.len() {
                break;
            }
            if next > start && !cuts.iter().any(|&(c, _)| c == next) {
                cuts.push((next, SaveReason::Continued));
            }
            f = next;
        }
        cuts.sort_by_key(|&(at, _)| at);
        for (at, reason) in cuts {
            let done = session.tokens().len() - start;
            prefill(session, &ids[done..at - start])?;
            self.save(session, reason);
            if reason == SaveReason::Continued {
                self.continued_frontier = at;
            }
        }
        let done = session.tokens().len() - start;
        prefill(session, &ids[done..])
    }

    /// Called after each decode step: a continued save when the live session has
    /// just reached a continued-save frontier.
    pub fn after_decode(&mut self, session: &Session) {
        let len = session.tokens().len();
        if self
            .policy()
            .continued_frontier(self.continued_frontier, len)
            == Some(len)
        {
            self.save(session, SaveReason::Continued);
            self.continued_frontier = len;
        }
    }

    /// Saves the whole live session under `reason` if it is long enough. Failures
    /// (full disk, permissions) are reported and otherwise ignored.
    pub fn save(&mut self, session: &Session, reason: SaveReason) {
        let n = session.tokens().len();
        if n < self.policy().min_tokens.max(1) {
            return;
        }
        let t = Instant::now();
        let text = session.model().tokenizer.prompt_text(session.tokens());
        let sections: Vec<_> = self
            .tool_memory
            .as_ref()
            .and_then(|m| m.section_for(&String::from_utf8_lossy(&text)))
            .into_iter()
            .collect();
        let mut write = |w: &mut dyn std::io::Write| {
            let mut w = std::io::BufWriter::with_capacity(1 << 20, w);
            session.save_payload(&mut w).map_err(std::io::Error::other)
        };
        let req = SaveRequest {
            text: &text,
            payload: Payload::Stream {
                estimated_bytes: session.payload_bytes(),
                write: &mut write,
            },
            reason,
            tokens: n as u32,
            n_ctx: session.n_ctx() as u32,
            model: self.model,
            ext_flags: if sections.is_empty() {
                0
            } else {
                EXT_TOOL_ID_MAP
            },
            sections: &sections,
        };
        match self.store.save(req) {
            Ok(SaveOutcome::Saved {
                file_bytes, path, ..
            }) => {
                self.saved_tokens += n;
                self.last_file = Some(path.clone());
                eprintln!(
                    "kv cache stored tokens={n} reason={} size={:.1} MiB save={:.0} ms file={}",
                    reason.as_str(),
                    file_bytes as f64 / (1 << 20) as f64,
                    t.elapsed().as_secs_f64() * 1e3,
                    path.display()
                )
            }
            Ok(SaveOutcome::Kept { .. }) => {}
            Ok(SaveOutcome::Skipped(why)) => eprintln!("kv cache save skipped tokens={n}: {why:?}"),
            Err(e) => {
                self.save_failures += 1;
                eprintln!(
                    "kv cache save failed tokens={n} reason={}: {e}",
                    reason.as_str()
                )
            }
        }
        self.evictions += report_notices(&self.store);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ds4_engine::{Model, Precision, SessionOptions, ThreadPool};
    use ds4_kvstore::{SaveReason, StoreConfig};

    use super::*;

    fn session(model: &Arc<Model>, kv_type: KvType) -> Session {
        let opts = SessionOptions {
            n_ctx: 1024,
            prefill_chunk: 256,
            precision: Precision::Fast,
            kv_type,
        };
        Session::new(Arc::clone(model), Arc::new(ThreadPool::new(1)), &opts)
    }

    /// A checkpoint saved by an f16 session is skipped (with a notice) by an f32
    /// session's restore, which starts cold; and the reverse; a session of the
    /// saving type restores it.
    #[test]
    fn checkpoints_of_the_other_kv_type_are_skipped() {
        let model = Arc::new(
            Model::load(ds4_testdata::model_path(ds4_testdata::SMOLLM2)).expect("loading SmolLM2"),
        );
        let text = "The quick brown fox jumps over the lazy dog. ".repeat(70);
        let ids = model.tokenizer.encode(&text, true, true);
        assert!(ids.len() >= 600, "{} tokens", ids.len());
        for saver in [KvType::F16, KvType::F32] {
            let dir = std::env::temp_dir()
                .join(format!("ds4-persist-kvtype-{}-{saver}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            let open = || Store::open(&dir, StoreConfig::default()).unwrap();
            let mut s = session(&model, saver);
            s.prefill(&ids).unwrap();
            let mut p = Persist::new(open(), &s);
            p.save(&s, SaveReason::Shutdown);
            assert_eq!(p.store_usage().files, 1, "{saver}: saved");
            let prompt = model.tokenizer.prompt_text(s.tokens());

            let other = if saver == KvType::F16 {
                KvType::F32
            } else {
                KvType::F16
            };
            let mut o = session(&model, other);
            let mut po = Persist::new(open(), &o);
            assert_eq!(po.restore(&mut o, &prompt), 0, "{saver} into {other}");
            assert!(o.tokens().is_empty());
            assert_eq!(po.kv_type_skips, 1);

            let mut same = session(&model, saver);
            let mut ps = Persist::new(open(), &same);
            assert_eq!(ps.restore(&mut same, &prompt), prompt.len());
            assert_eq!(same.tokens(), s.tokens());
            assert_eq!(ps.kv_type_skips, 0);
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}
