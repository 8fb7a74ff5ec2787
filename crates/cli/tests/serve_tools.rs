//! Tool calling over real loopback HTTP: a forced call comes back as a tool call
//! with an unguessable id, and resending it — re-serialised with its keys in
//! another order, as clients do — keeps the live prefix only with exact replay.

mod common;

use common::*;
use serde_json::{json, Map, Value};

/// Two required keys: the grammar writes them in schema order with `json.dumps`
/// spacing (the canonical form), so only a client that reorders them makes the
/// canonical re-render differ from what was sampled.
fn tools() -> Value {
    json!([{ "type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather for a city",
        "parameters": { "type": "object", "properties": {
            "city": { "type": "string" }, "unit": { "type": "string", "enum": ["c", "f"] } },
            "required": ["city", "unit"] },
    }}])
}

fn user() -> Value {
    json!({ "role": "user", "content": "What is the weather in Paris?" })
}

/// A JSON object text with its keys in reverse order and spaced out.
fn reordered(args: &str) -> String {
    let v: Map<String, Value> = serde_json::from_str(args).unwrap();
    let rev: Map<String, Value> = v.into_iter().rev().collect();
    serde_json::to_string_pretty(&rev).unwrap()
}

/// Turn 1: a forced call. Returns the call and turn 1's prompt + completion tokens.
fn forced_call(port: u16) -> (Value, u64) {
    let r = post(
        port,
        "/v1/chat/completions",
        &json!({ "messages": [user()], "tools": tools(), "temperature": 0, "max_tokens": 48,
                 "tool_choice": { "type": "function", "function": { "name": "get_weather" } } }),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let call = &choice["message"]["tool_calls"][0];
    let id = call["id"].as_str().unwrap();
    assert!(id.starts_with("call_") && id.len() == 37, "{id}");
    assert_eq!(call["function"]["name"], "get_weather");
    let args = call["function"]["arguments"].as_str().unwrap();
    assert!(
        serde_json::from_str::<Map<String, Value>>(args).is_ok(),
        "{args}"
    );
    (call.clone(), v["usage"]["total_tokens"].as_u64().unwrap())
}

/// Turn 2: the call sent back re-serialised with its keys reordered, and a result.
fn resend(port: u16, call: &Value) -> Reply {
    let id = call["id"].as_str().unwrap();
    let args = call["function"]["arguments"].as_str().unwrap();
    let mut echoed = call.clone();
    echoed["function"]["arguments"] = json!(reordered(args));
    let r = post(
        port,
        "/v1/chat/completions",
        &json!({ "messages": [user(),
                   { "role": "assistant", "content": null, "tool_calls": [echoed] },
                   { "role": "tool", "tool_call_id": id, "content": "18 C and sunny" }],
                 "tools": tools(), "temperature": 0, "max_tokens": 4 }),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    r
}

/// Both turns on one server.
fn two_turns(port: u16) -> (u64, Reply) {
    let (call, turn1) = forced_call(port);
    (turn1, resend(port, &call))
}

#[test]
fn a_resent_tool_call_keeps_the_live_prefix_only_with_exact_replay() {
    let srv = Server::start(&["--no-kv-disk"]);
    let (turn1, r) = two_turns(srv.port);
    let cache = r.header("x-ds4-cache").unwrap();
    let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cache.starts_with("memory-"), "{cache}");
    assert!(!cache.contains("diverge_byte"), "{cache}");
    assert!(
        cached >= turn1,
        "reused {cached} of the {turn1} live tokens"
    );
    srv.stop();

    let srv = Server::start(&["--no-kv-disk", "--disable-exact-tool-replay"]);
    let (turn1, r) = two_turns(srv.port);
    let cache = r.header("x-ds4-cache").unwrap();
    let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached < turn1, "reused {cached} of {turn1}: {cache}");
    // The miss is explained: where the canonical re-render left the live text.
    assert!(cache.contains("candidate=memory"), "{cache}");
    assert!(cache.contains("diverge_byte="), "{cache}");
    assert!(cache.contains(&format!("offered={turn1}")), "{cache}");
}

/// `n` choices of a forced call: each its own call with its own id (greedy:
/// the same arguments), and resending the second one's call continues that
/// choice's live state, exactly replayed.
#[test]
fn each_choice_carries_its_own_call_and_a_resent_one_continues_its_state() {
    let srv = Server::start(&["--no-kv-disk"]);
    let r = post(
        srv.port,
        "/v1/chat/completions",
        &json!({ "messages": [user()], "tools": tools(), "temperature": 0, "max_tokens": 48, "n": 2,
                 "tool_choice": { "type": "function", "function": { "name": "get_weather" } } }),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let calls: Vec<&Value> = (0..2)
        .map(|k| {
            let choice = &v["choices"][k];
            assert_eq!(choice["index"], k);
            assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
            &choice["message"]["tool_calls"][0]
        })
        .collect();
    assert_ne!(calls[0]["id"], calls[1]["id"]);
    assert_eq!(calls[0]["function"], calls[1]["function"]);
    let turn1 = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let r = resend(srv.port, calls[1]);
    let cache = r.header("x-ds4-cache").unwrap();
    assert!(cache.starts_with("memory-"), "{cache}");
    let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > turn1, "reused {cached}: {cache}");
}

#[test]
fn anthropic_and_responses_stream_forced_calls_as_their_own_events() {
    let srv = Server::start(&["--no-kv-disk"]);
    let p = srv.port;
    let r = post(
        p,
        "/v1/messages",
        &json!({ "model": "m", "max_tokens": 48, "temperature": 0, "stream": true,
                 "messages": [user()],
                 "tools": [{ "name": "get_weather", "description": "Get the current weather for a city",
                             "input_schema": tools()[0]["function"]["parameters"] }],
                 "tool_choice": { "type": "tool", "name": "get_weather" } }),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let events = sse_events(&r.body);
    let start = events
        .iter()
        .find(|(n, v)| n == "content_block_start" && v["content_block"]["type"] == "tool_use")
        .unwrap_or_else(|| panic!("no tool_use block: {}", r.body));
    let block = &start.1["content_block"];
    assert!(block["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(block["name"], "get_weather");
    let json_delta = events
        .iter()
        .find(|(_, v)| v["delta"]["type"] == "input_json_delta")
        .unwrap();
    let input: Value =
        serde_json::from_str(json_delta.1["delta"]["partial_json"].as_str().unwrap()).unwrap();
    assert!(input.is_object());
    let end = events.iter().find(|(n, _)| n == "message_delta").unwrap();
    assert_eq!(end.1["delta"]["stop_reason"], "tool_use");

    let r = post(
        p,
        "/v1/responses",
        &json!({ "input": "What is the weather in Paris?", "temperature": 0, "max_output_tokens": 48,
                 "tools": [{ "type": "function", "name": "get_weather",
                             "parameters": tools()[0]["function"]["parameters"] }],
                 "tool_choice": { "type": "function", "name": "get_weather" } }),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let call = v["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "function_call")
        .unwrap_or_else(|| panic!("no function_call item: {v}"));
    assert_eq!(call["name"], "get_weather");
    assert!(call["call_id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(v["status"], "completed");
}

#[test]
fn exact_tool_text_survives_a_restart_with_the_checkpoint() {
    let dir = temp_dir("tools-kv");
    let kv = dir.join("kv");
    let args = kv_flags(&kv);
    let srv = Server::start(&args);
    let (call, turn1) = forced_call(srv.port);
    // The shutdown checkpoint holds the tool-call turn and its id map.
    srv.stop();
    let srv = Server::start(&args);
    let r = resend(srv.port, &call);
    let cache = r.header("x-ds4-cache").unwrap();
    let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cache.starts_with("disk-text"), "{cache}");
    assert!(
        cached >= turn1,
        "reused {cached} of the {turn1} checkpointed tokens: {cache}"
    );
}

#[test]
fn an_unclosed_call_degrades_to_text_with_a_trace_event() {
    let dir = temp_dir("tools-trace");
    let trace = dir.join("trace.jsonl");
    let srv = Server::start(&["--no-kv-disk", "--trace", trace.to_str().unwrap()]);
    // The forced opening leaves the model 6 tokens: the call cannot close.
    let r = post(
        srv.port,
        "/v1/chat/completions",
        &json!({ "messages": [user()], "tools": tools(), "temperature": 0, "max_tokens": 6,
                 "tool_choice": "required" }),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "length", "{v}");
    assert!(choice["message"]["tool_calls"].is_null(), "{v}");
    let text = choice["message"]["content"].as_str().unwrap();
    assert!(text.starts_with("<tool_call>"), "{text}");
    srv.stop();
    let events = std::fs::read_to_string(&trace).unwrap();
    assert!(
        events
            .lines()
            .any(|l| l.contains(r#""event":"tool_call_malformed""#)),
        "{events}"
    );
}

/// What a grammar forces (a call's keys and punctuation, a schema's fixed
/// text) is drafted and kept: forced calls and structured output are the
/// same with and without drafts, and with them most of the output comes in
/// kept draft tokens.
#[test]
fn forced_text_is_drafted_and_answers_are_unchanged() {
    let schema = json!({"type": "json_schema", "json_schema": {"name": "place", "schema": {
        "type": "object", "additionalProperties": false,
        "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "country", "unit"]}}});
    let bodies = [
        json!({ "messages": [user()], "tools": tools(), "temperature": 0, "max_tokens": 48,
                "tool_choice": { "type": "function", "function": { "name": "get_weather" } } }),
        json!({ "messages": [user()], "temperature": 0, "max_tokens": 48, "response_format": schema }),
    ];
    let dir = temp_dir("tools-drafts");
    let trace = dir.join("trace.jsonl");
    let answers = |args: &[&str]| -> Vec<Value> {
        let srv = Server::start(args);
        let out = bodies
            .iter()
            .map(|b| {
                let r = post(srv.port, "/v1/chat/completions", b);
                assert_eq!(r.status, 200, "{}", r.body);
                let mut m = r.json()["choices"][0]["message"].clone();
                // Call ids are fresh per answer.
                if let Some(calls) = m["tool_calls"].as_array_mut() {
                    calls.iter_mut().for_each(|c| c["id"] = Value::Null);
                }
                m
            })
            .collect();
        srv.stop();
        out
    };
    let plain = answers(&["--no-kv-disk", "--draft-max", "0"]);
    let drafted = answers(&["--no-kv-disk", "--trace", trace.to_str().unwrap()]);
    assert_eq!(plain, drafted);
    assert_eq!(
        drafted[0]["tool_calls"][0]["function"]["name"],
        "get_weather"
    );
    let content: Value = serde_json::from_str(drafted[1]["content"].as_str().unwrap()).unwrap();
    assert!(content["unit"].is_string(), "{content}");
    let lines = std::fs::read_to_string(&trace).unwrap();
    for r in lines
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
    {
        if r["event"] != "request" {
            continue;
        }
        let (kept, generated) = (
            r["accepted_draft_tokens"].as_u64().unwrap(),
            r["generated_tokens"].as_u64().unwrap(),
        );
        assert!(
            kept * 3 >= generated,
            "{kept} of {generated} tokens came in drafts: {r}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
