//! Every kernel tier against the scalar references, bit for bit. Test builds only.
//!
//! Each test body runs on every tier this CPU has ([`available_tiers`]): the
//! scalar tier checks the harness, the SIMD tiers are checked against the
//! scalar references with `to_bits` equality (NaN only where both are NaN).
//! Inputs are random blocks (every byte random: -128, all nibbles and all
//! fifth bits occur), blocks quantized from realistic weights, and edge
//! blocks; lengths cover 1 block, odd counts and every remainder mod 8.
//!
//! `bench_tiers` (ignored) prints timings:
//! `cargo test --release -p ds4-kernels -- --ignored --nocapture bench_tiers`.

use bytemuck::{Pod, Zeroable};

use crate::f16::fp32_to_fp16;
use crate::q4_0::{self, BlockQ4_0};
use crate::q4_1::{self, BlockQ4_1};
use crate::q5_0::{self, BlockQ5_0};
use crate::q8_0::{self, BlockQ8_0, QK8_0};
use crate::testing::XorShift;
use crate::{available_tiers, select_tier, Kernels, SCALAR, TIER_NAMES};

/// Block counts: 1, odd counts, every remainder mod 8, and a few long rows.
const BLOCK_COUNTS: [usize; 18] = [
    1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 18, 31, 33, 48, 100, 257,
];

fn same_bits(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// How the f16 scale fields (`d`, and `m` for Q4_1) of generated blocks are set.
#[derive(Clone, Copy, Debug)]
enum Scales {
    /// Any finite f16: zero, subnormals, up to ±65504.
    AnyFinite,
    /// ±[1e-3, 0.1): the magnitudes real models have.
    Typical,
    /// One bit pattern everywhere.
    Fixed(u16),
}

fn scale(rng: &mut XorShift, how: Scales) -> [u8; 2] {
    match how {
        Scales::AnyFinite => loop {
            let bits = (rng.next_u64() >> 48) as u16;
            if bits & 0x7c00 != 0x7c00 {
                return bits.to_le_bytes();
            }
        },
        Scales::Typical => {
            let mag = 10f32.powf(rng.uniform(-3.0, -1.0));
            fp32_to_fp16(if rng.byte() & 1 == 0 { mag } else { -mag })
        }
        Scales::Fixed(bits) => bits.to_le_bytes(),
    }
}

/// `nb` blocks of random bytes whose first `n_scales` f16 fields are then set by `how`.
fn random_blocks<T: Pod>(rng: &mut XorShift, nb: usize, n_scales: usize, how: Scales) -> Vec<T> {
    let mut v = vec![T::zeroed(); nb];
    for b in bytemuck::cast_slice_mut::<T, u8>(&mut v) {
        *b = rng.byte();
    }
    set_scales(&mut v, n_scales, |_| scale(rng, how));
    v
}

fn set_scales<T: Pod>(v: &mut [T], n_scales: usize, mut f: impl FnMut(usize) -> [u8; 2]) {
    for blk in v.iter_mut() {
        let bytes = bytemuck::bytes_of_mut(blk);
        for s in 0..n_scales {
            bytes[2 * s..2 * s + 2].copy_from_slice(&f(s));
        }
    }
}

/// Fills every byte after the `n_scales` scale fields with `byte`.
fn fill_quants<T: Pod>(v: &mut [T], n_scales: usize, byte: u8) {
    for blk in v.iter_mut() {
        for b in &mut bytemuck::bytes_of_mut(blk)[2 * n_scales..] {
            *b = byte;
        }
    }
}

type DotFn<X> = fn(&[X], &[BlockQ8_0]) -> f32;

/// One weight format's dot product, its scalar reference and its table entry.
struct DotCase<X> {
    name: &'static str,
    n_scales: usize,
    reference: DotFn<X>,
    entry: fn(&Kernels) -> DotFn<X>,
    /// A weight block and an activation block (scales unset) whose products
    /// are all large and of one sign, so that `sumi` has 15-19 significant
    /// bits and `sumi·d` is inexact: only such blocks tell `(sumi·dx)·dy`
    /// from `sumi·(dx·dy)` (a product of two f16 is exact in f32, and random
    /// quants give sums of ~11 bits, whose products with a scale are exact too).
    large: fn(&mut XorShift) -> (X, BlockQ8_0),
}

/// An activation block with |q| in 64..=127; positive only if `positive`.
fn large_q8(rng: &mut XorShift, positive: bool) -> BlockQ8_0 {
    let mut y = BlockQ8_0::ZERO;
    for q in &mut y.qs {
        let mag = 64 + (rng.byte() & 63) as i8;
        *q = if positive || rng.byte() & 1 == 0 {
            mag
        } else {
            -mag
        };
    }
    y
}

/// Packs 32 4-bit quants in ggml's nibble order.
fn pack_nibbles(q: &[u8; 32]) -> [u8; 16] {
    std::array::from_fn(|j| q[j] | (q[j + 16] << 4))
}

fn check_dot<X: Pod>(case: &DotCase<X>, x: &[X], y: &[BlockQ8_0], what: &str) {
    let want = (case.reference)(x, y);
    for k in available_tiers() {
        let got = (case.entry)(k)(x, y);
        assert!(
            same_bits(got, want),
            "{} [{}] {what}, {} blocks: got {got:e} ({:#010x}), want {want:e} ({:#010x})",
            case.name,
            k.tier,
            x.len(),
            got.to_bits(),
            want.to_bits()
        );
    }
}

/// The property test body shared by the four formats.
fn dot_matches_reference_on_every_tier<X: Pod>(case: DotCase<X>, seed: u64) {
    let mut rng = XorShift::new(seed);
    for nb in BLOCK_COUNTS {
        for how in [Scales::AnyFinite, Scales::Typical] {
            for _ in 0..4 {
                let x: Vec<X> = random_blocks(&mut rng, nb, case.n_scales, how);
                let y: Vec<BlockQ8_0> = random_blocks(&mut rng, nb, 1, how);
                check_dot(&case, &x, &y, &format!("random, {how:?} scales"));
            }
        }
    }

    // Edge blocks: every quant byte at its extremes, with zero, tiny, huge,
    // negative-zero and (NaN-compared) infinite and NaN scales.
    for nb in [1, 7, 8, 9, 33] {
        for xq in [0x00u8, 0xFF, 0x80, 0x7F, 0x0F, 0xF0] {
            for yq in [0x80u8, 0x7F, 0x00, 0xFF] {
                for (dx, dy) in [
                    (0x0000, 0x0000),
                    (0x7bff, 0x7bff),
                    (0xfbff, 0x7bff),
                    (0x0001, 0x0001),
                    (0x8000, 0x3c00),
                    (0x3c00, 0x7c00),
                    (0x7e00, 0x3c00),
                    (0x2e66, 0x2118),
                ] {
                    let mut x: Vec<X> =
                        random_blocks(&mut rng, nb, case.n_scales, Scales::Fixed(dx));
                    let mut y: Vec<BlockQ8_0> = random_blocks(&mut rng, nb, 1, Scales::Fixed(dy));
                    fill_quants(&mut x, case.n_scales, xq);
                    fill_quants(&mut y, 1, yq);
                    let what =
                        format!("x quants {xq:#04x}, y quants {yq:#04x}, d {dx:#06x}/{dy:#06x}");
                    check_dot(&case, &x, &y, &what);
                }
            }
        }
    }
    // Large integer sums (see `DotCase::large`).
    for nb in BLOCK_COUNTS {
        for how in [Scales::AnyFinite, Scales::Typical] {
            for _ in 0..4 {
                let (mut x, mut y): (Vec<X>, Vec<BlockQ8_0>) =
                    (0..nb).map(|_| (case.large)(&mut rng)).unzip();
                set_scales(&mut x, case.n_scales, |_| scale(&mut rng, how));
                set_scales(&mut y, 1, |_| scale(&mut rng, how));
                check_dot(&case, &x, &y, &format!("large sums, {how:?} scales"));
            }
        }
    }
    // All-zero blocks, alone and between random ones.
    for nb in [1, 9] {
        let x = vec![X::zeroed(); nb];
        let y = vec![BlockQ8_0::ZERO; nb];
        check_dot(&case, &x, &y, "all-zero blocks");
        let mut x: Vec<X> = random_blocks(&mut rng, nb, case.n_scales, Scales::Typical);
        let y: Vec<BlockQ8_0> = random_blocks(&mut rng, nb, 1, Scales::Typical);
        x[nb / 2] = X::zeroed();
        check_dot(&case, &x, &y, "one all-zero weight block");
    }
}

/// Rows quantized the way the engine does it: realistic weights × Q8_0 activations.
fn dot_matches_reference_on_quantized_rows<X: Pod>(
    case: DotCase<X>,
    quantize: fn(&[f32], &mut [X]),
    seed: u64,
) {
    let mut rng = XorShift::new(seed);
    for nb in BLOCK_COUNTS {
        let n = nb * QK8_0;
        let w = rng.vec_weights(n, 0.02);
        let a = rng.vec_uniform(n, -4.0, 4.0);
        let mut x = vec![X::zeroed(); nb];
        let mut y = vec![BlockQ8_0::ZERO; nb];
        quantize(&w, &mut x);
        q8_0::quantize_row_ref(&a, &mut y);
        check_dot(&case, &x, &y, "quantized rows");
    }
}

fn q4_0_case() -> DotCase<BlockQ4_0> {
    DotCase {
        name: "vec_dot_q4_0_q8_0",
        n_scales: 1,
        reference: q4_0::vec_dot_q4_0_q8_0,
        entry: |k| k.vec_dot_q4_0_q8_0,
        large: |rng| {
            // q - 8 = +7 where y > 0, -8 where y < 0.
            let y = large_q8(rng, false);
            let q = y.qs.map(|v| if v > 0 { 15 } else { 0 });
            let x = BlockQ4_0 {
                d: [0; 2],
                qs: pack_nibbles(&q),
            };
            (x, y)
        },
    }
}

fn q4_1_case() -> DotCase<BlockQ4_1> {
    DotCase {
        name: "vec_dot_q4_1_q8_0",
        n_scales: 2,
        reference: q4_1::vec_dot_q4_1_q8_0,
        entry: |k| k.vec_dot_q4_1_q8_0,
        large: |rng| {
            let y = large_q8(rng, true);
            let q = std::array::from_fn(|_| 8 + (rng.byte() & 7));
            let x = BlockQ4_1 {
                d: [0; 2],
                m: [0; 2],
                qs: pack_nibbles(&q),
            };
            (x, y)
        },
    }
}

fn q5_0_case() -> DotCase<BlockQ5_0> {
    DotCase {
        name: "vec_dot_q5_0_q8_0",
        n_scales: 1,
        reference: q5_0::vec_dot_q5_0_q8_0,
        entry: |k| k.vec_dot_q5_0_q8_0,
        large: |rng| {
            // q - 16 in 9..=15 where y > 0, -16..=-9 where y < 0.
            let y = large_q8(rng, false);
            let q: [u8; 32] = y.qs.map(|v| {
                let m = rng.byte() & 7;
                if v > 0 {
                    24 + m
                } else {
                    m
                }
            });
            let qh = (0..32).fold(0u32, |h, i| h | (((q[i] >> 4) as u32 & 1) << i));
            let low = q.map(|v| v & 0x0F);
            let x = BlockQ5_0 {
                d: [0; 2],
                qh: qh.to_le_bytes(),
                qs: pack_nibbles(&low),
            };
            (x, y)
        },
    }
}

fn q8_0_case() -> DotCase<BlockQ8_0> {
    DotCase {
        name: "vec_dot_q8_0_q8_0",
        n_scales: 1,
        reference: q8_0::vec_dot_q8_0_q8_0,
        entry: |k| k.vec_dot_q8_0_q8_0,
        large: |rng| {
            let y = large_q8(rng, false);
            let mut x = large_q8(rng, true);
            for (a, &b) in x.qs.iter_mut().zip(&y.qs) {
                *a = if b < 0 { -*a } else { *a };
            }
            (x, y)
        },
    }
}

#[test]
fn vec_dot_q4_0_q8_0_is_bit_identical_on_every_tier() {
    dot_matches_reference_on_every_tier(q4_0_case(), 100);
    dot_matches_reference_on_quantized_rows(q4_0_case(), q4_0::quantize_row_ref, 101);
}

#[test]
fn vec_dot_q4_1_q8_0_is_bit_identical_on_every_tier() {
    dot_matches_reference_on_every_tier(q4_1_case(), 110);
    dot_matches_reference_on_quantized_rows(q4_1_case(), q4_1::quantize_row_ref, 111);
}

#[test]
fn vec_dot_q5_0_q8_0_is_bit_identical_on_every_tier() {
    dot_matches_reference_on_every_tier(q5_0_case(), 120);
    dot_matches_reference_on_quantized_rows(q5_0_case(), q5_0::quantize_row_ref, 121);
}

#[test]
fn vec_dot_q8_0_q8_0_is_bit_identical_on_every_tier() {
    dot_matches_reference_on_every_tier(q8_0_case(), 130);
    dot_matches_reference_on_quantized_rows(q8_0_case(), q8_0::quantize_row_ref, 131);
}

#[test]
fn vec_dot_f32_is_bit_identical_on_every_tier() {
    let mut rng = XorShift::new(140);
    let check = |x: &[f32], y: &[f32], what: &str| {
        let want = crate::f32::vec_dot_f32_ref(x, y);
        for k in available_tiers() {
            let got = (k.vec_dot_f32)(x, y);
            assert!(
                same_bits(got, want),
                "vec_dot_f32 [{}] {what}, n = {}: got {got:e}, want {want:e}",
                k.tier,
                x.len()
            );
        }
    };
    let lengths = (0..=70).chain([64, 127, 576, 1536, 4099]);
    for n in lengths {
        let x = rng.vec_uniform(n, -1.0, 1.0);
        let y = rng.vec_uniform(n, -1e3, 1e3);
        check(&x, &y, "uniform");
        // Mixed magnitudes, so that every rounding of the lane sums matters.
        let x: Vec<f32> = (0..n)
            .map(|_| rng.uniform(-1.0, 1.0) * 10f32.powi(rng.byte() as i32 % 16 - 8))
            .collect();
        check(&x, &y, "mixed magnitudes");
    }
    // Edge values: signed zeros, cancellation, overflow, infinities, NaN.
    let specials = [
        0.0,
        -0.0,
        1e8,
        -1e8,
        1.0,
        f32::MAX,
        -f32::MAX,
        f32::MIN_POSITIVE / 3.0,
    ];
    for n in [1, 8, 9, 17, 64] {
        for _ in 0..20 {
            let pick = |rng: &mut XorShift| specials[rng.byte() as usize % specials.len()];
            let x: Vec<f32> = (0..n).map(|_| pick(&mut rng)).collect();
            let y: Vec<f32> = (0..n).map(|_| pick(&mut rng)).collect();
            check(&x, &y, "special values");
        }
        let mut x = rng.vec_uniform(n, -1.0, 1.0);
        x[n / 2] = f32::INFINITY;
        check(&x, &x.clone(), "with inf");
        x[0] = f32::NAN;
        check(&x, &x.clone(), "with NaN");
    }
}

/// The order `x86/avx2.rs` documents for its `dot_f32_fused`, one element
/// at a time (`mul_add` is the correctly rounded fused multiply-add).
fn dot_f32_fused_avx2_spec(x: &[f32], y: &[f32]) -> f32 {
    let n = x.len();
    let mut acc = [[0.0f32; 8]; 4];
    let whole32 = n / 32 * 32;
    for i in 0..whole32 {
        let a = &mut acc[(i % 32) / 8][i % 8];
        *a = x[i].mul_add(y[i], *a);
    }
    let whole8 = n / 8 * 8;
    for i in whole32..whole8 {
        let a = &mut acc[(i - whole32) / 8][i % 8];
        *a = x[i].mul_add(y[i], *a);
    }
    let mut lanes: [f32; 8] =
        std::array::from_fn(|l| (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]));
    for i in whole8..n {
        lanes[i % 8] = x[i].mul_add(y[i], lanes[i % 8]);
    }
    crate::f32::reduce_lanes(&lanes)
}

/// The fused dot is each tier's own fixed order: scalar is the reference,
/// AVX2 (and AVX-512, which runs the AVX2 kernel) its documented 4×8-lane FMA
/// order. All are close to the f64 dot.
#[test]
fn vec_dot_f32_fused_follows_each_tiers_order() {
    let mut rng = XorShift::new(145);
    for n in (0..=100).chain([127, 576, 1536, 4099]) {
        let x = rng.vec_uniform(n, -1.0, 1.0);
        let y: Vec<f32> = (0..n)
            .map(|_| rng.uniform(-1.0, 1.0) * 10f32.powi(rng.byte() as i32 % 8 - 4))
            .collect();
        let exact = crate::testing::dot_f64(&x, &y);
        let scale: f64 = x.iter().zip(&y).map(|(a, b)| (a * b).abs() as f64).sum();
        for k in available_tiers() {
            let got = (k.vec_dot_f32_fused)(&x, &y);
            let want = match k.tier {
                "scalar" => crate::f32::vec_dot_f32_ref(&x, &y),
                "avx2" | "avx512" => dot_f32_fused_avx2_spec(&x, &y),
                other => panic!("no fused-dot spec for tier {other}"),
            };
            assert!(
                same_bits(got, want),
                "[{}] n = {n}: got {got:e}, want {want:e}",
                k.tier
            );
            assert!(
                (got as f64 - exact).abs() <= 1e-6 * scale + 1e-30,
                "[{}] n = {n}: got {got}, f64 {exact}",
                k.tier
            );
        }
    }
}

#[test]
fn dequantize_rows_are_bit_identical_on_every_tier() {
    let mut rng = XorShift::new(150);
    for nb in BLOCK_COUNTS {
        for how in [Scales::AnyFinite, Scales::Typical, Scales::Fixed(0x8000)] {
            let x: Vec<BlockQ4_1> = random_blocks(&mut rng, nb, 2, how);
            let mut want = vec![0.0; nb * QK8_0];
            q4_1::dequantize_row(&x, &mut want);
            let x8: Vec<BlockQ8_0> = random_blocks(&mut rng, nb, 1, how);
            let mut want8 = vec![0.0; nb * QK8_0];
            q8_0::dequantize_row(&x8, &mut want8);
            for k in available_tiers() {
                let mut got = vec![f32::NAN; nb * QK8_0];
                (k.dequantize_row_q4_1)(&x, &mut got);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "q4_1 [{}] {nb} blocks, {how:?}",
                    k.tier
                );
                (k.dequantize_row_q8_0)(&x8, &mut got);
                assert_eq!(
                    bits(&got),
                    bits(&want8),
                    "q8_0 [{}] {nb} blocks, {how:?}",
                    k.tier
                );
            }
        }
    }
}

fn check_quantize(x: &[f32], what: &str) {
    let nb = x.len() / QK8_0;
    let mut want = vec![BlockQ8_0::ZERO; nb];
    q8_0::quantize_row_ref(x, &mut want);
    for k in available_tiers() {
        let mut got = vec![BlockQ8_0::ZERO; nb];
        (k.quantize_row_q8_0)(x, &mut got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g, w,
                "quantize_row_q8_0 [{}] {what}: block {i} of {nb}",
                k.tier
            );
        }
    }
}

#[test]
fn quantize_row_q8_0_is_bit_identical_on_every_tier() {
    let mut rng = XorShift::new(160);
    for nb in BLOCK_COUNTS {
        check_quantize(&rng.vec_uniform(nb * QK8_0, -3.0, 3.0), "uniform");
        check_quantize(&rng.vec_weights(nb * QK8_0, 0.02), "weights");
        let x: Vec<f32> = (0..nb * QK8_0)
            .map(|_| rng.uniform(-1.0, 1.0) * 10f32.powi(rng.byte() as i32 % 80 - 40))
            .collect();
        check_quantize(&x, "magnitudes 1e-40..1e40");
    }
    // Exact ties: amax = 127 gives d = 1, and amax = 63.5 gives 1/d = 2, so
    // these land on k + 0.5 and must round away from zero.
    let mut x = vec![0.0f32; 2 * QK8_0];
    x[0] = 127.0;
    x[QK8_0] = -63.5;
    for i in 1..QK8_0 {
        let t = (i as f32 - 16.0) * 7.0 + 0.5;
        x[i] = t.clamp(-126.5, 126.5);
        x[QK8_0 + i] = t / 2.0 / 2.0;
    }
    check_quantize(&x, "ties");
    let mut rng = XorShift::new(161);
    for _ in 0..200 {
        // Random ties and near-ties around 0.5 steps at scale 1.
        let mut x: Vec<f32> = (0..QK8_0)
            .map(|_| (rng.byte() as i8 as f32 / 2.0).clamp(-127.0, 127.0))
            .collect();
        x[rng.byte() as usize % QK8_0] = -127.0;
        let j = rng.byte() as usize % QK8_0;
        x[j] = f32::from_bits(
            x[j].to_bits()
                .wrapping_add(rng.byte() as u32 % 3)
                .wrapping_sub(1),
        );
        check_quantize(&x, "random ties");
    }
    // Zeros, signed zeros, subnormals, the largest float, infinities, NaN.
    let specials = [
        0.0,
        -0.0,
        f32::MIN_POSITIVE / 8.0,
        -f32::MIN_POSITIVE,
        f32::MAX,
        -f32::MAX,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        1.0,
        -0.5,
    ];
    check_quantize(&[0.0; QK8_0], "all zero");
    check_quantize(&[-0.0; QK8_0], "all negative zero");
    check_quantize(&[f32::NAN; QK8_0], "all NaN");
    for _ in 0..300 {
        let x: Vec<f32> = (0..QK8_0)
            .map(|_| match rng.byte() % 3 {
                0 => specials[rng.byte() as usize % specials.len()],
                _ => rng.uniform(-2.0, 2.0),
            })
            .collect();
        check_quantize(&x, "special values");
    }
}

#[test]
fn tier_selection_honours_the_cap() {
    let avail = available_tiers();
    let best = *avail.last().unwrap();
    assert!(std::ptr::eq(avail[0], &SCALAR));
    for k in &avail {
        assert!(TIER_NAMES.contains(&k.tier), "{}", k.tier);
    }
    let pick = |r: Option<&str>| select_tier(r, &avail).map(|k| k.tier);
    assert_eq!(pick(None), Ok(best.tier));
    assert_eq!(pick(Some("")), Ok(best.tier));
    assert_eq!(pick(Some("scalar")), Ok("scalar"));
    assert_eq!(pick(Some(" scalar\n")), Ok("scalar"));
    assert_eq!(pick(Some("avx512")), Ok(best.tier));
    // A cap picks the highest tier at or below it.
    let has = |t: &str| avail.iter().any(|k| k.tier == t);
    if has("avx2") {
        assert_eq!(pick(Some("avx2")), Ok("avx2"));
    }
    assert!(pick(Some("avx9"))
        .unwrap_err()
        .contains("expected one of scalar, avx2, avx512"));
    // A cap above what the CPU has falls back to the best it has.
    assert_eq!(
        select_tier(Some("avx512"), &[&SCALAR]).map(|k| k.tier),
        Ok("scalar")
    );
    // The process-wide choice is what the environment asks for.
    let env = std::env::var("DS4_KERNELS").ok();
    assert_eq!(Ok(crate::kernel_tier()), pick(env.as_deref()));
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has_feature;
        if has_feature!("avx2") {
            assert!(has("avx2"));
        }
        let avx512 = ["avx512f", "avx512bw", "avx512vl", "avx512vnni"];
        let cpu512 = has_feature!("avx512f")
            && has_feature!("avx512bw")
            && has_feature!("avx512vl")
            && has_feature!("avx512vnni");
        assert_eq!(has("avx512"), cpu512, "{avx512:?}");
        if cpu512 {
            assert_eq!(best.tier, "avx512");
            // std reports AVX-512 only where the OS saves its state: XCR0's SSE,
            // AVX, opmask, ZMM_Hi256 and Hi16_ZMM bits (see `x86::avx512`).
            // SAFETY: `xgetbv` exists wherever the OS enabled XSAVE, which AVX
            // (detected above) requires.
            let xcr0 = unsafe { std::arch::x86_64::_xgetbv(0) };
            assert_eq!(xcr0 & 0xe6, 0xe6, "XCR0 {xcr0:#x}");
        }
    }
}

/// Timings, not a check. Single thread, best of several runs.
#[test]
#[ignore = "timing; run with --ignored --nocapture"]
fn bench_tiers() {
    use std::hint::black_box;
    use std::time::Instant;

    /// Minimum over many short samples of `reps` calls: robust to a noisy machine.
    fn best_ns(reps: usize, mut f: impl FnMut()) -> f64 {
        f();
        let start = Instant::now();
        let mut best = f64::INFINITY;
        while start.elapsed().as_secs_f64() < 0.5 {
            let t = Instant::now();
            for _ in 0..reps {
                f();
            }
            best = best.min(t.elapsed().as_nanos() as f64 / reps as f64);
        }
        best
    }

    /// One single-threaded matvec per tier: `n_out` rows of `n_in` weights.
    fn matvec<X: Pod>(
        name: &str,
        (n_in, n_out): (usize, usize),
        quantize: fn(&[f32], &mut [X]),
        entry: fn(&Kernels) -> DotFn<X>,
        rng: &mut XorShift,
    ) {
        let nb = n_in / QK8_0;
        let mut w = vec![X::zeroed(); n_out * nb];
        for row in w.chunks_exact_mut(nb) {
            quantize(&rng.vec_weights(n_in, 0.02), row);
        }
        let mut a = vec![BlockQ8_0::ZERO; nb];
        q8_0::quantize_row_ref(&rng.vec_uniform(n_in, -3.0, 3.0), &mut a);
        let mut base = 0.0;
        for k in available_tiers() {
            let dot = entry(k);
            let ns = best_ns(1, || {
                for row in w.chunks_exact(nb) {
                    black_box(dot(black_box(row), &a));
                }
            });
            if k.tier == "scalar" {
                base = ns;
            }
            println!(
                "{name} {n_in}x{n_out} [{:>6}]: {:9.1} us  ({:5.2} GB/s of weights, x{:.2} vs scalar)",
                k.tier,
                ns / 1e3,
                size_of_val(&w[..]) as f64 / ns,
                base / ns
            );
        }
    }

    let mut rng = XorShift::new(170);
    let q4_1 = (
        q4_1::quantize_row_ref as fn(&[f32], &mut [BlockQ4_1]),
        q4_1_case().entry,
    );
    matvec("q4_1", (576, 1536), q4_1.0, q4_1.1, &mut rng);
    matvec("q4_1", (1536, 576), q4_1.0, q4_1.1, &mut rng);
    matvec(
        "q4_0",
        (576, 1536),
        q4_0::quantize_row_ref,
        q4_0_case().entry,
        &mut rng,
    );
    matvec(
        "q5_0",
        (576, 1536),
        q5_0::quantize_row_ref,
        q5_0_case().entry,
        &mut rng,
    );
    let q8 = (
        q8_0::quantize_row_ref as fn(&[f32], &mut [BlockQ8_0]),
        q8_0_case().entry,
    );
    matvec("q8_0", (576, 1536), q8.0, q8.1, &mut rng);
    matvec("q8_0", (576, 49152), q8.0, q8.1, &mut rng);

    for n in [64, 576, 1536] {
        let x = rng.vec_uniform(n, -1.0, 1.0);
        let y = rng.vec_uniform(n, -1.0, 1.0);
        let mut base = 0.0;
        for k in available_tiers() {
            let ns = best_ns(20_000 / n, || {
                black_box((k.vec_dot_f32)(black_box(&x), black_box(&y)));
            });
            if k.tier == "scalar" {
                base = ns;
            }
            println!(
                "vec_dot_f32 n={n:<5} [{:>6}]: {:8.1} ns  (x{:.2})",
                k.tier,
                ns,
                base / ns
            );
            let nsf = best_ns(20_000 / n, || {
                black_box((k.vec_dot_f32_fused)(black_box(&x), black_box(&y)));
            });
            println!(
                "vec_dot_f32_fused n={n:<5} [{:>6}]: {:8.1} ns  (x{:.2})",
                k.tier,
                nsf,
                base / nsf
            );
        }
    }

    let n = 1536;
    let x = rng.vec_weights(n, 0.02);
    let mut b41 = vec![BlockQ4_1::zeroed(); n / QK8_0];
    q4_1::quantize_row_ref(&x, &mut b41);
    let mut b8 = vec![BlockQ8_0::ZERO; n / QK8_0];
    q8_0::quantize_row_ref(&x, &mut b8);
    let mut out = vec![0.0f32; n];
    let mut qout = vec![BlockQ8_0::ZERO; n / QK8_0];
    for k in available_tiers() {
        let d41 = best_ns(10, || (k.dequantize_row_q4_1)(black_box(&b41), &mut out));
        let d8 = best_ns(10, || (k.dequantize_row_q8_0)(black_box(&b8), &mut out));
        let q8 = best_ns(10, || (k.quantize_row_q8_0)(black_box(&x), &mut qout));
        println!(
            "n={n} [{:>6}]: dequantize q4_1 {d41:7.0} ns, dequantize q8_0 {d8:7.0} ns, quantize q8_0 {q8:7.0} ns",
            k.tier
        );
    }
}

// ---- the fast f32 path (`crate::fast`, order F1): bit for bit on every tier ----

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// Activations spanning several magnitudes, as hidden states do.
fn activations(rng: &mut XorShift, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| rng.uniform(-1.0, 1.0) * 10f32.powi(rng.byte() as i32 % 6 - 3))
        .collect()
}

#[test]
fn dot_fma1_is_bit_identical_on_every_tier() {
    let mut rng = XorShift::new(160);
    for n in (0..=70).chain([127, 576, 1536, 4099]) {
        let w = rng.vec_uniform(n, -1.0, 1.0);
        let x = activations(&mut rng, n);
        let want = crate::fast::dot_fma1_ref(&w, &x);
        for k in available_tiers() {
            let got = (k.dot_fma1)(&w, &x);
            assert!(
                same_bits(got, want),
                "[{}] n = {n}: {got:e} vs {want:e}",
                k.tier
            );
        }
    }
}

/// 16-bit activation rounding: the same quants, scales and sums on every tier,
/// for finite values over six decades, all-zero blocks and outliers; a block
/// with an infinity or NaN gets a NaN scale everywhere.
#[test]
fn act16_quantization_is_bit_identical_on_every_tier() {
    use crate::act16::quantize_row_ref;
    let mut rng = XorShift::new(171);
    for nb in BLOCK_COUNTS {
        let n = nb * QK8_0;
        let mut x = activations(&mut rng, n);
        x[..QK8_0.min(n)].fill(0.0);
        x[n - 1] = 3.0e4;
        let mut cases = vec![x.clone()];
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut y = x.clone();
            y[n / 2] = bad;
            cases.push(y);
        }
        for x in &cases {
            let (mut q, mut sc, mut sm) = (vec![0i16; n], vec![0.0; nb], vec![0.0; nb]);
            quantize_row_ref(x, &mut q, &mut sc, &mut sm);
            let bad_block = x.iter().position(|v| !v.is_finite()).map(|i| i / QK8_0);
            for k in available_tiers() {
                let (mut gq, mut gs, mut gm) = (vec![7i16; n], vec![1.0; nb], vec![1.0; nb]);
                (k.quantize_act16)(x, &mut gq, &mut gs, &mut gm);
                for b in 0..nb {
                    if Some(b) == bad_block {
                        assert!(gs[b].is_nan() && gm[b].is_nan(), "[{}] block {b}", k.tier);
                        continue;
                    }
                    let blk = b * QK8_0..(b + 1) * QK8_0;
                    assert_eq!(
                        gq[blk.clone()],
                        q[blk],
                        "[{}] {nb} blocks, block {b}",
                        k.tier
                    );
                    assert_eq!(gs[b].to_bits(), sc[b].to_bits(), "[{}] scale {b}", k.tier);
                    assert_eq!(gm[b].to_bits(), sm[b].to_bits(), "[{}] sum {b}", k.tier);
                }
            }
        }
    }
}

/// The products with 16-bit activations on packed rows ([`crate::act16::F2Matrix`])
/// give every (row, token) exactly the scalar order F2 on the blocks, on every
/// tier: one token (the decode kernel, four rows at a time), a few tokens (the
/// decode kernel over groups of three) and batches around the 6-token groups, rows around the 2- and 4-row groups and across a panel
/// (70 rows of 48 blocks), a range of rows not starting at 0, blocks around the
/// 8-block chunks, any finite weight scales, and activations from the quantizer
/// as well as raw quants over the whole i16 range.
#[test]
fn act16_products_are_bit_identical_on_every_tier() {
    use crate::act16::{
        gemm_q4_1_ref, gemm_q4_k_ref, gemm_q5_0_ref, gemm_q6_k_ref, gemm_q8_0_ref, Act16, F2Matrix,
        SubQ4K, SubQ6K,
    };
    // A K-quant sub-block's f32 heads: an f16 scale times a 6-bit (Q4_K) or
    // 8-bit signed (Q6_K) integer, as the conversion forms them.
    let f32_head = |rng: &mut XorShift, how: Scales, int: fn(u8) -> f32| {
        let d = crate::f16::fp16_to_fp32(scale(rng, how));
        (d * int(rng.byte())).to_le_bytes()
    };
    let mut rng = XorShift::new(172);
    for nb in [1, 2, 7, 8, 9, 18, 48] {
        for (n_rows, n_tok) in [
            (1, 1),
            (4, 1),
            (5, 1),
            (11, 1),
            (3, 2),
            (5, 3),
            (7, 4),
            (9, 5),
            (10, 6),
            (6, 7),
            (4, 8),
            (5, 9),
            (1, 17),
            (70, 9),
            // Rows of 18 blocks in four decode stretches of 32, 12 KiB apart:
            // the stretches are lengthened to 35 and the last one runs short.
            (128, 1),
            (128, 3),
        ] {
            for how in [Scales::AnyFinite, Scales::Typical] {
                let n = nb * QK8_0;
                let w4: Vec<BlockQ4_1> = random_blocks(&mut rng, nb * n_rows, 2, how);
                let w8: Vec<BlockQ8_0> = random_blocks(&mut rng, nb * n_rows, 1, how);
                let w5: Vec<BlockQ5_0> = random_blocks(&mut rng, nb * n_rows, 1, how);
                let mut quantized = Act16::default();
                quantized.quantize(&activations(&mut rng, n * n_tok), n);
                let raw = Act16::from_parts(
                    n,
                    (0..n * n_tok)
                        .map(|_| (rng.next_u64() >> 48) as i16)
                        .collect(),
                    &rng.vec_uniform(nb * n_tok, -1e-3, 1e-3),
                    &rng.vec_uniform(nb * n_tok, -2.0, 2.0),
                );
                let mut w4k: Vec<SubQ4K> = random_blocks(&mut rng, nb * n_rows, 0, how);
                for b in &mut w4k {
                    b.d = f32_head(&mut rng, how, |b| f32::from(b % 64));
                    b.m = f32_head(&mut rng, how, |b| -f32::from(b % 64));
                }
                let mut w6k: Vec<SubQ6K> = random_blocks(&mut rng, nb * n_rows, 0, how);
                for b in &mut w6k {
                    b.d = f32_head(&mut rng, how, |b| f32::from(b as i8));
                    b.d2 = f32_head(&mut rng, how, |b| f32::from(b as i8));
                }
                let (p4, p8) = (F2Matrix::pack(&w4, nb), F2Matrix::pack(&w8, nb));
                let (p4_pairs, p8_pairs) =
                    (F2Matrix::pack_pairs(&w4, nb), F2Matrix::pack_pairs(&w8, nb));
                let (p5, p5_pairs) = (F2Matrix::pack(&w5, nb), F2Matrix::pack_pairs(&w5, nb));
                let (p4k, p6k) = (F2Matrix::pack(&w4k, nb), F2Matrix::pack(&w6k, nb));
                // All rows, and all but the first or the first two (a unit of
                // rows mid-matrix; in pairs only from a pair's first row).
                let mut firsts = vec![0, 1.min(n_rows - 1), 2.min(n_rows - 1)];
                firsts.dedup();
                for first in firsts {
                    let rows = n_rows - first;
                    for acts in [&quantized, &raw] {
                        let mut want4 = vec![0.0; rows * n_tok];
                        let mut want8 = vec![0.0; rows * n_tok];
                        gemm_q4_1_ref(&w4[first * nb..], acts, &mut want4);
                        gemm_q8_0_ref(&w8[first * nb..], acts, &mut want8);
                        let mut want5 = vec![0.0; rows * n_tok];
                        gemm_q5_0_ref(&w5[first * nb..], acts, &mut want5);
                        let mut want4k = vec![0.0; rows * n_tok];
                        let mut want6k = vec![0.0; rows * n_tok];
                        gemm_q4_k_ref(&w4k[first * nb..], acts, &mut want4k);
                        gemm_q6_k_ref(&w6k[first * nb..], acts, &mut want6k);
                        for k in available_tiers() {
                            let mut got = vec![f32::NAN; rows * n_tok];
                            (k.gemm_q4_1_act16)(p4.rows(first..n_rows), acts, &mut got);
                            let case = format!(
                                "[{}] {nb} blocks, rows {first}..{n_rows} x {n_tok}, {how:?}",
                                k.tier
                            );
                            assert_eq!(bits(&got), bits(&want4), "q4_1 {case}");
                            (k.gemm_q8_0_act16)(p8.rows(first..n_rows), acts, &mut got);
                            assert_eq!(bits(&got), bits(&want8), "q8_0 {case}");
                            // Rows in pairs: where the tier lays them out so, and on
                            // the scalar tier (which reads any layout block by block).
                            if first.is_multiple_of(2) && (k.f2_pairs || k.tier == "scalar") {
                                got.fill(f32::NAN);
                                (k.gemm_q4_1_act16)(p4_pairs.rows(first..n_rows), acts, &mut got);
                                assert_eq!(bits(&got), bits(&want4), "q4_1 in pairs {case}");
                                got.fill(f32::NAN);
                                (k.gemm_q8_0_act16)(p8_pairs.rows(first..n_rows), acts, &mut got);
                                assert_eq!(bits(&got), bits(&want8), "q8_0 in pairs {case}");
                                got.fill(f32::NAN);
                                (k.gemm_q5_0_act16)(p5_pairs.rows(first..n_rows), acts, &mut got);
                                assert_eq!(bits(&got), bits(&want5), "q5_0 in pairs {case}");
                            }
                            (k.gemm_q5_0_act16)(p5.rows(first..n_rows), acts, &mut got);
                            assert_eq!(bits(&got), bits(&want5), "q5_0 {case}");
                            (k.gemm_q4_k_act16)(p4k.rows(first..n_rows), acts, &mut got);
                            assert_eq!(bits(&got), bits(&want4k), "q4_K {case}");
                            (k.gemm_q6_k_act16)(p6k.rows(first..n_rows), acts, &mut got);
                            assert_eq!(bits(&got), bits(&want6k), "q6_K {case}");
                        }
                    }
                }
            }
        }
    }
}

/// The multi-row products against 8-bit activations give every row exactly the
/// scalar dot product of its format, on every tier: row counts around the 4-row
/// groups, block counts around the 8-block chunks, any finite scales, and
/// activation quants over the whole i8 range (-128 included) as well as
/// quantizer output.
#[test]
fn q8_matvecs_are_bit_identical_on_every_tier() {
    let mut rng = XorShift::new(164);
    for nb in [1, 2, 7, 8, 9, 18, 48] {
        for n_rows in [1, 3, 4, 5, 8, 11] {
            for how in [Scales::AnyFinite, Scales::Typical] {
                let w4: Vec<BlockQ4_1> = random_blocks(&mut rng, nb * n_rows, 2, how);
                let w8: Vec<BlockQ8_0> = random_blocks(&mut rng, nb * n_rows, 1, how);
                let mut quantized = vec![BlockQ8_0::ZERO; nb];
                q8_0::quantize_row_ref(&activations(&mut rng, nb * QK8_0), &mut quantized);
                let raw: Vec<BlockQ8_0> = random_blocks(&mut rng, nb, 1, how);
                for y in [&quantized, &raw] {
                    let want4: Vec<f32> = w4
                        .chunks_exact(nb)
                        .map(|r| crate::q4_1::vec_dot_q4_1_q8_0(r, y))
                        .collect();
                    let want8: Vec<f32> = w8
                        .chunks_exact(nb)
                        .map(|r| q8_0::vec_dot_q8_0_q8_0(r, y))
                        .collect();
                    for k in available_tiers() {
                        let mut got = vec![f32::NAN; n_rows];
                        (k.gemm_q4_1_q8_0)(&w4, y, nb, &mut got);
                        assert_eq!(
                            bits(&got),
                            bits(&want4),
                            "q4_1 gemm [{}] {nb}x{n_rows}",
                            k.tier
                        );
                        (k.matvec_q4_1_q8_0)(&w4, y, &mut got);
                        assert_eq!(bits(&got), bits(&want4), "q4_1 [{}] {nb}x{n_rows}", k.tier);
                        (k.matvec_q8_0_q8_0)(&w8, y, &mut got);
                        assert_eq!(bits(&got), bits(&want8), "q8_0 [{}] {nb}x{n_rows}", k.tier);
                    }
                }
            }
        }
    }
}

/// The batched Q4_1 x Q8_0 product gives every (token, row) exactly the scalar
/// dot product, on every tier, over token and row counts around its groups and
/// rows longer than 256 blocks; from the GGUF blocks and from the packed layout
/// (whole, and a range of rows not starting at 0).
#[test]
fn q8_gemm_is_bit_identical_on_every_tier() {
    let mut rng = XorShift::new(165);
    for nb in [1, 3, 8, 9, 18, 48, 300] {
        for n_rows in [1, 4, 6, 9] {
            for n_tok in [1, 2, 3, 7] {
                let w: Vec<BlockQ4_1> = random_blocks(&mut rng, nb * n_rows, 2, Scales::Typical);
                let mut y = vec![BlockQ8_0::ZERO; nb * n_tok];
                q8_0::quantize_row_ref(&activations(&mut rng, nb * n_tok * QK8_0), &mut y);
                let want: Vec<f32> = y
                    .chunks_exact(nb)
                    .flat_map(|yt| {
                        w.chunks_exact(nb)
                            .map(move |r| crate::q4_1::vec_dot_q4_1_q8_0(r, yt))
                    })
                    .collect();
                for k in available_tiers() {
                    // No rows: nothing to write, whatever the tokens.
                    (k.gemm_q4_1_q8_0)(&[], &y, nb, &mut []);
                    let mut got = vec![f32::NAN; n_tok * n_rows];
                    (k.gemm_q4_1_q8_0)(&w, &y, nb, &mut got);
                    let case = format!("[{}] {nb} blocks, {n_rows} rows, {n_tok} tokens", k.tier);
                    assert_eq!(bits(&got), bits(&want), "{case}");
                    // The same rows packed, whole and without the first row.
                    let f2 = crate::act16::F2Matrix::pack(&w, nb);
                    got.fill(f32::NAN);
                    (k.gemm_q4_1_q8_0_f2)(f2.rows(0..n_rows), &y, &mut got);
                    assert_eq!(bits(&got), bits(&want), "packed {case}");
                    let tail = n_rows - 1;
                    let mut got = vec![f32::NAN; n_tok * tail];
                    (k.gemm_q4_1_q8_0_f2)(f2.rows(1..n_rows), &y, &mut got);
                    let want_tail: Vec<f32> = want
                        .chunks_exact(n_rows)
                        .flat_map(|t| t[1..].to_vec())
                        .collect();
                    assert_eq!(bits(&got), bits(&want_tail), "packed rows 1.. {case}");
                }
            }
        }
    }
}

/// Every tile shape gives each (row, token) exactly `dot_fma1` of the pair.
#[test]
fn gemm_tiles_are_bit_identical_on_every_tier() {
    use crate::fast::{TILE_ROWS, TILE_TOKENS};
    let mut rng = XorShift::new(163);
    for k_len in [1, 8, 13, 64, 576, 1536] {
        for rows in 1..=TILE_ROWS {
            for toks in 1..=TILE_TOKENS {
                let w = rng.vec_uniform(rows * k_len, -0.1, 0.1);
                let x = activations(&mut rng, toks * k_len);
                let want: Vec<f32> = (0..toks)
                    .flat_map(|t| (0..rows).map(move |r| (t, r)))
                    .map(|(t, r)| {
                        crate::fast::dot_fma1_ref(
                            &w[r * k_len..][..k_len],
                            &x[t * k_len..][..k_len],
                        )
                    })
                    .collect();
                for k in available_tiers() {
                    let mut got = vec![f32::NAN; rows * toks];
                    (k.gemm_tile)(&w, &x, k_len, &mut got);
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "[{}] {rows}x{toks}, k {k_len}",
                        k.tier
                    );
                }
            }
        }
    }
}

/// `exp` of the attention kernels: every tier equals `exp_ref` bit for bit, on
/// random inputs over the whole range (large negative, -inf, the clamps, NaN).
#[test]
fn attention_exp_is_bit_identical_on_every_tier() {
    use crate::attn::exp_ref;
    let mut rng = XorShift::new(171);
    let mut x: Vec<f32> = (0..20_000).map(|_| rng.uniform(-120.0, 100.0)).collect();
    x.extend((0..5_000).map(|_| -rng.uniform(0.0, 30.0)));
    x.extend((0..2_000).map(|_| rng.uniform(-1e-3, 1e-3)));
    x.extend((0..2_000).map(|_| f32::from_bits(rng.next_u64() as u32)));
    x.extend([
        f32::NEG_INFINITY,
        f32::INFINITY,
        f32::NAN,
        0.0,
        -0.0,
        -87.33654,
        -87.3365,
        -87.34,
        88.0,
        88.1,
        f32::MIN,
        f32::MAX,
        -f32::MIN_POSITIVE,
    ]);
    let want: Vec<f32> = x.iter().map(|&v| exp_ref(v)).collect();
    for k in available_tiers() {
        // Every length, so each tail size is covered.
        for len in [x.len(), 1, 7, 9, 15] {
            let mut got = x[..len].to_vec();
            (k.exp_inplace)(&mut got);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    same_bits(*g, *w),
                    "[{}] exp({}) = {g}, want {w}",
                    k.tier,
                    x[i]
                );
            }
        }
    }
}

#[test]
fn widen_f16_is_bit_identical_on_every_tier() {
    let mut rng = XorShift::new(172);
    let h: Vec<u16> = (0..1003).map(|_| rng.next_u64() as u16).collect();
    let mut want = vec![0.0; h.len()];
    crate::attn::widen_f16_ref(&h, &mut want);
    for k in available_tiers() {
        let mut got = vec![f32::NAN; h.len()];
        (k.widen_f16)(&h, &mut got);
        for (g, w) in got.iter().zip(&want) {
            assert!(same_bits(*g, *w), "[{}]", k.tier);
        }
    }
}

/// [`crate::attn::attn_group_ref`] from a copy of the states and accumulators.
fn group_ref<T: crate::attn::KvElem>(
    q: &[f32],
    k: &[T],
    v: &[T],
    scale: f32,
    st0: &[crate::attn::Running],
    acc0: &[f32],
) -> (Vec<crate::attn::Running>, Vec<f32>) {
    let (mut st, mut acc) = (st0.to_vec(), acc0.to_vec());
    let hd = acc0.len() / st0.len();
    let mut scores = vec![0.0; st0.len() * (k.len() / hd)];
    crate::attn::attn_group_ref(q, k, v, scale, &mut st, &mut acc, &mut scores, false);
    (st, acc)
}

/// A grouped attention tile step on every tier equals the reference (each query
/// alone) bit for bit: groups of 1 to 5 queries (the kernels' chunks of three or
/// four and their remainders), every tile length up to 64 (each tail, odd ones
/// for the position pairs of AVX-512), several head sizes (a multiple of 8 or
/// not; for AVX-512 one or two strips of 64, a strip of 16, a last 8), fresh and
/// running states, scores far apart (weights
/// underflowing to 0); f32 rows, f16 rows read directly, and f16 rows widened
/// first and run as f32.
#[test]
fn attention_groups_are_bit_identical_on_every_tier() {
    use crate::attn::{attn_group, KvElem, Running};
    let mut rng = XorShift::new(173);
    for hd in [8, 12, 24, 64, 80, 128] {
        for n in (1..=64).chain([100]) {
            for (spread, fresh) in [(1.0, true), (4.0, false), (60.0, false)] {
                let g = 1 + (n + hd) % 5;
                let q = rng.vec_uniform(g * hd, -spread, spread);
                let kr = rng.vec_uniform(n * hd, -1.0, 1.0);
                let vr = rng.vec_uniform(n * hd, -2.0, 2.0);
                let st0: Vec<Running> = (0..g)
                    .map(|_| {
                        if fresh {
                            Running::default()
                        } else {
                            Running {
                                m: rng.uniform(-3.0, 6.0),
                                l: rng.uniform(0.5, 20.0),
                            }
                        }
                    })
                    .collect();
                let acc0 = if fresh {
                    vec![0.0; g * hd]
                } else {
                    rng.vec_uniform(g * hd, -5.0, 5.0)
                };
                let scale = 1.0 / (hd as f32).sqrt();
                let kh: Vec<u16> = kr.iter().map(|&x| KvElem::narrow(x)).collect();
                let vh: Vec<u16> = vr.iter().map(|&x| KvElem::narrow(x)).collect();
                // The reference: each query alone.
                let want32 = group_ref(&q, &kr, &vr, scale, &st0, &acc0);
                let want16 = group_ref(&q, &kh, &vh, scale, &st0, &acc0);
                for k in available_tiers() {
                    let what = format!("[{}] hd {hd}, n {n}, {g} queries, spread {spread}", k.tier);
                    let check = |(st, acc): (Vec<Running>, Vec<f32>),
                                 want: &(Vec<Running>, Vec<f32>),
                                 kind: &str| {
                        for (a, b) in st.iter().zip(&want.0) {
                            assert_eq!(a.m.to_bits(), b.m.to_bits(), "{what} {kind}: m");
                            assert_eq!(a.l.to_bits(), b.l.to_bits(), "{what} {kind}: l");
                        }
                        assert_eq!(bits(&acc), bits(&want.1), "{what} {kind}: acc");
                    };
                    let (mut st, mut acc, mut sc) =
                        (st0.clone(), acc0.clone(), vec![0.0; g * n + 3]);
                    (k.attn_group_f32)(&q, &kr, &vr, scale, &mut st, &mut acc, &mut sc, false);
                    check((st, acc), &want32, "f32");
                    let (mut st, mut acc) = (st0.clone(), acc0.clone());
                    (k.attn_group_f16)(&q, &kh, &vh, scale, &mut st, &mut acc, &mut sc, true);
                    check((st, acc), &want16, "f16");
                    let (mut kf, mut vf) = (vec![0.0; kh.len()], vec![0.0; vh.len()]);
                    (k.widen_f16)(&kh, &mut kf);
                    (k.widen_f16)(&vh, &mut vf);
                    let (mut st, mut acc) = (st0.clone(), acc0.clone());
                    (k.attn_group_f32)(&q, &kf, &vf, scale, &mut st, &mut acc, &mut sc, true);
                    check((st, acc), &want16, "f16 widened");
                }
                // The dispatching front end picks the same kernels.
                let (mut st, mut acc, mut sc) = (st0.clone(), acc0.clone(), vec![0.0; g * n]);
                attn_group(&q, &kh, &vh, scale, &mut st, &mut acc, &mut sc, false);
                assert_eq!(bits(&acc), bits(&want16.1), "attn_group f16");
            }
        }
    }
}

/// Timings of the fast path's kernels against the dequantize-then-dot they
/// replace, on every SIMD tier of this CPU side by side (each case runs the
/// tiers one after the other, so a load that comes and goes hits them alike):
/// `cargo test --release -p ds4-kernels -- --ignored --nocapture bench_fast`.
#[test]
#[ignore]
fn bench_fast() {
    use crate::testing::best_ns;
    use std::hint::black_box;
    let mut rng = XorShift::new(171);
    let simd: Vec<&Kernels> = available_tiers()
        .into_iter()
        .filter(|k| k.tier != "scalar")
        .collect();
    // K-quant rows of 1536 (6 super-blocks): dequantization and Q8_K dots, the
    // scalar reference and every SIMD tier.
    {
        use crate::q8_k::{quantize_row_ref, BlockQ8_K};
        let nb = 6;
        let w4: Vec<crate::q4_k::BlockQ4_K> = random_blocks(&mut rng, nb, 2, Scales::Typical);
        let mut w6: Vec<crate::q6_k::BlockQ6_K> = random_blocks(&mut rng, nb, 0, Scales::Typical);
        for b in &mut w6 {
            b.d = scale(&mut rng, Scales::Typical);
        }
        let mut y = vec![BlockQ8_K::ZERO; nb];
        quantize_row_ref(&rng.vec_uniform(nb * 256, -1.0, 1.0), &mut y);
        let mut out = vec![0.0; nb * 256];
        for t in available_tiers() {
            let d4 = best_ns(|| (t.dequantize_row_q4_k)(black_box(&w4), &mut out));
            let d6 = best_ns(|| (t.dequantize_row_q6_k)(black_box(&w6), &mut out));
            let v4 = best_ns(|| {
                black_box((t.vec_dot_q4_k_q8_k)(black_box(&w4), &y));
            });
            let v6 = best_ns(|| {
                black_box((t.vec_dot_q6_k_q8_k)(black_box(&w6), &y));
            });
            println!(
                "k-quants, rows of 1536 [{}]: dequantize q4_K {d4:.0} ns, q6_K {d6:.0} ns; \
                 dot with q8_K q4_K {v4:.0} ns, q6_K {v6:.0} ns",
                t.tier
            );
        }
    }
    // One grouped attention tile step (64 positions; head_dim 64, and 256 with
    // four queries as on Gemma 3's global layers), per (query, position).
    for (g, hd) in [(1, 64), (2, 64), (3, 64), (4, 256)] {
        let n = 64;
        let q = rng.vec_uniform(g * hd, -1.0, 1.0);
        let kf = rng.vec_uniform(n * hd, -1.0, 1.0);
        let vf = rng.vec_uniform(n * hd, -1.0, 1.0);
        let kh: Vec<u16> = kf.iter().map(|&x| crate::attn::KvElem::narrow(x)).collect();
        let vh: Vec<u16> = vf.iter().map(|&x| crate::attn::KvElem::narrow(x)).collect();
        let mut st = vec![crate::attn::Running::default(); g];
        let (mut acc, mut sc) = (vec![0.0; g * hd], vec![0.0; g * n]);
        for k in &simd {
            let f32_ns = best_ns(|| {
                st.fill(crate::attn::Running::default());
                (k.attn_group_f32)(
                    black_box(&q),
                    &kf,
                    &vf,
                    0.125,
                    &mut st,
                    &mut acc,
                    &mut sc,
                    false,
                )
            });
            let f16_ns = best_ns(|| {
                st.fill(crate::attn::Running::default());
                (k.attn_group_f16)(
                    black_box(&q),
                    &kh,
                    &vh,
                    0.125,
                    &mut st,
                    &mut acc,
                    &mut sc,
                    false,
                )
            });
            let pairs = (g * n) as f64;
            println!(
                "attention tile, {g} queries of {hd} [{}]: f32 {:.2} ns, f16 {:.2} ns per (query, position)",
                k.tier,
                f32_ns / pairs,
                f16_ns / pairs
            );
        }
    }
    for (n_in, n_out) in [(576, 1536), (1536, 576), (576, 49152)] {
        let nb = n_in / QK8_0;
        let w4: Vec<BlockQ4_1> = random_blocks(&mut rng, nb * n_out, 2, Scales::Typical);
        let w8: Vec<BlockQ8_0> = random_blocks(&mut rng, nb * n_out, 1, Scales::Typical);
        let x = rng.vec_uniform(n_in, -1.0, 1.0);
        let mut out = vec![0.0; n_out];
        let mut row = vec![0.0; n_in];
        let mut a1 = crate::act16::Act16::default();
        a1.quantize(&x, n_in);
        let (p4, p8) = (
            crate::act16::F2Matrix::pack(&w4, nb),
            crate::act16::F2Matrix::pack(&w8, nb),
        );
        let w5: Vec<BlockQ5_0> = random_blocks(&mut rng, nb * n_out, 1, Scales::Typical);
        let p5 = crate::act16::F2Matrix::pack(&w5, nb);
        // The pair layout, which the engine packs these formats in on the
        // tiers that have it (`matmul.rs`): their F2 timings are the engine's.
        let (q4p, q8p, q5p) = (
            crate::act16::F2Matrix::pack_pairs(&w4, nb),
            crate::act16::F2Matrix::pack_pairs(&w8, nb),
            crate::act16::F2Matrix::pack_pairs(&w5, nb),
        );
        let p58 = crate::act16::F2Matrix::pack(&q5_0::to_q8_0(&w5), nb);
        let mut y8 = vec![BlockQ8_0::ZERO; nb];
        q8_0::quantize_row_ref(&x, &mut y8);
        // The batched products: 64 tokens, F1 tiles over 8 panels of 12 dequantized
        // rows, F2 over 96 rows; and a prefill chunk's shape, 256 tokens against
        // every row (up to 1536).
        let toks = 64;
        let xs = rng.vec_uniform(n_in * toks, -1.0, 1.0);
        let mut a64 = crate::act16::Act16::default();
        a64.quantize(&xs, n_in);
        let rows = 96.min(n_out);
        let mut o64 = vec![0.0; rows * toks];
        let (rows_p, toks_p) = (1536.min(n_out), 256);
        let mut a256 = crate::act16::Act16::default();
        a256.quantize(&rng.vec_uniform(n_in * toks_p, -1.0, 1.0), n_in);
        let mut o256 = vec![0.0; rows_p * toks_p];
        let mut wf = vec![0.0; 16 * n_in];
        let mut o = [0.0; 12];
        for k in &simd {
            let (f4, f8, f5) = match k.f2_pairs {
                true => (&q4p, &q8p, &q5p),
                false => (&p4, &p8, &p5),
            };
            let f1_4 = best_ns(|| {
                for (r, o) in w4.chunks_exact(nb).zip(out.iter_mut()) {
                    (k.dequantize_row_q4_1)(r, &mut row);
                    *o = (k.dot_fma1)(&row, &x);
                }
            });
            let f1_8 = best_ns(|| {
                for (r, o) in w8.chunks_exact(nb).zip(out.iter_mut()) {
                    (k.dequantize_row_q8_0)(r, &mut row);
                    *o = (k.dot_fma1)(&row, &x);
                }
            });
            let q8_blocks = best_ns(|| (k.matvec_q4_1_q8_0)(black_box(&w4), &y8, &mut out));
            let q8_packed =
                best_ns(|| (k.gemm_q4_1_q8_0_f2)(black_box(p4.rows(0..n_out)), &y8, &mut out));
            println!(
                "{n_in}x{n_out} [{}] one token, Q8 activations, q4_1 from blocks / packed: \
                 {:8.1} / {:8.1} us",
                k.tier,
                q8_blocks / 1e3,
                q8_packed / 1e3
            );
            let f2_4 = best_ns(|| (k.gemm_q4_1_act16)(black_box(f4.rows(0..n_out)), &a1, &mut out));
            let f2_8 = best_ns(|| (k.gemm_q8_0_act16)(black_box(f8.rows(0..n_out)), &a1, &mut out));
            println!(
                "{n_in}x{n_out} [{}] one token, dequantize + F1 dot vs 16-bit activations (F2): \
                 q4_1 {:8.1} / {:8.1} us | q8_0 {:8.1} / {:8.1} us",
                k.tier,
                f1_4 / 1e3,
                f2_4 / 1e3,
                f1_8 / 1e3,
                f2_8 / 1e3
            );
            // Batched decode's shapes: a few tokens against every row.
            let small: Vec<String> = [1usize, 2, 3, 4, 6, 8]
                .iter()
                .map(|&n| {
                    let mut a = crate::act16::Act16::default();
                    a.quantize(&xs[..n * n_in], n_in);
                    let mut o = vec![0.0; n * n_out];
                    let ns =
                        best_ns(|| (k.gemm_q4_1_act16)(black_box(f4.rows(0..n_out)), &a, &mut o));
                    format!("{n}: {:.1}", ns / 1e3)
                })
                .collect();
            println!(
                "{n_in}x{n_out} [{}] F2 q4_1, few tokens (tokens: us per call): {}",
                k.tier,
                small.join(", ")
            );
            // Q5_0 as it is against the Q8_0 blocks holding its values (what
            // the fast path ran it from before).
            let (one5, one58) = (
                best_ns(|| (k.gemm_q5_0_act16)(black_box(f5.rows(0..n_out)), &a1, &mut out)),
                best_ns(|| (k.gemm_q8_0_act16)(black_box(p58.rows(0..n_out)), &a1, &mut out)),
            );
            let (pre5, pre58) = (
                best_ns(|| (k.gemm_q5_0_act16)(black_box(f5.rows(0..rows_p)), &a256, &mut o256)),
                best_ns(|| (k.gemm_q8_0_act16)(black_box(p58.rows(0..rows_p)), &a256, &mut o256)),
            );
            println!(
                "{n_in}x{n_out} [{}] F2 q5_0 / as q8_0: one token {:.1} / {:.1} us, \
                 {toks_p} tokens {:.2} / {:.2} MAC/ns",
                k.tier,
                one5 / 1e3,
                one58 / 1e3,
                (rows_p * toks_p * n_in) as f64 / pre5,
                (rows_p * toks_p * n_in) as f64 / pre58
            );
            let f2 = best_ns(|| (k.gemm_q4_1_act16)(black_box(f4.rows(0..rows)), &a64, &mut o64));
            let f2p =
                best_ns(|| (k.gemm_q4_1_act16)(black_box(f4.rows(0..rows_p)), &a256, &mut o256));
            println!(
                "  [{}] F2 gemm q4_1: {:.2} MAC/ns (64 tokens x 96 rows), {:.2} MAC/ns \
                 ({toks_p} x {rows_p})",
                k.tier,
                (rows * toks * n_in) as f64 / f2,
                (rows_p * toks_p * n_in) as f64 / f2p
            );
            for (gr, gt) in [(4, 3), (4, 2), (3, 3)] {
                let gemm = best_ns(|| {
                    for p in w4.chunks_exact(12 * nb).take(8) {
                        (k.dequantize_row_q4_1)(p, &mut wf[..12 * n_in]);
                        for t0 in (0..toks).step_by(gt) {
                            let nt = gt.min(toks - t0);
                            for g in 0..12 / gr {
                                (k.gemm_tile)(
                                    &wf[g * gr * n_in..][..gr * n_in],
                                    &xs[t0 * n_in..(t0 + nt) * n_in],
                                    n_in,
                                    &mut o[..gr * nt],
                                );
                            }
                        }
                    }
                });
                let macs = (8 * 12 * toks * n_in) as f64;
                println!(
                    "  [{}] F1 gemm tiles {gr}x{gt}: {:.2} MAC/ns",
                    k.tier,
                    macs / gemm
                );
            }
        }
    }
}

/// Q4_K and Q6_K (random bytes, so every 6-bit scale and min, every quant, and
/// the f16 super-block scales set by `how`) against Q8_K activations from the
/// quantizer and raw ones over the whole i8 range (-128 included): dequantization
/// and dot products bit-identical to the scalar references on every tier.
#[test]
fn k_quants_are_bit_identical_on_every_tier() {
    use crate::q4_k::{self, BlockQ4_K};
    use crate::q6_k::{self, BlockQ6_K};
    use crate::q8_k::{self, BlockQ8_K};
    use crate::QK_K;
    let mut rng = XorShift::new(181);
    for nb in [1, 2, 3, 8] {
        for how in [Scales::AnyFinite, Scales::Typical, Scales::Fixed(0x8000)] {
            let w4: Vec<BlockQ4_K> = random_blocks(&mut rng, nb, 2, how);
            let mut w6: Vec<BlockQ6_K> = random_blocks(&mut rng, nb, 0, how);
            for b in &mut w6 {
                b.d = scale(&mut rng, how);
            }
            let mut quantized = vec![BlockQ8_K::ZERO; nb];
            q8_k::quantize_row_ref(&activations(&mut rng, nb * QK_K), &mut quantized);
            let raw: Vec<BlockQ8_K> = (0..nb)
                .map(|_| {
                    let mut y = BlockQ8_K::ZERO;
                    y.d = rng.uniform(-0.01, 0.01);
                    for q in &mut y.qs {
                        *q = rng.byte() as i8;
                    }
                    for (s, q) in y.bsums.iter_mut().zip(y.qs.chunks_exact(16)) {
                        *s = q.iter().map(|&q| i16::from(q)).sum();
                    }
                    y
                })
                .collect();
            let (mut want4, mut want6) = (vec![0.0; nb * QK_K], vec![0.0; nb * QK_K]);
            q4_k::dequantize_row(&w4, &mut want4);
            q6_k::dequantize_row(&w6, &mut want6);
            for k in available_tiers() {
                let case = format!("[{}] {nb} blocks, {how:?}", k.tier);
                let mut got = vec![f32::NAN; nb * QK_K];
                (k.dequantize_row_q4_k)(&w4, &mut got);
                assert_eq!(bits(&got), bits(&want4), "q4_K dequantize {case}");
                (k.dequantize_row_q6_k)(&w6, &mut got);
                assert_eq!(bits(&got), bits(&want6), "q6_K dequantize {case}");
                for y in [&quantized, &raw] {
                    let (got4, want4) = (
                        (k.vec_dot_q4_k_q8_k)(&w4, y),
                        q4_k::vec_dot_q4_K_q8_K(&w4, y),
                    );
                    assert!(same_bits(got4, want4), "q4_K dot {case}: {got4} vs {want4}");
                    let (got6, want6) = (
                        (k.vec_dot_q6_k_q8_k)(&w6, y),
                        q6_k::vec_dot_q6_K_q8_K(&w6, y),
                    );
                    assert!(same_bits(got6, want6), "q6_K dot {case}: {got6} vs {want6}");
                }
            }
        }
    }
}

/// The dequantizers of the fast path's other formats (order F1 decodes rows with
/// them): Q4_0 and Q5_0 blocks of random bytes, and f16 and bf16 rows of any bit
/// patterns (infinities, NaNs, subnormals) and lengths around the 8-wide steps.
#[test]
fn q4_0_q5_0_f16_bf16_dequantizers_are_bit_identical_on_every_tier() {
    let same = |got: &[f32], want: &[f32]| got.iter().zip(want).all(|(&a, &b)| same_bits(a, b));
    let mut rng = XorShift::new(182);
    for nb in BLOCK_COUNTS {
        for how in [Scales::AnyFinite, Scales::Typical, Scales::Fixed(0x8000)] {
            let x0: Vec<BlockQ4_0> = random_blocks(&mut rng, nb, 1, how);
            let x5: Vec<BlockQ5_0> = random_blocks(&mut rng, nb, 1, how);
            let (mut want0, mut want5) = (vec![0.0; nb * QK8_0], vec![0.0; nb * QK8_0]);
            q4_0::dequantize_row(&x0, &mut want0);
            q5_0::dequantize_row(&x5, &mut want5);
            for k in available_tiers() {
                let mut got = vec![f32::NAN; nb * QK8_0];
                (k.dequantize_row_q4_0)(&x0, &mut got);
                assert!(same(&got, &want0), "q4_0 [{}] {nb} blocks, {how:?}", k.tier);
                (k.dequantize_row_q5_0)(&x5, &mut got);
                assert!(same(&got, &want5), "q5_0 [{}] {nb} blocks, {how:?}", k.tier);
            }
        }
    }
    for n in (0..=40).chain([576, 1537]) {
        let row: Vec<u8> = (0..2 * n).map(|_| rng.byte()).collect();
        let (mut want16, mut want_bf) = (vec![0.0; n], vec![0.0; n]);
        crate::f16::dequantize_row(&row, &mut want16);
        crate::bf16::dequantize_row(&row, &mut want_bf);
        for k in available_tiers() {
            let mut got = vec![f32::NAN; n];
            (k.dequantize_row_f16)(&row, &mut got);
            assert!(same(&got, &want16), "f16 [{}] n = {n}", k.tier);
            (k.dequantize_row_bf16)(&row, &mut got);
            assert_eq!(bits(&got), bits(&want_bf), "bf16 [{}] n = {n}", k.tier);
        }
    }
}

/// DeepSeek V4's expert dots: Q2_K and IQ2_XXS blocks of random bytes (any
/// scales) against Q8_K activations as the quantizer makes them (quants in
/// ±127; `sign_epi8` cannot negate -128) and raw ones for Q2_K.
#[test]
fn deepseek4_expert_dots_are_bit_identical_on_every_tier() {
    use crate::iq2_xxs::{self, BlockIQ2_XXS};
    use crate::q2_k::{self, BlockQ2_K};
    use crate::q8_k::{self, BlockQ8_K};
    use crate::QK_K;
    let mut rng = XorShift::new(191);
    for nb in [1, 2, 3, 8, 16] {
        for how in [Scales::AnyFinite, Scales::Typical] {
            let w2: Vec<BlockQ2_K> = (0..nb)
                .map(|_| {
                    let mut b = BlockQ2_K::zeroed();
                    b.scales.iter_mut().for_each(|v| *v = rng.byte());
                    b.qs.iter_mut().for_each(|v| *v = rng.byte());
                    (b.d, b.dmin) = (scale(&mut rng, how), scale(&mut rng, how));
                    b
                })
                .collect();
            let wi: Vec<BlockIQ2_XXS> = (0..nb)
                .map(|_| {
                    let mut b = BlockIQ2_XXS::zeroed();
                    b.qs.iter_mut().for_each(|v| *v = rng.byte());
                    b.d = scale(&mut rng, how);
                    b
                })
                .collect();
            let mut y = vec![BlockQ8_K::ZERO; nb];
            q8_k::quantize_row_ref(&activations(&mut rng, nb * QK_K), &mut y);
            let mut raw = y.clone();
            for b in &mut raw {
                b.qs.iter_mut().for_each(|q| *q = rng.byte() as i8);
                for (s, q) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
                    *s = q.iter().map(|&q| i16::from(q)).sum();
                }
            }
            for k in available_tiers() {
                let case = format!("[{}] {nb} blocks, {how:?}", k.tier);
                for y in [&y, &raw] {
                    let (got, want) = (
                        (k.vec_dot_q2_k_q8_k)(&w2, y),
                        q2_k::vec_dot_q2_K_q8_K(&w2, y),
                    );
                    assert!(same_bits(got, want), "q2_K dot {case}: {got} vs {want}");
                }
                let (got, want) = (
                    (k.vec_dot_iq2_xxs_q8_k)(&wi, &y),
                    iq2_xxs::vec_dot_iq2_xxs_q8_K(&wi, &y),
                );
                assert!(same_bits(got, want), "iq2_xxs dot {case}: {got} vs {want}");
                let mut dec = iq2_xxs::Iq2Decoded::default();
                dec.decode(&wi);
                let got = (k.dot_iq2_decoded_q8_k)(&dec, &y);
                assert!(
                    same_bits(got, want),
                    "iq2_xxs decoded dot {case}: {got} vs {want}"
                );
            }
        }
    }
}

/// The lanes-over-rows serial sums of DeepSeek V4: every lane bitwise the
/// scalar sum of its row (Q8_0 rows of random bytes, -128 included, against
/// f32-scale activations; f16 rows of finite values; f32 vectors), every
/// chain count, lengths around the 8-wide steps.
#[test]
fn deepseek4_serial_sums_are_bit_identical_on_every_tier() {
    use crate::f16::{dot_f16_serial, fp32_to_fp16};
    use crate::serial::{F16x8, Q8_0x16, LANES, Q8_ROWS};
    let mut rng = XorShift::new(192);
    for nb in [1, 2, 5, 32] {
        for n_rows in [8, 16, 29] {
            let rows: Vec<BlockQ8_0> = random_blocks(&mut rng, n_rows * nb, 1, Scales::AnyFinite);
            let packed = Q8_0x16::pack(&rows, nb);
            let one = crate::pool::ThreadPool::new(1);
            let acts: Vec<crate::serial::Q8Acts> = (0..4)
                .map(|_| {
                    let mut a = crate::serial::Q8Acts::default();
                    a.quantize(&one, &activations(&mut rng, nb * QK8_0));
                    a
                })
                .collect();
            for k in available_tiers() {
                for n in 1..=4 {
                    let x: Vec<crate::serial::Q8Row<'_>> =
                        acts[..n].iter().map(|a| a.row(0, nb * QK8_0)).collect();
                    for g in 0..n_rows.div_ceil(Q8_ROWS) {
                        let mut got = vec![[f32::NAN; Q8_ROWS]; n];
                        (k.dot_q8_0x16_f32s)(packed.group(g), &x, &mut got);
                        for (j, got) in got.iter().enumerate() {
                            for (l, &v) in got.iter().enumerate().take(n_rows - Q8_ROWS * g) {
                                let r = Q8_ROWS * g + l;
                                let want = q8_0::vec_dot_q8_0_f32_scales(
                                    &rows[r * nb..(r + 1) * nb],
                                    x[j].qs,
                                    x[j].d,
                                );
                                assert!(
                                    same_bits(v, want),
                                    "q8_0x16 [{}] nb {nb} row {r} act {j}",
                                    k.tier
                                );
                            }
                        }
                    }
                }
            }
        }
    }
    for n in [1, 7, 8, 9, 256, 1025] {
        let rows: Vec<u8> = (0..13 * n)
            .flat_map(|_| fp32_to_fp16(rng.uniform(-2.0, 2.0)))
            .collect();
        let packed = F16x8::pack(&rows, n);
        let xs: Vec<Vec<f32>> = (0..8).map(|_| activations(&mut rng, n)).collect();
        let a = activations(&mut rng, LANES * n);
        for k in available_tiers() {
            for chains in 1..=8 {
                let x: Vec<&[f32]> = xs[..chains].iter().map(|v| &v[..]).collect();
                for g in 0..2 {
                    let mut got = vec![[f32::NAN; LANES]; chains];
                    (k.dots_f16x8_serial)(packed.group(g), &x, &mut got);
                    for (j, got) in got.iter().enumerate() {
                        for (l, &v) in got.iter().enumerate().take(13 - 8 * g) {
                            let r = 8 * g + l;
                            let want = dot_f16_serial(&rows[2 * n * r..2 * n * (r + 1)], x[j]);
                            assert!(
                                same_bits(v, want),
                                "f16x8 [{}] n {n} chain {j} row {r}",
                                k.tier
                            );
                        }
                    }
                }
                if chains > 4 {
                    continue;
                }
                let mut got = vec![[f32::NAN; LANES]; chains];
                (k.dots8_serial)(&a, &x, &mut got);
                let mut want = vec![[0.0; LANES]; chains];
                crate::serial::dots8_serial_ref(&a, &x, &mut want);
                for (g, w) in got.iter().zip(&want) {
                    assert_eq!(bits(g), bits(w), "dots8 [{}] n {n} chains {chains}", k.tier);
                }
            }
            // Sixteen heads: scores against up to eight rows, then the
            // weighted sums of those rows.
            let a16 = activations(&mut rng, crate::serial::HEADS * n);
            for chains in 1..=crate::serial::DOTS16_CHAINS {
                let x: Vec<&[f32]> = xs[..chains].iter().map(|v| &v[..]).collect();
                let mut got = vec![[f32::NAN; crate::serial::HEADS]; chains];
                (k.dots16_serial)(&a16, &x, &mut got);
                let mut want = vec![[0.0; crate::serial::HEADS]; chains];
                crate::serial::dots16_serial_ref(&a16, &x, &mut want);
                for (g, w) in got.iter().zip(&want) {
                    assert_eq!(
                        bits(g),
                        bits(w),
                        "dots16 [{}] n {n} chains {chains}",
                        k.tier
                    );
                }
                let w: Vec<[f32; crate::serial::HEADS]> = (0..chains)
                    .map(|_| std::array::from_fn(|_| rng.uniform(0.0, 1.0)))
                    .collect();
                let mut got = vec![f32::NAN; crate::serial::HEADS * n];
                (k.wsum16_serial)(&w, &x, &mut got);
                let mut want = vec![0.0; crate::serial::HEADS * n];
                crate::serial::wsum16_serial_ref(&w, &x, &mut want);
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "wsum16 [{}] n {n} rows {chains}",
                    k.tier
                );
            }
        }
    }
}
