//! A session: one conversation's state on one model — the exact token ids, the
//! family's per-sequence state and the next-token logits — advanced by chunked
//! prefill and single-token decode steps, cut back, snapshotted and written as a
//! payload. It knows no family.

use std::io::{Read, Write};
use std::sync::Arc;

use ds4_kernels::pool::ThreadPool;

use crate::error::{EngineError, Result};
use crate::kv_type::KvType;
use crate::model::Model;
use crate::models::{LogitsOut, Scratch, SeqStep};
use crate::ops::Precision;
use crate::payload::{self, PayloadHeader, PAYLOAD_VERSION};
use crate::rope::RopeScaling;
use crate::state::{Codec, CodecMut, SeqState};

/// Creation options of a [`Session`].
#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// Context size in tokens (K/V capacity).
    pub n_ctx: usize,
    /// Tokens per prefill chunk; bounds scratch memory.
    pub prefill_chunk: usize,
    pub precision: Precision,
    /// K/V element type.
    pub kv_type: KvType,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            n_ctx: 4096,
            prefill_chunk: 256,
            precision: Precision::Fast,
            kv_type: KvType::F32,
        }
    }
}

/// One conversation's state on one model: the exact token ids, the family's
/// per-sequence state ([`SeqState`]) and the next-token logits. It knows no
/// family: the model's family creates the state and runs the forward pass.
pub struct Session {
    model: Arc<Model>,
    pool: Arc<ThreadPool>,
    opts: SessionOptions,
    precision: Precision,
    /// The RoPE scaling resolved for this session's context.
    scaling: RopeScaling,
    state: Box<dyn SeqState>,
    scratch: Scratch,
    tokens: Vec<u32>,
    logits: Vec<f32>,
    has_logits: bool,
    /// Every token's logits of one chunk, for [`prefill_with_logits`](Self::prefill_with_logits)
    /// and [`keep_step_logits`](Self::keep_step_logits) (allocated on first use).
    chunk_logits: Vec<f32>,
    /// See [`keep_step_logits`](Self::keep_step_logits).
    step_logits: bool,
}

/// Most tokens a forward step takes while a session keeps every token's
/// logits: a step's rows of logits are `n_vocab` floats each (Gemma 3's
/// 262144: 64 MiB for 64 rows, against 256 MiB at the usual 256-token chunk).
pub(crate) const SCORED_STEP: usize = 64;

impl Session {
    /// A session whose RoPE scaling is the model's request resolved for
    /// `opts.n_ctx` ([`RopeRequest::resolve`](crate::RopeRequest::resolve)). It
    /// does not enforce the context bound; [`try_new`](Self::try_new) does.
    pub fn new(model: Arc<Model>, pool: Arc<ThreadPool>, opts: &SessionOptions) -> Self {
        let n_ctx = opts.n_ctx.max(1);
        // The request was validated when set, so this resolves; were it not, the
        // session runs unscaled rather than failing.
        let scaling = model
            .rope_request()
            .resolve(model.model_rope(), n_ctx)
            .unwrap_or(RopeScaling::NONE);
        Self::with_scaling(model, pool, opts, scaling)
    }

    /// Like [`new`](Self::new), but refuses a context beyond what the model's
    /// RoPE may be stretched to ([`Model::rope_scaling_for`]).
    pub fn try_new(
        model: Arc<Model>,
        pool: Arc<ThreadPool>,
        opts: &SessionOptions,
    ) -> Result<Self> {
        let scaling = model.rope_scaling_for(opts.n_ctx.max(1))?;
        Ok(Self::with_scaling(model, pool, opts, scaling))
    }

    fn with_scaling(
        model: Arc<Model>,
        pool: Arc<ThreadPool>,
        opts: &SessionOptions,
        scaling: RopeScaling,
    ) -> Self {
        let hp = model.hparams();
        let n_ctx = opts.n_ctx.max(1);
        let chunk = opts.prefill_chunk.clamp(1, n_ctx);
        Session {
            scaling,
            chunk_logits: Vec::new(),
            step_logits: false,
            state: model.family.new_state(hp, n_ctx, chunk, opts.kv_type),
            scratch: model.family.new_scratch(hp, chunk),
            logits: vec![0.0; hp.n_vocab],
            has_logits: false,
            tokens: Vec::with_capacity(n_ctx),
            precision: opts.precision,
            opts: opts.clone(),
            model,
            pool,
        }
    }

    /// A fresh session on the same model, threads and options with a context of
    /// `n_ctx` tokens: a second slot.
    pub fn sibling(&self, n_ctx: usize) -> Session {
        let opts = SessionOptions {
            n_ctx,
            ..self.opts.clone()
        };
        Session::new(Arc::clone(&self.model), Arc::clone(&self.pool), &opts)
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The threads its forward passes run on.
    pub fn pool(&self) -> &Arc<ThreadPool> {
        &self.pool
    }

    pub fn n_ctx(&self) -> usize {
        self.state.n_ctx()
    }

    /// How this session stores K and V.
    pub fn kv_type(&self) -> KvType {
        self.state.kv_type()
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Memory the per-sequence state holds (K/V rows), in bytes.
    pub fn state_memory_bytes(&self) -> u64 {
        self.state.memory_bytes()
    }

    /// The model fingerprint this session's checkpoints are filed under: the
    /// model's own for f32 K/V (so existing checkpoints stay valid), and for f16 a
    /// hash of it and the K/V type, so that a store never offers a checkpoint of
    /// one type to a session of the other.
    ///
    /// A session with RoPE scaling folds it in too ([`RopeScaling::fold_fingerprint`]):
    /// K rows are stored rotated, so state computed under one scaling is wrong
    /// under another. Unscaled sessions keep the fingerprint they had before
    /// scaling existed.
    pub fn state_fingerprint(&self) -> [u8; 16] {
        let fp = self.kv_type().state_fingerprint(&self.model.fingerprint);
        self.scaling.fold_fingerprint(fp)
    }

    /// The RoPE scaling this session runs with.
    pub fn rope_scaling(&self) -> RopeScaling {
        self.scaling
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
        self.prefill_while(tokens, |done, total| {
            progress(done, total);
            true
        })
        .map(|_| ())
    }

    /// Like [`prefill_with_progress`](Self::prefill_with_progress), but stops after
    /// any chunk for which `keep_going(done, total)` returns false, and returns how
    /// many tokens were prefilled. The session then holds exactly those tokens, in
    /// a consistent state.
    pub fn prefill_while(
        &mut self,
        tokens: &[u32],
        mut keep_going: impl FnMut(usize, usize) -> bool,
    ) -> Result<usize> {
        self.check_prefill(tokens)?;
        let mut done = 0;
        for chunk in tokens.chunks(self.max_step()) {
            self.run_chunk(chunk, self.step_logits);
            done += chunk.len();
            if !keep_going(done, tokens.len()) {
                break;
            }
        }
        Ok(done)
    }

    pub(crate) fn check_prefill(&self, tokens: &[u32]) -> Result<()> {
        let n_vocab = self.model.hparams().n_vocab;
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
        Ok(())
    }

    /// Like [`prefill`](Self::prefill), but computes every token's next-token
    /// logits and calls `each(i, logits)` for `tokens[i]`, in order (perplexity).
    /// Each row is bitwise the logits a token-by-token run would give there. Costs
    /// the output projection of every token, and `prefill_chunk * n_vocab` floats.
    pub fn prefill_with_logits(
        &mut self,
        tokens: &[u32],
        mut each: impl FnMut(usize, &[f32]),
    ) -> Result<()> {
        self.check_prefill(tokens)?;
        let n_vocab = self.model.hparams().n_vocab;
        let mut done = 0;
        for chunk in tokens.chunks(self.scratch.max_rows()) {
            self.run_chunk(chunk, true);
            for (i, row) in self.chunk_logits.chunks_exact(n_vocab).enumerate() {
                each(done + i, row);
            }
            done += chunk.len();
        }
        Ok(())
    }

    /// Runs one chunk (at most `prefill_chunk` tokens) after the held tokens:
    /// the last token's logits into `logits`, and with `all_logits` every
    /// token's into `chunk_logits` too.
    fn run_chunk(&mut self, chunk: &[u32], all_logits: bool) {
        let (model, pool, precision) = (
            Arc::clone(&self.model),
            Arc::clone(&self.pool),
            self.precision,
        );
        let (state, scaling, logits, scratch) = self.parts(chunk.len(), all_logits);
        let mut seqs = [SeqStep {
            state,
            tokens: chunk,
            scaling,
            logits,
            share: None,
        }];
        model
            .family
            .forward(&model.weights, &pool, precision, scratch, &mut seqs);
        self.finish_step(chunk, all_logits);
    }

    /// The per-sequence state, read-only.
    pub(crate) fn state(&self) -> &dyn SeqState {
        &*self.state
    }

    /// What a batched forward call of `n` tokens needs of this session: its
    /// state, its RoPE scaling and where its logits go.
    pub(crate) fn step_parts(
        &mut self,
        n: usize,
    ) -> (&mut dyn SeqState, RopeScaling, LogitsOut<'_>) {
        let (state, scaling, logits, _) = self.parts(n, self.step_logits);
        (state, scaling, logits)
    }

    /// A forward pass's parts for `n` tokens: the state, the scaling, the
    /// logits out (every row into `chunk_logits` with `all`) and the scratch.
    fn parts(
        &mut self,
        n: usize,
        all: bool,
    ) -> (&mut dyn SeqState, RopeScaling, LogitsOut<'_>, &mut Scratch) {
        let logits = match all {
            true => {
                self.chunk_logits.resize(n * self.logits.len(), 0.0);
                LogitsOut::All(&mut self.chunk_logits)
            }
            false => LogitsOut::Last(&mut self.logits),
        };
        (&mut *self.state, self.scaling, logits, &mut self.scratch)
    }

    /// Records tokens a batched forward call appended to this session's state
    /// (with [`keep_step_logits`](Self::keep_step_logits), every row's logits
    /// are in `chunk_logits`).
    pub(crate) fn appended(&mut self, tokens: &[u32]) {
        self.finish_step(tokens, self.step_logits);
    }

    /// Notes `tokens` appended; after a pass that wrote every row (`all`), the
    /// last row is the next-token logits.
    fn finish_step(&mut self, tokens: &[u32], all: bool) {
        if all {
            let n_vocab = self.logits.len();
            let last = (tokens.len() - 1) * n_vocab;
            self.logits
                .copy_from_slice(&self.chunk_logits[last..last + n_vocab]);
        }
        self.tokens.extend_from_slice(tokens);
        self.has_logits = true;
    }

    /// With `on`, every forward step (a prefill chunk, a batched step) keeps
    /// each of its tokens' next-token logits, [`step_logits`](Self::step_logits),
    /// and takes at most [`SCORED_STEP`] tokens: how a prompt's own tokens are
    /// scored while it is prefilled. Off (the default) frees them.
    pub fn keep_step_logits(&mut self, on: bool) {
        self.step_logits = on;
        if !on {
            self.chunk_logits = Vec::new();
        }
    }

    /// The next-token logits of each token the last forward step appended,
    /// `n_vocab` floats per token, while [`keep_step_logits`](Self::keep_step_logits)
    /// is on (empty otherwise). Row `i` scores the token after the step's `i`th.
    pub fn step_logits(&self) -> &[f32] {
        match self.step_logits {
            true => &self.chunk_logits,
            false => &[],
        }
    }

    /// Most tokens one forward call may append (the prefill chunk, or fewer
    /// while [`keep_step_logits`](Self::keep_step_logits) is on).
    pub fn max_step(&self) -> usize {
        match self.step_logits {
            true => self.state.max_step().min(SCORED_STEP),
            false => self.state.max_step(),
        }
    }

    /// After a forward step of `step` tokens run with
    /// [`keep_step_logits`](Self::keep_step_logits) on, keeps its first `n`
    /// (1 to `step`): the state is cut back to them and their last row of
    /// logits becomes the next-token logits, exactly the session those tokens
    /// alone would have given (a speculative step's verified part). Fails
    /// without changing anything when the step's rows are not kept or the
    /// state cannot be cut there ([`max_draft`](Self::max_draft) avoids it).
    pub fn keep_verified(&mut self, step: usize, n: usize) -> Result<()> {
        let len = self.tokens.len();
        let n_vocab = self.logits.len();
        let fail = |why| Err(EngineError::KeepVerified { n, step, why });
        if n == 0 || n > step || step > len {
            return fail("not a part of the last step");
        }
        if !self.step_logits || self.chunk_logits.len() != step * n_vocab {
            return fail("the step did not keep its rows of logits");
        }
        if n == step {
            return Ok(());
        }
        let keep = len - step + n;
        if !self.state.can_cut_to(keep) {
            return Err(EngineError::CannotCutBack { to: keep, len });
        }
        self.state.drop_appended(keep);
        self.tokens.truncate(keep);
        let row = (n - 1) * n_vocab;
        self.logits
            .copy_from_slice(&self.chunk_logits[row..row + n_vocab]);
        Ok(())
    }

    /// The most draft tokens a step after the held tokens may carry beside
    /// the one it feeds, at most `cap`: what the context and one step take,
    /// and no more than the state can be cut back from to keep only that one
    /// ([`keep_verified`](Self::keep_verified); a compressed state cannot cut
    /// back across a compression boundary).
    pub fn max_draft(&self, cap: usize) -> usize {
        let len = self.tokens.len();
        let room = self
            .n_ctx()
            .saturating_sub(len + 1)
            .min(self.max_step().saturating_sub(1))
            .min(cap);
        (0..=room)
            .rev()
            .find(|&k| k == 0 || self.state.could_cut_loaded(len + 1 + k, len + 1))
            .unwrap_or(0)
    }

    /// Feeds one token (sampled or forced) and computes the next logits.
    pub fn decode_step(&mut self, token: u32) -> Result<()> {
        self.prefill(&[token])
    }

    /// Forgets everything: the next prefill starts at position 0.
    pub fn reset(&mut self) {
        self.tokens.clear();
        self.state.reset();
        self.has_logits = false;
    }

    /// Whether [`rewind`](Self::rewind) to `n` tokens can work from the state in
    /// memory. It always can for dense K/V; a sliding-window ring only while it
    /// still holds the window before token `n - 1`.
    pub fn can_rewind(&self, n: usize) -> bool {
        let len = self.tokens.len();
        n <= len && (n == 0 || n == len || self.state.can_cut_to(n - 1))
    }

    /// Whether a session that loads a payload of `len` tokens could then be
    /// rewound to `n` ([`can_rewind`](Self::can_rewind) after the load is the
    /// answer; this one is optimistic): a checkpoint that can never be cut
    /// there is not loaded.
    pub fn could_rewind_loaded(&self, len: usize, n: usize) -> bool {
        n <= len && (n == 0 || n == len || self.state.could_cut_loaded(len, n - 1))
    }

    /// Cuts the session back to its first `n` tokens, with the logits that follow
    /// them: the state is cut back to `n - 1` tokens and token `n - 1` runs
    /// again (one decode step), which gives exactly the state an uninterrupted
    /// session of those `n` tokens has. Where the state cannot be cut back
    /// ([`can_rewind`](Self::can_rewind) is false) it fails with
    /// [`EngineError::CannotCutBack`] and leaves the session as it was; the caller
    /// restores a snapshot or prefills again.
    pub fn rewind(&mut self, n: usize) -> Result<()> {
        let len = self.tokens.len();
        if n > len {
            return Err(EngineError::RewindBeyondEnd { to: n, len });
        }
        if n == len {
            return Ok(());
        }
        if n == 0 {
            self.reset();
            return Ok(());
        }
        if !self.state.can_cut_to(n - 1) {
            return Err(EngineError::CannotCutBack { to: n, len });
        }
        let last = self.tokens[n - 1];
        self.tokens.truncate(n - 1);
        self.state.cut_to(n - 1);
        self.decode_step(last)
    }

    /// Exact size of [`save_payload`](Self::save_payload)'s output.
    pub fn payload_bytes(&self) -> u64 {
        let n_vocab = self.model.hparams().n_vocab;
        match self.state.codec() {
            Codec::Container(part) => {
                PayloadHeader::BYTES
                    + 4 * self.tokens.len() as u64
                    + 4 * n_vocab as u64
                    + part.payload_bytes()
            }
            Codec::Own(own) => own.payload_bytes(n_vocab),
        }
    }

    /// Writes the session (tokens, next-token logits, the family's state) as a
    /// payload: the DS4S container, or the family's own layout where it keeps
    /// its original engine's (DeepSeek V4). `w` should be buffered.
    pub fn save_payload(&self, w: &mut impl Write) -> Result<()> {
        if !self.has_logits {
            return Err(EngineError::NoLogits);
        }
        let part = match self.state.codec() {
            Codec::Container(part) => part,
            Codec::Own(own) => {
                own.write_payload(&self.tokens, &self.logits, w)?;
                return w.flush().map_err(EngineError::PayloadIo);
            }
        };
        let header = PayloadHeader {
            version: PAYLOAD_VERSION,
            family: self.model.family.entry().payload_id,
            n_vocab: self.model.hparams().n_vocab as u32,
            n_ctx: self.n_ctx() as u32,
            n_tokens: self.tokens.len() as u32,
            v1: None,
        };
        header.write(w)?;
        payload::write_u32s(w, &self.tokens)?;
        payload::write_f32s(w, &self.logits)?;
        part.write(w)?;
        w.flush().map_err(EngineError::PayloadIo)
    }

    /// Replaces the session with a payload written by [`save_payload`](Self::save_payload)
    /// (or a version-1 payload of a dense llama state) for a model of the same
    /// family and shape and with the same K/V type ([`EngineError::KvTypeMismatch`]
    /// otherwise). The payload must fit this session's context and must end where
    /// its header says. On error the session is left empty, never half-loaded.
    pub fn load_payload(&mut self, r: &mut impl Read) -> Result<()> {
        self.reset();
        let result = self.load_inner(r);
        if result.is_err() {
            self.reset();
        }
        result
    }

    fn load_inner(&mut self, r: &mut impl Read) -> Result<()> {
        if let CodecMut::Own(own) = self.state.codec_mut() {
            own.read_payload(&mut self.tokens, &mut self.logits, r)?;
            self.has_logits = true;
            return Ok(());
        }
        let h = PayloadHeader::read(r)?;
        let entry = self.model.family.entry();
        let hp = self.model.hparams();
        if h.family != entry.payload_id {
            return Err(payload::bad(format!(
                "family {} in the payload; this model is {} ({})",
                h.family, entry.name, entry.payload_id
            )));
        }
        if h.n_vocab as usize != hp.n_vocab {
            return Err(payload::bad(format!(
                "a vocabulary of {} in the payload differs from the model's {}",
                h.n_vocab, hp.n_vocab
            )));
        }
        let n = h.n_tokens as usize;
        if n == 0 || n > self.n_ctx() {
            return Err(payload::bad(format!(
                "{n} tokens do not fit this session's context of {}",
                self.n_ctx()
            )));
        }
        if let Some(v1) = h.v1 {
            let mine = [hp.n_layer, hp.n_head_kv, hp.head_dim].map(|x| x as u32);
            if [v1.n_layer, v1.n_head_kv, v1.head_dim] != mine {
                return Err(payload::bad(format!(
                    "shape (layers {}, kv heads {}, head dim {}) differs from the model's ({}, {}, {})",
                    v1.n_layer, v1.n_head_kv, v1.head_dim, mine[0], mine[1], mine[2]
                )));
            }
            match KvType::from_code(v1.kv_type) {
                Some(t) if t == self.kv_type() => {}
                Some(t) => {
                    return Err(EngineError::KvTypeMismatch {
                        payload: t,
                        session: self.kv_type(),
                    })
                }
                None => {
                    return Err(payload::bad(format!(
                        "K/V element type {} (this build stores f32 = 0, f16 = 1)",
                        v1.kv_type
                    )))
                }
            }
        }
        self.tokens.resize(n, 0);
        payload::read_u32s(r, &mut self.tokens, "tokens")?;
        payload::read_f32s(r, &mut self.logits, "logits")?;
        if let CodecMut::Container(part) = self.state.codec_mut() {
            match h.v1 {
                Some(_) => part.read_v1(n, r)?,
                None => part.read(n, r)?,
            }
        }
        payload::expect_end(r)?;
        let n_vocab = hp.n_vocab;
        if let Some(&id) = self.tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(EngineError::TokenOutOfRange { id, n_vocab });
        }
        self.has_logits = true;
        Ok(())
    }

    /// An in-memory copy of the whole state, for [`restore`](Self::restore).
    pub fn snapshot(&self) -> Result<Snapshot> {
        let mut bytes = Vec::with_capacity(self.payload_bytes() as usize);
        self.save_payload(&mut bytes)?;
        Ok(Snapshot { bytes })
    }

    /// Returns to the state of `snap` (taken from a session of the same model).
    pub fn restore(&mut self, snap: &Snapshot) -> Result<()> {
        self.load_payload(&mut snap.bytes.as_slice())
    }
}

/// A session's state held in memory (the payload bytes).
#[derive(Clone)]
pub struct Snapshot {
    bytes: Vec<u8>,
}

impl Snapshot {
    pub fn len_bytes(&self) -> usize {
        self.bytes.len()
    }
}
