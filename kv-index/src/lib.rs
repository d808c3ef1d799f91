//! The KV indexer: which worker holds which block on which tier, fed by every worker's event stream, and how many
//! of a prompt's leading blocks each worker holds.
//!
//! Blocks are kept in runs, the edges of a compressed radix tree: stretches of a chain whose blocks share their
//! holders. A chained block hash names its whole prefix, so one map from chained hash to (run, position) finds
//! where a prompt enters the tree; from there the prompt is compared with the run hash by hash in memory order,
//! with one lookup per run rather than per block. Holders are bits (per tier, one per worker slot), so a query
//! advances every worker at once with a few word operations per run, and touches a worker's own figures only
//! when it leaves a tier's run. Dropping a worker (it vanished, or resynced) scans the runs: rare, and it keeps
//! per-worker sets off both the event path and the query path.
//!
//! Pure and synchronous: the router's subscription tasks own the sockets and hand events to its one owner, and the
//! simulator and the benchmarks call it directly.

mod holders;
mod overlaps;
mod runs;

use std::collections::HashMap;

use kv_cache::events::{BlockMeta, EventId, KvEvent, Snapshot, Tier};
use kv_cache::fastmap::FastMap;
use kv_cache::{LocalHash, SeqHash};
use serde::Serialize;

pub use self::overlaps::Overlaps;
use self::runs::Runs;

/// A worker, as the router numbers them (stable while the worker stays registered).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct WorkerId(pub u32);

/// Leading blocks of the request a worker holds, per tier (`routing.md`, "Overlap").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Overlap {
    pub device: usize,
    pub host: usize,
    pub disk: usize,
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

/// An indexed worker.
#[derive(Clone, Copy, Debug)]
struct Indexed {
    slot: u32,
    last: Option<EventId>,
}

/// Every tier's bit in a tier mask.
const ALL_TIERS: u8 = 0b111;

/// The index of every worker's cached blocks.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    blocks: Runs,
    /// Looked up for every event applied: the keyed fast hasher, not SipHash.
    workers: FastMap<WorkerId, Indexed>,
    /// Which worker has each slot (`None`: free for the next worker).
    slots: Vec<Option<WorkerId>>,
    stats: IndexStats,
}

impl PrefixIndex {
    pub fn new() -> PrefixIndex {
        PrefixIndex::default()
    }

    /// An index with room for `blocks` distinct blocks (the sum of its workers' tiers, when known) that neither
    /// grows nor shrinks while it holds fewer.
    pub fn with_capacity(blocks: usize) -> PrefixIndex {
        PrefixIndex { blocks: Runs::with_capacity(blocks), ..PrefixIndex::default() }
    }

    pub fn stats(&self) -> IndexStats {
        self.stats
    }

    /// Distinct blocks indexed.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.len() == 0
    }

    /// How many blocks `worker` holds as far as the index knows, per tier (device, host, disk); `None` when the
    /// worker is not indexed.
    pub fn held(&self, worker: WorkerId) -> Option<[u64; 3]> {
        self.workers.get(&worker).map(|w| self.blocks.held(w.slot))
    }

    /// The last event applied for `worker`: where a resubscription resumes.
    pub fn last_event(&self, worker: WorkerId) -> Option<EventId> {
        self.workers.get(&worker).and_then(|w| w.last)
    }

    /// Replaces everything known about `worker` with `snapshot` (a new subscription, or a resync after a gap the
    /// worker could not replay). Registers the worker if it was not indexed.
    pub fn replace(&mut self, worker: WorkerId, snapshot: &Snapshot) {
        let slot = match self.workers.get(&worker) {
            Some(w) => {
                self.stats.resyncs += 1;
                let slot = w.slot;
                self.blocks.clear_slot(slot, ALL_TIERS);
                slot
            }
            None => self.take_slot(worker),
        };
        self.workers.insert(worker, Indexed { slot, last: snapshot.as_of });
        for t in Tier::ALL {
            self.blocks.store(slot, t.index(), None, &chain_order(&snapshot.tiers[t.index()]));
        }
    }

    /// The lowest free slot for a new worker.
    fn take_slot(&mut self, worker: WorkerId) -> u32 {
        match self.slots.iter().position(Option::is_none) {
            Some(free) => {
                self.slots[free] = Some(worker);
                free as u32
            }
            None => {
                self.slots.push(Some(worker));
                (self.slots.len() - 1) as u32
            }
        }
    }

    /// Applies event `id` from `worker`. Idempotent: an id at or before the last applied is ignored.
    pub fn apply(&mut self, worker: WorkerId, id: EventId, event: &KvEvent) -> Result<(), ApplyError> {
        let Indexed { slot, last } = *self.workers.get(&worker).ok_or(ApplyError::UnknownWorker)?;
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
                if parent.is_some_and(|p| !self.blocks.holders(&p).is_some_and(|h| h.has(slot))) {
                    self.stats.orphans += 1;
                }
                self.blocks.store(slot, tier.index(), *parent, blocks);
            }
            KvEvent::Removed { tier, seqs } => self.blocks.remove(slot, tier.index(), seqs),
            KvEvent::Cleared { tier } => {
                self.blocks.clear_slot(slot, tier.map_or(ALL_TIERS, |t| 1 << t.index()));
            }
        }
        if let Some(w) = self.workers.get_mut(&worker) {
            w.last = Some(id);
        }
        self.stats.events_applied += 1;
        Ok(())
    }

    /// Applies `events` from `worker` in order (as [`apply`](Self::apply) each), first asking for the lines where
    /// each event's blocks are found: an event of one block (a decode step's) otherwise waits on two misses in
    /// turn, its parent's and its own, and a batch's events on each other's. Stops at the first that fails.
    pub fn apply_all(&mut self, worker: WorkerId, events: &[(EventId, KvEvent)]) -> Result<(), ApplyError> {
        for (_, e) in events {
            match e {
                KvEvent::Stored { parent, blocks, .. } => {
                    parent.iter().chain(blocks.first().map(|b| &b.0)).for_each(|h| self.blocks.prefetch(h));
                }
                KvEvent::Removed { seqs, .. } => seqs.first().iter().for_each(|h| self.blocks.prefetch(h)),
                KvEvent::Cleared { .. } => {}
            }
        }
        events.iter().try_for_each(|(id, e)| self.apply(worker, *id, e))
    }

    /// Forgets `worker` and all its blocks (it vanished, or restarted under a new instance id).
    pub fn remove_worker(&mut self, worker: WorkerId) {
        if let Some(w) = self.workers.remove(&worker) {
            self.blocks.clear_slot(w.slot, ALL_TIERS);
            self.slots[w.slot as usize] = None;
        }
    }

    /// Overlap of the chained hashes `hashes` with every worker holding at least the first block
    /// (`routing.md`): leading blocks on device, then further consecutive ones on host, then on disk.
    pub fn overlap(&self, hashes: &[SeqHash]) -> Overlaps {
        self.blocks.overlap(hashes, |slot| self.slots.get(slot as usize).copied().flatten())
    }
}

/// A snapshot's blocks (sorted by hash) in chain order: each chain from its first block the snapshot holds, a
/// branch's blocks after the blocks before the branch, so that the index can keep chains together.
fn chain_order(blocks: &[BlockMeta]) -> Vec<(SeqHash, LocalHash)> {
    let held: HashMap<SeqHash, usize> = blocks.iter().enumerate().map(|(i, b)| (b.seq, i)).collect();
    let mut children: HashMap<SeqHash, Vec<usize>> = HashMap::new();
    let mut stack: Vec<usize> = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        match b.parent.filter(|p| held.contains_key(p)) {
            Some(p) => children.entry(p).or_default().push(i),
            None => stack.push(i),
        }
    }
    let mut out = Vec::with_capacity(blocks.len());
    let mut seen = vec![false; blocks.len()];
    // Depth first; a block is emitted once even if its parent links form a cycle (a bad snapshot).
    while let Some(i) = stack.pop() {
        if std::mem::replace(&mut seen[i], true) {
            continue;
        }
        out.push((blocks[i].seq, blocks[i].local));
        if let Some(c) = children.get(&blocks[i].seq) {
            stack.extend(c.iter().rev());
        }
    }
    // Blocks only reachable through a cycle.
    out.extend(blocks.iter().zip(&seen).filter(|(_, s)| !**s).map(|(b, _)| (b.seq, b.local)));
    out
}

#[cfg(test)]
mod tests;
