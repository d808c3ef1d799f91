//! Where each indexed block is: chained hash → (run, position), in a table made for the index's access pattern.
//! A simulated cluster's index holds millions of blocks, so nearly every insertion, removal and run change misses
//! the cache; the index knows ahead which hashes it will touch next (a stored stretch, a trimmed or deleted run, the
//! moved side of a split), so it asks for their lines a few blocks ahead ([`BlockMap::prefetch`]), which std's map
//! cannot be asked for. An entry is 16 bytes, key and value together, so a lookup is one miss; collisions go to the
//! next entries (linear probing), a removal shifts the later entries of its probe run back (no tombstones), and at
//! most half the entries are in use. The home of a key comes from the keyed hasher of [`kv_cache::fastmap`], so
//! hashes an adversary picks (they follow from public tokens and a public seed) do not pile into one probe run.

use std::hash::BuildHasher;

use kv_cache::SeqHash;
use kv_cache::fastmap::KeyedState;

/// A run number no run has: the entry is empty.
const EMPTY: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Entry {
    key: u64,
    run: u32,
    pos: u32,
}

const VACANT: Entry = Entry { key: 0, run: EMPTY, pos: 0 };

/// Chained hash → (run, position in the run's numbering).
#[derive(Debug)]
pub(crate) struct BlockMap {
    entries: Vec<Entry>,
    /// `entries.len() - 1` (a power of two minus one).
    mask: usize,
    /// 64 − log2(`entries.len()`): a key's home is its hash's top bits, the best mixed.
    shift: u32,
    len: usize,
    hasher: KeyedState,
}

impl Default for BlockMap {
    fn default() -> BlockMap {
        BlockMap::with_size(16)
    }
}

/// Where a key is, or where it would go.
enum Probe {
    Found(usize),
    Vacant(usize),
}

impl BlockMap {
    fn with_size(size: usize) -> BlockMap {
        debug_assert!(size.is_power_of_two());
        BlockMap {
            entries: vec![VACANT; size],
            mask: size - 1,
            shift: 64 - size.trailing_zeros(),
            len: 0,
            hasher: KeyedState::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    fn home(&self, key: u64) -> usize {
        (self.hasher.hash_one(key) >> self.shift) as usize & self.mask
    }

    fn probe(&self, key: u64) -> Probe {
        let mut i = self.home(key);
        loop {
            let e = &self.entries[i];
            if e.run == EMPTY {
                return Probe::Vacant(i);
            }
            if e.key == key {
                return Probe::Found(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Asks for the line where `h`'s probe starts, ahead of a lookup or change.
    pub fn prefetch(&self, h: &SeqHash) {
        kv_cache::prefetch::prefetch(&self.entries[self.home(h.0)]);
    }

    pub fn get(&self, h: &SeqHash) -> Option<(u32, u32)> {
        match self.probe(h.0) {
            Probe::Found(i) => Some((self.entries[i].run, self.entries[i].pos)),
            Probe::Vacant(_) => None,
        }
    }

    /// Puts `h` at `at` if it is absent; if it is there, leaves it and returns where it is.
    pub fn insert_new(&mut self, h: SeqHash, at: (u32, u32)) -> Result<(), (u32, u32)> {
        debug_assert!(at.0 != EMPTY);
        self.reserve_one();
        match self.probe(h.0) {
            Probe::Found(i) => Err((self.entries[i].run, self.entries[i].pos)),
            Probe::Vacant(i) => {
                self.entries[i] = Entry { key: h.0, run: at.0, pos: at.1 };
                self.len += 1;
                Ok(())
            }
        }
    }

    /// Moves `h`, if present, to run `run` (same position).
    pub fn set_run(&mut self, h: &SeqHash, run: u32) {
        if let Probe::Found(i) = self.probe(h.0) {
            self.entries[i].run = run;
        }
    }

    pub fn remove(&mut self, h: &SeqHash) {
        let Probe::Found(mut hole) = self.probe(h.0) else { return };
        // Shift back every later entry of the probe run that may move into the hole (whose home is not between
        // the hole and it), so that every key stays reachable from its home without crossing an empty entry.
        let mut i = hole;
        loop {
            i = (i + 1) & self.mask;
            let e = self.entries[i];
            if e.run == EMPTY {
                break;
            }
            let home = self.home(e.key);
            if (i.wrapping_sub(home) & self.mask) >= (i.wrapping_sub(hole) & self.mask) {
                self.entries[hole] = e;
                hole = i;
            }
        }
        self.entries[hole] = VACANT;
        self.len -= 1;
    }

    fn reserve_one(&mut self) {
        if 2 * (self.len + 1) <= self.entries.len() {
            return;
        }
        let mut grown = BlockMap::with_size(self.entries.len() * 2);
        grown.hasher = self.hasher;
        for e in self.entries.iter().filter(|e| e.run != EMPTY) {
            let mut i = grown.home(e.key);
            while grown.entries[i].run != EMPTY {
                i = (i + 1) & grown.mask;
            }
            grown.entries[i] = *e;
        }
        grown.len = self.len;
        *self = grown;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(500))]

        /// Insertions, run changes and removals agree with std's map, over keys few enough to collide often and
        /// through several growths.
        #[test]
        fn the_table_agrees_with_a_map(ops in proptest::collection::vec((0u8..4, 0u64..300, 0u32..50), 1..3_000)) {
            let mut table = BlockMap::default();
            let mut model: HashMap<u64, (u32, u32)> = HashMap::new();
            for (op, key, value) in ops {
                let h = SeqHash(key.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                match op {
                    0 => {
                        let got = table.insert_new(h, (value, key as u32));
                        let want = match model.get(&h.0) {
                            Some(&was) => Err(was),
                            None => {
                                model.insert(h.0, (value, key as u32));
                                Ok(())
                            }
                        };
                        proptest::prop_assert_eq!(got, want);
                    }
                    1 => {
                        table.set_run(&h, value);
                        if let Some(e) = model.get_mut(&h.0) {
                            e.0 = value;
                        }
                    }
                    2 => {
                        table.remove(&h);
                        model.remove(&h.0);
                    }
                    _ => proptest::prop_assert_eq!(table.get(&h), model.get(&h.0).copied()),
                }
                proptest::prop_assert_eq!(table.len(), model.len());
            }
            for key in 0u64..300 {
                let h = SeqHash(key.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                proptest::prop_assert_eq!(table.get(&h), model.get(&h.0).copied());
            }
        }
    }
}
