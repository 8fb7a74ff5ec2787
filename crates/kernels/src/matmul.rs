//! Matrix products of a weight matrix with a batch of activation rows, split over
//! the thread pool by weight rows. Each thread walks its rows once and reuses each
//! row across every token of the batch, so prefill reads the weights once per chunk.

use std::cell::RefCell;

use crate::pool::{split_range, ThreadPool};
use crate::{dequantize_row, vec_dot, QuantizedActivations, WeightFormat};

/// A row-major weight matrix of `n_out` rows of `n_in` elements in one format:
/// ggml's `[n_in, n_out]` tensor.
#[derive(Clone, Copy, Debug)]
pub struct WeightMatrix<'a> {
    pub fmt: WeightFormat,
    pub n_in: usize,
    pub n_out: usize,
    pub data: &'a [u8],
}

impl<'a> WeightMatrix<'a> {
    /// Checks that `data` holds exactly `n_out` rows of `n_in` elements.
    pub fn new(fmt: WeightFormat, n_in: usize, n_out: usize, data: &'a [u8]) -> Option<Self> {
        let row = fmt.row_bytes(n_in)?;
        (row.checked_mul(n_out)? == data.len()).then_some(WeightMatrix {
            fmt,
            n_in,
            n_out,
            data,
        })
    }

    fn row_bytes(&self) -> usize {
        self.data.len() / self.n_out
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }
}

/// A pointer to the output that threads write at disjoint indices.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every thread writes a disjoint set of indices (its own weight rows of each
// token), and `ThreadPool::run` returns only after all threads are done.
unsafe impl Sync for OutPtr {}
// SAFETY: as above.
unsafe impl Send for OutPtr {}

impl OutPtr {
    /// # Safety
    /// `i` is in bounds of the output and no other thread writes index `i`.
    unsafe fn write(self, i: usize, v: f32) {
        // SAFETY: guaranteed by the caller.
        unsafe { *self.0.add(i) = v }
    }
}

/// `out[t * n_out + r] = w.row(r) · act.row(t)` for every token `t` of `act`, with
/// activations already converted to `w.fmt.activation_format()`.
pub fn matmul(
    pool: &ThreadPool,
    w: &WeightMatrix<'_>,
    act: &QuantizedActivations,
    out: &mut [f32],
) {
    let n_tokens = act.rows();
    assert_eq!(act.n(), w.n_in, "activation row length");
    assert_eq!(out.len(), n_tokens * w.n_out, "output size");
    let ptr = OutPtr(out.as_mut_ptr());
    let n_threads = pool.n_threads();
    pool.run(&|ith| {
        for r in split_range(w.n_out, ith, n_threads) {
            let row = w.row(r);
            for t in 0..n_tokens {
                let v = vec_dot(w.fmt, w.n_in, row, act.row(t));
                // SAFETY: r < n_out and t < n_tokens, so the index is in bounds;
                // row r belongs to this thread alone.
                unsafe { ptr.write(t * w.n_out + r, v) };
            }
        }
    });
}

thread_local! {
    static ROW_SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// How [`matmul_f32`] sums a dequantized row against f32 activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum F32Dot {
    /// [`crate::f32::vec_dot_f32`]: the fixed 8-lane order of the scalar reference.
    Reference,
    /// [`crate::f32::vec_dot_f32_fused`]: the fastest order the CPU offers, with
    /// fused multiply-adds where present.
    Fused,
}

/// Every weight row is dequantized exactly and dotted with the f32 activations `x`
/// (`n_tokens` rows of `n_in`): no activation rounding at all.
pub fn matmul_f32(
    pool: &ThreadPool,
    w: &WeightMatrix<'_>,
    x: &[f32],
    out: &mut [f32],
    dot: F32Dot,
) {
    let dot_fn = match dot {
        F32Dot::Reference => crate::f32::vec_dot_f32,
        F32Dot::Fused => crate::f32::vec_dot_f32_fused,
    };
    assert_eq!(x.len() % w.n_in, 0, "activation length");
    let n_tokens = x.len() / w.n_in;
    assert_eq!(out.len(), n_tokens * w.n_out, "output size");
    let ptr = OutPtr(out.as_mut_ptr());
    let n_threads = pool.n_threads();
    pool.run(&|ith| {
        ROW_SCRATCH.with_borrow_mut(|scratch| {
            scratch.resize(w.n_in, 0.0);
            for r in split_range(w.n_out, ith, n_threads) {
                if let Err(e) = dequantize_row(w.fmt, w.row(r), scratch) {
                    panic!("matmul_f32: {e}");
                }
                for (t, xt) in x.chunks_exact(w.n_in).enumerate() {
                    let v = dot_fn(scratch, xt);
                    // SAFETY: in bounds as above; row r belongs to this thread alone.
                    unsafe { ptr.write(t * w.n_out + r, v) };
                }
            }
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::XorShift;
    use crate::{quantize_row, ActivationFormat};

    fn random_matrix(fmt: WeightFormat, n_in: usize, n_out: usize, rng: &mut XorShift) -> Vec<u8> {
        let rb = fmt.row_bytes(n_in).unwrap();
        let mut data = vec![0u8; rb * n_out];
        for r in 0..n_out {
            let x: Vec<f32> = (0..n_in).map(|_| rng.uniform(-1.0, 1.0)).collect();
            quantize_row(fmt, &x, &mut data[r * rb..(r + 1) * rb]).unwrap();
        }
        data
    }

    #[test]
    fn matmul_equals_per_row_dots_on_any_thread_count() {
        let mut rng = XorShift::new(7);
        for fmt in [
            WeightFormat::Q4_1,
            WeightFormat::Q8_0,
            WeightFormat::Q4_K,
            WeightFormat::F32,
        ] {
            let (n_in, n_out, n_tok) = (512, 37, 3);
            let data = random_matrix(fmt, n_in, n_out, &mut rng);
            let w = WeightMatrix::new(fmt, n_in, n_out, &data).unwrap();
            let x: Vec<f32> = (0..n_in * n_tok).map(|_| rng.uniform(-2.0, 2.0)).collect();
            let act = QuantizedActivations::quantize(fmt.activation_format(), &x, n_in).unwrap();
            let want: Vec<f32> = (0..n_tok)
                .flat_map(|t| (0..n_out).map(move |r| (t, r)))
                .map(|(t, r)| vec_dot(fmt, n_in, w.row(r), act.row(t)))
                .collect();
            for threads in [1, 2, 3] {
                let pool = ThreadPool::new(threads);
                let mut out = vec![f32::NAN; n_tok * n_out];
                matmul(&pool, &w, &act, &mut out);
                assert_eq!(out, want, "{} on {threads} threads", fmt.name());
                let mut exact = vec![f32::NAN; n_tok * n_out];
                matmul_f32(&pool, &w, &x, &mut exact, F32Dot::Reference);
                let mut deq = vec![0f32; n_in];
                for t in 0..n_tok {
                    for r in 0..n_out {
                        dequantize_row(fmt, w.row(r), &mut deq).unwrap();
                        let xt = &x[t * n_in..(t + 1) * n_in];
                        let d: f64 = deq.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                        let got = exact[t * n_out + r] as f64;
                        assert!((got - d).abs() <= 1e-4 * (1.0 + d.abs()), "{got} vs {d}");
                    }
                }
            }
            assert_eq!(
                fmt.activation_format() == ActivationFormat::F32,
                fmt == WeightFormat::F32
            );
        }
    }

    #[test]
    fn weight_matrix_checks_its_size() {
        assert!(WeightMatrix::new(WeightFormat::Q4_1, 64, 2, &[0; 80]).is_some());
        assert!(WeightMatrix::new(WeightFormat::Q4_1, 64, 2, &[0; 79]).is_none());
        assert!(WeightMatrix::new(WeightFormat::Q4_1, 63, 2, &[0; 80]).is_none());
    }
}
