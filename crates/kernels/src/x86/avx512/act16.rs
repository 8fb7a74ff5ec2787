//! Order F2 of [`crate::act16`] (16-bit activations against packed Q4_1 and
//! Q8_0 rows) and the activation rounding, on AVX-512 F/BW/VL/VNNI.
//!
//! The order's unit is one 8-lane accumulator per (row, token), fed per block
//! by eight exact integer lane sums and one `fma` with `c = d·s`. A 512-bit
//! register holds two such accumulators, so each instruction here advances two
//! (row, token) pairs by exactly the operations the 256-bit tier applies to one;
//! `vpdpwssd` adds the odd elements' products to the even ones' (`vpmaddwd`)
//! in the same instruction, and integer sums are exact in any grouping.
//!
//! - A batch (prefill) puts two tokens in a register, their lanes interleaved:
//!   lane `2l` is the first token's lane `l`, lane `2l + 1` the second's. Each
//!   panel of rows has its blocks widened once with every 32-bit pair of quants
//!   duplicated ([`Block16x2::quants_dup`]) and each group of tokens its blocks
//!   interleaved pair by pair once (two-source permutations), so that the tile
//!   loop is loads, `vpmaddwd` + `vpdpwssd`, a conversion and an `fma` per
//!   register, each block's two scales `(c_t, c_u)` one 64-bit broadcast from
//!   the chunk's products `d·s`, formed sixteen at a time.
//! - One token (decode) puts two rows in a register, one per 256-bit half
//!   ([`Block16x2::quants_halves`], the 256-bit tier's widening side by side),
//!   against the token's block broadcast to both halves; each block's scales
//!   are one permutation of the chunk's products.
//!
//! The tiles' shapes and the panel size were measured on Zen 5 (see
//! [`TILE_ROWS`]).

use std::arch::x86_64::*;

use super::super::avx2::{f2_heads, fifth_bits, nibbles_in_order, Prefetch};
use super::reduce_pairs;
use crate::act16::{
    f2_pair_bytes, Act16, Act16Row, F2Block, F2Layout, F2Rows, SubQ4K, SubQ6K, ACT16_MAX, CHUNK,
    QK_ACT16,
};
use crate::q4_1::BlockQ4_1;
use crate::q5_0::BlockQ5_0;
use crate::q8_0::BlockQ8_0;

mod pairs;

/// `vpshufb` indices that widen quant bytes to 16-bit words with every 32-bit
/// pair duplicated. Lane `L` of the source holds elements `8L..8L + 8` at byte
/// `8·(L % 2)` on; dwords `2k` and `2k + 1` of lane `L` (`k` = 0, 1) both get
/// elements `(8L + 4k + o, 8L + 4k + 2 + o)`, `o` = 0 for the even elements and
/// 1 for the odd ones: the 32-bit pairs `vpmaddwd` forms in the stored order of
/// [`crate::act16`]. Each byte goes to the word's low byte (the rest zeroed) or,
/// with `high`, to its high byte (for a sign-extending shift).
const fn dup_pairs(odd: bool, high: bool) -> __m512i {
    let mut idx = [0x80u8; 64];
    let mut lane = 0;
    while lane < 4 {
        let base = 8 * (lane % 2) + odd as usize;
        let mut w = 0;
        while w < 8 {
            let e = base + 4 * (w / 4) + 2 * (w % 2);
            idx[16 * lane + 2 * w + high as usize] = e as u8;
            w += 1;
        }
        lane += 1;
    }
    // SAFETY: 64 bytes to a 64-byte vector; every bit pattern is a valid __m512i.
    unsafe { std::mem::transmute::<[u8; 64], __m512i>(idx) }
}

/// 32-bit lanes `[k, 16 + k]` for `k` = `first..first + 8`: two vectors'
/// lanes interleaved by `vpermt2d`/`vpermt2ps`.
const fn interleave_idx(first: i32) -> __m512i {
    let mut idx = [0i32; 16];
    let mut k = 0;
    while k < 8 {
        idx[2 * k] = first + k as i32;
        idx[2 * k + 1] = 16 + first + k as i32;
        k += 1;
    }
    // SAFETY: 64 bytes to a 64-byte vector; every bit pattern is a valid __m512i.
    unsafe { std::mem::transmute::<[i32; 16], __m512i>(idx) }
}

/// 32-bit lanes from a list.
const fn lanes(idx: [i32; 16]) -> __m512i {
    // SAFETY: 64 bytes to a 64-byte vector; every bit pattern is a valid __m512i.
    unsafe { std::mem::transmute::<[i32; 16], __m512i>(idx) }
}

/// The even lanes, then the odd ones: an interleaved pair back in halves.
const DEINTERLEAVE: __m512i = lanes([0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]);
/// Each of the low eight lanes twice.
const DUP_LOW8: __m512i = lanes([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]);

/// A weight block as the AVX-512 tiles take it.
pub(super) trait Block16x2: F2Block {
    /// The block's 32 quants at `q` as i16 with each 32-bit pair duplicated:
    /// dwords `2k` and `2k + 1` of `[0]` hold elements `(4k, 4k + 2)`, those of
    /// `[1]` elements `(4k + 1, 4k + 3)`.
    ///
    /// # Safety
    /// `q` points at [`F2Block::QUANT_BYTES`] readable bytes; the CPU has
    /// AVX-512 F and BW.
    unsafe fn quants_dup(q: *const u8) -> [__m512i; 2];

    /// Two blocks' quants, the one at `q0` in the low 256-bit half and the one
    /// at `q1` in the high one, each as i16 in the stored order of
    /// [`crate::act16`]: `[0]` the even elements, `[1]` the odd ones.
    ///
    /// # Safety
    /// As [`Self::quants_dup`], for both pointers.
    unsafe fn quants_halves(q0: *const u8, q1: *const u8) -> [__m512i; 2];

    /// A unit of a row pair's blocks in [`crate::act16::F2Layout::Pairs`]
    /// widened: per block of it (see [`F2Block::PAIR_UNIT`]) its `E` and `O`
    /// words (dword `2l + r`: lane `l` of row `r`), zeros after the last.
    ///
    /// # Safety
    /// `q` points at [`F2Block::PAIR_UNIT_BYTES`] readable bytes; the CPU has
    /// AVX-512 F/BW.
    unsafe fn pair_unit(_q: *const u8) -> [__m512i; 4] {
        unreachable!("{:?} rows are never laid out in pairs", Self::KIND)
    }
}

impl Block16x2 for BlockQ4_1 {
    #[inline(always)]
    unsafe fn pair_unit(q: *const u8) -> [__m512i; 4] {
        // SAFETY: `q` is 64 readable bytes; AVX-512 as above.
        unsafe {
            let q = _mm512_loadu_si512(q.cast());
            let nibble = _mm512_set1_epi16(0x0F);
            [
                _mm512_and_si512(q, nibble),
                _mm512_and_si512(_mm512_srli_epi16::<4>(q), nibble),
                _mm512_and_si512(_mm512_srli_epi16::<8>(q), nibble),
                _mm512_srli_epi16::<12>(q),
            ]
        }
    }

    #[inline(always)]
    unsafe fn quants_dup(q: *const u8) -> [__m512i; 2] {
        // SAFETY: `q` is 16 readable bytes; the caller guarantees AVX-512 F/BW.
        unsafe {
            // Every 128-bit lane holds the 16 bytes; lanes 2 and 3 shifted by a
            // nibble, so that byte j's low nibble there is its high one (element
            // 16 + j), then one nibble per byte.
            let q = _mm512_broadcast_i32x4(_mm_loadu_si128(q.cast()));
            let q = _mm512_srlv_epi32(
                q,
                _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4),
            );
            let q = _mm512_and_si512(q, _mm512_set1_epi8(0x0F));
            [
                _mm512_shuffle_epi8(q, const { dup_pairs(false, false) }),
                _mm512_shuffle_epi8(q, const { dup_pairs(true, false) }),
            ]
        }
    }

    #[inline(always)]
    unsafe fn quants_halves(q0: *const u8, q1: *const u8) -> [__m512i; 2] {
        // SAFETY: `q0` and `q1` are 16 readable bytes each; AVX-512 as above.
        unsafe {
            // The low nibbles of the 16-bit words are the even elements and
            // those of their high bytes the odd.
            let q = nibble_halves(q0, q1);
            let low = _mm512_set1_epi16(0x0F);
            [
                _mm512_and_si512(q, low),
                _mm512_and_si512(_mm512_srli_epi16::<8>(q), low),
            ]
        }
    }
}

impl Block16x2 for BlockQ8_0 {
    #[inline(always)]
    unsafe fn pair_unit(q: *const u8) -> [__m512i; 4] {
        // SAFETY: `q` is 64 readable bytes; AVX-512 as above.
        unsafe {
            let [e, o] = signed_halves(_mm512_loadu_si512(q.cast()));
            [e, o, _mm512_setzero_si512(), _mm512_setzero_si512()]
        }
    }

    #[inline(always)]
    unsafe fn quants_dup(q: *const u8) -> [__m512i; 2] {
        // SAFETY: `q` is 32 readable bytes; AVX-512 as above.
        signed_dup(unsafe { _mm256_loadu_si256(q.cast()) })
    }

    #[inline(always)]
    unsafe fn quants_halves(q0: *const u8, q1: *const u8) -> [__m512i; 2] {
        // SAFETY: `q0` and `q1` are 32 readable bytes each; AVX-512 as above.
        unsafe {
            signed_halves(_mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_loadu_si256(q0.cast())),
                _mm256_loadu_si256(q1.cast()),
            ))
        }
    }
}

impl Block16x2 for BlockQ5_0 {
    #[inline(always)]
    unsafe fn pair_unit(q: *const u8) -> [__m512i; 4] {
        // SAFETY: `q` is 80 readable bytes (the words, then four masks);
        // AVX-512 as above.
        unsafe {
            let mut out = BlockQ4_1::pair_unit(q);
            let sixteen = _mm512_set1_epi16(16);
            for (f, v) in out.iter_mut().enumerate() {
                let mask = q.add(64 + 4 * f).cast::<u32>().read_unaligned();
                *v = _mm512_mask_sub_epi16(*v, mask, *v, sixteen);
            }
            out
        }
    }

    #[inline(always)]
    unsafe fn quants_dup(q: *const u8) -> [__m512i; 2] {
        // SAFETY: `q` is 20 readable bytes (`qh`, then `qs`); AVX-512 as above.
        unsafe {
            let nib = nibbles_in_order(q.add(4));
            // `q - 16` is the nibble minus 16 where the fifth bit is clear.
            signed_dup(_mm256_mask_sub_epi8(
                nib,
                !fifth_bits(q),
                nib,
                _mm256_set1_epi8(16),
            ))
        }
    }

    #[inline(always)]
    unsafe fn quants_halves(q0: *const u8, q1: *const u8) -> [__m512i; 2] {
        // SAFETY: `q0` and `q1` are 20 readable bytes each; AVX-512 as above.
        unsafe {
            let high = u64::from(fifth_bits(q0)) | u64::from(fifth_bits(q1)) << 32;
            let nib = _mm512_and_si512(nibble_halves(q0.add(4), q1.add(4)), _mm512_set1_epi8(0x0F));
            signed_halves(_mm512_mask_sub_epi8(nib, !high, nib, _mm512_set1_epi8(16)))
        }
    }
}

/// Signed bytes in element order (32) as i16 with every 32-bit pair
/// duplicated, as [`Block16x2::quants_dup`].
#[inline(always)]
fn signed_dup(q: __m256i) -> [__m512i; 2] {
    // SAFETY: register operations; the callers run with AVX-512 F/BW enabled.
    unsafe {
        // Lanes [bytes 0..16, bytes 0..16, bytes 16..32, bytes 16..32]; each
        // byte shuffled into a word's high byte, then sign-extended.
        let q = _mm512_castsi256_si512(q);
        let q = _mm512_shuffle_i64x2::<0x50>(q, q);
        [
            _mm512_srai_epi16::<8>(_mm512_shuffle_epi8(q, const { dup_pairs(false, true) })),
            _mm512_srai_epi16::<8>(_mm512_shuffle_epi8(q, const { dup_pairs(true, true) })),
        ]
    }
}

/// Two blocks' signed bytes in element order, one per 256-bit half, as i16
/// words: the even elements, then the odd ([`Block16x2::quants_halves`]).
#[inline(always)]
fn signed_halves(q: __m512i) -> [__m512i; 2] {
    // SAFETY: register operations; the callers run with AVX-512 F/BW enabled.
    unsafe {
        [
            _mm512_srai_epi16::<8>(_mm512_slli_epi16::<8>(q)),
            _mm512_srai_epi16::<8>(q),
        ]
    }
}

/// The 256-bit tier's nibble halves of the 16 bytes at `q0` (low 256-bit
/// half) and of those at `q1` (high half): in each, byte `j`'s low nibble is
/// element `j` of its block in the low 128 bits and element `16 + j` in the high.
///
/// # Safety
/// `q0` and `q1` point at 16 readable bytes each; the CPU has AVX-512 F.
#[inline(always)]
unsafe fn nibble_halves(q0: *const u8, q1: *const u8) -> __m512i {
    // SAFETY: the caller's guarantees.
    unsafe {
        let lo = _mm256_broadcastsi128_si256(_mm_loadu_si128(q0.cast()));
        let hi = _mm256_broadcastsi128_si256(_mm_loadu_si128(q1.cast()));
        let q = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
        _mm512_srlv_epi32(
            q,
            _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4),
        )
    }
}

impl Block16x2 for SubQ4K {
    #[inline(always)]
    unsafe fn quants_dup(q: *const u8) -> [__m512i; 2] {
        // SAFETY: the nibbles are laid out as Q4_1's; the caller's guarantees.
        unsafe { BlockQ4_1::quants_dup(q) }
    }

    #[inline(always)]
    unsafe fn quants_halves(q0: *const u8, q1: *const u8) -> [__m512i; 2] {
        // SAFETY: as above.
        unsafe { BlockQ4_1::quants_halves(q0, q1) }
    }
}

impl Block16x2 for SubQ6K {
    #[inline(always)]
    unsafe fn quants_dup(q: *const u8) -> [__m512i; 2] {
        // SAFETY: signed bytes as Q8_0's; the caller's guarantees.
        unsafe { BlockQ8_0::quants_dup(q) }
    }

    #[inline(always)]
    unsafe fn quants_halves(q0: *const u8, q1: *const u8) -> [__m512i; 2] {
        // SAFETY: as above.
        unsafe { BlockQ8_0::quants_halves(q0, q1) }
    }
}

/// `acc + madd(a, b)` as one `vpdpwssd` (LLVM otherwise splits the intrinsic
/// into `vpmaddwd` and `vpaddd`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn dpwssd(mut acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
    // SAFETY: one instruction on register operands, which this function's
    // target features (checked by the tier's detection) include.
    unsafe {
        std::arch::asm!(
            "vpdpwssd {acc}, {a}, {b}",
            acc = inout(zmm_reg) acc,
            a = in(zmm_reg) a,
            b = in(zmm_reg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// Block `b` of an activation row: its 32 stored quants (evens, then odds).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn act_block(row: &Act16Row<'_>, b: usize) -> __m512i {
    let x: &[i16; 32] = row.q[32 * b..32 * b + 32].try_into().unwrap();
    // SAFETY: `x` is 64 readable bytes; `loadu` has no alignment requirement.
    unsafe { _mm512_loadu_si512(x.as_ptr().cast()) }
}

/// Eight consecutive values of `v` from `at`, widened to a 512-bit register
/// (the high half undefined).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn load8(v: &[f32], at: usize) -> __m512 {
    let v: &[f32; 8] = v[at..at + 8].try_into().unwrap();
    // SAFETY: `v` is 8 readable f32s; `loadu` has no alignment requirement.
    _mm512_castps256_ps512(unsafe { _mm256_loadu_ps(v.as_ptr()) })
}

/// A panel of rows' quants widened for [`tile_pairs`] ([`Block16x2::quants_dup`],
/// per row its blocks in order) and their heads ([`widen_heads`]), and the
/// activations of one fill of an [`Act16`] (`acts_id`, its [`Act16::fill_id`])
/// interleaved by pairs of tokens (per pair its blocks in order, `[even, odd]`
/// elements; and per pair and chunk of eight blocks the interleaved scales `s`
/// and sums `σ`), kept across calls: every unit of rows and every matrix of a
/// call takes the same activations.
#[derive(Default)]
struct PairScratch {
    quants: Vec<[__m512i; 2]>,
    heads: Vec<[__m512; 2]>,
    acts_id: u64,
    acts: Vec<[__m512i; 2]>,
    scales: Vec<[__m512; 2]>,
}

thread_local! {
    static PAIR_SCRATCH: std::cell::RefCell<PairScratch> =
        std::cell::RefCell::new(PairScratch::default());
}

/// Widens the quants of rows `rows` of `w` into `out`, row after row.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn widen_panel<B: Block16x2>(
    w: &F2Rows<'_, B>,
    rows: std::ops::Range<usize>,
    out: &mut Vec<[__m512i; 2]>,
) {
    let (nb, rb) = (w.nb, w.row_bytes());
    out.clear();
    for r in rows {
        for c in 0..nb.div_ceil(CHUNK) {
            let len = (nb - CHUNK * c).min(CHUNK);
            let at = r * rb + c * B::CHUNK_BYTES + B::HEAD_BYTES;
            let q = &w.bytes[at..at + len * B::QUANT_BYTES];
            for j in 0..len {
                // SAFETY: `q` holds `len` blocks' quants and j < len; AVX-512
                // F/BW are enabled here.
                out.push(unsafe { B::quants_dup(q.as_ptr().add(j * B::QUANT_BYTES)) });
            }
        }
    }
}

/// The heads of rows `rows` of `w` into `out` (per row, per chunk: its `d`s
/// and second heads, each duplicated lane by lane), once per panel rather
/// than in every tile that takes the row: the conversions, permutations and
/// their addressing were 12% of the batched product's time in a SmolLM2
/// prefill (rows of 576: three chunks per tile), 3% now.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn widen_heads<B: Block16x2>(
    w: &F2Rows<'_, B>,
    rows: std::ops::Range<usize>,
    out: &mut Vec<[__m512; 2]>,
) {
    out.clear();
    for r in rows {
        for c in 0..w.nb.div_ceil(CHUNK) {
            let (d, m) = match w.layout {
                F2Layout::Pairs => pairs::heads(w, r, c),
                F2Layout::Rows => f2_heads::<B>(&w.bytes[r * w.row_bytes() + c * B::CHUNK_BYTES..]),
            };
            out.push([
                _mm512_permutexvar_ps(DUP_LOW8, _mm512_castps256_ps512(d)),
                _mm512_permutexvar_ps(DUP_LOW8, _mm512_castps256_ps512(m)),
            ]);
        }
    }
}

/// Interleaves the rows of `acts` into `sc` by pairs of tokens (an odd last
/// token paired with itself): per pair each block's even and odd elements,
/// and per chunk the scales and sums. Nothing to do if `sc` holds them already.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn interleave_tokens(acts: &Act16, sc: &mut PairScratch) {
    if sc.acts_id == acts.fill_id() {
        return;
    }
    let (even, odd) = (const { interleave_idx(0) }, const { interleave_idx(8) });
    let (nb, n_tok) = (acts.n() / QK_ACT16, acts.rows());
    sc.acts.clear();
    sc.scales.clear();
    for t0 in (0..n_tok).step_by(2) {
        let (t, u) = (acts.row(t0), acts.row((t0 + 1).min(n_tok - 1)));
        for b in 0..nb {
            let (xt, xu) = (act_block(&t, b), act_block(&u, b));
            sc.acts.push([
                _mm512_permutex2var_epi32(xt, even, xu),
                _mm512_permutex2var_epi32(xt, odd, xu),
            ]);
        }
        for c in (0..nb).step_by(CHUNK) {
            let s = _mm512_permutex2var_ps(load8(t.scale, c), even, load8(u.scale, c));
            let sigma = _mm512_permutex2var_ps(load8(t.sum, c), even, load8(u.sum, c));
            sc.scales.push([s, sigma]);
        }
    }
    sc.acts_id = acts.fill_id();
}

/// One batched tile of order F2: `R` rows (their widened quants `quants` and
/// heads `heads`, [`widen_heads`]) against `TP` token pairs (interleaved in
/// `acts` and `scales`), `R·TP` registers of two accumulators. Per chunk of
/// eight blocks each (row, pair)'s products `d·s` are formed sixteen wide;
/// per block each row's quants and each pair's activations are loaded once.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // r and p index several arrays at once
fn tile_pairs<B: Block16x2, const R: usize, const TP: usize>(
    quants: [&[[__m512i; 2]]; R],
    heads: [&[[__m512; 2]]; R],
    acts: [&[[__m512i; 2]]; TP],
    scales: [&[[__m512; 2]]; TP],
) -> [[[f32; 2]; TP]; R] {
    let nb = quants[0].len();
    let n_chunks = nb.div_ceil(CHUNK);
    let mut acc = [[_mm512_setzero_ps(); TP]; R];
    let mut cs = [[_mm512_setzero_ps(); TP]; R];
    // A split block's second scales, `d2·s`.
    let mut cs2 = [[_mm512_setzero_ps(); TP]; R];
    // One loop over the blocks, each chunk's products formed at its first
    // block: as a loop over chunks around one over their blocks, LLVM copied
    // the R·TP accumulators between two register sets at the end of every
    // block (11-12 moves per 48 operations; 3-5% of the tile on Emerald Rapids).
    for b in 0..nb {
        let (c, j) = (b / CHUNK, b % CHUNK);
        if j == 0 {
            for r in 0..R {
                let [d, m] = heads[r][c];
                for p in 0..TP {
                    let s = scales[p][c][0];
                    cs[r][p] = _mm512_mul_ps(d, s);
                    if B::SPLIT {
                        cs2[r][p] = _mm512_mul_ps(m, s);
                    }
                }
            }
        }
        let (csp, cs2p) = (cs.as_ptr().cast::<f64>(), cs2.as_ptr().cast::<f64>());
        // A loop: a closure would not inline (see `pairs::tile`).
        let mut x = [[_mm512_setzero_si512(); 2]; TP];
        for p in 0..TP {
            x[p] = acts[p][b];
        }
        for r in 0..R {
            let [we, wo] = quants[r][b];
            for p in 0..TP {
                let sums = dpwssd(_mm512_madd_epi16(we, x[p][0]), wo, x[p][1]);
                let at = (r * TP + p) * CHUNK + j;
                // SAFETY: `cs` holds R·TP vectors of 16 floats, 8 pairs each;
                // (r·TP + p)·8 + j indexes pair j of vector (r, p).
                let mut cb = _mm512_castpd_ps(_mm512_set1_pd(unsafe { *csp.add(at) }));
                if B::SPLIT {
                    // Lanes 4..8 of both tokens: the upper eight.
                    // SAFETY: `cs2` is laid out as `cs`.
                    let c2 = _mm512_castpd_ps(_mm512_set1_pd(unsafe { *cs2p.add(at) }));
                    cb = _mm512_mask_blend_ps(0xFF00, cb, c2);
                }
                acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), cb, acc[r][p]);
            }
        }
    }
    // The m·σ terms in a pass of their own, as in `pairs::tile`: R·TP fewer
    // registers live through the hot loop above, same bits.
    let mut macc = [[_mm512_setzero_ps(); TP]; R];
    if B::HAS_MIN {
        for c in 0..n_chunks {
            for r in 0..R {
                let m = heads[r][c][1];
                for p in 0..TP {
                    macc[r][p] = _mm512_fmadd_ps(m, scales[p][c][1], macc[r][p]);
                }
            }
        }
    }
    interleaved_sums(acc, B::HAS_MIN.then_some(macc))
}

/// The two tiles' results whose registers hold two interleaved accumulators
/// ([`tile_pairs`]: two tokens; [`pairs::tile`]: two rows): each register
/// (plus its `m·σ` register where the block has a minimum) back in halves,
/// then both halves' lane sums.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // x and y index several arrays at once
fn interleaved_sums<const X: usize, const Y: usize>(
    acc: [[__m512; Y]; X],
    macc: Option<[[__m512; Y]; X]>,
) -> [[[f32; 2]; Y]; X] {
    let mut halves = [[_mm512_setzero_ps(); Y]; X];
    for x in 0..X {
        for y in 0..Y {
            let v = match macc {
                Some(m) => _mm512_add_ps(acc[x][y], m[x][y]),
                None => acc[x][y],
            };
            halves[x][y] = _mm512_permutexvar_ps(DEINTERLEAVE, v);
        }
    }
    let mut out = [[[0.0f32; 2]; Y]; X];
    // Times 1: exact.
    reduce_pairs(
        halves.as_flattened(),
        1.0,
        out.as_flattened_mut().as_flattened_mut(),
    );
    out
}

/// One decode tile of order F2: the row pairs `rows` (indices into `w`, one
/// row per 256-bit half) against one token, `RP` accumulators. Per chunk the
/// pair's `d`s and `m`s are one load each and its products `d·s` sixteen wide;
/// per block the token's activations are broadcast to both halves once for all
/// rows, and each pair's scales put in place by one permutation. Each row's
/// successor `ahead` rows on (the same stream of [`gem16`]'s decode walk) is
/// prefetched over the chunks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // r indexes several arrays at once
fn tile_rows<B: Block16x2, const RP: usize, const T: usize>(
    w: &F2Rows<'_, B>,
    rows: [[usize; 2]; RP],
    toks: [&Act16Row<'_>; T],
    ahead: usize,
) -> [[[f32; 2]; RP]; T] {
    let (nb, rb) = (w.nb, w.row_bytes());
    let n_chunks = nb.div_ceil(CHUNK);
    // Filled by a loop: as a closure over `rows` LLVM did not inline it (5% of
    // decode time).
    let mut prefetch = [[Prefetch::NONE; 2]; RP];
    for (p, pair) in prefetch.iter_mut().zip(&rows) {
        for (p, &r) in p.iter_mut().zip(pair) {
            *p = Prefetch::new(&w.bytes[r * rb..][..rb], ahead, n_chunks);
        }
    }
    let mut acc = [[_mm512_setzero_ps(); RP]; T];
    let mut macc = [[_mm512_setzero_ps(); RP]; T];
    let both = |v: __m512| _mm512_shuffle_f32x4::<0x44>(v, v);
    for c in 0..n_chunks {
        for p in prefetch.as_flattened() {
            p.step(c);
        }
        let len = (nb - CHUNK * c).min(CHUNK);
        let mut cs = [[_mm512_setzero_ps(); RP]; T];
        // A split block's second scales, `d2·s`.
        let mut cs2 = [[_mm512_setzero_ps(); RP]; T];
        let mut quants = [[std::ptr::null::<u8>(); 2]; RP];
        for r in 0..RP {
            let mut heads = [(_mm256_setzero_ps(), _mm256_setzero_ps()); 2];
            for h in 0..2 {
                let chunk = &w.bytes[rows[r][h] * rb + c * B::CHUNK_BYTES..]
                    [..B::HEAD_BYTES + len * B::QUANT_BYTES];
                quants[r][h] = chunk[B::HEAD_BYTES..].as_ptr();
                heads[h] = f2_heads::<B>(chunk);
            }
            let pair = |a: __m256, b: __m256| {
                _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                    _mm512_castpd256_pd512(_mm256_castps_pd(a)),
                    _mm256_castps_pd(b),
                ))
            };
            let (d, second) = (pair(heads[0].0, heads[1].0), pair(heads[0].1, heads[1].1));
            for t in 0..T {
                let s = both(load8(toks[t].scale, CHUNK * c));
                cs[t][r] = _mm512_mul_ps(d, s);
                if B::SPLIT {
                    cs2[t][r] = _mm512_mul_ps(second, s);
                }
                if B::HAS_MIN {
                    let sigma = both(load8(toks[t].sum, CHUNK * c));
                    macc[t][r] = _mm512_fmadd_ps(second, sigma, macc[t][r]);
                }
            }
        }
        for j in 0..len {
            let b = CHUNK * c + j;
            let pick = _mm512_add_epi32(
                if B::SPLIT {
                    // Lanes 4..8 of each row from the second scales (indices 16..).
                    _mm512_setr_epi32(0, 0, 0, 0, 16, 16, 16, 16, 8, 8, 8, 8, 24, 24, 24, 24)
                } else {
                    _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8)
                },
                _mm512_set1_epi32(j as i32),
            );
            // Each row pair's quants widened once for the T tokens.
            let mut wq = [[_mm512_setzero_si512(); 2]; RP];
            for r in 0..RP {
                // SAFETY: both rows' chunk slices hold `len` blocks' quants after
                // their heads, and j < len; AVX-512 F/BW are enabled here.
                wq[r] = unsafe {
                    B::quants_halves(
                        quants[r][0].add(j * B::QUANT_BYTES),
                        quants[r][1].add(j * B::QUANT_BYTES),
                    )
                };
            }
            for t in 0..T {
                let x: &[i16; 32] = toks[t].q[32 * b..32 * b + 32].try_into().unwrap();
                // SAFETY: `x` is 64 readable bytes, read as two halves of 32.
                let (xe, xo) = unsafe {
                    (
                        _mm512_broadcast_i64x4(_mm256_loadu_si256(x.as_ptr().cast())),
                        _mm512_broadcast_i64x4(_mm256_loadu_si256(x.as_ptr().add(16).cast())),
                    )
                };
                for r in 0..RP {
                    let sums = dpwssd(_mm512_madd_epi16(wq[r][0], xe), wq[r][1], xo);
                    let cb = if B::SPLIT {
                        _mm512_permutex2var_ps(cs[t][r], pick, cs2[t][r])
                    } else {
                        _mm512_permutexvar_ps(pick, cs[t][r])
                    };
                    acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), cb, acc[t][r]);
                }
            }
        }
    }
    if B::HAS_MIN {
        for (a, m) in acc.as_flattened_mut().iter_mut().zip(macc.as_flattened()) {
            *a = _mm512_add_ps(*a, *m);
        }
    }
    let mut out = [[[0.0f32; 2]; RP]; T];
    // Times 1: exact.
    reduce_pairs(
        acc.as_flattened(),
        1.0,
        out.as_flattened_mut().as_flattened_mut(),
    );
    out
}

/// One tile of [`gem16`]'s decode walk: its rows (one of each stretch) and
/// where their results go.
struct DecodeTile<'a, 'b, B> {
    w: &'a F2Rows<'b, B>,
    rows: [[usize; 2]; DECODE_PAIRS],
    ahead: usize,
    stretch: usize,
    i: usize,
}

impl<B: Block16x2> DecodeTile<'_, '_, B> {
    /// Tokens `t0..t0 + T` of `toks` against the tile's rows; returns `T`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn tokens<const T: usize>(&self, toks: &[Act16Row<'_>], t0: usize, out: &mut [f32]) -> usize {
        let n_rows = self.w.n_rows;
        let group: [&Act16Row<'_>; T] = std::array::from_fn(|t| &toks[t0 + t]);
        let v = tile_rows::<B, DECODE_PAIRS, T>(self.w, self.rows, group, self.ahead);
        for (t, v) in v.iter().enumerate() {
            for (k, v) in v.as_flattened().iter().enumerate() {
                let r = k * self.stretch + self.i;
                if r < n_rows {
                    out[(t0 + t) * n_rows + r] = *v;
                }
            }
        }
        T
    }
}

/// The batched tile of [`gem16`]: [`TILE_ROWS`] rows x [`TILE_PAIRS`] pairs of
/// tokens (12 registers of accumulators, 8 of interleaved activations, the
/// row's two of quants). Measured on Zen 5 (1 thread, 256 tokens against Q4_1
/// rows of 576 and 1536): 3x4 91-96 MAC/ns, 4x3 78-97, 4x4 74-90 (spills the
/// loop's registers), 2x6, 3x5, 5x3 and 6x2 57-91; the AVX2 tier's 2x6 42-50.
/// On Emerald Rapids (the same, best of 5) 3x4 56-64, 2x4 and 2x6 55-64, 3x3
/// and 4x3 53-64, 4x2 48-58.
const TILE_ROWS: usize = 3;
const TILE_PAIRS: usize = 4;
/// Row pairs of the decode tile (4 rows: measured as fast as 8, and faster
/// than 2).
const DECODE_PAIRS: usize = 2;
/// The decode tile's rows are one from each of this many stretches of the
/// rows: sequential streams the L2 prefetcher follows side by side. One core
/// of a Sapphire Rapids VM reads memory at 8-10 GB/s in one stream and 13-18
/// in four.
const DECODE_STREAMS: usize = 2 * DECODE_PAIRS;
/// How far ahead (in bytes, rounded down to rows) each decode stream requests
/// its rows.
const PREFETCH_BYTES: usize = 2048;

/// Rows per stretch of the decode walk: at least a [`DECODE_STREAMS`]th of
/// `n_rows`, and a length whose byte distance between streams is not near a
/// multiple of 4 KiB. Streams that far apart alias in the L1 sets and the
/// load/store disambiguation: rows of 384 bytes in four stretches of 12288
/// (exactly 1152 pages apart) ran the decode tile 1.7-2x slower than one
/// stream, the same with the stretches moved apart 10% faster.
/// Lengths whose distance is a multiple of 4 KiB for every length (rows of a
/// whole number of pages) keep the shortest: the search adds at most an
/// eighth of it, so the rows the last stretch repeats stay few.
fn stream_stretch(n_rows: usize, row_bytes: usize) -> usize {
    let shortest = n_rows.div_ceil(DECODE_STREAMS);
    (shortest..=shortest + shortest / 8)
        .find(|s| (1024..=3072).contains(&(s * row_bytes % 4096)))
        .unwrap_or(shortest)
}
/// Up to this many tokens run the decode tile ([`tile_rows`]) in groups of
/// [`decode_group`] tokens rather than the batched tiles, whose widening of
/// every panel costs as much as about six decode tiles (Zen 5, rows of 576 and
/// 1536: 2 tokens 120 -> 40 us, 4 tokens 120 -> 80 us).
const FEW_TOKENS: usize = 8;

/// Tokens of the next decode tile when `left` are still to run: all of them up
/// to five, else four. A tile widens each row's quants once for its tokens;
/// Sapphire Rapids, one thread, 576x1536 Q4_1, 4 tokens: 179 us one at a time,
/// 140 in pairs, 100 as one group (the batched tiles: 275); 5 as one group
/// 133, as 4 + 1 147.
fn decode_group(left: usize) -> usize {
    if left <= 5 {
        left
    } else {
        4
    }
}
/// Packed weight bytes per panel of the batched path (widened to eight times
/// that for the tiles, in L2): 24-96 KiB measured alike, 16 KiB slower.
const PANEL_BYTES: usize = 48 * 1024;

/// [`crate::act16::gemm_q4_1_ref`] and its Q8_0 twin on packed rows against
/// every row of `acts`. Rows in pairs ([`F2Layout::Pairs`]): up to
/// [`FEW_TOKENS`] tokens by [`pairs::decode`], more by the batched tiles over
/// panels widened from the pairs. Rows one after the other: one token,
/// [`DECODE_PAIRS`] pairs of rows per tile.
/// More: groups of up to `2·TILE_PAIRS` tokens, each walking a panel of rows
/// [`TILE_ROWS`] at a time. A tile short of rows or tokens repeats the last
/// one and drops those results.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn gem16<B: Block16x2>(w: F2Rows<'_, B>, acts: &Act16, out: &mut [f32]) {
    let (n_rows, n_tok) = (w.n_rows, acts.rows());
    if n_rows == 0 {
        return;
    }
    let last = n_rows - 1;
    let pairs = w.layout == F2Layout::Pairs;
    if pairs && n_tok <= FEW_TOKENS {
        return pairs::decode(&w, acts, out);
    }
    if n_tok <= FEW_TOKENS {
        // One token, or batched decode's few: each tile of rows against the
        // tokens in groups, the quants widened once per group (and in L1 from
        // one group to the next). The tile's rows come from DECODE_STREAMS
        // stretches of the rows, one row of each, so that the reads are that
        // many sequential streams.
        let toks: Vec<Act16Row<'_>> = (0..n_tok).map(|t| acts.row(t)).collect();
        let stretch = stream_stretch(n_rows, w.row_bytes());
        let ahead = (PREFETCH_BYTES / w.row_bytes()).max(1);
        for i in 0..stretch {
            let row = |k: usize| (k * stretch + i).min(last);
            let rows = std::array::from_fn(|p| [row(2 * p), row(2 * p + 1)]);
            let mut t0 = 0;
            while t0 < n_tok {
                let walk = DecodeTile {
                    w: &w,
                    rows,
                    ahead,
                    stretch,
                    i,
                };
                t0 += match decode_group(n_tok - t0) {
                    1 => walk.tokens::<1>(&toks, t0, out),
                    2 => walk.tokens::<2>(&toks, t0, out),
                    3 => walk.tokens::<3>(&toks, t0, out),
                    4 => walk.tokens::<4>(&toks, t0, out),
                    _ => walk.tokens::<5>(&toks, t0, out),
                };
            }
        }
        return;
    }
    // Panels of whole pairs in the pair layout.
    let (row_bytes, align) = match pairs {
        true => (f2_pair_bytes::<B>(w.nb) / 2, 2 * TILE_ROWS),
        false => (w.row_bytes(), TILE_ROWS),
    };
    let panel_rows = (PANEL_BYTES / row_bytes).max(1).next_multiple_of(align);
    let (nb, n_chunks, n_pairs) = (w.nb, w.nb.div_ceil(CHUNK), n_tok.div_ceil(2));
    PAIR_SCRATCH.with_borrow_mut(|sc| {
        interleave_tokens(acts, sc);
        for p0 in (0..n_rows).step_by(panel_rows) {
            let p1 = (p0 + panel_rows).min(n_rows);
            match pairs {
                true => pairs::widen_panel(&w, p0..p1, &mut sc.quants),
                false => widen_panel(&w, p0..p1, &mut sc.quants),
            }
            widen_heads(&w, p0..p1, &mut sc.heads);
            for g0 in (0..n_pairs).step_by(TILE_PAIRS) {
                // Pairs g0.. of the group, the last one repeated past the end.
                let (mut acts, mut scales) = ([&[][..]; TILE_PAIRS], [&[][..]; TILE_PAIRS]);
                for k in 0..TILE_PAIRS {
                    let p = (g0 + k).min(n_pairs - 1);
                    acts[k] = &sc.acts[p * nb..(p + 1) * nb];
                    scales[k] = &sc.scales[p * n_chunks..(p + 1) * n_chunks];
                }
                let (t0, n_t) = (2 * g0, (n_tok - 2 * g0).min(2 * TILE_PAIRS));
                for r0 in (p0..p1).step_by(TILE_ROWS) {
                    let (mut quants, mut heads) = ([&[][..]; TILE_ROWS], [&[][..]; TILE_ROWS]);
                    for k in 0..TILE_ROWS {
                        let r = (r0 + k).min(p1 - 1) - p0;
                        quants[k] = &sc.quants[r * nb..(r + 1) * nb];
                        heads[k] = &sc.heads[r * n_chunks..(r + 1) * n_chunks];
                    }
                    let v = tile_pairs::<B, TILE_ROWS, TILE_PAIRS>(quants, heads, acts, scales);
                    let n_r = (p1 - r0).min(TILE_ROWS);
                    for (r, v) in v.iter().enumerate().take(n_r) {
                        for (t, v) in v.as_flattened().iter().enumerate().take(n_t) {
                            out[(t0 + t) * n_rows + r0 + r] = *v;
                        }
                    }
                }
            }
        }
    });
}

/// [`crate::act16::gemm_q4_1_ref`] and [`crate::act16::gemm_q8_0_ref`] on
/// packed rows: the table entry.
pub(super) fn gemm_act16<B: Block16x2>(w: F2Rows<'_, B>, acts: &Act16, out: &mut [f32]) {
    crate::act16::check_gemm_rows(&w, acts, out.len());
    // SAFETY: the tier is handed out only after detection (see `super`); the
    // shapes were checked.
    unsafe { gem16(w, acts, out) }
}

/// [`crate::act16::quantize_row_ref`]: the same per-block operations, sixteen
/// lanes at a time; the block maximum and the non-finite test reduced across
/// lanes (both are independent of the order), the quants rounded by `cvtps`
/// (ties to even, as the scalar) and saturated by `vpmovsdw` (as its clamp).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn quant_act16(x: &[f32], q: &mut [i16], scale: &mut [f32], sum: &mut [f32]) {
    let (evens, odds) = (
        lanes([0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30]),
        lanes([1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31]),
    );
    for (((xb, qb), s), sigma) in x
        .chunks_exact(QK_ACT16)
        .zip(q.chunks_exact_mut(QK_ACT16))
        .zip(scale)
        .zip(sum)
    {
        let xb: &[f32; QK_ACT16] = xb.try_into().unwrap();
        // SAFETY: `xb` is 32 readable f32s, read as two halves of 16.
        let v = unsafe {
            [
                _mm512_loadu_ps(xb.as_ptr()),
                _mm512_loadu_ps(xb.as_ptr().add(16)),
            ]
        };
        // `max` returns its second operand for a NaN lane, so NaN is skipped;
        // `v·0` is ±0 for finite values and NaN otherwise, added to +0.
        let (mut amax, mut non_finite) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for &v in &v {
            amax = _mm512_max_ps(_mm512_abs_ps(v), amax);
            non_finite = _mm512_add_ps(non_finite, _mm512_mul_ps(v, _mm512_setzero_ps()));
        }
        let amax = _mm512_reduce_max_ps(amax);
        let inv = _mm512_set1_ps(if amax > 0.0 { ACT16_MAX / amax } else { 0.0 });
        let i = [
            _mm512_cvtps_epi32(_mm512_mul_ps(v[0], inv)),
            _mm512_cvtps_epi32(_mm512_mul_ps(v[1], inv)),
        ];
        let stored = [
            _mm512_permutex2var_epi32(i[0], evens, i[1]),
            _mm512_permutex2var_epi32(i[0], odds, i[1]),
        ];
        for (part, v) in qb.chunks_exact_mut(16).zip(stored) {
            // SAFETY: `part` is 16 writable i16s (32 bytes); `storeu` is unaligned.
            unsafe { _mm256_storeu_si256(part.as_mut_ptr().cast(), _mm512_cvtsepi32_epi16(v)) };
        }
        let total = _mm512_reduce_add_epi32(_mm512_add_epi32(i[0], i[1]));
        *s = amax / ACT16_MAX + _mm512_reduce_add_ps(non_finite);
        *sigma = *s * total as f32;
    }
}

/// [`crate::act16::quantize_row_ref`]: the table entry.
pub(super) fn quantize_act16(x: &[f32], q: &mut [i16], scale: &mut [f32], sum: &mut [f32]) {
    crate::act16::check_quantize(x.len(), q.len(), scale.len(), sum.len());
    // SAFETY: the tier is handed out only after detection (see `super`).
    unsafe { quant_act16(x, q, scale, sum) }
}
