//! `ds4 serve` speaking Anthropic's Messages API over real loopback HTTP: answers,
//! the SSE event sequence, token counting, the usage split between cache reads,
//! checkpoint writes and the rest, and errors in Anthropic's shape.

mod common;

use common::*;
use serde_json::{json, Value};

impl Reply {
    /// Asserts an Anthropic error of `status` and `ty` whose message has `msg`.
    fn assert_error(&self, status: u16, ty: &str, msg: &str) {
        assert_eq!(self.status, status, "{}", self.body);
        let v = self.json();
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], ty, "{v}");
        let m = v["error"]["message"].as_str().unwrap_or_default();
        assert!(m.contains(msg), "{m:?} lacks {msg:?}");
    }
}

const FRANCE: &str = "What is the capital of France?";

/// A `/v1/messages` body at temperature 0 with `extra` merged in.
fn msg_body(messages: Value, extra: Value) -> Value {
    let mut b =
        json!({ "model": "claude-test", "messages": messages, "temperature": 0, "max_tokens": 24 });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn france() -> Value {
    json!([{ "role": "user", "content": FRANCE }])
}

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

/// input + cache read + cache creation: the whole prompt.
fn total_input(usage: &Value) -> u64 {
    n(&usage["input_tokens"])
        + n(&usage["cache_read_input_tokens"])
        + n(&usage["cache_creation_input_tokens"])
}

#[test]
fn messages_answer_stream_and_count_tokens() {
    let srv = Server::start(&["--no-kv-disk"]);
    let p = srv.port;

    let r = post(p, "/v1/messages", &msg_body(france(), json!({})));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let answer = v["content"][0]["text"].as_str().unwrap().to_string();
    assert!(answer.contains("Paris"), "{answer}");
    assert!(v["id"].as_str().unwrap().starts_with("msg_"), "{v}");
    assert_eq!(
        (&v["type"], &v["role"], &v["model"]),
        (
            &json!("message"),
            &json!("assistant"),
            &json!("claude-test")
        )
    );
    assert_eq!(v["content"].as_array().unwrap().len(), 1);
    assert_eq!(v["content"][0]["type"], "text");
    assert_eq!(v["stop_reason"], "end_turn", "{v}");
    assert!(v["stop_sequence"].is_null());
    let usage = &v["usage"];
    assert_eq!(usage["cache_read_input_tokens"], 0, "{usage}");
    assert_eq!(usage["cache_creation_input_tokens"], 0, "{usage}");
    let prompt_tokens = n(&usage["input_tokens"]);
    assert!(prompt_tokens > 5);
    let output_tokens = n(&usage["output_tokens"]);
    assert!(output_tokens > 0);

    // count_tokens agrees with the prompt the generation saw.
    let c = post(
        p,
        "/v1/messages/count_tokens",
        &json!({ "messages": france() }),
    );
    assert_eq!(c.status, 200, "{}", c.body);
    assert_eq!(c.json(), json!({ "input_tokens": prompt_tokens }));

    // Streaming: Anthropic's exact event sequence, the same text in deltas, and
    // the repeat reads the whole prompt from the live session.
    let r = post(
        p,
        "/v1/messages",
        &msg_body(france(), json!({ "stream": true })),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let events = sse_events(&r.body);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let k = names.len();
    assert!(k >= 7, "{names:?}");
    assert_eq!(
        names[..3],
        ["message_start", "ping", "content_block_start"],
        "{names:?}"
    );
    assert!(names[3..k - 3].iter().all(|n| *n == "content_block_delta"));
    assert_eq!(
        names[k - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    for (name, data) in &events {
        assert_eq!(data["type"], name.as_str(), "{data}");
    }
    let start = &events[0].1["message"];
    assert!(start["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(
        (
            &start["type"],
            &start["role"],
            &start["model"],
            &start["content"]
        ),
        (
            &json!("message"),
            &json!("assistant"),
            &json!("claude-test"),
            &json!([])
        )
    );
    assert!(start["stop_reason"].is_null() && start["stop_sequence"].is_null());
    assert_eq!(start["usage"]["output_tokens"], 0);
    assert_eq!(start["usage"]["cache_read_input_tokens"], prompt_tokens);
    assert_eq!(total_input(&start["usage"]), prompt_tokens);
    // Blocks open when their first piece is known (text, thinking or a tool call).
    assert_eq!(
        events[2].1,
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
    );
    let streamed: String = events[3..k - 3]
        .iter()
        .map(|(_, d)| {
            assert_eq!(d["index"], 0);
            assert_eq!(d["delta"]["type"], "text_delta");
            d["delta"]["text"].as_str().unwrap()
        })
        .collect();
    assert_eq!(streamed, answer);
    assert_eq!(
        events[k - 3].1,
        json!({"type": "content_block_stop", "index": 0})
    );
    let delta = &events[k - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");
    assert!(delta["delta"]["stop_sequence"].is_null());
    assert_eq!(delta["usage"]["output_tokens"], output_tokens);
    assert_eq!(total_input(&delta["usage"]), prompt_tokens);

    // Text blocks concatenate: the same prompt, hence the same answer.
    let blocks = json!([{ "role": "user", "content": [
        { "type": "text", "text": "What is the capital " },
        { "type": "text", "text": "of France?" } ] }]);
    let v = post(p, "/v1/messages", &msg_body(blocks, json!({}))).json();
    assert_eq!(v["content"][0]["text"], answer.as_str());
    assert_eq!(total_input(&v["usage"]), prompt_tokens);

    // The system prompt: `x-anthropic-` and empty parts are dropped, so both forms
    // render the same prompt (and count the same tokens).
    let count = |system: Value| {
        let r = post(
            p,
            "/v1/messages/count_tokens",
            &json!({ "model": "m", "system": system, "messages": france() }),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        n(&r.json()["input_tokens"])
    };
    let plain = count(json!("Answer in one word."));
    assert_ne!(plain, prompt_tokens);
    assert_eq!(
        count(json!([
            { "type": "text", "text": "x-anthropic-billing-header: cc_version=1" },
            { "type": "text", "text": "Answer in one word.", "cache_control": { "type": "ephemeral" } },
            { "type": "text", "text": "" }
        ])),
        plain
    );

    // Stop sequences cut the text (reported as end_turn, see anthropic.rs).
    let v = post(
        p,
        "/v1/messages",
        &msg_body(france(), json!({ "stop_sequences": ["Paris"] })),
    )
    .json();
    let cut = v["content"][0]["text"].as_str().unwrap();
    assert_eq!(cut, &answer[..answer.find("Paris").unwrap()]);
    assert_eq!(v["stop_reason"], "end_turn");

    // The token limit gives max_tokens.
    let v = post(
        p,
        "/v1/messages",
        &msg_body(france(), json!({ "max_tokens": 2 })),
    )
    .json();
    assert_eq!(v["stop_reason"], "max_tokens", "{v}");
    assert_eq!(v["usage"]["output_tokens"], 2);
}

#[test]
fn checkpoint_writes_and_reads_show_in_the_cache_fields() {
    let dir = temp_dir("kv");
    let kv = dir.join("kv");
    let srv = Server::start(&kv_flags(&kv));
    let p = srv.port;
    let total = n(&post(
        p,
        "/v1/messages/count_tokens",
        &json!({ "messages": france() }),
    )
    .json()["input_tokens"]);

    // A cold prompt is checkpointed while it is prefilled.
    let v = post(p, "/v1/messages", &msg_body(france(), json!({}))).json();
    let u = &v["usage"];
    assert_eq!(u["cache_read_input_tokens"], 0, "{u}");
    assert!(n(&u["cache_creation_input_tokens"]) > 0, "{u}");
    assert_eq!(total_input(u), total, "{u}");

    // The repeat reads it back (from the live session) and writes nothing new.
    let v = post(p, "/v1/messages", &msg_body(france(), json!({}))).json();
    let u = &v["usage"];
    assert!(n(&u["cache_read_input_tokens"]) > 0, "{u}");
    assert_eq!(total_input(u), total, "{u}");
    drop(srv);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn errors_have_anthropic_shape() {
    let srv = Server::start(&["--no-kv-disk", "--ctx", "64", "--max-body-bytes", "4096"]);
    let p = srv.port;
    let bad = "invalid_request_error";
    request(p, "POST", "/v1/messages", b"{not json", &[]).assert_error(
        400,
        bad,
        "invalid JSON request",
    );
    post(p, "/v1/messages", &json!({ "messages": france() })).assert_error(
        400,
        bad,
        "max_tokens: field required",
    );
    post(
        p,
        "/v1/messages",
        &json!({ "max_tokens": "9", "messages": france() }),
    )
    .assert_error(400, bad, "invalid type");
    post(p, "/v1/messages", &json!({ "max_tokens": 9 })).assert_error(
        400,
        bad,
        "messages: field required",
    );
    let image = json!([{ "role": "user", "content": [
        { "type": "text", "text": "What is this?" },
        { "type": "image", "source": { "type": "base64", "media_type": "image/png", "data": "AAAA" } } ] }]);
    post(p, "/v1/messages", &msg_body(image, json!({}))).assert_error(
        400,
        bad,
        "messages.0.content.1: image blocks are not supported",
    );
    post(
        p,
        "/v1/messages",
        &msg_body(
            france(),
            json!({ "tools": [{ "name": "f", "input_schema": { "type": "object" } }],
                    "tool_choice": { "type": "tool", "name": "g" } }),
        ),
    )
    .assert_error(400, bad, "tool_choice names an unknown tool \"g\"");
    post(
        p,
        "/v1/messages",
        &msg_body(france(), json!({ "thinking": { "type": "sometimes" } })),
    )
    .assert_error(400, bad, "thinking.type must be");
    post(
        p,
        "/v1/messages/count_tokens",
        &json!({ "messages": [{ "role": "tool", "content": "x" }] }),
    )
    .assert_error(400, bad, "unknown role \"tool\"");
    let long = json!([{ "role": "user", "content": "word ".repeat(200) }]);
    let r = post(p, "/v1/messages", &msg_body(long, json!({})));
    // Anthropic's wording, which Claude Code parses to compact its history.
    r.assert_error(400, bad, "prompt is too long: ");
    let m = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(m.ends_with(" tokens > 63 maximum"), "{m}");
    // A prompt that fits with a `max_tokens` that does not: the numbers Claude
    // Code retries with a smaller `max_tokens` from.
    let r = post(
        p,
        "/v1/messages",
        &msg_body(france(), json!({ "max_tokens": 60 })),
    );
    r.assert_error(
        400,
        bad,
        "input length and `max_tokens` exceed context limit: ",
    );
    let m = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(
        m.contains(" + 60 > 64, decrease input length or `max_tokens`"),
        "{m}"
    );
    request(p, "POST", "/v1/messages", &vec![b' '; 5000], &[]).assert_error(
        413,
        "request_too_large",
        "--max-body-bytes",
    );
    request(p, "POST", "/v1/messages/batches", b"{}", &[]).assert_error(
        404,
        "not_found_error",
        "unknown endpoint",
    );
    request(p, "GET", "/v1/messages", b"", &[]).assert_error(405, bad, "not allowed");
    // Other paths keep OpenAI's shape.
    let r = request(p, "GET", "/v1/nothing", b"", &[]);
    assert_eq!(r.status, 404);
    assert!(r.json().get("type").is_none() && r.json()["error"]["message"].is_string());

    // After all those refusals the server still answers.
    let v = post(
        p,
        "/v1/messages",
        &msg_body(
            json!([{ "role": "user", "content": "Capital of France?" }]),
            json!({ "max_tokens": 3 }),
        ),
    );
    assert_eq!(v.status, 200, "{}", v.body);
}

#[test]
fn x_api_key_is_checked_and_refusals_have_anthropic_shape() {
    let srv = Server::start(&["--no-kv-disk", "--api-key", "s3cret"]);
    let p = srv.port;
    let body = msg_body(france(), json!({ "max_tokens": 1 })).to_string();
    let body = body.as_bytes();
    request(p, "POST", "/v1/messages", body, &[]).assert_error(
        401,
        "authentication_error",
        "API key",
    );
    request(p, "POST", "/v1/messages", body, &[("x-api-key", "wrong")]).assert_error(
        401,
        "authentication_error",
        "API key",
    );
    request(p, "POST", "/v1/messages/count_tokens", body, &[]).assert_error(
        401,
        "authentication_error",
        "API key",
    );
    let r = request(
        p,
        "POST",
        "/v1/messages",
        body,
        &[("x-api-key", "s3cret"), ("anthropic-version", "2023-06-01")],
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["type"], "message");
    let r = request(
        p,
        "POST",
        "/v1/messages/count_tokens",
        body,
        &[("x-api-key", "s3cret")],
    );
    assert_eq!(r.status, 200, "{}", r.body);
    // The OpenAI routes keep their own error shape.
    let r = request(p, "POST", "/v1/chat/completions", body, &[]);
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["type"], "authentication_error");
    assert!(r.json().get("type").is_none());
}

#[test]
fn a_cache_control_breakpoint_is_checkpointed_and_reused_after_a_restart() {
    let dir = temp_dir("kv-hint");
    let kv = dir.join("kv");
    let args = kv_flags(&kv);
    let system = json!([{ "type": "text", "cache_control": { "type": "ephemeral" },
        "text": "You are the keeper's logbook. Answer in one short sentence. ".repeat(6) }]);
    let ask = |q: &str| {
        msg_body(
            json!([{ "role": "user", "content": q }]),
            json!({ "system": system }),
        )
    };
    let srv = Server::start(&args);
    let v = post(
        srv.port,
        "/v1/messages",
        &ask("What is the capital of France?"),
    )
    .json();
    assert!(n(&v["usage"]["cache_creation_input_tokens"]) > 0, "{v}");
    let log = srv.stop();
    assert!(log.contains("reason=client-hint"), "{log}");

    // Another question after a restart: the system prompt comes back from its
    // breakpoint checkpoint.
    let srv = Server::start(&args);
    let r = post(srv.port, "/v1/messages", &ask("Which year is it?"));
    let cache = r.header("x-ds4-cache").unwrap();
    assert!(cache.starts_with("disk-text"), "{cache}");
    assert!(
        n(&r.json()["usage"]["cache_read_input_tokens"]) >= 16,
        "{cache}"
    );
}
