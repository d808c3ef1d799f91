//! One scheduler step: admit waiting sequences (taking their cached prefix from any tier), plan decodes and
//! prompt chunks within the token budget, find device blocks (preempting the newest sequence when none are left),
//! run the forward pass, register completed blocks, and sample.
//!
//! A failure that belongs to one sequence (its blocks could not be read from a tier, it cannot get a block even
//! alone, its chunk is refused by the forward pass) ends that sequence only, with the reason; the step goes on
//! with the others. Only a failure of the batch as a whole ends every sequence in it.

use kv_cache::BlockSize;
use kv_cache::events::{BlockMeta, Tier};
use kv_cache::pool::{Action, PoolError};

use super::sequence::{Failure, Seq};
use super::{Engine, EngineError, Event};
use crate::backend::{Next, StepContext};
use crate::forward::SeqChunk;
use crate::kv::BlockId;
use crate::sampling::TokenLogprobs;

impl Engine {
    pub(super) fn block_size(&self) -> BlockSize {
        BlockSize::new(self.config.block_tokens as u32).unwrap_or_default()
    }

    /// Gives waiting sequences their cached prefix and a place in the running set, in the order of `seqs`
    /// (priority, then arrival). A sequence whose cached blocks cannot be brought to the device fails alone.
    pub(super) fn admit(&mut self, seqs: &mut [Seq]) {
        let bt = self.config.block_tokens;
        let room = self.config.max_num_seqs.saturating_sub(seqs.iter().filter(|s| s.running).count());
        for s in seqs.iter_mut().filter(|s| s.active() && !s.running).take(room) {
            // Reuse whole blocks, but always leave at least one token to compute (its logits are needed).
            let reusable = s.reusable_blocks(bt);
            // The blocks held for the sequence since it arrived (a pulled prompt's) lead its prefix: their
            // references pass to it as they are, and only the rest of the prefix is looked up and acquired (a
            // lookup and a reference more, then one fewer, per block before).
            let pinned = std::mem::take(&mut s.pinned);
            let hashes = &s.hashes(reusable, self.block_size()).seq[..reusable];
            self.stage_disk_hits(hashes);
            let held = self.held_prefix(&pinned, hashes);
            let mut acquired = self.pool.acquire(&hashes[held..]);
            acquired.from_tier[Tier::Device.index()] += held;
            s.blocks = pinned[..held].iter().copied().chain(acquired.slots.iter().copied().map(BlockId)).collect();
            // The sequence now references its prefix itself: the rest of the hold taken for it on arrival goes.
            for b in &pinned[held..] {
                let _ = self.pool.release(b.0);
            }
            if let Err(e) = self.execute(&acquired.actions) {
                self.fail(s, format!("cached blocks could not be brought to the device: {e}"));
                continue;
            }
            for tier in Tier::ALL {
                self.counters.cached_tokens[tier.index()] += (acquired.from_tier[tier.index()] * bt) as u64;
            }
            s.registered = s.blocks.len();
            s.computed = s.registered * bt;
            s.running = true;
            if s.admissions == 0 {
                s.cached_tokens = s.computed;
            }
            s.admissions += 1;
            s.admitted_at = self.tick;
            self.tick += 1;
        }
    }

    /// Ends `s` alone: its blocks go back (cached ones stay cached) and its reader is told `why`.
    pub(super) fn fail(&mut self, s: &mut Seq, why: String) {
        self.end_alone(s, Failure::Error(why));
    }

    /// Ends `s` alone because its deadline passed.
    pub(super) fn expire(&mut self, s: &mut Seq) {
        self.end_alone(s, Failure::Expired);
    }

    fn end_alone(&mut self, s: &mut Seq, failure: Failure) {
        let _ = self.release_blocks(s);
        s.running = false;
        s.failure = Some(failure);
        s.finish = Some(super::FinishReason::Cancelled);
    }

    /// Reads and verifies the disk blocks a prefix is about to onboard; a bad one is dropped from the pool (with a
    /// `Removed` event) so that the prefix stops before it and the block is recomputed.
    fn stage_disk_hits(&mut self, hashes: &[kv_cache::SeqHash]) {
        if self.stores.disk.is_none() {
            // No disk tier: nothing to read ahead, and no lookup of the whole prefix to find that out.
            return;
        }
        let m = self.pool.lookup(hashes);
        for &h in &hashes[m.device + m.host..m.device + m.host + m.disk] {
            let Some(at) = self.pool.find(h) else { break };
            if self.stores.stage_disk_block(at.slot, h).is_err() {
                self.pool.discard(at);
                self.counters.corrupt_disk_blocks += 1;
                break;
            }
        }
    }

    /// Performs the pool's copies and counts them; the device blocks they read are the backend's latest.
    pub(super) fn execute(&mut self, actions: &[Action]) -> Result<(), EngineError> {
        let mut read = Vec::new();
        for &Action::Copy { from, to, .. } in actions {
            if to.tier == Tier::Device {
                self.counters.onboards[from.tier.index()] += 1;
            } else {
                self.counters.offloads[to.tier.index()] += 1;
            }
            if from.tier == Tier::Device {
                read.push(BlockId(from.slot));
            }
        }
        if !read.is_empty() {
            self.backend.write_back(&mut self.stores.device, &read)?;
        }
        self.stores.execute(actions).map_err(EngineError::Tier)
    }

    /// Frees every block of `s` (registered ones stay cached for reuse) and sends it back to waiting.
    pub(super) fn preempt(&mut self, s: &mut Seq) -> Result<(), EngineError> {
        self.release_blocks(s)?;
        s.running = false;
        s.computed = 0;
        s.registered = 0;
        self.counters.preemptions += 1;
        Ok(())
    }

    /// Gives back every block `s` references, its held prefix included, last block first: blocks that become
    /// evictable join the end of the LRU order, so a chain leaves the device from its end and what stays is always
    /// a prefix (its first block gone first would leave the rest unreachable by any prompt).
    pub(super) fn release_blocks(&mut self, s: &mut Seq) -> Result<(), EngineError> {
        let mut result = Ok(());
        for b in s.blocks.drain(..).rev().chain(s.pinned.drain(..).rev()) {
            if let Err(e) = self.pool.release(b.0) {
                result = Err(EngineError::Pool(e));
            }
        }
        result
    }

    /// Plans and runs one step. Returns `Ok(false)` when nothing could run; sequences that failed alone are marked
    /// (see [`Engine::fail`]) and the step goes on without them.
    pub(super) fn step(&mut self, seqs: &mut [Seq], on_event: &mut impl FnMut(Event<'_>)) -> Result<bool, EngineError> {
        let mut plan = std::mem::take(&mut self.plan);
        plan.clear();
        let stepped = self.step_with(seqs, &mut plan, on_event);
        self.plan = plan;
        stepped
    }

    /// [`Engine::step`] with `plan` empty to fill.
    fn step_with(
        &mut self,
        seqs: &mut [Seq],
        plan: &mut Vec<(usize, usize)>,
        on_event: &mut impl FnMut(Event<'_>),
    ) -> Result<bool, EngineError> {
        let started = self.now();
        let onboards_before = self.counters.onboards;
        // Blocks whose exports ended are room for this step.
        self.reclaim_pinned();
        self.admit(seqs);
        let bt = self.config.block_tokens;
        let chunk_cap = self.config.prefill_chunk.map_or(usize::MAX, std::num::NonZeroUsize::get);
        // Decodes first (one token each), then prompt chunks while the budget lasts.
        let mut budget = self.config.max_batched_tokens;
        let runnable = |s: &Seq| s.active() && s.running;
        for (i, _) in seqs.iter().enumerate().filter(|(_, s)| runnable(s) && s.remaining() == 1) {
            if budget == 0 {
                break;
            }
            plan.push((i, 1));
            budget -= 1;
        }
        for (i, s) in seqs.iter().enumerate().filter(|(_, s)| runnable(s) && s.remaining() > 1) {
            if budget == 0 {
                break;
            }
            let n = s.remaining().min(chunk_cap).min(budget);
            plan.push((i, n));
            budget -= n;
        }
        // Device blocks for the plan, preempting the running sequence of the lowest priority (the newest among
        // equals) when the pool runs dry. A sequence ended
        // here (`ended`) is progress even when nothing is left to compute.
        let mut ended = false;
        let mut k = 0;
        while k < plan.len() {
            let (i, n) = plan[k];
            let need = (seqs[i].computed + n).div_ceil(bt);
            let mut preempted_self = false;
            while seqs[i].blocks.len() < need {
                // Room for the slots and for a copy per slot (each may evict a block to the host tier).
                let more = need - seqs[i].blocks.len();
                let (mut actions, mut slots) = (Vec::with_capacity(more), Vec::with_capacity(more));
                let allocated = self.pool.allocate_many(more, &mut slots, &mut actions);
                seqs[i].blocks.extend(slots.into_iter().map(BlockId));
                if let Err(e) = self.execute(&actions) {
                    self.fail(&mut seqs[i], format!("making room for a block failed: {e}"));
                    ended = true;
                    plan.remove(k);
                    preempted_self = true;
                    break;
                }
                match allocated {
                    Ok(()) => {}
                    Err(PoolError::OutOfBlocks) => {
                        let victim = seqs
                            .iter()
                            .enumerate()
                            .filter(|(_, s)| s.running && s.active())
                            .max_by_key(|(_, s)| (s.priority, s.admitted_at))
                            .map(|(v, _)| v);
                        let alone = seqs.iter().filter(|s| s.running && s.active()).count() == 1;
                        let Some(v) = victim.filter(|&v| !(v == i && alone)) else {
                            // It cannot get a block even with nothing else running: it can never run here.
                            let why = self.out_of_capacity().to_string();
                            self.fail(&mut seqs[i], why);
                            ended = true;
                            plan.remove(k);
                            preempted_self = true;
                            break;
                        };
                        self.preempt(&mut seqs[v])?;
                        if let Some(pos) = plan.iter().position(|&(p, _)| p == v) {
                            plan.remove(pos);
                            if pos < k {
                                k -= 1;
                            }
                        }
                        if v == i {
                            preempted_self = true;
                            break;
                        }
                    }
                    Err(e) => return Err(EngineError::Pool(e)),
                }
            }
            if !preempted_self {
                k += 1;
            }
        }
        // A chunk the forward pass would refuse fails its sequence alone, before the batch runs.
        let mut k = 0;
        while k < plan.len() {
            let (i, n) = plan[k];
            match self.backend.check_chunk(&self.stores.device, &seqs[i].chunk(n)) {
                Ok(()) => k += 1,
                Err(e) => {
                    self.fail(&mut seqs[i], e.to_string());
                    ended = true;
                    plan.remove(k);
                }
            }
        }
        if plan.is_empty() {
            // Nothing to compute: a step that ended sequences goes on (the others are not out of room); one that
            // could plan nothing at all could not run.
            return Ok(ended);
        }
        let mut chunks = recycle(std::mem::take(&mut self.chunks));
        chunks.extend(plan.iter().map(|&(i, n)| seqs[i].chunk(n)));
        let context = StepContext {
            started,
            onboarded: [
                self.counters.onboards[Tier::Host.index()] - onboards_before[Tier::Host.index()],
                self.counters.onboards[Tier::Disk.index()] - onboards_before[Tier::Disk.index()],
            ],
        };
        let mut logits = std::mem::take(&mut self.next);
        logits.clear();
        let scoring = chunks.iter().any(|c| c.scored.is_some());
        let mut scores = Vec::new();
        let forwarded = if scoring {
            self.backend.forward_scored(&mut self.stores.device, &chunks, context, &mut logits, &mut scores)
        } else {
            self.backend.forward_into(&mut self.stores.device, &chunks, context, &mut logits)
        };
        let took = match self.backend.virtual_step_secs() {
            Some(secs) => (secs * 1e9) as u64,
            None => u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX),
        };
        self.counters.compute_nanos += took;
        self.chunks = recycle(chunks);
        if let Err(e) = forwarded {
            // Not one sequence's fault: the sequences of this batch end; the waiting ones stay.
            for &(i, _) in plan.iter() {
                self.fail(&mut seqs[i], e.to_string());
            }
            return Ok(true);
        }
        let mut drained = logits.drain(..);
        let mut scores = scores.into_iter();
        // Every token of the step is produced by the same pass: one clock read for all of them.
        let produced = self.now();
        for &(i, n) in plan.iter() {
            let s = &mut seqs[i];
            if scoring {
                s.take_scores(n, &mut scores);
            }
            s.computed += n;
            self.counters.prefill_tokens += n as u64;
            if let Err(e) = self.register_complete(s) {
                self.fail(s, e.to_string());
                continue;
            }
            if s.computed < s.tokens.len() {
                continue;
            }
            let Some(next) = drained.next() else { continue };
            let top = s.sampler.params().logprobs().map(|n| n as usize);
            let (token, logprobs) = match next {
                Next::Logits(l) => {
                    // A grammar masks what it does not allow; log-probabilities stay the model's own.
                    let masked = match s.grammar.as_mut().map(|g| {
                        let mut m = l.clone();
                        g.mask(&mut m).map(|()| m)
                    }) {
                        None => None,
                        Some(Ok(m)) => Some(m),
                        Some(Err(e)) => {
                            self.fail(s, e.to_string());
                            continue;
                        }
                    };
                    let prior = s.sampler.params().logits().prior_generated as usize;
                    let from = s.prompt_len.saturating_sub(prior);
                    let tokenizer = self.text.tokenizer();
                    let eog = |t| tokenizer.is_end_of_generation(t);
                    let Some(token) = s.sampler.sample_in(masked.as_deref().unwrap_or(&l), &s.tokens, from, &eog)
                    else {
                        let why = "no token is possible here: allowed_token_ids, min_tokens, bad_words and the \
                                   structured output together rule out every one";
                        self.end_alone(s, Failure::Refused(why.into()));
                        continue;
                    };
                    (token, top.map(|k| TokenLogprobs::of(&l, token, k)))
                }
                // Only a chunk that asked for no more than the top token gets it ([`Seq::chunk`]); a backend that
                // answered another one so would have dropped what its sampler needs.
                Next::Token(token) if s.grammar.is_none() && s.sampler.takes_the_top() => (token, None),
                Next::Token(_) => {
                    self.fail(s, "the backend gave the top token where the sampler needs the logits".into());
                    continue;
                }
                Next::Draw(_) if s.grammar.is_some() => {
                    self.fail(s, "structured outputs need the model's logits; this backend draws its tokens".into());
                    continue;
                }
                Next::Draw(words) => {
                    let token = s.sampler.draw(&words);
                    (token, top.map(|k| TokenLogprobs::uniform(&words, token, k)))
                }
            };
            if let Some(Err(e)) = s.grammar.as_mut().map(|g| g.take(&[token])) {
                self.fail(s, e.to_string());
                continue;
            }
            s.accept(i, token, logprobs, produced, self.text.tokenizer(), on_event);
            if !s.active() && !s.keep_blocks {
                if let Err(e) = self.release_blocks(s) {
                    self.fail(s, e.to_string());
                }
                s.running = false;
            }
        }
        drop(drained);
        self.next = logits;
        Ok(true)
    }

    /// Runs one step for a driver that keeps its sequences going: a failure of one sequence ends that sequence only
    /// (the step marks it); a failure of the batch as a whole, or a step that could not run, ends every active one.
    pub(super) fn step_or_fail(&mut self, seqs: &mut [Seq], on_event: &mut impl FnMut(Event<'_>)) {
        let failure = match self.step(seqs, on_event) {
            Ok(true) => None,
            Ok(false) => Some(self.out_of_capacity().to_string()),
            Err(e) => Some(e.to_string()),
        };
        if let Some(failure) = failure {
            for s in seqs.iter_mut().filter(|s| s.active()) {
                self.fail(s, failure.clone());
            }
        }
    }

    /// Retires a finished sequence: its prompt's KV when `export` asked for it (and it ended well), then its blocks
    /// go back; the end is its completion, or why it failed (`Expired` for a passed deadline).
    pub(super) fn retire(
        &mut self,
        mut s: Seq,
        export: bool,
        start: std::time::Instant,
    ) -> (Option<super::ExportedKv>, Result<super::Completion, Failure>) {
        let mut exported = None;
        if export && s.failure.is_none() && s.finish != Some(super::FinishReason::Cancelled) {
            match self.export(&mut s) {
                Ok(kv) => exported = Some(kv),
                // The device could not hand its K/V back: the blocks stay the sequence's, released below.
                Err(e) => s.failure = Some(Failure::Error(e.to_string())),
            }
        }
        let released = self.release_blocks(&mut s);
        let end = match (released, s.failure.take()) {
            (_, Some(failure)) => Err(failure),
            (Ok(()), None) => Ok(s.into_completion(start)),
            (Err(e), None) => Err(Failure::Error(e.to_string())),
        };
        (exported, end)
    }

    /// The engine's state with `seqs` as its sequences, for load reports and metrics.
    pub(super) fn stats_of(&self, seqs: &[Seq]) -> super::EngineStats {
        // One pass over the sequences (read at every step of a simulated worker).
        let bt = self.config.block_tokens;
        let (mut running, mut waiting, mut prefill_tokens_pending, mut blocks_to_come) = (0, 0, 0, 0);
        for s in seqs.iter().filter(|s| s.active()) {
            if s.running {
                running += 1;
            } else {
                waiting += 1;
            }
            prefill_tokens_pending += s.pending_prefill();
            blocks_to_come += s.blocks_to_come(bt);
        }
        super::EngineStats {
            counters: self.counters(),
            usage: Tier::ALL.map(|t| self.kv_usage(t)),
            leased_blocks: self.leased_blocks(),
            running,
            waiting,
            prefill_tokens_pending,
            blocks_to_come,
            pacing: self.pacing(),
            tags: Vec::new(),
        }
    }

    /// Registers the sequence's newly completed blocks so later sequences can share them.
    fn register_complete(&mut self, s: &mut Seq) -> Result<(), EngineError> {
        let bt = self.config.block_tokens;
        let full = s.computed / bt;
        if full <= s.registered {
            return Ok(());
        }
        s.hashes(full, self.block_size());
        let hashes = &s.hashes;
        let run: Vec<(u32, BlockMeta)> = (s.registered..full)
            .map(|b| {
                let parent = b.checked_sub(1).map(|p| hashes.seq[p]);
                (s.blocks[b].0, BlockMeta { seq: hashes.seq[b], local: hashes.local[b], parent })
            })
            .collect();
        self.pool.register_run(&run).map_err(EngineError::Pool)?;
        s.registered = full;
        Ok(())
    }

    pub(super) fn out_of_capacity(&self) -> EngineError {
        let u = self.pool.usage(Tier::Device);
        EngineError::OutOfKvCapacity { used: u.used, total: self.pool.capacity(Tier::Device) }
    }
}

/// `v` emptied, as a vector of chunks borrowing for another lifetime, in the same memory: an empty vector's memory
/// does not depend on what its elements would borrow, and collecting a vector's own iterator into a vector of the
/// same layout reuses it. So each step builds its batch where the last one's was instead of allocating.
fn recycle<'b>(mut v: Vec<SeqChunk<'_>>) -> Vec<SeqChunk<'b>> {
    v.clear();
    v.into_iter().map(|_| unreachable!("the vector is empty")).collect()
}
