//! `ds4 serve` over real loopback HTTP: OpenAI chat and completions, streaming,
//! prefix reuse and its usage numbers, errors, API key, client disconnects, and a
//! restart that resumes from the disk checkpoint.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

fn chat_body(messages: Value, extra: Value) -> Value {
    merged(
        json!({ "messages": messages, "temperature": 0, "max_tokens": 24 }),
        extra,
    )
}

/// `base` with `extra`'s fields set.
fn merged(mut base: Value, extra: Value) -> Value {
    for (k, v) in extra.as_object().unwrap() {
        base[k] = v.clone();
    }
    base
}

/// The JSON events of an SSE body.
fn sse_json(body: &str) -> Vec<Value> {
    sse_data(body)
        .iter()
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect()
}

/// A legacy completion's `logprobs` token texts, each checked against its
/// `text_offset` (characters from the start of the text).
fn offset_tokens(lp: &Value) -> Vec<&str> {
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let mut offset = 0;
    for (i, t) in tokens.iter().enumerate() {
        assert_eq!(lp["text_offset"][i], offset, "token {i}");
        offset += t.chars().count();
    }
    tokens
}

/// The `token_logprobs` of a streamed legacy completion's chunks, in order.
fn streamed_token_logprobs(chunks: &[Value]) -> Vec<Value> {
    chunks
        .iter()
        .map(|c| &c["choices"][0]["logprobs"])
        .filter(|l| !l.is_null())
        .flat_map(|l| l["token_logprobs"].as_array().unwrap().clone())
        .collect()
}

/// The records of a `--trace` file.
fn trace_lines(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn chat_completions_stream_and_reuse() {
    let srv = Server::start(&["--no-kv-disk"]);
    let q = json!([{ "role": "user", "content": "What is the capital of France?" }]);
    let r = post(
        srv.port,
        "/v1/chat/completions",
        &chat_body(q.clone(), json!({})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let answer = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(answer.contains("Paris"), "{answer}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(r
        .header("x-ds4-cache")
        .unwrap()
        .starts_with("none; reused=0"));

    // The same request again reuses the whole prompt from the live session.
    let r = post(
        srv.port,
        "/v1/chat/completions",
        &chat_body(q.clone(), json!({"model": "anything"})),
    );
    let v = r.json();
    assert_eq!(v["model"], "anything");
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"],
        prompt_tokens
    );
    assert_eq!(v["choices"][0]["message"]["content"], answer.as_str());
    assert!(r.header("x-ds4-cache").unwrap().starts_with("memory-token"));

    // Streaming gives the same text, chunk by chunk, with usage at the end.
    let r = post(
        srv.port,
        "/v1/chat/completions",
        &chat_body(
            q.clone(),
            json!({"stream": true, "stream_options": {"include_usage": true}}),
        ),
    );
    assert_eq!(r.status, 200);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let data = sse_data(&r.body);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, answer);
    let fin = &chunks[chunks.len() - 2];
    assert_eq!(fin["choices"][0]["finish_reason"], "stop");
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(
        usage["usage"]["prompt_tokens_details"]["cached_tokens"],
        prompt_tokens
    );

    // The next turn extends the conversation: everything before it is reused.
    let turn2 = json!([
        { "role": "user", "content": "What is the capital of France?" },
        { "role": "assistant", "content": answer },
        { "role": "user", "content": "And of Italy?" }
    ]);
    let v = post(
        srv.port,
        "/v1/chat/completions",
        &chat_body(turn2, json!({})),
    )
    .json();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached > prompt_tokens,
        "cached {cached} of {}",
        v["usage"]["prompt_tokens"]
    );

    // Legacy completions with a raw prompt.
    let v = post(
        srv.port,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
    )
    .json();
    assert_eq!(v["object"], "text_completion");
    assert!(
        v["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with(" Paris"),
        "{v}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    // Stop sequences end the text before the stop string.
    let v2 = post(srv.port, "/v1/completions", &json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stop": "."})).json();
    assert_eq!(v2["choices"][0]["text"], " Paris");
    // Response ids are random, not a counter: `cmpl-` and 32 hex digits.
    let (a, b) = (v["id"].as_str().unwrap(), v2["id"].as_str().unwrap());
    for id in [a, b] {
        let hex = id.strip_prefix("cmpl-").unwrap_or_default();
        assert!(
            hex.len() == 32 && hex.chars().all(|c| c.is_ascii_hexdigit()),
            "{id}"
        );
    }
    assert_ne!(a, b);
    assert_eq!(v2["choices"][0]["finish_reason"], "stop");

    let models = request(srv.port, "GET", "/v1/models", b"", &[]).json();
    assert_eq!(models["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(
        request(srv.port, "GET", "/health", b"", &[]).json()["status"],
        "ok"
    );
}

#[test]
fn bad_requests_get_precise_errors_and_the_server_keeps_serving() {
    let srv = Server::start(&["--no-kv-disk", "--ctx", "64", "--max-body-bytes", "4096"]);
    let p = srv.port;
    let cases: Vec<(Reply, u16, &str)> = vec![
        (
            request(p, "POST", "/v1/chat/completions", b"{not json", &[]),
            400,
            "invalid JSON request",
        ),
        (
            post(p, "/v1/chat/completions", &json!({"messages": "hi"})),
            400,
            "invalid type",
        ),
        (
            post(p, "/v1/chat/completions", &json!({})),
            400,
            "missing `messages`",
        ),
        (
            post(
                p,
                "/v1/chat/completions",
                &json!({"messages": [{"role": "wizard", "content": "x"}]}),
            ),
            400,
            "unknown role",
        ),
        (
            post(
                p,
                "/v1/chat/completions",
                &json!({"messages": [{"content": "x"}], "n": 17}),
            ),
            400,
            "n must be from 1 to 16",
        ),
        (
            post(
                p,
                "/v1/chat/completions",
                &json!({"messages": [{"content": "x"}], "max_tokens": -1}),
            ),
            400,
            "invalid value",
        ),
        (
            post(
                p,
                "/v1/completions",
                &json!({"prompt": "word ".repeat(200)}),
            ),
            400,
            "maximum context length is 64",
        ),
        (
            request(p, "POST", "/v1/completions", &vec![b' '; 5000], &[]),
            413,
            "--max-body-bytes",
        ),
        (
            request(p, "GET", "/v1/nothing", b"", &[]),
            404,
            "unknown endpoint",
        ),
        (
            request(p, "GET", "/v1/chat/completions", b"", &[]),
            405,
            "not allowed",
        ),
        (
            post(
                p,
                "/v1/chat/completions",
                &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 500}),
            ),
            400,
            "in the messages, 500 in the completion)",
        ),
        (request(p, "HEAD", "/", b"", &[]), 200, ""),
    ];
    for (i, (r, status, msg)) in cases.iter().enumerate() {
        assert_eq!(r.status, *status, "case {i}: {}", r.body);
        if *status == 200 {
            continue;
        }
        let v = r.json();
        let m = v["error"]["message"].as_str().unwrap_or_default();
        assert!(m.contains(msg), "case {i}: {m:?} lacks {msg:?}");
    }
    for at in [6, 10] {
        assert_eq!(
            cases[at].0.json()["error"]["code"],
            "context_length_exceeded",
            "case {at}"
        );
    }
    let v = post(
        p,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}),
    )
    .json();
    assert!(
        v["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with(" Paris"),
        "{v}"
    );
}

/// `logit_bias` (OpenAI's object and llama.cpp's pairs) on a greedy
/// completion: banning the first token changes the answer's first token, +100
/// on a token makes every step that token, and an id outside the vocabulary
/// is refused by name while the server goes on serving.
#[test]
fn logit_bias_bans_and_forces_tokens() {
    let srv = Server::start(&["--no-kv-disk"]);
    let complete = |extra: Value| {
        let b = merged(
            json!({ "prompt": "The capital of France is", "temperature": 0, "max_tokens": 6 }),
            extra,
        );
        let r = post(srv.port, "/v1/completions", &b);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let first_token = |text: &str| {
        let r = post(srv.port, "/tokenize", &json!({ "content": text }));
        r.json()["tokens"][0].as_u64().unwrap()
    };
    let plain = complete(json!({}));
    let t0 = first_token(&plain);
    for ban in [
        json!({ "logit_bias": { t0.to_string(): -100 } }),
        json!({ "logit_bias": [[t0, false]] }),
    ] {
        let banned = complete(ban.clone());
        assert_ne!(first_token(&banned), t0, "{ban}: {plain:?} -> {banned:?}");
    }
    // A token the answer would not start with, forced at every step.
    let forced = [" Berlin", " Rome"]
        .map(first_token)
        .into_iter()
        .find(|&t| t != t0)
        .unwrap();
    let piece = post(srv.port, "/detokenize", &json!({ "tokens": [forced] })).json()["content"]
        .as_str()
        .unwrap()
        .to_string();
    let text = complete(json!({ "logit_bias": { forced.to_string(): 100 }, "max_tokens": 3 }));
    assert_eq!(text, piece.repeat(3));
    let chat = |extra: Value| {
        let hi = json!([{ "role": "user", "content": "Hi" }]);
        post(srv.port, "/v1/chat/completions", &chat_body(hi, extra))
    };
    // Streaming takes the same path.
    let r =
        chat(json!({ "logit_bias": { forced.to_string(): 100 }, "max_tokens": 2, "stream": true }));
    assert_eq!(r.status, 200, "{}", r.body);
    let streamed: String = sse_json(&r.body)
        .into_iter()
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(streamed, piece.repeat(2));
    // Under a grammar the bias cannot lift the mask: a JSON object still
    // opens with its brace.
    let r = chat(
        json!({ "logit_bias": { forced.to_string(): 100 }, "max_tokens": 4,
                         "response_format": { "type": "json_object" } }),
    );
    let content = r.json()["choices"][0]["message"]["content"].clone();
    assert!(content.as_str().unwrap().starts_with('{'), "{content}");
    let r = chat(json!({ "logit_bias": { "49152": 1 } }));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("logit_bias: token 49152 is outside the vocabulary (49152 tokens)"),
        "{}",
        r.body
    );
    assert_eq!(complete(json!({})), plain);
}

/// Log-probabilities on the OpenAI endpoints: one entry per token of the
/// text, alternatives best first with greedy's choice the best, the raw
/// model's numbers (a bias does not move them), streamed as given whole, a
/// stop sequence's tokens left out (and a token it cuts kept), and the
/// refusals.
#[test]
fn logprobs_cover_the_tokens_of_the_answer() {
    let srv = Server::start(&["--no-kv-disk"]);
    let complete = |extra: Value| {
        let b = merged(
            json!({ "prompt": "The capital of France is", "temperature": 0,
                            "max_tokens": 8, "logprobs": 3 }),
            extra,
        );
        post(srv.port, "/v1/completions", &b)
    };
    let r = complete(json!({}));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let (text, lp) = (
        v["choices"][0]["text"].as_str().unwrap(),
        &v["choices"][0]["logprobs"],
    );
    let tokens = offset_tokens(lp);
    assert_eq!(tokens.concat(), text);
    assert_eq!(
        tokens.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for (i, t) in tokens.iter().enumerate() {
        let chosen = lp["token_logprobs"][i].as_f64().unwrap();
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!(top.len() <= 3 && top.contains_key(*t), "{i}: {top:?}");
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!(chosen <= 0.0 && chosen == best, "{i}: {chosen} {top:?}");
    }
    // Streamed, the same entries.
    let r = complete(json!({ "stream": true }));
    let chunks = sse_json(&r.body);
    let streamed = streamed_token_logprobs(&chunks);
    assert_eq!(streamed, *lp["token_logprobs"].as_array().unwrap());
    // A stop sequence at the second token: only the first is kept.
    let v = complete(json!({ "stop": [tokens[1]] })).json();
    assert_eq!(v["choices"][0]["text"], tokens[0], "{v}");
    assert_eq!(v["choices"][0]["logprobs"]["tokens"], json!([tokens[0]]));
    // One that starts inside the first token: the text cut there, the token
    // kept.
    assert!(tokens[0].chars().count() >= 3, "{tokens:?}");
    let tail: String = tokens[0].chars().skip(2).collect();
    let v = complete(json!({ "stop": [tail] })).json();
    let head: String = tokens[0].chars().take(2).collect();
    assert_eq!(v["choices"][0]["text"], head, "{v}");
    assert_eq!(v["choices"][0]["logprobs"]["tokens"], json!([tokens[0]]));
    // The model's own numbers: forced by a bias, a token keeps its low logprob.
    let r = complete(json!({ "max_tokens": 1, "logit_bias": { "28": 100 } }));
    let forced = r.json()["choices"][0]["logprobs"]["token_logprobs"][0]
        .as_f64()
        .unwrap();
    assert!(forced < -1.0, "{forced}");
    // Chat: the content's tokens with their bytes and alternatives.
    let chat = |extra: Value| {
        let q = json!([{ "role": "user", "content": "What is the capital of France?" }]);
        post(srv.port, "/v1/chat/completions", &chat_body(q, extra))
    };
    let v = chat(json!({ "logprobs": true, "top_logprobs": 2 })).json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let mut joined = Vec::new();
    for e in content {
        let bytes: Vec<u8> = e["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(e["token"], String::from_utf8_lossy(&bytes).as_ref());
        joined.extend(bytes);
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert_eq!(top[0]["logprob"], e["logprob"]);
        assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
    }
    assert_eq!(
        String::from_utf8(joined).unwrap(),
        v["choices"][0]["message"]["content"]
    );
    assert!(chat(json!({})).json()["choices"][0]["logprobs"].is_null());
    // The Responses API renders the same prompt: the same tokens, whole and
    // streamed.
    let responses = |extra: Value| {
        let b = merged(
            json!({ "input": "What is the capital of France?", "temperature": 0,
                            "max_output_tokens": 24, "top_logprobs": 2,
                            "include": ["message.output_text.logprobs"] }),
            extra,
        );
        post(srv.port, "/v1/responses", &b)
    };
    let r = responses(json!({})).json();
    assert_eq!(
        r["output"][0]["content"][0]["logprobs"],
        json!(content),
        "{r}"
    );
    assert_eq!(r["top_logprobs"], 2);
    let r = responses(json!({ "stream": true }));
    let events = sse_json(&r.body);
    let deltas: Vec<Value> = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .flat_map(|e| e["logprobs"].as_array().unwrap().clone())
        .collect();
    assert_eq!(json!(deltas), json!(content));
    let done = events
        .iter()
        .find(|e| e["type"] == "response.output_text.done")
        .unwrap();
    assert_eq!(done["logprobs"], json!(content));
    for (extra, why) in [
        (json!({ "top_logprobs": 2 }), "top_logprobs needs logprobs"),
        (
            json!({ "logprobs": true, "top_logprobs": 21 }),
            "top_logprobs must be an integer from 0 to 20",
        ),
        (json!({ "logprobs": 1 }), "logprobs must be true or false"),
        (
            json!({ "logprobs": true, "tools": [{ "type": "function", "function": { "name": "f" } }] }),
            "not with tools or thinking",
        ),
    ] {
        let r = chat(extra.clone());
        assert_eq!(r.status, 400, "{extra}: {}", r.body);
        assert!(r.body.contains(why), "{extra}: {}", r.body);
    }
    let r = complete(json!({ "logprobs": true }));
    assert_eq!(r.status, 400, "{}", r.body);
}

/// Legacy completions' `echo`, and the prompt given as token ids, as
/// evaluation harnesses (lm-eval's `local-completions`) send them: the text
/// starts with the prompt; with `logprobs`, each prompt token after the first
/// is scored (the first `null`), and an answer's tokens scored as a prompt
/// get the numbers they had when generated, bit for bit, greedy's the best of
/// their alternatives; `max_tokens: 0` scores without generating; streamed
/// alike; ids run as the text they decode to; the refusals.
#[test]
fn an_echoed_prompt_is_scored_as_its_answer_was() {
    let srv = Server::start(&["--no-kv-disk"]);
    let prompt = "The capital of France is";
    let complete = |body: Value| {
        let r = post(
            srv.port,
            "/v1/completions",
            &merged(json!({ "temperature": 0 }), body),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let v = complete(json!({ "prompt": prompt, "max_tokens": 6, "logprobs": 1 }));
    let answer = v["choices"][0]["text"].as_str().unwrap().to_string();
    let generated = &v["choices"][0]["logprobs"];
    // Echo alone: the prompt, then the same answer, no log-probabilities.
    let v = complete(json!({ "prompt": prompt, "max_tokens": 6, "echo": true }));
    assert_eq!(v["choices"][0]["text"], format!("{prompt}{answer}"));
    assert!(v["choices"][0]["logprobs"].is_null());
    // The prompt and its answer scored, nothing generated.
    let whole = format!("{prompt}{answer}");
    let v = complete(json!({ "prompt": whole, "max_tokens": 0, "echo": true, "logprobs": 1 }));
    let c = &v["choices"][0];
    assert_eq!(c["text"], whole);
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 0);
    let lp = &c["logprobs"];
    let tokens = offset_tokens(lp);
    assert_eq!(tokens.concat(), whole);
    assert_eq!(
        tokens.len() as u64,
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    assert!(
        lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null(),
        "{lp}"
    );
    let n = generated["tokens"].as_array().unwrap().len();
    let tail = |key: &str| lp[key].as_array().unwrap()[tokens.len() - n..].to_vec();
    assert_eq!(
        tail("tokens"),
        *generated["tokens"].as_array().unwrap(),
        "the answer retokenized differently"
    );
    assert_eq!(
        tail("token_logprobs"),
        *generated["token_logprobs"].as_array().unwrap()
    );
    assert_eq!(
        tail("top_logprobs"),
        *generated["top_logprobs"].as_array().unwrap()
    );
    for i in 1..tokens.len() {
        let chosen = lp["token_logprobs"][i].as_f64().unwrap();
        let best = lp["top_logprobs"][i]
            .as_object()
            .unwrap()
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!(chosen <= best, "{i}: {chosen} {best}");
    }
    // Streamed: the echo leads the first chunk, the same entries follow.
    let r = post(
        srv.port,
        "/v1/completions",
        &json!({ "prompt": whole, "max_tokens": 2,
        "echo": true, "logprobs": 1, "temperature": 0, "stream": true }),
    );
    let chunks = sse_json(&r.body);
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert!(
        chunks[0]["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with(&whole),
        "{:?}",
        chunks[0]
    );
    assert!(
        text.starts_with(&whole) && text.len() > whole.len(),
        "{text}"
    );
    let streamed = streamed_token_logprobs(&chunks);
    assert_eq!(
        streamed[..tokens.len()],
        *lp["token_logprobs"].as_array().unwrap()
    );
    assert_eq!(streamed.len(), tokens.len() + 2);
    // Token ids, bare or as a batch of one, answer as their text does.
    let ids = post(srv.port, "/tokenize", &json!({ "content": prompt })).json()["tokens"].clone();
    for p in [ids.clone(), json!([ids.clone()])] {
        let v = complete(json!({ "prompt": p, "max_tokens": 6, "logprobs": 1 }));
        assert_eq!(v["choices"][0]["text"], answer.as_str());
        assert_eq!(
            v["choices"][0]["logprobs"]["token_logprobs"],
            generated["token_logprobs"]
        );
    }
    let v = complete(json!({ "prompt": ids, "max_tokens": 0, "echo": true }));
    assert_eq!(v["choices"][0]["text"], prompt);
    for (bad, param) in [
        (json!({ "prompt": [1, 4_000_000] }), "prompt"),
        (json!({ "prompt": [[1], [2, 4_000_000]] }), "prompt"),
        (json!({ "prompt": [1, -2] }), "prompt"),
        (json!({ "prompt": [] }), "prompt"),
        (json!({ "prompt": "x", "echo": "yes" }), ""),
    ] {
        let r = post(srv.port, "/v1/completions", &bad);
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
        let e = &r.json()["error"];
        assert!(
            param.is_empty()
                || e["param"] == param
                || e["message"].as_str().unwrap().contains(param),
            "{bad}: {e}"
        );
    }
}

/// OpenAI `n` and a legacy completion's batch of prompts: each choice is its
/// own job, in order by `index`, and is what its prompt gives alone (choice
/// `j` with the request's seed plus `j`); a batch larger than the queue waits
/// for its own jobs; usage counts each prompt once and every completion;
/// streamed, each chunk carries its choice's index and one usage chunk and
/// one `[DONE]` end them; a batch scored with `echo` (lm-eval's batches)
/// gives each prompt's numbers alone.
#[test]
fn several_choices_come_from_their_own_jobs() {
    let srv = Server::start(&["--no-kv-disk", "--batched-session", "2", "--queue-max", "1"]);
    let post_ok = |path: &str, body: Value| {
        let r = post(srv.port, path, &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let prompts = [
        "The capital of France is",
        "Once upon a time",
        "1, 2, 3,",
        "The sky is",
        "Water boils at",
    ];
    let complete = |prompt: Value, extra: Value| {
        let base = json!({ "prompt": prompt, "max_tokens": 5, "temperature": 0 });
        post_ok("/v1/completions", merged(base, extra))
    };
    let alone: Vec<Value> = prompts
        .iter()
        .map(|p| complete(json!(p), json!({})))
        .collect();
    let v = complete(json!(prompts), json!({}));
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), prompts.len());
    for (k, (c, a)) in choices.iter().zip(&alone).enumerate() {
        assert_eq!(c["index"], k);
        assert_eq!(c["text"], a["choices"][0]["text"], "prompt {k}");
    }
    let sum = |key: &str| {
        alone
            .iter()
            .map(|a| a["usage"][key].as_u64().unwrap())
            .sum::<u64>()
    };
    assert_eq!(v["usage"]["prompt_tokens"], sum("prompt_tokens"));
    assert_eq!(v["usage"]["completion_tokens"], sum("completion_tokens"));
    // `n` with a seed: choice j is the request alone with seed + j.
    let chat = |extra: Value| {
        let q = json!([{ "role": "user", "content": "Name an animal." }]);
        let base = chat_body(q, json!({ "temperature": 1.0, "max_tokens": 8 }));
        post_ok("/v1/chat/completions", merged(base, extra))
    };
    let v = chat(json!({ "n": 3, "seed": 11 }));
    let texts: Vec<&Value> = (0..3)
        .map(|j| &v["choices"][j]["message"]["content"])
        .collect();
    let mut completion = 0;
    for (j, text) in texts.iter().enumerate() {
        assert_eq!(v["choices"][j]["index"], j);
        let one = chat(json!({ "seed": 11 + j }));
        assert_eq!(
            *text, &one["choices"][0]["message"]["content"],
            "choice {j}"
        );
        assert_eq!(v["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"]);
        completion += one["usage"]["completion_tokens"].as_u64().unwrap();
    }
    assert_eq!(v["usage"]["completion_tokens"], completion);
    assert!(texts[0] != texts[1] || texts[1] != texts[2], "{texts:?}");
    // Streamed: the same texts by index, one usage chunk, one [DONE].
    let body = json!({ "prompt": &prompts[..2], "max_tokens": 5, "temperature": 0,
                       "stream": true, "stream_options": { "include_usage": true } });
    let r = post(srv.port, "/v1/completions", &body);
    let raw = sse_data(&r.body);
    assert_eq!(raw.iter().filter(|d| *d == "[DONE]").count(), 1);
    assert_eq!(raw.last().map(String::as_str), Some("[DONE]"));
    let chunks = sse_json(&r.body);
    for (k, a) in alone[..2].iter().enumerate() {
        let mine: Vec<&Value> = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == k)
            .collect();
        let text: String = mine
            .iter()
            .filter_map(|c| c["choices"][0]["text"].as_str())
            .collect();
        assert_eq!(
            text,
            a["choices"][0]["text"].as_str().unwrap(),
            "prompt {k}"
        );
        let finishes = mine
            .iter()
            .filter(|c| !c["choices"][0]["finish_reason"].is_null());
        assert_eq!(finishes.count(), 1, "prompt {k}");
    }
    let usage: Vec<&Value> = chunks.iter().filter(|c| c["usage"].is_object()).collect();
    assert_eq!(usage.len(), 1);
    assert_eq!(
        usage[0]["usage"]["completion_tokens"].as_u64().unwrap(),
        alone[..2]
            .iter()
            .map(|a| a["usage"]["completion_tokens"].as_u64().unwrap())
            .sum::<u64>()
    );
    // lm-eval's batch of scored prompts: each as it is scored alone.
    let scored = json!({ "max_tokens": 1, "echo": true, "logprobs": 1 });
    let both = complete(json!(&prompts[..2]), scored.clone());
    for k in 0..2 {
        let one = complete(json!(prompts[k]), scored.clone());
        assert_eq!(
            both["choices"][k]["logprobs"], one["choices"][0]["logprobs"],
            "prompt {k}"
        );
    }
    // Too many choices, or one prompt refused: the request is refused.
    for bad in [
        json!({ "prompt": "x", "n": 17 }),
        json!({ "prompt": vec!["x"; 65], "n": 2 }),
        json!({ "prompt": ["x", [1, 4_000_000]] }),
    ] {
        let r = post(srv.port, "/v1/completions", &bad);
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
    }
}

#[test]
fn api_key_is_required_when_set() {
    let srv = Server::start(&["--no-kv-disk", "--api-key", "s3cret", "--cors"]);
    let p = srv.port;
    let body = json!({"prompt": "Hi", "max_tokens": 1}).to_string();
    let r = request(p, "POST", "/v1/completions", body.as_bytes(), &[]);
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["type"], "authentication_error");
    assert_eq!(
        r.header("access-control-allow-origin").as_deref(),
        Some("*")
    );
    let r = request(
        p,
        "POST",
        "/v1/completions",
        body.as_bytes(),
        &[("Authorization", "Bearer wrong")],
    );
    assert_eq!(r.status, 401);
    let r = request(
        p,
        "POST",
        "/v1/completions",
        body.as_bytes(),
        &[("Authorization", "Bearer s3cret")],
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let r = request(
        p,
        "POST",
        "/v1/completions",
        body.as_bytes(),
        &[("x-api-key", "s3cret")],
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        request(p, "OPTIONS", "/v1/completions", b"", &[]).status,
        204
    );
}

#[test]
fn a_client_that_disconnects_mid_stream_cancels_and_leaves_the_session_usable() {
    let dir = temp_dir("cancel");
    let trace = dir.join("trace.jsonl");
    let srv = Server::start(&["--no-kv-disk", "--trace", trace.to_str().unwrap()]);
    let body =
        json!({"prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0, "stream": true})
            .to_string();
    let mut s = TcpStream::connect(("127.0.0.1", srv.port)).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut buf = [0u8; 512];
    let n = s.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    drop(s);
    // The generation stops at its next token; the next request is served normally.
    let t = std::time::Instant::now();
    let v = post(
        srv.port,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}),
    )
    .json();
    assert!(
        v["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with(" Paris"),
        "{v}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(60),
        "the abandoned generation was not cancelled"
    );
    let log = srv.log();
    let first = log.lines().find(|l| l.contains("request: cache=")).unwrap();
    let generated: usize = first
        .split("generated=")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(generated < 2000, "{first}");
    // Traced as cancelled (and why), not as the `length` it never reached.
    assert!(
        first.contains("finish=cancelled (the client went away)"),
        "{first}"
    );
    let traced = trace_lines(&trace)
        .into_iter()
        .find(|l| l["event"] == "request")
        .unwrap();
    assert_eq!(traced["finish_reason"], "cancelled", "{traced}");
    assert_eq!(traced["cancelled"], "the client went away");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn restart_resumes_from_the_disk_checkpoint_with_identical_output() {
    let dir = temp_dir("restart");
    let kv = dir.join("kv");
    let args = kv_flags(&kv);
    let turn1 = json!([{ "role": "user", "content": "What is the capital of France?" }]);
    let srv = Server::start(&args);
    let a = post(
        srv.port,
        "/v1/chat/completions",
        &chat_body(turn1, json!({})),
    )
    .json();
    let answer = a["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let turn2 = json!([
        { "role": "user", "content": "What is the capital of France?" },
        { "role": "assistant", "content": answer },
        { "role": "user", "content": "And of Italy?" }
    ]);
    let b1 = post(
        srv.port,
        "/v1/chat/completions",
        &chat_body(turn2.clone(), json!({})),
    )
    .json();
    // Turn 2's end is saved (the shutdown save then finds it on disk).
    let log = srv.stop();
    assert!(
        log.contains("reason=cold") && log.contains("reason=turn-end"),
        "{log}"
    );

    let trace = dir.join("trace.jsonl");
    let srv = Server::start(&[&args[..], &["--trace", trace.to_str().unwrap()]].concat());
    let r = post(
        srv.port,
        "/v1/chat/completions",
        &chat_body(turn2, json!({})),
    );
    let b2 = r.json();
    assert!(
        r.header("x-ds4-cache").unwrap().starts_with("disk-text"),
        "{:?}",
        r.header("x-ds4-cache")
    );
    assert!(
        b2["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert_eq!(
        b2["choices"][0]["message"], b1["choices"][0]["message"],
        "restart changed the output"
    );
    assert_eq!(b2["usage"]["prompt_tokens"], b1["usage"]["prompt_tokens"]);
    let lines = trace_lines(&trace);
    let cache = lines.iter().find(|l| l["event"] == "cache").unwrap();
    // The turn-end save holds turn 2 and its reply: cut back, it serves all
    // of turn 2 (more than the cold save of turn 1 does as a prefix).
    assert!(
        cache["cache_source"]
            .as_str()
            .unwrap()
            .starts_with("disk-text"),
        "{cache}"
    );
    assert!(cache["checkpoint_file"].as_str().unwrap().ends_with(".kv"));
    let req = lines.iter().find(|l| l["event"] == "request").unwrap();
    assert_eq!(req["route"], "/v1/chat/completions");
    assert_eq!(
        req["generated_text"],
        b2["choices"][0]["message"]["content"]
    );
    assert!(req["prompt"]["prompt"]
        .as_str()
        .unwrap()
        .contains("And of Italy?"));
    assert_eq!(
        req["reused_tokens"],
        b2["usage"]["prompt_tokens_details"]["cached_tokens"]
    );
    drop(srv);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A `kill -9` after a turn loses nothing of it: each turn end is saved in
/// the background, so after the restart the next turn is restored from disk
/// with only its new message prefilled, and answers as a cold server does.
#[test]
fn a_kill_9_after_a_turn_loses_nothing_of_it() {
    let dir = temp_dir("kill9");
    let kv = dir.join("kv");
    let args = [&["--batched-session", "1"][..], &kv_flags(&kv)[..]].concat();
    let ask = |port, messages: &Value| {
        let r = post(
            port,
            "/v1/chat/completions",
            &chat_body(messages.clone(), json!({})),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let cache = r.header("x-ds4-cache").unwrap_or_default();
        (r.json(), cache)
    };
    let answer = |b: &Value| {
        b["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let srv = Server::start(&args);
    let mut messages = json!([{ "role": "user", "content": "What is the capital of France?" }]);
    let (b1, _) = ask(srv.port, &messages);
    messages.as_array_mut().unwrap().extend([
        json!({ "role": "assistant", "content": answer(&b1) }),
        json!({ "role": "user", "content": "And of Italy?" }),
    ]);
    let (b2, _) = ask(srv.port, &messages);
    let held = b2["usage"]["prompt_tokens"].as_u64().unwrap()
        + b2["usage"]["completion_tokens"].as_u64().unwrap();
    // The second turn end is on disk a moment after the response.
    srv.wait_for_log("reason=turn-end", 2);
    srv.kill9();
    messages.as_array_mut().unwrap().extend([
        json!({ "role": "assistant", "content": answer(&b2) }),
        json!({ "role": "user", "content": "And of Spain?" }),
    ]);

    let srv = Server::start(&args);
    let (b3, cache) = ask(srv.port, &messages);
    assert!(cache.starts_with("disk-text;"), "{cache}");
    let cached = b3["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached + 1 >= held,
        "restored {cached} of the {held} tokens held after turn 2"
    );
    drop(srv);
    let cold = Server::start(&["--no-kv-disk", "--batched-session", "1"]);
    let (want, cache) = ask(cold.port, &messages);
    assert!(cache.starts_with("none"), "{cache}");
    assert_eq!(answer(&b3), answer(&want));
    drop(cold);
    std::fs::remove_dir_all(dir).unwrap();
}

/// After a graceful restart, a request sharing the saved prompt but not its
/// reply reuses the checkpoint cut back to the shared prefix: the header and
/// the trace say `disk-text-partial` with the tokens cut and the weighing, and
/// the answer is a cold server's.
#[test]
fn restart_reuses_a_diverging_checkpoint_cut_back_to_the_shared_prefix() {
    let dir = temp_dir("partial");
    let kv = dir.join("kv");
    // No cold save: the turn-end save of prompt + reply is the only checkpoint.
    let args = [
        &["--batched-session", "1", "--kv-cache-cold-max-tokens", "0"][..],
        &kv_flags(&kv)[..],
    ]
    .concat();
    let prompt = "The lighthouse stood on the rocks above the harbour, and every night \
                  its keeper climbed the stairs to light the lamp. "
        .repeat(12);
    let complete = |port, prompt: &str| {
        let r = post(
            port,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let cache = r.header("x-ds4-cache").unwrap_or_default();
        (r.json(), cache)
    };
    let srv = Server::start(&args);
    let (first, _) = complete(srv.port, &prompt);
    let reply = first["choices"][0]["text"].as_str().unwrap().to_string();
    let log = srv.stop();
    assert!(log.contains("reason=turn-end"), "{log}");
    let other = "\n\nQ: Who kept the lighthouse?\nA:";
    assert!(!reply.starts_with(&other[..2]), "{reply:?}");
    let request = format!("{prompt}{other}");

    let trace = dir.join("trace.jsonl");
    let srv = Server::start(&[&args[..], &["--trace", trace.to_str().unwrap()]].concat());
    let (b, cache) = complete(srv.port, &request);
    assert!(cache.starts_with("disk-text-partial;"), "{cache}");
    assert!(cache.contains("; cut="), "{cache}");
    let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached + 4 >= prompt_tokens && cached <= prompt_tokens,
        "{cache}"
    );
    drop(srv);
    let lines = trace_lines(&trace);
    let plan = lines.iter().find(|l| l["event"] == "cache").unwrap();
    assert_eq!(plan["cache_source"], "disk-text-partial");
    assert_eq!(plan["reused_tokens"], cached);
    assert!(plan["cut_tokens"].as_u64().unwrap() > 0, "{plan}");
    let used = &plan["disk_choice"][0];
    assert_eq!(used["verdict"], "used", "{plan}");
    assert_eq!(used["whole"], false, "{plan}");
    assert!(
        used["load_s"].as_f64().unwrap() < used["prefill_s"].as_f64().unwrap(),
        "{plan}"
    );
    let req = lines.iter().find(|l| l["event"] == "request").unwrap();
    assert_eq!(req["cut_tokens"], plan["cut_tokens"]);

    let cold = Server::start(&["--no-kv-disk", "--batched-session", "1"]);
    let (want, cache) = complete(cold.port, &request);
    assert!(cache.starts_with("none"), "{cache}");
    assert_eq!(b["choices"][0]["text"], want["choices"][0]["text"]);
    drop(cold);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn metrics_count_requests_tokens_and_cache_hits() {
    let srv = Server::start(&["--no-kv-disk"]);
    let body = json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0});
    post(srv.port, "/v1/completions", &body);
    post(srv.port, "/v1/completions", &body);
    request(srv.port, "GET", "/nope", b"", &[]);
    let r = request(srv.port, "GET", "/metrics", b"", &[]);
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/plain"));
    let has = |line: &str| r.body.lines().any(|l| l == line);
    for line in [
        "ds4_requests_total{route=\"/v1/completions\",status=\"200\"} 2",
        "ds4_requests_total{route=\"other\",status=\"404\"} 1",
        "ds4_prompt_tokens_total 10",
        "ds4_cached_tokens_total 5",
        "ds4_generated_tokens_total 6",
        "ds4_cache_hits_total{source=\"none\"} 1",
        "ds4_cache_hits_total{source=\"memory-token\"} 1",
    ] {
        assert!(has(line), "{line:?} missing:\n{}", r.body);
    }
    // The worker may still be finishing the last job's bookkeeping.
    assert!(
        has("ds4_queue_depth 0") || has("ds4_queue_depth 1"),
        "{}",
        r.body
    );
}

/// Speculative decoding over HTTP: a request that copies its prompt gets
/// the same answer, plain and streamed, with the same log-probabilities,
/// from a server drafting and one with `--draft-max 0`; the drafted and kept
/// tokens show in the trace and `/metrics`.
#[test]
fn drafts_leave_answers_unchanged_and_are_counted() {
    let story = include_str!("../../../bench/carrow_point.txt");
    let passage = &story[..story.len().min(1500)];
    let prompt = format!("{passage}\n\n{}", &passage[..200]);
    let body = json!({"prompt": prompt, "max_tokens": 48, "temperature": 0, "logprobs": 2});
    let dir = temp_dir("drafts");
    let trace = dir.join("trace.jsonl");
    let answers = |args: &[&str]| {
        let srv = Server::start(args);
        let plain = post(srv.port, "/v1/completions", &body);
        assert_eq!(plain.status, 200, "{}", plain.body);
        let streamed = post(
            srv.port,
            "/v1/completions",
            &merged(body.clone(), json!({"stream": true})),
        );
        let text: String = sse_json(&streamed.body)
            .iter()
            .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
            .collect();
        let metrics = request(srv.port, "GET", "/metrics", b"", &[]).body;
        let v = plain.json();
        (
            v["choices"][0]["text"].clone(),
            v["choices"][0]["logprobs"].clone(),
            text,
            metrics,
        )
    };
    let trace_arg = trace.to_str().unwrap();
    let (text0, lp0, streamed0, _) = answers(&["--no-kv-disk", "--draft-max", "0"]);
    let (text, lp, streamed, metrics) = answers(&["--no-kv-disk", "--trace", trace_arg]);
    assert_eq!(text, text0);
    assert_eq!(lp, lp0);
    assert_eq!(streamed, streamed0);
    assert_eq!(Some(streamed.as_str()), text.as_str());
    let counter = |name: &str| -> u64 {
        let line = metrics
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} missing"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let (drafted, kept) = (
        counter("ds4_draft_tokens_total "),
        counter("ds4_draft_accepted_tokens_total "),
    );
    assert!(kept > 0 && kept <= drafted, "{kept} of {drafted}");
    let requests: Vec<Value> = trace_lines(&trace)
        .into_iter()
        .filter(|r| r["event"] == "request")
        .collect();
    let traced: u64 = requests
        .iter()
        .map(|r| r["draft_tokens"].as_u64().unwrap())
        .sum();
    let traced_kept: u64 = requests
        .iter()
        .map(|r| r["accepted_draft_tokens"].as_u64().unwrap())
        .sum();
    assert_eq!((traced, traced_kept), (drafted, kept));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigterm_during_a_long_prefill_cancels_it_and_exits_promptly() {
    let srv = Server::start(&["--no-kv-disk", "--prefill-chunk", "64"]);
    let story = include_str!("../../../bench/carrow_point.txt");
    let port = srv.port;
    let client = std::thread::spawn(move || {
        post(
            port,
            "/v1/completions",
            &json!({"prompt": story, "max_tokens": 4, "temperature": 0}),
        )
    });
    // Let the prefill of ~1900 tokens get going, then stop the server.
    std::thread::sleep(Duration::from_secs(2));
    let t = std::time::Instant::now();
    let log = srv.stop();
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "exit took {:?}\n{log}",
        t.elapsed()
    );
    let r = client.join().unwrap();
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("cancelled"),
        "{}",
        r.body
    );
}

#[test]
fn a_failure_after_the_stream_started_is_the_dialects_error_event() {
    let srv = Server::start(&["--no-kv-disk", "--prefill-chunk", "64"]);
    let story = include_str!("../../../bench/carrow_point.txt");
    let port = srv.port;
    let body = json!({"model": "m", "max_tokens": 4, "stream": true,
                      "messages": [{"role": "user", "content": story}]});
    let client = std::thread::spawn(move || post(port, "/v1/messages", &body));
    // The headers and `message_start` go out before the prefill; stopping the
    // server mid-prefill fails the request after the stream has begun.
    std::thread::sleep(Duration::from_secs(2));
    srv.stop();
    let r = client.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("event: message_start"), "{}", r.body);
    let error = r
        .body
        .split("event: error\n")
        .nth(1)
        .expect("an error event")
        .lines()
        .next()
        .unwrap();
    let v: Value = serde_json::from_str(error.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(v["type"], "error");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("cancelled"),
        "{v}"
    );
}

/// Turn 1 of a conversation, an unrelated short request, then turn 2: returns
/// turn 1's total tokens and turn 2's reply.
fn conversation_around_a_side_request(port: u16) -> (u64, Reply) {
    let system = "You are a careful assistant for a lighthouse keeper. ".repeat(8);
    let q1 = json!([{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]);
    let r1 = post(
        port,
        "/v1/chat/completions",
        &json!({"messages": q1, "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(r1.status, 200, "{}", r1.body);
    let v1 = r1.json();
    let side = post(
        port,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "system", "content": "Write a 3-word title."},
                             {"role": "user", "content": "quota"}],
                "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(side.status, 200, "{}", side.body);
    let a1 = v1["choices"][0]["message"]["content"].as_str().unwrap();
    let q2 = json!([{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."},
                    {"role": "assistant", "content": a1}, {"role": "user", "content": "Another one."}]);
    let r2 = post(
        port,
        "/v1/chat/completions",
        &json!({"messages": q2, "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r2.status, 200, "{}", r2.body);
    (v1["usage"]["total_tokens"].as_u64().unwrap(), r2)
}

#[test]
fn a_short_unrelated_request_does_not_evict_the_live_conversation() {
    let srv = Server::start(&["--no-kv-disk"]);
    let (turn1, r2) = conversation_around_a_side_request(srv.port);
    let cache = r2.header("x-ds4-cache").unwrap();
    let cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cache.starts_with("memory-"), "{cache}");
    assert!(cached >= turn1 - 1, "reused {cached} of {turn1}: {cache}");
    srv.stop();

    // With one slot the side request takes the only session.
    let srv = Server::start(&["--no-kv-disk", "--batched-session", "1"]);
    let (turn1, r2) = conversation_around_a_side_request(srv.port);
    let cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached < turn1 / 2, "reused {cached} of {turn1}");
}

#[test]
fn a_prompt_cache_key_keeps_its_requests_on_their_slot() {
    let srv = Server::start(&["--no-kv-disk"]);
    let p = srv.port;
    let system = "You are a careful assistant for a lighthouse keeper. ".repeat(8);
    let chat = |messages: Value, key: Option<&str>| {
        let mut body = json!({"messages": messages, "max_tokens": 4, "temperature": 0});
        if let Some(k) = key {
            body["prompt_cache_key"] = json!(k);
        }
        let r = post(p, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r
    };
    let a1 = chat(
        json!([{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]),
        None,
    )
    .json();
    // The key's first request is short and unrelated: an empty slot. Its next
    // request shares the main conversation's system prompt, but the key keeps it
    // on that slot, so the main conversation is not cut back.
    chat(json!([{"role": "user", "content": "quota"}]), Some("k"));
    chat(
        json!([{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}]),
        Some("k"),
    );
    let answer = a1["choices"][0]["message"]["content"].as_str().unwrap();
    let a2 = chat(
        json!([{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."},
               {"role": "assistant", "content": answer}, {"role": "user", "content": "Another one."}]),
        None,
    );
    let turn1 = a1["usage"]["total_tokens"].as_u64().unwrap();
    let cached = a2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= turn1 - 1,
        "reused {cached} of {turn1}: {:?}",
        a2.header("x-ds4-cache")
    );
}
