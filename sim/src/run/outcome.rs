//! What a run produced: the records, the work its engines did, where each request went and how evenly.

use std::collections::BTreeMap;

use loadgen::summary::Record;
use router::scheduler::Candidates;
use router::scheduler::view::WorkerRole;

use super::Sim;

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
    /// The decision's candidates as scored, with [`Settings::record_candidates`](super::Settings::record_candidates) (never in a replay).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub candidates: Option<Candidates>,
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

impl Sim<'_> {
    /// Adds the current spread of work over each pool's workers to the balance figures.
    pub(super) fn sample_balance(&mut self, now: f64) {
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
}
