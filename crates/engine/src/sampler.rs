//! Token sampling: the logit bias, then greedy, or top-k → top-p → min-p →
//! temperature → draw, the order llama.cpp's default chain uses (filters see
//! the untempered distribution).

/// Sampling parameters. `temperature <= 0` means greedy.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1.0 disables.
    pub top_p: f32,
    /// 0.0 disables.
    pub min_p: f32,
    pub seed: u64,
    /// Added to these tokens' logits before anything else (OpenAI's
    /// `logit_bias`); `-inf` bans a token. Ids past the vocabulary are passed
    /// over (the caller refuses them).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            seed: 0,
            logit_bias: Vec::new(),
        }
    }
}

pub struct Sampler {
    cfg: SamplerConfig,
    rng: SplitMix64,
    candidates: Vec<(u32, f32)>,
    /// The logits with the bias added (kept: a vocabulary's worth per token).
    biased: Vec<f32>,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Self {
        Sampler {
            rng: SplitMix64(cfg.seed),
            cfg,
            candidates: Vec::new(),
            biased: Vec::new(),
        }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Picks the next token from `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.logit_bias.is_empty() {
            return self.pick(logits);
        }
        let mut biased = std::mem::take(&mut self.biased);
        biased.clear();
        biased.extend_from_slice(logits);
        for &(id, b) in &self.cfg.logit_bias {
            if let Some(l) = biased.get_mut(id as usize) {
                *l += b;
            }
        }
        let id = self.pick(&biased);
        self.biased = biased;
        id
    }

    fn pick(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature <= 0.0 {
            return argmax(logits);
        }
        let c = &mut self.candidates;
        c.clear();
        c.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        let by_logit_desc =
            |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if self.cfg.top_k > 0 && self.cfg.top_k < c.len() {
            c.select_nth_unstable_by(self.cfg.top_k - 1, by_logit_desc);
            c.truncate(self.cfg.top_k);
        }
        c.sort_unstable_by(by_logit_desc);

        // Probabilities of the untempered distribution over the survivors.
        let max = c[0].1;
        let mut probs: Vec<f32> = c.iter().map(|&(_, l)| (l - max).exp()).collect();
        let z: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= z);

        let mut keep = c.len();
        if self.cfg.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, p) in probs.iter().enumerate() {
                cum += p;
                if cum >= self.cfg.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        if self.cfg.min_p > 0.0 {
            let floor = probs[0] * self.cfg.min_p;
            keep = keep.min(probs.iter().take_while(|&&p| p >= floor).count().max(1));
        }
        c.truncate(keep);

        let t = self.cfg.temperature;
        let weights: Vec<f64> = c
            .iter()
            .map(|&(_, l)| f64::from((l - max) / t).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut r = self.rng.next_f64() * total;
        for (&(id, _), w) in c.iter().zip(&weights) {
            if r < *w {
                return id;
            }
            r -= w;
        }
        c[c.len() - 1].0
    }
}

/// Index of the largest logit (the first on ties; NaNs are passed over, and a
/// NaN first is kept: what a scan that moves on a strictly greater value gives).
/// Two passes that vectorize, the largest value in 16 lanes then the first
/// chunk holding it, where that scan was one dependent compare per logit
/// (0.7% of SmolLM2's one-thread decode over its 49152).
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    match logits.first() {
        None => return 0,
        Some(x) if x.is_nan() => return 0,
        Some(_) => {}
    }
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &l) in lanes.iter_mut().zip(c) {
            *m = if l > *m { l } else { *m };
        }
    }
    let max = lanes
        .iter()
        .chain(tail)
        .fold(logits[0], |m, &l| if l > m { l } else { m });
    // `==` holds for the first NaN-free maximum (both zeros compare equal, as
    // neither is greater than the other in the scan).
    let at = logits
        .chunks(LANES)
        .position(|c| c.iter().fold(false, |hit, &l| hit | (l == max)))
        .unwrap_or(0);
    let first = logits[at * LANES..]
        .iter()
        .position(|&l| l == max)
        .unwrap_or(0);
    (at * LANES + first) as u32
}

/// The normalizer of a softmax over some logits (their maximum and the log of
/// their exponentials' sum from it, accumulated in f64): any one logit's
/// log-probability without writing them all.
#[derive(Clone, Copy, Debug)]
pub struct LogNorm {
    max: f32,
    lz: f64,
}

impl LogNorm {
    pub fn of(logits: &[f32]) -> Self {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let z: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
        LogNorm { max, lz: z.ln() }
    }

    /// The log-probability of logit `l`.
    pub fn logprob(&self, l: f32) -> f32 {
        (f64::from(l - self.max) - self.lz) as f32
    }
}

/// `log(softmax(logits))`, accumulated in f64.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let norm = LogNorm::of(logits);
    logits.iter().map(|&l| norm.logprob(l)).collect()
}

/// The `k` highest entries as `(id, value)`, best first (lower id first on ties).
pub fn top_k(values: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut v: Vec<(u32, f32)> = values
        .iter()
        .enumerate()
        .map(|(i, &x)| (i as u32, x))
        .collect();
    let k = k.min(v.len());
    let cmp = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if k > 0 && k < v.len() {
        v.select_nth_unstable_by(k - 1, cmp);
    }
    v.truncate(k);
    v.sort_unstable_by(cmp);
    v
}

/// A small, fast, seedable generator (SplitMix64); sampling needs reproducibility,
/// not cryptographic strength.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplerConfig {
        SamplerConfig {
            temperature,
            top_k,
            top_p,
            min_p,
            seed: 42,
            logit_bias: vec![],
        }
    }

    fn histogram(cfg: SamplerConfig, logits: &[f32], n: usize) -> Vec<usize> {
        let mut s = Sampler::new(cfg);
        let mut h = vec![0; logits.len()];
        for _ in 0..n {
            h[s.sample(logits) as usize] += 1;
        }
        h
    }

    #[test]
    fn argmax_is_the_first_strictly_greatest_of_a_scan() {
        fn scan(logits: &[f32]) -> u32 {
            let mut best = 0;
            for (i, &l) in logits.iter().enumerate() {
                if l > logits[best] {
                    best = i;
                }
            }
            best as u32
        }
        let mut x = 9u32;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        };
        let specials = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            3.0,
            -3.0,
        ];
        for n in (0..70).chain([1000, 49152]) {
            for trial in 0..20 {
                let v: Vec<f32> = (0..n)
                    .map(|_| match rnd() % 10 {
                        // Few distinct values: ties everywhere.
                        0..=2 => specials[rnd() as usize % specials.len()],
                        3..=5 => (rnd() % 5) as f32,
                        _ => (rnd() % 20000) as f32 / 100.0 - 100.0,
                    })
                    .collect();
                assert_eq!(argmax(&v), scan(&v), "{n} logits, trial {trial}: {v:?}");
            }
        }
        assert_eq!(argmax(&[-0.0, 0.0, -0.0]), 0);
        assert_eq!(argmax(&[f32::NAN, 5.0]), 0);
        assert_eq!(argmax(&[1.0, f32::NAN, 5.0, 5.0]), 2);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 40]), 0);
    }

    /// The bias moves greedy's choice and every draw's; `-inf` bans a token
    /// even when it is the only one the filters would keep; an id past the
    /// vocabulary changes nothing.
    #[test]
    fn the_logit_bias_comes_before_every_filter() {
        let logits = [0.1, 3.0, 2.9, 1.0];
        let biased = |b: Vec<(u32, f32)>, temperature: f32, top_k: usize| SamplerConfig {
            logit_bias: b,
            ..cfg(temperature, top_k, 1.0, 0.0)
        };
        let mut s = Sampler::new(biased(vec![(2, 0.2)], 0.0, 0));
        assert_eq!(s.sample(&logits), 2);
        let mut s = Sampler::new(biased(vec![(1, -0.2), (99, 50.0)], 0.0, 0));
        assert_eq!(s.sample(&logits), 2);
        let mut s = Sampler::new(biased(vec![(0, 100.0)], 0.0, 0));
        assert_eq!(s.sample(&logits), 0);
        // top_k 1 keeps only the biased argmax: token 1 banned, 2 is drawn.
        let h = histogram(biased(vec![(1, f32::NEG_INFINITY)], 1.0, 1), &logits, 200);
        assert_eq!(h, vec![0, 0, 200, 0]);
        let h = histogram(biased(vec![(1, f32::NEG_INFINITY)], 1.0, 0), &logits, 2000);
        assert_eq!(h[1], 0, "{h:?}");
        assert!(h[2] > h[3] && h[3] > h[0], "{h:?}");
        // The logits themselves are left as they were.
        let mut s = Sampler::new(biased(vec![(3, 9.0)], 0.0, 0));
        assert_eq!(s.sample(&logits), 3);
        assert_eq!(Sampler::new(cfg(0.0, 0, 1.0, 0.0)).sample(&logits), 1);
    }

    #[test]
    fn greedy_takes_the_argmax() {
        let mut s = Sampler::new(cfg(0.0, 0, 1.0, 0.0));
        assert_eq!(s.sample(&[0.1, 3.0, 2.9, 3.0]), 1);
    }

    #[test]
    fn top_k_limits_the_support() {
        let logits = [1.0, 0.9, 0.8, 0.7, 0.6];
        let h = histogram(cfg(1.0, 2, 1.0, 0.0), &logits, 4000);
        assert!(h[0] > 0 && h[1] > 0);
        assert_eq!(h[2..], [0, 0, 0]);
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_reaching_p() {
        // Probabilities 0.5, 0.3, 0.2 (log-space): top_p 0.7 keeps two tokens.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let h = histogram(cfg(1.0, 0, 0.7, 0.0), &logits, 4000);
        assert_eq!(h[2], 0);
        let ratio = h[0] as f64 / h[1] as f64;
        assert!((ratio - 5.0 / 3.0).abs() < 0.25, "{h:?}");
    }

    #[test]
    fn min_p_drops_tokens_below_the_floor() {
        let logits = [0.6f32.ln(), 0.35f32.ln(), 0.05f32.ln()];
        let h = histogram(cfg(1.0, 0, 1.0, 0.1), &logits, 3000);
        assert_eq!(h[2], 0, "0.05 < 0.1 * 0.6");
        assert!(h[1] > 0);
    }

    #[test]
    fn temperature_sharpens_and_seed_reproduces() {
        let logits = [1.0, 0.0];
        let cold = histogram(cfg(0.25, 0, 1.0, 0.0), &logits, 2000);
        let warm = histogram(cfg(2.0, 0, 1.0, 0.0), &logits, 2000);
        // p0 = 1/(1+e^-4) = 0.98 vs 1/(1+e^-0.5) = 0.62.
        assert!(
            cold[0] > 1900 && (1100..1400).contains(&warm[0]),
            "{cold:?} {warm:?}"
        );
        assert_eq!(
            histogram(cfg(1.0, 0, 1.0, 0.0), &logits, 500),
            histogram(cfg(1.0, 0, 1.0, 0.0), &logits, 500)
        );
    }

    #[test]
    fn log_softmax_and_top_k() {
        let lp = log_softmax(&[0.0, 0.0, 2f32.ln() + 0.0]);
        assert!((lp[2] - 0.5f32.ln()).abs() < 1e-6 && (lp[0] - 0.25f32.ln()).abs() < 1e-6);
        assert_eq!(
            top_k(&[0.1, 0.5, 0.5, 0.2], 3),
            vec![(1, 0.5), (2, 0.5), (3, 0.2)]
        );
    }
}
