//! A sequence's text as it is generated: incremental UTF-8 decoding plus stop strings, holding back just the
//! text that could still turn out to start a stop string. Control tokens (`<|im_start|>` and the like) make no
//! text unless asked for, as in llama.cpp's server and vLLM (`skip_special_tokens`).

use crate::tokenizer::{StreamDecoder, Tokenizer};

/// Text assembled token by token.
#[derive(Debug, Default)]
pub struct TextStream {
    decoder: StreamDecoder,
    stops: Vec<String>,
    /// Decoded but not yet emitted: a possible start of a stop string.
    held: String,
    /// Control tokens' text is part of the text (vLLM's `skip_special_tokens: false`).
    keep_control: bool,
    /// A stop string found ends the text with it rather than before it (vLLM's `include_stop_str_in_output`).
    keep_stop: bool,
}

impl TextStream {
    pub fn new(stops: Vec<String>) -> TextStream {
        TextStream { stops, ..TextStream::default() }
    }

    /// Puts control tokens' text in the text too.
    pub fn keeping_control(mut self, keep: bool) -> TextStream {
        self.keep_control = keep;
        self
    }

    /// Ends the text after the stop string found rather than before it.
    pub fn keeping_stop(mut self, keep: bool) -> TextStream {
        self.keep_stop = keep;
        self
    }

    /// Adds a token. Returns the text that is now safe to emit, and whether a stop string was found (what
    /// follows it is dropped, and the stop string itself unless kept).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> (String, bool) {
        if !self.keep_control && tokenizer.is_control(id) {
            return (String::new(), false);
        }
        self.held.push_str(&self.decoder.push(tokenizer, id));
        // The earliest stop string found; of those starting there, the longest.
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s.len())))
            .min_by_key(|&(at, len)| (at, std::cmp::Reverse(len)));
        if let Some((at, len)) = hit {
            let end = if self.keep_stop { at + len } else { at };
            let out = self.held[..end].to_string();
            self.held.clear();
            return (out, true);
        }
        let keep = self.longest_stop_prefix_suffix();
        let out = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        (out, false)
    }

    /// Ends the stream and returns what was held.
    pub fn finish(&mut self, stopped: bool) -> String {
        if stopped {
            return String::new();
        }
        let mut out = std::mem::take(&mut self.held);
        out.push_str(&self.decoder.finish());
        out
    }

    /// Byte length of the longest suffix of `held` that is a proper prefix of some stop string.
    fn longest_stop_prefix_suffix(&self) -> usize {
        let h = &self.held;
        let mut best = 0;
        for (start, _) in h.char_indices() {
            let suffix = &h[start..];
            if suffix.len() > best && self.stops.iter().any(|s| s.len() > suffix.len() && s.starts_with(suffix)) {
                best = suffix.len();
            }
        }
        best
    }
}
