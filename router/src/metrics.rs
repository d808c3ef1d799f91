//! The router's Prometheus metrics (`observability.md`).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use telemetry::prom::{Exposition, Histogram, labels, one};

use crate::state::RouterState;

/// Counters keyed by a few label values.
#[derive(Debug, Default)]
struct Family(Mutex<BTreeMap<Vec<(&'static str, String)>, u64>>);

impl Family {
    fn inc(&self, key: Vec<(&'static str, String)>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()).entry(key).or_default() += 1;
    }

    fn samples(&self) -> Vec<(String, f64)> {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        map.iter()
            .map(|(k, v)| {
                let pairs: Vec<(&str, &str)> = k.iter().map(|(a, b)| (*a, b.as_str())).collect();
                (labels(&pairs), *v as f64)
            })
            .collect()
    }
}

/// What the router counts and times.
#[derive(Debug, Default)]
pub struct RouterMetrics {
    requests: Family,
    decisions: Family,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub request_duration: Histogram,
    overlap_blocks: [AtomicU64; 3],
    pub prefill_retries: AtomicU64,
    pub decode_resumptions: AtomicU64,
    pub local_prefill_fallbacks: AtomicU64,
    /// Leading pieces of prompts prefilled for streaming their KV, and those the decode worker failed to pull.
    pub streamed_pieces: AtomicU64,
    pub streamed_piece_failures: AtomicU64,
    /// Retries and failovers the retry budget refused.
    pub retries_denied: AtomicU64,
    /// Workers ejected by their circuit breaker.
    pub ejections: AtomicU64,
    /// Prompt tokens the router made from text (templates and tokenizer), and the time it spent on it.
    tokenized_tokens: AtomicU64,
    tokenize_nanos: AtomicU64,
}

impl RouterMetrics {
    /// A finished request: its route and HTTP status (or `error kind` for failures after the headers went out).
    pub fn request(&self, route: &'static str, status: u16) {
        self.requests.inc(vec![("route", route.to_string()), ("status", status.to_string())]);
    }

    /// A routing decision.
    pub fn decision(&self, policy: &'static str, reason: &'static str) {
        self.decisions.inc(vec![("policy", policy.to_string()), ("reason", reason.to_string())]);
    }

    /// A prompt's text became `tokens` tokens in `spent` (on whichever thread did it, so the figure includes
    /// waiting for a core when the machine is busy: what a request actually pays before it is routed).
    pub fn tokenized(&self, tokens: usize, spent: std::time::Duration) {
        self.tokenized_tokens.fetch_add(tokens as u64, Ordering::Relaxed);
        self.tokenize_nanos.fetch_add(spent.as_nanos() as u64, Ordering::Relaxed);
    }

    /// A prompt was prefilled on a worker that held this many of its leading blocks per tier (device, host,
    /// disk): the worker that actually prefilled, after any failover.
    pub fn prefilled_with_overlap(&self, overlap: [usize; 3]) {
        for (i, n) in overlap.iter().enumerate() {
            self.overlap_blocks[i].fetch_add(*n as u64, Ordering::Relaxed);
        }
    }
}

/// What one role's routable workers have to do, as this router sees it (its own sends and the workers' reports):
/// the signal to scale a role on (queued work says what GPU utilization cannot: whether requests wait).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PoolWork {
    pub workers: u64,
    /// Uncached prompt tokens sent to the role's workers and not yet computed (queued or computing).
    pub prefill_tokens: u64,
    pub requests: u64,
    /// Device KV blocks in use over the role's device capacity (0 with no capacity).
    pub kv_fraction: f64,
}

/// Each role's [`PoolWork`] (`prefill`, `decode`, `both`), every role listed even with no workers (a scaler reads 0,
/// not an absent series).
pub fn pool_work(views: &[crate::scheduler::view::WorkerView]) -> Vec<(&'static str, PoolWork)> {
    use crate::scheduler::view::WorkerRole;
    [("prefill", WorkerRole::Prefill), ("decode", WorkerRole::Decode), ("both", WorkerRole::Both)]
        .into_iter()
        .map(|(name, role)| {
            let of: Vec<_> = views.iter().filter(|v| v.role == role).collect();
            let (used, capacity) =
                of.iter().fold((0, 0), |(u, c), v| (u + v.load.active_blocks, c + v.load.capacity_blocks));
            let work = PoolWork {
                workers: of.len() as u64,
                prefill_tokens: of.iter().map(|v| v.load.active_prefill_tokens).sum(),
                requests: of.iter().map(|v| v.load.active_requests).sum(),
                kv_fraction: if capacity == 0 { 0.0 } else { used as f64 / capacity as f64 },
            };
            (name, work)
        })
        .collect()
}

type PoolMetric = (&'static str, &'static str, fn(&PoolWork) -> f64);

const POOL_METRICS: [PoolMetric; 4] = [
    ("tandem_router_pool_workers", "Routable workers per role.", |w| w.workers as f64),
    (
        "tandem_router_pool_queued_prefill_tokens",
        "Uncached prompt tokens sent to a role's workers and not yet computed: what to scale prefill workers on.",
        |w| w.prefill_tokens as f64,
    ),
    ("tandem_router_pool_requests", "Requests in flight on a role's workers.", |w| w.requests as f64),
    (
        "tandem_router_pool_kv_used_fraction",
        "Device KV blocks in use over device capacity, per role: what to scale decode workers on.",
        |w| w.kv_fraction,
    ),
];

/// The exposition text.
pub fn render(state: &RouterState) -> String {
    let m = &state.metrics;
    let mut e = Exposition::new();
    e.counter("tandem_router_requests_total", "Requests by route and HTTP status.", &m.requests.samples());
    e.histogram(
        "tandem_router_time_to_first_token_seconds",
        "From a request's arrival to its first token sent to the client.",
        &[(&[], &m.time_to_first_token)],
    );
    e.histogram(
        "tandem_router_inter_token_latency_seconds",
        "Time between consecutive tokens sent to a client.",
        &[(&[], &m.inter_token_latency)],
    );
    e.histogram(
        "tandem_router_request_duration_seconds",
        "From a request's arrival to its last byte.",
        &[(&[], &m.request_duration)],
    );
    e.counter("tandem_router_decisions_total", "Routing decisions by policy and reason.", &m.decisions.samples());
    let tiers = ["device", "host", "disk"];
    let overlap: Vec<(String, f64)> = tiers
        .iter()
        .enumerate()
        .map(|(i, t)| (labels(&[("tier", t)]), m.overlap_blocks[i].load(Ordering::Relaxed) as f64))
        .collect();
    e.counter(
        "tandem_router_overlap_blocks_total",
        "Prompt blocks already cached on the worker that prefilled (prefill or decode worker), by tier.",
        &overlap,
    );
    let (size, stats) = state.cluster.index_stats();
    e.gauge("tandem_router_indexer_blocks", "Distinct blocks in the KV index.", &one(size as f64));
    e.counter("tandem_router_indexer_events_applied_total", "KV events applied.", &one(stats.events_applied as f64));
    e.counter(
        "tandem_router_indexer_events_duplicate_total",
        "KV events seen twice (after a resubscription) and ignored.",
        &one(stats.events_duplicate as f64),
    );
    e.counter(
        "tandem_router_indexer_events_dropped_total",
        "KV events dropped after a gap in a worker's stream (each gap resubscribes).",
        &one(stats.gaps as f64),
    );
    e.counter(
        "tandem_router_indexer_orphans_total",
        "Stored events whose parent block was unknown.",
        &one(stats.orphans as f64),
    );
    e.counter(
        "tandem_router_indexer_resyncs_total",
        "Workers re-read from a snapshot after a gap or a reconnect.",
        &one(stats.resyncs as f64),
    );
    let pools = pool_work(&state.cluster.view(
        &[],
        crate::cluster::Needs::ANY,
        std::time::Duration::ZERO,
        std::time::Instant::now(),
    ));
    for (name, help, pick) in POOL_METRICS {
        let samples: Vec<(String, f64)> = pools.iter().map(|(role, w)| (labels(&[("role", role)]), pick(w))).collect();
        e.gauge(name, help, &samples);
    }
    let members = state.cluster.up_members();
    let in_flight: Vec<(String, f64)> = members
        .iter()
        .map(|(id, mem)| (labels(&[("worker", &mem.name)]), state.cluster.in_flight(*id) as f64))
        .collect();
    e.gauge("tandem_router_worker_in_flight", "Requests the router has in flight per worker.", &in_flight);
    let now = std::time::Instant::now();
    let ages: Vec<(String, f64)> = members
        .iter()
        .flat_map(|(id, mem)| {
            let (load, events) = state.cluster.signal_ages(*id, now);
            [("load", load), ("events", events)]
                .into_iter()
                .filter_map(|(signal, age)| age.map(|a| (labels(&[("worker", &mem.name), ("signal", signal)]), a)))
                .collect::<Vec<_>>()
        })
        .collect();
    let indexed: Vec<(String, f64)> = members
        .iter()
        .flat_map(|(id, mem)| {
            let held = state.cluster.indexed_blocks(*id).unwrap_or_default();
            kv_cache::events::Tier::ALL
                .map(|t| (labels(&[("worker", &mem.name), ("tier", t.as_str())]), held[t.index()] as f64))
        })
        .collect();
    e.gauge(
        "tandem_router_worker_indexed_blocks",
        "Blocks the router's index holds for each worker, per tier: the cache it can route to there.",
        &indexed,
    );
    let refused: Vec<(String, f64)> = members
        .iter()
        .flat_map(|(id, mem)| {
            let counts = state.cluster.refused_batches(*id);
            crate::cluster::Refused::ALL
                .map(|why| (labels(&[("worker", &mem.name), ("reason", why.as_str())]), counts[why as usize] as f64))
        })
        .filter(|(_, n)| *n > 0.0)
        .collect();
    e.counter(
        "tandem_router_worker_event_batches_refused_total",
        "KV event batches of an external worker not applied, by reason: unreadable, or published by another \
         data-parallel rank (its event ports are configured wrong).",
        &refused,
    );
    e.gauge(
        "tandem_router_worker_signal_age_seconds",
        "Seconds since each worker's last load report (signal=load) and last KV event batch or heartbeat (signal=events).",
        &ages,
    );
    e.gauge("tandem_router_workers_up", "Workers routed to.", &one(members.len() as f64));
    e.gauge(
        "tandem_router_requests_in_flight",
        "Requests holding an in-flight slot.",
        &one(state.admission.in_flight() as f64),
    );
    e.gauge(
        "tandem_router_queue_depth",
        "Requests waiting for an in-flight slot.",
        &one(state.admission.queued() as f64),
    );
    e.counter(
        "tandem_router_prefill_retries_total",
        "Prefill attempts that failed and moved to the next candidate.",
        &one(m.prefill_retries.load(Ordering::Relaxed) as f64),
    );
    e.counter(
        "tandem_router_local_prefill_fallbacks_total",
        "Requests prefilled on their decode worker after every prefill attempt failed.",
        &one(m.local_prefill_fallbacks.load(Ordering::Relaxed) as f64),
    );
    e.counter(
        "tandem_router_kv_stream_pieces_total",
        "Leading pieces of long prompts prefilled so that their decode worker pulls them while the rest computes.",
        &one(m.streamed_pieces.load(Ordering::Relaxed) as f64),
    );
    e.counter(
        "tandem_router_kv_stream_piece_failures_total",
        "Streamed pieces their decode worker did not pull (it pulls those blocks with the rest).",
        &one(m.streamed_piece_failures.load(Ordering::Relaxed) as f64),
    );
    e.counter(
        "tandem_router_decode_resumptions_total",
        "Streams resumed on another decode worker after theirs failed.",
        &one(m.decode_resumptions.load(Ordering::Relaxed) as f64),
    );
    e.counter(
        "tandem_router_retries_denied_total",
        "Retries and failovers refused because the retry budget was spent.",
        &one(m.retries_denied.load(Ordering::Relaxed) as f64),
    );
    e.counter(
        "tandem_router_tokenized_tokens_total",
        "Prompt tokens the router made from text (chat template and tokenizer).",
        &one(m.tokenized_tokens.load(Ordering::Relaxed) as f64),
    );
    e.counter(
        "tandem_router_tokenize_seconds_total",
        "Seconds the router spent making prompt tokens from text, summed over requests (the tokens over this: its speed).",
        &one(m.tokenize_nanos.load(Ordering::Relaxed) as f64 / 1e9),
    );
    let (stalled, stalls) = state.cluster.stalled();
    e.counter(
        "tandem_router_worker_stalls_total",
        "Times a worker was found stalled: holding work while its engine computed nothing for the stall limit.",
        &one(stalls as f64),
    );
    e.gauge(
        "tandem_router_workers_stalled",
        "Workers stalled now (no new requests; their calls moved elsewhere).",
        &one(stalled as f64),
    );
    e.counter(
        "tandem_router_worker_ejections_total",
        "Times a worker was ejected by its circuit breaker after failing again and again.",
        &one(m.ejections.load(Ordering::Relaxed) as f64),
    );
    e.gauge(
        "tandem_router_workers_ejected",
        "Workers ejected now.",
        &one(state.cluster.ejected(std::time::Instant::now()) as f64),
    );
    let overrun = state.cluster.step_overrun_steps();
    if !overrun.is_empty() {
        e.gauge(
            "tandem_router_mock_step_overrun_steps",
            "Mock workers' steps whose actual / modelled duration was at most `le` (cumulative), summed over the \
             workers followed now.",
            &worker::metrics::overrun_samples(&overrun),
        );
    }
    e.counter(
        "tandem_trace_spans_dropped_total",
        "Spans dropped because the trace export queue was full.",
        &one(telemetry::dropped_spans() as f64),
    );
    e.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::view::{Load, WorkerId, WorkerRole, WorkerView};

    fn worker(id: u32, role: WorkerRole, load: Load) -> WorkerView {
        WorkerView {
            id: WorkerId(id),
            name: format!("w{id}"),
            role,
            overlap: Default::default(),
            active_overlap: 0,
            load,
            ramp: 1.0,
            max_num_batched_tokens: 2048,
            block_bytes: 0,
            speed: Default::default(),
            predicted: false,
        }
    }

    #[test]
    fn pool_work_sums_each_roles_workers_and_lists_every_role() {
        let load = |tokens, blocks, requests| Load {
            active_prefill_tokens: tokens,
            active_blocks: blocks,
            capacity_blocks: 100,
            active_requests: requests,
        };
        let views = [
            worker(0, WorkerRole::Prefill, load(4096, 10, 2)),
            worker(1, WorkerRole::Prefill, load(1024, 30, 1)),
            worker(2, WorkerRole::Decode, load(0, 75, 9)),
        ];
        let pools = pool_work(&views);
        assert_eq!(pools[0], ("prefill", PoolWork { workers: 2, prefill_tokens: 5120, requests: 3, kv_fraction: 0.2 }));
        assert_eq!(pools[1], ("decode", PoolWork { workers: 1, prefill_tokens: 0, requests: 9, kv_fraction: 0.75 }));
        assert_eq!(pools[2], ("both", PoolWork::default()), "no such workers: zeros, not an absent series");
    }
}
