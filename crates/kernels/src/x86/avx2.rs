//! AVX2 (+F16C) kernels, called only after runtime detection (see
//! [`super::avx2()`]). Every function here except `dot_f32_fused` is
//! bit-identical to its scalar reference for every input (a NaN result is
//! NaN in both, though its payload may differ):
//!
//! - Dot products: each block's integer sum is computed exactly (no saturating
//!   tricks that break on -128), eight blocks at a time. The per-block float
//!   terms are then formed eight wide with exactly the scalar's multiplies and
//!   adds in the scalar's association order, and added to the running sum one
//!   at a time, in block order, as the scalar loop does. That serial add is
//!   the only part that is not vectorized; it costs ~20% of the kernel.
//! - `dot_f32`: one 8-lane accumulator with separate multiply and add is the
//!   documented order of [`crate::f32`]; the tail and the lane reduction
//!   reuse the scalar code.
//! - Conversions do per element the same rounded operations as the scalar.
//! - `dot_f32_fused` is the exception by design: its own fixed FMA order,
//!   documented on it and tested bit for bit against a scalar model of it.
//!
//! f16 scales are widened with F16C (`vcvtph2ps`), which is exact, like
//! [`crate::f16::fp16_to_fp32`].
//!
//! The functions with `#[target_feature]` are safe to call from each other;
//! the table entries below are plain `fn`s that call into them, sound because
//! [`KERNELS`] is only handed out after detection.

use std::arch::x86_64::*;

use crate::act16::{F2Block, F2Rows, SubQ4K, SubQ6K, CHUNK};
use crate::attn::{exp_ref, Running, EXP_LN2_HI, EXP_LN2_LO, EXP_LOG2E, EXP_MAX, EXP_MIN, EXP_P};
use crate::f16::fp32_to_fp16;
use crate::q4_0::BlockQ4_0;
use crate::q4_1::{BlockQ4_1, QK4_1};
use crate::q4_k::BlockQ4_K;
use crate::q5_0::BlockQ5_0;
use crate::q6_k::BlockQ6_K;
use crate::q8_0::{BlockQ8_0, QK8_0};
use crate::q8_k::BlockQ8_K;
use crate::Kernels;

mod kquants;
mod serial;

/// The AVX2 tier.
pub(super) static KERNELS: Kernels = Kernels {
    tier: "avx2",
    // Expanding Q5_0's fifth bits doubles the decode tile's operations per
    // block (in cache 1.8x the time of Q8_0's) and cost Gemma 3's prefill 8%.
    q5_0_native: false,
    f2_pairs: false,
    vec_dot_q4_0_q8_0,
    vec_dot_q4_1_q8_0,
    vec_dot_q5_0_q8_0,
    vec_dot_q8_0_q8_0,
    vec_dot_f32,
    vec_dot_f32_fused,
    dequantize_row_q4_1,
    dequantize_row_q8_0,
    quantize_row_q8_0,
    dot_fma1,
    matvec_q4_1_q8_0,
    matvec_q8_0_q8_0,
    gemm_q4_1_q8_0,
    gemm_q4_1_q8_0_f2,
    gemm_tile,
    exp_inplace,
    attn_group_f32: attn_group::<f32, Avx2Attn>,
    attn_group_f16: attn_group::<u16, Avx2Attn>,
    widen_f16,
    quantize_act16,
    gemm_q4_1_act16: gemm_act16::<BlockQ4_1>,
    gemm_q8_0_act16: gemm_act16::<BlockQ8_0>,
    gemm_q5_0_act16: gemm_act16::<BlockQ5_0>,
    gemm_q4_k_act16: gemm_act16::<SubQ4K>,
    gemm_q6_k_act16: gemm_act16::<SubQ6K>,
    vec_dot_q4_k_q8_k,
    vec_dot_q6_k_q8_k,
    dequantize_row_q4_k,
    dequantize_row_q6_k,
    dequantize_row_q4_0,
    dequantize_row_q5_0,
    dequantize_row_f16,
    dequantize_row_bf16,
    vec_dot_q2_k_q8_k,
    vec_dot_iq2_xxs_q8_k,
    dot_iq2_decoded_q8_k,
    dot_q8_0x16_f32s,
    dots_f16x8_serial,
    dots8_serial,
    dots16_serial,
    wsum16_serial,
};

pub(super) fn vec_dot_q2_k_q8_k(x: &[crate::q2_k::BlockQ2_K], y: &[BlockQ8_K]) -> f32 {
    assert_eq!(x.len(), y.len(), "vec_dot_q2_K_q8_K block counts");
    // SAFETY: see above.
    unsafe { kquants::dot_q2_k_q8_k(x, y) }
}

pub(super) fn vec_dot_iq2_xxs_q8_k(x: &[crate::iq2_xxs::BlockIQ2_XXS], y: &[BlockQ8_K]) -> f32 {
    assert_eq!(x.len(), y.len(), "vec_dot_iq2_xxs_q8_K block counts");
    // SAFETY: see above.
    unsafe { kquants::dot_iq2_xxs_q8_k(x, y) }
}

pub(super) fn dot_iq2_decoded_q8_k(x: &crate::iq2_xxs::Iq2Decoded, y: &[BlockQ8_K]) -> f32 {
    assert!(
        x.d.len() == y.len() && x.w.len() == y.len() * crate::QK_K && x.ls.len() == 8 * y.len(),
        "dot_decoded_q8_K lengths"
    );
    // SAFETY: see above.
    unsafe { kquants::dot_iq2_decoded_q8_k(x, y) }
}

/// The length checks of [`crate::serial::dot_q8_0x16_f32s_ref`] (and at most
/// four activation rows), shared with the AVX-512 entry.
pub(super) fn check_q8_0x16(group: &[u8], x: &[crate::serial::Q8Row<'_>], out_len: usize) {
    let nb = group.len() / crate::serial::Q8_0X16_BLOCK;
    assert!(
        x.len() <= 4
            && out_len == x.len()
            && group.len() == nb * crate::serial::Q8_0X16_BLOCK
            && x.iter()
                .all(|x| x.qs.len() == nb * QK8_0 && x.d.len() == nb && x.sums.len() == nb),
        "dot_q8_0x16_f32s lengths"
    );
}

pub(super) fn dot_q8_0x16_f32s(
    group: &[u8],
    x: &[crate::serial::Q8Row<'_>],
    out: &mut [[f32; crate::serial::Q8_ROWS]],
) {
    check_q8_0x16(group, x, out.len());
    // SAFETY: see above.
    unsafe { serial::dot_q8_0x16_f32s(group, x, out) }
}

pub(super) fn dots_f16x8_serial(w: &[u16], x: &[&[f32]], out: &mut [[f32; crate::serial::LANES]]) {
    assert!(
        x.len() <= crate::serial::F16X8_CHAINS
            && out.len() == x.len()
            && x.iter()
                .all(|xi| w.len() == crate::serial::LANES * xi.len()),
        "dots_f16x8_serial lengths"
    );
    // SAFETY: see above.
    unsafe { serial::dots_f16x8_serial(w, x, out) }
}

pub(super) fn dots16_serial(a: &[f32], b: &[&[f32]], out: &mut [[f32; crate::serial::HEADS]]) {
    crate::serial::check_dots16(a, b, out.len());
    // SAFETY: see above.
    unsafe { serial::dots16_serial(a, b, out) }
}

pub(super) fn wsum16_serial(w: &[[f32; crate::serial::HEADS]], rows: &[&[f32]], out: &mut [f32]) {
    let n = crate::serial::check_wsum16(w, rows, out);
    // SAFETY: see above.
    unsafe { serial::wsum16_serial(w, rows, out, n) }
}

pub(super) fn dots8_serial(a: &[f32], b: &[&[f32]], out: &mut [[f32; crate::serial::LANES]]) {
    assert!(
        b.len() <= 4
            && out.len() == b.len()
            && b.iter().all(|b| a.len() == crate::serial::LANES * b.len()),
        "dots8_serial lengths"
    );
    // SAFETY: see above.
    unsafe { serial::dots8_serial(a, b, out) }
}

// Table entries: the length checks the scalar references make, then the call.
// SAFETY (every `unsafe` call below): `KERNELS` is only reachable through
// `super::avx2()`, which returns it after detecting AVX2, FMA and F16C, the
// features the callee is compiled for; the entries the AVX-512 tier shares
// (`pub(super)`) are reachable through its table too, which `super::avx512()`
// hands out only where `super::avx2()` succeeds. Memory safety inside the
// callees does not depend on these length checks beyond what slices already
// guarantee.

pub(super) fn vec_dot_q4_k_q8_k(x: &[BlockQ4_K], y: &[BlockQ8_K]) -> f32 {
    assert_eq!(x.len(), y.len(), "vec_dot_q4_K_q8_K block counts");
    // SAFETY: see above.
    unsafe { kquants::dot_q4_k_q8_k(x, y) }
}

pub(super) fn vec_dot_q6_k_q8_k(x: &[BlockQ6_K], y: &[BlockQ8_K]) -> f32 {
    assert_eq!(x.len(), y.len(), "vec_dot_q6_K_q8_K block counts");
    // SAFETY: see above.
    unsafe { kquants::dot_q6_k_q8_k(x, y) }
}

pub(super) fn dequantize_row_q4_0(x: &[BlockQ4_0], y: &mut [f32]) {
    assert_eq!(y.len(), x.len() * QK8_0, "q4_0 dequantize_row lengths");
    // SAFETY: see above.
    unsafe { dequant_q4_0(x, y) }
}

pub(super) fn dequantize_row_q5_0(x: &[BlockQ5_0], y: &mut [f32]) {
    assert_eq!(y.len(), x.len() * QK8_0, "q5_0 dequantize_row lengths");
    // SAFETY: see above.
    unsafe { dequant_q5_0(x, y) }
}

pub(super) fn dequantize_row_f16(row: &[u8], y: &mut [f32]) {
    assert_eq!(row.len(), 2 * y.len(), "f16 row bytes vs output length");
    // SAFETY: see above.
    unsafe { dequant_f16(row, y) }
}

pub(super) fn dequantize_row_bf16(row: &[u8], y: &mut [f32]) {
    assert_eq!(row.len(), 2 * y.len(), "bf16 row bytes vs output length");
    // SAFETY: see above.
    unsafe { dequant_bf16(row, y) }
}

pub(super) fn dequantize_row_q4_k(x: &[BlockQ4_K], y: &mut [f32]) {
    assert_eq!(
        y.len(),
        x.len() * crate::QK_K,
        "q4_K dequantize_row lengths"
    );
    // SAFETY: see above.
    unsafe { kquants::dequant_q4_k(x, y) }
}

pub(super) fn dequantize_row_q6_k(x: &[BlockQ6_K], y: &mut [f32]) {
    assert_eq!(
        y.len(),
        x.len() * crate::QK_K,
        "q6_K dequantize_row lengths"
    );
    // SAFETY: see above.
    unsafe { kquants::dequant_q6_k(x, y) }
}

pub(super) fn vec_dot_q4_0_q8_0(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32 {
    assert_eq!(x.len(), y.len(), "vec_dot_q4_0_q8_0 block counts");
    // SAFETY: see above.
    unsafe { dot_q4_0_q8_0(x, y) }
}

pub(super) fn vec_dot_q4_1_q8_0(x: &[BlockQ4_1], y: &[BlockQ8_0]) -> f32 {
    assert_eq!(x.len(), y.len(), "vec_dot_q4_1_q8_0 block counts");
    // SAFETY: see above.
    unsafe { dot_q4_1_q8_0(x, y) }
}

pub(super) fn vec_dot_q5_0_q8_0(x: &[BlockQ5_0], y: &[BlockQ8_0]) -> f32 {
    assert_eq!(x.len(), y.len(), "vec_dot_q5_0_q8_0 block counts");
    // SAFETY: see above.
    unsafe { dot_q5_0_q8_0(x, y) }
}

pub(super) fn vec_dot_q8_0_q8_0(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> f32 {
    assert_eq!(x.len(), y.len(), "vec_dot_q8_0_q8_0 block counts");
    // SAFETY: see above.
    unsafe { dot_q8_0_q8_0(x, y) }
}

pub(super) fn vec_dot_f32(x: &[f32], y: &[f32]) -> f32 {
    assert_eq!(x.len(), y.len(), "vec_dot_f32 lengths");
    // SAFETY: see above.
    unsafe { dot_f32(x, y) }
}

pub(super) fn vec_dot_f32_fused(x: &[f32], y: &[f32]) -> f32 {
    assert_eq!(x.len(), y.len(), "vec_dot_f32_fused lengths");
    // SAFETY: see above.
    unsafe { dot_f32_fused(x, y) }
}

pub(super) fn dequantize_row_q4_1(x: &[BlockQ4_1], y: &mut [f32]) {
    assert_eq!(y.len(), x.len() * QK4_1, "q4_1 dequantize_row lengths");
    // SAFETY: see above.
    unsafe { dequant_q4_1(x, y) }
}

pub(super) fn dequantize_row_q8_0(x: &[BlockQ8_0], y: &mut [f32]) {
    assert_eq!(y.len(), x.len() * QK8_0, "q8_0 dequantize_row lengths");
    // SAFETY: see above.
    unsafe { dequant_q8_0(x, y) }
}

pub(super) fn quantize_row_q8_0(x: &[f32], y: &mut [BlockQ8_0]) {
    assert_eq!(x.len(), y.len() * QK8_0, "q8_0 quantize_row_ref lengths");
    // SAFETY: see above.
    unsafe { quant_q8_0(x, y) }
}

pub(super) fn quantize_act16(x: &[f32], q: &mut [i16], scale: &mut [f32], sum: &mut [f32]) {
    crate::act16::check_quantize(x.len(), q.len(), scale.len(), sum.len());
    // SAFETY: see above.
    unsafe { quant_act16(x, q, scale, sum) }
}

/// [`crate::act16::gemm_q4_1_ref`] and [`crate::act16::gemm_q8_0_ref`] on
/// packed rows.
fn gemm_act16<B: Block16>(w: F2Rows<'_, B>, acts: &crate::act16::Act16, out: &mut [f32]) {
    crate::act16::check_gemm_rows(&w, acts, out.len());
    // SAFETY: see above; the shapes were checked, as `gem16` requires.
    unsafe { gem16(w, acts, out) }
}

pub(super) fn dot_fma1(w: &[f32], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_fma1 lengths");
    // SAFETY: see above.
    unsafe { fma1(w, x) }
}

pub(super) fn matvec_q4_1_q8_0(w: &[BlockQ4_1], y: &[BlockQ8_0], out: &mut [f32]) {
    let nb = crate::q8_matvec::check_rows(w.len(), y.len(), out.len());
    if nb == 0 {
        return crate::q8_matvec::matvec_q4_1_q8_0_ref(w, y, out);
    }
    // SAFETY: see above; the shapes were checked, as `gemq_q4_1` requires.
    unsafe { gemq_q4_1(Q4_1Blocks { w, nb }, nb, y, out) }
}

pub(super) fn gemm_q4_1_q8_0(w: &[BlockQ4_1], y: &[BlockQ8_0], nb: usize, out: &mut [f32]) {
    crate::q8_matvec::check_gemm(w.len(), y.len(), nb, out.len());
    if nb == 0 {
        return crate::q8_matvec::gemm_q4_1_q8_0_ref(w, y, nb, out);
    }
    // SAFETY: see above; the shapes were checked, as `gemq_q4_1` requires.
    unsafe { gemq_q4_1(Q4_1Blocks { w, nb }, nb, y, out) }
}

/// [`gemm_q4_1_q8_0`] on packed rows.
pub(super) fn gemm_q4_1_q8_0_f2(w: F2Rows<'_, BlockQ4_1>, y: &[BlockQ8_0], out: &mut [f32]) {
    let nb = crate::q8_matvec::check_gemm_f2(&w, y, out.len());
    // SAFETY: see above; the shapes were checked, as `gemq_q4_1` requires.
    unsafe { gemq_q4_1(w, nb, y, out) }
}

pub(super) fn matvec_q8_0_q8_0(w: &[BlockQ8_0], y: &[BlockQ8_0], out: &mut [f32]) {
    let nb = crate::q8_matvec::check_rows(w.len(), y.len(), out.len());
    if nb == 0 {
        return crate::q8_matvec::matvec_q8_0_q8_0_ref(w, y, out);
    }
    // SAFETY: see above; the shapes were checked, as `mvq_q8_0` requires.
    unsafe { mvq_q8_0(w, nb, y, out) }
}

pub(super) fn gemm_tile(w: &[f32], x: &[f32], k: usize, out: &mut [f32]) {
    let (rows, toks) = crate::fast::check_tile(w.len(), x.len(), k, out.len());
    if !k.is_multiple_of(8) {
        return crate::fast::gemm_tile_ref(w, x, k, out);
    }
    // SAFETY: see above; `check_tile` and the `k % 8` test establish the
    // shapes `tile` requires.
    unsafe { super::dispatch_tile!(tile, rows, toks, (w, x, k, out)) }
}

pub(super) fn exp_inplace(x: &mut [f32]) {
    // SAFETY: see above.
    unsafe { exp_slice(x) }
}

/// A tier's grouped attention step for one chunk of at most `MAX_QUERIES`
/// queries of a KV head's group, which share every K and V load: the chunk's
/// scores, each query's softmax step, then the V rows accumulated into the
/// chunk's outputs ([`attn_group`] walks a group's chunks).
pub(super) trait AttnChunk<T> {
    /// Queries per chunk.
    const MAX_QUERIES: usize;
    /// [`crate::attn::attn_group_ref`] for the `st.len()` (at most
    /// `MAX_QUERIES`) queries `q` over `n` rows of `hd` elements (`n_hd`),
    /// with outputs `acc` and score slots `s`.
    ///
    /// # Safety
    /// `hd % 8 == 0`, `hd > 0`, `n > 0`, `k.len() == v.len() == n·hd`,
    /// `q.len() == acc.len() == st.len()·hd`, `s.len() == st.len()·n`, and the
    /// CPU has the tier's features.
    #[allow(clippy::too_many_arguments)]
    unsafe fn chunk<const STREAM: bool>(
        q: &[f32],
        k: &[T],
        v: &[T],
        n_hd: (usize, usize),
        scale: f32,
        st: &mut [Running],
        acc: &mut [f32],
        s: &mut [f32],
    );
}

/// [`crate::attn::attn_group_ref`] by the tier of `K`: the table entry of the
/// AVX2 and AVX-512 tiers (head sizes that are not a multiple of 8 go to the
/// reference). The group is taken in chunks of `K::MAX_QUERIES` queries.
#[allow(clippy::too_many_arguments)]
pub(super) fn attn_group<T: crate::attn::KvElem, K: AttnChunk<T>>(
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
    let mut g0 = 0;
    while g0 < st.len() {
        let g1 = (g0 + K::MAX_QUERIES).min(st.len());
        let (q, st) = (&q[g0 * hd..g1 * hd], &mut st[g0..g1]);
        let (acc, s) = (&mut acc[g0 * hd..g1 * hd], &mut scores[g0 * n..g1 * n]);
        // SAFETY: `K`'s table is handed out only after detecting its tier's
        // features; `check_group` and the `hd % 8` test establish the shapes,
        // restricted to the chunk's queries.
        unsafe {
            if stream {
                K::chunk::<true>(q, k, v, (n, hd), scale, st, acc, s)
            } else {
                K::chunk::<false>(q, k, v, (n, hd), scale, st, acc, s)
            }
        }
        g0 = g1;
    }
}

pub(super) fn widen_f16(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen_f16 lengths");
    // SAFETY: see above.
    unsafe { widen_f16_x8(src, dst) }
}

// ---- loads and stores -------------------------------------------------------

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load_u8x16(b: &[u8; 16]) -> __m128i {
    // SAFETY: `b` is 16 readable bytes; `loadu` has no alignment requirement.
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load_i8x32(b: &[i8; 32]) -> __m256i {
    // SAFETY: `b` is 32 readable bytes; `loadu` has no alignment requirement.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

/// Bytes `8k..8k + 8` of `b` in the low half.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load_i8x8(b: &[i8; 32], k: usize) -> __m128i {
    let part: &[i8; 8] = b[8 * k..8 * k + 8].try_into().unwrap();
    // SAFETY: `part` is 8 readable bytes, exactly what `loadl_epi64` reads.
    unsafe { _mm_loadl_epi64(part.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn load_f32x8(x: &[f32]) -> __m256 {
    let x: &[f32; 8] = x[..8].try_into().unwrap();
    // SAFETY: `x` is 8 readable f32s; `loadu` has no alignment requirement.
    unsafe { _mm256_loadu_ps(x.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn store_f32x8(out: &mut [f32], v: __m256) {
    let out: &mut [f32; 8] = (&mut out[..8]).try_into().unwrap();
    // SAFETY: `out` is 8 writable f32s; `storeu` has no alignment requirement.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn store_f32x4(out: &mut [f32], v: __m128) {
    let out: &mut [f32; 4] = (&mut out[..4]).try_into().unwrap();
    // SAFETY: `out` is 4 writable f32s; `storeu` has no alignment requirement.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), v) }
}

/// The first 4 bytes of each of up to 8 blocks (their f16 `d`, and for Q4_1
/// also `m`), one per 32-bit lane; lanes past `blocks.len()` are 0.
/// Eight scalar loads and unpacks: `vpgatherdd` is slower, and so is a
/// round trip through the stack.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn gather_head<T: bytemuck::Pod>(blocks: &[T]) -> __m256i {
    const { assert!(size_of::<T>() >= 4) };
    let head = |i: usize| match blocks.get(i) {
        Some(b) => {
            let b = bytemuck::bytes_of(b);
            _mm_cvtsi32_si128(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        }
        None => _mm_setzero_si128(),
    };
    let h01 = _mm_unpacklo_epi32(head(0), head(1));
    let h23 = _mm_unpacklo_epi32(head(2), head(3));
    let h45 = _mm_unpacklo_epi32(head(4), head(5));
    let h67 = _mm_unpacklo_epi32(head(6), head(7));
    _mm256_set_m128i(_mm_unpacklo_epi64(h45, h67), _mm_unpacklo_epi64(h01, h23))
}

// ---- small helpers ------------------------------------------------------------

/// Widens the f16 in the low 16 bits of each 32-bit lane (exactly).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_lo(v: __m256i) -> __m256 {
    let v = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
    let h = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    _mm256_cvtph_ps(h)
}

/// Widens the f16 in the high 16 bits of each 32-bit lane (exactly).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_hi(v: __m256i) -> __m256 {
    let v = _mm256_srli_epi32::<16>(v);
    let h = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    _mm256_cvtph_ps(h)
}

/// `[a, b, 0, 0]` widened from f16 (exactly, like [`crate::f16::fp16_to_fp32`]) without
/// the `half` crate's per-call feature check.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16x2_to_f32(a: [u8; 2], b: [u8; 2]) -> __m128 {
    let bits = u32::from_le_bytes([a[0], a[1], b[0], b[1]]);
    _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))
}

/// Lanes 8k..8k+8 of the 32 bytes of `v` widened to i32, zero- or sign-extended.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn widen8<const SIGNED: bool>(v: __m256i, k: usize) -> __m256i {
    let half = if k < 2 {
        _mm256_castsi256_si128(v)
    } else {
        _mm256_extracti128_si256::<1>(v)
    };
    let part = if k.is_multiple_of(2) {
        half
    } else {
        _mm_srli_si128::<8>(half)
    };
    if SIGNED {
        _mm256_cvtepi8_epi32(part)
    } else {
        _mm256_cvtepu8_epi32(part)
    }
}

/// `out[i] = q[i]·d` for the 32 signed bytes of `q`: the scalar's `q as f32 * d`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn store_scaled_i8x32(q: __m256i, d: __m256, out: &mut [f32]) {
    for (k, out) in out[..32].chunks_exact_mut(8).enumerate() {
        let v = _mm256_cvtepi32_ps(widen8::<true>(q, k));
        store_f32x8(out, _mm256_mul_ps(v, d));
    }
}

/// Lane `i` of the result is the sum of the 8 lanes of `p[i]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_8x8(p: &[__m256i; 8]) -> __m256i {
    // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7].
    let p01 = _mm256_hadd_epi32(p[0], p[1]);
    let p23 = _mm256_hadd_epi32(p[2], p[3]);
    let p45 = _mm256_hadd_epi32(p[4], p[5]);
    let p67 = _mm256_hadd_epi32(p[6], p[7]);
    // [Σp0[0..4], Σp1[0..4], Σp2[0..4], Σp3[0..4] | the same over lanes 4..8].
    let p0123 = _mm256_hadd_epi32(p01, p23);
    let p4567 = _mm256_hadd_epi32(p45, p67);
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(p0123, p4567),
        _mm256_permute2x128_si256::<0x31>(p0123, p4567),
    )
}

/// `sumf += terms[i]` for `i` in `0..n`, in order: the scalar loop's serial sum.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn add_in_order(mut sumf: f32, terms: __m256, n: usize) -> f32 {
    let mut t = [0.0f32; 8];
    store_f32x8(&mut t, terms);
    for &v in &t[..n] {
        sumf += v;
    }
    sumf
}

/// The 32 nibbles of a Q4 block as bytes 0..15, element order
/// (low nibbles are elements 0..16, high nibbles 16..32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nibbles(qs: &[u8; 16]) -> __m256i {
    let q = load_u8x16(qs);
    let m = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(q, m);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), m);
    _mm256_set_m128i(hi, lo)
}

/// Byte `i` is 0xFF if bit `i` of `bits` is set, else 0 (ggml's `bytes_from_bits_32`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bytes_from_bits(bits: u32) -> __m256i {
    let v = _mm256_set1_epi32(bits as i32);
    // Byte i gets byte i / 8 of `bits`...
    let shuf = _mm256_setr_epi64x(
        0x0000_0000_0000_0000,
        0x0101_0101_0101_0101,
        0x0202_0202_0202_0202,
        0x0303_0303_0303_0303,
    );
    let v = _mm256_shuffle_epi8(v, shuf);
    // ...and is all ones exactly when bit i % 8 of it is set.
    let v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe_u64 as i64));
    _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1))
}

/// Pairwise i16 sums to i32 (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sum_pairs_i16(v: __m256i) -> __m256i {
    _mm256_madd_epi16(v, _mm256_set1_epi16(1))
}

// ---- per-block integer sums (8 partial i32 lanes, exact) ------------------------

/// Σ (q - 8)·y. `maddubs` of the unsigned nibbles never saturates
/// (|pair| <= 2·15·128), nor does 8·(y0 + y1), nor their difference.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sumi_q4_0(x: &BlockQ4_0, y: &BlockQ8_0) -> __m256i {
    let q = nibbles(&x.qs);
    let y = load_i8x32(&y.qs);
    let qy = _mm256_maddubs_epi16(q, y);
    let y8 = _mm256_maddubs_epi16(_mm256_set1_epi8(8), y);
    sum_pairs_i16(_mm256_sub_epi16(qy, y8))
}

/// (Σ q·y, Σ y). No saturation: |pair| <= 2·15·128 and 2·128.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sumi_q4_1(x: &BlockQ4_1, y: &BlockQ8_0) -> (__m256i, __m256i) {
    let q = nibbles(&x.qs);
    let y = load_i8x32(&y.qs);
    let qy = _mm256_maddubs_epi16(q, y);
    let sy = _mm256_maddubs_epi16(_mm256_set1_epi8(1), y);
    (sum_pairs_i16(qy), sum_pairs_i16(sy))
}

/// Σ (q - 16)·y with q = nibble | fifth bit << 4. No saturation:
/// |pair| <= 2·31·128, 16·(y0 + y1) <= 4096, difference within i16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sumi_q5_0(x: &BlockQ5_0, y: &BlockQ8_0) -> __m256i {
    let high = _mm256_and_si256(
        bytes_from_bits(u32::from_le_bytes(x.qh)),
        _mm256_set1_epi8(0x10),
    );
    let q = _mm256_or_si256(nibbles(&x.qs), high);
    let y = load_i8x32(&y.qs);
    let qy = _mm256_maddubs_epi16(q, y);
    let y16 = _mm256_maddubs_epi16(_mm256_set1_epi8(16), y);
    sum_pairs_i16(_mm256_sub_epi16(qy, y16))
}

/// Σ x·y, sign-extended to i16 first so that every i8 value, -128 included,
/// is exact (the `abs`/`sign` + `maddubs` trick is not, for -128).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sumi_q8_0(x: &BlockQ8_0, y: &BlockQ8_0) -> __m256i {
    let xv = load_i8x32(&x.qs);
    let yv = load_i8x32(&y.qs);
    let x0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(xv));
    let x1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(xv));
    let y0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(yv));
    let y1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(yv));
    _mm256_add_epi32(_mm256_madd_epi16(x0, y0), _mm256_madd_epi16(x1, y1))
}

// ---- dot products ---------------------------------------------------------------

/// [`crate::q4_0::vec_dot_q4_0_q8_0`]: `sumf += (sumi·dx)·dy`.
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q4_0_q8_0(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0.0f32;
    for (xc, yc) in x.chunks(8).zip(y.chunks(8)) {
        let mut p = [_mm256_setzero_si256(); 8];
        for (p, (bx, by)) in p.iter_mut().zip(xc.iter().zip(yc)) {
            *p = sumi_q4_0(bx, by);
        }
        let sumi = _mm256_cvtepi32_ps(hsum_8x8(&p));
        let dx = f16_lo(gather_head(xc));
        let dy = f16_lo(gather_head(yc));
        let terms = _mm256_mul_ps(_mm256_mul_ps(sumi, dx), dy);
        sumf = add_in_order(sumf, terms, xc.len());
    }
    sumf
}

/// [`crate::q4_1::vec_dot_q4_1_q8_0`]: `sumf += (dx·dy)·sumi + m·(sum8·dy)`.
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q4_1_q8_0(x: &[BlockQ4_1], y: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0.0f32;
    for (xc, yc) in x.chunks(8).zip(y.chunks(8)) {
        let mut pi = [_mm256_setzero_si256(); 8];
        let mut p8 = [_mm256_setzero_si256(); 8];
        for (i, (bx, by)) in xc.iter().zip(yc).enumerate() {
            (pi[i], p8[i]) = sumi_q4_1(bx, by);
        }
        let sumi = _mm256_cvtepi32_ps(hsum_8x8(&pi));
        let sum8 = _mm256_cvtepi32_ps(hsum_8x8(&p8));
        let head = gather_head(xc);
        let (dx, mx) = (f16_lo(head), f16_hi(head));
        let dy = f16_lo(gather_head(yc));
        let s = _mm256_mul_ps(sum8, dy);
        let terms = _mm256_add_ps(
            _mm256_mul_ps(_mm256_mul_ps(dx, dy), sumi),
            _mm256_mul_ps(mx, s),
        );
        sumf = add_in_order(sumf, terms, xc.len());
    }
    sumf
}

/// [`crate::q5_0::vec_dot_q5_0_q8_0`]: `sumf += (dx·dy)·sumi`.
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q5_0_q8_0(x: &[BlockQ5_0], y: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0.0f32;
    for (xc, yc) in x.chunks(8).zip(y.chunks(8)) {
        let mut p = [_mm256_setzero_si256(); 8];
        for (p, (bx, by)) in p.iter_mut().zip(xc.iter().zip(yc)) {
            *p = sumi_q5_0(bx, by);
        }
        let sumi = _mm256_cvtepi32_ps(hsum_8x8(&p));
        let dx = f16_lo(gather_head(xc));
        let dy = f16_lo(gather_head(yc));
        let terms = _mm256_mul_ps(_mm256_mul_ps(dx, dy), sumi);
        sumf = add_in_order(sumf, terms, xc.len());
    }
    sumf
}

/// [`crate::q8_0::vec_dot_q8_0_q8_0`]: `sumf += sumi·(dx·dy)`.
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q8_0_q8_0(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0.0f32;
    for (xc, yc) in x.chunks(8).zip(y.chunks(8)) {
        let mut p = [_mm256_setzero_si256(); 8];
        for (p, (bx, by)) in p.iter_mut().zip(xc.iter().zip(yc)) {
            *p = sumi_q8_0(bx, by);
        }
        let sumi = _mm256_cvtepi32_ps(hsum_8x8(&p));
        let dx = f16_lo(gather_head(xc));
        let dy = f16_lo(gather_head(yc));
        let terms = _mm256_mul_ps(sumi, _mm256_mul_ps(dx, dy));
        sumf = add_in_order(sumf, terms, xc.len());
    }
    sumf
}

/// `sumf[r] += terms[r][i]` for `i` in `0..n`, in order, for four rows at once:
/// four lanes of the scalar loop's serial sum (IEEE addition is the same in a
/// lane as in a scalar register).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn add_in_order_x4(mut sumf: __m128, t: &[__m256; 4], n: usize) -> __m128 {
    // Transpose: v_i = [t0[i] t1[i] t2[i] t3[i] | t0[i+4] t1[i+4] t2[i+4] t3[i+4]].
    let u0 = _mm256_unpacklo_ps(t[0], t[1]);
    let u1 = _mm256_unpackhi_ps(t[0], t[1]);
    let u2 = _mm256_unpacklo_ps(t[2], t[3]);
    let u3 = _mm256_unpackhi_ps(t[2], t[3]);
    let v = [
        _mm256_shuffle_ps::<0x44>(u0, u2),
        _mm256_shuffle_ps::<0xEE>(u0, u2),
        _mm256_shuffle_ps::<0x44>(u1, u3),
        _mm256_shuffle_ps::<0xEE>(u1, u3),
    ];
    let lo = |i: usize| _mm256_castps256_ps128(v[i]);
    let hi = |i: usize| _mm256_extractf128_ps::<1>(v[i]);
    if n == 8 {
        for i in 0..4 {
            sumf = _mm_add_ps(sumf, lo(i));
        }
        for i in 0..4 {
            sumf = _mm_add_ps(sumf, hi(i));
        }
    } else {
        for i in 0..n {
            sumf = _mm_add_ps(sumf, if i < 4 { lo(i) } else { hi(i - 4) });
        }
    }
    sumf
}

/// The float terms `sumi·(dx·dy)` of up to eight Q8_0 blocks, as
/// [`dot_q8_0_q8_0`] forms them (`dy` given). With `NO_MIN_Y` (no activation quant
/// is -128) each block's sum is `maddubs(|x|, sign(y, x))`: |x| <= 128 as an
/// unsigned byte and |sign(y, x)| <= 127, so a pair is at most 2·128·127 and never
/// saturates, and Σ|x|·sign(y, x) = Σx·y exactly. Otherwise both sides are widened
/// to i16 first (exact for any bytes).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q8_0_terms<const NO_MIN_Y: bool>(xc: &[BlockQ8_0], yc: &[BlockQ8_0], dy: __m256) -> __m256 {
    let mut p = [_mm256_setzero_si256(); 8];
    for (p, (bx, by)) in p.iter_mut().zip(xc.iter().zip(yc)) {
        *p = if NO_MIN_Y {
            let (x, y) = (load_i8x32(&bx.qs), load_i8x32(&by.qs));
            sum_pairs_i16(_mm256_maddubs_epi16(
                _mm256_abs_epi8(x),
                _mm256_sign_epi8(y, x),
            ))
        } else {
            sumi_q8_0(bx, by)
        };
    }
    let sumi = _mm256_cvtepi32_ps(hsum_8x8(&p));
    let dx = f16_lo(gather_head(xc));
    _mm256_mul_ps(sumi, _mm256_mul_ps(dx, dy))
}

/// Whether some quant of `y` is -128 (which `maddubs(|x|, sign(y, x))` cannot
/// take: its negation does not fit in a byte).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn has_min_quant(y: &[BlockQ8_0]) -> bool {
    let min = _mm256_set1_epi8(i8::MIN);
    y.iter()
        .any(|b| _mm256_movemask_epi8(_mm256_cmpeq_epi8(load_i8x32(&b.qs), min)) != 0)
}

/// The activation side of Q4_1 x Q8_0 products for eight blocks, prepared once
/// for every row that meets it: the terms `dy` and `s = sum8·dy` (as
/// [`dot_q4_1_q8_0`] forms them), and the blocks' quants by halves, `lo` the
/// eight blocks' first 16 quants and `hi` their last 16, block after block
/// (zeros past the last block): a pair of blocks' nibbles (one 256-bit load)
/// meets `lo[p]` and `hi[p]`, four blocks' (one 512-bit load) `lo[2k..2k + 2]`
/// and `hi[2k..2k + 2]`.
#[derive(Clone, Copy)]
#[repr(C)]
pub(super) struct Q8Acts {
    pub(super) dy: __m256,
    pub(super) s: __m256,
    pub(super) lo: [__m256i; 4],
    pub(super) hi: [__m256i; 4],
}

/// Prepares `y` for [`Q4_1Terms`], eight blocks per [`Q8Acts`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn prepare_q8_acts(y: &[BlockQ8_0], out: &mut [Q8Acts]) {
    for (yc, a) in y.chunks(8).zip(out.iter_mut()) {
        let mut p8 = [_mm256_setzero_si256(); 8];
        for (p, by) in p8.iter_mut().zip(yc) {
            *p = sum_pairs_i16(_mm256_maddubs_epi16(
                _mm256_set1_epi8(1),
                load_i8x32(&by.qs),
            ));
        }
        a.dy = f16_lo(gather_head(yc));
        a.s = _mm256_mul_ps(_mm256_cvtepi32_ps(hsum_8x8(&p8)), a.dy);
        (a.lo, a.hi) = ([_mm256_setzero_si256(); 4], [_mm256_setzero_si256(); 4]);
        for (p, yp) in yc.chunks(2).enumerate() {
            let x = load_i8x32(&yp[0].qs);
            let z = yp
                .get(1)
                .map_or(_mm256_setzero_si256(), |b| load_i8x32(&b.qs));
            a.lo[p] = _mm256_permute2x128_si256::<0x20>(x, z);
            a.hi[p] = _mm256_permute2x128_si256::<0x31>(x, z);
        }
    }
}

/// Up to eight Q4_1 blocks of one row ready for [`q4_1_pair_terms`]: the low and
/// high nibbles of each block pair as bytes (one 256-bit load per pair), and the
/// blocks' `d` and `m`.
#[derive(Clone, Copy)]
pub(super) struct Q4_1Chunk {
    nibbles: [[__m256i; 2]; 4],
    d: __m256,
    m: __m256,
}

/// Rows of Q4_1 blocks as the Q8-activation kernels read them: the GGUF blocks
/// or the packed [`crate::act16::F2Matrix`] layout, with the same values.
pub(super) trait Q4_1Source: Copy {
    /// Rows held.
    fn n_rows(&self) -> usize;
    /// Blocks `8c..8c + len` of row `r`, unpacked.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C.
    unsafe fn chunk(&self, r: usize, c: usize, len: usize) -> Q4_1Chunk;
    /// The bytes of rows `r..r + n` (what decode prefetches).
    fn rows_bytes(&self, r: usize, n: usize) -> &[u8];
}

/// GGUF blocks, rows of `nb` back to back.
#[derive(Clone, Copy)]
struct Q4_1Blocks<'a> {
    w: &'a [BlockQ4_1],
    nb: usize,
}

impl Q4_1Source for Q4_1Blocks<'_> {
    fn n_rows(&self) -> usize {
        self.w.len() / self.nb
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn chunk(&self, r: usize, c: usize, len: usize) -> Q4_1Chunk {
        let xc = &self.w[r * self.nb + 8 * c..][..len];
        let mut nibbles = [[_mm256_setzero_si256(); 2]; 4];
        for (n, xp) in nibbles.iter_mut().zip(xc.chunks(2)) {
            let hi_block = xp.get(1).map_or(_mm_setzero_si128(), |b| load_u8x16(&b.qs));
            *n = split_nibbles(_mm256_set_m128i(hi_block, load_u8x16(&xp[0].qs)));
        }
        let head = chunk_heads(xc);
        Q4_1Chunk {
            nibbles,
            d: f16_lo(head),
            m: f16_hi(head),
        }
    }

    fn rows_bytes(&self, r: usize, n: usize) -> &[u8] {
        bytemuck::cast_slice(&self.w[r * self.nb..(r + n) * self.nb])
    }
}

impl Q4_1Source for F2Rows<'_, BlockQ4_1> {
    fn n_rows(&self) -> usize {
        self.n_rows
    }

    /// The chunk's heads are one load each, and each pair of blocks' quants one
    /// 256-bit load (they lie back to back).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn chunk(&self, r: usize, c: usize, len: usize) -> Q4_1Chunk {
        const HEAD: usize = <BlockQ4_1 as F2Block>::HEAD_BYTES;
        let at = r * self.row_bytes() + c * <BlockQ4_1 as F2Block>::CHUNK_BYTES;
        let chunk = &self.bytes[at..at + HEAD + 16 * len];
        let mut nibbles = [[_mm256_setzero_si256(); 2]; 4];
        for (p, n) in nibbles.iter_mut().enumerate().take(len.div_ceil(2)) {
            let q = &chunk[HEAD + 32 * p..];
            let q = if q.len() >= 32 {
                let q: &[u8; 32] = q[..32].try_into().unwrap();
                // SAFETY: `q` is 32 readable bytes; `loadu` is unaligned.
                unsafe { _mm256_loadu_si256(q.as_ptr().cast()) }
            } else {
                _mm256_zextsi128_si256(load_u8x16(q[..16].try_into().unwrap()))
            };
            *n = split_nibbles(q);
        }
        let (d, m) = f2_heads::<BlockQ4_1>(chunk);
        Q4_1Chunk { nibbles, d, m }
    }

    fn rows_bytes(&self, r: usize, n: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.bytes[r * rb..(r + n) * rb]
    }
}

/// The low and high nibbles of 32 bytes, as bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn split_nibbles(q: __m256i) -> [__m256i; 2] {
    let low = _mm256_set1_epi8(0x0F);
    [
        _mm256_and_si256(q, low),
        _mm256_and_si256(_mm256_srli_epi16::<4>(q), low),
    ]
}

/// How a tier forms the float terms `(dx·dy)·sumi + m·s` of up to eight blocks
/// of one Q4_1 row (from a source `S`) against activations prepared by
/// [`prepare_q8_acts`], as [`dot_q4_1_q8_0`] forms them (each block's integer
/// sum exact): [`gemq_q4_1_with`] runs any tier's with the same loops.
pub(super) trait Q4_1Terms<S> {
    /// Blocks `8c..8c + len` of one row, unpacked once for every token.
    type Chunk: Copy;
    /// Row `r`'s blocks `8c..8c + len` of `w`.
    ///
    /// # Safety
    /// The CPU has the tier's features.
    unsafe fn unpack(w: &S, r: usize, c: usize, len: usize) -> Self::Chunk;
    /// The chunk's `len` terms, against the token's activations `y` (lanes past
    /// `len` unspecified).
    ///
    /// # Safety
    /// As [`Self::unpack`].
    unsafe fn terms(x: &Self::Chunk, len: usize, y: &Q8Acts) -> __m256;
}

/// The AVX2 terms, from either source: each pair of blocks' nibbles meets the
/// pair's two activation vectors in two `maddubs` (never saturating: |pair| <=
/// 2·15·128, and the two add up within i16), widened to i32 in two halves of
/// four lanes, one half per block; three horizontal adds and a permutation put
/// the eight block sums in block order.
struct Avx2Terms;

impl<S: Q4_1Source> Q4_1Terms<S> for Avx2Terms {
    type Chunk = Q4_1Chunk;

    #[inline(always)]
    unsafe fn unpack(w: &S, r: usize, c: usize, len: usize) -> Q4_1Chunk {
        // SAFETY: the caller guarantees the AVX2 tier's features.
        unsafe { w.chunk(r, c, len) }
    }

    #[inline(always)]
    unsafe fn terms(x: &Q4_1Chunk, len: usize, y: &Q8Acts) -> __m256 {
        // SAFETY: as above.
        unsafe { q4_1_pair_terms(x, len.div_ceil(2), y) }
    }
}

/// [`Avx2Terms::terms`]: the `2·n_pairs` (at most eight) blocks of `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4_1_pair_terms(x: &Q4_1Chunk, n_pairs: usize, y: &Q8Acts) -> __m256 {
    let mut v = [_mm256_setzero_si256(); 4];
    for (p, (v, n)) in v.iter_mut().zip(&x.nibbles).enumerate().take(n_pairs) {
        let sum16 = _mm256_add_epi16(
            _mm256_maddubs_epi16(n[0], y.lo[p]),
            _mm256_maddubs_epi16(n[1], y.hi[p]),
        );
        *v = sum_pairs_i16(sum16);
    }
    // [b0 b2 b4 b6 | b1 b3 b5 b7], then block order.
    let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    let sumi = _mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(
        h,
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
    ));
    q4_1_terms(x.d, x.m, sumi, y)
}

/// `(dx·dy)·sumi + m·s` for eight blocks, as [`dot_q4_1_q8_0`] forms them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q4_1_terms(d: __m256, m: __m256, sumi: __m256, y: &Q8Acts) -> __m256 {
    _mm256_add_ps(
        _mm256_mul_ps(_mm256_mul_ps(d, y.dy), sumi),
        _mm256_mul_ps(m, y.s),
    )
}

/// Per-thread scratch of [`gemq_q4_1_with`]: every token's prepared activations
/// and running sums.
#[derive(Default)]
pub(super) struct GemqScratch {
    acts: Vec<Q8Acts>,
    sums: Vec<__m128>,
}

thread_local! {
    pub(super) static GEMQ_SCRATCH: std::cell::RefCell<GemqScratch> =
        std::cell::RefCell::new(GemqScratch::default());
}

/// [`gemq_q4_1_with`] on this tier.
#[target_feature(enable = "avx2,fma,f16c")]
fn gemq_q4_1<S: Q4_1Source>(w: S, nb: usize, y: &[BlockQ8_0], out: &mut [f32]) {
    // SAFETY: AVX2, FMA and F16C are enabled here (and in the closure, which
    // inherits them); the callers checked the shapes.
    GEMQ_SCRATCH.with_borrow_mut(|sc| unsafe { gemq_q4_1_with::<S, Avx2Terms>(w, nb, y, out, sc) })
}

/// [`crate::q8_matvec::gemm_q4_1_q8_0_ref`] (and with one token
/// [`crate::q8_matvec::matvec_q4_1_q8_0_ref`]): the rows of `w` (`nb` blocks each)
/// against every token of `y`, each value with the arithmetic of
/// [`dot_q4_1_q8_0`] (exact integer block sums, float terms eight blocks wide,
/// the serial sum in block order), the terms formed by the tier's `K`. Every
/// token's activations are prepared once ([`prepare_q8_acts`]); then, four rows
/// and eight blocks at a time, the rows' chunks are unpacked once and met by
/// every token, each token's four serial sums carried in the lanes of one
/// register (a last group of fewer rows adds zeros in the missing lanes). One
/// token (decode) prefetches the rows two groups ahead. Inlined into each
/// tier's entry, whose target features it then runs with (so it calls the
/// tier's functions directly, never from a closure, which would not inherit
/// them).
///
/// # Safety
/// The CPU has the features of `K`'s tier (which include AVX2, FMA and F16C);
/// `w` holds rows of `nb > 0` blocks and `y` whole tokens of `nb` blocks, and
/// `out` one value per (token, row).
#[inline(always)]
pub(super) unsafe fn gemq_q4_1_with<S: Q4_1Source, K: Q4_1Terms<S>>(
    w: S,
    nb: usize,
    y: &[BlockQ8_0],
    out: &mut [f32],
    sc: &mut GemqScratch,
) {
    let (n_tok, n_rows) = (y.len() / nb, w.n_rows());
    if n_rows == 0 || n_tok == 0 {
        return;
    }
    let n_chunks = nb.div_ceil(8);
    // SAFETY: the caller guarantees the features of `K`'s tier, which include
    // the AVX2 tier's that the callees need (here and in every block below).
    let (zero_acts, zero4, zero8) = unsafe {
        let acts = Q8Acts {
            dy: _mm256_setzero_ps(),
            s: _mm256_setzero_ps(),
            lo: [_mm256_setzero_si256(); 4],
            hi: [_mm256_setzero_si256(); 4],
        };
        (acts, _mm_setzero_ps(), _mm256_setzero_ps())
    };
    sc.acts.resize(n_tok * n_chunks, zero_acts);
    sc.sums.resize(n_tok, zero4);
    for (yt, acts) in y.chunks_exact(nb).zip(sc.acts.chunks_exact_mut(n_chunks)) {
        // SAFETY: as above.
        unsafe { prepare_q8_acts(yt, acts) };
    }
    for r0 in (0..n_rows).step_by(4) {
        let valid = (n_rows - r0).min(4);
        let ahead = Prefetch::new(w.rows_bytes(r0, valid), 2, n_chunks);
        sc.sums[..n_tok].fill(zero4);
        for c in 0..n_chunks {
            let len = (nb - 8 * c).min(8);
            let mut terms = [zero8; 4];
            if n_tok == 1 {
                // SAFETY: as above.
                unsafe { ahead.step(c) };
                // Each row's chunk is unpacked and met at once (keeping four
                // unpacked chunks alive would spill them).
                for (r, t) in terms.iter_mut().enumerate().take(valid) {
                    // SAFETY: as above.
                    *t = unsafe { K::terms(&K::unpack(&w, r0 + r, c, len), len, &sc.acts[c]) };
                }
                // SAFETY: as above.
                sc.sums[0] = unsafe { add_in_order_x4(sc.sums[0], &terms, len) };
                continue;
            }
            let mut x = [None; 4];
            for (r, x) in x.iter_mut().enumerate().take(valid) {
                // SAFETY: as above.
                *x = Some(unsafe { K::unpack(&w, r0 + r, c, len) });
            }
            for (t, sumf) in sc.sums[..n_tok].iter_mut().enumerate() {
                let acts = &sc.acts[t * n_chunks + c];
                for (t, x) in terms.iter_mut().zip(&x) {
                    if let Some(x) = x {
                        // SAFETY: as above.
                        *t = unsafe { K::terms(x, len, acts) };
                    }
                }
                // SAFETY: as above.
                *sumf = unsafe { add_in_order_x4(*sumf, &terms, len) };
            }
        }
        for (t, sumf) in sc.sums[..n_tok].iter().enumerate() {
            let mut lanes = [0.0f32; 4];
            // SAFETY: as above.
            unsafe { store_f32x4(&mut lanes, *sumf) };
            out[t * n_rows + r0..t * n_rows + r0 + valid].copy_from_slice(&lanes[..valid]);
        }
    }
}

/// [`crate::q8_matvec::matvec_q8_0_q8_0_ref`] for rows of `nb` blocks, four rows
/// at a time like [`gemq_q4_1`], each like [`dot_q8_0_q8_0`]; the sign trick of
/// [`q8_0_terms`] unless an activation quant is -128 (never, for activations
/// from [`crate::q8_0::quantize_row_ref`], whose quants lie in -127..=127).
#[target_feature(enable = "avx2,fma,f16c")]
fn mvq_q8_0(w: &[BlockQ8_0], nb: usize, y: &[BlockQ8_0], out: &mut [f32]) {
    if has_min_quant(y) {
        mvq_q8_0_rows::<false>(w, nb, y, out)
    } else {
        mvq_q8_0_rows::<true>(w, nb, y, out)
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn mvq_q8_0_rows<const NO_MIN_Y: bool>(
    w: &[BlockQ8_0],
    nb: usize,
    y: &[BlockQ8_0],
    out: &mut [f32],
) {
    let mut rows = w.chunks_exact(4 * nb);
    let mut outs = out.chunks_exact_mut(4);
    for (w4, o4) in rows.by_ref().zip(outs.by_ref()) {
        let mut sumf = _mm_setzero_ps();
        let ahead = Prefetch::new(w4, 2, nb.div_ceil(8));
        for (c, yc) in y.chunks(8).enumerate() {
            ahead.step(c);
            let dy = f16_lo(gather_head(yc));
            let xc = |r: usize| &w4[r * nb + 8 * c..][..yc.len()];
            let terms = [
                q8_0_terms::<NO_MIN_Y>(xc(0), yc, dy),
                q8_0_terms::<NO_MIN_Y>(xc(1), yc, dy),
                q8_0_terms::<NO_MIN_Y>(xc(2), yc, dy),
                q8_0_terms::<NO_MIN_Y>(xc(3), yc, dy),
            ];
            sumf = add_in_order_x4(sumf, &terms, yc.len());
        }
        store_f32x4(o4, sumf);
    }
    for (row, o) in rows.remainder().chunks_exact(nb).zip(outs.into_remainder()) {
        *o = dot_q8_0_q8_0(row, y);
    }
}

/// [`crate::f32::vec_dot_f32_ref`]: lane `l` accumulates elements `i ≡ l (mod 8)`
/// as `acc + x·y`; tail and reduction as the scalar code.
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f32(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let xc = x.chunks_exact(8);
    let yc = y.chunks_exact(8);
    let (xt, yt) = (xc.remainder(), yc.remainder());
    for (xs, ys) in xc.zip(yc) {
        acc = _mm256_add_ps(acc, _mm256_mul_ps(load_f32x8(xs), load_f32x8(ys)));
    }
    let mut lanes = [0.0f32; 8];
    store_f32x8(&mut lanes, acc);
    for ((a, &xv), &yv) in lanes.iter_mut().zip(xt).zip(yt) {
        *a += xv * yv;
    }
    crate::f32::reduce_lanes(&lanes)
}

/// [`crate::f32::vec_dot_f32_fused`] on this tier: four 8-lane FMA
/// accumulators, so its order (fixed, tested bit for bit) is:
/// 1. `acc[k][l] = fma(x[i], y[i], acc[k][l])` for `i = 32c + 8k + l`, over the
///    whole 32-element chunks `c` in order;
/// 2. the remaining whole 8-element chunks go to `acc[0]`, `acc[1]`, `acc[2]`
///    the same way;
/// 3. `lanes = (acc[0] + acc[1]) + (acc[2] + acc[3])`, lane by lane;
/// 4. the last `n % 8` elements: `lanes[l] = fma(x[i], y[i], lanes[l])` with
///    `l = i % 8`;
/// 5. the lane reduction of [`crate::f32`].
///
/// The FMA rounds once per element instead of twice: slightly more accurate
/// than [`dot_f32`], and about twice as fast for n >= 256 (four independent
/// add chains instead of one).
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f32_fused(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 4];
    let x32 = x.chunks_exact(32);
    let y32 = y.chunks_exact(32);
    let (xr, yr) = (x32.remainder(), y32.remainder());
    for (xs, ys) in x32.zip(y32) {
        for (k, acc) in acc.iter_mut().enumerate() {
            let (xk, yk) = (load_f32x8(&xs[8 * k..]), load_f32x8(&ys[8 * k..]));
            *acc = _mm256_fmadd_ps(xk, yk, *acc);
        }
    }
    let x8 = xr.chunks_exact(8);
    let y8 = yr.chunks_exact(8);
    let (xt, yt) = (x8.remainder(), y8.remainder());
    for ((xs, ys), acc) in x8.zip(y8).zip(acc.iter_mut()) {
        *acc = _mm256_fmadd_ps(load_f32x8(xs), load_f32x8(ys), *acc);
    }
    let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut lanes = [0.0f32; 8];
    store_f32x8(&mut lanes, sum);
    for ((a, &xv), &yv) in lanes.iter_mut().zip(xt).zip(yt) {
        *a = xv.mul_add(yv, *a);
    }
    crate::f32::reduce_lanes(&lanes)
}

// ---- conversions ----------------------------------------------------------------

/// [`crate::q4_1::dequantize_row`]: `q·d + m`, multiply then add.
#[target_feature(enable = "avx2,fma,f16c")]
fn dequant_q4_1(x: &[BlockQ4_1], y: &mut [f32]) {
    for (b, out) in x.iter().zip(y.chunks_exact_mut(QK4_1)) {
        let dm = f16x2_to_f32(b.d, b.m);
        let d = _mm256_broadcastss_ps(dm);
        let m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        // Bytes 0..8 and 8..16 widened to i32; low nibbles are elements 0..16,
        // high nibbles 16..32.
        let q = load_u8x16(&b.qs);
        let w0 = _mm256_cvtepu8_epi32(q);
        let w1 = _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(q));
        let low = _mm256_set1_epi32(0x0F);
        let quants = [
            _mm256_and_si256(w0, low),
            _mm256_and_si256(w1, low),
            _mm256_srli_epi32::<4>(w0),
            _mm256_srli_epi32::<4>(w1),
        ];
        for (q, out) in quants.into_iter().zip(out.chunks_exact_mut(8)) {
            let q = _mm256_cvtepi32_ps(q);
            store_f32x8(out, _mm256_add_ps(_mm256_mul_ps(q, d), m));
        }
    }
}

/// [`crate::q8_0::dequantize_row`]: `q·d`.
#[target_feature(enable = "avx2,fma,f16c")]
fn dequant_q4_0(x: &[BlockQ4_0], y: &mut [f32]) {
    for (b, out) in x.iter().zip(y.chunks_exact_mut(QK8_0)) {
        let d = _mm256_broadcastss_ps(f16x2_to_f32(b.d, [0; 2]));
        let q = _mm256_sub_epi8(nibbles(&b.qs), _mm256_set1_epi8(8));
        store_scaled_i8x32(q, d, out);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dequant_q5_0(x: &[BlockQ5_0], y: &mut [f32]) {
    for (b, out) in x.iter().zip(y.chunks_exact_mut(QK8_0)) {
        let d = _mm256_broadcastss_ps(f16x2_to_f32(b.d, [0; 2]));
        let high = _mm256_and_si256(
            bytes_from_bits(u32::from_le_bytes(b.qh)),
            _mm256_set1_epi8(0x10),
        );
        let q = _mm256_or_si256(nibbles(&b.qs), high);
        store_scaled_i8x32(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), d, out);
    }
}

/// Little-endian f16 (any alignment) widened by F16C, exactly.
#[target_feature(enable = "avx2,fma,f16c")]
fn dequant_f16(row: &[u8], y: &mut [f32]) {
    let whole = y.len() / 8 * 8;
    for (h, out) in row.chunks_exact(16).zip(y[..whole].chunks_exact_mut(8)) {
        let h: &[u8; 16] = h.try_into().unwrap();
        store_f32x8(out, _mm256_cvtph_ps(load_u8x16(h)));
    }
    crate::f16::dequantize_row(&row[2 * whole..], &mut y[whole..]);
}

/// Little-endian bf16 (any alignment): each value's bits moved to the top half.
#[target_feature(enable = "avx2,fma,f16c")]
fn dequant_bf16(row: &[u8], y: &mut [f32]) {
    let whole = y.len() / 8 * 8;
    for (h, out) in row.chunks_exact(16).zip(y[..whole].chunks_exact_mut(8)) {
        let h: &[u8; 16] = h.try_into().unwrap();
        let v = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(load_u8x16(h)));
        store_f32x8(out, _mm256_castsi256_ps(v));
    }
    crate::bf16::dequantize_row(&row[2 * whole..], &mut y[whole..]);
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dequant_q8_0(x: &[BlockQ8_0], y: &mut [f32]) {
    for (b, out) in x.iter().zip(y.chunks_exact_mut(QK8_0)) {
        let d = _mm256_broadcastss_ps(f16x2_to_f32(b.d, [0; 2]));
        for (k, out) in out.chunks_exact_mut(8).enumerate() {
            let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load_i8x8(&b.qs, k)));
            store_f32x8(out, _mm256_mul_ps(q, d));
        }
    }
}

/// `v.round() as i8` for each lane, as i32: round half away from zero, then
/// Rust's saturating cast (NaN → 0, ±inf and out of range → -128 / 127).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn round_to_i8(v: __m256) -> __m256i {
    let sign = _mm256_set1_ps(-0.0);
    // trunc(v) and the fraction v - trunc(v), which is exact.
    let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
    let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(v, t));
    let away = _mm256_cmp_ps::<_CMP_GE_OQ>(frac, _mm256_set1_ps(0.5));
    let one = _mm256_or_ps(_mm256_and_ps(v, sign), _mm256_set1_ps(1.0));
    let r = _mm256_add_ps(t, _mm256_and_ps(away, one));
    // NaN → 0 before clamping (min/max would turn it into a bound).
    let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
    let r = _mm256_min_ps(
        _mm256_max_ps(r, _mm256_set1_ps(-128.0)),
        _mm256_set1_ps(127.0),
    );
    _mm256_cvtps_epi32(r)
}

/// [`crate::q8_0::quantize_row_ref`]: `amax` with NaNs ignored (as
/// `f32::max` does), the scale in scalar code, quants `round(x·id)`.
#[target_feature(enable = "avx2,fma,f16c")]
fn quant_q8_0(x: &[f32], y: &mut [BlockQ8_0]) {
    let sign = _mm256_set1_ps(-0.0);
    for (x, b) in x.chunks_exact(QK8_0).zip(y) {
        let v = [
            load_f32x8(&x[0..]),
            load_f32x8(&x[8..]),
            load_f32x8(&x[16..]),
            load_f32x8(&x[24..]),
        ];
        // max_ps returns its second operand when either is NaN, so with |v|
        // first a NaN element is skipped; `mx` itself never becomes NaN.
        let mut mx = _mm256_setzero_ps();
        for &v in &v {
            mx = _mm256_max_ps(_mm256_andnot_ps(sign, v), mx);
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps::<1>(mx));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m1 = _mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2));
        let amax = _mm_cvtss_f32(m1);

        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = fp32_to_fp16(d);
        let idv = _mm256_set1_ps(id);
        let q0 = round_to_i8(_mm256_mul_ps(v[0], idv));
        let q1 = round_to_i8(_mm256_mul_ps(v[1], idv));
        let q2 = round_to_i8(_mm256_mul_ps(v[2], idv));
        let q3 = round_to_i8(_mm256_mul_ps(v[3], idv));
        // The packs work within 128-bit halves: the dwords come out as
        // [q0 0..4, q1 0..4, q2 0..4, q3 0..4, q0 4..8, q1 4..8, ...]; permute back.
        // Values are already in -128..=127, so the saturation never acts.
        let q01 = _mm256_packs_epi32(q0, q1);
        let q23 = _mm256_packs_epi32(q2, q3);
        let q = _mm256_packs_epi16(q01, q23);
        let q = _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: `b.qs` is 32 writable bytes; `storeu` has no alignment requirement.
        unsafe { _mm256_storeu_si256(b.qs.as_mut_ptr().cast(), q) };
    }
}

// ---- 16-bit activations (order F2 of `crate::act16`) ---------------------------

/// The f16 heads (first 4 bytes) of up to eight blocks, one per 32-bit lane,
/// zeros past `xc.len()`: a full chunk by one `vpgatherdd` (measured ~3% faster
/// than [`gather_head`] in the F2 decode kernel when it still read GGUF blocks;
/// the Q8 path's Q4_1 kernel reads blocks this way when no packed layout exists).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn chunk_heads<T: bytemuck::Pod>(xc: &[T]) -> __m256i {
    if xc.len() == 8 {
        let st = size_of::<T>() as i32;
        // SAFETY: the 8 blocks are 8·size_of::<T>() readable bytes (at least 4
        // each), and lane i reads the 4 head bytes of block i.
        unsafe {
            _mm256_i32gather_epi32::<1>(
                xc.as_ptr().cast(),
                _mm256_setr_epi32(0, st, 2 * st, 3 * st, 4 * st, 5 * st, 6 * st, 7 * st),
            )
        }
    } else {
        gather_head(xc)
    }
}

/// A weight block as order F2 takes it.
trait Block16: F2Block {
    /// The 32 quants as i16 in the stored order of [`crate::act16`]: the even
    /// elements, then the odd ones, each 128-bit half in element order.
    ///
    /// # Safety
    /// `q` points at the block's [`F2Block::QUANT_BYTES`] readable quant bytes;
    /// the CPU has AVX2.
    unsafe fn quants16(q: *const u8) -> [__m256i; 2];
}

impl Block16 for BlockQ4_1 {
    #[inline(always)]
    unsafe fn quants16(q: *const u8) -> [__m256i; 2] {
        // SAFETY: `q` is 16 readable bytes; the caller guarantees AVX2.
        unsafe {
            let q = nibble_halves(q);
            let low = _mm256_set1_epi16(0x0F);
            [
                _mm256_and_si256(q, low),
                _mm256_and_si256(_mm256_srli_epi16::<8>(q), low),
            ]
        }
    }
}

impl Block16 for BlockQ8_0 {
    #[inline(always)]
    unsafe fn quants16(q: *const u8) -> [__m256i; 2] {
        // SAFETY: `q` is 32 readable bytes; AVX2 as above.
        signed_words(unsafe { _mm256_loadu_si256(q.cast()) })
    }
}

impl Block16 for BlockQ5_0 {
    #[inline(always)]
    unsafe fn quants16(q: *const u8) -> [__m256i; 2] {
        // SAFETY: `q` is 20 readable bytes (`qh`, then `qs`); AVX2 as above.
        unsafe {
            let nib = nibbles_in_order(q.add(4));
            // `q - 16` is the nibble minus 16 where the fifth bit is clear.
            let clear = _mm256_andnot_si256(bytes_from_bits(fifth_bits(q)), _mm256_set1_epi8(16));
            signed_words(_mm256_sub_epi8(nib, clear))
        }
    }
}

/// Signed bytes in element order as i16 words: the even elements, then the odd.
#[inline(always)]
fn signed_words(q: __m256i) -> [__m256i; 2] {
    // SAFETY: register operations; the callers run with AVX2 enabled.
    unsafe {
        [
            _mm256_srai_epi16::<8>(_mm256_slli_epi16::<8>(q)),
            _mm256_srai_epi16::<8>(q),
        ]
    }
}

/// The 16 bytes at `q` in both 128-bit halves, the high half shifted by a
/// nibble: byte `j`'s low nibble is element `j` in the low half and element
/// `16 + j` (its high nibble) in the high one (Q4_1's and Q5_0's packing).
///
/// # Safety
/// `q` points at 16 readable bytes; the CPU has AVX2.
#[inline(always)]
unsafe fn nibble_halves(q: *const u8) -> __m256i {
    // SAFETY: the caller's guarantees.
    unsafe {
        let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(q.cast()));
        _mm256_srlv_epi32(q, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4))
    }
}

/// The 32 nibbles of the 16 bytes at `q` as bytes in element order.
///
/// # Safety
/// As [`nibble_halves`].
#[inline(always)]
pub(super) unsafe fn nibbles_in_order(q: *const u8) -> __m256i {
    // SAFETY: the caller's guarantees.
    unsafe { _mm256_and_si256(nibble_halves(q), _mm256_set1_epi8(0x0F)) }
}

/// A Q5_0 block's fifth bits (bit `i` of element `i`), the first 4 of the
/// quant bytes at `q`.
///
/// # Safety
/// `q` points at 4 readable bytes.
#[inline(always)]
pub(super) unsafe fn fifth_bits(q: *const u8) -> u32 {
    // SAFETY: the caller's guarantees; `read_unaligned` has no alignment requirement.
    u32::from_le_bytes(unsafe { std::ptr::read_unaligned(q.cast::<[u8; 4]>()) })
}

impl Block16 for SubQ4K {
    #[inline(always)]
    unsafe fn quants16(q: *const u8) -> [__m256i; 2] {
        // SAFETY: the nibbles are laid out as Q4_1's; the caller's guarantees.
        unsafe { BlockQ4_1::quants16(q) }
    }
}

impl Block16 for SubQ6K {
    #[inline(always)]
    unsafe fn quants16(q: *const u8) -> [__m256i; 2] {
        // SAFETY: signed bytes as Q8_0's; the caller's guarantees.
        unsafe { BlockQ8_0::quants16(q) }
    }
}

/// [`crate::act16::quantize_row_ref`]: the same per-block operations; the block
/// maximum and the non-finite test reduced across lanes (both are independent of
/// the order), the quants rounded by `cvtps` (ties to even, as the scalar) and
/// saturated by `packs` (as its clamp).
#[target_feature(enable = "avx2,fma,f16c")]
fn quant_act16(x: &[f32], q: &mut [i16], scale: &mut [f32], sum: &mut [f32]) {
    use crate::act16::{ACT16_MAX, QK_ACT16};
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    for (((xb, qb), s), sigma) in x
        .chunks_exact(QK_ACT16)
        .zip(q.chunks_exact_mut(QK_ACT16))
        .zip(scale)
        .zip(sum)
    {
        let mut v = [_mm256_setzero_ps(); 4];
        for (v, xs) in v.iter_mut().zip(xb.chunks_exact(8)) {
            *v = load_f32x8(xs);
        }
        let (mut amax, mut non_finite) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for &v in &v {
            // `max` returns its second operand for a NaN lane, so NaN is skipped.
            amax = _mm256_max_ps(_mm256_and_ps(v, abs_mask), amax);
            non_finite = _mm256_add_ps(non_finite, _mm256_mul_ps(v, _mm256_setzero_ps()));
        }
        let m = _mm_max_ps(
            _mm256_castps256_ps128(amax),
            _mm256_extractf128_ps::<1>(amax),
        );
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let inv = _mm256_set1_ps(if amax > 0.0 { ACT16_MAX / amax } else { 0.0 });
        let mut i = [_mm256_setzero_si256(); 4];
        for (i, &v) in i.iter_mut().zip(&v) {
            *i = _mm256_cvtps_epi32(_mm256_mul_ps(v, inv));
        }
        // `packs` gives [0..4 8..12 | 4..8 12..16] of each 16 elements; a word
        // shuffle per 128-bit lane makes 32-bit pairs [0 2][8 10][1 3][9 11] |
        // [4 6][12 14][5 7][13 15], and a pair permutation [evens | odds] of the
        // 16; two lane permutations then give the stored [evens | odds] of 32.
        let split = _mm256_setr_epi8(
            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3,
            6, 7, 10, 11, 14, 15,
        );
        let pairs = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        let mut halves = [_mm256_setzero_si256(); 2];
        for (h, v) in halves.iter_mut().enumerate() {
            let p = _mm256_shuffle_epi8(_mm256_packs_epi32(i[2 * h], i[2 * h + 1]), split);
            *v = _mm256_permutevar8x32_epi32(p, pairs);
        }
        let stored = [
            _mm256_permute2x128_si256::<0x20>(halves[0], halves[1]),
            _mm256_permute2x128_si256::<0x31>(halves[0], halves[1]),
        ];
        for (part, v) in qb.chunks_exact_mut(16).zip(stored) {
            // SAFETY: `part` is 16 writable i16s (32 bytes); `storeu` is unaligned.
            unsafe { _mm256_storeu_si256(part.as_mut_ptr().cast(), v) };
        }
        let t = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
        let t = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
        let t = _mm_add_epi32(t, _mm_shuffle_epi32::<0x4E>(t));
        let total = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32::<0xB1>(t)));
        *s = amax / ACT16_MAX + hsum_lanes(non_finite);
        *sigma = *s * total as f32;
    }
}

/// The `d`s and the second heads (`m`s with a minimum, `d2`s in a split
/// block, zeros otherwise) of a packed chunk that starts `chunk`, as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn f2_heads<B: F2Block>(chunk: &[u8]) -> (__m256, __m256) {
    let heads = &chunk[..B::HEAD_BYTES];
    let head = |k: usize| {
        let h = &heads[k * CHUNK * B::HEAD_SIZE..];
        if B::HEAD_F32 {
            let h: &[u8; 32] = h[..32].try_into().unwrap();
            // SAFETY: `h` is 32 readable bytes; `loadu` has no alignment requirement.
            unsafe { _mm256_loadu_ps(h.as_ptr().cast()) }
        } else {
            _mm256_cvtph_ps(load_u8x16(h[..16].try_into().unwrap()))
        }
    };
    let second = if B::HEADS > 1 {
        head(1)
    } else {
        _mm256_setzero_ps()
    };
    (head(0), second)
}

/// One tile of order F2: `R` packed rows of `nb` blocks (back to back in
/// `group`, `row_bytes` each) against `T` activation rows, every pair in its own
/// 8-lane accumulator. Per chunk of eight blocks each row's `d` and `m` are one
/// load each and each pair's `c = d·s` is formed eight wide (stored, then
/// broadcast per block); per block each row's quants are widened once for the
/// `T` tokens and each token's activations loaded once for the `R` rows. A
/// single token (`T == 1`, decode) prefetches the group of rows two groups ahead.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // r and t index several arrays at once
fn tile16<B: Block16, const R: usize, const T: usize>(
    group: &[u8],
    row_bytes: usize,
    nb: usize,
    toks: &[crate::act16::Act16Row<'_>; T],
) -> [[f32; T]; R] {
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut macc = [[_mm256_setzero_ps(); T]; R];
    let n_chunks = nb.div_ceil(CHUNK);
    let ahead = Prefetch::new(&group[..R * row_bytes], 2, n_chunks);
    for c in 0..n_chunks {
        if T == 1 {
            ahead.step(c);
        }
        let len = (nb - CHUNK * c).min(CHUNK);
        let mut cs = [[[0.0f32; CHUNK]; T]; R];
        // A split block's second scales, `d2·s`.
        let mut cs2 = [[[0.0f32; CHUNK]; T]; R];
        let mut quants = [std::ptr::null::<u8>(); R];
        for r in 0..R {
            let chunk = &group[r * row_bytes + c * B::CHUNK_BYTES..]
                [..B::HEAD_BYTES + len * B::QUANT_BYTES];
            quants[r] = chunk[B::HEAD_BYTES..].as_ptr();
            let (d, m) = f2_heads::<B>(chunk);
            for t in 0..T {
                let s = load_f32x8(&toks[t].scale[CHUNK * c..]);
                store_f32x8(&mut cs[r][t], _mm256_mul_ps(d, s));
                if B::SPLIT {
                    store_f32x8(&mut cs2[r][t], _mm256_mul_ps(m, s));
                }
                if B::HAS_MIN {
                    let sigma = load_f32x8(&toks[t].sum[CHUNK * c..]);
                    macc[r][t] = _mm256_fmadd_ps(m, sigma, macc[r][t]);
                }
            }
        }
        for j in 0..len {
            let b = CHUNK * c + j;
            let mut w = [[_mm256_setzero_si256(); 2]; R];
            for r in 0..R {
                // SAFETY: row r's chunk slice holds `len` blocks' quants after its
                // heads, and j < len; AVX2 is enabled here.
                w[r] = unsafe { B::quants16(quants[r].add(j * B::QUANT_BYTES)) };
            }
            for t in 0..T {
                let x: &[i16; 32] = toks[t].q[32 * b..32 * b + 32].try_into().unwrap();
                // SAFETY: `x` is 32 readable i16s, read as two halves of 16.
                let (x0, x1) = unsafe {
                    (
                        _mm256_loadu_si256(x.as_ptr().cast()),
                        _mm256_loadu_si256(x.as_ptr().add(16).cast()),
                    )
                };
                for r in 0..R {
                    let p = _mm256_add_epi32(
                        _mm256_madd_epi16(w[r][0], x0),
                        _mm256_madd_epi16(w[r][1], x1),
                    );
                    let mut cb = _mm256_broadcast_ss(&cs[r][t][j]);
                    if B::SPLIT {
                        cb = _mm256_blend_ps::<0xF0>(cb, _mm256_broadcast_ss(&cs2[r][t][j]));
                    }
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), cb, acc[r][t]);
                }
            }
        }
    }
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            let v = if B::HAS_MIN {
                _mm256_add_ps(acc[r][t], macc[r][t])
            } else {
                acc[r][t]
            };
            out[r][t] = hsum_lanes(v);
        }
    }
    out
}

/// The tile of [`tile16`] in a prefill: 2 rows x 6 tokens (12 accumulators, two
/// rows' widened quants and one token's activations in AVX2's 16 registers).
/// Measured against 1x8, 2x4, 2x5, 2x7, 2x8, 3x3, 3x4 and 1x12 on Zen 3: 10-40%
/// faster than the 1x8 it replaced (which loads every activation once per row).
const TILE16_ROWS: usize = 2;
const TILE16_TOKENS: usize = 6;

/// [`crate::act16::gemm_q4_1_ref`] and its Q8_0 twin on packed rows against
/// every row of `acts`. One token: four rows per tile. More: groups of up to
/// [`TILE16_TOKENS`] tokens, each walking a panel of rows [`TILE16_ROWS`] at a
/// time (the tokens' activations stay in L1 while the rows stream from L2).
#[target_feature(enable = "avx2,fma,f16c")]
fn gem16<B: Block16>(w: F2Rows<'_, B>, acts: &crate::act16::Act16, out: &mut [f32]) {
    let (nb, n_rows, rb) = (w.nb, w.n_rows, w.row_bytes());
    let n_tok = acts.rows();
    if n_tok == 1 {
        let a = acts.row(0);
        let full = n_rows / 4 * 4;
        for (g, o) in w.bytes[..full * rb]
            .chunks_exact(4 * rb)
            .zip(out.chunks_exact_mut(4))
        {
            for (o, v) in o.iter_mut().zip(tile16::<B, 4, 1>(g, rb, nb, &[a])) {
                *o = v[0];
            }
        }
        for (r, o) in (full..n_rows).zip(&mut out[full..]) {
            *o = tile16::<B, 1, 1>(&w.bytes[r * rb..(r + 1) * rb], rb, nb, &[a])[0][0];
        }
        return;
    }
    // Each group of tokens keeps its activations in L1 while a panel of rows
    // streams past from L2, two rows at a time.
    let panel_rows = (GEMM16_PANEL_BYTES / rb).max(1);
    for r0 in (0..n_rows).step_by(panel_rows) {
        let panel = r0..(r0 + panel_rows).min(n_rows);
        for t0 in (0..n_tok).step_by(TILE16_TOKENS) {
            let p = Panel16 {
                w,
                rows: panel.clone(),
                t0,
            };
            match n_tok - t0 {
                6.. => p.tokens::<6>(acts, out),
                5 => p.tokens::<5>(acts, out),
                4 => p.tokens::<4>(acts, out),
                3 => p.tokens::<3>(acts, out),
                2 => p.tokens::<2>(acts, out),
                _ => p.tokens::<1>(acts, out),
            }
        }
    }
}

/// Packed weight bytes per panel of [`gem16`]'s batched path (128 Q4_1 rows of
/// 576 elements, 48 Q8_0 rows of 1536): larger panels measured faster up to
/// about this size (as 384 chunks of eight blocks).
const GEMM16_PANEL_BYTES: usize = 48 * 1024;

/// One panel of rows of [`gem16`] and the first token of a group.
struct Panel16<'a, B> {
    w: F2Rows<'a, B>,
    rows: std::ops::Range<usize>,
    t0: usize,
}

impl<B: Block16> Panel16<'_, B> {
    /// Tokens `t0..t0 + T` against the panel's rows, [`TILE16_ROWS`] rows per
    /// tile (an odd last row alone).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn tokens<const T: usize>(&self, acts: &crate::act16::Act16, out: &mut [f32]) {
        let mut toks = [acts.row(self.t0); T];
        for (t, tok) in toks.iter_mut().enumerate() {
            *tok = acts.row(self.t0 + t);
        }
        let paired = self.rows.start + self.rows.len() / TILE16_ROWS * TILE16_ROWS;
        for r in (self.rows.start..paired).step_by(TILE16_ROWS) {
            let v = self.tile::<TILE16_ROWS, T>(r, &toks);
            self.store(r, &v, out);
        }
        for r in paired..self.rows.end {
            let v = self.tile::<1, T>(r, &toks);
            self.store(r, &v, out);
        }
    }

    /// Rows `r..r + R` of the panel against `toks`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn tile<const R: usize, const T: usize>(
        &self,
        r: usize,
        toks: &[crate::act16::Act16Row<'_>; T],
    ) -> [[f32; T]; R] {
        let rb = self.w.row_bytes();
        tile16::<B, R, T>(&self.w.bytes[r * rb..(r + R) * rb], rb, self.w.nb, toks)
    }

    /// Puts the products of rows `r..` for tokens `t0..` in place.
    #[inline]
    fn store<const R: usize, const T: usize>(&self, r: usize, v: &[[f32; T]; R], out: &mut [f32]) {
        for (k, row) in v.iter().enumerate() {
            for (t, &x) in row.iter().enumerate() {
                out[(self.t0 + t) * self.w.n_rows + r + k] = x;
            }
        }
    }
}

// ---- the fast f32 path (order F1 of `crate::fast`) -----------------------------

/// The lane reduction of [`crate::f32::reduce_lanes`] as a horizontal sum:
/// `[a0+a4, a1+a5, a2+a6, a3+a7]`, then `[(a0+a4)+(a2+a6), (a1+a5)+(a3+a7)]`,
/// then their sum: the same additions on the same operands.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum_lanes(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// [`crate::fast::dot_fma1_ref`]: one 8-lane FMA accumulator, the tail into the
/// stored lanes, the fixed reduction.
#[target_feature(enable = "avx2,fma,f16c")]
fn fma1(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let wc = w.chunks_exact(8);
    let xc = x.chunks_exact(8);
    let (wt, xt) = (wc.remainder(), xc.remainder());
    for (ws, xs) in wc.zip(xc) {
        acc = _mm256_fmadd_ps(load_f32x8(ws), load_f32x8(xs), acc);
    }
    if wt.is_empty() {
        return hsum_lanes(acc);
    }
    let mut lanes = [0.0f32; 8];
    store_f32x8(&mut lanes, acc);
    for ((a, &wv), &xv) in lanes.iter_mut().zip(wt).zip(xt) {
        *a = wv.mul_add(xv, *a);
    }
    crate::f32::reduce_lanes(&lanes)
}

/// Software prefetch for the multi-row matvecs. Their rows are short (a few cache
/// lines) and read several at a time, interleaved, which the hardware stream
/// prefetchers do not follow; so while a group of rows is processed, the group
/// `groups_ahead` further on is requested, a slice of it per step (a chunk of
/// eight blocks: per block, the bookkeeping cost a quarter of the decode kernel).
#[derive(Clone, Copy)]
pub(super) struct Prefetch {
    start: *const u8,
    /// Cache lines requested per step.
    per_step: usize,
}

impl Prefetch {
    /// Requests nothing (a placeholder to overwrite).
    pub(super) const NONE: Prefetch = Prefetch {
        start: std::ptr::null(),
        per_step: 0,
    };

    /// For a group processed in `steps` steps (at least one).
    #[inline]
    pub(super) fn new<T>(group: &[T], groups_ahead: usize, steps: usize) -> Self {
        let bytes = size_of_val(group);
        Prefetch {
            start: group
                .as_ptr()
                .cast::<u8>()
                .wrapping_add(groups_ahead * bytes),
            per_step: bytes.div_ceil(64).div_ceil(steps.max(1)),
        }
    }

    /// Requests step `b`'s share of the group ahead.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn step(self, b: usize) {
        let per = self.per_step;
        for l in b * per..(b + 1) * per {
            // A hint only: `_mm_prefetch` never faults, and `wrapping_add` forms
            // the address without claiming it is in any allocation.
            _mm_prefetch::<_MM_HINT_T0>(self.start.wrapping_add(64 * l).cast());
        }
    }
}

/// [`crate::fast::gemm_tile_ref`] for `R` rows × `T` tokens held in `R·T`
/// accumulators: each weight vector is loaded once for `T` tokens and each
/// activation vector once for `R` rows.
///
/// # Safety
/// `w.len() == R·k`, `x.len() == T·k`, `out.len() == R·T`, `k % 8 == 0`, and the
/// CPU has AVX2 and FMA.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // r and t index two arrays at once
unsafe fn tile<const R: usize, const T: usize>(w: &[f32], x: &[f32], k: usize, out: &mut [f32]) {
    debug_assert!(
        w.len() == R * k && x.len() == T * k && out.len() == R * T && k.is_multiple_of(8)
    );
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for c in (0..k).step_by(8) {
        // SAFETY: r < R and c + 8 <= k, so `r·k + c .. + 8` lies in `w` (length R·k).
        let wv: [__m256; R] =
            std::array::from_fn(|r| unsafe { _mm256_loadu_ps(wp.add(r * k + c)) });
        for t in 0..T {
            // SAFETY: t < T and c + 8 <= k, so the 8 floats lie in `x` (length T·k).
            let xv = unsafe { _mm256_loadu_ps(xp.add(t * k + c)) };
            for r in 0..R {
                acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
            }
        }
    }
    for t in 0..T {
        for r in 0..R {
            out[t * R + r] = hsum_lanes(acc[r][t]);
        }
    }
}

// ---- attention ------------------------------------------------------------------

/// [`crate::attn::exp_ref`] on 8 lanes: [`exp_lanes`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn exp8(x: __m256) -> __m256 {
    // SAFETY: AVX2 and FMA are enabled here.
    unsafe { exp_lanes(x) }
}

/// [`crate::attn::exp_ref`] on a vector of either tier's width: the same
/// operations lane by lane.
///
/// # Safety
/// The CPU has the features of `V`'s tier.
#[inline(always)]
pub(super) unsafe fn exp_lanes<V: F32Lanes>(x: V) -> V {
    // SAFETY: the caller guarantees the tier's features (every call below).
    unsafe {
        // `if x > MAX { MAX } else { x }` (a NaN stays).
        let x = x.min_keep_nan(EXP_MAX);
        let n = V::mul(x, V::splat(EXP_LOG2E)).round_even();
        let r = V::mul_add(n, V::splat(-EXP_LN2_HI), x);
        let r = V::mul_add(n, V::splat(-EXP_LN2_LO), r);
        let mut p = V::splat(EXP_P[0]);
        for &c in &EXP_P[1..] {
            p = V::mul_add(p, r, V::splat(c));
        }
        let y = V::add(V::mul_add(p, V::mul(r, r), r), V::splat(1.0));
        // Lanes below MIN (and -inf) get garbage exponents here; they are set to +0.
        V::mul(y, n.exp2_int()).zero_where_below(x, EXP_MIN)
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn exp_slice(x: &mut [f32]) {
    let mut chunks = x.chunks_exact_mut(8);
    for c in chunks.by_ref() {
        let v = exp8(load_f32x8(c));
        store_f32x8(c, v);
    }
    for v in chunks.into_remainder() {
        *v = exp_ref(*v);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn widen_f16_x8(src: &[u16], dst: &mut [f32]) {
    let mut d = dst.chunks_exact_mut(8);
    let mut s = src.chunks_exact(8);
    for (dc, sc) in d.by_ref().zip(s.by_ref()) {
        // SAFETY: `sc` is 8 u16 = 16 readable bytes; `loadu` has no alignment need.
        let h = unsafe { _mm_loadu_si128(sc.as_ptr().cast()) };
        store_f32x8(dc, _mm256_cvtph_ps(h));
    }
    for (dv, &h) in d.into_remainder().iter_mut().zip(s.remainder()) {
        *dv = crate::f16::fp16_to_fp32(h.to_le_bytes());
    }
}

/// Eight order-F1 accumulators reduced at once: lane `j` of the result is
/// `reduce_lanes(a[j])`, with exactly the additions of [`hsum_lanes`] (IEEE
/// addition commutes, so only the pairing matters).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_8_transposed(a: &[__m256; 8]) -> __m256 {
    // [a_i[0..4] + a_i[4..8] | a_{i+1}[0..4] + a_{i+1}[4..8]]
    let h = |i: usize, j: usize| {
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a[i], a[j]),
            _mm256_permute2f128_ps::<0x31>(a[i], a[j]),
        )
    };
    let (u01, u23, u45, u67) = (h(0, 1), h(2, 3), h(4, 5), h(6, 7));
    // y_i = [x_i0 + x_i2, x_i1 + x_i3]: c = [y0 y2 | y1 y3], d = [y4 y6 | y5 y7].
    let c = _mm256_add_ps(
        _mm256_shuffle_ps::<0x44>(u01, u23),
        _mm256_shuffle_ps::<0xEE>(u01, u23),
    );
    let d = _mm256_add_ps(
        _mm256_shuffle_ps::<0x44>(u45, u67),
        _mm256_shuffle_ps::<0xEE>(u45, u67),
    );
    // z_i = y_i0 + y_i1: [z0 z2 z4 z6 | z1 z3 z5 z7].
    let z = _mm256_add_ps(
        _mm256_shuffle_ps::<0x88>(c, d),
        _mm256_shuffle_ps::<0xDD>(c, d),
    );
    _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// The K/V element types the grouped attention kernel reads, eight at a time as
/// f32 lanes: f32 rows as they are, f16 rows widened with F16C (exact).
impl KvVector<__m256> for u16 {
    #[inline(always)]
    unsafe fn load_lanes(p: *const u16) -> __m256 {
        // SAFETY: the caller guarantees 8 readable u16s (16 bytes) and F16C.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

/// The AVX2 tier's chunks of [`attn_group`]: up to three queries, scores of
/// three queries over three positions at once (nine accumulators), then each
/// query's softmax step, then V rows accumulated into three queries' outputs
/// at once; every K and V load (and, for f16 rows, every widening) shared.
pub(super) struct Avx2Attn;

impl<T: KvVector<__m256>> AttnChunk<T> for Avx2Attn {
    const MAX_QUERIES: usize = 3;

    #[inline(always)]
    unsafe fn chunk<const STREAM: bool>(
        q: &[f32],
        k: &[T],
        v: &[T],
        nh: (usize, usize),
        scale: f32,
        st: &mut [Running],
        acc: &mut [f32],
        s: &mut [f32],
    ) {
        // SAFETY: the caller's guarantees, as `attn_chunk` requires.
        unsafe { attn_chunk::<T, STREAM>(q, k, v, nh, scale, st, acc, s) }
    }
}

/// [`Avx2Attn`]'s chunk.
///
/// # Safety
/// As [`AttnChunk::chunk`], with AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn attn_chunk<T: KvVector<__m256>, const STREAM: bool>(
    q: &[f32],
    k: &[T],
    v: &[T],
    (n, hd): (usize, usize),
    scale: f32,
    st: &mut [Running],
    acc: &mut [f32],
    s: &mut [f32],
) {
    let gn = st.len();
    debug_assert!(
        hd.is_multiple_of(8)
            && (1..=3).contains(&gn)
            && k.len() == n * hd
            && v.len() == n * hd
            && q.len() == gn * hd
            && acc.len() == q.len()
            && s.len() == gn * n
    );
    // SAFETY: (all three calls) the shapes the callee requires.
    unsafe {
        match gn {
            3 => group_scores::<T, 3, 3, STREAM>(q, k, n, hd, scale, s),
            2 => group_scores::<T, 2, 4, STREAM>(q, k, n, hd, scale, s),
            _ => group_scores::<T, 1, 8, STREAM>(q, k, n, hd, scale, s),
        }
    }
    for ((w, run), a) in s.chunks_exact_mut(n).zip(st).zip(acc.chunks_exact_mut(hd)) {
        softmax_step(w, run, a);
    }
    let vp = v.as_ptr();
    let mut d0 = 0;
    // SAFETY: (each call) d0 + 8R <= hd, `vp` points at n·hd readable
    // elements, `s` holds gn·n weights and `acc` gn·hd values.
    unsafe {
        while d0 + 32 <= hd {
            match gn {
                // Three queries' 4-vector strips would need all 16 registers.
                3 => {
                    accumulate_v::<T, __m256, 3, 2, STREAM>(s, n, vp, hd, d0, acc);
                    accumulate_v::<T, __m256, 3, 2, STREAM>(s, n, vp, hd, d0 + 16, acc);
                }
                2 => accumulate_v::<T, __m256, 2, 4, STREAM>(s, n, vp, hd, d0, acc),
                _ => accumulate_v::<T, __m256, 1, 4, STREAM>(s, n, vp, hd, d0, acc),
            }
            d0 += 32;
        }
        while d0 < hd {
            match gn {
                3 => accumulate_v::<T, __m256, 3, 1, STREAM>(s, n, vp, hd, d0, acc),
                2 => accumulate_v::<T, __m256, 2, 1, STREAM>(s, n, vp, hd, d0, acc),
                _ => accumulate_v::<T, __m256, 1, 1, STREAM>(s, n, vp, hd, d0, acc),
            }
            d0 += 8;
        }
    }
}

/// `s[g·n + p] = dot_fma1(q_g, k_p) · scale` for the `G` queries of `q` and every
/// position `p < n`, `P` positions at a time (`G·P` order-F1 accumulators, each K
/// vector loaded once for the `G` queries), the rest one position at a time.
///
/// # Safety
/// `hd % 8 == 0`, `q.len() == G·hd`, `k.len() == n·hd`, `s.len() == G·n`, and the
/// CPU has AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // g and j index two arrays at once
unsafe fn group_scores<T: KvVector<__m256>, const G: usize, const P: usize, const STREAM: bool>(
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
    while p + P <= n {
        let mut a = [[_mm256_setzero_ps(); P]; G];
        for c in (0..hd).step_by(8) {
            if STREAM {
                // Rows p + AHEAD .. + P, eight elements of each per step.
                prefetch_ahead(kp, hd, p, c * P, 8 * P);
            }
            // SAFETY: g < G and c + 8 <= hd: inside `q` (G·hd elements).
            let qv: [__m256; G] =
                std::array::from_fn(|g| unsafe { _mm256_loadu_ps(qp.add(g * hd + c)) });
            for j in 0..P {
                // SAFETY: p + j < n and c + 8 <= hd: inside `k` (n·hd elements).
                let kv = unsafe { T::load_lanes(kp.add((p + j) * hd + c)) };
                for g in 0..G {
                    a[g][j] = _mm256_fmadd_ps(qv[g], kv, a[g][j]);
                }
            }
        }
        let mut sums = [0.0f32; 16];
        reduce_accumulators(a.as_flattened(), scale, &mut sums[..G * P]);
        for g in 0..G {
            s[g * n + p..][..P].copy_from_slice(&sums[g * P..(g + 1) * P]);
        }
        p += P;
    }
    while p < n {
        let mut a = [_mm256_setzero_ps(); G];
        for c in (0..hd).step_by(8) {
            // SAFETY: as above, for one position.
            let kv = unsafe { T::load_lanes(kp.add(p * hd + c)) };
            for (g, a) in a.iter_mut().enumerate() {
                // SAFETY: as above.
                let qv = unsafe { _mm256_loadu_ps(qp.add(g * hd + c)) };
                *a = _mm256_fmadd_ps(qv, kv, *a);
            }
        }
        for (g, a) in a.iter().enumerate() {
            s[g * n + p] = hsum_lanes(*a) * scale;
        }
        p += 1;
    }
}

/// Positions ahead of the one being read that attention asks the memory system
/// for: the next tile's rows, so that a long decode's K/V stream from memory
/// while this tile is computed.
const ATTN_PREFETCH_AHEAD: usize = 64;

/// Requests elements `from .. from + n` of row `p + AHEAD` onwards (rows of
/// `hd` elements at `base`; `from` may run past the row into the next ones)
/// into L2. A hint only: the rows may lie past the tile (that is the point) or
/// past the cache's end; `_mm_prefetch` never faults and `wrapping_add` forms
/// the addresses without claiming they are in bounds.
///
/// Callers spread a tile's requests over the loop that reads the tile, a line
/// or two per step, instead of asking for whole rows at once: a burst of
/// requests larger than the core's miss buffers (about two dozen lines) stalls
/// the loop until memory answers, so the rows' arrival and the arithmetic took
/// turns rather than overlapping. Zen 4, 2 threads, Gemma 3's global layer (4
/// queries of 256) at 65535 positions streaming from memory
/// (`bench_attention`, best of 400): 3.82-3.89 ms a layer with K's eight rows
/// requested before each group of eight and V's row before each position,
/// 2.21-2.47 ms spread (30 GB/s, what this VM's two cores read with plain
/// loads). L2, not L1: a tile ahead is 16-64 KiB of K and V rows, as much as
/// L1 holds (measured: into L1 was slower on both heads' shapes).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn prefetch_ahead<T>(base: *const T, hd: usize, p: usize, from: usize, n: usize) {
    let start = base
        .wrapping_add((p + ATTN_PREFETCH_AHEAD) * hd + from)
        .cast::<i8>();
    for off in (0..n * size_of::<T>()).step_by(64) {
        _mm_prefetch::<_MM_HINT_T1>(start.wrapping_add(off));
    }
}

/// `out[i] = reduce_lanes(a[i]) · scale` for up to 16 accumulators, eight at a
/// time through [`hsum_8_transposed`]; a last group of four or more is padded with
/// zeros (whose lanes are dropped), a shorter one reduced one by one.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn reduce_accumulators(a: &[__m256], scale: f32, out: &mut [f32]) {
    debug_assert!(a.len() == out.len() && a.len() <= 16);
    for (a, out) in a.chunks(8).zip(out.chunks_mut(8)) {
        if a.len() < 4 {
            for (o, &v) in out.iter_mut().zip(a) {
                *o = hsum_lanes(v) * scale;
            }
            continue;
        }
        let mut group = [_mm256_setzero_ps(); 8];
        group[..a.len()].copy_from_slice(a);
        let mut lanes = [0.0f32; 8];
        let sums = _mm256_mul_ps(hsum_8_transposed(&group), _mm256_set1_ps(scale));
        store_f32x8(&mut lanes, sums);
        out.copy_from_slice(&lanes[..out.len()]);
    }
}

/// The largest of `s` (at least one value); for finite values the same as
/// folding with `f32::max`, since a maximum does not depend on the order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn max_of(s: &[f32]) -> f32 {
    let mut chunks = s.chunks_exact(8);
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    for c in chunks.by_ref() {
        m = _mm256_max_ps(m, load_f32x8(c));
    }
    let mut lanes = [0.0f32; 8];
    store_f32x8(&mut lanes, m);
    lanes
        .into_iter()
        .chain(chunks.remainder().iter().copied())
        .fold(f32::NEG_INFINITY, f32::max)
}

/// Steps 2 and 3 of [`crate::attn::attn_tile_ref`] for one query: the new maximum,
/// the correction of the running state and of `acc`, the weights `exp(s - m')`
/// written over the scores, their sum in 8 lanes; then `m = m'`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn softmax_step(s: &mut [f32], st: &mut Running, acc: &mut [f32]) {
    let tmax = max_of(s);
    let m_new = st.m.max(tmax);
    if st.m != f32::NEG_INFINITY {
        let c = exp_ref(st.m - m_new);
        st.l *= c;
        let cv = _mm256_set1_ps(c);
        for a in acc.chunks_exact_mut(8) {
            let x = _mm256_mul_ps(load_f32x8(a), cv);
            store_f32x8(a, x);
        }
    }
    let mv = _mm256_set1_ps(m_new);
    let mut lanes_v = _mm256_setzero_ps();
    let mut groups = s.chunks_exact_mut(8);
    for g in groups.by_ref() {
        let w = exp8(_mm256_sub_ps(load_f32x8(g), mv));
        lanes_v = _mm256_add_ps(lanes_v, w);
        store_f32x8(g, w);
    }
    let mut lanes = [0.0f32; 8];
    store_f32x8(&mut lanes, lanes_v);
    for (j, w) in groups.into_remainder().iter_mut().enumerate() {
        *w = exp_ref(*w - m_new);
        lanes[j] += *w;
    }
    st.l += crate::f32::reduce_lanes(&lanes);
    st.m = m_new;
}

/// f32 vectors of one tier's width, for the attention code whose only
/// difference between the tiers is that width: 8 lanes (AVX2) or 16 (AVX-512).
/// Every method is inlined into its tier's kernels, which run with the
/// features the intrinsics need.
pub(super) trait F32Lanes: Copy {
    /// Lanes per vector.
    const LANES: usize;
    /// # Safety
    /// `p` points at `LANES` readable f32s; the CPU has the tier's features.
    unsafe fn load(p: *const f32) -> Self;
    /// # Safety
    /// `p` points at `LANES` writable f32s; the CPU has the tier's features.
    unsafe fn store(self, p: *mut f32);
    /// # Safety
    /// The CPU has the tier's features.
    unsafe fn splat(x: f32) -> Self;
    /// `a·b + c`, one rounding.
    ///
    /// # Safety
    /// The CPU has the tier's features.
    unsafe fn mul_add(a: Self, b: Self, c: Self) -> Self;
    /// `a·b`. # Safety: as [`Self::splat`].
    unsafe fn mul(a: Self, b: Self) -> Self;
    /// `a + b`. # Safety: as [`Self::splat`].
    unsafe fn add(a: Self, b: Self) -> Self;
    /// `if x > max { max } else { x }` per lane (a NaN stays).
    /// # Safety: as [`Self::splat`].
    unsafe fn min_keep_nan(self, max: f32) -> Self;
    /// Rounded to an integer, ties to even. # Safety: as [`Self::splat`].
    unsafe fn round_even(self) -> Self;
    /// `2^n` for integral lanes `n` in `-126..=127`, from the exponent bits.
    /// # Safety: as [`Self::splat`].
    unsafe fn exp2_int(self) -> Self;
    /// `+0` in the lanes where `x < min`, `self` elsewhere.
    /// # Safety: as [`Self::splat`].
    unsafe fn zero_where_below(self, x: Self, min: f32) -> Self;
}

impl F32Lanes for __m256 {
    const LANES: usize = 8;

    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller's guarantees.
        unsafe { _mm256_loadu_ps(p) }
    }

    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller's guarantees.
        unsafe { _mm256_storeu_ps(p, self) }
    }

    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        // SAFETY: the caller guarantees AVX.
        unsafe { _mm256_set1_ps(x) }
    }

    #[inline(always)]
    unsafe fn mul_add(a: Self, b: Self, c: Self) -> Self {
        // SAFETY: the caller guarantees FMA.
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }

    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        // SAFETY: the caller guarantees AVX.
        unsafe { _mm256_mul_ps(a, b) }
    }

    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        // SAFETY: the caller guarantees AVX.
        unsafe { _mm256_add_ps(a, b) }
    }

    #[inline(always)]
    unsafe fn min_keep_nan(self, max: f32) -> Self {
        // SAFETY: the caller guarantees AVX.
        unsafe {
            let max = _mm256_set1_ps(max);
            _mm256_blendv_ps(self, max, _mm256_cmp_ps::<_CMP_GT_OQ>(self, max))
        }
    }

    #[inline(always)]
    unsafe fn round_even(self) -> Self {
        // SAFETY: the caller guarantees AVX.
        unsafe { _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(self) }
    }

    #[inline(always)]
    unsafe fn exp2_int(self) -> Self {
        // SAFETY: the caller guarantees AVX2.
        unsafe {
            let e = _mm256_add_epi32(_mm256_cvtps_epi32(self), _mm256_set1_epi32(127));
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e))
        }
    }

    #[inline(always)]
    unsafe fn zero_where_below(self, x: Self, min: f32) -> Self {
        // SAFETY: the caller guarantees AVX.
        unsafe { _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(min)), self) }
    }
}

/// K/V elements read as vectors `V` of f32 (f16 widened exactly).
pub(super) trait KvVector<V>: crate::attn::KvElem {
    /// `V::LANES` consecutive elements at `p`, as f32.
    ///
    /// # Safety
    /// `p` points at that many readable elements; the CPU has the tier's
    /// features.
    unsafe fn load_lanes(p: *const Self) -> V;
}

impl KvVector<__m256> for f32 {
    #[inline(always)]
    unsafe fn load_lanes(p: *const f32) -> __m256 {
        // SAFETY: the caller guarantees 8 readable f32s and AVX.
        unsafe { _mm256_loadu_ps(p) }
    }
}

/// `acc_g[d] = fma(w_g[p], v[p·hd + d], acc_g[d])` for the `G` queries (weights
/// `w[g·n..]`, outputs `acc[g·hd..]`), `d` in `d0..d0 + R·V::LANES`, `p` in
/// order: each V vector is loaded (and widened) once for the `G` queries. Both
/// tiers' V accumulation, at their widths.
///
/// # Safety
/// `d0 + R·V::LANES <= hd`, `w.len() == G·n`, `acc.len() == G·hd`, `vp` points
/// at `n·hd` readable elements, and the CPU has the features of `V`'s tier.
#[inline(always)]
pub(super) unsafe fn accumulate_v<
    T: KvVector<V>,
    V: F32Lanes,
    const G: usize,
    const R: usize,
    const STREAM: bool,
>(
    w: &[f32],
    n: usize,
    vp: *const T,
    hd: usize,
    d0: usize,
    acc: &mut [f32],
) {
    debug_assert!(d0 + V::LANES * R <= hd && w.len() == G * n && acc.len() == G * hd);
    let (ap, l) = (acc.as_mut_ptr(), V::LANES);
    let mut a: [[V; R]; G] = std::array::from_fn(|g| {
        std::array::from_fn(|r| {
            // SAFETY: g < G and d0 + l·(r + 1) <= hd: inside `acc` (G·hd
            // values); the caller guarantees the tier's features (here and in
            // every block below).
            unsafe { V::load(ap.add(g * hd + d0 + l * r)) }
        })
    });
    for p in 0..n {
        if STREAM {
            // This strip's columns of row p + AHEAD: over the strips, the row.
            // SAFETY: as above.
            unsafe { prefetch_ahead(vp, hd, p, d0, l * R) };
        }
        // SAFETY: as above.
        let wb: [V; G] = std::array::from_fn(|g| unsafe { V::splat(w[g * n + p]) });
        for r in 0..R {
            // SAFETY: p < n and d0 + l·(r + 1) <= hd: inside the V rows.
            let x = unsafe { T::load_lanes(vp.add(p * hd + d0 + l * r)) };
            for (a, &wb) in a.iter_mut().zip(&wb) {
                // SAFETY: as above.
                a[r] = unsafe { V::mul_add(wb, x, a[r]) };
            }
        }
    }
    for (g, a) in a.iter().enumerate() {
        for (r, a) in a.iter().enumerate() {
            // SAFETY: as the loads above.
            unsafe { a.store(ap.add(g * hd + d0 + l * r)) };
        }
    }
}
