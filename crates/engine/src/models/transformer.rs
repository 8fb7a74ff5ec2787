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
use ds4_kernels::matmul::WeightMatrix;
use ds4_kernels::pool::ThreadPool;

use super::{state_of, LogitsOut, SeqStep};
use crate::model::HParams;
use crate::ops::{attention, project, rms_norm, rms_norm_rows, Activations, Precision, Rope};
use crate::rope::RopeScaling;
use crate::state::{KvState, LayerRows, SeqState};

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

/// Writes the embedding rows of every sequence's tokens into `x`.
pub(crate) fn embed(embd: &WeightMatrix<'_>, seqs: &[SeqStep<'_>], n_embd: usize, x: &mut [f32]) {
    let ids = seqs.iter().flat_map(|s| s.tokens.iter());
    for (row, &id) in x.chunks_exact_mut(n_embd).zip(ids) {
        if let Err(e) = ds4_kernels::dequantize_row(embd.fmt, embd.row(id as usize), row) {
            panic!("embedding rows are validated at load: {e}");
        }
    }
}

/// For every sequence: stores its rows of `k`/`v` into layer `il` of its state
/// (at its positions), then runs its queries over the layer. `q`, `k`, `v` and
/// `att` hold all sequences' rows.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_layer(
    pool: &ThreadPool,
    seqs: &mut [SeqStep<'_>],
    il: usize,
    (n_head, n_head_kv, head_dim): (usize, usize, usize),
    scale: f32,
    q: &[f32],
    (k, v): (&[f32], &[f32]),
    att: &mut [f32],
) {
    let (n_q, n_kv) = (n_head * head_dim, n_head_kv * head_dim);
    let mut row = 0;
    for s in seqs.iter_mut() {
        let n = s.tokens.len();
        let state = state_of::<KvState>(&mut *s.state);
        let pos0 = state.len();
        let (rows, layout) = state.layer(il, scale);
        let rs = row..row + n;
        let (q, k, v) = (
            &q[rs.start * n_q..rs.end * n_q],
            &k[rs.start * n_kv..rs.end * n_kv],
            &v[rs.start * n_kv..rs.end * n_kv],
        );
        let att = &mut att[rs.start * n_q..rs.end * n_q];
        fn go<T: AsF32Rows>(
            pool: &ThreadPool,
            (kr, vr): (&mut [T], &mut [T]),
            layout: crate::ops::AttnLayout,
            (n_head, n_head_kv, head_dim): (usize, usize, usize),
            pos0: usize,
            (q, k, v): (&[f32], &[f32], &[f32]),
            att: &mut [f32],
        ) {
            crate::state::store_rows((kr, vr), &layout, (n_head_kv, head_dim), pos0, k, v);
            attention(
                pool, q, kr, vr, layout, n_head, n_head_kv, head_dim, pos0, att,
            );
        }
        let shape = (n_head, n_head_kv, head_dim);
        match rows {
            LayerRows::F32(kr, vr) => go(pool, (kr, vr), layout, shape, pos0, (q, k, v), att),
            LayerRows::F16(kr, vr) => go(pool, (kr, vr), layout, shape, pos0, (q, k, v), att),
        }
        row += n;
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
pub(crate) fn output_head(
    pool: &ThreadPool,
    precision: Precision,
    r: &mut Rows,
    seqs: &mut [SeqStep<'_>],
    (norm, eps): (&[f32], f32),
    output: &WeightMatrix<'_>,
) {
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
