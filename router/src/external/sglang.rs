//! SGLang's server, through its native `/generate` endpoint: the prompt goes as `input_ids` and the stream carries
//! `output_ids` (all generated so far by default; only the new ones with `--incremental-streaming-output`, told
//! apart by `meta_info.completion_tokens`), with `meta_info.finish_reason` and `cached_tokens` on the last chunk.
//! Log-probabilities are asked with `return_logprob` and `top_logprobs_num` and come in `meta_info` beside the ids,
//! one `[logprob, id, text]` entry per token in `output_token_logprobs` and a list of such per token in
//! `output_top_logprobs`, all so far or only the new ones as the ids are.

use engine::grammar::Grammar;
use proto::worker as pb;
use serde_json::{Value, json};

use super::Chunk;

pub const GENERATE_PATH: &str = "/generate";
/// 200 once the server is up.
pub const HEALTH_PATH: &str = "/health";
/// The resolved server settings, with the KV pool's size (`max_total_num_tokens`).
pub const INFO_PATH: &str = "/server_info";

/// The request body for `tokens` sampled as `sampling` says, in the cache namespace `namespace` (SGLang's
/// `cache_salt`).
pub fn body(tokens: &[u32], sampling: &pb::Sampling, namespace: Option<&str>) -> Value {
    let mut params = json!({
        "max_new_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        // -1: the whole vocabulary.
        "top_k": sampling.top_k.map_or(-1, i64::from),
        "min_p": sampling.min_p,
        "ignore_eos": sampling.ignore_eos,
    });
    if let Some(seed) = sampling.seed {
        // The client's signed seed, back from the sampler's 64 bits (a seed past i64 would be refused).
        params["sampling_seed"] = (seed as i64).into();
    }
    super::put_logits_rules(&mut params, sampling, "min_new_tokens");
    match super::grammar(sampling) {
        Some(Grammar::JsonSchema(schema)) => params["json_schema"] = schema.into(),
        Some(Grammar::JsonObject) => params["json_schema"] = super::ANY_OBJECT.into(),
        Some(Grammar::Regex(regex)) => params["regex"] = regex.into(),
        // Not relayed (`serve::needs`).
        // SGLang's grammar backend (xgrammar) reads GBNF as its own EBNF.
        Some(Grammar::Gbnf(gbnf)) => params["ebnf"] = gbnf.into(),
        Some(Grammar::Lark(_)) | None => {}
    }
    let mut b = json!({"input_ids": tokens, "sampling_params": params, "stream": true});
    if let Some(n) = sampling.logprobs {
        b["return_logprob"] = true.into();
        b["top_logprobs_num"] = n.into();
    }
    if let Some(salt) = namespace {
        b["cache_salt"] = salt.into();
    }
    b
}

#[derive(Debug, Default)]
pub struct Parser {
    /// Tokens passed on so far.
    sent: usize,
    /// Whether log-probabilities were asked for.
    scored: bool,
}

impl Parser {
    /// A parser for a request that asked for `alternatives` per token's log-probabilities (`None`: none asked).
    pub fn new(alternatives: Option<u32>) -> Parser {
        Parser { sent: 0, scored: alternatives.is_some() }
    }

    pub fn push(&mut self, data: &str) -> Result<Option<Chunk>, String> {
        if data.trim() == "[DONE]" {
            return Ok(None);
        }
        let v = super::chunk_json(data)?;
        let ids = super::token_ids(v.get("output_ids"))?;
        let meta = v.get("meta_info").unwrap_or(&Value::Null);
        let total = meta.get("completion_tokens").and_then(Value::as_u64).map(|t| t as usize);
        // All generated so far when the count says so, else only the new ones; the log-probabilities alike.
        let from = if total == Some(ids.len()) { self.sent } else { 0 };
        let new = ids.get(from..).map(<[u32]>::to_vec).ok_or("the stream went back")?;
        let logprobs = if self.scored { token_logprobs(meta, from, &new)? } else { Vec::new() };
        self.sent += new.len();
        let reason = match meta.get("finish_reason") {
            None | Some(Value::Null) if self.scored => return Ok(Some(Chunk::Scored(new, logprobs))),
            None | Some(Value::Null) => return Ok(Some(Chunk::Tokens(new))),
            Some(r) => match r.get("type").and_then(Value::as_str) {
                Some("length") => pb::FinishReason::Length,
                Some("stop") => pb::FinishReason::Stop,
                _ => return Err(format!("the server ended generation with {r}")),
            },
        };
        let cached = u32::try_from(meta.get("cached_tokens").and_then(Value::as_u64).unwrap_or(0)).unwrap_or(u32::MAX);
        Ok(Some(Chunk::Finished { tokens: new, logprobs, reason, cached_tokens: cached }))
    }
}

/// The log-probabilities of `tokens`, the entries from `from` on of `meta`'s lists: each token's own
/// (`[logprob, id, text]`) and its alternatives, most likely first. Anything missing, or naming another token, is
/// an error: the client asked for them.
fn token_logprobs(meta: &Value, from: usize, tokens: &[u32]) -> Result<Vec<pb::TokenLogprobs>, String> {
    let entries = |key: &str| -> Result<&[Value], String> {
        let list = meta.get(key).and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
        list.get(from..from + tokens.len())
            .ok_or_else(|| format!("meta_info.{key} has no entries for tokens {from} to {}", from + tokens.len()))
    };
    // `[logprob, id, text]`.
    let entry = |e: &Value| -> Result<(u32, f32), String> {
        let id = e.get(1).and_then(Value::as_u64).and_then(|i| u32::try_from(i).ok());
        let logprob = e.get(0).and_then(Value::as_f64);
        match (id, logprob) {
            (Some(id), Some(lp)) => Ok((id, lp as f32)),
            _ => Err(format!("a log-probability entry is {e}, not [logprob, id, text]")),
        }
    };
    let own = entries("output_token_logprobs")?;
    // Present only when alternatives were asked for (top_logprobs_num above 0).
    let tops = match meta.get("output_top_logprobs") {
        None | Some(Value::Null) => None,
        Some(_) => Some(entries("output_top_logprobs")?),
    };
    tokens
        .iter()
        .enumerate()
        .map(|(i, &token)| {
            let (id, logprob) = entry(&own[i])?;
            let top = match tops {
                None => Vec::new(),
                Some(tops) => {
                    let list = tops[i].as_array().ok_or_else(|| format!("an alternatives entry is {}", tops[i]))?;
                    list.iter().map(entry).collect::<Result<Vec<_>, _>>()?
                }
            };
            super::scored(token, id, logprob, &top)
        })
        .collect()
}

/// Tokens of KV the server holds, from its settings: one scheduler's pool (`max_total_num_tokens`), which is one
/// data-parallel rank's (`a_rank`), and for the whole server every rank's (`dp_size` of them, each with a pool of
/// its own the same size).
pub fn capacity_tokens(info: &Value, a_rank: bool) -> Option<u64> {
    let one = info
        .get("max_total_num_tokens")
        .or_else(|| info.pointer("/internal_states/0/max_total_num_tokens"))
        .and_then(Value::as_u64)?;
    let ranks = if a_rank { 1 } else { info.get("dp_size").and_then(Value::as_u64).unwrap_or(1).max(1) };
    one.checked_mul(ranks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_sends_input_ids() {
        let s = pb::Sampling { temperature: 0.0, top_p: 1.0, max_tokens: 3, seed: Some(9), ..Default::default() };
        let b = body(&[1, 2], &s, None);
        assert_eq!(b["input_ids"], json!([1, 2]));
        let p = &b["sampling_params"];
        assert_eq!(
            (p["max_new_tokens"].as_u64(), p["top_k"].as_i64(), p["sampling_seed"].as_u64()),
            (Some(3), Some(-1), Some(9))
        );
        let signed = body(&[1], &pb::Sampling { seed: Some(u64::MAX - 1), ..s.clone() }, None);
        assert_eq!(signed["sampling_params"]["sampling_seed"].as_i64(), Some(-2));
        assert_eq!(
            body(&[1], &pb::Sampling { min_p: 0.5, ..s.clone() }, None)["sampling_params"]["min_p"].as_f64(),
            Some(0.5)
        );
        // A request's cache namespace is SGLang's cache salt, beside the sampling parameters.
        assert_eq!(body(&[1], &s, None).get("cache_salt"), None);
        assert_eq!(body(&[1], &s, Some("t\0s"))["cache_salt"], json!("t\0s"));
    }

    #[test]
    fn structured_outputs_go_as_sglangs_own() {
        let with = |kind: &str, data: &str| pb::Sampling {
            grammar: Some(pb::Grammar { kind: kind.into(), data: data.into(), ..Default::default() }),
            ..Default::default()
        };
        let params = |s| body(&[1], &s, None)["sampling_params"].clone();
        let schema = r#"{"type": "integer"}"#;
        assert_eq!(
            (
                params(with("json_schema", schema))["json_schema"].as_str(),
                params(with("json_schema", schema)).get("regex")
            ),
            (Some(schema), None)
        );
        assert_eq!(params(with("json_object", ""))["json_schema"], json!(r#"{"type": "object"}"#));
        assert_eq!(params(with("gbnf", "root ::= \"a\""))["ebnf"], json!("root ::= \"a\""));
        assert_eq!(params(with("regex", "a|b"))["regex"], json!("a|b"));
    }

    #[test]
    fn cumulative_and_incremental_streams_give_the_same_tokens() {
        // SGLang 0.5's stream: `output_ids` so far and `meta_info` (by default), or only the new ids.
        let chunks = |ids: [&str; 3]| {
            [
                format!(
                    r#"{{"output_ids":{},"meta_info":{{"id":"a","finish_reason":null,"prompt_tokens":9,"completion_tokens":1,"cached_tokens":0}}}}"#,
                    ids[0]
                ),
                format!(
                    r#"{{"output_ids":{},"meta_info":{{"id":"a","finish_reason":null,"completion_tokens":2}}}}"#,
                    ids[1]
                ),
                format!(
                    r#"{{"output_ids":{},"meta_info":{{"id":"a","finish_reason":{{"type":"length","length":3}},"completion_tokens":3,"cached_tokens":8}}}}"#,
                    ids[2]
                ),
            ]
        };
        for ids in [["[7]", "[7,8]", "[7,8,9]"], ["[7]", "[8]", "[9]"]] {
            let mut p = Parser::default();
            let [a, b, c] = chunks(ids);
            assert_eq!(p.push(&a), Ok(Some(Chunk::Tokens(vec![7]))));
            assert_eq!(p.push(&b), Ok(Some(Chunk::Tokens(vec![8]))));
            assert_eq!(
                p.push(&c),
                Ok(Some(Chunk::Finished {
                    tokens: vec![9],
                    logprobs: vec![],
                    reason: pb::FinishReason::Length,
                    cached_tokens: 8
                }))
            );
            assert_eq!(p.push("[DONE]"), Ok(None));
        }
    }

    #[test]
    fn log_probabilities_are_asked_and_read_beside_the_ids() {
        let s = pb::Sampling { logprobs: Some(2), ..Default::default() };
        let b = body(&[5], &s, None);
        assert_eq!((b["return_logprob"].as_bool(), b["top_logprobs_num"].as_u64()), (Some(true), Some(2)));
        assert!(body(&[5], &pb::Sampling::default(), None).get("return_logprob").is_none());
        // As the server streams them, all so far (its default) or only the new ones; the alternatives most likely
        // first, the sampled token among them or not.
        let chunks = |cumulative: bool| {
            let (own, top) = (
                [r#"[-0.25, 7, null]"#, r#"[-1.5, 8, null]"#],
                [r#"[[-0.25, 7, null], [-2.0, 3, null]]"#, r#"[[-0.75, 4, null], [-1.5, 8, null]]"#],
            );
            let upto = |k: usize, list: &[&str; 2]| {
                let from = if cumulative { 0 } else { k };
                format!("[{}]", list[from..=k].join(","))
            };
            let ids = |k: usize| if cumulative { format!("{:?}", &[7, 8][..=k]) } else { format!("[{}]", [7, 8][k]) };
            [
                format!(
                    r#"{{"output_ids":{},"meta_info":{{"finish_reason":null,"completion_tokens":1,"output_token_logprobs":{},"output_top_logprobs":{}}}}}"#,
                    ids(0),
                    upto(0, &own),
                    upto(0, &top)
                ),
                format!(
                    r#"{{"output_ids":{},"meta_info":{{"finish_reason":{{"type":"stop"}},"completion_tokens":2,"cached_tokens":0,"output_token_logprobs":{},"output_top_logprobs":{}}}}}"#,
                    ids(1),
                    upto(1, &own),
                    upto(1, &top)
                ),
            ]
        };
        let first = pb::TokenLogprobs { logprob: -0.25, rank: 0, top_ids: vec![7, 3], top_logprobs: vec![-0.25, -2.0] };
        let second = pb::TokenLogprobs { logprob: -1.5, rank: 0, top_ids: vec![4, 8], top_logprobs: vec![-0.75, -1.5] };
        for cumulative in [true, false] {
            let mut p = Parser::new(Some(2));
            let [a, b] = chunks(cumulative);
            assert_eq!(p.push(&a), Ok(Some(Chunk::Scored(vec![7], vec![first.clone()]))), "cumulative {cumulative}");
            assert_eq!(
                p.push(&b),
                Ok(Some(Chunk::Finished {
                    tokens: vec![8],
                    logprobs: vec![second.clone()],
                    reason: pb::FinishReason::Stop,
                    cached_tokens: 0
                })),
                "cumulative {cumulative}"
            );
        }
        // No alternatives asked: no list of them.
        let own_only =
            r#"{"output_ids":[7],"meta_info":{"completion_tokens":1,"output_token_logprobs":[[-0.25,7,null]]}}"#;
        let lps = Parser::new(Some(0)).push(own_only);
        assert_eq!(
            lps,
            Ok(Some(Chunk::Scored(vec![7], vec![pb::TokenLogprobs { logprob: -0.25, ..Default::default() }])))
        );
        for bad in [
            r#"{"output_ids":[7],"meta_info":{"completion_tokens":1}}"#,
            r#"{"output_ids":[7],"meta_info":{"completion_tokens":1,"output_token_logprobs":[[-0.25,9,null]]}}"#,
            r#"{"output_ids":[7],"meta_info":{"completion_tokens":1,"output_token_logprobs":[[null,7,null]]}}"#,
            r#"{"output_ids":[7],"meta_info":{"completion_tokens":1,"output_token_logprobs":[[-0.2,7,null]],"output_top_logprobs":[]}}"#,
        ] {
            assert!(Parser::new(Some(1)).push(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn aborts_and_garbage_are_errors() {
        let mut p = Parser::default();
        let abort = r#"{"output_ids":[],"meta_info":{"finish_reason":{"type":"abort","message":"too long"},"completion_tokens":0}}"#;
        assert!(p.push(abort).expect_err("an abort").contains("too long"));
        assert!(p.push("[1,2").is_err());
        assert!(p.push(r#"{"output_ids":[-3]}"#).is_err());
        assert_eq!(capacity_tokens(&json!({"max_total_num_tokens": 500}), false), Some(500));
        assert_eq!(capacity_tokens(&json!({"internal_states": [{"max_total_num_tokens": 7}]}), false), Some(7));
        // A data-parallel server: a pool per rank.
        let dp = json!({"max_total_num_tokens": 500, "dp_size": 4});
        assert_eq!((capacity_tokens(&dp, false), capacity_tokens(&dp, true)), (Some(2000), Some(500)));
    }
}
