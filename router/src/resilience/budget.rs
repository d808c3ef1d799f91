//! A retry budget (Linkerd's and Finagle's): retries and failovers may add at most `ratio` of the requests seen in
//! the last `window`, plus `min_per_sec` so that a quiet router can still retry. A cluster that fails most
//! requests is then not sent each of them twice.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// How much retrying is allowed (typed, named defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct RetryBudgetSettings {
    pub ratio: f64,
    pub min_per_sec: f64,
    pub window: Duration,
}

/// Named defaults of [`RetryBudgetSettings`].
pub mod defaults {
    use std::time::Duration;

    /// Linkerd's defaults: 20% more load at most, at least 10 retries a second, over 10 s.
    pub const RATIO: f64 = 0.2;
    pub const MIN_PER_SEC: f64 = 10.0;
    pub const WINDOW: Duration = Duration::from_secs(10);
}

impl Default for RetryBudgetSettings {
    fn default() -> RetryBudgetSettings {
        RetryBudgetSettings { ratio: defaults::RATIO, min_per_sec: defaults::MIN_PER_SEC, window: defaults::WINDOW }
    }
}

/// Requests and retries over the sliding window.
#[derive(Debug, Default)]
pub struct RetryBudget {
    requests: VecDeque<Instant>,
    retries: VecDeque<Instant>,
}

impl RetryBudget {
    fn expire(&mut self, now: Instant, window: Duration) {
        for q in [&mut self.requests, &mut self.retries] {
            while q.front().is_some_and(|t| now.saturating_duration_since(*t) >= window) {
                q.pop_front();
            }
        }
    }

    /// A new request arrived.
    pub fn request(&mut self, now: Instant, s: &RetryBudgetSettings) {
        self.expire(now, s.window);
        self.requests.push_back(now);
    }

    /// Takes one retry from the budget if there is one left.
    pub fn try_retry(&mut self, now: Instant, s: &RetryBudgetSettings) -> bool {
        self.expire(now, s.window);
        let allowed = s.ratio * self.requests.len() as f64 + s.min_per_sec * s.window.as_secs_f64();
        if (self.retries.len() as f64) < allowed.floor() {
            self.retries.push_back(now);
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_stay_within_a_fraction_of_recent_requests() {
        let s = RetryBudgetSettings { ratio: 0.2, min_per_sec: 0.0, window: Duration::from_secs(10) };
        let t0 = Instant::now();
        let mut b = RetryBudget::default();
        for _ in 0..50 {
            b.request(t0, &s);
        }
        // 20% of 50: ten retries, then none.
        assert_eq!((0..15).filter(|_| b.try_retry(t0, &s)).count(), 10);
        // Ten seconds later the window has moved on: the old requests and retries no longer count.
        let later = t0 + Duration::from_secs(10);
        assert!(!b.try_retry(later, &s));
        for _ in 0..5 {
            b.request(later, &s);
        }
        assert_eq!((0..5).filter(|_| b.try_retry(later, &s)).count(), 1);
        // The floor lets a quiet router retry now and then.
        let floor = RetryBudgetSettings { min_per_sec: 0.5, ..s };
        let mut quiet = RetryBudget::default();
        assert_eq!((0..10).filter(|_| quiet.try_retry(t0, &floor)).count(), 5);
    }
}
