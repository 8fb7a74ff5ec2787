//! K/V rows per layer: the state of the attention families (llama, gemma3).
//!
//! Each layer stores K and V as `[n_head_kv][rows][head_dim]` (f32, or f16 bits
//! rounded to nearest even), position `p` at row `p % rows`, so one head's
//! history is contiguous for attention. A dense layer has a row for every
//! position of the context. A sliding-window layer whose window is smaller than
//! the context keeps a ring of `window + max_step` rows (rounded up to whole
//! attention tiles): the last `window` positions every query of a forward call
//! reads, plus the rows the same call writes before its earliest query has read
//! what they replace. So a 32k context costs the window's memory, not the
//! context's, on those layers.
//!
//! Each layer remembers the oldest position it still holds (`first`): 0 for a
//! dense layer, `end - rows` after the ring has passed `end`. The state can be
//! cut back to `n` tokens only while every sliding-window layer still holds the
//! `window - 1` positions before `n` that the next token reads.
//!
//! Payload (after the session's header, tokens and logits), little endian:
//!
//! | field | type |
//! | --- | --- |
//! | state kind | u32 = 1 (K/V rows) |
//! | K/V element type | u32 (0 = f32, 1 = f16) |
//! | layers L | u32 |
//! | per layer: kv heads, head dim, window (0 = none), first position held | u32 × 4 |
//! | per layer: K then V, per kv head, positions `first..len` in order | f32 or f16 |

use std::any::Any;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};

use ds4_kernels::attn::AsF32Rows;
use ds4_kernels::huge::HugeBuf;

use super::{Codec, CodecMut, SeqState, StatePart};
use crate::error::{EngineError, Result};
use crate::kv_type::KvType;
use crate::ops::{AttnLayout, ATTN_TILE};
use crate::payload::{self, bad};

/// The state kind a K/V payload records.
const KIND_KV: u32 = 1;

/// The shape of one layer's K/V, as a family asks for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KvLayerSpec {
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Sliding window: a query at `p` reads positions `p + 1 - window ..= p`.
    pub window: Option<usize>,
}

struct KvLayer {
    spec: KvLayerSpec,
    /// Rows per kv head.
    rows: usize,
    /// Start of the layer in the K and V buffers.
    offset: usize,
    /// The oldest position still held.
    first: usize,
}

impl KvLayer {
    fn len_elems(&self) -> usize {
        self.spec.n_head_kv * self.rows * self.spec.head_dim
    }
}

/// K and V of every layer, back to back, in one element type; on huge pages
/// where large ([`HugeBuf`]): attention over a long context streams them.
pub(crate) enum KvBuf {
    F32 {
        k: HugeBuf<f32>,
        v: HugeBuf<f32>,
    },
    /// f16 bits.
    F16 {
        k: HugeBuf<u16>,
        v: HugeBuf<u16>,
    },
}

/// One layer's K and V rows, mutable, in their element type.
pub(crate) enum LayerRows<'a> {
    F32(&'a mut [f32], &'a mut [f32]),
    F16(&'a mut [u16], &'a mut [u16]),
}

/// One layer's K and V rows, read-only.
#[derive(Clone, Copy)]
pub(crate) enum LayerRowsRef<'a> {
    F32(&'a [f32], &'a [f32]),
    F16(&'a [u16], &'a [u16]),
}

/// A K/V element type: how to find its rows in a [`LayerRowsRef`].
pub(crate) trait KvRows: AsF32Rows + Sized {
    fn rows(r: LayerRowsRef<'_>) -> Option<(&[Self], &[Self])>;
}

impl KvRows for f32 {
    fn rows(r: LayerRowsRef<'_>) -> Option<(&[f32], &[f32])> {
        match r {
            LayerRowsRef::F32(k, v) => Some((k, v)),
            LayerRowsRef::F16(..) => None,
        }
    }
}

impl KvRows for u16 {
    fn rows(r: LayerRowsRef<'_>) -> Option<(&[u16], &[u16])> {
        match r {
            LayerRowsRef::F16(k, v) => Some((k, v)),
            LayerRowsRef::F32(..) => None,
        }
    }
}

/// Which rows a state holds, for comparing two states' rows once and
/// remembering it: `id` names the state for its life, `epoch` changes whenever
/// rows below its length may have changed (a cut, a reset, a load). Appending
/// writes only positions at or past the length, and so does dropping what the
/// last step appended past a kept length (`drop_appended`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct RowsKey {
    pub id: u64,
    pub epoch: u64,
}

static NEXT_STATE_ID: AtomicU64 = AtomicU64::new(0);

pub(crate) struct KvState {
    n_ctx: usize,
    max_step: usize,
    layers: Vec<KvLayer>,
    buf: KvBuf,
    len: usize,
    rows_key: RowsKey,
}

impl KvState {
    /// A state of `n_ctx` positions whose forward calls append at most
    /// `max_step` tokens.
    pub fn new(specs: &[KvLayerSpec], n_ctx: usize, max_step: usize, kv_type: KvType) -> Self {
        let n_ctx = n_ctx.max(1);
        let max_step = max_step.clamp(1, n_ctx);
        let mut offset = 0;
        let layers: Vec<KvLayer> = specs
            .iter()
            .map(|&spec| {
                let rows = match spec.window {
                    Some(w) => (w + max_step).next_multiple_of(ATTN_TILE).min(n_ctx),
                    None => n_ctx,
                };
                let l = KvLayer {
                    spec,
                    rows,
                    offset,
                    first: 0,
                };
                offset += l.len_elems();
                l
            })
            .collect();
        // Zeroed pages cost nothing until a row is written.
        let buf = match kv_type {
            KvType::F32 => KvBuf::F32 {
                k: HugeBuf::zeroed(offset),
                v: HugeBuf::zeroed(offset),
            },
            KvType::F16 => KvBuf::F16 {
                k: HugeBuf::zeroed(offset),
                v: HugeBuf::zeroed(offset),
            },
        };
        KvState {
            n_ctx,
            max_step,
            layers,
            buf,
            len: 0,
            rows_key: RowsKey {
                id: NEXT_STATE_ID.fetch_add(1, Ordering::Relaxed),
                epoch: 0,
            },
        }
    }

    /// How attention reads layer `il`.
    pub fn layout(&self, il: usize, scale: f32) -> AttnLayout {
        let l = &self.layers[il];
        AttnLayout {
            rows: l.rows,
            window: l.spec.window,
            scale,
        }
    }

    /// See [`RowsKey`].
    pub fn rows_key(&self) -> RowsKey {
        self.rows_key
    }

    /// Rows below the length may change: what was learned about them is stale.
    fn rows_changed(&mut self) {
        self.rows_key.epoch += 1;
    }

    /// Layer `il`'s rows, read-only (see [`layer`](Self::layer)).
    pub fn layer_ref(&self, il: usize) -> LayerRowsRef<'_> {
        let l = &self.layers[il];
        let range = l.offset..l.offset + l.len_elems();
        match &self.buf {
            KvBuf::F32 { k, v } => LayerRowsRef::F32(&k[range.clone()], &v[range]),
            KvBuf::F16 { k, v } => LayerRowsRef::F16(&k[range.clone()], &v[range]),
        }
    }

    /// Whether the layers of `self` and `other` have the same shapes and
    /// element type, and every dense layer (the ones attention may read from
    /// another state, see `attention_shared`) holds bitwise the same K and V
    /// rows at positions `from..to` (both states hold them).
    pub fn dense_rows_equal(&self, other: &KvState, from: usize, to: usize) -> bool {
        let same_shape = self.layers.len() == other.layers.len()
            && self.kv_type_of() == other.kv_type_of()
            && self
                .layers
                .iter()
                .zip(&other.layers)
                .all(|(a, b)| a.spec == b.spec && a.rows == b.rows && a.offset == b.offset);
        if !same_shape || to > self.len.min(other.len) {
            return false;
        }
        let same_bits =
            |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        let mut dense = self.layers.iter().filter(|l| l.spec.window.is_none());
        dense.all(|l| {
            (0..l.spec.n_head_kv).all(|h| {
                let [run, _] = Self::runs(l, h, from, to);
                match (&self.buf, &other.buf) {
                    // Bits, not values: -0.0 == 0.0 and NaN != NaN.
                    (KvBuf::F32 { k, v }, KvBuf::F32 { k: k2, v: v2 }) => {
                        same_bits(&k[run.clone()], &k2[run.clone()])
                            && same_bits(&v[run.clone()], &v2[run])
                    }
                    (KvBuf::F16 { k, v }, KvBuf::F16 { k: k2, v: v2 }) => {
                        k[run.clone()] == k2[run.clone()] && v[run.clone()] == v2[run]
                    }
                    _ => false,
                }
            })
        })
    }

    /// Layer `il`'s rows and how attention reads them (its scale is the family's).
    pub fn layer(&mut self, il: usize, scale: f32) -> (LayerRows<'_>, AttnLayout) {
        let layout = self.layout(il, scale);
        let l = &self.layers[il];
        let range = l.offset..l.offset + l.len_elems();
        let rows = match &mut self.buf {
            KvBuf::F32 { k, v } => LayerRows::F32(&mut k[range.clone()], &mut v[range]),
            KvBuf::F16 { k, v } => LayerRows::F16(&mut k[range.clone()], &mut v[range]),
        };
        (rows, layout)
    }

    /// Records that positions `len..len + n` were written to every layer.
    pub fn advance(&mut self, n: usize) {
        self.len += n;
        for l in &mut self.layers {
            l.first = l.first.max(self.len.saturating_sub(l.rows));
        }
    }

    /// The element ranges of positions `from..to` of kv head `h` of layer `l`
    /// (at most `rows` positions): one run, or two where the ring wraps.
    fn runs(l: &KvLayer, h: usize, from: usize, to: usize) -> [std::ops::Range<usize>; 2] {
        let hd = l.spec.head_dim;
        let head = l.offset + h * l.rows * hd;
        let (a, b) = (from % l.rows, from % l.rows + (to - from));
        if b <= l.rows {
            [head + a * hd..head + b * hd, head..head]
        } else {
            [
                head + a * hd..head + l.rows * hd,
                head..head + (b - l.rows) * hd,
            ]
        }
    }

    fn element_bytes(&self) -> u64 {
        match self.buf {
            KvBuf::F32 { .. } => 4,
            KvBuf::F16 { .. } => 2,
        }
    }

    fn kv_type_of(&self) -> KvType {
        match self.buf {
            KvBuf::F32 { .. } => KvType::F32,
            KvBuf::F16 { .. } => KvType::F16,
        }
    }

    /// Writes the rows of positions `first..len` of every layer (K then V,
    /// per kv head).
    fn write_rows(&self, w: &mut dyn Write) -> Result<()> {
        for l in &self.layers {
            for is_v in [false, true] {
                for h in 0..l.spec.n_head_kv {
                    for run in Self::runs(l, h, l.first, self.len) {
                        match &self.buf {
                            KvBuf::F32 { k, v } => {
                                payload::write_pod(w, if is_v { &v[run] } else { &k[run] })?
                            }
                            KvBuf::F16 { k, v } => {
                                payload::write_pod(w, if is_v { &v[run] } else { &k[run] })?
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Reads what [`write_rows`](Self::write_rows) wrote, skipping the first
    /// `skip[il]` positions of each head of layer `il` (rows this state cannot
    /// hold).
    fn read_rows(&mut self, r: &mut dyn Read, skip: &[usize]) -> Result<()> {
        self.rows_changed();
        let elem = self.element_bytes();
        for (il, &skip) in skip.iter().enumerate() {
            let l = &self.layers[il];
            let skip_bytes = (skip * l.spec.head_dim) as u64 * elem;
            for is_v in [false, true] {
                for h in 0..l.spec.n_head_kv {
                    payload::skip(r, skip_bytes, "K/V rows")?;
                    for run in Self::runs(l, h, l.first, self.len) {
                        match &mut self.buf {
                            KvBuf::F32 { k, v } => payload::read_pod(
                                r,
                                if is_v { &mut v[run] } else { &mut k[run] },
                                "K/V rows",
                            )?,
                            KvBuf::F16 { k, v } => payload::read_pod(
                                r,
                                if is_v { &mut v[run] } else { &mut k[run] },
                                "K/V rows",
                            )?,
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Takes a payload's rows for `len` tokens whose layer `il` holds positions
    /// from `stored_first[il]`: checks each layer can continue from them, keeps
    /// what its rows can hold, reads them. On error the state is empty.
    fn load(&mut self, len: usize, stored_first: &[usize], r: &mut dyn Read) -> Result<()> {
        let result = self.load_inner(len, stored_first, r);
        if result.is_err() {
            self.reset();
        }
        result
    }

    fn load_inner(&mut self, len: usize, stored_first: &[usize], r: &mut dyn Read) -> Result<()> {
        self.reset();
        if len == 0 || len > self.n_ctx {
            return Err(bad(format!(
                "{len} tokens do not fit this session's context of {}",
                self.n_ctx
            )));
        }
        let mut skip = Vec::with_capacity(self.layers.len());
        for (il, (l, &first)) in self.layers.iter_mut().zip(stored_first).enumerate() {
            let needed = match l.spec.window {
                Some(w) => (len + 1).saturating_sub(w),
                None => 0,
            };
            if first > needed {
                return Err(bad(format!(
                    "layer {il} holds positions from {first}, but continuing after {len} \
                     tokens reads from {needed}"
                )));
            }
            l.first = first.max(len.saturating_sub(l.rows));
            skip.push(l.first - first);
        }
        self.len = len;
        self.read_rows(r, &skip)
    }
}

impl SeqState for KvState {
    fn len(&self) -> usize {
        self.len
    }

    fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    fn max_step(&self) -> usize {
        self.max_step
    }

    fn kv_type(&self) -> KvType {
        self.kv_type_of()
    }

    fn can_cut_to(&self, n: usize) -> bool {
        n <= self.len
            && self.layers.iter().all(|l| match l.spec.window {
                Some(w) => l.first <= (n + 1).saturating_sub(w),
                None => true,
            })
    }

    fn could_cut_loaded(&self, len: usize, n: usize) -> bool {
        // A loaded ring holds at most its own rows: its oldest position is at
        // least `len - rows`.
        n <= len
            && self.layers.iter().all(|l| match l.spec.window {
                Some(w) => len.saturating_sub(l.rows) <= (n + 1).saturating_sub(w),
                None => true,
            })
    }

    fn cut_to(&mut self, n: usize) {
        debug_assert!(self.can_cut_to(n));
        self.rows_changed();
        self.len = n;
    }

    fn drop_appended(&mut self, n: usize) {
        // No new epoch: the rows below `n` are unchanged, and a comparison
        // only ever covers positions whose tokens both states share, whose
        // rows (rewritten from `n` on) are a function of those tokens.
        debug_assert!(self.can_cut_to(n));
        self.len = n;
    }

    fn reset(&mut self) {
        self.rows_changed();
        self.len = 0;
        self.layers.iter_mut().for_each(|l| l.first = 0);
    }

    fn codec(&self) -> Codec<'_> {
        Codec::Container(self)
    }

    fn codec_mut(&mut self) -> CodecMut<'_> {
        CodecMut::Container(self)
    }

    fn memory_bytes(&self) -> u64 {
        let elems: usize = self.layers.iter().map(KvLayer::len_elems).sum();
        2 * elems as u64 * self.element_bytes()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl StatePart for KvState {
    fn payload_bytes(&self) -> u64 {
        let elem = self.element_bytes();
        let rows: u64 = self
            .layers
            .iter()
            .map(|l| 2 * (l.spec.n_head_kv * (self.len - l.first) * l.spec.head_dim) as u64)
            .sum();
        4 * (3 + 4 * self.layers.len() as u64) + elem * rows
    }

    fn write(&self, w: &mut dyn Write) -> Result<()> {
        let mut words = vec![KIND_KV, self.kv_type_of().code(), self.layers.len() as u32];
        for l in &self.layers {
            words.extend([
                l.spec.n_head_kv as u32,
                l.spec.head_dim as u32,
                l.spec.window.unwrap_or(0) as u32,
                l.first as u32,
            ]);
        }
        payload::write_pod(w, &words)?;
        self.write_rows(w)
    }

    fn read(&mut self, len: usize, r: &mut dyn Read) -> Result<()> {
        let mut head = [0u32; 3];
        if let Err(e) = payload::read_pod(r, &mut head, "state descriptor") {
            self.reset();
            return Err(e);
        }
        let [kind, ty, n_layer] = head;
        let fail = |this: &mut Self, e: EngineError| {
            this.reset();
            Err(e)
        };
        if kind != KIND_KV {
            return fail(
                self,
                bad(format!(
                    "state kind {kind}, this family stores K/V rows ({KIND_KV})"
                )),
            );
        }
        match KvType::from_code(ty) {
            Some(t) if t == self.kv_type_of() => {}
            Some(t) => {
                return fail(
                    self,
                    EngineError::KvTypeMismatch {
                        payload: t,
                        session: self.kv_type_of(),
                    },
                )
            }
            None => {
                return fail(
                    self,
                    bad(format!(
                        "K/V element type {ty} (this build stores f32 = 0, f16 = 1)"
                    )),
                )
            }
        }
        if n_layer as usize != self.layers.len() {
            return fail(
                self,
                bad(format!(
                    "{n_layer} layers, the model has {}",
                    self.layers.len()
                )),
            );
        }
        let mut desc = vec![0u32; 4 * self.layers.len()];
        if let Err(e) = payload::read_pod(r, &mut desc, "state descriptor") {
            return fail(self, e);
        }
        let mut firsts = Vec::with_capacity(self.layers.len());
        for (il, (l, d)) in self.layers.iter().zip(desc.chunks_exact(4)).enumerate() {
            let found = KvLayerSpec {
                n_head_kv: d[0] as usize,
                head_dim: d[1] as usize,
                window: (d[2] != 0).then_some(d[2] as usize),
            };
            if found != l.spec {
                return fail(
                    self,
                    bad(format!(
                        "layer {il} is {found:?} in the payload, {:?} in the model",
                        l.spec
                    )),
                );
            }
            firsts.push(d[3] as usize);
        }
        self.load(len, &firsts, r)
    }

    fn read_v1(&mut self, len: usize, r: &mut dyn Read) -> Result<()> {
        if self.layers.iter().any(|l| l.spec.window.is_some()) {
            self.reset();
            return Err(bad(
                "a version-1 payload holds dense K/V; this model has sliding-window layers".into(),
            ));
        }
        let firsts = vec![0; self.layers.len()];
        self.load(len, &firsts, r)
    }
}

/// Stores the new K/V rows of positions `pos0..` (rows of `n_head_kv * head_dim`
/// per token in `k` and `v`) into one layer's rows, rounded to the element type.
pub(crate) fn store_rows<T: AsF32Rows>(
    (k_rows, v_rows): (&mut [T], &mut [T]),
    layout: &AttnLayout,
    (n_head_kv, head_dim): (usize, usize),
    pos0: usize,
    k: &[f32],
    v: &[f32],
) {
    let n_kv = n_head_kv * head_dim;
    for t in 0..k.len() / n_kv {
        let row = (pos0 + t) % layout.rows;
        for h in 0..n_head_kv {
            let dst = (h * layout.rows + row) * head_dim;
            let src = t * n_kv + h * head_dim;
            T::narrow_slice(&k[src..src + head_dim], &mut k_rows[dst..dst + head_dim]);
            T::narrow_slice(&v[src..src + head_dim], &mut v_rows[dst..dst + head_dim]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Appends `n` positions whose K and V rows are `value`.
    fn append(s: &mut KvState, n: usize, value: f32) {
        for il in 0..s.layers.len() {
            let pos0 = s.len;
            let spec = s.layers[il].spec;
            let (rows, layout) = s.layer(il, 1.0);
            let x = vec![value; n * spec.n_head_kv * spec.head_dim];
            let shape = (spec.n_head_kv, spec.head_dim);
            match rows {
                LayerRows::F32(k, v) => store_rows((k, v), &layout, shape, pos0, &x, &x),
                LayerRows::F16(k, v) => store_rows((k, v), &layout, shape, pos0, &x, &x),
            }
        }
        s.advance(n);
    }

    /// What the batch relies on to read one state's rows for another: the
    /// key's epoch moves whenever rows below the length may change (a cut, a
    /// reset, a load) and not when rows are appended; rows compare by their
    /// bits on dense layers only, and states of other shapes never compare equal.
    #[test]
    fn rows_key_and_row_comparison() {
        let specs = [
            KvLayerSpec {
                n_head_kv: 2,
                head_dim: 4,
                window: None,
            },
            KvLayerSpec {
                n_head_kv: 1,
                head_dim: 4,
                window: Some(8),
            },
        ];
        let new = |ty| KvState::new(&specs, 64, 4, ty);
        let (mut a, mut b) = (new(KvType::F32), new(KvType::F32));
        assert_ne!(a.rows_key().id, b.rows_key().id);
        append(&mut a, 20, 1.0);
        append(&mut b, 20, 1.0);
        let key = a.rows_key();
        append(&mut a, 3, 2.0);
        assert_eq!(a.rows_key(), key, "appending keeps the key");
        assert!(a.dense_rows_equal(&b, 0, 20));
        assert!(!a.dense_rows_equal(&b, 0, 21), "past b's length");
        append(&mut b, 3, -2.0);
        assert!(!a.dense_rows_equal(&b, 16, 23));
        assert!(a.dense_rows_equal(&b, 0, 20));
        a.cut_to(10);
        assert_ne!(a.rows_key(), key, "a cut moves the epoch");
        let key = a.rows_key();
        let mut bytes = Vec::new();
        b.write(&mut bytes).unwrap();
        a.read(b.len(), &mut bytes.as_slice()).unwrap();
        assert_ne!(a.rows_key(), key, "a load moves the epoch");
        assert!(a.dense_rows_equal(&b, 0, 23));
        let key = a.rows_key();
        a.reset();
        assert_ne!(a.rows_key(), key, "a reset moves the epoch");
        // -0.0 and 0.0 are equal values but not equal rows.
        let (mut c, mut d) = (new(KvType::F32), new(KvType::F32));
        append(&mut c, 4, 0.0);
        append(&mut d, 4, -0.0);
        assert!(!c.dense_rows_equal(&d, 0, 4));
        let mut e = new(KvType::F16);
        append(&mut e, 4, 0.0);
        assert!(!c.dense_rows_equal(&e, 0, 4), "another element type");
    }
}
