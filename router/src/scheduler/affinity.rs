//! `prompt_cache_key` affinity: which worker last computed a prompt carrying a key, remembered for the most recent
//! keys only (two generations of a bounded map: a key not seen for a generation is forgotten).

use kv_cache::fastmap::FastMap;

use super::view::WorkerId;

/// Keys remembered per generation (about twice this in all).
const GENERATION: usize = 65_536;

#[derive(Clone, Debug, Default)]
pub struct Affinity {
    current: FastMap<u64, WorkerId>,
    previous: FastMap<u64, WorkerId>,
}

impl Affinity {
    /// The worker that last computed a prompt with `key`.
    pub fn get(&self, key: u64) -> Option<WorkerId> {
        self.current.get(&key).or_else(|| self.previous.get(&key)).copied()
    }

    /// `worker` computed a prompt with `key`.
    pub fn remember(&mut self, key: u64, worker: WorkerId) {
        if self.current.len() >= GENERATION && !self.current.contains_key(&key) {
            self.previous = std::mem::take(&mut self.current);
        }
        self.current.insert(key, worker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_worker_is_remembered_for_a_generation() {
        let mut a = Affinity::default();
        a.remember(1, WorkerId(3));
        a.remember(1, WorkerId(4));
        assert_eq!(a.get(1), Some(WorkerId(4)));
        assert_eq!(a.get(2), None);
        for k in 10..10 + GENERATION as u64 {
            a.remember(k, WorkerId(0));
        }
        assert_eq!(a.get(1), Some(WorkerId(4)), "still in the previous generation");
        for k in 10 + GENERATION as u64..10 + 2 * GENERATION as u64 {
            a.remember(k, WorkerId(0));
        }
        assert_eq!(a.get(1), None, "forgotten after two");
        assert!(a.current.len() + a.previous.len() <= 2 * GENERATION);
    }
}
