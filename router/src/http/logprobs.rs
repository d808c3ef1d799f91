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
}

/// A token as OpenAI names it: its text (invalid UTF-8 of a partial character replaced) and its bytes.
fn token(tokenizer: &Tokenizer, id: u32) -> (String, &[u8]) {
    let bytes = tokenizer.token_bytes(id);
    (String::from_utf8_lossy(bytes).into_owned(), bytes)
}

impl Logprobs {
    pub fn new(endpoint: Endpoint) -> Logprobs {
        Logprobs {
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
                        json!({"token": t, "logprob": l, "bytes": b})
                    })
                    .collect();
                self.content.push(json!({"token": text, "logprob": lp.logprob, "bytes": bytes,
                                         "top_logprobs": alternatives}));
            }
            Endpoint::Completion => {
                // A map from token text to log-probability, as OpenAI's legacy shape has it (equal texts merge).
                let alternatives: Map<String, Value> =
                    top.map(|(&alt, &l)| (token(tokenizer, alt).0, json!(l))).collect();
                self.text_offset.push(json!(self.offset));
                self.offset += text.chars().count();
                self.tokens.push(json!(text));
                self.token_logprobs.push(json!(lp.logprob));
                self.top_logprobs.push(Value::Object(alternatives));
            }
        }
        Ok(())
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
