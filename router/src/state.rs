//! What every request handler shares: the cluster, the text model, the live scheduler config, limits and
//! admission control.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use engine::text::TextModel;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::cluster::Cluster;
use crate::http::error::ApiError;
use crate::metrics::RouterMetrics;
use crate::scheduler::config::SchedulerConfig;
use crate::scheduler::rng::Rng;

/// Limits on requests (typed, with named defaults in [`crate::config`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    pub max_in_flight: usize,
    pub max_queue: usize,
    /// Whole-request deadline (504 past it).
    pub request_timeout: Duration,
    pub prefill_timeout: Duration,
    /// Prefill workers tried before the decode worker prefills itself.
    pub max_prefill_attempts: usize,
    /// Decode workers tried, including resumptions after a worker is lost mid-stream.
    pub max_decode_attempts: usize,
    /// Output budget when a request names none.
    pub default_max_tokens: u32,
}

/// Requests in flight and waiting: past `max_in_flight` they queue, past `max_queue` they are refused.
#[derive(Debug)]
pub struct Admission {
    slots: Arc<Semaphore>,
    queued: AtomicUsize,
    max_queue: usize,
}

/// Told to clients refused for load.
const RETRY_AFTER: Duration = Duration::from_secs(1);

impl Admission {
    pub fn new(max_in_flight: usize, max_queue: usize) -> Admission {
        Admission { slots: Arc::new(Semaphore::new(max_in_flight.max(1))), queued: AtomicUsize::new(0), max_queue }
    }

    /// A slot, waiting in the queue for one if needed; `Overloaded` when the queue is full.
    pub async fn admit(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        if let Ok(p) = Arc::clone(&self.slots).try_acquire_owned() {
            return Ok(p);
        }
        if self.queued.fetch_add(1, Ordering::AcqRel) >= self.max_queue {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(ApiError::Overloaded(RETRY_AFTER));
        }
        let permit = Arc::clone(&self.slots).acquire_owned().await;
        self.queued.fetch_sub(1, Ordering::AcqRel);
        permit.map_err(|_| ApiError::Unavailable("the router is shutting down".into()))
    }

    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }
}

/// Shared by every handler.
#[derive(Debug)]
pub struct RouterState {
    pub cluster: Arc<Cluster>,
    pub text: Arc<TextModel>,
    /// The model name clients use.
    pub served_model: String,
    pub max_model_len: usize,
    pub scheduler: RwLock<SchedulerConfig>,
    pub limits: Limits,
    /// Accepted bearer keys; empty: no key needed.
    pub api_keys: Vec<String>,
    pub admission: Admission,
    pub rng: Mutex<Rng>,
    /// This router process's random id: with `sequence`, request ids unique across replicas and restarts.
    pub instance: u64,
    pub sequence: AtomicU64,
    pub metrics: RouterMetrics,
    /// Releases prefill leases the router will not hand to a decode worker (mutual TLS, the router's certificate).
    pub leases: Option<Arc<kv_transfer::quic::QuicClient>>,
}

impl RouterState {
    pub fn scheduler_config(&self) -> SchedulerConfig {
        self.scheduler.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn set_scheduler_config(&self, c: SchedulerConfig) {
        *self.scheduler.write().unwrap_or_else(|p| p.into_inner()) = c;
    }

    /// A fresh request number.
    pub fn next_request(&self) -> u64 {
        self.sequence.fetch_add(1, Ordering::Relaxed)
    }
}
