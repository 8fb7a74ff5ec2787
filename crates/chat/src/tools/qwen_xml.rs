//! Qwen3-Coder's XML call syntax:
//!
//! ```text
//! <tool_call>
//! <function=NAME>
//! <parameter=P>
//! VALUE
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! Values are written bare: a string as itself, anything else as `tojson` prints it
//! (the template line `args_value | string if args_value is string else args_value |
//! tojson | safe`; the first Qwen3-Coder release wrote scalars with Python's `str`).
//! Reading back, a value is a string unless the tool's schema types the parameter
//! otherwise.

use serde_json::{Map, Value};

use super::markup::{self, BlockParser, Schemas};
use super::{ParsedCall, ToolCall, ToolChoice, ToolParser, ToolSpec, ToolSyntax};

const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";

/// The instructions after the `<tools>` listing, verbatim from the template.
const CALL_FORMAT: &str = "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>";

/// Qwen3-Coder's tool syntax.
///
/// Where the template puts the pieces: [`ToolSyntax::tools_block`] follows the system
/// text (or `You are Qwen, a helpful AI assistant that can interact with a computer
/// to solve tasks.` when there is none) after `"\n\n"`, inside the system turn.
/// [`ToolSyntax::render_calls`] starts with the `"\n"` the template writes after
/// non-empty content; with no content the template writes `<|im_start|>assistant`
/// straight before the first call's own `"\n<tool_call>"`, so a renderer that has
/// already written `<|im_start|>assistant\n` drops the calls' two leading newlines.
pub struct QwenXml;

impl ToolSyntax for QwenXml {
    fn name(&self) -> &'static str {
        "qwen-xml"
    }

    fn tools_block(&self, tools: &[ToolSpec]) -> String {
        let mut out =
            String::from("# Tools\n\nYou have access to the following functions:\n\n<tools>");
        for tool in tools {
            let function = markup::function_object(tool);
            out.push_str(&format!("\n<function>\n<name>{}</name>", tool.name));
            if let Some(description) = function.get("description") {
                let description = markup::py_str(description);
                out.push_str(&format!(
                    "\n<description>{}</description>",
                    description.trim()
                ));
            }
            out.push_str("\n<parameters>");
            let parameters = function.get("parameters");
            let properties = parameters
                .and_then(|p| p.get("properties"))
                .and_then(Value::as_object);
            for (name, fields) in properties.into_iter().flatten() {
                out.push_str(&format!("\n<parameter>\n<name>{name}</name>"));
                if let Some(kind) = fields.get("type") {
                    out.push_str(&format!("\n<type>{}</type>", markup::py_str(kind)));
                }
                if let Some(description) = fields.get("description") {
                    let description = markup::py_str(description);
                    out.push_str(&format!(
                        "\n<description>{}</description>",
                        description.trim()
                    ));
                }
                push_extra_keys(&mut out, fields, &["name", "type", "description"]);
                out.push_str("\n</parameter>");
            }
            if let Some(parameters) = parameters {
                push_extra_keys(&mut out, parameters, &["type", "properties"]);
            }
            out.push_str("\n</parameters>");
            push_extra_keys(
                &mut out,
                &function,
                &["type", "name", "description", "parameters"],
            );
            out.push_str("\n</function>");
        }
        out.push_str("\n</tools>");
        out.push_str(CALL_FORMAT);
        out
    }

    fn render_calls(&self, calls: &[ToolCall]) -> String {
        if calls.is_empty() {
            return String::new();
        }
        let mut out = String::from("\n");
        for call in calls {
            out.push_str(&format!("\n<tool_call>\n{FUNCTION_OPEN}{}>\n", call.name));
            for (name, value) in markup::argument_members(&call.arguments) {
                let value = markup::bare_value(&value);
                out.push_str(&format!("{PARAM_OPEN}{name}>\n{value}\n{PARAM_CLOSE}\n"));
            }
            out.push_str(&format!("{FUNCTION_CLOSE}\n{}", markup::CALL_CLOSE));
        }
        out
    }

    fn forced_prefix(&self, choice: &ToolChoice) -> Option<String> {
        let opener = format!("{}\n{FUNCTION_OPEN}", markup::CALL_OPEN);
        match choice {
            ToolChoice::Auto | ToolChoice::None => None,
            ToolChoice::Required => Some(opener),
            ToolChoice::Named(name) => Some(format!("{opener}{name}>\n")),
        }
    }

    fn parser(&self, tools: &[ToolSpec]) -> Box<dyn ToolParser> {
        Box::new(BlockParser::new(parse_body, tools))
    }
}

/// The template's `render_extra_keys`: each member not in `handled` as
/// `<key>value</key>`, containers through `tojson`, scalars through `| string`.
fn push_extra_keys(out: &mut String, object: &Value, handled: &[&str]) {
    let Some(members) = object.as_object() else {
        return;
    };
    for (key, value) in members
        .iter()
        .filter(|(k, _)| !handled.contains(&k.as_str()))
    {
        let text = match value {
            Value::Object(_) | Value::Array(_) => markup::py_json(value),
            scalar => markup::py_str(scalar),
        };
        out.push_str(&format!("\n<{key}>{text}</{key}>"));
    }
}

/// Reads `<function=NAME>` and its `<parameter=P>` blocks (between the call tags).
fn parse_body(body: &str, schemas: &Schemas) -> Result<ParsedCall, String> {
    let rest = markup::after_tag(body, FUNCTION_OPEN).ok_or("expected <function=NAME>")?;
    let (name, mut rest) = markup::split_at_tag(rest, ">").ok_or("unterminated <function=")?;
    let name = markup::tag_name(name, "function")?;
    let mut args = Map::new();
    loop {
        if let Some(after) = markup::after_tag(rest, FUNCTION_CLOSE) {
            if !after.trim().is_empty() {
                return Err("text after </function>".to_string());
            }
            break;
        }
        let Some(after) = markup::after_tag(rest, PARAM_OPEN) else {
            return Err(if rest.trim().is_empty() {
                "missing </function>".to_string()
            } else {
                format!("unexpected text in function `{name}`")
            });
        };
        let (param, after) = markup::split_at_tag(after, ">").ok_or("unterminated <parameter=")?;
        let param = markup::tag_name(param, "parameter")?;
        let (value, after) = markup::split_value(after, PARAM_CLOSE, &[PARAM_OPEN, FUNCTION_CLOSE])
            .ok_or_else(|| format!("parameter `{param}` is not closed"))?;
        // The template puts the value on lines of its own.
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        markup::insert_argument(&mut args, param, schemas.typed_value(name, param, value))?;
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

    /// The tools of vLLM's `tests/tool_use/test_qwen3coder_tool_parser.py` (`sample_tools`).
    fn vllm_tools() -> Vec<ToolSpec> {
        vec![
            tool(
                "get_current_weather",
                r#"{"type":"object","properties":{"city":{"type":"string","description":"The city name"},"state":{"type":"string","description":"The state code"},"unit":{"type":"string","enum":["fahrenheit","celsius"]}},"required":["city","state"]}"#,
            ),
            tool(
                "calculate_area",
                r#"{"type":"object","properties":{"shape":{"type":"string"},"dimensions":{"type":"object"},"precision":{"type":"integer"}}}"#,
            ),
        ]
    }

    fn call(name: &str, arguments: &str) -> ParsedCall {
        ParsedCall {
            name: name.to_string(),
            arguments: arguments.to_string(),
        }
    }

    fn text(s: &str) -> ToolEvent {
        ToolEvent::Text(s.to_string())
    }

    const DALLAS: &str = "<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n<parameter=state>\nTX\n</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n</function>\n</tool_call>";
    const DALLAS_ARGS: &str = r#"{"city":"Dallas","state":"TX","unit":"fahrenheit"}"#;

    // Recorded Qwen3-Coder outputs from vLLM, tests/tool_use/test_qwen3coder_tool_parser.py.
    #[test]
    fn vllm_single_call() {
        let (events, turn) = parse(&QwenXml, &vllm_tools(), DALLAS);
        assert_eq!(
            events,
            vec![ToolEvent::Call(call("get_current_weather", DALLAS_ARGS))]
        );
        assert_eq!(turn.content, "");
        assert_eq!(turn.calls_raw, DALLAS);
        assert_eq!(turn.malformed, None);
    }

    #[test]
    fn vllm_call_after_content() {
        let output = format!("Sure! Let me check the weather for you.{DALLAS}");
        let (events, turn) = parse(&QwenXml, &vllm_tools(), &output);
        assert_eq!(
            events,
            vec![
                text("Sure! Let me check the weather for you."),
                ToolEvent::Call(call("get_current_weather", DALLAS_ARGS)),
            ]
        );
        assert_eq!(turn.content, "Sure! Let me check the weather for you.");
        assert_eq!(turn.calls_raw, DALLAS);
    }

    #[test]
    fn vllm_typed_multiline_object_and_integer() {
        let output = "<tool_call>\n<function=calculate_area>\n<parameter=shape>\nrectangle\n</parameter>\n<parameter=dimensions>\n{\"width\": 10, \n \"height\": 20}\n</parameter>\n<parameter=precision>\n2\n</parameter>\n</function>\n</tool_call>";
        let (_, turn) = parse(&QwenXml, &vllm_tools(), output);
        assert_eq!(
            turn.calls,
            vec![call(
                "calculate_area",
                r#"{"shape":"rectangle","dimensions":{"width":10,"height":20},"precision":2}"#
            )]
        );
    }

    #[test]
    fn vllm_parallel_calls() {
        let orlando = DALLAS
            .replace("Dallas", "Orlando")
            .replace("TX", "FL")
            .replace("fahrenheit", "celsius");
        let output = format!("{DALLAS}\n{orlando}");
        let (events, turn) = parse(&QwenXml, &vllm_tools(), &output);
        let second = call(
            "get_current_weather",
            r#"{"city":"Orlando","state":"FL","unit":"celsius"}"#,
        );
        assert_eq!(
            events,
            vec![
                ToolEvent::Call(call("get_current_weather", DALLAS_ARGS)),
                text("\n"),
                ToolEvent::Call(second.clone()),
            ]
        );
        assert_eq!(
            turn.calls,
            vec![call("get_current_weather", DALLAS_ARGS), second]
        );
        assert_eq!(turn.calls_raw, output);
    }

    #[test]
    fn vllm_type_conversion() {
        let tools = [tool(
            "test_types",
            r#"{"type":"object","properties":{"int_param":{"type":"integer"},"float_param":{"type":"float"},"bool_param":{"type":"boolean"},"str_param":{"type":"string"},"obj_param":{"type":"object"}}}"#,
        )];
        let output = "<tool_call>\n<function=test_types>\n<parameter=int_param>\n42\n</parameter>\n<parameter=float_param>\n3.14\n</parameter>\n<parameter=bool_param>\ntrue\n</parameter>\n<parameter=str_param>\nhello world\n</parameter>\n<parameter=obj_param>\n{\"key\": \"value\"}\n</parameter>\n</function>\n</tool_call>";
        let (_, turn) = parse(&QwenXml, &tools, output);
        assert_eq!(
            turn.calls,
            vec![call(
                "test_types",
                r#"{"int_param":42,"float_param":3.14,"bool_param":true,"str_param":"hello world","obj_param":{"key":"value"}}"#
            )]
        );
    }

    #[test]
    fn strings_stay_strings_and_bad_json_falls_back() {
        let tools = [tool(
            "f",
            r#"{"type":"object","properties":{"s":{"type":"string"},"n":{"type":"number"},"a":{"type":"array"}}}"#,
        )];
        let output = "<tool_call>\n<function=f>\n<parameter=s>\n007\n</parameter>\n<parameter=n>\nabout 3\n</parameter>\n<parameter=a>\n[1, \"two\"]\n</parameter>\n<parameter=extra>\n12\n</parameter>\n</function>\n</tool_call>";
        let (_, turn) = parse(&QwenXml, &tools, output);
        assert_eq!(
            turn.calls,
            vec![call(
                "f",
                r#"{"s":"007","n":"about 3","a":[1,"two"],"extra":"12"}"#
            )]
        );
    }

    #[test]
    fn multiline_values_and_close_tag_lookalikes() {
        let output = "I'll write it.\n\n<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.html\n</parameter>\n<parameter=content>\n<p>a < b</p>\nwrite </parameter> to end one\n\n</parameter>\n<parameter=empty>\n\n</parameter>\n</function>\n</tool_call>";
        let (events, turn) = parse(&QwenXml, &[], output);
        let content = "<p>a < b</p>\nwrite </parameter> to end one\n";
        let args =
            serde_json::json!({"path": "/tmp/a.html", "content": content, "empty": ""}).to_string();
        assert_eq!(
            events,
            vec![
                text("I'll write it.\n\n"),
                ToolEvent::Call(call("write_file", &args))
            ]
        );
        assert_eq!(turn.content, "I'll write it.");
        assert!(turn.calls_raw.starts_with("\n\n<tool_call>"));
    }

    #[test]
    fn text_between_and_after_calls_is_kept_raw() {
        let output = format!("Checking both.\n{DALLAS}\nand then\n{DALLAS}\n");
        let (events, turn) = parse(&QwenXml, &vllm_tools(), &output);
        let dallas = ToolEvent::Call(call("get_current_weather", DALLAS_ARGS));
        assert_eq!(
            events,
            vec![
                text("Checking both.\n"),
                dallas.clone(),
                text("\nand then\n"),
                dallas,
                text("\n"),
            ]
        );
        assert_eq!(turn.content, "Checking both.");
        assert_eq!(turn.calls.len(), 2);
        assert_eq!(format!("{}{}", turn.content, turn.calls_raw), output);
    }

    #[test]
    fn unclosed_call_becomes_text() {
        let output =
            "Let me look.\n<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDal";
        let (events, turn) = parse(&QwenXml, &vllm_tools(), output);
        assert_eq!(
            events,
            vec![
                text(output),
                ToolEvent::Malformed {
                    reason: "unclosed tool call".to_string()
                },
            ]
        );
        assert_eq!(
            turn,
            ParsedTurn {
                content: output.to_string(),
                malformed: Some("unclosed tool call".to_string()),
                ..ParsedTurn::default()
            }
        );
    }

    #[test]
    fn garbage_blocks_become_text_and_later_calls_still_parse() {
        let cases = [
            ("<tool_call>{\"name\": \"f\"}</tool_call>", "expected <function=NAME>"),
            ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>", "missing </function>"),
            ("<tool_call>\n<function=f>\nhello\n</function>\n</tool_call>", "unexpected text in function `f`"),
            ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>", "parameter `a` is not closed"),
            (
                "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n</parameter>\n</function>\n</tool_call>",
                "argument `a` given twice",
            ),
            ("<tool_call>\n<function=two words>\n</function>\n</tool_call>", "bad function name \"two words\""),
        ];
        for (bad, reason) in cases {
            let output = format!("x {bad} y{DALLAS}");
            let (events, turn) = parse(&QwenXml, &vllm_tools(), &output);
            assert_eq!(
                events,
                vec![
                    text(&format!("x {bad}")),
                    ToolEvent::Malformed {
                        reason: reason.to_string()
                    },
                    text(" y"),
                    ToolEvent::Call(call("get_current_weather", DALLAS_ARGS)),
                ],
                "{bad}"
            );
            assert_eq!(turn.content, format!("x {bad} y"));
            assert_eq!(turn.malformed.as_deref(), Some(reason));
        }
    }

    #[test]
    fn plain_text_is_streamed_with_only_a_marker_prefix_held() {
        let mut parser = QwenXml.parser(&[]);
        assert_eq!(parser.push("a <b> <tool"), vec![text("a <b> ")]);
        assert_eq!(parser.push("box"), vec![text("<toolbox")]);
        assert_eq!(parser.push(" <tool_c"), vec![text(" ")]);
        let (events, turn) = parser.finish();
        assert_eq!(events, vec![text("<tool_c")]);
        assert_eq!(turn.content, "a <b> <toolbox <tool_c");
        assert!(turn.calls.is_empty() && turn.calls_raw.is_empty());
    }

    #[test]
    fn render_calls_matches_the_template() {
        // Expected bytes: the template rendered with jinja2 (trim_blocks, lstrip_blocks,
        // tojson = json.dumps) for content "Let me check." minus the content part.
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
        let rendered = QwenXml.render_calls(&calls);
        assert_eq!(
            rendered,
            "\n\n<tool_call>\n<function=get_current_weather>\n<parameter=city>\nParis\nFrance\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"a\": [1, 2.5, true, null], \"é\": \"x\"}\n</parameter>\n<parameter=flag>\nfalse\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=noargs>\n</function>\n</tool_call>"
        );
        assert_eq!(QwenXml.render_calls(&[]), "");

        // What the template renders is what the parser reads back.
        let tools = [tool(
            "get_current_weather",
            r#"{"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"},"opts":{"type":"object"},"flag":{"type":"boolean"}}}"#,
        )];
        let (_, turn) = parse(&QwenXml, &tools, &format!("Let me check.{rendered}"));
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
        // Expected bytes: the template's tools section rendered with jinja2 for this tool.
        let raw = r#"{"type":"function","function":{"name":"get_current_weather","description":" Get the current weather\n","parameters":{"type":"object","properties":{"city":{"type":"string","description":"The city name"},"unit":{"type":"string","enum":["fahrenheit","celsius"]},"days":{"type":["integer","null"],"default":1,"minimum":0.5}},"required":["city"],"additionalProperties":false},"strict":true}}"#;
        let spec = ToolSpec {
            name: "get_current_weather".into(),
            description: " Get the current weather\n".into(),
            parameters: r#"{"type":"object","properties":{"city":{"type":"string","description":"The city name"},"unit":{"type":"string","enum":["fahrenheit","celsius"]},"days":{"type":["integer","null"],"default":1,"minimum":0.5}},"required":["city"],"additionalProperties":false}"#.into(),
            raw: raw.into(),
        };
        let listing = "# Tools\n\nYou have access to the following functions:\n\n<tools>\n<function>\n<name>get_current_weather</name>\n<description>Get the current weather</description>\n<parameters>\n<parameter>\n<name>city</name>\n<type>string</type>\n<description>The city name</description>\n</parameter>\n<parameter>\n<name>unit</name>\n<type>string</type>\n<enum>[\"fahrenheit\", \"celsius\"]</enum>\n</parameter>\n<parameter>\n<name>days</name>\n<type>['integer', 'null']</type>\n<default>1</default>\n<minimum>0.5</minimum>\n</parameter>\n<required>[\"city\"]</required>\n<additionalProperties>False</additionalProperties>\n</parameters>\n<strict>True</strict>\n</function>\n</tools>";
        assert_eq!(
            QwenXml.tools_block(std::slice::from_ref(&spec)),
            format!("{listing}{CALL_FORMAT}")
        );

        // Without the client's definition the block is built from the fields.
        let bare = ToolSpec {
            raw: String::new(),
            ..spec
        };
        let block = QwenXml.tools_block(&[bare]);
        assert!(block.contains(
            "<additionalProperties>False</additionalProperties>\n</parameters>\n</function>"
        ));
    }

    #[test]
    fn forced_prefixes_start_a_call() {
        assert_eq!(QwenXml.forced_prefix(&ToolChoice::Auto), None);
        assert_eq!(QwenXml.forced_prefix(&ToolChoice::None), None);
        let required = QwenXml.forced_prefix(&ToolChoice::Required).unwrap();
        assert_eq!(required, "<tool_call>\n<function=");
        let named = QwenXml
            .forced_prefix(&ToolChoice::Named("get_current_weather".into()))
            .unwrap();
        assert_eq!(named, "<tool_call>\n<function=get_current_weather>\n");

        let rest = "<parameter=city>\nDallas\n</parameter>\n<parameter=state>\nTX\n</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n</function>\n</tool_call>";
        let mut parser = QwenXml.parser(&vllm_tools());
        assert_eq!(parser.push(&named), vec![]);
        let events = parser.push(rest);
        assert_eq!(
            events,
            vec![ToolEvent::Call(call("get_current_weather", DALLAS_ARGS))]
        );
        let (_, turn) = parse(
            &QwenXml,
            &vllm_tools(),
            &format!("{required}get_current_weather>\n{rest}"),
        );
        assert_eq!(turn.calls, vec![call("get_current_weather", DALLAS_ARGS)]);
    }
}
