//! llama.cpp's `llama-server`, through its native `/completion` endpoint: it takes the prompt as token ids and,
//! with `return_tokens`, streams the generated token ids back, so the router keeps its own detokenization, stop
//! strings and usage, as for its own workers. The last chunk says why generation stopped and how much of the
//! prompt the server's cache served (`timings.cache_n`).

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
pub fn body(tokens: &[u32], sampling: &pb::Sampling) -> Value {
    let mut b = json!({
        "prompt": tokens,
        "n_predict": sampling.max_tokens,
        "stream": true,
        "return_tokens": true,
        "cache_prompt": true,
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
    b
}

/// What llama-server cannot do that the request asks for.
pub fn unsupported(sampling: &pb::Sampling) -> Option<&'static str> {
    if sampling.min_tokens > 0 {
        Some("min_tokens")
    } else if !sampling.stop_token_ids.is_empty() {
        Some("stop_token_ids")
    } else {
        None
    }
}

/// Reads one chunk's JSON.
pub fn parse(data: &str) -> Result<Chunk, String> {
    let v = super::chunk_json(data)?;
    let tokens = super::token_ids(v.get("tokens"))?;
    if v.get("stop").and_then(Value::as_bool) != Some(true) {
        return Ok(Chunk::Tokens(tokens));
    }
    let reason = match v.get("stop_type").and_then(Value::as_str) {
        Some("limit") => pb::FinishReason::Length,
        _ => pb::FinishReason::Stop,
    };
    let cached = v.pointer("/timings/cache_n").and_then(Value::as_u64).unwrap_or(0);
    Ok(Chunk::Finished { tokens, reason, cached_tokens: u32::try_from(cached).unwrap_or(u32::MAX) })
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
        let b = body(&[1, 2, 3], &s);
        assert_eq!(b["prompt"], json!([1, 2, 3]));
        assert_eq!((b["n_predict"].as_u64(), b["return_tokens"].as_bool()), (Some(7), Some(true)));
        assert_eq!((b["top_k"].as_u64(), b["min_p"].as_f64(), b["seed"].as_u64()), (Some(0), Some(0.0), Some(3)));
        let b = body(&[1], &pb::Sampling { min_p: 0.25, ..s });
        assert_eq!(b["min_p"].as_f64(), Some(0.25));
    }

    #[test]
    fn chunks_as_the_server_streams_them() {
        // Shapes from llama.cpp's server (server-task.cpp, `to_json_non_oaicompat` of partial and final results).
        let partial = r#"{"index":0,"content":" Hi","tokens":[3874],"stop":false,"id_slot":0,"tokens_predicted":1,"tokens_evaluated":9}"#;
        assert_eq!(parse(partial), Ok(Chunk::Tokens(vec![3874])));
        let last = r#"{"index":0,"content":"","tokens":[],"id_slot":0,"stop":true,"model":"m","tokens_predicted":8,
            "tokens_evaluated":40,"stop_type":"limit","stopping_word":"","tokens_cached":47,
            "timings":{"cache_n":32,"prompt_n":8,"prompt_ms":3.1,"predicted_n":8}}"#;
        assert_eq!(
            parse(last),
            Ok(Chunk::Finished { tokens: vec![], reason: pb::FinishReason::Length, cached_tokens: 32 })
        );
        let eos = r#"{"tokens":[2],"stop":true,"stop_type":"eos"}"#;
        assert_eq!(
            parse(eos),
            Ok(Chunk::Finished { tokens: vec![2], reason: pb::FinishReason::Stop, cached_tokens: 0 })
        );
    }

    #[test]
    fn bad_chunks_are_errors_not_panics() {
        assert!(parse("not json").is_err());
        assert!(parse(r#"{"error":{"code":500,"message":"boom"}}"#).expect_err("error").contains("boom"));
        assert!(parse(r#"{"tokens":[-1]}"#).is_err());
        assert!(parse(r#"{"tokens":"abc"}"#).is_err());
        assert_eq!(parse("{}"), Ok(Chunk::Tokens(vec![])));
    }

    #[test]
    fn capacity_is_the_context_of_every_slot() {
        let props = json!({"default_generation_settings": {"n_ctx": 4096}, "total_slots": 2});
        assert_eq!(capacity_tokens(&props), Some(8192));
        assert_eq!(capacity_tokens(&json!({})), None);
    }
}
