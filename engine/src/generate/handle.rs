//! The engine on its own thread, driven from async code without blocking its runtime.
//!
//! Requests arrive on a bounded command channel; each sequence reports on its own stream whose capacity is its
//! `max_tokens + 1` messages, so the engine never waits for a slow reader and never drops a token. Dropping a
//! [`SeqStream`] cancels its sequence: the engine notices before its next step and frees the blocks.
//!
//! The engine's state ([`EngineStats`]) is published by the engine thread at every step boundary and every
//! admission or cancellation; readers take the latest copy and never wait for a step to end.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use bytes::Bytes;
use kv_cache::events::{EventId, KvEvent, Snapshot, TooOld};
use kv_cache::pool::{PrefixMatch, TierUsage};
use kv_cache::{CacheNamespace, SeqHash};
use tokio::sync::{mpsc, oneshot, watch};

use super::sequence::{Failure, Seq, take_finished};
use super::{Completion, Counters, Engine, EngineError, Event, ExportedKv, FinishReason, PulledBlocks, Request};

/// Commands waiting for the engine thread; a full queue makes submitters wait (backpressure).
const COMMAND_QUEUE: usize = 1024;

/// What a sequence's stream carries.
#[derive(Clone, Debug, PartialEq)]
pub enum SeqEvent {
    /// A new token, the text it makes safe to show, and its log-probabilities when the request asked for them;
    /// the first token also brings the prompt's when they were asked for (else empty).
    Token {
        token: u32,
        text: String,
        logprobs: Option<crate::sampling::TokenLogprobs>,
        prompt_logprobs: Vec<crate::sampling::TokenLogprobs>,
    },
    /// The sequence is done; the last message on the stream.
    Finished(Completion),
    /// The engine failed the sequence; the last message on the stream.
    Failed(String),
    /// What the request asks cannot be done (any engine would fail it so); the last message on the stream.
    Refused(String),
    /// The prompt's KV, sent just before `Finished` when the request asked for it.
    Exported(ExportedKv),
    /// The request's deadline passed before it finished; the last message on the stream.
    Expired,
}

/// The engine's state, for load reports and metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub counters: Counters,
    /// Blocks per state, by tier.
    pub usage: [TierUsage; 3],
    /// Device blocks counted as used that only exports hold (leased to readers), not any sequence: not load.
    pub leased_blocks: usize,
    /// Sequences holding blocks and taking part in steps.
    pub running: usize,
    /// Sequences waiting to be admitted (new or preempted).
    pub waiting: usize,
    /// Prompt tokens still to compute, over sequences that are not yet decoding (the router's prefill load).
    pub prefill_tokens_pending: usize,
    /// Device blocks the sequences' prompts will hold that they do not hold yet (waiting sequences' whole
    /// prompts, the rest of those in prefill): load a router counts on top of the blocks in use.
    pub blocks_to_come: usize,
    /// How closely a mock backend keeps to its timing profile (`None` for a computing backend).
    pub pacing: Option<crate::backend::Pacing>,
    /// The [`Tag`]s of the sequences these figures include (those submitted with one), in ascending order: read
    /// with the figures in one copy, they say exactly which requests the figures count.
    pub tags: Vec<Tag>,
}

impl EngineStats {
    /// Device blocks the engine's sequences use: what routers count as load (blocks held only for a lease,
    /// waiting for a decode worker to read them, are not).
    pub fn sequence_blocks(&self) -> usize {
        self.mark().used
    }

    /// The figures that decide whether a load report is due early.
    pub fn mark(&self) -> LoadMark {
        LoadMark::of(self.running, self.waiting, self.usage[0], self.leased_blocks)
    }
}

/// A move in the device blocks a worker's sequences use, as a share of its device blocks, that is reported at once
/// rather than at the next period.
pub const LARGE_BLOCK_CHANGE: f64 = 0.10;

/// The figures that decide whether a worker's load report goes out before its period. A worker
/// (`worker::service::subscribe`) and a simulated one (`sim::worker`) apply the same rule to them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadMark {
    pub running: usize,
    pub waiting: usize,
    /// Device blocks the sequences use ([`EngineStats::sequence_blocks`]).
    pub used: usize,
    /// Device blocks in all.
    pub capacity: usize,
}

impl LoadMark {
    /// From the sequences running and waiting, the device tier's usage, and the device blocks only a lease holds.
    pub fn of(running: usize, waiting: usize, device: TierUsage, leased: usize) -> LoadMark {
        LoadMark {
            running,
            waiting,
            used: device.used.saturating_sub(leased),
            capacity: device.used + device.cached + device.free,
        }
    }

    /// Whether the load moved enough since `prev` to tell the routers now: a sequence started, finished or
    /// queued, or the sequences' device blocks moved by [`LARGE_BLOCK_CHANGE`] of capacity.
    pub fn moved_since(&self, prev: &LoadMark) -> bool {
        let capacity = self.capacity.max(1) as f64;
        prev.running != self.running
            || prev.waiting != self.waiting
            || (prev.used as f64 - self.used as f64).abs() / capacity >= LARGE_BLOCK_CHANGE
    }
}

/// What a caller names a request by when it submits it, to find it again in [`EngineStats::tags`] (a worker tags
/// each call, so that a load report names exactly the requests its figures count).
pub type Tag = u64;

/// Why a request was not taken.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error(transparent)]
    Invalid(#[from] EngineError),
    /// No device block was free for the blocks handed in with the request.
    #[error(transparent)]
    Exhausted(EngineError),
    /// A block handed in with the request failed its check: the transfer, not the request, was at fault.
    #[error(transparent)]
    Transfer(EngineError),
    #[error("the engine is shutting down")]
    Closed,
}

impl SubmitError {
    fn from_engine(e: EngineError) -> SubmitError {
        match e {
            e @ EngineError::OutOfKvCapacity { .. } => SubmitError::Exhausted(e),
            e @ EngineError::Import(_) => SubmitError::Transfer(e),
            e => SubmitError::Invalid(e),
        }
    }
}

/// A sequence's output; dropping it cancels the sequence.
#[derive(Debug)]
pub struct SeqStream {
    rx: mpsc::Receiver<SeqEvent>,
}

impl SeqStream {
    /// The next message; `None` after the last one.
    pub async fn next(&mut self) -> Option<SeqEvent> {
        self.rx.recv().await
    }
}

/// Nothing pulled: a request computes or finds its prompt here.
fn no_blocks() -> Box<dyn PulledBlocks> {
    Box::new(Vec::<(usize, Bytes)>::new())
}

enum Command {
    Submit {
        /// Boxed: a request (its sampling rules included) is much larger than the other commands.
        request: Box<Request>,
        export: bool,
        /// Blocks pulled from another worker for this prompt (full blocks, by position): stored and held for the
        /// sequence until it is admitted, so nothing can evict them in between.
        blocks: Box<dyn PulledBlocks>,
        tag: Option<Tag>,
        reply: oneshot::Sender<Result<SeqStream, EngineError>>,
    },
    /// Blocks pulled ahead of a request (full blocks of `tokens`, by position): stored as cached blocks.
    Import {
        namespace: Option<CacheNamespace>,
        tokens: Vec<u32>,
        blocks: Box<dyn PulledBlocks>,
        reply: oneshot::Sender<Result<usize, EngineError>>,
    },
    Lookup {
        hashes: Vec<SeqHash>,
        reply: oneshot::Sender<PrefixMatch>,
    },
    Snapshot(oneshot::Sender<Snapshot>),
    EventsAfter {
        after: Option<EventId>,
        reply: oneshot::Sender<Result<Vec<(EventId, KvEvent)>, TooOld>>,
    },
    Shutdown {
        finish_in_flight: bool,
    },
    /// Exported blocks' pins ended: release them (sent by whoever dropped the last pin).
    Reclaim,
}

/// Holds the engine between steps while any [`StepHold`] lives (tests and diagnostics: a long step, on demand).
#[derive(Debug, Default)]
struct StepGate {
    holds: Mutex<usize>,
    released: Condvar,
}

impl StepGate {
    fn wait_open(&self) {
        let mut holds = self.holds.lock().unwrap_or_else(|p| p.into_inner());
        while *holds > 0 {
            holds = self.released.wait(holds).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// While it lives, the engine thread does not start another step (see [`EngineHandle::hold_steps`]).
#[derive(Debug)]
pub struct StepHold {
    gate: Arc<StepGate>,
}

impl Drop for StepHold {
    fn drop(&mut self) {
        let mut holds = self.gate.holds.lock().unwrap_or_else(|p| p.into_inner());
        *holds = holds.saturating_sub(1);
        self.gate.released.notify_all();
    }
}

/// A running engine. Cheap to share by reference; [`shutdown`](Self::shutdown) stops it.
#[derive(Debug)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    thread: Option<std::thread::JoinHandle<()>>,
    state: watch::Receiver<EngineStats>,
    gate: Arc<StepGate>,
}

impl EngineHandle {
    /// Moves `engine` onto a thread of its own.
    pub fn start(engine: Engine) -> std::io::Result<EngineHandle> {
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
        // A weak sender: pins outliving every handle do not keep the engine thread alive. A full queue needs no
        // wake-up (the loop drains the queue and reclaims at every step).
        let wake = tx.downgrade();
        engine.unpinned.on_return(move || {
            if let Some(tx) = wake.upgrade() {
                let _ = tx.try_send(Command::Reclaim);
            }
        });
        let (publish, state) = watch::channel(EngineStats::default());
        let gate = Arc::new(StepGate::default());
        let looped = Loop::new(engine, rx, publish, Arc::clone(&gate));
        let thread = std::thread::Builder::new().name("tandem-engine".into()).spawn(move || looped.run())?;
        Ok(EngineHandle { tx, thread: Some(thread), state, gate })
    }

    /// Queues a request; validation errors come back before any compute.
    pub async fn submit(&self, request: Request) -> Result<SeqStream, SubmitError> {
        self.submit_with(request, false, no_blocks(), None).await
    }

    /// Queues a request whose stream ends with the prompt's KV ([`SeqEvent::Exported`]) before `Finished`:
    /// the prefill side of disaggregation (run it with `max_tokens` 1). `tag` names it in [`EngineStats::tags`].
    pub async fn submit_exporting(&self, request: Request, tag: Option<Tag>) -> Result<SeqStream, SubmitError> {
        self.submit_with(request, true, no_blocks(), tag).await
    }

    /// Queues a request together with blocks of its prompt pulled from another worker (full blocks, by position;
    /// blocks already held are skipped), read where they lie: each is copied into a device block and checked
    /// there, then stored and held for the sequence until it runs, so they cannot be evicted before use;
    /// [`SubmitError::Exhausted`] when the device tier has no room for them, [`SubmitError::Transfer`] (and none
    /// kept) when one fails its check. `tag` names it in [`EngineStats::tags`].
    pub async fn submit_with_blocks(
        &self,
        request: Request,
        blocks: impl PulledBlocks + 'static,
        tag: Option<Tag>,
    ) -> Result<SeqStream, SubmitError> {
        self.submit_with(request, false, Box::new(blocks), tag).await
    }

    async fn submit_with(
        &self,
        request: Request,
        export: bool,
        blocks: Box<dyn PulledBlocks>,
        tag: Option<Tag>,
    ) -> Result<SeqStream, SubmitError> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Command::Submit { request: Box::new(request), export, blocks, tag, reply })
            .await
            .map_err(|_| SubmitError::Closed)?;
        answer.await.map_err(|_| SubmitError::Closed)?.map_err(SubmitError::from_engine)
    }

    /// Stores blocks of a prompt pulled from another worker ahead of its request (full blocks, by position; blocks
    /// already held are skipped) as cached blocks, each copied into a device block and checked there: a request
    /// for the prompt soon after finds them as any cached prefix. Nothing holds them meanwhile. Returns how many
    /// were stored; [`SubmitError::Exhausted`] when the device tier has no room, [`SubmitError::Transfer`] (and
    /// none kept) when one fails its check.
    pub async fn import(
        &self,
        namespace: Option<CacheNamespace>,
        tokens: Vec<u32>,
        blocks: impl PulledBlocks + 'static,
    ) -> Result<usize, SubmitError> {
        let (reply, answer) = oneshot::channel();
        let blocks = Box::new(blocks);
        self.tx.send(Command::Import { namespace, tokens, blocks, reply }).await.map_err(|_| SubmitError::Closed)?;
        answer.await.map_err(|_| SubmitError::Closed)?.map_err(SubmitError::from_engine)
    }

    /// How many of `hashes`' leading blocks the engine holds, per tier.
    pub async fn lookup(&self, hashes: Vec<SeqHash>) -> Option<PrefixMatch> {
        let (reply, answer) = oneshot::channel();
        self.tx.send(Command::Lookup { hashes, reply }).await.ok()?;
        answer.await.ok()
    }

    /// Every tier's content as of the newest event.
    pub async fn snapshot(&self) -> Option<Snapshot> {
        let (reply, answer) = oneshot::channel();
        self.tx.send(Command::Snapshot(reply)).await.ok()?;
        answer.await.ok()
    }

    /// KV events after `after`; `Err(TooOld)` when a snapshot is needed instead; `None` when the engine is gone.
    pub async fn events_after(&self, after: Option<EventId>) -> Option<Result<Vec<(EventId, KvEvent)>, TooOld>> {
        let (reply, answer) = oneshot::channel();
        self.tx.send(Command::EventsAfter { after, reply }).await.ok()?;
        answer.await.ok()
    }

    /// The engine's counters and occupancy as of its last step boundary, admission or cancellation; never waits
    /// for the engine thread.
    pub fn stats(&self) -> EngineStats {
        self.state.borrow().clone()
    }

    /// A receiver that sees every newly published [`EngineStats`].
    pub fn watch_stats(&self) -> watch::Receiver<EngineStats> {
        self.state.clone()
    }

    /// Whether the engine thread is still there to take work.
    pub fn is_running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished()) && !self.tx.is_closed()
    }

    /// Keeps the engine from starting another step until the returned hold is dropped, as a long step would: for
    /// tests of everything that must keep answering meanwhile, and for diagnostics.
    pub fn hold_steps(&self) -> StepHold {
        *self.gate.holds.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        StepHold { gate: Arc::clone(&self.gate) }
    }

    /// Stops taking requests, then either lets in-flight sequences finish or cancels them, and waits for the
    /// engine thread to end.
    pub async fn shutdown(mut self, finish_in_flight: bool) {
        let _ = self.tx.send(Command::Shutdown { finish_in_flight }).await;
        if let Some(thread) = self.thread.take() {
            let (done, wait) = oneshot::channel();
            std::thread::spawn(move || {
                let _ = thread.join();
                let _ = done.send(());
            });
            let _ = wait.await;
        }
    }
}

struct Live {
    out: mpsc::Sender<SeqEvent>,
    start: Instant,
    export: bool,
    tag: Option<Tag>,
}

struct Loop {
    engine: Engine,
    rx: mpsc::Receiver<Command>,
    seqs: Vec<Seq>,
    live: Vec<Live>,
    accepting: bool,
    next_index: usize,
    publish: watch::Sender<EngineStats>,
    gate: Arc<StepGate>,
}

impl Loop {
    fn new(
        engine: Engine,
        rx: mpsc::Receiver<Command>,
        publish: watch::Sender<EngineStats>,
        gate: Arc<StepGate>,
    ) -> Loop {
        let mut l =
            Loop { engine, rx, seqs: Vec::new(), live: Vec::new(), accepting: true, next_index: 0, publish, gate };
        l.publish();
        l
    }

    fn run(mut self) {
        loop {
            while let Ok(cmd) = self.rx.try_recv() {
                self.handle(cmd);
            }
            self.publish();
            if self.seqs.is_empty() {
                if !self.accepting {
                    return;
                }
                match self.rx.blocking_recv() {
                    Some(cmd) => self.handle(cmd),
                    None => return,
                }
                continue;
            }
            self.cancel_abandoned();
            self.gate.wait_open();
            self.step();
        }
    }

    /// Makes the current state visible to readers (only wakes them when it changed).
    fn publish(&mut self) {
        let now = self.stats();
        self.publish.send_if_modified(|s| {
            let changed = *s != now;
            *s = now;
            changed
        });
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Snapshot(reply) => {
                let _ = reply.send(self.engine.kv_snapshot());
            }
            Command::EventsAfter { after, reply } => {
                let _ = reply.send(self.engine.kv_events_after(after));
            }
            Command::Import { namespace, tokens, blocks, reply } => {
                let stored = self.engine.import_cached(namespace.as_ref(), &tokens, blocks.as_ref());
                if stored.as_ref().is_ok_and(|&n| n > 0) {
                    self.publish();
                }
                let _ = reply.send(stored);
            }
            Command::Lookup { hashes, reply } => {
                let _ = reply.send(self.engine.lookup(&hashes));
            }
            Command::Submit { request, export, blocks, tag, reply } => {
                let made = if self.accepting {
                    self.engine.prepare(*request, self.next_index, export, blocks.as_ref())
                } else {
                    Err(EngineError::Config("the engine is shutting down".into()))
                };
                self.next_index += 1;
                match made {
                    Ok(seq) => {
                        // Every token, the export, and the last message.
                        let (out, rx) = mpsc::channel(seq.max_new + 2);
                        let live = Live { out, start: Instant::now(), export, tag };
                        let at = super::sequence::enqueue(&mut self.seqs, &mut self.live, seq, live);
                        // Published before the caller hears of it: every state it reads from now on includes it.
                        self.publish();
                        if reply.send(Ok(SeqStream { rx })).is_err() {
                            self.seqs[at].finish = Some(FinishReason::Cancelled);
                        }
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Command::Reclaim => self.engine.reclaim_pinned(),
            Command::Shutdown { finish_in_flight } => {
                self.accepting = false;
                if !finish_in_flight {
                    for s in self.seqs.iter_mut().filter(|s| s.active()) {
                        s.finish = Some(FinishReason::Cancelled);
                    }
                    self.retire_finished();
                }
            }
        }
    }

    fn stats(&self) -> EngineStats {
        let mut stats = self.engine.stats_of(&self.seqs);
        stats.tags = self.seqs.iter().zip(&self.live).filter(|(s, _)| s.active()).filter_map(|(_, l)| l.tag).collect();
        stats.tags.sort_unstable();
        stats
    }

    /// Sequences whose reader is gone are cancelled, and those past their deadline dropped; their blocks are freed
    /// when they retire.
    fn cancel_abandoned(&mut self) {
        let now = Instant::now();
        for (s, l) in self.seqs.iter_mut().zip(&self.live) {
            if s.active() && l.out.is_closed() {
                s.finish = Some(FinishReason::Cancelled);
            } else if s.active() && s.deadline.is_some_and(|d| now >= d) {
                self.engine.expire(s);
            }
        }
        self.retire_finished();
    }

    fn step(&mut self) {
        let mut outbox: Vec<(mpsc::Sender<SeqEvent>, SeqEvent)> = Vec::new();
        let live = &self.live;
        self.engine.step_or_fail(&mut self.seqs, &mut |Event::Token {
                                                           seq,
                                                           token,
                                                           text,
                                                           logprobs,
                                                           prompt_logprobs,
                                                       }| {
            let prompt_logprobs = prompt_logprobs.to_vec();
            let event = SeqEvent::Token { token, text: text.to_string(), logprobs: logprobs.cloned(), prompt_logprobs };
            outbox.push((live[seq].out.clone(), event));
        });
        // Sequences that ended give their blocks back before the state is published, and the state is published
        // before the step's messages go out: a reader that has seen a token, or a sequence's end, sees a state that
        // includes the step which made it (and no blocks of a finished sequence still counted as in use).
        self.retire_into(&mut outbox);
        self.publish();
        for (out, ev) in outbox {
            // Capacity covers every message of the sequence, so this only fails when the reader is gone.
            let _ = out.try_send(ev);
        }
    }

    /// Finished sequences give back their blocks, send their last message and leave.
    fn retire_finished(&mut self) {
        let mut outbox = Vec::new();
        self.retire_into(&mut outbox);
        self.publish();
        for (out, ev) in outbox {
            let _ = out.try_send(ev);
        }
    }

    /// Retires finished sequences: their blocks go back and their last messages (the export, then the end) are
    /// queued on `outbox` for the caller to send.
    fn retire_into(&mut self, outbox: &mut Vec<(mpsc::Sender<SeqEvent>, SeqEvent)>) {
        for (s, l) in take_finished(&mut self.seqs, &mut self.live) {
            let (exported, end) = self.engine.retire(s, l.export, l.start);
            if let Some(kv) = exported {
                outbox.push((l.out.clone(), SeqEvent::Exported(kv)));
            }
            let last = match end {
                Ok(completion) => SeqEvent::Finished(completion),
                Err(Failure::Expired) => SeqEvent::Expired,
                Err(Failure::Error(why)) => SeqEvent::Failed(why),
                Err(Failure::Refused(why)) => SeqEvent::Refused(why),
            };
            outbox.push((l.out, last));
        }
    }
}
