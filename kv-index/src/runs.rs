//! The blocks, kept as runs: a run is a stretch of a chain whose blocks all have the same holders, the edge of a
//! compressed radix tree. A map from chained hash to (run, position) finds where a prompt enters; from there, how
//! far the prompt follows the run is a binary search, because a chained hash names its whole prefix: if the
//! prompt's block `j` equals the run's, so do all before it. That only holds if every run is a true chain, so a
//! stored block joins the run before it only when its hashes prove it follows that block (a worker sending blocks
//! out of order gets shorter runs, not wrong answers). The holders are looked at once per run. Changing some
//! blocks' holders splits their run where the change starts and ends.

use kv_cache::pool::ahead;
use kv_cache::probemap::ProbeMap;
use kv_cache::{LocalHash, SeqHash, chained};

use crate::WorkerId;
use crate::holders::Holders;
use crate::overlaps::{Overlaps, Walk};

#[derive(Debug, Default)]
struct Run {
    /// The position (in `Runs::at`) of the run's first block: positions stay put when the run loses its head.
    base: u32,
    /// The run's blocks are `hashes[off..]`: a run that loses its head (evictions take chains from the front)
    /// drops it lazily, compacting once half the vector is dead.
    off: u32,
    hashes: Vec<SeqHash>,
    holders: Holders,
}

impl Run {
    fn live(&self) -> &[SeqHash] {
        &self.hashes[self.off as usize..]
    }

    /// The position after the run's last block.
    fn end(&self) -> u32 {
        self.base + self.live().len() as u32
    }
}

#[derive(Debug, Default)]
pub(crate) struct Runs {
    runs: Vec<Run>,
    /// Ids of emptied runs, for reuse.
    free: Vec<u32>,
    /// Where each block is: its run and its position ([`place`]).
    at: ProbeMap,
    /// Per slot, how many blocks it holds on each tier.
    held: Vec<[u64; 3]>,
}

impl Runs {
    /// Room for `blocks` distinct blocks without growing.
    pub fn with_capacity(blocks: usize) -> Runs {
        Runs { at: ProbeMap::with_capacity(blocks), ..Runs::default() }
    }

    /// Distinct blocks held by anyone.
    pub fn len(&self) -> usize {
        self.at.len()
    }

    /// How many blocks `slot` holds on each tier.
    pub fn held(&self, slot: u32) -> [u64; 3] {
        self.held.get(slot as usize).copied().unwrap_or_default()
    }

    /// Asks for the line where `h` is looked up.
    pub fn prefetch(&self, h: &SeqHash) {
        self.at.prefetch(h);
    }

    pub fn holders(&self, h: &SeqHash) -> Option<&Holders> {
        self.at.get(h).map(unpack).map(|(r, _)| &self.runs[r as usize].holders)
    }

    /// Sets `slot` on `tier` for `blocks` (a worker's stored blocks: chained and local hashes, in chain order
    /// after `parent` when the worker is right).
    pub fn store(&mut self, slot: u32, tier: usize, parent: Option<SeqHash>, blocks: &[(SeqHash, LocalHash)]) {
        let mut i = 0;
        let mut prev = parent;
        let mut single = Holders::default();
        single.set(slot, tier, true);
        while i < blocks.len() {
            if let Some((r, p)) = self.at.get(&blocks[i].0).map(unpack) {
                let run = &self.runs[r as usize];
                let rest = &run.live()[(p - run.base) as usize..];
                let len = rest.iter().zip(&blocks[i..]).take_while(|(a, b)| **a == b.0).count();
                self.change(r, p, len, |h| h.set(slot, tier, true));
                i += len;
                prev = Some(blocks[i - 1].0);
                continue;
            }
            // New blocks, one at a time (a hash repeated within them is found stored the second time), each
            // extending the run of the block before it while it provably follows that block. One map operation
            // per block: the insert says whether the block was there after all.
            let mut open: Option<(u32, u32)> = None;
            let (new, start) = (&blocks[i..], i);
            while let Some(&(h, local)) = blocks.get(i) {
                ahead(new, i - start).iter().for_each(|b| self.at.prefetch(&b.0));
                let follows = prev.is_some_and(|p| chained(Some(p), local) == h);
                let (r, pos) = match open.filter(|_| follows) {
                    Some(at) => at,
                    None => self.open(prev.filter(|_| follows), single.clone()),
                };
                if self.at.insert_new(h, place(r, pos)).is_err() {
                    if self.runs[r as usize].live().is_empty() {
                        self.runs[r as usize] = Run::default();
                        self.free.push(r);
                    }
                    break;
                }
                self.runs[r as usize].hashes.push(h);
                held_by(&mut self.held, slot)[tier] += 1;
                open = Some((r, pos + 1));
                prev = Some(h);
                i += 1;
            }
        }
    }

    /// Clears `slot` on `tier` for `seqs` (in any order; runs of consecutive blocks, either way, go together).
    pub fn remove(&mut self, slot: u32, tier: usize, seqs: &[SeqHash]) {
        let mut i = 0;
        while i < seqs.len() {
            let Some((r, p)) = self.at.get(&seqs[i]).map(unpack) else {
                i += 1;
                continue;
            };
            let run = &self.runs[r as usize];
            let rest = &run.live()[(p - run.base) as usize..];
            let forward = rest.iter().zip(&seqs[i..]).take_while(|(a, b)| a == b).count();
            let (from, len) = if forward > 1 { (p, forward) } else { self.matching_back(r, p, &seqs[i..]) };
            self.change(r, from, len, |h| h.set(slot, tier, false));
            i += len;
        }
    }

    /// Clears `slot` on the tiers of the mask `tiers` everywhere (a scan of every run).
    pub fn clear_slot(&mut self, slot: u32, tiers: u8) {
        for r in 0..self.runs.len() {
            if self.runs[r].live().is_empty() || !self.runs[r].holders.has(slot) {
                continue;
            }
            self.runs[r].holders.clear(slot, tiers);
            if self.runs[r].holders.is_empty() {
                self.delete(r as u32);
            }
        }
        let held = held_by(&mut self.held, slot);
        for (t, n) in held.iter_mut().enumerate() {
            if tiers & (1 << t) != 0 {
                *n = 0;
            }
        }
    }

    /// The overlap of `query` (a prompt's chained hashes) with every slot; `worker` names the slots.
    pub fn overlap(&self, query: &[SeqHash], worker: impl Fn(u32) -> Option<WorkerId>) -> Overlaps {
        let Some((r0, p0)) = query.first().and_then(|h| self.at.get(h)).map(unpack) else { return Overlaps::default() };
        let mut walk = Walk::start(&self.runs[r0 as usize].holders);
        let (mut i, mut cur) = (0, Some((r0, p0)));
        while i < query.len() {
            let Some((r, p)) = cur else {
                walk.step(i, None);
                break;
            };
            if !walk.step(i, Some(&self.runs[r as usize].holders)) {
                break;
            }
            i += self.matching(r, p, &query[i..]);
            cur = query.get(i).and_then(|h| self.at.get(h)).map(unpack);
        }
        walk.finish(i.min(query.len()), worker)
    }

    /// How many of `chain`'s leading hashes follow run `r` from position `p` on (at least 1: `chain[0]` is there),
    /// by binary search: runs are true chains, so the blocks that match are a prefix.
    fn matching(&self, r: u32, p: u32, chain: &[SeqHash]) -> usize {
        let run = &self.runs[r as usize];
        let rest = &run.live()[(p - run.base) as usize..];
        let n = rest.len().min(chain.len());
        // Most often the prompt follows the run to one of their ends: one probe.
        if rest[n - 1] == chain[n - 1] {
            return n;
        }
        // Invariant: rest[..lo] matches; rest[hi..] does not.
        let (mut lo, mut hi) = (1, n);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if rest[mid] == chain[mid] {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// How many of `seqs`' leading hashes go backwards through run `r` from position `p`: (first position, count).
    fn matching_back(&self, r: u32, p: u32, seqs: &[SeqHash]) -> (u32, usize) {
        let run = &self.runs[r as usize];
        let upto = &run.live()[..=(p - run.base) as usize];
        let n = upto.iter().rev().zip(seqs).take_while(|(a, b)| a == b).count();
        (p + 1 - n as u32, n)
    }

    /// Applies `f` to the holders of positions `from..from + len` of run `r`, splitting it so that only those
    /// blocks change, and dropping the blocks nobody holds any more.
    fn change(&mut self, r: u32, from: u32, len: usize, f: impl Fn(&mut Holders)) {
        let mut after = self.runs[r as usize].holders.clone();
        f(&mut after);
        if after == self.runs[r as usize].holders {
            return;
        }
        count_change(&mut self.held, &self.runs[r as usize].holders, &after, len as u64);
        let run = &self.runs[r as usize];
        let end = from + len as u32;
        // Blocks nobody holds any more at either end of their run (evictions take chains from one end): the run
        // shrinks where it is.
        if after.is_empty() && (from == run.base || end == run.end()) && !(from == run.base && end == run.end()) {
            self.trim(r, from, end);
            return;
        }
        let mut r = r;
        if from > run.base {
            r = self.split(r, from).1;
        }
        let run = &self.runs[r as usize];
        if end < run.end() {
            r = self.split(r, end).0;
        }
        if after.is_empty() {
            self.delete(r);
        } else {
            self.runs[r as usize].holders = after;
        }
    }

    /// Forgets positions `from..end` at the head or the tail of run `r`.
    fn trim(&mut self, r: u32, from: u32, end: u32) {
        let run = &mut self.runs[r as usize];
        let (rel, rel_end) = ((from - run.base) as usize, (end - run.base) as usize);
        forget(&mut self.at, &run.hashes[run.off as usize + rel..run.off as usize + rel_end]);
        if rel == 0 {
            run.off += (rel_end - rel) as u32;
            run.base = end;
            if run.off as usize * 2 > run.hashes.len() {
                run.hashes.drain(..run.off as usize);
                run.off = 0;
            }
        } else {
            run.hashes.truncate(run.off as usize + rel);
        }
    }

    /// Splits run `r` before position `at`: (the head's run, the tail's run). The shorter side moves to a new run.
    fn split(&mut self, r: u32, at: u32) -> (u32, u32) {
        let new = self.new_run();
        let old = &mut self.runs[r as usize];
        let k = (at - old.base) as usize;
        let moved = if k <= old.live().len() - k {
            let head = old.live()[..k].to_vec();
            let run = Run { base: old.base, off: 0, hashes: head, holders: old.holders.clone() };
            old.base = at;
            old.off += k as u32;
            if old.off as usize * 2 > old.hashes.len() {
                old.hashes.drain(..old.off as usize);
                old.off = 0;
            }
            run
        } else {
            let tail = old.hashes.split_off(old.off as usize + k);
            Run { base: at, off: 0, hashes: tail, holders: old.holders.clone() }
        };
        let head_moved = moved.base < at;
        for (k, h) in moved.hashes.iter().enumerate() {
            self.at.prefetch_ahead(&moved.hashes, k);
            if let Some(v) = self.at.get_mut(h) {
                *v = place(new, unpack(*v).1);
            }
        }
        self.runs[new as usize] = moved;
        if head_moved { (new, r) } else { (r, new) }
    }

    /// Where new blocks held by `holders` go after `prev`: the end of `prev`'s run when `prev` ends a run with the
    /// same holders, else a run of their own. Returns the run and the position of the next block.
    fn open(&mut self, prev: Option<SeqHash>, holders: Holders) -> (u32, u32) {
        let extend = prev.and_then(|p| self.at.get(&p)).map(unpack).filter(|&(r, p)| {
            let run = &self.runs[r as usize];
            run.holders == holders && p + 1 == run.end()
        });
        match extend {
            Some((r, p)) => (r, p + 1),
            None => {
                let r = self.new_run();
                self.runs[r as usize] = Run { base: 0, off: 0, hashes: Vec::new(), holders };
                (r, 0)
            }
        }
    }

    fn new_run(&mut self) -> u32 {
        match self.free.pop() {
            Some(r) => r,
            None => {
                self.runs.push(Run::default());
                (self.runs.len() - 1) as u32
            }
        }
    }

    /// Forgets run `r`'s blocks.
    fn delete(&mut self, r: u32) {
        let run = std::mem::take(&mut self.runs[r as usize]);
        forget(&mut self.at, run.live());
        self.free.push(r);
    }
}

/// Removes `hashes` from the map, asking for the lines of the ones a few ahead while it goes.
fn forget(at: &mut ProbeMap, hashes: &[SeqHash]) {
    for (k, h) in hashes.iter().enumerate() {
        at.prefetch_ahead(hashes, k);
        at.remove(h);
    }
}

/// A block's place in the map's value: its run above its position (a run number below `u32::MAX`, so the value is
/// never the map's empty mark).
fn place(run: u32, pos: u32) -> u64 {
    (u64::from(run) << 32) | u64::from(pos)
}

fn unpack(value: u64) -> (u32, u32) {
    ((value >> 32) as u32, value as u32)
}

/// `slot`'s counts, growing the table for a new slot.
fn held_by(held: &mut Vec<[u64; 3]>, slot: u32) -> &mut [u64; 3] {
    if held.len() <= slot as usize {
        held.resize(slot as usize + 1, [0; 3]);
    }
    &mut held[slot as usize]
}

/// Counts `len` blocks whose holders went from `before` to `after`: a bit turned on adds them to its slot's tier,
/// one turned off takes them away.
fn count_change(held: &mut Vec<[u64; 3]>, before: &Holders, after: &Holders, len: u64) {
    let (b, a) = (before.words(), after.words());
    for k in 0..b.len().max(a.len()) {
        let (wb, wa) = (b.get(k).copied().unwrap_or_default(), a.get(k).copied().unwrap_or_default());
        for tier in 0..3 {
            let mut changed = wb[tier] ^ wa[tier];
            while changed != 0 {
                let bit = changed.trailing_zeros();
                changed &= changed - 1;
                let n = &mut held_by(held, 64 * k as u32 + bit)[tier];
                if wa[tier] & (1 << bit) != 0 {
                    *n += len;
                } else {
                    *n -= len;
                }
            }
        }
    }
}
