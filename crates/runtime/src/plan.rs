//! The reuse plan: positions a slot's session at the longest reusable prefix
//! of a request — its own tokens (`memory-token`, cut back where the state
//! allows it), its text tokenized differently (`memory-text`), a disk
//! checkpoint whose text is a prefix of the prompt (`disk-text`) or shares one
//! with it, cut back to the shared tokens (`disk-text-partial`), or nothing —
//! and explains a miss against the best candidate that offered more. Disk
//! checkpoints are weighed: a load must take less time than the prefill it
//! saves, and the reasoning goes with the plan (its trace record).

use std::path::PathBuf;

use ds4_engine::Session;
use ds4_kvstore::{Candidate, SaveReason};

use crate::job::{tokens_within, CacheSource, Divergence};
use crate::persist::{Persist, Rates};

/// How far back from a shared prefix's end a cut may look for a token where
/// the state can be cut (a compressed state cuts only at its boundaries) and
/// the rest of the prompt re-tokenizes as its own tokens.
const MAX_STEP_BACK: usize = 256;
/// Re-tokenizations tried per cut (each decodes the prompt once); a cut whose
/// rest does not re-tokenize within a few tokens of the shared end will not.
const MAX_CUT_TRIES: usize = 4;

/// The token counts `m <= n` (at most [`MAX_STEP_BACK`] back, none 0) that
/// `session` can be rewound to, the largest first.
fn rewindable(session: &Session, n: usize) -> impl Iterator<Item = usize> + '_ {
    (n.saturating_sub(MAX_STEP_BACK)..=n)
        .rev()
        .filter(move |&m| m > 0 && session.can_rewind(m))
}

/// What a session holds of a prompt.
pub(crate) struct Held {
    /// Its tokens that are a prefix of the prompt's tokens, where the state can
    /// be cut back there (0 otherwise).
    pub by_token: usize,
    /// When all its tokens are not, but their text is a prefix of the prompt's
    /// with control tokens where the prompt has them: the tokens that continue
    /// them to the prompt (`Tokenizer::continuation`).
    pub by_text: Option<Vec<u32>>,
}

impl Held {
    pub fn of(session: &Session, ids: &[u32]) -> Held {
        let live = session.tokens();
        let shared = live.iter().zip(ids).take_while(|(a, b)| a == b).count();
        // Where the state cannot be cut at the shared end, a little earlier (a
        // compressed state's boundary); a sliding-window ring that has
        // overwritten rows the continuation reads offers nothing by token (a
        // disk checkpoint or a cold prefill answers, never wrong logits).
        let by_token = rewindable(session, shared).next().unwrap_or(0);
        let by_text = (by_token < live.len())
            .then(|| session.model().tokenizer.continuation(live, ids))
            .flatten();
        Held { by_token, by_text }
    }

    /// Tokens reusable from the session.
    pub fn tokens(&self, session: &Session) -> usize {
        match self.by_text {
            Some(_) => session.tokens().len(),
            None => self.by_token,
        }
    }
}

/// The plan's outcome: the request's whole token sequence (the session holds
/// its first `reused`), where they came from, and the checkpoint used.
pub(crate) struct Plan {
    pub ids: Vec<u32>,
    pub reused: usize,
    pub source: CacheSource,
    /// Tokens of the loaded checkpoint dropped to reach the shared prefix.
    pub cut: usize,
    pub checkpoint: Option<PathBuf>,
    pub miss: Option<Box<Divergence>>,
    /// The disk checkpoints weighed, in the order tried, and what became of
    /// each.
    pub weighed: Vec<Weighed>,
}

impl Plan {
    /// `reused` of `ids` held, from `source`, nothing cut, loaded or missed.
    fn new(ids: Vec<u32>, reused: usize, source: CacheSource) -> Plan {
        Plan {
            ids,
            reused,
            source,
            cut: 0,
            checkpoint: None,
            miss: None,
            weighed: vec![],
        }
    }

    /// A job that scores its prompt: every token needs the logits before
    /// it, so only the `reused` tokens a slot's scored record covers (and
    /// its live state holds) are kept; the rest is prefilled.
    pub(crate) fn scored(ids: Vec<u32>, reused: usize) -> Plan {
        let source = match reused {
            0 => CacheSource::None,
            _ => CacheSource::MemoryToken,
        };
        Plan::new(ids, reused, source)
    }
}

/// One disk checkpoint the plan considered: what it offered, what loading it
/// would cost against the prefill it would save, and the verdict.
#[derive(Clone, Debug, PartialEq)]
pub struct Weighed {
    pub path: PathBuf,
    /// Its text is a prefix of the prompt (else it shares one with it).
    pub whole: bool,
    /// Tokens it holds.
    pub tokens: usize,
    /// Prompt tokens it would serve (for a shared prefix: the prompt's tokens
    /// wholly inside the shared bytes, an estimate until loaded).
    pub reusable: usize,
    pub file_bytes: u64,
    /// Estimated seconds to load it, and to prefill what it serves.
    pub load_s: f64,
    pub prefill_s: f64,
    pub verdict: Verdict,
}

/// What the plan did with a checkpoint it weighed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Loaded and used.
    Used,
    /// Loading would take longer than the prefill it saves.
    NotWorthIt,
    /// Its state could not be cut back to the shared prefix (a sliding window
    /// past it, no cut point where the rest re-tokenizes as the prompt's own).
    CannotCut,
    /// Its tokens read the prompt with control tokens elsewhere.
    TokensDisagree,
    /// Reading or verifying it failed (reported).
    LoadFailed,
    /// A better one was used first.
    NotTried,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Used => "used",
            Verdict::NotWorthIt => "not-worth-loading",
            Verdict::CannotCut => "cannot-cut-there",
            Verdict::TokensDisagree => "tokens-disagree",
            Verdict::LoadFailed => "load-failed",
            Verdict::NotTried => "not-tried",
        }
    }
}

impl Weighed {
    /// A checkpoint of `tokens` in a file of `file_bytes` at `path` serving
    /// `reusable` prompt tokens, weighed at `rates`; not tried yet, or not
    /// worth it when loading takes at least as long as the prefill it saves.
    pub fn new(
        rates: &Rates,
        path: &std::path::Path,
        whole: bool,
        tokens: usize,
        reusable: usize,
        file_bytes: u64,
    ) -> Weighed {
        let (load_s, prefill_s) = (rates.load_s(file_bytes), rates.prefill_s(reusable));
        Weighed {
            path: path.to_path_buf(),
            whole,
            tokens,
            reusable,
            file_bytes,
            load_s,
            prefill_s,
            verdict: if load_s < prefill_s {
                Verdict::NotTried
            } else {
                Verdict::NotWorthIt
            },
        }
    }

    /// The trace form: `FILE whole|partial tokens=T reusable=R bytes=B
    /// load=Ls prefill=Ps: VERDICT`.
    pub fn describe(&self) -> String {
        format!(
            "{} {} tokens={} reusable={} bytes={} load={:.3}s prefill={:.3}s: {}",
            self.path
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
            if self.whole { "whole" } else { "partial" },
            self.tokens,
            self.reusable,
            self.file_bytes,
            self.load_s,
            self.prefill_s,
            self.verdict.as_str()
        )
    }
}

/// Positions slot `slot`'s session at the longest reusable prefix of `prompt`
/// (whose own tokens are `ids`). When memory offers less than the store's
/// minimum, or less than a checkpoint whose text is a prefix of the prompt
/// (and loading it beats prefilling the difference), the live state is saved first
/// (reason `evict`) if the request does not extend it, then the store is
/// searched.
pub(crate) fn plan(
    slot: usize,
    session: &mut Session,
    mut persist: Option<&mut Persist>,
    prompt: &str,
    ids: Vec<u32>,
) -> Plan {
    let live = session.tokens().to_vec();
    let held = Held::of(session, &ids);
    let by_token = held.by_token;
    let mut plan = if let Some(rest) = held.by_text {
        // The live tokens represent a prefix of the text but are not the
        // prompt's own tokenization: keep them all, append the rest.
        let mut full = live.clone();
        full.extend(rest);
        Plan::new(full, live.len(), CacheSource::MemoryText)
    } else {
        match persist.as_deref_mut() {
            // Memory offers too little to keep, or less than a checkpoint of
            // the prompt holds (asked only when what is left to prefill is
            // worth a load: a lookup rescans the store, and a short new turn
            // after a live conversation is the common case).
            Some(p)
                if by_token < p.min_tokens()
                    || (ids.len().saturating_sub(by_token) >= p.min_tokens()
                        && p.offers_more_than(prompt.as_bytes(), session.n_ctx(), by_token)) =>
            {
                let mut checkpoint = None;
                if live.len() > by_token {
                    checkpoint = p.save(slot, session, SaveReason::Evict);
                }
                session.reset();
                let mut plan = from_disk(slot, session, p, prompt, ids);
                if plan.source == CacheSource::None {
                    plan.checkpoint = checkpoint;
                }
                plan
            }
            _ => {
                let source = if by_token > 0 {
                    CacheSource::MemoryToken
                } else {
                    CacheSource::None
                };
                Plan::new(ids, by_token, source)
            }
        }
    };
    plan.miss = explain(session, &live, prompt, &plan, persist.as_deref());
    plan
}

/// Loads the disk checkpoint that saves the most prefill into the (empty)
/// session: the longest whose text is a prefix of the prompt, or one sharing
/// a prefix with it, cut back to the last token inside the shared bytes. Each
/// is weighed first (a load that takes longer than the prefill it saves is
/// not made); one that cannot serve after all gives way to the next.
fn from_disk(
    slot: usize,
    session: &mut Session,
    p: &mut Persist,
    prompt: &str,
    ids: Vec<u32>,
) -> Plan {
    let model = std::sync::Arc::clone(session.model());
    let tok = &model.tokenizer;
    let offers = p.offers(prompt.as_bytes(), session.n_ctx());
    let rates = p.rates();
    let mut options: Vec<(Weighed, Candidate)> = Vec::new();
    if let Some(c) = offers.whole {
        let tokens = c.header.tokens as usize;
        options.push((weigh(&rates, &c, true, tokens), c));
    }
    for s in offers.sharing {
        let tokens = s.candidate.header.tokens as usize;
        // The prompt's own tokens inside the shared bytes: the checkpoint's
        // are the same text, so about as many.
        let reusable =
            tokens_within(&ids, s.common_bytes, |i, id| tok.prompt_piece(i, id).len()).min(tokens);
        if reusable < p.min_tokens() {
            continue;
        }
        let mut w = weigh(&rates, &s.candidate, false, reusable);
        if !session.could_rewind_loaded(tokens, reusable) {
            // A sliding window past the shared end even in a fresh load.
            w.verdict = Verdict::CannotCut;
        }
        options.push((w, s.candidate));
    }
    // The most time saved first; among equals the whole prefix (no cut).
    options.sort_by(|(a, _), (b, _)| {
        let net = |w: &Weighed| w.prefill_s - w.load_s;
        net(b).total_cmp(&net(a)).then(b.whole.cmp(&a.whole))
    });
    let mut weighed = Vec::with_capacity(options.len());
    let mut used: Option<Plan> = None;
    for (mut w, cand) in options {
        if used.is_some() || w.verdict != Verdict::NotTried {
            weighed.push(w);
            continue;
        }
        let Some(r) = p.load_into(slot, session, &cand, prompt.as_bytes()) else {
            w.verdict = Verdict::LoadFailed;
            weighed.push(w);
            continue;
        };
        let held = session.tokens().to_vec();
        if w.whole {
            // The store matches by text; the tokens must also read it as the
            // prompt does (control tokens in the same places).
            match tok.continuation(&held, &ids) {
                Some(rest) => {
                    w.reusable = held.len();
                    let mut full = held.clone();
                    full.extend(rest);
                    used = Some(Plan {
                        checkpoint: Some(r.path),
                        ..Plan::new(full, held.len(), CacheSource::DiskText)
                    });
                    w.verdict = Verdict::Used;
                }
                None => {
                    p.refuse(&r.path, None);
                    w.verdict = Verdict::TokensDisagree;
                }
            }
        } else {
            let shared = r.common_bytes;
            match cut_point(session, &ids, shared) {
                Some(n) => {
                    w.reusable = n;
                    used = Some(Plan {
                        cut: held.len() - n,
                        checkpoint: Some(r.path),
                        ..Plan::new(ids.clone(), n, CacheSource::DiskTextPartial)
                    });
                    w.verdict = Verdict::Used;
                }
                None => {
                    p.refuse(
                        &r.path,
                        Some("it cannot be cut back to the prefix it shares with the prompt"),
                    );
                    w.verdict = Verdict::CannotCut;
                }
            }
        }
        if used.is_none() {
            session.reset();
        }
        weighed.push(w);
    }
    let mut plan = used.unwrap_or_else(|| Plan::new(ids, 0, CacheSource::None));
    plan.weighed = weighed;
    plan
}

/// A checkpoint's offer, with the load's and the saved prefill's estimated
/// seconds.
fn weigh(rates: &Rates, c: &Candidate, whole: bool, reusable: usize) -> Weighed {
    let file_bytes = c.header.file_bytes().unwrap_or(u64::MAX);
    Weighed::new(
        rates,
        &c.path,
        whole,
        c.header.tokens as usize,
        reusable,
        file_bytes,
    )
}

/// Where a session holding a checkpoint that shares the first `shared` bytes
/// of the prompt (tokenized as `ids`) can be cut back to: at most its tokens
/// wholly inside those bytes that are the prompt's own, stepping back to where
/// the state can be cut and the tokenizer's continuation from there
/// re-tokenizes the rest as the prompt's own tokens — so the request runs on
/// exactly its own tokens and its logits are a cold run's.
fn cut_point(session: &Session, ids: &[u32], shared: usize) -> Option<usize> {
    let tok = &session.model().tokenizer;
    let held = session.tokens();
    let within = tokens_within(held, shared, |i, id| tok.prompt_piece(i, id).len());
    let same = held[..within]
        .iter()
        .zip(ids)
        .take_while(|(a, b)| a == b)
        .count();
    rewindable(session, same).take(MAX_CUT_TRIES).find(|&n| {
        tok.continuation(&held[..n], ids)
            .is_some_and(|rest| rest == ids[n..])
    })
}

/// When a candidate offered more than was reused — the live state, or the
/// checkpoint sharing the most text without being a prefix — where the prompt
/// departs from it.
fn explain(
    session: &Session,
    live: &[u32],
    prompt: &str,
    plan: &Plan,
    persist: Option<&Persist>,
) -> Option<Box<Divergence>> {
    let tok = &session.model().tokenizer;
    let piece_len = |i: usize, id: u32| tok.prompt_piece(i, id).len();
    let mut miss = (plan.reused < live.len()).then(|| {
        Divergence::find(
            "memory",
            live.len(),
            prompt.as_bytes(),
            &tok.prompt_text(live),
            &plan.ids,
            piece_len,
        )
    });
    if matches!(
        plan.source,
        CacheSource::None | CacheSource::DiskText | CacheSource::DiskTextPartial
    ) {
        if let Some(n) = persist.and_then(|p| p.nearest_miss(prompt.as_bytes(), session.n_ctx())) {
            let d = Divergence::find(
                "disk",
                n.tokens as usize,
                prompt.as_bytes(),
                &n.text,
                &plan.ids,
                piece_len,
            );
            if d.token > plan.reused && miss.as_ref().is_none_or(|m| d.token > m.token) {
                miss = Some(d);
            }
        }
    }
    miss.map(Box::new)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 200 MB file to save 30 tokens is not loaded at the default rates;
    /// at a slow model's measured prefill rate it is, and a small file that
    /// saves thousands of tokens always is.
    #[test]
    fn a_load_must_take_less_time_than_the_prefill_it_saves() {
        let path = std::path::Path::new("x.kv");
        let mut rates = Rates::default();
        let big = Weighed::new(&rates, path, false, 4000, 30, 200_000_000);
        assert_eq!(big.verdict, Verdict::NotWorthIt, "{}", big.describe());
        let small = Weighed::new(&rates, path, false, 4000, 3000, 90_000_000);
        assert_eq!(small.verdict, Verdict::NotTried, "{}", small.describe());
        rates.prefill_tokens_per_s = 20.0;
        let slow = Weighed::new(&rates, path, false, 4000, 30, 200_000_000);
        assert_eq!(slow.verdict, Verdict::NotTried, "{}", slow.describe());
        assert!(
            big.describe().ends_with("not-worth-loading"),
            "{}",
            big.describe()
        );
    }
}
