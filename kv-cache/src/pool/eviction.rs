//! Eviction policy: which unreferenced cached block of a tier leaves first. The pool (mechanism) tells the policy
//! when blocks become evictable or stop being so; the policy only chooses.

use std::collections::BTreeMap;

use crate::fastmap::FastMap;

/// Chooses eviction victims among a tier's evictable slots.
pub trait EvictionPolicy: std::fmt::Debug {
    /// `slot` became evictable (it was just cached or stored).
    fn insert(&mut self, slot: u32);
    /// `slot` is no longer evictable (it was taken, moved or dropped).
    fn remove(&mut self, slot: u32);
    /// The slot to evict next, if any is evictable.
    fn victim(&self) -> Option<u32>;
}

/// Least recently cached first. Time is a logical counter, so the policy stays a pure function of its calls.
#[derive(Debug, Default, Clone)]
pub struct Lru {
    tick: u64,
    by_tick: BTreeMap<u64, u32>,
    tick_of: FastMap<u32, u64>,
}

impl EvictionPolicy for Lru {
    fn insert(&mut self, slot: u32) {
        self.remove(slot);
        self.tick += 1;
        self.by_tick.insert(self.tick, slot);
        self.tick_of.insert(slot, self.tick);
    }

    fn remove(&mut self, slot: u32) {
        if let Some(t) = self.tick_of.remove(&slot) {
            self.by_tick.remove(&t);
        }
    }

    fn victim(&self) -> Option<u32> {
        self.by_tick.values().next().copied()
    }
}
