//! 16-bit activations: the fast path's order ("F2") for Q4_1 and Q8_0 weights,
//! the formats of the default model, for Q5_0 weights, and for Q4_K and Q6_K
//! weights resolved at load into blocks of 32 with f32 scales ([`SubQ4K`],
//! [`SubQ6K`]).
//!
//! Each activation row is rounded per block of 32 to 16-bit integers, `x ≈ s·q`
//! with `s = amax / 32767`: an error of at most 1/65534 of the block's largest
//! magnitude, finer than an f16's rounding for all but the block's smallest
//! values (8-bit activations, what llama.cpp uses, are 258 times coarser). That
//! turns the dot product with a 4- or 8-bit weight block into integer
//! multiply-adds (`vpmaddwd`), about a third of the instructions of decoding the
//! weights to f32 (order F1 of [`crate::fast`]), which is what bounds decode on
//! AVX2.
//!
//! The order, for one weight row against one activation row, block `b` holding
//! weight quants `w[j]` (Q4_1 and Q4_K nibbles 0..=15, Q8_0 bytes, Q5_0's
//! `q - 16`, Q6_K's `q - 32`) and activation quants `x[j]`, `j` in `0..32`:
//! 1. Eight exact integer lane sums: lane `l` is `Σ w[j]·x[j]` over
//!    `j` in `4l..4l+4` (the pairs `vpmaddwd` forms over the block's even and
//!    odd elements, then added).
//! 2. `c = d_b·s_b` (one rounding), then `acc[l] = fma(lane l as f32, c, acc[l])`
//!    for the blocks in order. Each lane sum is exact in f32 (|sum| <= 2^24).
//!    Q6_K's blocks hold two sub-blocks of 16 with a scale each: lanes 0..4
//!    take `c = d_b·s_b`, lanes 4..8 `c = d2_b·s_b`.
//! 3. Q4_1 and Q4_K only (`w = d·q + m`): `macc[b % 8] = fma(m_b, σ_b, macc[b % 8])` with
//!    `σ_b = s_b·Σx[j]` (formed when the activations are quantized), the blocks
//!    padded to a multiple of eight with `m = σ = 0`; then `acc[l] += macc[l]`.
//! 4. The lane reduction of [`crate::f32`] (`reduce_lanes`).
//!
//! A block holding an infinity or NaN gets `s = NaN`, so the result is NaN as it
//! would be in f32; its quants are unspecified. The batched product applies the
//! same order to every (row, token) pair, so a batch gives bit for bit what the
//! tokens one at a time give. The AVX2 and AVX-512 versions (`x86/avx2.rs`,
//! `x86/avx512/act16.rs`) are tested equal to these references bit for bit
//! (`tier_parity.rs`).

use crate::f16::fp16_to_fp32;
use crate::f32::reduce_lanes;
use crate::huge::HugeBuf;
use crate::q4_1::BlockQ4_1;
use crate::q5_0::BlockQ5_0;
use crate::q8_0::BlockQ8_0;

/// Elements per activation block.
pub const QK_ACT16: usize = 32;
/// The largest quant: `s = amax / ACT16_MAX`.
pub const ACT16_MAX: f32 = 32767.0;
const LANES: usize = 8;

/// Activation rows of `n` elements rounded to 16-bit blocks, as the fast path's
/// Q4_1 and Q8_0 products take them. Reuse one for every call: refilling does not
/// allocate once capacity suffices.
#[derive(Clone, Debug, Default)]
pub struct Act16 {
    n: usize,
    rows: usize,
    q: Vec<i16>,
    /// Per row [`stride`] values: the blocks' `s`, then zeros.
    scale: Vec<f32>,
    /// Per row [`stride`] values: the blocks' `σ = s·Σq`, then zeros.
    sum: Vec<f32>,
    /// Which fill this is: distinct for every fill in the process (0 before
    /// the first), so that a kernel may keep its own arrangement of these
    /// values across calls with the same activations ([`Self::fill_id`]).
    fill_id: u64,
}

/// Gives each fill of an [`Act16`] its id.
fn next_fill_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// One row of [`Act16`]: `q` holds `32·nb` quants; `scale` and `sum` hold the
/// `nb` blocks' values padded with zeros to a multiple of eight.
#[derive(Clone, Copy, Debug)]
pub struct Act16Row<'a> {
    pub(crate) q: &'a [i16],
    pub(crate) scale: &'a [f32],
    pub(crate) sum: &'a [f32],
}

/// Scales and sums kept per activation row of `n` elements: one per block, padded
/// to whole chunks of eight so that kernels load them eight at a time.
fn stride(n: usize) -> usize {
    (n / QK_ACT16).next_multiple_of(LANES)
}

impl Act16 {
    /// Rounds `x`, holding `x.len() / n` rows of `n` elements.
    ///
    /// # Panics
    /// If `n` is 0 or not a multiple of [`QK_ACT16`], or `x` is not whole rows:
    /// model shapes are validated at load, so this is a caller's bug.
    pub fn quantize(&mut self, x: &[f32], n: usize) {
        assert!(
            n > 0 && n.is_multiple_of(QK_ACT16) && x.len().is_multiple_of(n),
            "act16: {} values in rows of {n}",
            x.len()
        );
        let (rows, nb, stride) = (x.len() / n, n / QK_ACT16, stride(n));
        self.q.resize(x.len(), 0);
        for v in [&mut self.scale, &mut self.sum] {
            v.clear();
            v.resize(rows * stride, 0.0);
        }
        for (((xr, qr), sr), gr) in x
            .chunks_exact(n)
            .zip(self.q.chunks_exact_mut(n))
            .zip(self.scale.chunks_exact_mut(stride))
            .zip(self.sum.chunks_exact_mut(stride))
        {
            quantize_row(xr, qr, &mut sr[..nb], &mut gr[..nb]);
        }
        (self.n, self.rows, self.fill_id) = (n, rows, next_fill_id());
    }

    /// Row length in elements (0 before the first fill).
    pub fn n(&self) -> usize {
        self.n
    }

    /// The id of the current fill: two `Act16` with the same id hold the same
    /// values (one was cloned from the other after that fill).
    pub(crate) fn fill_id(&self) -> u64 {
        self.fill_id
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Row `t`.
    ///
    /// # Panics
    /// If `t >= self.rows()`.
    pub fn row(&self, t: usize) -> Act16Row<'_> {
        assert!(t < self.rows, "act16 row {t} of {}", self.rows);
        let stride = stride(self.n);
        Act16Row {
            q: &self.q[t * self.n..(t + 1) * self.n],
            scale: &self.scale[t * stride..(t + 1) * stride],
            sum: &self.sum[t * stride..(t + 1) * stride],
        }
    }
}

#[cfg(test)]
impl Act16 {
    /// Rows of `n` elements holding the given stored quants and each block's
    /// scale and sum (`q.len() / 32` of each, unpadded).
    pub(crate) fn from_parts(n: usize, q: Vec<i16>, scale: &[f32], sum: &[f32]) -> Self {
        let (rows, nb, stride) = (q.len() / n, n / QK_ACT16, stride(n));
        let pad = |v: &[f32]| {
            let mut out = vec![0.0; rows * stride];
            for (o, v) in out.chunks_exact_mut(stride).zip(v.chunks_exact(nb)) {
                o[..nb].copy_from_slice(v);
            }
            out
        };
        Self {
            n,
            rows,
            scale: pad(scale),
            sum: pad(sum),
            q,
            fill_id: next_fill_id(),
        }
    }
}

/// Rounds whole blocks of `x` (see the module docs): `q` gets the quants,
/// `scale[b]` and `sum[b]` block `b`'s `s` and `σ`. Scalar reference.
///
/// # Panics
/// If `x` is not whole blocks or the outputs do not match it.
pub fn quantize_row_ref(x: &[f32], q: &mut [i16], scale: &mut [f32], sum: &mut [f32]) {
    check_quantize(x.len(), q.len(), scale.len(), sum.len());
    for (((xb, qb), s), sigma) in x
        .chunks_exact(QK_ACT16)
        .zip(q.chunks_exact_mut(QK_ACT16))
        .zip(scale)
        .zip(sum)
    {
        // `max` skips NaN; the `v·0` terms turn any infinity or NaN into a NaN `s`
        // (and are +0 or -0 otherwise, which leave the +0 start at +0).
        let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let non_finite = xb.iter().fold(0.0f32, |a, v| a + v * 0.0);
        let inv = if amax > 0.0 { ACT16_MAX / amax } else { 0.0 };
        let mut total = 0i32;
        for (j, &v) in xb.iter().enumerate() {
            let qv = (v * inv).round_ties_even().clamp(-32768.0, 32767.0) as i16;
            qb[stored_index(j)] = qv;
            total += i32::from(qv);
        }
        *s = amax / ACT16_MAX + non_finite;
        *sigma = *s * total as f32;
    }
}

/// Where element `j` of a block is stored: the even elements, then the odd ones,
/// which is the order the AVX2 kernel widens weight quants in without crossing
/// 128-bit lanes.
pub(crate) fn stored_index(j: usize) -> usize {
    j / 2 + (j % 2) * (QK_ACT16 / 2)
}

/// [`quantize_row_ref`] by the selected tier.
pub fn quantize_row(x: &[f32], q: &mut [i16], scale: &mut [f32], sum: &mut [f32]) {
    (crate::kernels().quantize_act16)(x, q, scale, sum)
}

pub(crate) fn check_quantize(x: usize, q: usize, scale: usize, sum: usize) {
    assert!(
        x.is_multiple_of(QK_ACT16) && q == x && scale == x / QK_ACT16 && sum == scale,
        "act16 quantize: {x} values, {q} quants, {scale} scales, {sum} sums"
    );
}

/// Which block type an [`F2Matrix`] holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum F2Kind {
    Q4_1,
    Q8_0,
    Q5_0,
    /// [`SubQ4K`], from Q4_K.
    Q4K,
    /// [`SubQ6K`], from Q6_K.
    Q6K,
}

/// A weight block order F2 runs: its 32 quants in element order, its scale per
/// lane, `m` for formats with a minimum, and how [`F2Matrix`] stores it. The
/// GGUF blocks Q4_1, Q8_0 and Q5_0 as they are; Q4_K and Q6_K as [`SubQ4K`] and
/// [`SubQ6K`], their sub-blocks of 32 with the scales resolved to f32.
pub trait F2Block: bytemuck::Pod + sealed::Sealed {
    /// The matrix kind of these blocks.
    const KIND: F2Kind;
    /// Whether the block has a minimum (`m`).
    const HAS_MIN: bool;
    /// Whether the block has two scales, `d` for lanes 0..4 (elements 0..16)
    /// and `d2` for lanes 4..8 (Q6_K's sub-blocks of 16).
    const SPLIT: bool = false;
    /// Whether the heads are stored as f32 (else f16).
    const HEAD_F32: bool = false;
    /// Bytes of quants per block in [`F2Matrix`] (as in the block itself).
    const QUANT_BYTES: usize;
    /// Heads per block: `d`, then `m` or `d2`.
    const HEADS: usize = if Self::HAS_MIN || Self::SPLIT { 2 } else { 1 };
    /// Bytes per head.
    const HEAD_SIZE: usize = if Self::HEAD_F32 { 4 } else { 2 };
    /// Bytes of heads per chunk of eight blocks in [`F2Matrix`]: eight `d`s,
    /// then eight of the second head.
    const HEAD_BYTES: usize = Self::HEADS * CHUNK * Self::HEAD_SIZE;
    /// Bytes of a whole chunk (heads and eight blocks' quants) in [`F2Matrix`].
    const CHUNK_BYTES: usize = Self::HEAD_BYTES + CHUNK * Self::QUANT_BYTES;
    /// Bits of a quant in a unit's word of [`F2Layout::Pairs`]; 0 for blocks
    /// never laid out in pairs.
    const PAIR_BITS: usize = 0;
    /// Blocks a unit of [`F2Layout::Pairs`] holds (in its 64 bytes of words).
    const PAIR_UNIT: usize = if Self::PAIR_BITS == 0 {
        1
    } else {
        16 / (2 * Self::PAIR_BITS)
    };
    /// Whether a unit of [`F2Layout::Pairs`] follows its words with four
    /// 32-bit masks of fifth bits (Q5_0).
    const PAIR_FIFTH: bool = false;
    /// Bytes of a unit of [`F2Layout::Pairs`].
    const PAIR_UNIT_BYTES: usize = if Self::PAIR_FIFTH { 80 } else { 64 };
    #[doc(hidden)]
    fn quants(&self) -> [i32; QK_ACT16];
    /// The scale of lane `l` (the same for all lanes but in a split block).
    #[doc(hidden)]
    fn scale(&self, lane: usize) -> f32;
    #[doc(hidden)]
    fn min(&self) -> f32;
    /// Head `k` (`k < HEADS`) as stored: its first [`Self::HEAD_SIZE`] bytes.
    #[doc(hidden)]
    fn head(&self, k: usize) -> [u8; 4];
    /// The stored quant bytes.
    #[doc(hidden)]
    fn quant_bytes(&self) -> &[u8];
    /// The block from its stored parts (`qs` of [`Self::QUANT_BYTES`]).
    #[doc(hidden)]
    fn from_parts(heads: [[u8; 4]; 2], qs: &[u8]) -> Self;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for crate::q4_1::BlockQ4_1 {}
    impl Sealed for crate::q8_0::BlockQ8_0 {}
    impl Sealed for crate::q5_0::BlockQ5_0 {}
    impl Sealed for super::SubQ4K {}
    impl Sealed for super::SubQ6K {}
}

/// An f16 head in [`F2Block::head`]'s form.
fn f16_head(h: [u8; 2]) -> [u8; 4] {
    [h[0], h[1], 0, 0]
}

impl F2Block for BlockQ4_1 {
    const KIND: F2Kind = F2Kind::Q4_1;
    const HAS_MIN: bool = true;
    const PAIR_BITS: usize = 4;
    const QUANT_BYTES: usize = 16;
    fn quants(&self) -> [i32; QK_ACT16] {
        nibble_quants(&self.qs)
    }
    fn scale(&self, _lane: usize) -> f32 {
        fp16_to_fp32(self.d)
    }
    fn min(&self) -> f32 {
        fp16_to_fp32(self.m)
    }
    fn head(&self, k: usize) -> [u8; 4] {
        f16_head(if k == 0 { self.d } else { self.m })
    }
    fn quant_bytes(&self) -> &[u8] {
        &self.qs
    }
    fn from_parts(heads: [[u8; 4]; 2], qs: &[u8]) -> Self {
        let [d, m] = heads.map(|h| [h[0], h[1]]);
        let mut b = BlockQ4_1 { d, m, qs: [0; 16] };
        b.qs.copy_from_slice(qs);
        b
    }
}

impl F2Block for BlockQ8_0 {
    const KIND: F2Kind = F2Kind::Q8_0;
    const HAS_MIN: bool = false;
    const PAIR_BITS: usize = 8;
    const QUANT_BYTES: usize = 32;
    fn quants(&self) -> [i32; QK_ACT16] {
        self.qs.map(i32::from)
    }
    fn scale(&self, _lane: usize) -> f32 {
        fp16_to_fp32(self.d)
    }
    fn min(&self) -> f32 {
        0.0
    }
    fn head(&self, _k: usize) -> [u8; 4] {
        f16_head(self.d)
    }
    fn quant_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.qs)
    }
    fn from_parts(heads: [[u8; 4]; 2], qs: &[u8]) -> Self {
        let mut b = BlockQ8_0 {
            d: [heads[0][0], heads[0][1]],
            qs: [0; 32],
        };
        b.qs.copy_from_slice(bytemuck::cast_slice(qs));
        b
    }
}

/// Q5_0 as stored: the quants are its fifth bits `qh` then its nibbles `qs`
/// (20 bytes against the 34 of the Q8_0 block holding the same values; decode
/// reads the weights once per token, so the bytes are its time).
impl F2Block for BlockQ5_0 {
    const KIND: F2Kind = F2Kind::Q5_0;
    const HAS_MIN: bool = false;
    const PAIR_BITS: usize = 4;
    const PAIR_FIFTH: bool = true;
    const QUANT_BYTES: usize = 20;
    fn quants(&self) -> [i32; QK_ACT16] {
        let qh = u32::from_le_bytes(self.qh);
        let low = nibble_quants(&self.qs);
        std::array::from_fn(|j| (low[j] | (((qh >> j) & 1) << 4) as i32) - 16)
    }
    fn scale(&self, _lane: usize) -> f32 {
        fp16_to_fp32(self.d)
    }
    fn min(&self) -> f32 {
        0.0
    }
    fn head(&self, _k: usize) -> [u8; 4] {
        f16_head(self.d)
    }
    fn quant_bytes(&self) -> &[u8] {
        &bytemuck::bytes_of(self)[2..]
    }
    fn from_parts(heads: [[u8; 4]; 2], qs: &[u8]) -> Self {
        let mut b = BlockQ5_0 {
            d: [heads[0][0], heads[0][1]],
            qh: [0; 4],
            qs: [0; 16],
        };
        b.qh.copy_from_slice(&qs[..4]);
        b.qs.copy_from_slice(&qs[4..]);
        b
    }
}

/// Quants packed as Q4_1's: element `j < 16` in the low nibble of byte `j`,
/// element `16 + j` in its high nibble.
fn nibble_quants(qs: &[u8; 16]) -> [i32; QK_ACT16] {
    std::array::from_fn(|j| {
        let byte = qs[j % 16];
        i32::from(if j < 16 { byte & 0x0F } else { byte >> 4 })
    })
}

/// One Q4_K sub-block of 32 as order F2 runs it: `w = d·q + m` with `d` the
/// super-block's `d` times the sub-block's scale and `m` minus its `dmin`
/// times the sub-block's min, both exact in f32 (an f16 times a 6-bit
/// integer), the values the Q4_K dequantizer computes; the nibbles re-laid as
/// Q4_1's, so its kernels widen them alike.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SubQ4K {
    /// `d`, f32 little-endian.
    pub d: [u8; 4],
    /// `m`, f32 little-endian.
    pub m: [u8; 4],
    /// 4-bit quants as Q4_1 packs them.
    pub qs: [u8; 16],
}

const _: () = assert!(size_of::<SubQ4K>() == 24 && align_of::<SubQ4K>() == 1);

impl SubQ4K {
    /// The eight sub-blocks of each of `blocks`, in element order.
    pub fn from_q4_k(blocks: &[crate::q4_k::BlockQ4_K]) -> Vec<SubQ4K> {
        let mut out = Vec::with_capacity(8 * blocks.len());
        for b in blocks {
            let (d, dmin) = (fp16_to_fp32(b.d), fp16_to_fp32(b.dmin));
            for (pair, q) in b.qs.chunks_exact(32).enumerate() {
                for (half, shift) in [(0, 0), (1, 4)] {
                    let (sc, m) = crate::q4_k::get_scale_min_k4(2 * pair + half, &b.scales);
                    let nib = |i: usize| (q[i] >> shift) & 0x0F;
                    out.push(SubQ4K {
                        d: (d * f32::from(sc)).to_le_bytes(),
                        m: (-(dmin * f32::from(m))).to_le_bytes(),
                        qs: std::array::from_fn(|j| nib(j) | (nib(16 + j) << 4)),
                    });
                }
            }
        }
        out
    }
}

impl F2Block for SubQ4K {
    const KIND: F2Kind = F2Kind::Q4K;
    const HAS_MIN: bool = true;
    const HEAD_F32: bool = true;
    const QUANT_BYTES: usize = 16;
    fn quants(&self) -> [i32; QK_ACT16] {
        nibble_quants(&self.qs)
    }
    fn scale(&self, _lane: usize) -> f32 {
        f32::from_le_bytes(self.d)
    }
    fn min(&self) -> f32 {
        f32::from_le_bytes(self.m)
    }
    fn head(&self, k: usize) -> [u8; 4] {
        if k == 0 {
            self.d
        } else {
            self.m
        }
    }
    fn quant_bytes(&self) -> &[u8] {
        &self.qs
    }
    fn from_parts(heads: [[u8; 4]; 2], qs: &[u8]) -> Self {
        let mut b = SubQ4K {
            d: heads[0],
            m: heads[1],
            qs: [0; 16],
        };
        b.qs.copy_from_slice(qs);
        b
    }
}

/// Two Q6_K sub-blocks of 16 as one block of order F2: quants `q - 32` as
/// bytes (Q8_0's form) and a scale per sub-block, the super-block's `d` times
/// the sub-block's scale (exact in f32: an f16 times an 8-bit integer). The
/// first scale is lanes 0..4's, the second lanes 4..8's.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SubQ6K {
    /// The first sub-block's scale, f32 little-endian.
    pub d: [u8; 4],
    /// The second sub-block's scale, f32 little-endian.
    pub d2: [u8; 4],
    /// The quants minus 32.
    pub qs: [i8; 32],
}

const _: () = assert!(size_of::<SubQ6K>() == 40 && align_of::<SubQ6K>() == 1);

impl SubQ6K {
    /// The eight blocks of 32 of each of `blocks`, in element order.
    pub fn from_q6_k(blocks: &[crate::q6_k::BlockQ6_K]) -> Vec<SubQ6K> {
        let mut out = Vec::with_capacity(8 * blocks.len());
        for b in blocks {
            let d = fp16_to_fp32(b.d);
            let q = crate::q6_k::unpack(b);
            for (j, q) in q.chunks_exact(QK_ACT16).enumerate() {
                let scale = |k: usize| (d * f32::from(b.scales[2 * j + k])).to_le_bytes();
                out.push(SubQ6K {
                    d: scale(0),
                    d2: scale(1),
                    // -32..=31: the 6-bit quants minus 32.
                    qs: std::array::from_fn(|i| q[i] as i8),
                });
            }
        }
        out
    }
}

impl F2Block for SubQ6K {
    const KIND: F2Kind = F2Kind::Q6K;
    const HAS_MIN: bool = false;
    const SPLIT: bool = true;
    const HEAD_F32: bool = true;
    const QUANT_BYTES: usize = 32;
    fn quants(&self) -> [i32; QK_ACT16] {
        self.qs.map(i32::from)
    }
    fn scale(&self, lane: usize) -> f32 {
        f32::from_le_bytes(if lane < LANES / 2 { self.d } else { self.d2 })
    }
    fn min(&self) -> f32 {
        0.0
    }
    fn head(&self, k: usize) -> [u8; 4] {
        if k == 0 {
            self.d
        } else {
            self.d2
        }
    }
    fn quant_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.qs)
    }
    fn from_parts(heads: [[u8; 4]; 2], qs: &[u8]) -> Self {
        let mut b = SubQ6K {
            d: heads[0],
            d2: heads[1],
            qs: [0; 32],
        };
        b.qs.copy_from_slice(bytemuck::cast_slice(qs));
        b
    }
}

/// Blocks per chunk of [`F2Matrix`] (one 8-lane vector of heads).
pub(crate) const CHUNK: usize = LANES;

/// A matrix of [`F2Block`]s re-laid for order F2's kernels, built once at load,
/// in one of two layouts ([`F2Layout`]).
///
/// [`F2Layout::Rows`]: per row, per chunk of eight blocks (the last may be
/// shorter), the chunk's eight `d`s, with a second head its eight `m`s (or
/// `d2`s), then the chunk's blocks' quants, each as stored in the block. A
/// chunk's heads are one vector load instead of a gather across eight blocks
/// (decode measured 1.5x faster). The same bytes as the blocks, plus zero heads
/// padding a short last chunk.
///
/// [`F2Layout::Pairs`] (Q4_1, Q5_0 and Q8_0, for the tiers that read it): rows
/// two by two (an odd last row paired with itself); per pair and chunk, the
/// eight `d`s of both rows interleaved (`d0[0], d1[0], d0[1], ...`), for Q4_1
/// the same for the `m`s, then the chunk's blocks in units of 32 little-endian
/// words: two blocks a unit for Q4_1 and Q5_0 (an odd last block paired with a
/// zero block), one for Q8_0. Word `i` of a unit holds, from its low bits up,
/// `E[i]` and `O[i]` of its first block, then of its second (Q4_1: four
/// nibbles; Q5_0: four nibbles of `q + 16`; Q8_0: two bytes), where `E[i]` is
/// element `4·(i/4) + 2·(i%2)` of row `(i/2) % 2` and `O[i]` the element after
/// it. Masked and shifted, a unit is vectors of 16-bit quants whose dword
/// `2l + r` is lane `l` of row `r`: the pair of its even elements in `E`, of
/// its odd ones in `O`. A Q5_0 unit's words are followed by four 32-bit masks,
/// one per field (`E` and `O` of the first block, then of the second), bit `i`
/// set where word `i`'s quant is below zero (its fifth bit clear): that field's
/// vector minus 16 under the mask is the quants.
#[derive(Clone, Debug)]
pub struct F2Matrix {
    kind: F2Kind,
    layout: F2Layout,
    nb: usize,
    n_rows: usize,
    /// Huge pages where large: decode streams it whole every token.
    bytes: HugeBuf<u8>,
}

/// How an [`F2Matrix`] lays its rows out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum F2Layout {
    /// Row after row: every tier reads it.
    Rows,
    /// Q4_1 or Q8_0 rows two by two, for the tiers whose decode tile reads a
    /// row pair's block with one load (see [`F2Matrix`]).
    Pairs,
}

/// Bytes of one row of `nb` blocks of `B` in [`F2Matrix`].
pub(crate) fn f2_row_bytes<B: F2Block>(nb: usize) -> usize {
    nb.div_ceil(CHUNK) * B::HEAD_BYTES + nb * B::QUANT_BYTES
}

/// Blocks [`F2Layout::Pairs`] takes: Q4_1 and Q5_0 (nibbles, two blocks a
/// unit) and Q8_0 (bytes, one block a unit), [`F2Block::PAIR_BITS`] a quant.
pub trait PairBlock: F2Block {
    /// A quant's field in a unit's word, and its bit in the unit's masks
    /// ([`F2Block::PAIR_FIFTH`]; false without them).
    #[doc(hidden)]
    fn to_bits(q: i32) -> (u16, bool) {
        (q as u16 & ((1 << Self::PAIR_BITS) - 1), false)
    }
    /// A quant from its field in a unit's word and its mask bit.
    #[doc(hidden)]
    fn from_bits(bits: u16, masked: bool) -> i32;
    /// The stored quant bytes of a block of quants `q` (the first
    /// [`F2Block::QUANT_BYTES`] of them).
    #[doc(hidden)]
    fn stored(q: &[i32; QK_ACT16]) -> [u8; QK_ACT16];
}

impl PairBlock for BlockQ4_1 {
    fn from_bits(bits: u16, _masked: bool) -> i32 {
        i32::from(bits)
    }
    fn stored(q: &[i32; QK_ACT16]) -> [u8; QK_ACT16] {
        // Element e in the low nibble of byte e, e + 16 in the high.
        std::array::from_fn(|e| match e {
            0..16 => (q[e] | q[e + 16] << 4) as u8,
            _ => 0,
        })
    }
}

impl PairBlock for BlockQ8_0 {
    fn from_bits(bits: u16, _masked: bool) -> i32 {
        i32::from(bits as u8 as i8)
    }
    fn stored(q: &[i32; QK_ACT16]) -> [u8; QK_ACT16] {
        q.map(|q| q as i8 as u8)
    }
}

impl PairBlock for BlockQ5_0 {
    fn to_bits(q: i32) -> (u16, bool) {
        ((q + 16) as u16 & 0x0F, q < 0)
    }
    fn from_bits(bits: u16, masked: bool) -> i32 {
        i32::from(bits) - if masked { 16 } else { 0 }
    }
    fn stored(q: &[i32; QK_ACT16]) -> [u8; QK_ACT16] {
        // `qh` (bit e: the fifth bit of element e), then the nibbles of
        // `q + 16` as Q4_1's.
        let u = q.map(|q| (q + 16) as u32);
        let qh = (0..QK_ACT16).fold(0u32, |h, e| h | (u[e] >> 4 & 1) << e);
        std::array::from_fn(|i| match i {
            0..4 => qh.to_le_bytes()[i],
            4..20 => (u[i - 4] & 0x0F | (u[i + 12] & 0x0F) << 4) as u8,
            _ => 0,
        })
    }
}

/// Bytes of a chunk of `len` blocks of a pair of rows in [`F2Layout::Pairs`]:
/// the heads (sixteen f16s each), then the blocks in units.
pub(crate) const fn pair_chunk_bytes<B: F2Block>(len: usize) -> usize {
    32 * B::HEADS + len.div_ceil(B::PAIR_UNIT) * B::PAIR_UNIT_BYTES
}

/// Bytes of one pair of rows of `nb` blocks in [`F2Layout::Pairs`].
pub(crate) fn f2_pair_bytes<B: F2Block>(nb: usize) -> usize {
    let full = nb / CHUNK * pair_chunk_bytes::<B>(CHUNK);
    match nb % CHUNK {
        0 => full,
        rest => full + pair_chunk_bytes::<B>(rest),
    }
}

/// Row `(i / 2) % 2` and element of word `i`'s `E` quant in a unit of
/// [`F2Layout::Pairs`] (its `O` quant is the element after it).
const fn pair_word(i: usize) -> (usize, usize) {
    ((i / 2) % 2, 4 * (i / 4) + 2 * (i % 2))
}

impl F2Matrix {
    /// Re-lays `w`, rows of `nb` blocks back to back, as [`F2Layout::Rows`].
    ///
    /// # Panics
    /// If `nb` is 0 or `w` is not whole rows (shapes are validated at load).
    pub fn pack<B: F2Block>(w: &[B], nb: usize) -> Self {
        let n_rows = check_rows(w.len(), nb);
        let mut bytes = Vec::with_capacity(n_rows * f2_row_bytes::<B>(nb));
        for row in w.chunks_exact(nb) {
            for chunk in row.chunks(CHUNK) {
                for k in 0..B::HEADS {
                    let mut h = [0u8; 4 * CHUNK];
                    for (h, b) in h.chunks_exact_mut(B::HEAD_SIZE).zip(chunk) {
                        h.copy_from_slice(&b.head(k)[..B::HEAD_SIZE]);
                    }
                    bytes.extend_from_slice(&h[..B::HEAD_SIZE * CHUNK]);
                }
                for b in chunk {
                    bytes.extend_from_slice(b.quant_bytes());
                }
            }
        }
        F2Matrix {
            kind: B::KIND,
            layout: F2Layout::Rows,
            nb,
            n_rows,
            bytes: HugeBuf::from_vec(bytes),
        }
    }

    /// Re-lays rows `w` of `nb` blocks as [`F2Layout::Pairs`].
    ///
    /// # Panics
    /// As [`Self::pack`].
    pub fn pack_pairs<B: PairBlock>(w: &[B], nb: usize) -> Self {
        let n_rows = check_rows(w.len(), nb);
        let mut bytes = Vec::with_capacity(n_rows.div_ceil(2) * f2_pair_bytes::<B>(nb));
        for p in 0..n_rows.div_ceil(2) {
            let rows = [2 * p, (2 * p + 1).min(n_rows - 1)].map(|r| &w[r * nb..(r + 1) * nb]);
            for c in 0..nb.div_ceil(CHUNK) {
                let blocks = rows.map(|r| &r[CHUNK * c..(CHUNK * c + CHUNK).min(nb)]);
                for k in 0..B::HEADS {
                    for j in 0..CHUNK {
                        for r in blocks {
                            let h = r.get(j).map_or([0; 4], |b| b.head(k));
                            bytes.extend_from_slice(&h[..2]);
                        }
                    }
                }
                for u in 0..blocks[0].len().div_ceil(B::PAIR_UNIT) {
                    let unit: Vec<[Option<[i32; QK_ACT16]>; 2]> = (0..B::PAIR_UNIT)
                        .map(|k| blocks.map(|r| r.get(B::PAIR_UNIT * u + k).map(|b| b.quants())))
                        .collect();
                    // Field f of word i: E (f even) or O of block f / 2.
                    let mut masks = [0u32; 4];
                    for i in 0..32 {
                        let (r, e) = pair_word(i);
                        let mut word = 0u16;
                        for (k, q) in unit.iter().enumerate() {
                            let Some(q) = q[r] else { continue };
                            for (o, f) in [(0, 2 * k), (1, 2 * k + 1)] {
                                let (bits, masked) = B::to_bits(q[e + o]);
                                word |= bits << (B::PAIR_BITS * f);
                                masks[f] |= u32::from(masked) << i;
                            }
                        }
                        bytes.extend_from_slice(&word.to_le_bytes());
                    }
                    if B::PAIR_FIFTH {
                        masks
                            .iter()
                            .for_each(|m| bytes.extend_from_slice(&m.to_le_bytes()));
                    }
                }
            }
        }
        F2Matrix {
            kind: B::KIND,
            layout: F2Layout::Pairs,
            nb,
            n_rows,
            bytes: HugeBuf::from_vec(bytes),
        }
    }

    /// Rows held.
    pub fn n_rows(&self) -> usize {
        self.n_rows
    }

    /// Blocks per row.
    pub fn blocks_per_row(&self) -> usize {
        self.nb
    }

    /// The blocks it was packed from.
    pub fn kind(&self) -> F2Kind {
        self.kind
    }

    /// How its rows are laid out.
    pub fn layout(&self) -> F2Layout {
        self.layout
    }

    /// Rows `rows` as blocks of `B`; in [`F2Layout::Pairs`] `rows` starts at
    /// an even row (its pair's first), and a range ending inside a pair holds
    /// the whole pair.
    ///
    /// # Panics
    /// If the matrix was not packed from `B` blocks, `rows` is out of range or,
    /// in pairs, starts at an odd row.
    pub fn rows<B: F2Block>(&self, rows: std::ops::Range<usize>) -> F2Rows<'_, B> {
        assert!(
            self.kind == B::KIND && rows.start <= rows.end && rows.end <= self.n_rows,
            "F2 layout: rows {rows:?} of {} as the wrong format or out of range",
            self.n_rows
        );
        let bytes = match self.layout {
            F2Layout::Rows => {
                let rb = f2_row_bytes::<B>(self.nb);
                &self.bytes[rows.start * rb..rows.end * rb]
            }
            F2Layout::Pairs => {
                assert!(
                    rows.start.is_multiple_of(2),
                    "F2 layout: rows {rows:?} start inside a pair"
                );
                let pb = f2_pair_bytes::<B>(self.nb);
                &self.bytes[rows.start / 2 * pb..rows.end.div_ceil(2) * pb]
            }
        };
        F2Rows {
            nb: self.nb,
            n_rows: rows.len(),
            layout: self.layout,
            bytes,
            _block: std::marker::PhantomData,
        }
    }
}

/// Rows of `nb` blocks in `blocks` blocks.
fn check_rows(blocks: usize, nb: usize) -> usize {
    assert!(
        nb > 0 && blocks.is_multiple_of(nb),
        "F2 layout: {blocks} blocks in rows of {nb}"
    );
    blocks / nb
}

/// Consecutive rows of an [`F2Matrix`] of `B` blocks.
#[derive(Clone, Copy, Debug)]
pub struct F2Rows<'a, B> {
    pub(crate) nb: usize,
    pub(crate) n_rows: usize,
    pub(crate) layout: F2Layout,
    pub(crate) bytes: &'a [u8],
    _block: std::marker::PhantomData<B>,
}

impl<'a, B: F2Block> F2Rows<'a, B> {
    /// Bytes per row of [`F2Layout::Rows`], which the kernels that read rows
    /// by their offsets take.
    ///
    /// # Panics
    /// If the rows are laid out in pairs.
    pub(crate) fn row_bytes(&self) -> usize {
        assert!(
            self.layout == F2Layout::Rows,
            "F2 layout: rows in pairs handed to a kernel that reads rows"
        );
        f2_row_bytes::<B>(self.nb)
    }

    /// These rows as rows of `P` in pairs, if they are `P` blocks laid out so.
    pub(crate) fn in_pairs<P: PairBlock>(&self) -> Option<F2Rows<'a, P>> {
        (self.layout == F2Layout::Pairs && B::KIND == P::KIND).then_some(F2Rows {
            nb: self.nb,
            n_rows: self.n_rows,
            layout: self.layout,
            bytes: self.bytes,
            _block: std::marker::PhantomData,
        })
    }

    /// Block `b` of row `r`, as it was packed.
    pub(crate) fn block(&self, r: usize, b: usize) -> B {
        let (c, j) = (b / CHUNK, b % CHUNK);
        if self.layout == F2Layout::Pairs {
            if let Some(w) = self.in_pairs::<BlockQ4_1>() {
                return from_pair(w.pair_block(r, c, j));
            }
            if let Some(w) = self.in_pairs::<BlockQ5_0>() {
                return from_pair(w.pair_block(r, c, j));
            }
            if let Some(w) = self.in_pairs::<BlockQ8_0>() {
                return from_pair(w.pair_block(r, c, j));
            }
            unreachable!("only Q4_1, Q5_0 and Q8_0 rows are packed in pairs");
        }
        let chunk = r * self.row_bytes() + c * B::CHUNK_BYTES;
        let head = |k: usize| {
            let mut h = [0u8; 4];
            if k < B::HEADS {
                let at = chunk + (k * CHUNK + j) * B::HEAD_SIZE;
                h[..B::HEAD_SIZE].copy_from_slice(&self.bytes[at..at + B::HEAD_SIZE]);
            }
            h
        };
        let q = chunk + B::HEAD_BYTES + j * B::QUANT_BYTES;
        B::from_parts([head(0), head(1)], &self.bytes[q..q + B::QUANT_BYTES])
    }
}

/// A block of one kind as itself (`P` is `B`: their kinds were compared).
fn from_pair<P: F2Block, B: F2Block>(b: P) -> B {
    B::from_parts([b.head(0), b.head(1)], b.quant_bytes())
}

impl<P: PairBlock> F2Rows<'_, P> {
    /// Block `j` of chunk `c` of row `r` in [`F2Layout::Pairs`]: its heads and
    /// quants gathered back from the pair's chunk.
    fn pair_block(&self, r: usize, c: usize, j: usize) -> P {
        let row = r % 2;
        let chunk = r / 2 * f2_pair_bytes::<P>(self.nb) + c * pair_chunk_bytes::<P>(CHUNK);
        let head = |k: usize| match k < P::HEADS {
            true => {
                let at = chunk + 32 * k + 2 * (2 * j + row);
                [self.bytes[at], self.bytes[at + 1], 0, 0]
            }
            false => [0; 4],
        };
        let unit = chunk + 32 * P::HEADS + P::PAIR_UNIT_BYTES * (j / P::PAIR_UNIT);
        let field = 2 * (j % P::PAIR_UNIT);
        let mask = (1u16 << P::PAIR_BITS) - 1;
        let masked = |f: usize, i: usize| {
            let at = unit + 64 + 4 * f;
            P::PAIR_FIFTH && self.bytes[at + i / 8] >> (i % 8) & 1 == 1
        };
        let mut q = [0i32; QK_ACT16];
        for i in (0..32).filter(|&i| pair_word(i).0 == row) {
            let at = unit + 2 * i;
            let word = u16::from_le_bytes([self.bytes[at], self.bytes[at + 1]]);
            let e = pair_word(i).1;
            for (o, f) in [(0, field), (1, field + 1)] {
                q[e + o] = P::from_bits(word >> (P::PAIR_BITS * f) & mask, masked(f, i));
            }
        }
        P::from_parts([head(0), head(1)], &P::stored(&q)[..P::QUANT_BYTES])
    }
}

/// One row against one activation row in order F2.
fn dot_ref<B: F2Block>(row: impl ExactSizeIterator<Item = B>, a: Act16Row<'_>) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut macc = [0.0f32; LANES];
    let nb = row.len();
    for (b, (blk, x)) in row.zip(a.q.chunks_exact(QK_ACT16)).enumerate() {
        let w = blk.quants();
        for (l, acc) in acc.iter_mut().enumerate() {
            let c = blk.scale(l) * a.scale[b];
            let p: i32 = (4 * l..4 * l + 4)
                .map(|j| w[j] * i32::from(x[stored_index(j)]))
                .sum();
            *acc = (p as f32).mul_add(c, *acc);
        }
        if B::HAS_MIN {
            macc[b % LANES] = blk.min().mul_add(a.sum[b], macc[b % LANES]);
        }
    }
    if B::HAS_MIN {
        for b in nb..nb.next_multiple_of(LANES) {
            macc[b % LANES] = 0.0f32.mul_add(0.0, macc[b % LANES]);
        }
        for (acc, m) in acc.iter_mut().zip(macc) {
            *acc += m;
        }
    }
    reduce_lanes(&acc)
}

/// `out[t·n_rows + r]` = row `r` of `w` (rows of `acts.n()` elements, back to back)
/// against row `t` of `acts`, in order F2; `n_rows = w.len() / blocks per row`.
/// Scalar reference.
///
/// # Panics
/// If `w` is not whole rows or `out` is not `n_rows · acts.rows()` values.
pub fn gemm_q4_1_ref(w: &[BlockQ4_1], acts: &Act16, out: &mut [f32]) {
    gemm_ref(w, acts, out)
}

/// [`gemm_q4_1_ref`] for Q8_0 rows.
///
/// # Panics
/// As [`gemm_q4_1_ref`].
pub fn gemm_q8_0_ref(w: &[BlockQ8_0], acts: &Act16, out: &mut [f32]) {
    gemm_ref(w, acts, out)
}

/// [`gemm_q4_1_ref`] for Q4_K rows resolved into [`SubQ4K`]s.
///
/// # Panics
/// As [`gemm_q4_1_ref`].
pub fn gemm_q4_k_ref(w: &[SubQ4K], acts: &Act16, out: &mut [f32]) {
    gemm_ref(w, acts, out)
}

/// [`gemm_q4_1_ref`] for Q5_0 rows.
///
/// # Panics
/// As [`gemm_q4_1_ref`].
pub fn gemm_q5_0_ref(w: &[BlockQ5_0], acts: &Act16, out: &mut [f32]) {
    gemm_ref(w, acts, out)
}

/// [`gemm_q4_1_ref`] for Q6_K rows resolved into [`SubQ6K`]s.
///
/// # Panics
/// As [`gemm_q4_1_ref`].
pub fn gemm_q6_k_ref(w: &[SubQ6K], acts: &Act16, out: &mut [f32]) {
    gemm_ref(w, acts, out)
}

fn gemm_ref<B: F2Block>(w: &[B], acts: &Act16, out: &mut [f32]) {
    let (nb, n_rows) = check_gemm(w.len(), acts, out.len());
    for (t, ot) in out.chunks_exact_mut(n_rows.max(1)).enumerate() {
        for (row, o) in w.chunks_exact(nb).zip(ot) {
            *o = dot_ref(row.iter().copied(), acts.row(t));
        }
    }
}

/// [`gemm_q4_1_ref`] or [`gemm_q8_0_ref`] on packed rows, reading each block back
/// out of the layout: the scalar tier's entry.
///
/// # Panics
/// As [`gemm_q4_1_ref`].
pub fn gemm_packed_ref<B: F2Block>(w: F2Rows<'_, B>, acts: &Act16, out: &mut [f32]) {
    let (nb, n_rows) = check_gemm_rows(&w, acts, out.len());
    for (t, ot) in out.chunks_exact_mut(n_rows.max(1)).enumerate() {
        for (r, o) in ot.iter_mut().enumerate() {
            *o = dot_ref((0..nb).map(|b| w.block(r, b)), acts.row(t));
        }
    }
}

/// Checks a product's shapes; returns (blocks per row, rows).
pub(crate) fn check_gemm(w_blocks: usize, acts: &Act16, out: usize) -> (usize, usize) {
    let nb = acts.n() / QK_ACT16;
    assert!(
        nb > 0 && w_blocks.is_multiple_of(nb) && out == w_blocks / nb * acts.rows(),
        "act16 product: {w_blocks} weight blocks, rows of {} blocks, {} tokens, {out} outputs",
        nb,
        acts.rows()
    );
    (nb, w_blocks / nb)
}

/// [`check_gemm`] for packed rows.
pub(crate) fn check_gemm_rows<B: F2Block>(
    w: &F2Rows<'_, B>,
    acts: &Act16,
    out: usize,
) -> (usize, usize) {
    assert_eq!(
        w.nb,
        acts.n() / QK_ACT16,
        "act16 product: rows of {} blocks against activations of {}",
        w.nb,
        acts.n()
    );
    check_gemm(w.nb * w.n_rows, acts, out)
}

/// [`gemm_q4_1_ref`] on packed rows, by the selected tier.
#[inline]
pub fn gemm_q4_1(w: F2Rows<'_, BlockQ4_1>, acts: &Act16, out: &mut [f32]) {
    (crate::kernels().gemm_q4_1_act16)(w, acts, out)
}

/// [`gemm_q8_0_ref`] on packed rows, by the selected tier.
#[inline]
pub fn gemm_q8_0(w: F2Rows<'_, BlockQ8_0>, acts: &Act16, out: &mut [f32]) {
    (crate::kernels().gemm_q8_0_act16)(w, acts, out)
}

/// [`gemm_q5_0_ref`] on packed rows, by the selected tier.
#[inline]
pub fn gemm_q5_0(w: F2Rows<'_, BlockQ5_0>, acts: &Act16, out: &mut [f32]) {
    (crate::kernels().gemm_q5_0_act16)(w, acts, out)
}

/// [`gemm_q4_k_ref`] on packed rows, by the selected tier.
#[inline]
pub fn gemm_q4_k(w: F2Rows<'_, SubQ4K>, acts: &Act16, out: &mut [f32]) {
    (crate::kernels().gemm_q4_k_act16)(w, acts, out)
}

/// [`gemm_q6_k_ref`] on packed rows, by the selected tier.
#[inline]
pub fn gemm_q6_k(w: F2Rows<'_, SubQ6K>, acts: &Act16, out: &mut [f32]) {
    (crate::kernels().gemm_q6_k_act16)(w, acts, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{dot_f64, XorShift};
    use bytemuck::Zeroable;

    fn quantized(x: &[f32], n: usize) -> Act16 {
        let mut a = Act16::default();
        a.quantize(x, n);
        a
    }

    #[test]
    fn quantization_is_within_half_a_step_and_sums_its_quants() {
        let mut rng = XorShift::new(21);
        let mut x = rng.vec_uniform(32 * 5, -3.0, 3.0);
        x[40] = 250.0; // an outlier only coarsens its own block
        x[64..96].fill(0.0);
        let a = quantized(&x, 32 * 5);
        let row = a.row(0);
        assert_eq!(row.scale.len(), 8);
        assert_eq!(&row.scale[5..], &[0.0; 3]);
        for (b, xb) in x.chunks_exact(32).enumerate() {
            let s = row.scale[b];
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_eq!(s, amax / ACT16_MAX);
            let qb = &row.q[32 * b..32 * b + 32];
            for (j, &v) in xb.iter().enumerate() {
                let q = qb[stored_index(j)];
                assert!((q as f32 * s - v).abs() <= 0.51 * s, "{q}·{s} vs {v}");
            }
            let total: i32 = qb.iter().map(|&q| i32::from(q)).sum();
            assert_eq!(row.sum[b], s * total as f32);
        }
        assert!(row.q[64..96].iter().all(|&q| q == 0));
    }

    /// Every block read back from both layouts, over odd row counts, short
    /// chunks and ranges from every pair; and a unit's words as documented.
    fn layouts_give_back_every_block<B: PairBlock + PartialEq + std::fmt::Debug>(seed: u64) {
        let mut rng = XorShift::new(seed);
        for (n_rows, nb) in [(1, 1), (2, 3), (5, 8), (7, 9), (4, 18)] {
            let mut w = vec![B::zeroed(); n_rows * nb];
            for b in bytemuck::cast_slice_mut::<B, u8>(&mut w) {
                *b = rng.byte();
            }
            let (rows, pairs) = (F2Matrix::pack(&w, nb), F2Matrix::pack_pairs(&w, nb));
            assert_eq!(pairs.layout(), F2Layout::Pairs);
            assert_eq!(
                pairs.bytes.len(),
                n_rows.div_ceil(2) * f2_pair_bytes::<B>(nb)
            );
            for first in (0..n_rows).step_by(2) {
                let (rows, pairs) = (
                    rows.rows::<B>(first..n_rows),
                    pairs.rows::<B>(first..n_rows),
                );
                for r in 0..n_rows - first {
                    for b in 0..nb {
                        let want = w[(first + r) * nb + b];
                        assert_eq!(rows.block(r, b), want, "rows: row {r} block {b}");
                        assert_eq!(pairs.block(r, b), want, "pairs: row {r} block {b}");
                    }
                }
            }
            // Word i of the first unit: E and O of each of its blocks, from the
            // low bits up (the documented layout, read directly).
            let unit = &pairs.bytes[32 * B::HEADS..][..B::PAIR_UNIT_BYTES];
            let q = |r: usize, b: usize| match b < nb {
                true => w[r.min(n_rows - 1) * nb + b].quants(),
                false => [0; QK_ACT16],
            };
            let mask = (1u16 << B::PAIR_BITS) - 1;
            // Bit i of mask f, after the words (false without masks).
            let masked =
                |f: usize, i: usize| B::PAIR_FIFTH && unit[64 + 4 * f + i / 8] >> (i % 8) & 1 == 1;
            for i in 0..32 {
                let (r, e) = pair_word(i);
                let word = u16::from_le_bytes([unit[2 * i], unit[2 * i + 1]]);
                for k in 0..B::PAIR_UNIT {
                    let field = |f: usize| {
                        let f = 2 * k + f;
                        B::from_bits(word >> (B::PAIR_BITS * f) & mask, masked(f, i))
                    };
                    assert_eq!(
                        (field(0), field(1)),
                        (q(r, k)[e], q(r, k)[e + 1]),
                        "word {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn both_layouts_give_back_every_q4_1_block() {
        layouts_give_back_every_block::<BlockQ4_1>(24);
    }

    #[test]
    fn both_layouts_give_back_every_q8_0_block() {
        layouts_give_back_every_block::<BlockQ8_0>(25);
    }

    #[test]
    fn both_layouts_give_back_every_q5_0_block() {
        layouts_give_back_every_block::<BlockQ5_0>(26);
    }

    #[test]
    #[should_panic(expected = "start inside a pair")]
    fn rows_in_pairs_start_at_a_pair() {
        let w = vec![BlockQ4_1::zeroed(); 4];
        let _ = F2Matrix::pack_pairs(&w, 1).rows::<BlockQ4_1>(1..4);
    }

    #[test]
    fn non_finite_activations_give_nan() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = vec![0.5f32; 64];
            x[37] = bad;
            let a = quantized(&x, 64);
            assert!(a.row(0).scale[0].is_finite() && a.row(0).scale[1].is_nan());
            let w = vec![
                BlockQ8_0 {
                    d: [0, 0x3c],
                    qs: [1; 32]
                };
                2
            ];
            let mut out = [0.0];
            gemm_q8_0_ref(&w, &a, &mut out);
            assert!(out[0].is_nan(), "{bad}: {}", out[0]);
        }
    }

    /// K-quant super-blocks of typical weights (and a few extreme ones).
    fn k_quant_weights(rng: &mut XorShift, n: usize) -> Vec<f32> {
        let mut w = rng.vec_weights(n, 0.05);
        w[3] = 0.9;
        w[300] = -1.7;
        w
    }

    #[test]
    fn k_quant_sub_blocks_hold_exactly_the_dequantized_values() {
        let mut rng = XorShift::new(23);
        let w = k_quant_weights(&mut rng, 256 * 3);
        let mut q4 = vec![crate::q4_k::BlockQ4_K::zeroed(); 3];
        crate::q4_k::quantize_row_ref(&w, &mut q4);
        let mut q6 = vec![crate::q6_k::BlockQ6_K::zeroed(); 3];
        crate::q6_k::quantize_row_ref(&w, &mut q6);
        let (mut d4, mut d6) = (vec![0.0; w.len()], vec![0.0; w.len()]);
        crate::q4_k::dequantize_row(&q4, &mut d4);
        crate::q6_k::dequantize_row(&q6, &mut d6);
        let (s4, s6) = (SubQ4K::from_q4_k(&q4), SubQ6K::from_q6_k(&q6));
        assert_eq!((s4.len(), s6.len()), (24, 24));
        for (b, (s4, s6)) in s4.iter().zip(&s6).enumerate() {
            let (q4, q6) = (s4.quants(), s6.quants());
            for j in 0..QK_ACT16 {
                let i = QK_ACT16 * b + j;
                // The dequantizers' own operations: `d·q - m` and `(d·sc)·q`.
                let v4 = s4.scale(j / 4) * q4[j] as f32 + s4.min();
                assert_eq!(v4.to_bits(), d4[i].to_bits(), "q4_K element {i}");
                let v6 = s6.scale(j / 4) * q6[j] as f32;
                assert_eq!(v6.to_bits(), d6[i].to_bits(), "q6_K element {i}");
            }
        }
    }

    #[test]
    fn q4_1_and_q8_0_products_are_close_to_f64() {
        let mut rng = XorShift::new(22);
        let (n, rows, toks) = (32 * 18, 3, 2);
        let wf = rng.vec_weights(n * rows, 0.05);
        let x = rng.vec_uniform(n * toks, -2.0, 2.0);
        let a = quantized(&x, n);
        let mut q4 = vec![
            BlockQ4_1 {
                d: [0; 2],
                m: [0; 2],
                qs: [0; 16]
            };
            wf.len() / 32
        ];
        crate::q4_1::quantize_row_ref(&wf, &mut q4);
        let mut q8 = vec![BlockQ8_0::ZERO; wf.len() / 32];
        crate::q8_0::quantize_row_ref(&wf, &mut q8);
        let (mut o4, mut o8) = (vec![0.0; rows * toks], vec![0.0; rows * toks]);
        gemm_q4_1_ref(&q4, &a, &mut o4);
        gemm_q8_0_ref(&q8, &a, &mut o8);
        let (mut d4, mut d8) = (vec![0.0; wf.len()], vec![0.0; wf.len()]);
        crate::q4_1::dequantize_row(&q4, &mut d4);
        crate::q8_0::dequantize_row(&q8, &mut d8);
        for (out, wd) in [(&o4, &d4), (&o8, &d8)] {
            assert_close_to_f64(out, wd, &x, n);
        }
    }

    /// Q5_0 blocks give bit for bit what the Q8_0 blocks holding their values
    /// give (the layout the fast path ran Q5_0 from before it ran it natively),
    /// and its packed rows read back as the blocks they were packed from.
    #[test]
    fn q5_0_products_are_those_of_its_q8_0_values() {
        let mut rng = XorShift::new(23);
        let (n, rows, toks) = (32 * 10, 3, 2);
        let wf = rng.vec_weights(n * rows, 0.05);
        let x = rng.vec_uniform(n * toks, -2.0, 2.0);
        let a = quantized(&x, n);
        let mut q5 = vec![BlockQ5_0::zeroed(); wf.len() / 32];
        crate::q5_0::quantize_row_ref(&wf, &mut q5);
        let (mut o5, mut o8) = (vec![0.0; rows * toks], vec![0.0; rows * toks]);
        gemm_q5_0_ref(&q5, &a, &mut o5);
        gemm_q8_0_ref(&crate::q5_0::to_q8_0(&q5), &a, &mut o8);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&o5), bits(&o8));
        let packed = F2Matrix::pack(&q5, n / 32);
        let mut op = vec![0.0; rows * toks];
        gemm_packed_ref(packed.rows::<BlockQ5_0>(0..rows), &a, &mut op);
        assert_eq!(bits(&op), bits(&o5));
        let mut d5 = vec![0.0; wf.len()];
        crate::q5_0::dequantize_row(&q5, &mut d5);
        assert_close_to_f64(&o5, &d5, &x, n);
    }

    /// `out[t·rows + r]` against the f64 dot product of dequantized row `r` of
    /// `wd` and row `t` of `x` (rows of `n`): within 1e-4 of the sum of the
    /// products' magnitudes.
    fn assert_close_to_f64(out: &[f32], wd: &[f32], x: &[f32], n: usize) {
        let rows = wd.len() / n;
        for (t, xt) in x.chunks_exact(n).enumerate() {
            for (r, wr) in wd.chunks_exact(n).enumerate() {
                let scale: f64 = wr.iter().zip(xt).map(|(a, b)| (a * b).abs() as f64).sum();
                let err = (out[t * rows + r] as f64 - dot_f64(wr, xt)).abs();
                assert!(err <= 1e-4 * scale, "t={t} r={r}: err {err} of {scale}");
            }
        }
    }

    #[test]
    fn k_quant_products_are_close_to_f64() {
        let mut rng = XorShift::new(24);
        let (n, rows, toks) = (256 * 2, 3, 2);
        let w = k_quant_weights(&mut rng, n * rows);
        let x = rng.vec_uniform(n * toks, -2.0, 2.0);
        let a = quantized(&x, n);
        let mut q4 = vec![crate::q4_k::BlockQ4_K::zeroed(); w.len() / 256];
        crate::q4_k::quantize_row_ref(&w, &mut q4);
        let mut q6 = vec![crate::q6_k::BlockQ6_K::zeroed(); w.len() / 256];
        crate::q6_k::quantize_row_ref(&w, &mut q6);
        let (mut o4, mut o6) = (vec![0.0; rows * toks], vec![0.0; rows * toks]);
        gemm_q4_k_ref(&SubQ4K::from_q4_k(&q4), &a, &mut o4);
        gemm_q6_k_ref(&SubQ6K::from_q6_k(&q6), &a, &mut o6);
        let (mut d4, mut d6) = (vec![0.0; w.len()], vec![0.0; w.len()]);
        crate::q4_k::dequantize_row(&q4, &mut d4);
        crate::q6_k::dequantize_row(&q6, &mut d6);
        assert_close_to_f64(&o4, &d4, &x, n);
        assert_close_to_f64(&o6, &d6, &x, n);
    }
}
