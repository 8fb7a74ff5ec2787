//! Quantized block formats and their scalar reference kernels.
//!
//! Every format lives in its own module (`q4_0`, `q4_k`, ...) holding the
//! `#[repr(C)]` block exactly as ggml lays it out in `ggml-common.h`, its size
//! assertion, the dequantizer, ggml's reference quantizer and the scalar dot
//! product against the activation format ggml pairs it with. These are the
//! spec: later SIMD kernels are tested against them (exactly for the integer
//! parts, within a bound for float summation).
//!
//! This file is the type-erased front end the engine uses: [`WeightFormat`]
//! (a ggml type id we can run), [`dequantize_row`], [`quantize_row`],
//! [`QuantizedActivations`] and the dot products [`vec_dot`] and
//! [`vec_dot_exact`]; and the kernel table those go through.
//!
//! Kernel tiers: the hot kernels (the Q8_0-activation dot products,
//! [`f32::vec_dot_f32`], Q4_1/Q8_0 dequantization and Q8_0 activation
//! quantization) have SIMD versions (`x86/`). One `Kernels` table is chosen
//! at first use by runtime feature detection, capped by the environment
//! variable `DS4_KERNELS` (`scalar`, `avx2` or `avx512`; read once), and every call goes
//! through it. Every tier is bit-identical to the scalar references, so the
//! choice changes speed only; [`kernel_tier`] names it. The one exception is
//! [`f32::vec_dot_f32_fused`], whose summation order is each tier's own.
//!
//! Conventions shared by all modules:
//! - f16 fields are stored as little-endian `[u8; 2]` so that every weight
//!   block has alignment 1 and can be viewed in place inside an mmap'd GGUF
//!   file at any offset ([`f16::fp16_to_fp32`] reads them).
//! - No FMA contraction: every `a * b + c` is a rounded multiply followed by a
//!   rounded add, as in ggml's generic C built with `-ffp-contract=off`.
//! - Functions taking typed slices (`&[BlockQ4_0]`, `&mut [f32]`) assert that
//!   lengths agree: a mismatch there is a bug in the caller, not bad input.
//!   Untrusted sizes go through the `Result`-returning front end here.

pub mod act16;
pub mod attn;
pub mod bf16;
pub mod f16;
pub mod f32;
pub mod fast;
pub mod huge;
pub mod iq2_xxs;
pub mod matmul;
pub mod pool;
pub mod q2_k;
pub mod q4_0;
pub mod q4_1;
pub mod q4_k;
pub mod q5_0;
pub mod q6_k;
pub mod q8_0;
pub mod q8_k;
pub mod q8_matvec;
pub mod qat;
pub mod serial;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod ggml_parity;
#[cfg(test)]
mod testing;
#[cfg(test)]
mod tier_parity;

use std::sync::OnceLock;

use q8_0::{BlockQ8_0, QK8_0};
use q8_k::BlockQ8_K;

/// Number of weights in a K-quant super-block (ggml `QK_K`).
pub const QK_K: usize = 256;

/// One implementation of every kernel that has SIMD versions: a tier.
/// Each entry computes bit for bit what the scalar reference it names does,
/// with the same length checks (panics).
pub(crate) struct Kernels {
    /// The tier's name, as [`kernel_tier`] reports it and `DS4_KERNELS` takes it.
    pub(crate) tier: &'static str,
    /// Whether [`matmul::WeightMatrix::pack_f2`] keeps Q5_0 blocks as they are (run by
    /// `gemm_q5_0_act16`) rather than as the Q8_0 blocks holding their values
    /// (by `gemm_q8_0_act16`, the same results from 1.55 times the bytes):
    /// each tier takes what runs faster on it.
    pub(crate) q5_0_native: bool,
    /// Whether [`matmul::WeightMatrix::pack_f2`] lays Q4_1, Q5_0 and Q8_0
    /// matrices out in pairs of rows ([`act16::F2Layout::Pairs`], which this
    /// tier's `gemm_q4_1_act16`, `gemm_q5_0_act16` and `gemm_q8_0_act16` read
    /// as well as rows) rather than row after row.
    pub(crate) f2_pairs: bool,
    /// [`q4_0::vec_dot_q4_0_q8_0`].
    pub(crate) vec_dot_q4_0_q8_0: fn(&[q4_0::BlockQ4_0], &[BlockQ8_0]) -> f32,
    /// [`q4_1::vec_dot_q4_1_q8_0`].
    pub(crate) vec_dot_q4_1_q8_0: fn(&[q4_1::BlockQ4_1], &[BlockQ8_0]) -> f32,
    /// [`q5_0::vec_dot_q5_0_q8_0`].
    pub(crate) vec_dot_q5_0_q8_0: fn(&[q5_0::BlockQ5_0], &[BlockQ8_0]) -> f32,
    /// [`q8_0::vec_dot_q8_0_q8_0`].
    pub(crate) vec_dot_q8_0_q8_0: fn(&[BlockQ8_0], &[BlockQ8_0]) -> f32,
    /// [`f32::vec_dot_f32_ref`].
    pub(crate) vec_dot_f32: fn(&[f32], &[f32]) -> f32,
    /// [`f32::vec_dot_f32_fused`]: the one entry that is not bit-identical
    /// across tiers; each tier documents its own fixed order.
    pub(crate) vec_dot_f32_fused: fn(&[f32], &[f32]) -> f32,
    /// [`q4_1::dequantize_row`].
    pub(crate) dequantize_row_q4_1: fn(&[q4_1::BlockQ4_1], &mut [f32]),
    /// [`q8_0::dequantize_row`].
    pub(crate) dequantize_row_q8_0: fn(&[BlockQ8_0], &mut [f32]),
    /// [`q8_0::quantize_row_ref`].
    pub(crate) quantize_row_q8_0: fn(&[f32], &mut [BlockQ8_0]),
    /// [`fast::dot_fma1_ref`].
    pub(crate) dot_fma1: fn(&[f32], &[f32]) -> f32,
    /// [`q8_matvec::matvec_q4_1_q8_0_ref`].
    pub(crate) matvec_q4_1_q8_0: fn(&[q4_1::BlockQ4_1], &[BlockQ8_0], &mut [f32]),
    /// [`q8_matvec::gemm_q4_1_q8_0_ref`].
    pub(crate) gemm_q4_1_q8_0: fn(&[q4_1::BlockQ4_1], &[BlockQ8_0], usize, &mut [f32]),
    /// [`q8_matvec::gemm_q4_1_q8_0_f2_ref`].
    pub(crate) gemm_q4_1_q8_0_f2: fn(act16::F2Rows<'_, q4_1::BlockQ4_1>, &[BlockQ8_0], &mut [f32]),
    /// [`q8_matvec::matvec_q8_0_q8_0_ref`].
    pub(crate) matvec_q8_0_q8_0: fn(&[BlockQ8_0], &[BlockQ8_0], &mut [f32]),
    /// [`fast::gemm_tile_ref`].
    pub(crate) gemm_tile: fn(&[f32], &[f32], usize, &mut [f32]),
    /// [`attn::exp_inplace_ref`].
    pub(crate) exp_inplace: fn(&mut [f32]),
    /// [`attn::attn_group_ref`] over f32 rows.
    pub(crate) attn_group_f32: AttnGroupFn<f32>,
    /// [`attn::attn_group_ref`] over f16 rows.
    pub(crate) attn_group_f16: AttnGroupFn<u16>,
    /// [`attn::widen_f16_ref`].
    pub(crate) widen_f16: fn(&[u16], &mut [f32]),
    /// [`act16::quantize_row_ref`].
    pub(crate) quantize_act16: QuantizeAct16Fn,
    /// [`act16::gemm_q4_1_ref`] on rows packed as [`act16::F2Matrix`].
    pub(crate) gemm_q4_1_act16: GemmF2Fn<q4_1::BlockQ4_1>,
    /// [`act16::gemm_q8_0_ref`] on rows packed as [`act16::F2Matrix`].
    pub(crate) gemm_q8_0_act16: GemmF2Fn<BlockQ8_0>,
    /// [`act16::gemm_q5_0_ref`] on rows packed as [`act16::F2Matrix`].
    pub(crate) gemm_q5_0_act16: GemmF2Fn<q5_0::BlockQ5_0>,
    /// [`act16::gemm_q4_k_ref`] on rows packed as [`act16::F2Matrix`].
    pub(crate) gemm_q4_k_act16: GemmF2Fn<act16::SubQ4K>,
    /// [`act16::gemm_q6_k_ref`] on rows packed as [`act16::F2Matrix`].
    pub(crate) gemm_q6_k_act16: GemmF2Fn<act16::SubQ6K>,
    /// [`q4_k::vec_dot_q4_K_q8_K`].
    pub(crate) vec_dot_q4_k_q8_k: fn(&[q4_k::BlockQ4_K], &[BlockQ8_K]) -> f32,
    /// [`q6_k::vec_dot_q6_K_q8_K`].
    pub(crate) vec_dot_q6_k_q8_k: fn(&[q6_k::BlockQ6_K], &[BlockQ8_K]) -> f32,
    /// [`q4_k::dequantize_row`].
    pub(crate) dequantize_row_q4_k: fn(&[q4_k::BlockQ4_K], &mut [f32]),
    /// [`q6_k::dequantize_row`].
    pub(crate) dequantize_row_q6_k: fn(&[q6_k::BlockQ6_K], &mut [f32]),
    /// [`q4_0::dequantize_row`].
    pub(crate) dequantize_row_q4_0: fn(&[q4_0::BlockQ4_0], &mut [f32]),
    /// [`q5_0::dequantize_row`].
    pub(crate) dequantize_row_q5_0: fn(&[q5_0::BlockQ5_0], &mut [f32]),
    /// [`f16::dequantize_row`].
    pub(crate) dequantize_row_f16: fn(&[u8], &mut [f32]),
    /// [`bf16::dequantize_row`].
    pub(crate) dequantize_row_bf16: fn(&[u8], &mut [f32]),
    /// [`q2_k::vec_dot_q2_K_q8_K`].
    pub(crate) vec_dot_q2_k_q8_k: fn(&[q2_k::BlockQ2_K], &[BlockQ8_K]) -> f32,
    /// [`iq2_xxs::vec_dot_iq2_xxs_q8_K`].
    pub(crate) vec_dot_iq2_xxs_q8_k: fn(&[iq2_xxs::BlockIQ2_XXS], &[BlockQ8_K]) -> f32,
    /// [`iq2_xxs::dot_decoded_q8_K_ref`].
    pub(crate) dot_iq2_decoded_q8_k: fn(&iq2_xxs::Iq2Decoded, &[BlockQ8_K]) -> f32,
    /// [`serial::dot_q8_0x16_f32s_ref`].
    pub(crate) dot_q8_0x16_f32s: DotQ8_0x16Fn,
    /// [`serial::dots_f16x8_serial_ref`].
    pub(crate) dots_f16x8_serial: DotsF16x8Fn,
    /// [`serial::dots8_serial_ref`].
    pub(crate) dots8_serial: Dots8Fn,
    /// [`serial::dots16_serial_ref`].
    pub(crate) dots16_serial: Dots16Fn,
    /// [`serial::wsum16_serial_ref`].
    pub(crate) wsum16_serial: Wsum16Fn,
}

/// The signature of [`serial::dots16_serial_ref`].
#[doc(hidden)]
pub type Dots16Fn = fn(&[f32], &[&[f32]], &mut [[f32; serial::HEADS]]);

/// The signature of [`serial::wsum16_serial_ref`].
#[doc(hidden)]
pub type Wsum16Fn = fn(&[[f32; serial::HEADS]], &[&[f32]], &mut [f32]);

/// The signature of [`serial::dot_q8_0x16_f32s_ref`].
#[doc(hidden)]
pub type DotQ8_0x16Fn = fn(&[u8], &[serial::Q8Row<'_>], &mut [[f32; serial::Q8_ROWS]]);

/// The signature of [`serial::dots_f16x8_serial_ref`].
#[doc(hidden)]
pub type DotsF16x8Fn = fn(&[u16], &[&[f32]], &mut [[f32; serial::LANES]]);

/// The signature of [`serial::dots8_serial_ref`].
#[doc(hidden)]
pub type Dots8Fn = fn(&[f32], &[&[f32]], &mut [[f32; serial::LANES]]);

/// The signature of [`act16::quantize_row`].
#[doc(hidden)]
pub type QuantizeAct16Fn = fn(&[f32], &mut [i16], &mut [f32], &mut [f32]);

/// The signature of [`act16::gemm_q4_1`] on `B` blocks.
#[doc(hidden)]
pub type GemmF2Fn<B> = fn(act16::F2Rows<'_, B>, &act16::Act16, &mut [f32]);

/// The signature of [`attn::attn_group`] on rows of `T`.
#[doc(hidden)]
pub type AttnGroupFn<T> =
    fn(&[f32], &[T], &[T], f32, &mut [attn::Running], &mut [f32], &mut [f32], bool);

/// The scalar references: the lowest tier, available everywhere.
pub(crate) static SCALAR: Kernels = Kernels {
    tier: "scalar",
    q5_0_native: true,
    f2_pairs: false,
    vec_dot_q4_0_q8_0: q4_0::vec_dot_q4_0_q8_0,
    vec_dot_q4_1_q8_0: q4_1::vec_dot_q4_1_q8_0,
    vec_dot_q5_0_q8_0: q5_0::vec_dot_q5_0_q8_0,
    vec_dot_q8_0_q8_0: q8_0::vec_dot_q8_0_q8_0,
    vec_dot_f32: f32::vec_dot_f32_ref,
    vec_dot_f32_fused: f32::vec_dot_f32_ref,
    dequantize_row_q4_1: q4_1::dequantize_row,
    dequantize_row_q8_0: q8_0::dequantize_row,
    quantize_row_q8_0: q8_0::quantize_row_ref,
    dot_fma1: fast::dot_fma1_ref,
    matvec_q4_1_q8_0: q8_matvec::matvec_q4_1_q8_0_ref,
    matvec_q8_0_q8_0: q8_matvec::matvec_q8_0_q8_0_ref,
    gemm_q4_1_q8_0: q8_matvec::gemm_q4_1_q8_0_ref,
    gemm_q4_1_q8_0_f2: q8_matvec::gemm_q4_1_q8_0_f2_ref,
    gemm_tile: fast::gemm_tile_ref,
    exp_inplace: attn::exp_inplace_ref,
    attn_group_f32: attn::attn_group_ref::<f32>,
    attn_group_f16: attn::attn_group_ref::<u16>,
    widen_f16: attn::widen_f16_ref,
    quantize_act16: act16::quantize_row_ref,
    gemm_q4_1_act16: act16::gemm_packed_ref::<q4_1::BlockQ4_1>,
    gemm_q8_0_act16: act16::gemm_packed_ref::<BlockQ8_0>,
    gemm_q5_0_act16: act16::gemm_packed_ref::<q5_0::BlockQ5_0>,
    gemm_q4_k_act16: act16::gemm_packed_ref::<act16::SubQ4K>,
    gemm_q6_k_act16: act16::gemm_packed_ref::<act16::SubQ6K>,
    vec_dot_q4_k_q8_k: q4_k::vec_dot_q4_K_q8_K,
    vec_dot_q6_k_q8_k: q6_k::vec_dot_q6_K_q8_K,
    dequantize_row_q4_k: q4_k::dequantize_row,
    dequantize_row_q6_k: q6_k::dequantize_row,
    dequantize_row_q4_0: q4_0::dequantize_row,
    dequantize_row_q5_0: q5_0::dequantize_row,
    dequantize_row_f16: f16::dequantize_row,
    dequantize_row_bf16: bf16::dequantize_row,
    vec_dot_q2_k_q8_k: q2_k::vec_dot_q2_K_q8_K,
    vec_dot_iq2_xxs_q8_k: iq2_xxs::vec_dot_iq2_xxs_q8_K,
    dot_iq2_decoded_q8_k: iq2_xxs::dot_decoded_q8_K_ref,
    dot_q8_0x16_f32s: serial::dot_q8_0x16_f32s_ref,
    dots_f16x8_serial: serial::dots_f16x8_serial_ref,
    dots8_serial: serial::dots8_serial_ref,
    dots16_serial: serial::dots16_serial_ref,
    wsum16_serial: serial::wsum16_serial_ref,
};

/// [`q2_k::vec_dot_q2_K_q8_K`] by the selected tier.
pub fn vec_dot_q2_k_q8_k(x: &[q2_k::BlockQ2_K], y: &[BlockQ8_K]) -> f32 {
    (kernels().vec_dot_q2_k_q8_k)(x, y)
}

/// [`iq2_xxs::vec_dot_iq2_xxs_q8_K`] by the selected tier.
pub fn vec_dot_iq2_xxs_q8_k(x: &[iq2_xxs::BlockIQ2_XXS], y: &[BlockQ8_K]) -> f32 {
    (kernels().vec_dot_iq2_xxs_q8_k)(x, y)
}

/// Every tier name, lowest first: what `DS4_KERNELS` accepts.
const TIER_NAMES: [&str; 3] = ["scalar", "avx2", "avx512"];

/// The tiers this CPU can run, lowest first (always starts with [`SCALAR`]).
pub(crate) fn available_tiers() -> Vec<&'static Kernels> {
    #[allow(unused_mut)]
    let mut tiers = vec![&SCALAR];
    #[cfg(target_arch = "x86_64")]
    {
        tiers.extend(x86::avx2());
        tiers.extend(x86::avx512());
    }
    tiers
}

/// The highest of `available` (lowest first) that is not above `request`
/// (a `DS4_KERNELS` value; unset or empty means no cap).
fn select_tier(
    request: Option<&str>,
    available: &[&'static Kernels],
) -> Result<&'static Kernels, String> {
    let best = *available
        .last()
        .expect("the scalar tier is always available");
    let Some(request) = request.map(str::trim).filter(|r| !r.is_empty()) else {
        return Ok(best);
    };
    let rank = |name: &str| TIER_NAMES.iter().position(|&t| t == name);
    let Some(cap) = rank(request) else {
        return Err(format!(
            "DS4_KERNELS={request:?} is not a kernel tier; expected one of {}",
            TIER_NAMES.join(", ")
        ));
    };
    Ok(available
        .iter()
        .rev()
        .find(|k| rank(k.tier).is_some_and(|r| r <= cap))
        .copied()
        .unwrap_or(best))
}

/// The kernel table in use, chosen on first call.
///
/// # Panics
/// If `DS4_KERNELS` is set to something other than a tier name.
#[inline]
fn kernels() -> &'static Kernels {
    static SELECTED: OnceLock<&'static Kernels> = OnceLock::new();
    SELECTED.get_or_init(|| requested_tier().unwrap_or_else(|e| panic!("{e}")))
}

/// The tier `DS4_KERNELS` (read now) and the CPU select.
fn requested_tier() -> Result<&'static Kernels, String> {
    let request = std::env::var("DS4_KERNELS").ok();
    select_tier(request.as_deref(), &available_tiers())
}

/// The name of the kernel tier in use: `"avx512"` (AVX-512 F/BW/VL/VNNI,
/// x86_64), `"avx2"` (AVX2 + FMA + F16C, x86_64) or `"scalar"`. The first call
/// picks it: the best the CPU (and OS) support, capped by the environment
/// variable `DS4_KERNELS` (`scalar`, `avx2` or `avx512`) if set. Call it at
/// start-up so that a bad `DS4_KERNELS` fails there.
///
/// # Panics
/// If `DS4_KERNELS` is set to something other than a tier name.
pub fn kernel_tier() -> &'static str {
    kernels().tier
}

/// The kernel tiers this CPU can run, lowest first (`"scalar"` always; the
/// selected one is [`kernel_tier`]).
pub fn available_kernel_tiers() -> Vec<&'static str> {
    available_tiers().iter().map(|k| k.tier).collect()
}

/// The tier [`kernel_tier`] picks or would pick, or why `DS4_KERNELS` names none:
/// a front end calls this first to turn a bad value into a clear error instead
/// of [`kernel_tier`]'s panic.
pub fn requested_kernel_tier() -> Result<&'static str, String> {
    requested_tier().map(|k| k.tier)
}

/// Errors from the type-erased front end. Each names the format and the sizes involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// A row length (in elements) that the format cannot hold.
    #[error("{format}: row length {len} is not a multiple of the block size {block_size}")]
    RowLength {
        format: &'static str,
        len: usize,
        block_size: usize,
    },
    /// A byte buffer that is not a whole number of blocks.
    #[error("{format}: {len} bytes is not a whole number of {block_bytes}-byte blocks")]
    ByteLength {
        format: &'static str,
        len: usize,
        block_bytes: usize,
    },
    /// An encoded row whose byte size does not match its element count.
    #[error("{format}: a row of {n} elements takes {expected} bytes, got {got}")]
    RowBytes {
        format: &'static str,
        n: usize,
        expected: usize,
        got: usize,
    },
    /// A flat activation buffer that is not a whole number of rows.
    #[error("{len} activations are not a whole number of rows of {n}")]
    RowCount { len: usize, n: usize },
}

/// A weight tensor type we can compute with, identified by its ggml type id.
/// Variant names are ggml's (`Q4_K`, not `Q4K`).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q8_0,
    Q4_K,
    Q6_K,
}

impl WeightFormat {
    /// All supported formats, in ggml type id order.
    pub const ALL: [WeightFormat; 9] = [
        WeightFormat::F32,
        WeightFormat::F16,
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q5_0,
        WeightFormat::Q8_0,
        WeightFormat::Q4_K,
        WeightFormat::Q6_K,
        WeightFormat::BF16,
    ];

    /// The format for a ggml type id (`enum ggml_type`), or `None` if we do not support it.
    pub fn from_ggml_type(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            8 => Self::Q8_0,
            12 => Self::Q4_K,
            14 => Self::Q6_K,
            30 => Self::BF16,
            _ => return None,
        })
    }

    /// The ggml type id.
    pub fn ggml_type(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q8_0 => 8,
            Self::Q4_K => 12,
            Self::Q6_K => 14,
            Self::BF16 => 30,
        }
    }

    /// ggml's type name (`ggml_type_name`): "f32", "q4_0", "q4_K", ...
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::BF16 => "bf16",
            Self::Q4_0 => "q4_0",
            Self::Q4_1 => "q4_1",
            Self::Q5_0 => "q5_0",
            Self::Q8_0 => "q8_0",
            Self::Q4_K => "q4_K",
            Self::Q6_K => "q6_K",
        }
    }

    /// Elements per block (1 for the float formats).
    pub fn block_size(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 => q4_0::QK4_0,
            Self::Q4_1 => q4_1::QK4_1,
            Self::Q5_0 => q5_0::QK5_0,
            Self::Q8_0 => QK8_0,
            Self::Q4_K | Self::Q6_K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => size_of::<q4_0::BlockQ4_0>(),
            Self::Q4_1 => size_of::<q4_1::BlockQ4_1>(),
            Self::Q5_0 => size_of::<q5_0::BlockQ5_0>(),
            Self::Q8_0 => size_of::<BlockQ8_0>(),
            Self::Q4_K => size_of::<q4_k::BlockQ4_K>(),
            Self::Q6_K => size_of::<q6_k::BlockQ6_K>(),
        }
    }

    /// Bytes taken by a row of `n` elements; `None` if `n` is not a multiple
    /// of the block size (or the size overflows).
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        let bs = self.block_size();
        if !n.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(self.block_bytes())
    }

    /// The activation format [`vec_dot`] pairs with this weight format.
    pub fn activation_format(self) -> ActivationFormat {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => ActivationFormat::F32,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q8_0 => ActivationFormat::Q8_0,
            Self::Q4_K | Self::Q6_K => ActivationFormat::Q8_K,
        }
    }

    fn check_row(self, n: usize, row_len: usize) -> Result<(), KernelError> {
        let Some(expected) = self.row_bytes(n) else {
            return Err(KernelError::RowLength {
                format: self.name(),
                len: n,
                block_size: self.block_size(),
            });
        };
        if row_len != expected {
            return Err(KernelError::RowBytes {
                format: self.name(),
                n,
                expected,
                got: row_len,
            });
        }
        Ok(())
    }
}

/// The format activations are converted to before a dot product with weights.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActivationFormat {
    F32,
    Q8_0,
    Q8_K,
}

impl ActivationFormat {
    /// Elements per block.
    pub fn block_size(self) -> usize {
        match self {
            Self::F32 => 1,
            Self::Q8_0 => QK8_0,
            Self::Q8_K => QK_K,
        }
    }

    /// ggml's type name.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Q8_0 => "q8_0",
            Self::Q8_K => "q8_K",
        }
    }
}

/// Decodes one encoded row of `out.len()` elements into f32, exactly as ggml's
/// `dequantize_row_*` does. `row` may sit at any byte offset (an mmap'd file).
pub fn dequantize_row(fmt: WeightFormat, row: &[u8], out: &mut [f32]) -> Result<(), KernelError> {
    fmt.check_row(out.len(), row.len())?;
    match fmt {
        WeightFormat::F32 => f32::dequantize_row(row, out),
        WeightFormat::F16 => (kernels().dequantize_row_f16)(row, out),
        WeightFormat::BF16 => (kernels().dequantize_row_bf16)(row, out),
        WeightFormat::Q4_0 => (kernels().dequantize_row_q4_0)(q4_0::blocks(row)?, out),
        WeightFormat::Q4_1 => (kernels().dequantize_row_q4_1)(q4_1::blocks(row)?, out),
        WeightFormat::Q5_0 => (kernels().dequantize_row_q5_0)(q5_0::blocks(row)?, out),
        WeightFormat::Q8_0 => (kernels().dequantize_row_q8_0)(q8_0::blocks(row)?, out),
        WeightFormat::Q4_K => (kernels().dequantize_row_q4_k)(q4_k::blocks(row)?, out),
        WeightFormat::Q6_K => (kernels().dequantize_row_q6_k)(q6_k::blocks(row)?, out),
    }
    Ok(())
}

/// Encodes one row `x` into `out` with ggml's reference quantizer
/// (`quantize_row_*_ref`); for the float formats this is a plain conversion.
/// Used to build test weights and model files.
pub fn quantize_row(fmt: WeightFormat, x: &[f32], out: &mut [u8]) -> Result<(), KernelError> {
    fmt.check_row(x.len(), out.len())?;
    match fmt {
        WeightFormat::F32 => f32::quantize_row_ref(x, out),
        WeightFormat::F16 => f16::quantize_row_ref(x, out),
        WeightFormat::BF16 => bf16::quantize_row_ref(x, out),
        WeightFormat::Q4_0 => q4_0::quantize_row_ref(x, cast_blocks_mut(out)),
        WeightFormat::Q4_1 => q4_1::quantize_row_ref(x, cast_blocks_mut(out)),
        WeightFormat::Q5_0 => q5_0::quantize_row_ref(x, cast_blocks_mut(out)),
        WeightFormat::Q8_0 => q8_0::quantize_row_ref(x, cast_blocks_mut(out)),
        WeightFormat::Q4_K => q4_k::quantize_row_ref(x, cast_blocks_mut(out)),
        WeightFormat::Q6_K => q6_k::quantize_row_ref(x, cast_blocks_mut(out)),
    }
    Ok(())
}

/// Views `bytes` as weight blocks. Only for alignment-1 blocks, so the one
/// possible failure is a length that is not a whole number of blocks.
fn cast_blocks<'a, T: bytemuck::Pod>(
    format: &'static str,
    bytes: &'a [u8],
) -> Result<&'a [T], KernelError> {
    const { assert!(align_of::<T>() == 1) };
    bytemuck::try_cast_slice(bytes).map_err(|_| KernelError::ByteLength {
        format,
        len: bytes.len(),
        block_bytes: size_of::<T>(),
    })
}

/// Mutable [`cast_blocks`] for a buffer whose length the caller has checked.
fn cast_blocks_mut<T: bytemuck::Pod>(bytes: &mut [u8]) -> &mut [T] {
    const { assert!(align_of::<T>() == 1) };
    bytemuck::cast_slice_mut(bytes)
}

/// ggml's `nearest_int`: round to nearest, ties to even, via the 1.5·2^23
/// trick. Valid for |x| <= 4194303 (ggml asserts this in debug builds); the
/// result for larger inputs is garbage in both implementations, never UB here.
#[inline]
pub(crate) fn nearest_int(fval: f32) -> i32 {
    let val = fval + 12_582_912.0;
    let i = val.to_bits() as i32;
    (i & 0x007f_ffff) - 0x0040_0000
}

/// Activations for one or more rows of length `n`, converted to the format a
/// weight format's dot product consumes.
///
/// Allocate once (e.g. with [`QuantizedActivations::new`] sized for the
/// largest batch), then call [`requantize`](Self::requantize) each step:
/// it reuses the buffer and does not allocate while capacity suffices.
#[derive(Clone, Debug)]
pub struct QuantizedActivations {
    n: usize,
    rows: usize,
    data: ActivationData,
}

#[allow(non_camel_case_types)]
#[derive(Clone, Debug)]
enum ActivationData {
    F32(Vec<f32>),
    Q8_0(Vec<BlockQ8_0>),
    Q8_K(Vec<BlockQ8_K>),
}

/// One row of [`QuantizedActivations`], as [`vec_dot`] takes it.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug)]
pub enum ActivationRow<'a> {
    F32(&'a [f32]),
    Q8_0(&'a [BlockQ8_0]),
    Q8_K(&'a [BlockQ8_K]),
}

impl ActivationRow<'_> {
    /// The format of this row.
    pub fn format(&self) -> ActivationFormat {
        match self {
            Self::F32(_) => ActivationFormat::F32,
            Self::Q8_0(_) => ActivationFormat::Q8_0,
            Self::Q8_K(_) => ActivationFormat::Q8_K,
        }
    }

    /// Number of elements in the row.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(x) => x.len(),
            Self::Q8_0(b) => b.len() * QK8_0,
            Self::Q8_K(b) => b.len() * QK_K,
        }
    }

    /// Whether the row has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl QuantizedActivations {
    /// An empty buffer of `format` with room for `max_elements` activations
    /// (rows × row length) before [`requantize`](Self::requantize) allocates.
    pub fn new(format: ActivationFormat, max_elements: usize) -> Self {
        let blocks = max_elements.div_ceil(format.block_size());
        let data = match format {
            ActivationFormat::F32 => ActivationData::F32(Vec::with_capacity(max_elements)),
            ActivationFormat::Q8_0 => ActivationData::Q8_0(Vec::with_capacity(blocks)),
            ActivationFormat::Q8_K => ActivationData::Q8_K(Vec::with_capacity(blocks)),
        };
        Self {
            n: 0,
            rows: 0,
            data,
        }
    }

    /// Converts `x`, holding `x.len() / n` consecutive rows of length `n`.
    pub fn quantize(format: ActivationFormat, x: &[f32], n: usize) -> Result<Self, KernelError> {
        let mut a = Self::new(format, x.len());
        a.requantize(x, n)?;
        Ok(a)
    }

    /// Refills with new activations (same format), reusing the buffer.
    /// On error the previous contents are kept.
    pub fn requantize(&mut self, x: &[f32], n: usize) -> Result<(), KernelError> {
        let format = self.format();
        let block_size = format.block_size();
        if n == 0 || !n.is_multiple_of(block_size) {
            return Err(KernelError::RowLength {
                format: format.name(),
                len: n,
                block_size,
            });
        }
        if !x.len().is_multiple_of(n) {
            return Err(KernelError::RowCount { len: x.len(), n });
        }
        match &mut self.data {
            ActivationData::F32(v) => {
                v.clear();
                v.extend_from_slice(x);
            }
            ActivationData::Q8_0(v) => {
                v.clear();
                v.resize(x.len() / QK8_0, BlockQ8_0::ZERO);
                (kernels().quantize_row_q8_0)(x, v);
            }
            ActivationData::Q8_K(v) => {
                v.clear();
                v.resize(x.len() / QK_K, BlockQ8_K::ZERO);
                q8_k::quantize_row_ref(x, v);
            }
        }
        self.n = n;
        self.rows = x.len() / n;
        Ok(())
    }

    /// The activation format.
    pub fn format(&self) -> ActivationFormat {
        match self.data {
            ActivationData::F32(_) => ActivationFormat::F32,
            ActivationData::Q8_0(_) => ActivationFormat::Q8_0,
            ActivationData::Q8_K(_) => ActivationFormat::Q8_K,
        }
    }

    /// Row length in elements (0 before the first fill).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Number of rows held.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Every row's blocks back to back, for Q8_0 activations.
    pub fn q8_0_blocks(&self) -> Option<&[BlockQ8_0]> {
        match &self.data {
            ActivationData::Q8_0(v) => Some(&v[..self.rows * (self.n / QK8_0)]),
            _ => None,
        }
    }

    /// Row `i`.
    ///
    /// # Panics
    /// If `i >= self.rows()`, like slice indexing.
    pub fn row(&self, i: usize) -> ActivationRow<'_> {
        assert!(
            i < self.rows,
            "activation row {i} out of range ({} rows)",
            self.rows
        );
        match &self.data {
            ActivationData::F32(v) => ActivationRow::F32(&v[i * self.n..(i + 1) * self.n]),
            ActivationData::Q8_0(v) => {
                let nb = self.n / QK8_0;
                ActivationRow::Q8_0(&v[i * nb..(i + 1) * nb])
            }
            ActivationData::Q8_K(v) => {
                let nb = self.n / QK_K;
                ActivationRow::Q8_K(&v[i * nb..(i + 1) * nb])
            }
        }
    }

    #[cfg(test)]
    fn buffer_ptr(&self) -> *const u8 {
        match &self.data {
            ActivationData::F32(v) => v.as_ptr().cast(),
            ActivationData::Q8_0(v) => v.as_ptr().cast(),
            ActivationData::Q8_K(v) => v.as_ptr().cast(),
        }
    }
}

/// Dot product of one encoded weight row of `n` elements with one activation
/// row in `fmt.activation_format()`: the per-format kernel of the selected
/// tier, bit-identical to the scalar reference (`q4_0::vec_dot_q4_0_q8_0`, ...).
///
/// # Panics
/// If the activation format is not `fmt.activation_format()`, or `w_row` /
/// `act` do not hold exactly `n` elements. Shapes are validated when a model
/// is loaded; a mismatch here is a bug.
pub fn vec_dot(fmt: WeightFormat, n: usize, w_row: &[u8], act: ActivationRow<'_>) -> f32 {
    assert_eq!(
        fmt.row_bytes(n),
        Some(w_row.len()),
        "{}: weight row of {} bytes does not hold {n} elements",
        fmt.name(),
        w_row.len()
    );
    assert_eq!(act.len(), n, "{}: activation row length", fmt.name());
    match (fmt, act) {
        (WeightFormat::F32, ActivationRow::F32(y)) => f32::vec_dot_f32_le(w_row, y),
        (WeightFormat::F16, ActivationRow::F32(y)) => f16::vec_dot_f16_f32(w_row, y),
        (WeightFormat::BF16, ActivationRow::F32(y)) => bf16::vec_dot_bf16_f32(w_row, y),
        (WeightFormat::Q4_0, ActivationRow::Q8_0(y)) => {
            (kernels().vec_dot_q4_0_q8_0)(cast_checked(w_row), y)
        }
        (WeightFormat::Q4_1, ActivationRow::Q8_0(y)) => {
            (kernels().vec_dot_q4_1_q8_0)(cast_checked(w_row), y)
        }
        (WeightFormat::Q5_0, ActivationRow::Q8_0(y)) => {
            (kernels().vec_dot_q5_0_q8_0)(cast_checked(w_row), y)
        }
        (WeightFormat::Q8_0, ActivationRow::Q8_0(y)) => {
            (kernels().vec_dot_q8_0_q8_0)(cast_checked(w_row), y)
        }
        (WeightFormat::Q4_K, ActivationRow::Q8_K(y)) => {
            (kernels().vec_dot_q4_k_q8_k)(cast_checked(w_row), y)
        }
        (WeightFormat::Q6_K, ActivationRow::Q8_K(y)) => {
            (kernels().vec_dot_q6_k_q8_k)(cast_checked(w_row), y)
        }
        (fmt, act) => panic!(
            "{} weights take {} activations, got {}",
            fmt.name(),
            fmt.activation_format().name(),
            act.format().name()
        ),
    }
}

/// `out[r] = vec_dot(fmt, n, row r of w_rows, act)` for the `out.len()` rows of
/// `w_rows` (back to back), bit for bit: Q4_1 and Q8_0 rows go through the
/// multi-row kernels of [`q8_matvec`], which share each activation block between
/// rows; other formats through [`vec_dot`] row by row.
///
/// # Panics
/// If `w_rows` does not hold `out.len()` rows of `n` elements of `fmt`, or `act`
/// is not `n` elements of `fmt.activation_format()`.
pub fn vec_dot_rows(
    fmt: WeightFormat,
    n: usize,
    w_rows: &[u8],
    act: ActivationRow<'_>,
    out: &mut [f32],
) {
    let row_bytes = fmt.row_bytes(n);
    assert!(
        row_bytes.and_then(|b| b.checked_mul(out.len())) == Some(w_rows.len()),
        "{}: {} weight bytes do not hold {} rows of {n} elements",
        fmt.name(),
        w_rows.len(),
        out.len()
    );
    match (fmt, act) {
        (WeightFormat::Q4_1, ActivationRow::Q8_0(y)) if y.len() * QK8_0 == n => {
            (kernels().matvec_q4_1_q8_0)(cast_checked(w_rows), y, out)
        }
        (WeightFormat::Q8_0, ActivationRow::Q8_0(y)) if y.len() * QK8_0 == n => {
            (kernels().matvec_q8_0_q8_0)(cast_checked(w_rows), y, out)
        }
        _ => {
            let rb = row_bytes.unwrap_or(0);
            for (r, o) in out.iter_mut().enumerate() {
                *o = vec_dot(fmt, n, &w_rows[r * rb..(r + 1) * rb], act);
            }
        }
    }
}

/// [`cast_blocks`] for a row whose length the caller has already asserted.
fn cast_checked<T: bytemuck::Pod>(bytes: &[u8]) -> &[T] {
    const { assert!(align_of::<T>() == 1) };
    bytemuck::cast_slice(bytes)
}

/// The exact path: dequantizes the weight row into `scratch[..x.len()]` and
/// dots it with unquantized activations `x` using [`f32::vec_dot_f32`]
/// (8 lanes, fixed summation order). No activation rounding at all; slower
/// than [`vec_dot`], used where accuracy matters more than speed.
///
/// # Panics
/// If `w_row` does not hold `x.len()` elements of `fmt`, or `scratch` is
/// shorter than `x`.
pub fn vec_dot_exact(fmt: WeightFormat, w_row: &[u8], x: &[f32], scratch: &mut [f32]) -> f32 {
    let n = x.len();
    assert!(
        scratch.len() >= n,
        "scratch holds {} floats, need {n}",
        scratch.len()
    );
    let w = &mut scratch[..n];
    if let Err(e) = dequantize_row(fmt, w_row, w) {
        panic!("vec_dot_exact: {e}");
    }
    f32::vec_dot_f32(w, x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{dot_f64, XorShift};

    #[test]
    fn ggml_type_ids_round_trip_and_unknown_ids_are_rejected() {
        for fmt in WeightFormat::ALL {
            assert_eq!(WeightFormat::from_ggml_type(fmt.ggml_type()), Some(fmt));
        }
        // Q5_1, Q8_1, Q2_K, Q3_K, Q5_K, Q8_K, IQ types, out of range.
        for id in [7, 9, 10, 11, 13, 15, 16, 29, 31, 1000] {
            assert_eq!(WeightFormat::from_ggml_type(id), None, "id {id}");
        }
        let names: Vec<_> = WeightFormat::ALL.iter().map(|f| f.name()).collect();
        assert_eq!(
            names,
            ["f32", "f16", "q4_0", "q4_1", "q5_0", "q8_0", "q4_K", "q6_K", "bf16"]
        );
    }

    #[test]
    fn block_sizes_and_row_bytes_match_ggml() {
        // (format, block size, block bytes) from ggml's type_traits.
        let table = [
            (WeightFormat::F32, 1, 4),
            (WeightFormat::F16, 1, 2),
            (WeightFormat::BF16, 1, 2),
            (WeightFormat::Q4_0, 32, 18),
            (WeightFormat::Q4_1, 32, 20),
            (WeightFormat::Q5_0, 32, 22),
            (WeightFormat::Q8_0, 32, 34),
            (WeightFormat::Q4_K, 256, 144),
            (WeightFormat::Q6_K, 256, 210),
        ];
        for (fmt, bs, bb) in table {
            assert_eq!(fmt.block_size(), bs, "{}", fmt.name());
            assert_eq!(fmt.block_bytes(), bb, "{}", fmt.name());
            assert_eq!(fmt.row_bytes(4096), Some(4096 / bs * bb), "{}", fmt.name());
            assert_eq!(fmt.row_bytes(0), Some(0));
            if bs > 1 {
                assert_eq!(fmt.row_bytes(bs + 1), None, "{}", fmt.name());
            }
        }
        assert_eq!(WeightFormat::F32.row_bytes(usize::MAX), None);
    }

    #[test]
    fn dequantize_row_reports_bad_lengths() {
        let mut out = vec![0.0; 33];
        assert_eq!(
            dequantize_row(WeightFormat::Q4_0, &[0; 18], &mut out),
            Err(KernelError::RowLength {
                format: "q4_0",
                len: 33,
                block_size: 32
            })
        );
        let mut out = vec![0.0; 64];
        let err = dequantize_row(WeightFormat::Q4_0, &[0; 35], &mut out).unwrap_err();
        assert_eq!(
            err,
            KernelError::RowBytes {
                format: "q4_0",
                n: 64,
                expected: 36,
                got: 35
            }
        );
        assert_eq!(
            err.to_string(),
            "q4_0: a row of 64 elements takes 36 bytes, got 35"
        );
        let mut out = vec![0.0; 3];
        assert!(dequantize_row(WeightFormat::F16, &[0; 7], &mut out).is_err());
        assert!(quantize_row(WeightFormat::Q6_K, &[0.0; 256], &mut [0; 209]).is_err());
    }

    /// Weights at an odd offset in a larger buffer (as in an mmap'd file) decode
    /// exactly like the same bytes at offset 0.
    #[test]
    fn unaligned_rows_decode_like_aligned_ones() {
        let mut rng = XorShift::new(7);
        let n = 512;
        let x = rng.vec_uniform(n, -1.0, 1.0);
        for fmt in WeightFormat::ALL {
            let bytes = fmt.row_bytes(n).unwrap();
            let mut buf = vec![0u8; bytes + 3];
            quantize_row(fmt, &x, &mut buf[..bytes]).unwrap();
            let mut want = vec![0.0; n];
            dequantize_row(fmt, &buf[..bytes], &mut want).unwrap();
            buf.copy_within(0..bytes, 1);
            let mut got = vec![0.0; n];
            dequantize_row(fmt, &buf[1..1 + bytes], &mut got).unwrap();
            assert_eq!(got, want, "{}", fmt.name());
        }
    }

    #[test]
    fn nearest_int_rounds_half_to_even_like_ggml() {
        let cases = [
            (0.0, 0),
            (0.4999, 0),
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (-2.5, -2),
            (7.49, 7),
            (-7.51, -8),
            (4_194_303.0, 4_194_303),
            (-4_194_303.0, -4_194_303),
        ];
        for (x, want) in cases {
            assert_eq!(nearest_int(x), want, "nearest_int({x})");
        }
    }

    #[test]
    fn activations_hold_rows_that_match_single_row_quantization() {
        let mut rng = XorShift::new(11);
        let n = 512;
        let x = rng.vec_uniform(3 * n, -2.0, 2.0);
        for format in [
            ActivationFormat::F32,
            ActivationFormat::Q8_0,
            ActivationFormat::Q8_K,
        ] {
            let all = QuantizedActivations::quantize(format, &x, n).unwrap();
            assert_eq!((all.rows(), all.n(), all.format()), (3, n, format));
            for i in 0..3 {
                let one =
                    QuantizedActivations::quantize(format, &x[i * n..(i + 1) * n], n).unwrap();
                match (all.row(i), one.row(0)) {
                    (ActivationRow::F32(a), ActivationRow::F32(b)) => assert_eq!(a, b),
                    (ActivationRow::Q8_0(a), ActivationRow::Q8_0(b)) => assert_eq!(a, b),
                    (ActivationRow::Q8_K(a), ActivationRow::Q8_K(b)) => assert_eq!(a, b),
                    _ => panic!("row format changed"),
                }
                assert_eq!(all.row(i).len(), n);
            }
        }
    }

    #[test]
    fn requantize_reuses_the_buffer_and_rejects_bad_shapes() {
        let mut rng = XorShift::new(12);
        let x = rng.vec_uniform(4 * 256, -1.0, 1.0);
        for format in [
            ActivationFormat::F32,
            ActivationFormat::Q8_0,
            ActivationFormat::Q8_K,
        ] {
            let mut a = QuantizedActivations::new(format, 4 * 256);
            a.requantize(&x, 256).unwrap();
            let ptr = a.buffer_ptr();
            a.requantize(&x[..512], 256).unwrap();
            assert_eq!(a.rows(), 2);
            a.requantize(&x, 512).unwrap();
            assert_eq!((a.rows(), a.n()), (2, 512));
            assert_eq!(a.buffer_ptr(), ptr, "{format:?} reallocated");
            // Errors leave the previous contents in place.
            assert_eq!(
                a.requantize(&x[..300], 256),
                Err(KernelError::RowCount { len: 300, n: 256 })
            );
            assert!(a.requantize(&x, 0).is_err());
            assert_eq!((a.rows(), a.n()), (2, 512));
        }
        let mut a = QuantizedActivations::new(ActivationFormat::Q8_K, 0);
        assert_eq!(
            a.requantize(&x[..96], 96),
            Err(KernelError::RowLength {
                format: "q8_K",
                len: 96,
                block_size: 256
            })
        );
    }

    /// vec_dot for every format agrees with an f64 dot of what the kernel
    /// actually sees (dequantized weights × dequantized activations).
    #[test]
    fn vec_dot_matches_f64_dot_of_dequantized_operands() {
        let mut rng = XorShift::new(13);
        let n = 1024;
        for fmt in WeightFormat::ALL {
            let w = rng.vec_uniform(n, -1.0, 1.0);
            let x = rng.vec_uniform(n, -3.0, 3.0);
            let mut row = vec![0u8; fmt.row_bytes(n).unwrap()];
            quantize_row(fmt, &w, &mut row).unwrap();
            let mut wd = vec![0.0; n];
            dequantize_row(fmt, &row, &mut wd).unwrap();
            let act = QuantizedActivations::quantize(fmt.activation_format(), &x, n).unwrap();
            let xd: Vec<f32> = match act.row(0) {
                ActivationRow::F32(v) => v.to_vec(),
                ActivationRow::Q8_0(b) => {
                    let mut v = vec![0.0; n];
                    q8_0::dequantize_row(b, &mut v);
                    v
                }
                ActivationRow::Q8_K(b) => {
                    let mut v = vec![0.0; n];
                    q8_k::dequantize_row(b, &mut v);
                    v
                }
            };
            let got = vec_dot(fmt, n, &row, act.row(0)) as f64;
            let want = dot_f64(&wd, &xd);
            let scale: f64 = wd.iter().zip(&xd).map(|(a, b)| (a * b).abs() as f64).sum();
            assert!(
                (got - want).abs() <= 1e-6 * scale,
                "{}: got {got}, want {want} (scale {scale})",
                fmt.name()
            );
        }
    }

    #[test]
    fn vec_dot_exact_matches_f64_dot_with_unquantized_activations() {
        let mut rng = XorShift::new(14);
        let n = 768;
        let mut scratch = vec![0.0; 1024];
        for fmt in WeightFormat::ALL {
            let w = rng.vec_uniform(n, -1.0, 1.0);
            let x = rng.vec_uniform(n, -3.0, 3.0);
            let mut row = vec![0u8; fmt.row_bytes(n).unwrap()];
            quantize_row(fmt, &w, &mut row).unwrap();
            let mut wd = vec![0.0; n];
            dequantize_row(fmt, &row, &mut wd).unwrap();
            let got = vec_dot_exact(fmt, &row, &x, &mut scratch) as f64;
            let want = dot_f64(&wd, &x);
            let scale: f64 = wd.iter().zip(&x).map(|(a, b)| (a * b).abs() as f64).sum();
            assert!(
                (got - want).abs() <= 1e-6 * scale,
                "{}: got {got}, want {want}",
                fmt.name()
            );
            // And it is the documented composition, bit for bit.
            assert_eq!(got as f32, f32::vec_dot_f32(&wd, &x), "{}", fmt.name());
        }
    }

    #[test]
    #[should_panic(expected = "q4_K weights take q8_K activations, got q8_0")]
    fn vec_dot_rejects_the_wrong_activation_format() {
        let row = vec![0u8; 144];
        let act = QuantizedActivations::quantize(ActivationFormat::Q8_0, &[0.0; 256], 256).unwrap();
        vec_dot(WeightFormat::Q4_K, 256, &row, act.row(0));
    }

    #[test]
    #[should_panic(expected = "does not hold 64 elements")]
    fn vec_dot_rejects_a_short_weight_row() {
        let act = QuantizedActivations::quantize(ActivationFormat::Q8_0, &[0.0; 64], 64).unwrap();
        vec_dot(WeightFormat::Q8_0, 64, &[0u8; 34], act.row(0));
    }
}
