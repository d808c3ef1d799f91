//! The index against a naive model: per worker and tier a set of hashes, overlap computed by definition.

use std::collections::{BTreeSet, HashMap};

use kv_cache::events::{BlockMeta, EventId, KvEvent, Snapshot, Tier};
use kv_cache::{LocalHash, SeqHash};
use proptest::prelude::*;

use super::*;

const CHAIN: u64 = 8;
const WORKERS: u32 = 4;

/// The test's blocks, real chained hashes of 4-token blocks: ids 0..8 are one chain (A); ids 8..13 are a second
/// chain (B) that shares A's first three blocks and then branches. Per id: (chained hash, local hash, parent).
fn table() -> Vec<(SeqHash, LocalHash, Option<SeqHash>)> {
    let bs = kv_cache::BlockSize::new(4).expect("4 tokens");
    let a_tokens: Vec<u32> = (0..CHAIN as u32 * 4).collect();
    let mut b_tokens = a_tokens[..12].to_vec();
    b_tokens.extend(500..520);
    let a = kv_cache::block_hashes(&a_tokens, bs, None);
    let b = kv_cache::block_hashes(&b_tokens, bs, None);
    let row = |h: &kv_cache::BlockHashes, i: usize| (h.seq[i], h.local[i], i.checked_sub(1).map(|p| h.seq[p]));
    (0..CHAIN as usize).map(|i| row(&a, i)).chain((3..8).map(|i| row(&b, i))).collect()
}

fn hash(i: u64) -> u64 {
    table()[i as usize].0.0
}

/// Block ids of chain A (`false`) or B (`true`) in order.
fn chain(b: bool) -> Vec<u64> {
    if b { (0..3).chain(CHAIN..CHAIN + 5).collect() } else { (0..CHAIN).collect() }
}

/// The prompts asked about: both chains whole, a prefix, and chains entered in the middle.
fn queries() -> Vec<Vec<u64>> {
    let a: Vec<u64> = chain(false).into_iter().map(hash).collect();
    let b: Vec<u64> = chain(true).into_iter().map(hash).collect();
    vec![a.clone(), b.clone(), a[..4].to_vec(), a[2..].to_vec(), b[3..].to_vec()]
}

#[derive(Clone, Debug)]
enum Op {
    /// Blocks in any order (a confused worker).
    Store(u32, Tier, Vec<u64>),
    /// A stretch of chain A or B, in order after its parent (what engines send): (chain, first, length).
    StoreChain(u32, Tier, bool, usize, usize),
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
    let blocks = proptest::collection::vec(0..CHAIN + 5, 1..6);
    prop_oneof![
        2 => (w.clone(), tier(), blocks.clone()).prop_map(|(w, t, b)| Op::Store(w, t, b)),
        4 => (w.clone(), tier(), any::<bool>(), 0..8usize, 1..8usize).prop_map(|(w, t, c, s, n)| Op::StoreChain(w, t, c, s, n)),
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
    fn overlap(&self, w: u32, query: &[u64]) -> Option<Overlap> {
        let t = self.tiers.get(&w)?;
        let n = query.len();
        let on = |tier: usize, i: usize| t[tier].contains(&query[i]);
        let mut i = 0;
        let mut o = Overlap::default();
        while i < n && on(0, i) {
            o.device += 1;
            i += 1;
        }
        while i < n && on(1, i) {
            o.host += 1;
            i += 1;
        }
        while i < n && on(2, i) {
            o.disk += 1;
            i += 1;
        }
        (o != Overlap::default()).then_some(o)
    }

    fn snapshot(&self, w: u32) -> Snapshot {
        let t = self.tiers.get(&w).cloned().unwrap_or_default();
        let table = table();
        let meta = |h: &u64| {
            let (seq, local, parent) = *table.iter().find(|r| r.0.0 == *h).expect("a test block");
            BlockMeta { seq, local, parent }
        };
        Snapshot {
            as_of: self.next_id.get(&w).and_then(|n| n.checked_sub(1)).map(EventId),
            tiers: [0, 1, 2].map(|i| t[i].iter().map(meta).collect()),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]
    #[test]
    fn the_index_answers_like_the_model(
        ops in proptest::collection::vec(op(), 1..60),
        padding in prop_oneof![Just(0u32), Just(62), Just(130)],
    ) {
        let mut index = PrefixIndex::new();
        // Other workers first, so that the ones under test sit in the first word, across two, or in the third.
        for p in 0..padding {
            index.replace(WorkerId(1000 + p), &Snapshot { as_of: None, tiers: Default::default() });
        }
        let mut model = Model::default();
        let table = table();
        for w in 0..WORKERS {
            model.tiers.insert(w, Default::default());
            index.replace(WorkerId(w), &model.snapshot(w));
        }
        for op in ops {
            let (w, event) = match op {
                Op::Store(w, t, b) => (w, KvEvent::Stored {
                    tier: t,
                    parent: None,
                    blocks: b.iter().map(|i| (table[*i as usize].0, table[*i as usize].1)).collect(),
                }),
                Op::StoreChain(w, t, c, start, len) => {
                    let ids = chain(c);
                    let ids = &ids[start.min(7)..(start + len).min(8)];
                    (w, KvEvent::Stored {
                        tier: t,
                        parent: table[ids[0] as usize].2,
                        blocks: ids.iter().map(|i| (table[*i as usize].0, table[*i as usize].1)).collect(),
                    })
                }
                Op::Remove(w, t, b) => (w, KvEvent::Removed { tier: t, seqs: b.iter().map(|i| SeqHash(hash(*i))).collect() }),
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

            for q in queries() {
                let got = index.overlap(&q.iter().map(|h| SeqHash(*h)).collect::<Vec<_>>());
                for w in 0..WORKERS {
                    prop_assert_eq!(got.get(&WorkerId(w)).copied(), model.overlap(w, &q), "worker {} on {:?}", w, q);
                }
                prop_assert_eq!(got.len(), (0..WORKERS).filter(|&w| model.overlap(w, &q).is_some()).count());
            }
            let all: BTreeSet<u64> = model.tiers.values().flat_map(|t| t.iter().flatten().copied()).collect();
            prop_assert_eq!(index.len(), all.len());
            for w in 0..WORKERS {
                let held = model.tiers.get(&w).map(|t| t.each_ref().map(|s| s.len() as u64));
                prop_assert_eq!(index.held(WorkerId(w)), held, "worker {}'s block counts", w);
            }
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
