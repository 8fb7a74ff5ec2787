//! Every family against llama.cpp's golden vectors (`tests/vectors/llama-cpp/`,
//! copied from the shared set), teacher forced: feed the prompt plus the
//! reference's first i generated tokens and compare step i's log-probabilities
//! with the reference's top-5.
//!
//! Every precision mode is compared with `f32_reference/` (the same quantized
//! weights run exactly in f32; see the vectors' README §4), with bounds per
//! family ([`Bounds`]):
//! - exact: every top-5 log-prob within 0.03 at every step, same argmax wherever
//!   the reference's top-1/top-2 gap exceeds 0.03;
//! - fast (the default) and fast with f16 K/V (`--kv-type f16`): SmolLM2 as
//!   exact (measured worst 0.001-0.009 per vector); Gemma 3 a mean per-step
//!   maximum <= 0.05 and worst <= 0.15 (llama.cpp's own fast path sits
//!   0.16-0.30 mean away from the same reference);
//! - q8 (8-bit activations, like llama.cpp's CPU path): mean per-step max error
//!   <= 0.30 (Gemma 3: 0.40, llama.cpp's own path is 0.30 away on its Fibonacci
//!   vector), worst <= 1.0, same argmax wherever the gap exceeds 1.0.
//!
//! Each test prints its figures (`--nocapture`).

mod families;

use std::sync::Arc;

use ds4_engine::sampler::{argmax, log_softmax};
use ds4_engine::{KvType, Precision, Session, SessionOptions, ThreadPool};
use families::Family;

struct StepError {
    max_abs: f32,
    argmax: u32,
    ref_argmax: u32,
    ref_gap: f32,
}

/// Teacher-forces the vector and returns per-step errors against its top-5.
fn compare(f: &Family, name: &str, precision: Precision, kv_type: KvType) -> Vec<StepError> {
    let v = families::vector(&format!("f32_reference/{name}.json"));
    let prompt = families::ids(&v["prompt_token_ids"]);
    let generated = families::ids(&v["generated_token_ids"]);
    let steps = v["steps"].as_array().expect("steps");
    let model = families::model(f);
    assert_eq!(
        model
            .tokenizer
            .encode(v["prompt"].as_str().unwrap(), true, true),
        prompt,
        "{name}: prompt ids"
    );
    let opts = SessionOptions {
        n_ctx: prompt.len() + generated.len() + 1,
        prefill_chunk: 256,
        precision,
        kv_type,
    };
    let mut s = Session::new(model, Arc::new(ThreadPool::new(1)), &opts);
    s.prefill(&prompt).unwrap();
    let mut out = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        let logits = s.logits().unwrap();
        let lp = log_softmax(logits);
        let top5 = step["top5"].as_array().unwrap();
        let ref_lp = |j: usize| top5[j]["logprob"].as_f64().unwrap() as f32;
        let max_abs = top5
            .iter()
            .map(|t| {
                (lp[t["token_id"].as_u64().unwrap() as usize]
                    - t["logprob"].as_f64().unwrap() as f32)
                    .abs()
            })
            .fold(0f32, f32::max);
        out.push(StepError {
            max_abs,
            argmax: argmax(logits),
            ref_argmax: top5[0]["token_id"].as_u64().unwrap() as u32,
            ref_gap: ref_lp(0) - ref_lp(1),
        });
        if i + 1 < generated.len() {
            s.decode_step(generated[i]).unwrap();
        }
    }
    out
}

/// A family's bounds for one precision: the worst step, the mean of the
/// per-step maxima, and the reference gap above which argmax must agree.
#[derive(Clone, Copy)]
struct Bound {
    worst: f32,
    mean: f32,
    argmax_gap: f32,
}

struct Bounds {
    exact: Bound,
    fast: Bound,
    q8: Bound,
}

const EXACT: Bound = Bound {
    worst: 0.03,
    mean: 0.03,
    argmax_gap: 0.03,
};
const Q8: Bound = Bound {
    worst: 1.0,
    mean: 0.30,
    argmax_gap: 1.0,
};

fn bounds(f: &Family) -> Bounds {
    match f.name {
        "gemma3" => Bounds {
            exact: EXACT,
            fast: Bound {
                worst: 0.15,
                mean: 0.05,
                argmax_gap: 0.15,
            },
            // llama.cpp's own CPU path sits a mean 0.16-0.30 (worst 0.36-0.68)
            // from the exact result on these vectors (README §4): its numerics
            // are what this mode reproduces, each rounding a new draw.
            q8: Bound { mean: 0.40, ..Q8 },
        },
        _ => Bounds {
            exact: EXACT,
            fast: EXACT,
            q8: Q8,
        },
    }
}

fn check(f: &Family, name: &str, precision: Precision, kv_type: KvType) {
    let b = bounds(f);
    let bound = match precision {
        Precision::Exact => b.exact,
        Precision::Fast => b.fast,
        Precision::Q8 => b.q8,
    };
    let errs = compare(f, name, precision, kv_type);
    let worst = errs.iter().map(|e| e.max_abs).fold(0f32, f32::max);
    let mean = errs.iter().map(|e| e.max_abs).sum::<f32>() / errs.len() as f32;
    eprintln!(
        "{name} {precision:?} kv {kv_type}: {} steps, mean {mean:.5}, worst {worst:.5}",
        errs.len()
    );
    for (i, e) in errs.iter().enumerate() {
        assert!(
            e.max_abs <= bound.worst,
            "{name} {precision:?} kv {kv_type} step {i}: max |Δlogprob| {} > {}",
            e.max_abs,
            bound.worst
        );
        if e.ref_gap > bound.argmax_gap {
            assert_eq!(
                e.argmax, e.ref_argmax,
                "{name} {precision:?} step {i}: argmax (gap {})",
                e.ref_gap
            );
        }
    }
    assert!(
        mean <= bound.mean,
        "{name} {precision:?} kv {kv_type}: mean per-step max error {mean} > {}",
        bound.mean
    );
}

macro_rules! golden {
    ($($family:ident: $fam:expr => [$($name:ident),* $(,)?];)*) => {
        $(mod $family {
            use super::*;
            mod exact {
                $(#[test] fn $name() { super::super::check(&$fam, stringify!($name), super::Precision::Exact, super::KvType::F32); })*
            }
            mod fast {
                $(#[test] fn $name() { super::super::check(&$fam, stringify!($name), super::Precision::Fast, super::KvType::F32); })*
            }
            mod fast_kv_f16 {
                $(#[test] fn $name() { super::super::check(&$fam, stringify!($name), super::Precision::Fast, super::KvType::F16); })*
            }
            mod q8 {
                $(#[test] fn $name() { super::super::check(&$fam, stringify!($name), super::Precision::Q8, super::KvType::F32); })*
            }
        })*
    };
}

golden! {
    smollm2: crate::families::SMOLLM2 => [
        smollm2_capital_france,
        smollm2_fibonacci,
        smollm2_chatml_2plus2,
        smollm2_chatml_multiturn,
        smollm2_long_carrow_point,
    ];
    gemma3: crate::families::GEMMA3 => [
        gemma3_270m_capital_france,
        gemma3_270m_fibonacci,
        gemma3_270m_long_promessi_sposi,
    ];
}
