//! From per-request records to a run's summary: latency distributions, throughput, goodput under SLOs, cached
//! prompt share, errors by status, and whether the run can be trusted. Pure: records in, summary out. Metric
//! names follow aiperf's.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One request as the client saw it (a line of `records.jsonl`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub index: usize,
    /// When it was due and when it went, in milliseconds after the run started.
    pub scheduled_ms: f64,
    pub sent_ms: f64,
    /// HTTP status; 0 when no response came.
    pub status: u16,
    pub error: Option<String>,
    pub time_to_first_token_ms: Option<f64>,
    pub request_latency_ms: f64,
    /// (latency − TTFT) / (output tokens − 1), for requests with at least two output tokens.
    pub time_per_output_token_ms: Option<f64>,
    pub output_tokens: u64,
    /// Prompt tokens as the server counted them (`usage`), else as sent.
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// The trace's prompt length, and whether the prompt was cut to the server's context.
    pub input_length: usize,
    pub clipped: bool,
    pub finish_reason: Option<String>,
    /// Gaps between content chunks, in milliseconds.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub inter_chunk_ms: Vec<f64>,
}

impl Record {
    pub fn ok(&self) -> bool {
        self.status == 200 && self.error.is_none()
    }
}

/// Service-level objectives per request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
}

impl Slo {
    /// Parses `ttft_ms=2000,tpot_ms=25`.
    pub fn parse(s: &str) -> Result<Slo, String> {
        let mut slo = Slo::default();
        for part in s.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| format!("{part:?}: expected key=value"))?;
            let v: f64 = v.parse().map_err(|_| format!("{part:?}: {v:?} is not a number"))?;
            match k.trim() {
                "ttft_ms" => slo.ttft_ms = Some(v),
                "tpot_ms" => slo.tpot_ms = Some(v),
                other => return Err(format!("unknown SLO {other:?}: use ttft_ms and tpot_ms")),
            }
        }
        Ok(slo)
    }

    /// Whether a finished request met every objective.
    pub fn met(&self, r: &Record) -> bool {
        r.ok()
            && self.ttft_ms.is_none_or(|t| r.time_to_first_token_ms.is_some_and(|x| x <= t))
            && self.tpot_ms.is_none_or(|t| r.time_per_output_token_ms.is_none_or(|x| x <= t))
    }
}

/// A distribution's summary, in the metric's unit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Dist {
    pub count: usize,
    pub mean: f64,
    pub min: f64,
    pub max: f64,
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
}

impl Dist {
    /// Percentiles by linear interpolation between order statistics (numpy's default).
    pub fn of(values: &[f64]) -> Dist {
        Dist::of_slices(std::iter::once(values))
    }

    /// [`Dist::of`] the values of several slices together (a whole trace's inter-token gaps, one slice a request,
    /// need no copy of their own): room for all of them is taken at once.
    pub fn of_slices<'a>(parts: impl Iterator<Item = &'a [f64]> + Clone) -> Dist {
        // The values as integers in the same order (`order_key`): selection compares millions of them.
        let mut v: Vec<u64> = Vec::with_capacity(parts.clone().map(<[f64]>::len).sum());
        let mut sum = 0.0;
        v.extend(parts.flatten().copied().filter(|x| x.is_finite()).map(|x| {
            // Summed in the order the values came, before the selection below moves them.
            sum += x;
            order_key(x)
        }));
        if v.is_empty() {
            return Dist::default();
        }
        let n = v.len();
        let place = |p: f64| {
            let pos = p * (n - 1) as f64;
            (pos.floor() as usize, pos.ceil() as usize, pos)
        };
        let quantiles = [0.5, 0.9, 0.95, 0.99].map(place);
        let mean = sum / n as f64;
        // Only the order statistics the figures read are put in place: a whole trace's inter-token gaps are
        // millions of values, which a selection of these few ranks visits a few times and a sort many.
        let mut ranks: Vec<usize> = quantiles.iter().flat_map(|&(lo, hi, _)| [lo, hi]).chain([0, n - 1]).collect();
        ranks.sort_unstable();
        ranks.dedup();
        select_ranks(&mut v, &ranks, 0);
        let at = |k: usize| from_order_key(v[k]);
        let q = |(lo, hi, pos): (usize, usize, f64)| at(lo) + (at(hi) - at(lo)) * (pos - lo as f64);
        Dist {
            count: n,
            mean,
            min: at(0),
            max: at(n - 1),
            p50: q(quantiles[0]),
            p90: q(quantiles[1]),
            p95: q(quantiles[2]),
            p99: q(quantiles[3]),
        }
    }
}

/// `x`'s bits as an integer that orders as [`f64::total_cmp`] orders the floats (the sign bit flipped for
/// positives, every bit for negatives).
fn order_key(x: f64) -> u64 {
    let b = x.to_bits();
    if b >> 63 == 1 { !b } else { b | 1 << 63 }
}

fn from_order_key(k: u64) -> f64 {
    f64::from_bits(if k >> 63 == 1 { k & !(1 << 63) } else { !k })
}

/// Puts at each of `ranks` (ascending, each at least `offset`, counted in the whole slice `v` is part of, which
/// starts at `offset`) the value a sort would put there. Equal keys are the same bits, so the values are exactly a
/// sort's.
fn select_ranks(v: &mut [u64], ranks: &[usize], offset: usize) {
    let Some(&mid) = ranks.get(ranks.len() / 2) else { return };
    let (below, _, above) = v.select_nth_unstable(mid - offset);
    select_ranks(below, &ranks[..ranks.len() / 2], offset);
    select_ranks(above, &ranks[ranks.len() / 2 + 1..], mid + 1);
}

/// Figures about the run itself rather than the server.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunFacts {
    /// First send to last response, in seconds.
    pub duration_s: f64,
    pub closed_loop: bool,
    /// Mock workers' step overrun (actual / modelled duration) at the 99th percentile over the run (an upper
    /// bound: the bucket's), when the server reports it.
    pub step_overrun_p99: Option<f64>,
    /// Mean gap between scheduled sends, in milliseconds (open loop).
    pub mean_arrival_gap_ms: Option<f64>,
}

/// A run's summary (`summary.json`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub requests: usize,
    pub failed: usize,
    pub errors_by_status: BTreeMap<String, usize>,
    pub time_to_first_token_ms: Dist,
    pub time_per_output_token_ms: Dist,
    pub inter_token_latency_ms: Dist,
    pub request_latency_ms: Dist,
    pub schedule_lag_ms: Dist,
    /// Output tokens per second over the run, and per request (each request's own decode rate).
    pub output_tokens_per_s: f64,
    pub output_tokens_per_s_per_user: Dist,
    pub request_throughput_per_s: f64,
    pub goodput_requests_per_s: f64,
    /// Share of finished requests that met every SLO.
    pub slo_attainment: f64,
    pub slo: Slo,
    /// Cached prompt tokens / prompt tokens over successful requests.
    pub cached_token_fraction: f64,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    pub clipped_prompts: usize,
    pub duration_s: f64,
    pub closed_loop: bool,
    /// The bound of the overrun bucket holding the 99th percentile; `"+Inf"` when it is past the largest bound.
    #[serde(serialize_with = "bound", deserialize_with = "parse_bound")]
    pub step_overrun_p99: Option<f64>,
    /// False when the client or the mock workers could not keep time (see `invalid_reasons`).
    pub valid: bool,
    pub invalid_reasons: Vec<String>,
}

/// Writes a bucket bound, `+Inf` (as Prometheus writes it) for the open bucket: JSON has no infinity.
fn bound<S: serde::Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(x) if x.is_infinite() => s.serialize_str("+Inf"),
        Some(x) => s.serialize_f64(*x),
        None => s.serialize_none(),
    }
}

fn parse_bound<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Bound {
        Number(f64),
        Text(String),
    }
    Ok(match Option::<Bound>::deserialize(d)? {
        None => None,
        Some(Bound::Number(x)) => Some(x),
        Some(Bound::Text(t)) if t == "+Inf" => Some(f64::INFINITY),
        Some(Bound::Text(t)) => return Err(serde::de::Error::custom(format!("not a bucket bound: {t}"))),
    })
}

/// The most a run's timing may slip before its figures are not trusted: 5%.
pub const TIMING_TOLERANCE: f64 = 0.05;
/// Schedule lag always allowed (timer and task wake-up granularity), in milliseconds.
pub const LAG_FLOOR_MS: f64 = 5.0;

/// Summarises `records` under `slo`.
pub fn summarize(records: &[Record], slo: Slo, facts: &RunFacts) -> Summary {
    let ok: Vec<&Record> = records.iter().filter(|r| r.ok()).collect();
    let mut errors_by_status = BTreeMap::new();
    for r in records.iter().filter(|r| !r.ok()) {
        let key = if r.status == 0 { "no response".to_string() } else { r.status.to_string() };
        *errors_by_status.entry(key).or_default() += 1;
    }
    let of = |f: &dyn Fn(&Record) -> Option<f64>| Dist::of(&ok.iter().filter_map(|r| f(r)).collect::<Vec<_>>());
    let output_tokens: u64 = ok.iter().map(|r| r.output_tokens).sum();
    let prompt_tokens: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|r| r.cached_tokens).sum();
    let met = records.iter().filter(|r| slo.met(r)).count();
    let duration = facts.duration_s.max(1e-9);
    let lag = Dist::of(&records.iter().map(|r| r.sent_ms - r.scheduled_ms).collect::<Vec<_>>());
    let mut invalid_reasons = Vec::new();
    if let Some(gap) = facts.mean_arrival_gap_ms.filter(|_| !facts.closed_loop) {
        let allowed = (TIMING_TOLERANCE * gap).max(LAG_FLOOR_MS);
        if lag.p99 > allowed {
            invalid_reasons.push(format!(
                "the client fell behind its schedule: lag p99 {:.1} ms > {allowed:.1} ms (5% of the mean gap)",
                lag.p99
            ));
        }
    }
    if let Some(o) = facts.step_overrun_p99.filter(|&o| o > 1.0 + TIMING_TOLERANCE) {
        invalid_reasons.push(format!("mock workers overran their modelled step times: p99 ratio up to {o}"));
    }
    Summary {
        requests: records.len(),
        failed: records.len() - ok.len(),
        errors_by_status,
        time_to_first_token_ms: of(&|r| r.time_to_first_token_ms),
        time_per_output_token_ms: of(&|r| r.time_per_output_token_ms),
        inter_token_latency_ms: Dist::of_slices(ok.iter().map(|r| r.inter_chunk_ms.as_slice())),
        request_latency_ms: of(&|r| Some(r.request_latency_ms)),
        schedule_lag_ms: lag,
        output_tokens_per_s: output_tokens as f64 / duration,
        output_tokens_per_s_per_user: of(&|r| {
            let decode = r.request_latency_ms - r.time_to_first_token_ms?;
            (r.output_tokens > 1 && decode > 0.0).then(|| (r.output_tokens - 1) as f64 / (decode / 1000.0))
        }),
        request_throughput_per_s: ok.len() as f64 / duration,
        goodput_requests_per_s: met as f64 / duration,
        slo_attainment: if records.is_empty() { 0.0 } else { met as f64 / records.len() as f64 },
        slo,
        cached_token_fraction: if prompt_tokens == 0 { 0.0 } else { cached as f64 / prompt_tokens as f64 },
        prompt_tokens,
        output_tokens,
        clipped_prompts: records.iter().filter(|r| r.clipped).count(),
        duration_s: facts.duration_s,
        closed_loop: facts.closed_loop,
        step_overrun_p99: facts.step_overrun_p99,
        valid: invalid_reasons.is_empty(),
        invalid_reasons,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ttft: f64, latency: f64, tokens: u64) -> Record {
        Record {
            status: 200,
            time_to_first_token_ms: Some(ttft),
            request_latency_ms: latency,
            time_per_output_token_ms: (tokens > 1).then(|| (latency - ttft) / (tokens - 1) as f64),
            output_tokens: tokens,
            prompt_tokens: 100,
            cached_tokens: 25,
            ..Record::default()
        }
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let d = Dist::of(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!((d.p50, d.min, d.max, d.mean), (2.5, 1.0, 4.0, 2.5));
        assert!((d.p90 - 3.7).abs() < 1e-12);
        assert_eq!(Dist::of(&[]).count, 0);
    }

    #[test]
    fn order_keys_order_as_total_cmp_and_give_the_value_back() {
        let xs = [f64::MIN, -1e300, -2.5, -1e-300, -0.0, 0.0, 1e-300, 2.5, 1e300, f64::MAX];
        for a in xs {
            assert_eq!(from_order_key(order_key(a)).to_bits(), a.to_bits());
            for b in xs {
                assert_eq!(order_key(a).cmp(&order_key(b)), a.total_cmp(&b), "{a} {b}");
            }
        }
    }

    /// The figures read from the order statistics put in place are those of a whole sort, on values with ties,
    /// infinities and NaNs (left out), of every length up to a few hundred.
    #[test]
    fn percentiles_by_selection_are_those_of_a_sort() {
        let mut rng = crate::rng::Rng::new(7);
        for n in 0..400 {
            let values: Vec<f64> = (0..n)
                .map(|_| match rng.below(20) {
                    0 => f64::NAN,
                    1 => f64::INFINITY,
                    2 => 3.0,
                    _ => (rng.below(1000) as f64) / 7.0 - 50.0,
                })
                .collect();
            let mut sorted: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
            sorted.sort_by(f64::total_cmp);
            let d = Dist::of(&values);
            assert_eq!(d.count, sorted.len());
            if sorted.is_empty() {
                continue;
            }
            let q = |p: f64| {
                let pos = p * (sorted.len() - 1) as f64;
                let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
                sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
            };
            assert_eq!((d.min, d.max), (sorted[0], sorted[sorted.len() - 1]), "n = {n}");
            assert_eq!([d.p50, d.p90, d.p95, d.p99], [q(0.5), q(0.9), q(0.95), q(0.99)], "n = {n}");
            let mean = sorted.iter().sum::<f64>() / sorted.len() as f64;
            assert!((d.mean - mean).abs() <= 1e-9 * mean.abs().max(1.0), "n = {n}");
        }
    }

    #[test]
    fn goodput_counts_requests_meeting_every_slo() {
        let mut failed = rec(1.0, 2.0, 2);
        failed.status = 429;
        let records = [rec(100.0, 1000.0, 10), rec(300.0, 400.0, 11), failed];
        let slo = Slo::parse("ttft_ms=200,tpot_ms=50").expect("parses");
        let s = summarize(&records, slo, &RunFacts { duration_s: 2.0, ..RunFacts::default() });
        // The first is too slow per token (100 ms), the second too slow to start, the third failed.
        assert_eq!(s.goodput_requests_per_s, 0.0);
        let s = summarize(
            &records,
            Slo::parse("ttft_ms=200").expect("parses"),
            &RunFacts { duration_s: 2.0, ..RunFacts::default() },
        );
        assert_eq!((s.goodput_requests_per_s, s.failed), (0.5, 1));
        assert_eq!(s.errors_by_status["429"], 1);
        assert_eq!(s.cached_token_fraction, 0.25);
        assert_eq!(s.output_tokens, 21);
        assert!(s.valid);
        assert!(Slo::parse("ttft=3").is_err());
    }

    #[test]
    fn a_run_that_could_not_keep_time_is_marked_invalid() {
        let mut late = rec(1.0, 2.0, 2);
        late.scheduled_ms = 0.0;
        late.sent_ms = 30.0;
        let facts = RunFacts { duration_s: 1.0, mean_arrival_gap_ms: Some(100.0), ..RunFacts::default() };
        let s = summarize(&[late.clone()], Slo::default(), &facts);
        assert!(!s.valid && s.invalid_reasons[0].contains("lag"), "{s:?}");
        let facts = RunFacts { duration_s: 1.0, step_overrun_p99: Some(1.1), ..RunFacts::default() };
        late.sent_ms = 0.0;
        let s = summarize(&[late.clone()], Slo::default(), &facts);
        assert!(!s.valid && s.invalid_reasons[0].contains("overran"), "{s:?}");
        // Past the largest bucket: written as Prometheus writes it, and read back.
        let facts = RunFacts { duration_s: 1.0, step_overrun_p99: Some(f64::INFINITY), ..RunFacts::default() };
        let s = summarize(&[late], Slo::default(), &facts);
        let json = serde_json::to_value(&s).expect("serializes");
        assert_eq!(json["step_overrun_p99"], "+Inf");
        assert_eq!(serde_json::from_value::<Summary>(json).expect("parses"), s);
    }
}
