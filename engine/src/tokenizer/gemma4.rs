//! Gemma 4's tokenizer (`tokenizer.ggml.model = "gemma4"`): BPE with ranked merges, as byte-level BPE, but over the
//! text's own UTF-8 characters with its spaces written `▁` (SentencePiece's way), no split into words: a stretch of
//! text is cut only into runs of line breaks and runs of anything else. A run of line breaks that is a token of its
//! own is that token; a character no token spells falls back to the tokens of its bytes (`<0xXX>`). The rules are
//! llama.cpp's, whose tokenizer tests check them (`tests/llamacpp_vocabs.rs`).

use std::collections::HashMap;

use super::bpe::Merges;
use super::spm::SPACE;

/// A Gemma 4 vocabulary's starting symbols.
#[derive(Debug)]
pub struct Gemma4 {
    /// The token of every character that is one.
    chars: HashMap<char, u32>,
    /// The token of a run of `n` line breaks, by `n`, where there is one.
    line_breaks: HashMap<usize, u32>,
}

impl Gemma4 {
    pub fn new(tokens: &[String]) -> Gemma4 {
        let mut chars = HashMap::new();
        let mut line_breaks = HashMap::new();
        for (id, t) in tokens.iter().enumerate() {
            let mut it = t.chars();
            if let (Some(c), None) = (it.next(), it.next()) {
                chars.insert(c, id as u32);
            }
            if !t.is_empty() && t.bytes().all(|b| b == b'\n') {
                line_breaks.insert(t.len(), id as u32);
            }
        }
        Gemma4 { chars, line_breaks }
    }

    /// The ids of a stretch of plain text (no special tokens in it); `bytes`: each byte's fallback token.
    pub fn encode(&self, text: &str, merges: &Merges, bytes: &[Option<u32>; 256], out: &mut Vec<u32>) {
        let text = text.replace(' ', &SPACE.to_string());
        let mut rest = text.as_str();
        while let Some(first) = rest.chars().next() {
            let breaks = first == '\n';
            let end = rest.find(|c: char| (c == '\n') != breaks).unwrap_or(rest.len());
            let (run, next) = rest.split_at(end);
            rest = next;
            if let Some(&id) = self.line_breaks.get(&run.len()).filter(|_| breaks) {
                out.push(id);
                continue;
            }
            let mut symbols = Vec::with_capacity(run.len());
            for c in run.chars() {
                match self.chars.get(&c) {
                    Some(&id) => symbols.push(id),
                    None => {
                        let mut buf = [0; 4];
                        symbols.extend(c.encode_utf8(&mut buf).bytes().filter_map(|b| bytes[b as usize]));
                    }
                }
            }
            merges.apply(&mut symbols);
            out.extend(symbols);
        }
    }
}
