//! Pieces shared by the XML-tagged call syntaxes ([`super::QwenXml`], [`super::Glm`]):
//! the incremental `<tool_call>…</tool_call>` block scanner, argument value typing
//! from the offered schemas, tag-walking helpers for the block bodies, and the
//! Python-`tojson`-style printing their Jinja templates use.

use serde_json::{Map, Value};

use super::{ParsedCall, ParsedTurn, ToolEvent, ToolParser, ToolSpec};

pub(super) const CALL_OPEN: &str = "<tool_call>";
pub(super) const CALL_CLOSE: &str = "</tool_call>";

/// Parses the text between `<tool_call>` and `</tool_call>` into a call, or says why not.
pub(super) type ParseBody = fn(body: &str, schemas: &Schemas) -> Result<ParsedCall, String>;

/// Incremental parser for syntaxes whose calls are `<tool_call>BODY</tool_call>` blocks;
/// the family only supplies how a body reads.
pub(super) struct BlockParser {
    parse_body: ParseBody,
    schemas: Schemas,
    /// Everything generated so far (the turn is kept whole for `finish`).
    text: String,
    /// Bytes of `text` already reported (as text or as a call).
    reported: usize,
    /// Start of the open call block, while inside one.
    open_call: Option<usize>,
    /// Where the search for the open block's close tag resumes.
    close_search_from: usize,
    /// Start of the first block that parsed: where the content ends.
    first_call: Option<usize>,
    calls: Vec<ParsedCall>,
    malformed: Option<String>,
}

impl BlockParser {
    pub(super) fn new(parse_body: ParseBody, tools: &[ToolSpec]) -> Self {
        BlockParser {
            parse_body,
            schemas: Schemas::new(tools),
            text: String::new(),
            reported: 0,
            open_call: None,
            close_search_from: 0,
            first_call: None,
            calls: Vec::new(),
            malformed: None,
        }
    }

    fn scan(&mut self, events: &mut Vec<ToolEvent>) {
        loop {
            match self.open_call {
                Some(start) => {
                    let from = self.close_search_from;
                    let Some(at) = self.text[from..].find(CALL_CLOSE).map(|i| from + i) else {
                        // The close tag may be split across pushes: re-search its length.
                        let back = self.text.len().saturating_sub(CALL_CLOSE.len() - 1);
                        self.close_search_from = floor_char_boundary(&self.text, back.max(from));
                        return;
                    };
                    let end = at + CALL_CLOSE.len();
                    let body = &self.text[start + CALL_OPEN.len()..at];
                    match (self.parse_body)(body, &self.schemas) {
                        Ok(call) => {
                            self.first_call.get_or_insert(start);
                            self.calls.push(call.clone());
                            events.push(ToolEvent::Call(call));
                        }
                        Err(reason) => {
                            events.push(ToolEvent::Text(self.text[start..end].to_string()));
                            self.note_malformed(reason, events);
                        }
                    }
                    self.reported = end;
                    self.open_call = None;
                }
                None => {
                    let rest = &self.text[self.reported..];
                    if let Some(i) = rest.find(CALL_OPEN) {
                        let start = self.reported + i;
                        self.emit_text(start, events);
                        self.open_call = Some(start);
                        self.close_search_from = start + CALL_OPEN.len();
                    } else {
                        let held = held_tail(rest, CALL_OPEN);
                        self.emit_text(self.text.len() - held, events);
                        return;
                    }
                }
            }
        }
    }

    /// Reports `text[reported..to]` as visible text.
    fn emit_text(&mut self, to: usize, events: &mut Vec<ToolEvent>) {
        if to > self.reported {
            events.push(ToolEvent::Text(self.text[self.reported..to].to_string()));
            self.reported = to;
        }
    }

    fn note_malformed(&mut self, reason: String, events: &mut Vec<ToolEvent>) {
        events.push(ToolEvent::Malformed {
            reason: reason.clone(),
        });
        self.malformed = Some(reason);
    }
}

impl ToolParser for BlockParser {
    fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.text.push_str(text);
        let mut events = Vec::new();
        self.scan(&mut events);
        events
    }

    fn finish(&mut self) -> (Vec<ToolEvent>, ParsedTurn) {
        let mut events = Vec::new();
        self.emit_text(self.text.len(), &mut events);
        if self.open_call.take().is_some() {
            self.note_malformed("unclosed tool call".to_string(), &mut events);
        }
        let turn = match self.first_call {
            Some(start) => {
                let content = self.text[..start].trim_end();
                ParsedTurn {
                    content: content.to_string(),
                    calls: self.calls.clone(),
                    calls_raw: self.text[content.len()..].to_string(),
                    malformed: self.malformed.clone(),
                }
            }
            None => ParsedTurn {
                content: self.text.clone(),
                malformed: self.malformed.clone(),
                ..ParsedTurn::default()
            },
        };
        (events, turn)
    }
}

/// Length of the longest tail of `text` that is a proper prefix of `marker`: text
/// that must wait, because the next push may complete the marker.
pub(super) fn held_tail(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|&n| text.ends_with(&marker[..n]))
        .unwrap_or(0)
}

pub(super) fn floor_char_boundary(text: &str, mut at: usize) -> usize {
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// The offered tools' parameter schemas, for typing argument values.
pub(super) struct Schemas(Vec<(String, Value)>);

impl Schemas {
    fn new(tools: &[ToolSpec]) -> Self {
        Schemas(
            tools
                .iter()
                .map(|t| {
                    let schema = serde_json::from_str(&t.parameters).unwrap_or(Value::Null);
                    (t.name.clone(), schema)
                })
                .collect(),
        )
    }

    /// The JSON value of an argument the model wrote as bare text: a string, unless
    /// the tool's schema declares the parameter non-string, in which case the text
    /// is read as JSON (falling back to the string when it is not JSON).
    pub(super) fn typed_value(&self, tool: &str, param: &str, text: &str) -> Value {
        let property = self
            .0
            .iter()
            .find(|(name, _)| name == tool)
            .and_then(|(_, schema)| schema.get("properties")?.get(param));
        let non_string = property.is_some_and(|p| {
            let mut types = Vec::new();
            declared_types(p, &mut types);
            !types.is_empty() && !types.contains(&"string")
        });
        if non_string {
            if let Ok(value) = serde_json::from_str(text) {
                return value;
            }
        }
        Value::String(text.to_string())
    }
}

/// The `type`s a property schema allows, including those of `anyOf` / `oneOf` branches.
fn declared_types<'a>(schema: &'a Value, out: &mut Vec<&'a str>) {
    match schema.get("type") {
        Some(Value::String(t)) => out.push(t),
        Some(Value::Array(ts)) => out.extend(ts.iter().filter_map(Value::as_str)),
        _ => {}
    }
    for key in ["anyOf", "oneOf"] {
        for branch in schema
            .get(key)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            declared_types(branch, out);
        }
    }
}

/// Collects parsed arguments in the model's order; a repeated name is an error (the
/// JSON object could not hold both).
pub(super) fn insert_argument(
    args: &mut Map<String, Value>,
    name: &str,
    value: Value,
) -> Result<(), String> {
    if args.contains_key(name) {
        return Err(format!("argument `{name}` given twice"));
    }
    args.insert(name.to_string(), value);
    Ok(())
}

// ---- Walking a block body ----

/// `text` after leading whitespace, when it starts with `tag`: what follows the tag.
pub(super) fn after_tag<'a>(text: &'a str, tag: &str) -> Option<&'a str> {
    text.trim_start().strip_prefix(tag)
}

/// A function or argument name between tags: trimmed, non-empty, one word.
pub(super) fn tag_name<'a>(text: &'a str, what: &str) -> Result<&'a str, String> {
    let name = text.trim();
    if name.is_empty() || name.contains(|c: char| c.is_whitespace() || c == '<' || c == '>') {
        return Err(format!("bad {what} name {name:?}"));
    }
    Ok(name)
}

/// Splits `text` at the first `delim`: (before, after the delimiter).
pub(super) fn split_at_tag<'a>(text: &'a str, delim: &str) -> Option<(&'a str, &'a str)> {
    text.find(delim)
        .map(|i| (&text[..i], &text[i + delim.len()..]))
}

/// Splits a value off `text` at the `close` tag that ends it: the first one followed
/// (after whitespace) by one of `next` or by the end of `text`. A value may thus
/// contain the close tag's text itself, as code often does.
pub(super) fn split_value<'a>(
    text: &'a str,
    close: &str,
    next: &[&str],
) -> Option<(&'a str, &'a str)> {
    let mut from = 0;
    while let Some(i) = text[from..].find(close) {
        let at = from + i;
        let rest = &text[at + close.len()..];
        let follower = rest.trim_start();
        if follower.is_empty() || next.iter().any(|n| follower.starts_with(n)) {
            return Some((&text[..at], rest));
        }
        from = at + close.len();
    }
    None
}

// ---- Rendering the way the Jinja templates do ----

/// The function object of a tool (`{"name", "description", "parameters", …}`): from
/// the client's own definition when it has one, so extra keys and key order survive.
pub(super) fn function_object(tool: &ToolSpec) -> Value {
    match client_definition(tool) {
        Some(Value::Object(mut def)) => def.remove("function").unwrap_or(Value::Null),
        _ => built_function(tool),
    }
}

/// The whole tool object as the client sent it (`{"type": "function", "function": …}`),
/// rebuilt from the fields when the raw definition is not in that form.
pub(super) fn tool_object(tool: &ToolSpec) -> Value {
    client_definition(tool).unwrap_or_else(|| {
        let mut def = Map::new();
        def.insert("type".into(), "function".into());
        def.insert("function".into(), built_function(tool));
        Value::Object(def)
    })
}

/// The client's definition, if it is an OpenAI-style tool object.
fn client_definition(tool: &ToolSpec) -> Option<Value> {
    let def: Value = serde_json::from_str(&tool.raw).ok()?;
    def.get("function")?.is_object().then_some(def)
}

fn built_function(tool: &ToolSpec) -> Value {
    let mut f = Map::new();
    f.insert("name".into(), tool.name.clone().into());
    if !tool.description.is_empty() {
        f.insert("description".into(), tool.description.clone().into());
    }
    let parameters =
        serde_json::from_str(&tool.parameters).unwrap_or_else(|_| Value::Object(Map::new()));
    f.insert("parameters".into(), parameters);
    Value::Object(f)
}

/// A call's arguments object, members in the given order (nothing when the text is
/// not a JSON object: there is no template rendering for that).
pub(super) fn argument_members(arguments: &str) -> Map<String, Value> {
    match serde_json::from_str(arguments) {
        Ok(Value::Object(members)) => members,
        _ => Map::new(),
    }
}

/// An argument value as the templates write it: strings bare, anything else as
/// `tojson` prints it.
pub(super) fn bare_value(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => py_json(other),
    }
}

/// JSON as Python's `json.dumps` writes it by default, which is what the templates'
/// `tojson` runs: `", "` and `": "` separators, non-ASCII kept, floats in `repr` form.
pub(super) fn py_json(value: &Value) -> String {
    let mut out = String::new();
    write_py_json(value, &mut out);
    out
}

fn write_py_json(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&py_number(n)),
        Value::String(s) => write_json_string(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py_json(item, out);
            }
            out.push(']');
        }
        Value::Object(members) => {
            out.push('{');
            for (i, (key, item)) in members.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_json_string(key, out);
                out.push_str(": ");
                write_py_json(item, out);
            }
            out.push('}');
        }
    }
}

/// Python's `str()` of a JSON value, what the templates' `| string` prints.
pub(super) fn py_str(value: &Value) -> String {
    match value {
        Value::Null => "None".to_string(),
        Value::Bool(b) => (if *b { "True" } else { "False" }).to_string(),
        Value::String(s) => s.clone(),
        Value::Number(n) => py_number(n),
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(py_repr).collect();
            format!("[{}]", items.join(", "))
        }
        Value::Object(members) => {
            let members: Vec<String> = members
                .iter()
                .map(|(k, v)| format!("'{}': {}", py_quote_escape(k), py_repr(v)))
                .collect();
            format!("{{{}}}", members.join(", "))
        }
    }
}

/// Python's `repr()` as it shows inside a list or dict (strings single-quoted).
fn py_repr(value: &Value) -> String {
    match value {
        Value::String(s) => format!("'{}'", py_quote_escape(s)),
        other => py_str(other),
    }
}

fn py_quote_escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\'', "\\'")
}

/// A JSON string literal, escaped like serde_json's compact output.
pub(super) fn json_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    write_json_string(s, &mut out);
    out
}

fn write_json_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if c < ' ' => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

fn py_number(n: &serde_json::Number) -> String {
    match n.as_f64() {
        Some(f) if n.is_f64() => py_float(f),
        _ => n.to_string(),
    }
}

/// Python's float `repr`: the shortest round-trip digits, positional for exponents
/// -4..16 (always with a fraction), otherwise `d.ddde±XX`.
fn py_float(f: f64) -> String {
    // Rust's `{:e}` gives the same shortest digits, as `-d.ddde<exp>`.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        if exp < 0 {
            let zeros = "0".repeat((-exp - 1) as usize);
            format!("{sign}0.{zeros}{digits}")
        } else {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                let zeros = "0".repeat(int_len - digits.len());
                format!("{sign}{digits}{zeros}.0")
            } else {
                format!("{sign}{}.{}", &digits[..int_len], &digits[int_len..])
            }
        }
    } else {
        let (lead, frac) = digits.split_at(1);
        let dot = if frac.is_empty() { "" } else { "." };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{lead}{dot}{frac}e{exp_sign}{:02}", exp.abs())
    }
}

#[cfg(test)]
pub(super) mod test_support {
    //! Drives a syntax's parser over one text in several chunkings and checks that
    //! they all agree.

    use super::super::{ParsedTurn, ToolEvent, ToolSpec, ToolSyntax};

    /// Runs `text` through a fresh parser in the given pieces; adjacent `Text` events
    /// are merged so chunkings can be compared.
    pub fn run(
        syntax: &dyn ToolSyntax,
        tools: &[ToolSpec],
        pieces: &[&str],
    ) -> (Vec<ToolEvent>, ParsedTurn) {
        let mut parser = syntax.parser(tools);
        let mut events = Vec::new();
        for piece in pieces {
            events.extend(parser.push(piece));
        }
        let (tail, turn) = parser.finish();
        events.extend(tail);
        (merge_text(events), turn)
    }

    fn merge_text(events: Vec<ToolEvent>) -> Vec<ToolEvent> {
        let mut merged: Vec<ToolEvent> = Vec::new();
        for event in events {
            match (merged.last_mut(), event) {
                (_, ToolEvent::Text(t)) if t.is_empty() => {}
                (Some(ToolEvent::Text(prev)), ToolEvent::Text(t)) => prev.push_str(&t),
                (_, event) => merged.push(event),
            }
        }
        merged
    }

    /// Parses `text` whole, char by char and in pseudo-random chunks; asserts that all
    /// give the same events and turn, that the turn covers the text exactly, and that
    /// the visible text plus the calls' raw text is the input. Returns the result.
    pub fn parse(
        syntax: &dyn ToolSyntax,
        tools: &[ToolSpec],
        text: &str,
    ) -> (Vec<ToolEvent>, ParsedTurn) {
        let whole = run(syntax, tools, &[text]);
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(syntax, tools, &chars), whole, "char by char: {text:?}");
        let boundaries: Vec<usize> = text
            .char_indices()
            .map(|(i, _)| i)
            .chain([text.len()])
            .collect();
        for seed in 1..=8u64 {
            let mut state = seed;
            let mut pieces = Vec::new();
            let mut at = 0;
            while at < text.len() {
                // xorshift: a cheap reproducible stream of chunk lengths (1..=13 chars).
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let idx = boundaries.partition_point(|&b| b <= at) - 1;
                let next = boundaries[(idx + 1 + (state % 13) as usize).min(boundaries.len() - 1)];
                pieces.push(&text[at..next]);
                at = next;
            }
            assert_eq!(run(syntax, tools, &pieces), whole, "chunks {pieces:?}");
        }
        let (_, turn) = &whole;
        assert_eq!(format!("{}{}", turn.content, turn.calls_raw), text);
        whole
    }

    pub fn tool(name: &str, parameters: &str) -> ToolSpec {
        ToolSpec {
            name: name.to_string(),
            description: String::new(),
            parameters: parameters.to_string(),
            raw: String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_float_repr() {
        let cases = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.5, "1.5"),
            (100000.0, "100000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1e16, "1e+16"),
            (1.5e300, "1.5e+300"),
            (123456789.125, "123456789.125"),
            (-2.5e-7, "-2.5e-07"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float(f), want, "{f}");
        }
    }

    #[test]
    fn python_json_and_str() {
        let v: Value =
            serde_json::from_str(r#"{"b":[1,2.0,"x\ny"],"a":{"é":null,"t":true}}"#).unwrap();
        assert_eq!(
            py_json(&v),
            r#"{"b": [1, 2.0, "x\ny"], "a": {"é": null, "t": true}}"#
        );
        let v: Value = serde_json::from_str(r#"[true,null,"it's",3]"#).unwrap();
        assert_eq!(py_str(&v), r#"[True, None, 'it\'s', 3]"#);
        assert_eq!(py_str(&Value::Bool(false)), "False");
    }

    #[test]
    fn schema_types_decide_how_values_read() {
        let tools = [test_support::tool(
            "f",
            r#"{"type":"object","properties":{"s":{"type":"string"},"n":{"type":"integer"},"o":{"anyOf":[{"type":"object"},{"type":"null"}]},"u":{"type":["string","null"]},"e":{"enum":["1","2"]}}}"#,
        )];
        let schemas = Schemas::new(&tools);
        assert_eq!(schemas.typed_value("f", "s", "12"), Value::from("12"));
        assert_eq!(schemas.typed_value("f", "n", "12"), Value::from(12));
        assert_eq!(
            schemas.typed_value("f", "n", "twelve"),
            Value::from("twelve")
        );
        assert_eq!(
            schemas.typed_value("f", "o", "{\"a\": 1}"),
            serde_json::json!({"a": 1})
        );
        assert_eq!(schemas.typed_value("f", "u", "12"), Value::from("12"));
        assert_eq!(schemas.typed_value("f", "e", "1"), Value::from("1"));
        assert_eq!(schemas.typed_value("f", "unknown", "1"), Value::from("1"));
        assert_eq!(schemas.typed_value("g", "n", "1"), Value::from("1"));
    }

    #[test]
    fn held_tail_is_a_proper_prefix_of_the_marker() {
        assert_eq!(held_tail("abc <tool_ca", CALL_OPEN), 8);
        assert_eq!(held_tail("abc <", CALL_OPEN), 1);
        assert_eq!(held_tail("abc <tool_call", CALL_OPEN), 10);
        assert_eq!(held_tail("abc", CALL_OPEN), 0);
        assert_eq!(held_tail("a <b", CALL_OPEN), 0);
    }

    #[test]
    fn values_may_contain_their_close_tag() {
        let text = "a </x> b\n</x>\n<y>rest";
        assert_eq!(
            split_value(text, "</x>", &["<y>"]),
            Some(("a </x> b\n", "\n<y>rest"))
        );
        assert_eq!(split_value("v</x>", "</x>", &["<y>"]), Some(("v", "")));
        assert_eq!(split_value("v</x> tail", "</x>", &["<y>"]), None);
    }
}
