//! OpenAI request bodies for chat and text completions, checked into one validated form.

use engine::chat::{ChatMessage, Ending};
use engine::grammar::Grammar;
use serde::Deserialize;

use super::error::ApiError;

/// Most stop sequences OpenAI accepts.
const MAX_STOPS: usize = 4;
/// OpenAI's temperature range.
const MAX_TEMPERATURE: f32 = 2.0;
/// Most samples per prompt (`n`).
pub const MAX_N: u32 = 8;
/// Most prompts in one text completion request.
pub const MAX_BATCH: usize = 32;
/// Most alternatives per token (OpenAI's `top_logprobs` limit; vLLM's default `max_logprobs` for completions).
const MAX_LOGPROBS: u32 = engine::sampling::MAX_TOP_LOGPROBS;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// A boolean field that may be `null`, which OpenAI's schema allows for its optional fields: absent, `null` and
/// `false` are the same.
fn null_is_false<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or(false))
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default, deserialize_with = "null_is_false")]
    pub include_usage: bool,
    /// vLLM's usage so far in every chunk (with `include_usage`).
    #[serde(default, deserialize_with = "null_is_false")]
    pub continuous_usage_stats: bool,
    /// OpenAI's padding of stream events against size side channels: accepted, with no effect (docs/api.md).
    #[serde(default)]
    pub include_obfuscation: Option<bool>,
    /// Any other option, to be named in the refusal.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

/// `stream_options` asks only for what the router does: the usage after the last choice, and (vLLM's) in every
/// chunk too.
fn check_stream_options(o: &StreamOptions) -> Result<(), ApiError> {
    let refused = if let Some(name) = o.other.keys().next() {
        format!("unknown stream option `{name}`")
    } else if o.continuous_usage_stats && !o.include_usage {
        "stream_options.continuous_usage_stats adds the usage to every chunk, which needs include_usage".into()
    } else {
        return Ok(());
    };
    Err(ApiError::bad(refused, "stream_options"))
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    /// Content parts; only `text` parts are supported.
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant turn's calls of tools: they go to the template (each call's `arguments` as JSON).
    #[serde(default)]
    pub tool_calls: Option<serde_json::Value>,
    /// The deprecated single call (before `tool_calls`): refused unless null.
    #[serde(default)]
    pub function_call: Option<serde_json::Value>,
    /// A tool turn's call id: the template gets it.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// The participant's name: the template gets it, as transformers passes it.
    #[serde(default)]
    pub name: Option<String>,
    /// An assistant turn's thinking, as answers carry it (`reasoning_content`, or vLLM's newer `reasoning`): the
    /// template gets it as `reasoning_content`.
    #[serde(default)]
    pub reasoning_content: Option<String>,
    #[serde(default)]
    pub reasoning: Option<String>,
    /// Any other field: taken only where it asks for nothing (`refusal`, `audio` and `annotations` empty, as
    /// OpenAI's clients send an answer back), else refused by name.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

/// Checks a message's fields beyond those it uses.
fn check_other_fields(other: &serde_json::Map<String, serde_json::Value>) -> Result<(), ApiError> {
    for (name, value) in other {
        let empty = value.is_null() || value.as_array().is_some_and(Vec::is_empty);
        if !(empty && matches!(name.as_str(), "refusal" | "audio" | "annotations")) {
            let why =
                format!("a message's `{name}` is not supported (only empty `refusal`, `audio` and `annotations`)");
            return Err(ApiError::bad(why, "messages"));
        }
    }
    Ok(())
}

/// Fields shared by both endpoints.
#[derive(Debug, Deserialize, Default)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Not OpenAI's, but vLLM's and SGLang's: 0 and -1 mean no limit, as there (and in llama.cpp).
    pub top_k: Option<i64>,
    /// vLLM's, SGLang's and llama.cpp's: tokens under this fraction of the most likely one's probability are out.
    pub min_p: Option<f32>,
    /// OpenAI's seed is any 64-bit signed integer (so is vLLM's); the sampler takes its 64 bits.
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub n: Option<u32>,
    #[serde(default, deserialize_with = "null_is_false")]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub user: Option<String>,
    /// OpenAI's stable identifier of the end user (for abuse detection): recorded on the request's trace span.
    pub safety_identifier: Option<String>,
    /// Keep prefixes of this tenant apart from everyone else's (vLLM's `cache_salt`).
    pub cache_salt: Option<String>,
    #[serde(default, deserialize_with = "null_is_false")]
    pub ignore_eos: bool,
    /// Token id (a string, as OpenAI's JSON has it) to bias.
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    /// vLLM's.
    pub repetition_penalty: Option<f32>,
    /// vLLM's.
    pub min_tokens: Option<u32>,
    /// vLLM's.
    pub stop_token_ids: Option<Vec<u32>>,
    /// vLLM's: only these tokens can be sampled.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// vLLM's: words the output never holds (each as its tokens, with and without a leading space).
    pub bad_words: Option<Vec<String>>,
    /// Chat: `true` or `false`; completions: how many alternatives per token (OpenAI's two meanings).
    pub logprobs: Option<serde_json::Value>,
    /// Chat only: alternatives per token, with `logprobs: true`.
    pub top_logprobs: Option<u32>,
    /// vLLM's: each prompt token's log-probability with this many alternatives (-1, the whole vocabulary, is
    /// refused as over the limit).
    pub prompt_logprobs: Option<i64>,
    /// Chat only (OpenAI's): requests with the same key prefer the worker that last computed one.
    pub prompt_cache_key: Option<String>,
    /// Chat only (OpenAI's): `text`, `json_object` or `json_schema`.
    pub response_format: Option<serde_json::Value>,
    /// vLLM's structured output fields: a JSON schema (an object or its text), a regular expression, a choice.
    pub guided_json: Option<serde_json::Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    /// A context-free grammar in Lark (llguidance's dialect, as vLLM's `guidance` backend takes it).
    pub guided_grammar: Option<String>,
    /// vLLM's newer form of the same: `{"json": ..., "regex": ..., "choice": [...], "grammar": ..., "json_object": true}`.
    pub structured_outputs: Option<serde_json::Value>,
    /// vLLM's: `false` puts control tokens' text (`<|im_start|>`...) in the output; by default it is left out.
    pub skip_special_tokens: Option<bool>,
    /// vLLM's: `true` ends the text with the stop string that ended it.
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM's: whether the tokenizer adds its special tokens (the model's BOS) to the prompt text (by default a
    /// completion's prompt gets it, a conversation only where its template did not write one).
    pub add_special_tokens: Option<bool>,
    /// vLLM's: keep only the prompt's last this many tokens (-1: as many as the model's context holds).
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's: log-probabilities name tokens `token_id:ID` instead of by their text.
    #[serde(default, deserialize_with = "null_is_false")]
    pub return_tokens_as_token_ids: bool,
    /// vLLM's: lower values are served first (in the router's admission queue and in the workers' queues).
    pub priority: Option<i64>,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    /// vLLM's (default true): end the prompt with the assistant's generation prompt.
    pub add_generation_prompt: Option<bool>,
    /// vLLM's (default false): the model goes on writing the final message instead of starting a turn.
    pub continue_final_message: Option<bool>,
    /// Function tools the model may call (OpenAI's), which `tool_choice` may force.
    pub tools: Option<serde_json::Value>,
    pub tool_choice: Option<serde_json::Value>,
    /// Whether forced calls (`required`) may be several (default true, as OpenAI's).
    pub parallel_tool_calls: Option<bool>,
    /// vLLM's: arguments of the chat template's own (each one the template reads; others are refused by name).
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// vLLM's (default true): with a reasoning parser, the answer's thinking is in the response (false: left out).
    pub include_reasoning: Option<bool>,
    /// OpenAI's: how hard a reasoning model thinks, given to a chat template that reads `reasoning_effort`
    /// (gpt-oss's, DeepSeek V4's...), as vLLM gives it.
    pub reasoning_effort: Option<serde_json::Value>,
    /// vLLM's: documents for retrieval-augmented generation, each an object of strings (`title`, `text`...), given
    /// to a chat template that reads `documents` (Command R's, Granite's...), as transformers gives them.
    pub documents: Option<serde_json::Value>,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    /// A batch: one choice (or `n`) per prompt.
    Texts(Vec<String>),
    /// Token ids, as benchmarks and vLLM's clients send them.
    Tokens(Vec<u32>),
    /// A batch of token-id prompts.
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// Put the prompt before the completion in each choice's text.
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(flatten)]
    pub common: Common,
}

/// Which endpoint a request came in on (shapes the response).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

/// The input before templating: a conversation or raw text.
#[derive(Debug, Clone)]
pub enum Input {
    /// A conversation, how its rendering ends, and the tools the template shows (OpenAI's `tools` entries).
    Chat(Vec<ChatMessage>, Ending, Vec<serde_json::Value>),
    Text(String),
    /// Token ids given by the client (checked against the vocabulary when tokenizing).
    Tokens(Vec<u32>),
}

impl Input {
    /// Bytes of text to tokenize (token ids need none).
    pub fn text_bytes(&self) -> usize {
        match self {
            Input::Chat(messages, _, tools) => {
                let calls = |m: &ChatMessage| m.tool_calls.as_ref().map_or(0, |c| c.to_string().len());
                let tools: usize = tools.iter().map(|t| t.to_string().len()).sum();
                tools + messages.iter().map(|m| m.role.len() + m.content.len() + calls(m)).sum::<usize>()
            }
            Input::Text(t) => t.len(),
            Input::Tokens(_) => 0,
        }
    }
}

/// What changes the logits before sampling, as the request asks (OpenAI's and vLLM's meanings).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Logits {
    pub logit_bias: Vec<(u32, f32)>,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub repetition_penalty: Option<f32>,
    pub min_tokens: u32,
    pub stop_token_ids: Vec<u32>,
    /// Empty: any token.
    pub allowed_token_ids: Vec<u32>,
    /// As sent: tokenized with the prompt (`completions::bad_word_tokens`).
    pub bad_words: Vec<String>,
}

fn check_logits(c: &Common, max_tokens: Option<u32>) -> Result<Logits, ApiError> {
    let mut logit_bias = Vec::new();
    for (token, &bias) in c.logit_bias.iter().flatten() {
        let id = token
            .parse::<u32>()
            .map_err(|_| ApiError::bad(format!("logit_bias keys are token ids, not {token:?}"), "logit_bias"))?;
        if !(bias.is_finite() && (-100.0..=100.0).contains(&bias)) {
            return Err(ApiError::bad(format!("a logit_bias value must be in [-100, 100], got {bias}"), "logit_bias"));
        }
        logit_bias.push((id, bias));
    }
    for (name, v) in [("frequency_penalty", c.frequency_penalty), ("presence_penalty", c.presence_penalty)] {
        if v.is_some_and(|v| !(v.is_finite() && (-2.0..=2.0).contains(&v))) {
            return Err(ApiError::bad(format!("{name} must be in [-2, 2]"), name));
        }
    }
    if c.repetition_penalty.is_some_and(|p| !(p.is_finite() && p > 0.0)) {
        return Err(ApiError::bad("repetition_penalty must be a number > 0", "repetition_penalty"));
    }
    let min_tokens = c.min_tokens.unwrap_or(0);
    if max_tokens.is_some_and(|m| min_tokens > m) {
        return Err(ApiError::bad("min_tokens must not exceed max_tokens", "min_tokens"));
    }
    if c.allowed_token_ids.as_ref().is_some_and(Vec::is_empty) {
        // As vLLM answers: no token could be sampled.
        return Err(ApiError::bad("allowed_token_ids must not be empty", "allowed_token_ids"));
    }
    if c.bad_words.iter().flatten().any(|w| w.trim().is_empty()) {
        return Err(ApiError::bad("bad_words must not hold empty words", "bad_words"));
    }
    Ok(Logits {
        logit_bias,
        frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
        presence_penalty: c.presence_penalty.unwrap_or(0.0),
        repetition_penalty: c.repetition_penalty,
        min_tokens,
        stop_token_ids: c.stop_token_ids.clone().unwrap_or_default(),
        allowed_token_ids: c.allowed_token_ids.clone().unwrap_or_default(),
        bad_words: c.bad_words.clone().unwrap_or_default(),
    })
}

/// A request, checked.
#[derive(Debug, Clone)]
pub struct Checked {
    pub endpoint: Endpoint,
    pub model: String,
    pub input: Input,
    pub stream: bool,
    pub include_usage: bool,
    /// vLLM's `continuous_usage_stats`: every streamed chunk carries its choice's usage so far.
    pub continuous_usage: bool,
    /// `None`: as many as the context allows (capped by the router's default).
    pub max_tokens: Option<u32>,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: Option<u32>,
    /// 0: off.
    pub min_p: f32,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub namespace: Option<String>,
    /// Biases, penalties, `min_tokens`, stop token ids (validated; token ids against the vocabulary later).
    pub logits: Logits,
    /// `user` and `safety_identifier` as the client sent them (for the trace, nothing else).
    pub user: Option<String>,
    pub safety_identifier: Option<String>,
    /// Each token's log-probability with this many alternatives; `None`: not asked for.
    pub logprobs: Option<u32>,
    /// Samples per prompt (1 to [`MAX_N`]), each with its own seed (the request's seed plus its number).
    pub n: u32,
    /// The other prompts of a batch (a completion request with several), each answered as `input` is.
    pub batch: Vec<Input>,
    /// Text completions: each choice's text starts with its prompt.
    pub echo: bool,
    /// Text completions: `echo` with `max_tokens` 0, the prompt alone (one token is computed and dropped).
    pub echo_only: bool,
    /// vLLM's `prompt_logprobs`: the prompt tokens' log-probabilities with this many alternatives, answered in
    /// vLLM's shape (a choice's `prompt_logprobs`, or the chat response's).
    pub prompt_logprobs: Option<u32>,
    /// What the output must match, and the field that asked for it.
    pub grammar: Option<(engine::grammar::Grammar, &'static str)>,
    /// Chat: the tool calls the output makes (its grammar is `grammar`), answered as `tool_calls`.
    pub tool_calls: Option<super::tools::CallMode>,
    /// Chat: how its call ids look (the served model's template may take back only its own kind).
    pub call_ids: super::tools::CallIds,
    /// Chat: the answer's thinking is split from its content (with the router's reasoning parser).
    pub thinking: Option<super::reasoning::Thinking>,
    /// OpenAI's cache-routing key (a session, say): credited to the worker that last computed a prompt with it.
    pub prompt_cache_key: Option<String>,
    /// Control tokens' text goes in the output (vLLM's `skip_special_tokens: false`).
    pub keep_control: bool,
    /// The stop string that ends the output is part of it (vLLM's `include_stop_str_in_output`).
    pub keep_stop: bool,
    /// Whether the tokenizer's BOS goes before a prompt text (vLLM's `add_special_tokens`); `None`: as the endpoint
    /// does by default (`Tokenizer::encode_prompt`).
    pub add_special_tokens: Option<bool>,
    /// vLLM's `truncate_prompt_tokens`: the prompt's last tokens kept (applied once it is tokenized).
    pub keep_last: Option<KeepLast>,
    /// vLLM's `return_tokens_as_token_ids`: log-probabilities name each token `token_id:ID`.
    pub tokens_as_ids: bool,
    /// Lower first; 0 by default.
    pub priority: i32,
    /// Chat: vLLM's `chat_template_kwargs` (checked against the template when it renders), with
    /// `reasoning_effort` and `documents`.
    pub template_arguments: Option<serde_json::Map<String, serde_json::Value>>,
    /// Chat: the request's own fields among the template arguments (`reasoning_effort`, `documents`), so that a
    /// template that does not read one refuses it by that name.
    pub template_fields: Vec<&'static str>,
}

/// How much of a prompt `truncate_prompt_tokens` keeps: its last tokens, cut from the left as vLLM cuts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeepLast {
    /// At most this many.
    Tokens(u32),
    /// As many as the model's context holds.
    Context,
}

impl KeepLast {
    /// The prompt `tokens` cut to what is kept, for a model of `context` tokens; more than that is refused, as vLLM
    /// refuses it.
    pub fn apply(self, mut tokens: Vec<u32>, context: usize) -> Result<Vec<u32>, ApiError> {
        let keep = match self {
            KeepLast::Context => context,
            KeepLast::Tokens(k) if k as usize > context => {
                let why = format!("truncate_prompt_tokens ({k}) is more than the model's context of {context} tokens");
                return Err(ApiError::bad(why, "truncate_prompt_tokens"));
            }
            KeepLast::Tokens(k) => k as usize,
        };
        let cut = tokens.len().saturating_sub(keep);
        tokens.drain(..cut);
        Ok(tokens)
    }
}

/// The structured output a request asks for (at most one of `response_format`, `guided_json`, `guided_regex`,
/// `guided_choice`, `guided_grammar`, `structured_outputs`), with the field that asked.
fn check_grammar(c: &Common) -> Result<Option<(Grammar, &'static str)>, ApiError> {
    let mut found: Vec<(Grammar, &'static str)> = Vec::new();
    if let Some(rf) = c.response_format.as_ref().filter(|v| !v.is_null()) {
        let param = "response_format";
        match rf.get("type").and_then(serde_json::Value::as_str) {
            Some("text") => {}
            Some("json_object") => found.push((Grammar::JsonObject, param)),
            Some("json_schema") => {
                let schema = rf
                    .pointer("/json_schema/schema")
                    .ok_or_else(|| ApiError::bad("response_format.json_schema.schema is required", param))?;
                found.push((Grammar::JsonSchema(schema.to_string()), param));
            }
            _ => return Err(ApiError::bad("response_format.type must be text, json_object or json_schema", param)),
        }
    }
    match c.guided_json.as_ref().filter(|v| !v.is_null()) {
        None => {}
        Some(serde_json::Value::String(s)) => found.push((Grammar::JsonSchema(s.clone()), "guided_json")),
        Some(v @ serde_json::Value::Object(_)) => found.push((Grammar::JsonSchema(v.to_string()), "guided_json")),
        Some(_) => return Err(ApiError::bad("guided_json is a JSON schema (an object or its text)", "guided_json")),
    }
    if let Some(rx) = &c.guided_regex {
        found.push((Grammar::Regex(rx.clone()), "guided_regex"));
    }
    if let Some(choices) = &c.guided_choice {
        found.push((choice_regex(choices, "guided_choice")?, "guided_choice"));
    }
    if let Some(g) = &c.guided_grammar {
        found.push((lark(g, "guided_grammar")?, "guided_grammar"));
    }
    if let Some(so) = c.structured_outputs.as_ref().filter(|v| !v.is_null()) {
        found.extend(structured_outputs(so)?.into_iter().map(|g| (g, "structured_outputs")));
    }
    if let Some((_, second)) = found.get(1) {
        return Err(ApiError::bad("one structured output constraint per request", second));
    }
    Ok(found.pop())
}

/// A grammar in Lark, as vLLM's `guidance` backend takes it, or in GBNF (`root ::= ...`: llama.cpp's, which vLLM's
/// `xgrammar` backend takes; a malformed one is named here, [`engine::gbnf`]).
fn lark(grammar: &str, param: &'static str) -> Result<Grammar, ApiError> {
    if grammar.trim().is_empty() {
        return Err(ApiError::bad(format!("{param} is a grammar in Lark or GBNF, not empty"), param));
    }
    if engine::gbnf::is_gbnf(grammar) {
        engine::gbnf::to_lark(grammar).map_err(|e| ApiError::bad(format!("{param}: {e}"), param))?;
        return Ok(Grammar::Gbnf(grammar.to_string()));
    }
    Ok(Grammar::Lark(grammar.to_string()))
}

/// A regular expression matching exactly one of `choices`.
fn choice_regex(choices: &[String], param: &'static str) -> Result<Grammar, ApiError> {
    if choices.is_empty() || choices.iter().any(String::is_empty) {
        return Err(ApiError::bad(format!("{param} is a list of non-empty strings"), param));
    }
    let alternatives: Vec<String> = choices.iter().map(|s| regex::escape(s)).collect();
    Ok(Grammar::Regex(format!("({})", alternatives.join("|"))))
}

/// vLLM's `structured_outputs` object: each constraint it names (a JSON schema, a regular expression, a choice, a
/// Lark grammar, any JSON object); its options are taken at their defaults only, and a structural tag is refused.
fn structured_outputs(v: &serde_json::Value) -> Result<Vec<Grammar>, ApiError> {
    const PARAM: &str = "structured_outputs";
    let bad = |why: String| ApiError::bad(format!("structured_outputs: {why}"), PARAM);
    let fields = v.as_object().ok_or_else(|| bad("an object is expected".into()))?;
    let mut found = Vec::new();
    for (name, value) in fields.iter().filter(|(_, v)| !v.is_null()) {
        match (name.as_str(), value) {
            ("json", serde_json::Value::String(s)) => found.push(Grammar::JsonSchema(s.clone())),
            ("json", schema @ serde_json::Value::Object(_)) => found.push(Grammar::JsonSchema(schema.to_string())),
            ("json", _) => return Err(bad("`json` is a JSON schema (an object or its text)".into())),
            ("regex", serde_json::Value::String(rx)) => found.push(Grammar::Regex(rx.clone())),
            ("choice", serde_json::Value::Array(items)) => {
                let choices: Option<Vec<String>> = items.iter().map(|i| i.as_str().map(str::to_owned)).collect();
                let choices = choices.ok_or_else(|| bad("`choice` is a list of strings".into()))?;
                found.push(choice_regex(&choices, PARAM)?);
            }
            ("json_object", serde_json::Value::Bool(true)) => found.push(Grammar::JsonObject),
            (
                "json_object" | "disable_fallback" | "disable_any_whitespace" | "disable_additional_properties",
                serde_json::Value::Bool(false),
            ) => {}
            // Which backend vLLM falls back to: there is one here.
            ("disable_fallback", serde_json::Value::Bool(true)) => {}
            ("grammar", serde_json::Value::String(g)) => found.push(lark(g, PARAM)?),
            ("grammar", _) => return Err(bad("`grammar` is a grammar in Lark (a string)".into())),
            (name, value) => return Err(bad(format!("`{name}` = {value} is not supported"))),
        }
    }
    if found.is_empty() {
        return Err(bad("name a constraint: `json`, `regex`, `choice`, `grammar` or `json_object`".into()));
    }
    Ok(found)
}

/// The request's log-probabilities: chat's `logprobs` (a boolean) with `top_logprobs`, or completions' `logprobs`
/// (the number of alternatives).
fn check_logprobs(c: &Common, endpoint: Endpoint) -> Result<Option<u32>, ApiError> {
    let value = c.logprobs.as_ref().filter(|v| !v.is_null());
    let top = c.top_logprobs;
    if top.is_some_and(|n| n > MAX_LOGPROBS) {
        return Err(ApiError::bad(format!("top_logprobs must be between 0 and {MAX_LOGPROBS}"), "top_logprobs"));
    }
    match endpoint {
        Endpoint::Chat => match value {
            None | Some(serde_json::Value::Bool(false)) if top.is_some_and(|n| n > 0) => {
                Err(ApiError::bad("top_logprobs needs logprobs set to true", "top_logprobs"))
            }
            None | Some(serde_json::Value::Bool(false)) => Ok(None),
            Some(serde_json::Value::Bool(true)) => Ok(Some(top.unwrap_or(0))),
            Some(other) => Err(ApiError::bad(format!("logprobs must be true or false, not {other}"), "logprobs")),
        },
        Endpoint::Completion => match value {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n <= u64::from(MAX_LOGPROBS) => Ok(Some(n as u32)),
                _ => Err(ApiError::bad(
                    format!("logprobs must be an integer from 0 to {MAX_LOGPROBS}, not {v}"),
                    "logprobs",
                )),
            },
        },
    }
}

/// The typed request, once every field in it is one `endpoint` supports ([`super::fields`]).
fn parse<T: serde::de::DeserializeOwned>(body: &[u8], endpoint: Endpoint) -> Result<T, ApiError> {
    let v: serde_json::Value = serde_json::from_slice(body).map_err(|e| ApiError::MalformedJson(e.to_string()))?;
    let Some(fields) = v.as_object() else {
        return Err(ApiError::MalformedJson("the body is not a JSON object".into()));
    };
    super::fields::check(endpoint, fields)?;
    T::deserialize(&v).map_err(|e| misfit::<T>(&v).unwrap_or_else(|| ApiError::MalformedJson(e.to_string())))
}

/// The error naming the top-level field whose value does not fit its type in `T`, as OpenAI and vLLM name it in
/// `param`. Through `#[serde(flatten)]` a failure's path is lost, so the shared fields are looked at alone first.
fn misfit<T: serde::de::DeserializeOwned>(v: &serde_json::Value) -> Option<ApiError> {
    fn named<T: serde::de::DeserializeOwned>(v: &serde_json::Value) -> Option<ApiError> {
        let e = serde_path_to_error::deserialize::<_, T>(v).err()?;
        match e.path().iter().next() {
            Some(serde_path_to_error::Segment::Map { key }) => {
                Some(ApiError::bad_field(format!("invalid `{}`: {}", e.path(), e.inner()), key))
            }
            _ => None,
        }
    }
    named::<Common>(v).or_else(|| named::<T>(v))
}

fn check_common(c: Common, endpoint: Endpoint, input: Input) -> Result<Checked, ApiError> {
    c.stream_options.as_ref().map_or(Ok(()), check_stream_options)?;
    if c.stream_options.is_some() && !c.stream {
        // As OpenAI and vLLM answer: the options are for a stream.
        return Err(ApiError::bad("stream_options is only allowed when stream is true", "stream_options"));
    }
    let logits = check_logits(&c, c.max_completion_tokens.or(c.max_tokens))?;
    let logprobs = check_logprobs(&c, endpoint)?;
    let prompt_logprobs = match c.prompt_logprobs {
        None => None,
        Some(n) if (0..=i64::from(MAX_LOGPROBS)).contains(&n) => Some(n as u32),
        Some(n) => {
            let why = format!("prompt_logprobs must be an integer from 0 to {MAX_LOGPROBS}, not {n}");
            return Err(ApiError::bad(why, "prompt_logprobs"));
        }
    };
    if prompt_logprobs.is_some() && c.stream {
        // As vLLM answers: its shape has no place in a stream's chunks.
        return Err(ApiError::bad("prompt_logprobs is not available when streaming", "prompt_logprobs"));
    }
    let grammar = check_grammar(&c)?;
    let model = c.model.filter(|m| !m.is_empty()).ok_or_else(|| ApiError::bad("`model` is required", "model"))?;
    let n = c.n.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(ApiError::bad(format!("n must be between 1 and {MAX_N}, got {n}"), "n"));
    }
    let temperature = c.temperature.unwrap_or(1.0);
    if !(temperature.is_finite() && (0.0..=MAX_TEMPERATURE).contains(&temperature)) {
        return Err(ApiError::bad(format!("temperature must be between 0 and 2, got {temperature}"), "temperature"));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad(format!("top_p must be in (0, 1], got {top_p}"), "top_p"));
    }
    let top_k = match c.top_k {
        None | Some(0 | -1) => None,
        Some(k) => Some(u32::try_from(k).map_err(|_| {
            ApiError::bad(format!("top_k must be 0 or -1 (no limit), or from 1 to {}, got {k}", u32::MAX), "top_k")
        })?),
    };
    let min_p = c.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::bad(format!("min_p must be in [0, 1], got {min_p}"), "min_p"));
    }
    let max_tokens = c.max_completion_tokens.or(c.max_tokens);
    if max_tokens == Some(0) {
        return Err(ApiError::bad("max_tokens must be at least 1", "max_tokens"));
    }
    let stop = match c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > MAX_STOPS {
        return Err(ApiError::bad(format!("at most {MAX_STOPS} stop sequences are allowed"), "stop"));
    }
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::bad("stop sequences must not be empty", "stop"));
    }
    let keep_last = match c.truncate_prompt_tokens {
        None => None,
        Some(-1) => Some(KeepLast::Context),
        Some(k) => Some(KeepLast::Tokens(u32::try_from(k).ok().filter(|&k| k > 0).ok_or_else(|| {
            let why = format!("truncate_prompt_tokens must be -1 (the model's context) or at least 1, not {k}");
            ApiError::bad(why, "truncate_prompt_tokens")
        })?)),
    };
    let priority = i32::try_from(c.priority.unwrap_or(0)).map_err(|_| {
        let why = format!("priority must be an integer from {} to {}", i32::MIN, i32::MAX);
        ApiError::bad(why, "priority")
    })?;
    if c.cache_salt.as_deref().is_some_and(|s| s.contains('\0')) {
        return Err(ApiError::bad("cache_salt must not contain NUL", "cache_salt"));
    }
    Ok(Checked {
        logits,
        endpoint,
        model,
        input,
        stream: c.stream,
        include_usage: c.stream_options.as_ref().is_some_and(|o| o.include_usage),
        continuous_usage: c.stream_options.as_ref().is_some_and(|o| o.include_usage && o.continuous_usage_stats),
        max_tokens,
        temperature,
        top_p,
        top_k,
        min_p,
        seed: c.seed.map(|s| s as u64),
        stop,
        ignore_eos: c.ignore_eos,
        namespace: c.cache_salt.filter(|s| !s.is_empty()),
        user: c.user,
        safety_identifier: c.safety_identifier,
        logprobs,
        prompt_cache_key: c.prompt_cache_key.filter(|k| !k.is_empty()),
        n,
        batch: Vec::new(),
        echo: false,
        echo_only: false,
        prompt_logprobs,
        grammar,
        tool_calls: None,
        call_ids: Default::default(),
        thinking: None,
        keep_control: c.skip_special_tokens == Some(false),
        keep_stop: c.include_stop_str_in_output == Some(true),
        add_special_tokens: c.add_special_tokens,
        keep_last,
        tokens_as_ids: c.return_tokens_as_token_ids,
        priority,
        template_arguments: None,
        template_fields: Vec::new(),
    })
}

/// The served model's formats the router reads out of chat answers: its tool calls, its thinking.
#[derive(Clone, Copy, Debug, Default)]
pub struct OutputParsers {
    pub tool_call: Option<super::tools::ToolParser>,
    pub reasoning: Option<super::reasoning::ReasoningParser>,
}

/// Checks a `/v1/chat/completions` body.
pub fn check_chat(body: &[u8], parsers: OutputParsers) -> Result<Checked, ApiError> {
    let r: ChatRequest = parse(body, Endpoint::Chat)?;
    if r.messages.is_empty() {
        return Err(ApiError::bad("`messages` must not be empty", "messages"));
    }
    let mut messages = Vec::with_capacity(r.messages.len());
    for m in r.messages {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "developer" | "tool") {
            return Err(ApiError::bad(format!("unknown message role `{}`", m.role), "messages"));
        }
        if m.function_call.as_ref().is_some_and(|v| !v.is_null()) {
            let why = "a message's `function_call` (deprecated) is not supported: send its call in `tool_calls`";
            return Err(ApiError::bad(why, "messages"));
        }
        check_other_fields(&m.other)?;
        let tool_calls = history_calls(m.tool_calls)?;
        let content = match m.content {
            None => String::new(),
            Some(Content::Text(t)) => t,
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for p in parts {
                    if p.kind != "text" {
                        return Err(ApiError::bad(
                            format!("content parts of type `{}` are not supported", p.kind),
                            "messages",
                        ));
                    }
                    text.push_str(&p.text.unwrap_or_default());
                }
                text
            }
        };
        let role = if m.role == "developer" { "system".to_string() } else { m.role };
        let tool_call_id = m.tool_call_id.filter(|_| role == "tool");
        let reasoning_content = match (m.reasoning_content, m.reasoning) {
            (None, None) => None,
            _ if role != "assistant" => {
                return Err(ApiError::bad("only an assistant message carries reasoning", "messages"));
            }
            (Some(a), Some(b)) if a != b => {
                let why = "a message's reasoning_content and reasoning differ: send one";
                return Err(ApiError::bad(why, "messages"));
            }
            (a, b) => a.or(b),
        };
        let message = ChatMessage::new(role, content).named(m.name);
        messages.push(ChatMessage { tool_calls, tool_call_id, reasoning_content, ..message });
    }
    let ending = match (r.add_generation_prompt, r.continue_final_message) {
        (Some(true) | None, Some(true)) => {
            // vLLM's rule: a new turn and the last one continued exclude each other.
            let why = "continue_final_message needs add_generation_prompt false: they exclude each other";
            return Err(ApiError::bad(why, "continue_final_message"));
        }
        (Some(false), Some(true)) => Ending::ContinueLast,
        (Some(false), _) => Ending::AsIs,
        (Some(true) | None, _) => Ending::NewTurn,
    };
    let tools = super::tools::check(
        r.tools.filter(|v| !v.is_null()),
        r.tool_choice.filter(|v| !v.is_null()),
        r.parallel_tool_calls,
        parsers.tool_call,
    )?;
    let mut checked = check_common(r.common, Endpoint::Chat, Input::Chat(messages, ending, tools.entries))?;
    checked.template_arguments = r.chat_template_kwargs.filter(|a| !a.is_empty());
    match r.reasoning_effort {
        None | Some(serde_json::Value::Null) => {}
        Some(effort @ serde_json::Value::String(_)) => checked.template_field(EFFORT, effort)?,
        Some(_) => return Err(ApiError::bad("reasoning_effort is a string (low, medium, high...)", EFFORT)),
    }
    match r.documents {
        None | Some(serde_json::Value::Null) => {}
        Some(documents) if is_documents(&documents) => checked.template_field(DOCUMENTS, documents)?,
        Some(_) => {
            let why = "documents is a list of objects of strings, such as {\"title\": ..., \"text\": ...}";
            return Err(ApiError::bad(why, DOCUMENTS));
        }
    }
    if let Some(grammar) = tools.grammar {
        if let Some((_, other)) = &checked.grammar {
            let why = format!("tool_choice forces the output to be tool calls, so `{other}` cannot also constrain it");
            return Err(ApiError::bad(why, other));
        }
        checked.grammar = Some((grammar, "tool_choice"));
    }
    // vLLM keeps the control tokens' text for a parser whose markers are such tokens (Mistral's `[TOOL_CALLS]`).
    if let Some(super::tools::CallMode::Auto(choosing)) = &tools.mode {
        checked.keep_control |= choosing.parser.needs_control_text();
    }
    checked.tool_calls = tools.mode;
    checked.call_ids = super::tools::CallIds::of(parsers.tool_call);
    // Gemma 4's channel markers are control tokens.
    checked.keep_control |= parsers.reasoning.is_some_and(|p| p.needs_control_text());
    // A grammar holds the answer after its thinking (`Checked::grammar_thinking`), so the split is the parser's own.
    checked.thinking = parsers
        .reasoning
        .and_then(|parser| parser.for_request(checked.template_arguments.as_ref()))
        .map(|parser| super::reasoning::Thinking { parser, shown: r.include_reasoning != Some(false) });
    // gpt-oss's answer is messages; a grammar would have to hold in its final one only, which no worker applies.
    if let (Some(thinking), Some((_, param))) = (checked.thinking, &checked.grammar)
        && thinking.parser == super::reasoning::ReasoningParser::GptOss
    {
        let why = "structured outputs and forced tool calls are not served with gpt-oss's harmony answers \
                   (reasoning_parser openai_gptoss): its calls come with tool_choice auto";
        return Err(ApiError::bad(why, param));
    }
    Ok(checked)
}

/// An assistant turn's `tool_calls` as the template gets them: each call's `arguments` (JSON text in OpenAI's
/// messages) parsed, as transformers documents them and vLLM hands them over. `None` for none (absent, null, or
/// an empty list).
fn history_calls(calls: Option<serde_json::Value>) -> Result<Option<serde_json::Value>, ApiError> {
    let bad = |why: String| ApiError::bad(format!("a message's tool_calls: {why}"), "messages");
    let mut calls = match calls {
        None | Some(serde_json::Value::Null) => return Ok(None),
        Some(serde_json::Value::Array(v)) if v.is_empty() => return Ok(None),
        Some(serde_json::Value::Array(v)) => v,
        Some(_) => return Err(bad("a list of calls is expected".into())),
    };
    for call in &mut calls {
        let Some(f) = call.get_mut("function").and_then(serde_json::Value::as_object_mut) else {
            return Err(bad("each call has a `function`".into()));
        };
        if !f.get("name").is_some_and(serde_json::Value::is_string) {
            return Err(bad("each call's function has a `name`".into()));
        }
        if let Some(serde_json::Value::String(text)) = f.get("arguments") {
            let parsed = serde_json::from_str(text).map_err(|e| bad(format!("arguments that are not JSON ({e})")))?;
            f.insert("arguments".into(), parsed);
        }
    }
    Ok(Some(serde_json::Value::Array(calls)))
}

/// Checks a `/v1/completions` body.
pub fn check_completion(body: &[u8]) -> Result<Checked, ApiError> {
    let r: CompletionRequest = parse(body, Endpoint::Completion)?;
    let mut inputs: Vec<Input> = match r.prompt {
        Prompt::Text(t) => vec![Input::Text(t)],
        Prompt::Texts(v) => v.into_iter().map(Input::Text).collect(),
        Prompt::Tokens(t) => vec![Input::Tokens(t)],
        Prompt::TokenLists(v) => v.into_iter().map(Input::Tokens).collect(),
    };
    if inputs.len() > MAX_BATCH {
        return Err(ApiError::bad(format!("at most {MAX_BATCH} prompts per request"), "prompt"));
    }
    let empty =
        |i: &Input| matches!(i, Input::Text(t) if t.is_empty()) || matches!(i, Input::Tokens(t) if t.is_empty());
    if inputs.is_empty() || inputs.iter().any(empty) {
        return Err(ApiError::bad("`prompt` must not be empty", "prompt"));
    }
    let echo = r.echo.unwrap_or(false);
    let first = inputs.remove(0);
    let mut common = r.common;
    // `echo` with `max_tokens` 0 asks for the prompt alone (its log-probabilities, with `logprobs`): as vLLM does,
    // one token is computed and left out of the answer.
    let echo_only = echo && common.max_completion_tokens.or(common.max_tokens) == Some(0);
    if echo_only {
        (common.max_tokens, common.max_completion_tokens) = (Some(1), None);
    }
    let mut checked = check_common(common, Endpoint::Completion, first)?;
    checked.batch = inputs;
    checked.echo = echo;
    checked.echo_only = echo_only;
    Ok(checked)
}

/// Qwen3's `chat_template_kwargs` switch for thinking, which the router reads too under the `qwen3` parser.
pub const THINKING_SWITCH: &str = "enable_thinking";
/// OpenAI's `reasoning_effort`, a template argument of the templates that read it.
pub const EFFORT: &str = "reasoning_effort";
/// vLLM's `documents`, a template argument of the templates that read it.
pub const DOCUMENTS: &str = "documents";

/// Whether `v` is documents as vLLM takes them: a list of objects whose values are strings.
fn is_documents(v: &serde_json::Value) -> bool {
    v.as_array().is_some_and(|docs| {
        docs.iter().all(|d| d.as_object().is_some_and(|d| d.values().all(serde_json::Value::is_string)))
    })
}

impl Checked {
    /// The request's field `name` goes to the chat template as the argument of that name; `chat_template_kwargs`
    /// may say it too, alike.
    fn template_field(&mut self, name: &'static str, value: serde_json::Value) -> Result<(), ApiError> {
        let arguments = self.template_arguments.get_or_insert_with(Default::default);
        if arguments.get(name).is_some_and(|given| *given != value) {
            return Err(ApiError::bad(format!("{name} and chat_template_kwargs.{name} differ"), name));
        }
        arguments.insert(name.into(), value);
        self.template_fields.push(name);
        Ok(())
    }

    /// Once its conversation is rendered as `prompt`: the thinking split as the prompt leaves the answer
    /// ([`super::reasoning::ReasoningParser::after_prompt`]).
    pub fn rendered(&mut self, prompt: &str) {
        self.thinking = self
            .thinking
            .and_then(|t| Some(super::reasoning::Thinking { parser: t.parser.after_prompt(prompt)?, ..t }));
    }

    /// Where the answer's thinking comes before what its grammar holds (none without a reasoning parser). Qwen3's
    /// templates write an empty block into the prompt when `chat_template_kwargs` turns thinking off: the answer is
    /// then the grammar's from its first token, as vLLM finds the block's end in the prompt and holds it from there.
    pub fn grammar_thinking(&self) -> engine::grammar::Thinking {
        let off = || {
            let asked = self.template_arguments.as_ref().and_then(|a| a.get(THINKING_SWITCH));
            asked == Some(&serde_json::Value::Bool(false))
        };
        match self.thinking.map(|t| t.parser) {
            None => engine::grammar::Thinking::None,
            Some(parser) if parser.reads_thinking_switch() && off() => engine::grammar::Thinking::None,
            Some(parser) => parser.before_grammar(),
        }
    }

    /// How many alternatives the workers report for each prompt token (`None`: the prompt is not scored): what
    /// vLLM's `prompt_logprobs` asks, or `logprobs` with `echo` (the echoed prompt's tokens come with theirs).
    pub fn scored_prompt(&self) -> Option<u32> {
        let echoed = self.logprobs.filter(|_| self.echo);
        self.prompt_logprobs.max(echoed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bad(body: &str) -> (&'static str, String) {
        let e = check_chat(body.as_bytes(), OutputParsers::default()).expect_err("refused");
        (e.kind(), e.to_string())
    }

    #[test]
    fn reasoning_effort_goes_among_the_template_arguments() {
        let args = |extra: &str| {
            let c = chat_with(extra).expect("valid");
            (c.template_arguments, !c.template_fields.is_empty())
        };
        let high = serde_json::Map::from_iter([(EFFORT.to_string(), serde_json::json!("high"))]);
        assert_eq!(args(r#","reasoning_effort":"high""#), (Some(high.clone()), true));
        assert_eq!(args(r#","reasoning_effort":null"#), (None, false));
        // Said twice alike is said once; beside other arguments.
        let both = r#","reasoning_effort":"high","chat_template_kwargs":{"reasoning_effort":"high","x":1}"#;
        assert_eq!(args(both).0.map(|a| a.len()), Some(2));
        // In chat_template_kwargs alone it is a template argument like any other (refused by that name where the
        // template does not read it).
        assert!(!args(r#","chat_template_kwargs":{"reasoning_effort":"low"}"#).1);
        for body in [
            r#","reasoning_effort":3"#,
            r#","reasoning_effort":"high","chat_template_kwargs":{"reasoning_effort":"low"}"#,
        ] {
            let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}]{body}}}"#);
            let e = check_chat(body.as_bytes(), OutputParsers::default()).expect_err("refused");
            assert_eq!(e.body()["error"]["param"], EFFORT, "{body}");
        }
    }

    #[test]
    fn documents_go_among_the_template_arguments() {
        let docs = serde_json::json!([{"title": "Tides", "text": "Twice a day."}, {"text": "Moon."}]);
        let c = chat_with(&format!(r#","documents":{docs}"#)).expect("valid");
        assert_eq!(c.template_arguments.and_then(|mut a| a.remove(DOCUMENTS)), Some(docs.clone()));
        assert_eq!(c.template_fields, vec![DOCUMENTS]);
        let both =
            format!(r#","documents":{docs},"reasoning_effort":"low","chat_template_kwargs":{{"documents":{docs}}}"#);
        assert_eq!(chat_with(&both).expect("said alike").template_fields, vec![EFFORT, DOCUMENTS]);
        assert!(chat_with(r#","documents":null"#).expect("valid").template_arguments.is_none());
        for bad in [
            r#","documents":{"text":"x"}"#,
            r#","documents":["x"]"#,
            r#","documents":[{"text":1}]"#,
            r#","documents":[{"text":"x"}],"chat_template_kwargs":{"documents":[]}"#,
        ] {
            let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}]{bad}}}"#);
            let e = check_chat(body.as_bytes(), OutputParsers::default()).expect_err("refused");
            assert_eq!(e.body()["error"]["param"], DOCUMENTS, "{bad}");
        }
    }

    #[test]
    fn logprobs_take_each_endpoints_meaning() {
        let chat = |extra: &str| {
            let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}]{extra}}}"#);
            check_chat(body.as_bytes(), OutputParsers::default()).map(|c| c.logprobs).map_err(|e| e.to_string())
        };
        assert_eq!(chat(""), Ok(None));
        assert_eq!(chat(r#","logprobs":false"#), Ok(None));
        assert_eq!(chat(r#","logprobs":true"#), Ok(Some(0)));
        assert_eq!(chat(r#","logprobs":true,"top_logprobs":20"#), Ok(Some(20)));
        assert!(chat(r#","logprobs":true,"top_logprobs":21"#).is_err());
        assert!(chat(r#","top_logprobs":2"#).is_err(), "top_logprobs needs logprobs");
        assert!(chat(r#","logprobs":3"#).is_err(), "chat's logprobs is a boolean");
        let completion = |extra: &str| {
            let body = format!(r#"{{"model":"m","prompt":"x"{extra}}}"#);
            check_completion(body.as_bytes()).map(|c| c.logprobs).map_err(|e| e.to_string())
        };
        assert_eq!(completion(r#","logprobs":null"#), Ok(None));
        assert_eq!(completion(r#","logprobs":0"#), Ok(Some(0)));
        assert_eq!(completion(r#","logprobs":5"#), Ok(Some(5)));
        assert!(completion(r#","logprobs":true"#).is_err(), "completions' logprobs is a count");
        assert!(completion(r#","logprobs":21"#).is_err());
    }

    #[test]
    fn a_full_chat_request_is_checked() {
        let body = r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}],
            "max_completion_tokens":5,"temperature":0,"top_p":0.5,"seed":3,"stop":"\n","stream":true,
            "stream_options":{"include_usage":true},"user":"u1","presence_penalty":0}"#;
        let c = check_chat(body.as_bytes(), OutputParsers::default()).expect("valid");
        assert_eq!((c.max_tokens, c.temperature, c.top_p, c.seed), (Some(5), 0.0, 0.5, Some(3)));
        assert_eq!(c.stop, vec!["\n".to_string()]);
        assert!(c.stream && c.include_usage);
        // OpenAI's and vLLM's seeds are signed: a negative one is a seed like any other, past i64 is not one.
        let seeded = |seed: &str| {
            check_chat(
                format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"seed":{seed}}}"#).as_bytes(),
                OutputParsers::default(),
            )
            .map(|c| c.seed)
        };
        assert_eq!(seeded("-5").ok(), Some(Some(-5i64 as u64)));
        assert_eq!(seeded("-9223372036854775808").ok(), Some(Some(1 << 63)));
        assert!(seeded("9223372036854775808").is_err());
        let Input::Chat(m, _, _) = c.input else { panic!("chat") };
        assert_eq!(m.len(), 2);
    }

    fn chat_with(extra: &str) -> Result<Checked, String> {
        let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}]{extra}}}"#);
        check_chat(body.as_bytes(), OutputParsers::default()).map_err(|e| e.to_string())
    }

    #[test]
    fn a_value_of_the_wrong_type_names_its_field() {
        for (extra, field) in [
            (r#","max_tokens":5.5"#, "max_tokens"),
            (r#","temperature":"hot""#, "temperature"),
            (r#","n":-1"#, "n"),
            (r#","stop":[1]"#, "stop"),
            (r#","stream":"yes""#, "stream"),
            (r#","seed":1e30"#, "seed"),
        ] {
            let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}]{extra}}}"#);
            match check_chat(body.as_bytes(), OutputParsers::default()) {
                Err(ApiError::BadRequest { param: Some(p), message }) => assert_eq!(p, field, "{message}"),
                other => panic!("{extra}: {other:?}"),
            }
        }
        match check_chat(br#"{"model":"m","messages":[{"role":"user","content":5}]}"#, OutputParsers::default()) {
            Err(ApiError::BadRequest { param: Some(p), message }) => {
                assert_eq!(p, "messages");
                assert!(message.contains("messages[0]"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        for (body, field) in [
            (r#"{"model":"m","prompt":"x","max_tokens":"9"}"#, "max_tokens"),
            (r#"{"model":"m","prompt":5}"#, "prompt"),
        ] {
            let completion = check_completion(body.as_bytes());
            assert!(
                matches!(&completion, Err(ApiError::BadRequest { param: Some(p), .. }) if p == field),
                "{completion:?}"
            );
        }
    }

    #[test]
    fn top_k_zero_and_minus_one_mean_no_limit_as_in_vllm() {
        let top_k = |k: &str| chat_with(&format!(r#","top_k":{k}"#)).map(|c| c.top_k);
        assert_eq!(top_k("-1"), Ok(None));
        assert_eq!(top_k("0"), Ok(None));
        assert_eq!(top_k("null"), Ok(None));
        assert_eq!(top_k("40"), Ok(Some(40)));
        for bad in ["-2", "4294967296"] {
            assert!(top_k(bad).is_err_and(|e| e.contains("top_k must be 0 or -1")), "{bad}");
        }
    }

    #[test]
    fn stream_options_need_a_stream() {
        let e = chat_with(r#","stream_options":{"include_usage":true}"#).expect_err("refused");
        assert!(e.contains("stream_options is only allowed when stream is true"), "{e}");
        assert!(chat_with(r#","stream":false,"stream_options":{"include_usage":false}"#).is_err());
        assert!(chat_with(r#","stream":true,"stream_options":{"include_usage":true}"#).is_ok());
        assert!(chat_with(r#","stream_options":null"#).is_ok());
    }

    #[test]
    fn the_conversation_ends_as_vllms_fields_ask() {
        let ending = |extra: &str| {
            chat_with(extra).map(|c| match c.input {
                Input::Chat(_, e, _) => e,
                _ => panic!("chat"),
            })
        };
        assert_eq!(ending(""), Ok(Ending::NewTurn));
        assert_eq!(ending(r#","add_generation_prompt":true"#), Ok(Ending::NewTurn));
        assert_eq!(ending(r#","add_generation_prompt":false"#), Ok(Ending::AsIs));
        assert_eq!(ending(r#","add_generation_prompt":false,"continue_final_message":true"#), Ok(Ending::ContinueLast));
        for both in
            [r#","continue_final_message":true"#, r#","add_generation_prompt":true,"continue_final_message":true"#]
        {
            assert!(ending(both).is_err_and(|e| e.contains("exclude each other")), "{both}");
        }
    }

    #[test]
    fn a_messages_name_goes_to_the_template() {
        let body =
            r#"{"model":"m","messages":[{"role":"user","content":"x","name":"ann"},{"role":"user","content":"y"}]}"#;
        let Ok(Checked { input: Input::Chat(messages, _, _), .. }) =
            check_chat(body.as_bytes(), OutputParsers::default())
        else {
            panic!("chat")
        };
        assert_eq!(messages[0], ChatMessage::new("user", "x").named(Some("ann".into())));
        assert_eq!(messages[1].name, None);
    }

    #[test]
    fn vllms_structured_outputs_name_the_same_constraints() {
        let grammar = |so: &str| chat_with(&format!(r#","structured_outputs":{so}"#)).map(|c| c.grammar);
        let schema = r#"{"type":"object"}"#;
        assert_eq!(
            grammar(&format!(r#"{{"json":{schema}}}"#)),
            Ok(Some((Grammar::JsonSchema(schema.into()), "structured_outputs")))
        );
        assert_eq!(
            grammar(r#"{"regex":"[0-9]+","disable_fallback":true}"#),
            Ok(Some((Grammar::Regex("[0-9]+".into()), "structured_outputs")))
        );
        assert_eq!(
            grammar(r#"{"choice":["a.b","c"]}"#),
            Ok(Some((Grammar::Regex(r"(a\.b|c)".into()), "structured_outputs")))
        );
        assert_eq!(grammar(r#"{"json_object":true}"#), Ok(Some((Grammar::JsonObject, "structured_outputs"))));
        let lark = r#"start: "yes" | "no""#;
        assert_eq!(
            grammar(&serde_json::json!({"grammar": lark}).to_string()),
            Ok(Some((Grammar::Lark(lark.into()), "structured_outputs")))
        );
        let guided = chat_with(&format!(r#","guided_grammar":{}"#, serde_json::json!(lark))).expect("valid");
        assert_eq!(guided.grammar, Some((Grammar::Lark(lark.into()), "guided_grammar")));
        for bad in [r#","guided_grammar":"root ::= b""#, r#","guided_grammar":" ""#] {
            assert!(chat_with(bad).is_err_and(|e| e.contains("guided_grammar")), "{bad}");
        }
        // GBNF, as llama.cpp and vLLM's xgrammar backend take it.
        let gbnf = chat_with(r#","guided_grammar":"root ::= \"a\" | \"b\"""#).expect("GBNF");
        assert_eq!(gbnf.grammar, Some((Grammar::Gbnf(r#"root ::= "a" | "b""#.into()), "guided_grammar")));
        assert_eq!(grammar("null"), Ok(None));
        for refused in [
            r#"{"grammar":"root ::= [z-a]"}"#,
            r#"{"grammar":3}"#,
            r#"{"structural_tag":"x"}"#,
            r#"{"regex":"a","disable_any_whitespace":true}"#,
            r#"{"json":3}"#,
            r#"{"choice":[]}"#,
            r#"{}"#,
            r#"{"regex":"a","choice":["b"]}"#,
            r#""a""#,
        ] {
            assert!(grammar(refused).is_err(), "{refused}");
        }
        let both = chat_with(r#","guided_regex":"a","structured_outputs":{"regex":"b"}"#);
        assert!(both.is_err_and(|e| e.contains("one structured output constraint")));
    }

    #[test]
    fn special_tokens_and_stop_strings_in_the_text_as_asked() {
        let c = chat_with("").expect("valid");
        assert_eq!((c.keep_control, c.keep_stop), (false, false));
        let c = chat_with(r#","skip_special_tokens":false,"include_stop_str_in_output":true"#).expect("valid");
        assert_eq!((c.keep_control, c.keep_stop), (true, true));
        let c = chat_with(r#","skip_special_tokens":true,"include_stop_str_in_output":false"#).expect("valid");
        assert_eq!((c.keep_control, c.keep_stop), (false, false));
        assert_eq!(c.add_special_tokens, None);
        assert_eq!(chat_with(r#","add_special_tokens":true"#).map(|c| c.add_special_tokens), Ok(Some(true)));
    }

    #[test]
    fn null_is_what_leaving_a_field_out_is() {
        let nulls = r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":null,"stop":null,
            "n":null,"seed":null,"temperature":null,"top_p":null,"stream":null,"stream_options":null,
            "logprobs":null,"top_logprobs":null,"response_format":null,"tools":null,"tool_choice":null,"user":null,
            "frequency_penalty":null,"presence_penalty":null,"logit_bias":null,"ignore_eos":null}"#;
        let c = check_chat(nulls.as_bytes(), OutputParsers::default()).expect("nulls are absent fields");
        let plain =
            check_chat(br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#, OutputParsers::default())
                .expect("valid");
        assert_eq!(
            (c.stream, c.include_usage, c.ignore_eos, c.max_tokens, c.seed, c.temperature, c.logprobs),
            (false, false, false, None, None, plain.temperature, None)
        );
        let c = check_completion(br#"{"model":"m","prompt":"x","stream":null,"echo":null,"logprobs":null}"#);
        assert!(c.is_ok_and(|c| !c.stream));
    }

    #[test]
    fn a_turn_that_called_tools_goes_to_the_template_with_its_arguments_parsed() {
        let with = |m: &str| {
            check_chat(
                format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}},{m}]}}"#).as_bytes(),
                OutputParsers::default(),
            )
        };
        let call = r#"[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\": 1}"}}]"#;
        let turns = [format!(r#"{{"role":"assistant","content":null,"tool_calls":{call}}}"#)];
        let Ok(Checked { input: Input::Chat(m, _, _), .. }) = with(&turns[0]) else { panic!("accepted") };
        assert_eq!(
            m[1].tool_calls,
            Some(
                serde_json::json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}])
            )
        );
        let Ok(Checked { input: Input::Chat(m, _, _), .. }) =
            with(r#"{"role":"tool","tool_call_id":"c1","content":"2"}"#)
        else {
            panic!("accepted")
        };
        assert_eq!((m[1].tool_call_id.as_deref(), m[1].content.as_str()), (Some("c1"), "2"));
        for bad in [
            r#"{"role":"assistant","function_call":{"name":"f","arguments":"{}"}}"#,
            r#"{"role":"assistant","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{"}}]}"#,
            r#"{"role":"assistant","tool_calls":[{"id":"c1"}]}"#,
            r#"{"role":"assistant","tool_calls":{"id":"c1"}}"#,
        ] {
            let e = with(bad).expect_err("refused").body();
            assert_eq!(e["error"]["param"], "messages", "{bad}: {e}");
        }
        for m in [
            r#"{"role":"assistant","content":"hi","tool_calls":[]}"#,
            r#"{"role":"assistant","content":"hi","tool_calls":null}"#,
        ] {
            let Ok(Checked { input: Input::Chat(m, _, _), .. }) = with(m) else { panic!("{m}") };
            assert_eq!(m[1].tool_calls, None);
        }
    }

    #[test]
    fn truncation_keeps_the_prompts_last_tokens() {
        let keep = |v: &str| chat_with(&format!(r#","truncate_prompt_tokens":{v}"#)).map(|c| c.keep_last);
        assert_eq!(keep("3"), Ok(Some(KeepLast::Tokens(3))));
        assert_eq!(keep("-1"), Ok(Some(KeepLast::Context)));
        assert_eq!(keep("null"), Ok(None));
        for bad in ["0", "-2", "5000000000"] {
            assert!(keep(bad).is_err_and(|e| e.contains("truncate_prompt_tokens")), "{bad}");
        }
        let ids: Vec<u32> = (1..=10).collect();
        assert_eq!(KeepLast::Tokens(3).apply(ids.clone(), 8).ok(), Some(vec![8, 9, 10]));
        assert_eq!(KeepLast::Tokens(20).apply(ids[..2].to_vec(), 30).ok(), Some(vec![1, 2]), "short: whole");
        assert_eq!(KeepLast::Context.apply(ids.clone(), 4).ok(), Some(vec![7, 8, 9, 10]));
        assert!(KeepLast::Tokens(9).apply(ids, 8).is_err(), "more than the context: refused, as vLLM does");
    }

    #[test]
    fn priorities_are_32_bit_integers_and_0_by_default() {
        let priority = |v: &str| chat_with(&format!(r#","priority":{v}"#)).map(|c| c.priority);
        assert_eq!(priority("-5"), Ok(-5));
        assert_eq!(priority("null"), Ok(0));
        assert_eq!(priority("2147483647"), Ok(i32::MAX));
        assert!(priority("2147483648").is_err_and(|e| e.contains("priority")));
        assert!(priority("1.5").is_err());
    }

    #[test]
    fn forced_tool_calls_are_the_requests_one_grammar() {
        let tools = r#""tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]"#;
        let named = r#""tool_choice":{"type":"function","function":{"name":"f"}}"#;
        let c = chat_with(&format!(",{tools},{named}")).expect("valid");
        assert_eq!(c.tool_calls, Some(super::super::tools::CallMode::Named("f".into())));
        assert_eq!(c.grammar, Some((Grammar::JsonSchema(r#"{"type":"object"}"#.into()), "tool_choice")));
        let both = chat_with(&format!(r#",{tools},{named},"response_format":{{"type":"json_object"}}"#));
        assert!(both.is_err_and(|e| e.contains("cannot also constrain")));
        let c = chat_with(&format!(r#",{tools},"tool_choice":"none""#)).expect("valid");
        assert_eq!((c.tool_calls, c.grammar), (None, None));
        let Input::Chat(_, _, entries) = c.input else { panic!("chat") };
        assert_eq!(entries.len(), 1, "the template still sees the tools");
    }

    /// With Mistral's parser, `auto` keeps the control tokens' text (its marker is one) and call ids are Mistral's;
    /// forced calls and other parsers leave both as they are.
    #[test]
    fn the_parser_sets_what_its_format_needs() {
        use super::super::tools::{CallIds, ToolParser};
        let tools = r#""tools":[{"type":"function","function":{"name":"f"}}]"#;
        let with = |choice: &str, parser| {
            let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],{tools}{choice}}}"#);
            let parsers = OutputParsers { tool_call: parser, ..Default::default() };
            check_chat(body.as_bytes(), parsers).map(|c| (c.keep_control, c.call_ids)).expect("valid")
        };
        assert_eq!(with("", Some(ToolParser::Mistral)), (true, CallIds::Mistral));
        assert_eq!(with(r#","tool_choice":"required""#, Some(ToolParser::Mistral)), (false, CallIds::Mistral));
        assert_eq!(with("", Some(ToolParser::Hermes)), (false, CallIds::OpenAi));
        assert_eq!(with("", Some(ToolParser::Gemma4)), (true, CallIds::OpenAi), "Gemma 4's markers are control tokens");
        assert_eq!(with(r#","tool_choice":"none""#, None), (false, CallIds::OpenAi));
    }

    /// With a reasoning parser, chat answers are split (shown unless `include_reasoning` is false), and a grammar
    /// holds after the thinking as the parser reads it. An assistant turn's thinking goes to the template.
    #[test]
    fn thinking_is_split_as_the_parser_says_and_goes_back_to_the_template() {
        use super::super::reasoning::{ReasoningParser::*, Thinking};
        use engine::grammar::Thinking as Before;
        let checked = |extra: &str, parser| {
            let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}]{extra}}}"#);
            check_chat(body.as_bytes(), OutputParsers { reasoning: parser, ..Default::default() }).expect("valid")
        };
        let with = |extra: &str| checked(extra, Some(DeepSeekR1)).thinking;
        assert_eq!(with(""), Some(Thinking { parser: DeepSeekR1, shown: true }));
        assert_eq!(with(r#","include_reasoning":false"#), Some(Thinking { parser: DeepSeekR1, shown: false }));
        let json = r#","response_format":{"type":"json_object"}"#;
        assert_eq!(with(json), Some(Thinking { parser: DeepSeekR1, shown: true }));
        for (parser, before) in
            [(Some(DeepSeekR1), Before::Open), (Some(Qwen3), Before::Optional), (None, Before::None)]
        {
            assert_eq!(checked(json, parser).grammar_thinking(), before, "{parser:?}");
        }
        // Thinking turned off in Qwen3's template: the grammar from the first token; DeepSeek R1's always thinks.
        let off = format!(r#"{json},"chat_template_kwargs":{{"enable_thinking":false}}"#);
        assert_eq!(checked(&off, Some(Qwen3)).grammar_thinking(), Before::None);
        assert_eq!(checked(&off, Some(DeepSeekR1)).grammar_thinking(), Before::Open);
        // DeepSeek V3.1's and later: R1's thinking when the template arguments turn it on, none otherwise.
        for on in ["thinking", "enable_thinking"] {
            let asked = format!(r#","chat_template_kwargs":{{"{on}":true}}"#);
            assert_eq!(checked(&asked, Some(DeepSeekV3)).thinking, Some(Thinking { parser: DeepSeekR1, shown: true }));
        }
        let off = r#","chat_template_kwargs":{"thinking":false}"#;
        assert_eq!((checked(off, Some(DeepSeekV3)).thinking, checked("", Some(DeepSeekV3)).thinking), (None, None));
        assert_eq!(checked(json, Some(DeepSeekV3)).grammar_thinking(), Before::None);
        // A prompt that opens the block (Qwen3's thinking-only models, GLM 4.7): the answer thinks from its start,
        // and the grammar holds after the thinking; one that closes it leaves `qwen3`'s split as it was.
        let mut opened = checked(json, Some(Qwen3));
        opened.rendered("<|im_start|>assistant\n<think>\n");
        assert_eq!((opened.thinking.map(|t| t.parser), opened.grammar_thinking()), (Some(DeepSeekR1), Before::Open));
        let mut closed = checked(&format!(r#"{json},"chat_template_kwargs":{{"enable_thinking":false}}"#), Some(Qwen3));
        closed.rendered("<|assistant|></think>");
        assert_eq!((closed.thinking.map(|t| t.parser), closed.grammar_thinking()), (Some(Qwen3), Before::None));
        // gpt-oss's messages: a grammar would hold in the final one only, which no worker applies: refused by name.
        let harmony = OutputParsers { reasoning: Some(GptOss), ..Default::default() };
        let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}]{json}}}"#);
        let e = check_chat(body.as_bytes(), harmony).map(|_| ()).expect_err("refused");
        assert!(e.to_string().contains("gpt-oss"), "{e}");
        assert!(checked("", Some(GptOss)).keep_control, "its markers' text is kept");
        // Gemma 4's channel: its markers' text kept; its grammar after the channel, when the answer opens one.
        let gemma = checked(json, Some(Gemma4));
        assert!(gemma.keep_control && !checked(json, Some(Qwen3)).keep_control);
        assert_eq!(gemma.grammar_thinking(), Before::Channel);
        assert_eq!(chat_with("").expect("valid").thinking, None, "no parser");
        let turn = |m: &str| {
            let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}},{m}]}}"#);
            check_chat(body.as_bytes(), OutputParsers::default()).map_err(|e| e.to_string()).map(|c| match c.input {
                Input::Chat(messages, ..) => messages[1].reasoning_content.clone(),
                _ => unreachable!("chat"),
            })
        };
        for m in [
            r#"{"role":"assistant","content":"Yes.","reasoning_content":"Hmm."}"#,
            r#"{"role":"assistant","content":"Yes.","reasoning":"Hmm."}"#,
            r#"{"role":"assistant","content":"Yes.","reasoning":"Hmm.","reasoning_content":"Hmm."}"#,
        ] {
            assert_eq!(turn(m), Ok(Some("Hmm.".into())), "{m}");
        }
        // What OpenAI's clients send back of an answer passes; a field the router does not use is refused by name.
        let sent_back = r#"{"role":"assistant","content":"Yes.","refusal":null,"annotations":[],"audio":null}"#;
        assert_eq!(turn(sent_back), Ok(None));
        for m in [
            r#"{"role":"assistant","content":"Yes.","refusal":"no"}"#,
            r#"{"role":"assistant","content":"Yes.","prefix":true}"#,
        ] {
            assert!(turn(m).is_err_and(|e| e.contains("not supported")), "{m}");
        }
        let differ = turn(r#"{"role":"assistant","content":"","reasoning":"a","reasoning_content":"b"}"#);
        assert!(differ.is_err_and(|e| e.contains("differ")));
        assert!(turn(r#"{"role":"user","content":"x","reasoning":"a"}"#).is_err_and(|e| e.contains("assistant")));
    }

    #[test]
    fn stream_options_ask_only_for_what_is_done() {
        let with = |o: &str| {
            let body = format!(r#"{{"model":"m","prompt":"x","stream":true,"stream_options":{o}}}"#);
            check_completion(body.as_bytes())
                .map(|c| (c.include_usage, c.continuous_usage))
                .map_err(|e| e.body()["error"].clone())
        };
        assert_eq!(
            with(r#"{"include_usage":true,"continuous_usage_stats":false,"include_obfuscation":true}"#),
            Ok((true, false))
        );
        assert_eq!(with(r#"{"include_usage":true,"continuous_usage_stats":true}"#), Ok((true, true)));
        assert_eq!(with("{}"), Ok((false, false)));
        for (options, word) in [
            (r#"{"continuous_usage_stats":true}"#, "include_usage"),
            (r#"{"include_usage":true,"usage_every":3}"#, "usage_every"),
        ] {
            let e = with(options).expect_err(options);
            assert_eq!(e["param"], "stream_options", "{e}");
            assert!(e["message"].as_str().is_some_and(|m| m.contains(word)), "{e}");
        }
    }

    #[test]
    fn bad_requests_say_what_is_wrong() {
        assert_eq!(bad("{").0, "malformed_json");
        assert_eq!(bad(r#"{"model":"m"}"#).0, "malformed_json");
        assert_eq!(bad(r#"{"model":"m","messages":[]}"#).0, "bad_request");
        assert!(bad(r#"{"messages":[{"role":"user","content":"x"}]}"#).1.contains("model"));
        assert!(
            bad(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":3}"#)
                .1
                .contains("temperature")
        );
        assert!(bad(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"top_p":0}"#).1.contains("top_p"));
        assert!(bad(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":9}"#).1.contains("between 1 and 8"));
        assert!(
            bad(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":0}"#).1.contains("max_tokens")
        );
        assert!(bad(r#"{"model":"m","messages":[{"role":"wizard","content":"x"}]}"#).1.contains("role"));
        assert!(
            bad(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stop":["a","b","c","d","e"]}"#)
                .1
                .contains("stop")
        );
        let batch = check_completion(br#"{"model":"m","prompt":["a","b"],"n":2}"#).expect("a batch");
        assert_eq!((batch.batch.len(), batch.n), (1, 2), "the first prompt is the request's input, the rest follow");
    }

    #[test]
    fn the_prompts_log_probabilities_are_asked_by_echo_with_logprobs_or_by_prompt_logprobs() {
        let c = |body: &str| check_completion(body.as_bytes());
        let plain = c(r#"{"model":"m","prompt":"a","logprobs":2}"#).expect("valid");
        assert_eq!(plain.scored_prompt(), None, "logprobs alone are the output's");
        let echoed = c(r#"{"model":"m","prompt":"a","echo":true,"logprobs":2}"#).expect("valid");
        assert_eq!((echoed.scored_prompt(), echoed.echo_only, echoed.max_tokens), (Some(2), false, None));
        assert_eq!(c(r#"{"model":"m","prompt":"a","echo":true}"#).expect("valid").scored_prompt(), None);
        // vLLM's field, alone or with a larger echo: the workers are asked for the larger.
        let vllm = c(r#"{"model":"m","prompt":"a","prompt_logprobs":0}"#).expect("valid");
        assert_eq!((vllm.prompt_logprobs, vllm.scored_prompt()), (Some(0), Some(0)));
        let both = c(r#"{"model":"m","prompt":"a","echo":true,"logprobs":3,"prompt_logprobs":1}"#).expect("valid");
        assert_eq!(both.scored_prompt(), Some(3));
        let chat = check_chat(
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"prompt_logprobs":4}"#,
            OutputParsers::default(),
        );
        assert_eq!(chat.expect("valid").scored_prompt(), Some(4));
        // `echo` with `max_tokens` 0 is the prompt alone: one token is computed, and left out.
        let only = c(r#"{"model":"m","prompt":"a","echo":true,"logprobs":1,"max_tokens":0}"#).expect("valid");
        assert_eq!((only.echo_only, only.max_tokens, only.scored_prompt()), (true, Some(1), Some(1)));
        let e = c(r#"{"model":"m","prompt":"a","max_tokens":0}"#).expect_err("no tokens, nothing echoed");
        assert_eq!(e.body()["error"]["param"], "max_tokens");
        for (body, why) in [
            (r#"{"model":"m","prompt":"a","prompt_logprobs":-1}"#, "from 0 to 20"),
            (r#"{"model":"m","prompt":"a","prompt_logprobs":21}"#, "from 0 to 20"),
            (r#"{"model":"m","prompt":"a","prompt_logprobs":1,"stream":true}"#, "streaming"),
        ] {
            let e = c(body).expect_err(body);
            assert_eq!(e.body()["error"]["param"], "prompt_logprobs", "{body}");
            assert!(e.to_string().contains(why), "{body}: {e}");
        }
    }
}

#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// Whatever a client sends, the checks answer with a value or an error, never a panic.
        #[test]
        fn arbitrary_bodies_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = check_chat(&body, OutputParsers::default());
            let _ = check_completion(&body);
        }

        /// Well-formed JSON with wild field values: still a value or an error.
        #[test]
        fn wild_field_values_never_panic(
            t in any::<f32>(), p in any::<f32>(), k in any::<u32>(), m in any::<u32>(), n in any::<u32>(),
            stop in proptest::collection::vec(".{0,8}", 0..6), content in ".{0,64}", role in "[a-z]{0,10}",
        ) {
            let body = serde_json::json!({
                "model": "m", "temperature": t, "top_p": p, "top_k": k, "max_tokens": m, "n": n, "stop": stop,
                "messages": [{"role": role, "content": content}], "prompt": content,
            });
            let bytes = body.to_string().into_bytes();
            if let Ok(c) = check_chat(&bytes, OutputParsers::default()) {
                prop_assert!(c.temperature >= 0.0 && c.temperature <= 2.0 && c.top_p > 0.0 && c.top_p <= 1.0);
                prop_assert!(c.max_tokens != Some(0) && c.stop.len() <= 4);
            }
            let _ = check_completion(&bytes);
        }
    }
}
