//! OpenAI's tools on chat completions, served as vLLM serves them to a model it has no tool-call parser for: the
//! tools go to the chat template (which shows them to the model if it has tool support), a named function or
//! `tool_choice: "required"` constrains the output with a JSON schema (the function's parameters, or an array of
//! calls), and the answer carries that output as `tool_calls`. `tool_choice: "auto"` needs the model's own
//! tool-call format parsed out of free text, which the served model has none of, so it is refused by name.

use engine::grammar::Grammar;
use serde_json::{Map, Value, json};

use super::error::ApiError;

/// Longest function name OpenAI accepts.
const MAX_NAME: usize = 64;

/// The calls an answer must make.
#[derive(Clone, Debug, PartialEq)]
pub enum Forced {
    /// This function, once: the output is its arguments.
    Named(String),
    /// One call or more (one only without parallel calls): the output is an array of `{name, parameters}`.
    Required,
}

/// A request's tools, checked: what the template sees, and the calls forced with the grammar that forces them.
#[derive(Debug, Default)]
pub struct Tools {
    pub entries: Vec<Value>,
    pub forced: Option<(Forced, Grammar)>,
}

/// Checks `tools`, `tool_choice` and `parallel_tool_calls` (each `None` when absent or null).
pub fn check(tools: Option<Value>, choice: Option<Value>, parallel: Option<bool>) -> Result<Tools, ApiError> {
    let entries = match tools {
        None => Vec::new(),
        Some(Value::Array(v)) => v,
        Some(_) => return Err(ApiError::bad("tools must be an array of function tools", "tools")),
    };
    let functions = entries.iter().map(function).collect::<Result<Vec<_>, _>>()?;
    for (i, (name, _)) in functions.iter().enumerate() {
        if functions[..i].iter().any(|(other, _)| other == name) {
            return Err(ApiError::bad(format!("two tools are named `{name}`"), "tools"));
        }
    }
    let forced = match choice {
        // OpenAI's default is `auto` when there are tools, `none` when there are none.
        None if functions.is_empty() => None,
        None => return Err(no_auto("tools come without tool_choice, which then means `auto`")),
        Some(Value::String(s)) => match s.as_str() {
            "none" => None,
            "auto" => return Err(no_auto("tool_choice `auto`")),
            "required" => Some(Forced::Required),
            other => {
                let why = format!("tool_choice must be none, auto, required or a named function, not `{other}`");
                return Err(ApiError::bad(why, "tool_choice"));
            }
        },
        Some(v) => {
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    ApiError::bad(
                        r#"a named tool_choice is {"type": "function", "function": {"name": ...}}"#,
                        "tool_choice",
                    )
                })?;
            Some(Forced::Named(name.to_string()))
        }
    };
    let forced = match forced {
        None => None,
        Some(Forced::Named(name)) => {
            let Some((_, params)) = functions.iter().find(|(n, _)| *n == name) else {
                return Err(ApiError::bad(
                    format!("tool_choice names `{name}`, which is not among the tools"),
                    "tool_choice",
                ));
            };
            let grammar = Grammar::JsonSchema(params.to_string());
            Some((Forced::Named(name), grammar))
        }
        Some(Forced::Required) if functions.is_empty() => {
            return Err(ApiError::bad("tool_choice `required` needs tools", "tool_choice"));
        }
        Some(Forced::Required) => Some((Forced::Required, calls_schema(&functions, parallel != Some(false))?)),
    };
    Ok(Tools { entries, forced })
}

/// `auto` refused, with what to send instead.
fn no_auto(what: &str) -> ApiError {
    let why = format!(
        "{what}: choosing between text and tool calls needs a parser of the served model's tool-call format, which \
         it has none of; name a function (tool_choice {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}), or \
         send `required` or `none`"
    );
    ApiError::bad(why, "tool_choice")
}

/// One tool's function name and parameter schema (an object taking anything when it gives none).
fn function(tool: &Value) -> Result<(String, Value), ApiError> {
    let bad = |why: &str| {
        ApiError::bad(format!("each tool is {{\"type\": \"function\", \"function\": {{...}}}}: {why}"), "tools")
    };
    if tool.get("type").and_then(Value::as_str) != Some("function") {
        return Err(bad("only function tools are supported"));
    }
    let f = tool.get("function").and_then(Value::as_object).ok_or_else(|| bad("`function` is missing"))?;
    let name = f.get("name").and_then(Value::as_str).ok_or_else(|| bad("`function.name` is missing"))?;
    let valid = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if name.is_empty() || name.len() > MAX_NAME || !name.chars().all(valid) {
        let why = format!("a function's name is 1 to {MAX_NAME} letters, digits, `_` or `-`, not `{name}`");
        return Err(ApiError::bad(why, "tools"));
    }
    let params = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => return Err(bad("`function.parameters` is a JSON schema object")),
    };
    Ok((name.to_string(), params))
}

/// The schema of an array of calls, each `{"name": one of the functions, "parameters": its arguments}`, at most one
/// unless `parallel`. Definitions a function's schema refers to (`$defs`) move to the top, where its references
/// point once it is nested; two functions defining one name differently are refused.
fn calls_schema(functions: &[(String, Value)], parallel: bool) -> Result<Grammar, ApiError> {
    let mut defs = Map::new();
    let mut each = Vec::with_capacity(functions.len());
    for (name, params) in functions {
        let mut params = params.clone();
        if let Some(Value::Object(own)) = params.as_object_mut().and_then(|p| p.remove("$defs")) {
            for (k, v) in own {
                if defs.get(&k).is_some_and(|d| *d != v) {
                    let why =
                        format!("two tools define `$defs/{k}` differently, which one schema of calls cannot hold");
                    return Err(ApiError::bad(why, "tools"));
                }
                defs.insert(k, v);
            }
        }
        each.push(
            json!({"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": false}),
        );
    }
    let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": each}});
    if !parallel {
        schema["maxItems"] = json!(1);
    }
    if !defs.is_empty() {
        schema["$defs"] = Value::Object(defs);
    }
    Ok(Grammar::JsonSchema(schema.to_string()))
}

/// The calls an answer's text makes, as (name, arguments as JSON text): a named function's arguments are the text
/// itself (cut short when the answer was); required calls are the array the grammar allowed, `None` when the text
/// is not one (cut short by `max_tokens` or a stop string).
pub fn calls(forced: &Forced, text: &str) -> Option<Vec<(String, String)>> {
    match forced {
        Forced::Named(name) => Some(vec![(name.clone(), text.to_string())]),
        Forced::Required => {
            let Ok(Value::Array(items)) = serde_json::from_str::<Value>(text) else { return None };
            items
                .iter()
                .map(|c| Some((c.get("name")?.as_str()?.to_string(), c.get("parameters")?.to_string())))
                .collect::<Option<Vec<_>>>()
                .filter(|c| !c.is_empty())
        }
    }
}

/// The id of call `k` of choice `index` of request `request_id`: unique as request ids are.
pub fn call_id(request_id: &str, index: usize, k: usize) -> String {
    let own = request_id.rsplit('-').next().unwrap_or(request_id);
    format!("call_{own}{index:02x}{k:02x}")
}

/// The answer's `tool_calls`, for a whole (not streamed) answer.
pub fn tool_calls_json(request_id: &str, index: usize, calls: &[(String, String)]) -> Value {
    let calls = calls.iter().enumerate().map(|(k, (name, arguments))| {
        json!({"id": call_id(request_id, index, k), "type": "function",
               "function": {"name": name, "arguments": arguments}})
    });
    Value::Array(calls.collect())
}

/// The finish reason of an answer that made `calls` (for `forced` calls, where the worker said `reason`): as OpenAI
/// answers, a named function's call ends with `stop`, and calls the model chose (required) with `tool_calls`.
pub fn finish_reason(forced: &Forced, made: bool, reason: &'static str) -> &'static str {
    match forced {
        Forced::Required if made => "tool_calls",
        _ => reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "weather", "description": "the forecast",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    fn refused(tools: Value, choice: Option<Value>) -> (String, Option<String>) {
        let e = check(Some(tools), choice, None).expect_err("refused");
        let body = e.body();
        (body["error"]["message"].as_str().unwrap_or("").to_string(), body["error"]["param"].as_str().map(String::from))
    }

    #[test]
    fn a_named_function_is_forced_by_its_parameters() {
        let choice = json!({"type": "function", "function": {"name": "weather"}});
        let t = check(Some(json!([weather()])), Some(choice), None).expect("valid");
        assert_eq!(t.entries, vec![weather()], "the template sees the tools as sent");
        let schema = weather()["function"]["parameters"].to_string();
        assert_eq!(t.forced, Some((Forced::Named("weather".into()), Grammar::JsonSchema(schema))));
        // A function without parameters takes an object.
        let bare = json!({"type": "function", "function": {"name": "now"}});
        let t = check(Some(json!([bare])), Some(json!({"type": "function", "function": {"name": "now"}})), None);
        let (_, g) = t.expect("valid").forced.expect("forced");
        assert_eq!(g, Grammar::JsonSchema(json!({"type": "object", "properties": {}}).to_string()));
    }

    #[test]
    fn required_calls_are_an_array_of_the_functions() {
        let defs = json!({"type": "function", "function": {"name": "plot", "parameters": {
            "type": "object", "properties": {"p": {"$ref": "#/$defs/point"}}, "$defs": {"point": {"type": "array"}}}}});
        let t = check(Some(json!([weather(), defs])), Some(json!("required")), None).expect("valid");
        let Some((Forced::Required, Grammar::JsonSchema(s))) = t.forced else { panic!("required") };
        let s: Value = serde_json::from_str(&s).expect("json");
        assert_eq!(s["type"], "array");
        assert_eq!(s["minItems"], 1);
        assert!(s.get("maxItems").is_none(), "parallel calls by default");
        assert_eq!(s["items"]["anyOf"][0]["properties"]["name"]["enum"], json!(["weather"]));
        assert_eq!(s["items"]["anyOf"][1]["properties"]["parameters"]["properties"]["p"]["$ref"], "#/$defs/point");
        assert!(s["items"]["anyOf"][1]["properties"]["parameters"].get("$defs").is_none(), "moved to the top");
        assert_eq!(s["$defs"]["point"]["type"], "array");
        let one = check(Some(json!([weather()])), Some(json!("required")), Some(false)).expect("valid");
        let Some((_, Grammar::JsonSchema(s))) = one.forced else { panic!("required") };
        assert_eq!(serde_json::from_str::<Value>(&s).expect("json")["maxItems"], 1, "no parallel calls: one");
    }

    #[test]
    fn none_leaves_the_answer_text_and_auto_is_refused_by_name() {
        let t = check(Some(json!([weather()])), Some(json!("none")), None).expect("valid");
        assert_eq!((t.entries.len(), t.forced), (1, None));
        assert!(check(None, None, None).expect("valid").forced.is_none());
        for choice in [None, Some(json!("auto"))] {
            let (why, param) = refused(json!([weather()]), choice);
            assert_eq!(param.as_deref(), Some("tool_choice"));
            assert!(why.contains("parser") && why.contains("required"), "{why}");
        }
    }

    #[test]
    fn malformed_tools_and_choices_are_refused_by_name() {
        let named = |n: &str| Some(json!({"type": "function", "function": {"name": n}}));
        let cases = [
            (json!({"type": "function"}), None, "tools"),
            (json!([{"type": "custom", "custom": {"name": "x"}}]), None, "tools"),
            (json!([{"type": "function"}]), None, "tools"),
            (json!([{"type": "function", "function": {"name": "no spaces"}}]), None, "tools"),
            (json!([{"type": "function", "function": {"name": "f", "parameters": "x"}}]), None, "tools"),
            (json!([weather(), weather()]), Some(json!("required")), "tools"),
            (json!([weather()]), named("rain"), "tool_choice"),
            (json!([weather()]), Some(json!({"function": {"name": "weather"}})), "tool_choice"),
            (json!([weather()]), Some(json!("sometimes")), "tool_choice"),
            (json!([]), Some(json!("required")), "tool_choice"),
            (json!([]), named("weather"), "tool_choice"),
        ];
        for (tools, choice, param) in cases {
            let (why, got) = refused(tools.clone(), choice.clone());
            assert_eq!(got.as_deref(), Some(param), "{tools} {choice:?}: {why}");
        }
    }

    #[test]
    fn the_answer_text_becomes_calls() {
        let named = Forced::Named("weather".into());
        assert_eq!(calls(&named, r#"{"city": "Oslo"}"#), Some(vec![("weather".into(), r#"{"city": "Oslo"}"#.into())]));
        let two = r#"[{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]"#;
        assert_eq!(
            calls(&Forced::Required, two),
            Some(vec![("weather".into(), r#"{"city":"Oslo"}"#.into()), ("now".into(), "{}".into())])
        );
        assert_eq!(calls(&Forced::Required, r#"[{"name": "weather", "parameters": {"ci"#), None, "cut short");
        assert_eq!(finish_reason(&Forced::Required, true, "stop"), "tool_calls");
        assert_eq!(finish_reason(&Forced::Required, false, "length"), "length");
        assert_eq!(finish_reason(&named, true, "stop"), "stop");
        let v = tool_calls_json("chatcmpl-00ab", 1, &[("f".into(), "{}".into())]);
        assert_eq!(
            v,
            json!([{"id": "call_00ab0100", "type": "function", "function": {"name": "f", "arguments": "{}"}}])
        );
    }
}
