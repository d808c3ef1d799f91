//! A tiktoken vocabulary (`tiktoken.model`: a line per token, its bytes in base64 and its rank) written as a
//! vocabulary-only GGUF, as [`super::tekken`] writes Mistral's: the file a router fronting vLLM or SGLang servers of
//! Kimi K2 reads, from Kimi's directory (`tiktoken.model`, `tokenizer_config.json`, and `tokenization_kimi.py`,
//! which vLLM runs). The ranks become tokens joined as tiktoken joins them ([`super::tekken::ranked_tokens`]), then
//! come the special ids: Kimi's tokenizer keeps 256 after the ranked tokens, named by the config's
//! `added_tokens_decoder` or `<|reserved_token_N|>`. A `tiktoken.model` says nothing of its split pattern (it is in
//! the Python code beside it), so one is read only where that code is known: Kimi's, named by the config's
//! `auto_map`, whose pattern is [`super::pretokenize::KIMI_K2_PATTERN`].

use base64::Engine as _;
use serde_json::Value;

use super::import::{self, Vocabulary};
use super::{TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED, TokenizerError};
use crate::gguf::GgufWriter;

/// The special ids Kimi's tokenizer keeps after the ranked tokens (`num_reserved_special_tokens`).
const KIMI_SPECIALS: usize = 256;
/// The most ranked tokens a file may hold (the largest vocabularies have a few hundred thousand).
const MAX_RANKS: usize = 1 << 22;

/// The vocabulary GGUF for `model` (a `tiktoken.model`'s text) and `config` (the directory's parsed
/// `tokenizer_config.json`: which tokenizer it is, its special tokens, its chat template).
pub fn vocabulary_gguf(model: &str, config: &Value) -> Result<GgufWriter, TokenizerError> {
    let malformed = |why: String| TokenizerError::MalformedJson(why);
    let tokenizer = config.pointer("/auto_map/AutoTokenizer/0").and_then(Value::as_str).unwrap_or("none");
    if !tokenizer.starts_with("tokenization_kimi.") {
        let why = format!(
            "a tiktoken.model of the tokenizer {tokenizer:?}: its split pattern is in that tokenizer's code, and \
             only Kimi's (tokenization_kimi) is known"
        );
        return Err(TokenizerError::UnsupportedModel(why));
    }
    let mut ranked = Vec::new();
    for (i, line) in model.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let token = match line.split_whitespace().collect::<Vec<_>>()[..] {
            [b64, rank] if rank.parse::<usize>() == Ok(i) && i < MAX_RANKS => {
                base64::engine::general_purpose::STANDARD.decode(b64).ok().filter(|t| !t.is_empty())
            }
            _ => None,
        };
        let why =
            || malformed(format!("tiktoken.model line {} is not rank {i}'s bytes (of at most {MAX_RANKS})", i + 1));
        ranked.push(token.ok_or_else(why)?);
    }
    let (mut tokens, merges) = super::tekken::ranked_tokens(&ranked)?;
    let mut types = vec![TOKEN_TYPE_NORMAL as i32; tokens.len()];
    let first = tokens.len();
    let added = config["added_tokens_decoder"].as_object();
    for id in first..first + KIMI_SPECIALS {
        let entry = added.and_then(|a| a.get(&id.to_string()));
        let text = match entry {
            None => format!("<|reserved_token_{}|>", id - first),
            Some(e) => e["content"].as_str().ok_or_else(|| malformed(format!("added token {id}: {e}")))?.to_string(),
        };
        tokens.push(text);
        let control = entry.is_none_or(|e| e["special"] != false);
        types.push(if control { TOKEN_TYPE_CONTROL } else { TOKEN_TYPE_USER_DEFINED } as i32);
    }
    let specials = first..first + KIMI_SPECIALS;
    if let Some((id, _)) =
        added.into_iter().flatten().find(|(id, _)| !id.parse().is_ok_and(|id| specials.contains(&id)))
    {
        return Err(malformed(format!("added token {id} is not one of the special ids {specials:?}")));
    }
    if tokens[first..].iter().collect::<std::collections::HashSet<_>>().len() != KIMI_SPECIALS {
        return Err(malformed("two special tokens have the same text".into()));
    }
    // Among the special ids only: a ranked token may spell `[BOS]` too.
    let named = |key: &str| import::named_id(&tokens, first, Some(config), key);
    let (bos, eos) = (named("bos_token"), named("eos_token"));
    let add_bos = config["add_bos_token"].as_bool().unwrap_or(false);
    Ok(import::write(Vocabulary { pre: "kimi-k2", tokens, types, merges, bos, eos, add_bos }, Some(config)))
}

#[cfg(test)]
pub(crate) mod tests {
    use base64::Engine as _;
    use proptest::prelude::Strategy as _;
    use serde_json::json;

    use super::*;

    /// tiktoken's joining, written plainly (`rank` gives each token's id; every single byte has one): the whole piece
    /// if it is a token; else, from single bytes, the adjacent pair whose join is the lowest-ranked token, the
    /// leftmost of equals, until no join is a token.
    pub fn plain(rank: impl Fn(&[u8]) -> Option<u32>, piece: &str) -> Vec<u32> {
        if let Some(r) = rank(piece.as_bytes()) {
            return vec![r];
        }
        let mut parts: Vec<Vec<u8>> = piece.bytes().map(|b| vec![b]).collect();
        loop {
            let joins = (0..parts.len().saturating_sub(1))
                .filter_map(|i| Some((rank(&[parts[i].clone(), parts[i + 1].clone()].concat())?, i)));
            let Some((_, i)) = joins.min() else { break };
            let right = parts.remove(i + 1);
            parts[i].extend(right);
        }
        parts.iter().map(|p| rank(p).expect("every byte is a token")).collect()
    }

    /// A `tiktoken.model` of `ranked` (each token's bytes, by rank).
    fn model(ranked: &[Vec<u8>]) -> String {
        let b64 = |t: &[u8]| base64::engine::general_purpose::STANDARD.encode(t);
        ranked.iter().enumerate().map(|(r, t)| format!("{} {r}\n", b64(t))).collect()
    }

    fn kimi_config() -> Value {
        json!({"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]},
               "added_tokens_decoder": {}, "bos_token": "[BOS]", "eos_token": "[EOS]",
               "chat_template": "{% for m in messages %}<|im_user|>{{ m.content }}<|im_end|>{% endfor %}"})
    }

    /// The tokenizer `ranked` and `config` make, through a GGUF file.
    fn tokenizer(ranked: &[Vec<u8>], config: &Value) -> crate::tokenizer::Tokenizer {
        let path = std::env::temp_dir().join(format!(
            "tandem-tiktoken-{}-{:?}.gguf",
            std::process::id(),
            std::thread::current().id()
        ));
        vocabulary_gguf(&model(ranked), config).expect("a vocabulary").write(&path).expect("written");
        let tok =
            crate::tokenizer::Tokenizer::from_gguf(&crate::gguf::GgufFile::open(&path).expect("opens")).expect("loads");
        let _ = std::fs::remove_file(&path);
        tok
    }

    proptest::proptest! {
        /// The 256 bytes at any ranks among tokens of `a`, `b` and `c` in any order: each piece of Kimi K2's split
        /// encodes as tiktoken encodes it.
        #[test]
        fn a_tiktoken_vocabulary_joins_as_tiktoken(
            bytes in proptest::strategy::Just((0..=255u8).collect::<Vec<u8>>()).prop_shuffle(),
            more in proptest::sample::subsequence(
                vec!["ab", "ba", "aa", "bc", "ca", "cb", "aba", "bab", "abc", "cab", "bca", "abab", "cc", " a", "中文"], 4..15,
            ).prop_shuffle(),
            at in 0usize..256,
            text in "[abc 中文]{1,14}".prop_map(String::from),
        ) {
            let mut ranked: Vec<Vec<u8>> = bytes.iter().map(|&b| vec![b]).collect();
            for (k, t) in more.iter().enumerate() {
                ranked.insert((at + k).min(ranked.len()), t.as_bytes().to_vec());
            }
            let tok = tokenizer(&ranked, &kimi_config());
            let rank = |t: &[u8]| ranked.iter().position(|r| r == t).map(|r| r as u32);
            let mut want = Vec::new();
            crate::tokenizer::pretokenize::Pre::KimiK2.split(&text, |piece| want.extend(plain(rank, piece)));
            proptest::prop_assert_eq!(tok.encode_ordinary(&text), want);
        }
    }

    /// Kimi's special ids follow the ranked tokens: named by `added_tokens_decoder`, reserved otherwise; the BOS and
    /// EOS are the config's, and a chat's markers are single special ids.
    #[test]
    fn special_ids_follow_the_ranks() {
        let ranked: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).chain([b"ab".to_vec()]).collect();
        let mut config = kimi_config();
        config["added_tokens_decoder"] = json!({
            "257": {"content": "[BOS]", "special": true}, "258": {"content": "[EOS]", "special": true},
            "259": {"content": "<|im_end|>", "special": true}, "260": {"content": "<|im_user|>", "special": true}});
        let tok = tokenizer(&ranked, &config);
        assert_eq!(tok.vocab_size(), 257 + 256);
        assert_eq!((tok.special().bos, tok.special().eos), (Some(257), Some(258)));
        assert_eq!(tok.special_id("<|reserved_token_4|>"), Some(261));
        assert_eq!(tok.encode_chat("<|im_user|>ab<|im_end|>"), vec![260, 256, 259]);
        assert!(tok.is_end_of_generation(259));
    }

    #[test]
    fn other_files_are_refused_by_what_is_wrong() {
        let ranked: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        let refused =
            |model: &str, config: &Value| vocabulary_gguf(model, config).map(|_| ()).expect_err("refused").to_string();
        let mut other = kimi_config();
        other["auto_map"] = json!({"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", null]});
        assert!(refused(&model(&ranked), &other).contains("tokenization_qwen"));
        assert!(refused(&model(&ranked[1..]), &kimi_config()).contains("byte 0x00"));
        assert!(refused("YQ== 1\n", &kimi_config()).contains("line 1"));
        let mut outside = kimi_config();
        outside["added_tokens_decoder"] = json!({"9": {"content": "<x>", "special": true}});
        assert!(refused(&model(&ranked), &outside).contains("added token 9"));
    }
}
