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
//! two is the AVX2 tier's, with 16 lanes where its order allows.

use std::arch::x86_64::*;

use super::super::avx2::{accumulate_v, exp8, prefetch_rows_ahead, KvLanes};
use super::reduce_pairs;
use crate::attn::{exp_ref, Running, EXP_LN2_HI, EXP_LN2_LO, EXP_LOG2E, EXP_MAX, EXP_MIN, EXP_P};

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

/// [`crate::attn::exp_ref`] on 16 lanes: the AVX2 tier's `exp8`, lane by lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn exp16(x: __m512) -> __m512 {
    let max = _mm512_set1_ps(EXP_MAX);
    // `if x > MAX { MAX } else { x }` (a NaN stays).
    let x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, max), x, max);
    let small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(EXP_MIN));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
    );
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-EXP_LN2_HI), x);
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-EXP_LN2_LO), r);
    let mut p = _mm512_set1_ps(EXP_P[0]);
    for &c in &EXP_P[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let y = _mm512_add_ps(
        _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
        _mm512_set1_ps(1.0),
    );
    // Lanes below MIN (and -inf) get garbage exponents here; they are set to +0.
    let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvtps_epi32(n),
        _mm512_set1_epi32(127),
    ));
    _mm512_maskz_mul_ps(!small, y, _mm512_castsi512_ps(e))
}

/// `x[i] = exp_ref(x[i])`, 16 at a time.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn exp_slice(x: &mut [f32]) {
    let mut chunks = x.chunks_exact_mut(16);
    for c in chunks.by_ref() {
        // SAFETY: `c` is 16 f32s, read and written in place; `loadu`/`storeu`
        // have no alignment requirement.
        unsafe { _mm512_storeu_ps(c.as_mut_ptr(), exp16(_mm512_loadu_ps(c.as_ptr()))) };
    }
    for v in chunks.into_remainder() {
        *v = exp_ref(*v);
    }
}

/// [`crate::attn::exp_inplace_ref`]: the table entry.
pub(super) fn exp_inplace(x: &mut [f32]) {
    // SAFETY: the tier is handed out only after detection (see `super`).
    unsafe { exp_slice(x) }
}

/// Steps 2 and 3 of [`crate::attn::attn_tile_ref`] for one query, as the AVX2
/// tier's `softmax_step` with 16 lanes where the order allows: the new
/// maximum (independent of the order), the running state and `acc` rescaled
/// (per element), the weights `exp(s - m')` sixteen at a time, each group's
/// two halves added to the eight lane sums in position order; then one group
/// of eight and single positions, as on the AVX2 tier.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn softmax_step(s: &mut [f32], st: &mut Running, acc: &mut [f32]) {
    let mut m16 = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut groups = s.chunks_exact(16);
    for g in groups.by_ref() {
        // SAFETY: `g` is 16 readable f32s; `loadu` has no alignment requirement.
        m16 = _mm512_max_ps(m16, unsafe { _mm512_loadu_ps(g.as_ptr()) });
    }
    let tmax = groups
        .remainder()
        .iter()
        .fold(_mm512_reduce_max_ps(m16), |m, &v| m.max(v));
    let m_new = st.m.max(tmax);
    if st.m != f32::NEG_INFINITY {
        let c = exp_ref(st.m - m_new);
        st.l *= c;
        let mut parts = acc.chunks_exact_mut(16);
        for a in parts.by_ref() {
            // SAFETY: `a` is 16 f32s, read and written in place.
            unsafe {
                _mm512_storeu_ps(
                    a.as_mut_ptr(),
                    _mm512_mul_ps(_mm512_loadu_ps(a.as_ptr()), _mm512_set1_ps(c)),
                )
            };
        }
        parts.into_remainder().iter_mut().for_each(|a| *a *= c);
    }
    let mut lanes = _mm256_setzero_ps();
    let mut groups = s.chunks_exact_mut(16);
    for g in groups.by_ref() {
        // SAFETY: `g` is 16 f32s, read and written in place.
        let w = unsafe { _mm512_loadu_ps(g.as_ptr()) };
        let w = exp16(_mm512_sub_ps(w, _mm512_set1_ps(m_new)));
        lanes = _mm256_add_ps(lanes, _mm512_castps512_ps256(w));
        lanes = _mm256_add_ps(
            lanes,
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(w))),
        );
        // SAFETY: as the load.
        unsafe { _mm512_storeu_ps(g.as_mut_ptr(), w) };
    }
    let mut rest = groups.into_remainder().chunks_exact_mut(8);
    for g in rest.by_ref() {
        // SAFETY: `g` is 8 f32s, read and written in place.
        let w = unsafe { _mm256_loadu_ps(g.as_ptr()) };
        let w = exp8(_mm256_sub_ps(w, _mm256_set1_ps(m_new)));
        lanes = _mm256_add_ps(lanes, w);
        // SAFETY: as the load.
        unsafe { _mm256_storeu_ps(g.as_mut_ptr(), w) };
    }
    let mut sums = [0.0f32; 8];
    // SAFETY: `sums` is 8 writable f32s.
    unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), lanes) };
    for (j, w) in rest.into_remainder().iter_mut().enumerate() {
        *w = exp_ref(*w - m_new);
        sums[j] += *w;
    }
    st.l += crate::f32::reduce_lanes(&sums);
    st.m = m_new;
}
