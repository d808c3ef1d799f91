//! Model-based test of the block pool: random operation sequences run against the pool and against a trivial
//! reference model (vectors scanned linearly), checking after every step that they agree and that the pool's
//! invariants hold, and at the end that the event log replays to the pool's exact content.
//!
//! Cases: 10,000 by default; set `TANDEM_POOL_CASES` for a longer run.

use std::collections::{BTreeSet, HashMap};

use kv_cache::events::{BlockMeta, EventId, Tier, TierView};
use kv_cache::pool::{Action, BlockPool, Registered, TierSizes};
use kv_cache::{LocalHash, SeqHash};
use proptest::prelude::*;

/// Chains of blocks: hash of block `i` of chain `c`; prefixes are within a chain.
const CHAINS: u64 = 4;
const CHAIN_LEN: u64 = 6;

fn meta(c: u64, i: u64) -> BlockMeta {
    let seq = |i: u64| SeqHash(1000 * (c + 1) + i);
    BlockMeta { seq: seq(i), local: LocalHash(7 * (c + 1) + i), parent: i.checked_sub(1).map(seq) }
}

fn chain(c: u64, len: u64) -> Vec<SeqHash> {
    (0..len).map(|i| meta(c, i).seq).collect()
}

#[derive(Clone, Debug)]
enum Op {
    Allocate,
    /// Several blocks in one call (their evictions logged together).
    AllocateMany {
        n: usize,
    },
    /// A reader applies the events so far (sealing them) and must see the pool's content.
    Read,
    /// Register a held, unregistered block as block `i` of chain `c` (picked by index among candidates).
    Register {
        pick: usize,
        c: u64,
        i: u64,
    },
    /// Register held, unregistered blocks (the lowest slots first) as blocks `i..i + n` of chain `c`, in one call.
    RegisterRun {
        c: u64,
        i: u64,
        n: usize,
    },
    Release {
        pick: usize,
    },
    Acquire {
        c: u64,
        len: u64,
    },
    Clear {
        disk: bool,
    },
    /// Drop a host or disk block found unusable (a corrupt file).
    Discard {
        pick: usize,
        disk: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Allocate),
        2 => (2usize..6).prop_map(|n| Op::AllocateMany { n }),
        1 => Just(Op::Read),
        3 => (any::<usize>(), 0..CHAINS, 0..CHAIN_LEN).prop_map(|(pick, c, i)| Op::Register { pick, c, i }),
        2 => (0..CHAINS, 0..CHAIN_LEN, 1usize..5).prop_map(|(c, i, n)| Op::RegisterRun { c, i, n }),
        3 => any::<usize>().prop_map(|pick| Op::Release { pick }),
        3 => (0..CHAINS, 1..=CHAIN_LEN).prop_map(|(c, len)| Op::Acquire { c, len }),
        1 => any::<bool>().prop_map(|disk| Op::Clear { disk }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(pick, disk)| Op::Discard { pick, disk }),
    ]
}

/// The reference: per tier, an LRU-ordered list of cached blocks (oldest first); device blocks in use by slot.
#[derive(Debug, Default)]
struct Model {
    caps: [usize; 3],
    /// Device slots in use: (references, registered identity).
    used: HashMap<u32, (u32, Option<BlockMeta>)>,
    /// Cached (unreferenced) blocks per tier, least recently cached first.
    lru: [Vec<BlockMeta>; 3],
}

impl Model {
    fn count(&self, tier: Tier) -> usize {
        let used = if tier == Tier::Device { self.used.len() } else { 0 };
        used + self.lru[tier.index()].len()
    }

    /// Held device slots no block is registered in, lowest first.
    fn unregistered(&self) -> Vec<u32> {
        let free: BTreeSet<u32> = self.used.iter().filter(|(_, (_, m))| m.is_none()).map(|(s, _)| *s).collect();
        free.into_iter().collect()
    }

    /// Block `m` registered in held slot `slot` as new: its copies on lower tiers go.
    fn register(&mut self, slot: u32, m: BlockMeta, data: &mut HashMap<(Tier, u32), SeqHash>) {
        for t in [Tier::Host, Tier::Disk] {
            self.lru[t.index()].retain(|x| x.seq != m.seq);
        }
        if let Some(e) = self.used.get_mut(&slot) {
            e.1 = Some(m);
        }
        data.insert((Tier::Device, slot), m.seq);
    }

    fn on(&self, tier: Tier, seq: SeqHash) -> bool {
        self.lru[tier.index()].iter().any(|m| m.seq == seq)
            || (tier == Tier::Device && self.used.values().any(|(_, m)| m.is_some_and(|m| m.seq == seq)))
    }

    fn lookup(&self, hashes: &[SeqHash]) -> [usize; 3] {
        let mut at = 0;
        let mut out = [0; 3];
        for tier in Tier::ALL {
            while at < hashes.len() && self.on(tier, hashes[at]) {
                out[tier.index()] += 1;
                at += 1;
            }
        }
        out
    }

    /// Makes room on `tier` for one block by moving its oldest cached block down. `false` if nothing can go.
    fn make_room(&mut self, tier: Tier) -> bool {
        if self.count(tier) < self.caps[tier.index()] {
            return true;
        }
        if self.lru[tier.index()].is_empty() {
            return false;
        }
        let victim = self.lru[tier.index()].remove(0);
        if let Some(below) = tier.below().filter(|t| self.caps[t.index()] > 0)
            && self.make_room(below)
        {
            self.lru[below.index()].push(victim);
        }
        true
    }

    fn tier_content(&self, tier: Tier) -> BTreeSet<BlockMeta> {
        let mut s: BTreeSet<BlockMeta> = self.lru[tier.index()].iter().copied().collect();
        if tier == Tier::Device {
            s.extend(self.used.values().filter_map(|(_, m)| *m));
        }
        s
    }
}

fn apply_copies(actions: &[Action], data: &mut HashMap<(Tier, u32), SeqHash>, pool: &BlockPool) {
    // Contents travel with the copies; a destination must never be overwritten while still needed.
    for Action::Copy { from, to, block } in actions {
        let v = data.get(&(from.tier, from.slot)).copied();
        match v {
            Some(v) => {
                assert_eq!(v, *block, "the copy names the block it carries");
                data.insert((to.tier, to.slot), v);
            }
            None => panic!("copy from an empty slot {from:?} (pool {pool:?})"),
        }
    }
}

fn run(sizes: TierSizes, ops: Vec<Op>, snapshot_at: usize) -> Result<(), TestCaseError> {
    let mut pool: BlockPool = BlockPool::new(sizes, usize::MAX).expect("valid sizes");
    let mut model = Model { caps: [sizes.device, sizes.host, sizes.disk], ..Model::default() };
    // What each slot holds, moved by the pool's copies: proves a block's bytes follow its identity.
    let mut data: HashMap<(Tier, u32), SeqHash> = HashMap::new();
    // References the test holds: one entry per reference.
    let mut held: Vec<u32> = Vec::new();
    let mut snapshot = None;
    // A reader following the log as it goes.
    let (mut reader, mut read) = (TierView::default(), None);
    for (step, op) in ops.into_iter().enumerate() {
        if step == snapshot_at {
            snapshot = Some(pool.snapshot());
        }
        match op {
            Op::Allocate => {
                let mut actions = Vec::new();
                let room = model.make_room(Tier::Device);
                match pool.allocate(&mut actions) {
                    Ok(slot) => {
                        prop_assert!(room, "the pool allocated where the model had no room");
                        prop_assert!(
                            !held.contains(&slot) && !model.used.contains_key(&slot),
                            "slot {slot} handed out twice"
                        );
                        apply_copies(&actions, &mut data, &pool);
                        data.remove(&(Tier::Device, slot));
                        model.used.insert(slot, (1, None));
                        held.push(slot);
                    }
                    Err(_) => prop_assert!(!room, "the pool refused where the model had room"),
                }
            }
            Op::AllocateMany { n } => {
                let (mut actions, mut slots) = (Vec::new(), Vec::new());
                let result = pool.allocate_many(n, &mut slots, &mut actions);
                apply_copies(&actions, &mut data, &pool);
                let mut room = 0;
                while room < n && model.make_room(Tier::Device) {
                    let Some(&slot) = slots.get(room) else {
                        return Err(TestCaseError::fail("the pool allocated fewer blocks than the model could"));
                    };
                    prop_assert!(
                        !held.contains(&slot) && !model.used.contains_key(&slot),
                        "slot {slot} handed out twice"
                    );
                    data.remove(&(Tier::Device, slot));
                    model.used.insert(slot, (1, None));
                    held.push(slot);
                    room += 1;
                }
                prop_assert_eq!(slots.len(), room, "blocks allocated");
                prop_assert_eq!(result.is_ok(), room == n);
            }
            Op::Read => {
                for (id, e) in pool.events_after(read).expect("the whole log is kept") {
                    reader.apply(id, &e);
                    read = Some(id);
                }
                for tier in Tier::ALL {
                    prop_assert_eq!(&reader.blocks(tier), &model.tier_content(tier), "a reader's view of {:?}", tier);
                }
            }
            Op::Register { pick, c, i } => {
                let candidates = model.unregistered();
                if candidates.is_empty() {
                    continue;
                }
                let slot = candidates[pick % candidates.len()];
                let m = meta(c, i);
                let dup = model.on(Tier::Device, m.seq);
                match pool.register(slot, m).expect("a held, unregistered block registers") {
                    Registered::New => {
                        prop_assert!(!dup);
                        model.register(slot, m, &mut data);
                    }
                    Registered::Duplicate { .. } => prop_assert!(dup),
                }
            }
            Op::RegisterRun { c, i, n } => {
                let run: Vec<(u32, BlockMeta)> = model
                    .unregistered()
                    .into_iter()
                    .zip(i..CHAIN_LEN)
                    .take(n)
                    .map(|(slot, k)| (slot, meta(c, k)))
                    .collect();
                pool.register_run(&run).expect("held, unregistered blocks register");
                // As `register` each: a block already on the device stays where it is.
                for (slot, m) in run {
                    if !model.on(Tier::Device, m.seq) {
                        model.register(slot, m, &mut data);
                    }
                }
            }
            Op::Release { pick } => {
                if held.is_empty() {
                    continue;
                }
                let slot = held.swap_remove(pick % held.len());
                pool.release(slot).expect("a held block releases");
                let (refs, m) = model.used[&slot];
                if refs > 1 {
                    model.used.insert(slot, (refs - 1, m));
                } else {
                    model.used.remove(&slot);
                    if let Some(m) = m {
                        model.lru[0].push(m);
                    }
                }
            }
            Op::Acquire { c, len } => {
                let hashes = chain(c, len);
                let got = pool.acquire(&hashes);
                apply_copies(&got.actions, &mut data, &pool);
                // The model: take blocks while they are somewhere and room can be made.
                let mut taken = 0;
                for &h in &hashes {
                    if let Some((slot, _)) =
                        model.used.iter().find(|(_, (_, m))| m.is_some_and(|m| m.seq == h)).map(|(s, v)| (*s, *v))
                    {
                        if let Some(e) = model.used.get_mut(&slot) {
                            e.0 += 1;
                        }
                        prop_assert_eq!(got.slots.get(taken), Some(&slot));
                    } else if let Some(pos) = model.lru[0].iter().position(|m| m.seq == h) {
                        let m = model.lru[0].remove(pos);
                        let slot = got.slots.get(taken).copied();
                        prop_assert!(slot.is_some(), "the pool stopped at a device hit");
                        model.used.insert(slot.unwrap_or_default(), (1, Some(m)));
                    } else if let Some(tier) = [Tier::Host, Tier::Disk].into_iter().find(|t| model.on(*t, h)) {
                        // Pinned while room is made on the device.
                        let pos = model.lru[tier.index()].iter().position(|m| m.seq == h).unwrap_or_default();
                        let m = model.lru[tier.index()].remove(pos);
                        model.caps[tier.index()] -= 1;
                        let room = model.make_room(Tier::Device);
                        model.caps[tier.index()] += 1;
                        if !room {
                            model.lru[tier.index()].push(m);
                            break;
                        }
                        let Some(&slot) = got.slots.get(taken) else {
                            return Err(TestCaseError::fail("the pool did not onboard a block the model could"));
                        };
                        model.used.insert(slot, (1, Some(m)));
                    } else {
                        break;
                    }
                    let slot = got.slots[taken];
                    prop_assert_eq!(data.get(&(Tier::Device, slot)), Some(&h), "slot {} holds the wrong block", slot);
                    held.push(slot);
                    taken += 1;
                }
                prop_assert_eq!(got.slots.len(), taken);
            }
            Op::Discard { pick, disk } => {
                let tier = if disk { Tier::Disk } else { Tier::Host };
                let blocks = &model.lru[tier.index()];
                if blocks.is_empty() {
                    continue;
                }
                let m = blocks[pick % blocks.len()];
                let at = pool.find(m.seq).expect("the model's block is in the pool");
                prop_assert_eq!(at.tier, tier);
                prop_assert_eq!(pool.discard(at), Some(m));
                model.lru[tier.index()].retain(|x| x.seq != m.seq);
            }
            Op::Clear { disk } => {
                let tier = if disk { Tier::Disk } else { Tier::Host };
                pool.clear(tier);
                model.lru[tier.index()].clear();
            }
        }
        check(&pool, &model, &held)?;
    }
    // Replaying the whole log from empty, and a snapshot plus the events after it, give the pool's content.
    let mut from_empty = TierView::default();
    for (id, e) in pool.events_after(None).expect("the whole log is kept") {
        from_empty.apply(id, &e);
    }
    let snap = snapshot.unwrap_or_else(|| pool.snapshot());
    let mut from_snapshot = TierView::from_snapshot(&snap);
    for (id, e) in pool.events_after(snap.as_of).expect("kept") {
        from_snapshot.apply(id, &e);
    }
    for tier in Tier::ALL {
        let truth = model.tier_content(tier);
        prop_assert_eq!(&from_empty.blocks(tier), &truth, "replay from empty, {:?}", tier);
        prop_assert_eq!(&from_snapshot.blocks(tier), &truth, "replay from snapshot, {:?}", tier);
    }
    prop_assert_eq!(from_empty.as_of, pool.last_event());
    Ok(())
}

fn check(pool: &BlockPool, model: &Model, held: &[u32]) -> Result<(), TestCaseError> {
    for tier in Tier::ALL {
        let u = pool.usage(tier);
        prop_assert_eq!(u.used + u.cached + u.free, pool.capacity(tier), "{:?} accounting", tier);
        prop_assert_eq!(u.used + u.cached, model.count(tier), "{:?} occupancy", tier);
        let content: BTreeSet<BlockMeta> = pool.snapshot().tiers[tier.index()].iter().copied().collect();
        prop_assert_eq!(content, model.tier_content(tier), "{:?} content", tier);
    }
    // A referenced block is never evicted: every held registered block is still on the device, in its slot.
    for &slot in held {
        if let Some(m) = model.used.get(&slot).and_then(|(_, m)| *m) {
            prop_assert_eq!(pool.meta(slot), Some(m));
        }
    }
    for c in 0..CHAINS {
        let hashes = chain(c, CHAIN_LEN);
        let p = pool.lookup(&hashes);
        prop_assert_eq!([p.device, p.host, p.disk], model.lookup(&hashes), "prefix lookup of chain {}", c);
    }
    // At most one tier per hash.
    let mut seen = BTreeSet::new();
    for tier in Tier::ALL {
        for m in &pool.snapshot().tiers[tier.index()] {
            prop_assert!(seen.insert(m.seq), "{:?} on two tiers", m.seq);
        }
    }
    Ok(())
}

fn cases() -> u32 {
    std::env::var("TANDEM_POOL_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), max_shrink_iters: 10_000, ..ProptestConfig::default() })]

    #[test]
    fn the_pool_agrees_with_the_model(
        device in 1usize..6, host in 0usize..4, disk in 0usize..4,
        ops in proptest::collection::vec(op(), 1..60),
        snapshot_at in 0usize..60,
    ) {
        run(TierSizes { device, host, disk }, ops, snapshot_at)?;
    }
}

#[test]
fn a_bounded_log_sends_resubscribers_to_a_snapshot() {
    let mut pool: BlockPool = BlockPool::new(TierSizes { device: 4, host: 0, disk: 0 }, 2).expect("valid");
    // Three chains' first blocks: three events (blocks of one chain would make one, see the log's merging).
    for c in 0..3 {
        let slot = pool.allocate(&mut Vec::new()).expect("room");
        pool.register(slot, meta(c, 0)).expect("registers");
    }
    assert_eq!(pool.last_event(), Some(EventId(2)));
    assert_eq!(pool.events_after(Some(EventId(0))).expect("held").len(), 2);
    assert!(pool.events_after(None).is_err(), "event 0 was dropped");
    assert!(pool.events_after(Some(EventId(2))).expect("nothing new").is_empty());
}

#[test]
fn blocks_found_at_start_up_are_restored_once_with_events() {
    let mut pool: BlockPool = BlockPool::new(TierSizes { device: 2, host: 0, disk: 2 }, 16).expect("valid");
    assert_eq!(pool.restore(Tier::Disk, meta(1, 0)), Some(0));
    assert_eq!(pool.restore(Tier::Disk, meta(1, 0)), None, "already there");
    assert_eq!(pool.restore(Tier::Device, meta(1, 1)), None, "the device tier starts empty");
    assert_eq!(pool.restore(Tier::Disk, meta(1, 1)), Some(1));
    assert_eq!(pool.restore(Tier::Disk, meta(1, 2)), None, "the disk tier is full");
    assert_eq!(pool.lookup(&chain(1, 3)).disk, 2);
    let mut view = TierView::default();
    for (id, e) in pool.events_after(None).expect("kept") {
        view.apply(id, &e);
    }
    assert_eq!(view.blocks(Tier::Disk).len(), 2);
}

#[test]
fn a_device_tier_of_zero_is_refused() {
    assert!(BlockPool::<kv_cache::pool::Lru>::new(TierSizes { device: 0, host: 4, disk: 4 }, 16).is_err());
}

/// Evicts the block that became evictable last: a policy whose victims are not oldest first.
#[derive(Debug, Default)]
struct Newest(Vec<u32>);

impl kv_cache::pool::EvictionPolicy for Newest {
    fn insert(&mut self, slot: u32) {
        self.remove(slot);
        self.0.push(slot);
    }

    fn remove(&mut self, slot: u32) {
        self.0.retain(|&s| s != slot);
    }

    fn victim(&self) -> Option<u32> {
        self.0.last().copied()
    }
}

#[test]
fn a_batch_of_evictions_logs_in_order_under_a_policy_that_is_not_oldest_first() {
    let mut pool: BlockPool<Newest> = BlockPool::new(TierSizes { device: 2, host: 2, disk: 0 }, 1_000).expect("valid");
    let cache = |pool: &mut BlockPool<Newest>, m: BlockMeta| {
        let slot = pool.allocate(&mut Vec::new()).expect("room");
        pool.register(slot, m).expect("registers");
        pool.release(slot).expect("releases");
    };
    // Two blocks moved to the host tier, filling it.
    cache(&mut pool, meta(2, 0));
    cache(&mut pool, meta(3, 0));
    let mut slots = Vec::new();
    pool.allocate_many(2, &mut slots, &mut Vec::new()).expect("room");
    slots.iter().for_each(|&s| pool.release(s).expect("releases"));
    // Two more cached on the device, then both evicted in one batch: the second eviction's host victim is the block
    // the first one stored there (the newest), so its removal must be logged after that store.
    cache(&mut pool, meta(0, 0));
    cache(&mut pool, meta(1, 0));
    pool.allocate_many(2, &mut Vec::new(), &mut Vec::new()).expect("room");
    let mut view = TierView::default();
    for (id, e) in pool.events_after(None).expect("kept") {
        view.apply(id, &e);
    }
    let snapshot = pool.snapshot();
    for tier in Tier::ALL {
        let content: BTreeSet<BlockMeta> = snapshot.tiers[tier.index()].iter().copied().collect();
        assert_eq!(view.blocks(tier), content, "{tier:?}");
    }
    // meta(2, 0) made room for meta(1, 0), which then made room for meta(0, 0).
    assert_eq!(snapshot.tiers[Tier::Host.index()], vec![meta(0, 0), meta(3, 0)]);
}
