//! OpenAI's Responses API (`POST /v1/responses`), served as a chat completion: the request's input items become
//! a conversation (instructions as its system turn, function calls and their outputs as the assistant's calls and
//! the tools' turns, after a stored response's conversation when it names one), its fields the chat request's, and
//! the chat answer the response's output items (reasoning, a message, function calls). Every field is implemented
//! or refused by name, as on the chat endpoint. Pure: `http::responses_route` runs the chat request between
//! [`to_chat`] and [`from_chat`] (or [`stream`]'s events), and keeps responses in `crate::response_store`.

use serde_json::{Map, Value, json};

use super::error::ApiError;

pub mod stream;

/// What the response repeats of the request (OpenAI's response object echoes its settings).
#[derive(Clone, Debug, Default)]
pub struct Asked {
    pub instructions: Value,
    pub tools: Value,
    pub tool_choice: Value,
    pub text: Value,
    pub temperature: Value,
    pub top_p: Value,
    pub max_output_tokens: Value,
    pub parallel_tool_calls: bool,
    pub metadata: Value,
    pub user: Value,
    /// `{"effort": ..., "summary": null}` when an effort was asked.
    pub reasoning: Value,
    /// The output text's tokens carry their log-probabilities (`include: ["message.output_text.logprobs"]`).
    pub logprobs: bool,
    /// The response is kept (`store`, true unless false, as OpenAI's default).
    pub store: bool,
    /// `store` was sent (not left to its default).
    pub store_sent: bool,
    /// The stored response whose conversation this one goes on.
    pub previous: Option<String>,
}

/// What `include` may ask for.
const LOGPROBS: &str = "message.output_text.logprobs";

/// Fields the chat endpoint names differently, back to this API's names (a refusal names the field sent).
pub fn param_of(chat_param: &str) -> &str {
    match chat_param {
        "max_tokens" | "max_completion_tokens" => "max_output_tokens",
        "messages" => "input",
        "response_format" => "text.format",
        "reasoning_effort" => "reasoning.effort",
        other => other,
    }
}

/// The chat completion request a Responses request is, and what the response repeats of it.
pub fn to_chat(body: &[u8]) -> Result<(Value, Asked), ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| ApiError::MalformedJson(e.to_string()))?;
    let Value::Object(fields) = v else { return Err(ApiError::MalformedJson("a JSON object is expected".into())) };
    let mut chat = Map::new();
    let mut asked = Asked { parallel_tool_calls: true, store: true, ..Asked::default() };
    let mut messages = Vec::new();
    for (name, value) in fields.iter().filter(|(_, v)| !v.is_null()) {
        let refuse = |why: &str| Err(ApiError::bad_field(format!("{name}: {why}"), name));
        match name.as_str() {
            "model"
            | "stream"
            | "temperature"
            | "top_p"
            | "user"
            | "safety_identifier"
            | "prompt_cache_key"
            | "service_tier"
            | "parallel_tool_calls" => {
                chat.insert(name.clone(), value.clone());
            }
            "input" => {}
            "instructions" => {
                let text = value.as_str().ok_or_else(|| ApiError::bad("instructions is text", "instructions"))?;
                messages.insert(0, json!({"role": "system", "content": text}));
                asked.instructions = value.clone();
            }
            "max_output_tokens" => {
                chat.insert("max_completion_tokens".into(), value.clone());
            }
            "tools" => {
                chat.insert("tools".into(), chat_tools(value)?);
            }
            "tool_choice" => {
                chat.insert("tool_choice".into(), chat_tool_choice(value)?);
            }
            "text" => {
                if let Some(format) = text_format(value)? {
                    chat.insert("response_format".into(), format);
                }
            }
            "metadata" => asked.metadata = value.clone(),
            "store" => {
                asked.store = value.as_bool().ok_or_else(|| ApiError::bad("store is true or false", "store"))?;
                asked.store_sent = true;
            }
            "previous_response_id" => {
                let id = value
                    .as_str()
                    .ok_or_else(|| ApiError::bad("previous_response_id is an id", "previous_response_id"))?;
                asked.previous = Some(id.to_string());
            }
            "conversation" => {
                return refuse("conversation objects are not kept here: chain responses with previous_response_id");
            }
            "background" if value == &Value::Bool(false) => {}
            "background" => return refuse("background responses are not run here (each is answered as it runs)"),
            "truncation" if value == "disabled" => {}
            "truncation" => return refuse("only `disabled` (a conversation over the context is refused)"),
            "include" => {
                let items = value.as_array().ok_or_else(|| ApiError::bad("include is a list", "include"))?;
                for item in items {
                    if item != LOGPROBS {
                        let why = format!("only {LOGPROBS} is available, not {item}");
                        return Err(ApiError::bad(why, "include"));
                    }
                    asked.logprobs = true;
                }
            }
            "top_logprobs" => {
                chat.insert("top_logprobs".into(), value.clone());
            }
            "reasoning" => {
                let Some(reasoning) = value.as_object() else { return refuse("reasoning is an object") };
                for (k, v) in reasoning {
                    match k.as_str() {
                        // The chat's `reasoning_effort`: to a chat template that reads it.
                        "effort" if !v.is_null() => {
                            chat.insert("reasoning_effort".into(), v.clone());
                            asked.reasoning = json!({"effort": v, "summary": null});
                        }
                        "effort" | "summary" | "generate_summary" if v.is_null() => {}
                        _ => {
                            return refuse(
                                "only reasoning.effort is taken: summaries are not written (the thinking of a \
                                 reasoning model comes whole as a reasoning item with the router's reasoning_parser)",
                            );
                        }
                    }
                }
            }
            "stream_options" => {
                let only_obfuscation = value.as_object().is_some_and(|o| o.keys().all(|k| k == "include_obfuscation"));
                if !only_obfuscation {
                    return refuse("only include_obfuscation is taken (and has no effect)");
                }
            }
            "max_tool_calls" | "prompt" | "prompt_cache_retention" => return refuse("not supported"),
            _ => return Err(ApiError::bad_field(format!("unknown field `{name}`"), name)),
        }
    }
    // Echoed as sent, or as their defaults.
    let sent = |k: &str| fields.get(k).filter(|v| !v.is_null()).cloned();
    asked.tools = sent("tools").unwrap_or_else(|| json!([]));
    asked.tool_choice = sent("tool_choice").unwrap_or_else(|| json!("auto"));
    asked.text = sent("text").unwrap_or_else(|| json!({"format": {"type": "text"}}));
    asked.temperature = sent("temperature").unwrap_or_default();
    asked.top_p = sent("top_p").unwrap_or_default();
    asked.max_output_tokens = sent("max_output_tokens").unwrap_or_default();
    asked.user = sent("user").unwrap_or_default();
    asked.parallel_tool_calls = sent("parallel_tool_calls").and_then(|v| v.as_bool()).unwrap_or(true);
    if asked.logprobs {
        chat.insert("logprobs".into(), json!(true));
    } else if chat.get("top_logprobs").and_then(Value::as_u64).is_some_and(|n| n > 0) {
        let why = format!("top_logprobs needs include: [\"{LOGPROBS}\"], which returns them");
        return Err(ApiError::bad(why, "top_logprobs"));
    }
    let input =
        fields.get("input").filter(|v| !v.is_null()).ok_or_else(|| ApiError::bad("input is required", "input"))?;
    messages.extend(conversation(input)?);
    chat.insert("messages".into(), Value::Array(messages));
    if chat.get("stream").and_then(Value::as_bool) == Some(true) {
        // The final event carries the usage.
        chat.insert("stream_options".into(), json!({"include_usage": true}));
    }
    Ok((Value::Object(chat), asked))
}

/// The conversation the input is: a text (one user turn) or a list of items.
fn conversation(input: &Value) -> Result<Vec<Value>, ApiError> {
    let bad = |why: String| ApiError::bad(format!("input: {why}"), "input");
    let items = match input {
        Value::String(text) => return Ok(vec![json!({"role": "user", "content": text})]),
        Value::Array(items) => items,
        _ => return Err(bad("a text or a list of items is expected".into())),
    };
    let mut messages: Vec<Value> = Vec::new();
    // A reasoning item's text, for the assistant turn after it.
    let mut thought: Option<String> = None;
    for item in items {
        let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
        match kind {
            "message" => {
                let role =
                    item.get("role").and_then(Value::as_str).ok_or_else(|| bad("a message has a role".into()))?;
                if !matches!(role, "user" | "system" | "developer" | "assistant") {
                    return Err(bad(format!("unknown role `{role}`")));
                }
                let content = match item.get("content") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => parts.iter().map(part_text).collect::<Result<String, _>>()?,
                    _ => return Err(bad("a message's content is a text or a list of parts".into())),
                };
                let mut m = json!({"role": role, "content": content});
                if role == "assistant"
                    && let Some(t) = thought.take()
                {
                    m["reasoning_content"] = json!(t);
                }
                messages.push(m);
            }
            "function_call" => {
                let field = |k: &str| {
                    item.get(k).and_then(Value::as_str).ok_or_else(|| bad(format!("a function_call has `{k}`")))
                };
                let call = json!({"id": field("call_id")?, "type": "function",
                                  "function": {"name": field("name")?, "arguments": field("arguments")?}});
                // Calls in a row are one assistant turn's.
                match messages.last_mut() {
                    Some(last)
                        if last["role"] == "assistant" && last.get("tool_calls").is_some() && thought.is_none() =>
                    {
                        if let Some(calls) = last["tool_calls"].as_array_mut() {
                            calls.push(call);
                        }
                    }
                    _ => {
                        let mut m = json!({"role": "assistant", "content": null, "tool_calls": [call]});
                        if let Some(t) = thought.take() {
                            m["reasoning_content"] = json!(t);
                        }
                        messages.push(m);
                    }
                }
            }
            "function_call_output" => {
                let call_id = item.get("call_id").and_then(Value::as_str);
                let output = match item.get("output") {
                    Some(Value::String(s)) => Some(s.clone()),
                    Some(Value::Array(parts)) => Some(parts.iter().map(part_text).collect::<Result<String, _>>()?),
                    _ => None,
                };
                let (Some(call_id), Some(output)) = (call_id, output) else {
                    return Err(bad("a function_call_output has `call_id` and `output`".into()));
                };
                messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            "reasoning" => {
                let text: String = item
                    .get("content")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(|c| c.get("text").and_then(Value::as_str))
                    .collect();
                thought = Some(text);
            }
            other => return Err(bad(format!("items of type `{other}` are not supported"))),
        }
    }
    if let Some(t) = thought {
        messages.push(json!({"role": "assistant", "content": "", "reasoning_content": t}));
    }
    Ok(messages)
}

/// A content part's text (`input_text`, or `output_text` in an earlier answer).
fn part_text(part: &Value) -> Result<String, ApiError> {
    let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
    match (kind, part.get("text").and_then(Value::as_str)) {
        ("input_text" | "output_text" | "text", Some(text)) => Ok(text.to_string()),
        _ => {
            Err(ApiError::bad(format!("input: content parts of type `{kind}` are not supported (text only)"), "input"))
        }
    }
}

/// Function tools as chat takes them (`{"type": "function", "function": {...}}`).
fn chat_tools(tools: &Value) -> Result<Value, ApiError> {
    let bad = |why: &str| ApiError::bad(format!("tools: {why}"), "tools");
    let tools = tools.as_array().ok_or_else(|| bad("a list of tools is expected"))?;
    let each = tools.iter().map(|t| {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad("only function tools are supported"));
        }
        let mut f = t.as_object().cloned().unwrap_or_default();
        f.remove("type");
        Ok(json!({"type": "function", "function": f}))
    });
    each.collect::<Result<Vec<_>, _>>().map(Value::Array)
}

/// `tool_choice` as chat takes it.
fn chat_tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice {
        Value::String(_) => Ok(choice.clone()),
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o.get("name").and_then(Value::as_str).ok_or_else(|| {
                ApiError::bad(r#"a named tool_choice is {"type": "function", "name": ...}"#, "tool_choice")
            })?;
            Ok(json!({"type": "function", "function": {"name": name}}))
        }
        _ => Err(ApiError::bad("tool_choice is none, auto, required or a named function", "tool_choice")),
    }
}

/// `text.format` as chat's `response_format` (none for plain text).
fn text_format(text: &Value) -> Result<Option<Value>, ApiError> {
    let bad = |why: &str| ApiError::bad(format!("text: {why}"), "text");
    let o = text.as_object().ok_or_else(|| bad("an object is expected"))?;
    for (k, v) in o {
        match k.as_str() {
            "format" => {}
            "verbosity" if v.is_null() || v == "medium" => {}
            _ => return Err(bad(&format!("`{k}` is not supported"))),
        }
    }
    let Some(format) = o.get("format").filter(|f| !f.is_null()) else { return Ok(None) };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let schema = format.get("schema").ok_or_else(|| bad("format.schema is required"))?;
            let name = format.get("name").cloned().unwrap_or(json!("output"));
            Ok(Some(json!({"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                   "strict": format.get("strict")}})))
        }
        _ => Err(bad("format.type is text, json_object or json_schema")),
    }
}

/// The ids of a response and its items, from the chat answer's (`chatcmpl-HEX`).
pub fn ids(chat_id: &str) -> String {
    chat_id.rsplit('-').next().unwrap_or(chat_id).to_string()
}

/// The usage object of this API from chat's.
pub fn usage(chat_usage: &Value) -> Value {
    let n = |k: &str| chat_usage.get(k).and_then(Value::as_u64).unwrap_or(0);
    let detail = |p: &str| chat_usage.pointer(p).and_then(Value::as_u64).unwrap_or(0);
    let (cached, thinking) =
        (detail("/prompt_tokens_details/cached_tokens"), detail("/completion_tokens_details/reasoning_tokens"));
    json!({"input_tokens": n("prompt_tokens"), "input_tokens_details": {"cached_tokens": cached},
           "output_tokens": n("completion_tokens"), "output_tokens_details": {"reasoning_tokens": thinking},
           "total_tokens": n("total_tokens")})
}

/// The response object around `output`: `status` `completed`, or `incomplete` when the answer was cut by the token
/// budget.
pub fn response(id: &str, created: &Value, model: &Value, asked: &Asked, output: Vec<Value>, done: Done) -> Value {
    let previous = asked.previous.as_ref().map_or(Value::Null, |p| json!(p));
    let (status, incomplete) = match done {
        Done::InProgress => ("in_progress", Value::Null),
        Done::Completed => ("completed", Value::Null),
        Done::Cut => ("incomplete", json!({"reason": "max_output_tokens"})),
    };
    json!({"id": format!("resp_{id}"), "object": "response", "created_at": created, "status": status,
           "error": null, "incomplete_details": incomplete, "instructions": asked.instructions, "model": model,
           "output": output, "parallel_tool_calls": asked.parallel_tool_calls, "temperature": asked.temperature,
           "top_p": asked.top_p, "tool_choice": asked.tool_choice, "tools": asked.tools, "text": asked.text,
           "max_output_tokens": asked.max_output_tokens, "previous_response_id": previous, "reasoning": asked.reasoning,
           "store": asked.store, "truncation": "disabled", "metadata": asked.metadata, "user": asked.user,
           "usage": null})
}

/// Where a response is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Done {
    InProgress,
    Completed,
    /// Cut by `max_output_tokens`.
    Cut,
}

/// The output items of one chat answer (`message`, `finish_reason`): its thinking, its text (with its tokens'
/// `logprobs`, when asked for), its calls.
pub fn output_items(id: &str, message: &Value, logprobs: Option<&Value>, cut: bool) -> Vec<Value> {
    let mut items = Vec::new();
    if let Some(thought) = message.get("reasoning_content").and_then(Value::as_str) {
        items.push(reasoning_item(id, thought));
    }
    if let Some(text) = message.get("content").and_then(Value::as_str).filter(|t| !t.is_empty()) {
        let mut item = message_item(id, text, if cut { "incomplete" } else { "completed" });
        if let Some(lps) = logprobs {
            let after_thinking = message.get("reasoning_content").is_some();
            item["content"][0]["logprobs"] = text_logprobs(lps, text, after_thinking);
        }
        items.push(item);
    }
    for (k, call) in message.get("tool_calls").and_then(Value::as_array).into_iter().flatten().enumerate() {
        let f = &call["function"];
        items.push(call_item(id, k, &call["id"], &f["name"], f["arguments"].as_str().unwrap_or(""), "completed"));
    }
    items
}

/// The entries of the answer's tokens (chat's `logprobs.content`, each with its `bytes`) that make up its text:
/// those overlapping where the text sits in the whole answer (after the thinking when there is some, else from the
/// start: calls come after the text).
fn text_logprobs(entries: &Value, text: &str, after_thinking: bool) -> Value {
    let Some(entries) = entries.as_array() else { return json!([]) };
    let spans: Vec<usize> = entries.iter().map(|e| e["bytes"].as_array().map_or(0, Vec::len)).collect();
    let whole: Vec<u8> = entries
        .iter()
        .flat_map(|e| e["bytes"].as_array().into_iter().flatten().filter_map(Value::as_u64).map(|b| b as u8))
        .collect();
    let at = |hay: &[u8]| hay.windows(text.len().max(1)).position(|w| w == text.as_bytes());
    let start = if after_thinking {
        (0..=whole.len().saturating_sub(text.len())).rev().find(|&i| whole[i..].starts_with(text.as_bytes()))
    } else {
        at(&whole)
    };
    let Some(start) = start else { return json!([]) };
    let end = start + text.len();
    let mut offset = 0;
    let mut kept = Vec::new();
    for (entry, len) in entries.iter().zip(spans) {
        if offset < end && offset + len > start {
            kept.push(entry.clone());
        }
        offset += len;
    }
    Value::Array(kept)
}

/// The ids of a response's items: its one reasoning item, its one message, its call `k`.
pub fn reasoning_id(id: &str) -> String {
    format!("rs_{id}")
}

pub fn message_id(id: &str) -> String {
    format!("msg_{id}")
}

pub fn call_item_id(id: &str, k: usize) -> String {
    format!("fc_{id}{k:02x}")
}

pub fn reasoning_item(id: &str, thought: &str) -> Value {
    json!({"type": "reasoning", "id": reasoning_id(id), "summary": [],
           "content": [{"type": "reasoning_text", "text": thought}]})
}

pub fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if text.is_empty() && status == "in_progress" {
        json!([])
    } else {
        json!([{"type": "output_text", "text": text, "annotations": []}])
    };
    json!({"type": "message", "id": message_id(id), "status": status, "role": "assistant", "content": content})
}

pub fn call_item(id: &str, k: usize, call_id: &Value, name: &Value, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": call_item_id(id, k), "call_id": call_id, "name": name,
           "arguments": arguments, "status": status})
}

/// The conversation a chat request holds, less its instructions (a following response does not inherit them).
pub fn conversation_of(chat: &Value, asked: &Asked) -> Vec<Value> {
    let messages = chat["messages"].as_array().cloned().unwrap_or_default();
    let skip = usize::from(!asked.instructions.is_null());
    messages.into_iter().skip(skip).collect()
}

/// Puts a stored conversation before the request's own turns (after its instructions).
pub fn continue_from(chat: &mut Value, asked: &Asked, prior: &[Value]) {
    if let Some(messages) = chat["messages"].as_array_mut() {
        let at = usize::from(!asked.instructions.is_null()).min(messages.len());
        messages.splice(at..at, prior.iter().cloned());
    }
}

/// The assistant's turn a response's output is, as the chat conversation holds it: its text, its calls (by the ids
/// a `function_call_output` answers), its thinking.
pub fn assistant_turn(output: &[Value]) -> Value {
    let mut text = String::new();
    let mut calls = Vec::new();
    let mut thought = None;
    for item in output {
        match item["type"].as_str() {
            Some("message") => {
                let parts = item["content"].as_array().into_iter().flatten();
                text.extend(parts.filter_map(|p| p["text"].as_str()));
            }
            Some("function_call") => calls.push(json!({"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}})),
            Some("reasoning") => {
                let parts = item["content"].as_array().into_iter().flatten();
                thought = Some(parts.filter_map(|p| p["text"].as_str()).collect::<String>());
            }
            _ => {}
        }
    }
    let mut turn = json!({"role": "assistant", "content": text});
    if !calls.is_empty() {
        turn["tool_calls"] = Value::Array(calls);
        if text.is_empty() {
            turn["content"] = Value::Null;
        }
    }
    if let Some(t) = thought {
        turn["reasoning_content"] = json!(t);
    }
    turn
}

/// The response a whole chat completion is.
pub fn from_chat(chat: &Value, asked: &Asked) -> Value {
    let id = ids(chat["id"].as_str().unwrap_or(""));
    let choice = &chat["choices"][0];
    let cut = choice["finish_reason"] == "length";
    let logprobs = asked.logprobs.then(|| choice["logprobs"]["content"].clone());
    let output = output_items(&id, &choice["message"], logprobs.as_ref(), cut);
    let done = if cut { Done::Cut } else { Done::Completed };
    let mut r = response(&id, &chat["created"], &chat["model"], asked, output, done);
    r["usage"] = usage(&chat["usage"]);
    r
}

#[cfg(test)]
mod tests;
