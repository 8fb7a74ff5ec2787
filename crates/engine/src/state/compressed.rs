//! DeepSeek V4's per-sequence state (`deepseek4` family): per layer a ring of
//! the last raw K/V rows (one 512-wide row is both key and value), and on the
//! compressed layers the rows a compressor emits once per window of 4 or 128
//! positions, the indexer's rows (ratio-4 layers) and both compressors'
//! unfinished windows (the frontier). So a long context costs its raw window
//! plus a quarter (or 1/128) of its rows, not a row per position.
//!
//! - Raw ring: position `p` at row `p % raw_rows`; `raw_rows` is the window
//!   (128) plus one forward call's tokens, so every query of a call finds the
//!   window it reads even after later tokens of the same call were stored.
//! - Compressed rows, indexer rows: append-only, row `i` pools window `i`
//!   (`comp_cap = n_ctx / ratio + 2` rows allocated, zero pages until used).
//! - Frontier (`kv`, `score`): ratio 4 has `8 x 1024` floats each (rows 0..4:
//!   the previous complete window's lane, rows 4..8: the current window's
//!   positions), ratio 128 has `128 x 512`; the indexer's ratio-4 frontier is
//!   `8 x 256`. Empty score slots hold `-1e30`.
//!
//! Cutting back ([`SeqState::can_cut_to`]) works only within the current
//! compression window (a cut before the last window boundary would have to
//! take back emitted rows and rebuild the frontier) and while the ring still
//! holds the window before the cut.
//!
//! Payload ([`OwnPayload`]): the original engine's "DSV4" version 1, little
//! endian, as `shared/tools/parse_session.py` reads it: 13 u32 (magic
//! `0x34565344`, version 1, context, prefill cap `min(ctx, 2048)`, raw cap and
//! raw window `min(128, ctx)`, the ratio-4 layers' `comp_cap`, token count,
//! layers, head dim, indexer head dim, vocabulary, raw rows written
//! `min(128, tokens)`), the tokens, the last logits, per layer the compressed
//! and indexer row counts, then per layer the raw rows (oldest first), the
//! compressed rows and attention frontier (kv then score), the indexer rows
//! and indexer frontier. Frontier rows past the current window's positions
//! are written as the reference's prefill leaves them (kv 0, score `-1e30`),
//! so equal states give equal bytes whichever way they were computed. A load
//! checks every header field (the prefill cap is the writer's chunking and is
//! not checked), that each row count is the one its token count implies and
//! that the payload ends where the layout says.

use std::any::Any;
use std::io::{Read, Write};

use super::{Codec, CodecMut, OwnPayload, SeqState};
use crate::error::{EngineError, Result};
use crate::kv_type::KvType;
use crate::payload::{self, bad};

/// `0x34565344`, "DSV4" in little-endian bytes.
const DSV4_MAGIC: u32 = 0x3456_5344;
const DSV4_VERSION: u32 = 1;
const DSV4_HEADER_WORDS: usize = 13;
/// What the reference records as its prefill chunk: `min(ctx, 2048)`.
const DSV4_PREFILL_CAP: usize = 2048;
/// The reference's "minus infinity" for empty score slots.
pub(crate) const NEG_INF: f32 = -1.0e30;

/// The layout a family asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CompressedSpec {
    /// Per layer: 0 (raw window only), 4 or 128.
    pub ratios: Vec<usize>,
    /// Width of a K/V row (512).
    pub head_dim: usize,
    /// Width of an indexer row (128).
    pub index_dim: usize,
    /// Raw rows a query reads, its own included (128).
    pub window: usize,
}

impl CompressedSpec {
    /// Rows (`coff · ratio`) and width (`coff · dim`) of a frontier of `dim`-wide rows.
    pub fn frontier_shape(ratio: usize, dim: usize) -> (usize, usize) {
        let coff = if ratio == 4 { 2 } else { 1 };
        (coff * ratio, coff * dim)
    }
}

/// One layer's state.
pub(crate) struct CompLayer {
    pub ratio: usize,
    /// `raw_rows x head_dim`, position `p` at row `p % raw_rows`.
    pub raw: Vec<f32>,
    /// Compressed rows, `comp_cap x head_dim`.
    pub comp: Vec<f32>,
    pub n_comp: usize,
    /// The attention compressor's frontier.
    pub kv: Vec<f32>,
    pub score: Vec<f32>,
    /// Indexer rows, `comp_cap x index_dim` (ratio 4).
    pub index: Vec<f32>,
    pub n_index: usize,
    /// The indexer compressor's frontier (ratio 4).
    pub index_kv: Vec<f32>,
    pub index_score: Vec<f32>,
}

pub(crate) struct CompressedState {
    spec: CompressedSpec,
    n_ctx: usize,
    max_step: usize,
    /// Rows of each raw ring.
    raw_rows: usize,
    /// Compressed rows allocated per layer of each ratio: `n_ctx / ratio + 2`.
    layers: Vec<CompLayer>,
    len: usize,
    /// Logits the payload carries (the model's vocabulary).
    n_vocab: usize,
}

impl CompressedState {
    /// A state of `n_ctx` positions whose forward calls append at most
    /// `max_step` tokens, for a model of `n_vocab` tokens.
    pub fn new(spec: &CompressedSpec, n_ctx: usize, max_step: usize, n_vocab: usize) -> Self {
        let n_ctx = n_ctx.max(1);
        let max_step = max_step.clamp(1, n_ctx);
        let raw_rows = (spec.window + max_step).min(n_ctx.max(spec.window));
        let layers = spec
            .ratios
            .iter()
            .map(|&ratio| {
                let cap = n_ctx.checked_div(ratio).map_or(0, |c| c + 2);
                let (fr, fw) = CompressedSpec::frontier_shape(ratio, spec.head_dim);
                let (ir, iw) = CompressedSpec::frontier_shape(ratio, spec.index_dim);
                let indexed = ratio == 4;
                CompLayer {
                    ratio,
                    raw: vec![0.0; raw_rows * spec.head_dim],
                    comp: vec![0.0; cap * spec.head_dim],
                    n_comp: 0,
                    kv: vec![0.0; if ratio == 0 { 0 } else { fr * fw }],
                    score: vec![NEG_INF; if ratio == 0 { 0 } else { fr * fw }],
                    index: vec![0.0; if indexed { cap * spec.index_dim } else { 0 }],
                    n_index: 0,
                    index_kv: vec![0.0; if indexed { ir * iw } else { 0 }],
                    index_score: vec![NEG_INF; if indexed { ir * iw } else { 0 }],
                }
            })
            .collect();
        CompressedState {
            spec: spec.clone(),
            n_ctx,
            max_step,
            raw_rows,
            layers,
            len: 0,
            n_vocab,
        }
    }

    /// Rows of each raw ring.
    pub fn raw_rows(&self) -> usize {
        self.raw_rows
    }

    pub fn layer_mut(&mut self, il: usize) -> &mut CompLayer {
        &mut self.layers[il]
    }

    /// Records `n` new positions (after the forward pass stored their rows in every layer).
    pub fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// The smallest ratio of the compressed layers (their windows are nested).
    fn finest_ratio(&self) -> Option<usize> {
        self.layers
            .iter()
            .map(|l| l.ratio)
            .filter(|&r| r != 0)
            .min()
    }

    /// Raw rows the payload carries: `min(window, tokens)`.
    fn raw_live(&self, n_tokens: usize) -> usize {
        self.raw_window().min(n_tokens)
    }

    fn raw_window(&self) -> usize {
        self.spec.window.min(self.n_ctx)
    }

    /// The header words of a payload of `n_tokens` tokens.
    fn header(&self, n_tokens: usize) -> [u32; DSV4_HEADER_WORDS] {
        let comp_cap4 = self
            .layers
            .iter()
            .find(|l| l.ratio == 4)
            .map_or(0, |_| self.n_ctx / 4 + 2);
        [
            DSV4_MAGIC,
            DSV4_VERSION,
            self.n_ctx as u32,
            self.n_ctx.min(DSV4_PREFILL_CAP) as u32,
            self.raw_window() as u32,
            self.raw_window() as u32,
            comp_cap4 as u32,
            n_tokens as u32,
            self.layers.len() as u32,
            self.spec.head_dim as u32,
            self.spec.index_dim as u32,
            self.n_vocab as u32,
            self.raw_live(n_tokens) as u32,
        ]
    }

    /// The frontier as the payload holds it: rows past the current window's
    /// positions (`rem = len % ratio` of them are live) cleared to kv 0 and score `-1e30`.
    fn canonical_frontier(
        kv: &[f32],
        score: &[f32],
        ratio: usize,
        width: usize,
        len: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let rem = len % ratio;
        let (clear_start, clear_end) = if ratio == 4 {
            (4 + rem, 8)
        } else {
            (rem, ratio)
        };
        let (mut kv, mut score) = (kv.to_vec(), score.to_vec());
        kv[clear_start * width..clear_end * width].fill(0.0);
        score[clear_start * width..clear_end * width].fill(NEG_INF);
        (kv, score)
    }

    fn load(&mut self, tokens: &mut Vec<u32>, logits: &mut [f32], r: &mut dyn Read) -> Result<()> {
        let mut h = [0u32; DSV4_HEADER_WORDS];
        payload::read_pod(r, &mut h, "DSV4 header")?;
        let [magic, version, ctx, _prefill_cap, raw_cap, raw_window, comp_cap4, n, n_layer, head_dim, index_dim, n_vocab, raw_live] =
            h.map(|x| x as usize);
        if magic as u32 != DSV4_MAGIC || version as u32 != DSV4_VERSION {
            return Err(bad(format!(
                "magic {magic:#x} version {version}: this state reads DSV4 version 1"
            )));
        }
        let mine = [
            self.layers.len(),
            self.spec.head_dim,
            self.spec.index_dim,
            self.n_vocab,
        ];
        if [n_layer, head_dim, index_dim, n_vocab] != mine || logits.len() != n_vocab {
            return Err(bad(format!(
                "shape (layers {n_layer}, head dim {head_dim}, indexer dim {index_dim}, vocabulary \
                 {n_vocab}) differs from the model's {mine:?}"
            )));
        }
        if ctx > self.n_ctx || n == 0 || n > self.n_ctx {
            return Err(bad(format!(
                "{n} tokens of a context of {ctx} do not fit this session's context of {}",
                self.n_ctx
            )));
        }
        let window = self.spec.window.min(ctx);
        let comp_cap_writer = self
            .layers
            .iter()
            .any(|l| l.ratio == 4)
            .then_some(ctx / 4 + 2);
        if raw_window != window
            || raw_cap < raw_window
            || raw_live != window.min(n)
            || comp_cap4 != comp_cap_writer.unwrap_or(0)
        {
            return Err(bad(format!(
                "raw window {raw_window}, raw cap {raw_cap}, raw rows {raw_live}, comp cap \
                 {comp_cap4}: not what a context of {ctx} with {n} tokens holds"
            )));
        }
        tokens.resize(n, 0);
        payload::read_u32s(r, tokens, "tokens")?;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(EngineError::TokenOutOfRange { id, n_vocab });
        }
        payload::read_f32s(r, logits, "logits")?;
        let mut counts = vec![0u32; 2 * n_layer];
        payload::read_u32s(r, &mut counts, "row counts")?;
        let (hd, id) = (self.spec.head_dim, self.spec.index_dim);
        for (il, l) in self.layers.iter().enumerate() {
            let want_comp = n.checked_div(l.ratio).unwrap_or(0);
            let want_index = if l.ratio == 4 { want_comp } else { 0 };
            if counts[il] as usize != want_comp || counts[n_layer + il] as usize != want_index {
                return Err(bad(format!(
                    "layer {il}: {} compressed and {} indexer rows, {n} tokens make {want_comp} and {want_index}",
                    counts[il],
                    counts[n_layer + il]
                )));
            }
        }
        let raw_rows = self.raw_rows;
        for l in &mut self.layers {
            for p in n - raw_live..n {
                let row = p % raw_rows;
                payload::read_f32s(r, &mut l.raw[row * hd..(row + 1) * hd], "raw rows")?;
            }
            if l.ratio == 0 {
                continue;
            }
            l.n_comp = n / l.ratio;
            payload::read_f32s(r, &mut l.comp[..l.n_comp * hd], "compressed rows")?;
            payload::read_f32s(r, &mut l.kv, "compressor state")?;
            payload::read_f32s(r, &mut l.score, "compressor state")?;
            if l.ratio == 4 {
                l.n_index = l.n_comp;
                payload::read_f32s(r, &mut l.index[..l.n_index * id], "indexer rows")?;
                payload::read_f32s(r, &mut l.index_kv, "indexer state")?;
                payload::read_f32s(r, &mut l.index_score, "indexer state")?;
            }
        }
        payload::expect_end(r)?;
        self.len = n;
        Ok(())
    }
}

impl SeqState for CompressedState {
    fn len(&self) -> usize {
        self.len
    }

    fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    fn max_step(&self) -> usize {
        self.max_step
    }

    /// The rows are f16-rounded values kept as f32, as the reference holds them;
    /// `--kv-type` does not apply.
    fn kv_type(&self) -> KvType {
        KvType::F32
    }

    fn can_cut_to(&self, n: usize) -> bool {
        self.could_cut_loaded(self.len, n)
    }

    /// Exact, not optimistic: whether `n` can be reached from `len` tokens
    /// depends only on the two lengths (the compressor frontier of the last
    /// window, the rows the raw ring still holds), the same for any state of
    /// this layout.
    fn could_cut_loaded(&self, len: usize, n: usize) -> bool {
        if n == len || n == 0 {
            return n <= len;
        }
        let in_window = self.finest_ratio().is_none_or(|r| n >= len / r * r);
        let first_held = len.saturating_sub(self.raw_rows);
        n < len && in_window && n.saturating_sub(self.spec.window - 1) >= first_held
    }

    fn cut_to(&mut self, n: usize) {
        debug_assert!(self.can_cut_to(n));
        self.len = n;
    }

    fn reset(&mut self) {
        self.len = 0;
        for l in &mut self.layers {
            l.n_comp = 0;
            l.n_index = 0;
            l.kv.fill(0.0);
            l.score.fill(NEG_INF);
            l.index_kv.fill(0.0);
            l.index_score.fill(NEG_INF);
        }
    }

    fn codec(&self) -> Codec<'_> {
        Codec::Own(self)
    }

    fn codec_mut(&mut self) -> CodecMut<'_> {
        CodecMut::Own(self)
    }

    fn memory_bytes(&self) -> u64 {
        let floats: usize = self
            .layers
            .iter()
            .map(|l| {
                l.raw.len()
                    + l.comp.len()
                    + l.kv.len()
                    + l.score.len()
                    + l.index.len()
                    + l.index_kv.len()
                    + l.index_score.len()
            })
            .sum();
        4 * floats as u64
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl OwnPayload for CompressedState {
    fn payload_bytes(&self, n_vocab: usize) -> u64 {
        let n = self.len;
        let (hd, id) = (self.spec.head_dim, self.spec.index_dim);
        let mut floats = n_vocab + self.layers.len() * self.raw_live(n) * hd;
        for l in &self.layers {
            if let Some(rows) = n.checked_div(l.ratio) {
                floats += rows * hd + l.kv.len() + l.score.len();
            }
            if l.ratio == 4 {
                floats += (n / 4) * id + l.index_kv.len() + l.index_score.len();
            }
        }
        4 * (DSV4_HEADER_WORDS + n + 2 * self.layers.len() + floats) as u64
    }

    fn write_payload(&self, tokens: &[u32], logits: &[f32], w: &mut dyn Write) -> Result<()> {
        let n = self.len;
        debug_assert_eq!(tokens.len(), n);
        payload::write_pod(w, &self.header(n))?;
        payload::write_u32s(w, tokens)?;
        payload::write_f32s(w, logits)?;
        let comps: Vec<u32> = self.layers.iter().map(|l| l.n_comp as u32).collect();
        let indexes: Vec<u32> = self.layers.iter().map(|l| l.n_index as u32).collect();
        payload::write_u32s(w, &comps)?;
        payload::write_u32s(w, &indexes)?;
        let (hd, id) = (self.spec.head_dim, self.spec.index_dim);
        for l in &self.layers {
            for p in n - self.raw_live(n)..n {
                let row = p % self.raw_rows;
                payload::write_f32s(w, &l.raw[row * hd..(row + 1) * hd])?;
            }
            if l.ratio == 0 {
                continue;
            }
            payload::write_f32s(w, &l.comp[..l.n_comp * hd])?;
            let width = CompressedSpec::frontier_shape(l.ratio, hd).1;
            let (kv, score) = Self::canonical_frontier(&l.kv, &l.score, l.ratio, width, n);
            payload::write_f32s(w, &kv)?;
            payload::write_f32s(w, &score)?;
            if l.ratio == 4 {
                payload::write_f32s(w, &l.index[..l.n_index * id])?;
                let width = CompressedSpec::frontier_shape(4, id).1;
                let (kv, score) =
                    Self::canonical_frontier(&l.index_kv, &l.index_score, 4, width, n);
                payload::write_f32s(w, &kv)?;
                payload::write_f32s(w, &score)?;
            }
        }
        Ok(())
    }

    fn read_payload(
        &mut self,
        tokens: &mut Vec<u32>,
        logits: &mut [f32],
        r: &mut dyn Read,
    ) -> Result<()> {
        self.reset();
        let result = self.load(tokens, logits, r);
        if result.is_err() {
            self.reset();
            tokens.clear();
        }
        result
    }
}
