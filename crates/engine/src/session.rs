//! A session: one conversation's state on one model — the exact token ids, the
//! per-layer K/V state and the next-token logits — advanced by chunked prefill and
//! single-token decode steps.

use std::sync::Arc;

use ds4_kernels::pool::ThreadPool;

use crate::error::{EngineError, Result};
use crate::model::Model;
use crate::models::llama::{self, LlamaState, Scratch};
use crate::ops::Precision;

/// Creation options of a [`Session`].
#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// Context size in tokens (K/V capacity).
    pub n_ctx: usize,
    /// Tokens per prefill chunk; bounds scratch memory.
    pub prefill_chunk: usize,
    pub precision: Precision,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            n_ctx: 4096,
            prefill_chunk: 256,
            precision: Precision::Fast,
        }
    }
}

pub struct Session {
    model: Arc<Model>,
    pool: Arc<ThreadPool>,
    precision: Precision,
    state: LlamaState,
    scratch: Scratch,
    tokens: Vec<u32>,
    logits: Vec<f32>,
    has_logits: bool,
}

impl Session {
    pub fn new(model: Arc<Model>, pool: Arc<ThreadPool>, opts: &SessionOptions) -> Self {
        let hp = &model.hparams;
        let n_ctx = opts.n_ctx.max(1);
        Session {
            state: LlamaState::new(hp, n_ctx),
            scratch: Scratch::new(hp, opts.prefill_chunk.clamp(1, n_ctx)),
            logits: vec![0.0; hp.n_vocab],
            has_logits: false,
            tokens: Vec::with_capacity(n_ctx),
            precision: opts.precision,
            model,
            pool,
        }
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn n_ctx(&self) -> usize {
        self.state.n_ctx
    }

    /// The exact token ids the state represents.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Next-token logits after the last token.
    pub fn logits(&self) -> Result<&[f32]> {
        if self.has_logits {
            Ok(&self.logits)
        } else {
            Err(EngineError::NoLogits)
        }
    }

    /// Appends `tokens`, running them in chunks of the prefill size.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        self.prefill_with_progress(tokens, |_, _| {})
    }

    /// Like [`prefill`](Self::prefill), calling `progress(done, total)` after each chunk.
    pub fn prefill_with_progress(
        &mut self,
        tokens: &[u32],
        mut progress: impl FnMut(usize, usize),
    ) -> Result<()> {
        let n_vocab = self.model.hparams.n_vocab;
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= n_vocab) {
            return Err(EngineError::TokenOutOfRange { id, n_vocab });
        }
        let needed = self.tokens.len() + tokens.len();
        if needed > self.n_ctx() {
            return Err(EngineError::ContextFull {
                needed,
                n_ctx: self.n_ctx(),
            });
        }
        let mut done = 0;
        for chunk in tokens.chunks(self.scratch.max_batch) {
            llama::forward(
                &self.model,
                &mut self.state,
                &mut self.scratch,
                &self.pool,
                self.precision,
                chunk,
                self.tokens.len(),
                &mut self.logits,
            );
            self.tokens.extend_from_slice(chunk);
            self.has_logits = true;
            done += chunk.len();
            progress(done, tokens.len());
        }
        Ok(())
    }

    /// Feeds one token (sampled or forced) and computes the next logits.
    pub fn decode_step(&mut self, token: u32) -> Result<()> {
        self.prefill(&[token])
    }

    /// Forgets everything: the next prefill starts at position 0.
    pub fn reset(&mut self) {
        self.tokens.clear();
        self.has_logits = false;
    }
}
