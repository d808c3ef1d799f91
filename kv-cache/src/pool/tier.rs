//! One tier's slot table: the state of every slot, the free list and the eviction policy. Which slot holds a
//! block, whatever its tier, is the pool's one map (`BlockPool::located`): a block moving down a tier changes its
//! entry there instead of leaving one tier's map and joining the next one's. That map keeps no keys: the hash in
//! the slot an entry names is the key ([`TierTable::seq_at`]).

use std::num::NonZeroU32;

use super::{EvictionPolicy, TierUsage};
use crate::events::BlockMeta;
use crate::hash::SeqHash;
use crate::table::Table;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Free,
    /// Referenced by sequences (device tier only); registered once complete.
    Used {
        refs: NonZeroU32,
        meta: Option<BlockMeta>,
    },
    /// Complete and unreferenced: findable, evictable.
    Cached {
        meta: BlockMeta,
    },
    /// Being moved to another tier: neither free nor evictable, still findable.
    Pinned {
        meta: BlockMeta,
    },
}

#[derive(Debug)]
pub struct TierTable<E> {
    states: Table<State>,
    free: Vec<u32>,
    policy: E,
    /// Slots per state, kept as states change: usage is read at every engine step, and scanning every slot of
    /// a large tier each time cost more than the step itself.
    counts: TierUsage,
}

/// Where a slot in `state` is counted.
fn count_of(counts: &mut TierUsage, state: State) -> &mut usize {
    match state {
        State::Free => &mut counts.free,
        State::Used { .. } | State::Pinned { .. } => &mut counts.used,
        State::Cached { .. } => &mut counts.cached,
    }
}

impl<E: EvictionPolicy + Default> TierTable<E> {
    pub fn new(capacity: usize) -> TierTable<E> {
        TierTable {
            states: Table::filled(capacity, State::Free),
            // Lowest slot first, so slot numbers are predictable in tests and logs.
            free: (0..capacity as u32).rev().collect(),
            policy: E::default(),
            counts: TierUsage { free: capacity, ..TierUsage::default() },
        }
    }

    /// Moves `slot` to `state`, keeping the counts.
    fn set(&mut self, slot: u32, state: State) {
        let old = std::mem::replace(&mut self.states[slot as usize], state);
        *count_of(&mut self.counts, old) -= 1;
        *count_of(&mut self.counts, state) += 1;
    }

    pub fn capacity(&self) -> usize {
        self.states.len()
    }

    pub fn usage(&self) -> TierUsage {
        self.counts
    }

    pub fn meta(&self, slot: u32) -> Option<BlockMeta> {
        match self.states.get(slot as usize)? {
            State::Used { meta, .. } => *meta,
            State::Cached { meta } => Some(*meta),
            State::Free | State::Pinned { .. } => None,
        }
    }

    /// The hash of the block `slot` holds, pinned ones included: what the pool's table of locations checks
    /// its entries against.
    pub fn seq_at(&self, slot: u32) -> Option<SeqHash> {
        match self.states.get(slot as usize)? {
            State::Used { meta, .. } => meta.map(|m| m.seq),
            State::Cached { meta } | State::Pinned { meta } => Some(meta.seq),
            State::Free => None,
        }
    }

    pub fn ref_count(&self, slot: u32) -> Option<NonZeroU32> {
        match self.states.get(slot as usize)? {
            State::Used { refs, .. } => Some(*refs),
            _ => None,
        }
    }

    pub fn victim(&self) -> Option<u32> {
        self.policy.victim()
    }

    /// The victim after `slot` in the policy's order, where it knows.
    pub fn after(&self, slot: u32) -> Option<u32> {
        self.policy.after(slot)
    }

    /// Asks for the lines about `slot` (its state and the policy's links) ahead of use.
    pub fn prefetch(&self, slot: u32) {
        if let Some(state) = self.states.get(slot as usize) {
            crate::prefetch::prefetch(state);
        }
        self.policy.prefetch(slot);
    }

    pub fn oldest_first(&self) -> bool {
        self.policy.oldest_first()
    }

    pub fn take_free(&mut self) -> Option<u32> {
        self.free.pop()
    }

    pub fn set_used(&mut self, slot: u32, meta: Option<BlockMeta>) {
        self.set(slot, State::Used { refs: NonZeroU32::MIN, meta });
    }

    pub fn set_cached(&mut self, slot: u32, meta: BlockMeta) {
        self.set(slot, State::Cached { meta });
        self.policy.insert(slot);
    }

    /// Removes a cached block, leaving its slot free; returns what it held.
    pub fn take_cached(&mut self, slot: u32) -> Option<BlockMeta> {
        let State::Cached { meta } = *self.states.get(slot as usize)? else { return None };
        self.policy.remove(slot);
        self.set(slot, State::Free);
        self.free.push(slot);
        Some(meta)
    }

    /// Makes a cached block unevictable while it is copied elsewhere; returns what it holds.
    pub fn pin(&mut self, slot: u32) -> Option<BlockMeta> {
        let State::Cached { meta } = *self.states.get(slot as usize)? else { return None };
        self.policy.remove(slot);
        self.set(slot, State::Pinned { meta });
        Some(meta)
    }

    /// Undoes [`pin`](Self::pin).
    pub fn unpin(&mut self, slot: u32, meta: BlockMeta) {
        self.set_cached(slot, meta);
    }

    /// Frees a pinned slot once its copy is done.
    pub fn free_pinned(&mut self, slot: u32) {
        self.set(slot, State::Free);
        self.free.push(slot);
    }

    pub fn register(&mut self, slot: u32, meta: BlockMeta) {
        if let State::Used { refs, .. } = self.states[slot as usize] {
            self.set(slot, State::Used { refs, meta: Some(meta) });
        }
    }

    /// One more reference to a used or cached block.
    pub fn add_ref(&mut self, slot: u32) {
        let next = match self.states[slot as usize] {
            State::Used { refs, meta } => State::Used { refs: refs.saturating_add(1), meta },
            State::Cached { meta } => {
                self.policy.remove(slot);
                State::Used { refs: NonZeroU32::MIN, meta: Some(meta) }
            }
            other => other,
        };
        self.set(slot, next);
    }

    /// One reference fewer; `None` if the slot was not in use.
    pub fn release(&mut self, slot: u32) -> Option<()> {
        let State::Used { refs, meta } = *self.states.get(slot as usize)? else { return None };
        let next = match (NonZeroU32::new(refs.get() - 1), meta) {
            (Some(refs), meta) => State::Used { refs, meta },
            (None, Some(meta)) => {
                self.policy.insert(slot);
                State::Cached { meta }
            }
            (None, None) => {
                self.free.push(slot);
                State::Free
            }
        };
        self.set(slot, next);
        Some(())
    }

    /// Drops every cached block.
    pub fn clear(&mut self) {
        for slot in 0..self.states.len() as u32 {
            self.take_cached(slot);
        }
    }

    /// Every findable block (registered, in use or cached), sorted.
    pub fn blocks(&self) -> Vec<BlockMeta> {
        let mut v: Vec<BlockMeta> = (0..self.states.len() as u32).filter_map(|s| self.meta(s)).collect();
        v.sort();
        v
    }
}
