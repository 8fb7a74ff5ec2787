//! Hermes / Qwen2.5 tool calls, the syntax of ChatML models: the tools are listed as
//! JSON inside `<tools>` in the system turn, and each call is a JSON object on its
//! own line inside `<tool_call>` tags:
//!
//! ```text
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! The texts follow the `chat_template` of `Qwen/Qwen2.5-7B-Instruct`
//! (`tokenizer_config.json` on Hugging Face). JSON is printed the way that
//! template's `tojson` filter prints it (Python `json.dumps`: `", "` and `": "`
//! separators, non-ASCII kept, keys in the given order).

use serde_json::{Map, Value};

use super::markup::{floor_char_boundary, held_tail, json_quote, py_json};
use super::{
    ParsedCall, ParsedTurn, ToolCall, ToolChoice, ToolEvent, ToolParser, ToolSpec, ToolSyntax,
};

const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";

const TOOLS_INTRO: &str =
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
You are provided with function signatures within <tools></tools> XML tags:\n<tools>";
const TOOLS_OUTRO: &str =
    "\n</tools>\n\nFor each function call, return a json object with function name \
and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";

/// The Hermes / Qwen2.5 `<tool_call>` JSON syntax.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hermes;

impl ToolSyntax for Hermes {
    fn name(&self) -> &'static str {
        "hermes"
    }

    fn tools_block(&self, tools: &[ToolSpec]) -> String {
        let mut out = String::from(TOOLS_INTRO);
        for tool in tools {
            out.push('\n');
            out.push_str(&tool_json(tool));
        }
        out.push_str(TOOLS_OUTRO);
        out
    }

    fn render_calls(&self, calls: &[ToolCall]) -> String {
        let mut out = String::new();
        for call in calls {
            out.push_str("\n<tool_call>\n{\"name\": \"");
            // The template prints the name as is, unquoted by JSON rules.
            out.push_str(&call.name);
            out.push_str("\", \"arguments\": ");
            out.push_str(&reserialise(&call.arguments).unwrap_or_else(|| call.arguments.clone()));
            out.push_str("}\n</tool_call>");
        }
        out
    }

    /// The call's opening line; the grammar ([`call_grammar`](Self::call_grammar))
    /// picks the tool (any, or the named one) and holds its arguments.
    fn forced_prefix(&self, choice: &ToolChoice) -> Option<String> {
        match choice {
            ToolChoice::Auto | ToolChoice::None => None,
            ToolChoice::Required | ToolChoice::Named(_) => Some(format!("{CALL_OPEN}\n")),
        }
    }

    fn parser(&self, _tools: &[ToolSpec]) -> Box<dyn ToolParser> {
        Box::new(HermesParser::default())
    }

    fn call_trigger(&self) -> Option<&'static str> {
        Some(CALL_OPEN)
    }

    /// After `<tool_call>`: an optional newline (the forced prefix has it), the
    /// call object `{"name": "...", "arguments": {...}}` with its keys in that
    /// order, `\n</tool_call>`; then more calls in the same form or the end.
    fn call_grammar(
        &self,
        tools: &[ToolSpec],
        choice: &ToolChoice,
        parallel: bool,
    ) -> Option<String> {
        let chosen = super::chosen_tools(tools, choice)?;
        let mut g = String::from(if parallel {
            "start: \"\\n\"? call more*\n\
             more: \"\\n<tool_call>\\n\" call\n"
        } else {
            "start: \"\\n\"? call\n"
        });
        g.push_str("call: body \"\\n</tool_call>\"\n");
        let names: Vec<String> = (0..chosen.len()).map(|i| format!("tool_{i}")).collect();
        g.push_str(&format!("body: {}\n", names.join(" | ")));
        for (rule, tool) in names.iter().zip(&chosen) {
            let schema = serde_json::json!({
                "type": "object",
                "properties": {
                    "name": { "const": tool.name },
                    "arguments": super::call_arguments_schema(&tool.parameters),
                },
                "required": ["name", "arguments"],
                "additionalProperties": false,
            });
            g.push_str(&format!("{rule}: {}\n", super::json_rule(&schema)));
        }
        Some(g)
    }
}

/// One offered tool as the template prints it: `{"type": "function", "function": {...}}`.
fn tool_json(tool: &ToolSpec) -> String {
    // Invalid schema text is kept verbatim rather than dropped: the model still sees it.
    let parameters = reserialise(&tool.parameters).unwrap_or_else(|| tool.parameters.clone());
    let mut out = String::from("{\"type\": \"function\", \"function\": {\"name\": ");
    out.push_str(&json_quote(&tool.name));
    out.push_str(", \"description\": ");
    out.push_str(&json_quote(&tool.description));
    out.push_str(", \"parameters\": ");
    out.push_str(&parameters);
    out.push_str("}}");
    out
}

/// `text` parsed as JSON and printed like Python's `json.dumps`; `None` if not JSON.
fn reserialise(text: &str) -> Option<String> {
    let value: Value = serde_json::from_str(text).ok()?;
    Some(py_json(&value))
}

/// A `<tool_call>` whose close has not arrived yet (offsets into the whole text).
#[derive(Clone, Copy, Debug)]
struct OpenCall {
    /// Start of the whitespace run before `<tool_call>`: the separator from the text.
    separator_start: usize,
    body_start: usize,
    /// Where the next search for `</tool_call>` starts (everything before was searched).
    close_search_from: usize,
}

/// Incremental parser. All state is kept as offsets into the whole generated text,
/// so every decision depends only on where the markers are, never on how the text
/// was chunked. Besides a possible start of `<tool_call>`, trailing whitespace is
/// held too: before a call it is the separator, which is not content.
#[derive(Debug, Default)]
struct HermesParser {
    whole: String,
    /// Start of the text not yet reported (outside a call).
    undecided_start: usize,
    open: Option<OpenCall>,
    calls: Vec<ParsedCall>,
    /// Separator start of the first call that parsed: where `content` ends.
    first_call_at: Option<usize>,
    malformed: Option<String>,
}

impl HermesParser {
    /// Reports everything the text so far makes certain.
    fn advance(&mut self) -> Vec<ToolEvent> {
        let mut events = Vec::new();
        loop {
            match self.open {
                None => {
                    let undecided = &self.whole[self.undecided_start..];
                    if let Some(at) = undecided.find(CALL_OPEN) {
                        let text_len = undecided[..at].trim_end().len();
                        push_text(&mut events, &undecided[..text_len]);
                        let body_start = self.undecided_start + at + CALL_OPEN.len();
                        self.open = Some(OpenCall {
                            separator_start: self.undecided_start + text_len,
                            body_start,
                            close_search_from: body_start,
                        });
                    } else {
                        // Hold back what could still turn out to be a separator and
                        // the start of `<tool_call>`.
                        let certain = undecided.len() - held_tail_len(undecided);
                        push_text(&mut events, &undecided[..certain]);
                        self.undecided_start += certain;
                        return events;
                    }
                }
                Some(open) => {
                    let Some(found) = self.whole[open.close_search_from..].find(CALL_CLOSE) else {
                        self.open = Some(OpenCall {
                            close_search_from: floor_char_boundary(
                                &self.whole,
                                self.whole
                                    .len()
                                    .saturating_sub(CALL_CLOSE.len() - 1)
                                    .max(open.body_start),
                            ),
                            ..open
                        });
                        return events;
                    };
                    let body_end = open.close_search_from + found;
                    if ends_in_string(&self.whole[open.body_start..body_end]) {
                        // `</tool_call>` inside a JSON string is the string's
                        // text (a grammar-held call may write it there).
                        self.open = Some(OpenCall {
                            close_search_from: body_end + 1,
                            ..open
                        });
                        continue;
                    }
                    let block_end = body_end + CALL_CLOSE.len();
                    match parse_call_body(&self.whole[open.body_start..body_end]) {
                        Ok(call) => {
                            self.first_call_at.get_or_insert(open.separator_start);
                            self.calls.push(call.clone());
                            events.push(ToolEvent::Call(call));
                        }
                        Err(reason) => {
                            push_text(&mut events, &self.whole[open.separator_start..block_end]);
                            self.malformed.get_or_insert_with(|| reason.clone());
                            events.push(ToolEvent::Malformed { reason });
                        }
                    }
                    self.open = None;
                    self.undecided_start = block_end;
                }
            }
        }
    }
}

impl ToolParser for HermesParser {
    fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.whole.push_str(text);
        self.advance()
    }

    fn finish(&mut self) -> (Vec<ToolEvent>, ParsedTurn) {
        let mut events = self.advance();
        if let Some(open) = self.open.take() {
            push_text(&mut events, &self.whole[open.separator_start..]);
            let reason = "unclosed <tool_call> at the end of the turn".to_string();
            self.malformed.get_or_insert_with(|| reason.clone());
            events.push(ToolEvent::Malformed { reason });
        } else {
            let rest = &self.whole[self.undecided_start..];
            // Whitespace after the calls belongs to them (`calls_raw`), not to the text.
            if self.calls.is_empty() || !rest.trim().is_empty() {
                push_text(&mut events, rest);
            }
        }
        self.undecided_start = self.whole.len();

        let (content, calls_raw) = match self.first_call_at {
            Some(at) => (self.whole[..at].to_string(), self.whole[at..].to_string()),
            None => (self.whole.clone(), String::new()),
        };
        let turn = ParsedTurn {
            content,
            calls: self.calls.clone(),
            calls_raw,
            malformed: self.malformed.clone(),
        };
        (events, turn)
    }
}

fn push_text(events: &mut Vec<ToolEvent>, text: &str) {
    if !text.is_empty() {
        events.push(ToolEvent::Text(text.to_string()));
    }
}

/// Length of the tail of `text` that may still become a call's separator and opening:
/// trailing whitespace, then a proper prefix of `<tool_call>`.
fn held_tail_len(text: &str) -> usize {
    let marker_prefix = held_tail(text, CALL_OPEN);
    let before = &text[..text.len() - marker_prefix];
    marker_prefix + before.len() - before.trim_end().len()
}

/// Whether `body` (a call's JSON so far) ends inside a string.
fn ends_in_string(body: &str) -> bool {
    let (mut in_string, mut escaped) = (false, false);
    for c in body.chars() {
        match c {
            _ if escaped => escaped = false,
            '\\' if in_string => escaped = true,
            '"' => in_string = !in_string,
            _ => {}
        }
    }
    in_string
}

/// `body` with the brackets it leaves open closed, when it ends outside a string:
/// small models often stop one `}` short before `</tool_call>`.
fn close_open_brackets(body: &str) -> Option<String> {
    let (mut stack, mut in_string, mut escaped) = (Vec::new(), false, false);
    for c in body.chars() {
        match c {
            _ if escaped => escaped = false,
            '\\' if in_string => escaped = true,
            '"' => in_string = !in_string,
            '{' if !in_string => stack.push('}'),
            '[' if !in_string => stack.push(']'),
            '}' | ']' if !in_string && stack.pop() != Some(c) => return None,
            _ => {}
        }
    }
    if in_string || stack.is_empty() {
        return None;
    }
    let mut fixed = body.trim_end().to_string();
    fixed.extend(stack.iter().rev());
    Some(fixed)
}

/// The JSON between the tags: `{"name": ..., "arguments": {...}}`, arguments also
/// accepted under `parameters` or as a string holding a JSON object.
fn parse_call_body(body: &str) -> Result<ParsedCall, String> {
    let value: Value = serde_json::from_str(body)
        .or_else(|e| {
            close_open_brackets(body)
                .and_then(|fixed| serde_json::from_str(&fixed).ok())
                .ok_or(e)
        })
        .map_err(|e| format!("tool call is not JSON: {e}"))?;
    let object = value.as_object().ok_or("tool call is not a JSON object")?;
    let name = object
        .get("name")
        .and_then(Value::as_str)
        .filter(|name| !name.is_empty())
        .ok_or("tool call has no \"name\" string")?;
    let arguments = object
        .get("arguments")
        .or_else(|| object.get("parameters"))
        .ok_or("tool call has no \"arguments\"")?;
    let arguments: Map<String, Value> = match arguments {
        Value::Object(map) => map.clone(),
        Value::String(text) => match serde_json::from_str(text) {
            Ok(Value::Object(map)) => map,
            _ => return Err("tool call \"arguments\" string does not hold a JSON object".into()),
        },
        _ => return Err("tool call \"arguments\" is not an object".into()),
    };
    let arguments =
        serde_json::to_string(&arguments).map_err(|e| format!("tool call arguments: {e}"))?;
    Ok(ParsedCall {
        name: name.to_string(),
        arguments,
    })
}

#[cfg(test)]
mod tests {
    use super::super::markup::test_support;
    use super::*;

    fn spec(name: &str, description: &str, parameters: &str) -> ToolSpec {
        ToolSpec {
            name: name.into(),
            description: description.into(),
            parameters: parameters.into(),
            raw: String::new(),
        }
    }

    fn call(name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            id: String::new(),
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    fn parsed(name: &str, arguments: &str) -> ParsedCall {
        ParsedCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    fn parse_in_chunks(chunks: &[&str]) -> (Vec<ToolEvent>, ParsedTurn) {
        test_support::run(&Hermes, &[], chunks)
    }

    fn parse_whole(text: &str) -> (Vec<ToolEvent>, ParsedTurn) {
        parse_in_chunks(&[text])
    }

    /// One-shot, char-by-char and random chunkings all agree; returns the one-shot result.
    fn parse_every_way(text: &str) -> (Vec<ToolEvent>, ParsedTurn) {
        test_support::parse(&Hermes, &[], text)
    }

    /// A grammar-held call may write the closing tag inside a string value
    /// (seen from SmolLM2 at temperature 0.7): the string's text, not the close.
    #[test]
    fn a_close_tag_inside_a_string_is_the_strings_text() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \
                    \"New York, NY}}</tool_call>  # a \\\"note\\\" \"}}\n</tool_call>";
        let (_, turn) = parse_every_way(text);
        assert_eq!(
            turn.calls,
            vec![parsed(
                "get_weather",
                r#"{"city":"New York, NY}}</tool_call>  # a \"note\" "}"#
            )]
        );
        assert_eq!(turn.content, "");
        assert!(turn.malformed.is_none());
    }

    #[test]
    fn a_call_one_bracket_short_is_closed_and_other_breakage_is_text() {
        let (_, turn) = parse_whole(
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, \"}\"]}\n</tool_call>",
        );
        assert_eq!(turn.calls, vec![parsed("f", r#"{"a":[1,"}"]}"#)]);
        for broken in [
            "{\"name\": \"f\", \"arguments\": {\"a\": \"open",
            "{\"name\": \"f\", \"arguments\": {\"a\": 1]}",
            "{\"name\": \"f\", \"arguments\": {\"a\":",
        ] {
            let (_, turn) = parse_whole(&format!("<tool_call>\n{broken}\n</tool_call>"));
            assert!(
                turn.calls.is_empty() && turn.malformed.is_some(),
                "{broken}"
            );
        }
    }

    #[test]
    fn tools_block_is_qwen25_text_with_py_json() {
        let block = Hermes.tools_block(&[spec(
            "get_weather",
            "Weather — now",
            r#"{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}"#,
        )]);
        assert_eq!(
            block,
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
             You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n\
             {\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather — now\", \
             \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n\
             </tools>\n\nFor each function call, return a json object with function name and arguments within \
             <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
        );
    }

    #[test]
    fn calls_render_canonically_in_the_clients_key_order() {
        let rendered = Hermes.render_calls(&[
            call("b", "{ \"z\" :1,\n \"a\": [true, null, \"x\\\"y\"] }"),
            call("a", "{}"),
        ]);
        assert_eq!(
            rendered,
            "\n<tool_call>\n{\"name\": \"b\", \"arguments\": {\"z\": 1, \"a\": [true, null, \"x\\\"y\"]}}\n</tool_call>\
             \n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>"
        );
        // Not JSON: printed as given.
        assert_eq!(
            Hermes.render_calls(&[call("f", "{oops")]),
            "\n<tool_call>\n{\"name\": \"f\", \"arguments\": {oops}\n</tool_call>"
        );
    }

    #[test]
    fn forced_prefixes_open_a_call() {
        assert_eq!(Hermes.forced_prefix(&ToolChoice::Auto), None);
        assert_eq!(Hermes.forced_prefix(&ToolChoice::None), None);
        let required = Hermes
            .forced_prefix(&ToolChoice::Required)
            .unwrap_or_default();
        assert_eq!(required, "<tool_call>\n");
        let named = Hermes.forced_prefix(&ToolChoice::Named("f".into()));
        assert_eq!(named.as_deref(), Some("<tool_call>\n"));
        assert_eq!(Hermes.call_trigger(), Some("<tool_call>"));
        assert!(required.starts_with(Hermes.call_trigger().unwrap_or_default()));

        // The server feeds the prefix, then what the model generated.
        let text =
            format!("{required}{{\"name\": \"f\", \"arguments\": {{\"x\": 1}}}}\n</tool_call>");
        let (events, turn) = parse_every_way(&text);
        assert_eq!(events, vec![ToolEvent::Call(parsed("f", r#"{"x":1}"#))]);
        assert_eq!(turn.content, "");
    }

    #[test]
    fn the_call_grammar_names_the_offered_tools_and_closes_their_arguments() {
        let tool = |name: &str, parameters: &str| ToolSpec {
            name: name.into(),
            description: String::new(),
            parameters: parameters.into(),
            raw: String::new(),
        };
        let tools = [
            tool(
                "get_weather",
                r#"{"type":"object","properties":{"city":{"type":"string"}}}"#,
            ),
            tool("ls", "not json"),
        ];
        let all = Hermes
            .call_grammar(&tools, &ToolChoice::Required, true)
            .unwrap();
        assert!(all.contains("more*"), "{all}");
        let single = Hermes
            .call_grammar(&tools, &ToolChoice::Required, false)
            .unwrap();
        assert!(!single.contains("more"), "{single}");
        assert!(all.contains("body: tool_0 | tool_1\n"), "{all}");
        assert!(all.contains(r#""name":{"const":"get_weather"}"#), "{all}");
        assert!(
            all.contains(r#""properties":{"city":{"type":"string"}},"additionalProperties":false"#),
            "{all}"
        );
        // An unparsable schema takes any object.
        assert!(all.contains(r#""arguments":{"type":"object"}"#), "{all}");
        assert!(all.contains(r#""item_separator":", ""#), "{all}");
        let named = Hermes
            .call_grammar(&tools, &ToolChoice::Named("ls".into()), true)
            .unwrap();
        assert!(named.contains("body: tool_0\n") && !named.contains("get_weather"));
        assert_eq!(Hermes.call_grammar(&tools, &ToolChoice::None, true), None);
        assert_eq!(Hermes.call_grammar(&[], &ToolChoice::Auto, true), None);
        assert_eq!(
            Hermes.call_grammar(&tools, &ToolChoice::Named("nope".into()), true),
            None
        );
    }

    // Recorded model outputs from vLLM's Hermes parser tests
    // (vllm-project/vllm, tests/tool_parsers/test_hermes_tool_parser.py) and
    // llama.cpp's chat tests for Qwen2.5 / Hermes 3 (ggml-org/llama.cpp, tests/test-chat.cpp).
    #[test]
    fn recorded_outputs_parse() {
        let (events, turn) =
            parse_every_way("This is some prior text that has nothing to do with tool calling.");
        assert_eq!(
            events,
            vec![ToolEvent::Text(
                "This is some prior text that has nothing to do with tool calling.".into()
            )]
        );
        assert!(turn.calls.is_empty() && turn.calls_raw.is_empty());

        let (_, turn) = parse_every_way("Hello, world!\nWhat's up?");
        assert_eq!(turn.content, "Hello, world!\nWhat's up?");

        let text = "<tool_call>\n{\"name\": \"final_answer\", \"arguments\": {\"trigger\": true}}\n</tool_call>";
        let (events, turn) = parse_every_way(text);
        assert_eq!(
            events,
            vec![ToolEvent::Call(parsed(
                "final_answer",
                r#"{"trigger":true}"#
            ))]
        );
        assert_eq!((turn.content.as_str(), turn.calls_raw.as_str()), ("", text));

        let text = "<tool_call>{\"name\": \"get_current_temperature\",\"arguments\": {\"location\":\
                    \"San Francisco, California, United States\", \"unit\": \"celsius\"}}</tool_call>";
        assert_eq!(
            parse_every_way(text).1.calls,
            vec![parsed(
                "get_current_temperature",
                r#"{"location":"San Francisco, California, United States","unit":"celsius"}"#
            )]
        );

        let text = "Sure, let me check the weather.<tool_call>{\"name\": \"get_weather\", \
                    \"arguments\": {\"city\": \"NYC\"}}</tool_call>";
        let (events, turn) = parse_every_way(text);
        assert_eq!(
            events,
            vec![
                ToolEvent::Text("Sure, let me check the weather.".into()),
                ToolEvent::Call(parsed("get_weather", r#"{"city":"NYC"}"#)),
            ]
        );
        assert_eq!(turn.content, "Sure, let me check the weather.");

        let text = "<tool_call>{\"name\": \"search\", \"arguments\": {\"q\": \"cats\"}}</tool_call>\
                    <tool_call>{\"name\": \"search\", \"arguments\": {\"q\": \"dogs\"}}</tool_call>";
        assert_eq!(
            parse_every_way(text).1.calls,
            vec![
                parsed("search", r#"{"q":"cats"}"#),
                parsed("search", r#"{"q":"dogs"}"#)
            ]
        );

        // Arguments the model already serialised into a string.
        let text = "<tool_call>\n{\"name\": \"get_db_config\", \
                    \"arguments\": \"{\\\"param\\\": \\\"max_connections\\\"}\"}\n</tool_call>";
        assert_eq!(
            parse_every_way(text).1.calls,
            vec![parsed("get_db_config", r#"{"param":"max_connections"}"#)]
        );

        let text = "<tool_call>\n{\"name\": \"special_function\", \"arguments\": {\"arg1\": 1}}\n</tool_call>";
        assert_eq!(
            parse_every_way(text).1.calls,
            vec![parsed("special_function", r#"{"arg1":1}"#)]
        );
    }

    #[test]
    fn recorded_malformed_outputs_stay_text() {
        // vLLM: a missing closing brace (vLLM returns it as text; we close the
        // bracket, as small models do this often), and a call cut off by the end
        // of generation (text for both).
        let text = "<tool_call>\n{\"name\": \"final_answer\", \"arguments\": {\"trigger\": true}\n</tool_call>";
        let (_, turn) = parse_every_way(text);
        assert_eq!(
            turn.calls,
            vec![parsed("final_answer", r#"{"trigger":true}"#)]
        );

        let text = "<tool_call>\n{\"name\": \"final_answer\", \"arguments\": {\"trigger\": true}}";
        let (events, turn) = parse_every_way(text);
        assert_eq!(events.len(), 2);
        assert_eq!(events.first(), Some(&ToolEvent::Text(text.into())));
        assert_eq!(turn.content, text);

        // A string that holds no JSON object is not arguments.
        let text = "<tool_call>\n{\"name\": \"do_thing\", \"arguments\": \"hello\"}\n</tool_call>";
        assert!(parse_every_way(text).1.calls.is_empty());
    }

    #[test]
    fn separators_and_text_between_calls() {
        let first = "<tool_call>\n{\"name\": \"a\", \"parameters\": {\"k\": \"v\"}}\n</tool_call>";
        let second = "<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
        let text = format!("Let me look. \n\n{first}\n{second}\n");
        let (events, turn) = parse_every_way(&text);
        assert_eq!(
            events,
            vec![
                ToolEvent::Text("Let me look.".into()),
                ToolEvent::Call(parsed("a", r#"{"k":"v"}"#)),
                ToolEvent::Call(parsed("b", "{}")),
            ]
        );
        assert_eq!(turn.content, "Let me look.");
        assert_eq!(turn.calls_raw, format!(" \n\n{first}\n{second}\n"));
        assert_eq!(turn.malformed, None);

        let text = format!("{first}\nthen some words\n{second}");
        let (events, turn) = parse_every_way(&text);
        assert_eq!(
            events,
            vec![
                ToolEvent::Call(parsed("a", r#"{"k":"v"}"#)),
                ToolEvent::Text("\nthen some words".into()),
                ToolEvent::Call(parsed("b", "{}")),
            ]
        );
        assert_eq!(turn.content, "");
    }

    #[test]
    fn a_bad_block_before_a_good_call_is_content() {
        let bad = "<tool_call>\n{\"name\": 3}\n</tool_call>";
        let good = "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>";
        let text = format!("Hi\n{bad}\n{good}");
        let (events, turn) = parse_every_way(&text);
        assert_eq!(
            events,
            vec![
                ToolEvent::Text(format!("Hi\n{bad}")),
                ToolEvent::Malformed {
                    reason: "tool call has no \"name\" string".into()
                },
                ToolEvent::Call(parsed("a", "{}")),
            ]
        );
        assert_eq!(turn.content, format!("Hi\n{bad}"));
        assert_eq!(turn.calls_raw, format!("\n{good}"));
        assert!(turn.malformed.is_some());
    }

    #[test]
    fn text_is_held_only_while_it_could_open_a_call() {
        let mut parser = Hermes.parser(&[]);
        assert_eq!(parser.push("a <tool"), vec![ToolEvent::Text("a".into())]);
        assert_eq!(
            parser.push("box> b\n"),
            vec![ToolEvent::Text(" <toolbox> b".into())]
        );
        assert_eq!(parser.push("<"), vec![]);
        let (events, turn) = parser.finish();
        assert_eq!(events, vec![ToolEvent::Text("\n<".into())]);
        assert_eq!(turn.content, "a <toolbox> b\n<");
    }

    #[test]
    fn arbitrary_text_never_panics_and_chunking_never_matters() {
        let pieces = [
            "<tool_call>",
            "</tool_call>",
            "<tool_",
            "call>",
            "</tool",
            "{\"name\": \"f\", ",
            "\"arguments\": ",
            "{\"a\": 1}",
            "}",
            "\"",
            "\\",
            "\n",
            " ",
            "é",
            "日本",
            "🦀",
            "x",
            "<",
            ">",
            "/",
            "{",
            "[1, 2]",
        ];
        let mut state = 7u64;
        for _ in 0..200 {
            let mut text = String::new();
            for _ in 0..12 {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                text.push_str(pieces[(state >> 33) as usize % pieces.len()]);
            }
            parse_every_way(&text);
        }
    }

    #[test]
    fn finish_twice_reports_nothing_new() {
        let mut parser = Hermes.parser(&[]);
        parser.push("x\n<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n");
        let (_, first) = parser.finish();
        let (events, second) = parser.finish();
        assert!(events.is_empty());
        assert_eq!(first, second);
    }
}
