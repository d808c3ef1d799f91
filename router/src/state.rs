//! What every request handler shares: the cluster, the text model, the live scheduler config, limits and
//! admission control.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use engine::text::TextModel;
use tokio::sync::Semaphore;

use crate::cluster::Cluster;
use crate::metrics::RouterMetrics;
use crate::resilience::{RetryBudget, RetryBudgetSettings};
use crate::scheduler::RouteState;
use crate::scheduler::config::SchedulerConfig;

/// Limits on requests (typed, with named defaults in [`crate::config`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    pub max_in_flight: usize,
    pub max_queue: usize,
    /// Whole-request deadline (504 past it).
    pub request_timeout: Duration,
    /// Longest wait for a prefill's answer, and for a decode stream's first token (it may prefill itself).
    pub prefill_timeout: Duration,
    /// Longest silence of a decode stream between tokens; past it the stream is given up and resumed elsewhere.
    pub decode_idle_timeout: Duration,
    /// Prefill workers tried before the decode worker prefills itself.
    pub max_prefill_attempts: usize,
    /// Decode workers tried, including resumptions after a worker is lost mid-stream.
    pub max_decode_attempts: usize,
    /// Output budget when a request names none.
    pub default_max_tokens: u32,
    /// How many retries and failovers the router may add to the load.
    pub retry_budget: RetryBudgetSettings,
    /// Stream a long disaggregated prompt's KV: prefill it in pieces of about a chunk, the decode worker pulling
    /// each finished piece while the next computes (`crate::stream_kv`).
    pub stream_kv: bool,
}

/// Shared by every handler.
#[derive(Debug)]
pub struct RouterState {
    pub cluster: Arc<Cluster>,
    pub text: Arc<TextModel>,
    /// Structured outputs' grammars, compiled here to refuse a bad one before any worker sees it.
    pub grammars: engine::grammar::Grammars,
    /// The model name clients use.
    pub served_model: String,
    pub max_model_len: usize,
    /// How the served model writes tool calls (`tool_choice: auto`); `None`: `auto` is refused.
    pub tool_call_parser: Option<crate::http::tools::ToolParser>,
    /// How the served model marks its thinking; `None`: the answer is all content.
    pub reasoning_parser: Option<crate::http::reasoning::ReasoningParser>,
    pub scheduler: RwLock<SchedulerConfig>,
    pub limits: Limits,
    /// Accepted bearer keys and their tenants; none: no key needed.
    pub tenants: crate::tenants::Tenants,
    /// The Responses API's stored responses.
    pub responses: crate::response_store::ResponseStore,
    /// The key for `/admin/*` and `/debug/*`; `None`: those answer only on loopback.
    pub admin_key: Option<String>,
    pub admission: crate::admission::Admission,
    /// The scheduler's random source and round robin's places.
    pub route_state: Mutex<RouteState>,
    /// This router process's random id: with `sequence`, request ids unique across replicas and restarts.
    pub instance: u64,
    pub sequence: AtomicU64,
    pub metrics: RouterMetrics,
    /// Releases prefill leases the router will not hand to a decode worker (mutual TLS, the router's certificate).
    pub leases: Option<Arc<kv_transfer::quic::QuicClient>>,
    pub retry_budget: Mutex<RetryBudget>,
    /// Tokenizations running at once on the blocking pool.
    pub tokenize_slots: Semaphore,
    /// The traffic recording, while one runs.
    pub recording: Mutex<Option<crate::record::Recording>>,
}

impl RouterState {
    pub fn scheduler_config(&self) -> SchedulerConfig {
        self.scheduler.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn set_scheduler_config(&self, c: SchedulerConfig) {
        *self.scheduler.write().unwrap_or_else(|p| p.into_inner()) = c;
    }

    /// Adds a request to the recording, if one runs, and says where; a failed write ends the recording (the traffic
    /// goes on).
    pub fn record(
        &self,
        arrived: Instant,
        a: &crate::record::Arrival<'_>,
        outcome: crate::record::Outcome<'_>,
    ) -> Option<crate::record::Entry> {
        self.recording_write(|r| r.push(arrived, a, outcome))
    }

    /// Adds what a recorded request generated, once it has ended (`Recording::push_output`).
    pub fn record_output(&self, entry: crate::record::Entry, tokens: usize, finish: &str) {
        self.recording_write(|r| r.push_output(entry, tokens, finish));
    }

    /// `write` on the recording, if one runs; a failed write ends it.
    fn recording_write<T>(
        &self,
        write: impl FnOnce(&mut crate::record::Recording) -> Result<T, crate::record::RecordError>,
    ) -> Option<T> {
        let mut guard = self.recording.lock().unwrap_or_else(|p| p.into_inner());
        match write(guard.as_mut()?) {
            Ok(v) => Some(v),
            Err(e) => {
                tracing::error!(error = %e, "traffic recording stopped");
                *guard = None;
                None
            }
        }
    }

    /// A fresh request number.
    pub fn next_request(&self) -> u64 {
        self.sequence.fetch_add(1, Ordering::Relaxed)
    }

    /// A request starts running: it adds to what retries may spend.
    pub fn request_started(&self) {
        let mut b = self.retry_budget.lock().unwrap_or_else(|p| p.into_inner());
        b.request(std::time::Instant::now(), &self.limits.retry_budget);
    }

    /// Whether one more retry or failover is within the budget (and takes it); a refusal is counted.
    pub fn try_retry(&self) -> bool {
        let mut b = self.retry_budget.lock().unwrap_or_else(|p| p.into_inner());
        let ok = b.try_retry(std::time::Instant::now(), &self.limits.retry_budget);
        if !ok {
            self.metrics.retries_denied.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }
}
