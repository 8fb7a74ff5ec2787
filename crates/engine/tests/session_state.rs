//! Session state as an asset, for every family on its real model: a payload
//! written and read back, a snapshot restored, or a rewind must give bitwise the
//! next-token logits and the greedy continuation of the uninterrupted session.
//! Where a sliding-window ring can no longer be cut back, the session says so and
//! a cold run is the answer, never wrong logits. Damaged payloads are rejected
//! whole and leave the session empty; payloads of the first format still load.

mod families;

use std::sync::Arc;

use ds4_engine::sampler::argmax;
use ds4_engine::{EngineError, KvType, Precision, Session, SessionOptions, ThreadPool};
use families::Family;

const CHUNK: usize = 64;

fn session(f: &Family, n_ctx: usize, precision: Precision) -> Session {
    session_kv(f, n_ctx, precision, KvType::F32)
}

fn session_kv(f: &Family, n_ctx: usize, precision: Precision, kv_type: KvType) -> Session {
    let opts = SessionOptions {
        n_ctx,
        prefill_chunk: CHUNK,
        precision,
        kv_type,
    };
    Session::new(families::model(f), Arc::new(ThreadPool::new(2)), &opts)
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

/// A second session in the same state, through the public payload API.
fn clone_of(f: &Family, s: &Session) -> Session {
    let mut c = session_kv(f, s.n_ctx(), s.precision(), s.kv_type());
    c.restore(&s.snapshot().unwrap()).unwrap();
    c
}

fn payload_round_trip_is_bitwise_at_several_lengths(f: &Family) {
    let p = families::long_prompt(f);
    for (len, precision) in [
        (1, Precision::Fast),
        (CHUNK - 1, Precision::Fast),
        (CHUNK, Precision::Fast),
        (CHUNK + 1, Precision::Q8),
        (3 * CHUNK + 17, Precision::Fast),
        (100, Precision::Exact),
        // Past a 512-token window: the ring has wrapped.
        (700, Precision::Fast),
    ] {
        let mut a = session(f, 1024, precision);
        a.prefill(&p[..len]).unwrap();
        let mut bytes = Vec::new();
        a.save_payload(&mut bytes).unwrap();
        assert_eq!(
            bytes.len() as u64,
            a.payload_bytes(),
            "len {len}: size estimate"
        );

        let mut b = session(f, 1024, precision);
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
        // A session with another prefill chunk (so another ring length) takes
        // the payload too and continues the same way.
        let opts = SessionOptions {
            n_ctx: 1024,
            prefill_chunk: 16,
            precision,
            kv_type: KvType::F32,
        };
        let mut c = Session::new(families::model(f), Arc::new(ThreadPool::new(1)), &opts);
        c.load_payload(&mut bytes.as_slice()).unwrap();
        let mut a2 = session(f, 1024, precision);
        a2.load_payload(&mut bytes.as_slice()).unwrap();
        assert_eq!(
            greedy(&mut c, 4),
            greedy(&mut a2, 4),
            "len {len}: other chunk"
        );
        assert!(bits(&c) == bits(&a2), "len {len}: other chunk");
    }
}

fn payload_loads_into_a_larger_context_only(f: &Family) {
    let p = families::long_prompt(f);
    let mut a = session(f, 256, Precision::Fast);
    a.prefill(&p[..200]).unwrap();
    let mut bytes = Vec::new();
    a.save_payload(&mut bytes).unwrap();
    let mut big = session(f, 1024, Precision::Fast);
    big.load_payload(&mut bytes.as_slice()).unwrap();
    assert!(bits(&big) == bits(&a));
    let mut small = session(f, 128, Precision::Fast);
    let e = small.load_payload(&mut bytes.as_slice()).unwrap_err();
    assert!(
        e.to_string()
            .contains("do not fit this session's context of 128"),
        "{e}"
    );
    assert!(small.tokens().is_empty());
}

fn snapshot_restore_and_rewind_are_exact(f: &Family) {
    let p = families::long_prompt(f);
    let mut s = session(f, 1024, Precision::Fast);
    s.prefill(&p[..150]).unwrap();
    let snap = s.snapshot().unwrap();
    let at_150 = bits(&s);
    let cont_150 = greedy(&mut clone_of(f, &s), 5);
    s.prefill(&p[150..400]).unwrap();
    s.restore(&snap).unwrap();
    assert!(bits(&s) == at_150, "restore");
    assert_eq!(greedy(&mut s, 5), cont_150);

    // Rewind into the middle of a prefill chunk and to a chunk boundary.
    for n in [97, CHUNK * 2, 1] {
        let mut long = session(f, 1024, Precision::Fast);
        long.prefill(&p[..300]).unwrap();
        long.rewind(n).unwrap();
        let mut fresh = session(f, 1024, Precision::Fast);
        fresh.prefill(&p[..n]).unwrap();
        assert_eq!(long.tokens(), fresh.tokens());
        assert!(bits(&long) == bits(&fresh), "rewind to {n}");
        assert_eq!(greedy(&mut long, 4), greedy(&mut fresh, 4), "rewind to {n}");
    }
    let mut r = session(f, 64, Precision::Fast);
    r.prefill(&p[..10]).unwrap();
    assert!(matches!(
        r.rewind(11),
        Err(EngineError::RewindBeyondEnd { to: 11, len: 10 })
    ));
    r.rewind(0).unwrap();
    assert!(r.tokens().is_empty());
}

/// Past a sliding window: a rewind the state still holds the rows for is
/// exact; one further back is refused (the session unchanged), and the
/// answer then is a cold run, whose logits the refused rewind never faked.
/// Dense families rewind anywhere. A session about to load the state says
/// the same beforehand.
fn rewind_past_the_window_is_exact_or_refused(f: &Family) {
    let p = families::long_prompt(f);
    let mut s = session(f, 1024, Precision::Fast);
    s.prefill(&p[..900]).unwrap();
    let at_900 = bits(&s);
    // 20 back is inside the ring's slack (one prefill chunk); 600 back is not
    // for a 512-token window.
    for n in [880, 300] {
        let mut fresh = session(f, 1024, Precision::Fast);
        fresh.prefill(&p[..n]).unwrap();
        let mut t = clone_of(f, &s);
        if t.can_rewind(n) {
            t.rewind(n).unwrap();
            assert!(bits(&t) == bits(&fresh), "rewind to {n}");
            assert_eq!(greedy(&mut t, 4), greedy(&mut fresh, 4), "rewind to {n}");
        } else {
            assert_eq!(f.name, "gemma3", "only a ring refuses");
            let e = t.rewind(n).unwrap_err();
            assert!(
                matches!(e, EngineError::CannotCutBack { to, len: 900 } if to == n),
                "{e}"
            );
            assert_eq!(t.tokens().len(), 900, "a refused rewind changes nothing");
            assert!(bits(&t) == at_900);
        }
    }
    assert!(s.can_rewind(880), "{}: within the slack", f.name);
    assert_eq!(s.can_rewind(300), f.name != "gemma3", "{}", f.name);
    // Before a load, an empty session answers as the loaded one will: a
    // checkpoint is not read only to find it cannot be cut there.
    let mut payload = Vec::new();
    s.save_payload(&mut payload).unwrap();
    for n in [0, 300, 880, 900] {
        let mut loaded = session(f, 1024, Precision::Fast);
        let before = loaded.could_rewind_loaded(900, n);
        loaded.load_payload(&mut payload.as_slice()).unwrap();
        assert_eq!(before, loaded.can_rewind(n), "{}: rewind to {n}", f.name);
    }
    assert!(!s.could_rewind_loaded(900, 901));
}

fn damaged_payloads_are_rejected_and_leave_the_session_empty(f: &Family) {
    let p = families::long_prompt(f);
    let mut a = session(f, 256, Precision::Fast);
    a.prefill(&p[..40]).unwrap();
    let mut good = Vec::new();
    a.save_payload(&mut good).unwrap();

    let check = |bytes: &[u8], want: &str| {
        let mut s = session(f, 256, Precision::Fast);
        s.prefill(&p[..5]).unwrap();
        let e = s.load_payload(&mut &bytes[..]).unwrap_err().to_string();
        assert!(e.contains(want), "expected {want:?} in {e:?}");
        assert!(
            s.tokens().is_empty() && s.logits().is_err(),
            "{want}: session not emptied"
        );
    };
    // Header (28 bytes), tokens, logits, then the state's descriptor.
    let n_vocab = families::model(f).hparams().n_vocab;
    let state = 28 + 4 * 40 + 4 * n_vocab;
    for cut in [
        0,
        3,
        20,
        28,
        28 + 4 * 40,
        state + 2,
        state + 20,
        good.len() / 2,
        good.len() - 1,
    ] {
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
    let mut family = good.clone();
    family[8] ^= 3;
    check(&family, "in the payload; this model is");
    let mut vocab = good.clone();
    vocab[12] ^= 1;
    check(&vocab, "vocabulary");
    let mut token = good.clone();
    token[28..32].copy_from_slice(&u32::MAX.to_le_bytes());
    check(&token, "outside the vocabulary");
    let mut kind = good.clone();
    kind[state] ^= 2;
    check(&kind, "state kind");
    let mut layers = good.clone();
    layers[state + 8] ^= 1;
    check(&layers, "layers");
    let mut head_dim = good.clone();
    head_dim[state + 12 + 4] ^= 1;
    check(&head_dim, "in the payload");
    let mut first = good.clone();
    first[state + 12 + 12] = 30; // layer 0 claims to hold positions from 30 of 40
    let e = {
        let mut s = session(f, 256, Precision::Fast);
        s.load_payload(&mut first.as_slice())
    };
    // A dense layer must hold every position; a window of 512 every one of 40.
    assert!(e.is_err(), "a payload missing rows loaded");
}

/// f16 K/V: payloads are half the K/V bytes, round-trip bitwise, chunked prefill
/// equals token-by-token decoding; a payload of the other K/V type is refused with
/// the typed error and leaves the session empty.
fn f16_payloads_round_trip_and_do_not_load_into_f32_sessions(f: &Family) {
    let p = families::long_prompt(f);
    let model = families::model(f);
    let t = 3 * CHUNK + 5;
    let mut h = session_kv(f, 512, Precision::Fast, KvType::F16);
    h.prefill(&p[..t]).unwrap();
    let mut hb = Vec::new();
    h.save_payload(&mut hb).unwrap();
    assert_eq!(hb.len() as u64, h.payload_bytes());
    let mut fs = session(f, 512, Precision::Fast);
    fs.prefill(&p[..t]).unwrap();
    let mut fb = Vec::new();
    fs.save_payload(&mut fb).unwrap();
    let hp = model.hparams();
    let [l, kvh, hd, vocab, t] =
        [hp.n_layer, hp.n_head_kv, hp.head_dim, hp.n_vocab, t].map(|x| x as u64);
    let fixed = 28 + 4 * t + 4 * vocab + 4 * (3 + 4 * l);
    assert_eq!(fb.len() as u64 - fixed, 4 * 2 * l * kvh * t * hd);
    assert_eq!(hb.len() as u64 - fixed, 2 * 2 * l * kvh * t * hd);
    assert_ne!(h.state_fingerprint(), fs.state_fingerprint());
    assert_eq!(fs.state_fingerprint(), model.fingerprint.model);

    // Round trip, then the continuation is the uninterrupted one.
    let mut h2 = session_kv(f, 512, Precision::Fast, KvType::F16);
    h2.load_payload(&mut hb.as_slice()).unwrap();
    assert!(bits(&h2) == bits(&h));
    // Token by token from the same prefix gives the same bits as chunked prefill.
    let mut tbt = session_kv(f, 512, Precision::Fast, KvType::F16);
    for &id in &p[..t as usize] {
        tbt.decode_step(id).unwrap();
    }
    assert!(bits(&tbt) == bits(&h), "f16: chunked != token by token");
    assert_eq!(greedy(&mut h2, 5), greedy(&mut h, 5));

    for (bytes, into, want) in [
        (&hb, KvType::F32, (KvType::F16, KvType::F32)),
        (&fb, KvType::F16, (KvType::F32, KvType::F16)),
    ] {
        let mut s = session_kv(f, 512, Precision::Fast, into);
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

/// A speculative step keeps only its verified part: after a step of a token
/// and a draft with every row kept, keeping its first `n` tokens gives
/// bitwise the logits and the continuation of a session that ran those
/// tokens alone (past a sliding window; DeepSeek V4's compressed state drafts
/// only as far as it can be cut back), and misuse is refused.
fn keeping_part_of_a_step_is_that_part_alone(f: &Family) {
    let p = families::long_prompt(f);
    let mut base = session_kv(f, 1024, Precision::Fast, KvType::F16);
    base.prefill(&p[..600]).unwrap();
    base.keep_step_logits(true);
    let k = base.max_draft(7);
    assert!(k <= 7 && base.max_draft(0) == 0);
    // 601 tokens, then back to 601: DeepSeek V4's 4-token compression
    // window starting at 600 holds two more.
    let want = if f.name == "deepseek4" { 2 } else { 7 };
    assert_eq!(k, want, "{}", f.name);
    let step = &p[600..601 + k];
    for n in 1..=step.len() {
        let mut s = clone_of(f, &base);
        s.keep_step_logits(true);
        s.prefill(step).unwrap();
        s.keep_verified(step.len(), n).unwrap();
        let mut alone = session_kv(f, 1024, Precision::Fast, KvType::F16);
        alone.prefill(&p[..600 + n]).unwrap();
        assert_eq!(s.tokens(), alone.tokens());
        assert!(
            bits(&s) == bits(&alone),
            "{}: kept {n} of {}",
            f.name,
            step.len()
        );
        s.keep_step_logits(false);
        assert_eq!(
            greedy(&mut s, 4),
            greedy(&mut alone, 4),
            "{}: kept {n}",
            f.name
        );
    }
    // Nothing kept, more than the step, or a step without its rows: refused,
    // the session unchanged.
    let mut s = clone_of(f, &base);
    s.keep_step_logits(true);
    s.prefill(step).unwrap();
    let want = bits(&s);
    for n in [0, step.len() + 1] {
        let e = s.keep_verified(step.len(), n).unwrap_err();
        assert!(matches!(e, EngineError::KeepVerified { .. }), "{e}");
    }
    s.keep_step_logits(false);
    assert!(s.keep_verified(step.len(), 1).is_err());
    assert!(bits(&s) == want && s.tokens().len() == 601 + k);
}

for_each_family!(
    payload_round_trip_is_bitwise_at_several_lengths,
    keeping_part_of_a_step_is_that_part_alone,
    payload_loads_into_a_larger_context_only;
    attention:
    snapshot_restore_and_rewind_are_exact,
    rewind_past_the_window_is_exact_or_refused,
    damaged_payloads_are_rejected_and_leave_the_session_empty,
    f16_payloads_round_trip_and_do_not_load_into_f32_sessions,
);

/// A payload of one family does not load into a session of another (DS4S
/// payloads name their family; DeepSeek V4's DSV4 payloads are another layout).
#[test]
fn payloads_do_not_cross_families() {
    let (a, b, c) = (&families::SMOLLM2, &families::GEMMA3, &families::DEEPSEEK4);
    for (from, into) in [(a, b), (b, a), (c, a), (a, c)] {
        let p = families::long_prompt(from);
        let mut s = session(from, 256, Precision::Fast);
        s.prefill(&p[..20]).unwrap();
        let mut bytes = Vec::new();
        s.save_payload(&mut bytes).unwrap();
        let mut t = session(into, 256, Precision::Fast);
        let e = t
            .load_payload(&mut bytes.as_slice())
            .unwrap_err()
            .to_string();
        let want = match (from.name, into.name) {
            ("deepseek4", _) => "magic",
            (_, "deepseek4") => "magic",
            _ => "in the payload; this model is",
        };
        assert!(e.contains(want), "{} into {}: {e}", from.name, into.name);
        assert!(t.tokens().is_empty());
    }
}

/// A version-1 payload (written before payloads described their state: SmolLM2,
/// f16 K/V, "The capital of France is", prefill chunk 16) still loads: its state
/// is a fresh run's, as the build that wrote it computed it. That build's SiLU
/// took libm's `expf` where this one takes the kernels' `exp` (within 2 ulp),
/// so its logits are a fresh run's to within the fast path's scatter (0.0053
/// measured; f16 K/V alone moves them ~0.01), not bitwise; a misread K/V row
/// or head would move them by whole nats.
#[test]
fn version_1_payloads_still_load() {
    let f = &families::SMOLLM2;
    let bytes = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/smollm2-v1-f16.payload"),
    )
    .unwrap();
    assert_eq!(&bytes[4..8], &1u32.to_le_bytes(), "a version-1 payload");
    let mut old = session_kv(f, 64, Precision::Fast, KvType::F16);
    old.load_payload(&mut bytes.as_slice()).unwrap();
    assert_eq!(old.tokens(), &[504, 3575, 282, 4649, 314]);
    let mut fresh = session_kv(f, 64, Precision::Fast, KvType::F16);
    fresh.prefill(old.tokens()).unwrap();
    let worst = |a: &Session, b: &Session| {
        let (a, b) = (a.logits().unwrap(), b.logits().unwrap());
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
    };
    let d = worst(&old, &fresh);
    assert!(d < 0.02, "loaded logits differ from a fresh run's by {d}");
    // The continuation reads the loaded K/V rows.
    assert_eq!(greedy(&mut old, 5), greedy(&mut fresh, 5));
    let d = worst(&old, &fresh);
    assert!(d < 0.02, "after 5 tokens the logits differ by {d}");
    // Its K/V type is checked like a current payload's.
    let mut f32s = session_kv(f, 64, Precision::Fast, KvType::F32);
    let e = f32s.load_payload(&mut bytes.as_slice()).unwrap_err();
    assert!(matches!(e, EngineError::KvTypeMismatch { .. }), "{e}");
}
