//! The tiered block pool: device, host and disk tiers of fixed size, reference-counted device blocks shared by
//! hash, an LRU of cached blocks per tier, and eviction down the tiers (device → host → disk → gone).
//!
//! Pure mechanism: it decides slot numbers and returns the copies ([`Action`]) the caller must perform, in order,
//! before it uses the slots involved; it never touches memory, files or clocks. Every change to a tier's content
//! is logged as a [`KvEvent`] in the order it happened.
//!
//! **Invariants** (checked by the model-based test): a slot is never handed out twice; a referenced block is
//! never evicted; per tier, used + cached + free = capacity; a block hash lives on at most one tier; replaying
//! the log reproduces every tier's content.

mod eviction;
mod located;
mod tier;

pub use eviction::{EvictionPolicy, Lru};
use located::Located;
use tier::TierTable;

use crate::events::{BlockMeta, EventId, EventLog, KvEvent, Snapshot, Tier, TooOld};
use crate::hash::{LocalHash, SeqHash};

/// How many blocks ahead a walk over a prompt's hashes asks for the lines of their lookups
/// ([`BlockPool::prefetch`]): enough for the misses to overlap, few enough that the lines are still there.
pub const LOOK_AHEAD: usize = 8;

/// For a walk over `items` now at `i`, the ones to ask for now: the one [`LOOK_AHEAD`] further on, and at the
/// walk's start those before it too (most walks are a few blocks long, and would wait on each miss in turn).
pub fn ahead<T>(items: &[T], i: usize) -> &[T] {
    let (from, to) = if i == 0 { (1, LOOK_AHEAD + 1) } else { (i + LOOK_AHEAD, i + LOOK_AHEAD + 1) };
    &items[from.min(items.len())..to.min(items.len())]
}

/// Number of blocks of each tier. Host and disk may be 0 (tier absent); the device tier may not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierSizes {
    pub device: usize,
    pub host: usize,
    pub disk: usize,
}

/// A slot on a tier (for the device tier: a block of the engine's KV store).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Location {
    pub tier: Tier,
    pub slot: u32,
}

/// A copy the caller must perform before using the destination, in the order given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Copy the bytes of `block` from one slot to another.
    Copy { from: Location, to: Location, block: SeqHash },
}

/// Why a pool operation was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("the device tier needs at least one block")]
    NoDeviceBlocks,
    #[error("a tier may have at most {max} blocks, not {0}", max = located::MAX_SLOTS - 1)]
    TierTooLarge(usize),
    #[error("out of KV capacity: every device block is referenced")]
    OutOfBlocks,
    #[error("device block {0} is not in use")]
    NotInUse(u32),
    #[error("device block {0} is already registered")]
    AlreadyRegistered(u32),
}

/// How many of a request's leading blocks each tier holds (`routing.md`'s overlap).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Leading blocks on the device tier.
    pub device: usize,
    /// Further consecutive blocks on the host tier.
    pub host: usize,
    /// Further consecutive blocks on the disk tier.
    pub disk: usize,
}

/// A prefix taken for a sequence: device slots (referenced), and the onboarding copies to perform first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Acquired {
    pub slots: Vec<u32>,
    pub actions: Vec<Action>,
    /// Blocks that came from each tier (device hits, onboarded from host, onboarded from disk).
    pub from_tier: [usize; 3],
}

/// Blocks per state on one tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierUsage {
    pub used: usize,
    pub cached: usize,
    pub free: usize,
}

/// Outcome of registering a completed block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Registered {
    /// The block is now findable by its hash.
    New,
    /// Another device block already has this hash; this one stays private and is freed on release.
    Duplicate { existing: u32 },
}

/// The tiered pool. `E` is the eviction policy of every tier.
#[derive(Debug)]
pub struct BlockPool<E: EvictionPolicy + Default = Lru> {
    tiers: [TierTable<E>; 3],
    /// Where every findable block is: registered device blocks (in use or cached) and cached host and disk
    /// blocks. One map for all tiers, so a block moving down a tier is one update, and a miss one probe.
    located: Located,
    log: EventLog,
    /// The tier changes of the allocation under way, logged when it ends ([`BlockPool::allocate_many`]).
    moves: Moves,
}

/// The tier changes evictions made during one allocation of many blocks, per tier, logged together when it ends:
/// every tier's removals, then its stores (a store's copy before its original's removal, lowest tier first), which
/// is the order the changes happened in as long as no block stored on a tier in the batch leaves it again in the
/// batch. `older` tells when that could happen: under a policy whose victims come oldest first (LRU), while victims
/// cached before the batch remain, a victim cannot be a block the batch stored; when they run out (or under any
/// other policy, at every victim), the batch so far is logged first.
#[derive(Debug, Default)]
struct Moves {
    removed: [Vec<SeqHash>; 3],
    stored: [Vec<BlockMeta>; 3],
    older: [usize; 3],
}

impl<E: EvictionPolicy + Default> BlockPool<E> {
    /// A pool with the given tier sizes, keeping the last `replay` events for resubscribers.
    pub fn new(sizes: TierSizes, replay: usize) -> Result<BlockPool<E>, PoolError> {
        if sizes.device == 0 {
            return Err(PoolError::NoDeviceBlocks);
        }
        if let Some(&n) = [sizes.device, sizes.host, sizes.disk].iter().find(|&&n| n >= located::MAX_SLOTS) {
            return Err(PoolError::TierTooLarge(n));
        }
        let tiers = [TierTable::new(sizes.device), TierTable::new(sizes.host), TierTable::new(sizes.disk)];
        // Every block findable at once fits without the table growing.
        let located = Located::with_capacity(sizes.device + sizes.host + sizes.disk);
        Ok(BlockPool { tiers, located, log: EventLog::new(replay), moves: Moves::default() })
    }

    fn table(&self, tier: Tier) -> &TierTable<E> {
        &self.tiers[tier.index()]
    }

    fn table_mut(&mut self, tier: Tier) -> &mut TierTable<E> {
        &mut self.tiers[tier.index()]
    }

    /// Blocks per state on `tier`.
    pub fn usage(&self, tier: Tier) -> TierUsage {
        self.table(tier).usage()
    }

    /// Capacity of `tier` in blocks.
    pub fn capacity(&self, tier: Tier) -> usize {
        self.table(tier).capacity()
    }

    /// References to device slot `slot` (0: not in use).
    pub fn references(&self, slot: u32) -> u32 {
        self.table(Tier::Device).ref_count(slot).map_or(0, std::num::NonZeroU32::get)
    }

    /// The identity of the block in device slot `slot`, if it is registered.
    pub fn meta(&self, slot: u32) -> Option<BlockMeta> {
        self.table(Tier::Device).meta(slot)
    }

    /// The tier holding `seq`, and the slot there.
    pub fn find(&self, seq: SeqHash) -> Option<Location> {
        let tiers = &self.tiers;
        self.located.get(seq, |at| tiers[at.tier.index()].seq_at(at.slot))
    }

    /// Asks the processor for the line a lookup of `seq` starts at: a caller about to look up or register many
    /// blocks in turn asks a few ahead, so that their misses overlap.
    pub fn prefetch(&self, seq: SeqHash) {
        self.located.prefetch(seq);
    }

    /// For a walk over `hashes` now at block `i`: asks for the lookup lines of the blocks [`ahead`].
    pub fn prefetch_ahead(&self, hashes: &[SeqHash], i: usize) {
        ahead(hashes, i).iter().for_each(|&h| self.prefetch(h));
    }

    /// How many of `hashes`' leading blocks are on each tier, device first: a run on the device, then one on
    /// the host, then one on disk (each may be empty). One probe per block.
    pub fn lookup(&self, hashes: &[SeqHash]) -> PrefixMatch {
        let mut runs = [0; 3];
        let mut tier = 0;
        for (i, &h) in hashes.iter().enumerate() {
            self.prefetch_ahead(hashes, i);
            match self.find(h) {
                Some(at) if at.tier.index() >= tier => {
                    tier = at.tier.index();
                    runs[tier] += 1;
                }
                _ => break,
            }
        }
        let [device, host, disk] = runs;
        PrefixMatch { device, host, disk }
    }

    /// A fresh device block for a sequence, referenced once. Evicts the least recently used cached device block
    /// (moving it down the tiers) when none is free.
    pub fn allocate(&mut self, actions: &mut Vec<Action>) -> Result<u32, PoolError> {
        self.begin_moves();
        let slot = self.take_device_block(actions);
        self.log_moves();
        slot.ok_or(PoolError::OutOfBlocks)
    }

    /// `n` fresh device blocks (as [`allocate`](Self::allocate) each), appended to `slots`. When every device
    /// block is referenced before `n` are found, the ones found stay in `slots` and the answer is
    /// [`PoolError::OutOfBlocks`]. The evictions' events are logged once, as runs, instead of block by block.
    pub fn allocate_many(
        &mut self,
        n: usize,
        slots: &mut Vec<u32>,
        actions: &mut Vec<Action>,
    ) -> Result<(), PoolError> {
        self.begin_moves();
        let before = slots.len();
        slots.extend((0..n).map_while(|_| self.take_device_block(actions)));
        self.log_moves();
        if slots.len() - before == n { Ok(()) } else { Err(PoolError::OutOfBlocks) }
    }

    /// A free device block, made by eviction if need be, marked used; `None` when every device block is referenced.
    /// Its evictions' events wait in `moves`.
    fn take_device_block(&mut self, actions: &mut Vec<Action>) -> Option<u32> {
        let slot = match self.table_mut(Tier::Device).take_free() {
            Some(slot) => slot,
            None => {
                let victim = self.table(Tier::Device).victim()?;
                self.prefetch_after(Tier::Device, victim);
                self.evict(Location { tier: Tier::Device, slot: victim }, actions);
                self.table_mut(Tier::Device).take_free()?
            }
        };
        self.table_mut(Tier::Device).set_used(slot, None);
        Some(slot)
    }

    /// Asks for the lines the victims after `victim` on `tier` will need, as a pipeline over the eviction order:
    /// the map entry of the next victim (whose state line was asked for while the one before `victim` was
    /// handled), and the state and links of the one after it. A run of evictions then waits on one miss at a time
    /// less often. (Two victims ahead measured no faster.)
    fn prefetch_after(&self, tier: Tier, victim: u32) {
        let table = self.table(tier);
        let Some(next) = table.after(victim) else { return };
        if let Some(seq) = table.seq_at(next) {
            self.located.prefetch(seq);
        }
        if let Some(later) = table.after(next) {
            table.prefetch(later);
        }
    }

    /// Starts a batch of evictions: the lower tiers' blocks cached now are the victims that cannot be the batch's.
    fn begin_moves(&mut self) {
        for t in [Tier::Host, Tier::Disk] {
            self.moves.older[t.index()] = self.table(t).usage().cached;
        }
    }

    /// Moves the cached block at `at` one tier down (or drops it from the last tier), leaving `at` free; its
    /// events wait in `moves`.
    fn evict(&mut self, at: Location, actions: &mut Vec<Action>) {
        let Some(meta) = self.table_mut(at.tier).take_cached(at.slot) else { return };
        let Some(below) = at.tier.below().filter(|&t| self.table(t).capacity() > 0) else {
            self.located.remove_at(meta.seq, at);
            self.moves.removed[at.tier.index()].push(meta.seq);
            return;
        };
        let slot = match self.table_mut(below).take_free() {
            Some(s) => Some(s),
            None => self.table(below).victim().and_then(|v| {
                self.prefetch_after(below, v);
                // The victim may be a block this batch stored there: log the batch so far first.
                if self.moves.older[below.index()] == 0 || !self.table(below).oldest_first() {
                    self.log_moves();
                    self.moves.older[below.index()] = self.table(below).usage().cached;
                }
                self.moves.older[below.index()] -= 1;
                self.evict(Location { tier: below, slot: v }, actions);
                self.table_mut(below).take_free()
            }),
        };
        if let Some(slot) = slot {
            let to = Location { tier: below, slot };
            actions.push(Action::Copy { from: at, to, block: meta.seq });
            self.table_mut(below).set_cached(slot, meta);
            self.located.relocate(meta.seq, at, to);
            self.moves.stored[below.index()].push(meta);
        } else {
            self.located.remove_at(meta.seq, at);
        }
        self.moves.removed[at.tier.index()].push(meta.seq);
    }

    /// Logs the changes in `moves`: per tier, lowest first, the removals, then the stores as chain runs (the LRU
    /// evicts a chain from its end, so a run arrives backwards).
    fn log_moves(&mut self) {
        for tier in [Tier::Disk, Tier::Host, Tier::Device] {
            let removed = std::mem::take(&mut self.moves.removed[tier.index()]);
            if !removed.is_empty() {
                self.log.push(KvEvent::Removed { tier, seqs: removed });
            }
            let mut stored = std::mem::take(&mut self.moves.stored[tier.index()]);
            let mut rest = &mut stored[..];
            while !rest.is_empty() {
                // A run: each block the parent of the one before it.
                let len = 1 + rest.windows(2).take_while(|w| w[0].parent == Some(w[1].seq)).count();
                let (run, tail) = rest.split_at_mut(len);
                run.reverse();
                let blocks = run.iter().map(|m| (m.seq, m.local)).collect();
                self.log.push(KvEvent::Stored { tier, parent: run[0].parent, blocks });
                rest = tail;
            }
            // The buffer is kept for the next batch.
            stored.clear();
            self.moves.stored[tier.index()] = stored;
        }
    }

    /// Marks the block in `slot` complete under `meta`, making it findable. A copy of the same block on a lower
    /// tier is dropped (the device copy is the one that counts).
    pub fn register(&mut self, slot: u32, meta: BlockMeta) -> Result<Registered, PoolError> {
        let (registered, lower) = self.register_unlogged(slot, meta)?;
        if registered == Registered::New {
            self.log.push_stored(Tier::Device, meta);
        }
        if let Some(at) = lower {
            self.log.push_removed(at.tier, meta.seq);
        }
        Ok(registered)
    }

    /// Registers a sequence's newly completed blocks, `(slot, block)` in chain order, as [`register`](Self::register)
    /// each, and logs the new ones as stretches of the chain (one event per stretch, where a block registered
    /// elsewhere breaks it) rather than joining them into an event block by block. Blocks before a refused one stay
    /// registered (and logged).
    pub fn register_run(&mut self, run: &[(u32, BlockMeta)]) -> Result<(), PoolError> {
        let mut stretch: Vec<(SeqHash, LocalHash)> = Vec::with_capacity(run.len());
        let mut parent = run.first().and_then(|(_, m)| m.parent);
        // Copies of these blocks dropped from lower tiers: logged after the stretch, whose store came first.
        let mut lower: Vec<(Tier, SeqHash)> = Vec::new();
        let mut result = Ok(());
        for (i, &(slot, meta)) in run.iter().enumerate() {
            ahead(run, i).iter().for_each(|(_, m)| self.prefetch(m.seq));
            match self.register_unlogged(slot, meta) {
                Ok((Registered::New, dropped)) => {
                    stretch.push((meta.seq, meta.local));
                    lower.extend(dropped.map(|at| (at.tier, meta.seq)));
                }
                Ok((Registered::Duplicate { .. }, _)) => {
                    self.log_stretch(parent, &mut stretch, &mut lower);
                    parent = Some(meta.seq);
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.log_stretch(parent, &mut stretch, &mut lower);
        result
    }

    /// Logs a stretch of registered blocks after `parent`, then the removals of their lower-tier copies.
    fn log_stretch(
        &mut self,
        parent: Option<SeqHash>,
        stretch: &mut Vec<(SeqHash, LocalHash)>,
        lower: &mut Vec<(Tier, SeqHash)>,
    ) {
        if !stretch.is_empty() {
            self.log.push(KvEvent::Stored { tier: Tier::Device, parent, blocks: std::mem::take(stretch) });
        }
        for (tier, seq) in lower.drain(..) {
            self.log.push_removed(tier, seq);
        }
    }

    /// [`register`](Self::register) without logging: whether the block is new, and the lower-tier location its
    /// copy was dropped from.
    fn register_unlogged(&mut self, slot: u32, meta: BlockMeta) -> Result<(Registered, Option<Location>), PoolError> {
        let dev = self.table(Tier::Device);
        match dev.ref_count(slot) {
            None => return Err(PoolError::NotInUse(slot)),
            Some(_) if dev.meta(slot).is_some() => return Err(PoolError::AlreadyRegistered(slot)),
            Some(_) => {}
        }
        // One probe of the map: a fresh block (the common case) goes where the lookup ended, and a copy on a lower
        // tier is replaced; a device copy stays.
        let here = Location { tier: Tier::Device, slot };
        let tiers = &self.tiers;
        let key_at = |at: Location| tiers[at.tier.index()].seq_at(at.slot);
        let lower = match self.located.upsert(meta.seq, key_at, |now| match now {
            Some(at) if at.tier == Tier::Device => None,
            _ => Some(here),
        }) {
            Some(at) if at.tier == Tier::Device => return Ok((Registered::Duplicate { existing: at.slot }, None)),
            lower => lower,
        };
        self.table_mut(Tier::Device).register(slot, meta);
        if let Some(at) = lower {
            self.table_mut(at.tier).take_cached(at.slot);
        }
        Ok((Registered::New, lower))
    }

    /// Drops one reference to `slot`. At zero a registered block becomes cached (evictable), another is freed.
    pub fn release(&mut self, slot: u32) -> Result<(), PoolError> {
        self.table_mut(Tier::Device).release(slot).ok_or(PoolError::NotInUse(slot))
    }

    /// Takes the longest prefix of `hashes` found on any tier for a new sequence: device blocks are referenced,
    /// host and disk blocks are onboarded to fresh device blocks (copies in `Acquired::actions`). Stops at the
    /// first block that is nowhere, or when no device block can be had.
    pub fn acquire(&mut self, hashes: &[SeqHash]) -> Acquired {
        let mut out = Acquired::default();
        for (i, &h) in hashes.iter().enumerate() {
            self.prefetch_ahead(hashes, i);
            let Some(at) = self.find(h) else { break };
            if at.tier == Tier::Device {
                self.table_mut(Tier::Device).add_ref(at.slot);
                out.slots.push(at.slot);
                out.from_tier[0] += 1;
                continue;
            }
            // Pin the source so that making room on the device cannot evict it, then copy it up.
            let Some(meta) = self.table_mut(at.tier).pin(at.slot) else { break };
            let slot = match self.allocate(&mut out.actions) {
                Ok(s) => s,
                Err(_) => {
                    self.table_mut(at.tier).unpin(at.slot, meta);
                    break;
                }
            };
            out.actions.push(Action::Copy { from: at, to: Location { tier: Tier::Device, slot }, block: h });
            self.table_mut(Tier::Device).register(slot, meta);
            self.located.relocate(h, at, Location { tier: Tier::Device, slot });
            self.log.push_stored(Tier::Device, meta);
            self.table_mut(at.tier).free_pinned(at.slot);
            self.log.push_removed(at.tier, h);
            out.slots.push(slot);
            out.from_tier[at.tier.index()] += 1;
        }
        out
    }

    /// Drops every block of the host or disk tier (a restart that discards the disk directory, say).
    pub fn clear(&mut self, tier: Tier) {
        if tier == Tier::Device {
            return;
        }
        self.table_mut(tier).clear();
        self.located.remove_tier(tier);
        self.log.push(KvEvent::Cleared { tier: Some(tier) });
    }

    /// Puts a block found on a lower tier at start-up (a disk block file that checked out) into the pool.
    pub fn restore(&mut self, tier: Tier, meta: BlockMeta) -> Option<u32> {
        if tier == Tier::Device || self.find(meta.seq).is_some() {
            return None;
        }
        let slot = self.table_mut(tier).take_free()?;
        self.table_mut(tier).set_cached(slot, meta);
        self.located.insert_new(meta.seq, Location { tier, slot });
        self.log.push_stored(tier, meta);
        Some(slot)
    }

    /// Drops a block found to be unusable (a corrupt disk file): it leaves its tier with a `Removed` event.
    pub fn discard(&mut self, at: Location) -> Option<BlockMeta> {
        let meta = self.table_mut(at.tier).take_cached(at.slot)?;
        self.located.remove_at(meta.seq, at);
        self.log.push_removed(at.tier, meta.seq);
        Some(meta)
    }

    /// Every tier's content, current as of the newest event.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot { as_of: self.log.last(), tiers: Tier::ALL.map(|t| self.table(t).blocks()) }
    }

    /// Events after `after` for a resubscriber, or [`TooOld`].
    pub fn events_after(&self, after: Option<EventId>) -> Result<Vec<(EventId, KvEvent)>, TooOld> {
        self.log.events_after(after)
    }

    /// Every event not read yet, moved out ([`EventLog::take_unread`]).
    pub fn take_events(&mut self) -> Result<Vec<(EventId, KvEvent)>, TooOld> {
        self.log.take_unread()
    }

    /// The id of the newest event.
    pub fn last_event(&self) -> Option<EventId> {
        self.log.last()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_walk_asks_for_its_first_blocks_at_once_then_one_ahead() {
        let items: Vec<usize> = (0..20).collect();
        assert_eq!(ahead(&items, 0), &items[1..=LOOK_AHEAD]);
        assert_eq!(ahead(&items, 3), &[3 + LOOK_AHEAD]);
        assert!(ahead(&items, 20 - LOOK_AHEAD).is_empty());
        assert_eq!(ahead(&items[..3], 0), &[1, 2]);
        assert!(ahead::<usize>(&[], 0).is_empty());
    }
}
