//! The pool's change log: every tier transition as an ordered event with a strictly increasing id, a bounded
//! replay buffer, snapshots, and [`TierView`], the per-tier state that replaying events or a snapshot rebuilds
//! (what a router's indexer keeps per worker).

use std::collections::{BTreeSet, VecDeque};

use crate::fastmap::FastMap;

use crate::hash::{LocalHash, SeqHash};

/// The storage tiers, fastest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// The engine's working KV pool (GPU memory, or RAM on the CPU backend).
    Device,
    /// A second RAM pool.
    Host,
    /// Local files.
    Disk,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    /// The tier a block goes to when evicted from this one (`None`: gone).
    pub fn below(self) -> Option<Tier> {
        match self {
            Tier::Device => Some(Tier::Host),
            Tier::Host => Some(Tier::Disk),
            Tier::Disk => None,
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

/// Identity of a complete block: its prefix hash, its own hash, and its parent's prefix hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockMeta {
    pub seq: SeqHash,
    pub local: LocalHash,
    pub parent: Option<SeqHash>,
}

/// Position of an event in a pool's log: 0, 1, 2, ... with no gaps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventId(pub u64);

/// One change to the pool's content.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks became available on `tier` (in chain order when several).
    Stored { tier: Tier, parent: Option<SeqHash>, blocks: Vec<(SeqHash, LocalHash)> },
    /// Blocks left `tier`.
    Removed { tier: Tier, seqs: Vec<SeqHash> },
    /// Every block left `tier` (every tier when `None`).
    Cleared { tier: Option<Tier> },
}

/// The full per-tier content, current as of an event id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// The last event this snapshot includes; `None` before any event.
    pub as_of: Option<EventId>,
    /// Blocks per tier, indexed by [`Tier::index`], sorted.
    pub tiers: [Vec<BlockMeta>; 3],
}

/// Asked for events the replay buffer no longer holds: take a snapshot instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("events after {requested:?} are no longer buffered (oldest held: {oldest:?}); take a snapshot")]
pub struct TooOld {
    pub requested: Option<EventId>,
    pub oldest: Option<EventId>,
}

/// Ids and a bounded buffer of recent events.
#[derive(Clone, Debug)]
pub struct EventLog {
    next: u64,
    buffer: VecDeque<(EventId, KvEvent)>,
    capacity: usize,
}

impl EventLog {
    /// A log that keeps the last `capacity` events for replay.
    pub fn new(capacity: usize) -> EventLog {
        EventLog { next: 0, buffer: VecDeque::with_capacity(capacity.min(4096)), capacity }
    }

    /// Records `event` and returns its id.
    pub fn push(&mut self, event: KvEvent) -> EventId {
        let id = EventId(self.next);
        self.next += 1;
        if self.capacity > 0 {
            if self.buffer.len() == self.capacity {
                self.buffer.pop_front();
            }
            self.buffer.push_back((id, event));
        }
        id
    }

    /// The id of the newest event, if any.
    pub fn last(&self) -> Option<EventId> {
        self.next.checked_sub(1).map(EventId)
    }

    /// Every event after `after` (all events when `None`), or [`TooOld`] when some were already dropped.
    pub fn events_after(&self, after: Option<EventId>) -> Result<Vec<(EventId, KvEvent)>, TooOld> {
        let first_wanted = after.map_or(0, |id| id.0 + 1);
        if first_wanted >= self.next {
            return Ok(Vec::new());
        }
        let oldest = self.buffer.front().map(|(id, _)| *id);
        match oldest {
            Some(o) if o.0 <= first_wanted => {
                Ok(self.buffer.iter().skip((first_wanted - o.0) as usize).cloned().collect())
            }
            _ => Err(TooOld { requested: after, oldest }),
        }
    }
}

/// What is on each tier, rebuilt from a snapshot and events. Applying an event is idempotent; removing an unknown
/// block is ignored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierView {
    tiers: [FastMap<SeqHash, BlockMeta>; 3],
    /// The last event applied.
    pub as_of: Option<EventId>,
    /// `Stored` events whose parent was on no tier (still applied: the map is flat).
    pub orphans: u64,
}

impl TierView {
    /// The state a snapshot describes.
    pub fn from_snapshot(s: &Snapshot) -> TierView {
        let mut v = TierView { as_of: s.as_of, ..TierView::default() };
        for tier in Tier::ALL {
            v.tiers[tier.index()] = s.tiers[tier.index()].iter().map(|m| (m.seq, *m)).collect();
        }
        v
    }

    /// Applies one event.
    pub fn apply(&mut self, id: EventId, event: &KvEvent) {
        match event {
            KvEvent::Stored { tier, parent, blocks } => {
                if parent.is_some_and(|p| !self.tiers.iter().any(|t| t.contains_key(&p))) {
                    self.orphans += 1;
                }
                let mut parent = *parent;
                for &(seq, local) in blocks {
                    self.tiers[tier.index()].insert(seq, BlockMeta { seq, local, parent });
                    parent = Some(seq);
                }
            }
            KvEvent::Removed { tier, seqs } => {
                for s in seqs {
                    self.tiers[tier.index()].remove(s);
                }
            }
            KvEvent::Cleared { tier: Some(tier) } => self.tiers[tier.index()].clear(),
            KvEvent::Cleared { tier: None } => self.tiers.iter_mut().for_each(FastMap::clear),
        }
        self.as_of = Some(id);
    }

    /// Whether `seq` is on `tier`.
    pub fn contains(&self, tier: Tier, seq: SeqHash) -> bool {
        self.tiers[tier.index()].contains_key(&seq)
    }

    /// The blocks on `tier`, sorted.
    pub fn blocks(&self, tier: Tier) -> BTreeSet<BlockMeta> {
        self.tiers[tier.index()].values().copied().collect()
    }
}
