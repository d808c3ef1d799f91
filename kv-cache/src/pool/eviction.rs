//! Eviction policy: which unreferenced cached block of a tier leaves first. The pool (mechanism) tells the policy
//! when blocks become evictable or stop being so; the policy only chooses.

/// Chooses eviction victims among a tier's evictable slots.
pub trait EvictionPolicy: std::fmt::Debug {
    /// `slot` became evictable (it was just cached or stored).
    fn insert(&mut self, slot: u32);
    /// `slot` is no longer evictable (it was taken, moved or dropped).
    fn remove(&mut self, slot: u32);
    /// The slot to evict next, if any is evictable.
    fn victim(&self) -> Option<u32>;
    /// Whether victims come in the order slots became evictable (oldest first). The pool then tells from counts
    /// alone whether a victim became evictable during a batch of evictions; for other policies it logs each
    /// eviction's changes before the next.
    fn oldest_first(&self) -> bool {
        false
    }
    /// The slot that would be the victim after `slot` (itself a victim-to-be), where the policy knows it cheaply;
    /// the pool uses it to ask for the lines of victims ahead. `None`: unknown.
    fn after(&self, _slot: u32) -> Option<u32> {
        None
    }
    /// Asks the processor for the policy's own line about `slot` (see [`crate::prefetch`]).
    fn prefetch(&self, _slot: u32) {}
}

/// Least recently cached first: a list threaded through the slots (slots are small dense numbers), so each call is
/// a few array writes and no hashing; the policy stays a pure function of its calls.
#[derive(Debug, Default, Clone)]
pub struct Lru {
    /// Per slot: (previous, next) in the list, oldest first; `UNLINKED` when the slot is not evictable.
    links: Vec<(u32, u32)>,
    head: u32,
    tail: u32,
}

/// No slot: the end of the list, or an empty one.
const NONE: u32 = u32::MAX;
/// A slot not in the list.
const UNLINKED: (u32, u32) = (UNLINKED_NEXT, UNLINKED_NEXT);
const UNLINKED_NEXT: u32 = u32::MAX - 1;

impl Lru {
    fn linked(&self, slot: u32) -> bool {
        self.links.get(slot as usize).is_some_and(|l| *l != UNLINKED)
    }
}

impl EvictionPolicy for Lru {
    fn insert(&mut self, slot: u32) {
        self.remove(slot);
        if self.links.is_empty() {
            (self.head, self.tail) = (NONE, NONE);
        }
        if self.links.len() <= slot as usize {
            self.links.resize(slot as usize + 1, UNLINKED);
        }
        self.links[slot as usize] = (self.tail, NONE);
        match self.tail {
            NONE => self.head = slot,
            t => self.links[t as usize].1 = slot,
        }
        self.tail = slot;
    }

    fn remove(&mut self, slot: u32) {
        if !self.linked(slot) {
            return;
        }
        let (prev, next) = std::mem::replace(&mut self.links[slot as usize], UNLINKED);
        match prev {
            NONE => self.head = next,
            p => self.links[p as usize].1 = next,
        }
        match next {
            NONE => self.tail = prev,
            n => self.links[n as usize].0 = prev,
        }
    }

    fn victim(&self) -> Option<u32> {
        (!self.links.is_empty() && self.head != NONE).then_some(self.head)
    }

    fn oldest_first(&self) -> bool {
        true
    }

    fn after(&self, slot: u32) -> Option<u32> {
        match self.links.get(slot as usize)?.1 {
            NONE | UNLINKED_NEXT => None,
            next => Some(next),
        }
    }

    fn prefetch(&self, slot: u32) {
        if let Some(link) = self.links.get(slot as usize) {
            crate::prefetch::prefetch(link);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_inserted_goes_first_and_reinsertion_refreshes() {
        let mut lru = Lru::default();
        assert_eq!(lru.victim(), None);
        for s in [5, 2, 9] {
            lru.insert(s);
        }
        assert_eq!(lru.victim(), Some(5));
        lru.insert(5);
        assert_eq!(lru.victim(), Some(2));
        lru.remove(2);
        lru.remove(2);
        assert_eq!(lru.victim(), Some(9));
        lru.remove(9);
        lru.remove(5);
        assert_eq!(lru.victim(), None);
        lru.insert(1);
        assert_eq!(lru.victim(), Some(1));
    }
}
