//! Prometheus text exposition: a writer for gauges, counters and histograms, and a lock-free latency histogram.
//!
//! Names follow `observability.md`: the `tandem_` prefix, base units (seconds, bytes), `_total` for counters.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds (seconds) for request latencies on CPU and GPU alike: 1 ms to 2 minutes.
pub const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

/// A histogram of durations with fixed buckets, safe to observe from any thread.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative); the last slot counts values above every bound.
    counts: Vec<AtomicU64>,
    /// Sum of observations in nanoseconds.
    sum_nanos: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_nanos: AtomicU64::new(0),
        }
    }

    /// A histogram over [`LATENCY_BUCKETS`].
    pub fn latency() -> Histogram {
        Histogram::new(LATENCY_BUCKETS)
    }

    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let slot = self.bounds.iter().position(|&b| secs <= b).unwrap_or(self.bounds.len());
        self.counts[slot].fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    fn sum_seconds(&self) -> f64 {
        self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9
    }
}

impl Default for Histogram {
    fn default() -> Histogram {
        Histogram::latency()
    }
}

/// Label pairs rendered as `{a="x",b="y"}`; empty renders as nothing.
pub fn labels(pairs: &[(&str, &str)]) -> String {
    if pairs.is_empty() {
        return String::new();
    }
    let body: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
    format!("{{{}}}", body.join(","))
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Builds one exposition text.
#[derive(Debug, Default)]
pub struct Exposition {
    out: String,
}

impl Exposition {
    pub fn new() -> Exposition {
        Exposition::default()
    }

    fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    fn samples(&mut self, name: &str, kind: &str, help: &str, samples: &[(String, f64)]) {
        self.header(name, kind, help);
        for (labels, v) in samples {
            let _ = writeln!(self.out, "{name}{labels} {v}");
        }
    }

    /// A gauge: one sample per label set (rendered by [`labels`]).
    pub fn gauge(&mut self, name: &str, help: &str, samples: &[(String, f64)]) {
        self.samples(name, "gauge", help, samples);
    }

    /// A counter: one sample per label set; `name` ends in `_total`.
    pub fn counter(&mut self, name: &str, help: &str, samples: &[(String, f64)]) {
        debug_assert!(name.ends_with("_total"), "{name}");
        self.samples(name, "counter", help, samples);
    }

    /// A histogram family: one series per label set, each with its `le` buckets, sum and count.
    pub fn histogram(&mut self, name: &str, help: &str, series: &[(&[(&str, &str)], &Histogram)]) {
        self.header(name, "histogram", help);
        for (pairs, h) in series {
            let mut cumulative = 0;
            for (i, c) in h.counts.iter().enumerate() {
                cumulative += c.load(Ordering::Relaxed);
                let le = h.bounds.get(i).map_or("+Inf".to_string(), |b| b.to_string());
                let mut with_le = pairs.to_vec();
                with_le.push(("le", &le));
                let _ = writeln!(self.out, "{name}_bucket{} {cumulative}", labels(&with_le));
            }
            let l = labels(pairs);
            let _ = writeln!(self.out, "{name}_sum{l} {}", h.sum_seconds());
            let _ = writeln!(self.out, "{name}_count{l} {cumulative}");
        }
    }

    pub fn finish(self) -> String {
        self.out
    }
}

/// One unlabelled sample.
pub fn one(v: impl Into<f64>) -> Vec<(String, f64)> {
    vec![(String::new(), v.into())]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_end_in_inf() {
        let h = Histogram::new(&[0.01, 0.1, 1.0]);
        for ms in [5, 5, 50, 500, 5000] {
            h.observe(Duration::from_millis(ms));
        }
        let mut e = Exposition::new();
        e.histogram("tandem_x_seconds", "x.", &[(&[("role", "decode")], &h)]);
        let text = e.finish();
        for want in [
            "tandem_x_seconds_bucket{role=\"decode\",le=\"0.01\"} 2\n",
            "tandem_x_seconds_bucket{role=\"decode\",le=\"0.1\"} 3\n",
            "tandem_x_seconds_bucket{role=\"decode\",le=\"1\"} 4\n",
            "tandem_x_seconds_bucket{role=\"decode\",le=\"+Inf\"} 5\n",
            "tandem_x_seconds_sum{role=\"decode\"} 5.56\n",
            "tandem_x_seconds_count{role=\"decode\"} 5\n",
        ] {
            assert!(text.contains(want), "{want} missing from\n{text}");
        }
        assert_eq!(h.count(), 5);
    }

    #[test]
    fn a_value_on_a_bound_falls_in_that_bucket() {
        let h = Histogram::new(&[1.0]);
        h.observe(Duration::from_secs(1));
        let mut e = Exposition::new();
        e.histogram("tandem_y_seconds", "y.", &[(&[], &h)]);
        assert!(e.finish().contains("tandem_y_seconds_bucket{le=\"1\"} 1\n"));
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(labels(&[("a", "x\"y\\z\n")]), "{a=\"x\\\"y\\\\z\\n\"}");
        assert_eq!(labels(&[]), "");
    }
}
