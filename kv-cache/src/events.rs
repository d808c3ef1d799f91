//! The pool's change log: every tier transition as an ordered event with a strictly increasing id, a bounded
//! replay buffer, snapshots, and [`TierView`], the per-tier state that replaying events or a snapshot rebuilds
//! (what a router's indexer keeps per worker).

use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};

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
///
/// An event nobody has read yet takes in a later one that continues it (blocks stored on the same tier right after
/// its last block or right before its first, or more blocks leaving the same tier), when every event between them
/// commutes with the later one (another tier, or the same tier and other blocks): applying the joined event, then
/// the ones between, is applying them all in order. So a pool that stores a prompt block by block, or offloads a
/// chain block by block (a removal from one tier and a store on the next, interleaved), publishes one event per
/// run of blocks and tier instead of one per block. Reading seals what was read, so an event never grows after a
/// reader has seen it.
#[derive(Debug)]
pub struct EventLog {
    next: u64,
    buffer: VecDeque<(EventId, KvEvent)>,
    capacity: usize,
    /// Events with ids below this were read and never change again.
    sealed: AtomicU64,
}

/// How many unread events a new one looks back over for one to join.
const LOOKBACK: usize = 4;

/// A change to record, borrowed: a whole event's, or one block's (which then needs no allocation to join one).
#[derive(Clone, Copy)]
enum Change<'a> {
    Stored { tier: Tier, parent: Option<SeqHash>, blocks: &'a [(SeqHash, LocalHash)] },
    Removed { tier: Tier, seqs: &'a [SeqHash] },
    Cleared { tier: Option<Tier> },
}

impl KvEvent {
    fn change(&self) -> Change<'_> {
        match self {
            KvEvent::Stored { tier, parent, blocks } => Change::Stored { tier: *tier, parent: *parent, blocks },
            KvEvent::Removed { tier, seqs } => Change::Removed { tier: *tier, seqs },
            KvEvent::Cleared { tier } => Change::Cleared { tier: *tier },
        }
    }
}

/// Joins `later` into `earlier` when applying the result is applying both in order; whether it did.
fn join(earlier: &mut KvEvent, later: Change<'_>) -> bool {
    match (earlier, later) {
        (KvEvent::Stored { tier, parent, blocks }, Change::Stored { tier: t, parent: p, blocks: more })
            if *tier == t =>
        {
            if p.is_some() && blocks.last().map(|b| b.0) == p {
                blocks.extend_from_slice(more);
                true
            } else if parent.is_some() && blocks.len() < JOIN_BEFORE && more.last().map(|b| b.0) == *parent {
                blocks.splice(0..0, more.iter().copied());
                *parent = p;
                true
            } else {
                false
            }
        }
        (KvEvent::Removed { tier, seqs }, Change::Removed { tier: t, seqs: more }) if *tier == t => {
            seqs.extend_from_slice(more);
            true
        }
        _ => false,
    }
}

/// Blocks compared at most to tell a store and a removal on one tier apart (past it they are taken to overlap):
/// a bound on the work of every push.
const DISJOINT_CHECK: usize = 128;

/// The longest a stored event grows by blocks before its first (each such join moves every block it holds).
const JOIN_BEFORE: usize = 128;

/// Whether applying `a` then `b` leaves the same content as `b` then `a`.
fn commute(a: Change<'_>, b: Change<'_>) -> bool {
    let tier = |c: Change<'_>| match c {
        Change::Stored { tier, .. } | Change::Removed { tier, .. } => Some(tier),
        Change::Cleared { tier } => tier,
    };
    match (a, b) {
        (Change::Cleared { tier: None }, _) | (_, Change::Cleared { tier: None }) => false,
        _ if tier(a) != tier(b) => true,
        (Change::Stored { .. }, Change::Stored { .. }) | (Change::Removed { .. }, Change::Removed { .. }) => true,
        (Change::Stored { blocks, .. }, Change::Removed { seqs, .. })
        | (Change::Removed { seqs, .. }, Change::Stored { blocks, .. }) => {
            blocks.len().saturating_mul(seqs.len()) <= DISJOINT_CHECK && !blocks.iter().any(|(h, _)| among(*h, seqs))
        }
        _ => false,
    }
}

/// Whether `h` is one of `seqs`: every hash compared, with no early exit, so that the comparisons vectorize (this
/// runs for nearly every block stored, against a step's removals).
fn among(h: SeqHash, seqs: &[SeqHash]) -> bool {
    seqs.iter().fold(false, |found, s| found | (s.0 == h.0))
}

impl Clone for EventLog {
    fn clone(&self) -> EventLog {
        EventLog {
            next: self.next,
            buffer: self.buffer.clone(),
            capacity: self.capacity,
            sealed: AtomicU64::new(self.sealed.load(Ordering::Relaxed)),
        }
    }
}

impl EventLog {
    /// A log that keeps the last `capacity` events for replay.
    pub fn new(capacity: usize) -> EventLog {
        EventLog { next: 0, buffer: VecDeque::with_capacity(capacity.min(4096)), capacity, sealed: AtomicU64::new(0) }
    }

    /// Records `event` and returns its id: that of an unread event it joins (see the type's documentation).
    pub fn push(&mut self, event: KvEvent) -> EventId {
        match self.join_unread(event.change()) {
            Some(id) => id,
            None => self.append(event),
        }
    }

    /// Records that `meta`'s block is now on `tier` (as [`push`](Self::push), allocating only for a new event).
    pub fn push_stored(&mut self, tier: Tier, meta: BlockMeta) -> EventId {
        let one = [(meta.seq, meta.local)];
        match self.join_unread(Change::Stored { tier, parent: meta.parent, blocks: &one }) {
            Some(id) => id,
            None => self.append(KvEvent::Stored { tier, parent: meta.parent, blocks: one.to_vec() }),
        }
    }

    /// Records that block `seq` left `tier` (as [`push`](Self::push), allocating only for a new event).
    pub fn push_removed(&mut self, tier: Tier, seq: SeqHash) -> EventId {
        match self.join_unread(Change::Removed { tier, seqs: std::slice::from_ref(&seq) }) {
            Some(id) => id,
            None => self.append(KvEvent::Removed { tier, seqs: vec![seq] }),
        }
    }

    /// The id of the unread event `change` joined, if any.
    fn join_unread(&mut self, change: Change<'_>) -> Option<EventId> {
        let unread = self.next.saturating_sub(*self.sealed.get_mut()) as usize;
        let back = unread.min(self.buffer.len()).min(LOOKBACK);
        for k in 1..=back {
            let at = self.buffer.len() - k;
            let (id, earlier) = &mut self.buffer[at];
            if join(earlier, change) {
                return Some(*id);
            }
            // Past an event that does not commute with this one, joining an older one would reorder them.
            if !commute(self.buffer[at].1.change(), change) {
                break;
            }
        }
        None
    }

    fn append(&mut self, event: KvEvent) -> EventId {
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

    /// Every event not read yet, moved out of the log (which then holds none for replay), or [`TooOld`] when
    /// some were dropped unread: for a sole reader that never resubscribes (the simulator), which so reads each
    /// event once without copying it and keeps the buffer small.
    pub fn take_unread(&mut self) -> Result<Vec<(EventId, KvEvent)>, TooOld> {
        // Most of a simulated worker's steps log nothing.
        if self.buffer.is_empty() && self.next == *self.sealed.get_mut() {
            return Ok(Vec::new());
        }
        let sealed = std::mem::replace(self.sealed.get_mut(), self.next);
        let oldest = self.buffer.front().map(|(id, _)| *id);
        let events: Vec<(EventId, KvEvent)> = self.buffer.drain(..).filter(|(id, _)| id.0 >= sealed).collect();
        match events.first().map(|(id, _)| *id) {
            Some(first) if first.0 > sealed => Err(TooOld { requested: sealed.checked_sub(1).map(EventId), oldest }),
            None if self.next > sealed => Err(TooOld { requested: sealed.checked_sub(1).map(EventId), oldest }),
            _ => Ok(events),
        }
    }

    /// The id of the newest event, if any. It is sealed: whoever asks (a snapshot's `as_of`) has seen it whole.
    pub fn last(&self) -> Option<EventId> {
        self.sealed.fetch_max(self.next, Ordering::Relaxed);
        self.next.checked_sub(1).map(EventId)
    }

    /// Every event after `after` (all events when `None`), or [`TooOld`] when some were already dropped.
    pub fn events_after(&self, after: Option<EventId>) -> Result<Vec<(EventId, KvEvent)>, TooOld> {
        let first_wanted = after.map_or(0, |id| id.0 + 1);
        if first_wanted >= self.next {
            return Ok(Vec::new());
        }
        self.sealed.fetch_max(self.next, Ordering::Relaxed);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(tier: Tier, parent: Option<u64>, blocks: &[u64]) -> KvEvent {
        let blocks = blocks.iter().map(|&b| (SeqHash(b), LocalHash(b))).collect();
        KvEvent::Stored { tier, parent: parent.map(SeqHash), blocks }
    }

    fn removed(tier: Tier, seqs: &[u64]) -> KvEvent {
        KvEvent::Removed { tier, seqs: seqs.iter().map(|&s| SeqHash(s)).collect() }
    }

    #[test]
    fn unread_events_that_continue_each_other_merge_and_reading_seals_them() {
        let mut log = EventLog::new(16);
        assert_eq!(log.push(stored(Tier::Device, None, &[1])), EventId(0));
        assert_eq!(log.push(stored(Tier::Device, Some(1), &[2])), EventId(0), "continues block 1");
        assert_eq!(log.push(stored(Tier::Device, Some(2), &[3, 4])), EventId(0));
        assert_eq!(log.push(stored(Tier::Device, Some(9), &[10])), EventId(1), "another chain");
        assert_eq!(log.push(stored(Tier::Host, Some(10), &[11])), EventId(2), "another tier");
        assert_eq!(log.push(removed(Tier::Device, &[4])), EventId(3));
        assert_eq!(log.push(removed(Tier::Device, &[3])), EventId(3), "more blocks leaving the same tier");
        assert_eq!(log.push(removed(Tier::Host, &[11])), EventId(4));
        let read = log.events_after(None).expect("held");
        assert_eq!(read.len(), 5);
        assert_eq!(read[0].1, stored(Tier::Device, None, &[1, 2, 3, 4]));
        assert_eq!(read[3].1, removed(Tier::Device, &[4, 3]));
        // What was read never grows: the next removal from the host tier is an event of its own.
        assert_eq!(log.push(removed(Tier::Host, &[10])), EventId(5));
        assert_eq!(log.events_after(Some(EventId(4))).expect("held"), vec![(EventId(5), removed(Tier::Host, &[10]))]);
        // Nor does the newest event once a snapshot was taken as of it.
        assert_eq!(log.last(), Some(EventId(5)));
        assert_eq!(log.push(removed(Tier::Host, &[12])), EventId(6));
    }

    #[test]
    fn a_chain_offloaded_block_by_block_makes_one_event_per_tier() {
        // What the pool logs moving blocks 3, 2, 1 of a chain (last first) from the device to the host tier, each
        // made room for by dropping an old host block: the host drop, the host store, the device removal.
        let mut log = EventLog::new(16);
        for (b, old) in [(3, 30), (2, 20), (1, 10)] {
            log.push(removed(Tier::Host, &[old]));
            log.push(stored(Tier::Host, Some(b - 1), &[b]));
            log.push(removed(Tier::Device, &[b]));
        }
        assert_eq!(
            log.take_unread().expect("held"),
            vec![
                (EventId(0), removed(Tier::Host, &[30, 20, 10])),
                (EventId(1), stored(Tier::Host, Some(0), &[1, 2, 3])),
                (EventId(2), removed(Tier::Device, &[3, 2, 1])),
            ]
        );
        // A removal never moves before a store of the same block on its tier, nor a store before its removal.
        log.push(stored(Tier::Host, None, &[5]));
        log.push(removed(Tier::Host, &[6]));
        log.push(removed(Tier::Host, &[5]));
        log.push(stored(Tier::Host, Some(5), &[7]));
        log.push(stored(Tier::Host, None, &[5]));
        let read: Vec<KvEvent> = log.take_unread().expect("held").into_iter().map(|(_, e)| e).collect();
        assert_eq!(
            read,
            vec![stored(Tier::Host, None, &[5, 7]), removed(Tier::Host, &[6, 5]), stored(Tier::Host, None, &[5]),]
        );
    }

    #[test]
    fn blocks_pushed_one_by_one_log_as_their_single_block_events_would() {
        let (mut by_event, mut by_block) = (EventLog::new(16), EventLog::new(16));
        let meta = |b: u64| BlockMeta { seq: SeqHash(b), local: LocalHash(b), parent: b.checked_sub(1).map(SeqHash) };
        for (b, old) in [(3, 30), (2, 20), (1, 10), (4, 40)] {
            by_event.push(removed(Tier::Host, &[old]));
            by_event.push(stored(Tier::Host, Some(b - 1), &[b]));
            by_event.push(removed(Tier::Device, &[b]));
            by_block.push_removed(Tier::Host, SeqHash(old));
            by_block.push_stored(Tier::Host, meta(b));
            by_block.push_removed(Tier::Device, SeqHash(b));
        }
        let taken = by_event.take_unread().expect("held");
        assert_eq!(taken.len(), 3, "{taken:?}");
        assert_eq!(by_block.take_unread().expect("held"), taken);
    }

    #[test]
    fn a_sole_reader_takes_each_event_once_and_hears_of_any_it_missed() {
        let mut log = EventLog::new(2);
        assert_eq!(log.take_unread(), Ok(vec![]));
        log.push(stored(Tier::Device, None, &[1]));
        log.push(stored(Tier::Device, Some(1), &[2]));
        log.push(removed(Tier::Host, &[7]));
        assert_eq!(
            log.take_unread(),
            Ok(vec![(EventId(0), stored(Tier::Device, None, &[1, 2])), (EventId(1), removed(Tier::Host, &[7]))])
        );
        assert_eq!(log.take_unread(), Ok(vec![]), "taken once");
        // Taken events are sealed: the next removal from the host is an event of its own.
        assert_eq!(log.push(removed(Tier::Host, &[8])), EventId(2));
        // Three events into a log of two: the first is gone unread.
        log.push(stored(Tier::Host, None, &[9]));
        log.push(removed(Tier::Device, &[1]));
        assert!(log.take_unread().is_err(), "event 2 was dropped before it was read");
        assert_eq!(log.take_unread(), Ok(vec![]));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2_000))]

        /// Blocks of a small set stored on and removed from two tiers in any order, with reads in between: what a
        /// reader of the joined events rebuilds is what applying every change on its own gives.
        #[test]
        fn joined_events_rebuild_what_every_change_alone_does(
            ops in proptest::collection::vec((0u8..3, 0usize..2, 0u64..6), 1..80),
        ) {
            let mut log = EventLog::new(1_000);
            let (mut alone, mut joined) = (TierView::default(), TierView::default());
            let mut read: Option<EventId> = None;
            for (k, &(kind, tier, b)) in ops.iter().enumerate() {
                let tier = Tier::ALL[tier];
                let meta = BlockMeta { seq: SeqHash(b), local: LocalHash(b), parent: b.checked_sub(1).map(SeqHash) };
                match kind {
                    0 => {
                        log.push_stored(tier, meta);
                        alone.apply(EventId(k as u64), &stored(tier, meta.parent.map(|p| p.0), &[b]));
                    }
                    1 => {
                        log.push_removed(tier, SeqHash(b));
                        alone.apply(EventId(k as u64), &removed(tier, &[b]));
                    }
                    _ => {
                        for (id, e) in log.events_after(read).expect("held") {
                            joined.apply(id, &e);
                            read = Some(id);
                        }
                        for t in Tier::ALL {
                            proptest::prop_assert_eq!(joined.blocks(t), alone.blocks(t), "after op {}", k);
                        }
                    }
                }
            }
        }
    }
}
