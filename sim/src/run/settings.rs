//! What a run is asked to model: the cluster, the router's settings and the failures to inject.

use std::path::PathBuf;

use engine::generate::EngineConfig;
use router::scheduler::config::SchedulerConfig;

use crate::gate::Limits;

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
    /// and the routers fail its requests over as the real one does ([`failover`](super::failover)).
    pub failures: Vec<Failure>,
    /// Seconds a worker may hold work without computing before the routers count it stalled (the router's
    /// `stall_after_ms`; 0: never).
    pub stall_after: f64,
    /// The routers' time limits on each call to a worker.
    pub timeouts: CallTimeouts,
    /// Each placement keeps its decision's candidates as scored ([`Placed::candidates`](super::Placed::candidates)): to compare the
    /// simulated router's inputs with a real router's recording of them.
    pub record_candidates: bool,
    pub seed: u64,
}

/// The router's limits on one call to a worker, in seconds (its `prefill_timeout_ms` and `decode_idle_timeout_ms`):
/// a prefill call, and a decode stream's wait for its first token, may take `prefill`; a decode stream may then go
/// `decode_idle` without a token. A call past its limit fails over as a failed one does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CallTimeouts {
    pub prefill: f64,
    pub decode_idle: f64,
}

impl Default for CallTimeouts {
    /// The router's defaults.
    fn default() -> CallTimeouts {
        use router::run::defaults;
        CallTimeouts {
            prefill: defaults::PREFILL_TIMEOUT.as_secs_f64(),
            decode_idle: defaults::DECODE_IDLE_TIMEOUT.as_secs_f64(),
        }
    }
}

/// A worker that fails during the run, and may come back.
#[derive(Clone, Debug, PartialEq)]
pub struct Failure {
    /// Its name (`prefill-K` or `decode-K`).
    pub worker: String,
    /// Virtual seconds, on the workload's clock.
    pub at: f64,
    /// When it comes back: a crashed worker as a new process (an empty cache, its share of requests ramped up over
    /// the scheduler's `slow_start_secs`); a hung one goes on as it was; erring and stalled ones heal.
    pub back: Option<f64>,
    pub fault: Fault,
}

/// How a worker fails ([`failover`](super::failover)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fault {
    /// Its process dies: its connections break, and the routers know at once.
    #[default]
    Crash,
    /// Its process stops (a frozen host, a paused VM, a partition) with its connections open, so the routers learn
    /// of it only through their timeouts. When it goes on, its cache is intact: it reads the calls whose connection
    /// is still open, and routers whose watchdog had dropped it join it again.
    Hang,
    /// It answers every call at once with an error (a broken device), while its streams go on: the routers still
    /// see it up, idle, holding its cache, and only their circuit breakers keep requests away.
    Errors,
    /// Its engine hangs (a hung device) while its process answers and reports: no step ends until it is unstuck.
    /// The routers find it stalled once it has held work for `stall_after` without computing anything; without a
    /// stall limit, only their call timeouts give up on what they sent it.
    Stall,
}
