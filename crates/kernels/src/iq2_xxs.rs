//! IQ2_XXS (ggml type 16): super-blocks of 256 weights, 2.06 bits each. Eight
//! sub-blocks of 32; each is two little-endian u32 words: `a` holds four
//! indices into a 256-entry grid of 8-value patterns (values 8, 25, 43), `b`
//! holds four 7-bit sign patterns (the eighth sign is their parity) and a
//! 4-bit scale `s` in its top bits. Weight value:
//! `d·(0.5 + s)·0.25·grid[a_g][i]·sign`. Scalar reference (AVX2 dot:
//! `x86/avx2/kquants.rs`).
//!
//! Used by DeepSeek V4's routed-expert gate and up projections. Follows
//! ggml's `block_iq2_xxs`, `iq2xxs_grid`, `ksigns_iq2xs`,
//! `dequantize_row_iq2_xxs` and `ggml_vec_dot_iq2_xxs_q8_K_generic` (which the
//! DeepSeek V4 reference engine's scalar dot repeats operation for operation).

use bytemuck::{Pod, Zeroable};

use crate::f16::fp16_to_fp32;
use crate::q8_k::BlockQ8_K;
use crate::{KernelError, QK_K};

/// ggml `block_iq2_xxs`: 66 bytes, alignment 1.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockIQ2_XXS {
    /// Super-block scale, f16 little-endian.
    pub d: [u8; 2],
    /// Eight sub-blocks of two little-endian u32 (ggml: `uint16_t qs[32]`).
    pub qs: [u8; QK_K / 4],
}

const _: () = assert!(size_of::<BlockIQ2_XXS>() == 66);
const _: () = assert!(align_of::<BlockIQ2_XXS>() == 1);

/// ggml `iq2xxs_grid`: 256 patterns of 8 magnitudes, byte `i` = element `i`.
pub const IQ2XXS_GRID: [u64; 256] = [
    0x0808080808080808,
    0x080808080808082b,
    0x0808080808081919,
    0x0808080808082b08,
    0x0808080808082b2b,
    0x0808080808190819,
    0x0808080808191908,
    0x08080808082b0808,
    0x08080808082b082b,
    0x08080808082b2b08,
    0x08080808082b2b2b,
    0x0808080819080819,
    0x0808080819081908,
    0x0808080819190808,
    0x0808080819192b08,
    0x08080808192b0819,
    0x08080808192b1908,
    0x080808082b080808,
    0x080808082b08082b,
    0x080808082b082b2b,
    0x080808082b2b082b,
    0x0808081908080819,
    0x0808081908081908,
    0x0808081908190808,
    0x0808081908191919,
    0x0808081919080808,
    0x080808192b081908,
    0x080808192b192b08,
    0x0808082b08080808,
    0x0808082b0808082b,
    0x0808082b082b082b,
    0x0808082b2b08082b,
    0x0808190808080819,
    0x0808190808081908,
    0x0808190808190808,
    0x08081908082b0819,
    0x08081908082b1908,
    0x0808190819080808,
    0x080819081908082b,
    0x0808190819082b08,
    0x08081908192b0808,
    0x080819082b080819,
    0x080819082b081908,
    0x080819082b190808,
    0x080819082b2b1908,
    0x0808191908080808,
    0x080819190808082b,
    0x0808191908082b08,
    0x08081919082b0808,
    0x080819191908192b,
    0x08081919192b2b19,
    0x080819192b080808,
    0x080819192b190819,
    0x0808192b08082b19,
    0x0808192b08190808,
    0x0808192b19080808,
    0x0808192b2b081908,
    0x0808192b2b2b1908,
    0x08082b0808080808,
    0x08082b0808081919,
    0x08082b0808082b08,
    0x08082b0808191908,
    0x08082b08082b2b08,
    0x08082b0819080819,
    0x08082b0819081908,
    0x08082b0819190808,
    0x08082b081919082b,
    0x08082b082b082b08,
    0x08082b1908081908,
    0x08082b1919080808,
    0x08082b2b0808082b,
    0x08082b2b08191908,
    0x0819080808080819,
    0x0819080808081908,
    0x0819080808190808,
    0x08190808082b0819,
    0x0819080819080808,
    0x08190808192b0808,
    0x081908082b081908,
    0x081908082b190808,
    0x081908082b191919,
    0x0819081908080808,
    0x0819081908082b08,
    0x08190819082b0808,
    0x0819081919190808,
    0x0819081919192b2b,
    0x081908192b080808,
    0x0819082b082b1908,
    0x0819082b19081919,
    0x0819190808080808,
    0x0819190808082b08,
    0x08191908082b0808,
    0x08191908082b1919,
    0x0819190819082b19,
    0x081919082b080808,
    0x0819191908192b08,
    0x08191919192b082b,
    0x0819192b08080808,
    0x0819192b0819192b,
    0x08192b0808080819,
    0x08192b0808081908,
    0x08192b0808190808,
    0x08192b0819080808,
    0x08192b082b080819,
    0x08192b1908080808,
    0x08192b1908081919,
    0x08192b192b2b0808,
    0x08192b2b19190819,
    0x082b080808080808,
    0x082b08080808082b,
    0x082b080808082b2b,
    0x082b080819081908,
    0x082b0808192b0819,
    0x082b08082b080808,
    0x082b08082b08082b,
    0x082b0819082b2b19,
    0x082b081919082b08,
    0x082b082b08080808,
    0x082b082b0808082b,
    0x082b190808080819,
    0x082b190808081908,
    0x082b190808190808,
    0x082b190819080808,
    0x082b19081919192b,
    0x082b191908080808,
    0x082b191919080819,
    0x082b1919192b1908,
    0x082b192b2b190808,
    0x082b2b0808082b08,
    0x082b2b08082b0808,
    0x082b2b082b191908,
    0x082b2b2b19081908,
    0x1908080808080819,
    0x1908080808081908,
    0x1908080808190808,
    0x1908080808192b08,
    0x19080808082b0819,
    0x19080808082b1908,
    0x1908080819080808,
    0x1908080819082b08,
    0x190808081919192b,
    0x19080808192b0808,
    0x190808082b080819,
    0x190808082b081908,
    0x190808082b190808,
    0x1908081908080808,
    0x19080819082b0808,
    0x19080819192b0819,
    0x190808192b080808,
    0x190808192b081919,
    0x1908082b08080819,
    0x1908082b08190808,
    0x1908082b19082b08,
    0x1908082b1919192b,
    0x1908082b192b2b08,
    0x1908190808080808,
    0x1908190808082b08,
    0x19081908082b0808,
    0x190819082b080808,
    0x190819082b192b19,
    0x190819190819082b,
    0x19081919082b1908,
    0x1908192b08080808,
    0x19082b0808080819,
    0x19082b0808081908,
    0x19082b0808190808,
    0x19082b0819080808,
    0x19082b0819081919,
    0x19082b1908080808,
    0x19082b1919192b08,
    0x19082b19192b0819,
    0x19082b192b08082b,
    0x19082b2b19081919,
    0x19082b2b2b190808,
    0x1919080808080808,
    0x1919080808082b08,
    0x1919080808190819,
    0x1919080808192b19,
    0x19190808082b0808,
    0x191908082b080808,
    0x191908082b082b08,
    0x1919081908081908,
    0x191908191908082b,
    0x191908192b2b1908,
    0x1919082b2b190819,
    0x191919082b190808,
    0x191919082b19082b,
    0x1919191908082b2b,
    0x1919192b08080819,
    0x1919192b19191908,
    0x19192b0808080808,
    0x19192b0808190819,
    0x19192b0808192b19,
    0x19192b08192b1908,
    0x19192b1919080808,
    0x19192b2b08082b08,
    0x192b080808081908,
    0x192b080808190808,
    0x192b080819080808,
    0x192b0808192b2b08,
    0x192b081908080808,
    0x192b081919191919,
    0x192b082b08192b08,
    0x192b082b192b0808,
    0x192b190808080808,
    0x192b190808081919,
    0x192b191908190808,
    0x192b19190819082b,
    0x192b19192b081908,
    0x192b2b081908082b,
    0x2b08080808080808,
    0x2b0808080808082b,
    0x2b08080808082b2b,
    0x2b08080819080819,
    0x2b0808082b08082b,
    0x2b08081908081908,
    0x2b08081908192b08,
    0x2b08081919080808,
    0x2b08082b08190819,
    0x2b08190808080819,
    0x2b08190808081908,
    0x2b08190808190808,
    0x2b08190808191919,
    0x2b08190819080808,
    0x2b081908192b0808,
    0x2b08191908080808,
    0x2b0819191908192b,
    0x2b0819192b191908,
    0x2b08192b08082b19,
    0x2b08192b19080808,
    0x2b08192b192b0808,
    0x2b082b080808082b,
    0x2b082b1908081908,
    0x2b082b2b08190819,
    0x2b19080808081908,
    0x2b19080808190808,
    0x2b190808082b1908,
    0x2b19080819080808,
    0x2b1908082b2b0819,
    0x2b1908190819192b,
    0x2b1908192b080808,
    0x2b19082b19081919,
    0x2b19190808080808,
    0x2b191908082b082b,
    0x2b19190819081908,
    0x2b19191919190819,
    0x2b192b082b080819,
    0x2b192b19082b0808,
    0x2b2b08080808082b,
    0x2b2b080819190808,
    0x2b2b08082b081919,
    0x2b2b081908082b19,
    0x2b2b082b08080808,
    0x2b2b190808192b08,
    0x2b2b2b0819190808,
    0x2b2b2b1908081908,
];

/// ggml `ksigns_iq2xs`: a 7-bit sign pattern with its parity as the eighth bit
/// (so every pattern has an even number of minus signs).
pub const KSIGNS_IQ2XS: [u8; 128] = {
    let mut t = [0u8; 128];
    let mut i = 0;
    while i < 128 {
        t[i] = i as u8
            | if (i as u8).count_ones() % 2 == 1 {
                128
            } else {
                0
            };
        i += 1;
    }
    t
};

/// Views encoded weight bytes (any alignment) as blocks.
pub fn blocks(bytes: &[u8]) -> Result<&[BlockIQ2_XXS], KernelError> {
    crate::cast_blocks("iq2_xxs", bytes)
}

/// Sub-block `ib` (0..8) of a block as its two words `(a, b)`.
#[inline]
pub fn words(b: &BlockIQ2_XXS, ib: usize) -> (u32, u32) {
    let q = &b.qs[8 * ib..8 * ib + 8];
    (
        u32::from_le_bytes([q[0], q[1], q[2], q[3]]),
        u32::from_le_bytes([q[4], q[5], q[6], q[7]]),
    )
}

/// The signed grid values of group `g` (0..4) of a sub-block's words.
#[inline]
pub fn signed_group(a: u32, b: u32, g: usize) -> [i8; 8] {
    let grid = IQ2XXS_GRID[((a >> (8 * g)) & 0xFF) as usize].to_le_bytes();
    let signs = KSIGNS_IQ2XS[((b >> (7 * g)) & 127) as usize];
    std::array::from_fn(|i| {
        let v = grid[i] as i8;
        if signs & (1 << i) != 0 {
            -v
        } else {
            v
        }
    })
}

/// ggml `dequantize_row_iq2_xxs`: `db = d·(0.5 + s)·0.25`, then
/// `y = db·grid·sign`.
///
/// # Panics
/// If `y.len() != QK_K * x.len()`.
pub fn dequantize_row(x: &[BlockIQ2_XXS], y: &mut [f32]) {
    assert_eq!(y.len(), x.len() * QK_K, "iq2_xxs dequantize_row lengths");
    for (blk, y) in x.iter().zip(y.chunks_exact_mut(QK_K)) {
        let d = fp16_to_fp32(blk.d);
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let (a, b) = words(blk, ib);
            let db = d * (0.5 + (b >> 28) as f32) * 0.25;
            for (g, y) in y.chunks_exact_mut(8).enumerate() {
                for (y, &v) in y.iter_mut().zip(&signed_group(a, b, g)) {
                    *y = db * v as f32;
                }
            }
        }
    }
}

/// ggml `ggml_vec_dot_iq2_xxs_q8_K_generic`: per super-block an exact integer
/// sum `bsum = Σ_ib (2s+1)·Σ_{32 values} grid·sign·q8`, then
/// `sumf += (d·y.d)·bsum` in f32, super-blocks in order, and the result is
/// `0.125·sumf`.
///
/// # Panics
/// If the block counts differ.
#[allow(non_snake_case)]
pub fn vec_dot_iq2_xxs_q8_K(x: &[BlockIQ2_XXS], y: &[BlockQ8_K]) -> f32 {
    assert_eq!(x.len(), y.len(), "vec_dot_iq2_xxs_q8_K block counts");
    let mut sumf = 0.0f32;
    for (bx, by) in x.iter().zip(y) {
        let d = fp16_to_fp32(bx.d) * by.d;
        let mut bsum = 0i32;
        for (ib, q8) in by.qs.chunks_exact(32).enumerate() {
            let (a, b) = words(bx, ib);
            let ls = 2 * (b >> 28) as i32 + 1;
            let mut sumi = 0i32;
            for (g, q8) in q8.chunks_exact(8).enumerate() {
                let w = signed_group(a, b, g);
                sumi += w
                    .iter()
                    .zip(q8)
                    .map(|(&w, &q)| w as i32 * q as i32)
                    .sum::<i32>();
            }
            bsum += sumi * ls;
        }
        sumf += d * bsum as f32;
    }
    0.125 * sumf
}

/// IQ2_XXS rows decoded once for many dots (a batch's tokens choosing the
/// same expert): per super-block its `d`, per sub-block the scale `2s + 1`
/// and the 32 signed grid values.
#[derive(Clone, Debug, Default)]
pub struct Iq2Decoded {
    pub w: Vec<i8>,
    pub ls: Vec<i16>,
    pub d: Vec<f32>,
}

impl Iq2Decoded {
    /// Decodes a row of blocks, replacing what was held.
    pub fn decode(&mut self, row: &[BlockIQ2_XXS]) {
        self.w.clear();
        self.ls.clear();
        self.d.clear();
        for blk in row {
            self.d.push(fp16_to_fp32(blk.d));
            for ib in 0..QK_K / 32 {
                let (a, b) = words(blk, ib);
                self.ls.push(2 * (b >> 28) as i16 + 1);
                for g in 0..4 {
                    self.w.extend_from_slice(&signed_group(a, b, g));
                }
            }
        }
    }
}

/// [`vec_dot_iq2_xxs_q8_K`] of a decoded row: the same exact integer sums
/// and float steps, so the same bits.
///
/// # Panics
/// If the block counts differ.
#[allow(non_snake_case)]
pub fn dot_decoded_q8_K_ref(x: &Iq2Decoded, y: &[BlockQ8_K]) -> f32 {
    assert!(
        x.d.len() == y.len() && x.w.len() == y.len() * QK_K,
        "dot_decoded_q8_K lengths"
    );
    let mut sumf = 0.0f32;
    for (b, by) in y.iter().enumerate() {
        let mut bsum = 0i32;
        for (ib, q8) in by.qs.chunks_exact(32).enumerate() {
            let w = &x.w[b * QK_K + 32 * ib..b * QK_K + 32 * (ib + 1)];
            let sumi: i32 = w.iter().zip(q8).map(|(&w, &q)| w as i32 * q as i32).sum();
            bsum += sumi * x.ls[8 * b + ib] as i32;
        }
        sumf += x.d[b] * by.d * bsum as f32;
    }
    0.125 * sumf
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::f16::fp32_to_fp16;
    use crate::q8_k;
    use crate::testing::{check_close, dot_f64, XorShift};

    #[test]
    fn sign_table_is_ggml_ksigns() {
        // A few entries of ggml's literal table.
        assert_eq!(&KSIGNS_IQ2XS[..8], &[0, 129, 130, 3, 132, 5, 6, 135]);
        assert_eq!(KSIGNS_IQ2XS[127], 255);
        assert!(KSIGNS_IQ2XS.iter().all(|s| s.count_ones() % 2 == 0));
    }

    #[test]
    fn dequantize_one_group() {
        let mut b = BlockIQ2_XXS::zeroed();
        b.d = fp32_to_fp16(2.0);
        // Sub-block 1: grid index 3 in group 0 (0x0808080808082b08: element 1 is 43),
        // sign pattern 1 (element 0 negative, parity sets element 7), scale 5.
        b.qs[8..12].copy_from_slice(&3u32.to_le_bytes());
        b.qs[12..16].copy_from_slice(&(1u32 | (5 << 28)).to_le_bytes());
        let mut y = [0.0f32; QK_K];
        dequantize_row(&[b], &mut y);
        let db = 2.0 * 5.5 * 0.25;
        assert_eq!(y[32], -db * 8.0);
        assert_eq!(y[33], db * 43.0);
        assert_eq!(y[39], -db * 8.0);
        assert_eq!(y[40], db * 8.0, "group 1: grid 0, no signs");
    }

    #[test]
    fn dot_matches_dequantized_f64() {
        let mut rng = XorShift::new(11);
        for nb in [1, 3, 4] {
            let x: Vec<BlockIQ2_XXS> = (0..nb)
                .map(|_| {
                    let mut b = BlockIQ2_XXS::zeroed();
                    b.d = fp32_to_fp16(0.001 + 0.001 * rng.next_f32());
                    b.qs.iter_mut().for_each(|v| *v = rng.byte());
                    b
                })
                .collect();
            let a: Vec<f32> = (0..nb * QK_K).map(|_| rng.next_f32() * 2.0 - 1.0).collect();
            let mut y = vec![BlockQ8_K::ZERO; nb];
            q8_k::quantize_row_ref(&a, &mut y);
            let mut wx = vec![0.0; nb * QK_K];
            let mut ya = vec![0.0; nb * QK_K];
            dequantize_row(&x, &mut wx);
            q8_k::dequantize_row(&y, &mut ya);
            let want = dot_f64(&wx, &ya);
            let scale: f64 = wx.iter().zip(&ya).map(|(a, b)| (a * b).abs() as f64).sum();
            let tol = (1e-5 * scale) as f32;
            check_close(
                "iq2_xxs·q8_K",
                &[vec_dot_iq2_xxs_q8_K(&x, &y)],
                &[want as f32],
                |_| tol,
            );
        }
    }
}
