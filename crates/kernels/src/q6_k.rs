//! Q6_K (ggml type 14): super-blocks of 256 weights in 16 sub-blocks of 16.
//! Each sub-block has a signed 8-bit scale; the super-block has an f16 `d`.
//! Weight value: `(d·scale)·(q - 32)` with 6-bit `q`. Scalar reference (AVX2:
//! `x86/avx2/kquants.rs`).
//!
//! Layout (ggml): two halves of 128 weights; half `h` uses `ql[64h..64h+64]`
//! and `qh[32h..32h+32]`. Within a half, for `l` in 0..32, the four weights
//! `l`, `l+32`, `l+64`, `l+96` take their low 4 bits from the low nibble of
//! `ql[l]`, low nibble of `ql[l+32]`, high nibble of `ql[l]`, high nibble of
//! `ql[l+32]`, and their top 2 bits from bits 0-1, 2-3, 4-5, 6-7 of `qh[l]`.
//! Follows ggml's `block_q6_K`, `dequantize_row_q6_K`, `quantize_row_q6_K_ref`
//! (with `make_qx_quants`) and `ggml_vec_dot_q6_K_q8_K_generic`.

use bytemuck::{Pod, Zeroable};

use crate::f16::{fp16_to_fp32, fp32_to_fp16};
use crate::q8_k::BlockQ8_K;
use crate::{nearest_int, KernelError, QK_K};

/// ggml `GROUP_MAX_EPS`: below this a group counts as all zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml `block_q6_K`: 210 bytes, alignment 1.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ6_K {
    /// Low 4 bits of the quants.
    pub ql: [u8; QK_K / 2],
    /// High 2 bits of the quants.
    pub qh: [u8; QK_K / 4],
    /// Sub-block scales.
    pub scales: [i8; QK_K / 16],
    /// Super-block scale, f16 little-endian.
    pub d: [u8; 2],
}

const _: () = assert!(size_of::<BlockQ6_K>() == 210);
const _: () = assert!(align_of::<BlockQ6_K>() == 1);

/// Views encoded weight bytes (any alignment) as blocks.
pub fn blocks(bytes: &[u8]) -> Result<&[BlockQ6_K], KernelError> {
    crate::cast_blocks("q6_K", bytes)
}

/// The 256 quants of a block minus 32, in element order.
pub(crate) fn unpack(b: &BlockQ6_K) -> [i32; QK_K] {
    let mut a = [0i32; QK_K];
    for h in 0..2 {
        let ql = &b.ql[64 * h..64 * h + 64];
        let qh = &b.qh[32 * h..32 * h + 32];
        let a = &mut a[128 * h..128 * h + 128];
        for l in 0..32 {
            a[l] = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            a[l + 32] = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            a[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            a[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
        }
    }
    a
}

/// ggml `dequantize_row_q6_K`: `y = (d·scale)·(q - 32)`.
///
/// # Panics
/// If `y.len() != QK_K * x.len()`.
pub fn dequantize_row(x: &[BlockQ6_K], y: &mut [f32]) {
    assert_eq!(y.len(), x.len() * QK_K, "q6_K dequantize_row lengths");
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_K)) {
        let d = fp16_to_fp32(b.d);
        let q = unpack(b);
        for (i, y) in y.iter_mut().enumerate() {
            *y = d * b.scales[i / 16] as f32 * q[i] as f32;
        }
    }
}

/// ggml `make_qx_quants` with `rmse_type = 1` and no importance weights
/// (weights `x²`), the only form `quantize_row_q6_K_ref` uses: symmetric fit
/// `x ≈ scale·(L - nmax)`, `L` in 0..2·nmax, trying 19 inverse scales around
/// `-nmax/max`. Writes `L` to `l`, returns the scale.
fn make_qx_quants(nmax: i32, x: &[f32], l: &mut [u8]) -> f32 {
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let mut iscale = -(nmax as f32) / max;
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    for (li, &v) in l.iter_mut().zip(x) {
        let q = level(iscale, v);
        *li = (q + nmax) as u8;
        let w = v * v;
        sumlx += w * v * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &v in x {
            let q = level(iscale, v);
            let w = v * v;
            sumlx += w * v * q as f32;
            suml2 += w * q as f32 * q as f32;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (li, &v) in l.iter_mut().zip(x) {
                *li = (level(iscale, v) + nmax) as u8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// ggml `quantize_row_q6_K_ref` (the imatrix-free reference quantizer): fits
/// each sub-block of 16 with `make_qx_quants(16, 32, rmse_type = 1)`,
/// quantizes the 16 scales to int8 against `d = max_scale/-128` (the signed
/// scale of largest magnitude), then requantizes every weight against the
/// rounded scales. A block whose scales are all below 1e-15 is all zero.
///
/// # Panics
/// If `x.len() != QK_K * y.len()`.
pub fn quantize_row_ref(x: &[f32], y: &mut [BlockQ6_K]) {
    assert_eq!(x.len(), y.len() * QK_K, "q6_K quantize_row_ref lengths");
    let mut l = [0u8; QK_K];
    let mut scales = [0.0f32; QK_K / 16];
    for (x, b) in x.chunks_exact(QK_K).zip(y) {
        let mut max_scale = 0.0f32;
        let mut max_abs_scale = 0.0f32;
        for ib in 0..QK_K / 16 {
            let scale =
                make_qx_quants(32, &x[16 * ib..16 * ib + 16], &mut l[16 * ib..16 * ib + 16]);
            scales[ib] = scale;
            if scale.abs() > max_abs_scale {
                max_abs_scale = scale.abs();
                max_scale = scale;
            }
        }
        if max_abs_scale < GROUP_MAX_EPS {
            *b = BlockQ6_K::zeroed();
            continue;
        }

        let iscale = -128.0 / max_scale;
        b.d = fp32_to_fp16(1.0 / iscale);
        for (s, &v) in b.scales.iter_mut().zip(&scales) {
            *s = nearest_int(iscale * v).min(127) as i8;
        }

        for j in 0..QK_K / 16 {
            let d = fp16_to_fp32(b.d) * b.scales[j] as f32;
            if d == 0.0 {
                continue;
            }
            for ii in 0..16 {
                let q = nearest_int(x[16 * j + ii] / d).clamp(-32, 31);
                l[16 * j + ii] = (q + 32) as u8;
            }
        }

        for h in 0..2 {
            let l = &l[128 * h..128 * h + 128];
            let ql = &mut b.ql[64 * h..64 * h + 64];
            for i in 0..32 {
                ql[i] = (l[i] & 0xF) | ((l[i + 64] & 0xF) << 4);
                ql[i + 32] = (l[i + 32] & 0xF) | ((l[i + 96] & 0xF) << 4);
                b.qh[32 * h + i] = (l[i] >> 4)
                    | ((l[i + 32] >> 4) << 2)
                    | ((l[i + 64] >> 4) << 4)
                    | ((l[i + 96] >> 4) << 6);
            }
        }
    }
}

/// ggml `ggml_vec_dot_q6_K_q8_K_generic`, reproducing its float order: per
/// super-block, 8 integer lanes `aux32[l] = Σ_{i ≡ l mod 8} scale(i)·(q(i) - 32)·q8(i)`
/// (exact), then `sums[l] += (d·y.d)·aux32[l]` in f32; at the end
/// `sumf = 0 + sums[0] + ... + sums[7]` in order.
///
/// # Panics
/// If the block counts differ.
#[allow(non_snake_case)]
pub fn vec_dot_q6_K_q8_K(x: &[BlockQ6_K], y: &[BlockQ8_K]) -> f32 {
    assert_eq!(x.len(), y.len(), "vec_dot_q6_K_q8_K block counts");
    let mut sums = [0.0f32; 8];
    for (bx, by) in x.iter().zip(y) {
        let a = unpack(bx);
        let mut aux32 = [0i32; 8];
        for (i8, (a8, q8)) in a.chunks_exact(8).zip(by.qs.chunks_exact(8)).enumerate() {
            let scale = bx.scales[i8 / 2] as i32;
            for ((acc, &av), &qv) in aux32.iter_mut().zip(a8).zip(q8) {
                *acc += scale * (qv as i32 * av);
            }
        }
        let d = fp16_to_fp32(bx.d) * by.d;
        for (s, &v) in sums.iter_mut().zip(&aux32) {
            *s += d * v as f32;
        }
    }
    let mut sumf = 0.0f32;
    for s in sums {
        sumf += s;
    }
    sumf
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::q8_k;
    use crate::testing::{dot_f64, XorShift};

    /// Packs 256 six-bit quants (0..64) with the layout from the module docs,
    /// written independently of `quantize_row_ref`.
    fn pack(q: &[u8; QK_K]) -> ([u8; 128], [u8; 64]) {
        let mut ql = [0u8; 128];
        let mut qh = [0u8; 64];
        for (i, &v) in q.iter().enumerate() {
            let h = i / 128;
            let r = i % 128;
            let (l, quarter) = (r % 32, r / 32);
            let byte = 64 * h + l + if quarter % 2 == 1 { 32 } else { 0 };
            let shift = if quarter >= 2 { 4 } else { 0 };
            ql[byte] |= (v & 0xF) << shift;
            qh[32 * h + l] |= (v >> 4) << (2 * quarter);
        }
        (ql, qh)
    }

    #[test]
    fn hand_built_block_dequantizes_exactly() {
        // d = 0.125; scale of sub-block s = s - 8 (negative ones too); quant(i) = i % 64.
        let q: [u8; QK_K] = std::array::from_fn(|i| (i % 64) as u8);
        let (ql, qh) = pack(&q);
        let b = BlockQ6_K {
            ql,
            qh,
            scales: std::array::from_fn(|s| s as i8 - 8),
            d: 0x3000u16.to_le_bytes(),
        };
        let mut y = [0.0; QK_K];
        dequantize_row(&[b], &mut y);
        for (i, &v) in y.iter().enumerate() {
            let want = 0.125 * (i / 16) as f32 - 1.0;
            assert_eq!(v, want * ((i % 64) as f32 - 32.0), "element {i}");
        }
        // A specific byte: element 200 = half 1, quarter 2, l = 8 → high nibble of
        // ql[64 + 8], bits 4-5 of qh[32 + 8].
        assert_eq!(q[200], 8);
        assert_eq!(b.ql[72] >> 4, 8);
        assert_eq!((b.qh[40] >> 4) & 3, 0);
    }

    #[test]
    fn quantizer_packs_like_the_documented_layout() {
        let mut rng = XorShift::new(80);
        let x = rng.vec_weights(QK_K, 0.05);
        let mut b = [BlockQ6_K::zeroed()];
        quantize_row_ref(&x, &mut b);
        let q = unpack(&b[0]);
        let q: [u8; QK_K] = std::array::from_fn(|i| (q[i] + 32) as u8);
        assert_eq!(pack(&q), (b[0].ql, b[0].qh));
    }

    /// Per element, with step = d·scale of its sub-block (the exact divisor of
    /// the requantization) and t = (x - y)/step:
    /// - level -31..=30: |t| <= 1/2 (round to nearest) + float slack;
    /// - level -32 / 31: either that, or x lies beyond the clamp (t < 0 / t > 0);
    /// - step = 0 (the int8 scale rounded to 0): y = 0 exactly.
    ///
    /// Run on Gaussian-like data and on heavy-tailed data, which reaches the
    /// clamp and zero-scale cases (asserted). On the Gaussian-like data the RMS
    /// error is also below 0.35 of the mean step (uniform rounding alone gives 0.29).
    #[test]
    fn round_trip_error_bound() {
        let mut rng = XorShift::new(81);
        let nb = 32;
        for (name, x) in [
            ("gaussian", rng.vec_weights(QK_K * nb, 0.05)),
            ("heavy", rng.vec_heavy(QK_K * nb)),
        ] {
            let mut b = vec![BlockQ6_K::zeroed(); nb];
            quantize_row_ref(&x, &mut b);
            let mut y = vec![0.0; x.len()];
            dequantize_row(&b, &mut y);
            let levels: Vec<[i32; QK_K]> = b.iter().map(unpack).collect();
            let (mut clamped, mut zero_scale) = (0, 0);
            let mut sq_err = 0.0f64;
            let mut sum_step = 0.0f64;
            for (i, (&xv, &yv)) in x.iter().zip(&y).enumerate() {
                let blk = &b[i / QK_K];
                let step = fp16_to_fp32(blk.d) * blk.scales[(i % QK_K) / 16] as f32;
                if step == 0.0 {
                    assert_eq!(yv, 0.0, "{name} element {i}");
                    zero_scale += 1;
                    continue;
                }
                let q = levels[i / QK_K][i % QK_K];
                let t = (xv - yv) / step;
                let slack = 4.0 * f32::EPSILON * (xv.abs() / step.abs() + 32.0);
                let ok = t.abs() <= 0.5 + slack || (q == -32 && t < 0.0) || (q == 31 && t > 0.0);
                assert!(
                    ok,
                    "{name} element {i}: x {xv}, y {yv}, level {q}, step {step}"
                );
                if t.abs() > 0.5 + slack {
                    clamped += 1;
                }
                sq_err += ((xv - yv) as f64).powi(2);
                sum_step += step.abs() as f64;
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
    fn zero_row_quantizes_to_a_zero_block() {
        let mut b = [BlockQ6_K {
            ql: [1; 128],
            qh: [1; 64],
            scales: [1; 16],
            d: [1, 1],
        }];
        quantize_row_ref(&[0.0; QK_K], &mut b);
        assert_eq!(b[0], BlockQ6_K::zeroed());
    }

    #[test]
    fn dot_matches_f64_dot_of_dequantized() {
        let mut rng = XorShift::new(82);
        let nb = 8;
        let n = QK_K * nb;
        let w = rng.vec_weights(n, 0.02);
        let x = rng.vec_uniform(n, -4.0, 4.0);
        let mut bw = vec![BlockQ6_K::zeroed(); nb];
        let mut bx = vec![BlockQ8_K::ZERO; nb];
        quantize_row_ref(&w, &mut bw);
        q8_k::quantize_row_ref(&x, &mut bx);
        let (mut wd, mut xd) = (vec![0.0; n], vec![0.0; n]);
        dequantize_row(&bw, &mut wd);
        q8_k::dequantize_row(&bx, &mut xd);
        let want = dot_f64(&wd, &xd);
        let scale: f64 = wd.iter().zip(&xd).map(|(a, b)| (a * b).abs() as f64).sum();
        let got = vec_dot_q6_K_q8_K(&bw, &bx) as f64;
        assert!((got - want).abs() <= 1e-5 * scale, "got {got}, want {want}");
    }

    /// Random bytes as weights (negative scales, all 6-bit levels): the kernel
    /// still equals the f64 reference.
    #[test]
    fn dot_on_random_blocks() {
        let mut rng = XorShift::new(83);
        for _ in 0..20 {
            let mut bw = [BlockQ6_K::zeroed(); 2];
            for blk in &mut bw {
                for v in blk.ql.iter_mut().chain(blk.qh.iter_mut()) {
                    *v = rng.byte();
                }
                for s in &mut blk.scales {
                    *s = rng.byte() as i8;
                }
                blk.d = fp32_to_fp16(rng.uniform(-0.01, 0.01));
            }
            let x = rng.vec_uniform(2 * QK_K, -1.0, 1.0);
            let mut bx = [BlockQ8_K::ZERO; 2];
            q8_k::quantize_row_ref(&x, &mut bx);
            let (mut wd, mut xd) = (vec![0.0; 2 * QK_K], vec![0.0; 2 * QK_K]);
            dequantize_row(&bw, &mut wd);
            q8_k::dequantize_row(&bx, &mut xd);
            let want = dot_f64(&wd, &xd);
            let scale: f64 = wd.iter().zip(&xd).map(|(a, b)| (a * b).abs() as f64).sum();
            let got = vec_dot_q6_K_q8_K(&bw, &bx) as f64;
            assert!((got - want).abs() <= 1e-5 * scale, "got {got}, want {want}");
        }
    }
}
