//! Incremental decoding: tokens in, text out, never half a UTF-8 character.

use super::Tokenizer;

/// Turns a stream of token ids into text. Bytes of a character split across tokens are held until the
/// character is complete; bytes that can never form a character become U+FFFD.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Adds one token and returns the text it completes (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        self.pending.extend_from_slice(tokenizer.token_bytes(id));
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix was just checked to be UTF-8.
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // An incomplete character at the end: keep its bytes for the next token.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Ends the stream: bytes still held can no longer complete a character.
    pub fn finish(&mut self) -> String {
        let out = if self.pending.is_empty() { String::new() } else { char::REPLACEMENT_CHARACTER.to_string() };
        self.pending.clear();
        out
    }
}
