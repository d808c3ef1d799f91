//! OpenAI's tools on chat completions, served as vLLM serves them: the tools go to the chat template (which shows
//! them to the model if it has tool support), a named function or `tool_choice: "required"` constrains the output
//! with a JSON schema (the function's parameters, or an array of calls), and the answer carries that output as
//! `tool_calls`. `tool_choice: "auto"` (the default with tools) lets the model write calls in its own format among
//! free text: with the router's `tool_call_parser` set (vLLM's `--tool-call-parser`), they are parsed out of it;
//! without one it is refused by name.

use engine::grammar::Grammar;
use serde_json::{Map, Value, json};

use super::error::ApiError;

mod formats;
mod gemma4;
mod pythonic;

use formats::Scan;
pub use formats::{Call, ToolParser};

/// Longest function name OpenAI accepts.
const MAX_NAME: usize = 64;

/// How an answer's tool calls come.
#[derive(Clone, Debug, PartialEq)]
pub enum CallMode {
    /// Forced: this function, once; the output is its arguments.
    Named(String),
    /// Forced: one call or more (one only without parallel calls); the output is an array of `{name, parameters}`.
    Required,
    /// The model's choice (`auto`): calls written in its own format among free text.
    Auto(Choosing),
}

/// What the model may call when it chooses (`auto`), and how it writes calls.
#[derive(Clone, Debug, PartialEq)]
pub struct Choosing {
    pub parser: ToolParser,
    /// The functions among the tools.
    pub functions: Vec<Function>,
    /// Several calls in one answer (`parallel_tool_calls`, default true); without, the first one only.
    pub parallel: bool,
}

/// A function the model may call: its name, and its parameters' JSON schema (which a format that writes arguments
/// as text, `qwen3_coder`, reads their types from).
#[derive(Clone, Debug, PartialEq)]
pub struct Function {
    pub name: String,
    pub params: Value,
}

impl Function {
    /// The schema of parameter `key`'s type, when the function's schema gives one.
    pub fn param_type(&self, key: &str) -> Option<&Value> {
        self.params.get("properties")?.get(key)?.get("type")
    }
}

impl Choosing {
    /// The calls `text` makes and the content before them ([`ToolParser::parse`]), the first call only without
    /// parallel calls.
    pub fn parse(&self, text: &str) -> Option<Made> {
        let mut made = self.parser.parse(text, &self.functions)?;
        if !self.parallel {
            made.calls.truncate(1);
        }
        Some(made)
    }
}

/// An answer's tool calls, as (name, arguments as JSON text), and the content beside them.
#[derive(Clone, Debug, PartialEq)]
pub struct Made {
    pub content: Option<String>,
    pub calls: Vec<(String, String)>,
}

/// A request's tools, checked: what the template sees, how calls come, and the grammar that forces them.
#[derive(Debug, Default)]
pub struct Tools {
    pub entries: Vec<Value>,
    pub mode: Option<CallMode>,
    pub grammar: Option<Grammar>,
}

/// Checks `tools`, `tool_choice` and `parallel_tool_calls` (each `None` when absent or null); `parser`: how the
/// served model writes calls, when `auto` may be served.
pub fn check(
    tools: Option<Value>,
    choice: Option<Value>,
    parallel: Option<bool>,
    parser: Option<ToolParser>,
) -> Result<Tools, ApiError> {
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
    let auto = |what: &str| match parser {
        Some(parser) => Ok(Some(CallMode::Auto(Choosing {
            parser,
            functions: functions
                .iter()
                .map(|(name, params)| Function { name: name.clone(), params: params.clone() })
                .collect(),
            parallel: parallel != Some(false),
        }))),
        None => Err(no_auto(what)),
    };
    let mode = match choice {
        // OpenAI's default is `auto` when there are tools, `none` when there are none.
        None if functions.is_empty() => None,
        None => auto("tools come without tool_choice, which then means `auto`")?,
        Some(Value::String(s)) => match s.as_str() {
            "none" => None,
            "auto" if functions.is_empty() => {
                return Err(ApiError::bad("tool_choice `auto` needs tools", "tool_choice"));
            }
            "auto" => auto("tool_choice `auto`")?,
            "required" => Some(CallMode::Required),
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
            Some(CallMode::Named(name.to_string()))
        }
    };
    let grammar = match &mode {
        None | Some(CallMode::Auto(..)) => None,
        Some(CallMode::Named(name)) => {
            let Some((_, params)) = functions.iter().find(|(n, _)| n == name) else {
                return Err(ApiError::bad(
                    format!("tool_choice names `{name}`, which is not among the tools"),
                    "tool_choice",
                ));
            };
            Some(Grammar::JsonSchema(params.to_string()))
        }
        Some(CallMode::Required) if functions.is_empty() => {
            return Err(ApiError::bad("tool_choice `required` needs tools", "tool_choice"));
        }
        Some(CallMode::Required) => Some(calls_schema(&functions, parallel != Some(false))?),
    };
    Ok(Tools { entries, mode, grammar })
}

/// `auto` refused, with what to send instead.
fn no_auto(what: &str) -> ApiError {
    let why = format!(
        "{what}: choosing between text and tool calls needs a parser of the served model's tool-call format, and \
         the router has none set (tool_call_parser); name a function (tool_choice {{\"type\": \"function\", \
         \"function\": {{\"name\": ...}}}}), or send `required` or `none`"
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

/// The calls an answer's text makes: a named function's arguments are the text itself (cut short when the answer
/// was); required calls are the whole items of the array the grammar allowed (those before the cut, when
/// `max_tokens` or a stop string cut it), `None` when it has none; the model's own calls are what its parser finds
/// (`None`: the text is content).
pub fn calls(mode: &CallMode, text: &str) -> Option<Made> {
    match mode {
        CallMode::Named(name) => Some(Made { content: None, calls: vec![(name.clone(), text.to_string())] }),
        CallMode::Required => {
            let mut rest = text;
            let mut calls = Vec::new();
            while let Some((call, used)) = required_next(rest) {
                calls.push(call);
                rest = &rest[used..];
            }
            (!calls.is_empty()).then_some(Made { content: None, calls })
        }
        CallMode::Auto(choosing) => choosing.parse(text),
    }
}

/// The next whole item of required calls' array, `text` being what follows the items read so far (the array's `[`
/// or a `,`, then `{"name": ..., "parameters": ...}`), and how much of `text` it takes; `None` when no whole item
/// follows (yet). An item's JSON ends it, so an item read is read the same whatever follows.
pub fn required_next(text: &str) -> Option<(Call, usize)> {
    let item = text.trim_start().strip_prefix(['[', ','])?.trim_start();
    let (value, rest) = formats::json_prefix(item)?;
    let call = (value.get("name")?.as_str()?.to_string(), value.get("parameters")?.to_string());
    Some((call, text.len() - rest.len()))
}

/// A streamed answer's text as content up to its first call of the model's own (`auto`), then its calls: content goes
/// out as it comes, but for an end that may open a call; from a call's opening on, the text is held, and each call
/// goes out once it is whole where the format marks each one ([`ToolParser`]), or all at the end where the whole
/// answer is the calls. At the end, whatever was held and is not calls is content. What goes out is the whole
/// answer's content and calls.
#[derive(Debug)]
pub struct AutoStream {
    choosing: Choosing,
    /// The answer so far.
    text: String,
    /// How much of it went out as content.
    sent: usize,
    /// Whether a call opened (at `sent`).
    held: bool,
    /// Where the calls read so far end.
    read: usize,
    /// How many calls went out.
    calls: usize,
}

/// What goes out for a piece of a streamed answer: its content, and the calls it made whole (numbered on from
/// `first`, the calls that went out before).
#[derive(Debug, Default, PartialEq)]
pub struct Sent {
    pub content: String,
    pub calls: Vec<Call>,
    pub first: usize,
}

impl AutoStream {
    pub fn new(choosing: Choosing) -> AutoStream {
        AutoStream { choosing, text: String::new(), sent: 0, held: false, read: 0, calls: 0 }
    }

    /// What to send now for the next piece of text `s`.
    pub fn push(&mut self, s: &str) -> Sent {
        self.text.push_str(s);
        let parser = self.choosing.parser;
        let first = self.calls;
        if self.held {
            let calls = if parser.may_close(s) { self.whole_calls() } else { Vec::new() };
            return Sent { content: String::new(), calls, first };
        }
        let to = match parser.scan(&self.text, self.sent) {
            Scan::Opens(at) => {
                (self.held, self.read) = (true, at);
                at
            }
            Scan::ClearTo(at) => at,
        };
        let content = self.text[self.sent..to].to_string();
        self.sent = to;
        // The piece that opens a call may close it too.
        let calls = if self.held { self.whole_calls() } else { Vec::new() };
        Sent { content, calls, first }
    }

    /// How many calls went out.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// At the end, with the last piece `rest`: the content still to send (whatever was held, when it made no calls)
    /// and the calls not yet sent.
    pub fn end(&mut self, rest: &str) -> Sent {
        let mut sent = self.push(rest);
        match self.held.then(|| self.choosing.parse(&self.text)).flatten() {
            Some(made) => {
                sent.calls.extend(made.calls.into_iter().skip(self.calls));
                self.calls = sent.first + sent.calls.len();
            }
            // Calls that went out were the whole answer's: it makes some.
            None if self.calls > 0 => {}
            // Held back as the start of a marker, or opening what is no call.
            None => sent.content.push_str(&self.text[self.sent..]),
        }
        self.sent = self.text.len();
        sent
    }

    /// The marked calls that are whole since the last read, as many as may still go out.
    fn whole_calls(&mut self) -> Vec<Call> {
        let mut out = Vec::new();
        let most = if self.choosing.parallel { usize::MAX } else { 1 };
        while self.calls + out.len() < most
            && let Some((calls, used)) =
                self.choosing.parser.next_calls(&self.text[self.read..], &self.choosing.functions, false)
        {
            self.read += used;
            out.extend(calls);
        }
        out.truncate(most.saturating_sub(self.calls));
        self.calls += out.len();
        out
    }
}

/// How call ids look: OpenAI's `call_` and hex, unique as request ids are, or, for a model whose chat template
/// takes only its own back, Mistral's 9 letters and digits (a hash of the same: 53 bits, so unique within any
/// conversation) or Kimi K2's `functions.NAME:K` (K the call's place in its answer, as Kimi K2's template numbers the
/// calls it shows, and the tool results it shows by these ids).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CallIds {
    #[default]
    OpenAi,
    Mistral,
    Kimi,
}

impl CallIds {
    /// The ids the served model's calls take, given its parser.
    pub fn of(parser: Option<ToolParser>) -> CallIds {
        match parser {
            Some(ToolParser::Mistral) => CallIds::Mistral,
            Some(ToolParser::KimiK2) => CallIds::Kimi,
            _ => CallIds::OpenAi,
        }
    }

    /// The id of call `k`, of function `name`, in choice `index` of request `request_id`.
    pub fn id(self, request_id: &str, index: usize, k: usize, name: &str) -> String {
        let own = request_id.rsplit('-').next().unwrap_or(request_id);
        match self {
            CallIds::OpenAi => format!("call_{own}{index:02x}{k:02x}"),
            CallIds::Kimi => format!("functions.{name}:{k}"),
            CallIds::Mistral => {
                use std::hash::{BuildHasher, BuildHasherDefault};
                type Fixed = BuildHasherDefault<std::hash::DefaultHasher>;
                const DIGITS: &[u8; 62] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
                let mut h = Fixed::default().hash_one((own, index, k));
                (0..9)
                    .map(|_| {
                        let d = DIGITS[(h % 62) as usize] as char;
                        h /= 62;
                        d
                    })
                    .collect()
            }
        }
    }

    /// The answer's `tool_calls`, for a whole (not streamed) answer.
    pub fn calls_json(self, request_id: &str, index: usize, calls: &[(String, String)]) -> Value {
        let calls = calls.iter().enumerate().map(|(k, (name, arguments))| {
            json!({"id": self.id(request_id, index, k, name), "type": "function",
                   "function": {"name": name, "arguments": arguments}})
        });
        Value::Array(calls.collect())
    }
}

/// The finish reason of an answer that made calls or not (`made`), where the worker said `reason`: as OpenAI
/// answers, a named function's call ends with `stop`, and calls the model chose (required or auto) with
/// `tool_calls`; required calls cut short by `max_tokens` say `length` (the calls are those before the cut).
pub fn finish_reason(mode: &CallMode, made: bool, reason: &'static str) -> &'static str {
    match mode {
        CallMode::Required if reason == "length" => reason,
        CallMode::Required | CallMode::Auto(..) if made => "tool_calls",
        _ => reason,
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Functions of these names, taking anything.
    pub fn known(names: &[&str]) -> Vec<Function> {
        names.iter().map(|n| Function { name: n.to_string(), params: json!({"type": "object"}) }).collect()
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "weather", "description": "the forecast",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    fn refused(tools: Value, choice: Option<Value>) -> (String, Option<String>) {
        let e = check(Some(tools), choice, None, None).expect_err("refused");
        let body = e.body();
        (body["error"]["message"].as_str().unwrap_or("").to_string(), body["error"]["param"].as_str().map(String::from))
    }

    #[test]
    fn a_named_function_is_forced_by_its_parameters() {
        let choice = json!({"type": "function", "function": {"name": "weather"}});
        let t = check(Some(json!([weather()])), Some(choice), None, None).expect("valid");
        assert_eq!(t.entries, vec![weather()], "the template sees the tools as sent");
        let schema = weather()["function"]["parameters"].to_string();
        assert_eq!((t.mode, t.grammar), (Some(CallMode::Named("weather".into())), Some(Grammar::JsonSchema(schema))));
        // A function without parameters takes an object.
        let bare = json!({"type": "function", "function": {"name": "now"}});
        let t = check(Some(json!([bare])), Some(json!({"type": "function", "function": {"name": "now"}})), None, None);
        let g = t.expect("valid").grammar.expect("forced");
        assert_eq!(g, Grammar::JsonSchema(json!({"type": "object", "properties": {}}).to_string()));
    }

    #[test]
    fn required_calls_are_an_array_of_the_functions() {
        let defs = json!({"type": "function", "function": {"name": "plot", "parameters": {
            "type": "object", "properties": {"p": {"$ref": "#/$defs/point"}}, "$defs": {"point": {"type": "array"}}}}});
        let t = check(Some(json!([weather(), defs])), Some(json!("required")), None, None).expect("valid");
        let (Some(CallMode::Required), Some(Grammar::JsonSchema(s))) = (t.mode, t.grammar) else { panic!("required") };
        let s: Value = serde_json::from_str(&s).expect("json");
        assert_eq!(s["type"], "array");
        assert_eq!(s["minItems"], 1);
        assert!(s.get("maxItems").is_none(), "parallel calls by default");
        assert_eq!(s["items"]["anyOf"][0]["properties"]["name"]["enum"], json!(["weather"]));
        assert_eq!(s["items"]["anyOf"][1]["properties"]["parameters"]["properties"]["p"]["$ref"], "#/$defs/point");
        assert!(s["items"]["anyOf"][1]["properties"]["parameters"].get("$defs").is_none(), "moved to the top");
        assert_eq!(s["$defs"]["point"]["type"], "array");
        let one = check(Some(json!([weather()])), Some(json!("required")), Some(false), None).expect("valid");
        let Some(Grammar::JsonSchema(s)) = one.grammar else { panic!("required") };
        assert_eq!(serde_json::from_str::<Value>(&s).expect("json")["maxItems"], 1, "no parallel calls: one");
    }

    #[test]
    fn none_leaves_the_answer_text_and_auto_needs_a_parser() {
        let t = check(Some(json!([weather()])), Some(json!("none")), None, None).expect("valid");
        assert_eq!((t.entries.len(), t.mode, t.grammar), (1, None, None));
        assert!(check(None, None, None, None).expect("valid").mode.is_none());
        for choice in [None, Some(json!("auto"))] {
            let (why, param) = refused(json!([weather()]), choice.clone());
            assert_eq!(param.as_deref(), Some("tool_choice"));
            assert!(why.contains("parser") && why.contains("required"), "{why}");
            // With a parser: the model's choice, no grammar.
            let t = check(Some(json!([weather()])), choice, None, Some(ToolParser::Hermes)).expect("valid");
            let params = weather()["function"]["parameters"].clone();
            let functions = vec![Function { name: "weather".into(), params }];
            let choosing = Choosing { parser: ToolParser::Hermes, functions, parallel: true };
            assert_eq!((t.mode, t.grammar), (Some(CallMode::Auto(choosing)), None));
        }
        let e = check(None, Some(json!("auto")), None, Some(ToolParser::Hermes)).expect_err("no tools");
        assert_eq!(e.body()["error"]["param"], "tool_choice");
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
        let named = CallMode::Named("weather".into());
        let only = |calls: Vec<(&str, &str)>| {
            Some(Made { content: None, calls: calls.into_iter().map(|(n, a)| (n.into(), a.into())).collect() })
        };
        assert_eq!(calls(&named, r#"{"city": "Oslo"}"#), only(vec![("weather", r#"{"city": "Oslo"}"#)]));
        let two = r#"[{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]"#;
        assert_eq!(calls(&CallMode::Required, two), only(vec![("weather", r#"{"city":"Oslo"}"#), ("now", "{}")]));
        assert_eq!(calls(&CallMode::Required, r#"[{"name": "weather", "parameters": {"ci"#), None, "cut short");
        let cut = r#"[{"name": "now", "parameters": {}} , {"name": "weather", "parameters": {"ci"#;
        assert_eq!(calls(&CallMode::Required, cut), only(vec![("now", "{}")]), "the whole items before the cut");
        // Read item by item as they come, each once whole.
        assert_eq!(required_next(r#" [ {"name": "now", "parameters": {}"#), None);
        assert_eq!(required_next(r#" [ {"name": "now", "parameters": {}} ,"#), Some((("now".into(), "{}".into()), 36)));
        assert_eq!(required_next(r#"]"#), None);
        assert_eq!(finish_reason(&CallMode::Required, true, "stop"), "tool_calls");
        assert_eq!(finish_reason(&CallMode::Required, true, "length"), "length", "cut short, whatever came");
        assert_eq!(finish_reason(&CallMode::Required, false, "length"), "length");
        assert_eq!(finish_reason(&named, true, "stop"), "stop");
        let auto = CallMode::Auto(Choosing { parser: ToolParser::Hermes, functions: vec![], parallel: true });
        assert_eq!((finish_reason(&auto, true, "stop"), finish_reason(&auto, false, "stop")), ("tool_calls", "stop"));
        let v = CallIds::OpenAi.calls_json("chatcmpl-00ab", 1, &[("f".into(), "{}".into())]);
        assert_eq!(
            v,
            json!([{"id": "call_00ab0100", "type": "function", "function": {"name": "f", "arguments": "{}"}}])
        );
        // Mistral's templates take back only 9 letters and digits.
        assert_eq!(CallIds::of(Some(ToolParser::Mistral)), CallIds::Mistral);
        assert_eq!((CallIds::of(Some(ToolParser::Hermes)), CallIds::of(None)), (CallIds::OpenAi, CallIds::OpenAi));
        let ids: Vec<String> = (0..64).map(|k| CallIds::Mistral.id("chatcmpl-00ab", k % 4, k / 4, "f")).collect();
        assert!(ids.iter().all(|id| id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric())), "{ids:?}");
        assert_eq!(ids.iter().collect::<std::collections::HashSet<_>>().len(), ids.len(), "{ids:?}");
        assert_eq!(ids[5], CallIds::Mistral.id("chatcmpl-00ab", 1, 1, "f"), "the same call, the same id");
        // Kimi K2's template numbers an answer's calls `functions.NAME:K`, and shows tool results by those ids.
        assert_eq!(CallIds::of(Some(ToolParser::KimiK2)), CallIds::Kimi);
        let calls = [("now".into(), "{}".into()), ("get_weather".into(), "{}".into())];
        let v = CallIds::Kimi.calls_json("chatcmpl-00ab", 1, &calls);
        assert_eq!(
            (v[0]["id"].as_str(), v[1]["id"].as_str()),
            (Some("functions.now:0"), Some("functions.get_weather:1"))
        );
    }

    /// Nothing to send.
    fn nothing(s: &Sent) -> bool {
        s.content.is_empty() && s.calls.is_empty()
    }

    /// Streamed, content goes out as it comes up to a call's opening, which is held with everything after it until
    /// the call is whole; the pieces add up to the whole answer's content and calls, however the text is cut.
    #[test]
    fn streamed_content_stops_at_a_call_and_the_calls_come_at_the_end() {
        let functions = known(&["now"]);
        let text = r#"Sure <tool> tag? <tool_call>{"name": "now", "arguments": {}}</tool_call>"#;
        for cut in 1..8 {
            let mut s =
                AutoStream::new(Choosing { parser: ToolParser::Hermes, functions: functions.clone(), parallel: true });
            let mut content = String::new();
            let mut calls = Vec::new();
            let chars: Vec<char> = text.chars().collect();
            for piece in chars.chunks(cut) {
                let sent = s.push(&piece.iter().collect::<String>());
                content.push_str(&sent.content);
                calls.extend(sent.calls);
            }
            assert_eq!(calls, vec![("now".into(), "{}".into())], "cut {cut}: out once closed");
            assert!(nothing(&s.end("")), "cut {cut}");
            assert_eq!(content, "Sure <tool> tag? ", "cut {cut}");
        }
        // Not a call after all: the held text is content.
        let mut s = AutoStream::new(Choosing { parser: ToolParser::Hermes, functions, parallel: true });
        assert_eq!(s.push("a <tool_").content, "a ");
        assert!(nothing(&s.push("call>oops")));
        assert_eq!(s.end(" end"), Sent { content: "<tool_call>oops end".to_string(), ..Sent::default() });
    }

    /// Each marked call goes out once it is whole, the first before the second is written; a call of no tool ends
    /// the calls; without parallel calls, the first only.
    #[test]
    fn marked_calls_go_out_one_by_one() {
        let call =
            |zone: &str| format!(r#"<tool_call>{{"name": "now", "arguments": {{"zone": "{zone}"}}}}</tool_call>"#);
        let made = |zone: &str| ("now".to_string(), format!(r#"{{"zone":"{zone}"}}"#));
        for parallel in [true, false] {
            let mut s = AutoStream::new(Choosing { parser: ToolParser::Hermes, functions: known(&["now"]), parallel });
            assert_eq!(s.push("Checking. "), Sent { content: "Checking. ".into(), ..Sent::default() });
            assert!(nothing(&s.push(&call("UTC")[..20])), "not whole yet");
            assert_eq!(s.push(&call("UTC")[20..]).calls, vec![made("UTC")]);
            assert_eq!(s.push(&format!("\n{}", call("CET"))).calls, if parallel { vec![made("CET")] } else { vec![] });
            assert!(nothing(&s.push(r#"<tool_call>{"name": "rain"}</tool_call>"#)), "not a call");
            assert!(nothing(&s.push(&call("EST"))), "after one that is not a call");
            assert!(nothing(&s.end(" Done.")), "what follows the calls is left out");
        }
        // Mistral's calls are whole when their JSON is.
        let mut s =
            AutoStream::new(Choosing { parser: ToolParser::Mistral, functions: known(&["now"]), parallel: true });
        assert_eq!(s.push("[TOOL_CALLS]now{\"a\": {\"b\": 1}").calls, vec![]);
        assert_eq!(s.push("}[TOOL_CALLS]no").calls, vec![("now".to_string(), r#"{"a":{"b":1}}"#.to_string())]);
        assert_eq!(s.end("w{}").calls, vec![("now".to_string(), "{}".to_string())], "cut short at the end");
    }

    /// Each format's calls of the known function, whole, with its markers.
    const CALLS: [&str; 15] = [
        "<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"now\"}</tool_call>",
        "<|python_tag|>{\"name\": \"now\", \"parameters\": {}}; {\"name\": \"now\", \"parameters\": {\"a\": 1}}",
        "[TOOL_CALLS]now{\"a\": 1}[TOOL_CALLS]now[ARGS]{}",
        "<|python_start|>[now(a=1), now(b='x')]<|python_end|>",
        "<tool_call>\n<function=now>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
        "<|tool_call>call:now{a:<|\"|>x, y<|\"|>}<tool_call|><|tool_call>call:now{}<tool_call|>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{\"a\": 1}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{\"a\": 1}<｜tool▁call▁end｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"now\">\n<｜DSML｜parameter name=\"a\" string=\"false\">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"now\">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>",
        "<tool_call>now\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call><tool_call>now</tool_call>",
        "<minimax:tool_call>\n<invoke name=\"now\"><parameter name=\"a\">1</parameter>\n</invoke>\n</minimax:tool_call>\n<minimax:tool_call><invoke name=\"now\"></invoke></minimax:tool_call>",
        "to=functions.now<|message|>{\"a\": 1}",
        "<seed:tool_call>\n<function=now>\n<parameter=a>1</parameter>\n</function>\n</seed:tool_call><seed:tool_call><function=now></function></seed:tool_call>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.now:0<|tool_call_argument_begin|>{\"a\": 1}<|tool_call_end|><|tool_call_begin|>functions.now:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
        "<|tool_call|>[{\"name\": \"now\", \"arguments\": {\"a\": 1}}, {\"name\": \"now\", \"arguments\": {}}]",
    ];
    /// What may come before them: words or whitespace.
    const LEAD: [&str; 4] = ["Sure ", "\n", "é", " "];
    /// Each format's pieces: its markers whole and in parts, a call of the known function, one of another, words.
    #[rustfmt::skip]
    const PIECES: [(ToolParser, [&str; 10]); 15] = [
        (ToolParser::Hermes, ["Sure ", "<tool_call>", "</tool_call>", r#"{"name": "now", "arguments": {}}"#,
            r#"{"name": "rain"}"#, "<tool", "_call>", "\n", "é", "<"]),
        (ToolParser::Llama3Json, ["Sure ", "<|python_tag|>", "; ", r#"{"name": "now", "parameters": {}}"#,
            r#"{"name": "rain"}"#, "<|python", "_tag|>", "\n", "é", "<"]),
        (ToolParser::Mistral, ["Sure ", "[TOOL_CALLS]", r#"[{"name": "now", "arguments": {}}]"#, r#"now{"a": 1}"#,
            "rain{}", "[TOOL", "_CALLS]", "\n", "é", "["]),
        (ToolParser::Pythonic, ["Sure ", "<|python_start|>", "<|python_end|>", "[now(a=1)]", "[rain()]", "<|python",
            "[now(), ", "\n", "é", "now(b='x')]"]),
        (ToolParser::Qwen3Coder, ["Sure ", "<tool_call>", "</tool_call>", "<function=now></function>",
            "<function=rain></function>", "<tool", "_call>", "\n", "é", "<parameter=a>1</parameter>"]),
        (ToolParser::Gemma4, ["Sure ", "<|tool_call>", "<tool_call|>", "call:now{a:1}", "call:rain{}", "<|tool",
            "_call>", "\n", "é", "<|\"|>"]),
        (ToolParser::DeepSeekV3, ["Sure ", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁end｜>",
            "<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>rain\n```json\n{}\n```",
            "<｜tool▁calls", "▁begin｜>", "\n", "é", "<｜tool▁calls▁end｜>"]),
        (ToolParser::DeepSeekV31, ["Sure ", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁call▁begin｜>now<｜tool▁sep｜>{}",
            "<｜tool▁call▁begin｜>rain<｜tool▁sep｜>{}", "<｜tool▁calls", "▁begin｜>", "\n", "é", "<｜tool▁calls▁end｜>"]),
        (ToolParser::DeepSeekDsml, ["Sure ", "<｜DSML｜tool_calls>", "</｜DSML｜invoke>", "<｜DSML｜invoke name=\"now\">",
            "<｜DSML｜invoke name=\"rain\">", "<｜DS", "ML｜", "\n", "é",
            "<｜DSML｜parameter name=\"b\" string=\"true\">x</｜DSML｜parameter>"]),
        (ToolParser::Glm45, ["Sure ", "<tool_call>", "</tool_call>", "now", "rain", "<tool", "_call>", "\n", "é",
            "<arg_key>a</arg_key><arg_value>1</arg_value>"]),
        (ToolParser::MiniMaxM2, ["Sure ", "<minimax:tool_call>", "</minimax:tool_call>", "<invoke name=\"now\">",
            "<invoke name=\"rain\">", "</invoke>", "<minimax:", "\n", "é", "<parameter name=\"b\">x</parameter>"]),
        (ToolParser::OpenAi, ["Sure ", "to=functions.", "now", "rain", "<|message|>", "{\"a\": 1}", "to=func", "\n", "é",
            "}"]),
        (ToolParser::SeedOss, ["Sure ", "<seed:tool_call>", "</seed:tool_call>", "<function=now></function>",
            "<function=rain></function>", "<seed:", "tool_call>", "\n", "é", "<parameter=a>1</parameter>"]),
        (ToolParser::KimiK2, ["Sure ", "<|tool_calls_section_begin|>", "<|tool_call_end|>",
            "<|tool_call_begin|>functions.now:0<|tool_call_argument_begin|>{}", "<|tool_call_begin|>rain:1<|tool_call_argument_begin|>{}",
            "<|tool_calls", "_section_begin|>", "\n", "<|tool_call_section_begin|>", "<|tool_calls_section_end|>"]),
        (ToolParser::Granite, ["Sure ", "<|tool_call|>", "<tool_call>", r#"{"name": "now", "arguments": {}}"#,
            r#"{"name": "rain"}"#, "<|tool", "[", "\n", "é", "]"]),
    ];

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        /// However a text of words, calls, partial markers, JSON and any characters is cut into streamed pieces, in
        /// any format, the content sent and the calls made as it comes and at the end are the whole answer's: the
        /// text before its first call and its calls when it makes them, all of it as content when it does not.
        #[test]
        fn a_streamed_answer_is_the_whole_one(
            format in 0usize..PIECES.len(),
            lead in proptest::collection::vec(0usize..LEAD.len(), 0..3),
            whole in proptest::bool::ANY,
            parallel in proptest::bool::ANY,
            parts in proptest::collection::vec(0usize..10, 0..12),
            noise in proptest::collection::vec((0usize..12, "\\PC{0,3}"), 0..3),
            cuts in proptest::collection::vec(1usize..6, 1..40),
        ) {
            let (parser, pieces) = PIECES[format];
            let mut text: String = lead.iter().map(|&i| LEAD[i]).collect();
            if whole {
                text.push_str(CALLS[format]);
            }
            // The pieces, with any characters at all among them.
            for (k, &i) in parts.iter().enumerate() {
                text.extend(noise.iter().filter(|(at, _)| *at == k).map(|(_, n)| n.as_str()));
                text.push_str(pieces[i]);
            }
            let choosing = Choosing { parser, functions: known(&["now"]), parallel };
            let mut stream = AutoStream::new(choosing.clone());
            let (mut content, mut calls) = (String::new(), Vec::new());
            for piece in super::super::markers::pieces(&text, &cuts) {
                let sent = stream.push(&piece);
                content.push_str(&sent.content);
                calls.extend(sent.calls);
            }
            let last = stream.end("");
            content.push_str(&last.content);
            calls.extend(last.calls);
            match choosing.parse(&text) {
                Some(made) => {
                    let opening = parser.opening(&text).expect("a call opens");
                    proptest::prop_assert_eq!(&content, &text[..opening]);
                    proptest::prop_assert_eq!(calls, made.calls);
                }
                None => {
                    proptest::prop_assert_eq!(&content, &text);
                    proptest::prop_assert!(calls.is_empty());
                }
            }
        }
    }
}
