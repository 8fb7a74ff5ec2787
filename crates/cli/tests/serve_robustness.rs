//! `ds4 serve` under hostile and unlucky clients, over real loopback HTTP: a
//! deterministic barrage of broken bodies on every dialect (each answered with a
//! 4xx in that dialect's error shape, never a 5xx, a hang or a reset, and the live
//! session unharmed afterwards), the queue limit (503 + `Retry-After`), SSE
//! keep-alive comments during a long prefill, and HTTP/1.1 connection reuse.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

mod common;

use common::{Reply, Server};
use serde_json::{json, Value};

fn io_err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// The status line and headers of a response, up to the blank line.
fn read_head(r: &mut impl BufRead) -> Result<(u16, String), String> {
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).map_err(io_err)? == 0 {
            return Err(format!("connection closed inside the headers: {head:?}"));
        }
        if line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status line: {head:?}"))?;
    Ok((status, head))
}

/// One chunk of a chunked body; `None` at the terminating zero-size chunk (the
/// server sends no trailers, so that ends the body).
fn read_chunk(r: &mut impl BufRead) -> Result<Option<Vec<u8>>, String> {
    let mut size = String::new();
    r.read_line(&mut size).map_err(io_err)?;
    let n = usize::from_str_radix(size.trim(), 16).map_err(|e| format!("{e}: {size:?}"))?;
    let mut buf = vec![0; n + 2];
    r.read_exact(&mut buf).map_err(io_err)?;
    buf.truncate(n);
    Ok((n > 0).then_some(buf))
}

/// One whole response: the body by `Content-Length`, chunks, or until close.
fn read_reply(r: &mut impl BufRead) -> Result<Reply, String> {
    let (status, headers) = read_head(r)?;
    let reply = |body: Vec<u8>| Reply {
        status,
        headers: headers.clone(),
        body: String::from_utf8_lossy(&body).into_owned(),
    };
    let h = Reply {
        status,
        headers: headers.clone(),
        body: String::new(),
    };
    if let Some(n) = h.header("content-length") {
        let mut body = vec![0; n.parse().map_err(io_err)?];
        r.read_exact(&mut body).map_err(io_err)?;
        return Ok(reply(body));
    }
    if h.header("transfer-encoding")
        .is_some_and(|t| t.eq_ignore_ascii_case("chunked"))
    {
        let mut body = Vec::new();
        while let Some(c) = read_chunk(r)? {
            body.extend(c);
        }
        return Ok(reply(body));
    }
    let mut body = Vec::new();
    r.read_to_end(&mut body).map_err(io_err)?;
    Ok(reply(body))
}

fn head_of(method: &str, path: &str, len: usize, close: bool) -> String {
    format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{}Content-Type: application/json\r\nContent-Length: {len}\r\n\r\n",
        if close { "Connection: close\r\n" } else { "" }
    )
}

fn connect(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    s
}

/// One request on a fresh connection; an error for a reset, a timeout or a
/// malformed response.
fn try_request(port: u16, method: &str, path: &str, body: &[u8]) -> Result<Reply, String> {
    let mut s = connect(port);
    s.write_all(head_of(method, path, body.len(), true).as_bytes())
        .map_err(io_err)?;
    s.write_all(body).map_err(io_err)?;
    read_reply(&mut BufReader::new(s))
}

fn request(port: u16, method: &str, path: &str, body: &[u8]) -> Reply {
    try_request(port, method, path, body)
        .unwrap_or_else(|e| panic!("{method} {path}: no answer: {e}"))
}

fn post(port: u16, path: &str, body: &Value) -> Reply {
    request(port, "POST", path, body.to_string().as_bytes())
}

/// xorshift64: the barrage is the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// What a hostile body must get.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Expect {
    /// A 4xx.
    Invalid,
    /// A 2xx.
    Valid,
    /// Either (a byte flip inside a string, a type the field happens to accept).
    Any,
}

struct Case {
    label: String,
    body: Vec<u8>,
    expect: Expect,
}

/// A field a type swap targets: its JSON pointer and the JSON types it takes
/// (`s` string, `n` non-negative integer, `f` float, `a` array, `o` object, `b`
/// bool, `z` null), or `*` when the server reads it as any JSON value.
type Field = (&'static str, &'static str);

/// Raw replacements, each with the type letters it fits. `1e400` and `2^64`
/// overflow; `-1` only fits a float.
const SWAPS: &[(&str, &str)] = &[
    ("\"x\"", "s"),
    ("\"\"", "s"),
    ("7", "nf"),
    ("-1", "f"),
    ("1e400", ""),
    ("18446744073709551616", "f"),
    ("1.5", "f"),
    ("[]", "a"),
    ("{\"a\":1}", "o"),
    ("null", "z"),
    ("true", "b"),
];

#[derive(Clone, Copy, PartialEq)]
enum Shape {
    OpenAi,
    Anthropic,
}

struct Dialect {
    path: &'static str,
    shape: Shape,
    /// A valid request for one token (or a count).
    base: Value,
    fields: &'static [Field],
    /// Pointer to the user text the conversation ends with.
    text: &'static str,
    /// Dialect-specific bodies it must refuse.
    refusals: Vec<Value>,
    /// Whether the endpoint runs the model (count_tokens does not).
    generates: bool,
}

fn dialects() -> Vec<Dialect> {
    let chat_msgs = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]);
    let ant_msgs = json!([{"role": "user", "content": "Hi there"}]);
    let with = |base: &Value, extra: Value| {
        let mut b = base.clone();
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let chat = json!({"model": "m", "messages": chat_msgs, "max_tokens": 1, "temperature": 0,
                      "top_p": 0.9, "stop": ["\n\n"], "stream": false, "seed": 1});
    let completion = json!({"model": "m", "prompt": "The capital of France is", "max_tokens": 1,
                            "temperature": 0, "stop": ["\n"]});
    let messages = json!({"model": "m", "system": "Be brief.", "messages": ant_msgs, "max_tokens": 1,
                          "temperature": 0, "stop_sequences": ["\n\n"]});
    let count = json!({"model": "m", "system": "Be brief.", "messages": ant_msgs});
    let responses = json!({"model": "m", "instructions": "Be brief.",
                           "input": [{"role": "user", "content": "Hi there"}],
                           "max_output_tokens": 1, "temperature": 0, "store": false});
    let user = |c: Value| json!([{"role": "user", "content": c}]);
    vec![
        Dialect {
            path: "/v1/chat/completions",
            shape: Shape::OpenAi,
            refusals: vec![
                with(&chat, json!({"messages": [{"role": "tool", "content": 5}]})),
                with(
                    &chat,
                    json!({"messages": user(json!([{"type": "image_url", "image_url": {"url": "u"}}]))}),
                ),
                with(&chat, json!({"messages": user(json!([{"type": "text"}]))})),
                with(&chat, json!({"messages": user(json!(5))})),
                with(&chat, json!({"messages": [5]})),
                with(&chat, json!({"n": 17})),
                with(&chat, json!({"n": 0})),
                with(&chat, json!({"logprobs": 5})),
                with(&chat, json!({"top_logprobs": 2})),
                with(&chat, json!({"logprobs": true, "top_logprobs": 99})),
                with(&chat, json!({"logit_bias": {"5": 101}})),
                with(&chat, json!({"logit_bias": {"999999999": 1}})),
                with(&chat, json!({"logit_bias": {"x": 1}})),
                with(
                    &chat,
                    json!({"tools": [{"type": "function", "function": {"name": ""}}]}),
                ),
                with(&chat, json!({"functions": [{"name": "f"}]})),
                with(
                    &chat,
                    json!({"response_format": {"type": "json_schema", "json_schema": {}}}),
                ),
                with(&chat, json!({"stop": [1]})),
                with(&chat, json!({"top_p": 0})),
                with(&chat, json!({"min_p": 2})),
                with(&chat, json!({"modalities": ["audio"]})),
                with(&chat, json!({"audio": {"voice": "x"}})),
                json!({"max_tokens": 1}),
            ],
            base: chat,
            fields: &[
                ("/model", "sz"),
                ("/messages", "az"),
                ("/messages/0", "o"),
                ("/messages/1/role", "sz"),
                ("/messages/1/content", "*"),
                ("/max_tokens", "nz"),
                ("/max_completion_tokens", "nz"),
                ("/temperature", "*"),
                ("/top_p", "*"),
                ("/top_k", "nz"),
                ("/min_p", "*"),
                ("/seed", "nz"),
                ("/stop", "*"),
                ("/stream", "bz"),
                ("/stream_options", "oz"),
                ("/n", "*"),
                ("/logit_bias", "*"),
                ("/logprobs", "*"),
                ("/top_logprobs", "*"),
                ("/tools", "*"),
                ("/response_format", "*"),
            ],
            text: "/messages/1/content",
            generates: true,
        },
        Dialect {
            path: "/v1/completions",
            shape: Shape::OpenAi,
            refusals: vec![
                with(&completion, json!({"prompt": ["a", ""]})),
                with(&completion, json!({"prompt": [1, 99_999_999]})),
                with(&completion, json!({"prompt": [[1], [2, 99_999_999]]})),
                with(&completion, json!({"prompt": [1.5]})),
                with(&completion, json!({"prompt": [[]]})),
                with(&completion, json!({"prompt": []})),
                with(&completion, json!({"prompt": ""})),
                with(&completion, json!({"n": 17})),
                with(&completion, json!({"suffix": " end"})),
                with(&completion, json!({"best_of": 3})),
                with(&completion, json!({"n": 2, "prompt": vec!["a"; 65]})),
                with(&completion, json!({"logprobs": 21})),
                with(&completion, json!({"logprobs": true})),
                with(&completion, json!({"stop": {"a": 1}})),
                json!({"max_tokens": 1}),
            ],
            base: completion,
            fields: &[
                ("/model", "sz"),
                ("/prompt", "*"),
                ("/max_tokens", "nz"),
                ("/temperature", "*"),
                ("/top_p", "*"),
                ("/top_k", "nz"),
                ("/min_p", "*"),
                ("/seed", "nz"),
                ("/stop", "*"),
                ("/stream", "bz"),
                ("/stream_options", "oz"),
                ("/n", "*"),
                ("/logprobs", "*"),
                ("/echo", "bz"),
                ("/suffix", "*"),
                ("/best_of", "*"),
            ],
            text: "/prompt",
            generates: true,
        },
        Dialect {
            path: "/v1/messages",
            shape: Shape::Anthropic,
            refusals: vec![
                with(&messages, json!({"max_tokens": null})),
                with(&messages, json!({"max_tokens": 0})),
                with(&messages, json!({"temperature": 1.5})),
                with(
                    &messages,
                    json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}),
                ),
                with(
                    &messages,
                    json!({"messages": [{"role": "tool", "content": "a"}]}),
                ),
                with(
                    &messages,
                    json!({"messages": user(json!([{"type": "image", "source": {}}]))}),
                ),
                with(
                    &messages,
                    json!({"messages": user(json!([{"type": "tool_result", "tool_use_id": 7}]))}),
                ),
                with(&messages, json!({"messages": user(json!([{"text": "x"}]))})),
                with(&messages, json!({"messages": user(json!(5))})),
                with(&messages, json!({"system": [{"type": "image"}]})),
                with(&messages, json!({"system": 5})),
                with(&messages, json!({"stop_sequences": [""]})),
                with(
                    &messages,
                    json!({"thinking": {"type": "sometimes", "budget_tokens": 1024}}),
                ),
                with(
                    &messages,
                    json!({"tools": [{"name": "f", "input_schema": []}]}),
                ),
                json!({"max_tokens": 1}),
            ],
            base: messages,
            fields: &[
                ("/model", "sz"),
                ("/system", "*"),
                ("/messages", "az"),
                ("/messages/0", "o"),
                ("/messages/0/role", "s"),
                ("/messages/0/content", "*"),
                ("/max_tokens", "n"),
                ("/temperature", "*"),
                ("/top_p", "*"),
                ("/top_k", "nz"),
                ("/stop_sequences", "az"),
                ("/stream", "bz"),
                ("/tools", "az"),
                ("/thinking", "*"),
                ("/metadata", "*"),
            ],
            text: "/messages/0/content",
            generates: true,
        },
        Dialect {
            path: "/v1/messages/count_tokens",
            shape: Shape::Anthropic,
            refusals: vec![
                with(
                    &count,
                    json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}),
                ),
                with(
                    &count,
                    json!({"messages": [{"role": "tool", "content": "a"}]}),
                ),
                with(
                    &count,
                    json!({"messages": user(json!([{"type": "document", "source": {}}]))}),
                ),
                with(&count, json!({"system": [5]})),
                with(&count, json!({"tools": [{"name": 5}]})),
                with(&count, json!({"max_tokens": 0})),
                json!({"system": "x"}),
            ],
            base: count,
            fields: &[
                ("/model", "sz"),
                ("/system", "*"),
                ("/messages", "az"),
                ("/messages/0", "o"),
                ("/messages/0/role", "s"),
                ("/messages/0/content", "*"),
                ("/max_tokens", "*"),
                ("/temperature", "*"),
                ("/stop_sequences", "az"),
                ("/tools", "az"),
                ("/thinking", "*"),
            ],
            text: "/messages/0/content",
            generates: false,
        },
        Dialect {
            path: "/v1/responses",
            shape: Shape::OpenAi,
            refusals: vec![
                with(&responses, json!({"previous_response_id": "resp_1"})),
                with(&responses, json!({"conversation": "conv_1"})),
                with(&responses, json!({"background": true})),
                with(&responses, json!({"input": []})),
                with(&responses, json!({"input": [5]})),
                with(&responses, json!({"input": 5})),
                with(
                    &responses,
                    json!({"input": [{"type": "item_reference", "id": "msg_1"}]}),
                ),
                with(
                    &responses,
                    json!({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}),
                ),
                with(
                    &responses,
                    json!({"input": [{"role": "tool", "content": "x"}]}),
                ),
                with(
                    &responses,
                    json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
                ),
                with(&responses, json!({"reasoning": {"effort": "extreme"}})),
                with(
                    &responses,
                    json!({"text": {"format": {"type": "json_schema"}}}),
                ),
                with(&responses, json!({"top_logprobs": 21})),
                with(
                    &responses,
                    json!({"include": "message.output_text.logprobs"}),
                ),
                with(&responses, json!({"max_output_tokens": 0})),
                with(&responses, json!({"tool_choice": "required"})),
                with(
                    &responses,
                    json!({"tools": [{"type": "function", "name": ""}]}),
                ),
                json!({"instructions": "x"}),
            ],
            base: responses,
            fields: &[
                ("/model", "sz"),
                ("/input", "*"),
                ("/input/0", "o"),
                ("/input/0/role", "*"),
                ("/input/0/content", "*"),
                ("/input/0/type", "*"),
                ("/instructions", "sz"),
                ("/max_output_tokens", "nz"),
                ("/temperature", "*"),
                ("/top_p", "*"),
                ("/stream", "bz"),
                ("/store", "bz"),
                ("/metadata", "*"),
                ("/user", "sz"),
                ("/parallel_tool_calls", "bz"),
                ("/truncation", "sz"),
                ("/previous_response_id", "z"),
                ("/conversation", "z"),
                ("/background", "bz"),
                ("/tools", "az"),
                ("/tool_choice", "*"),
                ("/reasoning", "oz"),
                ("/text", "oz"),
                ("/top_logprobs", "nz"),
                ("/include", "*"),
            ],
            text: "/input/0/content",
            generates: true,
        },
    ]
}

/// `base` with the value at `ptr` replaced by (or, for a missing key, set to)
/// the raw JSON text `raw`, which need not be representable as a `Value`.
fn with_raw(base: &Value, ptr: &str, raw: &str) -> Vec<u8> {
    const MARK: &str = "\u{1}raw\u{1}";
    let mut v = base.clone();
    let (parent, key) = ptr.rsplit_once('/').unwrap();
    match v.pointer_mut(parent).unwrap() {
        Value::Object(o) => {
            o.insert(key.to_string(), json!(MARK));
        }
        Value::Array(a) => a[key.parse::<usize>().unwrap()] = json!(MARK),
        other => panic!("{ptr}: parent is {other}"),
    }
    let text = v.to_string();
    let marked = serde_json::to_string(MARK).unwrap();
    assert!(text.contains(&marked));
    text.replacen(&marked, raw, 1).into_bytes()
}

/// `body` with the bytes `from` (which occur once) replaced by `to`.
fn splice(body: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let at = body
        .windows(from.len())
        .position(|w| w == from)
        .unwrap_or_else(|| panic!("{:?} not in body", String::from_utf8_lossy(from)));
    [&body[..at], to, &body[at + from.len()..]].concat()
}

fn cases(d: &Dialect, rng: &mut Rng) -> Vec<Case> {
    let base = d.base.to_string().into_bytes();
    let mut out = Vec::new();
    let mut add = |label: String, body: Vec<u8>, expect| {
        out.push(Case {
            label,
            body,
            expect,
        })
    };

    // Every truncation of a valid body (the empty body included).
    for n in 0..base.len() {
        add(
            format!("truncated at {n}"),
            base[..n].to_vec(),
            Expect::Invalid,
        );
    }

    // Random byte flips: most break the JSON, some land in a string.
    for _ in 0..30 {
        let at = rng.below(base.len());
        let mut b = base.clone();
        b[at] ^= 1 + rng.below(255) as u8;
        add(
            format!("byte {at} {:?} -> {:#04x}", base[at] as char, b[at]),
            b,
            Expect::Any,
        );
    }

    // Every field, set to every JSON type. A field read as any value gets one
    // of each type (the rest would only add generations).
    for (ptr, takes) in d.fields {
        for (raw, fits) in SWAPS {
            if *takes == "*" && ["\"\"", "1.5", "18446744073709551616"].contains(raw) {
                continue;
            }
            let expect = if *takes == "*" || fits.chars().any(|c| takes.contains(c)) {
                Expect::Any
            } else {
                Expect::Invalid
            };
            add(
                format!("{ptr} = {raw}"),
                with_raw(&d.base, ptr, raw),
                expect,
            );
        }
    }

    // Not an object at all, or not JSON.
    let deep = |open: &str, close: &str, n: usize| [open.repeat(n), close.repeat(n)].concat();
    for (label, body) in [
        ("null", b"null".to_vec()),
        ("array", b"[]".to_vec()),
        ("array of the body", [b"[", &base[..], b"]"].concat()),
        ("string", b"\"hello\"".to_vec()),
        ("number", b"123".to_vec()),
        ("bool", b"true".to_vec()),
        ("empty object", b"{}".to_vec()),
        ("whitespace", b" \r\n\t ".to_vec()),
        ("NUL byte", b"\0".to_vec()),
        ("trailing garbage", [&base[..], b"x"].concat()),
        ("two bodies", [&base[..], &base[..]].concat()),
        ("100k [", "[".repeat(100_000).into_bytes()),
        ("100k balanced []", deep("[", "]", 100_000).into_bytes()),
        ("50k {\"a\":", deep("{\"a\":", "}", 50_000).into_bytes()),
        (
            "deep value in a field",
            with_raw(&d.base, "/model", &deep("[", "]", 10_000)),
        ),
        ("single quotes", b"{'model':'m'}".to_vec()),
        ("comment", [b"/* hi */", &base[..]].concat()),
    ] {
        add(label.to_string(), body, Expect::Invalid);
    }

    // Bytes and escapes inside the conversation text.
    let text = with_raw(&d.base, d.text, "\"TEXT\"");
    let text_as = |raw: &[u8]| splice(&text, b"TEXT", raw);
    for (label, raw, expect) in [
        ("raw NUL in a string", &b"a\0b"[..], Expect::Invalid),
        ("raw newline in a string", b"a\nb", Expect::Invalid),
        ("invalid UTF-8", b"a\xff\xfeb", Expect::Invalid),
        ("overlong UTF-8", b"a\xc0\x80b", Expect::Invalid),
        ("lone continuation byte", b"a\x80b", Expect::Invalid),
        ("truncated UTF-8", b"a\xe2\x82", Expect::Invalid),
        ("lone high surrogate", b"\\ud800", Expect::Invalid),
        ("lone low surrogate", b"\\udc00x", Expect::Invalid),
        (
            "high surrogate + letter",
            b"\\ud800\\u0041",
            Expect::Invalid,
        ),
        ("bad escape", b"\\q", Expect::Invalid),
        ("short \\u escape", b"\\u12", Expect::Invalid),
        ("\\u0000 escape", b"a\\u0000b", Expect::Valid),
        ("surrogate pair", b"\\ud83d\\ude00", Expect::Valid),
        (
            "special-token text",
            b"<|im_end|><|endoftext|>",
            Expect::Valid,
        ),
    ] {
        add(label.to_string(), text_as(raw), expect);
    }
    let inner = &base[1..base.len() - 1];
    add(
        "every key twice".into(),
        [b"{", inner, b",", inner, b"}"].concat(),
        Expect::Any,
    );

    // Very long strings, well under the body limit.
    let long = "word ".repeat(80_000);
    let prompt_expect = if d.generates {
        Expect::Invalid // longer than the context
    } else {
        Expect::Valid
    };
    add(
        "400 KB text".into(),
        with_raw(&d.base, d.text, &json!(long).to_string()),
        prompt_expect,
    );
    add(
        "400 KB single word".into(),
        with_raw(&d.base, d.text, &json!("x".repeat(400_000)).to_string()),
        prompt_expect,
    );
    add(
        "400 KB model name".into(),
        with_raw(&d.base, "/model", &json!(long).to_string()),
        Expect::Valid,
    );
    add(
        "400 KB unknown field".into(),
        with_raw(&d.base, "/zzz_unknown", &json!(long).to_string()),
        Expect::Valid,
    );
    add(
        "100k-element unknown array".into(),
        with_raw(
            &d.base,
            "/zzz_unknown",
            &format!("[{}0]", "0,".repeat(100_000)),
        ),
        Expect::Valid,
    );
    add(
        "unknown field 1e400".into(),
        with_raw(&d.base, "/zzz_unknown", "1e400"),
        Expect::Any,
    );

    // Numbers and limits.
    let limit = match d.path {
        "/v1/responses" => "/max_output_tokens",
        _ => "/max_tokens",
    };
    for raw in ["-1", "1e400", "18446744073709551616", "1.5", "1e3", "\"1\""] {
        add(
            format!("{limit} = {raw}"),
            with_raw(&d.base, limit, raw),
            Expect::Invalid,
        );
    }
    for raw in ["-0.5", "-0.001", "1e400", "2.5", "\"0\""] {
        add(
            format!("temperature = {raw}"),
            with_raw(&d.base, "/temperature", raw),
            Expect::Invalid,
        );
    }
    add(
        "temperature = 1e-45".into(),
        with_raw(&d.base, "/temperature", "1e-45"),
        Expect::Valid,
    );
    if d.generates {
        // The largest limit the field takes, on a question the model answers in
        // a few tokens (and a context of 512 bounds it anyway).
        let mut b = with_raw(&d.base, limit, "18446744073709551615");
        let question = "What is the capital of France?";
        let text = if d.path == "/v1/completions" {
            b = splice(&b, b"\"\\n\"", b"\".\"");
            "The capital of France is"
        } else {
            question
        };
        let v: Value = serde_json::from_slice(&b).unwrap();
        b = with_raw(&v, d.text, &json!(text).to_string());
        add("max tokens = u64::MAX".into(), b, Expect::Valid);
    }

    // The conversation itself.
    add(
        "empty text".into(),
        with_raw(&d.base, d.text, "\"\""),
        if d.path == "/v1/completions" {
            Expect::Invalid
        } else {
            Expect::Valid
        },
    );
    if d.path != "/v1/completions" {
        let conv = if d.path == "/v1/responses" {
            "/input"
        } else {
            "/messages"
        };
        add(
            "empty conversation".into(),
            with_raw(&d.base, conv, "[]"),
            Expect::Invalid,
        );
        add(
            "missing conversation".into(),
            with_raw(&d.base, conv, "null"),
            Expect::Invalid,
        );
        let role = format!(
            "{conv}/{}/role",
            if d.path == "/v1/chat/completions" {
                1
            } else {
                0
            }
        );
        // `tool` is a role of chat completions only (tool results).
        let tool = d.path != "/v1/chat/completions";
        for r in ["\"wizard\"", "\"\"", "\"USER\"", "\"tool\""]
            .into_iter()
            .filter(|r| tool || *r != "\"tool\"")
        {
            add(
                format!("role {r}"),
                with_raw(&d.base, &role, r),
                Expect::Invalid,
            );
        }
    }
    for (i, body) in d.refusals.iter().enumerate() {
        add(
            format!("refusal {i}: {body}"),
            body.to_string().into_bytes(),
            Expect::Invalid,
        );
    }
    out
}

/// The message of an error body in `shape`, or why the body is not one.
fn error_message(shape: Shape, v: &Value) -> Result<(String, Option<String>), String> {
    let e = &v["error"];
    let msg = e["message"].as_str().ok_or("no error.message")?;
    let ty = e["type"].as_str().ok_or("no error.type")?;
    if ty.is_empty() {
        return Err("empty error.type".into());
    }
    match shape {
        Shape::OpenAi => {
            let o = e.as_object().ok_or("error is not an object")?;
            if !o.contains_key("param") || !o.contains_key("code") || v.get("type").is_some() {
                return Err("not OpenAI's error shape".into());
            }
        }
        Shape::Anthropic => {
            if v["type"] != "error" {
                return Err("no top-level \"type\": \"error\"".into());
            }
        }
    }
    let param = e["param"].as_str().map(str::to_string);
    Ok((msg.to_string(), param))
}

/// Whether an error message says what is wrong and where: a JSON position, the
/// parameter, a field name, or the context limit.
fn precise(msg: &str, param: Option<&str>, d: &Dialect) -> bool {
    if msg.starts_with("invalid JSON request: ") {
        return msg.contains(" at line ") && msg.contains(" column ");
    }
    let fields: Vec<&str> = d
        .fields
        .iter()
        .map(|(p, _)| *p)
        .chain(["/prompt", "/functions", "/audio", "/modalities"])
        .filter_map(|p| p.split('/').nth(1))
        .collect();
    let mut words = msg.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'));
    msg.contains("context length")
        || param.is_some_and(|p| fields.contains(&p))
        || words.any(|w| fields.contains(&w))
}

/// A 2xx reply in the dialect's success shape.
fn check_success(d: &Dialect, r: &Reply) -> Result<(), String> {
    let ct = r.header("content-type").unwrap_or_default();
    if ct.starts_with("text/event-stream") {
        if r.body.contains("event: error") || r.body.contains("server_error") {
            return Err("the stream ended in an error".into());
        }
        let end = match d.shape {
            Shape::Anthropic => "event: message_stop",
            Shape::OpenAi if d.path == "/v1/responses" => "event: response.",
            Shape::OpenAi => "data: [DONE]",
        };
        return if r.body.contains(end) {
            Ok(())
        } else {
            Err(format!("the stream lacks {end:?}"))
        };
    }
    let v: Value = serde_json::from_str(&r.body).map_err(|e| format!("not JSON: {e}"))?;
    let ok = match d.path {
        "/v1/chat/completions" => v["choices"][0]["message"]["content"].is_string(),
        "/v1/completions" => v["choices"][0]["text"].is_string(),
        "/v1/messages" => v["type"] == "message" && v["content"][0]["text"].is_string(),
        "/v1/messages/count_tokens" => v["input_tokens"].is_u64(),
        _ => v["object"] == "response" && v["output"][0]["content"][0]["text"].is_string(),
    };
    if ok {
        Ok(())
    } else {
        Err("not the dialect's success shape".into())
    }
}

/// Checks one reply; the error says what is wrong with it.
fn check(d: &Dialect, c: &Case, r: &Reply) -> Result<(), String> {
    match (r.status, c.expect) {
        (500.., _) => return Err("a 5xx for client input".into()),
        (200..=299, Expect::Invalid) => return Err("accepted".into()),
        (400..=499, Expect::Valid) => return Err("refused".into()),
        (200..=299, _) => return check_success(d, r),
        (400..=499, _) => {}
        (s, _) => return Err(format!("unexpected status {s}")),
    }
    if !r
        .header("content-type")
        .is_some_and(|t| t.starts_with("application/json"))
    {
        return Err("the error is not JSON".into());
    }
    let v: Value = serde_json::from_str(&r.body).map_err(|e| format!("not JSON: {e}"))?;
    let (msg, param) = error_message(d.shape, &v)?;
    if !precise(&msg, param.as_deref(), d) {
        return Err(format!("imprecise message {msg:?}"));
    }
    Ok(())
}

fn chat_turn(messages: Value) -> Value {
    json!({"messages": messages, "temperature": 0, "max_tokens": 16})
}

fn chat_answer(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"))
        .to_string()
}

/// Greedy answers that must not change across the barrage: a two-turn chat,
/// one Anthropic message and a raw completion.
fn reference_answers(port: u16) -> (Vec<String>, Vec<Value>) {
    let q1 = json!([{"role": "user", "content": "What is the capital of France?"}]);
    let r1 = post(port, "/v1/chat/completions", &chat_turn(q1));
    assert_eq!(r1.status, 200, "{}", r1.body);
    let v1 = r1.json();
    let a1 = chat_answer(&v1);
    let q2 = json!([
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": a1},
        {"role": "user", "content": "And of Italy?"}
    ]);
    let r2 = post(port, "/v1/chat/completions", &chat_turn(q2));
    let v2 = r2.json();
    let m = post(
        port,
        "/v1/messages",
        &json!({"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0}),
    )
    .json();
    let c = post(
        port,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}),
    )
    .json();
    let answers = vec![
        a1,
        chat_answer(&v2),
        m["content"][0]["text"].as_str().unwrap().to_string(),
        c["choices"][0]["text"].as_str().unwrap().to_string(),
    ];
    let caches = vec![
        json!(r1.header("x-ds4-cache")),
        json!(r2.header("x-ds4-cache")),
        v1["usage"].clone(),
        v2["usage"].clone(),
    ];
    (answers, caches)
}

#[test]
fn hostile_bodies_get_dialect_errors_and_leave_the_session_intact() {
    let mut srv = Server::start(&["--no-kv-disk", "--ctx", "512", "--tokens", "4"]);
    let p = srv.port;
    let (before, _) = reference_answers(p);
    assert!(before[0].contains("Paris"), "{before:?}");

    let t = Instant::now();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut failures = Vec::new();
    let mut counts = Vec::new();
    for d in dialects() {
        let cases = cases(&d, &mut rng);
        let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
        for c in &cases {
            let r = match try_request(p, "POST", d.path, &c.body) {
                Ok(r) => r,
                Err(e) => {
                    srv.assert_alive();
                    failures.push(format!("{} [{}]: no answer: {e}", d.path, c.label));
                    continue;
                }
            };
            *statuses.entry(r.status).or_default() += 1;
            if let Err(e) = check(&d, c, &r) {
                let body: String = r.body.chars().take(300).collect();
                failures.push(format!(
                    "{} [{}] ({:?}): {} {e}: {body}",
                    d.path, c.label, c.expect, r.status
                ));
            }
        }
        assert!(cases.len() >= 200, "{}: {} cases", d.path, cases.len());
        counts.push(format!("{} {} {statuses:?}", d.path, cases.len()));
    }
    srv.assert_alive();
    eprintln!("barrage in {:.1}s: {counts:#?}", t.elapsed().as_secs_f64());
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures[..failures.len().min(40)].join("\n")
    );

    // The live session still answers as before, and reuses what it holds.
    let (after, caches) = reference_answers(p);
    assert_eq!(after, before, "the barrage changed greedy answers");
    let turn2 = caches[1].as_str().unwrap();
    assert!(
        turn2.starts_with("memory-token") || turn2.starts_with("memory-text"),
        "{turn2}"
    );
    let cached = caches[3]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let turn1_prompt = caches[2]["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached > turn1_prompt,
        "the second turn reused {cached} tokens; the first turn alone had {turn1_prompt}"
    );
    let metrics = request(p, "GET", "/metrics", b"").body;
    assert!(
        !metrics.lines().any(|l| l.contains("status=\"5")),
        "{metrics}"
    );
    srv.assert_alive();
}

fn health_depth(port: u16) -> u64 {
    request(port, "GET", "/health", b"").json()["queue_depth"]
        .as_u64()
        .unwrap()
}

#[test]
fn a_full_queue_answers_503_with_retry_after_in_each_dialect_then_recovers() {
    let srv = Server::start(&["--no-kv-disk", "--queue-max", "1", "--batched-session", "1"]);
    let p = srv.port;

    // A long generation holds the engine: wait for its first token.
    let body =
        json!({"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": true})
            .to_string();
    let mut long = connect(p);
    long.write_all(head_of("POST", "/v1/completions", body.len(), true).as_bytes())
        .unwrap();
    long.write_all(body.as_bytes()).unwrap();
    let mut long_r = BufReader::new(long.try_clone().unwrap());
    let (status, _) = read_head(&mut long_r).unwrap();
    assert_eq!(status, 200);
    let first = read_chunk(&mut long_r).unwrap().unwrap();
    assert!(first.starts_with(b"data: "), "{first:?}");

    // One job waits in the queue (room for one) ...
    let queued = std::thread::spawn(move || {
        post(
            p,
            "/v1/completions",
            &json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}),
        )
    });
    let t = Instant::now();
    while health_depth(p) < 2 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the job never queued"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // ... and everyone else is turned away at once, each in their dialect's shape.
    let q = json!([{"role": "user", "content": "Hi"}]);
    let overflow = [
        (
            "/v1/chat/completions",
            json!({"messages": q, "max_tokens": 1}),
            Shape::OpenAi,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": q, "max_tokens": 1, "stream": true}),
            Shape::OpenAi,
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "max_tokens": 1}),
            Shape::OpenAi,
        ),
        (
            "/v1/messages",
            json!({"messages": q, "max_tokens": 1}),
            Shape::Anthropic,
        ),
        (
            "/v1/messages",
            json!({"messages": q, "max_tokens": 1, "stream": true}),
            Shape::Anthropic,
        ),
        (
            "/v1/responses",
            json!({"input": "Hi", "max_output_tokens": 1}),
            Shape::OpenAi,
        ),
    ];
    let replies: Vec<_> = overflow
        .iter()
        .map(|(path, body, _)| {
            let (path, body) = (*path, body.clone());
            std::thread::spawn(move || post(p, path, &body))
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    for ((path, _, shape), r) in overflow.iter().zip(&replies) {
        assert_eq!(r.status, 503, "{path}: {}", r.body);
        let after: u64 = r
            .header("retry-after")
            .unwrap_or_else(|| panic!("{path}: no Retry-After: {}", r.headers))
            .parse()
            .unwrap();
        assert!(after >= 1, "{path}");
        let v = r.json();
        let (msg, _) = error_message(*shape, &v).unwrap_or_else(|e| panic!("{path}: {e}: {v}"));
        assert!(msg.contains("queue is full"), "{path}: {msg}");
        match shape {
            Shape::OpenAi => assert_eq!(
                (&v["error"]["type"], &v["error"]["code"]),
                (&json!("server_error"), &json!("overloaded")),
                "{path}"
            ),
            Shape::Anthropic => assert_eq!(v["error"]["type"], "overloaded_error", "{path}"),
        }
    }
    // Counting tokens does not queue for the engine.
    let r = post(p, "/v1/messages/count_tokens", &json!({"messages": q}));
    assert_eq!(r.status, 200, "{}", r.body);

    // The long stream is still going; hanging up cancels it and the queued job runs.
    assert!(read_chunk(&mut long_r).unwrap().is_some());
    long.shutdown(std::net::Shutdown::Both).unwrap();
    drop(long_r);
    let r = queued.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.json()["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with(" Paris"),
        "{}",
        r.body
    );

    // New requests are served again, in every dialect.
    for (path, body, _) in &overflow {
        let r = post(p, path, body);
        assert_eq!(r.status, 200, "{path}: {}", r.body);
    }
    // (The worker counts a job done just after its last event.)
    let t = Instant::now();
    while health_depth(p) > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the queue never drained"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = srv.log();
    let first = log.lines().find(|l| l.contains("request: cache=")).unwrap();
    assert!(!first.contains("generated=400"), "not cancelled: {first}");
}

#[test]
fn a_long_prefill_streams_keep_alive_comments_before_the_first_token() {
    let srv = Server::start(&["--no-kv-disk"]);
    // About 3800 tokens: a prefill of well over 5 s at one thread (the interval
    // of the keep-alive comments) on any machine this runs on (the AVX-512 tier
    // prefills ~1500 tokens in under 4 s). The test hangs up at the first
    // comment, so it waits about 5 s, not for the whole prefill.
    let prompt: String = (0..230)
        .map(|i| {
            format!(
                "Note {i}: the river bends where the {} old mills stand. ",
                i % 7
            )
        })
        .collect();
    let body =
        json!({"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": true}).to_string();
    let mut s = connect(srv.port);
    let t0 = Instant::now();
    s.write_all(head_of("POST", "/v1/completions", body.len(), true).as_bytes())
        .unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut r = BufReader::new(s);
    let (status, head) = read_head(&mut r).unwrap();
    let t_head = t0.elapsed();
    assert_eq!(status, 200, "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/event-stream"),
        "{head}"
    );
    assert!(
        t_head < Duration::from_secs(3),
        "headers after {t_head:?}: held back by the prefill?"
    );
    let (t_comment, line) = loop {
        let chunk = read_chunk(&mut r)
            .unwrap()
            .expect("the stream ended before any keep-alive comment");
        let t = t0.elapsed();
        let text = String::from_utf8_lossy(&chunk).into_owned();
        assert!(
            !text.lines().any(|l| l.starts_with("data:")),
            "data after {t:?} before any keep-alive comment (prefill too short?): {text:?}"
        );
        if let Some(l) = text.lines().find(|l| l.starts_with(':')) {
            break (t, l.to_string());
        }
    };
    assert_eq!(line, ": keep-alive");
    // The prefill was still running: the worker logs each request when it ends.
    assert!(
        !srv.log().contains("request: cache="),
        "the request already finished:\n{}",
        srv.log()
    );
    assert!(
        t_comment >= Duration::from_secs(4) && t_comment < Duration::from_secs(15),
        "first keep-alive after {t_comment:?}"
    );
}

#[test]
fn one_connection_carries_several_requests() {
    let srv = Server::start(&["--no-kv-disk"]);
    let mut s = connect(srv.port);
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut send = |method: &str, path: &str, body: &str| {
        s.write_all(format!("{}{body}", head_of(method, path, body.len(), false)).as_bytes())
            .unwrap();
    };
    let paris = json!({"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0})
        .to_string();
    let chat =
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0})
            .to_string();
    let stream = json!({"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, "stream": true})
        .to_string();

    send("POST", "/v1/completions", &paris);
    send("POST", "/v1/chat/completions", &chat); // pipelined behind the first
    let mut replies = vec![read_reply(&mut r).unwrap(), read_reply(&mut r).unwrap()];
    send("POST", "/v1/messages", "{");
    replies.push(read_reply(&mut r).unwrap());
    send("POST", "/v1/completions", &stream);
    replies.push(read_reply(&mut r).unwrap());
    send("GET", "/health", "");
    replies.push(read_reply(&mut r).unwrap());
    send("POST", "/v1/completions", &paris);
    replies.push(read_reply(&mut r).unwrap());

    let statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
    assert_eq!(statuses, [200, 200, 400, 200, 200, 200]);
    for r in &replies {
        assert!(
            !r.header("connection")
                .is_some_and(|c| c.eq_ignore_ascii_case("close")),
            "{}",
            r.headers
        );
    }
    assert!(replies[0].json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .starts_with(" Paris"));
    assert_eq!(replies[1].json()["object"], "chat.completion");
    assert_eq!(replies[2].json()["type"], "error");
    assert!(
        replies[3].body.trim_end().ends_with("data: [DONE]"),
        "{}",
        replies[3].body
    );
    assert_eq!(replies[4].json()["status"], "ok");
    // The last request reused the first one's prompt from the live session.
    assert_eq!(
        replies[5].json()["choices"][0]["text"],
        replies[0].json()["choices"][0]["text"]
    );
}
