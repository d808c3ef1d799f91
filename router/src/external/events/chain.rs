//! An engine's KV events in Tandem's terms: the engine names its blocks by its own hashes, at its own block size,
//! so each stored block is re-hashed here from the token ids the event carries, into the router's chained hashes
//! at the router's block size, and each removal is translated back through what was stored.
//!
//! Each engine block the engine still holds is remembered with the router blocks whose last token it holds (its
//! "own" blocks) and the tokens after the last whole router block (fewer than one block), which its children
//! continue from. With an engine block smaller than the router's, a block that completes no router block owns
//! none: removing it while a child it leads to is still held leaves one router block indexed a little longer (the
//! engines evict a chain's tail first, so this rarely happens).

use std::collections::HashMap;

use kv_cache::events::KvEvent;
use kv_cache::events::Tier;
use kv_cache::{BlockSize, CacheNamespace, LocalHash, SeqHash};

use super::wire::{EngineEvent, EngineHash};

#[derive(Clone, Debug)]
struct Node {
    /// The chained hash of the last whole router block up to the end of this engine block.
    last: Option<SeqHash>,
    /// The tokens after that block.
    tail: Vec<u32>,
    /// Router blocks completed inside this engine block.
    owned: Vec<(SeqHash, LocalHash)>,
    /// The chain's cache namespace while no router block is complete yet (an engine block smaller than the
    /// router's): the first router block, completed by a child, is hashed in it.
    namespace: Option<CacheNamespace>,
    /// Tiers holding it (a bit per [`Tier::index`]).
    tiers: u8,
}

/// What happened to one engine event.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// The router's events for it.
    pub events: Vec<KvEvent>,
    /// Engine blocks not followed: unknown parents (missed events), keys beyond tokens, tiers not modelled.
    pub skipped: usize,
}

/// The engine holds more blocks than a router follows for one worker: its view is dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the engine reports more than {0} blocks; not followed")]
pub struct Overflow(pub usize);

/// One engine's blocks, as far as its events said.
#[derive(Debug)]
pub struct EngineBlocks {
    block_size: BlockSize,
    nodes: HashMap<EngineHash, Node>,
    max_blocks: usize,
}

impl EngineBlocks {
    /// Following an engine for a router hashing `block_size`-token blocks, remembering `max_blocks` engine blocks
    /// at most.
    pub fn new(block_size: BlockSize, max_blocks: usize) -> EngineBlocks {
        EngineBlocks { block_size, nodes: HashMap::new(), max_blocks }
    }

    /// Engine blocks held now.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Forgets everything (the router no longer knows what the engine holds).
    pub fn clear(&mut self) {
        self.nodes.clear();
    }

    /// The router's events for one of the engine's.
    pub fn apply(&mut self, event: &EngineEvent) -> Result<Outcome, Overflow> {
        let mut out = Outcome::default();
        match event {
            EngineEvent::Stored { hashes, parent, tokens, block_size, tier, salt, keyed } => {
                let (Some(tier), false) = (tier, keyed) else {
                    out.skipped = hashes.len();
                    return Ok(out);
                };
                let chain = Chain { parent: *parent, namespace: salt.as_deref().map(CacheNamespace::new) };
                self.store(hashes, chain, tokens, *block_size as usize, *tier, &mut out)?;
            }
            EngineEvent::Removed { hashes, tier, other_group } => {
                let (Some(tier), false) = (tier, other_group) else {
                    out.skipped = hashes.len();
                    return Ok(out);
                };
                let bit = 1u8 << tier.index();
                let mut seqs = Vec::new();
                for h in hashes {
                    let Some(node) = self.nodes.get_mut(h) else { continue };
                    if node.tiers & bit == 0 {
                        continue;
                    }
                    node.tiers &= !bit;
                    seqs.extend(node.owned.iter().map(|(s, _)| *s));
                    if node.tiers == 0 {
                        self.nodes.remove(h);
                    }
                }
                if !seqs.is_empty() {
                    out.events.push(KvEvent::Removed { tier: *tier, seqs });
                }
            }
            EngineEvent::Cleared => {
                self.nodes.clear();
                out.events.push(KvEvent::Cleared { tier: None });
            }
            EngineEvent::Unknown(_) => {}
        }
        Ok(out)
    }

    fn store(
        &mut self,
        hashes: &[EngineHash],
        chain: Chain,
        tokens: &[u32],
        engine_block: usize,
        tier: Tier,
        out: &mut Outcome,
    ) -> Result<(), Overflow> {
        let (mut last, mut tail, mut namespace) = match chain.parent {
            None => (None, Vec::new(), chain.namespace),
            Some(p) => match self.nodes.get(&p) {
                Some(n) => (n.last, n.tail.clone(), n.namespace.clone()),
                None => {
                    // Its parent was never seen (events missed, or a parent keyed by more than tokens).
                    out.skipped = hashes.len();
                    return Ok(());
                }
            },
        };
        let bit = 1u8 << tier.index();
        let ours = self.block_size.tokens();
        // Consecutive router blocks newly stored on `tier`, after `run_parent`.
        let mut run_parent = last;
        let mut run = Vec::new();
        for (i, hash) in hashes.iter().enumerate() {
            let node = match self.nodes.get_mut(hash) {
                Some(node) => node,
                None => {
                    if self.nodes.len() >= self.max_blocks {
                        return Err(Overflow(self.max_blocks));
                    }
                    tail.extend_from_slice(&tokens[i * engine_block..(i + 1) * engine_block]);
                    let mut owned = Vec::new();
                    let whole = tail.len() / ours * ours;
                    for block in tail[..whole].chunks_exact(ours) {
                        let local = match last {
                            None => kv_cache::first_local_hash(block, namespace.as_ref()),
                            Some(_) => kv_cache::local_hash(block),
                        };
                        let seq = kv_cache::chained(last, local);
                        owned.push((seq, local));
                        last = Some(seq);
                    }
                    tail.drain(..whole);
                    let namespace = namespace.clone().filter(|_| last.is_none());
                    self.nodes.entry(*hash).or_insert(Node { last, tail: tail.clone(), owned, tiers: 0, namespace })
                }
            };
            // Known already (stored on another tier, or again): it continues from what it recorded.
            last = node.last;
            tail.clone_from(&node.tail);
            namespace.clone_from(&node.namespace);
            if node.tiers & bit != 0 {
                flush(tier, &mut run_parent, &mut run, last, out);
                continue;
            }
            node.tiers |= bit;
            run.extend_from_slice(&node.owned);
        }
        flush(tier, &mut run_parent, &mut run, last, out);
        Ok(())
    }
}

/// Where a stored run of engine blocks starts: after `parent`, or a chain's first blocks in `namespace`.
struct Chain {
    parent: Option<EngineHash>,
    namespace: Option<CacheNamespace>,
}

/// Emits the run of router blocks collected so far; the next run starts after `last`.
fn flush(
    tier: Tier,
    run_parent: &mut Option<SeqHash>,
    run: &mut Vec<(SeqHash, LocalHash)>,
    last: Option<SeqHash>,
    out: &mut Outcome,
) {
    if !run.is_empty() {
        out.events.push(KvEvent::Stored { tier, parent: *run_parent, blocks: std::mem::take(run) });
    }
    *run_parent = last;
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_index::{PrefixIndex, WorkerId};
    use proptest::prelude::*;

    const OURS: u32 = 16;

    fn stored(hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>, b: u32, tier: Tier) -> EngineEvent {
        EngineEvent::Stored { hashes, parent, tokens, block_size: b, tier: Some(tier), salt: None, keyed: false }
    }

    /// `event` with the cache salt `salt` (read only where it starts a chain).
    fn salted(mut event: EngineEvent, salt: &str) -> EngineEvent {
        if let EngineEvent::Stored { salt: s, .. } = &mut event {
            *s = Some(salt.to_string());
        }
        event
    }

    fn removed(hashes: Vec<u64>, tier: Tier) -> EngineEvent {
        EngineEvent::Removed { hashes, tier: Some(tier), other_group: false }
    }

    /// Feeds `events` through the converter into an index, and returns the overlap of `prompt` on the device tier.
    fn device_overlap(events: &[EngineEvent], prompt: &[u32]) -> usize {
        overlap_in(events, prompt, None)
    }

    /// The same for `prompt` in the cache namespace `namespace`.
    fn overlap_in(events: &[EngineEvent], prompt: &[u32], namespace: Option<&str>) -> usize {
        let mut blocks = EngineBlocks::new(BlockSize::new(OURS).expect("16"), 1 << 20);
        let mut index = PrefixIndex::default();
        let w = WorkerId(1);
        index.replace(w, &kv_cache::events::Snapshot { as_of: None, tiers: Default::default() });
        let mut id = 0;
        for e in events {
            for ours in blocks.apply(e).expect("room").events {
                index.apply(w, kv_cache::events::EventId(id), &ours).expect("in order");
                id += 1;
            }
        }
        let namespace = namespace.map(CacheNamespace::new);
        let hashes = kv_cache::block_hashes(prompt, BlockSize::new(OURS).expect("16"), namespace.as_ref()).seq;
        index.overlap(&hashes).get(&w).map_or(0, |o| o.device)
    }

    #[test]
    fn engine_blocks_of_any_size_index_as_the_routers_own() {
        let prompt: Vec<u32> = (0..96).collect();
        // 96 tokens in engine blocks of 32 (two events), 8, 16 and 24 tokens: six router blocks each time.
        for b in [32u32, 8, 16, 24] {
            let n = 96 / b as usize;
            let hashes: Vec<u64> = (100..100 + n as u64).collect();
            let split = n / 2;
            let first = stored(hashes[..split].to_vec(), None, prompt[..split * b as usize].to_vec(), b, Tier::Device);
            let second = stored(
                hashes[split..].to_vec(),
                Some(hashes[split - 1]),
                prompt[split * b as usize..].to_vec(),
                b,
                Tier::Device,
            );
            assert_eq!(device_overlap(&[first.clone(), second.clone()], &prompt), 6, "engine blocks of {b}");
            // A removal of the engine's last block takes the router blocks ending in it.
            let gone = removed(vec![*hashes.last().expect("one")], Tier::Device);
            // The router blocks whose last token is in the engine's last block go: (80, 96] for 24, (64, 96] for 32.
            let left = (1..=6).filter(|k| 16 * k <= 96 - b as usize).count();
            assert_eq!(device_overlap(&[first, second, gone], &prompt), left, "engine blocks of {b}");
        }
    }

    #[test]
    fn a_salted_chain_indexes_in_its_namespace_only() {
        let prompt: Vec<u32> = (0..96).collect();
        for b in [32u32, 8, 16, 24, 5] {
            let n = 96 / b as usize;
            let hashes: Vec<u64> = (100..100 + n as u64).collect();
            let split = n / 2;
            let cut = split * b as usize;
            // The first event starts the chain with the salt; its child continues in the parent's namespace.
            let first = salted(stored(hashes[..split].to_vec(), None, prompt[..cut].to_vec(), b, Tier::Device), "t\0s");
            let second = stored(
                hashes[split..].to_vec(),
                Some(hashes[split - 1]),
                prompt[cut..n * b as usize].to_vec(),
                b,
                Tier::Device,
            );
            let events = [first, second];
            let whole = n * b as usize / 16;
            assert_eq!(overlap_in(&events, &prompt, Some("t\0s")), whole, "engine blocks of {b}");
            assert_eq!(overlap_in(&events, &prompt, None), 0, "engine blocks of {b}: a plain prompt");
            assert_eq!(overlap_in(&events, &prompt, Some("t\0other")), 0, "engine blocks of {b}: another salt");
        }
    }

    #[test]
    fn a_block_moved_down_a_tier_and_its_orphans() {
        let prompt: Vec<u32> = (0..32).collect();
        let on = |tier| stored(vec![1, 2], None, prompt.clone(), 16, tier);
        let mut blocks = EngineBlocks::new(BlockSize::new(OURS).expect("16"), 10);
        assert_eq!(blocks.apply(&on(Tier::Device)).expect("room").events.len(), 1);
        // Offloaded: stored on the host, then removed from the device; known blocks keep their hashes.
        let host = blocks.apply(&on(Tier::Host)).expect("room").events;
        let dev = blocks.apply(&removed(vec![1, 2], Tier::Device)).expect("room").events;
        match (&host[..], &dev[..]) {
            (
                [KvEvent::Stored { tier: Tier::Host, blocks: h, .. }],
                [KvEvent::Removed { tier: Tier::Device, seqs }],
            ) => {
                assert_eq!(h.iter().map(|b| b.0).collect::<Vec<_>>(), *seqs);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(blocks.len(), 2);
        // Stored again on the host: nothing new. A child of a parent never seen is skipped.
        assert!(blocks.apply(&on(Tier::Host)).expect("room").events.is_empty());
        let orphan = blocks.apply(&stored(vec![9], Some(77), vec![0; 16], 16, Tier::Device)).expect("room");
        assert_eq!((orphan.events.len(), orphan.skipped), (0, 1));
        assert!(blocks.apply(&removed(vec![1, 2], Tier::Host)).expect("room").events.len() == 1);
        assert!(blocks.is_empty());
        // Past its limit it says so instead of growing.
        let many = stored((0..11).collect(), None, vec![0; 11 * 16], 16, Tier::Device);
        assert_eq!(blocks.apply(&many), Err(Overflow(10)));
    }

    proptest! {
        /// Whatever the engine's block size and however its chain is split into events, the device overlap of the
        /// whole sequence is the number of whole router blocks in it.
        #[test]
        fn any_split_of_any_block_size(
            b in 1u32..40,
            n in 1usize..12,
            cuts in proptest::collection::vec(any::<bool>(), 12),
            salt in proptest::option::of("[a-z]{1,3}"),
        ) {
            let tokens: Vec<u32> = (0..(b as usize * n) as u32).map(|t| t * 7 + 3).collect();
            let mut events = Vec::new();
            let mut start = 0;
            for i in 0..n {
                if i + 1 == n || cuts[i] {
                    let parent = (start > 0).then(|| start as u64 - 1);
                    let hashes = (start as u64..=i as u64).collect();
                    let toks = tokens[start * b as usize..(i + 1) * b as usize].to_vec();
                    // Every event says the salt, as SGLang's do: only the chain's first one counts.
                    let event = stored(hashes, parent, toks, b, Tier::Device);
                    events.push(match &salt { Some(s) => salted(event, s), None => event });
                    start = i + 1;
                }
            }
            let whole = tokens.len() / OURS as usize;
            prop_assert_eq!(overlap_in(&events, &tokens, salt.as_deref()), whole);
            if salt.is_some() {
                prop_assert_eq!(overlap_in(&events, &tokens, None), 0);
            }
        }
    }
}
