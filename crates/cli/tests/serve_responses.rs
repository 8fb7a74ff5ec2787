//! `ds4 serve` over real loopback HTTP, OpenAI Responses dialect: the response
//! object, the typed SSE event sequence, usage with prefix reuse, the output limit,
//! and 400s in OpenAI's error shape.

mod common;

use common::*;
use serde_json::{json, Value};

fn ask(extra: Value) -> Value {
    let mut b = json!({
        "model": "anything",
        "input": "What is the capital of France?",
        "temperature": 0,
        "max_output_tokens": 24,
    });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn output_text(v: &Value) -> String {
    assert_eq!(v["output"].as_array().unwrap().len(), 1, "{v}");
    let item = &v["output"][0];
    assert_eq!(
        (&item["type"], &item["role"]),
        (&json!("message"), &json!("assistant")),
        "{v}"
    );
    assert_eq!(item["content"][0]["type"], "output_text");
    item["content"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn responses_answer_stream_and_reuse_the_prompt() {
    let srv = Server::start(&["--no-kv-disk"]);
    let p = srv.port;

    let r = post(p, "/v1/responses", &ask(json!({})));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let answer = output_text(&v);
    assert!(answer.contains("Paris"), "{answer}");
    assert!(v["id"].as_str().unwrap().starts_with("resp_"), "{v}");
    assert!(v["output"][0]["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(
        (&v["object"], &v["model"]),
        (&json!("response"), &json!("anything"))
    );
    assert!(v["created_at"].as_u64().unwrap() > 0);
    let u = &v["usage"];
    let input = u["input_tokens"].as_u64().unwrap();
    let output = u["output_tokens"].as_u64().unwrap();
    assert!(input > 0 && output > 0, "{u}");
    assert_eq!(u["total_tokens"], input + output);
    assert_eq!(u["input_tokens_details"]["cached_tokens"], 0);
    assert_eq!(u["output_tokens_details"]["reasoning_tokens"], 0);
    // The answer fits in the limit.
    assert_eq!(v["status"], "completed", "{v}");
    assert!(v["incomplete_details"].is_null());
    assert_eq!(v["output"][0]["status"], "completed");

    // The same request again: the prompt comes from the live session.
    let r = post(p, "/v1/responses", &ask(json!({})));
    let v2 = r.json();
    let cached = v2["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0 && cached <= input, "cached {cached} of {input}");
    assert_eq!(output_text(&v2), answer);
    assert!(r.header("x-ds4-cache").unwrap().starts_with("memory-token"));

    // Streaming: the SDKs' event sequence, numbered, with the same text.
    let r = post(p, "/v1/responses", &ask(json!({"stream": true})));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let evs = sse_events(&r.body);
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    let n_delta = names
        .iter()
        .filter(|n| **n == "response.output_text.delta")
        .count();
    assert!(n_delta > 0);
    let mut want = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    want.extend(std::iter::repeat_n("response.output_text.delta", n_delta));
    want.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]);
    assert_eq!(names, want);
    for (i, (name, data)) in evs.iter().enumerate() {
        assert_eq!(data["type"], name.as_str());
        assert_eq!(data["sequence_number"], i, "{name}");
    }
    let msg_id = evs[2].1["item"]["id"].as_str().unwrap();
    let streamed: String = evs
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| {
            assert_eq!(
                (&d["item_id"], &d["output_index"], &d["content_index"]),
                (&json!(msg_id), &json!(0), &json!(0))
            );
            d["delta"].as_str().unwrap()
        })
        .collect();
    assert_eq!(streamed, answer);
    assert_eq!(evs[0].1["response"]["status"], "in_progress");
    let done = &evs[evs.len() - 4].1;
    assert_eq!(done["text"], answer.as_str());
    let fin = &evs[evs.len() - 1].1["response"];
    assert_eq!((&fin["status"], &fin["model"]), (&v["status"], &v["model"]));
    assert_eq!(output_text(fin), answer);
    assert_eq!(fin["usage"]["input_tokens"], input);
    assert_eq!(fin["usage"]["output_tokens"], output);
    assert!(
        fin["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );

    // The output limit: an incomplete response, streamed or not.
    let v = post(p, "/v1/responses", &ask(json!({"max_output_tokens": 2}))).json();
    assert_eq!(v["status"], "incomplete", "{v}");
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(v["output"][0]["status"], "incomplete");
    assert_eq!(v["usage"]["output_tokens"], 2);
    let short = output_text(&v);
    assert!(answer.starts_with(&short), "{short:?} vs {answer:?}");
    let r = post(
        p,
        "/v1/responses",
        &ask(json!({"max_output_tokens": 2, "stream": true})),
    );
    let evs = sse_events(&r.body);
    let (name, last) = evs.last().unwrap();
    assert_eq!(name, "response.incomplete");
    assert_eq!(
        last["response"]["incomplete_details"]["reason"],
        "max_output_tokens"
    );

    // Item input with instructions, as agents send it; ignored fields are fine.
    let v = post(
        p,
        "/v1/responses",
        &json!({
            "instructions": "You are a helpful assistant.",
            "input": [{"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "What is the capital of France?"}]}],
            "temperature": 0, "max_output_tokens": 24, "store": false,
            "metadata": {"k": "v"}, "user": "u", "parallel_tool_calls": false,
            "truncation": "auto", "reasoning": {"effort": "none"},
        }),
    )
    .json();
    assert!(output_text(&v).contains("Paris"), "{v}");
    assert_eq!(v["metadata"], json!({"k": "v"}));
    assert_eq!(v["instructions"], "You are a helpful assistant.");
}

#[test]
fn responses_errors_are_400s_in_openais_shape() {
    let srv = Server::start(&["--no-kv-disk", "--ctx", "64"]);
    let p = srv.port;
    let cases: Vec<(Reply, u16, Option<&str>, &str)> = vec![
        (
            request(p, "POST", "/v1/responses", b"{\"input\": ", &[]),
            400,
            None,
            "invalid JSON request",
        ),
        (
            post(
                p,
                "/v1/responses",
                &json!({"input": "x", "max_output_tokens": "9"}),
            ),
            400,
            None,
            "invalid type",
        ),
        (
            post(p, "/v1/responses", &json!({})),
            400,
            Some("input"),
            "missing `input`",
        ),
        (
            post(
                p,
                "/v1/responses",
                &json!({"input": [{"role": "user", "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {"type": "input_image", "image_url": "https://example.com/a.png"}]}]}),
            ),
            400,
            Some("input"),
            "input_image parts are not supported",
        ),
        (
            post(
                p,
                "/v1/responses",
                &json!({"input": "x", "previous_response_id": "resp_1"}),
            ),
            404,
            Some("previous_response_id"),
            "Previous response with id 'resp_1' not found.",
        ),
        (
            post(
                p,
                "/v1/responses",
                &json!({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {}}],
                        "tool_choice": {"type": "function", "name": "g"}}),
            ),
            400,
            Some("tool_choice"),
            "unknown tool",
        ),
        (
            post(
                p,
                "/v1/responses",
                &json!({"input": [{"type": "function_call_output", "call_id": 7, "output": "ok"}]}),
            ),
            400,
            Some("input"),
            "input[0].call_id must be a string",
        ),
        (
            post(p, "/v1/responses", &json!({"input": "word ".repeat(200)})),
            400,
            None,
            "maximum context length is 64",
        ),
        (
            request(p, "GET", "/v1/responses", b"", &[]),
            405,
            None,
            "not allowed",
        ),
    ];
    for (i, (r, status, param, msg)) in cases.iter().enumerate() {
        assert_eq!(r.status, *status, "case {i}: {}", r.body);
        let e = &r.json()["error"];
        let m = e["message"].as_str().unwrap_or_default();
        assert!(m.contains(msg), "case {i}: {m:?} lacks {msg:?}");
        assert_eq!(e["type"], "invalid_request_error", "case {i}");
        assert_eq!(e["param"].as_str(), *param, "case {i}");
        assert!(e.get("code").is_some(), "case {i}: {e}");
    }
    assert_eq!(
        cases[7].0.json()["error"]["code"],
        "context_length_exceeded"
    );
    // The server keeps serving.
    let v = post(
        p,
        "/v1/responses",
        &json!({"input": "Hi", "max_output_tokens": 2, "temperature": 0}),
    )
    .json();
    assert_eq!(v["status"], "incomplete", "{v}");
}

/// Stateful responses: a stored response's conversation continues from its id
/// with only the new input — after a `kill -9` and a restart too (the
/// conversation from disk, its state from the turn-end checkpoint) — and
/// answers as the full replay does on a cold server; `store: false` keeps
/// nothing, and an unknown id is a 404 `previous_response_not_found`.
#[test]
fn previous_response_id_continues_a_stored_conversation_across_a_restart() {
    let dir = temp_dir("stateful");
    let kv = dir.join("kv");
    let args = [&["--batched-session", "1"][..], &kv_flags(&kv)[..]].concat();
    let instructions = "You are a terse assistant.";
    let srv = Server::start(&args);
    let first = post(
        srv.port,
        "/v1/responses",
        &ask(json!({ "instructions": instructions })),
    );
    assert_eq!(first.status, 200, "{}", first.body);
    let first = first.json();
    assert_eq!(first["store"], true, "{first}");
    let id = first["id"].as_str().unwrap().to_string();
    let held = first["usage"]["total_tokens"].as_u64().unwrap();
    let unstored = post(srv.port, "/v1/responses", &ask(json!({ "store": false }))).json();
    assert_eq!(unstored["store"], false, "{unstored}");
    srv.wait_for_log("reason=turn-end", 2);
    srv.kill9();

    let follow = |previous: &str| {
        json!({ "model": "m", "instructions": instructions, "input": "And of Italy?",
                "previous_response_id": previous, "temperature": 0, "max_output_tokens": 16 })
    };
    let srv = Server::start(&args);
    let r = post(srv.port, "/v1/responses", &follow(&id));
    assert_eq!(r.status, 200, "{}", r.body);
    let cache = r.header("x-ds4-cache").unwrap_or_default();
    assert!(cache.starts_with("disk-text"), "{cache}");
    let next = r.json();
    assert_eq!(next["previous_response_id"], id.as_str());
    let cached = next["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached + 1 >= held,
        "restored {cached} of the first response's {held} tokens"
    );
    for unknown in [unstored["id"].as_str().unwrap(), "resp_0000", "../kv"] {
        let r = post(srv.port, "/v1/responses", &follow(unknown));
        assert_eq!(r.status, 404, "{unknown}: {}", r.body);
        let e = &r.json()["error"];
        assert_eq!(e["code"], "previous_response_not_found", "{e}");
        assert_eq!(e["param"], "previous_response_id", "{e}");
    }
    drop(srv);

    let cold = Server::start(&["--no-kv-disk", "--batched-session", "1"]);
    let replay = json!({ "model": "m", "instructions": instructions, "temperature": 0,
    "max_output_tokens": 16, "input": [
        { "role": "user", "content": "What is the capital of France?" },
        { "role": "assistant", "content": output_text(&first) },
        { "role": "user", "content": "And of Italy?" },
    ]});
    let want = post(cold.port, "/v1/responses", &replay).json();
    assert_eq!(output_text(&next), output_text(&want));
    drop(cold);
    std::fs::remove_dir_all(dir).unwrap();
}
