//! What an engine that publishes no KV events is predicted to hold: the blocks of the prompts the router sent it,
//! at most `capacity` of them (the least recently sent go first, a prompt's last blocks before its first, as an
//! engine's LRU frees a chain from its end), each forgotten `ttl` after it was last sent. SGLang's gateway and
//! Dynamo's router without events predict the same way. Pure: the caller applies the events it returns to the
//! index and passes the clock in.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use kv_cache::events::{KvEvent, Tier};
use kv_cache::{LocalHash, SeqHash};

/// One worker's predicted cache.
#[derive(Debug)]
pub struct Predicted {
    capacity: usize,
    ttl: Duration,
    /// Each block's place in `order`.
    stamps: HashMap<SeqHash, u64>,
    /// Blocks by last use, oldest first.
    order: BTreeMap<u64, (SeqHash, Instant)>,
    next: u64,
}

impl Predicted {
    pub fn new(capacity: usize, ttl: Duration) -> Predicted {
        Predicted { capacity, ttl, stamps: HashMap::new(), order: BTreeMap::new(), next: 0 }
    }

    pub fn len(&self) -> usize {
        self.stamps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stamps.is_empty()
    }

    /// A prompt with these blocks (in chain order) was sent at `now`: its blocks are predicted held, and used
    /// last. Returns the index events that say so: stores of the blocks not held before, then removals of
    /// those pushed out by the capacity.
    pub fn sent(&mut self, blocks: &[(SeqHash, LocalHash)], now: Instant) -> Vec<KvEvent> {
        let mut events = Vec::new();
        // New blocks as runs in chain order, each with its parent.
        let mut run: Vec<(SeqHash, LocalHash)> = Vec::new();
        let mut parent = None;
        for (i, &(seq, local)) in blocks.iter().enumerate() {
            if self.stamps.contains_key(&seq) {
                if !run.is_empty() {
                    events.push(stored(parent, std::mem::take(&mut run)));
                }
                parent = Some(seq);
            } else {
                if run.is_empty() {
                    parent = i.checked_sub(1).map(|p| blocks[p].0);
                }
                run.push((seq, local));
            }
        }
        if !run.is_empty() {
            events.push(stored(parent, run));
        }
        // Stamped last block first, so that the chain's end is older than its start.
        for &(seq, _) in blocks.iter().rev() {
            if let Some(old) = self.stamps.insert(seq, self.next) {
                self.order.remove(&old);
            }
            self.order.insert(self.next, (seq, now));
            self.next += 1;
        }
        let mut out = Vec::new();
        while self.stamps.len() > self.capacity {
            let Some((_, (seq, _))) = self.order.pop_first() else { break };
            self.stamps.remove(&seq);
            out.push(seq);
        }
        if !out.is_empty() {
            events.push(KvEvent::Removed { tier: Tier::Device, seqs: out });
        }
        events
    }

    /// Forgets the blocks not sent for `ttl` by `now`; the removal event, if any were.
    pub fn expire(&mut self, now: Instant) -> Option<KvEvent> {
        let mut out = Vec::new();
        while let Some((&stamp, &(seq, at))) = self.order.first_key_value() {
            if now.saturating_duration_since(at) < self.ttl {
                break;
            }
            self.order.remove(&stamp);
            self.stamps.remove(&seq);
            out.push(seq);
        }
        (!out.is_empty()).then_some(KvEvent::Removed { tier: Tier::Device, seqs: out })
    }
}

fn stored(parent: Option<SeqHash>, blocks: Vec<(SeqHash, LocalHash)>) -> KvEvent {
    KvEvent::Stored { tier: Tier::Device, parent, blocks }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use kv_cache::{BlockSize, block_hashes};
    use proptest::prelude::*;

    use super::*;

    fn blocks(tokens: &[u32]) -> Vec<(SeqHash, LocalHash)> {
        let h = block_hashes(tokens, BlockSize::new(2).expect("non-zero"), None);
        h.seq.into_iter().zip(h.local).collect()
    }

    /// The blocks the events say are held, applied in order to a set.
    fn apply(held: &mut HashSet<SeqHash>, events: &[KvEvent]) {
        for e in events {
            match e {
                KvEvent::Stored { blocks, .. } => held.extend(blocks.iter().map(|b| b.0)),
                KvEvent::Removed { seqs, .. } => seqs.iter().for_each(|s| assert!(held.remove(s), "removed twice")),
                KvEvent::Cleared { .. } => held.clear(),
            }
        }
    }

    #[test]
    fn a_shared_prefix_is_stored_once_and_new_blocks_name_their_parent() {
        let t0 = Instant::now();
        let mut p = Predicted::new(100, Duration::from_secs(60));
        let first = blocks(&[1, 2, 3, 4, 5, 6]);
        assert_eq!(p.sent(&first, t0), vec![stored(None, first.clone())]);
        let second = blocks(&[1, 2, 3, 4, 7, 8, 9, 10]);
        assert_eq!(p.sent(&second, t0), vec![stored(Some(second[1].0), second[2..].to_vec())]);
        assert_eq!(p.len(), 5);
        assert!(p.sent(&first, t0).is_empty(), "held already");
    }

    #[test]
    fn over_capacity_the_least_recently_sent_chain_loses_its_end_first() {
        let t0 = Instant::now();
        let mut p = Predicted::new(4, Duration::from_secs(60));
        let a = blocks(&[1, 2, 3, 4, 5, 6]);
        let b = blocks(&[9, 9, 8, 8]);
        p.sent(&a, t0);
        let events = p.sent(&b, t0);
        assert_eq!(events.last(), Some(&KvEvent::Removed { tier: Tier::Device, seqs: vec![a[2].0] }));
        // Sending `a` again makes `b` the oldest: its end goes first.
        let events = p.sent(&a, t0);
        assert_eq!(events.last(), Some(&KvEvent::Removed { tier: Tier::Device, seqs: vec![b[1].0] }));
    }

    #[test]
    fn blocks_not_sent_for_the_ttl_are_forgotten() {
        let t0 = Instant::now();
        let mut p = Predicted::new(100, Duration::from_secs(10));
        let a = blocks(&[1, 2, 3, 4]);
        let b = blocks(&[5, 6]);
        p.sent(&a, t0);
        p.sent(&b, t0 + Duration::from_secs(5));
        assert_eq!(p.expire(t0 + Duration::from_secs(9)), None);
        let gone = p.expire(t0 + Duration::from_secs(10));
        assert_eq!(gone, Some(KvEvent::Removed { tier: Tier::Device, seqs: vec![a[1].0, a[0].0] }));
        assert_eq!(p.len(), 1);
    }

    proptest! {
        /// Against a model: the events, applied in order, describe exactly what is held; never more than the
        /// capacity; every block of the prompt just sent is held when it fits.
        #[test]
        fn events_track_what_is_held(
            prompts in prop::collection::vec(prop::collection::vec(0u32..4, 0..12), 1..30),
            capacity in 1usize..12,
        ) {
            let t0 = Instant::now();
            let mut p = Predicted::new(capacity, Duration::from_secs(3));
            let mut held = HashSet::new();
            for (i, prompt) in prompts.iter().enumerate() {
                let now = t0 + Duration::from_secs(i as u64);
                apply(&mut held, p.expire(now).as_slice());
                let b = blocks(prompt);
                apply(&mut held, &p.sent(&b, now));
                prop_assert_eq!(held.len(), p.len());
                prop_assert!(held.len() <= capacity);
                let distinct: HashSet<SeqHash> = b.iter().map(|x| x.0).collect();
                if distinct.len() <= capacity {
                    prop_assert!(distinct.iter().all(|s| held.contains(s)));
                }
            }
        }
    }
}
