//! Replaying a router's recording: each request's workers are the recorded decision's, found by name, and a request
//! whose prefill fails moves on through the decision's recorded candidates (recordings made with
//! `--record-candidates`).

use std::collections::HashMap;

use loadgen::trace::{RecordedCandidate, RecordedDecision, TraceRequest};
use router::scheduler::RouteError;

use super::{Placement, Settings, Sim, SimError};

impl Sim<'_> {
    /// Request `i`'s recorded decision, its workers found by name (checked to exist when the run started).
    pub(super) fn replayed(&self, i: usize) -> Result<Placement, RouteError> {
        let recorded = self.workload[i].recorded.as_ref().map(|r| &r.decision);
        let named = |name: &Option<String>| name.as_ref().and_then(|n| self.recorded.get(n)).copied();
        match recorded {
            Some(d) if d.refused.is_some() => {
                Err(d.refused.as_deref().and_then(RouteError::from_kind).unwrap_or(RouteError::AllBusy))
            }
            Some(d) => Ok(Placement {
                prefill: named(&d.prefill).filter(|_| d.disaggregate),
                decode: named(&d.decode).ok_or(RouteError::NoDecodeWorkers)?,
                reason: format!("recorded {}", d.reason.as_deref().unwrap_or("decision")),
                margin: None,
                candidates: None,
                retry_order: recorded_retry_order(d, &self.recorded),
            }),
            None => Err(RouteError::NoDecodeWorkers),
        }
    }
}

/// [`super::failover::retry_order`] for a recorded decision, from its recorded candidates (`None` when it has none), with the
/// workers found by their recorded names (`names`; one the simulation lacks is left out).
fn recorded_retry_order(d: &RecordedDecision, names: &HashMap<String, usize>) -> Option<(Vec<(usize, u64)>, u64)> {
    let c = d.candidates.as_ref()?;
    let mut prefill: Vec<_> = if d.disaggregate { c.prefill.iter().collect() } else { Vec::new() };
    // As `Choice::by_preference`: the chosen one first, then by cost (a stable sort keeps the router's order).
    let chosen = d.prefill.as_deref();
    let key = |c: &RecordedCandidate| (Some(c.worker.as_str()) == chosen, c.cost);
    prefill.sort_by(|a, b| router::scheduler::preference(key(a), key(b)));
    let order = prefill.iter().filter_map(|c| Some((*names.get(&c.worker)?, c.held() as u64))).collect();
    let decode = c.decode.iter().find(|c| Some(c.worker.as_str()) == d.decode.as_deref());
    Some((order, decode.map_or(0, |c| c.held() as u64)))
}

/// The simulated worker for each worker a recording names: names of the simulator's own form (`prefill-K`,
/// `decode-K`) keep their number; otherwise (a router recording names workers by the address it knows them by)
/// prefill workers in the order they first appear become `prefill-0`, `prefill-1`, …, and decode workers
/// `decode-0`, …. Too many names for the simulated pools is an error.
pub(super) fn recorded_names(
    settings: &Settings,
    workload: &[TraceRequest],
) -> Result<HashMap<String, usize>, SimError> {
    let mut map = HashMap::new();
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    for d in workload.iter().filter_map(|r| r.recorded.as_ref()).map(|r| &r.decision) {
        for (name, seen) in [(&d.prefill, &mut prefill), (&d.decode, &mut decode)] {
            if let Some(n) = name.as_ref().filter(|n| !seen.contains(*n)) {
                seen.push(n.clone());
            }
        }
    }
    if prefill.is_empty() && decode.is_empty() {
        return Err(SimError::Settings(
            "the trace records no decisions to replay (record one with --record-trace)".into(),
        ));
    }
    if prefill.len() > settings.prefill || decode.len() > settings.decode {
        return Err(SimError::Settings(format!(
            "the recording names {} prefill and {} decode workers: give --prefill and --decode at least that",
            prefill.len(),
            decode.len()
        )));
    }
    // Names the simulator itself gives (`prefill-K`, `decode-K`, as `tandem up` and `tandem sim` name workers)
    // keep their number.
    let numbered =
        |n: &str, prefix: &str, pool: usize| n.strip_prefix(prefix)?.parse::<usize>().ok().filter(|&k| k < pool);
    let by_number = prefill.iter().all(|n| numbered(n, "prefill-", settings.prefill).is_some())
        && decode.iter().all(|n| numbered(n, "decode-", settings.decode).is_some());
    // Then the workers that were only candidates (in a recording with them), where the pools have room: a replay
    // moves a failed prefill on through them.
    for d in workload.iter().filter_map(|r| r.recorded.as_ref()).filter_map(|r| r.decision.candidates.as_ref()) {
        for (candidates, seen) in [(&d.prefill, &mut prefill), (&d.decode, &mut decode)] {
            for c in candidates {
                if !seen.contains(&c.worker) {
                    seen.push(c.worker.clone());
                }
            }
        }
    }
    for (k, n) in prefill.into_iter().enumerate() {
        let at = if by_number { numbered(&n, "prefill-", settings.prefill) } else { Some(k) };
        if let Some(at) = at.filter(|&at| at < settings.prefill) {
            map.insert(n, at);
        }
    }
    for (k, n) in decode.into_iter().enumerate() {
        let at = if by_number { numbered(&n, "decode-", settings.decode) } else { Some(k) };
        if let Some(at) = at.filter(|&at| at < settings.decode) {
            map.insert(n, settings.prefill + at);
        }
    }
    Ok(map)
}
