//! `tandem tune`: the scheduler's settings (and the prefill/decode split) searched in the simulator for an
//! objective, on the first part of a trace, and reported on the rest against the defaults and round robin.

pub mod search;
pub mod space;

use std::collections::BTreeMap;

use loadgen::schedule::{Arrivals, Start, plan};
use loadgen::summary::{RunFacts, Slo, Summary, summarize};
use loadgen::trace::TraceRequest;
use router::scheduler::config::{Policy, SchedulerConfig};

use self::search::{Search, mean, par_map, std_dev, successive_halving, windows};
use self::space::{Candidate, Param, Sampler, candidate, unit_points};
use crate::Settings;

/// What the search minimises or maximises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Objective {
    /// Requests per second that met every SLO (higher is better).
    Goodput,
    /// A latency percentile in milliseconds (lower is better).
    Latency(Metric, u8),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    Ttft,
    Tpot,
    Itl,
    E2e,
}

impl std::str::FromStr for Objective {
    type Err = String;

    fn from_str(s: &str) -> Result<Objective, String> {
        if s == "goodput" {
            return Ok(Objective::Goodput);
        }
        let bad =
            || format!("--objective: {s:?} is not goodput or METRIC_pQ (ttft, tpot, itl, e2e; p50, p90, p95, p99)");
        let (metric, q) = s.split_once("_p").ok_or_else(bad)?;
        let metric = match metric {
            "ttft" => Metric::Ttft,
            "tpot" => Metric::Tpot,
            "itl" => Metric::Itl,
            "e2e" => Metric::E2e,
            _ => return Err(bad()),
        };
        match q.parse::<u8>() {
            Ok(q @ (50 | 90 | 95 | 99)) => Ok(Objective::Latency(metric, q)),
            _ => Err(bad()),
        }
    }
}

impl std::fmt::Display for Objective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Objective::Goodput => f.write_str("goodput"),
            Objective::Latency(m, q) => {
                let m = match m {
                    Metric::Ttft => "ttft",
                    Metric::Tpot => "tpot",
                    Metric::Itl => "itl",
                    Metric::E2e => "e2e",
                };
                write!(f, "{m}_p{q}")
            }
        }
    }
}

impl Objective {
    /// The run's figure (requests/s or milliseconds).
    pub fn value(&self, s: &Summary) -> f64 {
        match *self {
            Objective::Goodput => s.goodput_requests_per_s,
            Objective::Latency(m, q) => {
                let d = match m {
                    Metric::Ttft => &s.time_to_first_token_ms,
                    Metric::Tpot => &s.time_per_output_token_ms,
                    Metric::Itl => &s.inter_token_latency_ms,
                    Metric::E2e => &s.request_latency_ms,
                };
                // A run where requests failed is not better for having fewer latencies to count.
                let v = match q {
                    50 => d.p50,
                    90 => d.p90,
                    95 => d.p95,
                    _ => d.p99,
                };
                if s.failed > 0 { f64::INFINITY } else { v }
            }
        }
    }

    /// The figure as a loss: lower is better.
    pub fn loss(&self, s: &Summary) -> f64 {
        match self {
            Objective::Goodput => -self.value(s),
            Objective::Latency(..) => self.value(s),
        }
    }

    pub fn higher_is_better(&self) -> bool {
        matches!(self, Objective::Goodput)
    }

    /// The loss turned back into the figure.
    pub fn from_loss(&self, loss: f64) -> f64 {
        if self.higher_is_better() { -loss } else { loss }
    }
}

/// How to search.
#[derive(Clone, Debug)]
pub struct TuneSettings {
    /// The simulated cluster, with the base scheduler settings and split every candidate starts from.
    pub base: Settings,
    pub arrivals: Arrivals,
    pub space: Vec<Param>,
    pub sampler: Sampler,
    /// Candidates drawn (the base settings are tried as well, as candidate 0).
    pub samples: usize,
    pub rounds: usize,
    /// Each round keeps 1/eta of its candidates on an eta times longer window.
    pub eta: usize,
    /// Requests in the first round's window at least.
    pub min_window: usize,
    /// The leading share of the trace (by arrival) tuned on; the rest is held out.
    pub train_fraction: f64,
    pub seeds: Vec<u64>,
    pub objective: Objective,
    pub slo: Slo,
    pub jobs: usize,
}

/// One setting's figures on the held-out part, one per seed.
#[derive(Clone, Debug, PartialEq)]
pub struct HeldOut {
    pub name: &'static str,
    pub values: Vec<f64>,
    /// The first seed's summary.
    pub summary: Summary,
}

impl HeldOut {
    pub fn mean(&self) -> f64 {
        mean(&self.values)
    }

    pub fn std_dev(&self) -> f64 {
        std_dev(&self.values)
    }
}

/// What the tuner found.
#[derive(Clone, Debug)]
pub struct Report {
    pub candidates: Vec<Candidate>,
    pub search: Search,
    pub train_requests: usize,
    pub test_requests: usize,
    /// The winner's and the current settings' objective on the whole training part, per seed.
    pub best_train: Vec<f64>,
    pub current_train: Vec<f64>,
    /// The winner, the base settings and round robin on the held-out part.
    pub held_out: Vec<HeldOut>,
}

impl Report {
    pub fn best(&self) -> &Candidate {
        &self.candidates[self.search.best]
    }
}

/// Draws the candidates, runs successive halving on the training part, and reports on the held-out part.
pub fn tune(t: &TuneSettings, workload: &[TraceRequest]) -> Result<Report, String> {
    if workload.len() < 4 {
        return Err("tuning needs a workload of at least 4 requests".into());
    }
    if !(t.train_fraction > 0.0 && t.train_fraction < 1.0) {
        return Err("the training share must be between 0 and 1".into());
    }
    if t.seeds.is_empty() {
        return Err("at least one seed".into());
    }
    let train = ((workload.len() as f64 * t.train_fraction).round() as usize).clamp(1, workload.len() - 1);
    let (train_part, test_part) = workload.split_at(train);
    let split = (t.base.prefill, t.base.decode);
    let seed = t.seeds[0];
    let mut candidates = vec![Candidate {
        changes: Default::default(),
        scheduler: t.base.scheduler.clone(),
        prefill: split.0,
        decode: split.1,
    }];
    for point in unit_points(t.sampler, t.samples, t.space.len(), seed) {
        candidates.push(candidate(&t.space, &point, &t.base.scheduler, split)?);
    }
    let windows = windows(train, t.rounds, t.eta, t.min_window);
    let starts: BTreeMap<usize, Vec<Start>> =
        windows.iter().map(|&w| (w, plan(&train_part[..w], &t.arrivals))).collect();
    let search = successive_halving(candidates.len(), &windows, t.eta, &t.seeds, t.jobs, |c, w, s| {
        let summary = run(t, &candidates[c], &train_part[..w], &starts[&w], s)?;
        Ok(t.objective.loss(&summary))
    })?;
    let full = windows.last().copied().unwrap_or(train);
    let on_train = |c: usize| -> Vec<f64> {
        let full = search.evaluations.iter().filter(|e| e.candidate == c && e.window == full);
        full.map(|e| t.objective.from_loss(e.loss)).collect()
    };
    let (best_train, current_train) = (on_train(search.best), on_train(0));
    let best = candidates[search.best].clone();
    let round_robin = Candidate {
        scheduler: SchedulerConfig { policy: Policy::RoundRobin, ..t.base.scheduler.clone() },
        ..candidates[0].clone()
    };
    let finalists = [("tuned", &best), ("defaults", &candidates[0]), ("round_robin", &round_robin)];
    let test_starts = plan(test_part, &t.arrivals);
    let tasks: Vec<(usize, u64)> = (0..finalists.len()).flat_map(|f| t.seeds.iter().map(move |&s| (f, s))).collect();
    let summaries = par_map(&tasks, t.jobs, |&(f, s)| run(t, finalists[f].1, test_part, &test_starts, s))?;
    let held_out = finalists
        .iter()
        .enumerate()
        .map(|(f, (name, _))| {
            let mine: Vec<&Summary> =
                tasks.iter().zip(&summaries).filter(|((k, _), _)| *k == f).map(|(_, s)| s).collect();
            HeldOut {
                name,
                values: mine.iter().map(|s| t.objective.value(s)).collect(),
                summary: mine.first().map(|s| (*s).clone()).unwrap_or_default(),
            }
        })
        .collect();
    Ok(Report {
        candidates,
        search,
        train_requests: train,
        test_requests: test_part.len(),
        best_train,
        current_train,
        held_out,
    })
}

/// One simulation of `part` with candidate `c`'s settings.
fn run(t: &TuneSettings, c: &Candidate, part: &[TraceRequest], starts: &[Start], seed: u64) -> Result<Summary, String> {
    let settings =
        Settings { scheduler: c.scheduler.clone(), prefill: c.prefill, decode: c.decode, seed, ..t.base.clone() };
    let outcome = crate::simulate(&settings, part, starts).map_err(|e| e.to_string())?;
    let facts = RunFacts { duration_s: outcome.duration_s, ..RunFacts::default() };
    Ok(summarize(&outcome.records, t.slo, &facts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objectives_parse_and_print_back() {
        for s in ["goodput", "ttft_p90", "tpot_p50", "itl_p99", "e2e_p95"] {
            assert_eq!(s.parse::<Objective>().expect(s).to_string(), s);
        }
        for s in ["", "ttft", "ttft_p91", "latency_p90"] {
            assert!(s.parse::<Objective>().is_err(), "{s}");
        }
    }
}
