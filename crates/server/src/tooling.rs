//! Server-side tool calling: tool definitions read from any dialect and
//! unguessable call ids (the exact-replay memory is the runtime's
//! `ToolMemory`).

use std::collections::HashMap;

use ds4_chat::ToolSpec;
use serde_json::Value;

/// One tool definition, in any dialect's shape: OpenAI `{type, function: {name,
/// description, parameters}}`, Anthropic `{name, description, input_schema}` or
/// Responses `{type: "function", name, description, parameters}`. Hosted tools
/// (a `type` other than function/custom and no schema, e.g. web search) are not
/// ours to run: `Ok(None)`. `at` names the item in errors (`tools[3]`).
fn parse_tool(v: &Value, at: &str) -> Result<Option<ToolSpec>, String> {
    let Some(obj) = v.as_object() else {
        return Err(format!("{at} must be an object"));
    };
    let def = obj.get("function").unwrap_or(v);
    let schema = def.get("parameters").or_else(|| def.get("input_schema"));
    let ty = obj.get("type").and_then(Value::as_str);
    if schema.is_none() && ty.is_some_and(|t| t != "function" && t != "custom") {
        return Ok(None);
    }
    let name = match def.get("name") {
        Some(Value::String(n)) if !n.is_empty() => n.clone(),
        _ => return Err(format!("{at}: a non-empty string `name` is required")),
    };
    let description = match def.get("description") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(d)) => d.clone(),
        Some(_) => return Err(format!("{at}.description must be a string")),
    };
    let parameters = match schema {
        None | Some(Value::Null) => r#"{"type":"object","properties":{}}"#.to_string(),
        Some(s @ Value::Object(_)) => s.to_string(),
        Some(_) => return Err(format!("{at}: the parameter schema must be an object")),
    };
    Ok(Some(ToolSpec {
        name,
        description,
        parameters,
        // Compact, in the client's key order (serde_json keeps it).
        raw: v.to_string(),
    }))
}

/// Parses a `tools` array; `None` and null mean no tools. A Responses
/// `namespace` item (`{type: "namespace", name, tools: [...]}`, Codex's sub-agent
/// tools) contributes its functions to the flat list under their own names; see
/// [`namespaces`] for the way back.
pub fn parse_tools(tools: Option<&Value>) -> Result<Vec<ToolSpec>, String> {
    let items = match tools {
        None | Some(Value::Null) => return Ok(vec![]),
        Some(Value::Array(a)) => a,
        Some(_) => return Err("tools must be an array".into()),
    };
    let mut out = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("tools[{i}]");
        let nested = match namespace_of(item) {
            Some((_, nested)) => nested,
            None => {
                push_tool(&mut out, parse_tool(item, &at)?, &at)?;
                continue;
            }
        };
        let Some(nested) = nested.as_array() else {
            return Err(format!("{at}.tools must be an array"));
        };
        for (k, t) in nested.iter().enumerate() {
            let at = format!("{at}.tools[{k}]");
            push_tool(&mut out, parse_tool(t, &at)?, &at)?;
        }
    }
    Ok(out)
}

/// A `namespace` tool item's name and its nested `tools`.
fn namespace_of(item: &Value) -> Option<(&str, &Value)> {
    if item.get("type").and_then(Value::as_str) != Some("namespace") {
        return None;
    }
    let name = item.get("name").and_then(Value::as_str).unwrap_or("");
    Some((name, item.get("tools").unwrap_or(&Value::Null)))
}

fn push_tool(out: &mut Vec<ToolSpec>, t: Option<ToolSpec>, at: &str) -> Result<(), String> {
    let Some(t) = t else { return Ok(()) };
    if out.iter().any(|o| o.name == t.name) {
        return Err(format!("{at}: duplicate tool name {:?}", t.name));
    }
    out.push(t);
    Ok(())
}

/// Function name -> the `namespace` it was declared in, for the functions of
/// `namespace` items in a `tools` array (a call to one goes back to the client
/// with its namespace).
pub fn namespaces(tools: Option<&Value>) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for item in tools.and_then(Value::as_array).into_iter().flatten() {
        let Some((ns, nested)) = namespace_of(item) else {
            continue;
        };
        for t in nested.as_array().into_iter().flatten() {
            let def = t.get("function").unwrap_or(t);
            if let Some(name) = def.get("name").and_then(Value::as_str) {
                out.insert(name.to_string(), ns.to_string());
            }
        }
    }
    out
}

/// A fresh unguessable id (tool calls, responses): `prefix` + 32 hex digits from
/// the OS random source.
pub fn random_id(prefix: &str) -> String {
    let mut bytes = [0u8; 16];
    if getrandom::fill(&mut bytes).is_err() {
        // No OS randomness: fall back to the clock and a counter (still unique).
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let t = crate::dialect::clock_seed();
        bytes[..8].copy_from_slice(&t.to_le_bytes());
        bytes[8..].copy_from_slice(&n.to_le_bytes());
    }
    let mut id = String::with_capacity(prefix.len() + 32);
    id.push_str(prefix);
    for b in bytes {
        id.push_str(&format!("{b:02x}"));
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(s: &str) -> Value {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn tools_parse_from_every_dialect_shape() {
        let openai = raw(
            r#"[{"type":"function","function":{"name":"get","description":"d","parameters":{"type":"object","properties":{"b":{},"a":{}}}}}]"#,
        );
        let t = parse_tools(Some(&openai)).unwrap();
        assert_eq!(t[0].name, "get");
        assert_eq!(
            t[0].parameters, r#"{"type":"object","properties":{"b":{},"a":{}}}"#,
            "key order is kept"
        );
        let anthropic = raw(
            r#"[{"name":"ls","input_schema":{"type":"object"}},{"type":"web_search_20250305","name":"web_search"}]"#,
        );
        let t = parse_tools(Some(&anthropic)).unwrap();
        assert_eq!(
            (t.len(), t[0].name.as_str()),
            (1, "ls"),
            "hosted tools are skipped"
        );
        let responses = raw(r#"[{"type": "function", "name":"f","parameters":null}]"#);
        let t = parse_tools(Some(&responses)).unwrap();
        assert_eq!(t[0].parameters, r#"{"type":"object","properties":{}}"#);
        assert_eq!(
            t[0].raw,
            r#"{"type":"function","name":"f","parameters":null}"#
        );

        for (bad, msg) in [
            (r#"{}"#, "must be an array"),
            (r#"[1]"#, "must be an object"),
            (
                r#"[{"type":"function","function":{}}]"#,
                "`name` is required",
            ),
            (r#"[{"name":"a","input_schema":[]}]"#, "must be an object"),
            (r#"[{"name":"a"},{"name":"a"}]"#, "duplicate tool name"),
        ] {
            let e = parse_tools(Some(&raw(bad))).unwrap_err();
            assert!(e.contains(msg), "{bad}: {e}");
        }
    }

    #[test]
    fn call_ids_are_random_hex() {
        let a = random_id("call_");
        let b = random_id("call_");
        assert_ne!(a, b);
        assert_eq!(a.len(), 5 + 32);
        assert!(a[5..].bytes().all(|c| c.is_ascii_hexdigit()));
    }
}
