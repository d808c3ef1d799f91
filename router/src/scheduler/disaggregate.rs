//! Conditional disaggregation: whether the prompt is prefilled on a prefill worker or on the decode worker.

use serde::Serialize;

use super::Choice;
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
    /// The rule said local, but the decode worker's KV is too full to also prefill there.
    DecodeTooFull,
    /// No prefill-only worker is alive.
    NoPrefillWorkers,
    /// Every prefill worker is over its busy thresholds.
    PrefillBusy,
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
            Reason::DecodeTooFull => "decode_too_full",
            Reason::NoPrefillWorkers => "no_prefill_workers",
            Reason::PrefillBusy => "prefill_busy",
            Reason::SameWorker => "same_worker",
            Reason::ConfiguredAlways => "configured_always",
            Reason::ConfiguredNever => "configured_never",
        }
    }
}

/// `(disaggregate, reason)` for a request whose decode worker is `decode`.
pub fn decide(
    req: &RouteRequest,
    decode: &WorkerView,
    prefill: Option<&Choice>,
    any_prefillers: bool,
    cfg: &SchedulerConfig,
) -> (bool, Reason) {
    if !any_prefillers {
        return (false, Reason::NoPrefillWorkers);
    }
    let Some(prefill) = prefill else { return (false, Reason::PrefillBusy) };
    if prefill.id == decode.id {
        return (false, Reason::SameWorker);
    }
    let (by_isl, by_load) = match cfg.disaggregation {
        DisaggregationRule::Always => return (true, Reason::ConfiguredAlways),
        DisaggregationRule::Never => return (false, Reason::ConfiguredNever),
        DisaggregationRule::IslBounding => (true, false),
        DisaggregationRule::PrefillLoad => (false, true),
        DisaggregationRule::IslOrLoad => (true, true),
    };
    let eff_isl = req.isl.saturating_sub(decode.overlap.device as u64 * req.block_size);
    let cached = by_isl
        && eff_isl < cfg.max_local_prefill_tokens
        && (eff_isl as f64) < cfg.local_prefill_fraction * req.isl as f64;
    let best_prefill_tokens = prefill.chosen().map_or(0, |c| c.active_prefill_tokens) as f64;
    let overloaded = by_load && best_prefill_tokens > cfg.prefill_load_threshold * cfg.max_num_batched_tokens as f64;
    if !cached && !overloaded {
        return (true, Reason::PrefillRemote);
    }
    if decode.load.active_blocks as f64 > cfg.local_prefill_veto * decode.load.capacity_blocks as f64 {
        return (true, Reason::DecodeTooFull);
    }
    (false, if cached { Reason::CachedOnDecode } else { Reason::PrefillOverloaded })
}
