//! The index against a naive model: per worker and tier a set of hashes, overlap computed by definition.

use std::collections::{BTreeSet, HashMap};

use kv_cache::events::{BlockMeta, EventId, KvEvent, Snapshot, Tier};
use kv_cache::{LocalHash, SeqHash};
use proptest::prelude::*;

use super::*;

const CHAIN: u64 = 8;
const WORKERS: u32 = 3;

fn chain() -> Vec<SeqHash> {
    (0..CHAIN).map(|i| SeqHash(1000 + i)).collect()
}

#[derive(Clone, Debug)]
enum Op {
    Store(u32, Tier, Vec<u64>),
    Remove(u32, Tier, Vec<u64>),
    Clear(u32, Option<Tier>),
    /// The worker's stream is replaced by a snapshot of its current state.
    Resync(u32),
    Vanish(u32),
}

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![Just(Tier::Device), Just(Tier::Host), Just(Tier::Disk)]
}

fn op() -> impl Strategy<Value = Op> {
    let w = 0..WORKERS;
    let blocks = proptest::collection::vec(0..CHAIN, 1..5);
    prop_oneof![
        4 => (w.clone(), tier(), blocks.clone()).prop_map(|(w, t, b)| Op::Store(w, t, b)),
        2 => (w.clone(), tier(), blocks).prop_map(|(w, t, b)| Op::Remove(w, t, b)),
        1 => (w.clone(), proptest::option::of(tier())).prop_map(|(w, t)| Op::Clear(w, t)),
        1 => w.clone().prop_map(Op::Resync),
        1 => w.prop_map(Op::Vanish),
    ]
}

#[derive(Default)]
struct Model {
    tiers: HashMap<u32, [BTreeSet<u64>; 3]>,
    next_id: HashMap<u32, u64>,
}

impl Model {
    fn overlap(&self, w: u32) -> Option<Overlap> {
        let t = self.tiers.get(&w)?;
        let on = |tier: usize, i: u64| t[tier].contains(&(1000 + i));
        let mut i = 0;
        let mut o = Overlap::default();
        while i < CHAIN && on(0, i) {
            o.device += 1;
            i += 1;
        }
        while i < CHAIN && on(1, i) {
            o.host += 1;
            i += 1;
        }
        while i < CHAIN && on(2, i) {
            o.disk += 1;
            i += 1;
        }
        (o != Overlap::default()).then_some(o)
    }

    fn snapshot(&self, w: u32) -> Snapshot {
        let t = self.tiers.get(&w).cloned().unwrap_or_default();
        let meta = |h: &u64| BlockMeta { seq: SeqHash(*h), local: LocalHash(*h), parent: None };
        Snapshot {
            as_of: self.next_id.get(&w).and_then(|n| n.checked_sub(1)).map(EventId),
            tiers: [0, 1, 2].map(|i| t[i].iter().map(meta).collect()),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn the_index_answers_like_the_model(ops in proptest::collection::vec(op(), 1..60)) {
        let mut index = PrefixIndex::new();
        let mut model = Model::default();
        for w in 0..WORKERS {
            model.tiers.insert(w, Default::default());
            index.replace(WorkerId(w), &model.snapshot(w));
        }
        for op in ops {
            let (w, event) = match op {
                Op::Store(w, t, b) => (w, KvEvent::Stored {
                    tier: t,
                    parent: None,
                    blocks: b.iter().map(|i| (SeqHash(1000 + i), LocalHash(*i))).collect(),
                }),
                Op::Remove(w, t, b) => (w, KvEvent::Removed { tier: t, seqs: b.iter().map(|i| SeqHash(1000 + i)).collect() }),
                Op::Clear(w, t) => (w, KvEvent::Cleared { tier: t }),
                Op::Resync(w) => {
                    model.tiers.entry(w).or_default();
                    index.replace(WorkerId(w), &model.snapshot(w));
                    continue;
                }
                Op::Vanish(w) => {
                    model.tiers.remove(&w);
                    model.next_id.remove(&w);
                    index.remove_worker(WorkerId(w));
                    continue;
                }
            };
            let Some(tiers) = model.tiers.get_mut(&w) else {
                // A vanished worker's late event is refused.
                prop_assert_eq!(index.apply(WorkerId(w), EventId(0), &event), Err(ApplyError::UnknownWorker));
                continue;
            };
            match &event {
                KvEvent::Stored { tier, blocks, .. } => blocks.iter().for_each(|(h, _)| { tiers[tier.index()].insert(h.0); }),
                KvEvent::Removed { tier, seqs } => seqs.iter().for_each(|h| { tiers[tier.index()].remove(&h.0); }),
                KvEvent::Cleared { tier: Some(t) } => tiers[t.index()].clear(),
                KvEvent::Cleared { tier: None } => tiers.iter_mut().for_each(BTreeSet::clear),
            }
            let id = model.next_id.entry(w).or_insert(0);
            prop_assert_eq!(index.apply(WorkerId(w), EventId(*id), &event), Ok(()));
            // A repeat is ignored.
            prop_assert_eq!(index.apply(WorkerId(w), EventId(*id), &event), Ok(()));
            *id += 1;

            let got = index.overlap(&chain());
            for w in 0..WORKERS {
                prop_assert_eq!(got.get(&WorkerId(w)).copied(), model.overlap(w), "worker {}", w);
            }
            let all: BTreeSet<u64> = model.tiers.values().flat_map(|t| t.iter().flatten().copied()).collect();
            prop_assert_eq!(index.len(), all.len());
        }
    }
}

#[test]
fn a_gap_is_reported_with_where_to_resume() {
    let mut index = PrefixIndex::new();
    let w = WorkerId(1);
    index.replace(w, &Snapshot { as_of: Some(EventId(9)), tiers: Default::default() });
    let e = KvEvent::Cleared { tier: None };
    assert_eq!(index.apply(w, EventId(12), &e), Err(ApplyError::Gap { expected: 10, got: 12 }));
    assert_eq!(index.last_event(w), Some(EventId(9)));
    assert_eq!(index.stats().gaps, 1);
    assert_eq!(index.apply(w, EventId(10), &e), Ok(()));
    assert_eq!(index.last_event(w), Some(EventId(10)));
}

#[test]
fn orphans_are_applied_and_counted() {
    let mut index = PrefixIndex::new();
    let w = WorkerId(0);
    index.replace(w, &Snapshot { as_of: None, tiers: Default::default() });
    let e = KvEvent::Stored { tier: Tier::Device, parent: Some(SeqHash(5)), blocks: vec![(SeqHash(6), LocalHash(6))] };
    index.apply(w, EventId(0), &e).expect("applies");
    assert_eq!(index.stats().orphans, 1);
    assert_eq!(index.overlap(&[SeqHash(6)]).get(&w), Some(&Overlap { device: 1, host: 0, disk: 0 }));
}
