//! Who holds one block: per tier, a bit per worker slot. Up to 64 slots fit in the block's own entry; beyond that
//! the words live on the heap. Slots are dense small numbers the index hands out, so the bits stay few.

/// Per tier (device, host, disk), the holding slots of one 64-slot word.
pub type Word = [u64; 3];

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holders {
    /// Slots 0..64.
    One(Word),
    /// Word `k` covers slots `64k..64k+64`.
    Many(Box<[Word]>),
}

impl Default for Holders {
    fn default() -> Holders {
        Holders::One([0; 3])
    }
}

impl Holders {
    pub fn words(&self) -> &[Word] {
        match self {
            Holders::One(w) => std::slice::from_ref(w),
            Holders::Many(w) => w,
        }
    }

    /// Sets or clears `slot`'s bit on `tier` (0 device, 1 host, 2 disk).
    pub fn set(&mut self, slot: u32, tier: usize, on: bool) {
        let (k, bit) = ((slot / 64) as usize, 1u64 << (slot % 64));
        if k >= self.words().len() {
            if !on {
                return;
            }
            let mut words = self.words().to_vec();
            words.resize(k + 1, [0; 3]);
            *self = Holders::Many(words.into_boxed_slice());
        }
        let word = match self {
            Holders::One(w) => w,
            Holders::Many(w) => &mut w[k],
        };
        if on {
            word[tier] |= bit;
        } else {
            word[tier] &= !bit;
        }
    }

    /// Clears `slot` on every tier in `tiers` (a bit mask of tiers).
    pub fn clear(&mut self, slot: u32, tiers: u8) {
        for t in 0..3 {
            if tiers & (1 << t) != 0 {
                self.set(slot, t, false);
            }
        }
    }

    /// Whether `slot` holds the block on any tier.
    pub fn has(&self, slot: u32) -> bool {
        let (k, bit) = ((slot / 64) as usize, 1u64 << (slot % 64));
        self.words().get(k).is_some_and(|w| (w[0] | w[1] | w[2]) & bit != 0)
    }

    /// Whether no slot holds the block.
    pub fn is_empty(&self) -> bool {
        self.words().iter().all(|w| w[0] | w[1] | w[2] == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_past_64_spill_to_more_words_and_clear_back() {
        let mut h = Holders::default();
        h.set(3, 0, true);
        h.set(130, 2, true);
        assert_eq!(h.words().len(), 3);
        assert!(h.has(3) && h.has(130) && !h.has(66));
        h.clear(130, 0b111);
        h.set(3, 0, false);
        assert!(h.is_empty());
        // Clearing a slot beyond the words is nothing to do.
        let mut one = Holders::default();
        one.set(500, 1, false);
        assert_eq!(one, Holders::default());
    }
}
