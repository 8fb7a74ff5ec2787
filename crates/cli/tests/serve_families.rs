//! `ds4 serve` on the second family (Gemma 3, a base model with a sliding
//! window): completions answer like the golden vector, chat routes without a
//! template are refused clearly, checkpoints of its ring state come back across
//! a restart and continue as the uninterrupted session, a prompt that diverges
//! further back than the window is answered as a cold run, and checkpoints never
//! cross families. On the third (the tiny DeepSeek V4 model) the compressed
//! state's checkpoints come back across a restart the same way. On the first two,
//! llama.cpp's `/tokenize` and `/detokenize` answer as its tokenizer vectors,
//! and `/apply-template` renders what the chat route does.

mod common;

use common::{kv_flags, post, temp_dir, Server};
use serde_json::{json, Value};

fn model_arg(file: &str) -> String {
    ds4_testdata::model_path(file).display().to_string()
}

fn vector(name: &str) -> Value {
    let path = ds4_testdata::vectors_dir("llama-cpp").join(name);
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn complete(port: u16, prompt: &str, max_tokens: u32) -> (String, String, u64) {
    let r = post(
        port,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let b = r.json();
    (
        b["choices"][0]["text"].as_str().unwrap().to_string(),
        r.header("x-ds4-cache").unwrap_or_default(),
        b["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    )
}

#[test]
fn gemma3_serves_completions_and_refuses_chat_without_a_template() {
    let g = model_arg(ds4_testdata::GEMMA3);
    let srv = Server::start(&["-m", &g, "--no-kv-disk"]);
    let v = vector("gemma3_270m_capital_france.json");
    let (text, _, _) = complete(srv.port, v["prompt"].as_str().unwrap(), 8);
    // The reference's first greedy tokens (its top-1 gaps there are wide).
    let want: String = v["generated_texts"].as_array().unwrap()[..8]
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(text, want);
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "/v1/messages",
            json!({"model": "x", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
        ),
        ("/v1/responses", json!({"model": "x", "input": "hi"})),
        (
            "/apply-template",
            json!({"messages": [{"role": "user", "content": "hi"}]}),
        ),
    ] {
        let r = post(srv.port, path, &body);
        assert_eq!(r.status, 400, "{path}: {}", r.body);
        assert!(r.body.contains("no chat template"), "{path}: {}", r.body);
    }
    let log = srv.stop();
    assert!(log.contains("(gemma3, 18 layers"), "{log}");
}

#[test]
fn gemma3_ring_checkpoints_restore_across_a_restart_and_never_cross_families() {
    let dir = temp_dir("gemma3");
    let kv = dir.join("kv");
    let g = model_arg(ds4_testdata::GEMMA3);
    // One slot: the diverged request must land on the live conversation.
    let args = [
        &["-m", g.as_str(), "--batched-session", "1"][..],
        &kv_flags(&kv)[..],
    ]
    .concat();
    // 1998 tokens: far past the 512-token window of the local layers.
    let prompt = vector("gemma3_270m_long_promessi_sposi.json")["prompt"]
        .as_str()
        .unwrap()
        .to_string();
    let srv = Server::start(&args);
    let (cold, src, _) = complete(srv.port, &prompt, 12);
    assert!(src.starts_with("none"), "{src}");
    // The same text cut about 1,200 tokens back, with a new ending: memory
    // holds that prefix's tokens, but the ring no longer holds the window
    // before it, so this runs cold (after an evict save of the live state)
    // and must equal a fresh server's answer.
    let cut = prompt
        .char_indices()
        .nth(prompt.chars().count() * 2 / 5)
        .unwrap()
        .0;
    let diverged = format!("{} E poi, all'improvviso,", &prompt[..cut]);
    let (after, src, reused) = complete(srv.port, &diverged, 12);
    assert_eq!(reused, 0, "{src}");
    // Each turn's end is saved (the evict and shutdown saves then find the
    // state on disk already).
    let log = srv.stop();
    assert!(log.matches("reason=turn-end").count() == 2, "{log}");

    // The uninterrupted session, on a server without a store.
    let fresh = Server::start(&["-m", &g, "--no-kv-disk", "--batched-session", "1"]);
    assert_eq!(complete(fresh.port, &prompt, 12).0, cold);
    let turn2 = format!("{prompt}{cold}");
    let (x0, src, _) = complete(fresh.port, &turn2, 12);
    assert!(src.starts_with("memory"), "{src}");
    let (want, _, _) = complete(fresh.port, &diverged, 12);
    assert_eq!(after, want, "a diverged prompt must answer as a cold run");
    drop(fresh);

    // Restart: the ring state of the long prompt and its answer (its
    // turn-end save) comes back from disk and continues as the uninterrupted session.
    let srv = Server::start(&args);
    let (x2, src, reused) = complete(srv.port, &turn2, 12);
    assert!(src.starts_with("disk-text") && reused > 1900, "{src}");
    assert_eq!(x2, x0, "restart changed the output");
    drop(srv);

    // A SmolLM2 server on the same store is never offered Gemma's checkpoints,
    // and the reverse.
    let s = model_arg(ds4_testdata::SMOLLM2);
    let srv = Server::start(&[&["-m", s.as_str()][..], &kv_flags(&kv)[..]].concat());
    let (_, src, reused) = complete(srv.port, &prompt, 4);
    assert!(src.starts_with("none") && reused == 0, "{src}");
    srv.stop();
    let srv = Server::start(&args);
    let smol_prompt = "Once upon a time there was a lighthouse keeper who ".repeat(8);
    let _ = complete(srv.port, &smol_prompt, 2);
    drop(srv);
    let srv = Server::start(&[&["-m", s.as_str()][..], &kv_flags(&kv)[..]].concat());
    let (_, src, _) = complete(srv.port, &smol_prompt, 2);
    assert!(src.starts_with("none"), "{src}");
    drop(srv);
    std::fs::remove_dir_all(dir).unwrap();
}

/// The compressed state (raw ring, compressed and indexer rows, compressor
/// frontiers) of a 1,500-token prompt and its answer, saved at the turn's
/// end, comes back from disk after a restart and continues exactly as a
/// server that never stopped.
#[test]
fn deepseek4_compressed_checkpoints_restore_across_a_restart() {
    let dir = temp_dir("deepseek4");
    let kv = dir.join("kv");
    let m = ds4_testdata::tiny_ds4::tiny_ds4_path()
        .display()
        .to_string();
    let args = [&["-m", m.as_str()][..], &kv_flags(&kv)[..]].concat();
    let text =
        std::fs::read_to_string(ds4_testdata::vectors_dir("ds4-tiny").join("long.txt")).unwrap();
    let srv = Server::start(&args);
    let (answer, src, _) = complete(srv.port, &text, 8);
    assert!(src.starts_with("none"), "{src}");
    let log = srv.stop();
    assert!(log.contains("reason=turn-end"), "{log}");

    let turn2 = format!("{text}{answer} And then");
    let srv = Server::start(&args);
    let (after, src, reused) = complete(srv.port, &turn2, 8);
    assert!(
        src.starts_with("disk-text") && reused > 1400,
        "{src} {reused}"
    );
    drop(srv);

    let fresh = Server::start(&["-m", &m, "--no-kv-disk"]);
    assert_eq!(complete(fresh.port, &text, 8).0, answer);
    let (want, src, _) = complete(fresh.port, &turn2, 8);
    assert!(src.starts_with("memory"), "{src}");
    assert_eq!(after, want, "restart changed the output");
    drop(fresh);
    std::fs::remove_dir_all(dir).unwrap();
}

/// The bytes a vector's piece stands for: a string, or a list of byte values.
fn piece_bytes(p: &Value) -> Vec<u8> {
    match p {
        Value::String(s) => s.as_bytes().to_vec(),
        Value::Array(b) => b.iter().map(|v| v.as_u64().unwrap() as u8).collect(),
        other => panic!("piece {other}"),
    }
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// llama.cpp's `/tokenize` and `/detokenize` on every family with a tokenizer
/// vector: for each of its strings and its four encodings, the ids llama.cpp
/// gave, each piece (string or bytes) as its server printed it, and the ids
/// decoded back to the concatenated pieces; then the refusals, and (with a
/// chat template) `/apply-template` against the chat route's prompt.
#[test]
fn tokenize_routes_answer_as_llama_cpp_on_every_family() {
    for (file, vectors) in [
        (ds4_testdata::SMOLLM2, "tokenizer_smollm2.json"),
        (ds4_testdata::GEMMA3, "tokenizer_gemma3_270m.json"),
    ] {
        let m = model_arg(file);
        let srv = Server::start(&["-m", &m, "--no-kv-disk"]);
        let v = vector(vectors);
        let cases = v["cases"].as_array().unwrap();
        assert!(cases.len() >= 40, "{vectors}");
        for case in cases {
            let text = case["text"].as_str().unwrap();
            for enc in case["encodings"].as_array().unwrap() {
                let (add, parse) = (&enc["add_special"], &enc["parse_special"]);
                let what = format!("{file} {:?} [{}]", text, enc["variant"]);
                let r = post(
                    srv.port,
                    "/tokenize",
                    &json!({"content": text, "add_special": add, "parse_special": parse}),
                );
                assert_eq!(r.status, 200, "{what}: {}", r.body);
                assert_eq!(r.json()["tokens"], enc["ids"], "{what}");
                let r = post(
                    srv.port,
                    "/tokenize",
                    &json!({"content": text, "add_special": add, "parse_special": parse,
                            "with_pieces": true}),
                );
                let tokens = r.json()["tokens"].as_array().unwrap().clone();
                let pieces = enc["pieces"].as_array().unwrap();
                assert_eq!(tokens.len(), pieces.len(), "{what}");
                for ((t, want), id) in tokens
                    .iter()
                    .zip(pieces)
                    .zip(enc["ids"].as_array().unwrap())
                {
                    assert_eq!(&t["id"], id, "{what}");
                    // A string exactly when the piece is UTF-8, as llama.cpp prints it.
                    assert_eq!(t["piece"].is_string(), want.is_string(), "{what}: {t}");
                    assert_eq!(piece_bytes(&t["piece"]), piece_bytes(want), "{what}");
                }
                let r = post(srv.port, "/detokenize", &json!({"tokens": enc["ids"]}));
                assert_eq!(r.status, 200, "{what}: {}", r.body);
                let concat = unhex(enc["pieces_concat_hex"].as_str().unwrap());
                assert_eq!(
                    r.json()["content"].as_str().unwrap(),
                    String::from_utf8_lossy(&concat),
                    "{what}"
                );
            }
        }
        // The defaults are llama.cpp's: no BOS, special texts parsed.
        let special = if file == ds4_testdata::GEMMA3 {
            "<start_of_turn>"
        } else {
            "<|im_start|>"
        };
        let r = post(srv.port, "/tokenize", &json!({ "content": special }));
        assert_eq!(
            r.json()["tokens"].as_array().unwrap().len(),
            1,
            "{}",
            r.body
        );
        for (path, body, says) in [
            ("/tokenize", json!({}), "missing field `content`"),
            ("/tokenize", json!({"content": 3}), "expected a string"),
            (
                "/tokenize",
                json!({"content": "a", "add_special": "yes"}),
                "expected a boolean",
            ),
            ("/detokenize", json!({"tokens": [-1]}), "expected u32"),
            (
                "/detokenize",
                json!({"tokens": "12"}),
                "expected a sequence",
            ),
            (
                "/detokenize",
                json!({"tokens": [0, 4000000]}),
                "token 4000000 is outside the vocabulary",
            ),
        ] {
            let r = post(srv.port, path, &body);
            assert_eq!(r.status, 400, "{path} {body}: {}", r.body);
            assert!(r.body.contains(says), "{path} {body}: {}", r.body);
        }
        if file == ds4_testdata::SMOLLM2 {
            // /apply-template gives the text the chat route renders: tokenized
            // as a prompt is, as many tokens as the completion's usage counts.
            let chat = json!({"messages": [
                {"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "What is the capital of France?"}]});
            let r = post(srv.port, "/apply-template", &chat);
            assert_eq!(r.status, 200, "{}", r.body);
            let prompt = r.json()["prompt"].as_str().unwrap().to_string();
            assert!(
                prompt.starts_with("<|im_start|>system\nAnswer in one word.<|im_end|>\n"),
                "{prompt}"
            );
            assert!(prompt.ends_with("<|im_start|>assistant\n"), "{prompt}");
            let r = post(
                srv.port,
                "/tokenize",
                &json!({"content": prompt, "add_special": true}),
            );
            let n = r.json()["tokens"].as_array().unwrap().len();
            let mut body = chat.clone();
            body["max_tokens"] = json!(1);
            let r = post(srv.port, "/v1/chat/completions", &body);
            assert_eq!(r.status, 200, "{}", r.body);
            assert_eq!(r.json()["usage"]["prompt_tokens"], json!(n), "{}", r.body);
            let r = post(srv.port, "/apply-template", &json!({"messages": "x"}));
            assert_eq!(r.status, 400, "{}", r.body);
            assert!(r.body.contains("expected a sequence"), "{}", r.body);
        }
        // Still serving after the refusals.
        let r = post(srv.port, "/tokenize", &json!({ "content": "ok" }));
        assert_eq!(r.status, 200, "{}", r.body);
        srv.stop();
    }
}
