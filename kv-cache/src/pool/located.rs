//! Where every findable block is: a hash table from block hash to [`Location`], made for the pool's access
//! pattern. Each tier move and eviction updates it, and on a large pool nearly every update misses the cache;
//! std's table keeps its control bytes apart from its entries, so each of those lookups misses twice. Here an
//! entry holds its key and value together and collisions go to the next entries (linear probing), so a lookup is
//! one miss; removal shifts the entries after it back (no tombstones), and the table keeps at most half its entries
//! in use so probe runs stay short. Positions come from the keyed hasher of [`crate::fastmap`], so hashes chosen by
//! an adversary do not pile into one run.

use std::hash::BuildHasher;

use super::Location;
use crate::events::Tier;
use crate::fastmap::KeyedState;
use crate::hash::SeqHash;

/// An entry's tier byte when the entry is empty.
const EMPTY: u8 = u8::MAX;

#[derive(Clone, Copy, Debug)]
struct Entry {
    key: u64,
    slot: u32,
    /// [`Tier::index`], or [`EMPTY`].
    tier: u8,
}

const VACANT: Entry = Entry { key: 0, slot: 0, tier: EMPTY };

impl Entry {
    fn new(key: u64, at: Location) -> Entry {
        Entry { key, slot: at.slot, tier: at.tier.index() as u8 }
    }

    fn location(&self) -> Location {
        Location { tier: Tier::ALL[self.tier as usize], slot: self.slot }
    }
}

/// Block hash → location.
#[derive(Debug)]
pub struct Located {
    entries: Vec<Entry>,
    /// `entries.len() - 1` (a power of two minus one).
    mask: usize,
    len: usize,
    hasher: KeyedState,
}

/// Where a key is, or where it would go.
enum Probe {
    Found(usize),
    Vacant(usize),
}

impl Located {
    /// A table that holds `n` entries without growing.
    pub fn with_capacity(n: usize) -> Located {
        let size = (2 * n).next_power_of_two().max(16);
        Located { entries: vec![VACANT; size], mask: size - 1, len: 0, hasher: KeyedState::default() }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.len
    }

    fn home(&self, key: u64) -> usize {
        // The hasher's high bits are its best mixed.
        (self.hasher.hash_one(key) >> 32) as usize & self.mask
    }

    fn probe(&self, key: u64) -> Probe {
        let mut i = self.home(key);
        loop {
            let e = &self.entries[i];
            if e.tier == EMPTY {
                return Probe::Vacant(i);
            }
            if e.key == key {
                return Probe::Found(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    pub fn get(&self, seq: &SeqHash) -> Option<Location> {
        match self.probe(seq.0) {
            Probe::Found(i) => Some(self.entries[i].location()),
            Probe::Vacant(_) => None,
        }
    }

    /// Sets `seq`'s location; returns the one it replaces.
    pub fn insert(&mut self, seq: SeqHash, at: Location) -> Option<Location> {
        self.upsert(seq, |_| Some(at))
    }

    /// Looks `seq` up once and sets its location to what `decide` returns given the current one (`None`: leave
    /// the table as it is); returns the current one.
    pub fn upsert(
        &mut self,
        seq: SeqHash,
        decide: impl FnOnce(Option<Location>) -> Option<Location>,
    ) -> Option<Location> {
        if 2 * (self.len + 1) > self.entries.len() {
            self.grow();
        }
        match self.probe(seq.0) {
            Probe::Found(i) => {
                let old = self.entries[i].location();
                if let Some(at) = decide(Some(old)) {
                    self.entries[i] = Entry::new(seq.0, at);
                }
                Some(old)
            }
            Probe::Vacant(i) => {
                if let Some(at) = decide(None) {
                    self.entries[i] = Entry::new(seq.0, at);
                    self.len += 1;
                }
                None
            }
        }
    }

    /// Removes `seq`; returns where it was.
    pub fn remove(&mut self, seq: &SeqHash) -> Option<Location> {
        let Probe::Found(mut hole) = self.probe(seq.0) else { return None };
        let old = self.entries[hole].location();
        // Shift back every later entry of the run that may move into the hole (whose home is not between the
        // hole and it), so that every key stays reachable from its home without crossing an empty entry.
        let mut i = hole;
        loop {
            i = (i + 1) & self.mask;
            let e = self.entries[i];
            if e.tier == EMPTY {
                break;
            }
            let home = self.home(e.key);
            let distance_home = i.wrapping_sub(home) & self.mask;
            let distance_hole = i.wrapping_sub(hole) & self.mask;
            if distance_home >= distance_hole {
                self.entries[hole] = e;
                hole = i;
            }
        }
        self.entries[hole] = VACANT;
        self.len -= 1;
        Some(old)
    }

    fn grow(&mut self) {
        let old = std::mem::take(&mut self.entries);
        let size = (old.len() * 2).max(16);
        self.entries = vec![VACANT; size];
        self.mask = size - 1;
        for e in old.into_iter().filter(|e| e.tier != EMPTY) {
            let Probe::Vacant(i) = self.probe(e.key) else { unreachable!("keys are unique") };
            self.entries[i] = e;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(500))]

        /// Inserts, replacements, removals and growth agree with std's map, over keys few enough to collide often.
        #[test]
        fn the_table_agrees_with_a_map(
            ops in proptest::collection::vec((0u8..3, 0u64..200, 0u32..1000, 0usize..3), 1..2_000),
            start in 0usize..40,
        ) {
            let mut table = Located::with_capacity(start);
            let mut model: HashMap<u64, Location> = HashMap::new();
            for (op, key, slot, tier) in ops {
                let at = Location { tier: Tier::ALL[tier], slot };
                let seq = SeqHash(key.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                match op {
                    0 => proptest::prop_assert_eq!(table.insert(seq, at), model.insert(seq.0, at)),
                    1 => proptest::prop_assert_eq!(table.remove(&seq), model.remove(&seq.0)),
                    _ => {
                        // Keep a found key as it is; put a missing one in.
                        let before = table.upsert(seq, |now| now.is_none().then_some(at));
                        proptest::prop_assert_eq!(before, model.get(&seq.0).copied());
                        model.entry(seq.0).or_insert(at);
                    }
                }
                proptest::prop_assert_eq!(table.len(), model.len());
            }
            for key in 0u64..200 {
                let seq = SeqHash(key.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                proptest::prop_assert_eq!(table.get(&seq), model.get(&seq.0).copied());
            }
        }
    }
}
