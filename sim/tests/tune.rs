//! `tandem tune` on a cluster whose current settings are plainly wrong for its workload: the search must find
//! better ones, never pick worse than the current on the training part, and be reproducible.

mod common;

use loadgen::schedule::Arrivals;
use loadgen::summary::Slo;
use router::scheduler::config::{DisaggregationRule, Policy, SchedulerConfig};
use sim::tune::space::{PREFILL_WORKERS, Param, Range, Sampler};
use sim::tune::{Objective, Report, TuneSettings, tune};

fn run(jobs: usize) -> Report {
    // Prefill costs 10 ms + 1 ms per token, decode 5 ms a step: 320-token prompts take 330 ms to prefill.
    let profile = "[prefill]\nbase_ms = 10.0\nper_token_ms = 1.0\n[decode]\nbase_ms = 5.0\n";
    let mut base = common::settings(profile, 1, 3, Policy::Kv);
    // Room for every request at once on any worker: refusals are not what this checks.
    (base.engine.kv_blocks, base.engine.host_blocks) = (4096, 4096);
    // Every prompt to the one prefill worker: at 5 requests/s it has 1.65 s of work per second and falls behind.
    base.scheduler = SchedulerConfig { disaggregation: DisaggregationRule::Always, ..base.scheduler };
    let spec = loadgen::synthetic::SyntheticSpec {
        requests: 80,
        prefixes: 40,
        prefix_len: 256,
        suffix_len: 64,
        output_len: 4,
        zipf: 0.0,
        turns: 1,
        turn_delay_ms: 0.0,
        seed: 5,
    };
    let settings = TuneSettings {
        base,
        arrivals: Arrivals::Rate { rate: 5.0, burstiness: 1.0, seed: 5 },
        space: vec![
            Param { name: "disaggregation", range: Range::Choice(&["always", "never", "isl_bounding"]) },
            Param { name: PREFILL_WORKERS, range: Range::Int(0, 3) },
        ],
        sampler: Sampler::LatinHypercube,
        samples: 6,
        rounds: 2,
        eta: 2,
        min_window: 20,
        train_fraction: 0.6,
        seeds: vec![0],
        objective: Objective::Latency(sim::tune::Metric::Ttft, 90),
        slo: Slo::default(),
        jobs,
    };
    tune(&settings, &spec.generate(512)).expect("the search runs")
}

#[test]
fn tuning_beats_settings_that_overload_one_prefill_worker_and_is_reproducible() {
    let report = run(2);
    assert_eq!((report.train_requests, report.test_requests), (48, 32));
    let best = report.best();
    let held = |name: &str| report.held_out.iter().find(|h| h.name == name).expect(name).mean();
    // The winner spreads prefill over more than one worker: its held-out TTFT p90 is a fraction of the current's.
    assert!(
        held("tuned") < 0.5 * held("defaults"),
        "tuned {} ms vs current {} ms ({:?})",
        held("tuned"),
        held("defaults"),
        best.changes
    );
    assert!(best.prefill != 1 || best.scheduler.disaggregation != DisaggregationRule::Always, "{best:?}");
    // Never worse than the current settings where it was chosen.
    assert!(report.best_train[0] <= report.current_train[0]);
    assert_eq!(best.prefill + best.decode, 4);
    // Parallel evaluations do not change the outcome.
    let again = run(1);
    assert_eq!(again.search, report.search);
}
