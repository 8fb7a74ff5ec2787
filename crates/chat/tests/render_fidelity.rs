//! Renderer fidelity: `ChatMl` renders the same bytes as the real Jinja chat
//! templates, run here with minijinja set up like Hugging Face's
//! `apply_chat_template` (`trim_blocks`, `lstrip_blocks`, a Python-style `tojson`).
//!
//! Two templates: SmolLM2's, read from the GGUF on disk, and Qwen2.5's (below),
//! which defines the tool-calling format ChatML models share.

use ds4_chat::tools::ToolSyntax;
use ds4_chat::{ChatMl, Message, RenderOptions, Role, Template, ToolCall, ToolSpec};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{json, Value};

/// `chat_template` of `Qwen/Qwen2.5-7B-Instruct` (Hugging Face, `tokenizer_config.json`;
/// the same text llama.cpp keeps as `models/templates/Qwen-Qwen2.5-7B-Instruct.jinja`).
const QWEN25_TEMPLATE: &str = r#"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

const QWEN25_DEFAULT_SYSTEM: &str =
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

fn smollm2_template() -> String {
    let gguf = ds4_gguf::Gguf::open(ds4_testdata::model_path(ds4_testdata::SMOLLM2))
        .expect("open SmolLM2 GGUF");
    gguf.get_str("tokenizer.chat_template")
        .expect("SmolLM2 has a chat template")
        .to_string()
}

/// Hugging Face's `tojson`: Python `json.dumps(..., ensure_ascii=False)`.
fn python_tojson(value: minijinja::Value) -> Result<String, Error> {
    let value = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(python_dumps(&value))
}

fn python_dumps(value: &Value) -> String {
    match value {
        Value::Array(items) => format!(
            "[{}]",
            items
                .iter()
                .map(python_dumps)
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Value::Object(map) => format!(
            "{{{}}}",
            map.iter()
                .map(|(k, v)| format!("{}: {}", Value::String(k.clone()), python_dumps(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        scalar => scalar.to_string(),
    }
}

/// The Jinja context the way OpenAI-style servers build it: calls are
/// `{"type": "function", "function": {...}}` with arguments as objects.
fn render_jinja(template: &str, messages: &[Message], tools: &[ToolSpec]) -> String {
    let messages: Vec<Value> = messages
        .iter()
        .map(|m| {
            let mut message = json!({ "role": m.role.as_str(), "content": m.content });
            if !m.tool_calls.is_empty() {
                message["tool_calls"] = m
                    .tool_calls
                    .iter()
                    .map(|c| {
                        let arguments: Value = serde_json::from_str(&c.arguments).expect("test arguments are JSON");
                        json!({ "type": "function", "function": { "name": c.name, "arguments": arguments } })
                    })
                    .collect();
            }
            if let Some(reasoning) = &m.reasoning {
                message["reasoning_content"] = json!(reasoning);
            }
            message
        })
        .collect();
    let mut context = json!({ "messages": messages, "add_generation_prompt": true });
    if !tools.is_empty() {
        context["tools"] = tools
            .iter()
            .map(|t| {
                let parameters: Value =
                    serde_json::from_str(&t.parameters).expect("test schema is JSON");
                json!({ "type": "function", "function": {
                    "name": t.name, "description": t.description, "parameters": parameters } })
            })
            .collect();
    }

    let mut env = Environment::new();
    env.set_syntax(
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("syntax config"),
    );
    env.add_filter("tojson", python_tojson);
    env.add_template("chat", template).expect("template parses");
    env.get_template("chat")
        .and_then(|t| t.render(Serde(&context)))
        .expect("template renders")
}

fn render_ours(template: &ChatMl, messages: &[Message], tools: &[ToolSpec]) -> String {
    template
        .render(
            messages,
            &RenderOptions {
                tools,
                ..Default::default()
            },
        )
        .into()
}

fn tools() -> Vec<ToolSpec> {
    let weather = r#"{"type":"object","properties":{"city":{"type":"string","description":"City, e.g. Zürich"},"unit":{"type":"string","enum":["c","f"]}},"required":["city"]}"#;
    let search =
        r#"{"type":"object","properties":{"query":{"type":"string"},"limit":{"type":"integer"}}}"#;
    vec![
        ToolSpec {
            name: "get_weather".into(),
            description: "Current weather for a city".into(),
            parameters: weather.into(),
            raw: String::new(),
        },
        ToolSpec {
            name: "search".into(),
            description: "Search the web \"quickly\"".into(),
            parameters: search.into(),
            raw: String::new(),
        },
    ]
}

fn msg(role: Role, content: &str) -> Message {
    Message::new(role, content)
}

fn calling(content: &str, calls: &[(&str, &str)]) -> Message {
    Message {
        role: Role::Assistant,
        content: content.into(),
        tool_calls: calls
            .iter()
            .enumerate()
            .map(|(i, (name, arguments))| ToolCall {
                id: format!("call_{i}"),
                name: (*name).into(),
                arguments: (*arguments).into(),
            })
            .collect(),
        ..Default::default()
    }
}

struct Case {
    name: &'static str,
    messages: Vec<Message>,
    /// Tools offered, or tool calls / results in the history: SmolLM2's template
    /// has no notion of these.
    uses_tools: bool,
}

fn cases() -> Vec<Case> {
    let mut reasoned = msg(Role::Assistant, "4");
    reasoned.reasoning = Some("2 plus 2 is 4.".into());
    let one_call = calling("", &[("get_weather", r#"{"city": "Paris"}"#)]);
    // Different key spacing from the client; rendered canonically.
    let two_calls = calling(
        "Checking both.",
        &[
            ("get_weather", r#"{"city":"Zürich","unit":"c"}"#),
            ("search", r#"{ "query" : "weather\nnews", "limit": 3 }"#),
        ],
    );
    vec![
        Case {
            name: "system + user",
            messages: vec![msg(Role::System, "Be brief."), msg(Role::User, "Hi")],
            uses_tools: false,
        },
        Case {
            name: "user without system",
            messages: vec![msg(Role::User, "What is 2+2?")],
            uses_tools: false,
        },
        Case {
            name: "multi-turn",
            messages: vec![
                msg(Role::System, "Be brief."),
                msg(Role::User, "Hi"),
                msg(Role::Assistant, "Hello!"),
                msg(Role::User, "Bye"),
            ],
            uses_tools: false,
        },
        Case {
            name: "assistant with reasoning",
            messages: vec![msg(Role::User, "2+2?"), reasoned, msg(Role::User, "thanks")],
            uses_tools: false,
        },
        Case {
            name: "tools offered",
            messages: vec![msg(Role::User, "Weather in Paris?")],
            uses_tools: true,
        },
        Case {
            name: "tools offered with system",
            messages: vec![
                msg(Role::System, "Be brief."),
                msg(Role::User, "Weather in Paris?"),
            ],
            uses_tools: true,
        },
        Case {
            name: "one call and its result",
            messages: vec![
                msg(Role::User, "Weather in Paris?"),
                one_call.clone(),
                msg(Role::Tool, "18 C, sunny"),
            ],
            uses_tools: true,
        },
        Case {
            name: "two calls and two results",
            messages: vec![
                msg(Role::System, "Be brief."),
                msg(Role::User, "Weather in Zürich, and news?"),
                two_calls,
                msg(Role::Tool, "{\"temp\": 3}"),
                msg(Role::Tool, "no news"),
                msg(Role::Assistant, "3 C and no news."),
                msg(Role::User, "And Paris?"),
                one_call,
            ],
            uses_tools: true,
        },
    ]
}

#[test]
fn chatml_matches_smollm2_gguf_template() {
    let template_text = smollm2_template();
    let ours = ChatMl::from_template(&template_text).expect("SmolLM2's template is ChatML");
    for case in cases().iter().filter(|c| !c.uses_tools) {
        assert_eq!(
            render_ours(&ours, &case.messages, &[]),
            render_jinja(&template_text, &case.messages, &[]),
            "{}",
            case.name
        );
    }
}

#[test]
fn chatml_matches_qwen25_template() {
    let ours = ChatMl::from_template(QWEN25_TEMPLATE).expect("Qwen2.5's template is ChatML");
    assert_eq!(ours.default_system.as_deref(), Some(QWEN25_DEFAULT_SYSTEM));
    let tools = tools();
    for case in cases() {
        let offered: &[ToolSpec] = if case.uses_tools { &tools } else { &[] };
        assert_eq!(
            render_ours(&ours, &case.messages, offered),
            render_jinja(QWEN25_TEMPLATE, &case.messages, offered),
            "{}",
            case.name
        );
    }
}

/// SmolLM2's template cannot render tools, so SmolLM2 uses Qwen2.5's tool format.
/// The only difference is the default system text each template inserts when the
/// conversation has no system message.
#[test]
fn smollm2_with_tools_is_qwen25_with_smollm2_default_system() {
    let template_text = smollm2_template();
    let ours = ChatMl::from_template(&template_text).expect("SmolLM2's template is ChatML");
    let smollm2_default = ours
        .default_system
        .clone()
        .expect("SmolLM2 has a default system message");
    let tools = tools();
    for case in cases() {
        let offered: &[ToolSpec] = if case.uses_tools { &tools } else { &[] };
        let qwen = render_jinja(QWEN25_TEMPLATE, &case.messages, offered);
        let expected = if case.messages.first().map(|m| m.role) == Some(Role::System) {
            qwen
        } else {
            qwen.replacen(QWEN25_DEFAULT_SYSTEM, &smollm2_default, 1)
        };
        assert_eq!(
            render_ours(&ours, &case.messages, offered),
            expected,
            "{}",
            case.name
        );
    }
}

#[test]
fn tools_block_is_what_the_template_prints() {
    let tools = tools();
    let jinja = render_jinja(QWEN25_TEMPLATE, &[msg(Role::System, "S")], &tools);
    let block = ds4_chat::tools::Hermes.tools_block(&tools);
    assert_eq!(
        jinja,
        format!("<|im_start|>system\nS\n\n{block}<|im_end|>\n<|im_start|>assistant\n")
    );
}
