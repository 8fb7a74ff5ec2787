//! The forward pass over several sessions at once, for every family: each
//! session's logits are bitwise what it gets alone, whatever its neighbours in
//! the batch (lengths past a sliding window, several tokens per step, every
//! precision and K/V type); a batch that breaks a rule is refused before
//! anything runs.

mod families;

use std::sync::Arc;

use ds4_engine::sampler::argmax;
use ds4_engine::{Batch, EngineError, KvType, Precision, Session, SessionOptions, ThreadPool};
use families::Family;

fn session(f: &Family, precision: Precision, kv_type: KvType, pool: &Arc<ThreadPool>) -> Session {
    let opts = SessionOptions {
        n_ctx: 1024,
        prefill_chunk: 32,
        precision,
        kv_type,
    };
    Session::new(families::model(f), Arc::clone(pool), &opts)
}

fn bits(s: &Session) -> Vec<u32> {
    s.logits().unwrap().iter().map(|v| v.to_bits()).collect()
}

fn batched_equals_alone(f: &Family) {
    let p = families::long_prompt(f);
    let pool = Arc::new(ThreadPool::new(2));
    // The exact path's products are per row too (`matmul_f32`); it is left out
    // only for time.
    for (precision, kv_type) in [
        (Precision::Fast, KvType::F16),
        (Precision::Fast, KvType::F32),
        (Precision::Q8, KvType::F32),
    ] {
        // Three conversations of different lengths (one past a 512-token
        // window), each prefilled alone.
        let starts = [(0, 37), (100, 700), (1500, 5)];
        let mut batched: Vec<Session> = Vec::new();
        let mut alone: Vec<Session> = Vec::new();
        for &(from, len) in &starts {
            let mut s = session(f, precision, kv_type, &pool);
            s.prefill(&p[from..from + len]).unwrap();
            let mut twin = session(f, precision, kv_type, &pool);
            twin.restore(&s.snapshot().unwrap()).unwrap();
            batched.push(s);
            alone.push(twin);
        }
        let mut batch = Batch::new(families::model(f), Arc::clone(&pool), 64);
        for step in 0..6 {
            // Each session's next tokens: its greedy token, and at some steps a
            // few forced ones (a multi-token step beside single ones).
            let next: Vec<Vec<u32>> = batched
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let mut t = vec![argmax(s.logits().unwrap())];
                    if (step + i) % 3 == 0 {
                        t.extend_from_slice(&p[200 + step..203 + step]);
                    }
                    t
                })
                .collect();
            let mut steps: Vec<(&mut Session, &[u32])> = batched
                .iter_mut()
                .zip(&next)
                .map(|(s, t)| (s, t.as_slice()))
                .collect();
            batch.forward(&mut steps).unwrap();
            for (i, (b, a)) in batched.iter().zip(alone.iter_mut()).enumerate() {
                a.prefill(&next[i]).unwrap();
                assert_eq!(b.tokens(), a.tokens());
                assert!(
                    bits(b) == bits(a),
                    "{} {precision:?} {kv_type}: session {i} step {step}",
                    f.name
                );
            }
        }
    }
}

/// Sessions forked from one long prompt decode together reading its rows once
/// (from the first session's state), each bitwise as alone; one of them then
/// cut back inside the shared part and refilled with other tokens shares only
/// what still holds the same rows, and an unrelated session shares nothing.
fn forked_sessions_share_rows_and_equal_alone(f: &Family) {
    let p = families::long_prompt(f);
    let pool = Arc::new(ThreadPool::new(2));
    let mut base = session(f, Precision::Fast, KvType::F16, &pool);
    base.prefill(&p[..300]).unwrap();
    let snap300 = base.snapshot().unwrap();
    base.prefill(&p[300..600]).unwrap();
    let snap = base.snapshot().unwrap();
    let fork = |tail: &[u32]| {
        let mut s = session(f, Precision::Fast, KvType::F16, &pool);
        s.restore(&snap).unwrap();
        s.prefill(tail).unwrap();
        s
    };
    let mut batched = vec![fork(&p[600..603]), fork(&p[900..940]), fork(&p[1200..1201])];
    let mut other = session(f, Precision::Fast, KvType::F16, &pool);
    other.prefill(&p[1300..1800]).unwrap();
    batched.push(other);
    let mut alone: Vec<Session> = batched
        .iter()
        .map(|s| {
            let mut twin = session(f, Precision::Fast, KvType::F16, &pool);
            twin.restore(&s.snapshot().unwrap()).unwrap();
            twin
        })
        .collect();
    let mut batch = Batch::new(families::model(f), Arc::clone(&pool), 64);
    let mut decode = |batched: &mut Vec<Session>, alone: &mut Vec<Session>, what: &str| {
        let next: Vec<[u32; 1]> = batched
            .iter()
            .map(|s| [argmax(s.logits().unwrap())])
            .collect();
        let mut steps: Vec<(&mut Session, &[u32])> = batched
            .iter_mut()
            .zip(&next)
            .map(|(s, t)| (s, &t[..]))
            .collect();
        batch.forward(&mut steps).unwrap();
        for (i, (b, a)) in batched.iter().zip(alone.iter_mut()).enumerate() {
            a.prefill(&next[i]).unwrap();
            assert!(bits(b) == bits(a), "{} {what}: session {i}", f.name);
        }
        batch.shared_positions()
    };
    for step in 0..3 {
        // Sessions 1 and 2 read 512 positions (two whole segments of the
        // 600 they share) from session 0.
        assert_eq!(
            decode(&mut batched, &mut alone, "forked"),
            1024,
            "step {step}"
        );
    }
    for s in [&mut batched[1], &mut alone[1]] {
        // A ring that has passed its window cannot cut back: it reloads.
        if s.can_rewind(300) {
            s.rewind(300).unwrap();
        } else {
            s.restore(&snap300).unwrap();
        }
        s.prefill(&p[1000..1400]).unwrap();
    }
    for step in 0..2 {
        // Session 1 now holds the fork's rows only below 300: one segment.
        assert_eq!(
            decode(&mut batched, &mut alone, "refilled"),
            256 + 512,
            "step {step}"
        );
    }
}

fn refused_batches_change_nothing(f: &Family) {
    let p = families::long_prompt(f);
    let pool = Arc::new(ThreadPool::new(1));
    let mut a = session(f, Precision::Fast, KvType::F16, &pool);
    let mut b = session(f, Precision::Q8, KvType::F16, &pool);
    a.prefill(&p[..10]).unwrap();
    b.prefill(&p[..10]).unwrap();
    let before = bits(&a);
    let mut batch = Batch::new(families::model(f), Arc::clone(&pool), 8);
    let cases: Vec<(Vec<u32>, Vec<u32>, &str)> = vec![
        (vec![1], vec![1], "another precision"),
        (vec![], vec![1], "a step takes"),
        (vec![1; 40], vec![1], "a step takes"),
        (vec![u32::MAX], vec![1], "outside the vocabulary"),
    ];
    for (ta, tb, want) in cases {
        let mut steps: Vec<(&mut Session, &[u32])> = vec![(&mut a, &ta[..]), (&mut b, &tb[..])];
        let e = batch.forward(&mut steps).unwrap_err();
        assert!(e.to_string().contains(want), "{want}: {e}");
        assert_eq!(a.tokens().len(), 10);
        assert!(bits(&a) == before);
    }
    let mut c = session(f, Precision::Fast, KvType::F16, &pool);
    c.prefill(&p[..10]).unwrap();
    let (t1, t2) = (vec![1u32; 5], vec![1u32; 5]);
    let e = batch
        .forward(&mut [(&mut a, &t1[..]), (&mut c, &t2[..])])
        .unwrap_err();
    assert!(
        matches!(e, EngineError::Batch { .. }) && e.to_string().contains("holds 8"),
        "{e}"
    );
}

for_each_family!(batched_equals_alone, refused_batches_change_nothing; attention: forked_sessions_share_rows_and_equal_alone);

/// Timing (not a test): batched decode steps of N sessions holding `ctx`
/// tokens each against N = 1 decoding alone, SmolLM2 (2 threads unless told):
/// `cargo test --release -p ds4-engine --test batch -- --ignored --nocapture bench_batched_decode`
/// (BENCH_CTX=16,1024 BENCH_N=1,4 BENCH_STEPS=32 BENCH_THREADS=2 choose the
/// contexts, session counts, steps per round and threads; the best of three
/// rounds is reported).
#[test]
#[ignore]
fn bench_batched_decode() {
    let f = &families::SMOLLM2;
    let p = families::long_prompt(f);
    let threads = std::env::var("BENCH_THREADS").map_or(2, |v| v.parse().unwrap());
    let pool = Arc::new(ThreadPool::new(threads));
    let opts = SessionOptions {
        n_ctx: 4096,
        prefill_chunk: 256,
        precision: Precision::Fast,
        kv_type: KvType::F16,
    };
    let ctxs: Vec<usize> = std::env::var("BENCH_CTX")
        .map(|v| v.split(",").map(|x| x.parse().unwrap()).collect())
        .unwrap_or(vec![16, 1024, 2048]);
    for ctx in ctxs {
        let mut first = Session::new(families::model(f), Arc::clone(&pool), &opts);
        first.prefill(&p[..ctx.min(p.len())]).unwrap();
        let snap = first.snapshot().unwrap();
        let mut alone = 0.0;
        let ns: Vec<usize> = std::env::var("BENCH_N")
            .map(|v| v.split(",").map(|x| x.parse().unwrap()).collect())
            .unwrap_or(vec![1, 2, 4]);
        for n in ns {
            let mut sessions: Vec<Session> = (0..n)
                .map(|_| {
                    let mut s = Session::new(families::model(f), Arc::clone(&pool), &opts);
                    s.restore(&snap).unwrap();
                    s
                })
                .collect();
            let mut batch = Batch::new(families::model(f), Arc::clone(&pool), 8);
            let steps = std::env::var("BENCH_STEPS")
                .map(|v| v.parse().unwrap())
                .unwrap_or(32);
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                let t = std::time::Instant::now();
                for _ in 0..steps {
                    let next: Vec<[u32; 1]> = sessions
                        .iter()
                        .map(|s| [argmax(s.logits().unwrap())])
                        .collect();
                    let mut step: Vec<(&mut Session, &[u32])> = sessions
                        .iter_mut()
                        .zip(&next)
                        .map(|(s, t)| (s, &t[..]))
                        .collect();
                    batch.forward(&mut step).unwrap();
                }
                best = best.min(t.elapsed().as_secs_f64() / steps as f64);
                for s in &mut sessions {
                    s.restore(&snap).unwrap();
                }
            }
            let tps = n as f64 / best;
            if n == 1 {
                alone = tps;
            }
            eprintln!(
                "context {ctx}, {n} sessions: {:.2} ms per step, {tps:.1} t/s ({:.2}x one alone)",
                best * 1e3,
                tps / alone
            );
        }
    }
}
