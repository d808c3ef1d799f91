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

use std::collections::BinaryHeap;

use kv_cache::SeqHash;
use kv_cache::probemap::ProbeMap;

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
    let blocks = Blocks::number(prompts);
    References {
        infinite_cache_prefill_tokens: infinite(prompts, &blocks, block_size),
        pooled_lru_prefill_tokens: lru(prompts, &blocks, block_size, capacity),
        belady_prefill_tokens: belady(prompts, &blocks, block_size, capacity),
        capacity_blocks: capacity as u64,
    }
}

/// Every prompt's blocks as small numbers (0, 1, 2, … in order of first appearance): the three pools then keep
/// their state in arrays indexed by block, hashing each block hash once in all instead of several times per pool.
struct Blocks {
    /// Every prompt's block numbers, one prompt after the other.
    ids: Vec<u32>,
    /// Where each prompt's numbers start in `ids`, and the end.
    starts: Vec<usize>,
    distinct: usize,
}

impl Blocks {
    /// Numbers the blocks without one table over all of them: a whole trace holds millions of distinct blocks, and
    /// looking each up in a map that size missed the cache about twice per block (1.1 s of a 12.5 s run on a 32 MiB
    /// cache; about 0.4 s this way). The hashes, with where they stand, are first spread into groups by their top bits,
    /// each group small enough that a [`ProbeMap`] of its own stays in cache.
    fn number(prompts: &[Prompt]) -> Blocks {
        let total: usize = prompts.iter().map(|p| p.blocks.len()).sum();
        let mut starts = Vec::with_capacity(prompts.len() + 1);
        let mut at = 0;
        for p in prompts {
            starts.push(at);
            at += p.blocks.len();
        }
        starts.push(at);
        // About four thousand hashes a group: a table of 128 KiB.
        let bits = (total / 4096).max(1).next_power_of_two().trailing_zeros().min(16);
        let group = |h: SeqHash| if bits == 0 { 0 } else { (h.0 >> (64 - bits)) as usize };
        let mut ends = vec![0usize; (1 << bits) + 1];
        for h in prompts.iter().flat_map(|p| &p.blocks) {
            ends[group(*h) + 1] += 1;
        }
        for g in 1..ends.len() {
            ends[g] += ends[g - 1];
        }
        let mut fill = ends.clone();
        let mut pairs: Vec<(u64, u32)> = vec![(0, 0); total];
        for (k, h) in prompts.iter().flat_map(|p| &p.blocks).enumerate() {
            let slot = &mut fill[group(*h)];
            pairs[*slot] = (h.0, k as u32);
            *slot += 1;
        }
        // Each group in turn: a hash's first place in the trace (a group holds its hashes in trace order), marked
        // in a bit per place, and every pair pointed at its hash's first place.
        let mut firsts = vec![0u64; total.div_ceil(64)];
        for g in 0..1 << bits {
            let pairs = &mut pairs[ends[g]..ends[g + 1]];
            let mut seen = ProbeMap::with_capacity(pairs.len());
            for pair in pairs.iter_mut() {
                let (h, k) = *pair;
                pair.0 = match seen.insert_new(SeqHash(h), u64::from(k)) {
                    Ok(()) => {
                        firsts[k as usize / 64] |= 1 << (k % 64);
                        u64::from(k)
                    }
                    Err(first) => first,
                };
            }
        }
        // A block's number is how many first places come before its hash's: numbers in order of first appearance,
        // so a prompt's new blocks get neighbouring numbers and the pools' arrays are walked in order.
        let mut before = Vec::with_capacity(firsts.len());
        let mut distinct = 0u32;
        for word in &firsts {
            before.push(distinct);
            distinct += word.count_ones();
        }
        let mut ids = vec![0u32; total];
        for &(first, k) in &pairs {
            let (word, bit) = (first as usize / 64, first % 64);
            ids[k as usize] = before[word] + (firsts[word] & ((1u64 << bit) - 1)).count_ones();
        }
        Blocks { ids, starts, distinct: distinct as usize }
    }

    fn of(&self, request: usize) -> &[u32] {
        &self.ids[self.starts[request]..self.starts[request + 1]]
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

fn infinite(prompts: &[Prompt], blocks: &Blocks, block_size: usize) -> u64 {
    let mut seen = vec![false; blocks.distinct];
    let mut total = 0;
    for (r, p) in prompts.iter().enumerate() {
        let ids = blocks.of(r);
        let hits = ids[..reusable(p, block_size)].iter().filter(|&&b| seen[b as usize]).count();
        total += computed(p, block_size, hits);
        for &b in ids {
            seen[b as usize] = true;
        }
    }
    total
}

/// No block: the end of the LRU list, or not in it.
const NONE: u32 = u32::MAX;

/// The pooled LRU: a list threaded through the block numbers, least recently used first.
struct LruList {
    prev: Vec<u32>,
    next: Vec<u32>,
    held: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl LruList {
    fn new(distinct: usize) -> LruList {
        LruList {
            prev: vec![NONE; distinct],
            next: vec![NONE; distinct],
            held: vec![false; distinct],
            head: NONE,
            tail: NONE,
            len: 0,
        }
    }

    fn unlink(&mut self, b: u32) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        match p {
            NONE => self.head = n,
            p => self.next[p as usize] = n,
        }
        match n {
            NONE => self.tail = p,
            n => self.prev[n as usize] = p,
        }
        self.held[b as usize] = false;
        self.len -= 1;
    }

    /// Makes `b` the most recently used block, taking it in if it was not held.
    fn touch(&mut self, b: u32) {
        if self.held[b as usize] {
            self.unlink(b);
        }
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NONE;
        match self.tail {
            NONE => self.head = b,
            t => self.next[t as usize] = b,
        }
        self.tail = b;
        self.held[b as usize] = true;
        self.len += 1;
    }
}

fn lru(prompts: &[Prompt], blocks: &Blocks, block_size: usize, capacity: usize) -> u64 {
    let mut list = LruList::new(blocks.distinct);
    let mut total = 0;
    for (r, p) in prompts.iter().enumerate() {
        let ids = blocks.of(r);
        let hits = ids[..reusable(p, block_size)].iter().filter(|&&b| list.held[b as usize]).count();
        total += computed(p, block_size, hits);
        // A zero-capacity pool keeps nothing.
        if capacity == 0 {
            continue;
        }
        for &b in ids.iter().rev() {
            list.touch(b);
            if list.len > capacity {
                // The block just touched is the newest (and not alone): the oldest one goes.
                list.unlink(list.head);
            }
        }
    }
    total
}

/// A held block and when it is next needed, ordered by that (then by block): the farthest is the heap's top.
fn entry(next: u32, b: u32) -> u64 {
    (u64::from(next) << 32) | u64::from(b)
}

fn belady(prompts: &[Prompt], blocks: &Blocks, block_size: usize, capacity: usize) -> u64 {
    // For each access (in order), when the block is next needed: the next request that asks for it, if that
    // request's hit on it saves work; never, if the next request asking for it computes it anyway (the prompt's
    // last full block) or nobody asks again, since then it can be taken in again for free. A request's hits are
    // settled when it arrives, so within one request every block is next needed by a later one.
    let mut next: Vec<u32> = vec![NONE; blocks.ids.len()];
    let mut later: Vec<u32> = vec![NONE; blocks.distinct];
    for (r, p) in prompts.iter().enumerate().rev() {
        let start = blocks.starts[r];
        let ids = blocks.of(r);
        for (k, &b) in ids.iter().enumerate() {
            next[start + k] = later[b as usize];
        }
        let saves = reusable(p, block_size);
        for (k, &b) in ids.iter().enumerate() {
            later[b as usize] = if k < saves { r as u32 } else { NONE };
        }
    }
    // Per block, its next use while held (NONE: not held); the heap holds an entry for every held block at its
    // current next use, and stale entries (a block since dropped or moved on) that are skipped when they surface.
    let mut next_of: Vec<u32> = vec![NONE; blocks.distinct];
    let mut held = 0usize;
    let mut by_next: BinaryHeap<u64> = BinaryHeap::new();
    let current = |next_of: &[u32], e: u64| next_of[(e & 0xffff_ffff) as usize] == (e >> 32) as u32;
    let mut total = 0;
    for (r, p) in prompts.iter().enumerate() {
        let ids = blocks.of(r);
        let hits = ids[..reusable(p, block_size)].iter().filter(|&&b| next_of[b as usize] != NONE).count();
        total += computed(p, block_size, hits);
        let nexts = &next[blocks.starts[r]..blocks.starts[r + 1]];
        // First what is held moves on to its next use (this request's are settled), then the rest may come in.
        for (&b, &n) in ids.iter().zip(nexts) {
            if next_of[b as usize] != NONE {
                next_of[b as usize] = n;
                if n == NONE {
                    held -= 1;
                } else {
                    by_next.push(entry(n, b));
                }
            }
        }
        for (&b, &n) in ids.iter().zip(nexts) {
            if n == NONE || next_of[b as usize] != NONE {
                continue;
            }
            if held >= capacity {
                // Full: keep this block only if it is needed sooner than the farthest one held.
                while by_next.peek().is_some_and(|&e| !current(&next_of, e)) {
                    by_next.pop();
                }
                match by_next.peek().copied() {
                    Some(e) if (e >> 32) as u32 > n => {
                        by_next.pop();
                        next_of[(e & 0xffff_ffff) as usize] = NONE;
                        held -= 1;
                    }
                    _ => continue,
                }
            }
            next_of[b as usize] = n;
            held += 1;
            by_next.push(entry(n, b));
        }
        // Stale entries never outnumber the live ones for long.
        if by_next.len() > 2 * held + 4096 {
            by_next.retain(|&e| current(&next_of, e));
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

    #[test]
    fn numbering_spread_over_many_groups_gives_equal_hashes_one_number_and_others_their_own() {
        // Enough blocks for dozens of groups, hashes spread over all 64 bits, each reused a few times.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut draw = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let pool: Vec<u64> = (0..40_000).map(|_| draw()).collect();
        let ps: Vec<Prompt> = (0..300)
            .map(|_| {
                let blocks: Vec<SeqHash> = (0..500).map(|_| SeqHash(pool[(draw() % 40_000) as usize])).collect();
                Prompt { tokens: blocks.len() * BS, blocks }
            })
            .collect();
        let blocks = Blocks::number(&ps);
        let mut seen = std::collections::HashMap::new();
        let mut used = std::collections::HashSet::new();
        for (h, &id) in ps.iter().flat_map(|p| &p.blocks).zip(&blocks.ids) {
            assert_eq!(*seen.entry(*h).or_insert(id), id, "one hash, one number");
            assert!((id as usize) < blocks.distinct);
            used.insert(id);
        }
        assert_eq!(seen.len(), blocks.distinct);
        assert_eq!(used.len(), blocks.distinct, "two hashes never share a number");
        assert_eq!(blocks.of(299).len(), 500);
        // Numbered in order of first appearance: each new hash takes the next number.
        let mut next = 0;
        for &id in &blocks.ids {
            assert!(id <= next, "number {id} before {next}");
            next = next.max(id + 1);
        }
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
