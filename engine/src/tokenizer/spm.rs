//! SentencePiece BPE as GGUF files carry it (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral, Phi-3): a text's
//! spaces become `▁` (one put first when the fragment follows the start or a special token), its characters are
//! merged pairwise, the pair that makes the highest-scored token first (ties: the leftmost), and a piece no token
//! spells falls back to the tokens of its bytes (`<0xXX>`). The order and tie rule are llama.cpp's, whose tokenizer
//! tests check it (`tests/llamacpp_vocabs.rs`).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// What SentencePiece writes for a space.
pub const SPACE: char = '\u{2581}';

/// A SentencePiece vocabulary's merging.
#[derive(Debug)]
pub struct Spm {
    /// Every token by its text (control tokens too: a merge can make one, as in llama.cpp).
    index: HashMap<String, u32>,
    scores: Vec<f32>,
    /// A fragment after the start or a special token gets a `▁` first.
    pub add_space_prefix: bool,
}

/// A run of characters being merged: its byte range in the text and its neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A pair that a token spells, by its score.
#[derive(PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    /// The higher score first; among equal scores, the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then(other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Spm {
    pub fn new(tokens: &[String], scores: Vec<f32>, add_space_prefix: bool) -> Spm {
        let index: HashMap<String, u32> = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        Spm { index, scores, add_space_prefix }
    }

    /// A token's bytes: its text with `▁` as a space, or the byte a `<0xXX>` token stands for.
    pub fn token_bytes(text: &str, is_byte: bool) -> Vec<u8> {
        if is_byte
            && let Some(hex) = text.strip_prefix("<0x").and_then(|t| t.strip_suffix('>'))
            && let Ok(b) = u8::from_str_radix(hex, 16)
        {
            return vec![b];
        }
        text.replace(SPACE, " ").into_bytes()
    }

    /// The ids of a fragment of plain text (`prefixed`: it follows the start or a special token); `bytes`: each
    /// byte's fallback token.
    pub fn encode(&self, fragment: &str, prefixed: bool, bytes: &[Option<u32>; 256], out: &mut Vec<u32>) {
        let mut text = String::with_capacity(fragment.len() + 3);
        if self.add_space_prefix && prefixed {
            text.push(SPACE);
        }
        text.extend(fragment.chars().map(|c| if c == ' ' { SPACE } else { c }));
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            let next = (start + c.len_utf8() < text.len()).then_some(i + 1);
            symbols.push(Symbol { start, len: c.len_utf8(), prev: i.checked_sub(1), next });
        }
        let mut queue = BinaryHeap::new();
        // Only pairs that spell a token merge, so every piece at the end is a token or one character.
        let add = |queue: &mut BinaryHeap<Bigram>, symbols: &[Symbol], l: usize, r: usize| {
            let (a, b) = (symbols[l], symbols[r]);
            let piece = &text[a.start..b.start + b.len];
            if let Some(&id) = self.index.get(piece) {
                let score = self.scores.get(id as usize).copied().unwrap_or(0.0);
                queue.push(Bigram { score, left: l, right: r, len: piece.len() });
            }
        };
        for i in 1..symbols.len() {
            add(&mut queue, &symbols, i - 1, i);
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (symbols[b.left], symbols[b.right]);
            // Stale: one side has been merged since.
            if l.len == 0 || r.len == 0 || l.len + r.len != b.len {
                continue;
            }
            symbols[b.left].len += r.len;
            symbols[b.right].len = 0;
            symbols[b.left].next = r.next;
            if let Some(n) = r.next {
                symbols[n].prev = Some(b.left);
            }
            if let Some(p) = symbols[b.left].prev {
                add(&mut queue, &symbols, p, b.left);
            }
            if let Some(n) = symbols[b.left].next {
                add(&mut queue, &symbols, b.left, n);
            }
        }
        let mut at = (!symbols.is_empty()).then_some(0);
        while let Some(i) = at {
            let piece = &text[symbols[i].start..symbols[i].start + symbols[i].len];
            match self.index.get(piece) {
                Some(&id) => out.push(id),
                // A character no token spells: its bytes' tokens.
                None => out.extend(piece.bytes().filter_map(|b| bytes[b as usize])),
            }
            at = symbols[i].next;
        }
    }
}
