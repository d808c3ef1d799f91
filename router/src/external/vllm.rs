//! vLLM's OpenAI server, through `/v1/completions` with the prompt as token ids and `return_token_ids`, so each
//! streamed chunk carries the generated ids and the router keeps its own detokenization, stop strings and usage.
//! The chunk with `finish_reason` says why generation stopped; the usage chunk after it (`include_usage`) says how
//! much of the prompt came from the cache (`prompt_tokens_details.cached_tokens`, present when the server runs
//! with `--enable-prompt-tokens-details`). Log-probabilities are asked with `logprobs` and
//! `return_tokens_as_token_ids`, so each token and alternative comes named `token_id:N`; vLLM reports the model's
//! raw distribution (its default `logprobs_mode`), what Tandem's workers report.

use engine::grammar::Grammar;
use proto::worker as pb;
use serde_json::{Value, json};

use super::Chunk;

pub const GENERATE_PATH: &str = "/v1/completions";
/// 200 once the engine is up.
pub const HEALTH_PATH: &str = "/health";

/// The request body for `tokens` sampled as `sampling` says (the model's generation-config defaults overridden:
/// OpenAI's meaning throughout), in the cache namespace `namespace` (vLLM's `cache_salt`).
pub fn body(tokens: &[u32], sampling: &pb::Sampling, namespace: Option<&str>) -> Value {
    let mut b = json!({
        "prompt": tokens,
        "max_tokens": sampling.max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
        "return_token_ids": true,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        // 0: top-k off in vLLM.
        "top_k": sampling.top_k.unwrap_or(0),
        "min_p": sampling.min_p,
        "ignore_eos": sampling.ignore_eos,
    });
    if let Some(n) = sampling.logprobs {
        b["logprobs"] = n.into();
        b["return_tokens_as_token_ids"] = true.into();
    }
    if let Some(seed) = sampling.seed {
        // The client's signed seed, back from the sampler's 64 bits (a seed past i64 would be refused).
        b["seed"] = (seed as i64).into();
    }
    // The same rules vLLM applies itself (Tandem's engine follows vLLM's meaning of each).
    super::put_logits_rules(&mut b, sampling, "min_tokens");
    if !sampling.allowed_token_ids.is_empty() {
        b["allowed_token_ids"] = sampling.allowed_token_ids.clone().into();
    }
    if let Some(salt) = namespace {
        b["cache_salt"] = salt.into();
    }
    // JSON without free whitespace, as Tandem's workers write it.
    let json = |schema: &str| json!({"json": super::schema_value(schema), "disable_any_whitespace": true});
    match super::grammar(sampling) {
        Some(Grammar::JsonSchema(schema)) => b["structured_outputs"] = json(&schema),
        Some(Grammar::JsonObject) => b["structured_outputs"] = json(super::ANY_OBJECT),
        Some(Grammar::Regex(regex)) => b["structured_outputs"] = json!({"regex": regex}),
        // Not relayed (`serve::needs`).
        // vLLM's default backend (xgrammar) reads GBNF as its own EBNF.
        Some(Grammar::Gbnf(gbnf)) => b["structured_outputs"] = json!({"grammar": gbnf}),
        Some(Grammar::Lark(_)) | None => {}
    }
    b
}

/// Reads the stream's chunks in order.
#[derive(Debug, Default)]
pub struct Parser {
    /// Why generation stopped, once a chunk said so (the usage chunk may follow).
    finished: Option<pb::FinishReason>,
    /// The alternatives per token asked for, when log-probabilities are.
    alternatives: Option<u32>,
}

impl Parser {
    /// A parser for a request that asked for `alternatives` per token's log-probabilities (`None`: none asked).
    pub fn new(alternatives: Option<u32>) -> Parser {
        Parser { finished: None, alternatives }
    }

    pub fn push(&mut self, data: &str) -> Result<Option<Chunk>, String> {
        if data.trim() == "[DONE]" {
            return Ok(self.finished.take().map(|reason| Chunk::Finished {
                tokens: vec![],
                logprobs: vec![],
                reason,
                cached_tokens: 0,
            }));
        }
        let v = super::chunk_json(data)?;
        let choices = v.get("choices").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
        if let Some(usage) = v.get("usage").filter(|u| !u.is_null())
            && choices.is_empty()
        {
            let cached = usage.pointer("/prompt_tokens_details/cached_tokens").and_then(Value::as_u64).unwrap_or(0);
            let reason = self.finished.take().ok_or("the usage chunk came before the last token")?;
            return Ok(Some(Chunk::Finished {
                tokens: vec![],
                logprobs: vec![],
                reason,
                cached_tokens: u32::try_from(cached).unwrap_or(u32::MAX),
            }));
        }
        let [choice] = choices else {
            return Err(format!("a chunk has {} choices, not one", choices.len()));
        };
        let tokens = super::token_ids(choice.get("token_ids"))?;
        match choice.get("finish_reason").and_then(Value::as_str) {
            None => {}
            Some("length") => self.finished = Some(pb::FinishReason::Length),
            Some("stop") => self.finished = Some(pb::FinishReason::Stop),
            Some(other) => return Err(format!("the server ended generation with {other:?}")),
        }
        match self.alternatives {
            Some(n) if !tokens.is_empty() => {
                let logprobs = token_logprobs(choice.get("logprobs"), &tokens, n)?;
                Ok(Some(Chunk::Scored(tokens, logprobs)))
            }
            _ => Ok(Some(Chunk::Tokens(tokens))),
        }
    }
}

/// A chunk's `logprobs` (`tokens`, `token_logprobs`, `top_logprobs`, one entry per token, the tokens written
/// `token_id:N`), as a worker reports them: each token's log-probability and its `n` most likely alternatives.
/// vLLM's `top_logprobs` names the sampled token too (first, or wherever it ranks), so it holds `n` or `n + 1`
/// entries: ranked here, the first `n` are the alternatives. Anything missing, or naming another token, is an
/// error, never a token without them.
fn token_logprobs(v: Option<&Value>, tokens: &[u32], n: u32) -> Result<Vec<pb::TokenLogprobs>, String> {
    let v = v.filter(|v| !v.is_null()).ok_or("a chunk without logprobs")?;
    let list = |key: &str| {
        v.get(key)
            .and_then(Value::as_array)
            .filter(|l| l.len() == tokens.len())
            .ok_or_else(|| format!("the chunk's logprobs.{key} is not a list of {} entries: {v}", tokens.len()))
    };
    let (named, logprobs, tops) = (list("tokens")?, list("token_logprobs")?, list("top_logprobs")?);
    let id_of = |name: &str| {
        name.strip_prefix("token_id:")
            .and_then(|id| id.parse::<u32>().ok())
            .ok_or_else(|| format!("a log-probability names {name:?}, not `token_id:N`"))
    };
    let logprob = |lp: &Value| lp.as_f64().map(|lp| lp as f32).ok_or_else(|| format!("a log-probability is {lp}"));
    tokens
        .iter()
        .zip(named.iter().zip(logprobs).zip(tops))
        .map(|(&token, ((name, lp), top))| {
            let id = id_of(name.as_str().unwrap_or_default())?;
            let top = top.as_object().ok_or_else(|| format!("top_logprobs entry {top} is not an object"))?;
            let mut top: Vec<(u32, f32)> =
                top.iter().map(|(name, lp)| Ok((id_of(name)?, logprob(lp)?))).collect::<Result<_, String>>()?;
            top.sort_by(|a, b| b.1.total_cmp(&a.1));
            top.truncate(n as usize);
            super::scored(token, id, logprob(lp)?, &top)
        })
        .collect()
}

/// Tokens of KV the server holds (`num_gpu_blocks` × `block_size` of `vllm:cache_config_info`, in its metrics).
pub fn capacity_tokens(metrics: &str, rank: Option<u32>) -> Option<u64> {
    // One sample per engine (a data-parallel rank each, labelled `engine`), with its blocks and their size.
    let engines: Vec<(Option<&str>, u64)> = metrics
        .lines()
        .filter_map(|l| l.strip_prefix("vllm:cache_config_info{")?.rsplit_once('}'))
        .filter_map(|(labels, _)| {
            let number = |key| super::metrics::label(labels, key)?.parse::<u64>().ok();
            Some((super::metrics::label(labels, "engine"), number("num_gpu_blocks")? * number("block_size")?))
        })
        .collect();
    let labelled = engines.iter().any(|(engine, _)| engine.is_some());
    match rank {
        // The rank's own engine.
        Some(r) if labelled => engines.iter().find(|(e, _)| *e == Some(r.to_string().as_str())).map(|(_, t)| *t),
        // The whole server: every engine's.
        None if labelled => Some(engines.iter().map(|(_, t)| t).sum()),
        _ => engines.first().map(|(_, t)| *t),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_sends_token_ids_and_asks_for_them_back() {
        let s = pb::Sampling { temperature: 0.5, top_p: 0.9, max_tokens: 4, seed: Some(1), ..Default::default() };
        let b = body(&[5, 6], &s, None);
        assert_eq!((b["prompt"].clone(), b["max_tokens"].as_u64()), (json!([5, 6]), Some(4)));
        assert_eq!(
            (b["return_token_ids"].as_bool(), b["stream_options"]["include_usage"].as_bool()),
            (Some(true), Some(true))
        );
        assert_eq!((b["top_k"].as_u64(), b["seed"].as_u64(), b.get("model")), (Some(0), Some(1), None));
        // A client's seed of -1 is the sampler's u64::MAX; vLLM takes seeds in i64's range only.
        assert_eq!(body(&[5], &pb::Sampling { seed: Some(u64::MAX), ..s.clone() }, None)["seed"].as_i64(), Some(-1));
        assert_eq!(body(&[5], &pb::Sampling { min_p: 0.5, ..s.clone() }, None)["min_p"].as_f64(), Some(0.5));
        assert_eq!(body(&[5], &s, None).get("structured_outputs"), None);
        assert_eq!(body(&[5], &s, None).get("allowed_token_ids"), None);
        let allowed = body(&[5], &pb::Sampling { allowed_token_ids: vec![7, 9], ..s.clone() }, None);
        assert_eq!(allowed["allowed_token_ids"], json!([7, 9]));
        // A request's cache namespace is vLLM's cache salt (its KV events carry it back on the chain's first block).
        assert_eq!(body(&[5], &s, None).get("cache_salt"), None);
        assert_eq!(body(&[5], &s, Some("tenant\0salt"))["cache_salt"], json!("tenant\0salt"));
    }

    #[test]
    fn structured_outputs_go_as_vllms_own() {
        let with = |kind: &str, data: &str| pb::Sampling {
            grammar: Some(pb::Grammar { kind: kind.into(), data: data.into(), ..Default::default() }),
            ..Default::default()
        };
        let b = body(&[1], &with("json_schema", r#"{"type": "integer"}"#), None);
        assert_eq!(b["structured_outputs"], json!({"json": {"type": "integer"}, "disable_any_whitespace": true}));
        let b = body(&[1], &with("json_object", ""), None);
        assert_eq!(b["structured_outputs"], json!({"json": {"type": "object"}, "disable_any_whitespace": true}));
        assert_eq!(body(&[1], &with("regex", "[0-9]+"), None)["structured_outputs"], json!({"regex": "[0-9]+"}));
        let gbnf = r#"root ::= "a" | "b""#;
        assert_eq!(body(&[1], &with("gbnf", gbnf), None)["structured_outputs"], json!({"grammar": gbnf}));
    }

    #[test]
    fn chunks_as_the_server_streams_them() {
        // Shapes of vLLM 0.33's `CompletionStreamResponse` (`exclude_unset`), then its usage chunk and `[DONE]`.
        let mut p = Parser::default();
        let first = r#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" Hi","logprobs":null,"finish_reason":null,"prompt_token_ids":[5,6],"token_ids":[3874]}]}"#;
        assert_eq!(p.push(first), Ok(Some(Chunk::Tokens(vec![3874]))));
        let last = r#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"!","finish_reason":"length","stop_reason":null,"token_ids":[17]}]}"#;
        assert_eq!(p.push(last), Ok(Some(Chunk::Tokens(vec![17]))));
        let usage = r#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":2,"completion_tokens":2,"total_tokens":4,"prompt_tokens_details":{"cached_tokens":16}}}"#;
        assert_eq!(
            p.push(usage),
            Ok(Some(Chunk::Finished {
                tokens: vec![],
                logprobs: vec![],
                reason: pb::FinishReason::Length,
                cached_tokens: 16
            }))
        );
        assert_eq!(p.push("[DONE]"), Ok(None));
        // Without a usage chunk, `[DONE]` ends it.
        let mut q = Parser::default();
        let eos = r#"{"choices":[{"index":0,"text":"","finish_reason":"stop","token_ids":[2]}]}"#;
        assert_eq!(q.push(eos), Ok(Some(Chunk::Tokens(vec![2]))));
        assert_eq!(
            q.push("[DONE]"),
            Ok(Some(Chunk::Finished {
                tokens: vec![],
                logprobs: vec![],
                reason: pb::FinishReason::Stop,
                cached_tokens: 0
            }))
        );
    }

    #[test]
    fn log_probabilities_are_asked_by_token_id_and_read_ranked() {
        let s = pb::Sampling { logprobs: Some(2), ..Default::default() };
        let b = body(&[5], &s, None);
        assert_eq!((b["logprobs"].as_u64(), b["return_tokens_as_token_ids"].as_bool()), (Some(2), Some(true)));
        assert!(body(&[5], &pb::Sampling::default(), None).get("logprobs").is_none());

        // As vLLM streams them (`CompletionLogProbs` with `return_tokens_as_token_ids`): the sampled token first in
        // `top_logprobs`, then the most likely ones; here the second token was not among the two most likely.
        let chunk = r#"{"choices":[{"index":0,"text":"ab","logprobs":{"text_offset":[0,1],
            "token_logprobs":[-0.25,-3.5],"tokens":["token_id:64","token_id:65"],
            "top_logprobs":[{"token_id:64":-0.25,"token_id:12":-1.75},
                            {"token_id:65":-3.5,"token_id:7":-0.5,"token_id:9":-1.0}]},
            "finish_reason":null,"token_ids":[64,65]}]}"#;
        let Ok(Some(Chunk::Scored(tokens, lps))) = Parser::new(Some(2)).push(chunk) else { panic!("scored") };
        assert_eq!(tokens, [64, 65]);
        assert_eq!(
            (lps[0].logprob, &lps[0].top_ids[..], &lps[0].top_logprobs[..]),
            (-0.25, &[64, 12][..], &[-0.25, -1.75][..])
        );
        assert_eq!(
            (lps[1].logprob, &lps[1].top_ids[..], &lps[1].top_logprobs[..]),
            (-3.5, &[7, 9][..], &[-0.5, -1.0][..])
        );
        // `top_logprobs: 0`: the token's own only.
        let Ok(Some(Chunk::Scored(_, lps))) = Parser::new(Some(0)).push(chunk) else { panic!("scored") };
        assert!(lps.iter().all(|l| l.top_ids.is_empty()) && lps[1].logprob == -3.5);
        // Not asked: the ids alone.
        assert_eq!(Parser::default().push(chunk), Ok(Some(Chunk::Tokens(vec![64, 65]))));
        // The last chunk's token is scored too, and the end comes after it.
        let mut p = Parser::new(Some(1));
        let last = r#"{"choices":[{"index":0,"text":"","logprobs":{"text_offset":[0],"token_logprobs":[-0.5],
            "tokens":["token_id:2"],"top_logprobs":[{"token_id:2":-0.5}]},"finish_reason":"stop","token_ids":[2]}]}"#;
        assert!(matches!(p.push(last), Ok(Some(Chunk::Scored(t, _))) if t == [2]));
        assert_eq!(
            p.push("[DONE]"),
            Ok(Some(Chunk::Finished {
                tokens: vec![],
                logprobs: vec![],
                reason: pb::FinishReason::Stop,
                cached_tokens: 0
            }))
        );
        for bad in [
            r#"{"choices":[{"token_ids":[64],"logprobs":null}]}"#,
            r#"{"choices":[{"token_ids":[64],"logprobs":{"tokens":[],"token_logprobs":[],"top_logprobs":[]}}]}"#,
            r#"{"choices":[{"token_ids":[64],"logprobs":{"tokens":["a"],"token_logprobs":[-1.0],"top_logprobs":[{}]}}]}"#,
            r#"{"choices":[{"token_ids":[64],"logprobs":{"tokens":["token_id:63"],"token_logprobs":[-1.0],"top_logprobs":[{}]}}]}"#,
            r#"{"choices":[{"token_ids":[64],"logprobs":{"tokens":["token_id:64"],"token_logprobs":[null],"top_logprobs":[{}]}}]}"#,
            r#"{"choices":[{"token_ids":[64],"logprobs":{"tokens":["token_id:64"],"token_logprobs":[-1.0],"top_logprobs":[{"x":-1.0}]}}]}"#,
        ] {
            assert!(Parser::new(Some(1)).push(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bad_chunks_are_errors() {
        let mut p = Parser::default();
        assert!(p.push("{").is_err());
        assert!(p.push(r#"{"error":{"message":"too long","code":400}}"#).expect_err("error").contains("too long"));
        assert!(p.push(r#"{"choices":[{"token_ids":["x"]}]}"#).is_err());
        assert!(p.push(r#"{"choices":[{"token_ids":[1],"finish_reason":"abort"}]}"#).is_err());
        assert!(p.push(r#"{"choices":[],"usage":{"prompt_tokens":1}}"#).is_err(), "usage before the end");
        assert!(p.push(r#"{"choices":[{},{}]}"#).is_err());
    }

    #[test]
    fn capacity_from_the_cache_config_metric() {
        let m = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
                 vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",engine=\"0\",num_gpu_blocks=\"2048\"} 1.0\n";
        assert_eq!(capacity_tokens(m, None), Some(32768));
        assert_eq!(capacity_tokens("vllm:num_requests_running 0\n", None), None);
        // A server of two data-parallel engines: the whole server holds both, each rank its own.
        let two = "vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"2048\"} 1.0\n\
                   vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"1024\"} 1.0\n";
        assert_eq!(capacity_tokens(two, None), Some(49152));
        assert_eq!((capacity_tokens(two, Some(0)), capacity_tokens(two, Some(1))), (Some(32768), Some(16384)));
        assert_eq!(capacity_tokens(two, Some(2)), None);
        // No engine label: the one engine's, whatever the rank.
        let bare = "vllm:cache_config_info{block_size=\"32\",num_gpu_blocks=\"10\"} 1.0\n";
        assert_eq!((capacity_tokens(bare, None), capacity_tokens(bare, Some(1))), (Some(320), Some(320)));
    }
}
