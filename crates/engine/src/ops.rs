//! The blocks the transformer families share: RMSNorm, rotary embeddings, causal
//! attention over a per-head K/V cache, SwiGLU, and projection through a weight
//! matrix in either precision.

use ds4_kernels::matmul::{matmul, matmul_f32, F32Dot, WeightMatrix};
use ds4_kernels::pool::ThreadPool;
use ds4_kernels::{ActivationFormat, QuantizedActivations};

/// How matrix products treat activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    /// Weights dequantized exactly, f32 activations, SIMD dot products with fused
    /// multiply-adds: the exact result up to float summation order.
    #[default]
    Fast,
    /// Weights dequantized exactly and dotted with f32 activations in the scalar
    /// reference order: what the golden vectors' `f32_reference/` files compute.
    Exact,
    /// Activations rounded to 8-bit blocks (Q8_0 / Q8_K) and integer dot products,
    /// as llama.cpp's CPU path does (its numerics, its 0.1-1 nat scatter).
    Q8,
}

/// `out = x / rms(x) * w` over each row of `w.len()` elements. The mean of squares
/// is accumulated in f64, as ggml does.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let ss: f64 = xr.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let scale = (1.0 / (ss / n as f64 + f64::from(eps)).sqrt()) as f32;
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * scale * g;
        }
    }
}

/// Rotary position embedding tables: `inv_freq[i] = base^(-2i / n_rot)`.
pub struct Rope {
    inv_freq: Vec<f64>,
}

impl Rope {
    pub fn new(base: f32, n_rot: usize) -> Self {
        let inv_freq = (0..n_rot / 2)
            .map(|i| f64::from(base).powf(-2.0 * i as f64 / n_rot as f64))
            .collect();
        Rope { inv_freq }
    }

    /// Rotates adjacent pairs `(2i, 2i+1)` of the first `n_rot` dims of every head
    /// (ggml's "normal" mode, which GGUF llama weights are permuted for).
    pub fn apply_interleaved(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        for head in x.chunks_exact_mut(head_dim) {
            for (i, &f) in self.inv_freq.iter().enumerate() {
                let (s, c) = (pos as f64 * f).sin_cos();
                let (s, c) = (s as f32, c as f32);
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * c - b * s;
                head[2 * i + 1] = a * s + b * c;
            }
        }
    }
}

/// `silu(gate) * up`, in place in `gate`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Activation buffers for each activation format, reused across matmuls.
pub struct Activations {
    q8_0: QuantizedActivations,
    q8_k: QuantizedActivations,
    f32: QuantizedActivations,
}

impl Activations {
    pub fn new(max_elements: usize) -> Self {
        Activations {
            q8_0: QuantizedActivations::new(ActivationFormat::Q8_0, max_elements),
            q8_k: QuantizedActivations::new(ActivationFormat::Q8_K, max_elements),
            f32: QuantizedActivations::new(ActivationFormat::F32, max_elements),
        }
    }

    fn slot(&mut self, f: ActivationFormat) -> &mut QuantizedActivations {
        match f {
            ActivationFormat::Q8_0 => &mut self.q8_0,
            ActivationFormat::Q8_K => &mut self.q8_k,
            ActivationFormat::F32 => &mut self.f32,
        }
    }
}

/// Projects `x` (rows of `n_in`) through every matrix in `ws`, writing `outs[i]`.
/// With 8-bit activations `x` is converted once per activation format the matrices
/// need, however many matrices share it.
pub fn project(
    pool: &ThreadPool,
    precision: Precision,
    acts: &mut Activations,
    x: &[f32],
    ws: &[&WeightMatrix<'_>],
    outs: &mut [&mut [f32]],
) {
    match precision {
        Precision::Exact | Precision::Fast => {
            let dot = if precision == Precision::Exact {
                F32Dot::Reference
            } else {
                F32Dot::Fused
            };
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                matmul_f32(pool, w, x, out, dot);
            }
        }
        Precision::Q8 => {
            let mut filled: [Option<ActivationFormat>; 3] = [None; 3];
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                let f = w.fmt.activation_format();
                if !filled.contains(&Some(f)) {
                    if let Err(e) = acts.slot(f).requantize(x, w.n_in) {
                        panic!("activation length is validated at load: {e}");
                    }
                    if let Some(free) = filled.iter_mut().find(|s| s.is_none()) {
                        *free = Some(f);
                    }
                }
                matmul(pool, w, acts.slot(f), out);
            }
        }
    }
}

/// Causal attention for a batch of query rows at positions `pos0..pos0 + n_tokens`.
///
/// `q` is `[n_tokens][n_head][head_dim]`; `k_cache`/`v_cache` are
/// `[n_head_kv][n_ctx][head_dim]` and already hold every position up to the last
/// query. Each query attends to positions `0..=its own`. Output like `q`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    pool: &ThreadPool,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    n_ctx: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    pos0: usize,
    out: &mut [f32],
) {
    let group = n_head / n_head_kv;
    let scale = 1.0 / (head_dim as f32).sqrt();
    pool.for_each_chunk_mut(out, head_dim, &|idx, o| {
        let (t, h) = (idx / n_head, idx % n_head);
        let kvh = h / group;
        let n_kv = pos0 + t + 1;
        let qh = &q[idx * head_dim..(idx + 1) * head_dim];
        let ks = &k_cache[kvh * n_ctx * head_dim..][..n_kv * head_dim];
        let vs = &v_cache[kvh * n_ctx * head_dim..][..n_kv * head_dim];
        SCORES.with_borrow_mut(|scores| {
            scores.clear();
            scores.extend(
                ks.chunks_exact(head_dim)
                    .map(|k| ds4_kernels::f32::vec_dot_f32(qh, k) * scale),
            );
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f64;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += f64::from(*s);
            }
            let inv = (1.0 / sum) as f32;
            o.fill(0.0);
            for (&p, v) in scores.iter().zip(vs.chunks_exact(head_dim)) {
                let p = p * inv;
                for (oi, &vi) in o.iter_mut().zip(v) {
                    *oi += p * vi;
                }
            }
        });
    });
}

thread_local! {
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_definition() {
        let x = [1.0f32, -2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 2.0];
        let w = [1.0f32, 0.5, 2.0, 1.0];
        let mut out = [0f32; 8];
        rms_norm(&x, &w, 1e-6, &mut out);
        let r0 = ((1.0 + 4.0 + 9.0 + 16.0) / 4.0f64 + 1e-6).sqrt();
        let want0 = [1.0 / r0, -2.0 * 0.5 / r0, 3.0 * 2.0 / r0, 4.0 / r0];
        for (g, w) in out[..4].iter().zip(want0) {
            assert!((f64::from(*g) - w).abs() < 1e-6);
        }
        let r1 = (4.0 / 4.0f64 + 1e-6).sqrt();
        assert!((f64::from(out[7]) - 2.0 / r1).abs() < 1e-6);
        assert_eq!(out[4], 0.0);
    }

    #[test]
    fn rope_rotates_pairs_and_preserves_norm() {
        let rope = Rope::new(10_000.0, 4);
        let mut x = [1.0f32, 0.0, 0.0, 1.0];
        rope.apply_interleaved(&mut x, 4, 0);
        assert_eq!(x, [1.0, 0.0, 0.0, 1.0], "position 0 is the identity");
        rope.apply_interleaved(&mut x, 4, 3);
        // Pair 0 turns by 3 rad, pair 1 by 3 * 10000^(-1/2) rad.
        assert!((x[0] - 3f32.cos()).abs() < 1e-6 && (x[1] - 3f32.sin()).abs() < 1e-6);
        let a = 3.0f64 * 0.01;
        assert!(
            (f64::from(x[2]) + a.sin()).abs() < 1e-6 && (f64::from(x[3]) - a.cos()).abs() < 1e-6
        );
    }

    #[test]
    fn attention_is_causal_softmax_over_cache() {
        // One kv head shared by two query heads, head_dim 2, three positions.
        let (n_ctx, hd) = (4, 2);
        let mut k = vec![0f32; n_ctx * hd];
        let mut v = vec![0f32; n_ctx * hd];
        k[..6].copy_from_slice(&[1.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
        v[..6].copy_from_slice(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let q = [1.0f32, 0.0, 0.0, 2.0, 1.0, 1.0, 0.0, 0.0];
        let mut out = vec![0f32; 8];
        let pool = ThreadPool::new(2);
        attention(&pool, &q, &k, &v, n_ctx, 2, 1, hd, 1, &mut out);
        let s = 1.0 / 2f64.sqrt();
        let expect = |scores: &[f64]| {
            let m = scores.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            let vs = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]];
            [0, 1].map(|d| e.iter().zip(vs).map(|(p, v)| p / z * v[d]).sum::<f64>())
        };
        // Token 0 sits at position 1: sees positions 0 and 1.
        let t0h0 = expect(&[s, 0.0]);
        let t0h1 = expect(&[0.0, 2.0 * s]);
        // Token 1 at position 2 sees all three.
        let t1h0 = expect(&[s, s, 2.0 * s]);
        let t1h1 = expect(&[0.0, 0.0, 0.0]);
        let want = [t0h0, t0h1, t1h0, t1h1].concat();
        for (g, w) in out.iter().zip(want) {
            assert!((f64::from(*g) - w).abs() < 1e-5, "{out:?}");
        }
    }
}
