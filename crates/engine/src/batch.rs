//! A forward pass over several sessions at once: each session's new tokens run
//! after its own state, and every weight matrix is read once for all their
//! rows (what batched decoding of concurrent slots runs on).
//!
//! Each session's results are bitwise what it gets alone: every row's norms,
//! RoPE and activations, and the matrix products of every precision mode,
//! compute a row the same way wherever it sits in a batch, and attention runs
//! per session over its own state's rows, or over another session's where the
//! batch has compared those rows and found the same bits: decoding sessions
//! forked from one long prompt (subagents, parallel clients of one system
//! prompt) then read its K/V once per step rather than once each.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use ds4_kernels::pool::ThreadPool;

use crate::error::{EngineError, Result};
use crate::model::Model;
use crate::models::{Scratch, SeqStep, Share};
use crate::ops::ATTN_SEG;
use crate::session::Session;
use crate::state::{KvState, RowsKey, SeqState};

/// What comparing two states' rows found: positions `0..equal` hold the same
/// bits in both; `0..checked` were compared (`equal < checked`: they differ
/// at the segment after `equal`).
#[derive(Clone, Copy, Default)]
struct Compared {
    equal: usize,
    checked: usize,
}

/// Intermediates for forward calls over several sessions of one model.
pub struct Batch {
    model: Arc<Model>,
    pool: Arc<ThreadPool>,
    scratch: Scratch,
    /// Per (leader's rows, member's rows), kept while both keep their rows.
    compared: HashMap<(RowsKey, RowsKey), Compared>,
    /// See [`shared_positions`](Self::shared_positions).
    shared_positions: usize,
}

impl Batch {
    /// Room for `max_rows` tokens in all per call.
    pub fn new(model: Arc<Model>, pool: Arc<ThreadPool>, max_rows: usize) -> Self {
        let scratch = model.family.new_scratch(model.hparams(), max_rows.max(1));
        Batch {
            model,
            pool,
            scratch,
            compared: HashMap::new(),
            shared_positions: 0,
        }
    }

    /// Positions the last call's sessions read from another session's rows
    /// rather than their own (summed over sessions; per dense layer).
    pub fn shared_positions(&self) -> usize {
        self.shared_positions
    }

    /// Most tokens over all sessions of one call.
    pub fn max_rows(&self) -> usize {
        self.scratch.max_rows()
    }

    /// Appends `steps[i].1` to `steps[i].0` for every `i` in one forward pass and
    /// leaves each session's next-token logits as [`Session::prefill`] would.
    /// Every session must be on this batch's model with the same precision, and
    /// each step must be non-empty, fit its session's context and its
    /// [`Session::max_step`]; the rows must fit [`max_rows`](Self::max_rows).
    /// Nothing runs when a check fails.
    pub fn forward(&mut self, steps: &mut [(&mut Session, &[u32])]) -> Result<()> {
        let pool = Arc::clone(&self.pool);
        self.forward_on(&pool, steps)
    }

    /// [`forward`](Self::forward) on the threads of `pool` rather than the
    /// batch's own (the results are the same on any number of threads): what
    /// the decoding slots step on while a prefill has the other threads.
    pub fn forward_on(
        &mut self,
        pool: &ThreadPool,
        steps: &mut [(&mut Session, &[u32])],
    ) -> Result<()> {
        let fail = |reason: String| Err(EngineError::Batch { reason });
        let Some(precision) = steps.first().map(|(s, _)| s.precision()) else {
            return Ok(());
        };
        let mut rows = 0;
        for (i, (s, tokens)) in steps.iter().enumerate() {
            if !Arc::ptr_eq(s.model(), &self.model) {
                return fail(format!("session {i} runs another model"));
            }
            if s.precision() != precision {
                return fail(format!("session {i} runs another precision"));
            }
            if tokens.is_empty() || tokens.len() > s.max_step() {
                return fail(format!(
                    "session {i}: {} tokens, a step takes 1 to {}",
                    tokens.len(),
                    s.max_step()
                ));
            }
            s.check_prefill(tokens)?;
            rows += tokens.len();
        }
        if rows > self.max_rows() {
            return fail(format!(
                "{rows} tokens, this batch holds {}",
                self.max_rows()
            ));
        }
        let shares = self.plan_shares(steps);
        self.shared_positions = shares.iter().flatten().map(|s| s.len).sum();
        let mut seqs: Vec<SeqStep<'_>> = steps
            .iter_mut()
            .zip(shares)
            .map(|((s, tokens), share)| {
                let (state, scaling, logits) = s.step_parts(tokens.len());
                SeqStep {
                    state,
                    tokens,
                    scaling,
                    logits,
                    share,
                }
            })
            .collect();
        self.model.family.forward(
            &self.model.weights,
            pool,
            precision,
            &mut self.scratch,
            &mut seqs,
        );
        drop(seqs);
        for (s, tokens) in steps.iter_mut() {
            s.appended(tokens);
        }
        Ok(())
    }

    /// Which decoding sessions read their first rows from another's state: a
    /// session of one token joins the first leader whose tokens it shares for
    /// at least a segment, for the whole segments whose rows the batch has
    /// compared and found bitwise equal (once per pair of states, extended as
    /// the common prefix grows, redone after either is cut or loaded). The
    /// tokens only pick the candidates; the rows decide.
    fn plan_shares(&mut self, steps: &[(&mut Session, &[u32])]) -> Vec<Option<Share>> {
        let states: Vec<Option<&KvState>> = steps
            .iter()
            .map(|(s, tokens)| {
                let state = s.state().as_any().downcast_ref::<KvState>();
                state.filter(|_| tokens.len() == 1)
            })
            .collect();
        let mut shares = vec![None; steps.len()];
        let mut leaders: Vec<usize> = Vec::new();
        let mut seen = HashSet::new();
        for (i, member) in states.iter().enumerate() {
            let Some(member) = member else { continue };
            let joined = leaders.iter().find_map(|&l| {
                let leader = states[l]?;
                let (a, b) = (steps[l].0.tokens(), steps[i].0.tokens());
                if a.get(..ATTN_SEG)? != b.get(..ATTN_SEG)? {
                    return None;
                }
                let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
                let want = common.min(leader.len()).min(member.len()) / ATTN_SEG * ATTN_SEG;
                let key = (leader.rows_key(), member.rows_key());
                seen.insert(key);
                let c = self.compared.entry(key).or_default();
                if c.checked < want {
                    if c.equal == c.checked {
                        while c.equal < want
                            && leader.dense_rows_equal(member, c.equal, c.equal + ATTN_SEG)
                        {
                            c.equal += ATTN_SEG;
                        }
                    }
                    c.checked = want;
                }
                let len = c.equal.min(want);
                (len >= ATTN_SEG).then_some(Share { leader: l, len })
            });
            match joined {
                Some(share) => shares[i] = Some(share),
                None => leaders.push(i),
            }
        }
        self.compared.retain(|k, _| seen.contains(k));
        shares
    }
}
