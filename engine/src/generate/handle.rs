//! The engine on its own thread, driven from async code without blocking its runtime.
//!
//! Requests arrive on a bounded command channel; each sequence reports on its own stream whose capacity is its
//! `max_tokens + 1` messages, so the engine never waits for a slow reader and never drops a token. Dropping a
//! [`SeqStream`] cancels its sequence: the engine notices before its next step and frees the blocks.

use std::time::Instant;

use bytes::Bytes;
use kv_cache::events::{EventId, KvEvent, Snapshot, Tier, TooOld};
use kv_cache::pool::{PrefixMatch, TierUsage};
use kv_cache::{CacheNamespace, SeqHash};
use tokio::sync::{mpsc, oneshot};

use super::sequence::Seq;
use super::{Completion, Counters, Engine, EngineError, Event, ExportedKv, FinishReason, Request};

/// Commands waiting for the engine thread; a full queue makes submitters wait (backpressure).
const COMMAND_QUEUE: usize = 1024;

/// What a sequence's stream carries.
#[derive(Clone, Debug, PartialEq)]
pub enum SeqEvent {
    /// A new token and the text it makes safe to show.
    Token { token: u32, text: String },
    /// The sequence is done; the last message on the stream.
    Finished(Completion),
    /// The engine failed the sequence; the last message on the stream.
    Failed(String),
    /// The prompt's KV, sent just before `Finished` when the request asked for it.
    Exported(ExportedKv),
}

/// The engine's state, for load reports and metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub counters: Counters,
    /// Blocks per state, by tier.
    pub usage: [TierUsage; 3],
    /// Sequences holding blocks and taking part in steps.
    pub running: usize,
    /// Sequences waiting to be admitted (new or preempted).
    pub waiting: usize,
    /// Prompt tokens still to compute, over sequences that are not yet decoding (the router's prefill load).
    pub prefill_tokens_pending: usize,
}

/// Why a request was not taken.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error(transparent)]
    Invalid(#[from] EngineError),
    #[error("the engine is shutting down")]
    Closed,
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

enum Command {
    Submit {
        request: Request,
        export: bool,
        reply: oneshot::Sender<Result<SeqStream, EngineError>>,
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
    Import {
        tokens: Vec<u32>,
        namespace: Option<CacheNamespace>,
        blocks: Vec<(usize, Bytes)>,
        reply: oneshot::Sender<Result<usize, EngineError>>,
    },
    Stats(oneshot::Sender<EngineStats>),
    Shutdown {
        finish_in_flight: bool,
    },
}

/// A running engine. Cheap to share by reference; [`shutdown`](Self::shutdown) stops it.
#[derive(Debug)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl EngineHandle {
    /// Moves `engine` onto a thread of its own.
    pub fn start(engine: Engine) -> std::io::Result<EngineHandle> {
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
        let thread =
            std::thread::Builder::new().name("tandem-engine".into()).spawn(move || Loop::new(engine, rx).run())?;
        Ok(EngineHandle { tx, thread: Some(thread) })
    }

    /// Queues a request; validation errors come back before any compute.
    pub async fn submit(&self, request: Request) -> Result<SeqStream, SubmitError> {
        self.submit_with(request, false).await
    }

    /// Queues a request whose stream ends with the prompt's KV ([`SeqEvent::Exported`]) before `Finished`:
    /// the prefill side of disaggregation (run it with `max_tokens` 1).
    pub async fn submit_exporting(&self, request: Request) -> Result<SeqStream, SubmitError> {
        self.submit_with(request, true).await
    }

    async fn submit_with(&self, request: Request, export: bool) -> Result<SeqStream, SubmitError> {
        let (reply, answer) = oneshot::channel();
        self.tx.send(Command::Submit { request, export, reply }).await.map_err(|_| SubmitError::Closed)?;
        answer.await.map_err(|_| SubmitError::Closed)?.map_err(SubmitError::Invalid)
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

    /// Stores blocks pulled from another worker (full blocks of `tokens`, by position) as cached prefix.
    pub async fn import(
        &self,
        tokens: Vec<u32>,
        namespace: Option<CacheNamespace>,
        blocks: Vec<(usize, Bytes)>,
    ) -> Result<usize, SubmitError> {
        let (reply, answer) = oneshot::channel();
        self.tx.send(Command::Import { tokens, namespace, blocks, reply }).await.map_err(|_| SubmitError::Closed)?;
        answer.await.map_err(|_| SubmitError::Closed)?.map_err(SubmitError::Invalid)
    }

    /// The engine's counters and occupancy.
    pub async fn stats(&self) -> Option<EngineStats> {
        let (reply, answer) = oneshot::channel();
        self.tx.send(Command::Stats(reply)).await.ok()?;
        answer.await.ok()
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
}

struct Loop {
    engine: Engine,
    rx: mpsc::Receiver<Command>,
    seqs: Vec<Seq>,
    live: Vec<Live>,
    accepting: bool,
    next_index: usize,
}

impl Loop {
    fn new(engine: Engine, rx: mpsc::Receiver<Command>) -> Loop {
        Loop { engine, rx, seqs: Vec::new(), live: Vec::new(), accepting: true, next_index: 0 }
    }

    fn run(mut self) {
        loop {
            while let Ok(cmd) = self.rx.try_recv() {
                self.handle(cmd);
            }
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
            self.step();
            self.retire_finished();
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Snapshot(reply) => {
                let _ = reply.send(self.engine.kv_snapshot());
            }
            Command::EventsAfter { after, reply } => {
                let _ = reply.send(self.engine.kv_events_after(after));
            }
            Command::Lookup { hashes, reply } => {
                let _ = reply.send(self.engine.lookup(&hashes));
            }
            Command::Import { tokens, namespace, blocks, reply } => {
                let views: Vec<(usize, &[u8])> = blocks.iter().map(|(i, b)| (*i, b.as_ref())).collect();
                let _ = reply.send(self.engine.import(&tokens, namespace.as_ref(), &views));
            }
            Command::Submit { request, export, reply } => {
                let made = if self.accepting {
                    self.engine.new_seq(&request, self.next_index)
                } else {
                    Err(EngineError::Config("the engine is shutting down".into()))
                };
                self.next_index += 1;
                match made {
                    Ok(mut seq) => {
                        seq.keep_blocks = export;
                        // Every token, the export, and the last message.
                        let (out, rx) = mpsc::channel(seq.max_new + 2);
                        if reply.send(Ok(SeqStream { rx })).is_ok() {
                            self.seqs.push(seq);
                            self.live.push(Live { out, start: Instant::now(), export });
                        }
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Command::Stats(reply) => {
                let _ = reply.send(self.stats());
            }
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
        EngineStats {
            counters: self.engine.counters(),
            usage: Tier::ALL.map(|t| self.engine.kv_usage(t)),
            running: self.seqs.iter().filter(|s| s.running).count(),
            waiting: self.seqs.iter().filter(|s| !s.running && s.active()).count(),
            prefill_tokens_pending: self
                .seqs
                .iter()
                .filter(|s| s.active() && s.remaining() > 1)
                .map(Seq::remaining)
                .sum(),
        }
    }

    /// Sequences whose reader is gone are cancelled; their blocks are freed when they retire.
    fn cancel_abandoned(&mut self) {
        for (s, l) in self.seqs.iter_mut().zip(&self.live) {
            if s.active() && l.out.is_closed() {
                s.finish = Some(FinishReason::Cancelled);
            }
        }
        self.retire_finished();
    }

    fn step(&mut self) {
        let live = &self.live;
        let result = self.engine.step(&mut self.seqs, &mut |Event::Token { seq, token, text }| {
            // Capacity covers every message of the sequence, so this only fails when the reader is gone.
            let _ = live[seq].out.try_send(SeqEvent::Token { token, text: text.to_string() });
        });
        let failure = match result {
            Ok(true) => return,
            Ok(false) => self.engine.out_of_capacity().to_string(),
            Err(e) => e.to_string(),
        };
        for (s, l) in self.seqs.iter_mut().zip(&self.live) {
            let _ = self.engine.release_blocks(s);
            s.running = false;
            let _ = l.out.try_send(SeqEvent::Failed(failure.clone()));
        }
        self.seqs.clear();
        self.live.clear();
    }

    /// Finished sequences give back their blocks, send their last message and leave.
    fn retire_finished(&mut self) {
        let mut i = 0;
        while i < self.seqs.len() {
            if self.seqs[i].active() {
                i += 1;
                continue;
            }
            let mut s = self.seqs.swap_remove(i);
            let l = self.live.swap_remove(i);
            if l.export && s.finish != Some(FinishReason::Cancelled) {
                let _ = l.out.try_send(SeqEvent::Exported(self.engine.export(&s)));
            }
            let released = self.engine.release_blocks(&mut s);
            let last = match released {
                Ok(()) => SeqEvent::Finished(s.completion(l.start)),
                Err(e) => SeqEvent::Failed(e.to_string()),
            };
            let _ = l.out.try_send(last);
        }
    }
}
