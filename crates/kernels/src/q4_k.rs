//! Q4_K (ggml type 12): super-blocks of 256 weights in 8 sub-blocks of 32.
//! Each sub-block `j` has a 6-bit scale `sc[j]` and 6-bit min `m[j]`; the
//! super-block has f16 `d` and `dmin`. Weight value: `(d·sc)·q - (dmin·m)` with
//! 4-bit `q`. Scalar reference (AVX2 versions: `x86/avx2/kquants.rs`).
//!
//! Layout (ggml): `qs` is 4 chunks of 32 bytes; chunk `c` holds sub-block
//! `2c` in its low nibbles and sub-block `2c + 1` in its high nibbles.
//! `scales` packs the 8 (sc, m) pairs in 12 bytes, see [`get_scale_min_k4`].
//! Follows ggml's `block_q4_K`, `dequantize_row_q4_K`, `quantize_row_q4_K_ref`
//! (with `make_qkx2_quants`) and `ggml_vec_dot_q4_K_q8_K_generic`.

use bytemuck::{Pod, Zeroable};

use crate::f16::{fp16_to_fp32, fp32_to_fp16};
use crate::q8_k::BlockQ8_K;
use crate::{nearest_int, KernelError, QK_K};

/// Bytes of packed scales and mins (ggml `K_SCALE_SIZE`).
pub const K_SCALE_SIZE: usize = 12;

/// ggml `block_q4_K`: 144 bytes, alignment 1.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ4_K {
    /// Super-block scale for the sub-block scales, f16 little-endian.
    pub d: [u8; 2],
    /// Super-block scale for the sub-block mins, f16 little-endian.
    pub dmin: [u8; 2],
    /// 8 six-bit scales and 8 six-bit mins, see [`get_scale_min_k4`].
    pub scales: [u8; K_SCALE_SIZE],
    /// 4-bit quants.
    pub qs: [u8; QK_K / 2],
}

const _: () = assert!(size_of::<BlockQ4_K>() == 144);
const _: () = assert!(align_of::<BlockQ4_K>() == 1);

/// Views encoded weight bytes (any alignment) as blocks.
pub fn blocks(bytes: &[u8]) -> Result<&[BlockQ4_K], KernelError> {
    crate::cast_blocks("q4_K", bytes)
}

/// ggml `get_scale_min_k4`: the 6-bit (scale, min) of sub-block `j` (0..8).
/// For j < 4 they are the low 6 bits of `q[j]` and `q[j + 4]`; for j >= 4 the
/// low 4 bits come from the nibbles of `q[j + 4]` and the top 2 bits from the
/// top 2 bits of `q[j - 4]` (scale) and `q[j]` (min).
#[inline]
pub fn get_scale_min_k4(j: usize, q: &[u8; K_SCALE_SIZE]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// ggml `dequantize_row_q4_K`: per sub-block `d1 = d·sc`, `m1 = dmin·m`,
/// `y = d1·q - m1`.
///
/// # Panics
/// If `y.len() != QK_K * x.len()`.
pub fn dequantize_row(x: &[BlockQ4_K], y: &mut [f32]) {
    assert_eq!(y.len(), x.len() * QK_K, "q4_K dequantize_row lengths");
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_K)) {
        let d = fp16_to_fp32(b.d);
        let min = fp16_to_fp32(b.dmin);
        for (c, (q, y)) in
            b.qs.chunks_exact(32)
                .zip(y.chunks_exact_mut(64))
                .enumerate()
        {
            let (sc1, m1) = get_scale_min_k4(2 * c, &b.scales);
            let (sc2, m2) = get_scale_min_k4(2 * c + 1, &b.scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            let (ylo, yhi) = y.split_at_mut(32);
            for ((&q, y1), y2) in q.iter().zip(ylo).zip(yhi) {
                *y1 = d1 * (q & 0xF) as f32 - m1;
                *y2 = d2 * (q >> 4) as f32 - m2;
            }
        }
    }
}

/// ggml `make_qkx2_quants` with `use_mad = false`: fits `x ≈ scale·L + min`
/// (min <= 0, L in 0..=nmax) by weighted least squares, trying `nstep + 1`
/// candidate inverse scales around `nmax/(max - min)`. Writes the levels to
/// `l`, returns `(scale, -min)`.
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let li = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = li as u8;
        let diff = scale * li as f32 + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    let mut laux = [0u8; 32];
    let laux = &mut laux[..n];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let li = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = li as u8;
            let w = weights[i];
            let lf = li as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * (diff * diff);
            }
            if cur_error < best_error {
                l.copy_from_slice(laux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// ggml `quantize_row_q4_K_ref` (the imatrix-free reference quantizer): fits
/// each sub-block with `make_qkx2_quants(32, 15, weights = av_x + |x|,
/// rmin = -1, rdelta = 0.1, nstep = 20)`, quantizes the 8 scales and mins to
/// 6 bits against `d = max_scale/63`, `dmin = max_min/63`, then requantizes
/// every weight against the rounded scales.
///
/// # Panics
/// If `x.len() != QK_K * y.len()`.
pub fn quantize_row_ref(x: &[f32], y: &mut [BlockQ4_K]) {
    assert_eq!(x.len(), y.len() * QK_K, "q4_K quantize_row_ref lengths");
    let mut l = [0u8; QK_K];
    let mut weights = [0.0f32; 32];
    let mut mins = [0.0f32; QK_K / 32];
    let mut scales = [0.0f32; QK_K / 32];
    for (x, b) in x.chunks_exact(QK_K).zip(y) {
        let mut max_scale = 0.0f32;
        let mut max_min = 0.0f32;
        for j in 0..QK_K / 32 {
            let xs = &x[32 * j..32 * j + 32];
            let mut sum_x2 = 0.0f32;
            for &v in xs {
                sum_x2 += v * v;
            }
            let av_x = (sum_x2 / 32.0).sqrt();
            for (w, &v) in weights.iter_mut().zip(xs) {
                *w = av_x + v.abs();
            }
            let (scale, min) =
                make_qkx2_quants(15, xs, &weights, &mut l[32 * j..32 * j + 32], -1.0, 0.1, 20);
            scales[j] = scale;
            mins[j] = min;
            if scale > max_scale {
                max_scale = scale;
            }
            if min > max_min {
                max_min = min;
            }
        }

        let inv_scale = if max_scale > 0.0 {
            63.0 / max_scale
        } else {
            0.0
        };
        let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
        for j in 0..QK_K / 32 {
            // ggml stores nearest_int into a uint8_t (wrapping), then clamps to 63.
            let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
            let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
            if j < 4 {
                b.scales[j] = ls;
                b.scales[j + 4] = lm;
            } else {
                b.scales[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
                b.scales[j - 4] |= (ls >> 4) << 6;
                b.scales[j] |= (lm >> 4) << 6;
            }
        }
        b.d = fp32_to_fp16(max_scale / 63.0);
        b.dmin = fp32_to_fp16(max_min / 63.0);

        for j in 0..QK_K / 32 {
            let (sc, m) = get_scale_min_k4(j, &b.scales);
            let d = fp16_to_fp32(b.d) * sc as f32;
            if d == 0.0 {
                continue;
            }
            let dm = fp16_to_fp32(b.dmin) * m as f32;
            for ii in 0..32 {
                l[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / d).clamp(0, 15) as u8;
            }
        }

        for (c, q) in b.qs.chunks_exact_mut(32).enumerate() {
            for (i, q) in q.iter_mut().enumerate() {
                *q = l[64 * c + i] | (l[64 * c + 32 + i] << 4);
            }
        }
    }
}

/// ggml `ggml_vec_dot_q4_K_q8_K_generic`, reproducing its float order:
/// per super-block, 8 integer lanes `aux32[l] = Σ_{i ≡ l mod 8} sc(i)·q(i)·q8(i)`
/// (exact), a min term `sumi = Σ_j bsums[j]·m[j/2]` (exact), then
/// `sums[l] += (d·y.d)·aux32[l]` and `sumf -= (dmin·y.d)·sumi` in f32; at the
/// end `sumf += sums[0]`, ..., `sums[7]` in order.
///
/// # Panics
/// If the block counts differ.
#[allow(non_snake_case)]
pub fn vec_dot_q4_K_q8_K(x: &[BlockQ4_K], y: &[BlockQ8_K]) -> f32 {
    assert_eq!(x.len(), y.len(), "vec_dot_q4_K_q8_K block counts");
    let mut sums = [0.0f32; 8];
    let mut sumf = 0.0f32;
    for (bx, by) in x.iter().zip(y) {
        let mut a = [0i32; QK_K];
        for (c, q) in bx.qs.chunks_exact(32).enumerate() {
            for (i, &q) in q.iter().enumerate() {
                a[64 * c + i] = (q & 0xF) as i32;
                a[64 * c + 32 + i] = (q >> 4) as i32;
            }
        }
        let mut scales = [0i32; 8];
        let mut mins = [0i32; 8];
        for j in 0..8 {
            let (sc, m) = get_scale_min_k4(j, &bx.scales);
            scales[j] = sc as i32;
            mins[j] = m as i32;
        }
        let mut sumi = 0i32;
        for (j, &s) in by.bsums.iter().enumerate() {
            sumi += s as i32 * mins[j / 2];
        }
        let mut aux32 = [0i32; 8];
        for (i8, (a8, q8)) in a.chunks_exact(8).zip(by.qs.chunks_exact(8)).enumerate() {
            let scale = scales[i8 / 4];
            for ((acc, &av), &qv) in aux32.iter_mut().zip(a8).zip(q8) {
                *acc += scale * (qv as i32 * av);
            }
        }
        let d = fp16_to_fp32(bx.d) * by.d;
        for (s, &v) in sums.iter_mut().zip(&aux32) {
            *s += d * v as f32;
        }
        let dmin = fp16_to_fp32(bx.dmin) * by.d;
        sumf -= dmin * sumi as f32;
    }
    for s in sums {
        sumf += s;
    }
    sumf
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::q8_k;
    use crate::testing::{check_close, dot_f64, XorShift};

    /// Packs 8 six-bit (scale, min) pairs the way ggml's quantizer does.
    fn pack_scales(sc: [u8; 8], m: [u8; 8]) -> [u8; K_SCALE_SIZE] {
        let mut q = [0u8; K_SCALE_SIZE];
        for j in 0..8 {
            if j < 4 {
                q[j] = sc[j];
                q[j + 4] = m[j];
            } else {
                q[j + 4] = (sc[j] & 0xF) | ((m[j] & 0xF) << 4);
                q[j - 4] |= (sc[j] >> 4) << 6;
                q[j] |= (m[j] >> 4) << 6;
            }
        }
        q
    }

    #[test]
    fn scale_min_unpacking_round_trips_all_six_bits() {
        let sc = [0, 1, 17, 63, 32, 47, 5, 63];
        let m = [63, 2, 40, 0, 63, 16, 33, 1];
        let q = pack_scales(sc, m);
        for j in 0..8 {
            assert_eq!(get_scale_min_k4(j, &q), (sc[j], m[j]), "sub-block {j}");
        }
        // A hand-packed byte: sub-block 4's scale = 0b11_0101 = 53 needs q[8] low nibble 5
        // and q[0] top bits 3.
        let mut q = [0u8; K_SCALE_SIZE];
        q[8] = 0x05;
        q[0] = 0xC0;
        assert_eq!(get_scale_min_k4(4, &q), (53, 0));
        assert_eq!(get_scale_min_k4(0, &q), (0, 0)); // the top bits do not leak into j = 0
    }

    #[test]
    fn hand_built_block_dequantizes_exactly() {
        // d = 0.5, dmin = 0.25; sub-block j: scale j + 1, min 2j; quants q(i) = i % 16.
        let sc: [u8; 8] = std::array::from_fn(|j| j as u8 + 1);
        let m: [u8; 8] = std::array::from_fn(|j| 2 * j as u8);
        let mut b = BlockQ4_K {
            d: 0x3800u16.to_le_bytes(),
            dmin: 0x3400u16.to_le_bytes(),
            scales: pack_scales(sc, m),
            qs: [0; 128],
        };
        for (c, chunk) in b.qs.chunks_exact_mut(32).enumerate() {
            for (i, q) in chunk.iter_mut().enumerate() {
                let lo = (64 * c + i) % 16;
                let hi = (64 * c + 32 + i) % 16;
                *q = lo as u8 | ((hi as u8) << 4);
            }
        }
        let mut y = [0.0; QK_K];
        dequantize_row(&[b], &mut y);
        for (i, &v) in y.iter().enumerate() {
            let j = i / 32;
            let want = 0.5 * (j + 1) as f32 * (i % 16) as f32 - 0.25 * (2 * j) as f32;
            assert_eq!(v, want, "element {i}");
        }
    }

    /// Per element, with d1 = d·sc and m1 = dmin·m of its sub-block (exactly the
    /// values the requantization divides by, so the bound is tight):
    /// - level 1..=14: |x - y| <= d1/2 (round to nearest) + float slack;
    /// - level 0 / 15: either that, or x lies beyond the clamp (x < y / x > y);
    /// - d1 = 0 (the 6-bit scale rounded to 0): y = -m1 exactly.
    ///
    /// Run on Gaussian-like data and on heavy-tailed data, which reaches the
    /// clamp and zero-scale cases (asserted). On the Gaussian-like data the RMS
    /// error is also below 0.35 of the mean step (uniform rounding alone gives 0.29).
    #[test]
    fn round_trip_error_bound() {
        let mut rng = XorShift::new(70);
        let nb = 32;
        for (name, x) in [
            ("gaussian", rng.vec_weights(QK_K * nb, 0.05)),
            ("heavy", rng.vec_heavy(QK_K * nb)),
        ] {
            let mut b = vec![BlockQ4_K::zeroed(); nb];
            quantize_row_ref(&x, &mut b);
            let mut y = vec![0.0; x.len()];
            dequantize_row(&b, &mut y);
            let (mut clamped, mut zero_scale) = (0, 0);
            let mut sq_err = 0.0f64;
            let mut sum_step = 0.0f64;
            for (i, (&xv, &yv)) in x.iter().zip(&y).enumerate() {
                let blk = &b[i / QK_K];
                let (sc, m) = get_scale_min_k4((i % QK_K) / 32, &blk.scales);
                let d1 = fp16_to_fp32(blk.d) * sc as f32;
                let m1 = fp16_to_fp32(blk.dmin) * m as f32;
                if d1 == 0.0 {
                    assert_eq!(yv, -m1, "{name} element {i}");
                    zero_scale += 1;
                    continue;
                }
                let (c, k) = (i / 64 % 4, i % 64);
                let q = if k < 32 {
                    blk.qs[32 * c + k] & 0xF
                } else {
                    blk.qs[32 * c + k - 32] >> 4
                };
                let slack = 4.0 * f32::EPSILON * (xv.abs() + m1 + 15.0 * d1);
                let err = xv - yv;
                let ok = err.abs() <= 0.5 * d1 + slack
                    || (q == 0 && err < 0.0)
                    || (q == 15 && err > 0.0);
                assert!(
                    ok,
                    "{name} element {i}: x {xv}, y {yv}, level {q}, step {d1}"
                );
                if err.abs() > 0.5 * d1 + slack {
                    clamped += 1;
                }
                sq_err += (err as f64).powi(2);
                sum_step += d1 as f64;
            }
            if name == "heavy" {
                assert!(
                    clamped > 0 && zero_scale > 0,
                    "heavy data: {clamped} clamped, {zero_scale} zero-scale"
                );
            } else {
                let rms = (sq_err / x.len() as f64).sqrt();
                let mean_step = sum_step / x.len() as f64;
                assert!(rms < 0.35 * mean_step, "rms {rms} vs mean step {mean_step}");
            }
        }
    }

    #[test]
    fn zero_and_constant_rows_quantize_cleanly() {
        let mut b = [BlockQ4_K::zeroed()];
        quantize_row_ref(&[0.0; QK_K], &mut b);
        let mut y = [1.0; QK_K];
        dequantize_row(&b, &mut y);
        assert!(y.iter().all(|&v| v == 0.0));
        // A negative constant is carried entirely by the min.
        quantize_row_ref(&[-0.5; QK_K], &mut b);
        dequantize_row(&b, &mut y);
        check_close("q4_K constant", &y, &[-0.5; QK_K], |_| 0.5 * 2f32.powi(-10));
    }

    /// The generic 8-lane dot against the same sum written directly from the
    /// dequantization formula, in f64: they agree to float rounding.
    #[test]
    fn dot_matches_f64_dot_of_dequantized() {
        let mut rng = XorShift::new(71);
        let nb = 8;
        let n = QK_K * nb;
        let w = rng.vec_weights(n, 0.02);
        let x = rng.vec_uniform(n, -4.0, 4.0);
        let mut bw = vec![BlockQ4_K::zeroed(); nb];
        let mut bx = vec![BlockQ8_K::ZERO; nb];
        quantize_row_ref(&w, &mut bw);
        q8_k::quantize_row_ref(&x, &mut bx);
        let (mut wd, mut xd) = (vec![0.0; n], vec![0.0; n]);
        dequantize_row(&bw, &mut wd);
        q8_k::dequantize_row(&bx, &mut xd);
        let want = dot_f64(&wd, &xd);
        let scale: f64 = wd.iter().zip(&xd).map(|(a, b)| (a * b).abs() as f64).sum();
        let got = vec_dot_q4_K_q8_K(&bw, &bx) as f64;
        assert!((got - want).abs() <= 1e-5 * scale, "got {got}, want {want}");
    }

    /// Random bytes as weights (any 6-bit scales, full nibble range, random
    /// f16 scales kept finite): the kernel still equals the f64 reference, so
    /// nothing depends on the quantizer's conventions.
    #[test]
    fn dot_on_random_blocks() {
        let mut rng = XorShift::new(72);
        for _ in 0..20 {
            let mut bw = [BlockQ4_K::zeroed(); 2];
            for blk in &mut bw {
                for v in blk.scales.iter_mut().chain(blk.qs.iter_mut()) {
                    *v = rng.byte();
                }
                blk.d = fp32_to_fp16(rng.uniform(0.0, 0.01));
                blk.dmin = fp32_to_fp16(rng.uniform(0.0, 0.01));
            }
            let x = rng.vec_uniform(2 * QK_K, -1.0, 1.0);
            let mut bx = [BlockQ8_K::ZERO; 2];
            q8_k::quantize_row_ref(&x, &mut bx);
            let (mut wd, mut xd) = (vec![0.0; 2 * QK_K], vec![0.0; 2 * QK_K]);
            dequantize_row(&bw, &mut wd);
            q8_k::dequantize_row(&bx, &mut xd);
            let want = dot_f64(&wd, &xd);
            let scale: f64 = wd.iter().zip(&xd).map(|(a, b)| (a * b).abs() as f64).sum();
            let got = vec_dot_q4_K_q8_K(&bw, &bx) as f64;
            assert!((got - want).abs() <= 1e-5 * scale, "got {got}, want {want}");
        }
    }
}
