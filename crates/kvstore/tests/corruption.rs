//! Every corruption class is caught: truncation anywhere, any single flipped byte, wrong
//! version, empty files, foreign names, stray temp files. A bad header is skipped at index
//! time; a bad body fails the load with a precise reason and is then skipped.

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use common::*;
use ds4_kvstore::{Defect, KvError, Notice, Section, Store, StoreConfig, HEADER_LEN};

/// One pristine checkpoint with text, payload and sections; returns (text, bytes, name).
fn pristine(td: &TempDir) -> (Vec<u8>, Vec<u8>, String) {
    let mut rng = Rng::new(77);
    let text = rng.text(700);
    let payload = rng.bytes(6000);
    let sections = vec![
        Section {
            kind: 1,
            bytes: rng.bytes(90),
        },
        Section {
            kind: 9,
            bytes: rng.bytes(40),
        },
    ];
    let dir = td.0.join("src");
    let store = Store::open(&dir, big_config()).unwrap();
    let mut spec = Spec::new(&text, &payload);
    spec.sections = &sections;
    let path = saved_path(&save(&store, &spec));
    let name = path.file_name().unwrap().to_str().unwrap().to_string();
    (text, fs::read(&path).unwrap(), name)
}

/// Put `bytes` in a fresh store directory under `name`; open a store on it.
fn fresh_with(td: &TempDir, tag: &str, name: &str, bytes: &[u8]) -> (Store, PathBuf) {
    let dir = td.0.join(tag);
    let _ = fs::remove_dir_all(&dir);
    make_dir(&dir);
    let path = dir.join(name);
    fs::write(&path, bytes).unwrap();
    (Store::open(&dir, big_config()).unwrap(), path)
}

/// Exactly one notice: this file skipped for this defect.
fn assert_skipped_once(store: &Store, path: &Path, want: &Defect) {
    let notices = store.drain_notices();
    assert_eq!(
        notices,
        vec![Notice::Skipped {
            file: path.to_path_buf(),
            defect: want.clone()
        }]
    );
    assert_eq!(store.skipped(), vec![(path.to_path_buf(), want.clone())]);
    // A re-scan reports nothing new.
    store.refresh().unwrap();
    assert!(store.drain_notices().is_empty());
}

#[test]
fn truncation_at_every_region() {
    let td = TempDir::new("trunc");
    let (text, full, name) = pristine(&td);
    let len = full.len();
    let mut offsets: Vec<usize> = (0..=HEADER_LEN + 4).collect();
    offsets.extend((HEADER_LEN + 5..len).step_by(53)); // text, payload, sections
    offsets.extend([len - 1, len - 12, len - 13, HEADER_LEN + text.len()]);
    for off in offsets {
        let (store, path) = fresh_with(&td, "t", &name, &full[..off]);
        let want = match off {
            0 => Defect::Empty,
            n if n < HEADER_LEN => Defect::ShortHeader { len: n as u64 },
            n => Defect::SizeMismatch {
                actual: n as u64,
                expected: len as u64,
            },
        };
        assert_skipped_once(&store, &path, &want);
        assert!(
            store.lookup(&text, &MODEL_A, 8192).unwrap().is_none(),
            "off {off}"
        );
        assert_eq!(store.total_bytes(), 0);
    }
    // Appended garbage is a size mismatch too.
    let mut longer = full.clone();
    longer.push(0);
    let (store, path) = fresh_with(&td, "t", &name, &longer);
    assert_skipped_once(
        &store,
        &path,
        &Defect::SizeMismatch {
            actual: len as u64 + 1,
            expected: len as u64,
        },
    );
}

#[test]
fn truncation_after_lookup_fails_the_load() {
    let td = TempDir::new("trunc-late");
    let (text, full, name) = pristine(&td);
    let mut rng = Rng::new(8);
    for _ in 0..20 {
        let (store, path) = fresh_with(&td, "t", &name, &full);
        let c = store.lookup(&text, &MODEL_A, 8192).unwrap().unwrap();
        let off = HEADER_LEN + rng.below((full.len() - HEADER_LEN) as u64) as usize;
        fs::write(&path, &full[..off]).unwrap();
        let err = store.load(&c, &text).unwrap_err();
        let want = Defect::SizeMismatch {
            actual: off as u64,
            expected: full.len() as u64,
        };
        assert_eq!(err.defect(), Some(&want), "{err}");
        assert!(err.to_string().contains(&name), "{err}");
        assert!(store.lookup(&text, &MODEL_A, 8192).unwrap().is_none());
    }
}

#[test]
fn any_flipped_byte_is_never_loaded() {
    let td = TempDir::new("flip");
    let (text, full, name) = pristine(&td);
    let body_start = HEADER_LEN;
    let text_end = HEADER_LEN + text.len();
    let mut rng = Rng::new(99);
    // Every header byte, then random body positions.
    let mut positions: Vec<usize> = (0..HEADER_LEN).collect();
    positions.extend(
        (0..400).map(|_| body_start + rng.below((full.len() - body_start) as u64) as usize),
    );
    for pos in positions {
        let mut bad = full.clone();
        bad[pos] ^= 1 + rng.below(255) as u8;
        let (store, path) = fresh_with(&td, "f", &name, &bad);
        if pos < HEADER_LEN {
            let notices = store.drain_notices();
            assert_eq!(notices.len(), 1, "pos {pos}");
            let Notice::Skipped { defect, .. } = &notices[0] else {
                panic!("{notices:?}")
            };
            match pos {
                0..=2 => assert!(matches!(defect, Defect::BadMagic { .. }), "{defect}"),
                3 => assert!(
                    matches!(defect, Defect::UnsupportedVersion { .. }),
                    "{defect}"
                ),
                _ => assert!(
                    matches!(defect, Defect::HeaderChecksum { .. }),
                    "{pos}: {defect}"
                ),
            }
            assert!(store.lookup(&text, &MODEL_A, 8192).unwrap().is_none());
            continue;
        }
        assert!(store.drain_notices().is_empty());
        let c = store
            .lookup(&text, &MODEL_A, 8192)
            .unwrap()
            .expect("header is intact");
        let err = store.load(&c, &text).unwrap_err();
        let KvError::Corrupt { path: p, defect } = &err else {
            panic!("pos {pos}: {err}")
        };
        assert_eq!(p, &path);
        if pos < text_end {
            assert!(
                matches!(defect, Defect::TextHash { .. }),
                "pos {pos}: {defect}"
            );
        } else {
            assert!(
                matches!(defect, Defect::BodyChecksum { .. }),
                "pos {pos}: {defect}"
            );
        }
        // Marked skipped: no second attempt.
        assert!(store.lookup(&text, &MODEL_A, 8192).unwrap().is_none());
        assert_eq!(store.skipped(), vec![(path.clone(), defect.clone())]);
        let r = store.verify(false).unwrap();
        assert_eq!(r.bad, vec![(path, defect.clone())]);
    }
}

#[test]
fn wrong_version_and_bad_fields() {
    let td = TempDir::new("version");
    let (text, full, name) = pristine(&td);
    let with_header_byte = |i: usize, v: u8| {
        let mut b = full.clone();
        b[i] = v;
        let sum = xxhash_rust::xxh3::xxh3_64(&b[..120]);
        b[120..128].copy_from_slice(&sum.to_le_bytes());
        b
    };
    for (tag, bytes, want) in [
        (
            "v1",
            with_header_byte(3, 1),
            Defect::UnsupportedVersion { found: 1 },
        ),
        (
            "v3",
            with_header_byte(3, 3),
            Defect::UnsupportedVersion { found: 3 },
        ),
        (
            "reason",
            with_header_byte(4, 9),
            Defect::BadField {
                field: "reason",
                value: 9,
            },
        ),
        (
            "tokens",
            {
                let mut b = with_header_byte(12, 0);
                b[13] = 0;
                b[14] = 0;
                b[15] = 0;
                let sum = xxhash_rust::xxh3::xxh3_64(&b[..120]);
                b[120..128].copy_from_slice(&sum.to_le_bytes());
                b
            },
            Defect::BadField {
                field: "tokens",
                value: 0,
            },
        ),
    ] {
        let (store, path) = fresh_with(&td, tag, &name, &bytes);
        assert_skipped_once(&store, &path, &want);
        assert!(store.lookup(&text, &MODEL_A, 8192).unwrap().is_none());
    }
    // A file of another model is valid, indexed and counted, but never matched.
    let (store, _) = fresh_with(&td, "model", &name, &full);
    assert!(store.lookup(&text, &MODEL_B, 8192).unwrap().is_none());
    assert_eq!(store.total_bytes(), full.len() as u64);
}

#[test]
fn foreign_names_and_zero_length() {
    let td = TempDir::new("names");
    let (text, full, name) = pristine(&td);
    let dir = td.0.join("n");
    make_dir(&dir);
    fs::write(dir.join(&name), &full).unwrap();
    fs::write(dir.join("sysprompt.kv"), b"agent file").unwrap();
    fs::write(dir.join(name.to_uppercase().replace(".KV", ".kv")), &full).unwrap();
    let empty = format!("{}.kv", "0".repeat(40));
    fs::write(dir.join(&empty), b"").unwrap();
    fs::create_dir(dir.join(format!("{}.kv", "1".repeat(40)))).unwrap();
    let store = Store::open(&dir, big_config()).unwrap();
    let mut got: Vec<(String, Defect)> = store
        .drain_notices()
        .into_iter()
        .map(|n| match n {
            Notice::Skipped { file, defect } => (
                file.file_name().unwrap().to_string_lossy().into_owned(),
                defect,
            ),
            other => panic!("{other}"),
        })
        .collect();
    got.sort_by(|a, b| a.0.cmp(&b.0));
    let mut want = vec![
        (empty, Defect::Empty),
        (format!("{}.kv", "1".repeat(40)), Defect::NotRegularFile),
        ("sysprompt.kv".to_string(), Defect::UnrecognizedName),
        (
            name.to_uppercase().replace(".KV", ".kv"),
            Defect::UnrecognizedName,
        ),
    ];
    want.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(got, want);
    let c = store.lookup(&text, &MODEL_A, 8192).unwrap().unwrap();
    assert!(store.load(&c, &text).is_ok());
    // verify --fix removes the bad checkpoint-named regular file, nothing else.
    let r = store.verify(true).unwrap();
    assert_eq!(
        (r.checked, r.ok, r.bad.len(), r.removed.len()),
        (3, 1, 2, 1)
    );
    assert!(!dir.join(format!("{}.kv", "0".repeat(40))).exists());
    assert!(dir.join("sysprompt.kv").exists());
}

#[test]
fn stray_temp_files() {
    let td = TempDir::new("temp");
    let dir = td.store_dir();
    make_dir(&dir);
    let base = format!("{}.kv", "a".repeat(40));
    // pid above any pid_max: its writer is certainly gone.
    let dead = dir.join(format!("{base}.tmp.4000000000"));
    // Our own pid and pid 1: alive. The fresh one is an in-flight write; the old one is
    // stale.
    let live_fresh = dir.join(format!("{base}.tmp.{}", std::process::id()));
    let live_old = dir.join(format!("{base}.tmp.1"));
    for p in [&dead, &live_fresh, &live_old] {
        fs::write(p, b"partial").unwrap();
    }
    let two_hours_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(7200);
    fs::File::options()
        .write(true)
        .open(&live_old)
        .unwrap()
        .set_modified(two_hours_ago)
        .unwrap();
    let store = Store::open(&dir, big_config()).unwrap();
    let mut notices = store.drain_notices();
    notices.sort_by_key(|n| format!("{n}"));
    assert_eq!(
        notices,
        vec![
            Notice::RemovedTemp {
                file: live_old.clone(),
                why: "older than 1 hour"
            },
            Notice::RemovedTemp {
                file: dead.clone(),
                why: "its writer process is not running"
            },
        ]
    );
    assert!(live_fresh.exists() && !dead.exists() && !live_old.exists());
    assert!(store.skipped().is_empty());
    assert_eq!(store.total_bytes(), 0);
}

/// A read-only store changes nothing on disk: stale temp files are named, not
/// removed; a missing directory is not created; saves are refused.
#[test]
fn a_read_only_store_changes_nothing() {
    let td = TempDir::new("readonly");
    let dir = td.store_dir();
    make_dir(&dir);
    let dead = dir.join(format!("{}.kv.tmp.4000000000", "a".repeat(40)));
    fs::write(&dead, b"partial").unwrap();
    let ro = StoreConfig {
        read_only: true,
        ..big_config()
    };
    let store = Store::open(&dir, ro.clone()).unwrap();
    assert_eq!(
        store.drain_notices(),
        vec![Notice::StaleTemp {
            file: dead.clone(),
            why: "its writer process is not running"
        }]
    );
    assert!(dead.exists());
    assert!(store.verify(false).is_ok() && dead.exists());
    assert!(store.verify(true).is_err() && dead.exists());
    let text = b"a prompt".repeat(20);
    let refused = store.save(ds4_kvstore::SaveRequest {
        text: &text,
        payload: ds4_kvstore::Payload::Bytes(b"p"),
        reason: ds4_kvstore::SaveReason::Cold,
        tokens: 40,
        n_ctx: 8192,
        model: MODEL_A,
        ext_flags: 0,
        sections: &[],
    });
    assert!(refused.is_err());
    assert!(Store::open(dir.join("missing"), ro).is_err());
    assert!(!dir.join("missing").exists());
}
