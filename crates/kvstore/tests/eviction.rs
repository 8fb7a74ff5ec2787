//! Eviction follows the score formula exactly (checked against an independent
//! implementation on a constructed set), the budget pre-check skips what cannot fit,
//! and the file just written is protected.

mod common;

use std::collections::HashSet;
use std::fs;

use common::*;
use ds4_kvstore::{
    eviction_score, now_unix, Header, Notice, SaveOutcome, SaveReason, SkipReason, Store,
    StoreConfig,
};

/// The formula, written out again from the design text (powf, not exp2).
fn expected_score(h: &Header, bytes: u64, superseded: bool, now: u64) -> f64 {
    let used = if h.last_used != 0 {
        h.last_used
    } else {
        h.created
    };
    let mut eh = if used == 0 {
        0.0
    } else {
        f64::from(h.hits) * 0.5f64.powf(now.saturating_sub(used) as f64 / 21600.0)
    };
    if eh < 0.01 {
        eh = 0.0;
    }
    let mut s = (eh + 1.0) * f64::from(h.tokens) / bytes as f64;
    if matches!(
        h.reason,
        SaveReason::Cold | SaveReason::Evict | SaveReason::Shutdown
    ) {
        s *= 2.0;
    }
    if superseded && h.reason == SaveReason::Continued {
        s *= 0.5;
    }
    s
}

struct Item {
    name: String,
    header: Header,
    bytes: u64,
    /// Indices of the items that supersede this one (by construction).
    superseded_by: Vec<usize>,
}

/// Build the set; returns items in creation order.
fn build(store: &Store, now: u64) -> Vec<Item> {
    let mut rng = Rng::new(2024);
    let p = rng.text(1000);
    let q = rng.text(900);
    let r = rng.text(800);
    let v = rng.text(700);
    struct Def {
        text: Vec<u8>,
        payload: usize,
        reason: SaveReason,
        tokens: u32,
        model: ds4_kvstore::ModelId,
        hits: u32,
        created: u64,
        last_used: u64,
        superseded_by: Vec<usize>,
    }
    let d = |text: &[u8], payload, reason, tokens, hits, created, last_used| Def {
        text: text.to_vec(),
        payload,
        reason,
        tokens,
        model: MODEL_A,
        hits,
        created,
        last_used,
        superseded_by: vec![],
    };
    use SaveReason::*;
    let mut defs = vec![
        // 0: continued, extended by 1 (same model, created later) -> superseded.
        Def {
            superseded_by: vec![1],
            ..d(&p[..400], 3000, Continued, 100, 0, now - 1000, now - 1000)
        },
        // 1
        d(&p, 5000, Continued, 250, 2, now - 500, now - 100),
        // 2: continued prefix of 3, but 3 is older -> not superseded. last_used 0.
        d(&q[..300], 4000, Continued, 300, 4, now - 5000, 0),
        // 3
        d(&q, 9000, Cold, 400, 1, now - 9000, now - 30000),
        // 4: another model
        Def {
            model: MODEL_B,
            ..d(&r, 20000, Evict, 500, 10, now - 100_000, now - 100_000)
        },
        // 5: continued prefix of 4's text, but 4 is another model -> not superseded.
        d(
            &r[..200],
            2500,
            Continued,
            90,
            0,
            now - 200_000,
            now - 200_000,
        ),
        // 6
        d(
            b"shutdown state of a long chat",
            2000,
            Shutdown,
            200,
            3,
            now - 50,
            now,
        ),
        // 7: never used, no times at all -> effective hits 0.
        d(b"unknown reason text", 30000, Unknown, 1000, 7, 0, 0),
        // 8
        d(
            b"agent session",
            6000,
            AgentSession,
            700,
            50,
            now - 90_000,
            now - 43200,
        ),
        // 9, 10: identical score (hits 0), 10 used earlier -> 10 goes first.
        d(
            b"tie one .........",
            4000,
            Evict,
            100,
            0,
            now - 10,
            now - 10,
        ),
        d(
            b"tie two .........",
            4000,
            Evict,
            100,
            0,
            now - 20,
            now - 20,
        ),
        // 11: continued, superseded by 12 until 12 is evicted; 12 goes first, after which
        // 11 doubles and overtakes 13.
        Def {
            superseded_by: vec![12],
            ..d(&v[..300], 9572, Continued, 100, 0, now - 300, now - 300)
        },
        d(&v, 9172, Unknown, 10, 0, now - 200, now - 200),
        d(
            b"between the two ...",
            9853,
            Unknown,
            75,
            0,
            now - 100,
            now - 100,
        ),
    ];
    let mut items = Vec::new();
    for def in defs.drain(..) {
        let payload = vec![0x5a; def.payload];
        let mut s = Spec::new(&def.text, &payload);
        s.reason = def.reason;
        s.tokens = def.tokens;
        s.model = def.model;
        let path = saved_path(&save(store, &s));
        patch_header(&path, |h| {
            h.hits = def.hits;
            h.created = def.created;
            h.last_used = def.last_used;
        });
        items.push(Item {
            name: path.file_name().unwrap().to_string_lossy().into_owned(),
            header: read_header(&path),
            bytes: fs::metadata(&path).unwrap().len(),
            superseded_by: def.superseded_by,
        });
    }
    items
}

/// The full eviction sequence, re-evaluating supersession as files go.
fn simulate(items: &[Item], now: u64) -> Vec<usize> {
    let mut alive: HashSet<usize> = (0..items.len()).collect();
    let mut order = Vec::new();
    while !alive.is_empty() {
        let mut best: Option<(f64, u64, &str, usize)> = None;
        for &i in &alive {
            let it = &items[i];
            let sup = it.superseded_by.iter().any(|j| alive.contains(j));
            let s = expected_score(&it.header, it.bytes, sup, now);
            let key = (s, it.header.used_at(), it.name.as_str(), i);
            let better = match &best {
                None => true,
                Some(b) => (key.0, key.1, key.2) < (b.0, b.1, b.2),
            };
            if better {
                best = Some(key);
            }
        }
        let i = best.unwrap().3;
        alive.remove(&i);
        order.push(i);
    }
    order
}

fn evicted_names(store: &Store) -> Vec<String> {
    store
        .drain_notices()
        .into_iter()
        .filter_map(|n| match n {
            Notice::Evicted(e) => Some(e.file.file_name().unwrap().to_string_lossy().into_owned()),
            _ => None,
        })
        .collect()
}

#[test]
fn eviction_order_matches_formula() {
    let td = TempDir::new("evict");
    let now = now_unix();
    let items = {
        let store = Store::open(td.store_dir(), big_config()).unwrap();
        build(&store, now)
    };
    let total: u64 = items.iter().map(|i| i.bytes).sum();

    // Static view: every score and flag as `ls` shows it.
    let store = Store::open(td.store_dir(), big_config()).unwrap();
    let entries = store.entries_at(now).unwrap();
    assert_eq!(entries.len(), items.len());
    let mut static_order: Vec<usize> = (0..items.len()).collect();
    let key = |i: &usize| {
        let it = &items[*i];
        let s = expected_score(&it.header, it.bytes, !it.superseded_by.is_empty(), now);
        (s, it.header.used_at(), it.name.clone())
    };
    static_order.sort_by(|a, b| key(a).partial_cmp(&key(b)).unwrap());
    for (e, &i) in entries.iter().zip(&static_order) {
        let it = &items[i];
        assert_eq!(format!("{}.kv", e.hash), it.name);
        assert_eq!(e.superseded, !it.superseded_by.is_empty(), "item {i}");
        let want = expected_score(&it.header, it.bytes, e.superseded, now);
        assert!(
            (e.score - want).abs() <= want * 1e-12,
            "item {i}: {} vs {want}",
            e.score
        );
        assert_eq!(
            e.score,
            eviction_score(&e.header, e.file_bytes, e.superseded, now)
        );
    }
    // Scores (other than the designed tie) are far apart: the order cannot depend on
    // the second the store reads the clock.
    let mut scores: Vec<f64> = static_order.iter().map(|i| key(i).0).collect();
    scores.dedup();
    assert_eq!(scores.len(), items.len() - 1);
    for w in scores.windows(2) {
        assert!(w[1] > w[0] * 1.01, "{w:?}");
    }

    let seq = simulate(&items, now);
    // The designed dynamic case: 12, then 13 before 11.
    let pos = |i: usize| seq.iter().position(|&x| x == i).unwrap();
    assert!(pos(12) < pos(13) && pos(13) < pos(11));
    assert!(pos(10) < pos(9));
    drop(store);

    // Partial: a budget that needs exactly the first three evictions.
    let first3: u64 = seq[..3].iter().map(|&i| items[i].bytes).sum();
    let cfg = StoreConfig {
        budget_bytes: total - first3,
        ..StoreConfig::default()
    };
    let store = Store::open(td.store_dir(), cfg).unwrap();
    let want: Vec<String> = seq[..3].iter().map(|&i| items[i].name.clone()).collect();
    assert_eq!(evicted_names(&store), want);
    assert_eq!(store.total_bytes(), total - first3);
    drop(store);

    // Everything: the whole sequence in order.
    let cfg = StoreConfig {
        budget_bytes: 1,
        ..StoreConfig::default()
    };
    let store = Store::open(td.store_dir(), cfg).unwrap();
    let want: Vec<String> = seq[3..].iter().map(|&i| items[i].name.clone()).collect();
    assert_eq!(evicted_names(&store), want);
    assert!(dir_names(&td.store_dir()).is_empty());
}

#[test]
fn budget_precheck_skips() {
    let td = TempDir::new("precheck");
    let cfg = StoreConfig {
        budget_bytes: 2000,
        ..StoreConfig::default()
    };
    let store = Store::open(td.store_dir(), cfg).unwrap();
    let text = [b'x'; 600];
    let out = save(&store, &Spec::new(&text, &[0u8; 1300]));
    assert_eq!(
        out,
        SaveOutcome::Skipped(SkipReason::OverBudget {
            file_bytes: 128 + 600 + 1300,
            budget_bytes: 2000
        })
    );
    assert!(dir_names(&td.store_dir()).is_empty());
    // Exactly at the budget fits.
    let out = save(&store, &Spec::new(&text, &[0u8; 1272]));
    assert!(
        matches!(
            out,
            SaveOutcome::Saved {
                file_bytes: 2000,
                ..
            }
        ),
        "{out:?}"
    );
}

#[test]
fn just_written_file_is_protected() {
    let td = TempDir::new("protect");
    let one = (128 + 600 + 3000) as u64;
    let cfg = StoreConfig {
        budget_bytes: one + one / 2,
        ..StoreConfig::default()
    };
    let store = Store::open(td.store_dir(), cfg).unwrap();
    let a = saved_path(&save(&store, &Spec::new(&[b'a'; 600], &[1u8; 3000])));
    // A is valuable (many recent hits, anchor); B is not. B still survives its own save.
    patch_header(&a, |h| {
        h.hits = 1000;
        h.last_used = now_unix();
    });
    let mut b = Spec::new(&[b'b'; 600], &[2u8; 3000]);
    b.reason = SaveReason::Continued;
    b.tokens = 1;
    let bp = saved_path(&save(&store, &b));
    assert_eq!(
        evicted_names(&store),
        vec![a.file_name().unwrap().to_string_lossy().into_owned()]
    );
    assert!(bp.exists() && !a.exists());
}
