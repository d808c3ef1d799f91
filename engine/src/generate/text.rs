//! A sequence's text as it is generated: incremental UTF-8 decoding plus stop strings, holding back just the
//! text that could still turn out to start a stop string.

use crate::tokenizer::{StreamDecoder, Tokenizer};

/// Text assembled token by token.
#[derive(Debug, Default)]
pub struct TextStream {
    decoder: StreamDecoder,
    stops: Vec<String>,
    /// Decoded but not yet emitted: a possible start of a stop string.
    held: String,
}

impl TextStream {
    pub fn new(stops: Vec<String>) -> TextStream {
        TextStream { stops, ..TextStream::default() }
    }

    /// Adds a token. Returns the text that is now safe to emit, and whether a stop string was found (the stop
    /// string and everything after it are dropped).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> (String, bool) {
        self.held.push_str(&self.decoder.push(tokenizer, id));
        let hit = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(at) = hit {
            let out = self.held[..at].to_string();
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
