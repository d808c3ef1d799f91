//! The tokenizer built from a GGUF's vocabulary: byte-level BPE (merges and a pre-tokenizer name) or SentencePiece
//! BPE (scores, [`spm`]).
//!
//! Encoding: special (control) tokens are split out of the text first; for byte-level BPE the rest is
//! pre-tokenized (by the vocabulary's pre-tokenizer), each piece is mapped byte by byte onto GPT-2's printable
//! alphabet and merged by rank; for SentencePiece each stretch between special tokens is merged by score. Decoding
//! maps tokens back to bytes; [`StreamDecoder`] turns a token stream into text without ever emitting half a UTF-8
//! character.

mod bpe;
pub(crate) mod bytes;
mod decode;
pub mod export;
mod gemma4;
pub mod import;
pub mod pretokenize;
mod spm;
pub mod tekken;
pub mod tiktoken;

use std::collections::HashMap;

pub use decode::StreamDecoder;

use crate::gguf::{GgufFile, MetaArray};
use bpe::Merges;

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_NORMAL: i64 = 1;
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;
/// A SentencePiece vocabulary's byte-fallback token (`<0xXX>`).
const TOKEN_TYPE_BYTE: i64 = 6;

/// Texts of control tokens that end a generation, as llama.cpp recognizes them: turn and document ends, and the
/// repository marker of code models, which only ever starts a new document.
const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<EOT>",
    "<reponame>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<turn|>",
    "<|tool_response>",
    // gpt-oss's (o200k_harmony): a final answer's end, and a tool call's.
    "<|return|>",
    "<|call|>",
];

/// Harmony's markers (gpt-oss): a message's start, its channel, its text's start, its end, and a call's format.
/// Its answers are messages in these, which a reasoning parser reads apart, so they are text that is always shown,
/// and a message's end does not end the answer, whose last message ends with `<|return|>` or `<|call|>` (as
/// llama.cpp reads a vocabulary that has those two).
const HARMONY_MARKERS: [&str; 5] = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>"];

/// Why a tokenizer could not be built from a model file.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("tokenizer metadata {key} is missing or has the wrong type")]
    Missing { key: &'static str },
    #[error("tokenizer model {0:?} is not supported (byte-level BPE, `gpt2`, and SentencePiece BPE, `llama`, are)")]
    UnsupportedModel(String),
    #[error("tokenizer pre-tokenizer {0:?} is not supported")]
    UnsupportedPre(String),
    #[error("tokenizer.json: {0}")]
    MalformedJson(String),
    #[error("tokenizer merge {index} ({merge:?}) {what}")]
    BadMerge { index: usize, merge: String, what: &'static str },
}

/// Token ids with a meaning of their own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// Every id that ends a generation (eos included).
    pub end_of_generation: Vec<u32>,
}

/// A byte-level BPE tokenizer.
#[derive(Debug)]
pub struct Tokenizer {
    tokens: Vec<String>,
    /// Decoded bytes of every token (special tokens: their text).
    token_bytes: Vec<Vec<u8>>,
    merges: Merges,
    /// Id of the single-byte token for every byte (`<0xXX>` in SentencePiece's and Gemma 4's vocabularies, their
    /// fallback for text no token spells); `None` for bytes the vocabulary lacks, which are dropped (as both
    /// llama.cpp and Hugging Face tokenizers do for a byte-level vocabulary without them).
    byte_ids: [Option<u32>; 256],
    /// Control and user-defined tokens that are matched literally in text, longest first.
    specials: Vec<(String, u32)>,
    /// Whether a special token starts with each byte: where [`Tokenizer::next_special`] looks.
    special_first: [bool; 256],
    special: SpecialTokens,
    /// Ids of control tokens (markers such as `<|im_start|>`, not text), ascending.
    control: Vec<u32>,
    add_bos: bool,
    pre: pretokenize::Pre,
    /// A SentencePiece vocabulary's merging (then `merges` and `pre` are not used).
    spm: Option<spm::Spm>,
    /// Gemma 4's starting symbols (then `pre` is not used).
    gemma4: Option<gemma4::Gemma4>,
    /// Every token by its text, for a pre-tokenizer that takes a whole piece as its token before merging
    /// ([`pretokenize::Pre::ignores_merges`]); empty otherwise.
    whole: HashMap<String, u32>,
    /// Ids of pre-token pieces already merged: text repeats its words, and BPE merging is most of encoding's
    /// cost (Hugging Face tokenizers keeps the same kind of cache).
    words: WordCache,
}

/// Pieces longer than this are merged every time (they rarely repeat).
const CACHED_PIECE_BYTES: usize = 64;
/// Pieces remembered before the cache starts over.
const CACHED_PIECES: usize = 1 << 16;

/// Read by every encoding at once, one read lock per stretch of text between special tokens (with a lock per
/// piece, two threads encoding together each took longer than one alone). The pieces a text adds go in afterwards,
/// and only if no other encoding is reading then: caching is a shortcut, not worth a wait, and a writer waiting
/// behind a long encoding would hold up every encoding that starts meanwhile.
#[derive(Default)]
struct WordCache(std::sync::RwLock<std::collections::HashMap<Box<str>, Box<[u32]>>>);

impl std::fmt::Debug for WordCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.read().map_or(0, |m| m.len());
        write!(f, "WordCache({n} pieces)")
    }
}

impl WordCache {
    /// Calls `each` with a lookup that gives every piece's ids: cached ones from the cache, others from `merge`
    /// (remembered afterwards, when short enough to repeat and the cache is free).
    fn with(&self, merge: impl Fn(&str) -> Vec<u32>, each: impl FnOnce(&mut dyn FnMut(&str, &mut Vec<u32>))) {
        let mut new: Vec<(Box<str>, Box<[u32]>)> = Vec::new();
        {
            let map = self.0.read().unwrap_or_else(|p| p.into_inner());
            each(&mut |piece, out| {
                if let Some(ids) = map.get(piece) {
                    out.extend_from_slice(ids);
                    return;
                }
                let ids = merge(piece);
                out.extend_from_slice(&ids);
                if piece.len() <= CACHED_PIECE_BYTES {
                    new.push((piece.into(), ids.into()));
                }
            });
        }
        if new.is_empty() {
            return;
        }
        let mut map = match self.0.try_write() {
            Ok(map) => map,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        for (piece, ids) in new {
            if map.len() >= CACHED_PIECES {
                map.clear();
            }
            map.insert(piece, ids);
        }
    }
}

/// The tokenizer's part of a GGUF's metadata, checked: what [`Tokenizer::from_gguf`] builds from and what
/// [`export`] writes out.
pub(crate) struct GgufVocab<'a> {
    /// `tokenizer.ggml.model`: "gpt2" (byte-level BPE), "llama" (SentencePiece) or "gemma4".
    pub model: &'a str,
    /// The pre-tokenizer's name (a supported one; Gemma 4's and SentencePiece's split text their own way).
    pub pre: &'a str,
    pub tokens: &'a [String],
    /// One type per token (1, normal, when the file gives none).
    pub types: Vec<i64>,
    pub merges: &'a [String],
    /// A SentencePiece vocabulary's token scores (none for byte-level BPE).
    pub scores: Option<Vec<f32>>,
    /// SentencePiece: a space first in each stretch of text after the start or a special token.
    pub add_space_prefix: bool,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
}

impl<'a> GgufVocab<'a> {
    pub(crate) fn read(file: &'a GgufFile) -> Result<GgufVocab<'a>, TokenizerError> {
        let meta = file.metadata();
        let model = meta.get("tokenizer.ggml.model").and_then(|v| v.as_str());
        let model = model.ok_or(TokenizerError::Missing { key: "tokenizer.ggml.model" })?;
        if !["gpt2", "llama", "gemma4"].contains(&model) {
            return Err(TokenizerError::UnsupportedModel(model.to_string()));
        }
        let pre = match model {
            "gemma4" => "default",
            _ => meta.get("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("default"),
        };
        pretokenize::Pre::of(pre)?;
        let strings = |key: &'static str| match meta.get(key).and_then(|v| v.as_array()) {
            Some(MetaArray::String(t)) => Ok(t.as_slice()),
            _ => Err(TokenizerError::Missing { key }),
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let types = match meta.get("tokenizer.ggml.token_type").and_then(|v| v.as_array()) {
            Some(a) => a.to_i64s().filter(|t| t.len() == tokens.len()),
            None => Some(vec![TOKEN_TYPE_NORMAL; tokens.len()]),
        };
        let types = types.ok_or(TokenizerError::Missing { key: "tokenizer.ggml.token_type" })?;
        let id_of = |k: &str| meta.get(k).and_then(|v| v.as_u64()).and_then(|v| u32::try_from(v).ok());
        let (merges, scores) = match model {
            "llama" => match meta.get("tokenizer.ggml.scores").and_then(|v| v.as_array()) {
                Some(MetaArray::F32(s)) if s.len() == tokens.len() => (&[][..], Some(s.clone())),
                _ => return Err(TokenizerError::Missing { key: "tokenizer.ggml.scores" }),
            },
            _ => (strings("tokenizer.ggml.merges")?, None),
        };
        Ok(GgufVocab {
            model,
            pre,
            tokens,
            types,
            merges,
            scores,
            add_space_prefix: meta.get("tokenizer.ggml.add_space_prefix").and_then(|v| v.as_bool()).unwrap_or(true),
            bos: id_of("tokenizer.ggml.bos_token_id").filter(|_| !pretokenize::NO_BOS.contains(&pre)),
            eos: id_of("tokenizer.ggml.eos_token_id"),
            // Gemma 4's files say false, but its prompts start with BOS (llama.cpp overrides it the same way).
            add_bos: model == "gemma4"
                || meta.get("tokenizer.ggml.add_bos_token").and_then(|v| v.as_bool()).unwrap_or(false),
        })
    }
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes.
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::new(GgufVocab::read(file)?)
    }

    fn new(v: GgufVocab) -> Result<Tokenizer, TokenizerError> {
        let spm = v.scores.map(|scores| spm::Spm::new(v.tokens, scores, v.add_space_prefix));
        let gemma4 = (v.model == "gemma4").then(|| gemma4::Gemma4::new(v.tokens));
        // Both write a space as `▁` and fall back to `<0xXX>` byte tokens.
        let spaces_spelled = spm.is_some() || gemma4.is_some();
        let pre = pretokenize::Pre::of(v.pre)?;
        let (tokens, types, merges, bos, eos, add_bos) =
            (v.tokens.to_vec(), &v.types, v.merges, v.bos, v.eos, v.add_bos);
        let index: HashMap<&str, u32> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i as u32)).collect();
        let whole = match pre.ignores_merges() && spm.is_none() {
            true => index.iter().map(|(t, i)| (t.to_string(), *i)).collect(),
            false => HashMap::new(),
        };
        let merges = Merges::new(merges, &index)?;
        let mut byte_ids = [None; 256];
        for b in 0..=255u8 {
            byte_ids[b as usize] = match spaces_spelled {
                true => index.get(format!("<0x{b:02X}>").as_str()).copied(),
                false => index.get(bytes::byte_to_char(b).to_string().as_str()).copied(),
            };
        }
        let is_special = |i: usize| matches!(types[i], TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED);
        let mut specials: Vec<(String, u32)> = (0..tokens.len())
            .filter(|&i| is_special(i) && !tokens[i].is_empty())
            .map(|i| (tokens[i].clone(), i as u32))
            .collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let mut special_first = [false; 256];
        for (s, _) in &specials {
            special_first[s.as_bytes()[0] as usize] = true;
        }
        let token_bytes = (0..tokens.len())
            .map(|i| match (is_special(i), spaces_spelled) {
                (true, _) => tokens[i].as_bytes().to_vec(),
                (false, true) => spm::Spm::token_bytes(&tokens[i], types[i] == TOKEN_TYPE_BYTE),
                (false, false) => bytes::token_to_bytes(&tokens[i]),
            })
            .collect();
        let is_control = |i: usize| types[i] == TOKEN_TYPE_CONTROL;
        let harmony =
            ["<|return|>", "<|call|>"].iter().all(|t| (0..tokens.len()).any(|i| is_control(i) && tokens[i] == *t));
        let marker = |i: usize| harmony && HARMONY_MARKERS.contains(&tokens[i].as_str());
        let mut end_of_generation: Vec<u32> = (0..tokens.len())
            .filter(|&i| is_control(i) && END_OF_GENERATION_TEXTS.contains(&tokens[i].as_str()) && !marker(i))
            .map(|i| i as u32)
            .collect();
        end_of_generation.extend(eos.filter(|e| !end_of_generation.contains(e)));
        end_of_generation.sort_unstable();
        let special = SpecialTokens { bos, eos, end_of_generation };
        let control = (0..tokens.len()).filter(|&i| is_control(i) && !marker(i)).map(|i| i as u32).collect();
        Ok(Tokenizer {
            tokens,
            token_bytes,
            merges,
            byte_ids,
            specials,
            special_first,
            special,
            control,
            add_bos,
            pre,
            spm,
            gemma4,
            whole,
            words: WordCache::default(),
        })
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub fn special(&self) -> &SpecialTokens {
        &self.special
    }

    /// The BOS [`encode`](Self::encode) puts first, when the model asks for one.
    pub fn added_bos(&self) -> Option<u32> {
        self.special.bos.filter(|_| self.add_bos)
    }

    /// Whether `id` is a control or user-defined token (its text stands for it; it is not ordinary text).
    pub fn is_special(&self, id: u32) -> bool {
        self.specials.iter().any(|(_, s)| *s == id)
    }

    /// The special token whose text is `text`, if the vocabulary has one (Qwen 3's `<think>`).
    pub fn special_id(&self, text: &str) -> Option<u32> {
        self.specials.iter().find(|(s, _)| s == text).map(|&(_, id)| id)
    }

    /// Whether `id` is a control token: a marker of the format (turns, documents), whose text is left out of
    /// generated text unless asked for, as llama.cpp's server and vLLM (`skip_special_tokens`) leave it out.
    pub fn is_control(&self, id: u32) -> bool {
        self.control.binary_search(&id).is_ok()
    }

    /// Whether generation ends at `id`.
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.special.end_of_generation.binary_search(&id).is_ok()
    }

    /// Ordinary word tokens (a space and three or more lowercase ASCII letters) that encode back to themselves
    /// alone, in id order. Any sequence of them re-tokenizes to the same ids, since each starts a new word: the
    /// mock engine draws its output from them and the load generator builds prompts of exact token counts.
    pub fn plain_words(&self) -> Vec<u32> {
        let bos = self.special.bos.filter(|_| self.add_bos);
        (0..self.tokens.len() as u32)
            .filter(|&id| {
                let b = self.token_bytes(id);
                b.len() >= 4 && b[0] == b' ' && b[1..].iter().all(u8::is_ascii_lowercase)
            })
            .filter(|&id| !self.is_end_of_generation(id))
            .filter(|&id| {
                let ids = self.encode(&String::from_utf8_lossy(self.token_bytes(id)));
                let ids = match (bos, ids.split_first()) {
                    (Some(b), Some((&first, rest))) if first == b => rest,
                    _ => &ids[..],
                };
                ids == [id]
            })
            .collect()
    }

    /// The vocabulary's text for `id` (GPT-2 alphabet for ordinary tokens).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// Token ids for `text`. Special tokens written in the text become their ids; a BOS is prepended when the
    /// model asks for one.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_with(text, self.add_bos)
    }

    /// Token ids for a conversation rendered by its chat template: as [`Tokenizer::encode`], except that no BOS is
    /// prepended where the template already wrote one first. A second BOS is never meant (transformers and vLLM add
    /// none to a rendered chat; llama.cpp adds one and warns of the double).
    pub fn encode_chat(&self, rendered: &str) -> Vec<u32> {
        self.encode_with(rendered, self.chat_adds_bos(rendered))
    }

    /// A prompt text's token ids as a request asks (vLLM's `add_special_tokens`): with the model's BOS first when
    /// `add_special_tokens` says so (and the model has one); by default, a plain prompt as [`Tokenizer::encode`] and
    /// a conversation rendered by its template (`chat`) as [`Tokenizer::encode_chat`].
    pub fn encode_prompt(&self, text: &str, chat: bool, add_special_tokens: Option<bool>) -> Vec<u32> {
        match add_special_tokens {
            Some(add) => self.encode_with(text, add && self.add_bos),
            None if chat => self.encode_chat(text),
            None => self.encode(text),
        }
    }

    /// Whether [`Tokenizer::encode_chat`] prepends the model's BOS to `rendered`.
    fn chat_adds_bos(&self, rendered: &str) -> bool {
        let bos_text = self.special.bos.and_then(|b| self.token_text(b)).filter(|t| !t.is_empty());
        self.add_bos && !bos_text.is_some_and(|t| rendered.starts_with(t))
    }

    /// Token ids for `text`, with the model's BOS first when `add_bos` (and the model has one).
    pub fn encode_with(&self, text: &str, add_bos: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_bos {
            out.extend(self.special.bos);
        }
        let mut rest = text;
        // SentencePiece: a stretch after the start or a special token gets a space first.
        let mut after_special = true;
        while !rest.is_empty() {
            let (plain, special) = self.next_special(rest);
            if plain > 0 {
                self.encode_plain(&rest[..plain], after_special, &mut out);
            }
            match special {
                Some((len, id)) => {
                    out.push(id);
                    after_special = true;
                    rest = &rest[plain + len..];
                }
                None => rest = "",
            }
        }
        out
    }

    /// Token ids for `text` as ordinary text: no BOS, and special tokens' text tokenized as any other (what
    /// llama.cpp's tokenizer tests ask of it).
    pub fn encode_ordinary(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if !text.is_empty() {
            self.encode_plain(text, true, &mut out);
        }
        out
    }

    /// Position of the earliest special token in `text` (longest at that position) with its length and id.
    /// One pass over the text: only where a special token could start are the tokens (longest first) compared;
    /// a search of the whole text per special token cost more than the rest of encoding a short prompt.
    fn next_special(&self, text: &str) -> (usize, Option<(usize, u32)>) {
        let bytes = text.as_bytes();
        for (pos, &b) in bytes.iter().enumerate() {
            if !self.special_first[b as usize] {
                continue;
            }
            if let Some((s, id)) = self.specials.iter().find(|(s, _)| bytes[pos..].starts_with(s.as_bytes())) {
                return (pos, Some((s.len(), *id)));
            }
        }
        (text.len(), None)
    }

    /// A stretch of text with no special token in it (`after_special`: after the start or a special token).
    fn encode_plain(&self, text: &str, after_special: bool, out: &mut Vec<u32>) {
        if let Some(spm) = &self.spm {
            return spm.encode(text, after_special, &self.byte_ids, out);
        }
        if let Some(gemma4) = &self.gemma4 {
            return gemma4.encode(text, &self.merges, &self.byte_ids, out);
        }
        let merge = |piece: &str| {
            if !self.whole.is_empty() {
                let spelled: String = piece.bytes().map(bytes::byte_to_char).collect();
                if let Some(&id) = self.whole.get(&spelled) {
                    return vec![id];
                }
            }
            let mut symbols: Vec<u32> = piece.bytes().filter_map(|b| self.byte_ids[b as usize]).collect();
            self.merges.apply(&mut symbols);
            symbols
        };
        self.words.with(merge, |ids_of| self.pre.split(text, |piece| ids_of(piece, out)));
    }

    /// The bytes a token stands for (empty for an id outside the vocabulary).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.token_bytes.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// Text of a whole token sequence; invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| self.token_bytes(id).iter().copied()).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level vocabulary of the 256 bytes and these control tokens.
    fn with_controls(controls: &[&str], eos: Option<u32>) -> Tokenizer {
        let mut tokens: Vec<String> = (0..=255u8).map(|b| bytes::byte_to_char(b).to_string()).collect();
        tokens.extend(controls.iter().map(|c| c.to_string()));
        let mut types = vec![TOKEN_TYPE_NORMAL; 256];
        types.extend(controls.iter().map(|_| TOKEN_TYPE_CONTROL));
        let v = GgufVocab {
            model: "gpt2",
            pre: "gpt-4o",
            tokens: &tokens,
            types,
            merges: &[],
            scores: None,
            add_space_prefix: false,
            bos: None,
            eos,
            add_bos: false,
        };
        Tokenizer::new(v).expect("a tokenizer")
    }

    /// gpt-oss's vocabulary (it has `<|return|>` and `<|call|>`): those end an answer, `<|end|>` only a message,
    /// and harmony's markers are text that is shown; Phi-3's `<|end|>` still ends one.
    #[test]
    fn harmonys_markers_are_text_and_only_its_last_message_ends_an_answer() {
        let harmony = [
            "<|start|>",
            "<|channel|>",
            "<|message|>",
            "<|end|>",
            "<|constrain|>",
            "<|return|>",
            "<|call|>",
            "<|endoftext|>",
        ];
        let tok = with_controls(&harmony, Some(256 + 5));
        let id = |t: &str| tok.special_id(t).expect("a token");
        for marker in &harmony[..5] {
            assert!(!tok.is_end_of_generation(id(marker)) && !tok.is_control(id(marker)), "{marker}");
        }
        for end in &harmony[5..] {
            assert!(tok.is_end_of_generation(id(end)) && tok.is_control(id(end)), "{end}");
        }
        let phi3 = with_controls(&["<|end|>", "<|user|>", "<|assistant|>"], None);
        let end = phi3.special_id("<|end|>").expect("a token");
        assert!(phi3.is_end_of_generation(end) && phi3.is_control(end));
    }
}
