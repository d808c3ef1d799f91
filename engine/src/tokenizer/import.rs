//! A Hugging Face tokenizer (`tokenizer.json`, with `tokenizer_config.json` for the special tokens and the chat
//! template) written as a vocabulary-only GGUF: the file a router reads its tokenizer and chat template from when it
//! fronts vLLM or SGLang servers of a model whose weights it never loads. Byte-level BPE only, with a pre-tokenizer
//! this tokenizer implements, recognised by what `tokenizer.json` states (its split patterns, or GPT-2's); anything
//! else is refused by name, never approximated. The mirror of [`super::export`].

use serde_json::Value;

use super::pretokenize::Pre;
use super::{TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED, TokenizerError};
use crate::gguf::GgufWriter;
use crate::gguf::{MetaArray, MetaValue};

/// The vocabulary GGUF for `tokenizer` (a parsed `tokenizer.json`) and `config` (a parsed `tokenizer_config.json`,
/// when there is one: the BOS and EOS tokens, whether prompts start with BOS, the chat template).
pub fn vocabulary_gguf(tokenizer: &Value, config: Option<&Value>) -> Result<GgufWriter, TokenizerError> {
    let malformed = |why: String| TokenizerError::MalformedJson(why);
    let model = &tokenizer["model"];
    if model["type"] != "BPE" || model["byte_fallback"] == true {
        let kind = model["type"].as_str().unwrap_or("unnamed");
        let what = if kind == "BPE" { "BPE with byte fallback".to_string() } else { kind.to_string() };
        return Err(TokenizerError::UnsupportedModel(what));
    }
    let (pre, name) = pre_tokenizer(&tokenizer["pre_tokenizer"])?;
    if model["ignore_merges"].as_bool().unwrap_or(false) != pre.ignores_merges() {
        return Err(TokenizerError::UnsupportedPre(format!("{name} with ignore_merges {}", model["ignore_merges"])));
    }
    let vocab = model["vocab"].as_object().ok_or_else(|| malformed("no model.vocab".into()))?;
    let added = tokenizer["added_tokens"].as_array().map(Vec::as_slice).unwrap_or_default();
    let size =
        vocab.values().chain(added.iter().map(|a| &a["id"])).filter_map(Value::as_u64).max().map_or(0, |m| m + 1);
    // Ids are 0 to N - 1, each named once or more: no more of them than names.
    if size > (vocab.len() + added.len()) as u64 {
        let why = format!("token ids up to {} for {} tokens: ids are not 0 to N - 1", size - 1, vocab.len());
        return Err(malformed(why));
    }
    let mut tokens = vec![None; size as usize];
    let mut types = vec![TOKEN_TYPE_NORMAL as i32; tokens.len()];
    for (text, id) in vocab {
        let id = id.as_u64().ok_or_else(|| malformed(format!("token {text:?} has id {id}")))?;
        tokens[id as usize] = Some(text.clone());
    }
    for a in added {
        let (Some(id), Some(text)) = (a["id"].as_u64(), a["content"].as_str()) else {
            return Err(malformed(format!("an added token without id or content: {a}")));
        };
        tokens[id as usize] = Some(text.to_string());
        types[id as usize] = if a["special"] == true { TOKEN_TYPE_CONTROL } else { TOKEN_TYPE_USER_DEFINED } as i32;
    }
    let tokens = tokens
        .into_iter()
        .enumerate()
        .map(|(id, t)| t.ok_or_else(|| malformed(format!("no token has id {id}"))))
        .collect::<Result<Vec<String>, _>>()?;
    let merges = model["merges"]
        .as_array()
        .ok_or_else(|| malformed("no model.merges".into()))?
        .iter()
        .map(|m| match m {
            // Older files write each merge as "a b", newer ones as ["a", "b"].
            Value::String(s) => Some(s.clone()),
            Value::Array(pair) => match pair.as_slice() {
                [Value::String(a), Value::String(b)] => Some(format!("{a} {b}")),
                _ => None,
            },
            _ => None,
        })
        .collect::<Option<Vec<String>>>()
        .ok_or_else(|| malformed("a merge that is not two tokens".into()))?;
    let (bos, eos) = (named_id(&tokens, 0, config, "bos_token"), named_id(&tokens, 0, config, "eos_token"));
    let add_bos = config.and_then(|c| c["add_bos_token"].as_bool()).unwrap_or(false);
    Ok(write(Vocabulary { pre: name, tokens, types, merges, bos, eos, add_bos }, config))
}

/// What a byte-level BPE vocabulary GGUF holds.
pub(super) struct Vocabulary {
    /// The pre-tokenizer's GGUF name.
    pub pre: &'static str,
    /// Each token's text (byte-level BPE's spelling of its bytes; a special token's own text), by id.
    pub tokens: Vec<String>,
    pub types: Vec<i32>,
    /// `"left right"`, the first the most preferred.
    pub merges: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
}

/// The GGUF of `v`, with the chat template `config` (a parsed `tokenizer_config.json`) gives.
pub(super) fn write(v: Vocabulary, config: Option<&Value>) -> GgufWriter {
    let mut w = GgufWriter::new();
    w.meta("general.architecture", MetaValue::String("llama".into()))
        .meta("general.type", MetaValue::String("vocab".into()))
        .meta("tokenizer.ggml.model", MetaValue::String("gpt2".into()))
        .meta("tokenizer.ggml.pre", MetaValue::String(v.pre.into()))
        .meta("tokenizer.ggml.tokens", MetaValue::Array(MetaArray::String(v.tokens)))
        .meta("tokenizer.ggml.token_type", MetaValue::Array(MetaArray::I32(v.types)))
        .meta("tokenizer.ggml.merges", MetaValue::Array(MetaArray::String(v.merges)));
    for (key, id) in [("tokenizer.ggml.bos_token_id", v.bos), ("tokenizer.ggml.eos_token_id", v.eos)] {
        if let Some(id) = id {
            w.meta(key, MetaValue::U32(id));
        }
    }
    w.meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(v.add_bos));
    if let Some(template) = config.and_then(|c| chat_template(&c["chat_template"])) {
        w.meta("tokenizer.chat_template", MetaValue::String(template));
    }
    w
}

/// The id of the token `config` names under `key` (transformers' spellings: the token's text, or an object with its
/// `content`), looked for from id `from` on (where a vocabulary's special tokens start).
pub(super) fn named_id(tokens: &[String], from: usize, config: Option<&Value>, key: &str) -> Option<u32> {
    let v = &config?[key];
    let text = v.as_str().or_else(|| v["content"].as_str())?;
    tokens.get(from..)?.iter().position(|t| t == text).map(|i| (from + i) as u32)
}

/// The pre-tokenizer `tokenizer.json` states, and its GGUF name (llama.cpp's).
fn pre_tokenizer(v: &Value) -> Result<(Pre, &'static str), TokenizerError> {
    let byte_level = |v: &Value, regex: bool| v["type"] == "ByteLevel" && v["use_regex"].as_bool() == Some(regex);
    let steps = match v["type"].as_str() {
        Some("Sequence") => v["pretokenizers"].as_array().map(Vec::as_slice).unwrap_or_default(),
        _ => std::slice::from_ref(v),
    };
    let named = match steps {
        [b] if byte_level(b, true) => Some((Pre::Gpt2, "gpt2")),
        [d, b] if d["type"] == "Digits" && d["individual_digits"] == true && byte_level(b, true) => {
            Some((Pre::DigitsThenGpt2, "smollm"))
        }
        [splits @ .., b] if byte_level(b, false) => {
            let isolating = |s: &Value| s["type"] == "Split" && s["behavior"] == "Isolated" && s["invert"] != true;
            // A line break in a pattern is written escaped (`\n`) in some files and as itself in others.
            let spelled = |p: &str| p.replace('\r', "\\r").replace('\n', "\\n");
            let patterns: Option<Vec<String>> = splits
                .iter()
                .map(|s| isolating(s).then(|| s["pattern"]["Regex"].as_str().map(spelled)).flatten())
                .collect();
            let known = |pre: Pre| pre.patterns().iter().map(|p| spelled(p)).collect::<Vec<_>>();
            [
                (Pre::Llama3, "llama-bpe"),
                (Pre::Qwen2, "qwen2"),
                (Pre::Qwen35, "qwen35"),
                (Pre::DeepSeekV3, "deepseek-v3"),
                (Pre::Tekken, "tekken"),
                (Pre::Gpt4o, "gpt-4o"),
                (Pre::KimiK2, "kimi-k2"),
                (Pre::SeedCoder, "seed-coder"),
            ]
            .into_iter()
            .find(|(pre, _)| patterns.as_ref() == Some(&known(*pre)))
        }
        _ => None,
    };
    named.ok_or_else(|| TokenizerError::UnsupportedPre(format!("the pre-tokenizer {v}")))
}

/// The chat template `tokenizer_config.json` gives: one text, or the one named `default` among several.
fn chat_template(v: &Value) -> Option<String> {
    match v {
        Value::String(t) => Some(t.clone()),
        Value::Array(named) => named.iter().find(|t| t["name"] == "default")?["template"].as_str().map(String::from),
        _ => None,
    }
}
