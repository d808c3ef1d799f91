//! A worker whose engine stopped making progress while its process still answers: a device hang, a deadlocked
//! step. Its load reports and pings go on, so neither the silence watchdog nor HTTP/2 keepalive notices; its
//! reports do show it, because the tokens its engine has run through stop growing while it holds work. Pure: `now`
//! is an input.

use std::time::{Duration, Instant};

/// When a worker holding work without progress counts as stalled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StallSettings {
    /// Longer than any step the engine takes (a CPU engine's prompt chunk of 2,048 tokens takes several seconds on
    /// two cores); zero turns the watch off.
    pub after: Duration,
}

/// Named defaults of [`StallSettings`].
pub mod defaults {
    use std::time::Duration;

    /// Several times the longest step seen of the CPU engine on a 2-core machine (a 2,048-token chunk, about 7 s),
    /// and well inside the prefill timeout (180 s) a stalled worker's requests would otherwise wait out.
    pub const AFTER: Duration = Duration::from_secs(30);
}

impl Default for StallSettings {
    fn default() -> StallSettings {
        StallSettings { after: defaults::AFTER }
    }
}

/// What changed with a report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    None,
    /// It has held work for `after` without progress.
    Stalled,
    /// It made progress (or holds nothing) again.
    Recovered,
}

/// One worker's progress, as its reports tell it (`Default`: nothing reported yet).
#[derive(Clone, Copy, Debug, Default)]
pub struct StallWatch {
    /// The tokens its engine had run through at the last report.
    total: u64,
    /// Its last progress, or the last report in which it held nothing (`None` before the first report).
    since: Option<Instant>,
    stalled: bool,
}

impl StallWatch {
    /// A report at `now`: the engine's running total of tokens computed, and whether the worker holds work (its
    /// engine's sequences, or requests the router sent it and has not heard the end of). Only progress ends a
    /// stall: once its calls are given up a stalled worker may hold nothing, and it is no better for that.
    pub fn report(&mut self, now: Instant, total: u64, holds_work: bool, settings: &StallSettings) -> Change {
        let progressed = total != self.total;
        self.total = total;
        let quiet_since = *self.since.get_or_insert(now);
        if progressed || settings.after.is_zero() {
            self.since = Some(now);
            return if std::mem::take(&mut self.stalled) { Change::Recovered } else { Change::None };
        }
        if self.stalled {
            return Change::None;
        }
        if !holds_work {
            // Idle time is not stalled time.
            self.since = Some(now);
            return Change::None;
        }
        if now.saturating_duration_since(quiet_since) >= settings.after {
            self.stalled = true;
            return Change::Stalled;
        }
        Change::None
    }

    pub fn stalled(&self) -> bool {
        self.stalled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holding_work_without_progress_for_the_limit_is_a_stall_and_progress_ends_it() {
        let settings = StallSettings { after: Duration::from_secs(30) };
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut w = StallWatch::default();
        assert_eq!(w.report(at(0), 100, true, &settings), Change::None);
        // Progress restarts the clock.
        assert_eq!(w.report(at(20), 200, true, &settings), Change::None);
        assert_eq!(w.report(at(40), 200, true, &settings), Change::None);
        assert_eq!(w.report(at(49), 200, true, &settings), Change::None);
        assert_eq!(w.report(at(50), 200, true, &settings), Change::Stalled, "30 s since its last progress");
        assert!(w.stalled());
        assert_eq!(w.report(at(60), 200, true, &settings), Change::None, "said once");
        // Its calls given up, it holds nothing: still stalled until it computes.
        assert_eq!(w.report(at(70), 200, false, &settings), Change::None);
        assert!(w.stalled());
        assert_eq!(w.report(at(71), 201, false, &settings), Change::Recovered);
        assert!(!w.stalled());
    }

    #[test]
    fn an_idle_worker_never_stalls_and_a_zero_limit_turns_the_watch_off() {
        let t0 = Instant::now();
        let mut w = StallWatch::default();
        let settings = StallSettings::default();
        for s in 0..10 {
            assert_eq!(w.report(t0 + Duration::from_secs(60 * s), 7, false, &settings), Change::None);
        }
        // Idle time before the work came does not count: the clock starts at the last report that held nothing.
        assert_eq!(w.report(t0 + Duration::from_secs(541), 7, true, &settings), Change::None);
        assert_eq!(w.report(t0 + Duration::from_secs(569), 7, true, &settings), Change::None);
        assert_eq!(w.report(t0 + Duration::from_secs(570), 7, true, &settings), Change::Stalled);
        let off = StallSettings { after: Duration::ZERO };
        let mut w = StallWatch::default();
        for s in 0..10 {
            assert_eq!(w.report(t0 + Duration::from_secs(60 * s), 7, true, &off), Change::None);
        }
    }
}
