//! Rank-ordered BPE merging over token ids, O(n log n) in the piece length.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::TokenizerError;

/// The merge table: for a pair of adjacent token ids, the merge's rank and the id it produces.
#[derive(Debug)]
pub struct Merges {
    pairs: HashMap<(u32, u32), (u32, u32)>,
}

impl Merges {
    /// Builds the table from GGUF merge strings (`"left right"`, rank = position).
    pub fn new(merges: &[String], index: &HashMap<&str, u32>) -> Result<Merges, TokenizerError> {
        let mut pairs = HashMap::with_capacity(merges.len());
        for (rank, m) in merges.iter().enumerate() {
            let bad = |what| TokenizerError::BadMerge { index: rank, merge: m.clone(), what };
            let (l, r) = m.split_once(' ').ok_or_else(|| bad("has no space"))?;
            let left = *index.get(l).ok_or_else(|| bad("has a left part outside the vocabulary"))?;
            let right = *index.get(r).ok_or_else(|| bad("has a right part outside the vocabulary"))?;
            let merged =
                *index.get(format!("{l}{r}").as_str()).ok_or_else(|| bad("makes a token outside the vocabulary"))?;
            // The first (lowest-rank) occurrence of a pair wins, as in the reference implementations.
            pairs.entry((left, right)).or_insert((rank as u32, merged));
        }
        Ok(Merges { pairs })
    }

    /// Merges `symbols` in place: always the lowest-rank adjacent pair, leftmost first, until none applies.
    pub fn apply(&self, symbols: &mut Vec<u32>) {
        let n = symbols.len();
        if n < 2 {
            return;
        }
        // A doubly linked list over positions; a merged-away position has `alive == false`.
        let mut next: Vec<usize> = (1..=n).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut alive = vec![true; n];
        let mut heap = BinaryHeap::new();
        let push = |heap: &mut BinaryHeap<_>, syms: &[u32], i: usize, j: usize| {
            if let Some(&(rank, merged)) = self.pairs.get(&(syms[i], syms[j])) {
                heap.push(Reverse((rank, i, syms[i], syms[j], merged)));
            }
        };
        for i in 0..n - 1 {
            push(&mut heap, symbols, i, i + 1);
        }
        while let Some(Reverse((_, i, left, right, merged))) = heap.pop() {
            let j = next[i];
            // Stale entry: one side was merged away or changed since this pair was queued.
            if !alive[i] || j >= n || symbols[i] != left || symbols[j] != right {
                continue;
            }
            symbols[i] = merged;
            alive[j] = false;
            next[i] = next[j];
            if next[j] < n {
                prev[next[j]] = i;
            }
            if prev[i] < n {
                push(&mut heap, symbols, prev[i], i);
            }
            if next[i] < n {
                push(&mut heap, symbols, i, next[i]);
            }
        }
        let mut w = 0;
        for r in 0..n {
            if alive[r] {
                symbols[w] = symbols[r];
                w += 1;
            }
        }
        symbols.truncate(w);
    }
}
