//! RoPE scaling on the real default model: SmolLM2 was trained on 8192 positions;
//! a 32768-position session (automatic YaRN x4) prefills 9000 tokens of the bench
//! novel, past the trained context, and still predicts the text there: the
//! perplexity of its last 256 tokens (positions 8744..9000) was 30.9 when
//! written, against 17-21 for this text's chunks within the trained context
//! unscaled; the bound is 40. Takes one to four minutes on two cores.

use std::sync::Arc;

use ds4_engine::{
    KvType, Model, Precision, RopeScaling, RopeScalingType, Session, SessionOptions, ThreadPool,
};

const BOOK: &str = include_str!("../../../bench/pride_and_prejudice.txt");

#[test]
fn yarn_session_prefills_past_the_trained_context() {
    let model = Arc::new(
        Model::load(ds4_testdata::model_path(ds4_testdata::SMOLLM2)).expect("loading SmolLM2"),
    );
    assert_eq!(model.hparams().n_ctx_train, 8192);
    let tokens = model.tokenizer.encode(BOOK, false, false);
    let (n, scored) = (9000, 256);
    assert!(tokens.len() > n);
    let opts = SessionOptions {
        n_ctx: 32768,
        prefill_chunk: 256,
        precision: Precision::Fast,
        kv_type: KvType::F16,
    };
    let mut s = Session::try_new(model, Arc::new(ThreadPool::new(2)), &opts).unwrap();
    assert_eq!(
        s.rope_scaling(),
        RopeScaling::new(RopeScalingType::Yarn, 4.0, 8192).unwrap()
    );
    s.prefill(&tokens[..n - scored]).unwrap();
    let mut nll = 0.0f64;
    s.prefill_with_logits(&tokens[n - scored..n], |i, logits| {
        assert!(
            logits.iter().all(|v| v.is_finite()),
            "position {}",
            n - scored + i
        );
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let z: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
        let target = tokens[n - scored + i + 1] as usize;
        nll -= f64::from(logits[target] - max) - z.ln();
    })
    .unwrap();
    assert_eq!(s.tokens().len(), n);
    let ppl = (nll / scored as f64).exp();
    eprintln!(
        "YaRN x4: perplexity of tokens {}..{n}: {ppl:.3}",
        n - scored + 1
    );
    assert!(ppl < 40.0, "perplexity {ppl} past the trained context");
}
