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

fn one(v: &Value) -> bool {
    v.as_f64() == Some(1.0)
}
fn empty(v: &Value) -> bool {
    v.as_array().is_some_and(Vec::is_empty) || v.as_object().is_some_and(Map::is_empty) || v.as_str() == Some("")
}
fn is_true(v: &Value) -> bool {
    v.as_bool() == Some(true)
}
fn is_false(v: &Value) -> bool {
    v.as_bool() == Some(false)
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

const OLD_FUNCTIONS: &str = "functions and function_call (deprecated) are not supported: send tools and tool_choice";
const NO_VERBOSITY: &str = "verbosity is not set per request";

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
        "min_p" => Used,
        "guided_json" | "guided_regex" | "guided_choice" | "guided_grammar" | "structured_outputs" => Used,
        "skip_special_tokens" | "include_stop_str_in_output" | "add_special_tokens" => Used,
        "prompt_logprobs" => Used,
        // vLLM's, taken at their defaults only.
        "spaces_between_special_tokens" => {
            Refused(is_true, "control tokens' text is never spaced apart from the text around it")
        }
        "use_beam_search" => Refused(is_false, "beam search is not supported: ask for n samples"),
        "length_penalty" => Refused(one, "length_penalty applies to beam search, which is not supported"),
        "priority" => Used,
        "bad_words" | "allowed_token_ids" => Used,
        "truncate_prompt_tokens" | "return_tokens_as_token_ids" => Used,
        "logits_processors" => Refused(empty, "custom logits processors are not supported"),
        "vllm_xargs" | "kv_transfer_params" => Refused(empty, "vLLM's own engine arguments do not apply here"),
        "request_id" => Refused(never, "send your own request id as the x-client-request-id header"),
        _ => return None,
    })
}

/// Fields only chat completions take.
fn chat(name: &str) -> Option<Rule> {
    Some(match name {
        "messages" => Used,
        // `safety_identifier` is recorded on the trace span; the other prompt cache fields ask for caching, which
        // the router does anyway.
        "metadata" | "store" | "safety_identifier" | "prompt_cache_retention" | "prompt_cache_options" => Inert,
        "prompt_cache_key" => Used,
        "add_generation_prompt" | "continue_final_message" => Used,
        // vLLM's chat fields, taken at their defaults only.
        "echo" => Refused(is_false, "echo is not supported for chat"),
        "chat_template" => Refused(never, "the served model's own chat template is used"),
        "chat_template_kwargs" | "include_reasoning" => Used,
        // Goes to the chat template, where it reads them (`completions::template_arguments`).
        "documents" => Used,
        "mm_processor_kwargs" => Refused(empty, "only text input is supported"),
        "logprobs" | "top_logprobs" => Used,
        "response_format" => Used,
        "tools" | "tool_choice" | "parallel_tool_calls" => Used,
        "functions" => Refused(empty, OLD_FUNCTIONS),
        "function_call" => Refused(none_choice, OLD_FUNCTIONS),
        "modalities" => Refused(text_only, "only text output is supported"),
        "audio" => Refused(never, "audio output is not supported"),
        "prediction" => Refused(never, "predicted outputs are not supported"),
        // Goes to the chat template, where it reads one (`completions::template_arguments`).
        "reasoning_effort" => Used,
        "verbosity" => Refused(never, NO_VERBOSITY),
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
        // Tools are checked with the request (`super::tools`).
        let tools = json!({"messages": [], "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "required", "parallel_tool_calls": false});
        assert_eq!(refused(chat, tools), None);
        for (field, value) in [
            ("functions", json!([{"name": "f"}])),
            ("function_call", json!("auto")),
            ("verbosity", json!("low")),
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
        assert_eq!(refused(Endpoint::Chat, json!({"messages": [], "echo": true})).as_deref(), Some("echo"));
    }

    #[test]
    fn vllms_extra_fields_pass_at_their_defaults_and_are_named_otherwise() {
        let chat = Endpoint::Chat;
        let defaults = json!({"model": "m", "messages": [], "echo": false, "add_special_tokens": false,
            "spaces_between_special_tokens": true, "use_beam_search": false, "length_penalty": 1.0, "priority": 0,
            "bad_words": [], "allowed_token_ids": null, "prompt_logprobs": null, "truncate_prompt_tokens": null,
            "return_tokens_as_token_ids": false, "chat_template": null, "chat_template_kwargs": {},
            "documents": null, "mm_processor_kwargs": {}, "vllm_xargs": null, "kv_transfer_params": null,
            "request_id": null, "skip_special_tokens": false, "include_stop_str_in_output": true,
            "add_generation_prompt": false, "continue_final_message": false, "structured_outputs": null});
        assert_eq!(refused(chat, defaults), None);
        for (field, value) in [
            ("echo", json!(true)),
            ("spaces_between_special_tokens", json!(false)),
            ("use_beam_search", json!(true)),
            ("length_penalty", json!(0.5)),
            ("chat_template", json!("{{ messages }}")),
            ("request_id", json!("abc")),
        ] {
            let mut body = fields(json!({"model": "m", "messages": []}));
            body.insert(field.into(), value);
            assert_eq!(refused(chat, Value::Object(body)).as_deref(), Some(field), "{field}");
        }
        // `add_special_tokens` is taken either way on both endpoints (`encode_prompt` applies it); so is
        // `prompt_logprobs` (the workers compute the prompt's log-probabilities).
        let completion = |v| refused(Endpoint::Completion, v);
        assert_eq!(completion(json!({"prompt": "x", "prompt_logprobs": 1})), None);
        assert_eq!(refused(chat, json!({"messages": [], "prompt_logprobs": 0})), None);
        assert_eq!(completion(json!({"prompt": "x", "priority": -3})), None);
        for add in [true, false] {
            assert_eq!(completion(json!({"prompt": "x", "add_special_tokens": add})), None);
            assert_eq!(refused(chat, json!({"messages": [], "add_special_tokens": add})), None);
        }
        assert_eq!(
            completion(json!({"prompt": "x", "continue_final_message": false})).as_deref(),
            Some("continue_final_message")
        );
    }
}
