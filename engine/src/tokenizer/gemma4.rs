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
    /// Each byte's fallback token.
    bytes: [Option<u32>; 256],
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
        let index: HashMap<&str, u32> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i as u32)).collect();
        let mut bytes = [None; 256];
        for (b, id) in bytes.iter_mut().enumerate() {
            *id = index.get(format!("<0x{b:02X}>").as_str()).copied();
        }
        Gemma4 { chars, line_breaks, bytes }
    }

    /// The ids of a stretch of plain text (no special tokens in it).
    pub fn encode(&self, text: &str, merges: &Merges, out: &mut Vec<u32>) {
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
                        symbols.extend(c.encode_utf8(&mut buf).bytes().filter_map(|b| self.bytes[b as usize]));
                    }
                }
            }
            merges.apply(&mut symbols);
            out.extend(symbols);
        }
    }
}
