//! The grouped attention tile step ([`crate::attn::attn_group_ref`]) on
//! AVX-512 F, bit-identical to the reference for finite inputs.
//!
//! Scores are order F1 (one 8-lane FMA accumulator per query and position), so
//! a 512-bit register holds two positions' accumulators, one per 256-bit half:
//! each K vector is two rows' 8 elements side by side (for f16 rows, widened by
//! one 16-wide `vcvtph2ps`), each query vector its 8 elements in both halves.
//! The V accumulation has no lane structure (lane `d` sums over the positions
//! in order), so it simply runs 16 dimensions per register and a whole head of
//! 64 for up to four queries in the 32 registers. The softmax step between the
//! two is the AVX2 tier's.

use std::arch::x86_64::*;

use super::super::avx2::{accumulate_v, prefetch_rows_ahead, softmax_step, KvLanes};
use crate::attn::Running;

/// K/V elements read 16 at a time (V) or as two rows' 8 (K).
pub(super) trait KvLanes16: KvLanes {
    /// Sixteen consecutive elements at `p`, as f32.
    ///
    /// # Safety
    /// `p` points at 16 readable elements and the CPU has AVX-512 F.
    unsafe fn load16(p: *const Self) -> __m512;

    /// Eight elements at `p0` (low half) and eight at `p1` (high half), as f32.
    ///
    /// # Safety
    /// `p0` and `p1` point at 8 readable elements each and the CPU has AVX-512 F.
    unsafe fn load8x2(p0: *const Self, p1: *const Self) -> __m512;
}

impl KvLanes16 for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> __m512 {
        // SAFETY: the caller guarantees 16 readable f32s and AVX-512 F.
        unsafe { _mm512_loadu_ps(p) }
    }

    #[inline(always)]
    unsafe fn load8x2(p0: *const f32, p1: *const f32) -> __m512 {
        // SAFETY: the caller guarantees 8 readable f32s at each and AVX-512 F.
        unsafe {
            _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(p0))),
                _mm256_castps_pd(_mm256_loadu_ps(p1)),
            ))
        }
    }
}

impl KvLanes16 for u16 {
    #[inline(always)]
    unsafe fn load16(p: *const u16) -> __m512 {
        // SAFETY: the caller guarantees 16 readable u16s (32 bytes) and AVX-512 F.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }

    #[inline(always)]
    unsafe fn load8x2(p0: *const u16, p1: *const u16) -> __m512 {
        // SAFETY: the caller guarantees 8 readable u16s (16 bytes) at each and
        // AVX-512 F.
        unsafe {
            _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(
                _mm256_castsi128_si256(_mm_loadu_si128(p0.cast())),
                _mm_loadu_si128(p1.cast()),
            ))
        }
    }
}

/// Queries per chunk of [`attn_group`]: each K and V vector is loaded once for
/// a chunk.
const MAX_QUERIES: usize = 4;

/// [`crate::attn::attn_group_ref`]: the `st.len()` queries of one KV head's
/// group over `n` rows of `hd` elements, in chunks of up to [`MAX_QUERIES`]
/// queries that share every K and V load: scores of the chunk's queries over
/// pairs of positions, each query's softmax step, then the V rows accumulated
/// into the chunk's outputs 64 dimensions at a time.
///
/// # Safety
/// `hd % 8 == 0`, `hd > 0`, `n > 0`, `k.len() == v.len() == n·hd`,
/// `q.len() == acc.len() == st.len()·hd`, `scores.len() >= st.len()·n`, and the
/// CPU has the features of this tier.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn attn_group<T: KvLanes16, const STREAM: bool>(
    q: &[f32],
    k: &[T],
    v: &[T],
    n: usize,
    hd: usize,
    scale: f32,
    st: &mut [Running],
    acc: &mut [f32],
    scores: &mut [f32],
) {
    debug_assert!(
        hd.is_multiple_of(8)
            && k.len() == n * hd
            && v.len() == n * hd
            && q.len() == st.len() * hd
            && acc.len() == q.len()
            && scores.len() >= st.len() * n
    );
    let mut g0 = 0;
    while g0 < st.len() {
        let gn = (st.len() - g0).min(MAX_QUERIES);
        let qs = &q[g0 * hd..(g0 + gn) * hd];
        let s = &mut scores[g0 * n..(g0 + gn) * n];
        // SAFETY: (all four calls) the chunk's shapes are those of the whole
        // group restricted to `gn` queries, as each callee requires.
        unsafe {
            match gn {
                4 => group_scores::<T, 4, 4, STREAM>(qs, k, n, hd, scale, s),
                3 => group_scores::<T, 3, 4, STREAM>(qs, k, n, hd, scale, s),
                2 => group_scores::<T, 2, 4, STREAM>(qs, k, n, hd, scale, s),
                _ => group_scores::<T, 1, 4, STREAM>(qs, k, n, hd, scale, s),
            }
        }
        let accs = &mut acc[g0 * hd..(g0 + gn) * hd];
        for ((w, run), a) in s
            .chunks_exact_mut(n)
            .zip(&mut st[g0..g0 + gn])
            .zip(accs.chunks_exact_mut(hd))
        {
            softmax_step(w, run, a);
        }
        let vp = v.as_ptr();
        // SAFETY: (each call) the strip lies inside the head dimension, `vp`
        // points at n·hd readable elements, `s` holds gn·n weights and `accs`
        // gn·hd values.
        unsafe {
            let mut d0 = 0;
            while d0 + 64 <= hd {
                match gn {
                    4 => accumulate_v16::<T, 4, 4, STREAM>(s, n, vp, hd, d0, accs),
                    3 => accumulate_v16::<T, 3, 4, STREAM>(s, n, vp, hd, d0, accs),
                    2 => accumulate_v16::<T, 2, 4, STREAM>(s, n, vp, hd, d0, accs),
                    _ => accumulate_v16::<T, 1, 4, STREAM>(s, n, vp, hd, d0, accs),
                }
                d0 += 64;
            }
            while d0 + 16 <= hd {
                match gn {
                    4 => accumulate_v16::<T, 4, 1, STREAM>(s, n, vp, hd, d0, accs),
                    3 => accumulate_v16::<T, 3, 1, STREAM>(s, n, vp, hd, d0, accs),
                    2 => accumulate_v16::<T, 2, 1, STREAM>(s, n, vp, hd, d0, accs),
                    _ => accumulate_v16::<T, 1, 1, STREAM>(s, n, vp, hd, d0, accs),
                }
                d0 += 16;
            }
            if d0 < hd {
                match gn {
                    4 => accumulate_v::<T, 4, 1, STREAM>(s, n, vp, hd, d0, accs),
                    3 => accumulate_v::<T, 3, 1, STREAM>(s, n, vp, hd, d0, accs),
                    2 => accumulate_v::<T, 2, 1, STREAM>(s, n, vp, hd, d0, accs),
                    _ => accumulate_v::<T, 1, 1, STREAM>(s, n, vp, hd, d0, accs),
                }
            }
        }
        g0 += gn;
    }
}

/// `s[g·n + p] = dot_fma1(q_g, k_p) · scale` for the `G` queries of `q` and
/// every position `p < n`, `2·PP` positions at a time in `G·PP` registers of
/// two accumulators (each K vector loaded once for the `G` queries); a last odd
/// position is paired with itself.
///
/// # Safety
/// `hd % 8 == 0`, `q.len() == G·hd`, `k.len() == n·hd`, `s.len() == G·n`, and
/// the CPU has AVX-512 F.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // g and j index two arrays at once
unsafe fn group_scores<T: KvLanes16, const G: usize, const PP: usize, const STREAM: bool>(
    q: &[f32],
    k: &[T],
    n: usize,
    hd: usize,
    scale: f32,
    s: &mut [f32],
) {
    debug_assert!(q.len() == G * hd && k.len() == n * hd && s.len() == G * n);
    let (qp, kp) = (q.as_ptr(), k.as_ptr());
    let mut p = 0;
    while p < n {
        let np = (n - p).min(2 * PP);
        if STREAM {
            prefetch_rows_ahead(kp, hd, p, np);
        }
        // Position pairs (p + 2j, p + 2j + 1), clamped to the tile.
        let rows: [[usize; 2]; PP] =
            std::array::from_fn(|j| [(p + 2 * j).min(n - 1), (p + 2 * j + 1).min(n - 1)]);
        let pairs = np.div_ceil(2);
        let mut a = [[_mm512_setzero_ps(); PP]; G];
        for c in (0..hd).step_by(8) {
            // SAFETY: g < G and c + 8 <= hd: inside `q` (G·hd elements).
            let qv: [__m512; G] = std::array::from_fn(|g| unsafe {
                let h = _mm256_loadu_ps(qp.add(g * hd + c));
                _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(h)))
            });
            for j in 0..pairs {
                // SAFETY: both positions are < n and c + 8 <= hd: inside `k`.
                let kv =
                    unsafe { T::load8x2(kp.add(rows[j][0] * hd + c), kp.add(rows[j][1] * hd + c)) };
                for g in 0..G {
                    a[g][j] = _mm512_fmadd_ps(qv[g], kv, a[g][j]);
                }
            }
        }
        let mut sums = [[[0.0f32; 2]; PP]; G];
        reduce_pairs(
            a.as_flattened(),
            scale,
            sums.as_flattened_mut().as_flattened_mut(),
        );
        for g in 0..G {
            s[g * n + p..][..np].copy_from_slice(&sums[g].as_flattened()[..np]);
        }
        p += np;
    }
}

/// `out[2i + h] = reduce_lanes(half h of a[i]) · scale` (the lane reduction of
/// [`crate::f32`]), eight registers (sixteen accumulators) at a time through
/// one transposed horizontal sum; a last group is padded with zeros.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn reduce_pairs(a: &[__m512], scale: f32, out: &mut [f32]) {
    debug_assert!(out.len() == 2 * a.len());
    // Position i of the final register holds accumulator 4·(i % 4) + i / 4.
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (a, out) in a.chunks(8).zip(out.chunks_mut(16)) {
        let mut r = [_mm512_setzero_ps(); 8];
        r[..a.len()].copy_from_slice(a);
        // Each 128-bit lane of u_i is one accumulator's [a0+a4, a1+a5, a2+a6,
        // a3+a7]: accumulators 4i..4i + 4.
        let u: [__m512; 4] = std::array::from_fn(|i| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(r[2 * i], r[2 * i + 1]),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(r[2 * i], r[2 * i + 1]),
            )
        });
        // Lane k: [y0, y1] of accumulators k and 4 + k (c), 8 + k and 12 + k (d),
        // with y0 = (a0+a4)+(a2+a6) and y1 = (a1+a5)+(a3+a7).
        let c = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(u[0], u[1]),
            _mm512_shuffle_ps::<0xEE>(u[0], u[1]),
        );
        let d = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(u[2], u[3]),
            _mm512_shuffle_ps::<0xEE>(u[2], u[3]),
        );
        // Lane k: y0 + y1 of accumulators k, 4 + k, 8 + k, 12 + k.
        let z = _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(c, d),
            _mm512_shuffle_ps::<0xDD>(c, d),
        );
        let sums = _mm512_mul_ps(_mm512_permutexvar_ps(order, z), _mm512_set1_ps(scale));
        let mut lanes = [0.0f32; 16];
        // SAFETY: `lanes` is 16 writable f32s; `storeu` has no alignment requirement.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), sums) };
        out.copy_from_slice(&lanes[..out.len()]);
    }
}

/// `acc_g[d] = fma(w_g[p], v[p·hd + d], acc_g[d])` for the `G` queries (weights
/// `w[g·n..]`, outputs `acc[g·hd..]`), `d` in `d0..d0 + 16R`, `p` in order:
/// each V vector is loaded (and widened) once for the `G` queries.
///
/// # Safety
/// `d0 + 16R <= hd`, `w.len() == G·n`, `acc.len() == G·hd`, `vp` points at
/// `n·hd` readable elements, and the CPU has AVX-512 F.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn accumulate_v16<T: KvLanes16, const G: usize, const R: usize, const STREAM: bool>(
    w: &[f32],
    n: usize,
    vp: *const T,
    hd: usize,
    d0: usize,
    acc: &mut [f32],
) {
    debug_assert!(d0 + 16 * R <= hd && w.len() == G * n && acc.len() == G * hd);
    let ap = acc.as_mut_ptr();
    let mut a: [[__m512; R]; G] = std::array::from_fn(|g| {
        std::array::from_fn(|r| {
            // SAFETY: g < G and d0 + 16r + 16 <= hd: inside `acc` (G·hd values).
            unsafe { _mm512_loadu_ps(ap.add(g * hd + d0 + 16 * r)) }
        })
    });
    for p in 0..n {
        if STREAM && d0 == 0 {
            prefetch_rows_ahead(vp, hd, p, 1);
        }
        let wb: [__m512; G] = std::array::from_fn(|g| _mm512_set1_ps(w[g * n + p]));
        for r in 0..R {
            // SAFETY: p < n and d0 + 16r + 16 <= hd: inside the V rows.
            let x = unsafe { T::load16(vp.add(p * hd + d0 + 16 * r)) };
            for (a, &wb) in a.iter_mut().zip(&wb) {
                a[r] = _mm512_fmadd_ps(wb, x, a[r]);
            }
        }
    }
    for (g, a) in a.iter().enumerate() {
        for (r, a) in a.iter().enumerate() {
            // SAFETY: as the loads above.
            unsafe { _mm512_storeu_ps(ap.add(g * hd + d0 + 16 * r), *a) };
        }
    }
}

/// [`crate::attn::attn_group_ref`]: the table entry (head sizes that are not a
/// multiple of 8 go to the reference, as on the AVX2 tier).
#[allow(clippy::too_many_arguments)]
pub(super) fn attn_group_checked<T: KvLanes16>(
    q: &[f32],
    k: &[T],
    v: &[T],
    scale: f32,
    st: &mut [Running],
    acc: &mut [f32],
    scores: &mut [f32],
    stream: bool,
) {
    let (n, hd) = crate::attn::check_group(q, k, v, st, acc, scores);
    if !hd.is_multiple_of(8) {
        return crate::attn::attn_group_ref(q, k, v, scale, st, acc, scores, stream);
    }
    // SAFETY: the tier is handed out only after detection (see `super`);
    // `check_group` and the `hd % 8` test establish the shapes `attn_group`
    // requires.
    unsafe {
        if stream {
            attn_group::<T, true>(q, k, v, n, hd, scale, st, acc, scores)
        } else {
            attn_group::<T, false>(q, k, v, n, hd, scale, st, acc, scores)
        }
    }
}
