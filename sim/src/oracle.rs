//! Reference points for prefill work: the prompt tokens a cluster must compute if its whole cache were one pool.
//!
//! Each request, in arrival order, asks for its prompt's full blocks; a block found in the pool saves its tokens
//! (only blocks before the prompt's last token count: one token is always computed), and after the request every
//! full block of its prompt is in the pool. Three pools: an infinite one (the trace's own reuse), one of the
//! cluster's total capacity evicting the least recently used block (leaves first: a prompt's blocks are touched
//! last-to-first, so a prefix outlives its extensions), and one of the same capacity evicting the block whose next
//! use is farthest away (Belady's rule, which may also decline to keep a block used later than everything held; a
//! block that its next request computes anyway counts as never used, since that request brings it back for free).
//! The Belady figure equals an exhaustive search over every eviction choice on small traces (tested).
//! Hits are counted per block, so the Belady figure is a lower bound on prefill work at that capacity for any
//! placement and eviction: a real engine, which needs a block's whole prefix, can only compute more.

use std::collections::{BTreeMap, BTreeSet};

use kv_cache::SeqHash;
use kv_cache::fastmap::{FastMap, FastSet};

/// One request as the references see it: its prompt length and the hashes of its full blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prompt {
    pub tokens: usize,
    pub blocks: Vec<SeqHash>,
}

/// Prompt tokens computed under each reference pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct References {
    pub infinite_cache_prefill_tokens: u64,
    pub pooled_lru_prefill_tokens: u64,
    pub belady_prefill_tokens: u64,
    /// The pooled references' capacity in blocks.
    pub capacity_blocks: u64,
}

/// The references for `prompts` (in arrival order) with blocks of `block_size` tokens and a pool of `capacity`
/// blocks.
pub fn references(prompts: &[Prompt], block_size: usize, capacity: usize) -> References {
    References {
        infinite_cache_prefill_tokens: infinite(prompts, block_size),
        pooled_lru_prefill_tokens: lru(prompts, block_size, capacity),
        belady_prefill_tokens: belady(prompts, block_size, capacity),
        capacity_blocks: capacity as u64,
    }
}

/// Full blocks whose hit saves work: those before the prompt's last token.
fn reusable(p: &Prompt, block_size: usize) -> usize {
    (p.tokens.saturating_sub(1) / block_size.max(1)).min(p.blocks.len())
}

/// Tokens computed for `p` when `hits` of its reusable blocks were found.
fn computed(p: &Prompt, block_size: usize, hits: usize) -> u64 {
    (p.tokens - hits * block_size) as u64
}

fn infinite(prompts: &[Prompt], block_size: usize) -> u64 {
    let mut seen: FastSet<SeqHash> = FastSet::default();
    let mut total = 0;
    for p in prompts {
        let hits = p.blocks[..reusable(p, block_size)].iter().filter(|h| seen.contains(h)).count();
        total += computed(p, block_size, hits);
        seen.extend(p.blocks.iter().copied());
    }
    total
}

fn lru(prompts: &[Prompt], block_size: usize, capacity: usize) -> u64 {
    let mut tick_of: FastMap<SeqHash, u64> = FastMap::default();
    let mut by_tick: BTreeMap<u64, SeqHash> = BTreeMap::new();
    let mut tick = 0u64;
    let mut total = 0;
    for p in prompts {
        let hits = p.blocks[..reusable(p, block_size)].iter().filter(|h| tick_of.contains_key(h)).count();
        total += computed(p, block_size, hits);
        for &h in p.blocks.iter().rev() {
            if let Some(old) = tick_of.insert(h, tick) {
                by_tick.remove(&old);
            } else if tick_of.len() > capacity {
                // The block just added is the newest: the oldest one goes.
                if let Some((_, victim)) = by_tick.pop_first() {
                    tick_of.remove(&victim);
                }
            }
            by_tick.insert(tick, h);
            tick += 1;
        }
        // A zero-capacity pool keeps nothing.
        if capacity == 0 {
            tick_of.clear();
            by_tick.clear();
        }
    }
    total
}

fn belady(prompts: &[Prompt], block_size: usize, capacity: usize) -> u64 {
    // For each access (in order), when the block is next needed: the next request that asks for it, if that
    // request's hit on it saves work; never, if the next request asking for it computes it anyway (the prompt's
    // last full block) or nobody asks again, since then it can be taken in again for free. A request's hits are
    // settled when it arrives, so within one request every block is next needed by a later one.
    let mut next: Vec<usize> = Vec::with_capacity(prompts.iter().map(|p| p.blocks.len()).sum());
    let mut later: FastMap<SeqHash, usize> = FastMap::default();
    for (r, p) in prompts.iter().enumerate().rev() {
        for h in p.blocks.iter().rev() {
            next.push(later.get(h).copied().unwrap_or(usize::MAX));
        }
        let saves = reusable(p, block_size);
        for (k, h) in p.blocks.iter().enumerate() {
            later.insert(*h, if k < saves { r } else { usize::MAX });
        }
    }
    next.reverse();
    let mut next_of: FastMap<SeqHash, usize> = FastMap::default();
    let mut by_next: BTreeSet<(usize, SeqHash)> = BTreeSet::new();
    let mut total = 0;
    let mut at = 0;
    for p in prompts {
        let hits = p.blocks[..reusable(p, block_size)].iter().filter(|h| next_of.contains_key(h)).count();
        total += computed(p, block_size, hits);
        let nexts = &next[at..at + p.blocks.len()];
        at += p.blocks.len();
        // First what is held moves on to its next use (this request's are settled), then the rest may come in.
        for (&h, &n) in p.blocks.iter().zip(nexts) {
            if let Some(old) = next_of.remove(&h) {
                by_next.remove(&(old, h));
                if n != usize::MAX {
                    next_of.insert(h, n);
                    by_next.insert((n, h));
                }
            }
        }
        for (&h, &n) in p.blocks.iter().zip(nexts) {
            if n == usize::MAX || next_of.contains_key(&h) {
                continue;
            }
            if next_of.len() >= capacity {
                // Full: keep this block only if it is needed sooner than the farthest one held.
                match by_next.last().copied() {
                    Some((far, victim)) if far > n => {
                        by_next.remove(&(far, victim));
                        next_of.remove(&victim);
                    }
                    _ => continue,
                }
            }
            next_of.insert(h, n);
            by_next.insert((n, h));
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const BS: usize = 2;

    fn prompts(raw: &[(Vec<u64>, usize)]) -> Vec<Prompt> {
        raw.iter()
            .map(|(ids, extra)| {
                // A prompt's chained hashes never repeat.
                let mut blocks: Vec<SeqHash> = Vec::new();
                for &i in ids {
                    if !blocks.contains(&SeqHash(i)) {
                        blocks.push(SeqHash(i));
                    }
                }
                Prompt { tokens: blocks.len() * BS + extra, blocks }
            })
            .collect()
    }

    fn work(ps: &[Prompt], saved_blocks: usize) -> u64 {
        ps.iter().map(|p| p.tokens as u64).sum::<u64>() - (saved_blocks * BS) as u64
    }

    /// LRU by linear scans: a list of blocks, most recent last.
    fn naive_lru(ps: &[Prompt], capacity: usize) -> u64 {
        let mut pool: Vec<SeqHash> = Vec::new();
        let mut saved = 0;
        for p in ps {
            saved += p.blocks[..reusable(p, BS)].iter().filter(|h| pool.contains(h)).count();
            for h in p.blocks.iter().rev() {
                pool.retain(|x| x != h);
                pool.push(*h);
                if pool.len() > capacity {
                    pool.remove(0);
                }
            }
        }
        work(ps, saved)
    }

    /// The best any eviction can do: at every miss, every choice (keep nothing, or keep the block and drop any
    /// one held); a request's hits are what the pool held when it arrived.
    fn optimal(ps: &[Prompt], capacity: usize) -> u64 {
        fn request(ps: &[Prompt], r: usize, pool: &mut Vec<SeqHash>, cap: usize) -> usize {
            let Some(p) = ps.get(r) else { return 0 };
            let saved = p.blocks[..reusable(p, BS)].iter().filter(|h| pool.contains(h)).count();
            saved + block(ps, r, 0, pool, cap)
        }
        fn block(ps: &[Prompt], r: usize, k: usize, pool: &mut Vec<SeqHash>, cap: usize) -> usize {
            let Some(&h) = ps[r].blocks.get(k) else { return request(ps, r + 1, pool, cap) };
            if pool.contains(&h) {
                return block(ps, r, k + 1, pool, cap);
            }
            let mut best = block(ps, r, k + 1, pool, cap);
            if pool.len() < cap {
                pool.push(h);
                best = best.max(block(ps, r, k + 1, pool, cap));
                pool.pop();
            } else {
                for i in 0..pool.len() {
                    let old = std::mem::replace(&mut pool[i], h);
                    best = best.max(block(ps, r, k + 1, pool, cap));
                    pool[i] = old;
                }
            }
            best
        }
        work(ps, request(ps, 0, &mut Vec::new(), capacity))
    }

    fn trace() -> impl Strategy<Value = Vec<(Vec<u64>, usize)>> {
        proptest::collection::vec((proptest::collection::vec(0u64..5, 1..4), 0usize..BS), 1..5)
    }

    proptest! {
        #[test]
        fn each_reference_equals_its_brute_force_count(raw in trace(), capacity in 0usize..4) {
            let ps = prompts(&raw);
            let r = references(&ps, BS, capacity);
            // Infinite: a block saves work when any earlier request had it.
            let mut seen: Vec<SeqHash> = Vec::new();
            let mut saved = 0;
            for p in &ps {
                saved += p.blocks[..reusable(p, BS)].iter().filter(|h| seen.contains(h)).count();
                seen.extend(&p.blocks);
            }
            prop_assert_eq!(r.infinite_cache_prefill_tokens, work(&ps, saved));
            prop_assert_eq!(r.pooled_lru_prefill_tokens, naive_lru(&ps, capacity));
            let best = optimal(&ps, capacity);
            prop_assert!(r.belady_prefill_tokens <= r.pooled_lru_prefill_tokens);
            prop_assert!(r.infinite_cache_prefill_tokens <= r.belady_prefill_tokens);
            prop_assert_eq!(r.belady_prefill_tokens, best);
        }
    }
}
