//! Loading validates the llama layout tensor by tensor, and the session's chunked
//! prefill equals token-by-token decoding bit for bit. Uses a tiny llama model
//! written with the GGUF writer: the real SmolLM2 tokenizer metadata, small random
//! weights, so a broken variant of it can be made in a few lines.

use std::sync::{Arc, OnceLock};

use ds4_engine::{
    Batch, EngineError, KvType, Model, Precision, RopeRequest, RopeScaling, RopeScalingType,
    Session, SessionOptions, ThreadPool,
};
use ds4_gguf::{GgmlType, Gguf, GgufWriter, Value};
use ds4_kernels::{quantize_row, WeightFormat};

const N_EMBD: u64 = 64;
const N_FF: u64 = 128;
const N_HEAD: u64 = 4;
const N_HEAD_KV: u64 = 2;
const N_LAYER: u64 = 2;
const N_VOCAB: u64 = 49152;

fn real_metadata() -> &'static [(String, Value)] {
    static META: OnceLock<Vec<(String, Value)>> = OnceLock::new();
    META.get_or_init(|| {
        Gguf::open(ds4_testdata::model_path(ds4_testdata::SMOLLM2))
            .unwrap()
            .metadata
    })
}

struct Tensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: Vec<u8>,
}

fn weights(name: &str, dims: &[u64], ty: GgmlType, seed: u64) -> Tensor {
    let n: u64 = dims.iter().product();
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let x: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.5
        })
        .collect();
    let data = match ty {
        GgmlType::F32 => x.iter().flat_map(|v| (1.0 + v).to_le_bytes()).collect(),
        _ => {
            let fmt = WeightFormat::from_ggml_type(ty.id()).unwrap();
            let mut data = vec![0u8; ty.bytes_for(n).unwrap() as usize];
            quantize_row(fmt, &x, &mut data).unwrap();
            data
        }
    };
    Tensor {
        name: name.into(),
        dims: dims.to_vec(),
        ty,
        data,
    }
}

fn tiny_parts() -> (Vec<(String, Value)>, Vec<Tensor>) {
    let mut meta = real_metadata().to_vec();
    for (k, v) in [
        ("llama.embedding_length", N_EMBD),
        ("llama.feed_forward_length", N_FF),
        ("llama.attention.head_count", N_HEAD),
        ("llama.attention.head_count_kv", N_HEAD_KV),
        ("llama.block_count", N_LAYER),
        ("llama.rope.dimension_count", N_EMBD / N_HEAD),
        ("llama.context_length", 256),
    ] {
        let slot = meta.iter_mut().find(|(key, _)| key == k).unwrap();
        slot.1 = Value::U32(v as u32);
    }
    let kv = N_EMBD / N_HEAD * N_HEAD_KV;
    let mut t = vec![
        weights("token_embd.weight", &[N_EMBD, N_VOCAB], GgmlType::Q8_0, 1),
        weights("output_norm.weight", &[N_EMBD], GgmlType::F32, 2),
    ];
    for il in 0..N_LAYER {
        let p = |n: &str| format!("blk.{il}.{n}.weight");
        let seed = 100 * (il + 1);
        t.push(weights(&p("attn_norm"), &[N_EMBD], GgmlType::F32, seed));
        t.push(weights(
            &p("attn_q"),
            &[N_EMBD, N_EMBD],
            GgmlType::Q4_1,
            seed + 1,
        ));
        t.push(weights(
            &p("attn_k"),
            &[N_EMBD, kv],
            GgmlType::Q4_1,
            seed + 2,
        ));
        t.push(weights(
            &p("attn_v"),
            &[N_EMBD, kv],
            GgmlType::Q4_1,
            seed + 3,
        ));
        t.push(weights(
            &p("attn_output"),
            &[N_EMBD, N_EMBD],
            GgmlType::Q4_1,
            seed + 4,
        ));
        t.push(weights(&p("ffn_norm"), &[N_EMBD], GgmlType::F32, seed + 5));
        t.push(weights(
            &p("ffn_gate"),
            &[N_EMBD, N_FF],
            GgmlType::Q4_1,
            seed + 6,
        ));
        t.push(weights(
            &p("ffn_up"),
            &[N_EMBD, N_FF],
            GgmlType::Q4_1,
            seed + 7,
        ));
        t.push(weights(
            &p("ffn_down"),
            &[N_FF, N_EMBD],
            GgmlType::Q4_1,
            seed + 8,
        ));
    }
    (meta, t)
}

fn build(meta: Vec<(String, Value)>, tensors: Vec<Tensor>) -> Result<Model, EngineError> {
    let mut w = GgufWriter::new();
    for (k, v) in meta {
        w.add_kv(k, v);
    }
    for t in tensors {
        w.add_tensor(t.name, &t.dims, t.ty, t.data).unwrap();
    }
    Model::from_gguf(Gguf::from_bytes(w.to_bytes().unwrap()).unwrap())
}

fn tiny() -> Arc<Model> {
    let (m, t) = tiny_parts();
    Arc::new(build(m, t).unwrap())
}

fn broken(edit: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<Tensor>)) -> String {
    let (mut m, mut t) = tiny_parts();
    edit(&mut m, &mut t);
    match build(m, t) {
        Ok(_) => panic!("a broken model loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn layout_errors_name_the_tensor() {
    let e = broken(|_, t| t.retain(|t| t.name != "blk.1.ffn_up.weight"));
    assert_eq!(e, "tensor \"blk.1.ffn_up.weight\" is missing");

    let e = broken(|_, t| {
        let i = t
            .iter()
            .position(|t| t.name == "blk.0.attn_k.weight")
            .unwrap();
        t[i] = weights("blk.0.attn_k.weight", &[N_EMBD, N_EMBD], GgmlType::Q4_1, 9);
    });
    assert_eq!(
        e,
        "tensor \"blk.0.attn_k.weight\" has shape [64, 64], expected [64, 32]"
    );

    let e = broken(|_, t| {
        let i = t
            .iter()
            .position(|t| t.name == "blk.0.ffn_norm.weight")
            .unwrap();
        t[i] = weights("blk.0.ffn_norm.weight", &[N_EMBD], GgmlType::F16, 9);
    });
    assert_eq!(
        e,
        "tensor \"blk.0.ffn_norm.weight\" has type f16, expected f32"
    );

    let e = broken(|_, t| {
        let i = t
            .iter()
            .position(|t| t.name == "blk.1.attn_q.weight")
            .unwrap();
        let n = (N_EMBD * N_EMBD) as usize;
        t[i] = Tensor {
            name: "blk.1.attn_q.weight".into(),
            dims: vec![N_EMBD, N_EMBD],
            ty: GgmlType::Q5_1,
            data: vec![0; n / 32 * 24],
        };
    });
    assert!(
        e.starts_with("tensor \"blk.1.attn_q.weight\" has type q5_1, expected a format"),
        "{e}"
    );

    let e = broken(|_, t| {
        t.push(weights(
            "blk.2.attn_norm.weight",
            &[N_EMBD],
            GgmlType::F32,
            3,
        ))
    });
    assert_eq!(
        e,
        "tensor \"blk.2.attn_norm.weight\" is not part of the llama layout"
    );
}

/// The fingerprint names the tensor data: a model whose bytes differ in one
/// quant has the same layout and quantization fingerprints and other weights.
#[test]
fn the_fingerprint_covers_the_weight_bytes() {
    let a = tiny().fingerprint;
    assert_eq!(tiny().fingerprint, a, "deterministic");
    let (m, mut t) = tiny_parts();
    let q = t
        .iter_mut()
        .find(|t| t.name == "blk.1.ffn_up.weight")
        .unwrap();
    q.data[7] ^= 0x10;
    let b = build(m, t).unwrap().fingerprint;
    assert_eq!((b.model, b.quant), (a.model, a.quant));
    assert_ne!(b.weights, a.weights);
}

#[test]
fn hyper_parameter_errors_name_the_key() {
    let e = broken(|m, _| m.retain(|(k, _)| k != "llama.attention.head_count_kv"));
    assert!(
        e.contains("llama.attention.head_count_kv") && e.contains("missing"),
        "{e}"
    );
    let e = broken(|m, _| {
        m.iter_mut()
            .find(|(k, _)| k == "general.architecture")
            .unwrap()
            .1 = Value::String("mamba".into())
    });
    assert_eq!(
        e,
        "unsupported architecture \"mamba\" (this build runs: llama, gemma3, deepseek4)"
    );
    let e = broken(|m, _| {
        m.iter_mut()
            .find(|(k, _)| k == "llama.attention.head_count_kv")
            .unwrap()
            .1 = Value::U32(3)
    });
    assert!(e.contains("does not divide head_count 4"), "{e}");
    let e = broken(|m, _| {
        m.iter_mut()
            .find(|(k, _)| k == "llama.block_count")
            .unwrap()
            .1 = Value::String("two".into())
    });
    assert!(
        e.contains("llama.block_count") && e.contains("expected unsigned integer"),
        "{e}"
    );
}

fn session(model: &Arc<Model>, chunk: usize, precision: Precision) -> Session {
    let opts = SessionOptions {
        n_ctx: 64,
        prefill_chunk: chunk,
        precision,
        ..SessionOptions::default()
    };
    Session::new(Arc::clone(model), Arc::new(ThreadPool::new(2)), &opts)
}

#[test]
fn chunked_prefill_equals_token_by_token_bitwise() {
    let model = tiny();
    let prompt: Vec<u32> = (0..37).map(|i| (i * 1297 + 11) % N_VOCAB as u32).collect();
    for precision in [Precision::Fast, Precision::Exact, Precision::Q8] {
        let mut whole = session(&model, 64, precision);
        whole.prefill(&prompt).unwrap();
        let want: Vec<u32> = whole
            .logits()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert!(whole.logits().unwrap().iter().all(|v| v.is_finite()));
        for chunk in [1, 3, 16] {
            let mut s = session(&model, chunk, precision);
            s.prefill(&prompt[..20]).unwrap();
            for &t in &prompt[20..] {
                s.decode_step(t).unwrap();
            }
            let got: Vec<u32> = s.logits().unwrap().iter().map(|v| v.to_bits()).collect();
            assert!(got == want, "{precision:?}, chunk {chunk}: logits differ");
            assert_eq!(s.tokens(), &prompt[..]);
        }
    }
}

#[test]
fn session_rejects_bad_tokens_and_overflow_without_damage() {
    let model = tiny();
    let mut s = session(&model, 8, Precision::Fast);
    assert!(matches!(s.logits(), Err(EngineError::NoLogits)));
    s.prefill(&[1, 2, 3]).unwrap();
    let before = s.logits().unwrap().to_vec();
    let e = s.prefill(&[5, N_VOCAB as u32]).unwrap_err();
    assert!(matches!(e, EngineError::TokenOutOfRange { id, .. } if id == N_VOCAB as u32));
    let e = s.prefill(&[7; 62]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "context is full: 65 tokens needed, the context holds 64"
    );
    assert_eq!(s.tokens(), &[1, 2, 3]);
    assert_eq!(s.logits().unwrap(), &before[..]);
    s.reset();
    assert!(s.tokens().is_empty());
    s.prefill(&[1, 2, 3]).unwrap();
    assert_eq!(
        s.logits().unwrap(),
        &before[..],
        "reset + same tokens = same logits"
    );
}

fn session_ctx(model: &Arc<Model>, n_ctx: usize, kv_type: KvType) -> Session {
    let opts = SessionOptions {
        n_ctx,
        prefill_chunk: 16,
        precision: Precision::Fast,
        kv_type,
    };
    Session::try_new(Arc::clone(model), Arc::new(ThreadPool::new(2)), &opts).unwrap()
}

fn with_request(kind: Option<RopeScalingType>, factor: Option<f32>) -> Arc<Model> {
    let (m, t) = tiny_parts();
    let mut model = build(m, t).unwrap();
    model
        .set_rope_request(RopeRequest {
            kind,
            factor,
            attn_temperature: None,
        })
        .unwrap();
    Arc::new(model)
}

fn logit_bits(s: &Session) -> Vec<u32> {
    s.logits().unwrap().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn rope_scaling_keys_are_read_from_the_file() {
    let with_keys = |keys: Vec<(&str, Value)>| {
        let (mut m, t) = tiny_parts();
        for (k, v) in keys {
            m.push((k.to_string(), v));
        }
        build(m, t)
    };
    let m = with_keys(vec![
        ("llama.rope.scaling.type", Value::String("yarn".into())),
        ("llama.rope.scaling.factor", Value::F32(4.0)),
        ("llama.rope.scaling.original_context_length", Value::U32(64)),
    ])
    .unwrap();
    assert_eq!(
        m.hparams().rope_scaling,
        RopeScaling::new(RopeScalingType::Yarn, 4.0, 64).unwrap()
    );
    // Without a request, sessions of any size run the file's scaling, with
    // YaRN's attention temperature (the model was made for it).
    assert_eq!(
        m.rope_scaling_for(16).unwrap(),
        m.hparams().rope_scaling.with_attn_temperature(true),
        "the file's scaling applies within the trained context too"
    );
    let m = with_keys(vec![("llama.rope.scale_linear", Value::F32(2.0))]).unwrap();
    assert_eq!(m.hparams().rope_scaling.kind, RopeScalingType::Linear);
    assert_eq!(m.hparams().rope_scaling.n_ctx_orig, 256);
    let m = with_keys(vec![(
        "llama.rope.scaling.type",
        Value::String("none".into()),
    )])
    .unwrap();
    assert!(m.hparams().rope_scaling.is_none());
    let e = with_keys(vec![(
        "llama.rope.scaling.type",
        Value::String("longrope".into()),
    )])
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("llama.rope.scaling.type") && e.contains("longrope"),
        "{e}"
    );
    let e = with_keys(vec![
        ("llama.rope.scaling.type", Value::String("linear".into())),
        ("llama.rope.scaling.factor", Value::F32(0.5)),
    ])
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("llama.rope.scaling.factor") && e.contains("0.5"),
        "{e}"
    );
    // The tiny model itself declares nothing.
    assert!(tiny().hparams().rope_scaling.is_none());
}

/// Within the trained context (256 here) a session runs unscaled whatever its
/// size, bitwise as before scaling existed; past it, the automatic YaRN changes
/// the logits. Checkpoint fingerprints follow the scaling.
#[test]
fn rope_scaling_policy_logits_and_fingerprints() {
    let model = tiny();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7919 + 5) % N_VOCAB as u32).collect();
    let run = |s: &mut Session| {
        s.prefill(&prompt).unwrap();
        logit_bits(s)
    };
    let mut small = session_ctx(&model, 64, KvType::F32);
    let mut trained = session_ctx(&model, 256, KvType::F32);
    let mut long = session_ctx(&model, 1024, KvType::F32);
    assert!(small.rope_scaling().is_none() && trained.rope_scaling().is_none());
    assert_eq!(
        long.rope_scaling(),
        RopeScaling::new(RopeScalingType::Yarn, 4.0, 256).unwrap()
    );
    let want = run(&mut small);
    assert!(run(&mut trained) == want, "unscaled logits depend on n_ctx");
    // An explicit none, and a factor of 1, are the same unscaled path.
    let none = with_request(Some(RopeScalingType::None), None);
    assert!(run(&mut session_ctx(&none, 1024, KvType::F32)) == want);
    let one = with_request(Some(RopeScalingType::Yarn), Some(1.0));
    assert!(run(&mut session_ctx(&one, 64, KvType::F32)) == want);
    // YaRN moves the logits (position 0 is unrotated, so the tokens after it do).
    assert!(run(&mut long) != want, "YaRN x4 changed nothing");

    // Fingerprints: unchanged when unscaled (= the K/V type's, as before).
    let fp = |s: &Session| s.state_fingerprint();
    let base = KvType::F32.state_fingerprint(&model.fingerprint);
    assert_eq!(fp(&small), base);
    assert_eq!(fp(&trained), base);
    assert_eq!(fp(&session_ctx(&none, 1024, KvType::F32)), base);
    assert_eq!(
        fp(&session_ctx(&model, 64, KvType::F16)),
        KvType::F16.state_fingerprint(&model.fingerprint)
    );
    // Scaled: equal settings, equal fingerprints; any difference, a different one.
    let y4 = fp(&long);
    assert_ne!(y4, base);
    assert_eq!(fp(&session_ctx(&model, 1024, KvType::F32)), y4);
    let explicit = with_request(Some(RopeScalingType::Yarn), Some(4.0));
    assert_eq!(fp(&session_ctx(&explicit, 64, KvType::F32)), y4);
    let linear = with_request(Some(RopeScalingType::Linear), None);
    let l4 = fp(&session_ctx(&linear, 1024, KvType::F32));
    let y2 = fp(&session_ctx(&model, 512, KvType::F32));
    let y4_f16 = fp(&session_ctx(&model, 1024, KvType::F16));
    for (i, a) in [base, y4, l4, y2, y4_f16].iter().enumerate() {
        for b in &[base, y4, l4, y2, y4_f16][i + 1..] {
            assert_ne!(a, b);
        }
    }

    // The bound: 4x the trained context, further with a covering factor.
    let opts = SessionOptions {
        n_ctx: 1025,
        ..SessionOptions::default()
    };
    let e = Session::try_new(Arc::clone(&model), Arc::new(ThreadPool::new(1)), &opts)
        .err()
        .unwrap();
    assert!(
        matches!(
            e,
            EngineError::ContextBeyondRope {
                n_ctx: 1025,
                n_ctx_train: 256,
                max: 1024
            }
        ),
        "{e}"
    );
    let f8 = with_request(None, Some(8.0));
    assert!(Session::try_new(f8, Arc::new(ThreadPool::new(1)), &opts).is_ok());
    // Invalid requests are refused when set.
    let (m, t) = tiny_parts();
    let mut m = build(m, t).unwrap();
    for (kind, factor) in [
        (None, Some(0.5)),
        (None, Some(f32::NAN)),
        (Some(RopeScalingType::None), Some(2.0)),
    ] {
        assert!(m
            .set_rope_request(RopeRequest {
                kind,
                factor,
                attn_temperature: None,
            })
            .is_err());
    }
}

/// 37 tokens spread over the vocabulary.
fn scored_prompt() -> Vec<u32> {
    (0..37).map(|i| (i * 1297 + 11) % N_VOCAB as u32).collect()
}

/// `prompt` decoded token by token in a fresh session (returned), with the
/// logits' bits after each token.
fn decoded_logits(model: &Arc<Model>, prompt: &[u32]) -> (Session, Vec<Vec<u32>>) {
    let mut one = session_ctx(model, 64, KvType::F16);
    let want = prompt
        .iter()
        .map(|&t| {
            one.decode_step(t).unwrap();
            logit_bits(&one)
        })
        .collect();
    (one, want)
}

/// A session that keeps its steps' logits gets, from batched steps beside
/// another session, each token's row as token-by-token decoding gives it, bit
/// for bit, and the last as its next-token logits; its steps are capped; off
/// again, it keeps none and decodes on.
#[test]
fn kept_step_logits_equal_decode_bitwise() {
    let prompt = scored_prompt();
    let model = tiny();
    let (mut one, want) = decoded_logits(&model, &prompt);
    let mut scored = session_ctx(&model, 64, KvType::F16);
    let mut other = session_ctx(&model, 64, KvType::F16);
    other.prefill(&[3, 4]).unwrap();
    scored.keep_step_logits(true);
    assert_eq!(scored.max_step(), 16, "the chunk is under the cap");
    let mut batch = Batch::new(Arc::clone(&model), Arc::clone(scored.pool()), 32);
    let (mut at, mut got) = (0, Vec::new());
    while at < prompt.len() {
        let n = (prompt.len() - at).min(7);
        let steps = &mut [(&mut scored, &prompt[at..at + n]), (&mut other, &[5][..])];
        batch.forward(steps).unwrap();
        let rows = scored.step_logits();
        assert_eq!(rows.len(), n * N_VOCAB as usize);
        got.extend(
            rows.chunks_exact(N_VOCAB as usize)
                .map(|r| r.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()),
        );
        at += n;
    }
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(g == w, "position {i}");
    }
    assert!(logit_bits(&scored) == want[prompt.len() - 1]);
    scored.keep_step_logits(false);
    assert!(scored.step_logits().is_empty());
    scored.decode_step(9).unwrap();
    one.decode_step(9).unwrap();
    assert!(logit_bits(&scored) == logit_bits(&one));
}

/// `prefill_with_logits` gives every position the logits token-by-token
/// decoding gives there, bit for bit, scaled or not, and leaves the session as
/// a plain prefill would.
#[test]
fn prefill_with_logits_equals_decode_bitwise() {
    let prompt = scored_prompt();
    for model in [tiny(), with_request(Some(RopeScalingType::Yarn), Some(4.0))] {
        let (_, want) = decoded_logits(&model, &prompt);
        let mut all = session_ctx(&model, 64, KvType::F16);
        all.prefill(&prompt[..5]).unwrap();
        let mut got = Vec::new();
        all.prefill_with_logits(&prompt[5..], |i, row| {
            assert_eq!(i, got.len());
            got.push(row.iter().map(|v| v.to_bits()).collect::<Vec<u32>>());
        })
        .unwrap();
        assert_eq!(got.len(), prompt.len() - 5);
        for (i, g) in got.iter().enumerate() {
            assert!(*g == want[5 + i], "position {}", 5 + i);
        }
        assert!(logit_bits(&all) == want[prompt.len() - 1]);
        assert_eq!(all.tokens(), &prompt[..]);
        let e = all.prefill_with_logits(&[1; 28], |_, _| ()).unwrap_err();
        assert!(matches!(e, EngineError::ContextFull { .. }));
    }
}
