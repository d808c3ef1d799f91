//! What `tandem tune` searches: the scheduler's settings (and optionally the prefill/decode split of a worker
//! budget), each a named range or a set of choices, and how points are drawn from it (uniform random or Latin
//! hypercube, reproducible from a seed).

use router::scheduler::config::SchedulerConfig;
use router::scheduler::rng::Rng;
use serde_json::{Map, Value};

/// One dimension of the search.
#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    /// A `[scheduler]` field, or [`PREFILL_WORKERS`].
    pub name: &'static str,
    pub range: Range,
}

/// The values a dimension takes.
#[derive(Clone, Debug, PartialEq)]
pub enum Range {
    Linear(f64, f64),
    /// Uniform in the logarithm: for scales, where 0.5 and 2 are as far from 1.
    Log(f64, f64),
    /// Whole numbers, uniform in the logarithm.
    LogInt(u64, u64),
    /// Whole numbers, uniform.
    Int(u64, u64),
    Choice(&'static [&'static str]),
}

/// The dimension that splits `--workers` between the pools: prefill workers (the rest decode).
pub const PREFILL_WORKERS: &str = "prefill_workers";

/// The KV policy's settings a deployment would tune (`routing.md`), with ranges wide enough to hold every sane
/// value; `workers`: also search the prefill/decode split of that many workers (at least one decodes).
///
/// `disk`: the workers have a disk tier, so `disk_weight` matters. Left out: the `prefix_hash` and
/// `sglang_threshold` knobs (other policies), and the limits that protect rather than steer (`decode_kv_limit`,
/// `local_prefill_veto`, `shed_wait_ms`).
pub fn default_space(workers: Option<usize>, disk: bool) -> Vec<Param> {
    let mut space = vec![
        Param { name: "overlap_credit", range: Range::Linear(0.0, 2.0) },
        Param { name: "host_weight", range: Range::Linear(0.0, 1.0) },
        Param { name: "decay", range: Range::Linear(0.0, 4.0) },
        Param { name: "prefill_load_scale", range: Range::Log(0.1, 10.0) },
        Param { name: "active_request_weight", range: Range::Linear(0.0, 128.0) },
        Param { name: "temperature", range: Range::Linear(0.0, 0.5) },
        Param { name: "cost_units", range: Range::Choice(&["blocks", "seconds"]) },
        Param {
            name: "disaggregation",
            range: Range::Choice(&["isl_bounding", "prefill_load", "isl_or_load", "always", "never"]),
        },
        Param { name: "max_local_prefill_tokens", range: Range::LogInt(128, 16384) },
        Param { name: "local_prefill_fraction", range: Range::Linear(0.1, 1.0) },
        Param { name: "prefill_load_threshold", range: Range::Log(1.0, 16.0) },
    ];
    if disk {
        space.push(Param { name: "disk_weight", range: Range::Linear(0.0, 1.0) });
    }
    if let Some(n) = workers.filter(|&n| n >= 2) {
        space.push(Param { name: PREFILL_WORKERS, range: Range::Int(0, n as u64 - 1) });
    }
    space
}

impl Range {
    /// The value at `u` in [0, 1).
    pub fn at(&self, u: f64) -> Value {
        let u = u.clamp(0.0, 1.0);
        match *self {
            Range::Linear(lo, hi) => Value::from(round(lo + u * (hi - lo))),
            Range::Log(lo, hi) => Value::from(round((lo.ln() + u * (hi.ln() - lo.ln())).exp())),
            Range::LogInt(lo, hi) => {
                let (a, b) = ((lo.max(1) as f64).ln(), ((hi.max(1) + 1) as f64).ln());
                Value::from(((a + u * (b - a)).exp().floor() as u64).clamp(lo, hi))
            }
            Range::Int(lo, hi) => Value::from((lo + (u * (hi - lo + 1) as f64).floor() as u64).min(hi)),
            Range::Choice(options) => {
                let k = ((u * options.len() as f64).floor() as usize).min(options.len().saturating_sub(1));
                Value::from(options.get(k).copied().unwrap_or_default())
            }
        }
    }
}

/// Four significant digits: what a person would type into a config file.
fn round(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let scale = 10f64.powi(3 - x.abs().log10().floor() as i32);
    (x * scale).round() / scale
}

/// How candidates are drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sampler {
    Random,
    /// Latin hypercube: each dimension's range cut into as many strata as samples, each stratum used once.
    LatinHypercube,
}

/// `n` points of the unit cube with `dims` dimensions.
pub fn unit_points(sampler: Sampler, n: usize, dims: usize, seed: u64) -> Vec<Vec<f64>> {
    let mut rng = Rng::new(seed);
    let mut points = vec![vec![0.0; dims]; n];
    for d in 0..dims {
        let mut strata: Vec<usize> = (0..n).collect();
        // Fisher-Yates.
        for i in (1..n).rev() {
            strata.swap(i, rng.below(i + 1));
        }
        for (i, point) in points.iter_mut().enumerate() {
            point[d] = match sampler {
                Sampler::Random => rng.unit(),
                Sampler::LatinHypercube => (strata[i] as f64 + rng.unit()) / n as f64,
            };
        }
    }
    points
}

/// A setting to try: the fields it changes and the cluster they make.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// The `[scheduler]` fields changed from the base, as drawn.
    pub changes: Map<String, Value>,
    pub scheduler: SchedulerConfig,
    pub prefill: usize,
    pub decode: usize,
}

/// The candidate at a point of the unit cube over `space`, from the `base` settings and split.
pub fn candidate(
    space: &[Param],
    point: &[f64],
    base: &SchedulerConfig,
    split: (usize, usize),
) -> Result<Candidate, String> {
    let (mut prefill, mut decode) = split;
    let mut changes = Map::new();
    for (p, &u) in space.iter().zip(point) {
        let v = p.range.at(u);
        if p.name == PREFILL_WORKERS {
            let total = split.0 + split.1;
            prefill = (v.as_u64().unwrap_or(0) as usize).min(total.saturating_sub(1));
            decode = total - prefill;
        }
        changes.insert(p.name.to_string(), v);
    }
    let mut fields = changes.clone();
    fields.remove(PREFILL_WORKERS);
    let scheduler = base.patched(fields)?;
    Ok(Candidate { changes, scheduler, prefill, decode })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latin_hypercube_uses_every_stratum_once() {
        let n = 16;
        let points = unit_points(Sampler::LatinHypercube, n, 3, 7);
        for d in 0..3 {
            let mut strata: Vec<usize> = points.iter().map(|p| (p[d] * n as f64) as usize).collect();
            strata.sort_unstable();
            assert_eq!(strata, (0..n).collect::<Vec<_>>(), "dimension {d}");
        }
        assert_eq!(points, unit_points(Sampler::LatinHypercube, n, 3, 7), "same seed, same points");
        assert_ne!(points, unit_points(Sampler::LatinHypercube, n, 3, 8));
    }

    #[test]
    fn ranges_map_the_unit_interval_onto_their_values() {
        assert_eq!(Range::Linear(0.0, 2.0).at(0.25), Value::from(0.5));
        assert_eq!(Range::Log(0.1, 10.0).at(0.5), Value::from(1.0));
        assert_eq!(Range::LogInt(128, 16384).at(0.0), Value::from(128u64));
        assert_eq!(Range::LogInt(128, 16384).at(0.999_999), Value::from(16384u64));
        assert_eq!(Range::Int(0, 3).at(0.0), Value::from(0u64));
        assert_eq!(Range::Int(0, 3).at(0.99), Value::from(3u64));
        assert_eq!(Range::Choice(&["a", "b"]).at(0.6), Value::from("b"));
    }

    #[test]
    fn every_drawn_candidate_is_a_valid_configuration() {
        let space = default_space(Some(16), true);
        for point in unit_points(Sampler::Random, 200, space.len(), 1) {
            let c = candidate(&space, &point, &SchedulerConfig::default(), (8, 8)).expect("valid");
            assert_eq!(c.prefill + c.decode, 16);
            assert!(c.decode >= 1);
        }
    }
}
