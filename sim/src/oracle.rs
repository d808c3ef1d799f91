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
use kv_cache::fastmap::FastMap;

/// One request as the references see it: its prompt length and the chained hashes of its full blocks (as
/// `kv_cache::block_hashes` makes them: equal hashes stand for equal prefixes, which the numbering relies on).
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
    /// Numbers the blocks through the prompts' shared prefixes instead of looking up each block: a chained hash
    /// names its whole prefix, so a prompt's blocks seen before are exactly its longest prefix shared with an
    /// earlier prompt, which has the same numbers there, and every block after that prefix is new. So a prompt's
    /// numbers are a copy of an earlier prompt's leading numbers followed by fresh ones, and the only search is for
    /// that prefix, in a trie of the prompts ([`Prefixes`]). (A map of the whole trace's millions of distinct blocks
    /// missed the cache about twice per block; spreading the blocks into small groups first still took 0.4 s of a
    /// 6 s run.)
    fn number(prompts: &[Prompt]) -> Blocks {
        let total: usize = prompts.iter().map(|p| p.blocks.len()).sum();
        let mut ids: Vec<u32> = Vec::with_capacity(total);
        let mut starts = Vec::with_capacity(prompts.len() + 1);
        let mut trie = Prefixes::new();
        let mut distinct = 0u32;
        for r in 0..prompts.len() {
            starts.push(ids.len());
            let (shared, from) = trie.insert(prompts, r);
            let at = starts[from];
            ids.extend_from_within(at..at + shared);
            let new = (prompts[r].blocks.len() - shared) as u32;
            ids.extend(distinct..distinct + new);
            distinct += new;
        }
        starts.push(ids.len());
        Blocks { ids, starts, distinct: distinct as usize }
    }

    fn of(&self, request: usize) -> &[u32] {
        &self.ids[self.starts[request]..self.starts[request + 1]]
    }
}

/// A compressed trie of the prompts' block chains, each edge a stretch of one prompt's blocks: where a new prompt
/// leaves it is its longest prefix shared with any earlier prompt. Branches are few (a trace's prompts share a few
/// system prompts and conversations), so a walk takes a handful of lookups and compares blocks in memory order.
struct Prefixes {
    /// Node 0 is the root (the empty prefix); every other node ends an edge.
    edges: Vec<Edge>,
    /// (node, first block of a child's edge) → the child.
    children: FastMap<(u32, u64), u32>,
}

/// Blocks of prompt `prompt` up to `end`, from where the parent's edge ends.
#[derive(Clone, Copy)]
struct Edge {
    prompt: u32,
    end: u32,
}

impl Prefixes {
    fn new() -> Prefixes {
        Prefixes { edges: vec![Edge { prompt: 0, end: 0 }], children: FastMap::default() }
    }

    /// Adds prompt `r` (after every earlier one): how many of its leading blocks an earlier prompt has, and a
    /// prompt that has them (`r` itself when none).
    fn insert(&mut self, prompts: &[Prompt], r: usize) -> (usize, usize) {
        let blocks = &prompts[r].blocks;
        let (mut node, mut at, mut from) = (0u32, 0usize, r);
        while let Some(&child) = blocks.get(at).and_then(|h| self.children.get(&(node, h.0))) {
            let e = self.edges[child as usize];
            let theirs = &prompts[e.prompt as usize].blocks[at..e.end as usize];
            let same = theirs.iter().zip(&blocks[at..]).take_while(|(a, b)| a == b).count();
            from = e.prompt as usize;
            at += same;
            if at < e.end as usize {
                if at < blocks.len() {
                    // The prompt leaves this edge part of the way: the shared part becomes an edge of its own.
                    let mid = self.edges.len() as u32;
                    self.edges.push(Edge { end: at as u32, ..e });
                    self.children.insert((node, theirs[0].0), mid);
                    self.children.insert((mid, theirs[same].0), child);
                    node = mid;
                }
                break;
            }
            node = child;
        }
        if at < blocks.len() {
            let leaf = self.edges.len() as u32;
            self.edges.push(Edge { prompt: r as u32, end: blocks.len() as u32 });
            self.children.insert((node, blocks[at].0), leaf);
        }
        (at, from)
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

    /// Chained hashes of blocks whose own contents are `locals`: prompts that start with the same ids share
    /// those blocks, and only those.
    fn chain(locals: &[u64]) -> Vec<SeqHash> {
        let mut blocks: Vec<SeqHash> = Vec::with_capacity(locals.len());
        for &l in locals {
            blocks.push(kv_cache::chained(blocks.last().copied(), kv_cache::LocalHash(l)));
        }
        blocks
    }

    fn prompts(raw: &[(Vec<u64>, usize)]) -> Vec<Prompt> {
        raw.iter().map(|(ids, extra)| Prompt { tokens: ids.len() * BS + extra, blocks: chain(ids) }).collect()
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
    fn numbering_gives_equal_hashes_one_number_in_order_of_first_appearance() {
        // Conversations that branch: each prompt continues an earlier one (or starts from one of a few system
        // prompts) for a while, then goes its own way; some end inside an earlier prompt, some repeat one whole.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut draw = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let mut locals: Vec<Vec<u64>> = (0..4).map(|s| vec![s; 3]).collect();
        for _ in 0..2_000 {
            let base = locals[draw(locals.len() as u64) as usize].clone();
            let keep = draw(base.len() as u64 + 1) as usize;
            let mut next = base[..keep].to_vec();
            next.extend((0..draw(40)).map(|_| draw(1 << 40)));
            locals.push(next);
        }
        let ps: Vec<Prompt> = locals
            .iter()
            .filter(|l| !l.is_empty())
            .map(|l| Prompt { tokens: l.len() * BS, blocks: chain(l) })
            .collect();
        let blocks = Blocks::number(&ps);
        // The plain way: a map in order of first appearance.
        let mut first: std::collections::HashMap<SeqHash, u32> = std::collections::HashMap::new();
        let want: Vec<u32> = ps
            .iter()
            .flat_map(|p| &p.blocks)
            .map(|h| {
                let n = first.len() as u32;
                *first.entry(*h).or_insert(n)
            })
            .collect();
        assert_eq!(blocks.ids, want);
        assert_eq!(blocks.distinct, first.len());
        assert!(4 * blocks.distinct < 3 * want.len(), "the prompts share much: {} of {}", blocks.distinct, want.len());
        for (r, p) in ps.iter().enumerate() {
            assert_eq!(blocks.of(r).len(), p.blocks.len());
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
