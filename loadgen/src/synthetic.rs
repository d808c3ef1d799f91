//! Synthetic shared-prefix workloads, as Dynamo's prefix-ratio benchmark builds them: `prefixes` system prompts
//! of `prefix_len` tokens chosen by Zipf popularity, each request adding `suffix_len` tokens of its own, and
//! optionally sessions of several turns where each turn re-sends the conversation so far plus a new message.
//! Lengths are whole trace blocks (rounded up), so that every block id stands for whole blocks of tokens;
//! [`SyntheticSpec::check`] refuses lengths that would be rounded, for callers that take them from a user.

use crate::rng::{Rng, Zipf};
use crate::trace::TraceRequest;

/// The shape of a synthetic workload.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticSpec {
    pub requests: usize,
    pub prefixes: usize,
    pub prefix_len: usize,
    pub suffix_len: usize,
    pub output_len: usize,
    /// Zipf exponent of prefix popularity (0: uniform).
    pub zipf: f64,
    /// Turns per session (1: independent requests).
    pub turns: usize,
    /// Milliseconds between a turn's end and the next turn.
    pub turn_delay_ms: f64,
    pub seed: u64,
}

/// Ids below this stand for shared prefixes; the rest are requests' own blocks.
const OWN_IDS: u64 = 1 << 40;

impl SyntheticSpec {
    /// Whether the lengths are whole blocks of `block` tokens, as [`generate`](Self::generate) makes them; a
    /// length it would round up (256 tokens of 512-token blocks become 512) is refused, naming the length.
    pub fn check(&self, block: usize) -> Result<(), String> {
        for (name, len) in [("prefix length", self.prefix_len), ("suffix length", self.suffix_len)] {
            if block == 0 || len == 0 || len % block != 0 {
                return Err(format!(
                    "the {name} ({len} tokens) must be a positive multiple of the trace block ({block} tokens): \
                     the workload shares and differs by whole blocks (change the length, or the block size)"
                ));
            }
        }
        Ok(())
    }

    /// The workload's requests in session order (a session's turns follow each other), with block ids for
    /// blocks of `block` tokens.
    pub fn generate(&self, block: usize) -> Vec<TraceRequest> {
        let block = block.max(1);
        let (prefix_blocks, suffix_blocks) = (self.prefix_len.div_ceil(block), self.suffix_len.div_ceil(block).max(1));
        let zipf = Zipf::new(self.prefixes.max(1), self.zipf);
        let mut rng = Rng::new(self.seed);
        let mut own = OWN_IDS;
        let mut out = Vec::with_capacity(self.requests);
        let turns = self.turns.max(1);
        let mut session = 0;
        while out.len() < self.requests {
            let p = zipf.sample(&mut rng) as u64;
            let mut ids: Vec<u64> = (0..prefix_blocks as u64).map(|j| (p << 20) | j).collect();
            for turn in 0..turns {
                if out.len() == self.requests {
                    break;
                }
                ids.extend((0..suffix_blocks).map(|_| {
                    own += 1;
                    own
                }));
                out.push(TraceRequest {
                    arrival_ms: None,
                    input_length: ids.len() * block,
                    output_length: self.output_len.max(1),
                    hash_ids: ids.clone(),
                    session_id: (turns > 1).then(|| format!("s{session}")),
                    delay_ms: (turn > 0).then_some(self.turn_delay_ms),
                    recorded: None,
                    literal: None,
                    priority: 0,
                });
            }
            session += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_shared_and_turns_grow() {
        let spec = SyntheticSpec {
            requests: 7,
            prefixes: 2,
            prefix_len: 100,
            suffix_len: 30,
            output_len: 4,
            zipf: 1.0,
            turns: 3,
            turn_delay_ms: 50.0,
            seed: 1,
        };
        let r = spec.generate(64);
        assert_eq!(r.len(), 7);
        assert_eq!(r[0].input_length, 3 * 64, "two prefix blocks and one of its own");
        assert_eq!(r[1].hash_ids[..3], r[0].hash_ids[..], "a turn re-sends the conversation so far");
        assert_eq!(r[2].input_length, 5 * 64);
        assert_eq!((r[0].delay_ms, r[1].delay_ms), (None, Some(50.0)));
        assert_eq!(r[0].session_id.as_deref(), Some("s0"));
        assert_eq!(r[3].session_id.as_deref(), Some("s1"));
        // Every request starts with one of the two prefixes.
        assert!(r.iter().all(|x| x.hash_ids[0] >> 20 < 2 && x.hash_ids[1] & 0xFFFFF == 1));
    }

    #[test]
    fn lengths_that_would_be_rounded_up_are_refused() {
        let spec = |prefix_len, suffix_len| SyntheticSpec {
            requests: 1,
            prefixes: 1,
            prefix_len,
            suffix_len,
            output_len: 1,
            zipf: 0.0,
            turns: 1,
            turn_delay_ms: 0.0,
            seed: 1,
        };
        assert_eq!(spec(1024, 512).check(512), Ok(()));
        assert_eq!(spec(256, 64).check(64), Ok(()));
        let e = spec(256, 64).check(512).expect_err("256 tokens would become 512");
        assert!(e.contains("prefix length (256 tokens)") && e.contains("512"), "{e}");
        assert!(spec(512, 64).check(512).expect_err("64 would become 512").contains("suffix length (64 tokens)"));
        assert!(spec(512, 0).check(512).is_err(), "no tokens of its own would still get a block");
        // What the check guards: generate rounds up.
        assert_eq!(spec(256, 64).generate(512)[0].input_length, 1024);
    }
}
