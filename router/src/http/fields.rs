//! Every top-level field of a chat or text completion request, and what the router does with it: implemented,
//! accepted because it changes nothing by nature, or refused with 400 naming it unless its value is the default
//! (so a client asking for something the router does not do is told, never silently ignored). A field no schema
//! has is refused too. The list, with reasons, is `docs/api.md`.

use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::openai::Endpoint;

/// What the router does with a field.
#[derive(Clone, Copy, Debug)]
enum Rule {
    /// Implemented: the typed request checks it.
    Used,
    /// Changes nothing here by nature: accepted with any value.
    Inert,
    /// Not supported: refused, with this reason, unless the value is one that asks for nothing.
    Refused(fn(&Value) -> bool, &'static str),
}

use Rule::{Inert, Refused, Used};

fn zero(v: &Value) -> bool {
    v.as_f64() == Some(0.0)
}
fn one(v: &Value) -> bool {
    v.as_f64() == Some(1.0)
}
fn empty(v: &Value) -> bool {
    v.as_array().is_some_and(Vec::is_empty) || v.as_object().is_some_and(Map::is_empty) || v.as_str() == Some("")
}
fn none_choice(v: &Value) -> bool {
    v.as_str() == Some("none")
}
fn text_only(v: &Value) -> bool {
    *v == json!(["text"])
}
fn standard_tier(v: &Value) -> bool {
    matches!(v.as_str(), Some("auto" | "default"))
}
fn never(_: &Value) -> bool {
    false
}

pub(super) const NO_TOOLS: &str = "the served model's chat template has no tool support";
const NOT_REASONING: &str = "the served model is not a reasoning model";

/// Fields both endpoints take (OpenAI's, then vLLM's extra ones).
fn common(name: &str) -> Option<Rule> {
    Some(match name {
        "model"
        | "max_tokens"
        | "max_completion_tokens"
        | "temperature"
        | "top_p"
        | "seed"
        | "stop"
        | "stream"
        | "stream_options" => Used,
        // Recorded on the request's trace span; nothing else.
        "user" => Inert,
        "n" => Used,
        "frequency_penalty" | "presence_penalty" | "logit_bias" => Used,
        // vLLM's extra sampling fields.
        "top_k" | "ignore_eos" | "cache_salt" | "repetition_penalty" | "min_tokens" | "stop_token_ids" => Used,
        "min_p" => Refused(zero, "min_p is not supported yet"),
        "guided_json" | "guided_regex" | "guided_choice" => Used,
        "guided_grammar" => Refused(
            never,
            "grammars in EBNF/Lark are not supported: give a JSON schema (guided_json) or a regular expression (guided_regex)",
        ),
        _ => return None,
    })
}

/// Fields only chat completions take.
fn chat(name: &str) -> Option<Rule> {
    Some(match name {
        "messages" => Used,
        // `safety_identifier` is recorded on the trace span; the other prompt cache fields ask for caching, which
        // the router does anyway.
        "metadata"
        | "store"
        | "parallel_tool_calls"
        | "safety_identifier"
        | "prompt_cache_retention"
        | "prompt_cache_options" => Inert,
        "prompt_cache_key" => Used,
        "logprobs" | "top_logprobs" => Used,
        "response_format" => Used,
        "tools" | "functions" => Refused(empty, NO_TOOLS),
        "tool_choice" | "function_call" => Refused(none_choice, NO_TOOLS),
        "modalities" => Refused(text_only, "only text output is supported"),
        "audio" => Refused(never, "audio output is not supported"),
        "prediction" => Refused(never, "predicted outputs are not supported"),
        "reasoning_effort" | "verbosity" => Refused(never, NOT_REASONING),
        "web_search_options" => Refused(never, "web search is not available"),
        "moderation" => Refused(never, "moderation is not available"),
        "service_tier" => Refused(standard_tier, "there is one service tier (auto)"),
        _ => return None,
    })
}

/// Fields only text completions take.
fn completion(name: &str) -> Option<Rule> {
    Some(match name {
        "prompt" => Used,
        "logprobs" => Used,
        "best_of" => Refused(one, "best_of is not supported: ask for n samples and rank them yourself"),
        "echo" => Used,
        "suffix" => Refused(empty, "suffix is not supported: the served model has no fill-in-the-middle mode"),
        _ => return None,
    })
}

/// The refusal of a field an endpoint does not have.
pub(super) fn unknown_field(name: &str) -> ApiError {
    ApiError::bad_field(format!("unknown field `{name}` for this endpoint"), name)
}

/// Checks every top-level field of `body` (a JSON object) against what `endpoint` supports.
pub fn check(endpoint: Endpoint, body: &Map<String, Value>) -> Result<(), ApiError> {
    for (name, value) in body {
        let own = match endpoint {
            Endpoint::Chat => chat(name),
            Endpoint::Completion => completion(name),
        };
        let Some(rule) = own.or_else(|| common(name)) else {
            return Err(unknown_field(name));
        };
        match rule {
            Used | Inert => {}
            Refused(asks_nothing, why) => {
                if !value.is_null() && !asks_nothing(value) {
                    return Err(ApiError::bad_field(format!("`{name}` = {value}: {why}"), name));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(v: Value) -> Map<String, Value> {
        v.as_object().expect("an object").clone()
    }

    fn refused(endpoint: Endpoint, v: Value) -> Option<String> {
        match check(endpoint, &fields(v)) {
            Ok(()) => None,
            Err(ApiError::BadRequest { param, .. }) => param.map(|p| p.into_owned()),
            Err(other) => panic!("{other:?}"),
        }
    }

    #[test]
    fn defaults_pass_and_anything_else_is_named() {
        let chat = Endpoint::Chat;
        let ok = json!({"model": "m", "messages": [], "n": 1, "logprobs": false, "frequency_penalty": 0,
            "logit_bias": {}, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
            "user": "u", "metadata": {"a": "b"}, "store": true, "service_tier": "auto", "top_logprobs": null});
        assert_eq!(refused(chat, ok), None);
        for (field, value) in [
            ("tools", json!([{"type": "function", "function": {"name": "f"}}])),
            ("guided_grammar", json!("root ::= \"a\"")),
            ("reasoning_effort", json!("low")),
            ("min_p", json!(0.1)),
            ("best_of", json!(2)),
            ("made_up", json!(1)),
        ] {
            let mut body = fields(json!({"model": "m", "messages": []}));
            body.insert(field.into(), value);
            let param = refused(chat, Value::Object(body));
            assert_eq!(param.as_deref(), Some(field), "{field}");
        }
        // Completions: their own fields, and chat's are unknown there.
        assert_eq!(refused(Endpoint::Completion, json!({"prompt": "x", "suffix": "y"})).as_deref(), Some("suffix"));
        assert_eq!(refused(Endpoint::Completion, json!({"prompt": "x", "messages": []})).as_deref(), Some("messages"));
        assert_eq!(refused(Endpoint::Completion, json!({"prompt": "x", "best_of": 1, "logprobs": null})), None);
        assert_eq!(refused(Endpoint::Chat, json!({"messages": [], "echo": false})).as_deref(), Some("echo"));
    }
}
