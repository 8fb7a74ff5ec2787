//! x86_64 SIMD kernel tiers and their runtime detection.
//!
//! Each tier is a [`Kernels`] table in its own module. A table is handed out
//! only by the detector below, after `is_x86_feature_detected!` has confirmed
//! every feature its functions are compiled for: that check is what makes the
//! `unsafe` calls inside the tables' safe entry points sound.

use crate::Kernels;

mod avx2;

/// The AVX2 tier, if this CPU has AVX2, FMA and F16C (every AVX2 CPU from
/// Intel Haswell and AMD Zen on). FMA is enabled for the code but never
/// emitted: Rust does not contract a multiply and an add, and the kernels keep
/// them separate so that they stay bit-identical to the scalar references.
pub(crate) fn avx2() -> Option<&'static Kernels> {
    let ok = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    ok.then_some(&avx2::KERNELS)
}
