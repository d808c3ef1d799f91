//! Table-driven tests of whole decisions.

use super::config::{DisaggregationRule, Policy, SchedulerConfig};
use super::view::{Load, Overlap, RouteRequest, WorkerId, WorkerRole, WorkerView};
use super::*;

fn w(id: u32, role: WorkerRole, device: usize, prefill_tokens: u64, active_blocks: u64) -> WorkerView {
    WorkerView {
        id: WorkerId(id),
        name: format!("w{id}"),
        role,
        overlap: Overlap { device, host: 0, disk: 0 },
        active_overlap: 0,
        load: Load { active_prefill_tokens: prefill_tokens, active_blocks, capacity_blocks: 1000, active_requests: 0 },
        ramp: 1.0,
        max_num_batched_tokens: 2048,
        block_bytes: 368_640,
        speed: Default::default(),
        predicted: false,
    }
}

fn req(isl: u64) -> RouteRequest {
    RouteRequest { isl, block_size: 16, prefix_key: 0, key: 0, affinity: None, priority: 0 }
}

fn decide(r: &RouteRequest, workers: &[WorkerView], cfg: &SchedulerConfig) -> Decision {
    route(r, workers, cfg, &mut RouteState::seeded(3)).expect("routes")
}

use WorkerRole::{Both, Decode, Prefill};

#[test]
fn prefill_goes_where_the_prefix_is_and_decode_where_the_load_is_least() {
    let workers = [w(0, Prefill, 0, 0, 0), w(1, Prefill, 6, 0, 0), w(2, Decode, 6, 0, 40), w(3, Decode, 0, 0, 10)];
    let d = decide(&req(160), &workers, &SchedulerConfig::default());
    let prefill = d.prefill.as_ref().expect("a prefill choice");
    assert_eq!(prefill.id, WorkerId(1), "{d:?}");
    assert_eq!(prefill.runner_up_cost(), Some(20.0));
    assert_eq!(d.decode.id, WorkerId(3), "pure load: overlap on w2 earns it nothing");
    assert_eq!((d.disaggregate, d.reason), (true, Reason::PrefillRemote));
    assert_eq!((d.request_blocks, d.isl), (10, 160));
}

#[test]
fn a_failed_prefill_moves_on_to_the_next_cheapest_candidate() {
    // w1 holds the prefix and is chosen; w3's load makes it the dearest; the rest follow by cost.
    let workers = [
        w(0, Prefill, 0, 0, 0),
        w(1, Prefill, 6, 0, 0),
        w(2, Prefill, 3, 0, 0),
        w(3, Prefill, 0, 9000, 0),
        w(4, Decode, 0, 0, 0),
    ];
    let d = decide(&req(160), &workers, &SchedulerConfig::default());
    let prefill = d.prefill.as_ref().expect("a prefill choice");
    let order: Vec<u32> = prefill.by_preference().iter().map(|c| c.id.0).collect();
    assert_eq!(order, [1, 2, 0, 3], "{prefill:?}");
    let costs: Vec<f64> = prefill.by_preference().iter().map(|c| c.cost).collect();
    assert!(costs.windows(2).all(|p| p[0] <= p[1]), "{costs:?}");
}

#[test]
fn with_random_ties_equal_candidates_share_the_work_even_for_one_prompt() {
    let workers = [w(0, Prefill, 0, 0, 0), w(1, Prefill, 0, 0, 0), w(2, Decode, 0, 0, 0)];
    let mut rng = RouteState::seeded(11);
    let mut counts = [0; 2];
    let cfg = SchedulerConfig { ties: config::Ties::Random, ..SchedulerConfig::default() };
    for _ in 0..2000 {
        let d = route(&req(64), &workers, &cfg, &mut rng).expect("routes");
        counts[d.prefill.expect("prefill").id.0 as usize] += 1;
    }
    assert!(counts.iter().all(|&c| (800..1200).contains(&c)), "{counts:?}");
}

#[test]
fn hashed_ties_follow_the_prompt_not_the_random_source_nor_the_candidates_order() {
    let cfg = SchedulerConfig { ties: config::Ties::Hashed, ..Default::default() };
    let workers = [w(0, Prefill, 0, 0, 0), w(1, Prefill, 0, 0, 0), w(2, Prefill, 0, 0, 0), w(3, Decode, 0, 0, 0)];
    let keyed = |key: u64| RouteRequest { key, ..req(64) };
    let mut counts = [0; 3];
    for key in 0..3000 {
        let picks: Vec<WorkerId> = (0..4)
            .map(|seed| route(&keyed(key), &workers, &cfg, &mut RouteState::seeded(seed)).expect("routes"))
            .map(|d| d.prefill.expect("prefill").id)
            .collect();
        assert!(picks.iter().all(|p| *p == picks[0]), "key {key}: {picks:?}");
        let mut reversed = workers.clone();
        reversed.reverse();
        let d = route(&keyed(key), &reversed, &cfg, &mut RouteState::seeded(0)).expect("routes");
        assert_eq!(d.prefill.expect("prefill").id, picks[0], "the order of the candidates does not matter");
        counts[picks[0].0 as usize] += 1;
    }
    assert!(counts.iter().all(|&c| (850..1150).contains(&c)), "different prompts spread evenly: {counts:?}");
    // A cheaper worker still wins whatever the key; a tie is only broken among the cheapest.
    let loaded = [w(0, Prefill, 0, 64, 0), w(1, Prefill, 0, 0, 0), w(2, Prefill, 0, 0, 0), w(3, Decode, 0, 0, 0)];
    for key in 0..200 {
        let d = route(&keyed(key), &loaded, &cfg, &mut RouteState::seeded(0)).expect("routes");
        assert_ne!(d.prefill.expect("prefill").id, WorkerId(0));
    }
}

/// (name, decode worker's device overlap, its active blocks, best prefill load, rule, disaggregate, reason).
#[test]
fn conditional_disaggregation() {
    use DisaggregationRule::*;
    let cases = [
        ("cold prompt", 0, 0, 0, IslBounding, true, Reason::PrefillRemote),
        ("80% on D, 64 tokens left", 16, 0, 0, IslBounding, false, Reason::CachedOnDecode),
        ("exactly 70% left is not < 0.7", 6, 0, 0, IslBounding, true, Reason::PrefillRemote),
        ("mostly cached, but D's KV is 91% full", 16, 910, 0, IslBounding, true, Reason::DecodeTooFull),
        // The threshold is 4 steps of the prefill worker's own budget (2048 tokens, from its Info): 8192.
        ("overloaded prefill pool", 0, 0, 9000, PrefillLoad, false, Reason::PrefillOverloaded),
        ("four steps queued is not overloaded", 0, 0, 8000, PrefillLoad, true, Reason::PrefillRemote),
        ("prefill pool fine", 0, 0, 100, PrefillLoad, true, Reason::PrefillRemote),
        ("either rule: load", 0, 0, 9000, IslOrLoad, false, Reason::PrefillOverloaded),
        ("either rule: cache", 16, 0, 0, IslOrLoad, false, Reason::CachedOnDecode),
        ("always", 16, 0, 0, Always, true, Reason::ConfiguredAlways),
        ("never", 0, 0, 0, Never, false, Reason::ConfiguredNever),
    ];
    for (name, d_overlap, d_blocks, p_tokens, rule, want, reason) in cases {
        let workers = [w(0, Prefill, 0, p_tokens, 0), w(1, Decode, d_overlap, 0, d_blocks)];
        let cfg = SchedulerConfig { disaggregation: rule, ..SchedulerConfig::default() };
        // 320 tokens = 20 blocks.
        let d = decide(&req(320), &workers, &cfg);
        assert_eq!((d.disaggregate, d.reason), (want, reason), "{name}");
    }
}

#[test]
fn a_long_prompt_is_disaggregated_even_when_mostly_cached() {
    // 4096 tokens, 75% on D: 1024 left is under 2048 and under 70%: local. 8192 tokens, 50% cached: 4096 left.
    let workers = [w(0, Prefill, 0, 0, 0), w(1, Decode, 192, 0, 0)];
    let mut cfg = SchedulerConfig::default();
    assert_eq!(decide(&req(4096), &workers, &cfg).reason, Reason::CachedOnDecode);
    let workers = [w(0, Prefill, 0, 0, 0), w(1, Decode, 256, 0, 0)];
    assert_eq!(decide(&req(8192), &workers, &cfg).reason, Reason::PrefillRemote);
    cfg.max_local_prefill_tokens = 8192;
    assert_eq!(decide(&req(8192), &workers, &cfg).reason, Reason::CachedOnDecode);
}

#[test]
fn the_prefill_load_rule_uses_each_workers_own_step_budget() {
    // A prefill worker that computes 512 tokens a step is overloaded at 4 x 512 = 2048 queued tokens.
    let mut small = w(0, Prefill, 0, 3000, 0);
    small.max_num_batched_tokens = 512;
    let cfg = SchedulerConfig { disaggregation: DisaggregationRule::PrefillLoad, ..SchedulerConfig::default() };
    let d = decide(&req(320), &[small.clone(), w(1, Decode, 0, 0, 0)], &cfg);
    assert_eq!((d.disaggregate, d.reason), (false, Reason::PrefillOverloaded));
    // One that did not say falls back to the configured budget (2048: 8192 tokens).
    small.max_num_batched_tokens = 0;
    assert_eq!(decide(&req(320), &[small, w(1, Decode, 0, 0, 0)], &cfg).reason, Reason::PrefillRemote);
}

#[test]
fn a_transfer_slower_than_prefilling_locally_keeps_the_prompt_on_the_decode_worker() {
    // 320 tokens = 20 blocks of 368,640 bytes = 7.4 MB.
    let mut d = w(1, Decode, 0, 0, 0);
    let p = w(0, Prefill, 0, 0, 0);
    // No measured prefill speed on D: nothing to compare, the prompt goes to the prefill worker.
    assert_eq!(decide(&req(320), &[p.clone(), d.clone()], &SchedulerConfig::default()).reason, Reason::PrefillRemote);
    // A CPU-like decode worker (200 tokens/s: 1.6 s to prefill) and QUIC at 350 MB/s (21 ms): transfer pays.
    d.speed.prefill_tokens_per_sec = Some(200.0);
    assert_eq!(decide(&req(320), &[p.clone(), d.clone()], &SchedulerConfig::default()).reason, Reason::PrefillRemote);
    // A GPU-like one (20,000 tokens/s: 16 ms) behind a 100 MB/s link (74 ms): prefilling locally is faster.
    d.speed = view::Speed { prefill_tokens_per_sec: Some(20_000.0), transfer_bytes_per_sec: Some(100e6) };
    let got = decide(&req(320), &[p.clone(), d.clone()], &SchedulerConfig::default());
    assert_eq!((got.disaggregate, got.reason), (false, Reason::TransferCostly));
    // The same with the decode worker's KV too full to prefill there: the veto wins.
    d.load.active_blocks = 920;
    let got = decide(&req(320), &[p, d], &SchedulerConfig::default());
    assert_eq!((got.disaggregate, got.reason), (true, Reason::DecodeTooFull));
}

#[test]
fn without_prefill_workers_or_with_all_busy_the_decode_worker_prefills_if_it_may() {
    let d = decide(&req(64), &[w(1, Decode, 0, 0, 0)], &SchedulerConfig::default());
    assert_eq!((d.disaggregate, d.reason, d.prefill), (false, Reason::NoPrefillWorkers, None));
    let cfg = SchedulerConfig { busy_prefill_tokens: Some(1000), ..SchedulerConfig::default() };
    let d = decide(&req(64), &[w(0, Prefill, 0, 5000, 0), w(1, Decode, 0, 0, 0)], &cfg);
    assert_eq!((d.disaggregate, d.reason), (false, Reason::PrefillPoolBusy));
    // Every prefill worker busy and the decode worker too full to prefill: refused (queue or 429), not silent.
    let refused =
        route(&req(64), &[w(0, Prefill, 0, 5000, 0), w(1, Decode, 0, 0, 910)], &cfg, &mut RouteState::seeded(1));
    assert_eq!(refused, Err(RouteError::AllBusy));
    // A single mixed worker does both.
    let d = decide(&req(64), &[w(0, Both, 0, 0, 0)], &SchedulerConfig::default());
    assert_eq!((d.disaggregate, d.reason), (false, Reason::NoPrefillWorkers));
    let d = decide(&req(64), &[w(0, Both, 0, 0, 0), w(1, Prefill, 0, 99_999, 0)], &SchedulerConfig::default());
    assert_eq!((d.disaggregate, d.reason), (false, Reason::SameWorker));
}

#[test]
fn without_prefill_only_workers_the_prompt_goes_where_its_prefix_is_unless_that_worker_is_loaded() {
    // Workers that do both (an aggregated fleet, external engines): the one that computes the prompt decodes it,
    // chosen by the prefill cost, not by decode load alone.
    // Costs (prefill blocks less the overlap, plus decode blocks): w0 10 + 20, w1 (10 - 8) + 15, w2 10 + 10.
    let workers = [w(0, Both, 0, 0, 10), w(1, Both, 8, 0, 5), w(2, Both, 0, 0, 0)];
    let d = decide(&req(160), &workers, &SchedulerConfig::default());
    assert_eq!(d.decode.id, WorkerId(1), "{d:?}");
    assert_eq!((d.disaggregate, d.reason, d.prefill.is_none()), (false, Reason::NoPrefillWorkers, true));
    // w1 at (10 - 8) + 410: the overlap no longer pays for its load.
    let loaded = [w(0, Both, 0, 0, 10), w(1, Both, 8, 0, 400), w(2, Both, 0, 0, 0)];
    let d = decide(&req(160), &loaded, &SchedulerConfig::default());
    assert_eq!(d.decode.id, WorkerId(2), "{d:?}");
    // A predicted overlap earns `predicted_weight` per block instead of the reported overlap's credit.
    let mut predicted = w(1, Both, 8, 0, 5);
    predicted.predicted = true;
    let workers = [w(0, Both, 0, 0, 0), predicted];
    let chosen = |weight| {
        let cfg = SchedulerConfig { predicted_weight: weight, ..SchedulerConfig::default() };
        let d = decide(&req(160), &workers, &cfg);
        assert!(d.decode.chosen().expect("chosen").predicted == (d.decode.id == WorkerId(1)));
        d.decode.id
    };
    // w0: 10 + 10 = 20. w1 at weight 1: (10 - 8) + (5 + 10) = 17; at weight 0.25: (10 - 2) + 15 = 23.
    assert_eq!(chosen(1.0), WorkerId(1));
    assert_eq!(chosen(0.25), WorkerId(0));
}

#[test]
fn decode_workers_near_exhaustion_are_never_chosen() {
    let workers = [w(0, Decode, 0, 0, 949), w(1, Decode, 0, 0, 500)];
    for seed in 0..50 {
        let d = route(&req(32), &workers, &SchedulerConfig::default(), &mut RouteState::seeded(seed)).expect("routes");
        assert_eq!(d.decode.id, WorkerId(1));
    }
    assert_eq!(
        route(&req(32), &workers[..1], &SchedulerConfig::default(), &mut RouteState::seeded(0)),
        Err(RouteError::AllBusy)
    );
    assert_eq!(
        route(&req(32), &[w(0, Prefill, 0, 0, 0)], &SchedulerConfig::default(), &mut RouteState::seeded(0)),
        Err(RouteError::NoDecodeWorkers)
    );
}

#[test]
fn comparison_policies() {
    let workers = [w(0, Decode, 0, 0, 300), w(1, Decode, 0, 0, 100), w(2, Decode, 0, 0, 200)];
    let rr = SchedulerConfig { policy: Policy::RoundRobin, ..SchedulerConfig::default() };
    let mut state = RouteState::seeded(0);
    let picks: Vec<u32> = (0..6).map(|_| route(&req(16), &workers, &rr, &mut state).expect("ok").decode.id.0).collect();
    assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
    // Prefill and decode rotate on their own: a disaggregated stream visits every prefill worker in turn too.
    let pd = [w(0, Prefill, 0, 0, 0), w(1, Prefill, 0, 0, 0), w(2, Decode, 0, 0, 0), w(3, Decode, 0, 0, 0)];
    let mut state = RouteState::seeded(0);
    let pairs: Vec<(u32, u32)> = (0..4)
        .map(|_| {
            let d = route(&req(320), &pd, &rr, &mut state).expect("ok");
            (d.prefill.expect("prefill").id.0, d.decode.id.0)
        })
        .collect();
    assert_eq!(pairs, [(0, 2), (1, 3), (0, 2), (1, 3)]);
    let ll = SchedulerConfig { policy: Policy::LeastLoaded, ..SchedulerConfig::default() };
    assert_eq!(decide(&req(16), &workers, &ll).decode.id, WorkerId(1));
    let p2 = SchedulerConfig { policy: Policy::PowerOfTwo, ..SchedulerConfig::default() };
    let mut rng = RouteState::seeded(5);
    for _ in 0..200 {
        assert_ne!(route(&req(16), &workers, &p2, &mut rng).expect("ok").decode.id, WorkerId(0));
    }
    let random = SchedulerConfig { policy: Policy::Random, ..SchedulerConfig::default() };
    let mut seen = [false; 3];
    let mut rng = RouteState::seeded(9);
    for _ in 0..100 {
        seen[route(&req(16), &workers, &random, &mut rng).expect("ok").decode.id.0 as usize] = true;
    }
    assert_eq!(seen, [true; 3]);
}

#[test]
fn prefix_baselines_place_prefill_by_prefix_and_decode_by_load() {
    let workers = [
        w(0, Prefill, 0, 0, 0),
        w(1, Prefill, 8, 0, 0),
        w(2, Prefill, 0, 0, 0),
        w(3, Decode, 0, 0, 50),
        w(4, Decode, 0, 0, 5),
    ];
    let keyed = |key: u64| RouteRequest { prefix_key: key, ..req(160) };
    let ph = SchedulerConfig { policy: Policy::PrefixHash, ..SchedulerConfig::default() };
    let home = decide(&keyed(7), &workers, &ph).prefill.expect("prefill").id;
    for seed in 0..20 {
        let d = route(&keyed(7), &workers, &ph, &mut RouteState::seeded(seed)).expect("routes");
        assert_eq!(d.prefill.expect("prefill").id, home, "one prefix, one home");
        assert_eq!(d.decode.id, WorkerId(4), "decode by load");
    }
    let homes: std::collections::HashSet<WorkerId> =
        (0..32).map(|k| decide(&keyed(k), &workers, &ph).prefill.expect("prefill").id).collect();
    assert_eq!(homes.len(), 3, "prefixes spread over every prefill worker");
    // SGLang's rule: w1 holds 8 of 10 blocks (above the 0.3 threshold) and the load is balanced.
    let sg = SchedulerConfig { policy: Policy::SglangThreshold, ..SchedulerConfig::default() };
    let d = decide(&req(160), &workers, &sg);
    assert_eq!((d.prefill.expect("prefill").id, d.decode.id), (WorkerId(1), WorkerId(4)));
    // The same worker with 100 more requests in flight than the others: the shortest queue instead.
    let mut busy = workers.clone();
    busy[1].load.active_requests = 100;
    assert_ne!(decide(&req(160), &busy, &sg).prefill.expect("prefill").id, WorkerId(1));
}

#[test]
fn a_warming_worker_gets_its_ramped_share() {
    let mut fresh = w(1, Decode, 0, 0, 0);
    fresh.ramp = 0.25;
    let workers = [w(0, Decode, 0, 0, 50), fresh];
    let mut rng = RouteState::seeded(2);
    let n = 4000;
    let to_fresh = (0..n)
        .filter(|_| {
            route(&req(16), &workers, &SchedulerConfig::default(), &mut rng).expect("ok").decode.id == WorkerId(1)
        })
        .count();
    // Without slow start the idle newcomer would take every request.
    assert!((800..1200).contains(&to_fresh), "{to_fresh}");
}

#[test]
fn workers_that_joined_together_are_all_candidates_while_they_warm_up() {
    // A fresh cluster (or a restarted router): every worker at the same early ramp. The one holding the prompt is
    // the cheapest and must be chosen every time, not only when the ramp's draw happens to keep it.
    let mut workers = [w(0, Prefill, 0, 0, 0), w(1, Prefill, 8, 0, 0), w(2, Prefill, 0, 0, 0), w(3, Decode, 0, 0, 0)];
    for x in &mut workers {
        x.ramp = 0.2;
    }
    let mut rng = RouteState::seeded(5);
    for _ in 0..200 {
        let d = route(&req(160), &workers, &SchedulerConfig::default(), &mut rng).expect("routes");
        assert_eq!(d.prefill.expect("prefill").id, WorkerId(1));
    }
    // Among workers further along, a later one still gets its share relative to the warmest.
    workers[1].ramp = 0.05;
    let to_late = (0..4000)
        .filter(|_| {
            route(&req(160), &workers, &SchedulerConfig::default(), &mut rng).expect("ok").prefill.expect("p").id
                == WorkerId(1)
        })
        .count();
    assert!((800..1200).contains(&to_late), "0.05 of 0.2: a quarter of the requests it would win, {to_late}");
}

#[test]
fn the_explanation_serializes_as_the_debug_api_promises() {
    let workers = [w(0, Prefill, 2, 0, 0), w(1, Decode, 0, 0, 0)];
    let d = decide(&req(64), &workers, &SchedulerConfig::default());
    let v = serde_json::to_value(&d).expect("json");
    assert_eq!(v["policy"], "kv");
    assert_eq!(v["prefill"]["worker"], "w0");
    let c = &v["prefill"]["candidates"][0];
    for key in [
        "worker",
        "device_blocks",
        "host_blocks",
        "disk_blocks",
        "active_overlap_blocks",
        "active_prefill_tokens",
        "active_blocks",
        "potential_decode_blocks",
        "capacity_blocks",
        "active_requests",
        "cost",
    ] {
        assert!(!c[key].is_null(), "{key} missing from {c}");
    }
    assert_eq!(v["decode"]["worker"], "w1");
    assert_eq!(v["disaggregate"], true);
    assert_eq!(v["reason"], "prefill_remote");
    assert_eq!((v["request_blocks"].as_u64(), v["isl"].as_u64()), (Some(4), Some(64)));
}

#[test]
fn a_request_is_shed_when_the_worker_that_would_prefill_it_has_too_much_queued() {
    let cfg = SchedulerConfig { shed_wait_ms: Some(1000.0), ..SchedulerConfig::default() };
    let measured = |mut v: WorkerView| {
        v.speed.prefill_tokens_per_sec = Some(10_000.0);
        v
    };
    // 30,000 queued tokens at 10,000 tokens/s: 3 s ahead of the request on the only prefill worker.
    let (p, d) = (measured(w(0, Prefill, 0, 30_000, 0)), measured(w(1, Decode, 0, 0, 0)));
    let got = route(&req(4096), &[p.clone(), d.clone()], &cfg, &mut RouteState::seeded(1));
    assert_eq!(got, Err(RouteError::Shed { wait_ms: 3000, limit_ms: 1000 }));
    // The same cluster with the shedding limit off routes it as before.
    let off = decide(&req(4096), &[p.clone(), d.clone()], &SchedulerConfig::default());
    assert_eq!((off.disaggregate, off.reason), (true, Reason::PrefillRemote));
    // Most of the prompt on the decode worker: it prefills there, its own queue is empty, nothing is shed.
    let holder = WorkerView { overlap: Overlap { device: 250, host: 0, disk: 0 }, ..d.clone() };
    let local = decide(&req(4096), &[p.clone(), holder], &cfg);
    assert_eq!((local.disaggregate, local.reason), (false, Reason::CachedOnDecode));
    // A single worker that does both: its own queue decides.
    let both = measured(w(2, Both, 0, 30_000, 0));
    let got = route(&req(64), &[both], &cfg, &mut RouteState::seeded(1));
    assert_eq!(got, Err(RouteError::Shed { wait_ms: 3000, limit_ms: 1000 }));
    // Before any speed is measured there is no estimate, and nothing is shed.
    let unmeasured = decide(&req(4096), &[w(0, Prefill, 0, 30_000, 0), d], &cfg);
    assert!(unmeasured.disaggregate);
}

/// A request more urgent than the default (a negative priority) is neither shed nor refused as all busy: it goes to
/// the best worker, where it waits ahead of the others; a default one is refused as before.
#[test]
fn an_urgent_request_is_never_shed_or_refused_as_busy() {
    let urgent = RouteRequest { priority: -1, ..req(4096) };
    let cfg = SchedulerConfig { shed_wait_ms: Some(1000.0), ..SchedulerConfig::default() };
    let mut p = w(0, Prefill, 0, 30_000, 0);
    p.speed.prefill_tokens_per_sec = Some(10_000.0);
    let d = w(1, Decode, 0, 0, 0);
    assert!(matches!(
        route(&req(4096), &[p.clone(), d.clone()], &cfg, &mut RouteState::seeded(1)),
        Err(RouteError::Shed { .. })
    ));
    let got = route(&urgent, &[p, d], &cfg, &mut RouteState::seeded(1)).expect("routed");
    assert_eq!((got.disaggregate, got.reason), (true, Reason::PrefillRemote));
    // Every worker past the busy thresholds.
    let cfg =
        SchedulerConfig { busy_prefill_tokens: Some(1000), busy_kv_fraction: Some(0.5), ..SchedulerConfig::default() };
    let workers = [w(0, Prefill, 0, 5000, 0), w(1, Decode, 0, 0, 600)];
    assert_eq!(route(&req(64), &workers, &cfg, &mut RouteState::seeded(1)), Err(RouteError::AllBusy));
    let urgent = RouteRequest { priority: -1, ..req(64) };
    let got = route(&urgent, &workers, &cfg, &mut RouteState::seeded(1)).expect("routed");
    assert_eq!(got.decode.id, WorkerId(1));
    // Past the hard KV limit nothing goes, urgent or not.
    let full = [w(1, Decode, 0, 0, 949)];
    assert_eq!(route(&urgent, &full, &cfg, &mut RouteState::seeded(1)), Err(RouteError::AllBusy));
}

#[test]
fn a_refusals_kind_names_it_back() {
    for e in [RouteError::NoDecodeWorkers, RouteError::AllBusy, RouteError::Shed { wait_ms: 0, limit_ms: 0 }] {
        assert_eq!(RouteError::from_kind(e.kind()), Some(e));
    }
    assert_eq!(RouteError::from_kind("kv"), None);
}
