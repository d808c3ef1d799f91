//! A circuit breaker per worker: after `failures` consecutive failures the worker is ejected (not routed to) for
//! `base_ejection`, doubled at each ejection in a row up to `max_ejection`. When the time is up it gets traffic
//! again; one success closes the breaker and resets the doubling, one more failure ejects it again at once.

use std::time::{Duration, Instant};

/// How the breakers behave (typed, named defaults).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BreakerSettings {
    /// Consecutive failures that eject a worker.
    pub failures: u32,
    pub base_ejection: Duration,
    pub max_ejection: Duration,
}

/// Named defaults of [`BreakerSettings`].
pub mod defaults {
    use std::time::Duration;

    /// Envoy's outlier detection default (5 consecutive 5xx).
    pub const FAILURES: u32 = 5;
    /// Long enough for a restarting worker to come back, short enough not to idle a healthy one for long.
    pub const BASE_EJECTION: Duration = Duration::from_secs(5);
    pub const MAX_EJECTION: Duration = Duration::from_secs(300);
}

impl Default for BreakerSettings {
    fn default() -> BreakerSettings {
        BreakerSettings {
            failures: defaults::FAILURES,
            base_ejection: defaults::BASE_EJECTION,
            max_ejection: defaults::MAX_EJECTION,
        }
    }
}

/// One worker's breaker.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Breaker {
    consecutive: u32,
    /// Ejections since the last success (the doubling's exponent).
    ejections: u32,
    ejected_until: Option<Instant>,
}

impl Breaker {
    /// Whether the worker may be routed to at `now`.
    pub fn admits(&self, now: Instant) -> bool {
        self.ejected_until.is_none_or(|until| now >= until)
    }

    /// A request to the worker succeeded.
    pub fn success(&mut self) {
        *self = Breaker::default();
    }

    /// A request to the worker failed in a way that says the worker is unwell; returns the ejection when this
    /// failure ejects it.
    pub fn failure(&mut self, now: Instant, s: &BreakerSettings) -> Option<Duration> {
        self.consecutive += 1;
        // Back from an ejection: one more failure sends it out again.
        let probing = self.ejections > 0 && self.ejected_until.is_some_and(|until| now >= until);
        if self.consecutive < s.failures.max(1) && !probing {
            return None;
        }
        let factor = 1u32.checked_shl(self.ejections.min(20)).unwrap_or(u32::MAX);
        let ejection = s.base_ejection.saturating_mul(factor).min(s.max_ejection);
        self.ejections += 1;
        self.consecutive = 0;
        self.ejected_until = Some(now + ejection);
        Some(ejection)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_failures_eject_for_a_growing_time_and_a_success_forgives() {
        let s = BreakerSettings {
            failures: 3,
            base_ejection: Duration::from_secs(5),
            max_ejection: Duration::from_secs(12),
        };
        let t0 = Instant::now();
        let at = |secs: u64| t0 + Duration::from_secs(secs);
        let mut b = Breaker::default();
        assert_eq!((b.failure(at(0), &s), b.failure(at(0), &s)), (None, None));
        b.success();
        // The count is of failures in a row: two, a success, then three.
        assert_eq!((b.failure(at(0), &s), b.failure(at(0), &s)), (None, None));
        assert_eq!(b.failure(at(1), &s), Some(Duration::from_secs(5)));
        assert!(!b.admits(at(5)) && b.admits(at(6)));
        // Back after its ejection, it fails once more: out again at once, for twice as long.
        assert_eq!(b.failure(at(6), &s), Some(Duration::from_secs(10)));
        assert!(!b.admits(at(15)) && b.admits(at(16)));
        // The doubling stops at the maximum.
        assert_eq!(b.failure(at(16), &s), Some(Duration::from_secs(12)));
        // A success closes it and resets everything.
        b.success();
        assert!(b.admits(at(16)));
        assert_eq!(b.failure(at(30), &s), None);
    }
}
