//! Sessions and the disk checkpoint store: restore the longest saved prefix of a
//! rendered prompt, the save policy's cut points in a prefill (cold and
//! continued saves and clients' cache breakpoints cut the prefill where a save
//! is due; a live session is never rewound to make one), and saves, each
//! reported as a [`Notice`].

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use ds4_engine::{KvType, Session};
use ds4_kvstore::{
    Candidate, ModelId, Payload, SaveOutcome, SavePolicy, SaveReason, SaveRequest, Shared, Store,
    EXT_TOOL_ID_MAP,
};

use crate::notice::{Notice, NoticeSink};
use crate::tool_memory::{ToolMemory, SECTION_TOOL_IDS};

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

/// What loading a checkpoint costs and what prefilling saves, as measured by
/// this process's loads and prefills (defaults until the first of each): the
/// reuse plan weighs a load against the prefill it saves.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rates {
    pub load_bytes_per_s: f64,
    pub prefill_tokens_per_s: f64,
    measured_prefill: bool,
}

impl Default for Rates {
    /// A disk read from the page cache or a fast SSD, and a slow prefill: until
    /// measured, loading is favoured (as before loads were weighed).
    fn default() -> Self {
        Rates {
            load_bytes_per_s: 1e9,
            prefill_tokens_per_s: 200.0,
            measured_prefill: false,
        }
    }
}

impl Rates {
    /// Folds a prefill's measured rate in: the first replaces the default
    /// (a prefill worth noting takes long enough to say), later ones move it a
    /// third of the way.
    fn fold_prefill(&mut self, new: f64) {
        if !new.is_finite() || new <= 0.0 {
            return;
        }
        self.prefill_tokens_per_s = match self.measured_prefill {
            true => self.prefill_tokens_per_s + (new - self.prefill_tokens_per_s) / 3.0,
            false => new,
        };
        self.measured_prefill = true;
    }

    /// Folds a load's measured rate in: a third of the way there, in ratio,
    /// from the default on. A load takes milliseconds, so one that a busy
    /// machine preempted reads tens of times too slow, and it alone must not
    /// turn every later load into a prefill; a truly slow disk shows within
    /// a few loads (each one closes a third of the gap in orders of
    /// magnitude).
    fn fold_load(&mut self, new: f64) {
        if new.is_finite() && new > 0.0 {
            self.load_bytes_per_s *= (new / self.load_bytes_per_s).cbrt();
        }
    }

    /// Seconds loading `bytes` takes.
    pub fn load_s(&self, bytes: u64) -> f64 {
        bytes as f64 / self.load_bytes_per_s
    }

    /// Seconds prefilling `tokens` takes.
    pub fn prefill_s(&self, tokens: usize) -> f64 {
        tokens as f64 / self.prefill_tokens_per_s
    }
}

/// What the store offers a prompt: the longest checkpoint whose text is a
/// prefix of it, and those sharing a prefix with it, the most shared first.
pub struct Offers {
    pub whole: Option<Candidate>,
    pub sharing: Vec<Shared>,
}

/// A checkpoint loaded into a session.
pub struct Restored {
    /// Bytes of its text.
    pub covered: usize,
    /// Bytes its text shares with the prompt (`covered` for a prefix).
    pub common_bytes: usize,
    pub path: PathBuf,
}

/// The runtime's link to the store, shared by its slots (which all hold
/// sessions of one model, K/V type and context).
pub struct Persist {
    w: Arc<Writer>,
    /// The sessions' K/V type, and the identity of checkpoints of the other type.
    kv_type: KvType,
    other_kv: (KvType, ModelId),
    rates: Rates,
    /// Consider only checkpoints whose whole text is a prefix of the prompt
    /// (the rule before partial reuse; for comparisons).
    whole_only: bool,
}

/// What writing a checkpoint needs: shared by the engine thread and the
/// background saver that writes turn ends ([`Persist::writer`]).
pub struct Writer {
    store: Store,
    model: ModelId,
    /// Tokens written by successful saves so far (per-request differences feed
    /// Anthropic's `cache_creation_input_tokens`).
    saved_tokens: AtomicUsize,
    evictions: AtomicU64,
    save_failures: AtomicU64,
    /// Exact tool-call text saved with checkpoints and reloaded on a hit.
    tool_memory: Option<Arc<ToolMemory>>,
    notices: NoticeSink,
}

impl Persist {
    /// For sessions like `session`.
    pub fn new(
        store: Store,
        session: &Session,
        tool_memory: Option<Arc<ToolMemory>>,
        notices: NoticeSink,
    ) -> Self {
        let fp = session.model().fingerprint;
        let other = match session.kv_type() {
            KvType::F32 => KvType::F16,
            KvType::F16 => KvType::F32,
        };
        let model = model_id(session);
        Persist {
            w: Arc::new(Writer {
                store,
                model,
                saved_tokens: AtomicUsize::new(0),
                evictions: AtomicU64::new(0),
                save_failures: AtomicU64::new(0),
                tool_memory,
                notices,
            }),
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
            rates: Rates::default(),
            whole_only: false,
        }
    }

    /// Uses only checkpoints whose whole text is a prefix of a prompt (the
    /// rule before partial reuse), for comparing the two.
    pub fn whole_prefix_only(mut self) -> Self {
        self.whole_only = true;
        self
    }

    /// The load and prefill rates loads are weighed with.
    pub fn rates(&self) -> Rates {
        self.rates
    }

    /// Records a prefill of `tokens` that took `secs` (short ones say more
    /// about overheads than the rate, and are ignored).
    pub fn note_prefill(&mut self, tokens: usize, secs: f64) {
        if tokens >= 64 {
            self.rates.fold_prefill(tokens as f64 / secs);
        }
    }

    /// Checkpoints shorter than this are neither saved nor loaded.
    pub fn min_tokens(&self) -> usize {
        self.policy().min_tokens.max(1)
    }

    /// Tokens written by successful saves since this was created.
    pub fn saved_tokens(&self) -> usize {
        self.w.saved_tokens.load(Ordering::Relaxed)
    }

    /// What the store holds, and what this process's saves did to it.
    pub fn store_usage(&self) -> StoreUsage {
        let (files, bytes) = self.w.store.usage();
        StoreUsage {
            files,
            bytes,
            evictions: self.w.evictions.load(Ordering::Relaxed),
            save_failures: self.w.save_failures.load(Ordering::Relaxed),
        }
    }

    pub fn policy(&self) -> SavePolicy {
        *self.w.store.policy()
    }

    /// The checkpoint that shares the most of `prompt` without being a prefix of
    /// it (for explaining a miss); store failures count as none.
    pub fn nearest_miss(&self, prompt: &[u8], n_ctx: usize) -> Option<ds4_kvstore::NearMiss> {
        self.w
            .store
            .nearest_miss(prompt, &self.w.model, n_ctx as u32)
            .ok()
            .flatten()
    }

    /// Loads the longest checkpoint that is a prefix of `prompt` into the (empty)
    /// session of slot `slot`; `None` on a miss or on any failure, which is
    /// reported and leaves the session empty.
    pub fn restore(
        &mut self,
        slot: usize,
        session: &mut Session,
        prompt: &[u8],
    ) -> Option<Restored> {
        let cand = self.whole_offer(prompt, session.n_ctx())?;
        self.load_into(slot, session, &cand, prompt)
    }

    /// The checkpoints a prompt may start from: the longest whose text is a
    /// prefix of it, and (unless [`whole_prefix_only`](Self::whole_prefix_only))
    /// those sharing at least the store's minimum in bytes with it.
    pub fn offers(&self, prompt: &[u8], n_ctx: usize) -> Offers {
        let min = self.min_tokens();
        let sharing = if self.whole_only {
            vec![]
        } else {
            // A token is at least a byte: sharing fewer bytes than the
            // minimum cannot reuse the minimum. A failing store offers none
            // (the lookup reports it).
            self.w
                .store
                .sharing(prompt, &self.w.model, n_ctx as u32, min)
                .unwrap_or_default()
                .into_iter()
                .filter(|s| s.candidate.header.tokens as usize >= min)
                .collect()
        };
        Offers {
            whole: self.whole_offer(prompt, n_ctx),
            sharing,
        }
    }

    /// Whether the longest checkpoint whose text is a prefix of `prompt` holds
    /// more than the `held` tokens a live state offers, and loading it takes
    /// less time than prefilling the difference (a conversation switched back
    /// to, in a slot that holds only its start or another conversation
    /// sharing it).
    pub(crate) fn offers_more_than(&self, prompt: &[u8], n_ctx: usize, held: usize) -> bool {
        match self.w.store.lookup(prompt, &self.w.model, n_ctx as u32) {
            Ok(Some(c)) => {
                let tokens = c.header.tokens as usize;
                let bytes = c.header.file_bytes().unwrap_or(u64::MAX);
                tokens > held && self.rates.load_s(bytes) < self.rates.prefill_s(tokens - held)
            }
            _ => false,
        }
    }

    /// The longest checkpoint whose text is a prefix of `prompt`, of at least
    /// the store's minimum; a miss is explained, a failing store reported.
    fn whole_offer(&self, prompt: &[u8], n_ctx: usize) -> Option<Candidate> {
        match self.w.store.lookup(prompt, &self.w.model, n_ctx as u32) {
            Ok(Some(c)) if c.header.tokens as usize >= self.min_tokens() => Some(c),
            Ok(_) => {
                self.explain_miss(prompt, n_ctx);
                None
            }
            Err(e) => {
                (self.w.notices)(Notice::LoadFailed {
                    path: None,
                    why: format!("lookup failed: {e}"),
                });
                self.w.drain_store_notices();
                None
            }
        }
    }

    /// Loads checkpoint `cand` (from [`offers`](Self::offers) for `prompt`)
    /// into the (empty) session of slot `slot`; `None` on any failure, which
    /// is reported and leaves the session empty.
    pub fn load_into(
        &mut self,
        slot: usize,
        session: &mut Session,
        cand: &Candidate,
        prompt: &[u8],
    ) -> Option<Restored> {
        let t = Instant::now();
        let not_restored = |this: &Self, path: Option<PathBuf>, why: String| {
            (this.w.notices)(Notice::LoadFailed { path, why });
            this.w.drain_store_notices();
        };
        let loaded = match self.w.store.load(cand, prompt) {
            Ok(l) => l,
            Err(e) => {
                not_restored(self, Some(cand.path.clone()), e.to_string());
                return None;
            }
        };
        if let Err(e) = session.load_payload(&mut loaded.payload.as_slice()) {
            not_restored(self, Some(cand.path.clone()), e.to_string());
            return None;
        }
        if session.tokens().len() != loaded.header.tokens as usize {
            let why = format!(
                "header says {} tokens, payload holds {}",
                loaded.header.tokens,
                session.tokens().len()
            );
            session.reset();
            not_restored(self, Some(cand.path.clone()), why);
            return None;
        }
        if let Some(m) = &self.w.tool_memory {
            for s in loaded
                .sections
                .iter()
                .filter(|s| s.kind == SECTION_TOOL_IDS)
            {
                m.load_section(&s.bytes);
            }
        }
        let secs = t.elapsed().as_secs_f64();
        if let Some(bytes) = cand.header.file_bytes().filter(|&b| b >= 1 << 20) {
            self.rates.fold_load(bytes as f64 / secs);
        }
        (self.w.notices)(Notice::Restored {
            slot,
            tokens: session.tokens().len(),
            text_bytes: loaded.text.len(),
            load_ms: secs * 1e3,
            path: cand.path.clone(),
        });
        Some(Restored {
            covered: loaded.text.len(),
            common_bytes: loaded
                .text
                .iter()
                .zip(prompt)
                .take_while(|(a, b)| a == b)
                .count(),
            path: cand.path.clone(),
        })
    }

    /// After a miss: says which checkpoint would have served the prompt and why
    /// it was not loaded — saved by other weights, before weights were
    /// recorded, with the other K/V type (its rows were rounded differently),
    /// another model or a larger context.
    fn explain_miss(&self, prompt: &[u8], n_ctx: usize) {
        let Ok(Some((path, h, why))) =
            self.w
                .store
                .lookup_refused(prompt, &self.w.model, n_ctx as u32)
        else {
            return;
        };
        if (h.tokens as usize) < self.policy().min_tokens {
            return;
        }
        let (other, id) = self.other_kv;
        let why = if h.model.model_fp == id.model_fp {
            format!(
                "saved with {other} K/V, this session stores {} (--kv-type)",
                self.kv_type
            )
        } else {
            format!("its text is a prefix of the prompt, but {why}")
        };
        (self.w.notices)(Notice::Skipped {
            path,
            tokens: h.tokens as usize,
            why,
        });
    }

    /// Reports a restored checkpoint that is not used after all: its tokens read
    /// the prompt's text with control tokens elsewhere (special-token text
    /// typed in content), or (`why`) it cannot be cut back where it departs.
    pub fn refuse(&self, path: &std::path::Path, why: Option<&str>) {
        (self.w.notices)(Notice::LoadFailed {
            path: Some(path.to_path_buf()),
            why: why
                .unwrap_or(
                    "its tokens read the prompt's text with control tokens elsewhere \
                     (special-token text typed in content)",
                )
                .into(),
        });
    }

    /// Where a prefill of `n_new` tokens onto a session holding `start` must stop
    /// for a save, in order: a cold save of a first prompt (`cold_prompt`,
    /// nothing reused), a client's cache breakpoint (`hints`: prompt token
    /// counts, trimmed and aligned like a cold save), a continued save past
    /// `frontier` (the last one made).
    pub fn cuts(
        &self,
        start: usize,
        n_new: usize,
        cold_prompt: bool,
        hints: &[usize],
        frontier: usize,
    ) -> Vec<(usize, SaveReason)> {
        let policy = self.policy();
        let end = start + n_new;
        let mut cuts: Vec<(usize, SaveReason)> = Vec::new();
        if cold_prompt && start == 0 {
            if let Some(c) = policy.cold_save_len(n_new) {
                cuts.push((c, SaveReason::Cold));
            }
        }
        for &h in hints {
            if let Some(at) = policy.cold_save_len(h) {
                if at > start && at <= end && !cuts.iter().any(|&(c, _)| c == at) {
                    cuts.push((at, SaveReason::ClientHint));
                }
            }
        }
        let mut f = frontier;
        while let Some(next) = policy.next_continued_frontier(f) {
            if next > end {
                break;
            }
            if next > start && !cuts.iter().any(|&(c, _)| c == next) {
                cuts.push((next, SaveReason::Continued));
            }
            f = next;
        }
        cuts.sort_by_key(|&(at, _)| at);
        cuts
    }

    /// Whether a session of `len` tokens, after a decode step, has just reached
    /// a continued-save frontier past `frontier`.
    pub fn continued_due(&self, frontier: usize, len: usize) -> bool {
        self.policy().continued_frontier(frontier, len) == Some(len)
    }

    /// Saves the whole session of slot `slot` under `reason` if it is long
    /// enough; the file written, if one was. Failures (full disk, permissions)
    /// are reported and otherwise ignored.
    pub fn save(&mut self, slot: usize, session: &Session, reason: SaveReason) -> Option<PathBuf> {
        self.w.save(slot, session, reason)
    }

    /// The part of this that writes checkpoints, for a thread of its own.
    pub fn writer(&self) -> Arc<Writer> {
        Arc::clone(&self.w)
    }
}

impl Writer {
    /// Saves the whole session of slot `slot` under `reason` if it is long
    /// enough; the file written, if one was. Failures (full disk, permissions)
    /// are reported and otherwise ignored.
    pub fn save(&self, slot: usize, session: &Session, reason: SaveReason) -> Option<PathBuf> {
        let text = session.model().tokenizer.prompt_text(session.tokens());
        match self.save_text(slot, session, reason, &text) {
            Some((path, true)) => Some(path),
            _ => None,
        }
    }

    /// [`save`](Self::save) with the session's text given (`prompt_text` of
    /// its tokens); the checkpoint that holds it, and whether this wrote it
    /// (not when the store already had it).
    pub fn save_text(
        &self,
        slot: usize,
        session: &Session,
        reason: SaveReason,
        text: &[u8],
    ) -> Option<(PathBuf, bool)> {
        let n = session.tokens().len();
        if n < self.store.policy().min_tokens.max(1) {
            return None;
        }
        let t = Instant::now();
        let sections: Vec<_> = self
            .tool_memory
            .as_ref()
            .and_then(|m| m.section_for(&String::from_utf8_lossy(text)))
            .into_iter()
            .collect();
        let mut write = |w: &mut dyn std::io::Write| {
            let mut w = std::io::BufWriter::with_capacity(1 << 20, w);
            session.save_payload(&mut w).map_err(std::io::Error::other)
        };
        let req = SaveRequest {
            text,
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
        let saved = match self.store.save(req) {
            Ok(SaveOutcome::Saved {
                file_bytes, path, ..
            }) => {
                self.saved_tokens.fetch_add(n, Ordering::Relaxed);
                (self.notices)(Notice::Saved {
                    slot,
                    tokens: n,
                    reason,
                    file_bytes,
                    save_ms: t.elapsed().as_secs_f64() * 1e3,
                    path: path.clone(),
                });
                Some((path, true))
            }
            Ok(SaveOutcome::Kept { path }) => Some((path, false)),
            Ok(SaveOutcome::Skipped(why)) => {
                (self.notices)(Notice::SaveSkipped {
                    slot,
                    tokens: n,
                    why: format!("{why:?}"),
                });
                None
            }
            Err(e) => {
                self.save_failures.fetch_add(1, Ordering::Relaxed);
                (self.notices)(Notice::SaveFailed {
                    slot,
                    tokens: n,
                    reason,
                    error: e.to_string(),
                });
                None
            }
        };
        self.evictions
            .fetch_add(self.drain_store_notices(), Ordering::Relaxed);
        saved
    }

    /// Removes checkpoint `path` (a turn end the next one of its conversation
    /// supersedes), with a notice saying why.
    pub fn remove(&self, path: &std::path::Path, why: &str) {
        let Some(hash) = path.file_stem().and_then(|s| s.to_str()) else {
            return;
        };
        match self.store.remove(hash) {
            Ok(true) => (self.notices)(Notice::Store(format!(
                "kv cache removed {}: {why}",
                path.display()
            ))),
            Ok(false) => {}
            Err(e) => (self.notices)(Notice::Store(format!(
                "kv cache could not remove {}: {e}",
                path.display()
            ))),
        }
    }

    /// Hands the store's pending notices on; returns how many were evictions.
    fn drain_store_notices(&self) -> u64 {
        let mut evictions = 0;
        for n in self.store.drain_notices() {
            evictions += u64::from(matches!(n, ds4_kvstore::Notice::Evicted(_)));
            (self.notices)(Notice::Store(n.to_string()));
        }
        evictions
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

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

    /// One load that a busy machine stalled (2.5 MB in 0.6 s: the agent's
    /// restore in a loaded CI run) does not make a conversation's checkpoint
    /// "not worth loading" against an unmeasured prefill; a disk that stays
    /// that slow does within a few loads, and a prefill's rate is taken at
    /// its first measurement.
    #[test]
    fn one_stalled_load_does_not_decide_the_load_rate() {
        let path = std::path::Path::new("x.kv");
        let weigh =
            |r: &Rates| crate::plan::Weighed::new(r, path, true, 105, 105, 2_600_000).verdict;
        let mut rates = Rates::default();
        rates.fold_load(1_400_000.0 / 0.6);
        assert_eq!(weigh(&rates), crate::plan::Verdict::NotTried, "{rates:?}");
        for _ in 0..6 {
            rates.fold_load(1_400_000.0 / 0.6);
        }
        assert_eq!(weigh(&rates), crate::plan::Verdict::NotWorthIt, "{rates:?}");
        let mut rates = Rates::default();
        rates.fold_load(f64::NAN);
        rates.fold_load(0.0);
        assert_eq!(rates, Rates::default());
        rates.fold_prefill(900.0);
        assert_eq!(rates.prefill_tokens_per_s, 900.0);
        rates.fold_prefill(300.0);
        assert_eq!(rates.prefill_tokens_per_s, 700.0);
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
            let skips = Arc::new(Mutex::new(0));
            let counter = Arc::clone(&skips);
            let notices: NoticeSink = Arc::new(move |n| {
                if matches!(n, Notice::Skipped { .. }) {
                    *counter.lock().unwrap() += 1;
                }
            });
            let open = || Store::open(&dir, StoreConfig::default()).unwrap();
            let mut s = session(&model, saver);
            s.prefill(&ids).unwrap();
            let mut p = Persist::new(open(), &s, None, Arc::clone(&notices));
            assert!(p.save(0, &s, SaveReason::Shutdown).is_some(), "{saver}");
            assert_eq!(p.store_usage().files, 1, "{saver}: saved");
            let prompt = model.tokenizer.prompt_text(s.tokens());

            let other = if saver == KvType::F16 {
                KvType::F32
            } else {
                KvType::F16
            };
            let mut o = session(&model, other);
            let mut po = Persist::new(open(), &o, None, Arc::clone(&notices));
            assert!(
                po.restore(0, &mut o, &prompt).is_none(),
                "{saver} into {other}"
            );
            assert!(o.tokens().is_empty());
            assert_eq!(*skips.lock().unwrap(), 1, "{saver} into {other}");

            let mut same = session(&model, saver);
            let mut ps = Persist::new(open(), &same, None, Arc::clone(&notices));
            let restored = ps.restore(0, &mut same, &prompt).expect("restored");
            assert_eq!(restored.covered, prompt.len());
            assert_eq!(same.tokens(), s.tokens());
            assert_eq!(
                *skips.lock().unwrap(),
                1,
                "{saver}: no skip of its own type"
            );
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}
