//! Loading validates the llama layout tensor by tensor, and the session's chunked
//! prefill equals token-by-token decoding bit for bit. Uses a tiny llama model
//! written with the GGUF writer: the real SmolLM2 tokenizer metadata, small random
//! weights, so a broken variant of it can be made in a few lines.

use std::sync::{Arc, OnceLock};

use ds4_engine::{EngineError, Model, Precision, Session, SessionOptions, ThreadPool};
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
        "unsupported architecture \"mamba\" (this build runs: llama)"
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
