//! DSML, the tool-call syntax of DeepSeek V4 (system spec §7). The prompt teaches
//! the canonical `<｜DSML｜tool_calls>` block (§4.4); the parser also reads the short
//! (`<DSML｜tool_calls>`) and plain XML (`<tool_calls>`) spellings models drift into.
//! One block holds every call of the turn (generation stops at its close).
//!
//! Feed the parser only the text after the think block: DSML inside reasoning is
//! never a call (§7.4 step 1).

use super::markup::json_quote;
use super::{
    ParsedCall, ParsedTurn, ToolCall, ToolChoice, ToolEvent, ToolParser, ToolSpec, ToolSyntax,
};

/// The DSML syntax.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Dsml;

/// The §4.4 tool block up to the schemas (ends with "### Available Tool Schemas\n\n").
const TOOLS_HEAD: &str = "## Tools\n\
\n\
You have access to a set of tools to help answer the user question. You can invoke tools by writing a \"<｜DSML｜tool_calls>\" block like the following:\n\
\n\
<｜DSML｜tool_calls>\n\
<｜DSML｜invoke name=\"$TOOL_NAME\">\n\
<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n\
...\n\
</｜DSML｜invoke>\n\
<｜DSML｜invoke name=\"$TOOL_NAME2\">\n\
...\n\
</｜DSML｜invoke>\n\
</｜DSML｜tool_calls>\n\
\n\
String parameters should be specified as raw text and set `string=\"true\"`. Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string characters with XML or HTML entity escapes. Only if a string value itself contains the exact closing parameter tag `</｜DSML｜parameter>`, write that tag as `&lt;/｜DSML｜parameter>` inside the value. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\
\n\
If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\
\n\
Otherwise, output directly after </think> with tool calls or final response.\n\
\n\
### Available Tool Schemas\n\
\n";

/// The §4.4 tool block after the schemas (no final newline).
const TOOLS_TAIL: &str = "\n\
\n\
You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls. Use the exact parameter names from the schemas.";

/// The tags of one DSML spelling (§7.1).
#[derive(Debug)]
struct Style {
    open: &'static str,
    close: &'static str,
    invoke: &'static str,
    invoke_close: &'static str,
    param: &'static str,
    param_close: &'static str,
}

macro_rules! style {
    ($bar:literal) => {
        Style {
            open: concat!("<", $bar, "tool_calls>"),
            close: concat!("</", $bar, "tool_calls>"),
            invoke: concat!("<", $bar, "invoke"),
            invoke_close: concat!("</", $bar, "invoke>"),
            param: concat!("<", $bar, "parameter"),
            param_close: concat!("</", $bar, "parameter>"),
        }
    };
}

/// Canonical, short (first bar missing), plain XML. No opening tag occurs inside
/// another, so the earliest one in the text is unambiguous.
static STYLES: [Style; 3] = [style!("｜DSML｜"), style!("DSML｜"), style!("")];
/// What rendering writes and the tool block teaches.
static CANONICAL: &Style = &STYLES[0];

impl ToolSyntax for Dsml {
    fn name(&self) -> &'static str {
        "dsml"
    }

    fn tools_block(&self, tools: &[ToolSpec]) -> String {
        let schemas: Vec<String> = tools.iter().map(schema_line).collect();
        format!("{TOOLS_HEAD}{}{TOOLS_TAIL}", schemas.join("\n"))
    }

    fn render_calls(&self, calls: &[ToolCall]) -> String {
        if calls.is_empty() {
            return String::new();
        }
        let tags = CANONICAL;
        let mut out = format!("\n\n{}\n", tags.open);
        for call in calls {
            out.push_str(&format!(
                "{} name=\"{}\">\n",
                tags.invoke,
                escape_attr(&call.name)
            ));
            match json::object_members(&call.arguments) {
                Some(members) => {
                    for (key, raw) in members {
                        push_param(&mut out, &key, raw);
                    }
                }
                // §7.3: arguments that are not an object travel as one string.
                None => push_string_param(&mut out, "arguments", &call.arguments),
            }
            out.push_str(tags.invoke_close);
            out.push('\n');
        }
        out.push_str(tags.close);
        out
    }

    fn forced_prefix(&self, choice: &ToolChoice) -> Option<String> {
        let tags = CANONICAL;
        match choice {
            ToolChoice::Auto | ToolChoice::None => None,
            ToolChoice::Required => Some(format!("\n\n{}\n{} name=\"", tags.open, tags.invoke)),
            ToolChoice::Named(name) => Some(format!(
                "\n\n{}\n{} name=\"{}\">\n",
                tags.open,
                tags.invoke,
                escape_attr(name)
            )),
        }
    }

    fn parser(&self, _tools: &[ToolSpec]) -> Box<dyn ToolParser> {
        Box::new(DsmlParser::default())
    }

    fn call_trigger(&self) -> Option<&'static str> {
        Some(CANONICAL.open)
    }

    /// The canonical block (§7.3), continuing what precedes the grammar: after
    /// the trigger (`Auto`: the model opened the block itself) the first
    /// invoke's newline; after the `Required` prefix a tool's name; after the
    /// `Named` prefix that tool's parameters. Each invoke holds the tool's
    /// schema properties in order (the required ones always, the others
    /// optionally): strings as raw text without `<` (one of an `enum`'s
    /// values when it has one; `string="true"`), other values as JSON to
    /// their schema (`string="false"`); then more invokes when `parallel`,
    /// and the close. A free string has no length bound: the model ends it.
    fn call_grammar(
        &self,
        tools: &[ToolSpec],
        choice: &ToolChoice,
        parallel: bool,
    ) -> Option<String> {
        let chosen = super::chosen_tools(tools, choice)?;
        let tags = CANONICAL;
        let end_invoke = lark_literal(&format!("{}\n", tags.invoke_close));
        let close = lark_literal(tags.close);
        let more = if parallel { " invoke*" } else { "" };
        let mut g = match choice {
            ToolChoice::Named(_) => format!("start: params_0 {end_invoke}{more} {close}\n"),
            ToolChoice::Required => format!("start: named {end_invoke}{more} {close}\n"),
            _ => format!(
                "start: \"\\n\" invoke{} {close}\n",
                if parallel { "+" } else { "" }
            ),
        };
        let names: Vec<String> = (0..chosen.len()).map(|i| format!("named_{i}")).collect();
        g.push_str(&format!("named: {}\n", names.join(" | ")));
        let open_invoke = lark_literal(&format!("{} name=\"", tags.invoke));
        g.push_str(&format!("invoke: {open_invoke} named {end_invoke}\n"));
        for (i, tool) in chosen.iter().enumerate() {
            let name = lark_literal(&format!("{}\">\n", escape_attr(&tool.name)));
            g.push_str(&format!("named_{i}: {name} params_{i}\n"));
            g.push_str(&params_rules(i, tool, tags));
        }
        Some(g)
    }
}

/// A Lark string literal of `s` (JSON's escapes are Lark's).
fn lark_literal(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// The rule `params_{i}`: the parameter lines of one tool's call, the
/// schema's properties in order, each required one always and the others
/// optionally; non-string values get a JSON rule each (`value_{i}_{k}`).
fn params_rules(i: usize, tool: &ToolSpec, tags: &Style) -> String {
    let schema = super::call_arguments_schema(&tool.parameters);
    let required: Vec<&str> = schema["required"]
        .as_array()
        .map(|r| r.iter().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    let end = lark_literal(&format!("{}\n", tags.param_close));
    let (mut parts, mut values) = (Vec::new(), String::new());
    if let Some(props) = schema["properties"].as_object() {
        for (k, (key, prop)) in props.iter().enumerate() {
            let is_string = prop["type"].as_str() == Some("string");
            let open = lark_literal(&format!(
                "{} name=\"{}\" string=\"{is_string}\">",
                tags.param,
                escape_attr(key)
            ));
            let choices: Option<Vec<String>> = prop["enum"].as_array().map(|e| {
                e.iter()
                    .filter_map(|v| v.as_str())
                    .map(lark_literal)
                    .collect()
            });
            let value =
                if let (true, Some(choices)) = (is_string, choices.filter(|c| !c.is_empty())) {
                    format!("( {} )", choices.join(" | "))
                } else if is_string {
                    // Raw text up to the close tag (`<` itself would need the
                    // entity a string value cannot hold unescaped).
                    "/[^<]*/".to_string()
                } else {
                    values.push_str(&format!("value_{i}_{k}: {}\n", super::json_rule(prop)));
                    format!("value_{i}_{k}")
                };
            let optional = if required.contains(&key.as_str()) {
                ""
            } else {
                "?"
            };
            parts.push(format!("( {open} {value} {end} ){optional}"));
        }
    }
    let body = if parts.is_empty() {
        "\"\"".to_string()
    } else {
        parts.join(" ")
    };
    format!("params_{i}: {body}\n{values}")
}

/// The §7.2 schema line of a tool, from the client's raw JSON: the raw value of
/// the `function` member for an OpenAI-wrapped tool, else the raw definition
/// itself (Anthropic `{"name","description","input_schema"}`, Responses
/// `{"type":"function",…}`). A spec without `raw` (one the dialect layer built,
/// e.g. from a Responses namespace or `tool_search` tool) gets the §7.2 synthesised
/// line `{"name":…,"description":…,"parameters":…}`.
fn schema_line(spec: &ToolSpec) -> String {
    if spec.raw.trim().is_empty() {
        let parameters = match spec.parameters.trim() {
            "" => r#"{"type":"object","properties":{}}"#,
            p => p,
        };
        return format!(
            "{{\"name\":{},\"description\":{},\"parameters\":{}}}",
            json_quote(&spec.name),
            json_quote(&spec.description),
            parameters
        );
    }
    json::object_members(&spec.raw)
        .and_then(|members| members.into_iter().find(|(key, _)| key == "function"))
        .map_or_else(|| spec.raw.clone(), |(_, raw)| raw.to_string())
}

/// One `parameter` line for a JSON member: strings decoded and written raw,
/// anything else as minified JSON (§7.3).
fn push_param(out: &mut String, key: &str, raw_value: &str) {
    if raw_value.starts_with('"') {
        if let Ok(text) = serde_json::from_str::<String>(raw_value) {
            push_string_param(out, key, &text);
            return;
        }
    }
    // Inside JSON the close tag can only sit in a string literal, where `\u003c`
    // means the same `<` (§4.6).
    let close = CANONICAL.param_close;
    let body = json::minify(raw_value).replace(close, &format!("\\u003c{}", &close[1..]));
    push_param_line(out, key, false, &body);
}

fn push_string_param(out: &mut String, key: &str, text: &str) {
    let close = CANONICAL.param_close;
    let body = text.replace(close, &format!("&lt;{}", &close[1..]));
    push_param_line(out, key, true, &body);
}

fn push_param_line(out: &mut String, key: &str, string: bool, body: &str) {
    out.push_str(&format!(
        "{} name=\"{}\" string=\"{string}\">{body}{}\n",
        CANONICAL.param,
        escape_attr(key),
        CANONICAL.param_close
    ));
}

/// §4.6: attribute values escape `& < > "`.
fn escape_attr(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            c => out.push(c),
        }
    }
    out
}

/// §7.4: the five XML entities are decoded; any other `&` is literal.
fn decode_entities(text: &str) -> String {
    const ENTITIES: [(&str, char); 5] = [
        ("&amp;", '&'),
        ("&lt;", '<'),
        ("&gt;", '>'),
        ("&quot;", '"'),
        ("&apos;", '\''),
    ];
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('&') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        match ENTITIES.iter().find(|(name, _)| rest.starts_with(name)) {
            Some((name, c)) => {
                out.push(*c);
                rest = &rest[name.len()..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

fn trim_ascii_ws_end(text: &str) -> &str {
    text.trim_end_matches(|c: char| c.is_ascii_whitespace())
}

/// The largest char boundary of `text` at or below `at`.
fn floor_boundary(text: &str, mut at: usize) -> usize {
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// Incremental DSML parser of one generated turn.
///
/// Text is reported once it cannot belong to a block: a tail that is a proper
/// prefix of an opening tag is held, and so is trailing whitespace (the content
/// before a block is trimmed, §7.4 step 3). From an opening tag on, nothing is
/// reported until the block resolves: parsed calls are reported when its close
/// arrives, and everything after the block is part of `calls_raw`; a block that
/// cannot parse is reported as text with a `Malformed` event, and the search for a
/// block resumes after its opening tag.
#[derive(Debug, Default)]
struct DsmlParser {
    /// The whole turn so far.
    text: String,
    /// Bytes of `text` reported as `Text`.
    emitted: usize,
    /// Where the search for an opening tag continues.
    scan_from: usize,
    open: Option<OpenBlock>,
    parsed: Option<ParsedBlock>,
    malformed: Option<String>,
    /// The whitespace run `safe_limit` last held back.
    ws_run: std::ops::Range<usize>,
}

#[derive(Debug)]
struct OpenBlock {
    style: &'static Style,
    /// Offset of the opening tag and of the first byte after it.
    start: usize,
    body: usize,
    /// Body length at which to try a parse again without a new close tag:
    /// geometric, so re-parsing a growing block stays linear overall.
    retry_at: usize,
    /// Where the search for the block's close tag continues.
    close_from: usize,
}

impl OpenBlock {
    /// Whether a parse attempt could now give a new answer: a close tag arrived,
    /// or enough text did to look for a structural error.
    fn due(&mut self, text: &str) -> bool {
        let close = self.style.close;
        let close_seen = match text[self.close_from..].find(close) {
            Some(at) => {
                // The tag starts with the one-byte `<`, so this is a boundary.
                self.close_from += at + 1;
                true
            }
            None => {
                let tail = text.len().saturating_sub(close.len() - 1);
                self.close_from = self.close_from.max(floor_boundary(text, tail));
                false
            }
        };
        let body_len = text.len() - self.body;
        if close_seen || body_len >= self.retry_at {
            self.retry_at = body_len + body_len / 4 + 32;
            return true;
        }
        false
    }
}

#[derive(Debug)]
struct ParsedBlock {
    /// End of the content (text before the block, trailing whitespace trimmed).
    content_end: usize,
    calls: Vec<ParsedCall>,
}

impl DsmlParser {
    fn advance(&mut self, eof: bool) -> Vec<ToolEvent> {
        let mut events = Vec::new();
        while self.parsed.is_none() {
            if let Some(block) = &mut self.open {
                if !eof && !block.due(&self.text) {
                    break;
                }
                match parse_block(&self.text[block.body..], block.style, eof) {
                    Ok(calls) => {
                        let content_end = trim_ascii_ws_end(&self.text[..block.start]).len();
                        events.extend(calls.iter().cloned().map(ToolEvent::Call));
                        self.parsed = Some(ParsedBlock { content_end, calls });
                    }
                    Err(Stop::NeedMore) => break,
                    Err(Stop::Invalid(reason)) => {
                        events.push(ToolEvent::Malformed {
                            reason: reason.clone(),
                        });
                        self.malformed.get_or_insert(reason);
                        self.scan_from = block.body;
                    }
                }
                self.open = None;
                continue;
            }
            match find_open(&self.text, self.scan_from) {
                Some((start, style)) => {
                    let content_end = trim_ascii_ws_end(&self.text[..start]).len();
                    self.emit_to(content_end, &mut events);
                    let body = start + style.open.len();
                    self.open = Some(OpenBlock {
                        style,
                        start,
                        body,
                        retry_at: 0,
                        close_from: body,
                    });
                }
                None => {
                    let limit = if eof {
                        self.text.len()
                    } else {
                        self.safe_limit()
                    };
                    self.emit_to(limit, &mut events);
                    let tail = self.text.len().saturating_sub(MAX_OPEN_LEN - 1);
                    self.scan_from = self.scan_from.max(floor_boundary(&self.text, tail));
                    break;
                }
            }
        }
        events
    }

    /// How far text can be reported: before a tail that may start an opening tag
    /// and before the whitespace in front of it.
    fn safe_limit(&mut self) -> usize {
        let text = &self.text;
        let held = STYLES
            .iter()
            .filter_map(|style| {
                (1..style.open.len()).rev().find(|&k| {
                    style
                        .open
                        .get(..k)
                        .is_some_and(|prefix| text.ends_with(prefix))
                })
            })
            .max()
            .unwrap_or(0);
        let end = text.len() - held;
        // Walk back over trailing whitespace, jumping over the run found last
        // time, so a model emitting endless newlines costs linear time.
        let bytes = text.as_bytes();
        let mut at = end;
        while at > self.emitted && bytes[at - 1].is_ascii_whitespace() {
            if at == self.ws_run.end {
                at = self.ws_run.start.max(self.emitted);
                break;
            }
            at -= 1;
        }
        self.ws_run = at..end;
        at
    }

    fn emit_to(&mut self, limit: usize, events: &mut Vec<ToolEvent>) {
        if limit > self.emitted {
            events.push(ToolEvent::Text(self.text[self.emitted..limit].to_string()));
            self.emitted = limit;
        }
    }
}

impl ToolParser for DsmlParser {
    fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.text.push_str(text);
        self.advance(false)
    }

    fn finish(&mut self) -> (Vec<ToolEvent>, ParsedTurn) {
        let events = self.advance(true);
        let malformed = self.malformed.clone();
        let turn = match &self.parsed {
            Some(block) => ParsedTurn {
                content: self.text[..block.content_end].to_string(),
                calls: block.calls.clone(),
                calls_raw: self.text[block.content_end..].to_string(),
                malformed,
            },
            None => ParsedTurn {
                content: self.text.clone(),
                malformed,
                ..ParsedTurn::default()
            },
        };
        (events, turn)
    }
}

const MAX_OPEN_LEN: usize = "<｜DSML｜tool_calls>".len();

/// The earliest opening tag at or after `from`.
fn find_open(text: &str, from: usize) -> Option<(usize, &'static Style)> {
    STYLES
        .iter()
        .filter_map(|style| text[from..].find(style.open).map(|at| (from + at, style)))
        .min_by_key(|(at, _)| *at)
}

/// Why a block parse stopped without calls.
#[derive(Debug, PartialEq, Eq)]
enum Stop {
    /// The text so far is a valid beginning that more text may complete.
    NeedMore,
    Invalid(String),
}

/// Parses the calls of a block from just after its opening tag through its close.
/// The answer for a prefix of a text is `NeedMore` or the answer for the text, so
/// it never depends on how the text was chunked. At `eof` nothing more comes.
fn parse_block(body: &str, style: &Style, eof: bool) -> Result<Vec<ParsedCall>, Stop> {
    let mut cur = Cursor {
        text: body,
        pos: 0,
        eof,
    };
    let mut calls = Vec::new();
    loop {
        cur.skip_ws();
        if cur.eat(style.close)? {
            if calls.is_empty() {
                return Err(Stop::Invalid("tool_calls block without invoke".into()));
            }
            return Ok(calls);
        }
        if !cur.eat(style.invoke)? {
            return Err(cur.unexpected("invoke or tool_calls close"));
        }
        let name = cur
            .attributes()?
            .into_iter()
            .find(|(key, _)| *key == "name")
            .map(|(_, value)| value)
            .filter(|name| !name.is_empty())
            .ok_or_else(|| Stop::Invalid("invoke without name".into()))?;
        let mut args = Vec::new();
        loop {
            cur.skip_ws();
            if cur.eat(style.invoke_close)? {
                break;
            }
            if !cur.eat(style.param)? {
                return Err(cur.unexpected("parameter or invoke close"));
            }
            args.push(cur.parameter(style, true)?);
        }
        calls.push(ParsedCall {
            name,
            arguments: object_json(&args),
        });
    }
}

/// A parsed argument value.
#[derive(Debug)]
enum ArgValue {
    Str(String),
    /// Minified JSON text.
    Json(String),
}

/// Compact JSON object text, members in the order written.
fn object_json(members: &[(String, ArgValue)]) -> String {
    let mut out = String::from("{");
    for (i, (key, value)) in members.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&json_quote(key));
        out.push(':');
        match value {
            ArgValue::Str(text) => out.push_str(&json_quote(text)),
            ArgValue::Json(json) => out.push_str(json),
        }
    }
    out.push('}');
    out
}

/// A `string="false"` body: minified JSON, `null` when empty. Text that is not
/// JSON is kept as a string (the C server would turn the whole call into `{}`).
fn json_value(body: &str) -> ArgValue {
    let minified = json::minify(body);
    if minified.is_empty() {
        ArgValue::Json("null".into())
    } else if serde_json::from_str::<serde_json::Value>(&minified).is_ok() {
        ArgValue::Json(minified)
    } else {
        ArgValue::Str(body.to_string())
    }
}

struct Cursor<'a> {
    text: &'a str,
    pos: usize,
    eof: bool,
}

impl<'a> Cursor<'a> {
    fn rest(&self) -> &'a str {
        &self.text[self.pos..]
    }

    fn skip_ws(&mut self) {
        let rest = self.rest();
        self.pos += rest.len()
            - rest
                .trim_start_matches(|c: char| c.is_ascii_whitespace())
                .len();
    }

    /// Consumes `lit` if the text continues with it; `NeedMore` while the text
    /// ends inside it.
    fn eat(&mut self, lit: &str) -> Result<bool, Stop> {
        let rest = self.rest();
        if rest.starts_with(lit) {
            self.pos += lit.len();
            Ok(true)
        } else if !self.eof && lit.starts_with(rest) {
            Err(Stop::NeedMore)
        } else {
            Ok(false)
        }
    }

    /// For a text that ran out: more may come, unless this is the end.
    fn ran_out(&self, what: &str) -> Stop {
        if self.eof {
            Stop::Invalid(format!("unterminated {what}"))
        } else {
            Stop::NeedMore
        }
    }

    fn unexpected(&self, expected: &str) -> Stop {
        if self.rest().is_empty() {
            return self.ran_out("tool_calls block");
        }
        Stop::Invalid(format!(
            "expected {expected} at byte {} of the block",
            self.pos
        ))
    }

    /// A tag's attributes through its `>`, values entity-decoded.
    fn attributes(&mut self) -> Result<Vec<(&'a str, String)>, Stop> {
        let mut attrs = Vec::new();
        loop {
            let before = self.pos;
            self.skip_ws();
            if self.eat(">")? {
                return Ok(attrs);
            }
            if self.pos == before {
                return Err(self.unexpected("whitespace or '>' in a tag"));
            }
            let rest = self.rest();
            let name_len = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
                .ok_or_else(|| self.ran_out("tag"))?;
            if name_len == 0 {
                return Err(self.unexpected("an attribute name"));
            }
            let name = &rest[..name_len];
            self.pos += name_len;
            if !self.eat("=\"")? {
                return Err(self.unexpected("=\" after an attribute name"));
            }
            let value_len = self.rest().find('"').ok_or_else(|| self.ran_out("tag"))?;
            attrs.push((name, decode_entities(&self.rest()[..value_len])));
            self.pos += value_len + 1;
        }
    }

    /// A parameter after its `<…parameter`, through its close. With `nested`, a
    /// parameter without a `string` attribute whose body opens another parameter
    /// is an object of leaf parameters (the C loose-nesting recovery, §7.4).
    fn parameter(&mut self, style: &Style, nested: bool) -> Result<(String, ArgValue), Stop> {
        let mut name = None;
        let mut string = None;
        for (key, value) in self.attributes()? {
            match key {
                "name" => name = Some(value),
                "string" => string = Some(value),
                _ => {}
            }
        }
        let name = name.ok_or_else(|| Stop::Invalid("parameter without name".into()))?;
        if nested && string.is_none() {
            let body = self.pos;
            self.skip_ws();
            if self.eat(style.param)? {
                let mut fields = vec![self.parameter(style, false)?];
                loop {
                    self.skip_ws();
                    if self.eat(style.param_close)? {
                        return Ok((name, ArgValue::Json(object_json(&fields))));
                    }
                    if !self.eat(style.param)? {
                        return Err(self.unexpected("parameter or parameter close"));
                    }
                    fields.push(self.parameter(style, false)?);
                }
            }
            self.pos = body;
        }
        let rest = self.rest();
        let len = rest
            .find(style.param_close)
            .ok_or_else(|| self.ran_out("parameter"))?;
        self.pos += len + style.param_close.len();
        let body = &rest[..len];
        // `string` defaults to true (§7.4).
        let value = if string.as_deref() == Some("false") {
            json_value(body)
        } else {
            ArgValue::Str(decode_entities(body))
        };
        Ok((name, value))
    }
}

/// Just enough JSON tokenising to re-emit values byte-for-byte (a `Value` round
/// trip would re-format numbers).
mod json {
    /// The members of `text` if it is one valid JSON object: keys decoded, values
    /// as raw text, in the order written.
    pub(super) fn object_members(text: &str) -> Option<Vec<(String, &str)>> {
        if !serde_json::from_str::<serde_json::Value>(text)
            .ok()?
            .is_object()
        {
            return None;
        }
        let bytes = text.as_bytes();
        let mut at = skip_ws(bytes, 0) + 1; // past `{`
        let mut members = Vec::new();
        loop {
            at = skip_ws(bytes, at);
            match bytes.get(at)? {
                b'}' => return Some(members),
                b',' => at = skip_ws(bytes, at + 1),
                _ => {}
            }
            let key_end = string_end(bytes, at)?;
            let key = serde_json::from_str::<String>(&text[at..key_end]).ok()?;
            at = skip_ws(bytes, key_end) + 1; // past `:`
            let value_start = skip_ws(bytes, at);
            let value_end = value_end(bytes, value_start)?;
            members.push((key, &text[value_start..value_end]));
            at = value_end;
        }
    }

    /// Removes whitespace outside string literals.
    pub(super) fn minify(text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let (mut in_string, mut escaped) = (false, false);
        for c in text.chars() {
            if in_string {
                match c {
                    _ if escaped => escaped = false,
                    '\\' => escaped = true,
                    '"' => in_string = false,
                    _ => {}
                }
            } else if matches!(c, ' ' | '\t' | '\n' | '\r') {
                continue;
            } else if c == '"' {
                in_string = true;
            }
            out.push(c);
        }
        out
    }

    fn skip_ws(bytes: &[u8], mut at: usize) -> usize {
        while bytes
            .get(at)
            .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        {
            at += 1;
        }
        at
    }

    /// End (exclusive) of the string literal opening at `at`.
    fn string_end(bytes: &[u8], at: usize) -> Option<usize> {
        let mut i = at + 1;
        loop {
            match bytes.get(i)? {
                b'\\' => i += 2,
                b'"' => return Some(i + 1),
                _ => i += 1,
            }
        }
    }

    /// End (exclusive) of the value starting at `at`.
    fn value_end(bytes: &[u8], at: usize) -> Option<usize> {
        match bytes.get(at)? {
            b'"' => string_end(bytes, at),
            b'{' | b'[' => {
                let mut depth = 0usize;
                let mut i = at;
                loop {
                    match bytes.get(i)? {
                        b'"' => {
                            i = string_end(bytes, i)?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                return Some(i + 1);
                            }
                        }
                        _ => {}
                    }
                    i += 1;
                }
            }
            _ => Some(
                at + bytes[at..]
                    .iter()
                    .position(|b| matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
                    .unwrap_or(bytes.len() - at),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::markup::test_support;
    use super::*;

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

    /// Runs the parser over `chunks`; events with adjacent texts merged.
    fn run(chunks: &[&str]) -> (Vec<ToolEvent>, ParsedTurn) {
        test_support::run(&Dsml, &[], chunks)
    }

    fn parse(text: &str) -> (Vec<ToolEvent>, ParsedTurn) {
        run(&[text])
    }

    /// `text` cut at char boundaries into pieces of at least `size` bytes.
    fn cut(text: &str, size: usize) -> Vec<&str> {
        let mut pieces = Vec::new();
        let mut at = 0;
        while at < text.len() {
            let mut end = (at + size.max(1)).min(text.len());
            while !text.is_char_boundary(end) {
                end += 1;
            }
            pieces.push(&text[at..end]);
            at = end;
        }
        pieces
    }

    const CANONICAL_EXAMPLE: &str = "Let me check.\n\n<｜DSML｜tool_calls>\n\
<｜DSML｜invoke name=\"read_file\">\n\
<｜DSML｜parameter name=\"path\" string=\"true\">src/main.rs</｜DSML｜parameter>\n\
<｜DSML｜parameter name=\"limit\" string=\"false\">100</｜DSML｜parameter>\n\
</｜DSML｜invoke>\n\
<｜DSML｜invoke name=\"grep\">\n\
<｜DSML｜parameter name=\"pattern\" string=\"true\">a && b > c</｜DSML｜parameter>\n\
<｜DSML｜parameter name=\"opts\" string=\"false\">{ \"i\": true, \"globs\": [\"*.rs\", \"*.md\"] }</｜DSML｜parameter>\n\
</｜DSML｜invoke>\n\
</｜DSML｜tool_calls>";

    #[test]
    fn tools_block_is_the_spec_text_with_schema_lines() {
        let openai = ToolSpec {
            name: "get_weather".into(),
            description: "Weather".into(),
            parameters: "{}".into(),
            raw: r#"{"type": "function", "function": {"name": "get_weather", "parameters": {"type":"object"}}}"#.into(),
        };
        let anthropic = ToolSpec {
            name: "ls".into(),
            description: String::new(),
            parameters: "{}".into(),
            raw: r#"{"name":"ls","input_schema":{}}"#.into(),
        };
        let synthesised = ToolSpec {
            name: "fs.read".into(),
            description: "Read \"it\"".into(),
            parameters: String::new(),
            raw: String::new(),
        };
        let expected = r#"## Tools

You have access to a set of tools to help answer the user question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as raw text and set `string="true"`. Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string characters with XML or HTML entity escapes. Only if a string value itself contains the exact closing parameter tag `</｜DSML｜parameter>`, write that tag as `&lt;/｜DSML｜parameter>` inside the value. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{"name": "get_weather", "parameters": {"type":"object"}}
{"name":"ls","input_schema":{}}
{"name":"fs.read","description":"Read \"it\"","parameters":{"type":"object","properties":{}}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls. Use the exact parameter names from the schemas."#;
        assert_eq!(
            Dsml.tools_block(&[openai, anthropic, synthesised]),
            expected
        );
    }

    #[test]
    fn render_calls_is_canonical() {
        let rendered = Dsml.render_calls(&[
            call("read_file", r#"{ "path": "src/main.rs", "limit": 100 }"#),
            call("noop", "{}"),
        ]);
        assert_eq!(
            rendered,
            "\n\n<｜DSML｜tool_calls>\n\
<｜DSML｜invoke name=\"read_file\">\n\
<｜DSML｜parameter name=\"path\" string=\"true\">src/main.rs</｜DSML｜parameter>\n\
<｜DSML｜parameter name=\"limit\" string=\"false\">100</｜DSML｜parameter>\n\
</｜DSML｜invoke>\n\
<｜DSML｜invoke name=\"noop\">\n\
</｜DSML｜invoke>\n\
</｜DSML｜tool_calls>"
        );
        assert_eq!(Dsml.render_calls(&[]), "");
    }

    #[test]
    fn render_calls_escapes_per_spec_table() {
        let rendered = Dsml.render_calls(&[call(
            "a&<b>\"",
            r#"{"k\"&": "x && y > z &amp; </｜DSML｜parameter> end", "n": { "s": "</｜DSML｜parameter>", "v": [1, 2.50, 1e3] }}"#,
        )]);
        assert_eq!(
            rendered,
            "\n\n<｜DSML｜tool_calls>\n\
<｜DSML｜invoke name=\"a&amp;&lt;b&gt;&quot;\">\n\
<｜DSML｜parameter name=\"k&quot;&amp;\" string=\"true\">x && y > z &amp; &lt;/｜DSML｜parameter> end</｜DSML｜parameter>\n\
<｜DSML｜parameter name=\"n\" string=\"false\">{\"s\":\"\\u003c/｜DSML｜parameter>\",\"v\":[1,2.50,1e3]}</｜DSML｜parameter>\n\
</｜DSML｜invoke>\n\
</｜DSML｜tool_calls>"
        );
    }

    #[test]
    fn non_object_arguments_become_one_string_parameter() {
        let rendered = Dsml.render_calls(&[call("f", "[1, 2]"), call("g", "not json")]);
        assert!(rendered.contains(
            "<｜DSML｜parameter name=\"arguments\" string=\"true\">[1, 2]</｜DSML｜parameter>"
        ));
        assert!(rendered.contains(
            "<｜DSML｜parameter name=\"arguments\" string=\"true\">not json</｜DSML｜parameter>"
        ));
    }

    #[test]
    fn forced_prefixes() {
        assert_eq!(
            Dsml.forced_prefix(&ToolChoice::Required).as_deref(),
            Some("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"")
        );
        assert_eq!(
            Dsml.forced_prefix(&ToolChoice::Named("a\"b".into()))
                .as_deref(),
            Some("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"a&quot;b\">\n")
        );
        assert_eq!(Dsml.forced_prefix(&ToolChoice::Auto), None);
        assert_eq!(Dsml.forced_prefix(&ToolChoice::None), None);
    }

    #[test]
    fn parses_the_canonical_example() {
        let (events, turn) = parse(CANONICAL_EXAMPLE);
        let calls = vec![
            parsed("read_file", r#"{"path":"src/main.rs","limit":100}"#),
            parsed(
                "grep",
                r#"{"pattern":"a && b > c","opts":{"i":true,"globs":["*.rs","*.md"]}}"#,
            ),
        ];
        assert_eq!(
            events,
            vec![
                ToolEvent::Text("Let me check.".into()),
                ToolEvent::Call(calls[0].clone()),
                ToolEvent::Call(calls[1].clone()),
            ]
        );
        assert_eq!(turn.content, "Let me check.");
        assert_eq!(turn.calls, calls);
        assert_eq!(turn.content + &turn.calls_raw, CANONICAL_EXAMPLE);
        assert_eq!(turn.malformed, None);
    }

    #[test]
    fn parses_short_and_plain_spellings() {
        for bar in ["DSML｜", ""] {
            let text = format!(
                "Hi\n\n<{bar}tool_calls>\n<{bar}invoke name=\"f\">\n\
                 <{bar}parameter name=\"x\" string=\"false\">[1, 2]</{bar}parameter>\n\
                 </{bar}invoke>\n</{bar}tool_calls>"
            );
            let (_, turn) = parse(&text);
            assert_eq!(turn.calls, vec![parsed("f", r#"{"x":[1,2]}"#)], "{bar:?}");
            assert_eq!(turn.content, "Hi");
            assert_eq!(turn.calls_raw, &text[2..]);
        }
    }

    #[test]
    fn string_defaults_true_and_entities_decode() {
        let text = "<｜DSML｜tool_calls><｜DSML｜invoke name=\"a&amp;b\">\
<｜DSML｜parameter name=\"s\">&lt;x&gt; &amp;&amp; &quot;q&quot; &apos;a&apos; &nbsp; &</｜DSML｜parameter>\
<｜DSML｜parameter name=\"e\" string=\"false\"></｜DSML｜parameter>\
<｜DSML｜parameter name=\"bad\" string=\"false\">not json</｜DSML｜parameter>\
</｜DSML｜invoke></｜DSML｜tool_calls>";
        let (_, turn) = parse(text);
        assert_eq!(
            turn.calls,
            vec![parsed(
                "a&b",
                r#"{"s":"<x> && \"q\" 'a' &nbsp; &","e":null,"bad":"not json"}"#
            )]
        );
        assert_eq!(turn.content, "");
    }

    #[test]
    fn loose_nesting_becomes_an_object() {
        let text = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n\
<｜DSML｜parameter name=\"opts\">\n\
  <｜DSML｜parameter name=\"depth\" string=\"false\">2</｜DSML｜parameter>\n\
  <｜DSML｜parameter name=\"name\">x</｜DSML｜parameter>\n\
</｜DSML｜parameter>\n\
<｜DSML｜parameter name=\"blank\"> </｜DSML｜parameter>\n\
</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        let (_, turn) = parse(text);
        assert_eq!(
            turn.calls,
            vec![parsed(
                "f",
                r#"{"opts":{"depth":2,"name":"x"},"blank":" "}"#
            )]
        );
    }

    #[test]
    fn malformed_block_is_returned_as_text() {
        let text =
            "See <｜DSML｜tool_calls>\n<｜DSML｜invoke>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        let (events, turn) = parse(text);
        assert_eq!(
            events,
            vec![
                ToolEvent::Text("See".into()),
                ToolEvent::Malformed {
                    reason: "invoke without name".into()
                },
                ToolEvent::Text(text[3..].into()),
            ]
        );
        assert_eq!(turn.content, text);
        assert!(turn.calls.is_empty() && turn.calls_raw.is_empty());
        assert_eq!(turn.malformed.as_deref(), Some("invoke without name"));
    }

    #[test]
    fn unterminated_block_is_text_at_finish() {
        let text = "x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\">1";
        let (events, turn) = parse(text);
        assert_eq!(
            events,
            vec![
                ToolEvent::Text("x".into()),
                ToolEvent::Malformed {
                    reason: "unterminated parameter".into()
                },
                ToolEvent::Text(text[1..].into()),
            ]
        );
        assert_eq!(turn.content, text);
        assert!(turn.calls.is_empty());
    }

    #[test]
    fn prose_with_a_marker_does_not_hide_a_later_block() {
        // The C parser prefers the canonical marker over `<tool_calls>`; retrying
        // after a failed block gives the same answer here.
        let text = "Use <tool_calls> like this.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        let (events, turn) = parse(text);
        assert_eq!(turn.content, "Use <tool_calls> like this.");
        assert_eq!(turn.calls, vec![parsed("f", "{}")]);
        assert!(matches!(events[1], ToolEvent::Malformed { .. }));
        assert_eq!(events.last(), Some(&ToolEvent::Call(parsed("f", "{}"))));
    }

    #[test]
    fn plain_text_is_streamed_with_only_possible_markers_held() {
        let mut parser = Dsml.parser(&[]);
        assert_eq!(parser.push("a < b"), vec![ToolEvent::Text("a < b".into())]);
        assert_eq!(
            parser.push(" and \n\n<"),
            vec![ToolEvent::Text(" and".into())]
        );
        assert_eq!(parser.push("｜DS"), vec![]);
        assert_eq!(
            parser.push("X"),
            vec![ToolEvent::Text(" \n\n<｜DSX".into())]
        );
        assert_eq!(parser.push("\n"), vec![]);
        let (events, turn) = parser.finish();
        assert_eq!(events, vec![ToolEvent::Text("\n".into())]);
        assert_eq!(turn.content, "a < b and \n\n<｜DSX\n");
        assert!(turn.calls.is_empty() && turn.malformed.is_none());
    }

    #[test]
    fn calls_are_reported_when_the_block_closes() {
        let mut parser = Dsml.parser(&[]);
        let open = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>\n";
        assert_eq!(parser.push(open), vec![]);
        assert_eq!(parser.push("</｜DSML｜tool_calls"), vec![]);
        assert_eq!(parser.push(">"), vec![ToolEvent::Call(parsed("f", "{}"))]);
        // Anything after the block is part of calls_raw, never text.
        assert_eq!(parser.push("\ntrailing"), vec![]);
        let (events, turn) = parser.finish();
        assert!(events.is_empty());
        assert_eq!(
            turn.calls_raw,
            format!("{open}</｜DSML｜tool_calls>\ntrailing")
        );
    }

    #[test]
    fn forced_prefix_then_generated_text() {
        let prefix = Dsml
            .forced_prefix(&ToolChoice::Named("f".into()))
            .unwrap_or_default();
        let generated = "<｜DSML｜parameter name=\"q\">hi</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        let (events, turn) = run(&[&prefix, generated]);
        assert_eq!(events, vec![ToolEvent::Call(parsed("f", r#"{"q":"hi"}"#))]);
        assert_eq!(turn.content, "");
        assert_eq!(turn.calls_raw, prefix + generated);
    }

    #[test]
    fn chunking_does_not_change_the_result() {
        let texts = [
            CANONICAL_EXAMPLE.to_string(),
            "plain answer with <b>tags</b> and  trailing  \n\n".into(),
            "ünïcödé <｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"é\">\n<｜DSML｜parameter name=\"s\">日本語 </｜DSML｜tool_calls> &lt;/｜DSML｜parameter></｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>".into(),
            "Use <tool_calls> x </tool_calls> then\n\n<DSML｜tool_calls><DSML｜invoke name=\"g\"></DSML｜invoke></DSML｜tool_calls>".into(),
            "bad <｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\"><｜DSML｜parameter name=\"a\" string=\"false\">{\"a\": </｜DSML｜parameter>".into(),
            format!("{}{}", "x".repeat(3000), CANONICAL_EXAMPLE),
        ];
        for text in &texts {
            // Whole, char by char and random chunks agree; content + calls_raw = text.
            let (want_events, want_turn) = test_support::parse(&Dsml, &[], text);
            // Text events add up to the content (all of the text without calls).
            let shown: String = want_events
                .iter()
                .filter_map(|e| match e {
                    ToolEvent::Text(t) => Some(t.as_str()),
                    _ => None,
                })
                .collect();
            assert_eq!(shown, want_turn.content);
        }
    }

    #[test]
    fn long_turns_in_tiny_chunks_parse_in_linear_time() {
        // Quadratic rescans would take minutes here.
        let newlines = "\n".repeat(300_000);
        let body = "y".repeat(300_000);
        let text = format!(
            "a{newlines}b\n\n<｜DSML｜tool_calls><｜DSML｜invoke name=\"f\">\
             <｜DSML｜parameter name=\"s\">{body}</｜DSML｜parameter>\
             </｜DSML｜invoke></｜DSML｜tool_calls>"
        );
        let chunks = cut(&text, 2);
        let (events, turn) = run(&chunks);
        assert_eq!(turn.content, format!("a{newlines}b"));
        assert_eq!(
            turn.calls,
            vec![parsed("f", &format!("{{\"s\":\"{body}\"}}"))]
        );
        assert_eq!(events.len(), 2);
    }

    #[test]
    fn render_then_parse_gives_the_calls_back() {
        let calls = [
            call("read_file", r#"{"path":"a b/c.txt","n":3,"flags":[1,2.50,-1e3],"o":{"x":null,"y":"z"}}"#),
            call("write", "{\"text\":\"line\\nbreak\\ttab \\\"q\\\" \\\\ a && b </｜DSML｜parameter> <x>\",\"ok\":false}"),
            call("empty", "{}"),
        ];
        let (events, turn) = parse(&Dsml.render_calls(&calls));
        let want: Vec<ParsedCall> = calls
            .iter()
            .map(|c| parsed(&c.name, &c.arguments))
            .collect();
        assert_eq!(turn.calls, want);
        assert_eq!(events.len(), 3);
    }

    #[test]
    fn entity_text_in_string_values_does_not_round_trip() {
        // The body is written verbatim but read entity-decoded (§4.6 vs §7.4), as in
        // the C server; the prompt tells the model never to write entities.
        let (_, turn) = parse(&Dsml.render_calls(&[call("f", r#"{"s":"&amp;"}"#)]));
        assert_eq!(turn.calls, vec![parsed("f", r#"{"s":"&"}"#)]);
    }

    #[test]
    fn the_call_grammar_writes_the_canonical_block_from_each_schema() {
        let tool = |name: &str, parameters: &str| ToolSpec {
            name: name.into(),
            description: String::new(),
            parameters: parameters.into(),
            raw: String::new(),
        };
        let tools = [
            tool(
                "get_weather",
                r#"{"type":"object","properties":{"city":{"type":"string"},
                   "unit":{"type":"string","enum":["c","f"]},"days":{"type":"integer"}},
                   "required":["city"]}"#,
            ),
            tool("ls", "not json"),
        ];
        let all = Dsml
            .call_grammar(&tools, &ToolChoice::Required, true)
            .unwrap();
        assert!(all.starts_with(
            "start: named \"</｜DSML｜invoke>\\n\" invoke* \"</｜DSML｜tool_calls>\"\n"
        ));
        assert!(all.contains("named: named_0 | named_1\n"), "{all}");
        assert!(
            all.contains("named_0: \"get_weather\\\">\\n\" params_0\n"),
            "{all}"
        );
        // A free string ends at the close tag; an enum is one of its values; a
        // number is JSON to its schema; only the required property is owed.
        assert!(all.contains(
            "( \"<｜DSML｜parameter name=\\\"city\\\" string=\\\"true\\\">\" /[^<]*/ \"</｜DSML｜parameter>\\n\" ) "
        ), "{all}");
        assert!(
            all.contains("string=\\\"true\\\">\" ( \"c\" | \"f\" ) \"</｜DSML｜parameter>\\n\" )?"),
            "{all}"
        );
        assert!(
            all.contains("string=\\\"false\\\">\" value_0_2 \"</｜DSML｜parameter>\\n\" )?"),
            "{all}"
        );
        assert!(all.contains("value_0_2: %json"), "{all}");
        // Tools without properties take an empty invoke.
        assert!(all.contains("params_1: \"\"\n"), "{all}");
        let single = Dsml
            .call_grammar(&tools, &ToolChoice::Required, false)
            .unwrap();
        assert!(!single.contains("invoke*"), "{single}");
        let auto = Dsml.call_grammar(&tools, &ToolChoice::Auto, true).unwrap();
        assert!(auto.starts_with("start: \"\\n\" invoke+ \"</｜DSML｜tool_calls>\"\n"));
        assert_eq!(Dsml.call_trigger(), Some("<｜DSML｜tool_calls>"));
        let named = Dsml
            .call_grammar(&tools, &ToolChoice::Named("ls".into()), false)
            .unwrap();
        assert!(named.starts_with("start: params_0 ") && !named.contains("get_weather"));
        assert_eq!(Dsml.call_grammar(&tools, &ToolChoice::None, true), None);
        assert_eq!(
            Dsml.call_grammar(&tools, &ToolChoice::Named("nope".into()), true),
            None
        );
    }
}
