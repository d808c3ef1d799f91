//! Mistral's Tekken vocabulary (`tekken.json`: Mistral NeMo's, Pixtral's, Mistral Small's, Devstral's...) written
//! as a vocabulary-only GGUF, as [`super::import`] writes a Hugging Face one: the file a router fronting vLLM servers
//! of those models reads (vLLM's `--tokenizer-mode mistral` encodes with this file through mistral_common). A Tekken
//! file is tiktoken's form: tokens by rank as bytes, no merges, and a number of ids ahead of them kept for special
//! tokens. tiktoken merges, at each step, the adjacent pair whose joined bytes are the token of the lowest rank,
//! after looking the whole piece up; the GGUF states that as merges of every split of each token into two tokens,
//! in the order of the tokens they make, under the pre-tokenizer `tekken` (which looks a piece up whole first).

use std::collections::HashMap;

use base64::Engine as _;
use serde_json::Value;

use super::import::{self, Vocabulary};
use super::pretokenize::TEKKEN_PATTERN;
use super::{TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED, TokenizerError, bytes};
use crate::gguf::GgufWriter;

/// The most token ids a file may state (the largest vocabularies have a few hundred thousand).
const MAX_IDS: usize = 1 << 22;

/// The special tokens of a file that lists none (mistral_common's for versions up to v7), by rank from 0.
const DEFAULT_SPECIALS: [&str; 20] = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
];

/// The vocabulary GGUF for `tekken` (a parsed `tekken.json`) and `config` (a parsed `tokenizer_config.json`, when
/// the model's directory has one: its chat template, whether prompts start with BOS).
pub fn vocabulary_gguf(tekken: &Value, config: Option<&Value>) -> Result<GgufWriter, TokenizerError> {
    let malformed = |why: String| TokenizerError::MalformedJson(why);
    let settings = &tekken["config"];
    let pattern = settings["pattern"].as_str().ok_or_else(|| malformed("no config.pattern".into()))?;
    if pattern != TEKKEN_PATTERN {
        return Err(TokenizerError::UnsupportedPre(format!("the Tekken pattern {pattern:?}")));
    }
    let count =
        |key: &str| settings[key].as_u64().map(|n| n as usize).ok_or_else(|| malformed(format!("no config.{key}")));
    let (size, special_count) = (count("default_vocab_size")?, count("default_num_special_tokens")?);
    // The special ids become tokens of their own: a count no vocabulary has would be memory no machine has.
    if size > MAX_IDS {
        return Err(malformed(format!("{size} token ids, more than any vocabulary has ({MAX_IDS})")));
    }
    let listed = tekken["vocab"].as_array().ok_or_else(|| malformed("no vocab".into()))?;
    // mistral_common keeps the first `size - special_count` tokens of the list.
    let inner = size.checked_sub(special_count).filter(|&n| n <= listed.len() && n >= 256).ok_or_else(|| {
        malformed(format!("{size} ids with {special_count} special for {} listed tokens", listed.len()))
    })?;
    let mut ranked: Vec<Vec<u8>> = Vec::with_capacity(inner);
    for (i, entry) in listed[..inner].iter().enumerate() {
        let b64 = entry["token_bytes"].as_str().filter(|_| entry["rank"].as_u64() == Some(i as u64));
        let token = b64
            .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
            .filter(|t| !t.is_empty() && (i >= 256 || t[..] == [i as u8]))
            .ok_or_else(|| malformed(format!("vocab entry {i} is not rank {i}'s bytes: {entry}")))?;
        ranked.push(token);
    }
    let (spelled, merges) = ranked_tokens(&ranked)?;
    let (specials, control) = special_tokens(tekken, special_count)?;
    let mut types: Vec<i32> =
        control.iter().map(|&c| if c { TOKEN_TYPE_CONTROL } else { TOKEN_TYPE_USER_DEFINED } as i32).collect();
    types.resize(special_count + inner, TOKEN_TYPE_NORMAL as i32);
    let mut tokens = specials;
    tokens.extend(spelled);
    let id_of = |name: &str| tokens[..special_count].iter().position(|t| t == name).map(|i| i as u32);
    let add_bos = config.and_then(|c| c["add_bos_token"].as_bool()).unwrap_or(true);
    let (bos, eos) = (id_of("<s>"), id_of("</s>"));
    Ok(import::write(Vocabulary { pre: "tekken", tokens, types, merges, bos, eos, add_bos }, config))
}

/// tiktoken's tokens by rank (`ranked`, each token's bytes; every single byte among them) as byte-level BPE's
/// spelling of them, and the merges that join as tiktoken joins: every split of a token into two tokens, in rank
/// order (the pair whose join ranks lowest is joined first).
pub(super) fn ranked_tokens(ranked: &[Vec<u8>]) -> Result<(Vec<String>, Vec<String>), TokenizerError> {
    let malformed = |why: String| TokenizerError::MalformedJson(why);
    let rank_of: HashMap<&[u8], u32> = ranked.iter().enumerate().map(|(r, t)| (t.as_slice(), r as u32)).collect();
    if rank_of.len() != ranked.len() {
        return Err(malformed("two tokens of the vocab have the same bytes".into()));
    }
    if let Some(b) = (0..=255u8).find(|b| !rank_of.contains_key(&[*b][..])) {
        return Err(malformed(format!("byte {b:#04x} is not a token of its own")));
    }
    let spell = |t: &[u8]| t.iter().map(|&b| bytes::byte_to_char(b)).collect::<String>();
    let mut merges = Vec::new();
    for token in ranked.iter().filter(|t| t.len() > 1) {
        for k in 1..token.len() {
            let (left, right) = token.split_at(k);
            if rank_of.contains_key(left) && rank_of.contains_key(right) {
                merges.push(format!("{} {}", spell(left), spell(right)));
            }
        }
    }
    Ok((ranked.iter().map(|t| spell(t)).collect(), merges))
}

/// The special tokens' texts by id (those the file lists, then mistral_common's fillers up to `count`) and whether
/// each is a control token.
fn special_tokens(tekken: &Value, count: usize) -> Result<(Vec<String>, Vec<bool>), TokenizerError> {
    let malformed = |why: String| TokenizerError::MalformedJson(why);
    let named: Vec<(String, bool)> = match tekken["special_tokens"].as_array() {
        Some(list) => list
            .iter()
            .enumerate()
            .map(|(i, s)| match (s["rank"].as_u64(), s["token_str"].as_str()) {
                (Some(r), Some(text)) if r == i as u64 => Ok((text.to_string(), s["is_control"] != false)),
                _ => Err(malformed(format!("special token {i} is not rank {i}'s: {s}"))),
            })
            .collect::<Result<_, _>>()?,
        None => {
            // As mistral_common: files of versions after v7 must list theirs.
            let version = tekken["config"]["version"].as_str().unwrap_or("v3");
            if version.strip_prefix('v').and_then(|n| n.parse::<u32>().ok()).is_none_or(|n| n > 7) {
                return Err(malformed(format!("a Tekken file of version {version} that lists no special tokens")));
            }
            DEFAULT_SPECIALS.iter().map(|s| (s.to_string(), true)).collect()
        }
    };
    if named.len() > count {
        return Err(malformed(format!("{} special tokens for {count} special ids", named.len())));
    }
    let fillers = (named.len()..count).map(|i| (format!("<SPECIAL_{i}>"), true));
    let (texts, control): (Vec<String>, Vec<bool>) = named.into_iter().chain(fillers).unzip();
    if texts.iter().collect::<std::collections::HashSet<_>>().len() != texts.len() {
        return Err(malformed("two special tokens have the same text".into()));
    }
    Ok((texts, control))
}

#[cfg(test)]
mod tests {
    use base64::Engine as _;
    use proptest::prelude::Strategy as _;
    use serde_json::{Value, json};

    use super::*;

    /// A Tekken file of the 256 bytes and `more` tokens, `specials` ids ahead of them.
    fn file(more: &[&str], specials: usize, version: &str) -> Value {
        let b64 = |t: &[u8]| base64::engine::general_purpose::STANDARD.encode(t);
        let mut vocab: Vec<Value> = (0..=255u8).map(|b| json!({"rank": b, "token_bytes": b64(&[b])})).collect();
        for t in more {
            vocab.push(json!({"rank": vocab.len(), "token_bytes": b64(t.as_bytes())}));
        }
        let size = specials + vocab.len();
        json!({"config": {"pattern": TEKKEN_PATTERN, "default_vocab_size": size,
            "default_num_special_tokens": specials, "version": version}, "vocab": vocab})
    }

    fn refused(tekken: &Value) -> String {
        vocabulary_gguf(tekken, None).map(|_| ()).expect_err("refused").to_string()
    }

    /// tiktoken's joining over the 256 bytes at their own ranks and `ranks` after them.
    fn tiktoken(ranks: &[&str], piece: &str) -> Vec<u32> {
        let rank = |t: &[u8]| match t {
            [b] => Some(u32::from(*b)),
            _ => ranks.iter().position(|r| r.as_bytes() == t).map(|r| 256 + r as u32),
        };
        crate::tokenizer::tiktoken::tests::plain(rank, piece)
    }

    proptest::proptest! {
        /// Over a vocabulary of strings of `a`, `b` and `c` in any rank order, a Tekken vocabulary encodes a letter run
        /// as tiktoken does (ids past 20 special ones). One merge per token, the split its own bytes merge to (Hugging
        /// Face's conversion), is not enough: a token joins from whichever two tokens meet first (e.g. `abab` from `ab`
        /// and `ab` in `aacababbccb` where `aba` ranks before `ab`).
        #[test]
        fn a_tekken_vocabulary_joins_as_tiktoken(
            order in proptest::sample::subsequence(
                vec!["ab", "ba", "aa", "bc", "ca", "cb", "aba", "bab", "abc", "cab", "bca", "aab", "abab", "baba", "abca", "cc"], 4..16,
            ).prop_shuffle(),
            text in "[abc]{1,14}".prop_map(String::from),
        ) {
            let path = std::env::temp_dir().join(format!("tandem-tekken-prop-{}.gguf", std::process::id()));
            vocabulary_gguf(&file(&order, 20, "v3"), None).expect("a vocabulary").write(&path).expect("written");
            let tok = crate::tokenizer::Tokenizer::from_gguf(&crate::gguf::GgufFile::open(&path).expect("opens"))
                .expect("loads");
            let _ = std::fs::remove_file(&path);
            let want: Vec<u32> = tiktoken(&order, &text).into_iter().map(|id| id + 20).collect();
            proptest::prop_assert_eq!(tok.encode_ordinary(&text), want);
        }
    }

    #[test]
    fn malformed_files_are_refused_by_what_is_wrong() {
        let mut wrong_rank = file(&["ab"], 20, "v3");
        wrong_rank["vocab"][256]["rank"] = json!(7);
        assert!(refused(&wrong_rank).contains("vocab entry 256"));
        assert!(refused(&file(&["ab", "ab"], 20, "v3")).contains("same bytes"));
        assert!(refused(&file(&["ab"], 20, "v13")).contains("lists no special tokens"));
        // Fewer special ids than mistral_common's default special tokens.
        assert!(refused(&file(&["ab"], 10, "v3")).contains("20 special tokens for 10"));
        // A count of special ids no vocabulary has is refused, not allocated (found by the vocab_import fuzz target's
        // seed with its counts raised: the reader asked for 24 TB).
        assert!(refused(&file(&["ab"], 1_000_000_000_000, "v3")).contains("more than any vocabulary has"));
        let mut listed = file(&["ab"], 4, "v13");
        listed["special_tokens"] = json!([{"rank": 0, "token_str": "<unk>"}, {"rank": 1, "token_str": "<unk>"}]);
        assert!(refused(&listed).contains("same text"));
        let mut other = file(&["ab"], 20, "v3");
        other["config"]["pattern"] = json!(r"\p{L}+");
        assert!(refused(&other).contains("Tekken pattern"));
    }
}
