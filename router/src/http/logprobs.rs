//! Log-probabilities in OpenAI's two response shapes: chat's `logprobs.content` (one entry per token, with its
//! bytes and alternatives) and text completions' four parallel lists. Workers send each token's log-probability
//! and its most likely alternatives by id; the router names them with the tokenizer it already holds.

use engine::tokenizer::Tokenizer;
use proto::worker as pb;
use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::openai::Endpoint;

/// The log-probabilities of a response's tokens, gathered as they arrive.
#[derive(Debug)]
pub struct Logprobs {
    endpoint: Endpoint,
    /// Chat: one entry per token not yet taken.
    content: Vec<Value>,
    /// Completions: the parallel lists of the tokens not yet taken.
    tokens: Vec<Value>,
    token_logprobs: Vec<Value>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<Value>,
    /// Characters of output before the next token (completions' `text_offset`).
    offset: usize,
    /// Tokens are named `token_id:ID` (vLLM's `return_tokens_as_token_ids`), not by their text.
    as_ids: bool,
}

/// A token as OpenAI names it: its text (invalid UTF-8 of a partial character replaced) and its bytes.
fn token(tokenizer: &Tokenizer, id: u32) -> (String, &[u8]) {
    let bytes = tokenizer.token_bytes(id);
    (String::from_utf8_lossy(bytes).into_owned(), bytes)
}

impl Logprobs {
    /// `as_ids`: name tokens `token_id:ID`, as vLLM's `return_tokens_as_token_ids` asks, so that a token whose
    /// bytes are part of a character is told apart from the others that show as `�`; its `bytes` stay its own.
    pub fn new(endpoint: Endpoint, as_ids: bool) -> Logprobs {
        Logprobs {
            as_ids,
            endpoint,
            content: Vec::new(),
            tokens: Vec::new(),
            token_logprobs: Vec::new(),
            top_logprobs: Vec::new(),
            text_offset: Vec::new(),
            offset: 0,
        }
    }

    /// Adds token `id`'s log-probabilities; a worker that sent none when they were asked for is an upstream
    /// error (never an answer silently without them).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32, lp: Option<&pb::TokenLogprobs>) -> Result<(), ApiError> {
        let lp = lp.ok_or_else(|| ApiError::Upstream("a worker sent a token without its log-probabilities".into()))?;
        let (text, bytes) = token(tokenizer, id);
        let top = lp.top_ids.iter().zip(&lp.top_logprobs);
        match self.endpoint {
            Endpoint::Chat => {
                let alternatives: Vec<Value> = top
                    .map(|(&alt, &l)| {
                        let (t, b) = token(tokenizer, alt);
                        json!({"token": self.name(alt, t), "logprob": l, "bytes": b})
                    })
                    .collect();
                self.content.push(json!({"token": self.name(id, text), "logprob": lp.logprob, "bytes": bytes,
                                         "top_logprobs": alternatives}));
            }
            Endpoint::Completion => {
                // A map from token text to log-probability, as OpenAI's legacy shape has it (equal texts merge).
                let alternatives: Map<String, Value> =
                    top.map(|(&alt, &l)| (self.name(alt, token(tokenizer, alt).0), json!(l))).collect();
                self.text_offset.push(json!(self.offset));
                // The offset counts the text's characters, however the token is named.
                self.offset += text.chars().count();
                self.tokens.push(json!(self.name(id, text)));
                self.token_logprobs.push(json!(lp.logprob));
                self.top_logprobs.push(Value::Object(alternatives));
            }
        }
        Ok(())
    }

    /// Adds an echoed prompt's tokens (completions): the first with no log-probability (nothing comes before it),
    /// the others with theirs, `scores` (one per token from the second on, as the workers send them) with at most
    /// `top` alternatives each.
    pub fn push_prompt(
        &mut self,
        tokenizer: &Tokenizer,
        prompt: &[u32],
        scores: &[pb::TokenLogprobs],
        top: usize,
    ) -> Result<(), ApiError> {
        check_scores(prompt, scores)?;
        let Some((&first, rest)) = prompt.split_first() else { return Ok(()) };
        let text = token(tokenizer, first).0;
        self.text_offset.push(json!(self.offset));
        self.offset += text.chars().count();
        self.tokens.push(json!(self.name(first, text)));
        self.token_logprobs.push(Value::Null);
        self.top_logprobs.push(Value::Null);
        for (&id, lp) in rest.iter().zip(scores) {
            let cut = pb::TokenLogprobs {
                top_ids: lp.top_ids.iter().copied().take(top).collect(),
                top_logprobs: lp.top_logprobs.iter().copied().take(top).collect(),
                ..lp.clone()
            };
            self.push(tokenizer, id, Some(&cut))?;
        }
        Ok(())
    }

    /// How token `id`, whose text is `text`, is named.
    fn name(&self, id: u32, text: String) -> String {
        if self.as_ids { format!("token_id:{id}") } else { text }
    }

    /// The `logprobs` object of the tokens pushed since the last call, in the endpoint's shape.
    pub fn take(&mut self) -> Value {
        match self.endpoint {
            Endpoint::Chat => json!({"content": std::mem::take(&mut self.content), "refusal": null}),
            Endpoint::Completion => json!({
                "tokens": std::mem::take(&mut self.tokens),
                "token_logprobs": std::mem::take(&mut self.token_logprobs),
                "top_logprobs": std::mem::take(&mut self.top_logprobs),
                "text_offset": std::mem::take(&mut self.text_offset),
            }),
        }
    }
}

/// The workers send one entry per prompt token from the second on; anything else is an upstream error.
fn check_scores(prompt: &[u32], scores: &[pb::TokenLogprobs]) -> Result<(), ApiError> {
    if scores.len() + 1 == prompt.len().max(1) {
        return Ok(());
    }
    let why =
        format!("a worker sent {} prompt log-probabilities for a prompt of {} tokens", scores.len(), prompt.len());
    Err(ApiError::Upstream(why))
}

/// vLLM's `prompt_logprobs`: `null` for the first token, then for each token a map from token id to its
/// `logprob`, `rank` and `decoded_token`, holding the prompt's own token and its `top` most likely alternatives.
pub fn vllm_prompt_logprobs(
    tokenizer: &Tokenizer,
    prompt: &[u32],
    scores: &[pb::TokenLogprobs],
    top: usize,
) -> Result<Value, ApiError> {
    check_scores(prompt, scores)?;
    let entry = |id: u32, logprob: f32, rank: Option<u32>| json!({"logprob": logprob, "rank": rank, "decoded_token": token(tokenizer, id).0});
    let mut out = Vec::with_capacity(prompt.len());
    if !prompt.is_empty() {
        out.push(Value::Null);
    }
    for (&id, lp) in prompt.iter().skip(1).zip(scores) {
        let mut position = Map::new();
        for (i, (&alt, &l)) in lp.top_ids.iter().zip(&lp.top_logprobs).take(top).enumerate() {
            position.insert(alt.to_string(), entry(alt, l, Some(i as u32 + 1)));
        }
        // The prompt's own token, whatever its rank (0: the worker did not say).
        position.insert(id.to_string(), entry(id, lp.logprob, (lp.rank > 0).then_some(lp.rank)));
        out.push(Value::Object(position));
    }
    Ok(Value::Array(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> std::sync::Arc<engine::text::TextModel> {
        let path = engine::fetch::ensure_default_model(&engine::fetch::Quiet).expect("the embedded model");
        std::sync::Arc::new(engine::text::TextModel::open(&path).expect("opens"))
    }

    fn scored(logprob: f32, rank: u32, top: &[(u32, f32)]) -> pb::TokenLogprobs {
        pb::TokenLogprobs {
            logprob,
            rank,
            top_ids: top.iter().map(|t| t.0).collect(),
            top_logprobs: top.iter().map(|t| t.1).collect(),
        }
    }

    #[test]
    fn prompt_log_probabilities_in_vllms_and_echos_shapes_and_a_wrong_count_is_an_upstream_error() {
        let text = tokenizer();
        let tok = text.tokenizer();
        let prompt = tok.encode("Hello world again");
        assert_eq!(prompt.len(), 3);
        let scores =
            [scored(-1.5, 4, &[(9, -0.5), (prompt[1], -1.5)]), scored(-0.25, 1, &[(prompt[2], -0.25), (7, -2.0)])];
        let v = vllm_prompt_logprobs(tok, &prompt, &scores, 1).expect("shaped");
        let name = |id: u32| String::from_utf8_lossy(tok.token_bytes(id)).into_owned();
        assert_eq!(v[0], Value::Null);
        // The prompt's own token with its rank, and the one alternative asked for with rank 1.
        assert_eq!(v[1].as_object().map(Map::len), Some(2), "{v}");
        assert_eq!(v[1][prompt[1].to_string()], json!({"logprob": -1.5, "rank": 4, "decoded_token": name(prompt[1])}));
        assert_eq!(v[1]["9"]["rank"], 1);
        // The most likely token is the prompt's own: one entry.
        assert_eq!(v[2].as_object().map(Map::len), Some(1), "{v}");
        assert_eq!(v[2][prompt[2].to_string()]["rank"], 1);
        // A rank the worker did not say (0) is null.
        let unranked = vllm_prompt_logprobs(tok, &prompt[..2], &[scored(-1.0, 0, &[])], 0).expect("shaped");
        assert_eq!(unranked[1][prompt[1].to_string()]["rank"], Value::Null);

        let mut echoed = Logprobs::new(Endpoint::Completion, false);
        echoed.push_prompt(tok, &prompt, &scores, 1).expect("pushed");
        let lp = echoed.take();
        assert_eq!(lp["token_logprobs"], json!([null, -1.5, -0.25]));
        assert_eq!(lp["top_logprobs"][0], Value::Null);
        assert_eq!(lp["top_logprobs"][1], json!({name(9): -0.5}), "cut to the one alternative asked for");
        let offsets: Vec<u64> =
            lp["text_offset"].as_array().expect("offsets").iter().filter_map(Value::as_u64).collect();
        assert_eq!(offsets[0], 0);
        assert_eq!(offsets[2] as usize, name(prompt[0]).chars().count() + name(prompt[1]).chars().count());

        for wrong in [&scores[..1], &[scores[0].clone(), scores[1].clone(), scores[1].clone()][..]] {
            let e = vllm_prompt_logprobs(tok, &prompt, wrong, 1).expect_err("a count that does not fit");
            assert!(matches!(e, ApiError::Upstream(_)), "{e}");
            assert!(Logprobs::new(Endpoint::Completion, false).push_prompt(tok, &prompt, wrong, 1).is_err());
        }
    }

    #[test]
    fn tokens_are_named_by_id_when_asked() {
        let text = tokenizer();
        let tok = text.tokenizer();
        let id = tok.encode(" sea")[0];
        let lp = scored(-0.5, 1, &[(id, -0.5), (9, -2.0)]);
        let mut chat = Logprobs::new(Endpoint::Chat, true);
        chat.push(tok, id, Some(&lp)).expect("pushed");
        let v = chat.take();
        let entry = &v["content"][0];
        assert_eq!(entry["token"], format!("token_id:{id}"));
        assert_eq!(entry["bytes"], json!(b" sea"), "the bytes stay the token's own");
        assert_eq!(entry["top_logprobs"][1]["token"], "token_id:9");
        let mut completion = Logprobs::new(Endpoint::Completion, true);
        completion.push(tok, id, Some(&lp)).expect("pushed");
        completion.push(tok, id, Some(&lp)).expect("pushed");
        let v = completion.take();
        assert_eq!(v["tokens"], json!([format!("token_id:{id}"), format!("token_id:{id}")]));
        assert_eq!(v["top_logprobs"][0], json!({format!("token_id:{id}"): -0.5, "token_id:9": -2.0}));
        assert_eq!(v["text_offset"], json!([0, 4]), "offsets count the text");
    }
}
