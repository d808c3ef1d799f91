//! The worker's Prometheus metrics (`observability.md`: `tandem_` prefix, base units, `_total` counters),
//! rendered from the engine's counters and the worker's own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use engine::generate::EngineStats;
use kv_cache::events::Tier;
use telemetry::prom::{Exposition, Histogram, labels, one};

/// How KV blocks reached this worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Quic,
    Shm,
}

impl Transport {
    const ALL: [Transport; 2] = [Transport::Quic, Transport::Shm];

    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Quic => "quic",
            Transport::Shm => "shm",
        }
    }
}

#[derive(Debug, Default)]
struct TransportFigures {
    blocks: AtomicU64,
    bytes: AtomicU64,
    nanos: AtomicU64,
}

/// What the worker measures beyond the engine's counters; shared by every request handler.
#[derive(Debug, Default)]
pub struct WorkerMetrics {
    /// From a request's arrival to its first token (Prefill's answer, or Generate's first streamed token).
    pub time_to_first_token: Histogram,
    /// Per finished request: time from its first to its last token over the tokens after the first.
    pub time_per_output_token: Histogram,
    transfers: [TransportFigures; 2],
}

impl WorkerMetrics {
    /// Records one finished pull.
    pub fn pulled(&self, transport: Transport, blocks: usize, bytes: u64, took: Duration) {
        let f = &self.transfers[transport as usize];
        f.blocks.fetch_add(blocks as u64, Ordering::Relaxed);
        f.bytes.fetch_add(bytes, Ordering::Relaxed);
        f.nanos.fetch_add(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Bytes pulled and nanoseconds spent pulling, over every transport (the measured transfer bandwidth).
    pub fn pulled_totals(&self) -> (u64, u64) {
        self.transfers
            .iter()
            .fold((0, 0), |(b, n), f| (b + f.bytes.load(Ordering::Relaxed), n + f.nanos.load(Ordering::Relaxed)))
    }

    /// Blocks pulled over `transport` so far.
    pub fn pulled_blocks(&self, transport: Transport) -> u64 {
        self.transfers[transport as usize].blocks.load(Ordering::Relaxed)
    }

    fn per_transport(&self, value: impl Fn(&TransportFigures) -> f64) -> Vec<(String, f64)> {
        Transport::ALL
            .iter()
            .map(|&t| (labels(&[("transport", t.as_str())]), value(&self.transfers[t as usize])))
            .collect()
    }
}

fn per_tier(values: impl Fn(Tier) -> f64, skip_device: bool) -> Vec<(String, f64)> {
    Tier::ALL
        .iter()
        .filter(|&&t| !(skip_device && t == Tier::Device))
        .map(|&t| (labels(&[("tier", t.as_str())]), values(t)))
        .collect()
}

/// Cumulative `le`-labelled samples of overrun bucket counts (as a histogram's buckets).
pub fn overrun_samples(buckets: &[u64]) -> Vec<(String, f64)> {
    let bounds = engine::backend::OVERRUN_BOUNDS.iter().map(f64::to_string).chain(std::iter::once("+Inf".into()));
    let mut sum = 0;
    bounds
        .zip(buckets)
        .map(|(le, n)| {
            sum += n;
            (labels(&[("le", &le)]), sum as f64)
        })
        .collect()
}

/// What the worker holds beside the engine, at the moment of rendering.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    pub leases: usize,
    pub leased_bytes: u64,
    pub leased_bytes_cap: u64,
    /// `Prefill` and `Generate` calls in flight.
    pub calls: usize,
}

/// The Prometheus text exposition of the worker's state.
pub fn render(stats: &EngineStats, worker: &WorkerMetrics, held: Held) -> String {
    let c = &stats.counters;
    let mut e = Exposition::new();
    e.gauge(
        "tandem_worker_running_sequences",
        "Sequences holding KV blocks and taking part in steps.",
        &one(stats.running as f64),
    );
    e.gauge(
        "tandem_worker_waiting_sequences",
        "Sequences waiting to be admitted (new or preempted).",
        &one(stats.waiting as f64),
    );
    e.gauge(
        "tandem_worker_prefill_tokens_pending",
        "Prompt tokens still to compute.",
        &one(stats.prefill_tokens_pending as f64),
    );
    e.gauge(
        "tandem_worker_kv_blocks_to_come",
        "Device KV blocks the sequences' prompts will still take (waiting prompts, the rest of those computed in \
         chunks): load reports carry them, and routers count them on top of the blocks in use.",
        &one(stats.blocks_to_come as f64),
    );
    let mut blocks = Vec::new();
    for t in Tier::ALL {
        let u = stats.usage[t.index()];
        for (state, n) in [("used", u.used), ("cached", u.cached), ("free", u.free)] {
            blocks.push((labels(&[("tier", t.as_str()), ("state", state)]), n as f64));
        }
    }
    e.gauge("tandem_kv_blocks", "KV blocks per tier and state.", &blocks);
    e.histogram(
        "tandem_worker_time_to_first_token_seconds",
        "From a request's arrival at the worker to its first token.",
        &[(&[], &worker.time_to_first_token)],
    );
    e.histogram(
        "tandem_worker_time_per_output_token_seconds",
        "Per request: seconds per output token after the first.",
        &[(&[], &worker.time_per_output_token)],
    );
    e.counter(
        "tandem_tokens_computed_total",
        "Tokens run through the model (prompt chunks, recomputation, decode steps).",
        &one(c.prefill_tokens as f64),
    );
    e.counter(
        "tandem_prefix_cache_hit_tokens_total",
        "Prompt tokens served from cached blocks, by the tier they came from.",
        &per_tier(|t| c.cached_tokens[t.index()] as f64, false),
    );
    e.counter("tandem_preemptions_total", "Sequences preempted for lack of device blocks.", &one(c.preemptions as f64));
    e.counter(
        "tandem_kv_offloads_total",
        "Blocks copied down to a tier.",
        &per_tier(|t| c.offloads[t.index()] as f64, true),
    );
    e.counter(
        "tandem_kv_onboards_total",
        "Blocks copied up to the device from a tier.",
        &per_tier(|t| c.onboards[t.index()] as f64, true),
    );
    e.counter(
        "tandem_kv_corrupt_blocks_total",
        "Disk blocks that failed their check and were recomputed.",
        &one(c.corrupt_disk_blocks as f64),
    );
    e.counter(
        "tandem_kv_imported_blocks_total",
        "Blocks received from other workers and stored.",
        &one(c.imported_blocks as f64),
    );
    e.counter(
        "tandem_kv_import_fallbacks_total",
        "Pulled prompts that found no free device block: queued to compute their prompt instead.",
        &one(c.import_fallbacks as f64),
    );
    e.counter(
        "tandem_kv_transfer_pulled_blocks_total",
        "Blocks pulled from other workers, by transport.",
        &worker.per_transport(|f| f.blocks.load(Ordering::Relaxed) as f64),
    );
    e.counter(
        "tandem_kv_transfer_bytes_total",
        "KV bytes pulled from other workers, by transport.",
        &worker.per_transport(|f| f.bytes.load(Ordering::Relaxed) as f64),
    );
    e.counter(
        "tandem_kv_transfer_seconds_total",
        "Time spent pulling KV from other workers, by transport.",
        &worker.per_transport(|f| f.nanos.load(Ordering::Relaxed) as f64 / 1e9),
    );
    e.counter(
        "tandem_trace_spans_dropped_total",
        "Spans dropped because the trace export queue was full.",
        &one(telemetry::dropped_spans() as f64),
    );
    if let Some(p) = &stats.pacing {
        e.counter("tandem_mock_steps_total", "Steps the mock engine took.", &one(p.steps as f64));
        e.counter(
            "tandem_mock_modelled_seconds_total",
            "Modelled step time (after the speed-up) of the mock engine.",
            &one(p.modelled_nanos as f64 / 1e9),
        );
        e.counter(
            "tandem_mock_step_overrun_steps_total",
            "Mock steps whose actual / modelled duration was at most `le` (cumulative).",
            &overrun_samples(&p.overrun_buckets),
        );
    }
    e.gauge("tandem_kv_leases", "Prefilled prompts whose KV is held for a decode worker.", &one(held.leases as f64));
    e.gauge(
        "tandem_kv_leased_bytes",
        "Bytes of KV held under leases (heap and shared memory).",
        &one(held.leased_bytes as f64),
    );
    e.gauge("tandem_kv_leased_bytes_limit", "The cap on leased KV bytes.", &one(held.leased_bytes_cap as f64));
    e.gauge("tandem_worker_calls_in_flight", "Prefill and Generate calls in flight.", &one(held.calls as f64));
    e.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sample_is_well_formed() {
        let mut pacing = engine::backend::Pacing::default();
        pacing.record(0.010, 0.0101);
        pacing.record(0.010, 0.030);
        let mut stats =
            EngineStats { running: 2, waiting: 1, blocks_to_come: 7, pacing: Some(pacing), ..EngineStats::default() };
        stats.counters.cached_tokens = [32, 16, 0];
        stats.usage[0].used = 5;
        let worker = WorkerMetrics::default();
        worker.pulled(Transport::Quic, 4, 4096, Duration::from_millis(2));
        worker.time_to_first_token.observe(Duration::from_millis(30));
        let text = render(&stats, &worker, Held { leases: 1, leased_bytes: 100, leased_bytes_cap: 1000, calls: 2 });
        assert!(text.contains("tandem_kv_leased_bytes 100\n") && text.contains("tandem_worker_calls_in_flight 2\n"));
        assert!(text.contains("tandem_worker_running_sequences 2\n"));
        assert!(text.contains("tandem_worker_kv_blocks_to_come 7\n"), "{text}");
        assert!(text.contains("tandem_prefix_cache_hit_tokens_total{tier=\"host\"} 16\n"));
        assert!(text.contains("tandem_kv_blocks{tier=\"device\",state=\"used\"} 5\n"));
        assert!(text.contains("tandem_kv_transfer_pulled_blocks_total{transport=\"quic\"} 4\n"));
        assert!(text.contains("tandem_kv_transfer_bytes_total{transport=\"shm\"} 0\n"));
        assert!(text.contains("tandem_worker_time_to_first_token_seconds_count 1\n"));
        assert!(text.contains("tandem_mock_step_overrun_steps_total{le=\"1.01\"} 1\n"), "{text}");
        assert!(text.contains("tandem_mock_step_overrun_steps_total{le=\"2\"} 1\n"));
        assert!(text.contains("tandem_mock_step_overrun_steps_total{le=\"4\"} 2\n"));
        assert!(text.contains("tandem_mock_step_overrun_steps_total{le=\"+Inf\"} 2\n"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (name, value) = line.rsplit_once(' ').expect("name and value");
            assert!(name.starts_with("tandem_"), "{line}");
            assert!(value.parse::<f64>().is_ok(), "{line}");
        }
    }
}
