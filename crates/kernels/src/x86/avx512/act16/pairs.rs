//! Order F2 over Q4_1, Q5_0 and Q8_0 rows laid out in pairs
//! ([`crate::act16::F2Layout::Pairs`]).
//!
//! The decode tile widens a row pair's unit from one 64-byte load (Q4_1: two
//! blocks by three masks and three shifts; Q5_0: the same, then 16 subtracted
//! under each field's mask of fifth bits; Q8_0: one block by three shifts),
//! the words' dword `2l + r` being lane `l` of row `r`, so `vpmaddwd` against
//! an activation block whose every dword is duplicated gives both rows' lane
//! sums interleaved, and each block's two scales `(d0·s, d1·s)` are one 64-bit
//! broadcast from memory (the row layout needs a permutation per row pair,
//! token and block, and four or five operations to widen). The arithmetic is
//! the row layout's: the same exact integer lane sums, the same products
//! `d·s`, the same `fma`s in block order and the same reduction, so the same
//! bits. The batched tiles read the layout through [`widen_panel`] and
//! [`heads`].

use std::arch::x86_64::*;

use super::super::super::avx2::Prefetch;
use super::{
    dpwssd, load8, stream_stretch, Block16x2, DECODE_STREAMS, DEINTERLEAVE, DUP_LOW8,
    PREFETCH_BYTES,
};
use crate::act16::{f2_pair_bytes, pair_chunk_bytes, Act16, F2Rows, CHUNK, QK_ACT16};

/// A chunk's heads of a row pair: its `d`s interleaved and, with a second
/// head, its `m`s (zeros otherwise).
///
/// # Safety
/// `chunk` points at the chunk's heads; the CPU has AVX-512 F.
#[inline(always)]
unsafe fn pair_heads<B: Block16x2>(chunk: *const u8) -> (__m512, __m512) {
    // SAFETY: the caller's guarantees; a second head follows the first.
    unsafe {
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(chunk.cast()));
        let m = match B::HEADS {
            2 => _mm512_cvtph_ps(_mm256_loadu_si256(chunk.add(32).cast())),
            _ => _mm512_setzero_ps(),
        };
        (d, m)
    }
}

/// Row `r`'s `d`s and second heads of chunk `c` (eight each), as
/// [`super::super::super::avx2::f2_heads`] reads them from the row layout.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) fn heads<B: Block16x2>(w: &F2Rows<'_, B>, r: usize, c: usize) -> (__m256, __m256) {
    let at = r / 2 * f2_pair_bytes::<B>(w.nb) + c * pair_chunk_bytes::<B>(CHUNK);
    let h = &w.bytes[at..at + 32 * B::HEADS];
    let pick = if r.is_multiple_of(2) {
        EVEN_LANES
    } else {
        ODD_LANES
    };
    // SAFETY: `h` holds the chunk's heads; AVX-512 F is enabled here.
    let (d, m) = unsafe { pair_heads::<B>(h.as_ptr()) };
    (
        _mm512_castps512_ps256(_mm512_permutexvar_ps(pick, d)),
        _mm512_castps512_ps256(_mm512_permutexvar_ps(pick, m)),
    )
}

/// The even lanes (row 0 of a pair), then anything.
const EVEN_LANES: __m512i = DEINTERLEAVE;
/// The odd lanes (row 1 of a pair), then anything.
const ODD_LANES: __m512i = super::lanes([1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14]);

/// [`super::widen_panel`] for rows `rows` (starting at a pair's first) of
/// the pair layout: each row's blocks as [`super::Block16x2::quants_dup`]
/// gives them, row after row.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) fn widen_panel<B: Block16x2>(
    w: &F2Rows<'_, B>,
    rows: std::ops::Range<usize>,
    out: &mut Vec<[__m512i; 2]>,
) {
    debug_assert!(rows.start.is_multiple_of(2));
    let (nb, pb) = (w.nb, f2_pair_bytes::<B>(w.nb));
    // Dword k: dword 2·(k / 2) + row of the pair's interleaved words.
    let dup = [
        super::lanes([0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14]),
        super::lanes([1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15]),
    ];
    // Grown, never shrunk or cleared: every block of the panel is written
    // below (zeroing it first was 2% of the batched product).
    if out.len() < rows.len() * nb {
        out.resize(rows.len() * nb, [_mm512_setzero_si512(); 2]);
    }
    for r0 in rows.clone().step_by(2) {
        let mut at = r0 / 2 * pb;
        for c in 0..nb.div_ceil(CHUNK) {
            let len = (nb - CHUNK * c).min(CHUNK);
            let q = &w.bytes[at + 32 * B::HEADS..at + pair_chunk_bytes::<B>(len)];
            for u in 0..len.div_ceil(B::PAIR_UNIT) {
                // SAFETY: unit u is 64 readable bytes of `q`; AVX-512 F/BW are
                // enabled here.
                let unit = unsafe { B::pair_unit(q.as_ptr().add(B::PAIR_UNIT_BYTES * u)) };
                for k in 0..B::PAIR_UNIT.min(len - B::PAIR_UNIT * u) {
                    let b = CHUNK * c + B::PAIR_UNIT * u + k;
                    for (h, idx) in dup.iter().enumerate() {
                        if r0 + h == rows.end {
                            break;
                        }
                        out[(r0 + h - rows.start) * nb + b] = [
                            _mm512_permutexvar_epi32(*idx, unit[2 * k]),
                            _mm512_permutexvar_epi32(*idx, unit[2 * k + 1]),
                        ];
                    }
                }
            }
            at += pair_chunk_bytes::<B>(len);
        }
    }
}

/// Each token of one fill of an [`Act16`] (`acts_id`, its
/// [`Act16::fill_id`]) with every dword duplicated (per block the even
/// elements, then the odd) and, per chunk, its scales `s` and sums `σ` with
/// every lane duplicated; kept across calls, as every unit of rows and every
/// matrix of a call takes the same activations.
#[derive(Default)]
struct DupScratch {
    acts_id: u64,
    acts: Vec<[__m512i; 2]>,
    scales: Vec<[__m512; 2]>,
}

thread_local! {
    static DUP_SCRATCH: std::cell::RefCell<DupScratch> =
        std::cell::RefCell::new(DupScratch::default());
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn duplicate(acts: &Act16, sc: &mut DupScratch) {
    if sc.acts_id == acts.fill_id() {
        return;
    }
    let nb = acts.n() / QK_ACT16;
    sc.acts.clear();
    sc.scales.clear();
    for t in 0..acts.rows() {
        let row = acts.row(t);
        for b in 0..nb {
            let x: &[i16; 32] = row.q[32 * b..32 * b + 32].try_into().unwrap();
            // SAFETY: `x` is 64 readable bytes, read as two halves of 32.
            let (e, o) = unsafe {
                (
                    _mm512_castsi256_si512(_mm256_loadu_si256(x.as_ptr().cast())),
                    _mm512_castsi256_si512(_mm256_loadu_si256(x.as_ptr().add(16).cast())),
                )
            };
            sc.acts.push([
                _mm512_permutexvar_epi32(DUP_LOW8, e),
                _mm512_permutexvar_epi32(DUP_LOW8, o),
            ]);
        }
        for c in (0..nb).step_by(CHUNK) {
            sc.scales.push([
                _mm512_permutexvar_ps(DUP_LOW8, load8(row.scale, c)),
                _mm512_permutexvar_ps(DUP_LOW8, load8(row.sum, c)),
            ]);
        }
    }
    sc.acts_id = acts.fill_id();
}

/// `P` row pairs (`pairs`, pair indices into `w`) against `T` tokens: `T·P`
/// registers of two interleaved accumulators. Per chunk each pair's `d`s and
/// `m`s are one load each and its products `d·s` sixteen wide (stored, then
/// broadcast per block); per unit of blocks each pair's quants are widened
/// once for the `T` tokens. Each pair's successor `ahead` pairs on (the same
/// stream of [`decode`]'s walk) is prefetched in bursts over the units, a
/// chunk's share each or at most [`PREFETCH_BURST_LINES`] lines.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // p and t index several arrays at once
fn tile<B: Block16x2, const P: usize, const T: usize, const BY_UNIT: bool>(
    w: &F2Rows<'_, B>,
    pairs: [usize; P],
    acts: [&[[__m512i; 2]]; T],
    scales: [&[[__m512; 2]]; T],
    ahead: usize,
) -> [[[f32; 2]; P]; T] {
    let (nb, pb) = (w.nb, f2_pair_bytes::<B>(w.nb));
    let n_chunks = nb.div_ceil(CHUNK);
    // The successors are requested a chunk's share at a time or, with
    // `BY_UNIT` (where that is more than PREFETCH_BURST_LINES lines at once),
    // in `steps` bursts spread over the units of blocks.
    let n_units = nb.div_ceil(B::PAIR_UNIT);
    let steps = match BY_UNIT {
        true => (P * pb.div_ceil(64))
            .div_ceil(PREFETCH_BURST_LINES)
            .clamp(n_chunks, n_units),
        false => n_chunks,
    };
    // Arrays filled by loops, here and below: closures passed to `map` or
    // `from_fn` do not inline into a function with target features (they
    // inherit them, `from_fn` does not), and the call per unit of blocks
    // returned the widened quants through memory.
    let mut prefetch = [Prefetch::NONE; P];
    for (f, &p) in prefetch.iter_mut().zip(&pairs) {
        *f = Prefetch::new(&w.bytes[p * pb..][..pb], ahead, steps);
    }
    let mut acc = [[_mm512_setzero_ps(); P]; T];
    let mut at = 0;
    let (mut unit, mut next_step) = (0, 0);
    for c in 0..n_chunks {
        if !BY_UNIT {
            for p in &prefetch {
                p.step(c);
            }
        }
        let len = (nb - CHUNK * c).min(CHUNK);
        let mut chunk = [std::ptr::null::<u8>(); P];
        for (c, &p) in chunk.iter_mut().zip(&pairs) {
            *c = w.bytes[p * pb + at..][..pair_chunk_bytes::<B>(len)].as_ptr();
        }
        let mut cs = [[_mm512_setzero_ps(); P]; T];
        for p in 0..P {
            // SAFETY: a chunk starts with its heads; AVX-512 F is enabled here.
            let (d, _) = unsafe { pair_heads::<B>(chunk[p]) };
            for t in 0..T {
                cs[t][p] = _mm512_mul_ps(d, scales[t][c][0]);
            }
        }
        let cs = cs.as_ptr().cast::<f64>();
        for u in 0..len.div_ceil(B::PAIR_UNIT) {
            // Step s at the first unit u with u·steps >= s·n_units: each
            // once, as steps <= n_units.
            if BY_UNIT && unit * steps >= next_step * n_units {
                for p in &prefetch {
                    p.step(next_step);
                }
                next_step += 1;
            }
            unit += 1;
            let mut wq = [[_mm512_setzero_si512(); 4]; P];
            for p in 0..P {
                // SAFETY: the chunk holds its units of 64 bytes after its
                // heads; AVX-512 F/BW are enabled here.
                wq[p] =
                    unsafe { B::pair_unit(chunk[p].add(32 * B::HEADS + B::PAIR_UNIT_BYTES * u)) };
            }
            for half in 0..B::PAIR_UNIT.min(len - B::PAIR_UNIT * u) {
                let j = B::PAIR_UNIT * u + half;
                for t in 0..T {
                    let [xe, xo] = acts[t][CHUNK * c + j];
                    for p in 0..P {
                        let sums = dpwssd(
                            _mm512_madd_epi16(wq[p][2 * half], xe),
                            wq[p][2 * half + 1],
                            xo,
                        );
                        // SAFETY: `cs` holds T·P vectors of eight pairs; j < 8.
                        let cb = _mm512_castpd_ps(_mm512_set1_pd(unsafe {
                            *cs.add((t * P + p) * CHUNK + j)
                        }));
                        acc[t][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), cb, acc[t][p]);
                    }
                }
            }
        }
        at += pair_chunk_bytes::<B>(len);
    }
    // The m·σ terms in a pass of their own, each register's in chunk order as
    // before (same bits): beside the quants' they held T·P more registers
    // live through the hot loop above.
    let mut macc = [[_mm512_setzero_ps(); P]; T];
    if B::HAS_MIN {
        let mut at = 0;
        for c in 0..n_chunks {
            for p in 0..P {
                // SAFETY: as above.
                let (_, m) = unsafe { pair_heads::<B>(w.bytes[pairs[p] * pb + at..].as_ptr()) };
                for t in 0..T {
                    macc[t][p] = _mm512_fmadd_ps(m, scales[t][c][1], macc[t][p]);
                }
            }
            at += pair_chunk_bytes::<B>((nb - CHUNK * c).min(CHUNK));
        }
    }
    super::interleaved_sums(acc, B::HAS_MIN.then_some(macc))
}

/// Most lines a decode tile requests at once: about the miss buffers of a
/// core (Zen 4: 24). A burst past them stalls the tile until memory answers.
/// Gemma 3's Q8_0 head (640x262144, one token: 4 pairs of 22 lines, 3
/// chunks), 30 alternating timings in one process on Zen 4: a chunk's 32
/// lines at once min/median 7.21/8.01 ms, 22-24 at once 6.73/7.14 (and the
/// row layout 8.09/8.23). Fewer at once (12-16) measured slower again.
const PREFETCH_BURST_LINES: usize = 24;

/// Tokens of a decode tile in pairs: one token takes a pair from each of the
/// [`DECODE_STREAMS`] stretches, more take two pairs at a time (their
/// accumulators fill the registers).
const PAIR_TOKENS: usize = 4;

/// [`crate::act16::gemm_q4_1_ref`] (or its Q8_0 twin) for a few tokens on rows
/// in pairs: the tiles' pairs come from [`DECODE_STREAMS`] stretches of the
/// pairs, one of each, so that the reads are that many sequential streams; the
/// tokens in groups of up to [`PAIR_TOKENS`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) fn decode<B: Block16x2>(w: &F2Rows<'_, B>, acts: &Act16, out: &mut [f32]) {
    let (n_rows, n_tok) = (w.n_rows, acts.rows());
    let n_pairs = n_rows.div_ceil(2);
    let pb = f2_pair_bytes::<B>(w.nb);
    let stretch = stream_stretch(n_pairs, pb);
    let ahead = (PREFETCH_BYTES / pb).max(1);
    DUP_SCRATCH.with_borrow_mut(|sc| {
        duplicate(acts, sc);
        for i in 0..stretch {
            let pairs: [usize; DECODE_STREAMS] =
                std::array::from_fn(|k| (k * stretch + i).min(n_pairs - 1));
            let mut t0 = 0;
            while t0 < n_tok {
                let run = Run {
                    w,
                    sc,
                    t0,
                    n_tok,
                    ahead,
                };
                t0 += match n_tok - t0 {
                    1 => run.tile::<DECODE_STREAMS, 1>(pairs, out),
                    2 => run.two_by_two::<2>(pairs, out),
                    3 => run.two_by_two::<3>(pairs, out),
                    _ => run.two_by_two::<PAIR_TOKENS>(pairs, out),
                };
            }
        }
    });
}

/// Tokens `t0..` of [`decode`]'s walk against some of its pairs.
struct Run<'a, 'b, B> {
    w: &'a F2Rows<'b, B>,
    sc: &'a DupScratch,
    t0: usize,
    n_tok: usize,
    ahead: usize,
}

impl<B: Block16x2> Run<'_, '_, B> {
    /// Tokens `t0..t0 + T` against `pairs`, their results in place; returns `T`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn tile<const P: usize, const T: usize>(&self, pairs: [usize; P], out: &mut [f32]) -> usize {
        let (nb, n_rows) = (self.w.nb, self.w.n_rows);
        let n_chunks = nb.div_ceil(CHUNK);
        let tok = |t: usize| (self.t0 + t).min(self.n_tok - 1);
        let (mut acts, mut scales) = ([&[][..]; T], [&[][..]; T]);
        for t in 0..T {
            acts[t] = &self.sc.acts[tok(t) * nb..][..nb];
            scales[t] = &self.sc.scales[tok(t) * n_chunks..][..n_chunks];
        }
        let pair_lines = f2_pair_bytes::<B>(nb).div_ceil(64);
        // One token only: more take two pairs at a time, under the limit.
        let v = match T == 1 && P * pair_lines > PREFETCH_BURST_LINES * n_chunks {
            true => tile::<B, P, T, true>(self.w, pairs, acts, scales, self.ahead),
            false => tile::<B, P, T, false>(self.w, pairs, acts, scales, self.ahead),
        };
        for (t, v) in v.iter().enumerate() {
            for (k, v) in v.iter().enumerate() {
                for (h, v) in v.iter().enumerate() {
                    let r = 2 * pairs[k] + h;
                    if r < n_rows {
                        out[(self.t0 + t) * n_rows + r] = *v;
                    }
                }
            }
        }
        T
    }

    /// Tokens `t0..t0 + T` against `pairs` two at a time; returns `T`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn two_by_two<const T: usize>(&self, pairs: [usize; DECODE_STREAMS], out: &mut [f32]) -> usize {
        for two in pairs.chunks_exact(2) {
            self.tile::<2, T>([two[0], two[1]], out);
        }
        T
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::act16::F2Matrix;
    use crate::q4_1::BlockQ4_1;
    use crate::q8_0::BlockQ8_0;
    use crate::testing::XorShift;

    fn q4_1_rows(rng: &mut XorShift, n_rows: usize, nb: usize) -> Vec<BlockQ4_1> {
        let mut v: Vec<BlockQ4_1> = vec![bytemuck::Zeroable::zeroed(); n_rows * nb];
        for b in bytemuck::cast_slice_mut::<BlockQ4_1, u8>(&mut v) {
            *b = rng.byte();
        }
        for b in &mut v {
            b.d = crate::f16::fp32_to_fp16(rng.uniform(0.001, 0.02));
            b.m = crate::f16::fp32_to_fp16(rng.uniform(-0.1, 0.0));
        }
        v
    }

    fn avx512() -> Option<&'static crate::Kernels> {
        crate::available_tiers()
            .into_iter()
            .find(|k| k.tier == "avx512")
    }

    #[test]
    #[ignore = "timing; run with --ignored --nocapture"]
    fn bench_pairs() {
        use crate::testing::best_ns;
        use std::hint::black_box;
        let Some(k) = avx512() else {
            return;
        };
        let mut rng = XorShift::new(9);
        // In cache, and matrices far past the last-level cache (as in decode):
        // Q4_1 rows of SmolLM2's shapes, its Q8_0 output head and Gemma 3's.
        for (n_in, n_out, q8) in [
            (576, 1536, false),
            (1536, 576, false),
            (576, 4 * 49152, false),
            (576, 49152, true),
            (640, 262144, true),
        ] {
            let nb = n_in / 32;
            let w = q4_1_rows(&mut rng, n_out, nb);
            let w8: Vec<BlockQ8_0> = bytemuck::cast_slice::<u8, BlockQ8_0>(
                &(0..n_out * nb * 34)
                    .map(|_| rng.byte() & 0x3F)
                    .collect::<Vec<_>>(),
            )
            .to_vec();
            let (rows, pairs) = match q8 {
                false => (F2Matrix::pack(&w, nb), F2Matrix::pack_pairs(&w, nb)),
                true => (F2Matrix::pack(&w8, nb), F2Matrix::pack_pairs(&w8, nb)),
            };
            for n_tok in [1, 2, 4, 8] {
                let mut a = Act16::default();
                a.quantize(&rng.vec_uniform(n_tok * n_in, -1.0, 1.0), n_in);
                let mut out = vec![0.0; n_out * n_tok];
                let mut time = |m: &F2Matrix| match q8 {
                    false => {
                        best_ns(|| (k.gemm_q4_1_act16)(black_box(m.rows(0..n_out)), &a, &mut out))
                    }
                    true => {
                        best_ns(|| (k.gemm_q8_0_act16)(black_box(m.rows(0..n_out)), &a, &mut out))
                    }
                };
                let (old, new) = (time(&rows), time(&pairs));
                let gb = (n_out * nb * if q8 { 34 } else { 20 }) as f64;
                println!(
                    "{n_in}x{n_out} {}, {n_tok} tokens: rows {:.1} us ({:.1} GB/s), \
                     pairs {:.1} us ({:.1} GB/s)",
                    if q8 { "q8_0" } else { "q4_1" },
                    old / 1e3,
                    gb / old,
                    new / 1e3,
                    gb / new
                );
            }
        }
        // Q5_0 of Gemma 3's shapes (its q, k, gate and up matrices).
        for (n_in, n_out) in [(640, 1024), (640, 2048), (640, 4 * 32768)] {
            let nb = n_in / 32;
            let w: Vec<crate::q5_0::BlockQ5_0> =
                bytemuck::cast_slice(&(0..n_out * nb * 22).map(|_| rng.byte()).collect::<Vec<_>>())
                    .to_vec();
            let (rows, pairs) = (F2Matrix::pack(&w, nb), F2Matrix::pack_pairs(&w, nb));
            for n_tok in [1, 2, 4, 8] {
                let mut a = Act16::default();
                a.quantize(&rng.vec_uniform(n_tok * n_in, -1.0, 1.0), n_in);
                let mut out = vec![0.0; n_out * n_tok];
                let mut time = |m: &F2Matrix| {
                    best_ns(|| (k.gemm_q5_0_act16)(black_box(m.rows(0..n_out)), &a, &mut out))
                };
                let (old, new) = (time(&rows), time(&pairs));
                let gb = (n_out * nb * 22) as f64;
                println!(
                    "{n_in}x{n_out} q5_0, {n_tok} tokens: rows {:.1} us ({:.1} GB/s), \
                     pairs {:.1} us ({:.1} GB/s)",
                    old / 1e3,
                    gb / old,
                    new / 1e3,
                    gb / new
                );
            }
        }
    }
}
