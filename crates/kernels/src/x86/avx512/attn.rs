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

use super::super::avx2::{
    accumulate_v, exp8, exp_lanes, prefetch_ahead, AttnChunk, F32Lanes, KvVector,
};
use super::reduce_pairs;
use crate::attn::{exp_ref, Running};

impl F32Lanes for __m512 {
    const LANES: usize = 16;

    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller's guarantees.
        unsafe { _mm512_loadu_ps(p) }
    }

    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller's guarantees.
        unsafe { _mm512_storeu_ps(p, self) }
    }

    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        // SAFETY: the caller guarantees AVX-512 F.
        unsafe { _mm512_set1_ps(x) }
    }

    #[inline(always)]
    unsafe fn mul_add(a: Self, b: Self, c: Self) -> Self {
        // SAFETY: the caller guarantees AVX-512 F.
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }

    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        // SAFETY: the caller guarantees AVX-512 F.
        unsafe { _mm512_mul_ps(a, b) }
    }

    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        // SAFETY: the caller guarantees AVX-512 F.
        unsafe { _mm512_add_ps(a, b) }
    }

    #[inline(always)]
    unsafe fn min_keep_nan(self, max: f32) -> Self {
        // SAFETY: the caller guarantees AVX-512 F.
        unsafe {
            let max = _mm512_set1_ps(max);
            _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(self, max), self, max)
        }
    }

    #[inline(always)]
    unsafe fn round_even(self) -> Self {
        // SAFETY: the caller guarantees AVX-512 F.
        unsafe { _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(self) }
    }

    #[inline(always)]
    unsafe fn exp2_int(self) -> Self {
        // SAFETY: the caller guarantees AVX-512 F.
        unsafe {
            let e = _mm512_add_epi32(_mm512_cvtps_epi32(self), _mm512_set1_epi32(127));
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(e))
        }
    }

    #[inline(always)]
    unsafe fn zero_where_below(self, x: Self, min: f32) -> Self {
        // SAFETY: the caller guarantees AVX-512 F.
        unsafe {
            let below = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(min));
            _mm512_maskz_mov_ps(!below, self)
        }
    }
}

impl KvVector<__m512> for f32 {
    #[inline(always)]
    unsafe fn load_lanes(p: *const f32) -> __m512 {
        // SAFETY: the caller guarantees 16 readable f32s and AVX-512 F.
        unsafe { _mm512_loadu_ps(p) }
    }
}

impl KvVector<__m512> for u16 {
    #[inline(always)]
    unsafe fn load_lanes(p: *const u16) -> __m512 {
        // SAFETY: the caller guarantees 16 readable u16s (32 bytes) and AVX-512 F.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
}

/// K/V elements as this tier reads them: 16 at a time (V), 8 (a V tail), or
/// two rows' 8 side by side (K).
pub(super) trait KvLanes16: KvVector<__m512> + KvVector<__m256> {
    /// Eight elements at `p0` (low half) and eight at `p1` (high half), as f32.
    ///
    /// # Safety
    /// `p0` and `p1` point at 8 readable elements each and the CPU has AVX-512 F.
    unsafe fn load8x2(p0: *const Self, p1: *const Self) -> __m512;
}

impl KvLanes16 for f32 {
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

/// The AVX-512 tier's chunks of [`attn_group`](super::super::avx2::attn_group):
/// up to four queries (a whole head's V strip of 64 for each in the 32
/// registers), scores over pairs of positions, each query's softmax step, then
/// V rows accumulated into the chunk's outputs 64 dimensions at a time.
pub(super) struct Avx512Attn;

impl<T: KvLanes16> AttnChunk<T> for Avx512Attn {
    const MAX_QUERIES: usize = 4;

    #[inline(always)]
    unsafe fn chunk<const STREAM: bool>(
        q: &[f32],
        k: &[T],
        v: &[T],
        (n, hd): (usize, usize),
        scale: f32,
        st: &mut [Running],
        acc: &mut [f32],
        s: &mut [f32],
    ) {
        // SAFETY: (each arm) the caller's guarantees, for `G = st.len()`
        // queries, as `attn_chunk` requires.
        unsafe {
            match st.len() {
                4 => attn_chunk::<T, 4, STREAM>(q, k, v, n, hd, scale, st, acc, s),
                3 => attn_chunk::<T, 3, STREAM>(q, k, v, n, hd, scale, st, acc, s),
                2 => attn_chunk::<T, 2, STREAM>(q, k, v, n, hd, scale, st, acc, s),
                _ => attn_chunk::<T, 1, STREAM>(q, k, v, n, hd, scale, st, acc, s),
            }
        }
    }
}

/// [`Avx512Attn`]'s chunk of `G` queries.
///
/// # Safety
/// As [`AttnChunk::chunk`] with `st.len() == G`, and the CPU has this tier's
/// features.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn attn_chunk<T: KvLanes16, const G: usize, const STREAM: bool>(
    q: &[f32],
    k: &[T],
    v: &[T],
    n: usize,
    hd: usize,
    scale: f32,
    st: &mut [Running],
    acc: &mut [f32],
    s: &mut [f32],
) {
    debug_assert!(
        hd.is_multiple_of(8)
            && st.len() == G
            && k.len() == n * hd
            && v.len() == n * hd
            && q.len() == G * hd
            && acc.len() == q.len()
            && s.len() == G * n
    );
    // SAFETY: the shapes `group_scores` requires.
    unsafe { group_scores::<T, G, 4, STREAM>(q, k, n, hd, scale, s) };
    for ((w, run), a) in s.chunks_exact_mut(n).zip(st).zip(acc.chunks_exact_mut(hd)) {
        softmax_step(w, run, a);
    }
    let vp = v.as_ptr();
    let mut d0 = 0;
    // SAFETY: (each call) the strip lies inside the head dimension, `vp`
    // points at n·hd readable elements, `s` holds G·n weights and `acc` G·hd
    // values.
    unsafe {
        while d0 + 64 <= hd {
            accumulate_v::<T, __m512, G, 4, STREAM>(s, n, vp, hd, d0, acc);
            d0 += 64;
        }
        while d0 + 16 <= hd {
            accumulate_v::<T, __m512, G, 1, STREAM>(s, n, vp, hd, d0, acc);
            d0 += 16;
        }
        if d0 < hd {
            accumulate_v::<T, __m256, G, 1, STREAM>(s, n, vp, hd, d0, acc);
        }
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
        // Position pairs (p + 2j, p + 2j + 1), clamped to the tile.
        let rows: [[usize; 2]; PP] =
            std::array::from_fn(|j| [(p + 2 * j).min(n - 1), (p + 2 * j + 1).min(n - 1)]);
        let pairs = np.div_ceil(2);
        let mut a = [[_mm512_setzero_ps(); PP]; G];
        for c in (0..hd).step_by(8) {
            if STREAM {
                // Rows p + AHEAD .. + np, eight elements of each per step.
                prefetch_ahead(kp, hd, p, c * np, 8 * np);
            }
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

/// [`crate::attn::exp_ref`] on 16 lanes: [`exp_lanes`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn exp16(x: __m512) -> __m512 {
    // SAFETY: AVX-512 F is enabled here.
    unsafe { exp_lanes(x) }
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
