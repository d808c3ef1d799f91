//! The scheduler's weights and thresholds (`routing.md`): typed, validated as a whole, changeable live.

use serde::{Deserialize, Serialize};

/// Which rule picks the workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// The KV-aware cost (`routing.md`): overlap credit against load.
    #[default]
    Kv,
    RoundRobin,
    Random,
    /// Fewest active prefill tokens (prefill) or blocks (decode).
    LeastLoaded,
    /// The less loaded of two random candidates.
    PowerOfTwo,
    /// Consistent hashing of the prompt's first blocks with bounded load: each prefix has a home worker (by
    /// rendezvous hashing), passed over when it has more than `prefix_hash_load_factor` times the mean load.
    /// Prefill only; decode goes to the least loaded.
    PrefixHash,
    /// SGLang's gateway rule: cache-aware (the longest prefix match, when at least `cache_threshold` of the
    /// prompt) unless the load is imbalanced past both balance thresholds, then the shortest queue. Prefill
    /// only; decode goes to the least loaded.
    SglangThreshold,
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Kv => "kv",
            Policy::RoundRobin => "round_robin",
            Policy::Random => "random",
            Policy::LeastLoaded => "least_loaded",
            Policy::PowerOfTwo => "power_of_two",
            Policy::PrefixHash => "prefix_hash",
            Policy::SglangThreshold => "sglang_threshold",
        }
    }
}

/// What the prefill term of the kv cost counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum CostUnits {
    /// Uncached prompt blocks, queued plus this request's, whatever the worker's speed (`routing.md`).
    #[default]
    Blocks,
    /// The same blocks' predicted prefill time: blocks scaled by the fleet's mean measured prefill speed over the
    /// worker's own, so a twice-as-fast worker's queue costs half. Where every worker measures the same speed (or
    /// none is measured yet) it equals `blocks`, so the other terms keep their weights.
    Seconds,
}

/// How a tie between equally cheap workers is broken (`temperature` 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Ties {
    /// Uniformly at random, from the router's seeded random source (`routing.md`; the default).
    #[default]
    Random,
    /// By rendezvous hashing of the request's prompt with each tied worker's id: uniform over different prompts,
    /// but a function of the request and the router's view alone, so a decision can be reproduced without
    /// replaying every decision before it, by a router that numbers the workers alike (ids follow the order the
    /// workers were first followed: the simulator, against `tandem up`). As good as random ties in every
    /// measurement of `docs/simulation.md`, but identical prompts arriving at once at several replicas all take
    /// the same worker while they tie.
    Hashed,
}

/// When to skip the prefill pool and prefill on the decode worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum DisaggregationRule {
    /// Locally when little uncached work is left and much of the prompt is already on the decode worker.
    #[default]
    IslBounding,
    /// Locally when the best prefill worker is overloaded.
    PrefillLoad,
    /// Either of the two.
    IslOrLoad,
    /// Always disaggregate when a prefill worker is alive (for comparison).
    Always,
    /// Never disaggregate: every request is prefilled on its decode worker.
    Never,
}

/// Dynamo's defaults where `routing.md` names them; every other default says why.
pub mod defaults {
    pub const OVERLAP_CREDIT: f64 = 1.0;
    /// Off, as Dynamo ships it: decaying the credit of a busy worker only pays when a few prefixes are very hot.
    pub const DECAY: f64 = 0.0;
    pub const HOST_WEIGHT: f64 = 0.75;
    pub const DISK_WEIGHT: f64 = 0.25;
    /// Blocks an engine without KV events is only predicted to hold (from the prompts sent to it) count as
    /// device blocks, as Dynamo's and SGLang's routers count them without events; lower it when such engines
    /// evict more than their predicted capacity says.
    pub const PREDICTED_WEIGHT: f64 = 1.0;
    pub const PREFILL_LOAD_SCALE: f64 = 1.0;
    pub const ACTIVE_REQUEST_WEIGHT: f64 = 0.0;
    /// A request's `prompt_cache_key` credits the worker that last computed a prompt with that key as if it held
    /// 16 more of the prompt's blocks (256 tokens): enough to keep a session in place against small load
    /// differences, not enough to pile sessions onto a busy worker.
    pub const CACHE_KEY_CREDIT: f64 = 16.0;
    pub const TEMPERATURE: f64 = 0.0;
    pub const MAX_LOCAL_PREFILL_TOKENS: u64 = 2048;
    /// At least 30% of the prompt must already be on the decode worker to prefill there.
    pub const LOCAL_PREFILL_FRACTION: f64 = 0.7;
    pub const PREFILL_LOAD_THRESHOLD: f64 = 4.0;
    /// The engine's default step budget (`engine::generate::DEFAULT_MAX_BATCHED_TOKENS`), used for a worker that
    /// does not report its own in `Info`.
    pub const MAX_NUM_BATCHED_TOKENS: u64 = 2048;
    /// QUIC between two workers, as `tandem bench transfer` measured it (0.35 GB/s on loopback); used until the
    /// decode worker's own pulls have been measured.
    pub const TRANSFER_BYTES_PER_SEC: f64 = 350e6;
    /// Prefill locally when moving the KV would take longer than this many times computing it there.
    pub const TRANSFER_COST_RATIO: f64 = 1.0;
    /// A decode worker with more of its KV in use than this never also prefills.
    pub const LOCAL_PREFILL_VETO: f64 = 0.9;
    /// A decode worker that would pass this fraction of its KV is near exhaustion (it would preempt).
    pub const DECODE_KV_LIMIT: f64 = 0.95;
    /// A new worker's share ramps from little to full over this time.
    pub const SLOW_START_SECS: f64 = 10.0;
    /// Prefix hashing keys on the first 4 blocks (64 tokens): a system prompt's start, before users differ.
    pub const PREFIX_HASH_BLOCKS: usize = 4;
    /// A home worker past 1.25 times the mean load is passed over (the bounded-load paper's usual c).
    pub const PREFIX_HASH_LOAD_FACTOR: f64 = 1.25;
    /// SGLang router defaults (`cache_threshold`, `balance_abs_threshold`, `balance_rel_threshold`).
    pub const CACHE_THRESHOLD: f64 = 0.3;
    pub const BALANCE_ABS_THRESHOLD: f64 = 64.0;
    pub const BALANCE_REL_THRESHOLD: f64 = 1.5;
}

/// Every knob of the scheduler.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerConfig {
    pub policy: Policy,
    pub overlap_credit: f64,
    pub decay: f64,
    pub host_weight: f64,
    pub disk_weight: f64,
    /// Credit per block a worker is only predicted to hold (an engine that publishes no KV events), in place
    /// of `overlap_credit`.
    pub predicted_weight: f64,
    pub prefill_load_scale: f64,
    pub active_request_weight: f64,
    /// Blocks of prefill credited to the worker that last computed a prompt with the request's
    /// `prompt_cache_key` (0: keys do not steer routing).
    pub cache_key_credit: f64,
    pub temperature: f64,
    /// How ties are broken at temperature 0.
    pub ties: Ties,
    /// Blocks or predicted seconds for the prefill term (heterogeneous fleets).
    pub cost_units: CostUnits,
    /// A prefill worker with more active prefill tokens than this is busy (skipped); none: no limit.
    pub busy_prefill_tokens: Option<u64>,
    /// A worker with more active KV blocks than this fraction of its capacity is busy; none: no limit.
    pub busy_kv_fraction: Option<f64>,
    pub disaggregation: DisaggregationRule,
    pub max_local_prefill_tokens: u64,
    pub local_prefill_fraction: f64,
    pub prefill_load_threshold: f64,
    pub max_num_batched_tokens: u64,
    /// KV transfer bandwidth assumed until a worker's pulls are measured.
    pub transfer_bytes_per_sec: f64,
    /// Prefill on the decode worker when the transfer would take more than this times the local prefill.
    pub transfer_cost_ratio: f64,
    pub local_prefill_veto: f64,
    pub decode_kv_limit: f64,
    pub slow_start_secs: f64,
    /// `prefix_hash`: leading blocks that make the key.
    pub prefix_hash_blocks: usize,
    /// `prefix_hash`: a worker above this many times the mean load (plus one request) is passed over.
    pub prefix_hash_load_factor: f64,
    /// `sglang_threshold`: the least share of the prompt a worker must hold to be chosen for its cache.
    pub cache_threshold: f64,
    /// `sglang_threshold`: the load is imbalanced when max − min exceeds this and max exceeds
    /// `balance_rel_threshold` × min (load in requests in flight).
    pub balance_abs_threshold: f64,
    pub balance_rel_threshold: f64,
    /// Refuse a request (429 with Retry-After) when the worker that would prefill it has more than this many
    /// milliseconds of prompts queued at its measured speed; none: never (requests queue at the workers).
    pub shed_wait_ms: Option<f64>,
    /// Count a disaggregated request on its decode worker from the routing decision on, not only once the decode
    /// worker starts it (after the prefill and the pull): requests routed meanwhile see the decode work coming
    /// (`docs/simulation.md`, "Counting the decode worker at the decision").
    pub reserve_decode: bool,
}

impl Default for SchedulerConfig {
    fn default() -> SchedulerConfig {
        use defaults::*;
        SchedulerConfig {
            policy: Policy::Kv,
            overlap_credit: OVERLAP_CREDIT,
            decay: DECAY,
            host_weight: HOST_WEIGHT,
            disk_weight: DISK_WEIGHT,
            predicted_weight: PREDICTED_WEIGHT,
            prefill_load_scale: PREFILL_LOAD_SCALE,
            active_request_weight: ACTIVE_REQUEST_WEIGHT,
            cache_key_credit: CACHE_KEY_CREDIT,
            temperature: TEMPERATURE,
            ties: Ties::Random,
            cost_units: CostUnits::Blocks,
            busy_prefill_tokens: None,
            busy_kv_fraction: None,
            disaggregation: DisaggregationRule::IslBounding,
            max_local_prefill_tokens: MAX_LOCAL_PREFILL_TOKENS,
            local_prefill_fraction: LOCAL_PREFILL_FRACTION,
            prefill_load_threshold: PREFILL_LOAD_THRESHOLD,
            max_num_batched_tokens: MAX_NUM_BATCHED_TOKENS,
            transfer_bytes_per_sec: TRANSFER_BYTES_PER_SEC,
            transfer_cost_ratio: TRANSFER_COST_RATIO,
            local_prefill_veto: LOCAL_PREFILL_VETO,
            decode_kv_limit: DECODE_KV_LIMIT,
            slow_start_secs: SLOW_START_SECS,
            prefix_hash_blocks: PREFIX_HASH_BLOCKS,
            prefix_hash_load_factor: PREFIX_HASH_LOAD_FACTOR,
            cache_threshold: CACHE_THRESHOLD,
            balance_abs_threshold: BALANCE_ABS_THRESHOLD,
            balance_rel_threshold: BALANCE_REL_THRESHOLD,
            shed_wait_ms: None,
            reserve_decode: true,
        }
    }
}

impl SchedulerConfig {
    /// This configuration with `fields` (names and values as in the `[scheduler]` table) changed, validated:
    /// what `PUT /admin/router-config` applies and what `tandem tune` tries.
    pub fn patched(&self, fields: serde_json::Map<String, serde_json::Value>) -> Result<SchedulerConfig, String> {
        let mut current = serde_json::to_value(self).map_err(|e| e.to_string())?;
        if let serde_json::Value::Object(obj) = &mut current {
            obj.extend(fields);
        }
        let next: SchedulerConfig = serde_json::from_value(current).map_err(|e| e.to_string())?;
        next.validate().map_err(|errors| errors.join("; "))?;
        Ok(next)
    }

    /// Every problem with the values, all at once.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut errors = Vec::new();
        let mut non_negative = |name: &str, v: f64| {
            if !(v.is_finite() && v >= 0.0) {
                errors.push(format!("{name} must be a finite number >= 0, got {v}"));
            }
        };
        non_negative("overlap_credit", self.overlap_credit);
        non_negative("decay", self.decay);
        non_negative("host_weight", self.host_weight);
        non_negative("disk_weight", self.disk_weight);
        non_negative("predicted_weight", self.predicted_weight);
        non_negative("prefill_load_scale", self.prefill_load_scale);
        non_negative("active_request_weight", self.active_request_weight);
        non_negative("cache_key_credit", self.cache_key_credit);
        non_negative("temperature", self.temperature);
        non_negative("prefill_load_threshold", self.prefill_load_threshold);
        non_negative("slow_start_secs", self.slow_start_secs);
        non_negative("transfer_cost_ratio", self.transfer_cost_ratio);
        non_negative("balance_abs_threshold", self.balance_abs_threshold);
        if let Some(ms) = self.shed_wait_ms {
            non_negative("shed_wait_ms", ms);
        }
        if !(self.prefix_hash_load_factor.is_finite() && self.prefix_hash_load_factor >= 1.0) {
            errors.push(format!("prefix_hash_load_factor must be >= 1, got {}", self.prefix_hash_load_factor));
        }
        if !(self.balance_rel_threshold.is_finite() && self.balance_rel_threshold >= 1.0) {
            errors.push(format!("balance_rel_threshold must be >= 1, got {}", self.balance_rel_threshold));
        }
        if !(0.0..=1.0).contains(&self.cache_threshold) {
            errors.push(format!("cache_threshold must be in [0, 1], got {}", self.cache_threshold));
        }
        if self.prefix_hash_blocks == 0 {
            errors.push("prefix_hash_blocks must be at least 1".into());
        }
        if !(self.transfer_bytes_per_sec.is_finite() && self.transfer_bytes_per_sec > 0.0) {
            errors.push(format!("transfer_bytes_per_sec must be > 0, got {}", self.transfer_bytes_per_sec));
        }
        let mut fraction = |name: &str, v: f64| {
            if !(v > 0.0 && v <= 1.0) {
                errors.push(format!("{name} must be in (0, 1], got {v}"));
            }
        };
        fraction("local_prefill_fraction", self.local_prefill_fraction);
        fraction("local_prefill_veto", self.local_prefill_veto);
        fraction("decode_kv_limit", self.decode_kv_limit);
        if let Some(f) = self.busy_kv_fraction {
            fraction("busy_kv_fraction", f);
        }
        if self.max_num_batched_tokens == 0 {
            errors.push("max_num_batched_tokens must be at least 1".into());
        }
        if errors.is_empty() { Ok(()) } else { Err(errors) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_round_trip() {
        let c = SchedulerConfig::default();
        assert_eq!(c.validate(), Ok(()));
        let json = serde_json::to_string(&c).expect("json");
        assert_eq!(serde_json::from_str::<SchedulerConfig>(&json).expect("parses"), c);
    }

    #[test]
    fn every_bad_value_is_reported_and_unknown_keys_refused() {
        let c = SchedulerConfig { decay: -1.0, temperature: f64::NAN, decode_kv_limit: 1.5, ..Default::default() };
        let errors = c.validate().expect_err("invalid");
        assert_eq!(errors.len(), 3, "{errors:?}");
        assert!(serde_json::from_str::<SchedulerConfig>(r#"{"overlap_weight": 1}"#).is_err());
        let partial: SchedulerConfig = serde_json::from_str(r#"{"policy": "round_robin", "decay": 2}"#).expect("ok");
        assert_eq!((partial.policy, partial.decay, partial.host_weight), (Policy::RoundRobin, 2.0, 0.75));
    }
}
