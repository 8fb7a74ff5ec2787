//! Partial reuse of a disk checkpoint, per family: a checkpoint of a prompt and
//! its reply (a graceful restart's shutdown save) serves the same prompt with
//! another continuation after a restart — cut back to the shared prefix
//! (`disk-text-partial`), within a few tokens of it, answering exactly as a
//! cold run, and the cut session's logits are bitwise a cold session's.

mod common;
#[path = "../../engine/tests/families/mod.rs"]
mod families;

use std::path::Path;
use std::sync::{Arc, Mutex};

use common::{collect, greedy_job};
use ds4_engine::{KvType, Model, Precision, Session, SessionOptions, ThreadPool};
use ds4_kvstore::{SavePolicy, Store, StoreConfig};
use ds4_runtime::{CacheSource, Notice, Persist, Runtime, RuntimeConfig, Usage, Verdict};
use families::Family;

fn session(model: &Arc<Model>, pool: &Arc<ThreadPool>) -> Session {
    let opts = SessionOptions {
        n_ctx: 4096,
        prefill_chunk: 64,
        precision: Precision::Fast,
        kv_type: KvType::F16,
    };
    Session::new(Arc::clone(model), Arc::clone(pool), &opts)
}

/// The store, without cold saves: the shutdown save of prompt + reply is the
/// only checkpoint (a cold save of the whole prompt would serve as a prefix).
fn persist(dir: &Path, s: &Session, sink: ds4_runtime::NoticeSink) -> Persist {
    let cfg = StoreConfig {
        policy: SavePolicy {
            min_tokens: 16,
            cold_max_tokens: 0,
            ..Default::default()
        },
        ..Default::default()
    };
    Persist::new(Store::open(dir, cfg).unwrap(), s, None, sink)
}

/// Runs `prompt` greedily for `max_tokens` on a one-slot runtime (with the
/// store at `store`, else none), then shuts it down gracefully (a shutdown
/// save): its text, usage and notices.
fn run(
    model: &Arc<Model>,
    store: Option<&Path>,
    prompt: &str,
    max_tokens: usize,
) -> (String, Usage, Vec<Notice>) {
    let pool = Arc::new(ThreadPool::new(2));
    let s = session(model, &pool);
    let notices = Arc::new(Mutex::new(Vec::new()));
    let sink: ds4_runtime::NoticeSink = {
        let n = Arc::clone(&notices);
        Arc::new(move |x: Notice| n.lock().unwrap().push(x))
    };
    let p = store.map(|d| persist(d, &s, Arc::clone(&sink)));
    let rt = Runtime::start(vec![s], pool, p, RuntimeConfig::default(), sink);
    let ids = model.tokenizer.encode(prompt, true, true);
    let (job, rx) = greedy_job(prompt, ids, max_tokens, &[], vec![]);
    rt.handle.submit(job).unwrap();
    let (text, _, usage) = collect(rx);
    rt.handle.begin_shutdown();
    rt.join();
    let n = notices.lock().unwrap().clone();
    (text, usage, n)
}

/// The family's long prompt: the vector's text where it has one, else its
/// tokens' text.
fn prompt_text(f: &Family, model: &Model) -> String {
    let path = ds4_testdata::vectors_dir(f.long_vector.0);
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).expect("the long vector")).expect("JSON");
    match v["prompt"].as_str() {
        Some(p) => p.to_string(),
        None => {
            let ids = families::long_prompt(f);
            String::from_utf8_lossy(&model.tokenizer.prompt_text(&ids[..ids.len().min(600)]))
                .into_owned()
        }
    }
}

/// Every family: a checkpoint of prompt + reply never changes the answer to
/// the prompt with another continuation after a restart, whatever its state
/// can be cut back to (DeepSeek V4's compressed state only within its current
/// compression window: there the request falls back to what it can use), and
/// never counts more reuse than the prompts share.
fn a_diverging_checkpoint_never_changes_the_answer(f: &Family) {
    let model = families::model(f);
    let dir = std::env::temp_dir().join(format!("ds4-diverge-{}-{}", f.name, std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let prompt = prompt_text(f, &model);
    let own = model.tokenizer.encode(&prompt, true, true).len();
    run(&model, Some(&dir), &prompt, 24);
    let request = format!("{prompt}\n\nQ: Who wrote this, and when?\nA:");
    let (text, usage, _) = run(&model, Some(&dir), &request, 16);
    assert!(usage.cached_tokens <= own, "{usage:?}");
    let (cold, _, _) = run(&model, None, &request, 16);
    assert_eq!(
        text, cold,
        "{}: reuse changed the output ({usage:?})",
        f.name
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn a_checkpoint_is_reused_up_to_where_the_request_departs(f: &Family) {
    let model = families::model(f);
    let dir = std::env::temp_dir().join(format!("ds4-partial-{}-{}", f.name, std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let prompt = prompt_text(f, &model);
    let own = model.tokenizer.encode(&prompt, true, true).len();
    // Prompt + reply, saved at shutdown.
    let (reply, _, _) = run(&model, Some(&dir), &prompt, 24);
    let other = "\n\nQ: Who wrote this, and when?\nA:";
    assert!(!reply.starts_with(&other[..2]), "{reply:?}");
    let request = format!("{prompt}{other}");

    // Restart: the same prompt with another continuation.
    let (text, usage, notices) = run(&model, Some(&dir), &request, 16);
    assert_eq!(
        usage.cache_source,
        CacheSource::DiskTextPartial,
        "{usage:?}"
    );
    assert!(
        usage.cached_tokens + 4 >= own && usage.cached_tokens <= own,
        "reused {} of the {own} shared tokens",
        usage.cached_tokens
    );
    assert!(usage.cut_tokens >= 20, "{usage:?}");
    let planned = notices
        .iter()
        .find_map(|n| match n {
            Notice::Planned(p) => Some(p.clone()),
            _ => None,
        })
        .expect("a plan");
    assert_eq!(planned.cut, usage.cut_tokens);
    assert!(
        planned
            .weighed
            .iter()
            .any(|w| !w.whole && w.verdict == Verdict::Used && w.load_s < w.prefill_s),
        "{:?}",
        planned.weighed
    );

    // A cold run of the same request answers the same.
    let (cold, cold_usage, _) = run(&model, None, &request, 16);
    assert_eq!(cold_usage.cache_source, CacheSource::None);
    assert_eq!(text, cold, "partial reuse changed the output");

    // The checkpoint cut where the runtime cut it, then prefilled, holds a
    // cold session's logits, bit for bit.
    let pool = Arc::new(ThreadPool::new(2));
    let ids = model.tokenizer.encode(&request, true, true);
    let mut cut = session(&model, &pool);
    let mut p = persist(&dir, &cut, ds4_runtime::discard());
    let offers = p.offers(request.as_bytes(), cut.n_ctx());
    let best = offers
        .sharing
        .first()
        .expect("a checkpoint sharing the prompt");
    p.load_into(0, &mut cut, &best.candidate, request.as_bytes())
        .expect("loaded");
    let n = usage.cached_tokens;
    assert_eq!(&cut.tokens()[..n], &ids[..n]);
    cut.rewind(n).unwrap();
    cut.prefill(&ids[n..]).unwrap();
    let mut fresh = session(&model, &pool);
    fresh.prefill(&ids).unwrap();
    let bits =
        |s: &Session| -> Vec<u32> { s.logits().unwrap().iter().map(|x| x.to_bits()).collect() };
    assert!(bits(&cut) == bits(&fresh), "logits differ from a cold run");
    let _ = std::fs::remove_dir_all(&dir);
}

for_each_family!(
    a_diverging_checkpoint_never_changes_the_answer;
    attention: a_checkpoint_is_reused_up_to_where_the_request_departs
);
