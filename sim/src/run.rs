//! One simulated run: requests arrive on the workload's schedule, the real `route` picks their workers from the
//! real indexer and load tracker (fed with KV events and load reports after modelled delays), and each worker's
//! real engine steps in virtual time. What the client would have seen comes out as `bench serve` records.

use std::collections::HashMap;
use std::path::PathBuf;

use engine::generate::{Engine, Stepper};
use engine::sampling::{RawSampling, SamplingParams};
use kv_cache::events::{EventId, KvEvent, Snapshot};
use kv_cache::{BlockSize, HashedTokens};
use loadgen::prompt::PromptBuilder;
use loadgen::schedule::Start;
use loadgen::summary::Record;
use loadgen::trace::TraceRequest;
use router::indexer::PrefixIndex;
use router::load::{LoadTracker, Report};
use router::scheduler::RouteState;
use router::scheduler::view::{WorkerId, WorkerRole};

use crate::cores::Cores;
use crate::gate::Gate;
use crate::queue::Queue;
use crate::worker::SimWorker;

mod failover;
mod leases;
mod outcome;
mod replay;
mod routing;
mod settings;
mod stepping;
mod timeouts;
mod transfer;

pub use outcome::{Balance, Outcome, Placed};
use routing::Placement;
pub use settings::{CallTimeouts, Failure, Fault, Settings};

/// Why a run could not start.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("worker engine: {0}")]
    Engine(#[from] engine::generate::EngineError),
    #[error("model: {0}")]
    Model(#[from] engine::text::TextError),
    #[error("{0}")]
    Settings(String),
}

enum Ev {
    Arrive(usize),
    /// Request `i` was given a router slot it waited for.
    Admitted(usize),
    /// Request `i`'s wait for a router slot runs out.
    WaitEnds(usize),
    /// The router has tokenized request `i`.
    Route(usize),
    /// Worker `w`'s step ends, if `turn` is still its current end (shared cores move ends).
    StepEnd {
        w: usize,
        turn: u64,
    },
    Events(usize, Vec<(EventId, KvEvent)>),
    /// A load report from worker `w` on router replica `r`'s stream.
    Report {
        w: usize,
        r: usize,
        report: Report,
    },
    /// Request `r`'s KV has reached its decode worker.
    Pulled(usize),
    /// Worker `w` fails.
    Fail(usize),
    /// Worker `w` hangs; the routers' watchdogs notice its silence later (`Silent`), and its connections close
    /// later still (`Cut`), failing what was sent there, unless it goes on (`Resume`) before; `epoch` names the
    /// hang they follow.
    Hang(usize),
    Silent {
        w: usize,
        epoch: u64,
    },
    Cut {
        w: usize,
        epoch: u64,
    },
    Resume(usize),
    /// Request `i`'s pull from a prefill worker that hung runs out of time.
    PullTimeout(usize),
    /// Worker `w` starts failing every call, and later stops.
    Errors(usize),
    Healed(usize),
    /// Worker `w`'s engine gets stuck, and later computes again.
    Stall(usize),
    Unstall(usize),
    /// Router replica `r` looks whether worker `w`, stuck (`epoch`), has held work without progress for
    /// `stall_after`.
    StallCheck {
        w: usize,
        r: usize,
        epoch: u64,
    },
    /// Router replica `r` sees worker `w` compute again.
    StallCleared {
        w: usize,
        r: usize,
    },
    /// Worker `w` comes back.
    Back(usize),
    /// Request `i`'s deadline: the request timeout since it was routed.
    Deadline(usize),
    /// Request `i`'s call number `call` may have waited too long: for its first answer, or (`idle`) for its
    /// stream's next token (`timeouts`).
    CallTimer {
        i: usize,
        call: u32,
        idle: bool,
    },
}

#[derive(Default)]
struct Live {
    /// The router replica that took it.
    router: usize,
    /// It holds one of its router's slots, until it finishes.
    slot: bool,
    /// It waits for one.
    waiting: bool,
    /// The worker its current attempt runs on (its prefill worker while prefilling, then its decode worker);
    /// `None` before it is routed and after it ends.
    on: Option<usize>,
    /// Its decode attempt starts with a pull (`Ev::Pulled` to come).
    pulling: bool,
    /// When the decode worker started that pull.
    pull_since: f64,
    /// That pull's data came while its prefill worker hung: it ends when the worker goes on (or times out).
    pull_stalled: bool,
    /// Tokens its current decode attempt made (the router's accounting learns of the first).
    attempt_tokens: u32,
    /// The calls the router made for it so far (its timers name the call they were set for).
    call: u32,
    /// What its failover needs, in every run: a prefill refused for want of lease room goes to the next candidate
    /// whether or not the run has failures.
    retries: Option<Box<failover::Retries>>,
    /// The prefill worker holding room for its prompt's KV, and how many blocks (`leases`).
    lease: Option<(usize, u64)>,
    /// Prompt tokens.
    isl: usize,
    /// The prompt, hashed once for the router and the engines alike; it moves to the engine that runs it last.
    prompt: Option<HashedTokens>,
    clipped: bool,
    max_tokens: u32,
    arrival: f64,
    prefill: Option<usize>,
    decode: usize,
    /// The first token (made by the prefill worker when disaggregated).
    first_token: Option<u32>,
    first_at: Option<f64>,
    last_at: Option<f64>,
    gaps: Vec<f64>,
    produced: u64,
    cached: usize,
    /// From the transfer's start until the decode worker's engine takes them: the prompt's KV from its prefill
    /// worker, and the positions of the blocks its decode worker pulls (the full blocks it does not hold).
    pull: Option<(engine::generate::ExportedKv, std::ops::Range<usize>)>,
}

/// What a worker is asked to run for a request: its prompt (`None` when it was lost, which fails the request), how
/// many tokens to make, whether to keep the prompt's KV for export, and whether it comes with the blocks its
/// decode worker pulled (the request's `pull`, which the engine copies in as it takes the request).
pub(crate) struct Job {
    pub(crate) i: usize,
    prompt: Option<HashedTokens>,
    max_tokens: u32,
    export: bool,
    pulled: bool,
}

/// One router replica's own state.
struct Replica {
    index: PrefixIndex,
    load: LoadTracker,
    state: RouteState,
    /// When each tokenizer slot is free.
    tokenizers: Vec<f64>,
    gate: Gate,
    /// Retries and failovers allowed (the real router's budget, on the virtual clock).
    budget: router::resilience::RetryBudget,
    /// Each worker's circuit breaker (the real router's, on the virtual clock): ejected workers are left out.
    breakers: Vec<router::resilience::Breaker>,
    /// Each worker found stalled (its engine computed nothing while it held work), until it computes again.
    stalled: Vec<bool>,
}

/// The workers, the routers' state, and the requests in flight.
struct Sim<'a> {
    settings: &'a Settings,
    workload: &'a [TraceRequest],
    /// Later turns waiting on request `i`: (turn, delay seconds).
    followers: Vec<Vec<(usize, f64)>>,
    prompts: PromptBuilder,
    block_size: BlockSize,
    workers: Vec<SimWorker>,
    routers: Vec<Replica>,
    queue: Queue<Ev>,
    /// The host's shared cores (`Settings::host_cores`), when the workers share some.
    cores: Option<Cores>,
    live: Vec<Live>,
    out: Outcome,
    /// When the latest response ended.
    last_response: f64,
    /// The failures to come, resolved to workers (queued when the run starts).
    failures: Vec<(f64, Ev)>,
    /// What virtual time 0 stands for in the retry budget, which only compares instants with each other.
    origin: std::time::Instant,
    /// The model and its vocabulary, for a worker that comes back.
    text: std::sync::Arc<engine::text::TextModel>,
    words: std::sync::Arc<[u32]>,
    /// What the engines of workers that came back computed before they failed: prompt tokens, cached tokens by tier.
    retired: (u64, [u64; 3]),
    /// In a replay, the simulated worker for each worker the recording names.
    recorded: HashMap<String, usize>,
    /// The workers' disk tiers live here for the run (removed at its end).
    _disk: Option<ScratchDir>,
}

/// A directory of the run's own, removed when dropped.
struct ScratchDir(PathBuf);

impl ScratchDir {
    /// A fresh directory under the system's temporary directory, unique to this process and run (runs of one
    /// search go on in parallel).
    fn new() -> Result<ScratchDir, SimError> {
        static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("tandem-sim-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| SimError::Settings(format!("{}: {e}", dir.display())))?;
        Ok(ScratchDir(dir))
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `workload` (with its `starts`, from `loadgen::schedule::plan`) through a simulated cluster.
pub fn simulate(settings: &Settings, workload: &[TraceRequest], starts: &[Start]) -> Result<Outcome, SimError> {
    if settings.decode == 0 {
        return Err(SimError::Settings("the cluster needs at least one decode worker".into()));
    }
    let t = settings.timeouts;
    if !(t.prefill > 0.0 && t.decode_idle > 0.0 && t.prefill.is_finite() && t.decode_idle.is_finite()) {
        return Err(SimError::Settings("the router's prefill and decode idle timeouts must be above 0 s".into()));
    }
    if workload.len() != starts.len() {
        return Err(SimError::Settings("one start per request".into()));
    }
    let mut sim = Sim::new(settings, workload)?;
    let mut arrivals = Vec::new();
    for (i, s) in starts.iter().enumerate() {
        match *s {
            Start::At(ms) => arrivals.push((ms / 1000.0, Ev::Arrive(i))),
            Start::After { prev, delay_ms } => sim.followers[prev].push((i, delay_ms / 1000.0)),
            Start::Slot => return Err(SimError::Settings("closed-loop schedules are not simulated".into())),
        }
    }
    arrivals.append(&mut sim.failures);
    sim.queue.up_front(arrivals);
    while let Some((at, ev)) = sim.queue.pop() {
        // The end of a wait that ended with a slot, the deadline of a request that ended: nothing happens then.
        match ev {
            Ev::WaitEnds(i) if !sim.live[i].waiting => continue,
            Ev::Deadline(i) if sim.live[i].on.is_none() => continue,
            _ => {}
        }
        sim.handle(at, ev);
    }
    let first = sim.live.iter().map(|l| l.arrival).fold(f64::INFINITY, f64::min);
    sim.out.duration_s = if first.is_finite() { sim.last_response - first } else { 0.0 };
    (sim.out.prefill_tokens_computed, sim.out.cached_tokens_by_tier) = sim.retired;
    for w in &sim.workers {
        let c = w.engine.engine().counters();
        sim.out.prefill_tokens_computed += c.prefill_tokens;
        for t in 0..3 {
            sim.out.cached_tokens_by_tier[t] += c.cached_tokens[t];
        }
    }
    // Decode steps compute one token per sequence too: what counts as prefill work is prompt tokens.
    let decoded: u64 = sim.out.records.iter().map(|r| r.output_tokens.saturating_sub(1)).sum();
    sim.out.prefill_tokens_computed = sim.out.prefill_tokens_computed.saturating_sub(decoded);
    sim.out.records.sort_by_key(|r| r.index);
    Ok(sim.out)
}

impl<'a> Sim<'a> {
    fn new(settings: &'a Settings, workload: &'a [TraceRequest]) -> Result<Sim<'a>, SimError> {
        let block_size = BlockSize::new(settings.engine.block_tokens as u32)
            .ok_or_else(|| SimError::Settings("block_tokens must be at least 1".into()))?;
        let mut workers = Vec::new();
        let roles = std::iter::repeat_n(WorkerRole::Prefill, settings.prefill)
            .chain(std::iter::repeat_n(WorkerRole::Decode, settings.decode));
        let replicas = settings.routers.max(1);
        // One read of the model's vocabulary for every worker.
        let text = std::sync::Arc::new(engine::text::TextModel::open(&settings.model)?);
        // A disk tier is real files, as on a worker: each worker gets a directory of this run's own.
        let disk = (settings.engine.disk_blocks > 0).then(ScratchDir::new).transpose()?;
        let words = text.tokenizer().plain_words();
        let shared_words: std::sync::Arc<[u32]> = words.as_slice().into();
        for (i, role) in roles.enumerate() {
            let mut config = settings.engine.clone();
            config.disk_dir = disk.as_ref().map(|d| d.0.join(format!("worker-{i}")));
            // Every publish takes all of a worker's new events out of its log, so an unbounded log holds one
            // step's worth at most and never drops one unread.
            config.replay_events = usize::MAX;
            if let (WorkerRole::Prefill, false, engine::generate::BackendChoice::Mock(mock)) =
                (role, settings.prefill_speedups.is_empty(), &mut config.backend)
            {
                mock.speedup *= settings.prefill_speedups[i % settings.prefill_speedups.len()];
            }
            let engine =
                Engine::open_mock(std::sync::Arc::clone(&text), std::sync::Arc::clone(&shared_words), config.clone())?;
            let name = match role {
                WorkerRole::Prefill => format!("prefill-{i}"),
                _ => format!("decode-{}", i - settings.prefill),
            };
            workers.push(SimWorker::new(WorkerId(i as u32), name, role, Stepper::new(engine), replicas, config));
        }
        let recorded = if settings.replay { replay::recorded_names(settings, workload)? } else { HashMap::new() };
        let mut failures = Vec::new();
        for f in &settings.failures {
            let w = workers.iter().position(|w| w.name == f.worker).ok_or_else(|| {
                SimError::Settings(format!("no worker {} to fail (the workers are prefill-K and decode-K)", f.worker))
            })?;
            if !(f.at.is_finite() && f.at >= 0.0) {
                return Err(SimError::Settings(format!("{}: a failure's time must be >= 0 s", f.worker)));
            }
            failures.push((
                f.at,
                match f.fault {
                    Fault::Crash => Ev::Fail(w),
                    Fault::Hang => Ev::Hang(w),
                    Fault::Errors => Ev::Errors(w),
                    Fault::Stall => Ev::Stall(w),
                },
            ));
            if let Some(back) = f.back {
                // Its messages from before the failure have all landed by then.
                let landed = f.at + settings.event_delay.max(settings.report_delay);
                if !(back.is_finite() && back > landed) {
                    let why = format!("{}: it comes back at {back} s, not after it fails at {} s", f.worker, f.at);
                    return Err(SimError::Settings(why));
                }
                let back_event = match f.fault {
                    Fault::Errors => Ev::Healed(w),
                    Fault::Stall => Ev::Unstall(w),
                    Fault::Hang => Ev::Resume(w),
                    Fault::Crash => Ev::Back(w),
                };
                failures.push((back, back_event));
            }
        }
        let routers = (0..replicas)
            .map(|r| {
                let mut index = PrefixIndex::with_capacity(index_capacity(settings, workload, workers.len()));
                for w in &workers {
                    index.replace(w.id, &Snapshot { as_of: None, tiers: Default::default() });
                }
                let state = RouteState::seeded(settings.seed.wrapping_add(r as u64));
                Replica {
                    index,
                    load: LoadTracker::new(),
                    state,
                    tokenizers: vec![0.0; settings.router_slots.max(1)],
                    gate: Gate::new(settings.admission),
                    budget: Default::default(),
                    breakers: vec![Default::default(); workers.len()],
                    stalled: vec![false; workers.len()],
                }
            })
            .collect();
        Ok(Sim {
            settings,
            workload,
            followers: vec![Vec::new(); workload.len()],
            prompts: PromptBuilder::new(words, settings.trace_block),
            block_size,
            workers,
            routers,
            queue: Queue::new(),
            cores: (settings.host_cores > 0)
                .then(|| Cores::new(settings.host_cores, settings.prefill + settings.decode)),
            live: (0..workload.len()).map(|_| Live::default()).collect(),
            out: Outcome { placements: vec![None; workload.len()], ..Outcome::default() },
            last_response: 0.0,
            failures,
            text,
            words: shared_words,
            retired: (0, [0; 3]),
            origin: std::time::Instant::now(),
            recorded,
            _disk: disk,
        })
    }

    fn handle(&mut self, now: f64, ev: Ev) {
        match ev {
            Ev::Arrive(i) => self.arrive(now, i),
            Ev::Admitted(i) => self.tokenize(now, i),
            Ev::WaitEnds(i) => {
                self.live[i].waiting = false;
                self.routers[self.live[i].router].gate.expire(i);
                *self.out.decisions.entry("deadline".into()).or_default() += 1;
                let error = "the request waited for a router slot until its deadline".to_string();
                self.finish(now, i, 504, Some(error), None);
            }
            Ev::Route(i) => self.route(now, i),
            Ev::StepEnd { w, turn } => self.step_end(now, w, turn),
            // A failed worker's messages on their way stop with it.
            Ev::Events(w, _) | Ev::Report { w, .. } if self.workers[w].down => {}
            Ev::Events(w, events) => {
                for replica in &mut self.routers {
                    // In order and gapless by construction: nothing to resync.
                    let _ = replica.index.apply_all(WorkerId(w as u32), &events);
                }
            }
            Ev::Report { w, r, report } => self.routers[r].load.report(WorkerId(w as u32), report),
            Ev::Pulled(i) => self.pulled(now, i),
            Ev::Fail(w) => self.fail_worker(now, w),
            Ev::Hang(w) => self.hang_worker(now, w),
            Ev::Silent { w, epoch } => self.worker_silent(now, w, epoch),
            Ev::Cut { w, epoch } => self.connection_cut(now, w, epoch),
            Ev::Resume(w) => self.worker_resumed(now, w),
            Ev::PullTimeout(i) => self.pull_timed_out(now, i),
            Ev::Errors(w) => self.worker_errs(now, w),
            Ev::Healed(w) => self.workers[w].erring = false,
            Ev::Stall(w) => self.worker_stuck(now, w),
            Ev::Unstall(w) => self.worker_unstuck(now, w),
            Ev::StallCheck { w, r, epoch } => self.stall_check(now, w, r, epoch),
            Ev::StallCleared { w, r } => self.routers[r].stalled[w] = false,
            Ev::Back(w) => self.worker_back(now, w),
            Ev::Deadline(i) => self.deadline(now, i),
            Ev::CallTimer { i, call, idle } => self.call_timer(now, i, call, idle),
        }
    }

    fn sampling(&self, i: usize, max_tokens: u32) -> SamplingParams {
        let raw = RawSampling {
            max_tokens,
            ignore_eos: true,
            // Nobody reads the text: the records count tokens.
            detokenize: false,
            seed: Some(self.settings.seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)),
            ..RawSampling::default()
        };
        SamplingParams::new(raw).unwrap_or_else(|_| {
            SamplingParams::greedy(std::num::NonZeroU32::new(max_tokens.max(1)).unwrap_or(std::num::NonZeroU32::MIN))
        })
    }

    /// Request `i`'s deadline passed: the router answers 504 and gives up its work, which its worker's engine drops
    /// between steps (a request sent during the step never reaches it); a lease on its prompt's KV ends.
    fn deadline(&mut self, now: f64, i: usize) {
        let Some(w) = self.live[i].on else { return };
        self.routers[self.live[i].router].load.done(WorkerId(w as u32), i as u64);
        self.drop_from(now, w, i);
        self.end_pull(now, i);
        *self.out.decisions.entry("deadline".into()).or_default() += 1;
        let timeout = self.routers[self.live[i].router].gate.timeout();
        self.finish(now, i, 504, Some(format!("the request ran past its deadline ({timeout} s)")), None);
    }

    /// Request `i` ended: its record, and the session turns that wait for it.
    fn finish(&mut self, now: f64, i: usize, status: u16, error: Option<String>, finish: Option<&str>) {
        // However it ended, the router forgets it on its decode worker (reserved there at the decision, or sent).
        let (router, decode) = (self.live[i].router, self.live[i].decode);
        self.routers[router].load.done(WorkerId(decode as u32), i as u64);
        // A lease nobody will pull (the answer ended at the first token, or the request failed) ends with it.
        self.release_lease(i);
        // What a finished request no longer needs goes (a whole trace's prompts would not fit in memory); its
        // gaps move into the record.
        let gaps = std::mem::take(&mut self.live[i].gaps);
        let live = &self.live[i];
        let r = &self.workload[i];
        let ttft = live.first_at.map(|f| (f - live.arrival) * 1000.0);
        let latency = (now - live.arrival) * 1000.0;
        let tpot = match (ttft, live.produced) {
            (Some(t), n) if n >= 2 => Some((latency - t) / (n - 1) as f64),
            _ => None,
        };
        let at_ms = live.arrival * 1000.0;
        self.last_response = self.last_response.max(now);
        self.out.records.push(Record {
            index: i,
            scheduled_ms: at_ms,
            sent_ms: at_ms,
            status,
            error,
            time_to_first_token_ms: ttft,
            request_latency_ms: latency,
            time_per_output_token_ms: tpot,
            output_tokens: live.produced,
            prompt_tokens: live.isl as u64,
            cached_tokens: live.cached as u64,
            input_length: r.input_length,
            clipped: live.clipped,
            finish_reason: finish.map(str::to_string),
            inter_chunk_ms: gaps,
        });
        let live = &mut self.live[i];
        live.prompt = None;
        (live.on, live.pulling, live.retries) = (None, false, None);
        // Its router slot goes to the request waiting longest, which goes on as an event of its own (a chain of
        // refusals would otherwise recurse).
        if std::mem::take(&mut live.slot)
            && let Some(next) = self.routers[router].gate.leave()
        {
            (self.live[next].slot, self.live[next].waiting) = (true, false);
            self.queue.at(now, Ev::Admitted(next));
        }
        for (next, delay) in std::mem::take(&mut self.followers[i]) {
            self.queue.at(now + delay, Ev::Arrive(next));
        }
    }
}

/// Blocks the router index may hold at once: every block the workers can hold, or every block the workload can
/// make when that is fewer. Sized so, the index is never rebuilt as the run fills it, and a short run does not
/// take (and the kernel clear) a table for a whole cluster.
fn index_capacity(settings: &Settings, workload: &[TraceRequest], workers: usize) -> usize {
    let e = &settings.engine;
    let held = workers * (e.kv_blocks + e.host_blocks + e.disk_blocks);
    let made: usize = workload.iter().map(|r| (r.input_length + r.output_length) / e.block_tokens.max(1)).sum();
    held.min(made)
}
