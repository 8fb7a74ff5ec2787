//! DeepSeek V4's chat format (system spec §4.3), byte-exact with the C server:
//! BOS, the Think Max prefix, one hoisted system text (tool block first), then
//! `<｜User｜>` / `<｜Assistant｜>` turns with tool results wrapped in
//! `<tool_result>` and tool calls written in DSML.

use crate::think::{ThinkMode, THINK_MAX_PREFIX};
use crate::tools::{Dsml, ToolSyntax};
use crate::{Message, Prompt, RenderOptions, Role, Template};

const BOS: &str = "<｜begin▁of▁sentence｜>";
const EOS: &str = "<｜end▁of▁sentence｜>";
const USER: &str = "<｜User｜>";
const ASSISTANT: &str = "<｜Assistant｜>";
const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const TOOL_RESULT_OPEN: &str = "<tool_result>";
const TOOL_RESULT_CLOSE: &str = "</tool_result>";

/// The DeepSeek V4 template.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeepSeek;

impl Template for DeepSeek {
    fn name(&self) -> &'static str {
        "deepseek"
    }

    fn render(&self, messages: &[Message], opts: &RenderOptions) -> Prompt {
        let think = opts.think.is_thinking();
        let tool_context = !opts.tools.is_empty()
            || messages.iter().any(|m| {
                m.role == Role::Tool || (m.role == Role::Assistant && !m.tool_calls.is_empty())
            });

        // The tool block comes before client system text, so a trim of the
        // system text's tail never cuts a schema.
        let mut system = if opts.tools.is_empty() {
            String::new()
        } else {
            Dsml.tools_block(opts.tools)
        };
        for m in messages.iter().filter(|m| m.role == Role::System) {
            if !system.is_empty() {
                system.push_str("\n\n");
            }
            system.push_str(&m.content);
        }
        let last_user_idx = messages
            .iter()
            .rposition(|m| matches!(m.role, Role::User | Role::Tool));

        let mut out = Prompt::new();
        out.markup(BOS);
        if opts.think == ThinkMode::Max {
            out.markup(THINK_MAX_PREFIX);
        }
        out.content(&system);

        let mut pending_assistant = false;
        let mut pending_tool_result = false;
        for (i, m) in messages.iter().enumerate() {
            match m.role {
                Role::System => {}
                Role::User => {
                    out.markup(USER);
                    out.content(&m.content);
                    pending_assistant = true;
                    pending_tool_result = false;
                }
                Role::Tool => {
                    // Consecutive results share one user turn, in order.
                    if !pending_tool_result {
                        out.markup(USER);
                    }
                    out.markup(TOOL_RESULT_OPEN);
                    out.content(&escape_tool_result(&m.content));
                    out.markup(TOOL_RESULT_CLOSE);
                    pending_assistant = true;
                    pending_tool_result = true;
                }
                Role::Assistant => {
                    // Quirk kept from the C server: an assistant message that
                    // follows no user/tool turn continues right after the last EOS.
                    if pending_assistant {
                        out.markup(ASSISTANT);
                        // Reasoning is kept through tool loops and for the latest
                        // turn; older reasoning is dropped.
                        let keep_reasoning = last_user_idx.is_none_or(|u| i > u) || tool_context;
                        if think && keep_reasoning {
                            out.markup(THINK_OPEN);
                            out.content(m.reasoning.as_deref().unwrap_or(""));
                        }
                        out.markup(THINK_CLOSE);
                    }
                    out.content(&m.content);
                    if !m.tool_calls.is_empty() {
                        match &m.tool_calls_raw {
                            Some(raw) => out.content(raw),
                            None => out.content(&Dsml.render_calls(&m.tool_calls)),
                        }
                    }
                    out.markup(EOS);
                    pending_assistant = false;
                    pending_tool_result = false;
                }
            }
        }
        if opts.add_generation_prompt && pending_assistant {
            out.markup(ASSISTANT);
            out.markup(if think { THINK_OPEN } else { THINK_CLOSE });
        }
        out
    }

    fn tool_syntax(&self) -> &dyn ToolSyntax {
        &Dsml
    }

    fn supports_thinking(&self) -> bool {
        true
    }

    fn end_of_turn(&self) -> &'static str {
        EOS
    }
}

/// §4.6: a tool result is verbatim except that it cannot close its wrapper.
fn escape_tool_result(content: &str) -> String {
    content.replace(TOOL_RESULT_CLOSE, "&lt;/tool_result>")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::think::{ThinkSplitter, THINK_MAX_PREFIX};
    use crate::tools::{ParsedTurn, ToolCall, ToolChoice, ToolSpec};

    fn user(text: &str) -> Message {
        Message::new(Role::User, text)
    }

    fn assistant(text: &str) -> Message {
        Message::new(Role::Assistant, text)
    }

    fn tool_result(id: &str, text: &str) -> Message {
        Message {
            tool_call_id: Some(id.into()),
            ..Message::new(Role::Tool, text)
        }
    }

    fn render(messages: &[Message], think: ThinkMode, tools: &[ToolSpec]) -> String {
        DeepSeek
            .render(
                messages,
                &RenderOptions {
                    tools,
                    think,
                    add_generation_prompt: true,
                },
            )
            .into()
    }

    fn read_tool() -> ToolSpec {
        ToolSpec {
            name: "read".into(),
            description: "Read a file".into(),
            parameters: r#"{"type":"object"}"#.into(),
            raw: r#"{"type":"function","function":{"name":"read","description":"Read a file","parameters":{"type":"object"}}}"#.into(),
        }
    }

    #[test]
    fn spec_examples() {
        assert_eq!(
            render(&[user("Hello")], ThinkMode::None, &[]),
            "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜></think>"
        );
        let first = Message {
            reasoning: Some("old thoughts".into()),
            ..assistant("first answer")
        };
        assert_eq!(
            render(
                &[user("first"), first, user("second")],
                ThinkMode::High,
                &[]
            ),
            "<｜begin▁of▁sentence｜><｜User｜>first<｜Assistant｜></think>first answer\
             <｜end▁of▁sentence｜><｜User｜>second<｜Assistant｜><think>"
        );
        let system = Message::new(Role::System, "You are terse.");
        assert_eq!(
            render(&[system, user("Hello")], ThinkMode::Max, &[]),
            format!(
                "<｜begin▁of▁sentence｜>{THINK_MAX_PREFIX}You are terse.<｜User｜>Hello<｜Assistant｜><think>"
            )
        );
    }

    #[test]
    fn tool_conversation() {
        let tools = [read_tool()];
        let call = ToolCall {
            id: "call_1".into(),
            name: "read".into(),
            arguments: r#"{"path": "a.txt"}"#.into(),
        };
        let messages = [
            Message::new(Role::System, "Be brief."),
            user("Read a.txt and b.txt"),
            Message {
                reasoning: Some("need files".into()),
                tool_calls: vec![call.clone(), call],
                ..assistant("Reading.")
            },
            tool_result("call_1", "A</tool_result>"),
            tool_result("call_1", "B"),
            Message::new(Role::System, "Late system text."),
        ];
        let calls = "\n\n<｜DSML｜tool_calls>\n\
<｜DSML｜invoke name=\"read\">\n\
<｜DSML｜parameter name=\"path\" string=\"true\">a.txt</｜DSML｜parameter>\n\
</｜DSML｜invoke>\n\
<｜DSML｜invoke name=\"read\">\n\
<｜DSML｜parameter name=\"path\" string=\"true\">a.txt</｜DSML｜parameter>\n\
</｜DSML｜invoke>\n\
</｜DSML｜tool_calls>";
        let expected = format!(
            "<｜begin▁of▁sentence｜>{}\n\nBe brief.\n\nLate system text.\
             <｜User｜>Read a.txt and b.txt<｜Assistant｜><think>need files</think>Reading.{calls}<｜end▁of▁sentence｜>\
             <｜User｜><tool_result>A&lt;/tool_result></tool_result><tool_result>B</tool_result>\
             <｜Assistant｜><think>",
            Dsml.tools_block(&tools)
        );
        assert_eq!(render(&messages, ThinkMode::High, &tools), expected);

        // The same history without tools on offer is still a tool context: the
        // reasoning of the earlier turn is kept. Non-thinking mode never shows it.
        let without_tools = render(&messages, ThinkMode::High, &[]);
        assert!(without_tools
            .starts_with("<｜begin▁of▁sentence｜>Be brief.\n\nLate system text.<｜User｜>"));
        assert!(without_tools.contains("<think>need files</think>Reading."));
        let non_thinking = render(&messages, ThinkMode::None, &tools);
        assert!(non_thinking.contains("<｜Assistant｜></think>Reading."));
        assert!(non_thinking.ends_with("<｜Assistant｜></think>"));
    }

    #[test]
    fn sampled_call_text_is_replayed_verbatim() {
        let raw = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"read\">\n<｜DSML｜parameter name=\"path\">a.txt</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        let message = Message {
            tool_calls: vec![ToolCall {
                id: "call_1".into(),
                name: "read".into(),
                arguments: r#"{"path":"a.txt"}"#.into(),
            }],
            tool_calls_raw: Some(raw.into()),
            ..assistant("")
        };
        let prompt = render(&[user("go"), message], ThinkMode::None, &[]);
        assert_eq!(
            prompt,
            format!("<｜begin▁of▁sentence｜><｜User｜>go<｜Assistant｜></think>{raw}<｜end▁of▁sentence｜>")
        );
    }

    #[test]
    fn assistant_without_a_preceding_user_turn_gets_no_prefix() {
        let messages = [assistant("Hi."), assistant("Again."), user("Q")];
        assert_eq!(
            render(&messages, ThinkMode::High, &[]),
            "<｜begin▁of▁sentence｜>Hi.<｜end▁of▁sentence｜>Again.<｜end▁of▁sentence｜>\
             <｜User｜>Q<｜Assistant｜><think>"
        );
    }

    #[test]
    fn latest_assistant_turn_keeps_its_reasoning_and_gets_no_prefix() {
        let last = Message {
            reasoning: Some("r".into()),
            ..assistant("a")
        };
        assert_eq!(
            render(&[user("q"), last], ThinkMode::High, &[]),
            "<｜begin▁of▁sentence｜><｜User｜>q<｜Assistant｜><think>r</think>a<｜end▁of▁sentence｜>"
        );
        let opts = RenderOptions {
            add_generation_prompt: false,
            ..RenderOptions::default()
        };
        assert_eq!(
            DeepSeek.render(&[user("q")], &opts).as_str(),
            "<｜begin▁of▁sentence｜><｜User｜>q"
        );
    }

    /// Splits and parses a generated turn the way the server does.
    fn parse_generated(think: ThinkMode, text: &str) -> (Option<String>, ParsedTurn) {
        let mut splitter = ThinkSplitter::new(think);
        splitter.push(text);
        let (_, split) = splitter.finish();
        let mut parser = Dsml.parser(&[]);
        parser.push(&split.content);
        let (_, turn) = parser.finish();
        (split.reasoning, turn)
    }

    /// The assistant message a client sends back for a parsed turn.
    fn echoed(reasoning: Option<String>, turn: &ParsedTurn, keep_raw: bool) -> Message {
        Message {
            reasoning,
            tool_calls: turn
                .calls
                .iter()
                .enumerate()
                .map(|(i, c)| ToolCall {
                    id: format!("call_{i}"),
                    name: c.name.clone(),
                    arguments: c.arguments.clone(),
                })
                .collect(),
            tool_calls_raw: keep_raw.then(|| turn.calls_raw.clone()),
            ..assistant(&turn.content)
        }
    }

    #[test]
    fn next_prompt_extends_the_live_state_after_a_tool_call() {
        // Generation stops at the DSML close without EOS (§4.7), so the next
        // prompt is the live text plus EOS plus the results and a new prefix.
        let tools = [read_tool()];
        let history = vec![Message::new(Role::System, "sys"), user("Read a.txt")];
        let calls = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"read\">\n\
<｜DSML｜parameter name=\"path\" string=\"true\">a.txt</｜DSML｜parameter>\n\
</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        let sloppy = "  \n<DSML｜tool_calls><DSML｜invoke name=\"read\"><DSML｜parameter name=\"path\">a.txt</DSML｜parameter></DSML｜invoke></DSML｜tool_calls>";
        for (think, generated, keep_raw) in [
            (
                ThinkMode::High,
                format!("plan</think>Looking.{calls}"),
                false,
            ),
            (
                ThinkMode::High,
                format!("plan</think>Looking.{sloppy}"),
                true,
            ),
            (ThinkMode::None, format!("Looking.{sloppy}"), true),
            (ThinkMode::None, calls.to_string(), false),
        ] {
            let prompt = render(&history, think, &tools);
            let (reasoning, turn) = parse_generated(think, &generated);
            assert_eq!(turn.calls.len(), 1, "{generated:?}");
            let mut messages = history.clone();
            messages.push(echoed(reasoning, &turn, keep_raw));
            messages.push(tool_result("call_0", "contents"));
            let open = if think.is_thinking() {
                "<think>"
            } else {
                "</think>"
            };
            assert_eq!(
                render(&messages, think, &tools),
                format!(
                    "{prompt}{generated}<｜end▁of▁sentence｜>\
                     <｜User｜><tool_result>contents</tool_result><｜Assistant｜>{open}"
                ),
                "{generated:?}"
            );
        }
    }

    #[test]
    fn forced_call_prefix_is_part_of_the_live_state() {
        let tools = [read_tool()];
        let history = [user("Read a.txt")];
        let prompt = render(&history, ThinkMode::None, &tools);
        let prefix = Dsml
            .forced_prefix(&ToolChoice::Named("read".into()))
            .unwrap_or_default();
        let generated =
            "<｜DSML｜parameter name=\"path\" string=\"true\">a.txt</｜DSML｜parameter>\n\
</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        // The server feeds the prefix to the parser before the sampled text.
        let (reasoning, turn) = parse_generated(ThinkMode::None, &format!("{prefix}{generated}"));
        let mut messages = history.to_vec();
        messages.push(echoed(reasoning, &turn, false));
        messages.push(tool_result("call_0", "x"));
        assert!(
            render(&messages, ThinkMode::None, &tools).starts_with(&format!(
                "{prompt}{prefix}{generated}<｜end▁of▁sentence｜><｜User｜>"
            ))
        );
    }

    #[test]
    fn rendering_is_append_only_in_a_tool_loop() {
        let tools = [read_tool()];
        let call = ToolCall {
            id: "c".into(),
            name: "read".into(),
            arguments: r#"{"path":"x"}"#.into(),
        };
        let mut messages = vec![user("q")];
        let mut previous = render(&messages, ThinkMode::High, &tools);
        for step in 0..3 {
            messages.push(Message {
                reasoning: Some(format!("step {step}")),
                tool_calls: vec![call.clone()],
                ..assistant("")
            });
            messages.push(tool_result("c", "r"));
            let next = render(&messages, ThinkMode::High, &tools);
            assert!(next.starts_with(&previous), "step {step}");
            previous = next;
        }
    }
}
