//! Session state as an asset, on the real default model: a payload written and read
//! back, a snapshot restored, or a rewind must give bitwise the next-token logits and
//! the greedy continuation of the uninterrupted session. Damaged payloads are
//! rejected whole and leave the session empty.

use std::sync::{Arc, OnceLock};

use ds4_engine::sampler::argmax;
use ds4_engine::{EngineError, KvType, Model, Precision, Session, SessionOptions, ThreadPool};

const CHUNK: usize = 64;

fn model() -> Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    Arc::clone(MODEL.get_or_init(|| {
        Arc::new(
            Model::load(ds4_testdata::model_path(ds4_testdata::SMOLLM2)).expect("loading SmolLM2"),
        )
    }))
}

/// A long real prompt (the 2024-token story of the golden vectors).
fn prompt() -> Vec<u32> {
    let path = ds4_testdata::vectors_dir("llama-cpp/smollm2_long_carrow_point.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    v["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn session(n_ctx: usize, precision: Precision) -> Session {
    session_kv(n_ctx, precision, KvType::F32)
}

fn session_kv(n_ctx: usize, precision: Precision, kv_type: KvType) -> Session {
    let opts = SessionOptions {
        n_ctx,
        prefill_chunk: CHUNK,
        precision,
        kv_type,
    };
    Session::new(model(), Arc::new(ThreadPool::new(2)), &opts)
}

fn bits(s: &Session) -> Vec<u32> {
    s.logits().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// Greedy continuation of `n` tokens (the session advances).
fn greedy(s: &mut Session, n: usize) -> Vec<u32> {
    (0..n)
        .map(|_| {
            let t = argmax(s.logits().unwrap());
            s.decode_step(t).unwrap();
            t
        })
        .collect()
}

#[test]
fn payload_round_trip_is_bitwise_at_several_lengths() {
    let p = prompt();
    for (len, precision) in [
        (1, Precision::Fast),
        (CHUNK - 1, Precision::Fast),
        (CHUNK, Precision::Fast),
        (CHUNK + 1, Precision::Q8),
        (3 * CHUNK + 17, Precision::Fast),
        (100, Precision::Exact),
    ] {
        let mut a = session(512, precision);
        a.prefill(&p[..len]).unwrap();
        let mut bytes = Vec::new();
        a.save_payload(&mut bytes).unwrap();
        assert_eq!(
            bytes.len() as u64,
            a.payload_bytes(),
            "len {len}: size estimate"
        );

        let mut b = session(512, precision);
        b.prefill(&p[300..310]).unwrap(); // stale state that the load must replace
        b.load_payload(&mut bytes.as_slice()).unwrap();
        assert_eq!(b.tokens(), a.tokens(), "len {len}");
        assert!(
            bits(&b) == bits(&a),
            "len {len} {precision:?}: logits differ after reload"
        );
        assert_eq!(
            greedy(&mut b, 6),
            greedy(&mut a, 6),
            "len {len}: continuation"
        );
        assert!(
            bits(&b) == bits(&a),
            "len {len}: logits differ after continuing"
        );
    }
}

#[test]
fn payload_loads_into_a_larger_context_only() {
    let p = prompt();
    let mut a = session(256, Precision::Fast);
    a.prefill(&p[..200]).unwrap();
    let mut bytes = Vec::new();
    a.save_payload(&mut bytes).unwrap();
    let mut big = session(1024, Precision::Fast);
    big.load_payload(&mut bytes.as_slice()).unwrap();
    assert!(bits(&big) == bits(&a));
    let mut small = session(128, Precision::Fast);
    let e = small.load_payload(&mut bytes.as_slice()).unwrap_err();
    assert!(
        e.to_string()
            .contains("do not fit this session's context of 128"),
        "{e}"
    );
    assert!(small.tokens().is_empty());
}

#[test]
fn snapshot_restore_and_rewind_are_exact() {
    let p = prompt();
    let mut s = session(1024, Precision::Fast);
    s.prefill(&p[..150]).unwrap();
    let snap = s.snapshot().unwrap();
    let at_150 = bits(&s);
    let cont_150 = greedy(&mut s.clone_for_test(), 5);
    s.prefill(&p[150..400]).unwrap();
    s.restore(&snap).unwrap();
    assert!(bits(&s) == at_150, "restore");
    assert_eq!(greedy(&mut s, 5), cont_150);

    // Rewind into the middle of a prefill chunk and to a chunk boundary.
    for n in [97, CHUNK * 2, 1] {
        let mut long = session(1024, Precision::Fast);
        long.prefill(&p[..300]).unwrap();
        long.rewind(n).unwrap();
        let mut fresh = session(1024, Precision::Fast);
        fresh.prefill(&p[..n]).unwrap();
        assert_eq!(long.tokens(), fresh.tokens());
        assert!(bits(&long) == bits(&fresh), "rewind to {n}");
        assert_eq!(greedy(&mut long, 4), greedy(&mut fresh, 4), "rewind to {n}");
    }
    let mut r = session(64, Precision::Fast);
    r.prefill(&p[..10]).unwrap();
    assert!(matches!(
        r.rewind(11),
        Err(EngineError::RewindBeyondEnd { to: 11, len: 10 })
    ));
    r.rewind(0).unwrap();
    assert!(r.tokens().is_empty());
}

#[test]
fn damaged_payloads_are_rejected_and_leave_the_session_empty() {
    let p = prompt();
    let mut a = session(256, Precision::Fast);
    a.prefill(&p[..40]).unwrap();
    let mut good = Vec::new();
    a.save_payload(&mut good).unwrap();

    let check = |bytes: &[u8], want: &str| {
        let mut s = session(256, Precision::Fast);
        s.prefill(&p[..5]).unwrap();
        let e = s.load_payload(&mut &bytes[..]).unwrap_err().to_string();
        assert!(e.contains(want), "expected {want:?} in {e:?}");
        assert!(
            s.tokens().is_empty() && s.logits().is_err(),
            "{want}: session not emptied"
        );
    };
    for cut in [0, 3, 20, 44, 44 + 4 * 40, good.len() / 2, good.len() - 1] {
        check(&good[..cut], "truncated");
    }
    let mut trailing = good.clone();
    trailing.push(0);
    check(&trailing, "trailing bytes");
    let mut magic = good.clone();
    magic[0] = b'X';
    check(&magic, "magic");
    let mut version = good.clone();
    version[4] = 9;
    check(&version, "version 9");
    let mut shape = good.clone();
    shape[12] ^= 1; // n_layer
    check(&shape, "differs from the model");
    let mut token = good.clone();
    token[44..48].copy_from_slice(&u32::MAX.to_le_bytes());
    check(&token, "outside the vocabulary");
}

/// f16 K/V: payloads are half the K/V bytes, round-trip bitwise, chunked prefill
/// equals token-by-token decoding; a payload of the other K/V type is refused with
/// the typed error and leaves the session empty.
#[test]
fn f16_payloads_round_trip_and_do_not_load_into_f32_sessions() {
    let p = prompt();
    let mut h = session_kv(512, Precision::Fast, KvType::F16);
    h.prefill(&p[..3 * CHUNK + 5]).unwrap();
    let mut hb = Vec::new();
    h.save_payload(&mut hb).unwrap();
    assert_eq!(hb.len() as u64, h.payload_bytes());
    let mut f = session(512, Precision::Fast);
    f.prefill(&p[..3 * CHUNK + 5]).unwrap();
    let mut fb = Vec::new();
    f.save_payload(&mut fb).unwrap();
    let hp = &model().hparams;
    let (l, kvh, hd, vocab) = (hp.n_layer, hp.n_head_kv, hp.head_dim, hp.n_vocab);
    let [l, kvh, hd, vocab] = [l, kvh, hd, vocab].map(|x| x as u64);
    let t = 3 * CHUNK as u64 + 5;
    let fixed = 44 + 4 * t + 4 * vocab;
    assert_eq!(fb.len() as u64 - fixed, 4 * 2 * l * kvh * t * hd);
    assert_eq!(hb.len() as u64 - fixed, 2 * 2 * l * kvh * t * hd);
    assert_ne!(h.state_fingerprint(), f.state_fingerprint());
    assert_eq!(f.state_fingerprint(), model().fingerprint.model);

    // Round trip, then the continuation is the uninterrupted one.
    let mut h2 = session_kv(512, Precision::Fast, KvType::F16);
    h2.load_payload(&mut hb.as_slice()).unwrap();
    assert!(bits(&h2) == bits(&h));
    // Token by token from the same prefix gives the same bits as chunked prefill.
    let mut tbt = session_kv(512, Precision::Fast, KvType::F16);
    for &t in &p[..3 * CHUNK + 5] {
        tbt.decode_step(t).unwrap();
    }
    assert!(bits(&tbt) == bits(&h), "f16: chunked != token by token");
    assert_eq!(greedy(&mut h2, 5), greedy(&mut h, 5));

    for (bytes, into, want) in [
        (&hb, KvType::F32, (KvType::F16, KvType::F32)),
        (&fb, KvType::F16, (KvType::F32, KvType::F16)),
    ] {
        let mut s = session_kv(512, Precision::Fast, into);
        s.prefill(&p[..5]).unwrap();
        let e = s.load_payload(&mut bytes.as_slice()).unwrap_err();
        assert!(
            matches!(e, EngineError::KvTypeMismatch { payload, session } if (payload, session) == want),
            "{e}"
        );
        assert!(e.to_string().contains("--kv-type"), "{e}");
        assert!(s.tokens().is_empty() && s.logits().is_err());
    }
}

/// A second session in the same state, built through the public payload API.
trait CloneForTest {
    fn clone_for_test(&self) -> Session;
}

impl CloneForTest for Session {
    fn clone_for_test(&self) -> Session {
        let mut s = session(self.n_ctx(), Precision::Fast);
        s.restore(&self.snapshot().unwrap()).unwrap();
        s
    }
}
