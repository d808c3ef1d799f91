//! The cost formulas of `routing.md`, one function each, no state.

use super::config::SchedulerConfig;
use super::view::{RouteRequest, WorkerView};

/// A prefill candidate's terms and cost (lower is better).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillCost {
    pub potential_decode_blocks: u64,
    /// Blocks credited because `w` last computed a prompt with the request's `prompt_cache_key`.
    pub affinity_credit: f64,
    pub cost: f64,
}

/// Dynamo's prefill cost for `w`, given the least active prefill tokens over all candidates. `speed_factor`
/// scales the prefill term (1 in block units; the fleet's mean prefill speed over `w`'s in seconds units).
pub fn prefill_cost(
    req: &RouteRequest,
    w: &WorkerView,
    min_active_prefill: u64,
    speed_factor: f64,
    cfg: &SchedulerConfig,
) -> PrefillCost {
    let bs = req.block_size.max(1) as f64;
    let request_blocks = req.request_blocks().max(1) as f64;
    let raw_prefill_blocks = (w.load.active_prefill_tokens + req.isl) as f64 / bs;
    let excess = w.load.active_prefill_tokens.saturating_sub(min_active_prefill) as f64 / bs;
    let decay = if cfg.decay == 0.0 { 1.0 } else { 1.0 / (1.0 + cfg.decay * excess / request_blocks) };
    let o = w.overlap;
    let device_credit = if w.predicted { cfg.predicted_weight } else { cfg.overlap_credit };
    let credit =
        device_credit * decay * o.device as f64 + cfg.host_weight * o.host as f64 + cfg.disk_weight * o.disk as f64;
    let adjusted = (raw_prefill_blocks - credit).max(0.0);
    // Blocks active on w, plus this request's blocks not already active there (cached is not active).
    let potential_decode_blocks = w.load.active_blocks + req.request_blocks().saturating_sub(w.active_overlap as u64);
    let affinity_credit = if req.affinity == Some(w.id) { cfg.cache_key_credit } else { 0.0 };
    let cost = cfg.prefill_load_scale * speed_factor * adjusted
        + potential_decode_blocks as f64
        + cfg.active_request_weight * w.load.active_requests as f64
        - affinity_credit;
    PrefillCost { potential_decode_blocks, affinity_credit, cost }
}

/// Per candidate, what its prefill term is multiplied by: 1 in block units; in seconds units the mean measured
/// prefill speed over the candidates that have one, divided by the candidate's own (1 when it has none yet).
pub fn speed_factors(candidates: &[&WorkerView], units: super::config::CostUnits) -> Vec<f64> {
    let speed = |w: &WorkerView| w.speed.prefill_tokens_per_sec.filter(|s| *s > 0.0);
    let measured: Vec<f64> = candidates.iter().filter_map(|w| speed(w)).collect();
    if units == super::config::CostUnits::Blocks || measured.is_empty() {
        return vec![1.0; candidates.len()];
    }
    let mean = measured.iter().sum::<f64>() / measured.len() as f64;
    candidates.iter().map(|w| speed(w).map_or(1.0, |s| mean / s)).collect()
}

/// A decode candidate's cost: its active KV blocks after adding this request, as a fraction of capacity.
pub fn decode_cost(req: &RouteRequest, w: &WorkerView) -> f64 {
    (w.load.active_blocks + req.request_blocks()) as f64 / w.load.capacity_blocks.max(1) as f64
}

/// Whether taking this request would push `w` past `limit` of its KV capacity.
pub fn over_kv(req: &RouteRequest, w: &WorkerView, limit: f64) -> bool {
    decode_cost(req, w) > limit
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::view::{Load, Overlap, WorkerId, WorkerRole};

    fn worker(device: usize, host: usize, disk: usize, prefill_tokens: u64, active_blocks: u64) -> WorkerView {
        WorkerView {
            id: WorkerId(0),
            name: "w".into(),
            role: WorkerRole::Prefill,
            overlap: Overlap { device, host, disk },
            active_overlap: 0,
            load: Load {
                active_prefill_tokens: prefill_tokens,
                active_blocks,
                capacity_blocks: 1000,
                active_requests: 3,
            },
            ramp: 1.0,
            max_num_batched_tokens: 2048,
            block_bytes: 368_640,
            speed: Default::default(),
            predicted: false,
        }
    }

    /// (device, host, disk, active prefill tokens, active blocks, min active prefill, config tweak, cost).
    #[test]
    fn the_formula_term_by_term() {
        let req = RouteRequest { isl: 160, block_size: 16, prefix_key: 0, key: 0, affinity: None, priority: 0 };
        let base = SchedulerConfig::default();
        let active = |mut w: WorkerView, n| {
            w.active_overlap = n;
            w
        };
        let cases: Vec<(&str, WorkerView, u64, SchedulerConfig, f64)> = vec![
            // raw = 10, no credit, potential decode = 0 + 10.
            ("cold and idle", worker(0, 0, 0, 0, 0), 0, base.clone(), 20.0),
            // raw = 10 - 4 device = 6; potential decode = 0 + 10 (cached blocks are not active ones).
            ("device overlap", worker(4, 0, 0, 0, 0), 0, base.clone(), 16.0),
            // the same 4 blocks also in use by a running request there: potential decode = 10 - 4 = 6.
            ("device overlap, active", active(worker(4, 0, 0, 0, 4), 4), 0, base.clone(), 16.0),
            // credit = 4 + 0.75*2 + 0.25*4 = 6.5 → adjusted 3.5; potential decode 10.
            ("all tiers", worker(4, 2, 4, 0, 0), 0, base.clone(), 13.5),
            // raw = (32+160)/16 = 12, credit 4 → 8; potential decode = 5 + 10 = 15.
            ("loaded", worker(4, 0, 0, 32, 5), 0, base.clone(), 23.0),
            // decay 1: excess = 32/16 = 2 blocks, decay = 1/(1+2/10) = 5/6 → credit 10/3.
            (
                "decay",
                worker(4, 0, 0, 32, 0),
                0,
                SchedulerConfig { decay: 1.0, ..base.clone() },
                12.0 - 10.0 / 3.0 + 10.0,
            ),
            // the least loaded candidate has no excess: no decay.
            ("decay, least loaded", worker(4, 0, 0, 32, 0), 32, SchedulerConfig { decay: 1.0, ..base.clone() }, 18.0),
            // overlap beyond the load clamps to zero.
            ("credit clamps", worker(10, 0, 0, 0, 0), 0, SchedulerConfig { overlap_credit: 5.0, ..base.clone() }, 10.0),
            // scale and request weight: 2*6 + 10 + 0.5*3.
            (
                "scale and request weight",
                worker(4, 0, 0, 0, 0),
                0,
                SchedulerConfig { prefill_load_scale: 2.0, active_request_weight: 0.5, ..base.clone() },
                23.5,
            ),
        ];
        for (name, w, min, cfg, want) in cases {
            let got = prefill_cost(&req, &w, min, 1.0, &cfg).cost;
            assert!((got - want).abs() < 1e-9, "{name}: got {got}, want {want}");
        }
    }

    #[test]
    fn the_worker_a_prompt_cache_key_last_used_is_credited() {
        use crate::scheduler::view::WorkerId;
        let cfg = SchedulerConfig::default();
        let req =
            RouteRequest { isl: 160, block_size: 16, prefix_key: 0, key: 0, affinity: Some(WorkerId(0)), priority: 0 };
        // Cold and idle costs 20 (above); the credited worker 20 - 16, another worker 20.
        let c = prefill_cost(&req, &worker(0, 0, 0, 0, 0), 0, 1.0, &cfg);
        assert_eq!((c.affinity_credit, c.cost), (16.0, 4.0));
        let other = WorkerView { id: WorkerId(1), ..worker(0, 0, 0, 0, 0) };
        assert_eq!(prefill_cost(&req, &other, 0, 1.0, &cfg).cost, 20.0);
        // Load beyond the credit outweighs it: 32 more blocks queued on the credited worker.
        let busy = worker(0, 0, 0, 32 * 16, 0);
        assert!(prefill_cost(&req, &busy, 0, 1.0, &cfg).cost > prefill_cost(&req, &other, 0, 1.0, &cfg).cost);
        let off = SchedulerConfig { cache_key_credit: 0.0, ..cfg };
        assert_eq!(prefill_cost(&req, &worker(0, 0, 0, 0, 0), 0, 1.0, &off).cost, 20.0);
    }

    #[test]
    fn in_seconds_a_faster_worker_queue_costs_less_and_equal_workers_cost_as_in_blocks() {
        use crate::scheduler::config::CostUnits;
        use crate::scheduler::view::Speed;
        let req = RouteRequest { isl: 160, block_size: 16, prefix_key: 0, key: 0, affinity: None, priority: 0 };
        let with_speed = |tps: Option<f64>| WorkerView {
            speed: Speed { prefill_tokens_per_sec: tps, ..Speed::default() },
            ..worker(0, 0, 0, 320, 0)
        };
        // Mean speed 3000 tokens/s: the fast worker's prefill term is scaled by 3000/4000, the slow one's by 3000/2000.
        let (fast, slow, unmeasured) = (with_speed(Some(4000.0)), with_speed(Some(2000.0)), with_speed(None));
        let f = speed_factors(&[&fast, &slow, &unmeasured], CostUnits::Seconds);
        assert_eq!(f, vec![0.75, 1.5, 1.0]);
        assert_eq!(speed_factors(&[&fast, &slow], CostUnits::Blocks), vec![1.0, 1.0]);
        // raw prefill = (320 + 160) / 16 = 30 blocks, nothing cached, no decode blocks active: 10 potential.
        let cfg = SchedulerConfig::default();
        assert!((prefill_cost(&req, &fast, 0, f[0], &cfg).cost - (0.75 * 30.0 + 10.0)).abs() < 1e-9);
        assert!((prefill_cost(&req, &slow, 0, f[1], &cfg).cost - (1.5 * 30.0 + 10.0)).abs() < 1e-9);
        // Equal speeds: seconds and blocks agree.
        let same = with_speed(Some(3000.0));
        assert_eq!(speed_factors(&[&same, &same], CostUnits::Seconds), vec![1.0, 1.0]);
    }

    #[test]
    fn request_blocks_round_up_and_decode_cost_is_a_fraction() {
        let req = RouteRequest { isl: 17, block_size: 16, prefix_key: 0, key: 0, affinity: None, priority: 0 };
        assert_eq!(req.request_blocks(), 2);
        let w = worker(0, 0, 0, 0, 98);
        assert!((decode_cost(&req, &w) - 0.1).abs() < 1e-12);
        assert!(over_kv(&req, &w, 0.09) && !over_kv(&req, &w, 0.1));
    }
}
