//! Hash maps for keys that are already hashes or small integers (block hashes, slots, request numbers): SipHash,
//! std's default, costs more than the rest of an index lookup. The hasher here is one keyed multiply and shift per
//! word, the key drawn from std's per-process random source for every map, so keys an adversary picks (a block hash
//! follows from public tokens and a public seed) do not collide by design in a router's maps.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};

/// A map with the keyed fast hasher.
pub type FastMap<K, V> = HashMap<K, V, KeyedState>;
/// A set with the keyed fast hasher.
pub type FastSet<K> = HashSet<K, KeyedState>;

/// Odd 64-bit multiplier (the golden ratio's fraction).
const MUL: u64 = 0x9E37_79B9_7F4A_7C15;

/// Builds [`KeyedHasher`]s with one random key per map.
#[derive(Clone, Copy, Debug)]
pub struct KeyedState {
    key: u64,
}

impl Default for KeyedState {
    fn default() -> KeyedState {
        // `RandomState` is seeded from the OS once per process and varies per instance after that.
        KeyedState { key: std::collections::hash_map::RandomState::new().hash_one(0u64) | 1 }
    }
}

impl BuildHasher for KeyedState {
    type Hasher = KeyedHasher;

    fn build_hasher(&self) -> KeyedHasher {
        KeyedHasher { key: self.key, state: self.key }
    }
}

/// Folds each word into the state with a keyed multiply and shift.
#[derive(Clone, Copy, Debug)]
pub struct KeyedHasher {
    key: u64,
    state: u64,
}

impl KeyedHasher {
    fn mix(&mut self, word: u64) {
        let x = (self.state ^ word).wrapping_add(self.key).wrapping_mul(MUL);
        self.state = x ^ (x >> 29);
    }
}

impl Hasher for KeyedHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.mix(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.mix(n);
    }

    fn write_u32(&mut self, n: u32) {
        self.mix(u64::from(n));
    }

    fn write_usize(&mut self, n: usize) {
        self.mix(n as u64);
    }

    fn finish(&self) -> u64 {
        // A last multiply spreads the state into the high bits the table's control bytes use.
        (self.state ^ (self.state >> 32)).wrapping_mul(MUL)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_work_and_two_maps_hash_differently() {
        let mut m: FastMap<u64, u32> = FastMap::default();
        for i in 0..10_000u64 {
            m.insert(i << 20, i as u32);
        }
        assert!((0..10_000u64).all(|i| m.get(&(i << 20)) == Some(&(i as u32))));
        let (a, b) = (KeyedState::default(), KeyedState::default());
        assert_ne!(a.hash_one(42u64), b.hash_one(42u64), "each map has its own key");
    }
}
