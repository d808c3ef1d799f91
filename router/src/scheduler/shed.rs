//! Shedding by expected wait: a request whose prefill would only start after `shed_wait_ms` of queued work is
//! refused at once (429 with Retry-After) rather than queued behind work that already misses its first-token
//! target. Under overload this keeps the admitted requests inside their targets, so goodput holds near capacity
//! instead of every request arriving late.

use super::view::WorkerView;

/// Seconds of queued prompt work ahead of a new request on `w`: its uncached prompt tokens still to compute at
/// its measured prefill speed. `None` until that speed is measured (nothing to estimate from: never shed).
pub fn queue_wait_secs(w: &WorkerView) -> Option<f64> {
    let rate = w.speed.prefill_tokens_per_sec.filter(|r| r.is_finite() && *r > 0.0)?;
    Some(w.load.active_prefill_tokens as f64 / rate)
}

/// `Some(wait in seconds)` when the request should be shed: the worker that would prefill it has more than
/// `limit_ms` of queued work.
pub fn over_limit(prefiller: &WorkerView, limit_ms: f64) -> Option<f64> {
    queue_wait_secs(prefiller).filter(|wait| *wait * 1000.0 > limit_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::view::{Load, Speed, WorkerId, WorkerRole};

    fn worker(queued: u64, rate: Option<f64>) -> WorkerView {
        WorkerView {
            id: WorkerId(0),
            name: "p0".into(),
            role: WorkerRole::Prefill,
            overlap: Default::default(),
            active_overlap: 0,
            load: Load { active_prefill_tokens: queued, ..Load::default() },
            ramp: 1.0,
            max_num_batched_tokens: 2048,
            block_bytes: 1024,
            speed: Speed { prefill_tokens_per_sec: rate, transfer_bytes_per_sec: None },
            predicted: false,
        }
    }

    #[test]
    fn the_wait_is_queued_tokens_over_the_measured_speed() {
        assert_eq!(queue_wait_secs(&worker(20_000, Some(10_000.0))), Some(2.0));
        assert_eq!(queue_wait_secs(&worker(20_000, None)), None);
        assert_eq!(queue_wait_secs(&worker(20_000, Some(0.0))), None);
    }

    #[test]
    fn only_a_measured_wait_past_the_limit_sheds() {
        assert_eq!(over_limit(&worker(20_000, Some(10_000.0)), 1500.0), Some(2.0));
        assert_eq!(over_limit(&worker(20_000, Some(10_000.0)), 2000.0), None, "at the limit is admitted");
        assert_eq!(over_limit(&worker(20_000_000, None), 1.0), None, "no speed measured yet");
        assert_eq!(over_limit(&worker(0, Some(10.0)), 0.0), None, "an empty queue never sheds");
    }
}
