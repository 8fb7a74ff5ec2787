//! Order F1 of [`crate::fast`] (the fast path's f32 products) and f16 widening
//! on AVX-512 F.
//!
//! A register tile of [`crate::fast::gemm_tile_ref`] holds one 8-lane FMA
//! accumulator per (row, token); here two rows of a tile share a 512-bit
//! register, one per 256-bit half, against each token's vector broadcast to
//! both halves from memory, so a 3 x 3 tile takes six FMAs per eight elements
//! instead of nine and one shuffle (the row pair) where pairing tokens took
//! three. A tile of one row has nothing to pair and is the AVX2 tier's.

use std::arch::x86_64::*;

use super::super::avx2::{self, hsum_lanes};
use super::reduce_pairs;

/// [`crate::fast::gemm_tile_ref`]: the table entry.
pub(super) fn gemm_tile(w: &[f32], x: &[f32], k: usize, out: &mut [f32]) {
    let (rows, toks) = crate::fast::check_tile(w.len(), x.len(), k, out.len());
    if rows == 1 || !k.is_multiple_of(8) {
        return avx2::gemm_tile(w, x, k, out);
    }
    // SAFETY: the tier is handed out only after detection (see `super`);
    // `check_tile`, `rows > 1` and the `k % 8` test establish the shapes `tile`
    // requires.
    unsafe { super::super::dispatch_tile!(tile, rows, toks, (w, x, k, out)) }
}

/// [`crate::fast::gemm_tile_ref`] for `R` rows x `T` tokens: rows `2p` and
/// `2p + 1` in the halves of `T` registers per pair, an odd last row in `T`
/// 256-bit ones.
///
/// # Safety
/// `w.len() == R·k`, `x.len() == T·k`, `out.len() == R·T`, `k % 8 == 0`,
/// `R >= 2`, and the CPU has AVX-512 F and FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // p and t index several arrays at once
unsafe fn tile<const R: usize, const T: usize>(w: &[f32], x: &[f32], k: usize, out: &mut [f32]) {
    debug_assert!(
        w.len() == R * k && x.len() == T * k && out.len() == R * T && k.is_multiple_of(8) && R >= 2
    );
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    // At most two row pairs (R <= 4).
    let mut pairs = [[_mm512_setzero_ps(); T]; 2];
    let mut last = [_mm256_setzero_ps(); T];
    for c in (0..k).step_by(8) {
        // SAFETY: 2p + 1 < R and c + 8 <= k: inside `w` (R·k).
        let wv: [__m512; 2] = std::array::from_fn(|p| unsafe {
            let lo = _mm256_castps_pd(_mm256_loadu_ps(wp.add(2 * p * k + c)));
            let hi = _mm256_castps_pd(_mm256_loadu_ps(wp.add((2 * p + 1).min(R - 1) * k + c)));
            _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castpd256_pd512(lo), hi))
        });
        // SAFETY: as above, for the last row.
        let wl = unsafe { _mm256_loadu_ps(wp.add((R - 1) * k + c)) };
        for t in 0..T {
            // SAFETY: t < T and c + 8 <= k: inside `x` (T·k).
            let xv = unsafe {
                _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(
                    xp.add(t * k + c),
                ))))
            };
            for p in 0..R / 2 {
                pairs[p][t] = _mm512_fmadd_ps(wv[p], xv, pairs[p][t]);
            }
            if R % 2 == 1 {
                last[t] = _mm256_fmadd_ps(wl, _mm512_castps512_ps256(xv), last[t]);
            }
        }
    }
    for p in 0..R / 2 {
        let mut sums = [[0.0f32; 2]; T];
        reduce_pairs(&pairs[p], 1.0, sums.as_flattened_mut());
        for (t, s) in sums.iter().enumerate() {
            out[t * R + 2 * p] = s[0];
            out[t * R + 2 * p + 1] = s[1];
        }
    }
    if R % 2 == 1 {
        for (t, a) in last.iter().enumerate() {
            out[t * R + R - 1] = hsum_lanes(*a);
        }
    }
}

/// [`crate::attn::widen_f16_ref`], sixteen at a time (`vcvtph2ps` is exact);
/// the last `n % 16` by the AVX2 tier.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn widen16(src: &[u16], dst: &mut [f32]) {
    let whole = src.len() / 16 * 16;
    for (d, s) in dst[..whole].chunks_exact_mut(16).zip(src.chunks_exact(16)) {
        // SAFETY: `s` is 16 u16s (32 bytes) to read and `d` 16 f32s to write;
        // `loadu`/`storeu` have no alignment requirement.
        unsafe {
            _mm512_storeu_ps(
                d.as_mut_ptr(),
                _mm512_cvtph_ps(_mm256_loadu_si256(s.as_ptr().cast())),
            )
        };
    }
    avx2::widen_f16(&src[whole..], &mut dst[whole..]);
}

/// [`crate::attn::widen_f16_ref`]: the table entry.
pub(super) fn widen_f16(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen_f16 lengths");
    // SAFETY: the tier is handed out only after detection (see `super`).
    unsafe { widen16(src, dst) }
}
