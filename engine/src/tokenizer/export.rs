//! The GGUF's tokenizer written as a Hugging Face `tokenizer.json` (and a `tokenizer_config.json`), for tools
//! that load a tokenizer directory (aiperf, vLLM's benchmark): the same vocabulary, merges, special tokens,
//! pre-tokenizer (digits isolated, then GPT-2's byte-level split) and chat template.

use serde_json::{Value, json};

use super::{TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TokenizerError};
use crate::gguf::{GgufFile, MetaArray};

/// `tokenizer.json` and `tokenizer_config.json` for the tokenizer `file` describes.
pub fn hugging_face_files(file: &GgufFile) -> Result<(Value, Value), TokenizerError> {
    let meta = file.metadata();
    let strings = |key: &'static str| match meta.get(key).and_then(|v| v.as_array()) {
        Some(MetaArray::String(v)) => Ok(v.clone()),
        _ => Err(TokenizerError::Missing { key }),
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = strings("tokenizer.ggml.merges")?;
    let types = meta
        .get("tokenizer.ggml.token_type")
        .and_then(|v| v.as_array())
        .and_then(MetaArray::to_i64s)
        .filter(|t| t.len() == tokens.len())
        .unwrap_or_else(|| vec![1; tokens.len()]);
    let pre = meta.get("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("default");
    super::pretokenize::check_supported(pre)?;
    let digits = super::pretokenize::isolates_digits(pre);
    let id_of = |k: &str| meta.get(k).and_then(|v| v.as_u64()).and_then(|v| usize::try_from(v).ok());
    let name_of = |k: &str| id_of(k).and_then(|i| tokens.get(i)).cloned();
    let added: Vec<Value> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (t, ty))| matches!(**ty, TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED) && !t.is_empty())
        .map(|(id, (t, ty))| {
            json!({"id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": *ty == TOKEN_TYPE_CONTROL})
        })
        .collect();
    let vocab: serde_json::Map<String, Value> =
        tokens.iter().enumerate().map(|(i, t)| (t.clone(), Value::from(i))).collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let pre_tokenizer = if digits {
        json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level]})
    } else {
        byte_level.clone()
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
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges},
    });
    let mut config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": meta.get("llama.context_length").and_then(|v| v.as_u64()).unwrap_or(2048),
        "add_bos_token": meta.get("tokenizer.ggml.add_bos_token").and_then(|v| v.as_bool()).unwrap_or(false),
        "clean_up_tokenization_spaces": false,
    });
    for (key, gguf) in [("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id")] {
        if let Some(t) = name_of(gguf) {
            config[key] = t.into();
        }
    }
    if let Some(t) = meta.get("tokenizer.chat_template").and_then(|v| v.as_str()) {
        config["chat_template"] = t.into();
    }
    Ok((tokenizer, config))
}
