//! The Q8 path's Q4_1 products ([`crate::q8_matvec`], llama.cpp's numerics) on
//! AVX-512 VNNI, from the packed rows of [`crate::act16::F2Matrix`]: the AVX2
//! tier's loops ([`gemq_q4_1_with`]: four rows' serial sums in one register,
//! activations prepared once per token), with each block's exact integer sum
//! formed by `vpdpbusd`. Four blocks' quants are one 512-bit load, their low
//! and high nibbles meet the four blocks' activation halves in two `vpdpbusd`
//! (unsigned nibbles times signed quants, four products per 32-bit lane, no
//! intermediate rounding or saturation), and two shuffles sum each block's four
//! lanes; the float terms and the serial sum are the AVX2 tier's operations.

use std::arch::x86_64::*;

use super::super::avx2::{f2_heads, gemq_q4_1_with, q4_1_terms, Q4_1Terms, Q8Acts, GEMQ_SCRATCH};
use crate::act16::{F2Block, F2Rows};
use crate::q4_1::BlockQ4_1;
use crate::q8_0::BlockQ8_0;

/// Up to eight blocks of one packed Q4_1 row: their quant bytes, four blocks
/// per register (zeros past the row's end), and their `d` and `m`.
#[derive(Clone, Copy)]
pub(super) struct Quads {
    q: [__m512i; 2],
    d: __m256,
    m: __m256,
}

/// The VNNI terms of packed Q4_1 rows.
pub(super) struct VnniTerms;

impl Q4_1Terms<F2Rows<'_, BlockQ4_1>> for VnniTerms {
    type Chunk = Quads;

    #[inline(always)]
    unsafe fn unpack(w: &F2Rows<'_, BlockQ4_1>, r: usize, c: usize, len: usize) -> Quads {
        // SAFETY: the caller guarantees this tier's features.
        unsafe { unpack(w, r, c, len) }
    }

    #[inline(always)]
    unsafe fn terms(x: &Quads, len: usize, y: &Q8Acts) -> __m256 {
        // SAFETY: as above.
        unsafe { terms(x, len, y) }
    }
}

/// Row `r`'s blocks `8c..8c + len` of `w`: one load of the chunk's `d`s and
/// one of its `m`s, and the blocks' quants (they lie back to back), a short
/// chunk's by a masked load that reads only its bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn unpack(w: &F2Rows<'_, BlockQ4_1>, r: usize, c: usize, len: usize) -> Quads {
    const HEAD: usize = <BlockQ4_1 as F2Block>::HEAD_BYTES;
    let at = r * w.row_bytes() + c * <BlockQ4_1 as F2Block>::CHUNK_BYTES;
    let chunk = &w.bytes[at..at + HEAD + 16 * len];
    let (d, m) = f2_heads::<BlockQ4_1>(chunk);
    let qs = &chunk[HEAD..];
    let q = std::array::from_fn(|k| {
        let part = &qs[(64 * k).min(qs.len())..];
        if part.len() >= 64 {
            // SAFETY: `part` holds 64 readable bytes; `loadu` is unaligned.
            unsafe { _mm512_loadu_si512(part.as_ptr().cast()) }
        } else {
            // SAFETY: the mask selects the `part.len()` (< 64) bytes `part`
            // holds; a masked load reads no other byte.
            unsafe { _mm512_maskz_loadu_epi8((1u64 << part.len()) - 1, part.as_ptr().cast()) }
        }
    });
    Quads { q, d, m }
}

/// The chunk's terms (see the module docs).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn terms(x: &Quads, len: usize, y: &Q8Acts) -> __m256 {
    let low = _mm512_set1_epi8(0x0F);
    let mut sums = [_mm512_setzero_si512(); 2];
    for (k, s) in sums.iter_mut().enumerate().take(len.div_ceil(4)) {
        // SAFETY: `lo` and `hi` are 4 vectors (128 bytes) each, read as two
        // halves of 64; `loadu` has no alignment requirement.
        let (ylo, yhi) = unsafe {
            (
                _mm512_loadu_si512(y.lo.as_ptr().add(2 * k).cast()),
                _mm512_loadu_si512(y.hi.as_ptr().add(2 * k).cast()),
            )
        };
        let q = x.q[k];
        let v = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(q, low), ylo);
        let v = _mm512_dpbusd_epi32(v, _mm512_and_si512(_mm512_srli_epi16::<4>(q), low), yhi);
        // Each 128-bit lane is one block: its four partial sums added in all four.
        let v = _mm512_add_epi32(v, _mm512_shuffle_epi32::<0xB1>(v));
        *s = _mm512_add_epi32(v, _mm512_shuffle_epi32::<0x4E>(v));
    }
    let sumi = _mm512_permutex2var_epi32(
        sums[0],
        _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0),
        sums[1],
    );
    let sumi = _mm256_cvtepi32_ps(_mm512_castsi512_si256(sumi));
    q4_1_terms(x.d, x.m, sumi, y)
}

/// [`crate::q8_matvec::gemm_q4_1_q8_0_f2_ref`] on this tier.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn gemq_f2(w: F2Rows<'_, BlockQ4_1>, nb: usize, y: &[BlockQ8_0], out: &mut [f32]) {
    // SAFETY: this tier's features are enabled here (and in the closure, which
    // inherits them); the caller checked the shapes.
    GEMQ_SCRATCH.with_borrow_mut(|sc| unsafe { gemq_q4_1_with::<_, VnniTerms>(w, nb, y, out, sc) })
}

/// [`crate::q8_matvec::gemm_q4_1_q8_0_f2_ref`]: the table entry.
pub(super) fn gemm_q4_1_q8_0_f2(w: F2Rows<'_, BlockQ4_1>, y: &[BlockQ8_0], out: &mut [f32]) {
    let nb = crate::q8_matvec::check_gemm_f2(&w, y, out.len());
    // SAFETY: the tier is handed out only after detection (see `super`); the
    // shapes were checked.
    unsafe { gemq_f2(w, nb, y, out) }
}
