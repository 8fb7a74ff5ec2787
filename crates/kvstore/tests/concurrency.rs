//! Two processes (this test binary re-invoked as a child) and two threads share one
//! directory under a small budget, saving, looking up, loading and evicting at random.
//! Every successful load must verify; no load may ever see a damaged file.

mod common;

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use common::*;
use ds4_kvstore::{
    KvError, Notice, Payload, SaveOutcome, SaveReason, SaveRequest, SkipReason, Store, StoreConfig,
};
use xxhash_rust::xxh3::xxh3_64;

const ENV_DIR: &str = "DS4_KVSTORE_HAMMER_DIR";
const ENV_SEED: &str = "DS4_KVSTORE_HAMMER_SEED";
const ITERS: usize = 1500;

fn keys() -> Vec<Vec<u8>> {
    let mut rng = Rng::new(5150);
    let base = rng.text(3000);
    let mut k: Vec<Vec<u8>> = [600, 1200, 1800, 2400, 3000]
        .iter()
        .map(|&n| base[..n].to_vec())
        .collect();
    for _ in 0..4 {
        k.push(rng.text(1000));
    }
    k
}

/// A payload that proves its own integrity and its text: nonce, hash of text, stream.
fn payload_for(text: &[u8], nonce: u64, len: usize) -> Vec<u8> {
    let th = xxh3_64(text);
    let mut r = Rng::new(nonce ^ th);
    let mut p = Vec::with_capacity(len);
    p.extend_from_slice(&nonce.to_le_bytes());
    p.extend_from_slice(&th.to_le_bytes());
    while p.len() < len {
        p.extend_from_slice(&r.next_u64().to_le_bytes());
    }
    p.truncate(len.max(16));
    p
}

fn payload_ok(text: &[u8], p: &[u8]) -> bool {
    p.len() >= 16 && {
        let nonce = u64::from_le_bytes(p[..8].try_into().unwrap());
        payload_for(text, nonce, p.len()) == p
    }
}

fn hammer(store: &Store, seed: u64) -> (usize, usize) {
    let keys = keys();
    let mut rng = Rng::new(seed);
    let (mut saves, mut loads) = (0, 0);
    for _ in 0..ITERS {
        let text = &keys[rng.below(keys.len() as u64) as usize];
        if rng.below(2) == 0 {
            let len = 10_000 + rng.below(150_000) as usize;
            let payload = payload_for(text, rng.next_u64(), len);
            // Small pieces with yields: a wide window for anyone who could see the file
            // half-written.
            let mut stream = |w: &mut dyn Write| {
                for piece in payload.chunks(4096) {
                    w.write_all(piece)?;
                    w.flush()?;
                    std::thread::yield_now();
                }
                Ok(())
            };
            let use_stream = rng.below(2) == 0;
            let req = SaveRequest {
                text,
                payload: if use_stream {
                    Payload::Stream {
                        estimated_bytes: len as u64,
                        write: &mut stream,
                    }
                } else {
                    Payload::Bytes(&payload)
                },
                reason: SaveReason::from_u8(1 + rng.below(4) as u8).unwrap(),
                tokens: text.len() as u32 / 4,
                n_ctx: 4096,
                model: MODEL_A,
                ext_flags: 0,
                sections: &[],
            };
            match store.save(req) {
                Ok(SaveOutcome::Saved { .. } | SaveOutcome::Kept { .. }) => saves += 1,
                Ok(SaveOutcome::Skipped(SkipReason::InFlight)) => {}
                other => panic!("save: {other:?}"),
            }
        } else {
            let mut prompt = text.clone();
            let n = rng.below(50) as usize;
            prompt.extend(rng.text(n));
            let Some(c) = store.lookup(&prompt, &MODEL_A, 4096).unwrap() else {
                continue;
            };
            match store.load(&c, &prompt) {
                Ok(l) => {
                    assert!(prompt.starts_with(&l.text));
                    assert!(payload_ok(&l.text, &l.payload), "payload does not verify");
                    assert_eq!(l.header.tokens as usize, l.text.len() / 4);
                    loads += 1;
                }
                // Evicted or replaced by the other side between lookup and open.
                Err(KvError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => panic!("load: {e}"),
            }
        }
        // Files become visible only complete: the index never meets a bad one, and no
        // temp file of a live process is ever touched.
        for n in store.drain_notices() {
            assert!(matches!(n, Notice::Evicted(_)), "{n}");
        }
    }
    (saves, loads)
}

fn config() -> StoreConfig {
    StoreConfig {
        budget_bytes: 700_000,
        ..StoreConfig::default()
    }
}

fn run_worker(dir: &Path, seed: u64) -> (usize, usize) {
    let store = Store::open(dir, config()).unwrap();
    hammer(&store, seed)
}

/// Runs only when re-invoked by `two_processes_and_two_threads`.
#[test]
fn child_hammer() {
    let Ok(dir) = std::env::var(ENV_DIR) else {
        return;
    };
    let seed: u64 = std::env::var(ENV_SEED).unwrap().parse().unwrap();
    let (s, l) = run_worker(Path::new(&dir), seed);
    eprintln!("child: {s} saves, {l} loads");
}

#[test]
fn two_processes_and_two_threads() {
    let td = TempDir::new("hammer");
    let dir = td.store_dir();
    Store::open(&dir, config()).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["child_hammer", "--exact", "--nocapture", "--test-threads=1"])
        .env(ENV_DIR, &dir)
        .env(ENV_SEED, "1")
        .spawn()
        .unwrap();
    let shared = Arc::new(Store::open(&dir, config()).unwrap());
    let threads: Vec<_> = [2u64, 3]
        .into_iter()
        .map(|seed| {
            let s = Arc::clone(&shared);
            std::thread::spawn(move || hammer(&s, seed))
        })
        .collect();
    let mut loads = 0;
    for t in threads {
        let (_, l) = t.join().expect("worker panicked");
        loads += l;
    }
    assert!(child.wait().unwrap().success(), "child failed");
    assert!(loads > 10, "too few loads to mean anything: {loads}");
    let r = shared.verify(false).unwrap();
    assert!(r.bad.is_empty() && r.unreadable.is_empty(), "{r:?}");
    assert!(shared.skipped().is_empty(), "{:?}", shared.skipped());
    assert!(shared.total_bytes() <= config().budget_bytes + 200_000);
    // No temp file survives.
    assert!(
        dir_names(&dir).iter().all(|n| !n.contains(".tmp.")),
        "{:?}",
        dir_names(&dir)
    );
}
