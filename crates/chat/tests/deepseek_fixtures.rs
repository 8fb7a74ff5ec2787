//! The DeepSeek V4 template against conversations whose expected bytes were
//! written from the system spec (`shared/docs/ds4-system-spec.md` §4-5: the
//! tool block of §4.4 and the Think Max prefix of §5.3 copied verbatim, the
//! rest by the rules of §4.3, §4.6 and §7.3): plain and thinking turns, Think
//! Max, tool calls rendered canonically and replayed exactly, tool results,
//! escapes. Fixtures: `tests/fixtures/deepseek4/NAME.json` (messages, tools,
//! mode) and `NAME.txt` (the prompt).

use ds4_chat::{DeepSeek, Message, RenderOptions, Role, Template, ThinkMode, ToolCall, ToolSpec};
use serde_json::Value;

fn role(s: &str) -> Role {
    match s {
        "system" => Role::System,
        "user" => Role::User,
        "assistant" => Role::Assistant,
        "tool" => Role::Tool,
        _ => panic!("role {s}"),
    }
}

fn message(v: &Value) -> Message {
    let text = |k: &str| v[k].as_str().map(str::to_string);
    Message {
        role: role(v["role"].as_str().expect("role")),
        content: text("content").unwrap_or_default(),
        reasoning: text("reasoning"),
        tool_calls: v["tool_calls"]
            .as_array()
            .map(|calls| {
                calls
                    .iter()
                    .map(|c| ToolCall {
                        id: c["id"].as_str().unwrap_or_default().into(),
                        name: c["name"].as_str().unwrap_or_default().into(),
                        arguments: c["arguments"].as_str().unwrap_or_default().into(),
                    })
                    .collect()
            })
            .unwrap_or_default(),
        tool_calls_raw: text("tool_calls_raw"),
        tool_call_id: text("tool_call_id"),
        name: None,
    }
}

/// A tool as a client sends it: the raw JSON text is what the prompt shows.
fn tool(raw: &str) -> ToolSpec {
    let v: Value = serde_json::from_str(raw).expect("tool JSON");
    let f = if v["function"].is_object() {
        &v["function"]
    } else {
        &v
    };
    let schema = if f["parameters"].is_object() {
        &f["parameters"]
    } else {
        &f["input_schema"]
    };
    ToolSpec {
        name: f["name"].as_str().unwrap_or_default().into(),
        description: f["description"].as_str().unwrap_or_default().into(),
        parameters: schema.to_string(),
        raw: raw.into(),
    }
}

#[test]
fn conversations_render_the_spec_bytes() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek4");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("fixtures")
        .filter_map(|e| {
            e.ok()?
                .file_name()
                .into_string()
                .ok()?
                .strip_suffix(".json")
                .map(str::to_string)
        })
        .collect();
    names.sort();
    assert_eq!(names.len(), 8, "{names:?}");
    for name in names {
        let case: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap(),
        )
        .unwrap();
        let expected = std::fs::read_to_string(dir.join(format!("{name}.txt"))).unwrap();
        let messages: Vec<Message> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(message)
            .collect();
        let tools: Vec<ToolSpec> = case["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| tool(t.as_str().expect("raw tool text")))
            .collect();
        let think = match case["think"].as_str().unwrap() {
            "none" => ThinkMode::None,
            "high" => ThinkMode::High,
            "max" => ThinkMode::Max,
            other => panic!("{other}"),
        };
        let prompt = DeepSeek.render(
            &messages,
            &RenderOptions {
                tools: &tools,
                think,
                add_generation_prompt: true,
            },
        );
        let got = prompt.as_str();
        if got != expected {
            let at = got
                .bytes()
                .zip(expected.bytes())
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            panic!(
                "{name}: differs at byte {at}:\n got: {:?}\nwant: {:?}",
                &got[got.floor_char_boundary(at)..]
                    [..80.min(got.len() - got.floor_char_boundary(at))],
                &expected[expected.floor_char_boundary(at)..]
                    [..80.min(expected.len() - expected.floor_char_boundary(at))]
            );
        }
    }
}

/// §5.2: Think Max needs a context of at least 393,216 tokens; below it the
/// mode is ordinary thinking (the server gates with its --ctx).
#[test]
fn think_max_is_gated_on_the_context() {
    assert_eq!(ThinkMode::Max.for_context(393_215), ThinkMode::High);
    assert_eq!(ThinkMode::Max.for_context(393_216), ThinkMode::Max);
    assert_eq!(ThinkMode::None.for_context(1), ThinkMode::None);
}
