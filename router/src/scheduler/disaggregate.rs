//! Conditional disaggregation: whether the prompt is prefilled on a prefill worker or on the decode worker.

use serde::Serialize;

use super::Choice;
use super::RouteError;
use super::config::{DisaggregationRule, SchedulerConfig};
use super::view::{RouteRequest, WorkerView};

/// Why a request was or was not disaggregated (a metric label and a span attribute).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// The rule found enough uncached work for a prefill worker to pay.
    PrefillRemote,
    /// Much of the prompt is already on the decode worker and little is left to compute.
    CachedOnDecode,
    /// The best prefill worker is overloaded.
    PrefillOverloaded,
    /// Moving the KV would take longer than computing it on the decode worker.
    TransferCostly,
    /// The rule said local, but the decode worker's KV is too full to also prefill there.
    DecodeTooFull,
    /// No prefill-only worker is alive.
    NoPrefillWorkers,
    /// Every prefill worker is over its busy thresholds, and the decode worker has room to prefill.
    PrefillPoolBusy,
    /// The best prefill worker is the decode worker itself.
    SameWorker,
    ConfiguredAlways,
    ConfiguredNever,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::PrefillRemote => "prefill_remote",
            Reason::CachedOnDecode => "cached_on_decode",
            Reason::PrefillOverloaded => "prefill_overloaded",
            Reason::TransferCostly => "transfer_costly",
            Reason::DecodeTooFull => "decode_too_full",
            Reason::NoPrefillWorkers => "no_prefill_workers",
            Reason::PrefillPoolBusy => "prefill_pool_busy",
            Reason::SameWorker => "same_worker",
            Reason::ConfiguredAlways => "configured_always",
            Reason::ConfiguredNever => "configured_never",
        }
    }
}

/// The prefill side as the rules see it.
#[derive(Clone, Copy, Debug)]
pub enum PrefillPool<'a> {
    /// No prefill-only worker is alive.
    Absent,
    /// Prefill workers exist, but every one is over its busy thresholds.
    Busy,
    /// The best prefill worker, as chosen.
    Chosen(&'a Choice, &'a WorkerView),
}

/// Whether the decode worker's KV use forbids it to also prefill (the veto).
fn vetoed(decode: &WorkerView, cfg: &SchedulerConfig) -> bool {
    decode.load.active_blocks as f64 > cfg.local_prefill_veto * decode.load.capacity_blocks as f64
}

/// Seconds to move the blocks of the prompt the decode worker lacks, and to compute its uncached tokens there.
/// Speeds are the decode worker's measured ones; the transfer falls back to the configured bandwidth, and without
/// a measured prefill speed there is nothing to compare (`None`).
fn transfer_and_local_secs(
    req: &RouteRequest,
    decode: &WorkerView,
    eff_isl: u64,
    cfg: &SchedulerConfig,
) -> Option<(f64, f64)> {
    let prefill_rate = decode.speed.prefill_tokens_per_sec.filter(|r| *r > 0.0)?;
    let bandwidth = decode.speed.transfer_bytes_per_sec.filter(|b| *b > 0.0).unwrap_or(cfg.transfer_bytes_per_sec);
    let missing = req.request_blocks().saturating_sub(decode.overlap.device as u64);
    Some((missing as f64 * decode.block_bytes as f64 / bandwidth, eff_isl as f64 / prefill_rate))
}

/// `(disaggregate, reason)` for a request whose decode worker is `decode`; `Err` when the prefill pool is busy and
/// the decode worker may not prefill either (the request waits or is refused, never silently overloads anyone).
pub fn decide(
    req: &RouteRequest,
    decode: &WorkerView,
    prefill: PrefillPool<'_>,
    cfg: &SchedulerConfig,
) -> Result<(bool, Reason), RouteError> {
    let (choice, prefill_worker) = match prefill {
        PrefillPool::Absent => return Ok((false, Reason::NoPrefillWorkers)),
        PrefillPool::Busy if vetoed(decode, cfg) => return Err(RouteError::AllBusy),
        PrefillPool::Busy => return Ok((false, Reason::PrefillPoolBusy)),
        PrefillPool::Chosen(c, w) => (c, w),
    };
    if choice.id == decode.id {
        return Ok((false, Reason::SameWorker));
    }
    let (by_isl, by_load) = match cfg.disaggregation {
        DisaggregationRule::Always => return Ok((true, Reason::ConfiguredAlways)),
        DisaggregationRule::Never => return Ok((false, Reason::ConfiguredNever)),
        DisaggregationRule::IslBounding => (true, false),
        DisaggregationRule::PrefillLoad => (false, true),
        DisaggregationRule::IslOrLoad => (true, true),
    };
    let eff_isl = req.isl.saturating_sub(decode.overlap.device as u64 * req.block_size);
    let cached = by_isl
        && eff_isl < cfg.max_local_prefill_tokens
        && (eff_isl as f64) < cfg.local_prefill_fraction * req.isl as f64;
    let best_prefill_tokens = choice.chosen().map_or(0, |c| c.active_prefill_tokens) as f64;
    let budget = match prefill_worker.max_num_batched_tokens {
        0 => cfg.max_num_batched_tokens,
        n => n,
    };
    let overloaded = by_load && best_prefill_tokens > cfg.prefill_load_threshold * budget as f64;
    let costly = transfer_and_local_secs(req, decode, eff_isl, cfg)
        .is_some_and(|(transfer, local)| transfer > cfg.transfer_cost_ratio * local);
    let reason = match (cached, overloaded, costly) {
        (false, false, false) => return Ok((true, Reason::PrefillRemote)),
        (true, _, _) => Reason::CachedOnDecode,
        (false, true, _) => Reason::PrefillOverloaded,
        (false, false, true) => Reason::TransferCostly,
    };
    if vetoed(decode, cfg) {
        return Ok((true, Reason::DecodeTooFull));
    }
    Ok((false, reason))
}
