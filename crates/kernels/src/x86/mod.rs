//! x86_64 SIMD kernel tiers and their runtime detection.
//!
//! Each tier is a [`Kernels`] table in its own module. A table is handed out
//! only by the detector below, after `is_x86_feature_detected!` has confirmed
//! every feature its functions are compiled for: that check is what makes the
//! `unsafe` calls inside the tables' safe entry points sound.

use crate::Kernels;

/// Calls `$tile::<R, T>$args` for the `R x T` of a register tile of
/// [`crate::fast::gemm_tile_ref`] (`$rows x $toks`, bounded by
/// `crate::fast::check_tile`): each tier's tiles are monomorphized per shape.
macro_rules! dispatch_tile {
    ($tile:ident, $rows:expr, $toks:expr, $args:tt) => {
        $crate::x86::dispatch_tile!(@shapes $tile, $rows, $toks, $args,
            (1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3),
            (3, 1), (3, 2), (3, 3), (4, 1), (4, 2), (4, 3))
    };
    (@shapes $tile:ident, $rows:expr, $toks:expr, $args:tt, $(($r:literal, $t:literal)),*) => {
        match ($rows, $toks) {
            $(($r, $t) => $tile::<$r, $t> $args,)*
            _ => unreachable!("check_tile bounds the tile"),
        }
    };
}
pub(crate) use dispatch_tile;

/// Calls `$kernel::<N>$args` for the run-time chain count `$n` in `1..=$max`
/// (4 or 8; the serial-sum kernels of `crate::serial` keep their chains in
/// registers, one monomorphized loop per count); any other count does
/// nothing: the entry's checks refused it.
macro_rules! dispatch_chains {
    ($kernel:ident, $n:expr, 4, $args:tt) => {
        $crate::x86::dispatch_chains!(@counts $kernel, $n, $args, 1, 2, 3, 4)
    };
    ($kernel:ident, $n:expr, 8, $args:tt) => {
        $crate::x86::dispatch_chains!(@counts $kernel, $n, $args, 1, 2, 3, 4, 5, 6, 7, 8)
    };
    (@counts $kernel:ident, $n:expr, $args:tt, $($k:literal),*) => {
        match $n {
            $($k => $kernel::<$k> $args,)*
            _ => {}
        }
    };
}
pub(crate) use dispatch_chains;

mod avx2;
mod avx512;

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

/// The AVX-512 tier, if this CPU has AVX-512 F, BW, VL and VNNI besides the
/// AVX2 tier's features (Intel Cascade Lake and AMD Zen 4 on).
///
/// The OS must also save the registers' state: `is_x86_feature_detected!`
/// already requires that. std reads XCR0 with `xgetbv` and reports no
/// `avx512*` feature unless the OS enables the opmask, ZMM_Hi256 and Hi16_ZMM
/// state (bits 7:5, mask `0xe0`) besides SSE and AVX (bits 2:1)
/// (`std_detect/src/detect/os/x86.rs`); `tier_parity` checks that claim on the
/// machine it runs on. No AMX bit is consulted: the tier uses no AMX.
pub(crate) fn avx512() -> Option<&'static Kernels> {
    let ok = avx2().is_some()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni");
    ok.then_some(&avx512::KERNELS)
}
