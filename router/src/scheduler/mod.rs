//! The scheduler: a pure function of (request, cluster view, config, random source) that picks a decode worker
//! by load, a prefill worker by prefix overlap against load, and whether disaggregation pays (`routing.md`).
//! It reads no clock, spawns nothing and logs nothing; the router and the simulator both call it.

pub mod affinity;
pub mod config;
pub mod cost;
mod disaggregate;
pub mod rng;
pub mod select;
pub mod shed;
pub mod view;

use serde::Serialize;

use config::{Policy, SchedulerConfig, Ties};
use disaggregate::PrefillPool;
pub use disaggregate::Reason;
use rng::Rng;
use select::{Rotation, Tie};
use view::{RouteRequest, WorkerView};

/// What the scheduler carries from one decision to the next: its random source and round robin's places. The
/// caller owns it (the router behind a lock, the simulator by value), so `route` stays a pure function.
#[derive(Clone, Debug)]
pub struct RouteState {
    pub rng: Rng,
    prefill_rotation: Rotation,
    decode_rotation: Rotation,
    /// Which worker last computed a prompt with each recent `prompt_cache_key`.
    pub affinity: affinity::Affinity,
}

impl RouteState {
    pub fn seeded(seed: u64) -> RouteState {
        RouteState {
            rng: Rng::new(seed),
            prefill_rotation: Rotation::default(),
            decode_rotation: Rotation::default(),
            affinity: affinity::Affinity::default(),
        }
    }
}

/// One candidate as scored, for explanations and span attributes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Scored {
    pub worker: String,
    #[serde(skip)]
    pub id: view::WorkerId,
    pub device_blocks: usize,
    pub host_blocks: usize,
    pub disk_blocks: usize,
    pub active_prefill_tokens: u64,
    pub active_blocks: u64,
    pub active_overlap_blocks: usize,
    pub potential_decode_blocks: u64,
    pub capacity_blocks: u64,
    pub active_requests: u64,
    /// What the prefill term was multiplied by: 1 in block units; in seconds units, the fleet's mean measured
    /// prefill speed over this worker's.
    pub speed_factor: f64,
    /// Blocks credited because it last computed a prompt with the request's `prompt_cache_key` (0: none).
    pub affinity_credit: f64,
    pub cost: f64,
    /// Its overlap is predicted from what the router sent it (an engine without KV events).
    pub predicted: bool,
}

/// A choice among candidates.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Choice {
    pub worker: String,
    #[serde(skip)]
    pub id: view::WorkerId,
    pub candidates: Vec<Scored>,
}

impl Choice {
    /// The chosen candidate's scores.
    pub fn chosen(&self) -> Option<&Scored> {
        self.candidates.iter().find(|c| c.id == self.id)
    }

    /// The candidates in the order a failed attempt moves on through them: the chosen one first, then by cost
    /// (`crate::serve`'s prefill retries, and the simulator's).
    pub fn by_preference(&self) -> Vec<&Scored> {
        let mut order: Vec<&Scored> = self.candidates.iter().collect();
        order.sort_by(|a, b| preference((a.id == self.id, a.cost), (b.id == self.id, b.cost)));
        order
    }

    /// The best cost among the candidates not chosen.
    pub fn runner_up_cost(&self) -> Option<f64> {
        self.candidates.iter().filter(|c| c.id != self.id).map(|c| c.cost).min_by(f64::total_cmp)
    }

    /// How much cheaper the chosen worker was than the next best (0: a tie, broken at random; `None`: no rival).
    pub fn margin(&self) -> Option<f64> {
        Some(self.runner_up_cost()? - self.chosen()?.cost)
    }
}

/// What to do with a request.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    pub policy: Policy,
    /// The prefill worker's choice, also when the rule then prefills on the decode worker (to explain why).
    pub prefill: Option<Choice>,
    pub decode: Choice,
    pub disaggregate: bool,
    pub reason: Reason,
    pub request_blocks: u64,
    pub isl: u64,
}

/// Every candidate of a decision as the scheduler scored it: what a recording or the simulator's placements
/// write when asked to explain decisions (to find where two routers' inputs part).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Candidates {
    /// The prefill choice's candidates (empty when there was none).
    pub prefill: Vec<Scored>,
    pub decode: Vec<Scored>,
}

impl Decision {
    /// Its candidates, prefill and decode.
    pub fn candidates(&self) -> Candidates {
        Candidates {
            prefill: self.prefill.as_ref().map(|c| c.candidates.clone()).unwrap_or_default(),
            decode: self.decode.candidates.clone(),
        }
    }

    /// The margin of the choice that decided where the prompt is computed: the prefill worker's when
    /// disaggregated, else the decode worker's.
    pub fn prefill_margin(&self) -> Option<f64> {
        match (&self.prefill, self.disaggregate) {
            (Some(p), true) => p.margin(),
            _ => self.decode.margin(),
        }
    }
}

/// The order of [`Choice::by_preference`] between two candidates, each given as (whether it is the chosen one, its
/// cost): the chosen one first, then the cheaper; a stable sort keeps equals in their order.
pub fn preference(a: (bool, f64), b: (bool, f64)) -> std::cmp::Ordering {
    b.0.cmp(&a.0).then(a.1.total_cmp(&b.1))
}

/// Why no worker can take the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("no decode workers are available")]
    NoDecodeWorkers,
    #[error("every decode worker is busy")]
    AllBusy,
    /// The worker that would prefill the request has more queued work than `shed_wait_ms`.
    #[error("the cluster is overloaded: about {wait_ms} ms of prompts are queued ahead of this one")]
    Shed { wait_ms: u64, limit_ms: u64 },
}

impl RouteError {
    pub fn kind(self) -> &'static str {
        match self {
            RouteError::NoDecodeWorkers => "no_decode_workers",
            RouteError::AllBusy => "all_busy",
            RouteError::Shed { .. } => "shed",
        }
    }

    /// The refusal a [`kind`](Self::kind) names (a recorded one; a shed's figures are not kept): `None` for
    /// another word.
    pub fn from_kind(kind: &str) -> Option<RouteError> {
        match kind {
            "no_decode_workers" => Some(RouteError::NoDecodeWorkers),
            "all_busy" => Some(RouteError::AllBusy),
            "shed" => Some(RouteError::Shed { wait_ms: 0, limit_ms: 0 }),
            _ => None,
        }
    }
}

/// Slow start: a worker warmer than the others' warmest stays a candidate; a cooler one with probability its ramp
/// over that warmest's, so a newcomer among warm workers gets its ramped share, while workers that joined together
/// (a fresh cluster, a restarted router) are all candidates, as equals. If that leaves nobody, all stay.
fn ramped<'a>(workers: Vec<&'a WorkerView>, rng: &mut Rng) -> Vec<&'a WorkerView> {
    let warmest = workers.iter().map(|w| w.ramp).fold(0.0, f64::max).min(1.0);
    let kept: Vec<&WorkerView> =
        workers.iter().copied().filter(|w| w.ramp >= warmest || rng.unit() * warmest < w.ramp).collect();
    if kept.is_empty() { workers } else { kept }
}

/// Whether `w` is too busy to take `req` (`busy_prefill_tokens`, `busy_kv_fraction`). Never for a request more
/// urgent than the default (a negative priority): it goes to the best worker all the same and waits there ahead of
/// the others.
fn busy(req: &RouteRequest, w: &WorkerView, cfg: &SchedulerConfig) -> bool {
    req.priority >= 0
        && (cfg.busy_prefill_tokens.is_some_and(|max| w.load.active_prefill_tokens > max)
            || cfg.busy_kv_fraction.is_some_and(|f| cost::over_kv(req, w, f)))
}

fn scored(w: &WorkerView, potential_decode_blocks: u64, speed_factor: f64, affinity_credit: f64, cost: f64) -> Scored {
    Scored {
        worker: w.name.clone(),
        id: w.id,
        device_blocks: w.overlap.device,
        host_blocks: w.overlap.host,
        disk_blocks: w.overlap.disk,
        active_overlap_blocks: w.active_overlap,
        active_prefill_tokens: w.load.active_prefill_tokens,
        active_blocks: w.load.active_blocks,
        potential_decode_blocks,
        capacity_blocks: w.load.capacity_blocks,
        active_requests: w.load.active_requests,
        speed_factor,
        affinity_credit,
        cost,
        predicted: w.predicted,
    }
}

/// Which pool a choice is for: the prefix-aware baselines apply to prefill only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pool {
    Prefill,
    Decode,
}

/// Picks one of `candidates` (their costs already computed) as the configured policy says.
fn pick(
    pool: Pool,
    req: &RouteRequest,
    cfg: &SchedulerConfig,
    candidates: &[Scored],
    load: &[f64],
    rng: &mut Rng,
    rotation: &mut Rotation,
) -> usize {
    let requests: Vec<u64> = candidates.iter().map(|c| c.active_requests).collect();
    let ids: Vec<view::WorkerId>;
    let tie = match cfg.ties {
        Ties::Random => Tie::Random,
        Ties::Hashed => {
            ids = candidates.iter().map(|c| c.id).collect();
            Tie::Hashed { key: req.key, ids: &ids }
        }
    };
    match (cfg.policy, pool) {
        (Policy::Kv, _) => {
            select::choose(&candidates.iter().map(|c| c.cost).collect::<Vec<_>>(), cfg.temperature, tie, rng)
        }
        (Policy::LeastLoaded, _) | (Policy::PrefixHash | Policy::SglangThreshold, Pool::Decode) => {
            select::choose(load, 0.0, tie, rng)
        }
        (Policy::PowerOfTwo, _) => select::power_of_two(load, rng),
        (Policy::Random, _) => rng.below(candidates.len()),
        (Policy::RoundRobin, _) => rotation.next(&candidates.iter().map(|c| c.id).collect::<Vec<_>>()),
        (Policy::PrefixHash, Pool::Prefill) => {
            let names: Vec<&str> = candidates.iter().map(|c| c.worker.as_str()).collect();
            select::prefix_hash(req.prefix_key, &names, &requests, cfg.prefix_hash_load_factor)
        }
        (Policy::SglangThreshold, Pool::Prefill) => {
            let blocks = req.request_blocks().max(1) as f64;
            let matched: Vec<f64> =
                candidates.iter().map(|c| (c.device_blocks + c.host_blocks + c.disk_blocks) as f64 / blocks).collect();
            let (abs, rel) = (cfg.balance_abs_threshold, cfg.balance_rel_threshold);
            select::sglang_threshold(&matched, &requests, cfg.cache_threshold, abs, rel, rng)
        }
    }
}

/// The prompt's worker among `ready` (not empty) by the prefill cost, as the configured policy picks (`load`: what
/// the load-only policies compare).
fn prefill_choice<'a>(
    req: &RouteRequest,
    ready: &[&'a WorkerView],
    cfg: &SchedulerConfig,
    load: impl Fn(&WorkerView) -> f64,
    rng: &mut Rng,
    rotation: &mut Rotation,
) -> (Choice, &'a WorkerView) {
    let min_active = ready.iter().map(|w| w.load.active_prefill_tokens).min().unwrap_or(0);
    let factors = cost::speed_factors(ready, cfg.cost_units);
    let prefill_scored: Vec<Scored> = ready
        .iter()
        .zip(&factors)
        .map(|(w, &f)| {
            let c = cost::prefill_cost(req, w, min_active, f, cfg);
            scored(w, c.potential_decode_blocks, f, c.affinity_credit, c.cost)
        })
        .collect();
    let load: Vec<f64> = ready.iter().map(|w| load(w)).collect();
    let at = pick(Pool::Prefill, req, cfg, &prefill_scored, &load, rng, rotation);
    (choice(prefill_scored, at), ready[at])
}

/// Refuses the request when the worker that would compute its prompt has more queued than `shed_wait_ms`; never one
/// more urgent than the default (a negative priority), which would wait ahead of that queue.
fn shed(req: &RouteRequest, prefiller: &WorkerView, cfg: &SchedulerConfig) -> Result<(), RouteError> {
    let Some(limit_ms) = cfg.shed_wait_ms.filter(|_| req.priority >= 0) else { return Ok(()) };
    match shed::over_limit(prefiller, limit_ms) {
        Some(wait) => {
            Err(RouteError::Shed { wait_ms: (wait * 1000.0).round() as u64, limit_ms: limit_ms.round() as u64 })
        }
        None => Ok(()),
    }
}

fn choice(candidates: Vec<Scored>, at: usize) -> Choice {
    Choice { worker: candidates[at].worker.clone(), id: candidates[at].id, candidates }
}

/// Decides where `req` goes.
pub fn route(
    req: &RouteRequest,
    workers: &[WorkerView],
    cfg: &SchedulerConfig,
    state: &mut RouteState,
) -> Result<Decision, RouteError> {
    let rng = &mut state.rng;
    let request_blocks = req.request_blocks();
    // Decode: pure load, never a worker that would run out of KV.
    let decoders: Vec<&WorkerView> = workers.iter().filter(|w| w.role.decodes()).collect();
    if decoders.is_empty() {
        return Err(RouteError::NoDecodeWorkers);
    }
    let open: Vec<&WorkerView> =
        decoders.into_iter().filter(|w| !cost::over_kv(req, w, cfg.decode_kv_limit) && !busy(req, w, cfg)).collect();
    if open.is_empty() {
        return Err(RouteError::AllBusy);
    }
    let open = ramped(open, rng);
    let any_prefillers = workers.iter().any(|w| w.role == view::WorkerRole::Prefill);
    // No prefill-only worker: the worker that decodes also computes the prompt (aggregated), so it is chosen by the
    // prefill cost (overlap against load: Dynamo's aggregated routing), not by load alone; the load-only
    // policies weigh their whole load, as for decode.
    if !any_prefillers {
        let load = |w: &WorkerView| cost::decode_cost(req, w);
        let (decode, worker) = prefill_choice(req, &open, cfg, load, rng, &mut state.decode_rotation);
        shed(req, worker, cfg)?;
        let reason = Reason::NoPrefillWorkers;
        return Ok(Decision {
            policy: cfg.policy,
            prefill: None,
            decode,
            disaggregate: false,
            reason,
            request_blocks,
            isl: req.isl,
        });
    }
    let decode_scored: Vec<Scored> = open
        .iter()
        .map(|w| scored(w, w.load.active_blocks + request_blocks, 1.0, 0.0, cost::decode_cost(req, w)))
        .collect();
    let load: Vec<f64> = decode_scored.iter().map(|c| c.cost).collect();
    let at = pick(Pool::Decode, req, cfg, &decode_scored, &load, rng, &mut state.decode_rotation);
    let decode_worker = open[at];
    let decode = choice(decode_scored, at);

    // Prefill: the cost with overlap credit, among prefill-capable workers that are not busy.
    let prefillers: Vec<&WorkerView> = workers.iter().filter(|w| w.role.prefills()).collect();
    let ready: Vec<&WorkerView> = ramped(prefillers.into_iter().filter(|w| !busy(req, w, cfg)).collect(), rng);
    let prefill = if ready.is_empty() {
        None
    } else {
        let load = |w: &WorkerView| w.load.active_prefill_tokens as f64;
        Some(prefill_choice(req, &ready, cfg, load, rng, &mut state.prefill_rotation))
    };
    let pool = match &prefill {
        _ if !any_prefillers => PrefillPool::Absent,
        None => PrefillPool::Busy,
        Some((c, w)) => PrefillPool::Chosen(c, w),
    };
    let (disaggregate, reason) = disaggregate::decide(req, decode_worker, pool, cfg)?;
    let prefiller = match &prefill {
        Some((_, w)) if disaggregate => w,
        _ => decode_worker,
    };
    shed(req, prefiller, cfg)?;
    let prefill = prefill.map(|(c, _)| c);
    Ok(Decision { policy: cfg.policy, prefill, decode, disaggregate, reason, request_blocks, isl: req.isl })
}

#[cfg(test)]
mod tests;
