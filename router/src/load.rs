//! What the router believes each worker's load is: the worker's last report plus the work the router sent it
//! since that report (own-sent accounting). Reports reconcile rather than overwrite: work sent before a report is
//! in the report; work sent after it is added on top until the next report covers it. Pure: `now` is an input.

use std::collections::HashMap;
use std::time::Instant;

use crate::scheduler::view::{Load, WorkerId};

/// A worker's own figures (a `WatchLoad` report).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub running: u64,
    pub waiting: u64,
    pub active_prefill_tokens: u64,
    pub device_used: u64,
    pub device_total: u64,
}

/// One request the router sent a worker and has not yet seen finish there.
#[derive(Clone, Copy, Debug)]
struct Sent {
    at: Instant,
    /// Prompt tokens the worker still has to compute; zero once its first token came back.
    prefill_tokens: u64,
    blocks: u64,
}

#[derive(Debug, Default)]
struct Tracked {
    report: Report,
    reported_at: Option<Instant>,
    sent: HashMap<u64, Sent>,
}

/// Load per worker.
#[derive(Debug, Default)]
pub struct LoadTracker {
    workers: HashMap<WorkerId, Tracked>,
}

impl LoadTracker {
    pub fn new() -> LoadTracker {
        LoadTracker::default()
    }

    /// A report from `worker`, taken at `now`.
    pub fn report(&mut self, worker: WorkerId, report: Report, now: Instant) {
        let t = self.workers.entry(worker).or_default();
        t.report = report;
        t.reported_at = Some(now);
    }

    /// The router sent request `id` to `worker`: `prefill_tokens` to compute there, `blocks` of KV it will hold.
    pub fn sent(&mut self, worker: WorkerId, id: u64, prefill_tokens: u64, blocks: u64, now: Instant) {
        self.workers.entry(worker).or_default().sent.insert(id, Sent { at: now, prefill_tokens, blocks });
    }

    /// The worker produced request `id`'s first token: its prompt is computed.
    pub fn first_token(&mut self, worker: WorkerId, id: u64) {
        if let Some(s) = self.workers.get_mut(&worker).and_then(|t| t.sent.get_mut(&id)) {
            s.prefill_tokens = 0;
        }
    }

    /// Request `id` is finished (or failed, or was cancelled) on `worker`.
    pub fn done(&mut self, worker: WorkerId, id: u64) {
        if let Some(t) = self.workers.get_mut(&worker) {
            t.sent.remove(&id);
        }
    }

    /// Requests sent to `worker` and not yet done.
    pub fn own_requests(&self, worker: WorkerId) -> u64 {
        self.workers.get(&worker).map_or(0, |t| t.sent.len() as u64)
    }

    pub fn forget(&mut self, worker: WorkerId) {
        self.workers.remove(&worker);
    }

    /// The reconciled load of `worker`; `capacity` when the worker has not reported yet.
    pub fn load(&self, worker: WorkerId, capacity: u64) -> Load {
        let Some(t) = self.workers.get(&worker) else {
            return Load { capacity_blocks: capacity, ..Load::default() };
        };
        let newer = t.sent.values().filter(|s| t.reported_at.is_none_or(|r| s.at > r));
        let (tokens, blocks) = newer.fold((0, 0), |(a, b), s| (a + s.prefill_tokens, b + s.blocks));
        Load {
            active_prefill_tokens: t.report.active_prefill_tokens + tokens,
            active_blocks: t.report.device_used + blocks,
            capacity_blocks: if t.report.device_total > 0 { t.report.device_total } else { capacity },
            active_requests: (t.sent.len() as u64).max(t.report.running + t.report.waiting),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn reports_reconcile_with_what_was_sent_since() {
        let t0 = Instant::now();
        let w = WorkerId(0);
        let mut l = LoadTracker::new();
        assert_eq!(l.load(w, 100).capacity_blocks, 100);
        l.sent(w, 1, 300, 20, t0);
        assert_eq!(l.load(w, 100).active_prefill_tokens, 300, "counted at once, before any report");
        // A report taken after the send includes it: not counted twice.
        let r =
            Report { running: 1, active_prefill_tokens: 300, device_used: 20, device_total: 128, ..Report::default() };
        l.report(w, r, t0 + Duration::from_millis(10));
        let now = l.load(w, 100);
        assert_eq!((now.active_prefill_tokens, now.active_blocks, now.capacity_blocks), (300, 20, 128));
        // Sent after the report: added on top until the next report.
        l.sent(w, 2, 100, 7, t0 + Duration::from_millis(20));
        assert_eq!(l.load(w, 100).active_prefill_tokens, 400);
        assert_eq!(l.load(w, 100).active_requests, 2);
        // Its first token came back: no more prefill work, the blocks stay.
        l.first_token(w, 2);
        assert_eq!((l.load(w, 100).active_prefill_tokens, l.load(w, 100).active_blocks), (300, 27));
        l.done(w, 2);
        l.done(w, 1);
        l.report(w, Report { device_total: 128, ..Report::default() }, t0 + Duration::from_millis(30));
        assert_eq!(l.load(w, 100), Load { capacity_blocks: 128, ..Load::default() });
    }
}
