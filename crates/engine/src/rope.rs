//! RoPE scaling: running a model past the context it was trained on by stretching
//! its rotary frequencies, the two methods as llama.cpp defines them, and the
//! policy that picks one for a session.
//!
//! - Linear (position interpolation): every angle times `freq_scale = 1/factor`.
//! - YaRN (Peng et al. 2023, ggml's `rope_yarn`): pair `i`'s angle is
//!   `θ_interp·(1 - r_i) + θ_extrap·r_i` with `θ_interp = freq_scale·θ_extrap` and
//!   `r_i = 1 - clamp((i - low) / max(0.001, high - low), 0, 1)`, where
//!   `[low, high]` are the correction dims (`ggml_rope_yarn_corr_dims`) for
//!   `beta_fast = 32` and `beta_slow = 1` rotations over the original context:
//!   fast pairs (`i <= low`) keep their angle, slow ones (`i >= high`) are
//!   interpolated, the ramp blends between. With the attention temperature on,
//!   the rotated values' `cos` and `sin` are multiplied by
//!   `mscale = 1 + 0.1·ln(factor)` (so attention logits by its square), as
//!   llama.cpp does for every YaRN model (`ext_factor` 1, `attn_factor` 1).
//!
//! The temperature is on only for a model whose file declares YaRN (it was
//! trained or tuned that way) or on request (`--yarn-attn-temperature`). A model
//! stretched past a context it never saw is better without it: on SmolLM2,
//! measured with `ds4 perplexity` over the same tokens, YaRN x2 at 16k gives
//! 21.72 with the temperature and 22.02 without (21.26 unscaled at 8k), but
//! with it greedy answers to short chats change for the worse ("What is the
//! capital of France?" no longer gets "Paris"), while without it they stay the
//! unscaled model's: short prompts live in the high-frequency pairs YaRN keeps.
//!
//! A factor of 1 is no scaling under either method (the angles and magnitudes are
//! unchanged), and is normalised to [`RopeScaling::NONE`].

use std::f64::consts::PI;

use crate::error::{EngineError, Result};

/// YaRN's rotation counts bounding the ramp (llama.cpp's defaults).
pub const YARN_BETA_FAST: f64 = 32.0;
pub const YARN_BETA_SLOW: f64 = 1.0;

/// Without an explicit `--rope-scale`, a session may be at most this many times
/// the model's trained context.
pub const MAX_AUTO_CTX_MULTIPLE: usize = 4;

/// A RoPE scaling method.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RopeScalingType {
    /// The trained frequencies, unchanged.
    #[default]
    None,
    /// Position interpolation: every frequency divided by the factor.
    Linear,
    /// YaRN: high frequencies kept, low ones divided, a ramp between, magnitudes
    /// scaled by `1 + 0.1·ln(factor)`.
    Yarn,
}

impl RopeScalingType {
    pub fn name(self) -> &'static str {
        match self {
            RopeScalingType::None => "none",
            RopeScalingType::Linear => "linear",
            RopeScalingType::Yarn => "yarn",
        }
    }
}

impl std::fmt::Display for RopeScalingType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for RopeScalingType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "none" => Ok(RopeScalingType::None),
            "linear" => Ok(RopeScalingType::Linear),
            "yarn" => Ok(RopeScalingType::Yarn),
            _ => Err(format!("RoPE scaling {s:?}: expected none, linear or yarn")),
        }
    }
}

/// The scaling a session's rotary embeddings run with.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeScaling {
    pub kind: RopeScalingType,
    /// Context multiple, at least 1 (exactly 1 for [`RopeScalingType::None`]).
    pub factor: f32,
    /// The context the frequencies were trained for (YaRN's correction dims);
    /// 0 for [`RopeScalingType::None`].
    pub n_ctx_orig: usize,
    /// YaRN's attention temperature (`mscale`); false for the other methods.
    pub attn_temperature: bool,
}

impl RopeScaling {
    pub const NONE: RopeScaling = RopeScaling {
        kind: RopeScalingType::None,
        factor: 1.0,
        n_ctx_orig: 0,
        attn_temperature: false,
    };

    /// A scaling without YaRN's attention temperature, normalised: a factor of
    /// 1 (or the `None` method) is [`NONE`](Self::NONE). The factor must be
    /// finite and at least 1.
    pub fn new(kind: RopeScalingType, factor: f32, n_ctx_orig: usize) -> Result<Self> {
        check_factor(factor)?;
        if kind == RopeScalingType::None || factor == 1.0 {
            return Ok(Self::NONE);
        }
        Ok(RopeScaling {
            kind,
            factor,
            n_ctx_orig: n_ctx_orig.max(1),
            attn_temperature: false,
        })
    }

    /// The same scaling with YaRN's attention temperature on or off (it exists
    /// only for YaRN).
    pub fn with_attn_temperature(self, on: bool) -> Self {
        RopeScaling {
            attn_temperature: on && self.kind == RopeScalingType::Yarn,
            ..self
        }
    }

    pub fn is_none(&self) -> bool {
        self.kind == RopeScalingType::None
    }

    /// `1 / factor`, ggml's `freq_scale`.
    pub fn freq_scale(&self) -> f64 {
        1.0 / f64::from(self.factor)
    }

    /// What the rotated values' `cos` and `sin` are multiplied by: YaRN's
    /// `1 + 0.1·ln(factor)` with the attention temperature, else 1.
    pub fn mscale(&self) -> f64 {
        if self.attn_temperature {
            1.0 + 0.1 * f64::from(self.factor).ln()
        } else {
            1.0
        }
    }

    /// Per rotated pair `i` of `n_rot` dims, what its trained angle `pos·base^(-2i/n_rot)`
    /// is multiplied by: 1 without scaling, `freq_scale` for linear, YaRN's blend
    /// `freq_scale·(1 - r_i) + r_i`.
    pub fn angle_multipliers(&self, base: f32, n_rot: usize) -> Vec<f64> {
        let n_pairs = n_rot / 2;
        match self.kind {
            RopeScalingType::None => vec![1.0; n_pairs],
            RopeScalingType::Linear => vec![self.freq_scale(); n_pairs],
            RopeScalingType::Yarn => {
                let [low, high] = yarn_corr_dims(
                    n_rot,
                    self.n_ctx_orig,
                    f64::from(base),
                    YARN_BETA_FAST,
                    YARN_BETA_SLOW,
                );
                let fs = self.freq_scale();
                (0..n_pairs)
                    .map(|i| {
                        let r = yarn_ramp(low, high, i);
                        fs * (1.0 - r) + r
                    })
                    .collect()
            }
        }
    }

    /// Folds this scaling into a state fingerprint: unchanged without scaling (so
    /// checkpoints of unscaled sessions keep their fingerprint), else a hash of it,
    /// the method, the factor's bits and the original context.
    pub fn fold_fingerprint(&self, fp: [u8; 16]) -> [u8; 16] {
        if self.is_none() {
            return fp;
        }
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(&fp);
        h.update(b"ds4 rope-scaling ");
        h.update(self.kind.name().as_bytes());
        if self.kind == RopeScalingType::Yarn {
            h.update(format!(" beta {YARN_BETA_FAST} {YARN_BETA_SLOW}").as_bytes());
            h.update(if self.attn_temperature {
                b" temperature on"
            } else {
                b" temperature off"
            });
        }
        h.update(&self.factor.to_bits().to_le_bytes());
        h.update(&(self.n_ctx_orig as u64).to_le_bytes());
        h.digest128().to_le_bytes()
    }
}

impl std::fmt::Display for RopeScaling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            RopeScalingType::None => f.write_str("none"),
            k => write!(
                f,
                "{k} x{} (original context {}{})",
                self.factor,
                self.n_ctx_orig,
                if self.attn_temperature {
                    ", attention temperature"
                } else {
                    ""
                }
            ),
        }
    }
}

fn check_factor(factor: f32) -> Result<()> {
    if factor.is_finite() && factor >= 1.0 {
        Ok(())
    } else {
        Err(EngineError::BadRopeScaling {
            reason: format!("the factor must be a finite number >= 1, got {factor}"),
        })
    }
}

/// The dimension (in pairs, fractional) at which a pair turns `n_rotations` times
/// over `n_ctx_orig` positions: `n_rot·ln(n_ctx_orig / (2π·n_rotations)) / (2·ln base)`
/// (ggml's `ggml_rope_yarn_corr_dim`).
pub fn yarn_corr_dim(n_rot: usize, n_ctx_orig: usize, n_rotations: f64, base: f64) -> f64 {
    n_rot as f64 * (n_ctx_orig as f64 / (n_rotations * 2.0 * PI)).ln() / (2.0 * base.ln())
}

/// `[low, high]`: the floor of the `beta_fast` dim and the ceiling of the
/// `beta_slow` one, clamped to `[0, n_rot - 1]` (ggml's `ggml_rope_yarn_corr_dims`).
pub fn yarn_corr_dims(
    n_rot: usize,
    n_ctx_orig: usize,
    base: f64,
    beta_fast: f64,
    beta_slow: f64,
) -> [f64; 2] {
    let low = yarn_corr_dim(n_rot, n_ctx_orig, beta_fast, base).floor();
    let high = yarn_corr_dim(n_rot, n_ctx_orig, beta_slow, base).ceil();
    [low.max(0.0), high.min(n_rot as f64 - 1.0)]
}

/// How much of pair `i`'s trained angle YaRN keeps: 1 up to `low`, 0 from `high`,
/// linear between.
pub fn yarn_ramp(low: f64, high: f64, i: usize) -> f64 {
    let y = (i as f64 - low) / (high - low).max(0.001);
    1.0 - y.clamp(0.0, 1.0)
}

/// What a model file says of its positions: its declared scaling
/// ([`RopeScaling::NONE`] if none) and its trained context.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelRope {
    pub file: RopeScaling,
    pub n_ctx_train: usize,
}

/// What the operator asked for (`--rope-scaling`, `--rope-scale`); unset fields
/// follow the model file, then the policy of [`RopeRequest::resolve`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RopeRequest {
    pub kind: Option<RopeScalingType>,
    pub factor: Option<f32>,
    /// YaRN's attention temperature; unset: on only when the file declares YaRN.
    pub attn_temperature: Option<bool>,
}

impl RopeRequest {
    /// Refuses a factor that is not finite or below 1, and a factor with the
    /// `none` method.
    pub fn validate(&self) -> Result<()> {
        if let Some(f) = self.factor {
            check_factor(f)?;
            if self.kind == Some(RopeScalingType::None) {
                return Err(EngineError::BadRopeScaling {
                    reason: format!("a factor ({f}) was given with the method none"),
                });
            }
        }
        Ok(())
    }

    /// The scaling of a session of `n_ctx` positions on a model of `hp`:
    /// - the method: the requested one, else the file's (`rope.scaling.type`), else
    ///   YaRN when a factor was requested or `n_ctx` exceeds the trained context,
    ///   else none;
    /// - the factor: the requested one, else the file's, else
    ///   `max(1, n_ctx / n_ctx_train)`;
    /// - the original context: the file's `rope.scaling.original_context_length`,
    ///   else the trained context.
    ///
    /// A context within the trained one therefore runs unscaled unless asked.
    /// The request must have passed [`validate`](Self::validate).
    pub fn resolve(&self, model: ModelRope, n_ctx: usize) -> Result<RopeScaling> {
        self.validate()?;
        let ModelRope { file, n_ctx_train } = model;
        let n_ctx_orig = if file.is_none() {
            n_ctx_train
        } else {
            file.n_ctx_orig
        };
        let kind = self.kind.unwrap_or(if !file.is_none() {
            file.kind
        } else if self.factor.is_some() || n_ctx > n_ctx_train {
            RopeScalingType::Yarn
        } else {
            RopeScalingType::None
        });
        let factor = self.factor.unwrap_or(if !file.is_none() {
            file.factor
        } else {
            (n_ctx as f32 / n_ctx_train as f32).max(1.0)
        });
        let temperature = self
            .attn_temperature
            .unwrap_or(file.kind == RopeScalingType::Yarn);
        Ok(RopeScaling::new(kind, factor, n_ctx_orig)?.with_attn_temperature(temperature))
    }

    /// [`resolve`](Self::resolve), refusing a context beyond
    /// [`MAX_AUTO_CTX_MULTIPLE`] times the trained one unless a requested factor
    /// covers it (`factor · n_ctx_orig >= n_ctx`).
    pub fn resolve_checked(&self, model: ModelRope, n_ctx: usize) -> Result<RopeScaling> {
        let scaling = self.resolve(model, n_ctx)?;
        let n_ctx_train = model.n_ctx_train;
        let auto_max = MAX_AUTO_CTX_MULTIPLE * n_ctx_train;
        let covered = self.factor.map_or(0, |f| {
            let orig = if scaling.is_none() {
                n_ctx_train
            } else {
                scaling.n_ctx_orig
            };
            (f64::from(f) * orig as f64).floor() as usize
        });
        let max = auto_max.max(covered);
        if n_ctx > max {
            return Err(EngineError::ContextBeyondRope {
                n_ctx,
                n_ctx_train,
                max,
            });
        }
        Ok(scaling)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2's RoPE: head_dim 64, base 100000, trained context 8192.
    const N_ROT: usize = 64;
    const BASE: f32 = 100_000.0;
    const ORIG: usize = 8192;

    fn hp(n_ctx_train: usize, file: RopeScaling) -> ModelRope {
        ModelRope { file, n_ctx_train }
    }

    #[test]
    fn corr_dims_by_hand() {
        // 64·ln(8192 / (32·2π)) / (2·ln 1e5) = 64·3.70724 / 23.02585 = 10.3044 -> 10;
        // 64·ln(8192 / 2π) / (2·ln 1e5) = 64·7.17301 / 23.02585 = 19.9372 -> 20.
        let fast = yarn_corr_dim(N_ROT, ORIG, 32.0, 100_000.0);
        let slow = yarn_corr_dim(N_ROT, ORIG, 1.0, 100_000.0);
        assert!((fast - 10.3044).abs() < 1e-3, "{fast}");
        assert!((slow - 19.9372).abs() < 1e-3, "{slow}");
        assert_eq!(
            yarn_corr_dims(N_ROT, ORIG, 100_000.0, 32.0, 1.0),
            [10.0, 20.0]
        );
        // Clamped to [0, n_rot - 1] when the context is tiny or huge.
        assert_eq!(yarn_corr_dims(N_ROT, 8, 100_000.0, 32.0, 1.0)[0], 0.0);
        assert_eq!(
            yarn_corr_dims(N_ROT, 1 << 60, 100_000.0, 32.0, 1.0)[1],
            63.0
        );
    }

    #[test]
    fn yarn_multipliers_and_mscale_at_factor_4() {
        let s = RopeScaling::new(RopeScalingType::Yarn, 4.0, ORIG).unwrap();
        let m = s.angle_multipliers(BASE, N_ROT);
        assert_eq!(m.len(), 32);
        // High-frequency pairs 0..=10 keep their angle exactly.
        for (i, &v) in m.iter().enumerate().take(11) {
            assert_eq!(v, 1.0, "pair {i}");
        }
        // Ramp: pair 15 is halfway between 10 and 20: 0.25·0.5 + 0.5 = 0.625;
        // pair 12: r = 0.8, 0.25·0.2 + 0.8 = 0.85.
        assert!((m[15] - 0.625).abs() < 1e-15, "{}", m[15]);
        assert!((m[12] - 0.85).abs() < 1e-15, "{}", m[12]);
        // Low-frequency pairs 20.. are divided by the factor.
        for (i, &v) in m.iter().enumerate().skip(20) {
            assert_eq!(v, 0.25, "pair {i}");
        }
        // Without the attention temperature the magnitudes stay; with it,
        // 1 + 0.1·ln 4 = 1.1386294361.
        assert_eq!(s.mscale(), 1.0);
        let t = s.with_attn_temperature(true);
        assert!((t.mscale() - 1.138_629_436_1).abs() < 1e-9);
        assert_ne!(s.fold_fingerprint([0; 16]), t.fold_fingerprint([0; 16]));
        assert_eq!(t.angle_multipliers(BASE, N_ROT), m);
    }

    #[test]
    fn linear_and_none() {
        let s = RopeScaling::new(RopeScalingType::Linear, 2.0, ORIG).unwrap();
        assert_eq!(s.angle_multipliers(BASE, N_ROT), vec![0.5; 32]);
        assert_eq!(s.mscale(), 1.0);
        assert_eq!(
            RopeScaling::NONE.angle_multipliers(BASE, N_ROT),
            vec![1.0; 32]
        );
        // A factor of 1 is no scaling, under either method.
        for k in [RopeScalingType::Linear, RopeScalingType::Yarn] {
            assert!(RopeScaling::new(k, 1.0, ORIG).unwrap().is_none());
        }
        for bad in [0.5, f32::NAN, f32::INFINITY, -2.0] {
            assert!(RopeScaling::new(RopeScalingType::Yarn, bad, ORIG).is_err());
        }
    }

    #[test]
    fn the_attention_temperature_follows_the_file_unless_asked() {
        let stretched = RopeRequest::default().resolve(hp(8192, RopeScaling::NONE), 32768);
        assert!(!stretched.unwrap().attn_temperature);
        let declared = RopeScaling::new(RopeScalingType::Yarn, 4.0, 8192).unwrap();
        let tuned = RopeRequest::default().resolve(hp(32768, declared), 32768);
        assert!(tuned.unwrap().attn_temperature);
        let asked = RopeRequest {
            attn_temperature: Some(true),
            ..RopeRequest::default()
        };
        let on = asked.resolve(hp(8192, RopeScaling::NONE), 32768).unwrap();
        assert!(on.attn_temperature && on.mscale() > 1.0);
        // Only YaRN has one.
        assert!(
            !asked
                .resolve(hp(8192, RopeScaling::NONE), 4096)
                .unwrap()
                .attn_temperature
        );
    }

    #[test]
    fn policy() {
        let h = hp(8192, RopeScaling::NONE);
        let auto = RopeRequest::default();
        // Within the trained context: none.
        assert!(auto.resolve(h, 8192).unwrap().is_none());
        assert!(auto.resolve(h, 100).unwrap().is_none());
        // Beyond it: YaRN, factor n_ctx / n_ctx_train, original context 8192.
        let s = auto.resolve(h, 32768).unwrap();
        assert_eq!(
            (s.kind, s.factor, s.n_ctx_orig),
            (RopeScalingType::Yarn, 4.0, 8192)
        );
        let s = auto.resolve(h, 21000).unwrap();
        assert_eq!(s.factor, 21000.0 / 8192.0);
        // Explicit method, auto factor; explicit factor, auto (YaRN) method.
        let lin = RopeRequest {
            kind: Some(RopeScalingType::Linear),
            factor: None,
            attn_temperature: None,
        };
        let s = lin.resolve(h, 16384).unwrap();
        assert_eq!((s.kind, s.factor), (RopeScalingType::Linear, 2.0));
        let f3 = RopeRequest {
            kind: None,
            factor: Some(3.0),
            attn_temperature: None,
        };
        let s = f3.resolve(h, 1024).unwrap();
        assert_eq!((s.kind, s.factor), (RopeScalingType::Yarn, 3.0));
        // Explicit none beyond the trained context is honoured.
        let none = RopeRequest {
            kind: Some(RopeScalingType::None),
            factor: None,
            attn_temperature: None,
        };
        assert!(none.resolve_checked(h, 32768).unwrap().is_none());
        // A factor with none is refused.
        let bad = RopeRequest {
            kind: Some(RopeScalingType::None),
            factor: Some(2.0),
            attn_temperature: None,
        };
        assert!(bad.validate().is_err());
        // The bound: 4x the trained context, further only with a covering factor.
        assert!(auto.resolve_checked(h, 32768).is_ok());
        let e = auto.resolve_checked(h, 32769).unwrap_err().to_string();
        assert!(
            e.contains("32769") && e.contains("32768") && e.contains("8192"),
            "{e}"
        );
        let f8 = RopeRequest {
            kind: None,
            factor: Some(8.0),
            attn_temperature: None,
        };
        assert!(f8.resolve_checked(h, 65536).is_ok());
        assert!(f8.resolve_checked(h, 65537).is_err());
        // A file's own scaling is used as given.
        let file = RopeScaling::new(RopeScalingType::Linear, 4.0, 2048).unwrap();
        let s = auto.resolve(hp(8192, file), 100).unwrap();
        assert_eq!(s, file);
    }

    #[test]
    fn fingerprint_folding() {
        let fp = [7u8; 16];
        assert_eq!(RopeScaling::NONE.fold_fingerprint(fp), fp);
        let y4 = RopeScaling::new(RopeScalingType::Yarn, 4.0, ORIG).unwrap();
        let y2 = RopeScaling::new(RopeScalingType::Yarn, 2.0, ORIG).unwrap();
        let l4 = RopeScaling::new(RopeScalingType::Linear, 4.0, ORIG).unwrap();
        let y4o = RopeScaling::new(RopeScalingType::Yarn, 4.0, 4096).unwrap();
        let all = [y4, y2, l4, y4o].map(|s| s.fold_fingerprint(fp));
        for (i, a) in all.iter().enumerate() {
            assert_ne!(*a, fp);
            for b in &all[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(y4.fold_fingerprint(fp), all[0]);
    }
}
