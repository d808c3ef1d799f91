//! The engine driven one step at a time by a caller that keeps the clock: the simulator's worker. The same
//! scheduler, pool, export and import as [`EngineHandle`](super::EngineHandle), with no thread and no channels:
//! the caller submits sequences, runs a step, and gets back what the step produced and (with a mock backend in
//! virtual time) how long it took in modelled seconds.

use std::time::Instant;

use kv_cache::events::{EventId, KvEvent, Tier, TooOld};
use kv_cache::pool::PrefixMatch;

use super::handle::{EngineStats, LoadMark};
use super::sequence::{Seq, take_finished};
use super::{Completion, Engine, EngineError, Event, ExportedKv, FinishReason, PulledBlocks, Request};
use crate::sampling::SamplingParams;

/// What one sequence did in a step; `id` is the caller's.
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    Token {
        id: u64,
        token: u32,
    },
    /// The sequence ended; `exported` holds the prompt's KV when it was submitted exporting.
    Finished {
        id: u64,
        completion: Completion,
        exported: Option<ExportedKv>,
    },
    Failed {
        id: u64,
        why: String,
    },
}

/// One step's result.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stepped {
    /// Modelled seconds (a virtual-time backend), else the real time the step took.
    pub secs: f64,
    pub outputs: Vec<Output>,
}

/// An engine and its sequences, stepped by the caller.
#[derive(Debug)]
pub struct Stepper {
    engine: Engine,
    seqs: Vec<Seq>,
    /// Per sequence: the caller's id and whether its KV is exported when it ends.
    tags: Vec<(u64, bool)>,
    next_index: usize,
}

impl Stepper {
    pub fn new(engine: Engine) -> Stepper {
        Stepper { engine, seqs: Vec::new(), tags: Vec::new(), next_index: 0 }
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// KV events not read yet, moved out ([`Engine::take_kv_events`]).
    pub fn take_kv_events(&mut self) -> Result<Vec<(EventId, KvEvent)>, TooOld> {
        self.engine.take_kv_events()
    }

    /// Queues `request` under the caller's `id`; `blocks` are leading full blocks of its prompt pulled from
    /// another worker (by position; `&[(usize, &[u8])]` for bytes at hand), checked and held for it until it runs.
    /// Refused requests leave nothing behind.
    pub fn submit(
        &mut self,
        id: u64,
        request: Request,
        export: bool,
        blocks: &dyn PulledBlocks,
    ) -> Result<(), EngineError> {
        self.queue(id, request, None, export, blocks)
    }

    /// [`submit`](Self::submit) for a prompt hashed already (for routing, say): the request runs `prompt` with
    /// `sampling` at `priority` ([`Request::priority`]), in the prompt's namespace, and when the prompt was hashed
    /// in this engine's block size the sequence keeps those hashes instead of hashing the prompt again.
    pub fn submit_hashed(
        &mut self,
        id: u64,
        prompt: kv_cache::HashedTokens,
        sampling: SamplingParams,
        priority: i32,
        export: bool,
        blocks: &dyn PulledBlocks,
    ) -> Result<(), EngineError> {
        let ours = prompt.block_size() == self.engine.block_size();
        let (tokens, namespace, hashes) = prompt.into_parts();
        let request = Request { prompt: tokens, sampling, namespace, deadline: None, priority };
        self.queue(id, request, ours.then_some(hashes), export, blocks)
    }

    fn queue(
        &mut self,
        id: u64,
        request: Request,
        hashes: Option<kv_cache::BlockHashes>,
        export: bool,
        blocks: &dyn PulledBlocks,
    ) -> Result<(), EngineError> {
        let seq = self.engine.prepare_hashed(request, hashes, self.next_index, export, blocks);
        self.next_index += 1;
        super::sequence::enqueue(&mut self.seqs, &mut self.tags, seq?, (id, export));
        Ok(())
    }

    /// Releases the blocks of exports whose pins have ended (a step or a submission does it too).
    pub fn reclaim_pinned(&mut self) {
        self.engine.reclaim_pinned();
    }

    /// Whether any sequence is waiting or running.
    pub fn busy(&self) -> bool {
        !self.seqs.is_empty()
    }

    /// How many of `hashes`' leading blocks the engine holds, per tier.
    pub fn lookup(&self, hashes: &[kv_cache::SeqHash]) -> PrefixMatch {
        self.engine.lookup(hashes)
    }

    /// Runs one step (nothing when no sequence is queued).
    pub fn step(&mut self) -> Stepped {
        let mut outputs = Vec::new();
        let secs = self.step_into(&mut outputs);
        Stepped { secs, outputs }
    }

    /// [`Stepper::step`] appending what the step produced to `outputs` (a buffer the caller keeps from step to
    /// step), returning the step's seconds.
    pub fn step_into(&mut self, outputs: &mut Vec<Output>) -> f64 {
        if self.seqs.is_empty() {
            return 0.0;
        }
        let started = self.engine.now();
        let compute_before = self.engine.counters().compute_nanos;
        let tags = &self.tags;
        self.engine.step_or_fail(&mut self.seqs, &mut |Event::Token { seq, token, .. }| {
            outputs.push(Output::Token { id: tags[seq].0, token });
        });
        self.retire(outputs, started);
        match self.engine.backend.virtual_step_secs() {
            Some(_) => (self.engine.counters().compute_nanos - compute_before) as f64 / 1e9,
            None => started.elapsed().as_secs_f64(),
        }
    }

    /// Ends sequence `id` at once (the caller gave up on it); its blocks go back.
    pub fn cancel(&mut self, id: u64) {
        if let Some(i) = self.tags.iter().position(|t| t.0 == id) {
            self.seqs[i].finish = Some(FinishReason::Cancelled);
            let mut dropped = Vec::new();
            self.retire(&mut dropped, self.engine.now());
        }
    }

    /// The engine's state, as a worker publishes it for load reports.
    pub fn stats(&self) -> EngineStats {
        self.engine.stats_of(&self.seqs)
    }

    /// [`Stepper::stats`]'s [`EngineStats::mark`] without the rest of its figures (read after every simulated
    /// step).
    pub fn load_mark(&self) -> LoadMark {
        let (running, waiting) = self.held();
        LoadMark::of(running, waiting, self.engine.kv_usage(Tier::Device), self.engine.leased_blocks())
    }

    /// Sequences running and waiting: [`Stepper::stats`]'s counts without the rest of its figures.
    pub fn held(&self) -> (usize, usize) {
        let running = self.seqs.iter().filter(|s| s.running && s.active()).count();
        (running, self.seqs.iter().filter(|s| s.active()).count() - running)
    }

    /// The caller's ids of the sequences queued or running.
    pub fn ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.tags.iter().map(|t| t.0)
    }

    /// Finished sequences give back their blocks and report their end (the export first, when asked).
    fn retire(&mut self, outputs: &mut Vec<Output>, start: Instant) {
        for (s, (id, export)) in take_finished(&mut self.seqs, &mut self.tags) {
            outputs.push(match self.engine.retire(s, export, start) {
                (exported, Ok(completion)) => Output::Finished { id, completion, exported },
                (_, Err(why)) => Output::Failed { id, why: why.to_string() },
            });
        }
    }
}
