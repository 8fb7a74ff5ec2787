//! The DeepSeek V4 serial sums on AVX-512 VNNI (see [`crate::serial`]): each
//! row's float sum stays one chain in block order, as in the reference; what
//! the wider tier speeds up is the exact integer part of each Q8_0 block
//! (sixteen rows per register) and attention, sixteen heads per register.

use std::arch::x86_64::*;

use crate::q8_0::QK8_0;
use crate::serial::{Q8Row, HEADS, Q8_0X16_BLOCK, Q8_ROWS};

/// 64 bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn load64(b: &[u8]) -> __m512i {
    let b: &[u8; 64] = b[..64].try_into().unwrap();
    // SAFETY: `b` is 64 readable bytes; `loadu` has no alignment requirement.
    unsafe { _mm512_loadu_si512(b.as_ptr().cast()) }
}

/// [`crate::serial::dot_q8_0x16_f32s_ref`] for `N` activation rows. A block of
/// the group is eight 64-byte slices, each the sixteen rows' bytes
/// `4k..4k + 4`, offset by 128 ([`crate::serial::Q8_0x16`]); `vpdpbusd` of a
/// slice (unsigned) against the row's bytes `4k..4k + 4` broadcast (signed)
/// adds each row's 4-byte sum to its own lane. Starting from `-128·Σx` (the
/// offset's share, one value per activation block) that gives the sixteen
/// exact integer sums; then per lane `acc += (d_w·d_x)·isum`, as the scalar
/// loop does per row.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn dot_q8_0x16_n<const N: usize>(group: &[u8], x: &[Q8Row<'_>], out: &mut [[f32; Q8_ROWS]]) {
    let mut acc = [_mm512_setzero_ps(); N];
    for (b, blk) in group.chunks_exact(Q8_0X16_BLOCK).enumerate() {
        let h: &[u8; 32] = blk[..2 * Q8_ROWS].try_into().unwrap();
        // SAFETY: `h` is 32 readable bytes; `loadu` has no alignment requirement.
        let scales = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(h.as_ptr().cast()) });
        let w: [__m512i; 8] = std::array::from_fn(|k| load64(&blk[2 * Q8_ROWS + 64 * k..]));
        for j in 0..N {
            let q: &[u8] = bytemuck::cast_slice(&x[j].qs[b * QK8_0..(b + 1) * QK8_0]);
            let xb = |k: usize| {
                _mm512_set1_epi32(i32::from_le_bytes(q[4 * k..4 * k + 4].try_into().unwrap()))
            };
            // Two chains, for latency; the integer sums are exact in any order.
            let mut s0 = _mm512_set1_epi32(-128 * x[j].sums[b]);
            let mut s1 = _mm512_setzero_si512();
            for k in (0..8).step_by(2) {
                s0 = _mm512_dpbusd_epi32(s0, w[k], xb(k));
                s1 = _mm512_dpbusd_epi32(s1, w[k + 1], xb(k + 1));
            }
            let isum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            let t = _mm512_mul_ps(_mm512_mul_ps(scales, _mm512_set1_ps(x[j].d[b])), isum);
            acc[j] = _mm512_add_ps(acc[j], t);
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        // SAFETY: `o` is 16 writable f32s; `storeu` has no alignment requirement.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), a) };
    }
}

/// The table entry: [`super::super::avx2::check_q8_0x16`]'s checks, then the
/// kernel for the row count.
pub(super) fn dot_q8_0x16_f32s(group: &[u8], x: &[Q8Row<'_>], out: &mut [[f32; Q8_ROWS]]) {
    super::super::avx2::check_q8_0x16(group, x, out.len());
    // SAFETY: this tier's table is handed out only after its features were
    // detected (see `super::super::avx512()`).
    unsafe { super::super::dispatch_chains!(dot_q8_0x16_n, x.len(), 4, (group, x, out)) }
}

/// [`crate::serial::dots16_serial_ref`] with `N` rows: the sixteen heads in
/// the lanes of one register per row.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn dots16_n<const N: usize>(a: &[f32], b: &[&[f32]], out: &mut [[f32; HEADS]]) {
    let n = b[0].len();
    let b: [&[f32]; N] = std::array::from_fn(|j| &b[j][..n]);
    let mut acc = [_mm512_setzero_ps(); N];
    for (i, a) in a[..n * HEADS].chunks_exact(HEADS).enumerate() {
        // SAFETY: `a` is 16 readable f32s; `loadu` has no alignment requirement.
        let av = unsafe { _mm512_loadu_ps(a.as_ptr()) };
        for j in 0..N {
            acc[j] = _mm512_add_ps(acc[j], _mm512_mul_ps(av, _mm512_set1_ps(b[j][i])));
        }
    }
    for (o, v) in out.iter_mut().zip(acc) {
        // SAFETY: `o` is 16 writable f32s; `storeu` has no alignment requirement.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), v) };
    }
}

pub(super) fn dots16_serial(a: &[f32], b: &[&[f32]], out: &mut [[f32; HEADS]]) {
    crate::serial::check_dots16(a, b, out.len());
    // SAFETY: as in `dot_q8_0x16_f32s`.
    unsafe { super::super::dispatch_chains!(dots16_n, b.len(), 8, (a, b, out)) }
}

/// [`crate::serial::wsum16_serial_ref`] for rows of `n`: per sixteen
/// elements, the sixteen heads' running sums in registers over all the rows
/// in order (each element keeps the reference's chain); the `n % 16` tail
/// element by element in the same order.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn wsum16(w: &[[f32; HEADS]], rows: &[&[f32]], out: &mut [f32], n: usize) {
    let n16 = n / 16 * 16;
    for d in (0..n16).step_by(16) {
        let mut acc = [_mm512_setzero_ps(); HEADS];
        for (wk, row) in w.iter().zip(rows) {
            let row: &[f32; 16] = row[d..d + 16].try_into().unwrap();
            // SAFETY: `row` is 16 readable f32s; `loadu` has no alignment requirement.
            let v = unsafe { _mm512_loadu_ps(row.as_ptr()) };
            for (a, &wh) in acc.iter_mut().zip(wk) {
                *a = _mm512_add_ps(*a, _mm512_mul_ps(_mm512_set1_ps(wh), v));
            }
        }
        for (h, a) in acc.into_iter().enumerate() {
            let o: &mut [f32; 16] = (&mut out[h * n + d..h * n + d + 16]).try_into().unwrap();
            // SAFETY: `o` is 16 writable f32s; `storeu` has no alignment requirement.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), a) };
        }
    }
    crate::serial::wsum16_from(w, rows, out, n, n16);
}

pub(super) fn wsum16_serial(w: &[[f32; HEADS]], rows: &[&[f32]], out: &mut [f32]) {
    let n = crate::serial::check_wsum16(w, rows, out);
    // SAFETY: as in `dot_q8_0x16_f32s`.
    unsafe { wsum16(w, rows, out, n) }
}
