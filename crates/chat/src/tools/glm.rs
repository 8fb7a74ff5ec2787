//! GLM-4.5 / GLM-4.6's call syntax:
//!
//! ```text
//! <tool_call>NAME
//! <arg_key>K</arg_key>
//! <arg_value>V</arg_value>
//! </tool_call>
//! ```
//!
//! Values are written bare: a string as itself, anything else as `tojson` prints it
//! (`v | tojson(ensure_ascii=False) if v is not string else v`). Reading back, a value
//! is a string unless the tool's schema types the argument otherwise.

use serde_json::{Map, Value};

use super::markup::{self, BlockParser, Schemas};
use super::{ParsedCall, ToolCall, ToolChoice, ToolParser, ToolSpec, ToolSyntax};

const KEY_OPEN: &str = "<arg_key>";
const KEY_CLOSE: &str = "</arg_key>";
const VALUE_OPEN: &str = "<arg_value>";
const VALUE_CLOSE: &str = "</arg_value>";

const TOOLS_INTRO: &str = "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n";

/// The instructions after the `<tools>` listing, verbatim from the template.
const CALL_FORMAT: &str = "</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>";

/// GLM-4.5 / 4.6's tool syntax.
///
/// Where the template puts the pieces: [`ToolSyntax::tools_block`] is the system
/// turn right after `[gMASK]<sop><|system|>\n`. [`ToolSyntax::render_calls`] follows
/// the assistant turn's `<think>…</think>` and content; every call starts with its
/// own `"\n"`, written whether or not there is content.
pub struct Glm;

impl ToolSyntax for Glm {
    fn name(&self) -> &'static str {
        "glm"
    }

    fn tools_block(&self, tools: &[ToolSpec]) -> String {
        let mut out = String::from(TOOLS_INTRO);
        for tool in tools {
            out.push_str(&markup::py_json(&markup::tool_object(tool)));
            out.push('\n');
        }
        out.push_str(CALL_FORMAT);
        out
    }

    fn render_calls(&self, calls: &[ToolCall]) -> String {
        let mut out = String::new();
        for call in calls {
            out.push_str(&format!("\n{}{}\n", markup::CALL_OPEN, call.name));
            for (key, value) in markup::argument_members(&call.arguments) {
                let value = markup::bare_value(&value);
                out.push_str(&format!(
                    "{KEY_OPEN}{key}{KEY_CLOSE}\n{VALUE_OPEN}{value}{VALUE_CLOSE}\n"
                ));
            }
            out.push_str(markup::CALL_CLOSE);
        }
        out
    }

    /// The newline is the one the template writes before every call.
    fn forced_prefix(&self, choice: &ToolChoice) -> Option<String> {
        let opener = format!("\n{}", markup::CALL_OPEN);
        match choice {
            ToolChoice::Auto | ToolChoice::None => None,
            ToolChoice::Required => Some(opener),
            ToolChoice::Named(name) => Some(format!("{opener}{name}\n")),
        }
    }

    fn parser(&self, tools: &[ToolSpec]) -> Box<dyn ToolParser> {
        Box::new(BlockParser::new(parse_body, tools))
    }
}

/// Reads `NAME` and its `<arg_key>`/`<arg_value>` pairs (between the call tags).
/// GLM-4.7 drops the newlines between the tags; that reads the same.
fn parse_body(body: &str, schemas: &Schemas) -> Result<ParsedCall, String> {
    let name_end = body.find(KEY_OPEN).unwrap_or(body.len());
    let name = markup::tag_name(&body[..name_end], "function")?;
    let mut rest = &body[name_end..];
    let mut args = Map::new();
    while !rest.trim().is_empty() {
        let after = markup::after_tag(rest, KEY_OPEN).ok_or("unexpected text between arguments")?;
        let (key, after) = markup::split_at_tag(after, KEY_CLOSE).ok_or("unclosed <arg_key>")?;
        let key = markup::tag_name(key, "argument")?;
        let after = markup::after_tag(after, VALUE_OPEN)
            .ok_or_else(|| format!("argument `{key}` has no <arg_value>"))?;
        let (value, after) = markup::split_value(after, VALUE_CLOSE, &[KEY_OPEN])
            .ok_or_else(|| format!("argument `{key}` is not closed"))?;
        // Surrounding whitespace is layout, as vLLM's and llama.cpp's readers take it.
        markup::insert_argument(&mut args, key, schemas.typed_value(name, key, value.trim()))?;
        rest = after;
    }
    Ok(ParsedCall {
        name: name.to_string(),
        arguments: Value::Object(args).to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::super::markup::test_support::{parse, tool};
    use super::super::{ParsedTurn, ToolEvent};
    use super::*;

    fn call(name: &str, arguments: &str) -> ParsedCall {
        ParsedCall {
            name: name.to_string(),
            arguments: arguments.to_string(),
        }
    }

    fn text(s: &str) -> ToolEvent {
        ToolEvent::Text(s.to_string())
    }

    fn weather_tools() -> Vec<ToolSpec> {
        vec![tool(
            "get_weather",
            r#"{"type":"object","properties":{"city":{"type":"string"},"date":{"type":"string"},"days":{"type":"integer"},"verbose":{"type":"boolean"},"filters":{"type":"object"}}}"#,
        )]
    }

    const BEIJING: &str = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n<arg_key>date</arg_key>\n<arg_value>2025-08-01</arg_value>\n</tool_call>";
    const BEIJING_ARGS: &str = r#"{"city":"Beijing","date":"2025-08-01"}"#;

    // Recorded GLM-4.5 outputs from vLLM, tests/tool_use/test_glm4_moe_tool_parser.py.
    #[test]
    fn vllm_indented_calls() {
        let output = "<tool_call>get_current_weather\n    <arg_key>city</arg_key>\n    <arg_value>Dallas</arg_value>\n    <arg_key>state</arg_key>\n    <arg_value>TX</arg_value>\n    <arg_key>unit</arg_key>\n    <arg_value>fahrenheit</arg_value>\n    </tool_call>\n    <tool_call>get_current_weather\n    <arg_key>city</arg_key>\n    <arg_value>Orlando</arg_value>\n    <arg_key>state</arg_key>\n    <arg_value>FL</arg_value>\n    <arg_key>unit</arg_key>\n    <arg_value>fahrenheit</arg_value>\n    </tool_call>";
        let (events, turn) = parse(&Glm, &[], output);
        let dallas = call(
            "get_current_weather",
            r#"{"city":"Dallas","state":"TX","unit":"fahrenheit"}"#,
        );
        let orlando = call(
            "get_current_weather",
            r#"{"city":"Orlando","state":"FL","unit":"fahrenheit"}"#,
        );
        assert_eq!(
            events,
            vec![
                ToolEvent::Call(dallas.clone()),
                text("\n    "),
                ToolEvent::Call(orlando.clone()),
            ]
        );
        assert_eq!(turn.content, "");
        assert_eq!(turn.calls, vec![dallas, orlando]);
        assert_eq!(turn.calls_raw, output);
    }

    #[test]
    fn vllm_content_before_call() {
        let output = format!("I will help you get the weather.{BEIJING}");
        let (events, turn) = parse(&Glm, &weather_tools(), &output);
        assert_eq!(
            events,
            vec![
                text("I will help you get the weather."),
                ToolEvent::Call(call("get_weather", BEIJING_ARGS)),
            ]
        );
        assert_eq!(turn.content, "I will help you get the weather.");
    }

    #[test]
    fn vllm_thinking_and_content_before_call() {
        let output = format!(
            "<think>I want to get the weather.</think>\n\nI will help you get the weather.\n{BEIJING}"
        );
        let (_, turn) = parse(&Glm, &weather_tools(), &output);
        assert_eq!(
            turn.content,
            "<think>I want to get the weather.</think>\n\nI will help you get the weather."
        );
        assert_eq!(turn.calls_raw, format!("\n{BEIJING}"));
        assert_eq!(turn.calls, vec![call("get_weather", BEIJING_ARGS)]);
    }

    #[test]
    fn vllm_mixed_content_and_two_calls() {
        let shanghai = BEIJING.replace("Beijing", "Shanghai");
        let between = "\n\nmeaningwhile, I will also check the weather in Shanghai.\n\n";
        let output =
            format!("I will help you get the weather info.\n\n{BEIJING}{between}{shanghai}");
        let (events, turn) = parse(&Glm, &weather_tools(), &output);
        let second = call("get_weather", r#"{"city":"Shanghai","date":"2025-08-01"}"#);
        assert_eq!(
            events,
            vec![
                text("I will help you get the weather info.\n\n"),
                ToolEvent::Call(call("get_weather", BEIJING_ARGS)),
                text(between),
                ToolEvent::Call(second.clone()),
            ]
        );
        assert_eq!(turn.content, "I will help you get the weather info.");
        assert_eq!(turn.calls, vec![call("get_weather", BEIJING_ARGS), second]);
    }

    #[test]
    fn vllm_empty_arguments() {
        let (_, turn) = parse(&Glm, &[], "<tool_call>get_current_time\n</tool_call>");
        assert_eq!(turn.calls, vec![call("get_current_time", "{}")]);
    }

    #[test]
    fn vllm_malformed_key() {
        let output = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Seattle</arg_value>\n<arg_key>incomplete_arg\n<arg_value>value</arg_value>\n</tool_call>";
        let (events, turn) = parse(&Glm, &[], output);
        let reason = "unclosed <arg_key>".to_string();
        assert_eq!(
            events,
            vec![
                text(output),
                ToolEvent::Malformed {
                    reason: reason.clone()
                }
            ]
        );
        assert_eq!(
            turn,
            ParsedTurn {
                content: output.to_string(),
                malformed: Some(reason),
                ..ParsedTurn::default()
            }
        );
    }

    #[test]
    fn vllm_incomplete_call() {
        let output = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n<arg_key>date</arg_key>\n<arg_value>2025-08-01</arg_value>";
        let (events, turn) = parse(&Glm, &weather_tools(), output);
        let reason = "unclosed tool call".to_string();
        assert_eq!(
            events,
            vec![
                text(output),
                ToolEvent::Malformed {
                    reason: reason.clone()
                }
            ]
        );
        assert!(turn.calls.is_empty());
        assert_eq!(turn.content, output);
        assert_eq!(turn.malformed, Some(reason));
    }

    #[test]
    fn values_are_typed_by_schema() {
        let output = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>2025</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>verbose</arg_key>\n<arg_value>true</arg_value>\n<arg_key>filters</arg_key>\n<arg_value>{\"rain\": [1, 2]}</arg_value>\n<arg_key>note</arg_key>\n<arg_value>42</arg_value>\n</tool_call>";
        let (_, turn) = parse(&Glm, &weather_tools(), output);
        assert_eq!(
            turn.calls,
            vec![call(
                "get_weather",
                r#"{"city":"2025","days":3,"verbose":true,"filters":{"rain":[1,2]},"note":"42"}"#
            )]
        );
        // A non-JSON value for a typed argument stays the string the model wrote.
        let output =
            "<tool_call>get_weather<arg_key>days</arg_key><arg_value>three</arg_value></tool_call>";
        let (_, turn) = parse(&Glm, &weather_tools(), output);
        assert_eq!(turn.calls, vec![call("get_weather", r#"{"days":"three"}"#)]);
    }

    #[test]
    fn multiline_values_and_close_tag_lookalikes() {
        let code = "if a < b:\n    print(\"</arg_value> is a tag\")\n<arg_key> too";
        let output = format!(
            "<tool_call>run\n<arg_key>code</arg_key>\n<arg_value>{code}</arg_value>\n<arg_key>lang</arg_key>\n<arg_value>py</arg_value>\n</tool_call>"
        );
        let (_, turn) = parse(&Glm, &[], &output);
        let args = serde_json::json!({"code": code, "lang": "py"}).to_string();
        assert_eq!(turn.calls, vec![call("run", &args)]);
    }

    #[test]
    fn garbage_blocks_become_text_and_later_calls_still_parse() {
        let cases = [
            ("<tool_call></tool_call>", "bad function name \"\""),
            ("<tool_call>{\"name\": \"f\"}</tool_call>", "bad function name \"{\\\"name\\\": \\\"f\\\"}\""),
            ("<tool_call>f\n<arg_key>a</arg_key>\n</tool_call>", "argument `a` has no <arg_value>"),
            ("<tool_call>f\n<arg_key>a</arg_key><arg_value>1</tool_call>", "argument `a` is not closed"),
            ("<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value>junk</tool_call>", "argument `a` is not closed"),
            (
                "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>a</arg_key><arg_value>2</arg_value></tool_call>",
                "argument `a` given twice",
            ),
        ];
        for (bad, reason) in cases {
            let output = format!("x {bad} y{BEIJING}");
            let (events, turn) = parse(&Glm, &weather_tools(), &output);
            assert_eq!(
                events,
                vec![
                    text(&format!("x {bad}")),
                    ToolEvent::Malformed {
                        reason: reason.to_string()
                    },
                    text(" y"),
                    ToolEvent::Call(call("get_weather", BEIJING_ARGS)),
                ],
                "{bad}"
            );
            assert_eq!(turn.content, format!("x {bad} y"));
            assert_eq!(turn.malformed.as_deref(), Some(reason));
        }
    }

    #[test]
    fn render_calls_matches_the_template() {
        // Expected bytes: the GLM-4.5 template rendered with jinja2 (trim_blocks,
        // lstrip_blocks, tojson = json.dumps), after the content `\nLet me check.`.
        let calls = [
            ToolCall {
                id: "a".into(),
                name: "get_current_weather".into(),
                arguments: r#"{"city":"Paris\nFrance","days":3,"opts":{"a":[1,2.5,true,null],"é":"x"},"flag":false}"#.into(),
            },
            ToolCall {
                id: "b".into(),
                name: "noargs".into(),
                arguments: "{}".into(),
            },
        ];
        let rendered = Glm.render_calls(&calls);
        assert_eq!(
            rendered,
            "\n<tool_call>get_current_weather\n<arg_key>city</arg_key>\n<arg_value>Paris\nFrance</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>opts</arg_key>\n<arg_value>{\"a\": [1, 2.5, true, null], \"é\": \"x\"}</arg_value>\n<arg_key>flag</arg_key>\n<arg_value>false</arg_value>\n</tool_call>\n<tool_call>noargs\n</tool_call>"
        );
        assert_eq!(Glm.render_calls(&[]), "");

        let tools = [tool(
            "get_current_weather",
            r#"{"type":"object","properties":{"days":{"type":"integer"},"opts":{"type":"object"},"flag":{"type":"boolean"}}}"#,
        )];
        let (_, turn) = parse(&Glm, &tools, &format!("Let me check.{rendered}"));
        assert_eq!(turn.content, "Let me check.");
        assert_eq!(turn.calls_raw, rendered);
        assert_eq!(
            turn.calls,
            vec![
                call(
                    "get_current_weather",
                    r#"{"city":"Paris\nFrance","days":3,"opts":{"a":[1,2.5,true,null],"é":"x"},"flag":false}"#
                ),
                call("noargs", "{}"),
            ]
        );
    }

    #[test]
    fn tools_block_matches_the_template() {
        // Expected bytes: the template's system turn rendered with jinja2 for this tool.
        let raw = r#"{"type":"function","function":{"name":"get_current_weather","description":" Get the current weather\n","parameters":{"type":"object","properties":{"city":{"type":"string","description":"The city name"},"unit":{"type":"string","enum":["fahrenheit","celsius"]},"days":{"type":["integer","null"],"default":1,"minimum":0.5}},"required":["city"],"additionalProperties":false},"strict":true}}"#;
        let spec = ToolSpec {
            name: "get_current_weather".into(),
            description: " Get the current weather\n".into(),
            parameters: r#"{"type":"object","properties":{"city":{"type":"string","description":"The city name"},"unit":{"type":"string","enum":["fahrenheit","celsius"]},"days":{"type":["integer","null"],"default":1,"minimum":0.5}},"required":["city"],"additionalProperties":false}"#.into(),
            raw: raw.into(),
        };
        let expected = "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_current_weather\", \"description\": \" Get the current weather\\n\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\", \"description\": \"The city name\"}, \"unit\": {\"type\": \"string\", \"enum\": [\"fahrenheit\", \"celsius\"]}, \"days\": {\"type\": [\"integer\", \"null\"], \"default\": 1, \"minimum\": 0.5}}, \"required\": [\"city\"], \"additionalProperties\": false}, \"strict\": true}}\n</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>";
        assert_eq!(Glm.tools_block(std::slice::from_ref(&spec)), expected);

        // Without the client's definition the tool object is rebuilt from the fields.
        let bare = ToolSpec {
            raw: String::new(),
            ..spec
        };
        assert!(Glm.tools_block(&[bare]).contains(
            "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_current_weather\", \"description\": \" Get the current weather\\n\", \"parameters\": {\"type\": \"object\""
        ));
    }

    #[test]
    fn forced_prefixes_start_a_call() {
        assert_eq!(Glm.forced_prefix(&ToolChoice::Auto), None);
        assert_eq!(Glm.forced_prefix(&ToolChoice::None), None);
        let required = Glm.forced_prefix(&ToolChoice::Required).unwrap();
        assert_eq!(required, "\n<tool_call>");
        let named = Glm
            .forced_prefix(&ToolChoice::Named("get_weather".into()))
            .unwrap();
        assert_eq!(named, "\n<tool_call>get_weather\n");

        let rest = "<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n<arg_key>date</arg_key>\n<arg_value>2025-08-01</arg_value>\n</tool_call>";
        let (events, turn) = parse(&Glm, &weather_tools(), &format!("{named}{rest}"));
        assert_eq!(
            events,
            vec![
                text("\n"),
                ToolEvent::Call(call("get_weather", BEIJING_ARGS))
            ]
        );
        assert_eq!(turn.content, "");
        assert_eq!(turn.calls_raw, format!("{named}{rest}"));
        let (_, turn) = parse(
            &Glm,
            &weather_tools(),
            &format!("{required}get_weather\n{rest}"),
        );
        assert_eq!(turn.calls, vec![call("get_weather", BEIJING_ARGS)]);
    }
}
