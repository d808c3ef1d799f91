//! llama.cpp's `llama-server`, through its native `/completion` endpoint: it takes the prompt as token ids and,
//! with `return_tokens`, streams the generated token ids back, so the router keeps its own detokenization, stop
//! strings and usage, as for its own workers. The last chunk says why generation stopped and how much of the
//! prompt the server's cache served (`timings.cache_n`). Asked with `n_probs`, each token comes with its
//! log-probability and the most likely alternatives, by id, from the model's own distribution (before sampling,
//! `post_sampling_probs` off): what Tandem's workers report, relayed as they are.

use engine::grammar::Grammar;
use proto::worker as pb;
use serde_json::{Value, json};

use super::Chunk;

/// The path requests go to.
pub const GENERATE_PATH: &str = "/completion";
/// Answers 200 once the model is loaded (503 while loading).
pub const HEALTH_PATH: &str = "/health";
/// The server's settings: its context per slot and its slots.
pub const PROPS_PATH: &str = "/props";

/// The request body for `tokens` sampled as `sampling` says (OpenAI's meaning: llama.cpp's other samplers off).
/// The request body for `tokens` sampled as `sampling` says; `cache_prompt`: whether the server may reuse its
/// slots' cached prompts for it (and so whether what it caches is predicted).
pub fn body(tokens: &[u32], sampling: &pb::Sampling, cache_prompt: bool) -> Value {
    let mut b = json!({
        "prompt": tokens,
        "n_predict": sampling.max_tokens,
        "stream": true,
        "return_tokens": true,
        "cache_prompt": cache_prompt,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        // 0 turns top-k off in llama.cpp (its default is 40), and min-p (its default is 0.05) unless asked for.
        "top_k": sampling.top_k.unwrap_or(0),
        "min_p": sampling.min_p,
        "ignore_eos": sampling.ignore_eos,
        // llama.cpp's penalties, over the whole sequence (its window is the last 64 tokens by default; the server
        // takes no -1 for "all").
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        "repeat_penalty": sampling.repetition_penalty.unwrap_or(1.0),
        "repeat_last_n": tokens.len() + sampling.max_tokens as usize,
        "logit_bias": sampling.logit_bias.iter().map(|(t, v)| json!([t, v])).collect::<Vec<_>>(),
    });
    if let Some(seed) = sampling.seed {
        b["seed"] = seed.into();
    }
    if let Some(n) = sampling.logprobs {
        // At least one alternative: the server reports the chosen token's log-probability only with them.
        b["n_probs"] = n.max(1).into();
        b["post_sampling_probs"] = false.into();
    }
    // A schema, which the server turns into its own grammar; a regular expression is refused (`unsupported`).
    match super::grammar(sampling) {
        Some(Grammar::JsonSchema(schema)) => b["json_schema"] = super::schema_value(&schema),
        Some(Grammar::JsonObject) => b["json_schema"] = super::schema_value(super::ANY_OBJECT),
        // GBNF is llama.cpp's own.
        Some(Grammar::Gbnf(gbnf)) => b["grammar"] = gbnf.into(),
        Some(Grammar::Regex(_) | Grammar::Lark(_)) | None => {}
    }
    b
}

/// What llama-server cannot do that the request asks for.
pub fn unsupported(sampling: &pb::Sampling) -> Option<&'static str> {
    if sampling.min_tokens > 0 {
        Some("min_tokens")
    } else if matches!(super::grammar(sampling), Some(Grammar::Regex(_))) {
        Some("structured outputs by regular expression")
    } else if !sampling.stop_token_ids.is_empty() {
        Some("stop_token_ids")
    } else {
        None
    }
}

/// Reads one chunk's JSON; `alternatives`: the log-probabilities asked for (this many alternatives per token).
pub fn parse(data: &str, alternatives: Option<u32>) -> Result<Chunk, String> {
    let v = super::chunk_json(data)?;
    let tokens = super::token_ids(v.get("tokens"))?;
    if v.get("stop").and_then(Value::as_bool) != Some(true) {
        return match alternatives {
            Some(n) if !tokens.is_empty() => {
                let logprobs = token_logprobs(v.get("completion_probabilities"), &tokens, n)?;
                Ok(Chunk::Scored(tokens, logprobs))
            }
            _ => Ok(Chunk::Tokens(tokens)),
        };
    }
    if alternatives.is_some() && !tokens.is_empty() {
        // The server sends every token, end of generation included, in a chunk of its own before the last.
        return Err("the last chunk carries tokens, whose log-probabilities are not relayed from it".into());
    }
    let reason = match v.get("stop_type").and_then(Value::as_str) {
        Some("limit") => pb::FinishReason::Length,
        _ => pb::FinishReason::Stop,
    };
    let cached = v.pointer("/timings/cache_n").and_then(Value::as_u64).unwrap_or(0);
    Ok(Chunk::Finished {
        tokens,
        logprobs: Vec::new(),
        reason,
        cached_tokens: u32::try_from(cached).unwrap_or(u32::MAX),
    })
}

/// Each token's entry of `completion_probabilities`, as a worker reports it: its log-probability and the first
/// `n` alternatives. An entry missing or naming another token is an error, never a token without them.
fn token_logprobs(v: Option<&Value>, tokens: &[u32], n: u32) -> Result<Vec<pb::TokenLogprobs>, String> {
    let entries = v.and_then(Value::as_array).ok_or("a chunk without completion_probabilities")?;
    if entries.len() != tokens.len() {
        return Err(format!("{} tokens with {} completion_probabilities", tokens.len(), entries.len()));
    }
    let id_and_logprob = |e: &Value| {
        let id = e.get("id").and_then(Value::as_u64).and_then(|t| u32::try_from(t).ok());
        let lp = e.get("logprob").and_then(Value::as_f64);
        id.zip(lp)
            .map(|(id, lp)| (id, lp as f32))
            .ok_or_else(|| format!("a probability entry without id or logprob: {e}"))
    };
    tokens
        .iter()
        .zip(entries)
        .map(|(&token, e)| {
            let (id, logprob) = id_and_logprob(e)?;
            let top = e.get("top_logprobs").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
            let top: Vec<(u32, f32)> = top.iter().take(n as usize).map(id_and_logprob).collect::<Result<_, _>>()?;
            super::scored(token, id, logprob, &top)
        })
        .collect()
}

/// Tokens of KV the server holds in all (its context per slot times its slots), from `/props`.
pub fn capacity_tokens(props: &Value) -> Option<u64> {
    let per_slot = props.pointer("/default_generation_settings/n_ctx").and_then(Value::as_u64)?;
    Some(per_slot * props.get("total_slots").and_then(Value::as_u64).unwrap_or(1).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_asks_for_token_ids_with_openai_sampling() {
        let s = pb::Sampling { temperature: 0.0, top_p: 1.0, max_tokens: 7, seed: Some(3), ..Default::default() };
        let b = body(&[1, 2, 3], &s, true);
        assert_eq!(b["prompt"], json!([1, 2, 3]));
        assert_eq!((b["n_predict"].as_u64(), b["return_tokens"].as_bool()), (Some(7), Some(true)));
        assert_eq!((b["top_k"].as_u64(), b["min_p"].as_f64(), b["seed"].as_u64()), (Some(0), Some(0.0), Some(3)));
        let b = body(&[1], &pb::Sampling { min_p: 0.25, ..s.clone() }, true);
        assert_eq!(b["min_p"].as_f64(), Some(0.25));
        assert_eq!(b.get("json_schema"), None);
    }

    #[test]
    fn structured_outputs_go_as_json_schemas_and_regular_expressions_are_refused() {
        let with = |kind: &str, data: &str| pb::Sampling {
            grammar: Some(pb::Grammar { kind: kind.into(), data: data.into(), ..Default::default() }),
            ..Default::default()
        };
        let schema = r#"{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}"#;
        let b = body(&[1], &with("json_schema", schema), true);
        assert_eq!(b["json_schema"]["properties"]["n"]["type"], "integer", "{b}");
        assert_eq!(body(&[1], &with("json_object", ""), true)["json_schema"], json!({"type": "object"}));
        // GBNF is its own grammar format.
        assert_eq!(body(&[1], &with("gbnf", "root ::= \"a\""), true)["grammar"], json!("root ::= \"a\""));
        assert_eq!(unsupported(&with("json_schema", schema)), None);
        assert_eq!(unsupported(&with("regex", "a+")), Some("structured outputs by regular expression"));
    }

    #[test]
    fn chunks_as_the_server_streams_them() {
        // Shapes from llama.cpp's server (server-task.cpp, `to_json_non_oaicompat` of partial and final results).
        let partial = r#"{"index":0,"content":" Hi","tokens":[3874],"stop":false,"id_slot":0,"tokens_predicted":1,"tokens_evaluated":9}"#;
        assert_eq!(parse(partial, None), Ok(Chunk::Tokens(vec![3874])));
        let last = r#"{"index":0,"content":"","tokens":[],"id_slot":0,"stop":true,"model":"m","tokens_predicted":8,
            "tokens_evaluated":40,"stop_type":"limit","stopping_word":"","tokens_cached":47,
            "timings":{"cache_n":32,"prompt_n":8,"prompt_ms":3.1,"predicted_n":8}}"#;
        assert_eq!(
            parse(last, None),
            Ok(Chunk::Finished {
                tokens: vec![],
                logprobs: vec![],
                reason: pb::FinishReason::Length,
                cached_tokens: 32
            })
        );
        let eos = r#"{"tokens":[2],"stop":true,"stop_type":"eos"}"#;
        assert_eq!(
            parse(eos, None),
            Ok(Chunk::Finished { tokens: vec![2], logprobs: vec![], reason: pb::FinishReason::Stop, cached_tokens: 0 })
        );
        assert!(parse(eos, Some(1)).is_err(), "a token there would go without its log-probabilities");
        assert_eq!(parse(last, Some(1)).map(|c| matches!(c, Chunk::Finished { .. })), Ok(true));
    }

    #[test]
    fn log_probabilities_come_by_id_with_as_many_alternatives_as_asked() {
        // As the server streams them with n_probs 2 (its `completion_probabilities`).
        let chunk = r#"{"content":"x","tokens":[198],"stop":false,"completion_probabilities":[{"id":198,"token":"x",
            "bytes":[120],"logprob":-2.5,"top_logprobs":[{"id":198,"token":"x","bytes":[120],"logprob":-2.5},
            {"id":1604,"token":"def","bytes":[100,101,102],"logprob":-2.9}]}]}"#;
        let scored = |n| match parse(chunk, Some(n)) {
            Ok(Chunk::Scored(tokens, lps)) => (tokens, lps),
            other => panic!("{other:?}"),
        };
        let (tokens, lps) = scored(2);
        assert_eq!(tokens, [198]);
        assert_eq!(
            lps,
            [pb::TokenLogprobs { logprob: -2.5, rank: 0, top_ids: vec![198, 1604], top_logprobs: vec![-2.5, -2.9] }]
        );
        assert_eq!(scored(0).1[0].top_ids, Vec::<u32>::new(), "none asked: the chosen token's only");
        assert_eq!(parse(chunk, None), Ok(Chunk::Tokens(vec![198])), "not asked for: not read");
        for bad in [
            r#"{"tokens":[198],"stop":false}"#,
            r#"{"tokens":[198],"stop":false,"completion_probabilities":[]}"#,
            r#"{"tokens":[198],"stop":false,"completion_probabilities":[{"id":7,"logprob":-1.0}]}"#,
            r#"{"tokens":[198],"stop":false,"completion_probabilities":[{"id":198}]}"#,
        ] {
            assert!(parse(bad, Some(1)).is_err(), "{bad}");
        }
        let s = pb::Sampling { logprobs: Some(0), ..Default::default() };
        let b = body(&[1], &s, true);
        assert_eq!((b["n_probs"].as_u64(), b["post_sampling_probs"].as_bool()), (Some(1), Some(false)));
        assert!(body(&[1], &pb::Sampling::default(), true).get("n_probs").is_none());
    }

    #[test]
    fn bad_chunks_are_errors_not_panics() {
        assert!(parse("not json", None).is_err());
        assert!(parse(r#"{"error":{"code":500,"message":"boom"}}"#, None).expect_err("error").contains("boom"));
        assert!(parse(r#"{"tokens":[-1]}"#, None).is_err());
        assert!(parse(r#"{"tokens":"abc"}"#, None).is_err());
        assert_eq!(parse("{}", None), Ok(Chunk::Tokens(vec![])));
    }

    #[test]
    fn capacity_is_the_context_of_every_slot() {
        let props = json!({"default_generation_settings": {"n_ctx": 4096}, "total_slots": 2});
        assert_eq!(capacity_tokens(&props), Some(8192));
        assert_eq!(capacity_tokens(&json!({})), None);
    }
}
