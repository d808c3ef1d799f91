//! The GGUF's tokenizer written as a Hugging Face `tokenizer.json` (and a `tokenizer_config.json`), for tools
//! that load a tokenizer directory (aiperf, vLLM's benchmark): the same vocabulary, merges, special tokens,
//! pre-tokenizer (digits isolated, then GPT-2's byte-level split) and chat template.

use serde_json::{Value, json};

use super::{GgufVocab, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TokenizerError};
use crate::gguf::GgufFile;

/// `tokenizer.json` and `tokenizer_config.json` for the tokenizer `file` describes.
pub fn hugging_face_files(file: &GgufFile) -> Result<(Value, Value), TokenizerError> {
    let meta = file.metadata();
    let v = GgufVocab::read(file)?;
    if v.scores.is_some() || v.model == "gemma4" {
        let why = format!("{} (spaces written as ▁: not written as tokenizer.json here)", v.model);
        return Err(TokenizerError::UnsupportedModel(why));
    }
    let name_of = |id: Option<u32>| id.and_then(|i| v.tokens.get(i as usize)).cloned();
    let added: Vec<Value> = v
        .tokens
        .iter()
        .zip(&v.types)
        .enumerate()
        .filter(|(_, (t, ty))| matches!(**ty, TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED) && !t.is_empty())
        .map(|(id, (t, ty))| {
            json!({"id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": *ty == TOKEN_TYPE_CONTROL})
        })
        .collect();
    let vocab: serde_json::Map<String, Value> =
        v.tokens.iter().enumerate().map(|(i, t)| (t.clone(), Value::from(i))).collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let pre = super::pretokenize::Pre::of(v.pre)?;
    let pre_tokenizer = match (pre, pre.patterns()) {
        (super::pretokenize::Pre::DigitsThenGpt2, _) => {
            json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level]})
        }
        (_, []) => byte_level.clone(),
        (_, patterns) => {
            let mut steps: Vec<Value> = patterns
                .iter()
                .map(|p| json!({"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": false}))
                .collect();
            steps.push(
                json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}),
            );
            json!({"type": "Sequence", "pretokenizers": steps})
        }
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": pre.ignores_merges(),
                  "vocab": vocab, "merges": v.merges},
    });
    let mut config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": meta.get("llama.context_length").and_then(|v| v.as_u64()).unwrap_or(2048),
        "add_bos_token": v.add_bos,
        "clean_up_tokenization_spaces": false,
    });
    for (key, id) in [("bos_token", v.bos), ("eos_token", v.eos)] {
        if let Some(t) = name_of(id) {
            config[key] = t.into();
        }
    }
    if let Some(t) = meta.get("tokenizer.chat_template").and_then(|v| v.as_str()) {
        config["chat_template"] = t.into();
    }
    Ok((tokenizer, config))
}
