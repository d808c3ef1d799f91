//! One workload for both indexers: the Mooncake conversation trace's prompts as engine blocks of 16 tokens (each
//! 512-token trace block expanded to 32 blocks of deterministic tokens, hashed with Tandem's real block hashing),
//! each request placed on a worker (mostly by its first block, as a cache-aware router would), and every worker
//! storing the blocks of each prompt it does not hold yet: the stored-block events. Each request's whole chain is a
//! query. Device tier only: Dynamo's radix tree indexes one tier.

use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData, KvCacheStoredBlockData,
    LocalBlockHash, RouterEvent,
};
use dynamo_kv_router::radix_tree::RadixTree;
use kv_cache::events::{EventId, KvEvent, Snapshot, Tier};
use kv_cache::{BlockSize, LocalHash, SeqHash};
use kv_index::{PrefixIndex, WorkerId};

/// Tokens per trace block id in Mooncake traces.
const TRACE_BLOCK: usize = 512;
const BLOCK: usize = 16;

/// One prompt: its blocks' local and chained hashes.
#[derive(Clone, Debug)]
pub struct Prompt {
    pub local: Vec<LocalHash>,
    pub seq: Vec<SeqHash>,
}

/// The events and queries of a trace on `workers` workers.
pub struct Workload {
    pub workers: u32,
    /// (worker, event id, first block of the run, stored blocks) per stored-block event.
    pub events: Vec<(u32, u64, usize, usize)>,
    pub prompts: Vec<Prompt>,
    /// Which prompt each event stores blocks of.
    pub event_prompt: Vec<usize>,
    pub stored_blocks: usize,
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The prompts of a Mooncake-format JSONL trace (`input_length`, `hash_ids`), at most `limit`.
pub fn read_trace(text: &str, limit: usize) -> Vec<Prompt> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()).take(limit) {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let input = v["input_length"].as_u64().unwrap_or(0) as usize;
        let ids: Vec<u64> =
            v["hash_ids"].as_array().map(|a| a.iter().filter_map(|x| x.as_u64()).collect()).unwrap_or_default();
        let full = (input / BLOCK).min(ids.len() * (TRACE_BLOCK / BLOCK));
        let mut tokens = Vec::with_capacity(full * BLOCK);
        for b in 0..full {
            let id = ids[b / (TRACE_BLOCK / BLOCK)];
            let seed = splitmix(id.wrapping_mul(64).wrapping_add((b % (TRACE_BLOCK / BLOCK)) as u64));
            tokens.extend((0..BLOCK as u64).map(|t| (splitmix(seed ^ t) % 49_152) as u32));
        }
        let h = kv_cache::block_hashes(&tokens, BlockSize::DEFAULT, None);
        out.push(Prompt { local: h.local, seq: h.seq });
    }
    out
}

impl Workload {
    /// Places each prompt on a worker (by its first block 80% of the time, else at random, reproducibly) and
    /// lists the blocks each worker has to store.
    pub fn new(prompts: Vec<Prompt>, workers: u32) -> Workload {
        let mut held: Vec<std::collections::HashSet<u64>> = vec![Default::default(); workers as usize];
        let mut next_id = vec![0u64; workers as usize];
        let (mut events, mut event_prompt, mut stored_blocks) = (Vec::new(), Vec::new(), 0);
        for (i, p) in prompts.iter().enumerate() {
            let Some(first) = p.seq.first() else { continue };
            let r = splitmix(i as u64 ^ 0xA5A5);
            let w = if r % 10 < 8 { splitmix(first.0) % workers as u64 } else { (r >> 8) % workers as u64 } as usize;
            let have = p.seq.iter().take_while(|h| held[w].contains(&h.0)).count();
            if have == p.seq.len() {
                continue;
            }
            held[w].extend(p.seq[have..].iter().map(|h| h.0));
            events.push((w as u32, next_id[w], have, p.seq.len() - have));
            event_prompt.push(i);
            next_id[w] += 1;
            stored_blocks += p.seq.len() - have;
        }
        Workload { workers, events, prompts, event_prompt, stored_blocks }
    }

    /// Tandem's events, in order.
    pub fn tandem_events(&self) -> Vec<(WorkerId, EventId, KvEvent)> {
        self.events
            .iter()
            .zip(&self.event_prompt)
            .map(|(&(w, id, from, n), &p)| {
                let prompt = &self.prompts[p];
                let blocks = (from..from + n).map(|b| (prompt.seq[b], prompt.local[b])).collect();
                let parent = from.checked_sub(1).map(|b| prompt.seq[b]);
                (WorkerId(w), EventId(id), KvEvent::Stored { tier: Tier::Device, parent, blocks })
            })
            .collect()
    }

    /// Dynamo's events, in order.
    pub fn dynamo_events(&self) -> Vec<RouterEvent> {
        self.events
            .iter()
            .zip(&self.event_prompt)
            .map(|(&(w, id, from, n), &p)| {
                let prompt = &self.prompts[p];
                let blocks = (from..from + n)
                    .map(|b| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(prompt.seq[b].0),
                        tokens_hash: LocalBlockHash(prompt.local[b].0),
                        mm_extra_info: None,
                    })
                    .collect();
                let parent_hash = from.checked_sub(1).map(|b| ExternalSequenceBlockHash(prompt.seq[b].0));
                let data = KvCacheEventData::Stored(KvCacheStoreData { parent_hash, start_position: None, blocks });
                RouterEvent::new(u64::from(w), KvCacheEvent { event_id: id, data, dp_rank: 0 })
            })
            .collect()
    }

    /// Tandem's index with every worker registered and nothing stored.
    pub fn empty_tandem(&self) -> PrefixIndex {
        let mut index = PrefixIndex::new();
        for w in 0..self.workers {
            index.replace(WorkerId(w), &Snapshot { as_of: None, tiers: Default::default() });
        }
        index
    }

    /// Queries for Dynamo: each prompt's local hashes.
    pub fn dynamo_queries(&self) -> Vec<Vec<LocalBlockHash>> {
        self.prompts.iter().map(|p| p.local.iter().map(|h| LocalBlockHash(h.0)).collect()).collect()
    }
}

/// Both indexers after every event.
pub fn build(w: &Workload) -> (PrefixIndex, RadixTree) {
    let mut ours = w.empty_tandem();
    for (worker, id, e) in w.tandem_events() {
        ours.apply(worker, id, &e).expect("in order");
    }
    let mut theirs = RadixTree::new();
    for e in w.dynamo_events() {
        theirs.apply_event(e).expect("applies");
    }
    (ours, theirs)
}

/// Prompts whose answers differ: per worker, Tandem's device overlap against Dynamo's score.
pub fn disagreements(w: &Workload, ours: &PrefixIndex, theirs: &RadixTree) -> usize {
    let queries = w.dynamo_queries();
    w.prompts
        .iter()
        .zip(queries)
        .filter(|(p, q)| {
            let a = ours.overlap(&p.seq);
            let b = theirs.find_matches(q.clone(), false);
            let mut mine: Vec<(u64, u32)> = a.iter().map(|(id, o)| (u64::from(id.0), o.device as u32)).collect();
            let mut other: Vec<(u64, u32)> = b.scores.iter().map(|(k, v)| (k.worker_id, *v)).collect();
            mine.retain(|x| x.1 > 0);
            mine.sort_unstable();
            other.sort_unstable();
            mine != other
        })
        .count()
}
