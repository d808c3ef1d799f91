//! Where every findable block is: a hash table from block hash to [`Location`], made for the pool's access
//! pattern. Each tier move and eviction updates it, and on a large pool nearly every update misses the cache;
//! std's table keeps its control bytes apart from its entries, so each of those lookups misses twice. Here an
//! entry is 8 bytes, 32 bits of the key's keyed hash (its tag) next to the location, and collisions go to the next
//! entries (linear probing), so a lookup is one miss; the key itself is not stored, since the slot an entry names
//! holds it: a lookup checks a tag match there, and a move or removal names where the block is. Removal shifts the
//! entries after it back (no tombstones), and the table keeps at most half its entries in use so probe runs stay
//! short. Tags come from the keyed hasher of [`crate::fastmap`], so hashes chosen by an adversary do not pile into
//! one run.

use std::hash::BuildHasher;

use super::Location;
use crate::events::Tier;
use crate::fastmap::KeyedState;
use crate::hash::SeqHash;
use crate::table::Table;

/// An entry's `at` when the entry is empty (tier bits 3: no tier).
const EMPTY: u32 = u32::MAX;
/// Bits of `at` that hold the slot; the two above them hold the tier.
const SLOT_BITS: u32 = 30;
/// A tier has fewer slots than this (so that a table for three tiers has fewer than 2^32 entries and a tag
/// places an entry anywhere in it).
pub const MAX_SLOTS: usize = 1 << 28;

/// 8 bytes: a simulated cluster's pools have tables of 16 × 131,072 entries, which at 16 bytes an entry did not
/// fit the last-level cache next to everything else. The entry keeps 32 bits of the key's hash (the tag) and the
/// location; the key itself is the one stored in the slot the entry names, which the pool checks.
#[derive(Clone, Copy, Debug)]
struct Entry {
    tag: u32,
    /// [`Tier::index`] above [`SLOT_BITS`] bits of slot, or [`EMPTY`].
    at: u32,
}

const VACANT: Entry = Entry { tag: 0, at: EMPTY };

fn pack(at: Location) -> u32 {
    debug_assert!((at.slot as usize) < MAX_SLOTS);
    (at.tier.index() as u32) << SLOT_BITS | at.slot
}

impl Entry {
    fn is_empty(&self) -> bool {
        self.at == EMPTY
    }

    fn location(&self) -> Location {
        Location { tier: Tier::ALL[(self.at >> SLOT_BITS) as usize], slot: self.at & ((1 << SLOT_BITS) - 1) }
    }
}

/// Block hash → location. The table does not hold whole keys: each method takes `key_at`, the hash of the block
/// a location holds (the pool's slot states), or the location the block is known to be at.
#[derive(Debug)]
pub struct Located {
    entries: Table<Entry>,
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
        Located { entries: Table::filled(size, VACANT), mask: size - 1, len: 0, hasher: KeyedState::default() }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.len
    }

    fn tag(&self, seq: SeqHash) -> u32 {
        // The hasher's high bits are its best mixed.
        (self.hasher.hash_one(seq.0) >> 32) as u32
    }

    fn home(&self, tag: u32) -> usize {
        tag as usize & self.mask
    }

    /// The entry for `seq` (one whose tag matches and whose location `is_it` accepts), or the empty one where it
    /// would go.
    fn probe(&self, seq: SeqHash, mut is_it: impl FnMut(Location) -> bool) -> Probe {
        let tag = self.tag(seq);
        let mut i = self.home(tag);
        loop {
            let e = self.entries[i];
            if e.is_empty() {
                return Probe::Vacant(i);
            }
            if e.tag == tag && is_it(e.location()) {
                return Probe::Found(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Asks for the line `seq`'s probe starts at, ahead of a lookup or change.
    pub fn prefetch(&self, seq: SeqHash) {
        crate::prefetch::prefetch(&self.entries[self.home(self.tag(seq))]);
    }

    /// Where `seq` is; `key_at` tells what a location holds.
    pub fn get(&self, seq: SeqHash, key_at: impl Fn(Location) -> Option<SeqHash>) -> Option<Location> {
        match self.probe(seq, |at| key_at(at) == Some(seq)) {
            Probe::Found(i) => Some(self.entries[i].location()),
            Probe::Vacant(_) => None,
        }
    }

    /// Adds `seq`, known to be absent, at `at`.
    pub fn insert_new(&mut self, seq: SeqHash, at: Location) {
        self.reserve_one();
        if let Probe::Vacant(i) = self.probe(seq, |_| false) {
            self.entries[i] = Entry { tag: self.tag(seq), at: pack(at) };
            self.len += 1;
        }
    }

    /// Looks `seq` up once and sets its location to what `decide` returns given the current one (`None`: leave
    /// the table as it is); returns the current one.
    pub fn upsert(
        &mut self,
        seq: SeqHash,
        key_at: impl Fn(Location) -> Option<SeqHash>,
        decide: impl FnOnce(Option<Location>) -> Option<Location>,
    ) -> Option<Location> {
        self.reserve_one();
        match self.probe(seq, |at| key_at(at) == Some(seq)) {
            Probe::Found(i) => {
                let old = self.entries[i].location();
                if let Some(at) = decide(Some(old)) {
                    self.entries[i].at = pack(at);
                }
                Some(old)
            }
            Probe::Vacant(i) => {
                if let Some(at) = decide(None) {
                    self.entries[i] = Entry { tag: self.tag(seq), at: pack(at) };
                    self.len += 1;
                }
                None
            }
        }
    }

    /// Moves `seq` from `from` (where it is) to `to`; false if it was not at `from`.
    pub fn relocate(&mut self, seq: SeqHash, from: Location, to: Location) -> bool {
        let from = pack(from);
        match self.probe(seq, |at| pack(at) == from) {
            Probe::Found(i) => {
                self.entries[i].at = pack(to);
                true
            }
            Probe::Vacant(_) => false,
        }
    }

    /// Removes `seq`, known to be at `at`; false if it was not there.
    pub fn remove_at(&mut self, seq: SeqHash, at: Location) -> bool {
        let at = pack(at);
        let Probe::Found(mut hole) = self.probe(seq, |now| pack(now) == at) else { return false };
        // Shift back every later entry of the run that may move into the hole (whose home is not between the
        // hole and it), so that every key stays reachable from its home without crossing an empty entry.
        let mut i = hole;
        loop {
            i = (i + 1) & self.mask;
            let e = self.entries[i];
            if e.is_empty() {
                break;
            }
            let home = self.home(e.tag);
            let distance_home = i.wrapping_sub(home) & self.mask;
            let distance_hole = i.wrapping_sub(hole) & self.mask;
            if distance_home >= distance_hole {
                self.entries[hole] = e;
                hole = i;
            }
        }
        self.entries[hole] = VACANT;
        self.len -= 1;
        true
    }

    /// Drops every entry on `tier`.
    pub fn remove_tier(&mut self, tier: Tier) {
        let kept: Vec<Entry> =
            self.entries.iter().copied().filter(|e| !e.is_empty() && e.location().tier != tier).collect();
        self.entries.fill(VACANT);
        self.len = 0;
        for e in kept {
            self.place(e);
        }
    }

    fn place(&mut self, e: Entry) {
        let mut i = self.home(e.tag);
        while !self.entries[i].is_empty() {
            i = (i + 1) & self.mask;
        }
        self.entries[i] = e;
        self.len += 1;
    }

    fn reserve_one(&mut self) {
        if 2 * (self.len + 1) > self.entries.len() {
            let old = std::mem::take(&mut self.entries);
            let size = (old.len() * 2).max(16);
            self.entries = Table::filled(size, VACANT);
            self.mask = size - 1;
            self.len = 0;
            for e in old.iter().copied().filter(|e| !e.is_empty()) {
                self.place(e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(500))]

        /// Inserts, moves, upserts, removals, tier drops and growth agree with a map, over keys few enough to
        /// collide often; which block each location holds is the model's, as the pool's slot states are.
        #[test]
        fn the_table_agrees_with_a_map(
            ops in proptest::collection::vec((0u8..5, 0u64..200, 0u32..300, 0usize..3), 1..2_000),
            start in 0usize..40,
        ) {
            let mut table = Located::with_capacity(start);
            let mut model: HashMap<u64, Location> = HashMap::new();
            let mut holder: HashMap<Location, u64> = HashMap::new();
            for (op, key, slot, tier) in ops {
                let at = Location { tier: Tier::ALL[tier], slot };
                let seq = SeqHash(key.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                let now = model.get(&seq.0).copied();
                let taken = holder.contains_key(&at);
                match op {
                    0 if now.is_none() && !taken => {
                        table.insert_new(seq, at);
                        model.insert(seq.0, at);
                        holder.insert(at, seq.0);
                    }
                    1 => {
                        // A missing key is "moved" from where it is not, which changes nothing; a move to a
                        // taken location stays put.
                        let from = now.unwrap_or(at);
                        let moves = now.is_some() && !taken;
                        let to = if moves { at } else { from };
                        proptest::prop_assert_eq!(table.relocate(seq, from, to), now.is_some());
                        if moves {
                            holder.remove(&from);
                            holder.insert(at, seq.0);
                            model.insert(seq.0, at);
                        }
                    }
                    2 => {
                        proptest::prop_assert_eq!(table.remove_at(seq, now.unwrap_or(at)), now.is_some());
                        if let Some(was) = model.remove(&seq.0) {
                            holder.remove(&was);
                        }
                    }
                    3 if !taken => {
                        // Keep a found key as it is; put a missing one in.
                        let key_at = |l: Location| holder.get(&l).map(|&k| SeqHash(k));
                        let before = table.upsert(seq, key_at, |now| now.is_none().then_some(at));
                        proptest::prop_assert_eq!(before, now);
                        if now.is_none() {
                            model.insert(seq.0, at);
                            holder.insert(at, seq.0);
                        }
                    }
                    4 if key % 50 == 0 => {
                        table.remove_tier(at.tier);
                        model.retain(|_, l| l.tier != at.tier);
                        holder.retain(|l, _| l.tier != at.tier);
                    }
                    _ => {}
                }
                proptest::prop_assert_eq!(table.len(), model.len());
            }
            for key in 0u64..200 {
                let seq = SeqHash(key.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                let key_at = |l: Location| holder.get(&l).map(|&k| SeqHash(k));
                proptest::prop_assert_eq!(table.get(seq, key_at), model.get(&seq.0).copied());
            }
        }
    }
}
