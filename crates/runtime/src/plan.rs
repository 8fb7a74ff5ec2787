//! The reuse plan: positions a slot's session at the longest reusable prefix
//! of a request — its own tokens (`memory-token`, cut back where the state
//! allows it), its text tokenized differently (`memory-text`), a disk
//! checkpoint (`disk-text`), or nothing — and explains a miss against the best
//! candidate that offered more.

use ds4_engine::Session;
use ds4_kvstore::SaveReason;

use crate::job::{CacheSource, Divergence};
use crate::persist::Persist;

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
        let mut by_token = live.iter().zip(ids).take_while(|(a, b)| a == b).count();
        if !session.can_rewind(by_token) {
            // A sliding-window ring has overwritten rows the shared prefix's
            // continuation reads: nothing is reusable by token (a disk
            // checkpoint or a cold prefill answers, never wrong logits).
            by_token = 0;
        }
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
    pub checkpoint: Option<std::path::PathBuf>,
    pub miss: Option<Box<Divergence>>,
}

/// Positions slot `slot`'s session at the longest reusable prefix of `prompt`
/// (whose own tokens are `ids`). When memory offers less than the store's
/// minimum, the live state is saved first (reason `evict`) if the request
/// does not extend it, then the store is searched.
pub(crate) fn plan(
    slot: usize,
    session: &mut Session,
    mut persist: Option<&mut Persist>,
    prompt: &str,
    ids: Vec<u32>,
) -> Plan {
    let model = std::sync::Arc::clone(session.model());
    let tok = &model.tokenizer;
    let live = session.tokens().to_vec();
    let held = Held::of(session, &ids);
    let by_token = held.by_token;
    let mut plan = if let Some(rest) = held.by_text {
        // The live tokens represent a prefix of the text but are not the
        // prompt's own tokenization: keep them all, append the rest.
        let mut full = live.clone();
        full.extend(rest);
        Plan {
            ids: full,
            reused: live.len(),
            source: CacheSource::MemoryText,
            checkpoint: None,
            miss: None,
        }
    } else {
        match persist.as_deref_mut() {
            Some(p) if by_token < p.min_tokens() => {
                let mut checkpoint = None;
                if live.len() > by_token {
                    checkpoint = p.save(slot, session, SaveReason::Evict);
                }
                session.reset();
                // The store matches by text; the tokens must also read it as
                // the prompt does (control tokens in the same places).
                let restored = p.restore(slot, session, prompt.as_bytes()).and_then(|r| {
                    let rest = tok.continuation(session.tokens(), &ids);
                    if rest.is_none() {
                        p.refuse(&r.path);
                    }
                    rest.map(|rest| (r, rest))
                });
                match restored {
                    Some((r, rest)) => {
                        let mut full = session.tokens().to_vec();
                        let reused = full.len();
                        full.extend(rest);
                        Plan {
                            ids: full,
                            reused,
                            source: CacheSource::DiskText,
                            checkpoint: Some(r.path),
                            miss: None,
                        }
                    }
                    None => {
                        session.reset();
                        Plan {
                            ids,
                            reused: 0,
                            source: CacheSource::None,
                            checkpoint,
                            miss: None,
                        }
                    }
                }
            }
            _ => Plan {
                source: if by_token > 0 {
                    CacheSource::MemoryToken
                } else {
                    CacheSource::None
                },
                ids,
                reused: by_token,
                checkpoint: None,
                miss: None,
            },
        }
    };
    plan.miss = explain(session, &live, prompt, &plan, persist.as_deref());
    plan
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
    if matches!(plan.source, CacheSource::None | CacheSource::DiskText) {
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
