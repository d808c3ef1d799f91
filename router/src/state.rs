//! What every request handler shares: the cluster, the text model, the live scheduler config, limits and
//! admission control.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use engine::text::TextModel;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::cluster::Cluster;
use crate::http::error::ApiError;
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

/// Requests in flight and waiting: past `max_in_flight` they queue, past `max_queue` they are refused.
#[derive(Debug)]
pub struct Admission {
    slots: Arc<Semaphore>,
    max_in_flight: usize,
    queued: AtomicUsize,
    max_queue: usize,
}

/// Told to clients refused for load.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// A place in the queue; leaving it (admitted, timed out, or the client gone and its future dropped) always gives
/// it back.
struct Queued<'a>(&'a AtomicUsize);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Admission {
    pub fn new(max_in_flight: usize, max_queue: usize) -> Admission {
        let max_in_flight = max_in_flight.max(1);
        Admission {
            slots: Arc::new(Semaphore::new(max_in_flight)),
            max_in_flight,
            queued: AtomicUsize::new(0),
            max_queue,
        }
    }

    /// A slot, waiting in the queue for one for at most `wait` (the request's deadline): `Overloaded` when the
    /// queue is full, `Deadline` when the wait runs out. Cancel-safe: a caller dropped while queued leaves the
    /// queue.
    pub async fn admit(&self, wait: Duration) -> Result<OwnedSemaphorePermit, ApiError> {
        if let Ok(p) = Arc::clone(&self.slots).try_acquire_owned() {
            return Ok(p);
        }
        if self.queued.fetch_add(1, Ordering::AcqRel) >= self.max_queue {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(ApiError::Overloaded(RETRY_AFTER));
        }
        let _place = Queued(&self.queued);
        match tokio::time::timeout(wait, Arc::clone(&self.slots).acquire_owned()).await {
            Ok(Ok(permit)) => Ok(permit),
            Ok(Err(_)) => Err(ApiError::Unavailable("the router is shutting down".into())),
            Err(_) => Err(ApiError::Deadline(wait)),
        }
    }

    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// Requests holding a slot.
    pub fn in_flight(&self) -> usize {
        self.max_in_flight.saturating_sub(self.slots.available_permits())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_queued_request_that_leaves_gives_its_place_back() {
        let a = Admission::new(1, 2);
        let held = a.admit(Duration::from_secs(60)).await.expect("a slot");
        for _ in 0..5 {
            // The client goes away while queued: its future is dropped mid-wait.
            let waiting = a.admit(Duration::from_secs(60));
            assert!(tokio::time::timeout(Duration::from_millis(10), waiting).await.is_err());
            assert_eq!(a.queued(), 0);
        }
        // The queue still takes two; a third is refused.
        let (first, second) = (a.admit(Duration::from_secs(60)), a.admit(Duration::from_secs(60)));
        tokio::pin!(first, second);
        assert!(futures_util::poll!(&mut first).is_pending() && futures_util::poll!(&mut second).is_pending());
        assert_eq!(a.queued(), 2);
        assert!(matches!(a.admit(Duration::from_secs(60)).await, Err(ApiError::Overloaded(_))));
        drop(held);
        let p = first.await.expect("admitted in turn");
        assert_eq!(a.queued(), 1);
        // The queue wait counts against the deadline.
        assert!(matches!(second.await, Err(ApiError::Deadline(_))));
        assert_eq!((a.queued(), a.in_flight()), (0, 1));
        drop(p);
        assert_eq!(a.in_flight(), 0);
    }
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
    pub scheduler: RwLock<SchedulerConfig>,
    pub limits: Limits,
    /// Accepted bearer keys and their tenants; none: no key needed.
    pub tenants: crate::tenants::Tenants,
    /// The key for `/admin/*` and `/debug/*`; `None`: those answer only on loopback.
    pub admin_key: Option<String>,
    pub admission: Admission,
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
