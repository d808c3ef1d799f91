//! When each request is sent: at the trace's timestamps (sped up), at open-loop arrivals of a given rate
//! (Poisson, or gamma gaps for burstier traffic), or whenever one of a fixed number of slots frees up (closed loop,
//! which cannot show overload: a slow server just slows the client down). A session's later turn is sent a delay
//! after its previous turn finished, under every schedule.

use std::collections::HashMap;

use crate::rng::Rng;
use crate::trace::TraceRequest;

/// How requests arrive.
#[derive(Clone, Debug, PartialEq)]
pub enum Arrivals {
    /// The trace's own timestamps divided by `speedup`.
    Trace { speedup: f64 },
    /// Open loop: `rate` requests per second with gamma-distributed gaps of shape `burstiness` (1: Poisson;
    /// below 1: burstier; the gaps' coefficient of variation is 1/sqrt(burstiness)), reproducible from `seed`.
    Rate { rate: f64, burstiness: f64, seed: u64 },
    /// Closed loop: this many requests in flight at all times.
    Concurrency(usize),
}

/// When one request starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Start {
    /// At this many milliseconds after the run starts.
    At(f64),
    /// `delay_ms` after request `prev` (the previous turn of its session) finished.
    After { prev: usize, delay_ms: f64 },
    /// When a concurrency slot is free.
    Slot,
}

impl Arrivals {
    /// Whether the schedule is closed loop.
    pub fn closed_loop(&self) -> bool {
        matches!(self, Arrivals::Concurrency(_))
    }
}

/// Under the trace's own schedule, the first request that has no timestamp and no earlier turn of its session to
/// follow (aiperf's traces may leave timestamps out, for a rate or a concurrency to set the pace): there is no
/// moment to send it at.
pub fn untimed(requests: &[TraceRequest], arrivals: &Arrivals) -> Option<usize> {
    if !matches!(arrivals, Arrivals::Trace { .. }) {
        return None;
    }
    let mut sessions = std::collections::HashSet::new();
    requests.iter().position(|r| {
        let follows = r.session_id.as_deref().is_some_and(|s| !sessions.insert(s));
        r.arrival_ms.is_none() && !follows
    })
}

/// The start of every request, in order.
pub fn plan(requests: &[TraceRequest], arrivals: &Arrivals) -> Vec<Start> {
    let mut last_turn: HashMap<&str, usize> = HashMap::new();
    let mut rng = match arrivals {
        Arrivals::Rate { seed, .. } => Rng::new(*seed),
        _ => Rng::new(0),
    };
    let mut clock = 0.0;
    // The trace's clock starts at its earliest arrival (not its first line's: a request listed out of order would
    // otherwise be sent at once instead of when it came).
    let zero = requests.iter().filter_map(|r| r.arrival_ms).fold(f64::INFINITY, f64::min);
    requests
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let prev = r.session_id.as_deref().and_then(|s| last_turn.insert(s, i));
            if let (Some(prev), None) = (prev, r.arrival_ms.filter(|_| matches!(arrivals, Arrivals::Trace { .. }))) {
                return Start::After { prev, delay_ms: r.delay_ms.unwrap_or(0.0) };
            }
            match arrivals {
                Arrivals::Trace { speedup } => {
                    let at = r.arrival_ms.unwrap_or(zero);
                    Start::At((at - zero).max(0.0) / speedup)
                }
                Arrivals::Rate { rate, burstiness, .. } => {
                    let at = clock;
                    // Gamma(k, θ) with k·θ = 1/rate: the mean gap is 1/rate whatever the burstiness.
                    clock += crate::rng::gamma(&mut rng, *burstiness) / (burstiness * rate) * 1000.0;
                    Start::At(at)
                }
                Arrivals::Concurrency(_) => Start::Slot,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: f64) -> TraceRequest {
        TraceRequest { arrival_ms: Some(ms), input_length: 1, output_length: 1, ..TraceRequest::default() }
    }

    #[test]
    fn trace_times_are_sped_up_from_the_earliest() {
        let p = plan(&[at(1000.0), at(1500.0), at(3000.0)], &Arrivals::Trace { speedup: 2.0 });
        assert_eq!(p, [Start::At(0.0), Start::At(250.0), Start::At(1000.0)]);
        let p = plan(&[at(1500.0), at(1000.0), at(3000.0)], &Arrivals::Trace { speedup: 1.0 });
        assert_eq!(p, [Start::At(500.0), Start::At(0.0), Start::At(2000.0)], "from the earliest, not the first");
    }

    #[test]
    fn a_request_with_no_moment_to_start_is_named_under_the_traces_schedule_only() {
        let untimed_req = TraceRequest { arrival_ms: None, ..at(0.0) };
        let turn = |s: &str, ms: Option<f64>| TraceRequest { arrival_ms: ms, session_id: Some(s.into()), ..at(0.0) };
        let trace = Arrivals::Trace { speedup: 1.0 };
        assert_eq!(untimed(&[at(0.0), turn("a", Some(1.0)), turn("a", None)], &trace), None, "a later turn follows");
        assert_eq!(untimed(&[at(0.0), untimed_req.clone()], &trace), Some(1));
        assert_eq!(untimed(&[turn("b", None)], &trace), Some(0), "a session's first turn needs a moment of its own");
        assert_eq!(untimed(std::slice::from_ref(&untimed_req), &Arrivals::Concurrency(2)), None);
        assert_eq!(untimed(&[untimed_req], &Arrivals::Rate { rate: 1.0, burstiness: 1.0, seed: 0 }), None);
    }

    #[test]
    fn later_turns_follow_their_session() {
        let turn = |s: &str, ms: Option<f64>| TraceRequest {
            arrival_ms: ms,
            session_id: Some(s.into()),
            delay_ms: Some(40.0),
            ..at(0.0)
        };
        let reqs = [turn("a", Some(0.0)), turn("b", Some(10.0)), turn("a", None), turn("a", None)];
        let p = plan(&reqs, &Arrivals::Trace { speedup: 1.0 });
        assert_eq!(p[2], Start::After { prev: 0, delay_ms: 40.0 });
        assert_eq!(p[3], Start::After { prev: 2, delay_ms: 40.0 });
        let p = plan(&reqs, &Arrivals::Concurrency(2));
        assert_eq!((p[0], p[2]), (Start::Slot, Start::After { prev: 0, delay_ms: 40.0 }));
    }

    #[test]
    fn open_loop_keeps_the_mean_rate_and_burstiness_spreads_the_gaps() {
        let reqs = vec![at(0.0); 20_000];
        let gaps = |burstiness: f64| -> (f64, f64) {
            let p = plan(&reqs, &Arrivals::Rate { rate: 50.0, burstiness, seed: 9 });
            let t: Vec<f64> = p.iter().map(|s| if let Start::At(x) = s { *x } else { f64::NAN }).collect();
            let g: Vec<f64> = t.windows(2).map(|w| w[1] - w[0]).collect();
            let mean = g.iter().sum::<f64>() / g.len() as f64;
            let sd = (g.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / g.len() as f64).sqrt();
            (mean, sd / mean)
        };
        let (mean, cv) = gaps(1.0);
        assert!((mean - 20.0).abs() < 0.5 && (cv - 1.0).abs() < 0.05, "Poisson: mean {mean} ms, cv {cv}");
        let (mean, cv) = gaps(0.25);
        assert!((mean - 20.0).abs() < 1.0 && (cv - 2.0).abs() < 0.15, "bursty: mean {mean} ms, cv {cv}");
    }
}
