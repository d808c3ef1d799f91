//! A prompt's overlap with every worker at once: the holders of a stretch of blocks are words of bits, so the walk
//! keeps, per 64-slot word, which slots are still in their device, host and disk runs, and touches a worker's own
//! figures only when it leaves a run (at most three times per worker per query).

use crate::holders::{Holders, Word};
use crate::{Overlap, WorkerId};

/// Each worker's overlap, sorted by worker.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overlaps(Vec<(WorkerId, Overlap)>);

impl Overlaps {
    /// `worker`'s overlap; `None` when it does not hold the first block.
    pub fn get(&self, worker: &WorkerId) -> Option<&Overlap> {
        self.0.binary_search_by_key(worker, |(w, _)| *w).ok().map(|i| &self.0[i].1)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &(WorkerId, Overlap)> {
        self.0.iter()
    }
}

/// One word's slots still in a run.
struct Live {
    /// Which word.
    k: usize,
    /// Slots in their device, host and disk runs.
    runs: Word,
}

/// The walk along a prompt: started with the first block's holders, stepped at the first block of every stretch
/// whose blocks share holders, finished where the prompt (or the last worker's runs) ended. Steps only note which
/// slots left which run where, a few words each; every worker's figures are written once, at the end.
pub(crate) struct Walk {
    /// Per word: which word, and every slot that held the first block there.
    words: Vec<(usize, u64)>,
    live: Vec<Live>,
    /// (word, block, slots that left their device run, their host run, every run there) per step that moved any.
    moves: Vec<(usize, usize, Word)>,
}

impl Walk {
    pub fn start(first: &Holders) -> Walk {
        let mut words = Vec::new();
        let mut live = Vec::new();
        for (k, w) in first.words().iter().enumerate() {
            let all = w[0] | w[1] | w[2];
            if all != 0 {
                words.push((k, all));
                // Everyone starts in the device run; the first step moves those without it on device down at once.
                live.push(Live { k, runs: [all, 0, 0] });
            }
        }
        Walk { words, live, moves: Vec::new() }
    }

    /// Block `i` starts a stretch held by `holders` (none: no worker holds it). Returns whether any worker is
    /// still in a run.
    pub fn step(&mut self, i: usize, holders: Option<&Holders>) -> bool {
        for l in &mut self.live {
            let m = holders.and_then(|h| h.words().get(l.k)).copied().unwrap_or([0; 3]);
            let [d, h, x] = l.runs;
            let left_d = d & !m[0];
            let into_h = h | left_d;
            let left_h = into_h & !m[1];
            let into_x = x | left_h;
            let gone = into_x & !m[2];
            l.runs = [d & m[0], into_h & m[1], into_x & m[2]];
            if left_d | left_h | gone != 0 {
                self.moves.push((l.k, i, [left_d, left_h, gone]));
            }
        }
        self.live.retain(|l| l.runs.iter().any(|&r| r != 0));
        !self.live.is_empty()
    }

    /// Every worker's figures: each left its runs where a step says so, or holds every block up to `walked`.
    /// `worker` names each slot.
    pub fn finish(self, walked: usize, worker: impl Fn(u32) -> Option<WorkerId>) -> Overlaps {
        let total = self.words.iter().map(|(_, all)| all.count_ones() as usize).sum();
        let mut out: Vec<(WorkerId, Overlap)> = Vec::with_capacity(total);
        let mut mine: Vec<(usize, Word)> = Vec::new();
        for &(k, all) in &self.words {
            mine.clear();
            mine.extend(self.moves.iter().filter(|m| m.0 == k).map(|m| (m.1, m.2)));
            let mut rest = all;
            while rest != 0 {
                let bit = rest & rest.wrapping_neg();
                rest &= rest - 1;
                // Where the slot left each run (steps are in block order).
                let left = |run: usize| mine.iter().find(|(_, w)| w[run] & bit != 0).map_or(walked, |(i, _)| *i);
                let (d, h, x) = (left(0), left(1), left(2));
                let slot = (k * 64) as u32 + bit.trailing_zeros();
                if let Some(w) = worker(slot) {
                    out.push((w, Overlap { device: d, host: h - d, disk: x - h }));
                }
            }
        }
        // Slots are mostly handed out in worker order: then there is nothing to sort.
        if !out.is_sorted_by_key(|(w, _)| *w) {
            out.sort_unstable_by_key(|(w, _)| *w);
        }
        Overlaps(out)
    }
}
