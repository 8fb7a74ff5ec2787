//! Attention kernels: one query against one tile of K/V rows, as a step of an
//! online softmax, with K/V stored as f32 or f16 (IEEE binary16 bits, `u16`).
//!
//! The scalar functions here define the arithmetic; the AVX2 and AVX-512
//! versions (`x86/avx2.rs`, `x86/avx512/attn.rs`) compute the same bits for
//! every finite input (tested in `tier_parity.rs`), so a session's results do
//! not depend on the tier.
//!
//! One step ([`attn_tile_ref`]) over positions `p` of a tile, for a query `q` of
//! `hd` elements and a running state `(m, l, acc)`:
//! 1. `s[p] = dot_fma1(q, k_p) · scale`: order F1 of [`crate::fast`] (one 8-lane FMA
//!    accumulator, the fixed lane reduction), f16 rows widened exactly first.
//! 2. `m' = max(m, max_p s[p])`; if `m` is not `-inf`, `c = exp(m - m')`,
//!    `l = l · c`, `acc[d] = acc[d] · c`.
//! 3. `w[p] = exp(s[p] - m')` with [`exp_ref`]; `l = l + Σ w[p]`, the sum taken in
//!    8 lanes (`w[p]` into lane `p % 8`, in increasing `p`) and reduced like
//!    [`crate::f32`]'s dot product.
//! 4. `acc[d] = fma(w[p], v_p[d], acc[d])` in increasing `p`; `m = m'`.
//!
//! [`exp_ref`] is a Cephes-style `expf` with fused multiply-adds: `n =
//! round_ties_even(x·log2 e)`, `r = x - n·ln 2` in two FMA steps, a degree-5
//! polynomial (Horner, FMA), times `2^n` built in the exponent bits. Within 2 ulp of
//! `exp` on `[-87.3, 88]`; below `-87.33` (where `exp` is under the smallest
//! normal f32) it returns `+0`, and inputs above `88` are clamped to it.

use crate::f16::fp16_to_fp32;
use crate::f32::reduce_lanes;

/// A K/V element type the attention kernels read: f32, or f16 bits.
pub trait KvElem: bytemuck::Pod + Send + Sync + Default {
    /// Exact widening to f32.
    fn widen(self) -> f32;
    /// Storage rounding (nearest even for f16).
    fn narrow(x: f32) -> Self;
    /// [`narrow`](Self::narrow) of each of `src` into `dst` (equal lengths).
    fn narrow_slice(src: &[f32], dst: &mut [Self]) {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = Self::narrow(x);
        }
    }
}

impl KvElem for f32 {
    #[inline]
    fn widen(self) -> f32 {
        self
    }
    #[inline]
    fn narrow(x: f32) -> Self {
        x
    }
}

/// f16 as its little-endian-independent bit pattern.
impl KvElem for u16 {
    #[inline]
    fn widen(self) -> f32 {
        fp16_to_fp32(self.to_le_bytes())
    }
    #[inline]
    fn narrow(x: f32) -> Self {
        u16::from_le_bytes(crate::f16::fp32_to_fp16(x))
    }
    /// `half`'s slice conversion: eight at a time with F16C's `vcvtps2ph` in
    /// the same rounding mode as its one-value path, so the same bits, without
    /// a call and a CPU check per value (storing a decoded token's K/V rows one
    /// value at a time was 1.3% of SmolLM2's decode).
    fn narrow_slice(src: &[f32], dst: &mut [u16]) {
        use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
        assert_eq!(src.len(), dst.len(), "narrow_slice lengths");
        dst.reinterpret_cast_mut::<half::f16>()
            .convert_from_f32_slice(src);
    }
}

pub(crate) const EXP_LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2 = LN2_HI + LN2_LO` (to about 2^-45), subtracted in two FMA steps.
pub(crate) const EXP_LN2_HI: f32 = 0.693_145_75;
pub(crate) const EXP_LN2_LO: f32 = 1.428_606_8e-6;
/// Below this, `exp` returns 0.
pub(crate) const EXP_MIN: f32 = -87.336_54;
/// Inputs above this are clamped (`n <= 127`, the result stays finite).
pub(crate) const EXP_MAX: f32 = 88.0;
/// Cephes `expf` coefficients, highest degree first.
pub(crate) const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x` as the attention kernels compute it (see the module docs); the AVX2
/// version is bit-identical for every input (NaN gives NaN).
#[inline]
pub fn exp_ref(x: f32) -> f32 {
    let x = if x > EXP_MAX { EXP_MAX } else { x };
    if x < EXP_MIN {
        return 0.0;
    }
    let n = (x * EXP_LOG2E).round_ties_even();
    let r = n.mul_add(-EXP_LN2_HI, x);
    let r = n.mul_add(-EXP_LN2_LO, r);
    let mut p = EXP_P[0];
    for &c in &EXP_P[1..] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    // n is in [-126, 127] here (NaN saturates to 0, and y is NaN then anyway).
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    y * scale
}

/// `x[i] = exp_ref(x[i])` by the selected tier.
pub fn exp_inplace(x: &mut [f32]) {
    (crate::kernels().exp_inplace)(x)
}

/// [`exp_inplace`], scalar reference.
pub fn exp_inplace_ref(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = exp_ref(*v));
}

/// The running state of one query's online softmax.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Running {
    /// Largest score seen (`-inf` before the first).
    pub m: f32,
    /// Sum of `exp(score - m)`.
    pub l: f32,
}

impl Default for Running {
    fn default() -> Self {
        Running {
            m: f32::NEG_INFINITY,
            l: 0.0,
        }
    }
}

/// Checks a tile's shapes; returns (positions, head_dim).
pub(crate) fn check_tile<T>(
    q: &[f32],
    k: &[T],
    v: &[T],
    acc: &[f32],
    scores: &[f32],
) -> (usize, usize) {
    let hd = q.len();
    assert!(
        hd > 0 && acc.len() == hd,
        "attn tile: query {hd}, acc {}",
        acc.len()
    );
    let n = k.len() / hd;
    assert!(
        k.len() == n * hd && v.len() == k.len() && n > 0 && scores.len() >= n,
        "attn tile: {} K, {} V elements, head_dim {hd}, {} score slots",
        k.len(),
        v.len(),
        scores.len()
    );
    (n, hd)
}

/// One online-softmax step of query `q` over the K/V rows in `k`/`v` (whole rows of
/// `q.len()` elements, at least one), scores scaled by `scale`. `scores` is scratch
/// of at least one slot per row. Scalar reference; see the module docs.
///
/// # Panics
/// On a shape mismatch.
pub fn attn_tile_ref<T: KvElem>(
    q: &[f32],
    k: &[T],
    v: &[T],
    scale: f32,
    st: &mut Running,
    acc: &mut [f32],
    scores: &mut [f32],
) {
    let (n, hd) = check_tile(q, k, v, acc, scores);
    let s = &mut scores[..n];
    for (sp, kr) in s.iter_mut().zip(k.chunks_exact(hd)) {
        let mut lanes = [0.0f32; 8];
        for (i, (&a, &b)) in q.iter().zip(kr).enumerate() {
            lanes[i % 8] = a.mul_add(b.widen(), lanes[i % 8]);
        }
        *sp = reduce_lanes(&lanes) * scale;
    }
    let tmax = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let m_new = st.m.max(tmax);
    if st.m != f32::NEG_INFINITY {
        let c = exp_ref(st.m - m_new);
        st.l *= c;
        acc.iter_mut().for_each(|a| *a *= c);
    }
    let mut lanes = [0.0f32; 8];
    for (p, sp) in s.iter_mut().enumerate() {
        *sp = exp_ref(*sp - m_new);
        lanes[p % 8] += *sp;
    }
    st.l += reduce_lanes(&lanes);
    for (&w, vr) in s.iter().zip(v.chunks_exact(hd)) {
        for (a, &x) in acc.iter_mut().zip(vr) {
            *a = w.mul_add(x.widen(), *a);
        }
    }
    st.m = m_new;
}

/// [`attn_tile_ref`] for each of the `st.len()` queries of one KV head's group over
/// the same tile of K/V rows: query `g` is `q[g·hd..(g+1)·hd]` with state `st[g]`,
/// accumulator `acc[g·hd..(g+1)·hd]` and score slots `scores[g·n..(g+1)·n]`, where
/// `hd = acc.len() / st.len()` and `n` is the number of rows. Scalar reference:
/// the queries one after the other, so a fast tier that shares each K/V row
/// between the queries (grouped-query attention) computes the same bits.
///
/// `stream` says the rows are read once, from memory, and the tile after them
/// comes next (a decoded token's history): a fast tier then requests those
/// rows ahead as it goes. A hint only, which the result does not depend on;
/// the reference ignores it.
///
/// # Panics
/// On a shape mismatch.
#[allow(clippy::too_many_arguments)]
pub fn attn_group_ref<T: KvElem>(
    q: &[f32],
    k: &[T],
    v: &[T],
    scale: f32,
    st: &mut [Running],
    acc: &mut [f32],
    scores: &mut [f32],
    stream: bool,
) {
    let _ = stream;
    let (n, hd) = check_group(q, k, v, st, acc, scores);
    for (g, run) in st.iter_mut().enumerate() {
        let (qg, ag) = (&q[g * hd..(g + 1) * hd], &mut acc[g * hd..(g + 1) * hd]);
        attn_tile_ref(qg, k, v, scale, run, ag, &mut scores[g * n..(g + 1) * n]);
    }
}

/// Checks the shapes of a grouped tile step; returns (positions, head_dim).
pub(crate) fn check_group<T>(
    q: &[f32],
    k: &[T],
    v: &[T],
    st: &[Running],
    acc: &[f32],
    scores: &[f32],
) -> (usize, usize) {
    let g = st.len();
    assert!(
        g > 0 && acc.len().is_multiple_of(g) && q.len() == acc.len(),
        "attn group: {g} queries, query {}, acc {}",
        q.len(),
        acc.len()
    );
    let hd = acc.len() / g;
    let n = k.len().checked_div(hd).unwrap_or(0);
    assert!(
        hd > 0 && k.len() == n * hd && v.len() == k.len() && n > 0 && scores.len() >= g * n,
        "attn group: {} K, {} V elements, head_dim {hd}, {} score slots for {g} queries",
        k.len(),
        v.len(),
        scores.len()
    );
    (n, hd)
}

/// [`attn_group_ref`] by the selected tier, bit for bit (for finite inputs), on K/V
/// rows of f32 or f16 bits.
#[inline]
#[allow(clippy::too_many_arguments)]
pub fn attn_group<T: AsF32Rows>(
    q: &[f32],
    k: &[T],
    v: &[T],
    scale: f32,
    st: &mut [Running],
    acc: &mut [f32],
    scores: &mut [f32],
    stream: bool,
) {
    (T::group_kernel())(q, k, v, scale, st, acc, scores, stream)
}

/// Widens f16 bits to f32 (exactly) by the selected tier.
///
/// # Panics
/// If the lengths differ.
#[inline]
pub fn widen_f16(src: &[u16], dst: &mut [f32]) {
    (crate::kernels().widen_f16)(src, dst)
}

/// [`widen_f16`], scalar reference.
///
/// # Panics
/// If the lengths differ.
pub fn widen_f16_ref(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen_f16 lengths");
    for (d, &h) in dst.iter_mut().zip(src) {
        *d = h.widen();
    }
}

/// The two K/V element types the attention kernels run on: f32 rows, and f16 rows
/// that a tile of many queries widens to f32 once (exact, so either way computes
/// [`attn_tile_ref`] on the stored rows).
pub trait AsF32Rows: KvElem {
    fn as_f32_rows<'a>(rows: &'a [Self], buf: &'a mut Vec<f32>) -> &'a [f32];
    /// The selected tier's grouped tile step on rows of this type.
    #[doc(hidden)]
    fn group_kernel() -> crate::AttnGroupFn<Self>;
}

impl AsF32Rows for f32 {
    #[inline]
    fn as_f32_rows<'a>(rows: &'a [f32], _buf: &'a mut Vec<f32>) -> &'a [f32] {
        rows
    }
    #[inline]
    fn group_kernel() -> crate::AttnGroupFn<f32> {
        crate::kernels().attn_group_f32
    }
}

impl AsF32Rows for u16 {
    #[inline]
    fn as_f32_rows<'a>(rows: &'a [u16], buf: &'a mut Vec<f32>) -> &'a [f32] {
        buf.resize(rows.len(), 0.0);
        widen_f16(rows, buf);
        buf
    }
    #[inline]
    fn group_kernel() -> crate::AttnGroupFn<u16> {
        crate::kernels().attn_group_f16
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::XorShift;

    /// A slice narrowed at once gives each value's one-at-a-time bits: random
    /// values across the exponent range, f16's subnormals, overflow, infinities,
    /// signed zeros, NaNs with payloads, at every length around the vector width.
    #[test]
    fn narrow_slice_gives_each_values_bits() {
        let mut rng = XorShift::new(5);
        let mut xs: Vec<f32> = (0..4000)
            .map(|i| rng.uniform(-1.0, 1.0) * 2f32.powi(i % 40 - 28))
            .collect();
        xs.extend([
            0.0,
            -0.0,
            65504.0,
            65520.0,
            -70000.0,
            6e-8,
            -3e-8,
            1e-9,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xffc1_2345),
        ]);
        for n in (0..20).chain([xs.len()]) {
            let src = &xs[xs.len() - n..];
            let mut got = vec![0u16; n];
            u16::narrow_slice(src, &mut got);
            let want: Vec<u16> = src.iter().map(|&x| u16::narrow(x)).collect();
            assert_eq!(got, want, "{n} values");
            let mut same = vec![0f32; n];
            f32::narrow_slice(src, &mut same);
            assert_eq!(
                same.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                src.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut rng = XorShift::new(11);
        let mut xs: Vec<f32> = (0..100_000).map(|_| rng.uniform(-87.0, 88.0)).collect();
        xs.extend([0.0, -0.0, 1.0, -1.0, 1e-8, -1e-8, 0.5, -0.5, 88.0, -87.0]);
        for x in xs {
            let got = exp_ref(x);
            let want = f64::from(x).exp();
            let ulp = f64::from(f32::EPSILON) * want.abs().max(f64::from(f32::MIN_POSITIVE));
            assert!(
                (f64::from(got) - want).abs() <= 2.0 * ulp,
                "exp({x}) = {got}, want {want}"
            );
        }
    }

    #[test]
    fn exp_edges() {
        assert_eq!(exp_ref(f32::NEG_INFINITY).to_bits(), 0);
        assert_eq!(exp_ref(-1000.0).to_bits(), 0);
        assert_eq!(exp_ref(-87.4).to_bits(), 0);
        assert!(exp_ref(-87.3) > 0.0);
        assert!(exp_ref(f32::INFINITY).is_finite());
        assert!(exp_ref(f32::NAN).is_nan());
        assert_eq!(exp_ref(0.0), 1.0);
    }

    #[test]
    fn tile_step_is_an_online_softmax() {
        let mut rng = XorShift::new(12);
        let (hd, n) = (16, 100);
        let q = rng.vec_uniform(hd, -1.0, 1.0);
        let k = rng.vec_uniform(n * hd, -2.0, 2.0);
        let v = rng.vec_uniform(n * hd, -2.0, 2.0);
        let mut st = Running::default();
        let mut acc = vec![0.0; hd];
        let mut scores = vec![0.0; 64];
        for c in (0..n).step_by(37) {
            let e = (c + 37).min(n);
            let (kr, vr) = (&k[c * hd..e * hd], &v[c * hd..e * hd]);
            attn_tile_ref(&q, kr, vr, 0.25, &mut st, &mut acc, &mut scores);
        }
        let s: Vec<f64> = k
            .chunks_exact(hd)
            .map(|kr| {
                0.25 * q
                    .iter()
                    .zip(kr)
                    .map(|(&a, &b)| f64::from(a * b))
                    .sum::<f64>()
            })
            .collect();
        let mx = s.iter().copied().fold(f64::MIN, f64::max);
        let w: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
        let z: f64 = w.iter().sum();
        assert!((f64::from(st.l) - z).abs() < 1e-4 * z);
        for d in 0..hd {
            let want: f64 = (0..n).map(|p| w[p] * f64::from(v[p * hd + d])).sum::<f64>() / z;
            let got = f64::from(acc[d]) / f64::from(st.l);
            assert!((got - want).abs() < 1e-5, "d {d}: {got} vs {want}");
        }
    }
}
