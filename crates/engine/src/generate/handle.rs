//! The engine on its own thread, driven from async code without blocking its runtime.
//!
//! Requests arrive on a bounded command channel; each sequence reports on its own stream whose capacity is its
//! `max_tokens + 1` messages, so the engine never waits for a slow reader and never drops a token. Dropping a
//! [`SeqStream`] cancels its sequence: the engine notices before its next step and frees the blocks.

use std::time::Instant;

use kv_cache::events::Tier;
use kv_cache::pool::TierUsage;
use tokio::sync::{mpsc, oneshot};

use super::sequence::Seq;
use super::{Completion, Counters, Engine, EngineError, Event, FinishReason, Request};

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
    Submit { request: Request, reply: oneshot::Sender<Result<SeqStream, EngineError>> },
    Stats(oneshot::Sender<EngineStats>),
    Shutdown { finish_in_flight: bool },
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
        let (reply, answer) = oneshot::channel();
        self.tx.send(Command::Submit { request, reply }).await.map_err(|_| SubmitError::Closed)?;
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
            Command::Submit { request, reply } => {
                let made = if self.accepting {
                    self.engine.new_seq(&request, self.next_index)
                } else {
                    Err(EngineError::Config("the engine is shutting down".into()))
                };
                self.next_index += 1;
                match made {
                    Ok(seq) => {
                        let (out, rx) = mpsc::channel(seq.max_new + 1);
                        if reply.send(Ok(SeqStream { rx })).is_ok() {
                            self.seqs.push(seq);
                            self.live.push(Live { out, start: Instant::now() });
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
            let released = self.engine.release_blocks(&mut s);
            let last = match released {
                Ok(()) => SeqEvent::Finished(s.completion(l.start)),
                Err(e) => SeqEvent::Failed(e.to_string()),
            };
            let _ = l.out.try_send(last);
        }
    }
}
