//! A map from block hash to a 64-bit value for walks over many blocks whose hashes are known ahead, such as the router
//! index's block map (hash → run and position). With millions of blocks nearly every lookup misses the cache, and std's
//! map keeps its control bytes apart from its entries, so each misses twice, one block after another. Here an entry is
//! 16 bytes, key and value together, so a lookup is one miss, and a walk asks for the entries of the blocks a few ahead
//! ([`ProbeMap::prefetch`]), which std's map cannot be asked for, so that the misses overlap. Collisions go to the next
//! entries (linear probing), a removal shifts the later entries of its probe run back (no tombstones), and at most half
//! the entries are in use. A key's home comes from the keyed hasher of [`crate::fastmap`], so hashes an adversary picks
//! (they follow from public tokens and a public seed) do not pile into one probe run.

use std::hash::BuildHasher;

use crate::fastmap::KeyedState;
use crate::hash::SeqHash;
use crate::pool::ahead;
use crate::table::Table;

/// The value no entry may hold: the entry is empty.
const EMPTY: u64 = u64::MAX;

/// The fewest entries a table has.
const MIN_SIZE: usize = 16;

#[derive(Clone, Copy, Debug)]
struct Entry {
    key: u64,
    value: u64,
}

const VACANT: Entry = Entry { key: 0, value: EMPTY };

/// Block hash → a value other than `u64::MAX`.
#[derive(Debug)]
pub struct ProbeMap {
    entries: Table<Entry>,
    /// `entries.len() - 1` (a power of two minus one).
    mask: usize,
    /// 64 − log2(`entries.len()`): a key's home is its hash's top bits, the best mixed.
    shift: u32,
    len: usize,
    /// The fewest entries the table keeps when it shrinks: the size it was made with.
    floor: usize,
    hasher: KeyedState,
}

impl Default for ProbeMap {
    fn default() -> ProbeMap {
        ProbeMap::with_capacity(0)
    }
}

/// Where a key is, or where it would go.
enum Probe {
    Found(usize),
    Vacant(usize),
}

impl ProbeMap {
    /// A map that holds `n` entries without growing, and keeps room for them when emptied (one whose size is
    /// known, as a simulated cluster's index is, is never rebuilt).
    pub fn with_capacity(n: usize) -> ProbeMap {
        let size = (2 * n).next_power_of_two().max(MIN_SIZE);
        ProbeMap::with_size(size, size, KeyedState::default())
    }

    fn with_size(size: usize, floor: usize, hasher: KeyedState) -> ProbeMap {
        debug_assert!(size.is_power_of_two());
        ProbeMap {
            entries: Table::filled(size, VACANT),
            mask: size - 1,
            shift: 64 - size.trailing_zeros(),
            len: 0,
            floor,
            hasher,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn home(&self, key: u64) -> usize {
        (self.hasher.hash_one(key) >> self.shift) as usize & self.mask
    }

    fn probe(&self, key: u64) -> Probe {
        let mut i = self.home(key);
        loop {
            let e = &self.entries[i];
            if e.value == EMPTY {
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
        crate::prefetch::prefetch(&self.entries[self.home(h.0)]);
    }

    /// For a walk over `hashes` now at `i`: asks for the entries of the hashes [`ahead`].
    pub fn prefetch_ahead(&self, hashes: &[SeqHash], i: usize) {
        ahead(hashes, i).iter().for_each(|h| self.prefetch(h));
    }

    pub fn get(&self, h: &SeqHash) -> Option<u64> {
        match self.probe(h.0) {
            Probe::Found(i) => Some(self.entries[i].value),
            Probe::Vacant(_) => None,
        }
    }

    /// The value of `h`, to change in place (not to `u64::MAX`).
    pub fn get_mut(&mut self, h: &SeqHash) -> Option<&mut u64> {
        match self.probe(h.0) {
            Probe::Found(i) => Some(&mut self.entries[i].value),
            Probe::Vacant(_) => None,
        }
    }

    /// Puts `value` (not `u64::MAX`) under `h` if `h` is absent; if it is there, leaves it and returns its value.
    pub fn insert_new(&mut self, h: SeqHash, value: u64) -> Result<(), u64> {
        debug_assert!(value != EMPTY);
        self.reserve_one();
        match self.probe(h.0) {
            Probe::Found(i) => Err(self.entries[i].value),
            Probe::Vacant(i) => {
                self.entries[i] = Entry { key: h.0, value };
                self.len += 1;
                Ok(())
            }
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
            if e.value == EMPTY {
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
        // Less than an eighth full: a table that once held many blocks (a worker with a large tier, since gone)
        // gives the memory back, to a quarter full at most, so that growing again takes as many inserts as the
        // shrink took removals.
        if self.entries.len() > self.floor && 8 * self.len < self.entries.len() {
            self.rebuild((4 * self.len).next_power_of_two().max(self.floor));
        }
    }

    fn reserve_one(&mut self) {
        if 2 * (self.len + 1) <= self.entries.len() {
            return;
        }
        self.rebuild(self.entries.len() * 2);
    }

    /// Moves every entry into a table of `size` entries.
    fn rebuild(&mut self, size: usize) {
        // The same key: homes in the new table follow from the same hashes.
        let mut table = ProbeMap::with_size(size, self.floor, self.hasher);
        for e in self.entries.iter().filter(|e| e.value != EMPTY) {
            let mut i = table.home(e.key);
            while table.entries[i].value != EMPTY {
                i = (i + 1) & table.mask;
            }
            table.entries[i] = *e;
        }
        table.len = self.len;
        *self = table;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(500))]

        /// Insertions, changes in place and removals agree with std's map, over keys few enough to collide often
        /// and through several growths.
        #[test]
        fn the_table_agrees_with_a_map(ops in proptest::collection::vec((0u8..4, 0u64..300, 0u64..50), 1..3_000)) {
            let mut table = ProbeMap::default();
            let mut model: HashMap<u64, u64> = HashMap::new();
            for (op, key, value) in ops {
                let h = SeqHash(key.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                match op {
                    0 => {
                        let got = table.insert_new(h, value);
                        let want = match model.get(&h.0) {
                            Some(&was) => Err(was),
                            None => {
                                model.insert(h.0, value);
                                Ok(())
                            }
                        };
                        proptest::prop_assert_eq!(got, want);
                    }
                    1 => {
                        if let Some(v) = table.get_mut(&h) {
                            *v += value;
                        }
                        if let Some(v) = model.get_mut(&h.0) {
                            *v += value;
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

    #[test]
    fn a_table_emptied_gives_its_memory_back_and_keeps_what_is_left() {
        let h = |k: u64| SeqHash(k.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5555);
        let mut table = ProbeMap::default();
        for k in 0..100_000 {
            assert_eq!(table.insert_new(h(k), k), Ok(()));
        }
        let full = table.entries.len();
        assert!(full >= 200_000);
        for k in 100..100_000 {
            table.remove(&h(k));
        }
        assert_eq!(table.len(), 100);
        assert!(table.entries.len() <= 512, "{} entries for 100 keys (was {full})", table.entries.len());
        for k in 0..100_000 {
            assert_eq!(table.get(&h(k)), (k < 100).then_some(k));
        }
        // Emptied, it stays usable at its smallest.
        for k in 0..100 {
            table.remove(&h(k));
        }
        assert_eq!((table.len(), table.entries.len()), (0, MIN_SIZE));
        assert_eq!(table.insert_new(h(7), 7), Ok(()));
        assert_eq!(table.get(&h(7)), Some(7));
    }

    #[test]
    fn a_table_made_for_many_keeps_its_size_when_emptied_and_still_grows() {
        let h = |k: u64| SeqHash(k.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5555);
        let mut table = ProbeMap::with_capacity(1_000);
        let made = table.entries.len();
        assert!(made >= 2_000);
        for k in 0..10 {
            assert_eq!(table.insert_new(h(k), k), Ok(()));
        }
        for k in 0..10 {
            table.remove(&h(k));
        }
        assert_eq!((table.len(), table.entries.len()), (0, made), "no rebuild below the size it was made with");
        for k in 0..5_000 {
            assert_eq!(table.insert_new(h(k), k), Ok(()));
        }
        assert!(table.entries.len() > made);
        for k in 0..5_000 {
            table.remove(&h(k));
        }
        assert_eq!((table.len(), table.entries.len()), (0, made), "back to its first size, not below");
    }
}
