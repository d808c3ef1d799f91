//! One simulated run: requests arrive on the workload's schedule, the real `route` picks their workers from the
//! real indexer and load tracker (fed with KV events and load reports after modelled delays), and each worker's
//! real engine steps in virtual time. What the client would have seen comes out as `bench serve` records.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use engine::generate::{Engine, EngineConfig, Output, Stepper};
use engine::sampling::{RawSampling, SamplingParams};
use kv_cache::events::{EventId, KvEvent, Snapshot};
use kv_cache::{BlockSize, HashedTokens, SeqHash};
use loadgen::prompt::PromptBuilder;
use loadgen::schedule::Start;
use loadgen::summary::Record;
use loadgen::trace::TraceRequest;
use router::indexer::PrefixIndex;
use router::load::{LoadTracker, Report};
use router::scheduler::config::SchedulerConfig;
use router::scheduler::view::{RouteRequest, WorkerId, WorkerRole, WorkerView};
use router::scheduler::{Candidates, RouteError, RouteState, route};

use crate::cores::Cores;
use crate::gate::{Arrival, Gate, Limits};
use crate::queue::Queue;
use crate::worker::SimWorker;

mod failover;
mod leases;
mod replay;

/// What the simulator models beyond the engine's own steps.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// The model file: its tokenizer gives the vocabulary the prompts and outputs are drawn from.
    pub model: PathBuf,
    pub prefill: usize,
    pub decode: usize,
    /// Every worker's engine (a mock backend in virtual time).
    pub engine: EngineConfig,
    /// A heterogeneous prefill pool: prefill worker k runs its profile sped up by entry `k % len` (2: twice as
    /// fast, 0.5: half as fast); empty: all alike.
    pub prefill_speedups: Vec<f64>,
    pub scheduler: SchedulerConfig,
    /// From a worker's step to the router applying its KV events.
    pub event_delay: f64,
    /// From a worker's state change to the router reading its load report.
    pub report_delay: f64,
    /// Modelled KV transfer: latency, bandwidth, and bytes per block (the modelled model's, not the stand-in's).
    pub transfer_latency: f64,
    pub transfer_bandwidth: f64,
    pub transfer_block_bytes: u64,
    /// Tokens per trace block id (Mooncake: 512).
    pub trace_block: usize,
    /// Longest prompt: longer ones are cut (and counted).
    pub max_isl: usize,
    /// Router replicas: requests are spread over them in turn; each has its own index, load reports and
    /// accounting of what it sent (none sees what the others sent).
    pub routers: usize,
    /// Route every request as its router recording says (the trace's `recorded` decisions, workers matched by
    /// name) instead of by the scheduler: what the recorded decisions would have done here.
    pub replay: bool,
    /// The router's tokenizer: prompt tokens per second per slot (0: routing is instant), and slots per router
    /// replica. A request is routed once tokenized; its TTFT counts from its arrival.
    pub router_tokens_per_s: f64,
    pub router_slots: usize,
    /// The cores every worker shares (one host, one compute thread per worker, as `tandem up` on a small
    /// machine runs them): while `k` workers compute, each step advances at `min(1, cores / k)` of its modelled
    /// speed (processor sharing, `cores`). 0: each worker has its own hardware (a GPU each).
    pub host_cores: usize,
    /// The router streams a long prompt's KV while it computes (`router::stream_kv`): the decode worker pulls the
    /// prompt's leading pieces during the prefill, and only the last piece's blocks after it. (The round trips
    /// between pieces, and the step a busy prefill worker runs in each, are not modelled.)
    pub stream_kv: bool,
    /// Each router replica's admission control (the router's `max_in_flight`, `max_queue` and request timeout).
    pub admission: Limits,
    /// Workers that fail, by name, and when (virtual seconds): from then on a worker computes and reports nothing,
    /// and the routers fail its requests over as the real one does ([`failover`]).
    pub failures: Vec<Failure>,
    /// Seconds a worker may hold work without computing before the routers count it stalled (the router's
    /// `stall_after_ms`; 0: never).
    pub stall_after: f64,
    /// Each placement keeps its decision's candidates as scored ([`Placed::candidates`]): to compare the
    /// simulated router's inputs with a real router's recording of them.
    pub record_candidates: bool,
    pub seed: u64,
}

/// A worker that fails during the run, and may come back.
#[derive(Clone, Debug, PartialEq)]
pub struct Failure {
    /// Its name (`prefill-K` or `decode-K`).
    pub worker: String,
    /// Virtual seconds, on the workload's clock.
    pub at: f64,
    /// When it comes back (a new process: an empty cache, its share of requests ramped up over the scheduler's
    /// `slow_start_secs`).
    pub back: Option<f64>,
    pub fault: Fault,
}

/// How a worker fails ([`failover`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fault {
    /// Its process dies: its connections break, and the routers know at once.
    #[default]
    Crash,
    /// Its process stops (a frozen host, a paused VM, a partition) with its connections open, so the routers learn
    /// of it only through their timeouts. Such a worker does not come back here.
    Hang,
    /// It answers every call at once with an error (a broken device), while its streams go on: the routers still
    /// see it up, idle, holding its cache, and only their circuit breakers keep requests away.
    Errors,
    /// Its engine hangs (a hung device) while its process answers and reports: no step ends until it is unstuck.
    /// The routers find it stalled once it has held work for `stall_after` without computing anything.
    Stall,
}

/// What a run produced.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outcome {
    pub records: Vec<Record>,
    /// Prompt tokens the engines computed (prefill work, recomputation after preemption included).
    pub prefill_tokens_computed: u64,
    /// Prompt tokens served from each tier's cache (device, host, disk).
    pub cached_tokens_by_tier: [u64; 3],
    /// Modelled KV bytes moved between workers.
    pub transfer_bytes: u64,
    /// Routing decisions by reason (refusals by their kind).
    pub decisions: BTreeMap<String, u64>,
    /// Requests each worker prefilled or decoded, by worker name.
    pub per_worker: BTreeMap<String, u64>,
    /// Virtual seconds from the first arrival to the last response.
    pub duration_s: f64,
    /// Every request's prompt (length and block hashes) in the order they arrived: what the references of
    /// [`crate::oracle`] replay.
    pub arrivals: Vec<crate::oracle::Prompt>,
    /// Balance at each arrival: per pool (prefill, decode), the spread (most minus fewest) of requests each
    /// worker actually holds, and its coefficient of variation.
    pub balance: Balance,
    /// At each arrival (virtual seconds), the requests each worker held (running and waiting), in worker order.
    pub queues: Vec<(f64, Vec<u32>)>,
    /// Per request (by index): the workers it went to, by name; `None` when it was refused.
    pub placements: Vec<Option<Placed>>,
}

/// Where a request went.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Placed {
    /// The prefill worker, when the request was disaggregated.
    pub prefill: Option<String>,
    pub decode: String,
    /// How much cheaper the worker that computed the prompt was than the next best (0: a tie broken at random;
    /// `None` in a replay, or without a rival).
    pub margin: Option<f64>,
    /// The decision's candidates as scored, with [`Settings::record_candidates`] (never in a replay).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub candidates: Option<Candidates>,
}

/// Where a request goes, as indices of the simulated workers.
struct Placement {
    /// The prefill worker when disaggregated.
    prefill: Option<usize>,
    decode: usize,
    reason: String,
    margin: Option<f64>,
    candidates: Option<Candidates>,
    /// The prefill candidates in the order the router tries them, each with the blocks it held, and the decode
    /// worker's held blocks ([`failover::Retries`]); `None` for a recorded decision without its candidates.
    retry_order: Option<(Vec<(usize, u64)>, u64)>,
}

/// How evenly the work was spread, sampled at every arrival (what herding shows in).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Balance {
    pub prefill_spread_mean: f64,
    pub prefill_spread_max: u64,
    pub prefill_cv_mean: f64,
    pub decode_spread_mean: f64,
    pub decode_spread_max: u64,
    pub decode_cv_mean: f64,
    /// Arrivals sampled.
    pub samples: u64,
}

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
    /// later still (`Cut`), failing what was sent there.
    Hang(usize),
    Silent(usize),
    Cut(usize),
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
    /// Tokens its current decode attempt made (the router's accounting learns of the first).
    attempt_tokens: u32,
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
            if f.fault == Fault::Hang && f.back.is_some() {
                return Err(SimError::Settings(format!("{}: a worker that hangs does not come back", f.worker)));
            }
            if f.fault == Fault::Stall && (settings.stall_after.is_nan() || settings.stall_after <= 0.0) {
                // Only the router's prefill and decode idle timeouts would catch it then, which are not modelled.
                let why = format!(
                    "{}: a stalled engine needs a stall limit above 0 (the router's timeouts that would \
                                   catch it without one are not modelled)",
                    f.worker
                );
                return Err(SimError::Settings(why));
            }
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
                    Fault::Crash | Fault::Hang => Ev::Back(w),
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
            Ev::Silent(w) => self.worker_silent(now, w),
            Ev::Cut(w) => self.connection_cut(now, w),
            Ev::PullTimeout(i) => self.pull_timed_out(now, i),
            Ev::Errors(w) => self.worker_errs(now, w),
            Ev::Healed(w) => self.workers[w].erring = false,
            Ev::Stall(w) => self.worker_stuck(now, w),
            Ev::Unstall(w) => self.worker_unstuck(now, w),
            Ev::StallCheck { w, r, epoch } => self.stall_check(now, w, r, epoch),
            Ev::StallCleared { w, r } => self.routers[r].stalled[w] = false,
            Ev::Back(w) => self.worker_back(now, w),
            Ev::Deadline(i) => self.deadline(now, i),
        }
    }

    fn view(&self, r: usize, hashes: &[SeqHash], now: f64) -> Vec<WorkerView> {
        let slow_start = self.settings.scheduler.slow_start_secs;
        let Replica { index, load, .. } = &self.routers[r];
        let overlap = index.overlap(hashes);
        let capacity = self.settings.engine.kv_blocks as u64;
        self.workers
            .iter()
            .enumerate()
            .filter(|&(k, _)| self.routable(now, r, k))
            .map(|(_, w)| w)
            .map(|w| WorkerView {
                id: w.id,
                name: w.name.clone(),
                role: w.role,
                overlap: overlap.get(&w.id).copied().unwrap_or_default(),
                active_overlap: load.active_overlap(w.id, hashes),
                load: load.load(w.id, capacity),
                // As the router ramps a worker that joined: one that came back after a failure (the others have
                // been up since before the run).
                ramp: if slow_start > 0.0 { ((now - w.joined) / slow_start).clamp(0.05, 1.0) } else { 1.0 },
                max_num_batched_tokens: self.settings.engine.max_batched_tokens as u64,
                block_bytes: self.settings.transfer_block_bytes,
                speed: load.speed(w.id),
                predicted: false,
            })
            .collect()
    }

    /// Request `i` reaches its router replica: past the replica's admission control (at once, after a wait for a
    /// slot, or refused), then routed once the router has tokenized it.
    fn arrive(&mut self, now: f64, i: usize) {
        let r = &self.workload[i];
        // Room for the output: the engine's sequence takes this vector over.
        let prompt = self.prompt(i, r.output_length.clamp(1, 2048));
        let hashed = HashedTokens::new(prompt.tokens, self.block_size, None);
        let router = i % self.routers.len();
        let live = &mut self.live[i];
        live.router = router;
        live.max_tokens = r.output_length.max(1) as u32;
        live.arrival = now;
        live.clipped = prompt.clipped;
        live.isl = hashed.tokens().len();
        self.out.arrivals.push(crate::oracle::Prompt { tokens: live.isl, blocks: hashed.hashes().seq.clone() });
        live.prompt = Some(hashed);
        match self.routers[router].gate.arrive(i) {
            Arrival::Admitted => {
                self.live[i].slot = true;
                self.tokenize(now, i);
            }
            Arrival::Queued => {
                self.live[i].waiting = true;
                let timeout = self.routers[router].gate.timeout();
                self.queue.at_in_order(now + timeout, Ev::WaitEnds(i));
            }
            Arrival::Refused => {
                *self.out.decisions.entry("overloaded".into()).or_default() += 1;
                self.finish(now, i, 429, Some("the router's queue is full".into()), None);
            }
        }
    }

    /// Request `i`'s prompt, cut to leave room for its output within `max_isl`, in a vector with room for `room`
    /// more tokens.
    fn prompt(&self, i: usize, room: usize) -> loadgen::prompt::Prompt {
        let r = &self.workload[i];
        let max_isl = self.settings.max_isl.saturating_sub(r.output_length.max(1)).max(1);
        self.prompts.prompt_with_room(r, i, Some(max_isl), room)
    }

    /// Request `i`, holding a router slot, is routed once the router has tokenized it (at once when the tokenizer
    /// is not modelled).
    fn tokenize(&mut self, now: f64, i: usize) {
        let router = self.live[i].router;
        let rate = self.settings.router_tokens_per_s;
        if rate > 0.0 {
            // The replica's first free tokenizer slot takes it.
            let slots = &mut self.routers[router].tokenizers;
            let slot = (0..slots.len()).min_by(|&a, &b| slots[a].total_cmp(&slots[b])).unwrap_or(0);
            let done = now.max(slots[slot]) + self.live[i].isl as f64 / rate;
            slots[slot] = done;
            self.queue.at(done, Ev::Route(i));
        } else {
            self.route(now, i);
        }
    }

    /// Routes request `i`: the real scheduler over this replica's view (or the recorded decision), then starts it.
    fn route(&mut self, now: f64, i: usize) {
        let router = self.live[i].router;
        let cfg = &self.settings.scheduler;
        let bs = self.block_size.tokens() as u64;
        let req = RouteRequest::new(self.live[i].isl as u64, bs, self.hashes(i), cfg.prefix_hash_blocks);
        self.sample_balance(now);
        let views = self.view(router, self.hashes(i), now);
        let placed = if self.settings.replay {
            self.replayed(i)
        } else {
            let explain = self.settings.record_candidates;
            route(&req, &views, cfg, &mut self.routers[router].state).map(|d| Placement {
                margin: d.prefill_margin(),
                candidates: explain.then(|| d.candidates()),
                retry_order: Some(failover::retry_order(&d)),
                prefill: d.prefill.filter(|_| d.disaggregate).map(|c| c.id.0 as usize),
                decode: d.decode.id.0 as usize,
                reason: d.reason.as_str().to_string(),
            })
        };
        let mut placed = match placed {
            Ok(p) => p,
            Err(e) => return self.refuse(now, i, e),
        };
        *self.out.decisions.entry(placed.reason.clone()).or_default() += 1;
        self.out.placements[i] = Some(Placed {
            prefill: placed.prefill.map(|p| self.workers[p].name.clone()),
            decode: self.workers[placed.decode].name.clone(),
            margin: placed.margin,
            candidates: placed.candidates.take(),
        });
        self.start(now, i, &placed, &views);
    }

    /// Adds the current spread of work over each pool's workers to the balance figures.
    fn sample_balance(&mut self, now: f64) {
        let held: Vec<u32> = self
            .workers
            .iter()
            .map(|w| {
                // Those sent during a step are the worker's too, waiting for its end.
                let (running, waiting) = w.engine.held();
                (running + waiting + w.sent.len()) as u32
            })
            .collect();
        let pool = |role: WorkerRole| -> Vec<f64> {
            self.workers.iter().zip(&held).filter(|(w, _)| w.role == role).map(|(_, &n)| f64::from(n)).collect()
        };
        let spread_cv = |v: &[f64]| -> (u64, f64) {
            if v.is_empty() {
                return (0, 0.0);
            }
            let (max, min) = v.iter().fold((f64::MIN, f64::MAX), |(a, b), &x| (a.max(x), b.min(x)));
            let mean = v.iter().sum::<f64>() / v.len() as f64;
            let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
            ((max - min) as u64, if mean > 0.0 { var.sqrt() / mean } else { 0.0 })
        };
        let (ps, pc) = spread_cv(&pool(WorkerRole::Prefill));
        let (ds, dc) = spread_cv(&pool(WorkerRole::Decode));
        let b = &mut self.out.balance;
        b.samples += 1;
        let n = b.samples as f64;
        // Running means, so nothing grows with the trace.
        b.prefill_spread_mean += (ps as f64 - b.prefill_spread_mean) / n;
        b.prefill_cv_mean += (pc - b.prefill_cv_mean) / n;
        b.decode_spread_mean += (ds as f64 - b.decode_spread_mean) / n;
        b.decode_cv_mean += (dc - b.decode_cv_mean) / n;
        b.prefill_spread_max = b.prefill_spread_max.max(ps);
        b.decode_spread_max = b.decode_spread_max.max(ds);
        self.out.queues.push((now, held));
    }

    fn refuse(&mut self, now: f64, i: usize, e: RouteError) {
        *self.out.decisions.entry(e.kind().to_string()).or_default() += 1;
        let status = if matches!(e, RouteError::NoDecodeWorkers) { 503 } else { 429 };
        self.finish(now, i, status, Some(e.to_string()), None);
    }

    fn start(&mut self, now: f64, i: usize, d: &Placement, views: &[WorkerView]) {
        let decode = d.decode;
        self.live[i].decode = decode;
        let target = d.prefill.unwrap_or(decode);
        let held = views
            .iter()
            .find(|v| v.id.0 as usize == target)
            .map_or(0, |v| (v.overlap.device + v.overlap.host + v.overlap.disk) as u64);
        self.live[i].retries = Some(Box::new(failover::Retries::new(d.retry_order.clone(), target != decode)));
        let at = self.instant(now);
        self.routers[self.live[i].router].budget.request(at, &failover::budget_settings());
        (self.live[i].on, self.live[i].attempt_tokens) = (Some(target), 0);
        // As the router's: the whole request, from here, within the request timeout.
        let timeout = self.routers[self.live[i].router].gate.timeout();
        self.queue.at_in_order(now + timeout, Ev::Deadline(i));
        let isl = self.live[i].isl as u64;
        let uncached = isl.saturating_sub(held * self.block_size.tokens() as u64);
        let export = target != decode;
        let max_tokens = if export { 1 } else { self.live[i].max_tokens };
        if export {
            self.live[i].prefill = Some(target);
        }
        self.send(target, i, uncached);
        if export && self.settings.scheduler.reserve_decode {
            self.send(decode, i, 0);
        }
        // After a disaggregated prefill the decode worker needs the prompt again.
        let prompt = if export { self.live[i].prompt.clone() } else { self.live[i].prompt.take() };
        self.submit(now, target, Job { i, prompt, max_tokens, export, pulled: false });
    }

    /// The router's own accounting of work it sent `w` for request `i`.
    fn send(&mut self, w: usize, i: usize, uncached: u64) {
        let blocks = self.prompt_blocks(i);
        let live = &self.live[i];
        let load = &mut self.routers[live.router].load;
        let hashes = live.prompt.as_ref().map_or(&[][..], |p| &p.hashes().seq);
        load.sent(WorkerId(w as u32), i as u64, &i.to_string(), uncached, blocks, hashes);
    }

    /// The blocks request `i`'s whole prompt takes.
    fn prompt_blocks(&self, i: usize) -> u64 {
        (self.live[i].isl as u64).div_ceil(self.block_size.tokens() as u64)
    }

    /// Request `i`'s prompt's block hashes (none once the prompt has moved to its last engine).
    fn hashes(&self, i: usize) -> &[SeqHash] {
        self.live[i].prompt.as_ref().map_or(&[], |p| &p.hashes().seq)
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

    /// Sends worker `w` a request. Its engine takes it between steps, as a worker's engine thread takes its
    /// commands: while a step runs, the request waits for its end, out of the worker's load reports (a long CPU
    /// step kept a newly sent prompt out of the real workers' reports for seconds; the router counts it by its own
    /// figures meanwhile).
    fn submit(&mut self, now: f64, w: usize, job: Job) {
        if self.workers[w].down {
            // A call to a worker that is gone fails at once.
            return self.attempt_failed(now, job.i, w);
        }
        *self.out.per_worker.entry(self.workers[w].name.clone()).or_default() += 1;
        if self.workers[w].erring {
            // It answers at once with an error.
            return self.attempt_failed(now, job.i, w);
        }
        if self.workers[w].hung {
            // A call to a worker that hangs but is not known to: it waits, unanswered, until the connection closes.
            return;
        }
        if job.export && !self.reserve_lease(job.i, w) {
            // Refused before its engine sees it: the worker's `ResourceExhausted`.
            return self.prefill_refused(now, job.i, w);
        }
        if self.workers[w].stepping {
            self.workers[w].sent.push(job);
            return;
        }
        self.admit(now, w, job);
        self.publish(now, w);
        self.kick(now, w);
    }

    /// Worker `w`'s engine takes a request; with the blocks its pull brought, whose lease then ends.
    fn admit(&mut self, now: f64, w: usize, job: Job) {
        let i = job.i;
        let sampling = self.sampling(i, job.max_tokens);
        let pull = if job.pulled { self.live[i].pull.take() } else { None };
        let blocks: Vec<(usize, &[u8])> = match &pull {
            Some((kv, range)) => range.clone().map(|k| (k, kv.block(k))).collect(),
            None => Vec::new(),
        };
        let submitted = match job.prompt {
            Some(prompt) => self.workers[w]
                .engine
                .submit_hashed(i as u64, prompt, sampling, job.export, &blocks.as_slice())
                .map_err(|e| e.to_string()),
            // Not reached: each request's prompt moves to an engine once, at its last submission.
            None => Err("the request's prompt had already gone to its last worker".to_string()),
        };
        // The pulled blocks are in the engine: the lease ends and the prefill worker's blocks are its own again.
        if let (Some(_), Some(p)) = (pull, self.live[i].prefill) {
            self.release_lease(i);
            self.unpinned(now, p);
        }
        if let Err(e) = submitted {
            self.routers[self.live[i].router].load.done(WorkerId(w as u32), i as u64);
            self.finish(now, i, 500, Some(e), None);
        }
    }

    /// Starts worker `w`'s next step when it is idle and has work.
    fn kick(&mut self, now: f64, w: usize) {
        let worker = &mut self.workers[w];
        if worker.stepping || !worker.engine.busy() {
            return;
        }
        // The step's outputs go into the buffer the last step's were read from.
        let secs = worker.engine.step_into(&mut worker.pending);
        worker.stepping = true;
        worker.step_started = now;
        if worker.stuck {
            // It will not end: the routers' stall checks count from here, its last progress.
            self.check_stall_after(now, now, w);
        }
        match &mut self.cores {
            None => self.queue.at(now + secs, Ev::StepEnd { w, turn: 0 }),
            Some(cores) => {
                for e in cores.start(now, w, secs) {
                    self.queue.at(e.at, Ev::StepEnd { w: e.worker, turn: e.turn });
                }
            }
        }
    }

    /// Sends what worker `w`'s state change tells the router: new KV events and, when due, a load report.
    fn publish(&mut self, now: f64, w: usize) {
        if self.workers[w].down || self.workers[w].hung {
            return;
        }
        let events = self.workers[w].new_events();
        if !events.is_empty() {
            self.queue.at(now + self.settings.event_delay, Ev::Events(w, events));
        }
        for (r, report) in self.workers[w].reports_due(now) {
            self.queue.at(now + self.settings.report_delay, Ev::Report { w, r, report });
        }
    }

    fn step_end(&mut self, now: f64, w: usize, turn: u64) {
        if let Some(cores) = &mut self.cores {
            // A stale end (another step started or ended since), or the others' new ends.
            let Some(ends) = cores.end(now, w, turn) else { return };
            for e in ends {
                self.queue.at(e.at, Ev::StepEnd { w: e.worker, turn: e.turn });
            }
        }
        if self.workers[w].down || self.workers[w].hung {
            // It failed during the step: nothing of it comes out, and nothing more runs there (until it comes back,
            // which waited for this).
            self.workers[w].pending.clear();
            self.workers[w].stepping = false;
            if std::mem::take(&mut self.workers[w].back) {
                self.worker_back(now, w);
            }
            return;
        }
        if self.workers[w].stuck {
            // Its device hangs: the step ends only when it is unstuck.
            self.workers[w].held = true;
            return;
        }
        self.step_done(now, w);
    }

    /// Worker `w`'s step is over: its outputs go out, and the engine takes what came meanwhile and plans the next.
    pub(super) fn step_done(&mut self, now: f64, w: usize) {
        // The step's outputs go out while the worker still counts as stepping: what they cause on this worker
        // (a request sent back to it, a lease ended) queues behind what came during the step.
        let mut pending = std::mem::take(&mut self.workers[w].pending);
        for out in pending.drain(..) {
            self.output(now, w, out);
        }
        // The emptied buffer goes back for the next step.
        self.workers[w].pending = pending;
        self.workers[w].stepping = false;
        // Then the engine takes what came, in the order it came, and plans its next step.
        if std::mem::take(&mut self.workers[w].reclaim) {
            self.workers[w].engine.reclaim_pinned();
        }
        for id in std::mem::take(&mut self.workers[w].cancels) {
            self.workers[w].engine.cancel(id);
        }
        for job in std::mem::take(&mut self.workers[w].sent) {
            self.admit(now, w, job);
        }
        self.publish(now, w);
        self.kick(now, w);
    }

    fn output(&mut self, now: f64, w: usize, out: Output) {
        let worker = WorkerId(w as u32);
        let id = match &out {
            Output::Token { id, .. } | Output::Finished { id, .. } | Output::Failed { id, .. } => *id as usize,
        };
        if self.live[id].on != Some(w) {
            // The request ended (its deadline passed) while the step ran: what the step made for it goes nowhere,
            // and a prompt it exported is nobody's to pull.
            if let Output::Finished { exported: Some(_), .. } = out {
                self.unpinned(now, w);
            }
            return;
        }
        match out {
            Output::Token { id, token } => {
                // The tokens sent so far matter to a resumption, which only a run with failures has.
                let resumable = !self.settings.failures.is_empty();
                let live = &mut self.live[id as usize];
                if live.prefill == Some(w) {
                    live.first_token = Some(token);
                } else {
                    if live.attempt_tokens == 0 {
                        // The decode attempt's first token (after the prefill worker's, when there was one).
                        self.routers[live.router].load.first_token(worker, id);
                    }
                    live.attempt_tokens += 1;
                }
                if let Some(r) = live.retries.as_mut().filter(|_| resumable) {
                    r.generated.push(token);
                }
                if let Some(last) = live.last_at {
                    if live.gaps.capacity() == 0 {
                        // Room for every gap of the output at once (the trace's lengths are budgets the engine
                        // keeps to): growing it by doubling copied millions of gaps over a whole trace.
                        live.gaps.reserve_exact(live.max_tokens.saturating_sub(1) as usize);
                    }
                    live.gaps.push((now - last) * 1000.0);
                }
                live.first_at.get_or_insert(now);
                live.last_at = Some(now);
                live.produced += 1;
            }
            Output::Finished { id, completion, exported } => {
                let i = id as usize;
                self.routers[self.live[i].router].load.done(worker, id);
                self.call_succeeded(i, w);
                if self.live[i].prefill == Some(w) {
                    self.live[i].cached = completion.cached_tokens;
                    match exported {
                        Some(kv) if self.live[i].max_tokens > 1 => self.transfer(now, i, w, kv),
                        unread => {
                            drop(unread);
                            self.unpinned(now, w);
                            self.finish(now, i, 200, None, Some("length"));
                        }
                    }
                } else {
                    if self.live[i].prefill.is_none() {
                        self.live[i].cached = completion.cached_tokens;
                    }
                    self.finish(now, i, 200, None, Some(completion.finish_reason.as_str()));
                }
            }
            Output::Failed { id, why } => {
                self.routers[self.live[id as usize].router].load.done(worker, id);
                self.finish(now, id as usize, 500, Some(why), None);
            }
        }
    }

    /// Moves request `i`'s prompt KV from prefill worker `p` to its decode worker: only the leading full blocks
    /// the decode worker does not hold, over both workers' links, charged at the modelled block size.
    fn transfer(&mut self, now: f64, i: usize, p: usize, kv: engine::generate::ExportedKv) {
        if !self.routable(now, self.live[i].router, self.live[i].decode) {
            // The decided decode worker failed, or its breaker ejected it, while the prompt prefilled: nothing ran
            // there, so another takes the request as its first decode attempt (not a resumption), as the real
            // router does.
            let tried = self.live[i].retries.as_ref().map(|r| r.tried.clone()).unwrap_or_default();
            self.live[i].decode = self.next_decoder(now, i, &tried);
        }
        let d = self.live[i].decode;
        (self.live[i].on, self.live[i].pulling, self.live[i].attempt_tokens) = (Some(d), true, 0);
        self.live[i].pull_since = now;
        let hashes: Vec<SeqHash> = kv.metas.iter().map_while(|b| b.map(|m| m.seq)).collect();
        let m = self.workers[d].engine.lookup(&hashes);
        let held = (m.device + m.host + m.disk).min(hashes.len());
        let pulled = hashes.len() - held;
        let bytes = pulled as u64 * self.settings.transfer_block_bytes;
        // Streamed: the leading pieces' blocks came over while the later pieces computed (each piece a pull of
        // its own), so what is left after the prefill is what the last piece added. The modelled simplification:
        // the pieces' pulls are taken to have ended by now, whatever else held the links meanwhile.
        let ends = self.piece_ends(i);
        let streamed = ends.last().map_or(0, |end| end / self.block_size.tokens()).min(hashes.len());
        let ahead = streamed.saturating_sub(held).min(pulled);
        let pull_secs = |blocks: usize| match blocks {
            0 => 0.0,
            n => {
                let bytes = n as u64 * self.settings.transfer_block_bytes;
                self.settings.transfer_latency + bytes as f64 / self.settings.transfer_bandwidth
            }
        };
        let secs = pull_secs(pulled - ahead);
        // Every pull the decode worker made, for its measured link speed: one per leading piece, then the rest.
        let piece_latencies = if ahead > 0 { ends.len() - 1 } else { 0 };
        let total_secs = secs + pull_secs(ahead) + self.settings.transfer_latency * piece_latencies as f64;
        let begin = now.max(self.workers[p].link_free).max(self.workers[d].link_free);
        let end = begin + secs;
        self.workers[p].link_free = end;
        self.workers[d].link_free = end;
        self.workers[d].pulled_bytes += bytes;
        self.workers[d].pulled_nanos += (total_secs * 1e9) as u64;
        self.out.transfer_bytes += bytes;
        if pulled > 0 {
            self.live[i].pull = Some((kv, held..hashes.len()));
        } else {
            drop(kv);
            self.release_lease(i);
            self.unpinned(now, p);
        }
        // The router calls the decode worker as soon as the prefill answers; the pull happens inside that call.
        self.send(d, i, 0);
        self.queue.at(end, Ev::Pulled(i));
    }

    /// Where the router cuts request `i`'s prompt when it streams its KV (`router::stream_kv::piece_ends`, from
    /// what its prefill worker held of it); empty when it does not.
    fn piece_ends(&self, i: usize) -> Vec<usize> {
        let live = &self.live[i];
        if !self.settings.stream_kv || live.max_tokens <= 1 {
            return Vec::new();
        }
        let bt = self.block_size.tokens();
        router::stream_kv::piece_ends(live.isl, live.cached, bt, self.settings.engine.max_batched_tokens)
    }

    /// Prefill worker `p` takes back the blocks of exports that nobody reads any more (its lease ended): its
    /// engine does between steps, so one under way first ends (and until then nothing of the step's own effects,
    /// which the simulated engine has already applied, may reach the router).
    fn unpinned(&mut self, now: f64, p: usize) {
        if self.workers[p].stepping {
            self.workers[p].reclaim = true;
            return;
        }
        self.workers[p].engine.reclaim_pinned();
        self.publish(now, p);
    }

    fn pulled(&mut self, now: f64, i: usize) {
        if self.live[i].pulling && self.live[i].prefill.is_some_and(|p| self.workers[p].hung) {
            // Its prefill worker hung before the pull ended: it stalls until the pull times out.
            return;
        }
        if !std::mem::take(&mut self.live[i].pulling) {
            // The attempt it was for failed meanwhile.
            return;
        }
        let d = self.live[i].decode;
        // The last submission: the prompt (made with room for the output) moves to the engine.
        let mut prompt = self.live[i].prompt.take();
        if let Some(p) = &mut prompt {
            p.extend(self.live[i].first_token);
        }
        let max_tokens = self.live[i].max_tokens - 1;
        self.submit(now, d, Job { i, prompt, max_tokens, export: false, pulled: true });
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

    /// The prompt's KV on its way to request `i`'s decode attempt (pulling, or pulled and waiting for the engine) is
    /// not wanted any more: the lease ends, and its prefill worker takes the blocks back (unless it is gone).
    fn end_pull(&mut self, now: f64, i: usize) {
        self.release_lease(i);
        let live = &mut self.live[i];
        live.pulling = false;
        if let (Some(p), Some(_)) = (live.prefill, live.pull.take())
            && !self.workers[p].down
        {
            self.unpinned(now, p);
        }
    }

    /// Worker `w`'s engine drops request `i` between steps (one sent during the step never reaches it).
    fn drop_from(&mut self, now: f64, w: usize, i: usize) {
        let worker = &mut self.workers[w];
        let sent = worker.sent.len();
        worker.sent.retain(|job| job.i != i);
        if worker.sent.len() == sent {
            if worker.stepping {
                worker.cancels.push(i as u64);
            } else {
                worker.engine.cancel(i as u64);
                self.publish(now, w);
            }
        }
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
