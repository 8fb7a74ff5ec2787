//! A forward pass over several sessions at once: each session's new tokens run
//! after its own state, and every weight matrix is read once for all their
//! rows (what batched decoding of concurrent slots runs on).
//!
//! Each session's results are bitwise what it gets alone: every row's norms,
//! RoPE and activations, and the matrix products of every precision mode,
//! compute a row the same way wherever it sits in a batch, and attention runs
//! per session over its own state.

use std::sync::Arc;

use ds4_kernels::pool::ThreadPool;

use crate::error::{EngineError, Result};
use crate::model::Model;
use crate::models::{LogitsOut, Scratch, SeqStep};
use crate::session::Session;

/// Intermediates for forward calls over several sessions of one model.
pub struct Batch {
    model: Arc<Model>,
    pool: Arc<ThreadPool>,
    scratch: Scratch,
}

impl Batch {
    /// Room for `max_rows` tokens in all per call.
    pub fn new(model: Arc<Model>, pool: Arc<ThreadPool>, max_rows: usize) -> Self {
        let scratch = model.family.new_scratch(model.hparams(), max_rows.max(1));
        Batch {
            model,
            pool,
            scratch,
        }
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
        let mut seqs: Vec<SeqStep<'_>> = steps
            .iter_mut()
            .map(|(s, tokens)| {
                let (state, scaling, logits) = s.step_parts();
                SeqStep {
                    state,
                    tokens,
                    scaling,
                    logits: LogitsOut::Last(logits),
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
}
