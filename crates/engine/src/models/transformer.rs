//! What the decoder-only attention families (llama, gemma3) share around their
//! layers: the named intermediates of a forward call over several sequences,
//! the token embedding lookup, RoPE angle tables per row, storing each
//! sequence's new K/V rows and attending over its own state, and the output
//! head that writes each sequence's logits.
//!
//! Rows of all sequences sit back to back in every buffer (sequence `i`'s
//! tokens at rows `offsets[i]..`), so a projection reads each weight matrix once
//! for all of them; everything per row (norms, RoPE, activations) and the
//! matrix products compute each row the same way wherever it sits, which is why
//! a sequence's results do not depend on its batch.

use ds4_kernels::attn::AsF32Rows;
use ds4_kernels::pool::ThreadPool;

use super::{state_of, LogitsOut, SeqStep, Share};
use crate::error::Result;
use crate::ops::{
    add_rows, attention, attention_shared, project, rms_norm, rms_norm_rows, rms_norm_rows_inplace,
    Activations, AttnLayout, Precision, Rope, SharedQuery,
};
use crate::rope::RopeScaling;
use crate::state::{store_rows, KvRows, KvState, LayerRows, LayerRowsRef, SeqState};
use crate::weights::{Binder, HParams, TensorRef, Weights};

/// Named intermediates for `max_rows` token rows.
pub(crate) struct Rows {
    pub x: Vec<f32>,
    pub xn: Vec<f32>,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub att: Vec<f32>,
    pub attn_out: Vec<f32>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub ffn_out: Vec<f32>,
    pub acts: Activations,
    /// RoPE `(sin, cos)` per row and pair, one table per RoPE a family uses
    /// (Gemma 3: local and global), computed once per forward call.
    pub angles: Vec<Vec<(f32, f32)>>,
    /// Logits of several sequences before they are handed out (allocated on
    /// first use).
    logits: Vec<f32>,
    /// RoPE tables by (base, dims, scaling), built on first use.
    ropes: Vec<(u32, usize, RopeScaling, Rope)>,
}

impl Rows {
    pub fn new(hp: &HParams, max_rows: usize, n_tables: usize) -> Self {
        let b = max_rows;
        Rows {
            x: vec![0.0; b * hp.n_embd],
            xn: vec![0.0; b * hp.n_embd],
            q: vec![0.0; b * hp.n_embd_q()],
            k: vec![0.0; b * hp.n_embd_kv()],
            v: vec![0.0; b * hp.n_embd_kv()],
            att: vec![0.0; b * hp.n_embd_q()],
            attn_out: vec![0.0; b * hp.n_embd],
            gate: vec![0.0; b * hp.n_ff],
            up: vec![0.0; b * hp.n_ff],
            ffn_out: vec![0.0; b * hp.n_embd],
            acts: Activations::new(b * hp.n_ff.max(hp.n_embd_q()).max(hp.n_embd)),
            angles: vec![vec![(0.0, 0.0); b * hp.n_rot / 2]; n_tables],
            logits: Vec::new(),
            ropes: Vec::new(),
        }
    }

    /// Fills angle table `table` for every row: each sequence's positions
    /// continue its state, under the RoPE of `base` and `n_rot` dims scaled by
    /// `scaling(seq)`.
    pub fn fill_angles(
        &mut self,
        table: usize,
        seqs: &[SeqStep<'_>],
        base: f32,
        n_rot: usize,
        scaling: impl Fn(&SeqStep<'_>) -> RopeScaling,
    ) {
        let n_pairs = n_rot / 2;
        let mut row = 0;
        for s in seqs {
            let sc = scaling(s);
            let i = match self
                .ropes
                .iter()
                .position(|r| (r.0, r.1, r.2) == (base.to_bits(), n_rot, sc))
            {
                Some(i) => i,
                None => {
                    self.ropes
                        .push((base.to_bits(), n_rot, sc, Rope::scaled(base, n_rot, sc)));
                    self.ropes.len() - 1
                }
            };
            let rope = &self.ropes[i].3;
            let pos0 = s.state.len();
            let out = &mut self.angles[table][row * n_pairs..(row + s.tokens.len()) * n_pairs];
            for (t, a) in out.chunks_exact_mut(n_pairs.max(1)).enumerate() {
                rope.angles(pos0 + t, a);
            }
            row += s.tokens.len();
        }
    }
}

/// The token embedding and the output head: `token_embd.weight [n_embd,
/// n_vocab]`, `output_norm.weight [n_embd]`, and `output.weight [n_embd,
/// n_vocab]` or, when the file has none, the embedding tied to it.
pub(crate) struct Head {
    pub tok_embd: TensorRef,
    pub output_norm: Vec<f32>,
    pub output: TensorRef,
}

impl Head {
    pub fn bind(b: &mut Binder<'_>, hp: &HParams) -> Result<Self> {
        let tok_embd = b.matrix("token_embd.weight", hp.n_embd, hp.n_vocab)?;
        let output = if b.has("output.weight") {
            b.matrix("output.weight", hp.n_embd, hp.n_vocab)?
        } else {
            tok_embd
        };
        Ok(Head {
            tok_embd,
            output_norm: b.f32_vector("output_norm.weight", hp.n_embd)?,
            output,
        })
    }
}

/// The tensors of layer `il` that every family here has (`blk.{il}.`):
/// `attn_norm [n_embd]`, `attn_q [n_embd, n_head*hd]`, `attn_k`/`attn_v
/// [n_embd, n_head_kv*hd]`, `attn_output [n_head*hd, n_embd]`, `ffn_norm
/// [n_embd]`, `ffn_gate`/`ffn_up [n_embd, n_ff]`, `ffn_down [n_ff, n_embd]`.
pub(crate) struct CoreLayer {
    pub attn_norm: Vec<f32>,
    pub wq: TensorRef,
    pub wk: TensorRef,
    pub wv: TensorRef,
    pub wo: TensorRef,
    pub ffn_norm: Vec<f32>,
    pub w_gate: TensorRef,
    pub w_up: TensorRef,
    pub w_down: TensorRef,
}

impl CoreLayer {
    pub fn bind(b: &mut Binder<'_>, hp: &HParams, il: usize) -> Result<Self> {
        let (n_embd, n_q, n_kv, n_ff) = (hp.n_embd, hp.n_embd_q(), hp.n_embd_kv(), hp.n_ff);
        let name = |t: &str| format!("blk.{il}.{t}.weight");
        Ok(CoreLayer {
            attn_norm: b.f32_vector(&name("attn_norm"), n_embd)?,
            wq: b.matrix(&name("attn_q"), n_embd, n_q)?,
            wk: b.matrix(&name("attn_k"), n_embd, n_kv)?,
            wv: b.matrix(&name("attn_v"), n_embd, n_kv)?,
            wo: b.matrix(&name("attn_output"), n_q, n_embd)?,
            ffn_norm: b.f32_vector(&name("ffn_norm"), n_embd)?,
            w_gate: b.matrix(&name("ffn_gate"), n_embd, n_ff)?,
            w_up: b.matrix(&name("ffn_up"), n_embd, n_ff)?,
            w_down: b.matrix(&name("ffn_down"), n_ff, n_embd)?,
        })
    }

    pub fn qkv(&self) -> [&TensorRef; 3] {
        [&self.wq, &self.wk, &self.wv]
    }

    pub fn ffn(&self) -> [&TensorRef; 3] {
        [&self.w_gate, &self.w_up, &self.w_down]
    }
}

/// Row offsets of each sequence and the total.
pub(crate) fn offsets(seqs: &[SeqStep<'_>]) -> (Vec<usize>, usize) {
    let mut offs = Vec::with_capacity(seqs.len());
    let mut n = 0;
    for s in seqs {
        offs.push(n);
        n += s.tokens.len();
    }
    (offs, n)
}

/// How a family rotates a head by precomputed `(sin, cos)` pairs.
pub(crate) type RotateFn = fn(&mut [f32], usize, &[(f32, f32)]);

/// The steps of a decoder layer, over the `nt` rows of one forward call: what
/// the families compose their layers from.
pub(crate) struct Pass<'a> {
    pub model: &'a Weights,
    pub pool: &'a ThreadPool,
    pub precision: Precision,
    /// Rows (tokens of every sequence) in this call.
    pub nt: usize,
}

impl<'a> Pass<'a> {
    /// A pass over every row of `seqs`.
    pub fn new(
        model: &'a Weights,
        pool: &'a ThreadPool,
        precision: Precision,
        seqs: &[SeqStep<'_>],
    ) -> Self {
        Pass {
            model,
            pool,
            precision,
            nt: offsets(seqs).1,
        }
    }

    fn hp(&self) -> &HParams {
        &self.model.hparams
    }

    /// `xn = rms_norm(x) * w`.
    pub fn norm(&self, r: &mut Rows, w: &[f32]) {
        let n = self.nt * self.hp().n_embd;
        rms_norm_rows(self.pool, &r.x[..n], w, self.hp().rms_eps, &mut r.xn[..n]);
    }

    /// `q, k, v = xn · (wq, wk, wv)`, one dispatch.
    pub fn qkv(&self, r: &mut Rows, [wq, wk, wv]: [&TensorRef; 3]) {
        let (nt, hp) = (self.nt, self.hp());
        let m = |t| self.model.matrix(t);
        project(
            self.pool,
            self.precision,
            &mut r.acts,
            &r.xn[..nt * hp.n_embd],
            &[&m(wq), &m(wk), &m(wv)],
            &mut [
                &mut r.q[..nt * hp.n_embd_q()],
                &mut r.k[..nt * hp.n_embd_kv()],
                &mut r.v[..nt * hp.n_embd_kv()],
            ],
        );
    }

    /// RMSNorm of every query and key head with its weight (QK-norm).
    pub fn norm_heads(&self, r: &mut Rows, q_norm: &[f32], k_norm: &[f32]) {
        let (nt, hp) = (self.nt, self.hp());
        rms_norm_rows_inplace(
            self.pool,
            &mut r.q[..nt * hp.n_embd_q()],
            q_norm,
            hp.rms_eps,
        );
        rms_norm_rows_inplace(
            self.pool,
            &mut r.k[..nt * hp.n_embd_kv()],
            k_norm,
            hp.rms_eps,
        );
    }

    /// Rotates every query and key head by angle table `table` (`rotate`:
    /// [`Rope::rotate`] on adjacent pairs or [`Rope::rotate_neox`] on halves).
    pub fn rope_qk(&self, r: &mut Rows, table: usize, rotate: RotateFn) {
        let (nt, hp) = (self.nt, self.hp());
        let (hd, n_pairs) = (hp.head_dim, hp.n_rot / 2);
        let angles = &r.angles[table][..nt * n_pairs];
        for (rows, n) in [
            (&mut r.q[..nt * hp.n_embd_q()], hp.n_embd_q()),
            (&mut r.k[..nt * hp.n_embd_kv()], hp.n_embd_kv()),
        ] {
            self.pool.for_each_row_block_mut(rows, n, &|first, rows| {
                for (t, row) in (first..).zip(rows.chunks_exact_mut(n)) {
                    rotate(row, hd, &angles[t * n_pairs..(t + 1) * n_pairs]);
                }
            });
        }
    }

    /// Layer `il`'s attention for every sequence (K/V stored into its state,
    /// queries scaled by `scale`), then `attn_out = att · wo`.
    pub fn attention(
        &self,
        r: &mut Rows,
        seqs: &mut [SeqStep<'_>],
        il: usize,
        scale: f32,
        wo: &TensorRef,
    ) {
        let (nt, hp) = (self.nt, self.hp());
        let (n_q, n_kv) = (hp.n_embd_q(), hp.n_embd_kv());
        attend_layer(
            self.pool,
            seqs,
            il,
            (hp.n_head, hp.n_head_kv, hp.head_dim),
            scale,
            &r.q[..nt * n_q],
            (&r.k[..nt * n_kv], &r.v[..nt * n_kv]),
            &mut r.att[..nt * n_q],
        );
        project(
            self.pool,
            self.precision,
            &mut r.acts,
            &r.att[..nt * n_q],
            &[&self.model.matrix(wo)],
            &mut [&mut r.attn_out[..nt * hp.n_embd]],
        );
    }

    /// `ffn_out = act(xn · gate, xn · up) · down` (`act` in place on the gate
    /// rows: SwiGLU, GeGLU).
    pub fn ffn(
        &self,
        r: &mut Rows,
        [gate, up, down]: [&TensorRef; 3],
        act: fn(&mut [f32], &[f32]),
    ) {
        let (nt, hp) = (self.nt, self.hp());
        let m = |t| self.model.matrix(t);
        let (g, u) = (&mut r.gate[..nt * hp.n_ff], &mut r.up[..nt * hp.n_ff]);
        project(
            self.pool,
            self.precision,
            &mut r.acts,
            &r.xn[..nt * hp.n_embd],
            &[&m(gate), &m(up)],
            &mut [&mut *g, &mut *u],
        );
        let (u, n_ff) = (&*u, hp.n_ff);
        self.pool.for_each_row_block_mut(g, n_ff, &|first, rows| {
            act(rows, &u[first * n_ff..][..rows.len()]);
        });
        project(
            self.pool,
            self.precision,
            &mut r.acts,
            g,
            &[&m(down)],
            &mut [&mut r.ffn_out[..nt * hp.n_embd]],
        );
    }

    /// `x += rms_norm(y) * post_norm` (or `x += y` without a post-norm), `y`
    /// being the attention output or, with `ffn`, the feed-forward output.
    pub fn residual(&self, r: &mut Rows, ffn: bool, post_norm: Option<&[f32]>) {
        let n = self.nt * self.hp().n_embd;
        let y = if ffn {
            &mut r.ffn_out[..n]
        } else {
            &mut r.attn_out[..n]
        };
        if let Some(w) = post_norm {
            rms_norm_rows_inplace(self.pool, y, w, self.hp().rms_eps);
        }
        add_rows(self.pool, &mut r.x[..n], y, self.hp().n_embd);
    }
}

/// Writes the embedding rows of every sequence's tokens into `x`.
pub(crate) fn embed(p: &Pass<'_>, head: &Head, seqs: &[SeqStep<'_>], x: &mut [f32]) {
    let (embd, n_embd) = (p.model.matrix(&head.tok_embd), p.hp().n_embd);
    let ids = seqs.iter().flat_map(|s| s.tokens.iter());
    for (row, &id) in x.chunks_exact_mut(n_embd).zip(ids) {
        if let Err(e) = ds4_kernels::dequantize_row(embd.fmt, embd.row(id as usize), row) {
            panic!("embedding rows are validated at load: {e}");
        }
    }
}

/// For every sequence: stores its rows of `k`/`v` into layer `il` of its state
/// (at its positions), then runs its queries over the layer. `q`, `k`, `v` and
/// `att` hold all sequences' rows. Decoding sequences that share their first
/// rows with a leader ([`SeqStep::share`]) run together on a dense layer, the
/// shared rows read once from the leader's state (`attention_shared`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_layer(
    pool: &ThreadPool,
    seqs: &mut [SeqStep<'_>],
    il: usize,
    shape: (usize, usize, usize),
    scale: f32,
    q: &[f32],
    (k, v): (&[f32], &[f32]),
    att: &mut [f32],
) {
    let (n_head, n_head_kv, head_dim) = shape;
    let (n_q, n_kv) = (n_head * head_dim, n_head_kv * head_dim);
    let (offsets, _) = offsets(seqs);
    for (s, &row) in seqs.iter_mut().zip(&offsets) {
        let rs = row * n_kv..(row + s.tokens.len()) * n_kv;
        let state = state_of::<KvState>(&mut *s.state);
        let pos0 = state.len();
        let (rows, layout) = state.layer(il, scale);
        let (k, v) = (&k[rs.clone()], &v[rs]);
        match rows {
            LayerRows::F32(kr, vr) => {
                store_rows((kr, vr), &layout, (n_head_kv, head_dim), pos0, k, v)
            }
            LayerRows::F16(kr, vr) => {
                store_rows((kr, vr), &layout, (n_head_kv, head_dim), pos0, k, v)
            }
        }
    }
    let shares: Vec<Option<Share>> = seqs.iter().map(|s| s.share).collect();
    let counts: Vec<usize> = seqs.iter().map(|s| s.tokens.len()).collect();
    let n_seq = counts.len();
    let states: Vec<&KvState> = seqs
        .iter_mut()
        .map(|s| &*state_of::<KvState>(&mut *s.state))
        .collect();
    let mut outs: Vec<&mut [f32]> = Vec::with_capacity(n_seq);
    let mut rest = att;
    for &n in &counts {
        let (out, tail) = std::mem::take(&mut rest).split_at_mut(n * n_q);
        outs.push(out);
        rest = tail;
    }
    let query = |i: usize| &q[offsets[i] * n_q..][..counts[i] * n_q];
    let mut done = vec![false; n_seq];
    for leader in 0..n_seq {
        let members: Vec<(usize, usize)> = (0..n_seq)
            .filter_map(|i| match shares[i] {
                Some(s) if s.leader == leader => Some((i, s.len)),
                _ => (i == leader).then_some((i, 0)),
            })
            .collect();
        let layout = states[leader].layout(il, scale);
        if members.len() < 2 || layout.window.is_some() {
            continue;
        }
        #[allow(clippy::too_many_arguments)]
        fn go<'a, T: KvRows>(
            pool: &ThreadPool,
            states: &[&'a KvState],
            (leader, members): (usize, &[(usize, usize)]),
            il: usize,
            layout: AttnLayout,
            (n_head, n_head_kv, head_dim): (usize, usize, usize),
            query: &dyn Fn(usize) -> &'a [f32],
            outs: &mut [&mut [f32]],
        ) {
            let rows = |i: usize| {
                T::rows(states[i].layer_ref(il))
                    .expect("states whose rows compared equal have one element type")
            };
            let queries: Vec<SharedQuery<'_, T>> = members
                .iter()
                .map(|&(i, shared)| SharedQuery {
                    q: query(i),
                    kv: rows(i),
                    pos: states[i].len(),
                    shared,
                })
                .collect();
            let mut group_outs: Vec<&mut [f32]> = members
                .iter()
                .map(|&(i, _)| std::mem::take(&mut outs[i]))
                .collect();
            attention_shared(
                pool,
                rows(leader),
                &queries,
                layout,
                n_head,
                n_head_kv,
                head_dim,
                &mut group_outs,
            );
        }
        let group = (leader, &members[..]);
        match states[leader].layer_ref(il) {
            LayerRowsRef::F32(..) => {
                go::<f32>(pool, &states, group, il, layout, shape, &query, &mut outs)
            }
            LayerRowsRef::F16(..) => {
                go::<u16>(pool, &states, group, il, layout, shape, &query, &mut outs)
            }
        }
        members.iter().for_each(|&(i, _)| done[i] = true);
    }
    for (i, out) in outs.iter_mut().enumerate() {
        if done[i] {
            continue;
        }
        let (state, q) = (states[i], query(i));
        let layout = state.layout(il, scale);
        fn go<T: AsF32Rows>(
            pool: &ThreadPool,
            (kr, vr): (&[T], &[T]),
            layout: AttnLayout,
            (n_head, n_head_kv, head_dim): (usize, usize, usize),
            pos0: usize,
            q: &[f32],
            out: &mut [f32],
        ) {
            attention(
                pool, q, kr, vr, layout, n_head, n_head_kv, head_dim, pos0, out,
            );
        }
        match state.layer_ref(il) {
            LayerRowsRef::F32(kr, vr) => go(pool, (kr, vr), layout, shape, state.len(), q, out),
            LayerRowsRef::F16(kr, vr) => go(pool, (kr, vr), layout, shape, state.len(), q, out),
        }
    }
}

/// Records every sequence's new positions in its state (after the last layer).
pub(crate) fn advance(seqs: &mut [SeqStep<'_>]) {
    for s in seqs.iter_mut() {
        let n = s.tokens.len();
        state_of::<KvState>(&mut *s.state).advance(n);
    }
}

/// The final norm and output projection of the rows each sequence asks logits
/// for, written to each sequence's buffer.
#[allow(clippy::too_many_arguments)]
pub(crate) fn output_head(p: &Pass<'_>, r: &mut Rows, seqs: &mut [SeqStep<'_>], head: &Head) {
    let (pool, precision) = (p.pool, p.precision);
    let (norm, eps) = (&head.output_norm[..], p.hp().rms_eps);
    let output = &p.model.matrix(&head.output);
    let n_embd = norm.len();
    let n_vocab = output.n_out;
    let (offs, _) = offsets(seqs);
    // The rows wanted, in sequence order.
    let mut wanted: Vec<std::ops::Range<usize>> = Vec::with_capacity(seqs.len());
    for (s, &o) in seqs.iter().zip(&offs) {
        let n = s.tokens.len();
        wanted.push(match s.logits {
            LogitsOut::Last(_) => o + n - 1..o + n,
            LogitsOut::All(_) => o..o + n,
        });
    }
    let n_rows: usize = wanted.iter().map(|w| w.len()).sum();
    // Gather the wanted rows at the front of `xn`, normalized.
    let mut at = 0;
    for w in &wanted {
        let src = &r.x[w.start * n_embd..w.end * n_embd];
        let dst = &mut r.xn[at * n_embd..(at + w.len()) * n_embd];
        if w.len() == 1 {
            rms_norm(src, norm, eps, dst);
        } else {
            rms_norm_rows(pool, src, norm, eps, dst);
        }
        at += w.len();
    }
    let xn = &r.xn[..n_rows * n_embd];
    if let [only] = seqs {
        let out = match &mut only.logits {
            LogitsOut::Last(o) => &mut **o,
            LogitsOut::All(o) => &mut **o,
        };
        project(pool, precision, &mut r.acts, xn, &[output], &mut [out]);
        return;
    }
    r.logits.resize(n_rows * n_vocab, 0.0);
    project(
        pool,
        precision,
        &mut r.acts,
        xn,
        &[output],
        &mut [&mut r.logits[..]],
    );
    let mut at = 0;
    for (s, w) in seqs.iter_mut().zip(&wanted) {
        let src = &r.logits[at * n_vocab..(at + w.len()) * n_vocab];
        let out = match &mut s.logits {
            LogitsOut::Last(o) => &mut **o,
            LogitsOut::All(o) => &mut **o,
        };
        out.copy_from_slice(src);
        at += w.len();
    }
}
