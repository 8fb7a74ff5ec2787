//! The replay of issue #20: a Claude-Code-like session (a long system prompt
//! with a tool list, tool results appended turn by turn, a cache breakpoint on
//! the last message, as Claude Code sends) on the default model, with a restart
//! before request 5 — graceful (a shutdown save of prompt 4 and its reply) and
//! `kill -9` (only the saves made while serving: with turn-end saves, prompt
//! 4 and its reply too) — where request 5 resends
//! prompt 4 with its reply edited (`clear_thinking`, a re-serialised tool
//! call): it shares the prompt, not the reply. Each restart is replayed under
//! the whole-prefix rule and the partial rule; the per-request table is
//! printed (`cargo test --release -p ds4-runtime --test replay -- --nocapture`).

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use common::{collect, greedy_job};
use ds4_engine::{KvType, Model, Precision, Session, SessionOptions, ThreadPool};
use ds4_kvstore::{Store, StoreConfig};
use ds4_runtime::{tokens_within, CacheSource, Notice, Persist, Runtime, RuntimeConfig, Usage};

fn model() -> Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    Arc::clone(M.get_or_init(|| {
        Arc::new(Model::load(ds4_testdata::model_path(ds4_testdata::SMOLLM2)).unwrap())
    }))
}

type Log = Arc<Mutex<Vec<String>>>;

fn start(store: &Path, whole_only: bool) -> (Runtime, Log) {
    let pool = Arc::new(ThreadPool::new(2));
    let opts = SessionOptions {
        n_ctx: 8192,
        prefill_chunk: 256,
        precision: Precision::Fast,
        kv_type: KvType::F16,
    };
    let s = Session::new(model(), Arc::clone(&pool), &opts);
    let log: Log = Arc::default();
    let sink: ds4_runtime::NoticeSink = {
        let log = Arc::clone(&log);
        Arc::new(move |n: Notice| log.lock().unwrap().push(n.to_string()))
    };
    let p = Persist::new(
        Store::open(store, StoreConfig::default()).unwrap(),
        &s,
        None,
        Arc::clone(&sink),
    );
    let p = if whole_only { p.whole_prefix_only() } else { p };
    (
        Runtime::start(vec![s], pool, Some(p), RuntimeConfig::default(), sink),
        log,
    )
}

/// Waits (at most a minute) for `n` turn-end saves: what a `kill -9` a
/// moment after the response finds on disk.
fn wait_for_turn_ends(log: &Log, n: usize) {
    let t = std::time::Instant::now();
    let count = || {
        log.lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains("reason=turn-end"))
            .count()
    };
    while count() < n {
        assert!(
            t.elapsed().as_secs() < 60,
            "{} of {n} turn ends saved",
            count()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Runs one request greedily: its reply and usage.
fn send(rt: &Runtime, prompt: &str) -> (String, Usage) {
    let ids = model().tokenizer.encode(prompt, true, true);
    // Claude Code marks its last message for caching.
    let (mut job, rx) = greedy_job(prompt, ids, 24, &[], vec![prompt.len()]);
    job.turn_save = Some(ds4_kvstore::SaveReason::TurnEnd);
    rt.handle.submit(job).unwrap();
    let (text, _, usage) = collect(rx);
    (text, usage)
}

const WORDS: [&str; 12] = [
    "reads",
    "writes",
    "lists",
    "searches",
    "edits",
    "moves",
    "copies",
    "deletes",
    "renames",
    "inspects",
    "formats",
    "validates",
];

/// A system prompt with a tool list (about 2,100 tokens).
fn system() -> String {
    let mut s = String::from(
        "You are an interactive CLI tool that helps users with software engineering tasks. \
         Use the tools below. Be concise; prefer editing files to creating them.\n\n# Tools\n",
    );
    for i in 0..36 {
        s.push_str(&format!(
            "\n## tool_{i}\nThe tool {} a file or a directory, then {} its contents and {} the \
             result. Parameters: {{\"path\": string, \"recursive\": boolean, \"limit\": integer \
             (at most {}), \"pattern\": string}}.\n",
            WORDS[i % 12],
            WORDS[(i * 5 + 3) % 12],
            WORDS[(i * 7 + 1) % 12],
            100 + i
        ));
    }
    s
}

/// A tool result of about 650 tokens.
fn tool_result(turn: usize) -> String {
    let mut s = format!("Result of call {turn}:\n");
    for line in 0..32 {
        s.push_str(&format!(
            "src/module_{turn}/file_{line}.rs: {} {} lines\n",
            WORDS[(turn + line) % 12],
            10 * line + turn
        ));
    }
    s
}

fn turn(user: &str) -> String {
    format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
}

/// Tokens of `prompt` an uninterrupted server could reuse after serving
/// `before` (the previous prompt with its generated reply): those wholly
/// inside the bytes they share.
fn shared_tokens(prompt: &str, before: &str) -> usize {
    let tok = &model().tokenizer;
    let ids = tok.encode(prompt, true, true);
    let common = prompt
        .bytes()
        .zip(before.bytes())
        .take_while(|(a, b)| a == b)
        .count();
    tokens_within(&ids, common, |i, id| tok.prompt_piece(i, id).len())
}

fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

struct Row {
    request: usize,
    prompt_tokens: usize,
    shared: usize,
    old: (usize, CacheSource),
    new: (usize, CacheSource),
}

#[test]
fn a_restart_before_request_5_reuses_the_shared_prompt() {
    let base: PathBuf = std::env::temp_dir().join(format!("ds4-replay-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let serving = base.join("serving");
    let crashed = base.join("kill-9");

    // Requests 1-4 on one server; what its store holds at a kill -9 after
    // request 4, and after a graceful stop.
    let mut prompt = format!(
        "<|im_start|>system\n{}<|im_end|>\n{}",
        system(),
        turn("Find where the configuration is loaded and list the files involved.")
    );
    let mut before = String::new();
    let mut first = Vec::new();
    let (rt, log) = start(&serving, false);
    let mut reply = String::new();
    for request in 1..=4 {
        if request > 1 {
            prompt = format!(
                "{prompt}{reply}<|im_end|>\n{}",
                turn(&tool_result(request - 1))
            );
        }
        let shared = shared_tokens(&prompt, &before);
        let (r, u) = send(&rt, &prompt);
        first.push((
            request,
            u.prompt_tokens,
            shared,
            u.cached_tokens,
            u.cache_source,
        ));
        before = format!("{prompt}{r}");
        reply = r;
    }
    wait_for_turn_ends(&log, 4);
    copy_dir(&serving, &crashed);
    rt.handle.begin_shutdown();
    rt.join();

    // Request 5 resends prompt 4 with its reply edited; request 6 continues it.
    let edited = "<tool_call>\n{\"name\": \"tool_3\", \"arguments\": {\"path\": \"src\", \"recursive\": true}}\n</tool_call>";
    assert!(!reply.starts_with('<'), "{reply:?}");
    let prompt5 = format!("{prompt}{edited}<|im_end|>\n{}", turn(&tool_result(4)));
    let shared5 = shared_tokens(&prompt5, &before);

    let mut tables = Vec::new();
    for (variant, store) in [("graceful restart", &serving), ("kill -9", &crashed)] {
        let mut rows: Vec<Row> = first
            .iter()
            .map(|&(request, prompt_tokens, shared, reused, source)| Row {
                request,
                prompt_tokens,
                shared,
                old: (reused, source),
                new: (reused, source),
            })
            .collect();
        let mut after = Vec::new();
        for whole_only in [true, false] {
            let dir = base.join(format!("{variant}-{whole_only}").replace(' ', "-"));
            copy_dir(store, &dir);
            let (rt, _) = start(&dir, whole_only);
            let (r5, u5) = send(&rt, &prompt5);
            let prompt6 = format!("{prompt5}{r5}<|im_end|>\n{}", turn(&tool_result(5)));
            let shared6 = shared_tokens(&prompt6, &format!("{prompt5}{r5}"));
            let (_, u6) = send(&rt, &prompt6);
            rt.handle.begin_shutdown();
            rt.join();
            after.push([(u5, shared5), (u6, shared6)]);
        }
        for (i, ((old, shared), (new, _))) in after[0].iter().zip(&after[1]).enumerate() {
            rows.push(Row {
                request: 5 + i,
                prompt_tokens: new.prompt_tokens,
                shared: *shared,
                old: (old.cached_tokens, old.cache_source),
                new: (new.cached_tokens, new.cache_source),
            });
        }
        tables.push((variant, rows));
    }

    for (variant, rows) in &tables {
        println!("\n{variant} before request 5:");
        println!("| request | prompt tokens | shared tokens | reused, whole-prefix rule | reused, partial rule |");
        println!("|---:|---:|---:|---|---|");
        for r in rows {
            println!(
                "| {} | {} | {} | {} ({}) | {} ({}) |",
                r.request,
                r.prompt_tokens,
                r.shared,
                r.old.0,
                r.old.1.as_str(),
                r.new.0,
                r.new.1.as_str()
            );
        }
    }
    for (variant, rows) in &tables {
        for r in rows {
            assert!(r.new.0 >= r.old.0, "{variant}: request {}", r.request);
        }
    }
    // Either restart brings back the shared prompt: a kill -9 finds request
    // 4's turn end on disk as a graceful stop leaves its shutdown save.
    for (variant, rows) in &tables {
        let r5 = &rows[4];
        assert_eq!(r5.new.1, CacheSource::DiskTextPartial, "{variant}");
        assert!(
            r5.new.0 as f64 >= 0.95 * r5.shared as f64,
            "{variant}: reused {} of {} shared",
            r5.new.0,
            r5.shared
        );
    }
    let _ = std::fs::remove_dir_all(&base);
}
