//! Test support: a deterministic PRNG and comparison helpers. Test builds only.

/// xorshift64* — small, deterministic, good enough for test data.
pub(crate) struct XorShift(u64);

impl XorShift {
    pub(crate) fn new(seed: u64) -> Self {
        // Never zero (a zero state stays zero); mix the seed a little.
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1) with 24 random bits.
    pub(crate) fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    pub(crate) fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.next_f32()
    }

    pub(crate) fn vec_uniform(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }

    /// Roughly Gaussian (sum of 4 uniforms, centred), scaled by `sigma`, with
    /// an occasional 8σ outlier: closer to real weights than plain uniforms.
    pub(crate) fn vec_weights(&mut self, n: usize, sigma: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let g: f32 = (0..4).map(|_| self.next_f32()).sum::<f32>() - 2.0;
                let outlier = self.next_u64().is_multiple_of(97);
                sigma * g * if outlier { 8.0 } else { 1.7 }
            })
            .collect()
    }

    /// Heavy-tailed values (cubes of [`Self::vec_weights`]): within one
    /// super-block, sub-block ranges differ by orders of magnitude, which
    /// drives the K-quant 6-bit sub-block scales to 0 and 1 and makes the
    /// requantization clamp.
    pub(crate) fn vec_heavy(&mut self, n: usize) -> Vec<f32> {
        self.vec_weights(n, 1.0)
            .into_iter()
            .map(|v| v * v * v)
            .collect()
    }

    pub(crate) fn byte(&mut self) -> u8 {
        (self.next_u64() >> 56) as u8
    }
}

/// Dot product in f64, the reference for every f32 kernel.
pub(crate) fn dot_f64(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// Asserts |got[i] - want[i]| <= tol[i] for all i; on failure reports the
/// max abs error, max rel error and the first bad index.
pub(crate) fn check_close(name: &str, got: &[f32], want: &[f32], tol: impl Fn(usize) -> f32) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let mut max_abs = 0.0f32;
    let mut max_rel = 0.0f32;
    let mut first_bad = None;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        max_abs = max_abs.max(err);
        if w != 0.0 {
            max_rel = max_rel.max(err / w.abs());
        }
        if first_bad.is_none() && (err > tol(i) || err.is_nan()) {
            first_bad = Some(i);
        }
    }
    if let Some(i) = first_bad {
        panic!(
            "{name}: max abs err {max_abs:e}, max rel err {max_rel:e}; first bad index {i}: \
             got {}, want {}, tol {:e}",
            got[i],
            want[i],
            tol(i)
        );
    }
}

/// The fastest of `f`'s runs over about half a second, in nanoseconds (after
/// one warm-up run): the ignored timing tests' measure.
pub(crate) fn best_ns(mut f: impl FnMut()) -> f64 {
    f();
    let start = std::time::Instant::now();
    let mut best = f64::INFINITY;
    while start.elapsed().as_secs_f64() < 0.5 {
        let t = std::time::Instant::now();
        f();
        best = best.min(t.elapsed().as_nanos() as f64);
    }
    best
}
