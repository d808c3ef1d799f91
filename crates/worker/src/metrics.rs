//! The worker's Prometheus metrics (`observability.md`: `tandem_` prefix, base units, `_total` counters),
//! rendered from the engine's counters and the worker's own.

use std::fmt::Write;

use engine::generate::EngineStats;
use kv_cache::events::Tier;

/// What the worker adds to the engine's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerFigures {
    /// Blocks pulled from other workers over a transport.
    pub pulled_blocks: u64,
    /// Leases currently held for readers.
    pub live_leases: usize,
}

fn metric(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(String, f64)]) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for (labels, v) in samples {
        let _ = writeln!(out, "{name}{labels} {v}");
    }
}

fn one(v: impl Into<f64>) -> Vec<(String, f64)> {
    vec![(String::new(), v.into())]
}

fn per_tier(values: impl Fn(Tier) -> f64, skip_device: bool) -> Vec<(String, f64)> {
    Tier::ALL
        .iter()
        .filter(|&&t| !(skip_device && t == Tier::Device))
        .map(|&t| (format!("{{tier=\"{}\"}}", t.as_str()), values(t)))
        .collect()
}

/// The Prometheus text exposition of the worker's state.
pub fn render(stats: &EngineStats, worker: WorkerFigures) -> String {
    let c = &stats.counters;
    let mut out = String::new();
    metric(
        &mut out,
        "tandem_worker_running_sequences",
        "gauge",
        "Sequences holding KV blocks and taking part in steps.",
        &one(stats.running as f64),
    );
    metric(
        &mut out,
        "tandem_worker_waiting_sequences",
        "gauge",
        "Sequences waiting to be admitted (new or preempted).",
        &one(stats.waiting as f64),
    );
    metric(
        &mut out,
        "tandem_worker_prefill_tokens_pending",
        "gauge",
        "Prompt tokens still to compute.",
        &one(stats.prefill_tokens_pending as f64),
    );
    let mut blocks = Vec::new();
    for t in Tier::ALL {
        let u = stats.usage[t.index()];
        for (state, n) in [("used", u.used), ("cached", u.cached), ("free", u.free)] {
            blocks.push((format!("{{tier=\"{}\",state=\"{state}\"}}", t.as_str()), n as f64));
        }
    }
    metric(&mut out, "tandem_kv_blocks", "gauge", "KV blocks per tier and state.", &blocks);
    metric(
        &mut out,
        "tandem_tokens_computed_total",
        "counter",
        "Tokens run through the model (prompt chunks, recomputation, decode steps).",
        &one(c.prefill_tokens as f64),
    );
    metric(
        &mut out,
        "tandem_prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens served from cached blocks, by the tier they came from.",
        &per_tier(|t| c.cached_tokens[t.index()] as f64, false),
    );
    metric(
        &mut out,
        "tandem_preemptions_total",
        "counter",
        "Sequences preempted for lack of device blocks.",
        &one(c.preemptions as f64),
    );
    metric(
        &mut out,
        "tandem_kv_offloads_total",
        "counter",
        "Blocks copied down to a tier.",
        &per_tier(|t| c.offloads[t.index()] as f64, true),
    );
    metric(
        &mut out,
        "tandem_kv_onboards_total",
        "counter",
        "Blocks copied up to the device from a tier.",
        &per_tier(|t| c.onboards[t.index()] as f64, true),
    );
    metric(
        &mut out,
        "tandem_kv_corrupt_blocks_total",
        "counter",
        "Disk blocks that failed their check and were recomputed.",
        &one(c.corrupt_disk_blocks as f64),
    );
    metric(
        &mut out,
        "tandem_kv_imported_blocks_total",
        "counter",
        "Blocks received from other workers and stored.",
        &one(c.imported_blocks as f64),
    );
    metric(
        &mut out,
        "tandem_kv_transfer_pulled_blocks_total",
        "counter",
        "Blocks pulled from other workers.",
        &one(worker.pulled_blocks as f64),
    );
    metric(
        &mut out,
        "tandem_kv_leases",
        "gauge",
        "Prefilled prompts whose KV is held for a decode worker.",
        &one(worker.live_leases as f64),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sample_is_well_formed() {
        let mut stats = EngineStats { running: 2, waiting: 1, ..EngineStats::default() };
        stats.counters.cached_tokens = [32, 16, 0];
        stats.usage[0].used = 5;
        let text = render(&stats, WorkerFigures { pulled_blocks: 4, live_leases: 1 });
        assert!(text.contains("tandem_worker_running_sequences 2\n"));
        assert!(text.contains("tandem_prefix_cache_hit_tokens_total{tier=\"host\"} 16\n"));
        assert!(text.contains("tandem_kv_blocks{tier=\"device\",state=\"used\"} 5\n"));
        assert!(text.contains("tandem_kv_transfer_pulled_blocks_total 4\n"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (name, value) = line.rsplit_once(' ').expect("name and value");
            assert!(name.starts_with("tandem_"), "{line}");
            assert!(value.parse::<f64>().is_ok(), "{line}");
        }
    }
}
