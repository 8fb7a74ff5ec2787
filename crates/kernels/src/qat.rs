//! DeepSeek V4's quantization-aware-training round trips, as its reference
//! engine simulates them on the CPU (scalar; they run once per stored row).
//!
//! - [`fp8_kv_round_trip`]: the non-rotary dims of a K/V row through FP8
//!   E4M3FN in blocks of 64, each block scaled by a power of two so that its
//!   largest magnitude fits 448 (`dsv4_fp8_kv_quantize_row_inplace_cpu`).
//! - [`indexer_round_trip`]: a 128-wide indexer row through an unnormalized
//!   Walsh–Hadamard transform times `1/sqrt(128)`, then FP4 E2M1 in blocks of
//!   32 scaled to a largest magnitude of 6 (`dsv4_indexer_qat_row_inplace_cpu`).
//!
//! Nearest values are found the way the reference finds them (the largest
//! code not above the magnitude, then the next one if it is nearer, ties to
//! the even code), so the results are its bits. Scales come from `log2f`,
//! which is the platform's, as in the reference.

/// FP8 E4M3FN: values per scaled block.
pub const FP8_BLOCK: usize = 64;
/// FP8 E4M3FN: largest finite magnitude.
pub const FP8_MAX: f32 = 448.0;
/// FP4 E2M1: values per scaled block.
pub const FP4_BLOCK: usize = 32;
/// FP4 E2M1: largest magnitude.
pub const FP4_MAX: f32 = 6.0;
/// Width of the indexer rows the Hadamard transform runs over.
pub const HADAMARD_N: usize = 128;
/// `1/sqrt(128)`, written as the reference writes it.
#[allow(clippy::excessive_precision)]
const HADAMARD_SCALE: f32 = 0.088_388_347_648_318_45;
/// The smallest FP4 block maximum (`6·2^-126`), written as the reference writes it.
#[allow(clippy::excessive_precision)]
const FP4_AMAX_FLOOR: f32 = 7.052_966_104_933_725e-38;

/// The E4M3FN magnitude of code `i` (0..=126): `m·2^-9` for exponent 0, else
/// `(1 + m/8)·2^(e-7)`.
fn e4m3fn_value(i: usize) -> f32 {
    let (e, m) = ((i >> 3) & 15, (i & 7) as f32);
    if e == 0 {
        m * 0.001_953_125
    } else {
        (1.0 + m * 0.125) * pow2(e as i32 - 7)
    }
}

/// The magnitudes of codes 0..=126, for the nearest-value search.
fn e4m3fn_table() -> &'static [f32; 127] {
    static T: std::sync::OnceLock<[f32; 127]> = std::sync::OnceLock::new();
    T.get_or_init(|| std::array::from_fn(e4m3fn_value))
}

/// `x` (already clamped to ±448 by the caller's scaling) to the nearest E4M3FN value.
fn e4m3fn_nearest(x: f32) -> f32 {
    let value = |i: usize| e4m3fn_table()[i];
    let sign = if x < 0.0 { -1.0 } else { 1.0 };
    let ax = x.abs().min(FP8_MAX);
    let (mut lo, mut hi) = (0usize, 126usize);
    while lo < hi {
        let mid = (lo + hi + 1) >> 1;
        if value(mid) <= ax {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let mut best = lo;
    if best < 126 {
        let best_diff = (ax - value(best)).abs();
        let next_diff = (ax - value(best + 1)).abs();
        if next_diff < best_diff || (next_diff == best_diff && (best + 1) % 2 == 0 && best % 2 == 1)
        {
            best += 1;
        }
    }
    sign * value(best)
}

const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// `x` to the nearest E2M1 value (ties to the even code).
fn e2m1_nearest(x: f32) -> f32 {
    let sign = if x < 0.0 { -1.0 } else { 1.0 };
    let ax = x.abs().min(FP4_MAX);
    let mut best = 0;
    let mut best_diff = ax;
    for (i, &v) in E2M1_VALUES.iter().enumerate().skip(1) {
        let diff = (ax - v).abs();
        if diff < best_diff || (diff == best_diff && i % 2 == 0 && best % 2 == 1) {
            best = i;
            best_diff = diff;
        }
    }
    sign * E2M1_VALUES[best]
}

/// `2^k` (exact; `ldexpf(1, k)`), built from its bits in the normal range.
fn pow2(k: i32) -> f32 {
    if (-126..=127).contains(&k) {
        f32::from_bits(((k + 127) as u32) << 23)
    } else {
        2f64.powi(k) as f32
    }
}

/// One block through a scaled float format: `S = 2^ceil(log2(amax/max))`
/// with `amax` at least `floor`, every value `nearest(clamp(x/S)) · S`.
fn round_trip_block(x: &mut [f32], floor: f32, max: f32, nearest: fn(f32) -> f32) {
    let amax = x
        .iter()
        .fold(0.0f32, |m, v| if v.abs() > m { v.abs() } else { m });
    let scale = pow2((amax.max(floor) / max).log2().ceil() as i32);
    for v in x {
        *v = nearest((*v / scale).clamp(-max, max)) * scale;
    }
}

/// The FP8 round trip of a K/V row's first `row.len() - n_rot` dims (a
/// multiple of 64), in blocks of 64; the rotary tail is untouched.
///
/// # Panics
/// If the non-rotary part is not a whole number of blocks.
pub fn fp8_kv_round_trip(row: &mut [f32], n_rot: usize) {
    let n_nope = row.len() - n_rot;
    assert!(
        n_nope.is_multiple_of(FP8_BLOCK),
        "fp8 round trip: {n_nope} dims"
    );
    for block in row[..n_nope].chunks_exact_mut(FP8_BLOCK) {
        round_trip_block(block, 1.0e-4, FP8_MAX, e4m3fn_nearest);
    }
}

/// The unnormalized Walsh–Hadamard butterflies (strides 1, 2, ..., 64:
/// `(a, b) -> (a + b, a - b)`) of a 128-wide row, then every value times
/// `1/sqrt(128)` rounded to f32.
///
/// # Panics
/// If the row is not 128 wide.
pub fn hadamard128(x: &mut [f32]) {
    assert_eq!(x.len(), HADAMARD_N, "hadamard128 width");
    let mut stride = 1;
    while stride < HADAMARD_N {
        for base in (0..HADAMARD_N).step_by(2 * stride) {
            for i in base..base + stride {
                let (a, b) = (x[i], x[i + stride]);
                x[i] = a + b;
                x[i + stride] = a - b;
            }
        }
        stride <<= 1;
    }
    x.iter_mut().for_each(|v| *v *= HADAMARD_SCALE);
}

/// The indexer's round trip of one 128-wide row: [`hadamard128`], then FP4
/// E2M1 in blocks of 32.
///
/// # Panics
/// If the row is not 128 wide.
pub fn indexer_round_trip(x: &mut [f32]) {
    hadamard128(x);
    for block in x.chunks_exact_mut(FP4_BLOCK) {
        round_trip_block(block, FP4_AMAX_FLOOR, FP4_MAX, e2m1_nearest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3fn_codes_and_ties() {
        assert_eq!(e4m3fn_value(126), 448.0);
        assert_eq!(e4m3fn_value(8), 2f32.powi(-6));
        assert_eq!(e4m3fn_value(7), 7.0 * 2f32.powi(-9));
        // 1.0625 lies halfway between 1.0 (code 56) and 1.125 (code 57): even code.
        assert_eq!(e4m3fn_nearest(1.0625), 1.0);
        // 1.1875 lies halfway between 1.125 (57) and 1.25 (58): even code 58.
        assert_eq!(e4m3fn_nearest(-1.1875), -1.25);
        assert_eq!(e4m3fn_nearest(500.0), 448.0);
        assert_eq!(e4m3fn_nearest(-0.0).to_bits(), 0.0f32.to_bits());
    }

    #[test]
    fn e2m1_nearest_and_ties() {
        assert_eq!(e2m1_nearest(2.5), 2.0, "tie between codes 4 and 5: even");
        assert_eq!(e2m1_nearest(5.0), 4.0, "tie between codes 6 and 7: even");
        assert_eq!(e2m1_nearest(0.25), 0.0);
        assert_eq!(e2m1_nearest(-1.3), -1.5);
    }

    #[test]
    fn fp8_block_scale_is_a_power_of_two_and_the_tail_is_kept() {
        let mut row: Vec<f32> = (0..512).map(|i| (i as f32 - 256.0) / 37.0).collect();
        let tail: Vec<f32> = row[448..].to_vec();
        fp8_kv_round_trip(&mut row, 64);
        assert_eq!(&row[448..], &tail[..]);
        // Block 0 holds -6.92..-5.19: amax/448 = 0.0154, S = 2^-6; -256/37 / S = -442.8 -> -448.
        assert_eq!(row[0], -448.0 / 64.0);
    }

    #[test]
    fn hadamard_is_its_own_inverse_up_to_rounding() {
        let x: Vec<f32> = (0..128).map(|i| ((i * 37) % 11) as f32 - 5.0).collect();
        let mut y = x.clone();
        hadamard128(&mut y);
        hadamard128(&mut y);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        let mut e = vec![0.0f32; 128];
        e[0] = 1.0;
        hadamard128(&mut e);
        assert!(e.iter().all(|&v| v == HADAMARD_SCALE));
    }
}
