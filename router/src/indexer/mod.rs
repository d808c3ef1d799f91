//! The KV indexer: which worker holds which block on which tier, fed by every worker's event stream.
//!
//! A flat map from chained block hash to its holders answers prefix questions, because a chained hash names the
//! whole prefix up to its block. Pure: the subscription tasks own the sockets and hand events to its one owner.

use std::collections::HashMap;

use kv_cache::fastmap::{FastMap, FastSet};

use kv_cache::SeqHash;
use kv_cache::events::{EventId, KvEvent, Snapshot, Tier};

use crate::scheduler::view::{Overlap, WorkerId};

/// Tiers as bits of a holder's mask.
fn bit(t: Tier) -> u8 {
    1 << t.index()
}

/// Why an event was not applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    /// Events were lost between the last applied and this one: resubscribe after `last`.
    #[error("event gap: expected {expected}, got {got}")]
    Gap { expected: u64, got: u64 },
    /// The worker is not (or no longer) indexed.
    #[error("unknown worker")]
    UnknownWorker,
}

/// Counters for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    pub events_applied: u64,
    /// Duplicates of already applied events (a resubscription's overlap), ignored.
    pub events_duplicate: u64,
    /// `Stored` events whose parent block the index did not know (applied anyway).
    pub orphans: u64,
    pub resyncs: u64,
    /// Events dropped because earlier ones were missing (each gap leads to a resubscription).
    pub gaps: u64,
}

#[derive(Debug, Default)]
struct Indexed {
    last: Option<EventId>,
    /// Every hash this worker holds on some tier: what to drop when it goes.
    held: FastSet<SeqHash>,
}

/// The index of every worker's cached blocks.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    holders: FastMap<SeqHash, Vec<(WorkerId, u8)>>,
    workers: HashMap<WorkerId, Indexed>,
    stats: IndexStats,
}

impl PrefixIndex {
    pub fn new() -> PrefixIndex {
        PrefixIndex::default()
    }

    pub fn stats(&self) -> IndexStats {
        self.stats
    }

    /// Distinct blocks indexed.
    pub fn len(&self) -> usize {
        self.holders.len()
    }

    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    /// The last event applied for `worker`: where a resubscription resumes.
    pub fn last_event(&self, worker: WorkerId) -> Option<EventId> {
        self.workers.get(&worker).and_then(|w| w.last)
    }

    fn set(&mut self, worker: WorkerId, hash: SeqHash, tier: Tier, on: bool) {
        let entry = self.holders.entry(hash).or_default();
        match entry.iter_mut().find(|(w, _)| *w == worker) {
            Some((_, mask)) if on => *mask |= bit(tier),
            Some((_, mask)) => *mask &= !bit(tier),
            None if on => entry.push((worker, bit(tier))),
            None => {}
        }
        entry.retain(|(_, m)| *m != 0);
        let still = entry.iter().any(|(w, _)| *w == worker);
        if entry.is_empty() {
            self.holders.remove(&hash);
        }
        if let Some(w) = self.workers.get_mut(&worker) {
            if still {
                w.held.insert(hash);
            } else {
                w.held.remove(&hash);
            }
        }
    }

    fn drop_blocks(&mut self, worker: WorkerId) {
        let held = self.workers.get_mut(&worker).map(|w| std::mem::take(&mut w.held)).unwrap_or_default();
        for h in held {
            if let Some(entry) = self.holders.get_mut(&h) {
                entry.retain(|(w, _)| *w != worker);
                if entry.is_empty() {
                    self.holders.remove(&h);
                }
            }
        }
    }

    /// Replaces everything known about `worker` with `snapshot` (a new subscription, or a resync after a gap the
    /// worker could not replay). Registers the worker if it was not indexed.
    pub fn replace(&mut self, worker: WorkerId, snapshot: &Snapshot) {
        if self.workers.contains_key(&worker) {
            self.stats.resyncs += 1;
        }
        self.drop_blocks(worker);
        self.workers.entry(worker).or_default().last = snapshot.as_of;
        for t in Tier::ALL {
            for b in &snapshot.tiers[t.index()] {
                self.set(worker, b.seq, t, true);
            }
        }
    }

    /// Applies event `id` from `worker`. Idempotent: an id at or before the last applied is ignored.
    pub fn apply(&mut self, worker: WorkerId, id: EventId, event: &KvEvent) -> Result<(), ApplyError> {
        let last = self.workers.get(&worker).ok_or(ApplyError::UnknownWorker)?.last;
        let expected = last.map_or(0, |l| l.0 + 1);
        if id.0 < expected {
            self.stats.events_duplicate += 1;
            return Ok(());
        }
        if id.0 > expected {
            self.stats.gaps += 1;
            return Err(ApplyError::Gap { expected, got: id.0 });
        }
        match event {
            KvEvent::Stored { tier, parent, blocks } => {
                if parent.is_some_and(|p| !self.holds(worker, p)) {
                    self.stats.orphans += 1;
                }
                for (seq, _) in blocks {
                    self.set(worker, *seq, *tier, true);
                }
            }
            KvEvent::Removed { tier, seqs } => {
                for seq in seqs {
                    self.set(worker, *seq, *tier, false);
                }
            }
            KvEvent::Cleared { tier } => {
                let held: Vec<SeqHash> =
                    self.workers.get(&worker).map(|w| w.held.iter().copied().collect()).unwrap_or_default();
                for h in held {
                    match tier {
                        Some(t) => self.set(worker, h, *t, false),
                        None => Tier::ALL.iter().for_each(|&t| self.set(worker, h, t, false)),
                    }
                }
            }
        }
        if let Some(w) = self.workers.get_mut(&worker) {
            w.last = Some(id);
        }
        self.stats.events_applied += 1;
        Ok(())
    }

    fn holds(&self, worker: WorkerId, hash: SeqHash) -> bool {
        self.holders.get(&hash).is_some_and(|e| e.iter().any(|(w, _)| *w == worker))
    }

    /// Forgets `worker` and all its blocks (it vanished, or restarted under a new instance id).
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.drop_blocks(worker);
        self.workers.remove(&worker);
    }

    /// Overlap of the chained hashes `hashes` with every worker holding at least the first block
    /// (`routing.md`): leading blocks on device, then further consecutive ones on host, then on disk.
    pub fn overlap(&self, hashes: &[SeqHash]) -> HashMap<WorkerId, Overlap> {
        let mut out: HashMap<WorkerId, Overlap> = HashMap::new();
        let mut live: Vec<(WorkerId, usize)> = Vec::new(); // (worker, current tier index)
        for (i, h) in hashes.iter().enumerate() {
            let holders = self.holders.get(h).map_or(&[][..], |v| v.as_slice());
            if i == 0 {
                live = holders.iter().map(|(w, _)| (*w, 0)).collect();
            }
            live.retain_mut(|(w, tier)| {
                let Some(mask) = holders.iter().find(|(x, _)| x == w).map(|(_, m)| *m) else { return false };
                // Stay on this tier if the block is there, else move down to the first lower tier holding it.
                let Some(t) = (*tier..Tier::ALL.len()).find(|&t| mask & (1 << t) != 0) else { return false };
                *tier = t;
                let o = out.entry(*w).or_default();
                match Tier::ALL[t] {
                    Tier::Device => o.device += 1,
                    Tier::Host => o.host += 1,
                    Tier::Disk => o.disk += 1,
                }
                true
            });
            if live.is_empty() {
                break;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;
