//! Save → index → lookup → load round trips, lookup rules (longest prefix, context
//! direction, fingerprints), keep/replace of same-name files, in-place usage updates,
//! permissions and streamed payloads.

mod common;

use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;

use common::*;
use ds4_kvstore::{
    file_name_for, Mismatch, Notice, Payload, SaveOutcome, SaveReason, SaveRequest, Section,
    SkipReason, Store, StoreConfig, HEADER_LEN,
};

#[test]
fn round_trip_random() {
    let td = TempDir::new("rt");
    let store = Store::open(td.store_dir(), big_config()).unwrap();
    let mut rng = Rng::new(1);
    for i in 0..40 {
        let n = 1 + rng.below(3000) as usize;
        let text = rng.text(n);
        let n = rng.below(70_000) as usize;
        let payload = rng.bytes(n);
        let nsec = rng.below(3) as usize;
        let sections: Vec<Section> = (0..nsec)
            .map(|k| {
                let n = rng.below(500) as usize;
                Section {
                    kind: k as u32 + 1,
                    bytes: rng.bytes(n),
                }
            })
            .collect();
        let mut spec = Spec::new(&text, &payload);
        spec.sections = &sections;
        spec.reason = SaveReason::from_u8((i % 7) as u8).unwrap();
        let out = save(&store, &spec);
        let path = saved_path(&out);
        assert_eq!(
            path.file_name().unwrap().to_str().unwrap(),
            file_name_for(&text)
        );
        // A fresh store indexes it from the header alone.
        let fresh = Store::open(td.store_dir(), big_config()).unwrap();
        let mut prompt = text.clone();
        let n = rng.below(100) as usize;
        prompt.extend(rng.text(n));
        let cand = fresh.lookup(&prompt, &MODEL_A, 8192).unwrap().expect("hit");
        assert_eq!(cand.path, path);
        assert_eq!(cand.header.text_bytes, text.len() as u64);
        let l = fresh.load(&cand, &prompt).unwrap();
        assert_eq!(l.text, text);
        assert_eq!(l.payload, payload);
        assert_eq!(l.sections, sections);
        assert_eq!(l.header.reason, spec.reason);
        assert_eq!(l.header.tokens, spec.tokens);
        assert_eq!(l.header.n_ctx, 8192);
        assert_eq!(l.header.ext_flags, u32::from(nsec > 0));
        assert_eq!(l.header.hits, 1);
        store.remove(cand.hash.as_str()).unwrap();
    }
    assert!(store.verify(false).unwrap().bad.is_empty());
}

#[test]
fn longest_prefix_wins() {
    let td = TempDir::new("longest");
    let store = Store::open(td.store_dir(), big_config()).unwrap();
    let mut rng = Rng::new(2);
    let full = rng.text(5000);
    // Nested prefixes, saved in shuffled order, plus a non-prefix of similar length.
    let lens = [100usize, 4000, 900, 2500, 4999];
    for &n in &lens {
        let payload = vec![n as u8; 64];
        save(&store, &Spec::new(&full[..n], &payload));
    }
    let mut other = full[..4500].to_vec();
    other[4499] ^= 1;
    save(&store, &Spec::new(&other, b"x"));
    for (prompt_len, want) in [
        (5000, Some(4999)),
        (4999, Some(4999)),
        (4998, Some(4000)),
        (3000, Some(2500)),
        (2499, Some(900)),
        (150, Some(100)),
        (99, None),
    ] {
        let got = store
            .lookup(&full[..prompt_len], &MODEL_A, 8192)
            .unwrap()
            .map(|c| c.header.text_bytes as usize);
        assert_eq!(got, want, "prompt {prompt_len}");
    }
    let c = store.lookup(&full, &MODEL_A, 8192).unwrap().unwrap();
    assert_eq!(
        store.load(&c, &full).unwrap().payload,
        vec![4999u16 as u8; 64]
    );
}

#[test]
fn context_direction_and_fingerprints() {
    let td = TempDir::new("ctx");
    let mut rng = Rng::new(3);
    let text = rng.text(800);
    {
        let store = Store::open(td.store_dir(), big_config()).unwrap();
        let mut s = Spec::new(&text, b"payload");
        s.n_ctx = 4096;
        save(&store, &s);
        // Saved at 4096: loads into 4096 and larger, never smaller.
        assert!(store.lookup(&text, &MODEL_A, 4096).unwrap().is_some());
        assert!(store.lookup(&text, &MODEL_A, 65536).unwrap().is_some());
        assert!(store.lookup(&text, &MODEL_A, 4095).unwrap().is_none());
        // Another model never matches; another quant matches while accepted.
        assert!(store.lookup(&text, &MODEL_B, 8192).unwrap().is_none());
        let c = store.lookup(&text, &MODEL_A_Q2, 8192).unwrap().unwrap();
        assert_eq!(store.load(&c, &text).unwrap().payload, b"payload");
    }
    let reject = StoreConfig {
        reject_different_quant: true,
        ..big_config()
    };
    let store = Store::open(td.store_dir(), reject).unwrap();
    assert!(store.lookup(&text, &MODEL_A_Q2, 8192).unwrap().is_none());
    assert!(store.lookup(&text, &MODEL_A, 8192).unwrap().is_some());
}

/// Within one quantization the weights must match: a file with other tensor
/// data (or one from before weights were recorded) is refused, and
/// `lookup_refused` names it with why.
#[test]
fn other_weights_are_refused_and_named() {
    let td = TempDir::new("weights");
    let mut rng = Rng::new(4);
    let text = rng.text(800);
    let store = Store::open(td.store_dir(), big_config()).unwrap();
    let path = saved_path(&save(&store, &Spec::new(&text, b"payload")));
    assert!(store.lookup(&text, &MODEL_A, 8192).unwrap().is_some());
    assert!(store
        .lookup(&text, &MODEL_A_TAMPERED, 8192)
        .unwrap()
        .is_none());
    let (p, h, why) = store
        .lookup_refused(&text, &MODEL_A_TAMPERED, 8192)
        .unwrap()
        .unwrap();
    assert_eq!(
        (p, h.model, why),
        (path.clone(), MODEL_A, Mismatch::Weights)
    );
    assert!(why.to_string().contains("weights differ"), "{why}");
    // Another quantization is another question (accepted by default).
    assert!(store.lookup(&text, &MODEL_A_Q2, 8192).unwrap().is_some());
    assert!(store
        .lookup_refused(&text, &MODEL_A, 8192)
        .unwrap()
        .is_none());
    assert_eq!(
        store
            .lookup_refused(&text, &MODEL_B, 8192)
            .unwrap()
            .map(|r| r.2),
        Some(Mismatch::Model)
    );
    // A file from before the weights were recorded (zeros there) matches nothing
    // of its quantization.
    patch_header(&path, |h| h.model.weights_fp = [0; 16]);
    let store = Store::open(td.store_dir(), big_config()).unwrap();
    assert!(store.lookup(&text, &MODEL_A, 8192).unwrap().is_none());
    assert_eq!(
        store
            .lookup_refused(&text, &MODEL_A, 8192)
            .unwrap()
            .map(|r| r.2),
        Some(Mismatch::WeightsUnknown)
    );
}

#[test]
fn prefix_mismatch_is_reported_not_loaded() {
    let td = TempDir::new("prefix");
    let store = Store::open(td.store_dir(), big_config()).unwrap();
    let text = b"the rendered prompt prefix".repeat(30);
    save(&store, &Spec::new(&text, b"p"));
    let c = store.lookup(&text, &MODEL_A, 8192).unwrap().unwrap();
    let mut other = text.clone();
    other[3] ^= 1;
    assert!(matches!(
        store.load(&c, &other),
        Err(ds4_kvstore::KvError::PrefixMismatch { .. })
    ));
}

#[test]
fn existing_compatible_file_is_kept_incompatible_replaced() {
    let td = TempDir::new("keep");
    let store = Store::open(td.store_dir(), big_config()).unwrap();
    let text = b"system prompt and tools ".repeat(40);
    let mut s = Spec::new(&text, b"first payload");
    s.n_ctx = 4096;
    let path = saved_path(&save(&store, &s));
    patch_header(&path, |h| {
        h.last_used = 1000;
        h.hits = 5;
    });
    // Same text from a session with a larger context: the file is loadable there, keep.
    s.payload = b"second payload";
    s.n_ctx = 8192;
    assert_eq!(save(&store, &s), SaveOutcome::Kept { path: path.clone() });
    let h = read_header(&path);
    assert_eq!(h.hits, 5);
    assert!(h.last_used > 1000);
    assert_eq!(fs::read(&path).unwrap().len(), HEADER_LEN + text.len() + 13);
    // A smaller context cannot load a file saved at 4096: replace it.
    s.n_ctx = 2048;
    match save(&store, &s) {
        SaveOutcome::Saved { replaced, .. } => assert!(replaced),
        o => panic!("{o:?}"),
    }
    let h = read_header(&path);
    assert_eq!((h.hits, h.n_ctx, h.payload_bytes), (0, 2048, 14));
    // Different sections: rewritten (atomically), not patched.
    let sec = [Section {
        kind: 1,
        bytes: b"call_1 -> <tool>".to_vec(),
    }];
    s.sections = &sec;
    assert!(matches!(
        save(&store, &s),
        SaveOutcome::Saved { replaced: true, .. }
    ));
    assert_eq!(save(&store, &s), SaveOutcome::Kept { path: path.clone() });
    let c = store.lookup(&text, &MODEL_A, 2048).unwrap().unwrap();
    assert_eq!(store.load(&c, &text).unwrap().sections, sec);
    assert_eq!(dir_names(&td.store_dir()).len(), 1);
}

#[test]
fn in_place_usage_update_keeps_file_valid() {
    let td = TempDir::new("usage");
    let store = Store::open(td.store_dir(), big_config()).unwrap();
    let mut rng = Rng::new(4);
    let text = rng.text(2000);
    let payload = rng.bytes(100_000);
    let path = saved_path(&save(&store, &Spec::new(&text, &payload)));
    patch_header(&path, |h| h.last_used = 12345);
    let before = fs::read(&path).unwrap();
    let ino = fs::metadata(&path).unwrap();
    for n in 1..=3u32 {
        let c = store.lookup(&text, &MODEL_A, 8192).unwrap().unwrap();
        let l = store.load(&c, &text).unwrap();
        assert_eq!(l.header.hits, n);
        let h = read_header(&path);
        assert_eq!(h.hits, n);
        assert!(h.last_used >= ds4_kvstore::now_unix() - 5);
    }
    let after = fs::read(&path).unwrap();
    // Only the 20-byte usage tail of the header changed; same inode, same size.
    assert_eq!(before.len(), after.len());
    let diff: Vec<usize> = (0..before.len())
        .filter(|&i| before[i] != after[i])
        .collect();
    assert!(diff.iter().all(|&i| (108..128).contains(&i)), "{diff:?}");
    use std::os::unix::fs::MetadataExt;
    assert_eq!(fs::metadata(&path).unwrap().ino(), ino.ino());
    let fresh = Store::open(td.store_dir(), big_config()).unwrap();
    assert!(fresh.drain_notices().is_empty());
    let r = fresh.verify(false).unwrap();
    assert_eq!((r.checked, r.ok), (1, 1));
    assert_eq!(fresh.entries().unwrap()[0].header.hits, 3);
}

#[test]
fn permissions() {
    let td = TempDir::new("perm");
    let dir = td.0.join("a/b/kv");
    let store = Store::open(&dir, big_config()).unwrap();
    assert_eq!(
        fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
        0o700
    );
    assert!(store.drain_notices().is_empty());
    let path = saved_path(&save(&store, &Spec::new(&[b'x'; 600], b"p")));
    assert_eq!(
        fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    drop(store);
    // An existing, group-readable directory is reported, not changed.
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    let store = Store::open(&dir, big_config()).unwrap();
    assert_eq!(
        store.drain_notices(),
        vec![Notice::InsecureDir {
            dir: dir.clone(),
            mode: 0o755
        }]
    );
    assert_eq!(
        fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
        0o755
    );
}

#[test]
fn streamed_payload() {
    let td = TempDir::new("stream");
    let store = Store::open(td.store_dir(), big_config()).unwrap();
    let mut rng = Rng::new(5);
    let text = rng.text(1000);
    let chunks: Vec<Vec<u8>> = (0..20).map(|_| rng.bytes(50_000)).collect();
    let mut write = |w: &mut dyn Write| {
        for c in &chunks {
            w.write_all(c)?;
        }
        Ok(())
    };
    let out = store
        .save(SaveRequest {
            text: &text,
            // Deliberately inexact: the header records what was written.
            payload: Payload::Stream {
                estimated_bytes: 900_000,
                write: &mut write,
            },
            reason: SaveReason::Continued,
            tokens: 250,
            n_ctx: 4096,
            model: MODEL_A,
            ext_flags: 0,
            sections: &[],
        })
        .unwrap();
    assert!(
        matches!(out, SaveOutcome::Saved { file_bytes, .. } if file_bytes == 128 + 1000 + 1_000_000)
    );
    let c = store.lookup(&text, &MODEL_A, 4096).unwrap().unwrap();
    assert_eq!(store.load(&c, &text).unwrap().payload, chunks.concat());

    // A stream larger than the budget allows is caught after writing; nothing stays.
    let small = Store::open(
        td.0.join("small"),
        StoreConfig {
            budget_bytes: 10_000,
            ..StoreConfig::default()
        },
    )
    .unwrap();
    let mut big = |w: &mut dyn Write| w.write_all(&[7u8; 20_000]);
    let out = small
        .save(SaveRequest {
            text: &text,
            payload: Payload::Stream {
                estimated_bytes: 10,
                write: &mut big,
            },
            reason: SaveReason::Continued,
            tokens: 250,
            n_ctx: 4096,
            model: MODEL_A,
            ext_flags: 0,
            sections: &[],
        })
        .unwrap();
    assert_eq!(
        out,
        SaveOutcome::Skipped(SkipReason::OverBudget {
            file_bytes: 128 + 1000 + 20_000,
            budget_bytes: 10_000
        })
    );
    assert!(dir_names(&td.0.join("small")).is_empty());
}

#[test]
fn invalid_requests() {
    let td = TempDir::new("invalid");
    let store = Store::open(td.store_dir(), big_config()).unwrap();
    let mut s = Spec::new(b"abc", b"p");
    s.tokens = 0;
    fn req<'a>(s: &Spec<'a>) -> SaveRequest<'a> {
        SaveRequest {
            text: s.text,
            payload: Payload::Bytes(s.payload),
            reason: s.reason,
            tokens: s.tokens,
            n_ctx: s.n_ctx,
            model: s.model,
            ext_flags: 0,
            sections: &[],
        }
    }
    assert!(matches!(
        store.save(req(&s)),
        Err(ds4_kvstore::KvError::InvalidRequest(_))
    ));
    s.tokens = 10;
    s.n_ctx = 9;
    assert!(matches!(
        store.save(req(&s)),
        Err(ds4_kvstore::KvError::InvalidRequest(_))
    ));
    assert!(store.remove("not-a-hash").is_err());
    assert!(!store.remove(&"0".repeat(40)).unwrap());
    assert!(dir_names(&td.store_dir()).is_empty());
}

#[test]
fn entries_and_clear() {
    let td = TempDir::new("ls");
    let store = Store::open(td.store_dir(), big_config()).unwrap();
    let long = "héllo wörld, ".repeat(20);
    save(&store, &Spec::new(long.as_bytes(), b"p1"));
    save(&store, &Spec::new(b"short text of a prompt", b"p2"));
    fs::write(td.store_dir().join("notes.txt"), b"mine").unwrap();
    let e = store.entries().unwrap();
    assert_eq!(e.len(), 2);
    let ex: Vec<&str> = e.iter().map(|e| e.excerpt.as_str()).collect();
    assert!(ex.contains(&"short text of a prompt"));
    let want: String = long.chars().take(60).collect();
    assert!(ex.contains(&want.as_str()));
    assert_eq!(store.clear().unwrap(), 2);
    assert_eq!(dir_names(&td.store_dir()), vec!["notes.txt"]);
    assert!(store.entries().unwrap().is_empty());
}

#[test]
fn sections_are_read_without_the_payload() {
    let td = TempDir::new("sections");
    let store = Store::open(td.store_dir(), big_config()).unwrap();
    let sections = vec![Section {
        kind: 1,
        bytes: b"tool map".to_vec(),
    }];
    let payload = vec![7u8; 50_000];
    let mut with = Spec::new(b"with sections", &payload);
    with.sections = &sections;
    let with_path = saved_path(&save(&store, &with));
    save(&store, &Spec::new(b"without sections", &payload));
    let found = Store::open(td.store_dir(), big_config())
        .unwrap()
        .sections_with_flags(1)
        .unwrap();
    assert_eq!(found, vec![(with_path.clone(), sections)]);
    // A damaged section area is skipped, not an error.
    let mut bytes = fs::read(&with_path).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0xff;
    bytes.truncate(n - 1);
    fs::write(&with_path, &bytes).unwrap();
    assert!(store.sections_with_flags(1).unwrap().is_empty());
}

#[test]
fn the_nearest_miss_is_the_longest_shared_prefix_that_is_not_a_prefix() {
    let td = TempDir::new("nearmiss");
    let store = Store::open(td.store_dir(), big_config()).unwrap();
    let payload = vec![1u8; 100];
    save(
        &store,
        &Spec::new(b"system: be brief. user: hello", &payload),
    );
    save(&store, &Spec::new(b"system: be brief. user: bye", &payload));
    save(&store, &Spec::new(b"system: be", &payload));
    let prompt = b"system: be brief. user: help me";
    let m = store
        .nearest_miss(prompt, &MODEL_A, 8192)
        .unwrap()
        .expect("a near miss");
    assert_eq!(m.text, b"system: be brief. user: hello");
    assert_eq!(m.common_bytes, b"system: be brief. user: hel".len());
    assert!(store
        .nearest_miss(prompt, &MODEL_B, 8192)
        .unwrap()
        .is_none());
}

/// Every checkpoint sharing enough of a prompt is offered, the most shared
/// first; one loads when it still shares exactly those bytes, and a file
/// rewritten with other text since is refused.
#[test]
fn checkpoints_sharing_a_prefix_are_offered_and_load_with_their_shared_bytes() {
    let td = TempDir::new("sharing");
    let store = Store::open(td.store_dir(), big_config()).unwrap();
    save(
        &store,
        &Spec::new(b"system: be brief. user: hello", b"hello"),
    );
    save(&store, &Spec::new(b"system: be brief. user: bye", b"bye"));
    save(&store, &Spec::new(b"system: be", b"prefix"));
    save(&store, &Spec::new(b"other text", b"other"));
    let prompt = b"system: be brief. user: help me";
    let shared = store.sharing(prompt, &MODEL_A, 8192, 10).unwrap();
    let common: Vec<_> = shared.iter().map(|s| s.common_bytes).collect();
    assert_eq!(
        common,
        [27, 24],
        "the prefix and the unrelated file are not offered"
    );
    let l = store.load(&shared[0].candidate, prompt).unwrap();
    assert_eq!(l.payload, b"hello");
    assert_eq!(l.text, b"system: be brief. user: hello");
    // Another prompt sharing other bytes: the same candidate no longer fits.
    assert!(store
        .load(&shared[0].candidate, b"system: be brief. user: hi")
        .is_err());
    assert!(store.sharing(prompt, &MODEL_B, 8192, 1).unwrap().is_empty());
}
