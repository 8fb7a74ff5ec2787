//! Replays the sessions the real agent CLIs sent (tests/vectors/clients/
//! *-session.json, recorded by tests/clients/run.py: Claude Code, Codex CLI,
//! opencode against `ds4 serve`) request by request, with their headers, on the
//! server the recording ran on (SmolLM2, --ctx 32768, --tool-first): each
//! request is answered 2xx, the first one (a user turn) with a tool call parsed
//! into the dialect's own shape, the tool calls and results the history carries
//! are rendered into the prompt in the model's call syntax, and every later
//! request reuses the whole previous prompt (the recorded replies were sampled,
//! so the replay's own differ after it) or at least 90% of its own. No npm
//! needed.

mod common;

use common::{kv_flags, request, temp_dir, Server};
use serde_json::Value;
use std::path::PathBuf;

/// Output tokens per replayed request: the prefills are what is being replayed.
const MAX_TOKENS: u64 = 24;
/// Output tokens of the first request of the thread: room for the forced call
/// (a name and the required arguments of the client's largest tool schema).
const FIRST_CALL_TOKENS: u64 = 160;

fn sessions() -> Vec<PathBuf> {
    let dir = ds4_testdata::vectors_dir("clients");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with("-session.json"))
        .collect();
    v.sort();
    v
}

/// The body with its output limit cut to `limit` (the field each dialect uses).
fn capped(path: &str, mut body: Value, limit: u64) -> Value {
    let field = if path.starts_with("/v1/responses") {
        "max_output_tokens"
    } else {
        "max_tokens"
    };
    let o = body.as_object_mut().unwrap();
    o.insert(field.into(), limit.into());
    o.remove("max_completion_tokens");
    body
}

/// (source, reused, prompt) of an `x-ds4-cache` header.
fn cache(h: &str) -> (String, u64, u64) {
    let source = h.split(';').next().unwrap().trim().to_string();
    let num = |k: &str| {
        h.split(';')
            .map(str::trim)
            .find_map(|p| p.strip_prefix(k))
            .unwrap_or_else(|| panic!("{k} in {h}"))
            .parse()
            .unwrap()
    };
    (source, num("reused="), num("prompt="))
}

/// Names of the tool calls in a response body (SSE or JSON), in any dialect.
fn calls(body: &str) -> Vec<String> {
    let payloads: Vec<Value> = if body.trim_start().starts_with('{') {
        vec![serde_json::from_str(body).unwrap()]
    } else {
        common::sse_data(body)
            .iter()
            .filter(|d| d.as_str() != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
            .collect()
    };
    let mut names = vec![];
    for p in payloads {
        if p["content_block"]["type"] == "tool_use" {
            names.push(p["content_block"]["name"].as_str().unwrap().to_string());
        }
        if p["type"] == "response.output_item.done" && p["item"]["type"] == "function_call" {
            names.push(p["item"]["name"].as_str().unwrap().to_string());
        }
        for ch in p["choices"].as_array().into_iter().flatten() {
            let d = if ch["delta"].is_null() {
                &ch["message"]
            } else {
                &ch["delta"]
            };
            for tc in d["tool_calls"].as_array().into_iter().flatten() {
                if let Some(n) = tc["function"]["name"].as_str() {
                    names.push(n.to_string());
                }
            }
        }
    }
    names
}

#[test]
fn recorded_client_sessions_replay_with_tool_calls_and_prefix_reuse() {
    let files = sessions();
    assert!(
        !files.is_empty(),
        "no *-session.json under tests/vectors/clients"
    );
    for file in files {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let session: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        let dir = temp_dir(&format!("clients-{}", &name[..name.find('-').unwrap()]));
        let trace = dir.join("trace.jsonl");
        let kv = dir.join("kv");
        let mut args = vec!["--ctx", "32768", "--tool-first"];
        args.extend(kv_flags(&kv));
        args.extend(["--trace", trace.to_str().unwrap()]);
        let mut server = Server::start(&args);
        let reqs = session["requests"].as_array().unwrap();
        let mut main_turn = 0;
        let mut previous_prompt = 0;
        for (i, r) in reqs.iter().enumerate() {
            let path = r["path"].as_str().unwrap();
            let opens =
                main_turn == 0 && r["body"]["tools"].as_array().is_some_and(|t| !t.is_empty());
            let limit = if opens { FIRST_CALL_TOKENS } else { MAX_TOKENS };
            let body = capped(path, r["body"].clone(), limit);
            let headers: Vec<(String, String)> = r["headers"]
                .as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| k.as_str() != "content-type")
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
                .collect();
            let extra: Vec<(&str, &str)> = headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let reply = request(
                server.port,
                "POST",
                path,
                body.to_string().as_bytes(),
                &extra,
            );
            server.assert_alive();
            assert!(
                (200..300).contains(&reply.status),
                "{name} request {i} {path}: {} {}",
                reply.status,
                reply.body
            );
            let has_tools = body["tools"].as_array().is_some_and(|t| !t.is_empty());
            if !has_tools {
                continue; // a side request (a title): answered, not part of the thread
            }
            main_turn += 1;
            let (source, reused, prompt) = cache(&reply.header("x-ds4-cache").unwrap());
            let got = calls(&reply.body);
            let results = r["tool_results"].as_array().unwrap();
            if main_turn == 1 {
                assert!(
                    !got.is_empty(),
                    "{name} request {i}: --tool-first gave no parsed call: {}",
                    reply.body
                );
            } else {
                // The recording's replies were sampled, so the replay's own
                // differ and the history departs from the slot after the
                // previous prompt: all of that is reused (or 90% of this one).
                assert!(
                    reused * 10 >= prompt * 9 || reused + 2 >= previous_prompt,
                    "{name} request {i}: {source} reused {reused} of {prompt} (the previous prompt: {previous_prompt})"
                );
            }
            previous_prompt = prompt;
            if !results.is_empty() {
                // The history's calls and results are in the rendered prompt.
                let text = std::fs::read_to_string(&trace).unwrap();
                let last = text
                    .lines()
                    .rev()
                    .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                    .find(|e| e["event"] == "request")
                    .unwrap();
                let prompt = last["prompt"]["prompt"].as_str().unwrap();
                for c in reqs[..i]
                    .iter()
                    .flat_map(|p| p["tool_calls"].as_array().unwrap())
                {
                    let call = format!(
                        "<tool_call>\n{{\"name\": \"{}\"",
                        c["name"].as_str().unwrap()
                    );
                    assert!(
                        prompt.contains(&call),
                        "{name} request {i}: {call} not in the prompt"
                    );
                }
                assert!(
                    prompt.contains("<tool_response>"),
                    "{name} request {i}: no tool result rendered"
                );
            }
        }
        assert!(
            main_turn >= 2,
            "{name}: fewer than two main-thread requests"
        );
        server.stop();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
