//! Prompts from a workload's lengths and prefix-block ids. Each block id expands to the same tokens every time
//! (drawn, seeded by the id, from ordinary word tokens that re-tokenize to themselves), so requests that share
//! leading ids share leading tokens at the server, block for block. Tokens past the ids are the request's own.

use std::sync::Arc;

use crate::rng::Rng;
use crate::trace::TraceRequest;

/// Mooncake's prefix-block size in tokens.
pub const DEFAULT_TRACE_BLOCK: usize = 512;

/// Builds prompt token ids (and text) for workload requests.
#[derive(Clone, Debug)]
pub struct PromptBuilder {
    words: Arc<[u32]>,
    block: usize,
}

/// One request's prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct Prompt {
    pub tokens: Vec<u32>,
    /// Cut to the longest prompt allowed.
    pub clipped: bool,
}

impl PromptBuilder {
    /// Tokens come from `words` (see `Tokenizer::plain_words`); each id covers `block` tokens.
    pub fn new(words: Vec<u32>, block: usize) -> PromptBuilder {
        PromptBuilder { words: words.into(), block: block.max(1) }
    }

    /// The tokens block id `id` stands for.
    pub fn block(&self, id: u64) -> impl Iterator<Item = u32> + '_ {
        let mut rng = Rng::new(id ^ 0x6A09_E667_F3BC_C908);
        (0..self.block).map(move |_| self.words[rng.below(self.words.len())])
    }

    /// The prompt of request number `index`: its blocks' tokens, then tokens of its own up to `input_length`, cut
    /// to `max_isl` tokens when longer.
    pub fn prompt(&self, r: &TraceRequest, index: usize, max_isl: Option<usize>) -> Prompt {
        self.prompt_with_room(r, index, max_isl, 0)
    }

    /// [`prompt`](Self::prompt) in a vector with room for `room` more tokens (the output a caller appends). A
    /// literal prompt is its own tokens ([`crate::trace::tokenize_literals`]).
    pub fn prompt_with_room(&self, r: &TraceRequest, index: usize, max_isl: Option<usize>, room: usize) -> Prompt {
        let want = r.input_length;
        let mut tokens: Vec<u32> = Vec::with_capacity(want.min(max_isl.unwrap_or(usize::MAX)).max(1) + room);
        if let Some(literal) = &r.literal {
            // Its length is its token count: nothing is added to it.
            tokens.extend_from_slice(&literal.tokens);
        }
        for &id in &r.hash_ids {
            if tokens.len() >= want {
                break;
            }
            tokens.extend(self.block(id).take(want - tokens.len()));
        }
        let mut own = Rng::new((index as u64) ^ 0xBB67_AE85_84CA_A73B_u64.rotate_left(17));
        while tokens.len() < want {
            tokens.push(self.words[own.below(self.words.len())]);
        }
        let clipped = max_isl.is_some_and(|m| tokens.len() > m);
        if let Some(m) = max_isl {
            tokens.truncate(m.max(1));
        }
        Prompt { tokens, clipped }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builder() -> PromptBuilder {
        PromptBuilder::new((100..200).collect(), 8)
    }

    #[test]
    fn shared_ids_are_shared_tokens_and_the_rest_is_the_requests_own() {
        let b = builder();
        let r = |ids: Vec<u64>, len| TraceRequest { input_length: len, hash_ids: ids, ..TraceRequest::default() };
        let a = b.prompt(&r(vec![0, 1, 2], 24), 0, None);
        let c = b.prompt(&r(vec![0, 1, 9], 20), 1, None);
        assert_eq!(a.tokens.len(), 24);
        assert_eq!(c.tokens.len(), 20);
        assert_eq!(a.tokens[..16], c.tokens[..16]);
        assert_ne!(a.tokens[16..20], c.tokens[16..20]);
        // Same request, same prompt; past its ids, a request's tokens are its own.
        assert_eq!(b.prompt(&r(vec![0, 1, 2], 24), 0, None), a);
        let long_a = b.prompt(&r(vec![5], 30), 3, None);
        let long_b = b.prompt(&r(vec![5], 30), 4, None);
        assert_eq!(long_a.tokens[..8], long_b.tokens[..8]);
        assert_ne!(long_a.tokens[8..], long_b.tokens[8..]);
    }

    #[test]
    fn long_prompts_are_clipped_and_say_so() {
        let r = TraceRequest { input_length: 40, hash_ids: vec![1, 2, 3, 4, 5], ..TraceRequest::default() };
        let p = builder().prompt(&r, 0, Some(10));
        assert_eq!((p.tokens.len(), p.clipped), (10, true));
        assert!(!builder().prompt(&r, 0, Some(40)).clipped);
    }
}
