//! What the scheduler sees: each worker's overlap with the request and its load, as plain numbers.

use serde::Serialize;

pub use kv_index::{Overlap, WorkerId};

/// What a worker can do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerRole {
    Prefill,
    Decode,
    /// Prefills and decodes.
    Both,
}

impl WorkerRole {
    pub fn prefills(self) -> bool {
        matches!(self, WorkerRole::Prefill | WorkerRole::Both)
    }

    pub fn decodes(self) -> bool {
        matches!(self, WorkerRole::Decode | WorkerRole::Both)
    }
}

/// A worker's load as the router believes it now (reports reconciled with what the router sent since).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Load {
    pub active_prefill_tokens: u64,
    /// Device KV blocks in use by running sequences.
    pub active_blocks: u64,
    pub capacity_blocks: u64,
    pub active_requests: u64,
}

/// A worker's measured speeds (learned from its reports); `None` until it has done enough to measure.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Speed {
    /// Tokens its engine computes per second of compute.
    pub prefill_tokens_per_sec: Option<f64>,
    /// Bytes per second of its KV pulls.
    pub transfer_bytes_per_sec: Option<f64>,
}

/// One worker as a scheduling candidate.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerView {
    pub id: WorkerId,
    pub name: String,
    pub role: WorkerRole,
    pub overlap: Overlap,
    /// Blocks of the request already in use by requests in flight on the worker (not cached: active).
    pub active_overlap: usize,
    pub load: Load,
    /// Slow start: the share of requests a new worker may take, from near 0 up to 1 (fully warmed up).
    pub ramp: f64,
    /// Tokens its engine computes per step (`Info`); 0 when it did not say.
    pub max_num_batched_tokens: u64,
    /// Bytes of one KV block on this worker.
    pub block_bytes: u64,
    pub speed: Speed,
    /// Its overlap is predicted from the prompts the router sent it, not reported (an engine without KV events).
    pub predicted: bool,
}

/// The request, reduced to what routing needs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouteRequest {
    /// Input sequence length (prompt tokens).
    pub isl: u64,
    pub block_size: u64,
    /// The chained hash of the prompt's first blocks (up to `prefix_hash_blocks` of them), or of what it has:
    /// equal keys, equal starts (the `prefix_hash` policy's key).
    pub prefix_key: u64,
    /// A key of the whole prompt (its last full block's chained hash and its length): what hashed tie-breaking
    /// ranks the tied workers by, so the same prompt in the same state goes to the same worker in any router.
    pub key: u64,
    /// The worker that last computed a prompt with this request's `prompt_cache_key` (credited
    /// `cache_key_credit` blocks), if the key is remembered.
    pub affinity: Option<WorkerId>,
    /// vLLM's request priority: a negative one (more urgent than the default) is never refused by the busy and
    /// shedding rules.
    pub priority: i32,
}

impl RouteRequest {
    /// A request of `isl` tokens with chained block hashes `hashes` (its full blocks), keyed on its first
    /// `prefix_blocks` blocks.
    pub fn new(isl: u64, block_size: u64, hashes: &[kv_cache::SeqHash], prefix_blocks: usize) -> RouteRequest {
        let prefix_key = hashes.get(prefix_blocks.min(hashes.len()).wrapping_sub(1)).map_or(isl, |h| h.0);
        let key = hashes.last().map_or(0, |h| h.0) ^ isl.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        RouteRequest { isl, block_size, prefix_key, key, affinity: None, priority: 0 }
    }

    /// `ceil(isl / block_size)`.
    pub fn request_blocks(&self) -> u64 {
        self.isl.div_ceil(self.block_size.max(1))
    }
}
