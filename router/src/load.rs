//! What the router believes each worker's load is: the worker's last report plus the work the router sent it that
//! the report does not cover (own-sent accounting). A report names the requests whose work its figures include;
//! every other request the router sent and has not seen end is added on top, by what the router knows of it
//! (its uncached prefill tokens, its blocks). Reconciliation is by what a report covers, never by the clock, so
//! no interleaving of sends, reports and completions makes the router see less work than the worker has (a
//! property test below). Also kept per worker: the blocks of its in-flight requests (so a new request's blocks
//! already active there are not counted twice) and its measured prefill and transfer speeds. Pure: no clock, no
//! I/O.

use kv_cache::fastmap::{FastMap, FastSet};

use kv_cache::SeqHash;

use crate::external::metrics::EngineLoad;
use crate::scheduler::view::{Load, Speed, WorkerId};

/// A worker's own figures (a `WatchLoad` report).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    pub running: u64,
    pub waiting: u64,
    /// Uncached prompt tokens still to compute.
    pub active_prefill_tokens: u64,
    pub device_used: u64,
    pub device_total: u64,
    /// Device blocks the covered requests' prompts will hold that they do not hold yet (waiting, or part way
    /// through a prefill in chunks): load, as the router counted them before the report covered the requests.
    pub blocks_to_come: u64,
    /// The request ids whose work these figures include (with the keyed fast hasher: every view of a worker's
    /// load asks it about each request the router sent there).
    pub covered: FastSet<String>,
    /// Totals since the worker started (speeds are learned from their growth).
    pub computed_tokens_total: u64,
    pub compute_nanos_total: u64,
    pub transfer_bytes_total: u64,
    pub transfer_nanos_total: u64,
    /// A mock worker's steps by overrun bucket (see the proto's `step_overrun_steps`); empty otherwise.
    pub step_overrun_steps: Vec<u64>,
}

/// One request the router sent a worker and has not yet seen end there.
#[derive(Clone, Debug)]
struct Sent {
    request_id: String,
    /// Uncached prompt tokens the worker has to compute; zero once its first token came back.
    prefill_tokens: u64,
    blocks: u64,
    hashes: Vec<SeqHash>,
}

/// How much a new measurement moves a learned speed.
const SPEED_WEIGHT: f64 = 0.3;
/// Growth of the totals too small to measure a speed from (noise, or an idle worker).
const MIN_MEASURED_NANOS: u64 = 10_000_000;

#[derive(Debug, Default)]
struct Tracked {
    report: Report,
    sent: FastMap<u64, Sent>,
    speed: Speed,
    /// An external engine's own figures, from its metrics: they include requests that did not come through this
    /// router, but not those it sent a moment ago, so the load is the larger of the two counts, never their sum.
    engine: Option<EngineLoad>,
}

/// An exponentially weighted moving average, started by its first value.
fn ewma(old: Option<f64>, new: f64) -> Option<f64> {
    Some(old.map_or(new, |o| o + SPEED_WEIGHT * (new - o)))
}

/// The rate from the growth of a (units, nanoseconds) pair of totals, when it is large enough to mean something.
fn rate(units: (u64, u64), nanos: (u64, u64)) -> Option<f64> {
    let (du, dn) = (units.1.checked_sub(units.0)?, nanos.1.checked_sub(nanos.0)?);
    (dn >= MIN_MEASURED_NANOS && du > 0).then(|| du as f64 / (dn as f64 / 1e9))
}

impl Tracked {
    fn learn(&mut self, next: &Report) {
        let prev = &self.report;
        let compute = (prev.computed_tokens_total, next.computed_tokens_total);
        if let Some(r) = rate(compute, (prev.compute_nanos_total, next.compute_nanos_total)) {
            self.speed.prefill_tokens_per_sec = ewma(self.speed.prefill_tokens_per_sec, r);
        }
        let bytes = (prev.transfer_bytes_total, next.transfer_bytes_total);
        if let Some(r) = rate(bytes, (prev.transfer_nanos_total, next.transfer_nanos_total)) {
            self.speed.transfer_bytes_per_sec = ewma(self.speed.transfer_bytes_per_sec, r);
        }
    }

    fn uncovered(&self) -> impl Iterator<Item = &Sent> {
        self.sent.values().filter(|s| !self.report.covered.contains(&s.request_id))
    }
}

/// Load per worker.
#[derive(Debug, Default)]
pub struct LoadTracker {
    /// Looked up for every worker of every decision: the keyed fast hasher, not SipHash.
    workers: FastMap<WorkerId, Tracked>,
}

impl LoadTracker {
    pub fn new() -> LoadTracker {
        LoadTracker::default()
    }

    /// A report from `worker`; it replaces the previous one.
    pub fn report(&mut self, worker: WorkerId, report: Report) {
        let t = self.workers.entry(worker).or_default();
        t.learn(&report);
        t.report = report;
    }

    /// What external engine `worker`'s metrics say now (replaces what they said before).
    pub fn engine_load(&mut self, worker: WorkerId, load: EngineLoad) {
        self.workers.entry(worker).or_default().engine = Some(load);
    }

    /// Mock workers' steps by overrun bucket, summed over the workers tracked now.
    pub fn step_overrun_steps(&self) -> Vec<u64> {
        let mut sum: Vec<u64> = Vec::new();
        for t in self.workers.values() {
            let b = &t.report.step_overrun_steps;
            if sum.len() < b.len() {
                sum.resize(b.len(), 0);
            }
            for (s, n) in sum.iter_mut().zip(b) {
                *s += n;
            }
        }
        sum
    }

    /// The router sent request number `seq` (id `request_id`) to `worker`: `prefill_tokens` uncached prompt tokens
    /// to compute there, `blocks` of KV it will hold, with these block hashes.
    pub fn sent(
        &mut self,
        worker: WorkerId,
        seq: u64,
        request_id: &str,
        prefill_tokens: u64,
        blocks: u64,
        hashes: &[SeqHash],
    ) {
        let t = self.workers.entry(worker).or_default();
        let sent = Sent { request_id: request_id.to_string(), prefill_tokens, blocks, hashes: hashes.to_vec() };
        t.sent.insert(seq, sent);
    }

    /// The worker produced request `seq`'s first token: its prompt is computed.
    pub fn first_token(&mut self, worker: WorkerId, seq: u64) {
        if let Some(s) = self.workers.get_mut(&worker).and_then(|t| t.sent.get_mut(&seq)) {
            s.prefill_tokens = 0;
        }
    }

    /// Request `seq` is finished (or failed, or was cancelled) on `worker`.
    pub fn done(&mut self, worker: WorkerId, seq: u64) {
        if let Some(t) = self.workers.get_mut(&worker) {
            t.sent.remove(&seq);
        }
    }

    /// Requests sent to `worker` and not yet done.
    pub fn own_requests(&self, worker: WorkerId) -> u64 {
        self.workers.get(&worker).map_or(0, |t| t.sent.len() as u64)
    }

    pub fn forget(&mut self, worker: WorkerId) {
        self.workers.remove(&worker);
    }

    /// How many of `hashes` (a request's chained block hashes) are blocks of requests in flight on `worker`.
    /// They are always its leading ones, and the longest prefix it shares with one of those requests: a chained
    /// hash names its whole prefix (so it can only stand at one position of any prompt) and each request in flight
    /// counts every block of its prompt. So nothing is kept per block: a request sent or done is one entry, and a
    /// decision compares the first block not yet matched with each request in flight, and binary-searches the
    /// few that match it.
    pub fn active_overlap(&self, worker: WorkerId, hashes: &[SeqHash]) -> usize {
        let Some(t) = self.workers.get(&worker) else { return 0 };
        let mut best = 0;
        for s in t.sent.values() {
            let n = s.hashes.len().min(hashes.len());
            if n <= best || s.hashes[best] != hashes[best] {
                continue;
            }
            // The first `lo` blocks are shared; at most `hi` are.
            let (mut lo, mut hi) = (best + 1, n);
            while lo < hi {
                let mid = (lo + hi).div_ceil(2);
                if s.hashes[mid - 1] == hashes[mid - 1] {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            best = lo;
        }
        best
    }

    /// The worker's measured speeds, once it reported enough work to measure.
    pub fn speed(&self, worker: WorkerId) -> Speed {
        self.workers.get(&worker).map_or_else(Speed::default, |t| t.speed)
    }

    /// The reconciled load of `worker`; `capacity` when the worker has not reported its own.
    pub fn load(&self, worker: WorkerId, capacity: u64) -> Load {
        let Some(t) = self.workers.get(&worker) else {
            return Load { capacity_blocks: capacity, ..Load::default() };
        };
        let (mut tokens, mut blocks, mut requests) = (0, 0, 0);
        for s in t.uncovered() {
            tokens += s.prefill_tokens;
            blocks += s.blocks;
            requests += 1;
        }
        let r = &t.report;
        let mut load = Load {
            active_prefill_tokens: r.active_prefill_tokens + tokens,
            active_blocks: r.device_used + r.blocks_to_come + blocks,
            capacity_blocks: if r.device_total > 0 { r.device_total } else { capacity },
            active_requests: r.running + r.waiting + requests,
        };
        if let Some(e) = &t.engine {
            load.active_requests = load.active_requests.max(e.running + e.waiting);
            if let Some(usage) = e.kv_usage {
                load.active_blocks = load.active_blocks.max((usage * load.capacity_blocks as f64).round() as u64);
            }
        }
        load
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use proptest::prelude::*;

    use super::*;

    fn report(running: u64, prefill: u64, used: u64, covered: &[&str]) -> Report {
        Report {
            running,
            active_prefill_tokens: prefill,
            device_used: used,
            device_total: 128,
            covered: covered.iter().map(|s| s.to_string()).collect(),
            ..Report::default()
        }
    }

    #[test]
    fn reports_cover_what_they_name_and_the_rest_is_added() {
        let w = WorkerId(0);
        let mut l = LoadTracker::new();
        assert_eq!(l.load(w, 100).capacity_blocks, 100);
        l.sent(w, 1, "a", 300, 20, &[]);
        assert_eq!(l.load(w, 100).active_prefill_tokens, 300, "counted at once, before any report");
        // A report that names it includes it: not counted twice.
        l.report(w, report(1, 300, 20, &["a"]));
        let now = l.load(w, 100);
        assert_eq!((now.active_prefill_tokens, now.active_blocks, now.capacity_blocks), (300, 20, 128));
        // A request sent after that report (or sent before it but not yet arrived) is added on top, whatever the
        // clock says.
        l.sent(w, 2, "b", 100, 7, &[]);
        l.report(w, report(1, 250, 20, &["a"]));
        assert_eq!((l.load(w, 100).active_prefill_tokens, l.load(w, 100).active_requests), (350, 2));
        // Its first token came back: no more prefill work of its own, the blocks stay.
        l.first_token(w, 2);
        assert_eq!((l.load(w, 100).active_prefill_tokens, l.load(w, 100).active_blocks), (250, 27));
        l.done(w, 2);
        l.done(w, 1);
        l.report(w, report(0, 0, 0, &[]));
        assert_eq!(l.load(w, 100), Load { capacity_blocks: 128, ..Load::default() });
    }

    #[test]
    fn a_report_covering_a_request_still_waiting_keeps_its_blocks() {
        let w = WorkerId(0);
        let mut l = LoadTracker::new();
        l.sent(w, 1, "a", 300, 20, &[]);
        assert_eq!(l.load(w, 100).active_blocks, 20);
        // The worker took it but has not admitted it: no block in use yet, all twenty to come.
        l.report(w, Report { waiting: 1, blocks_to_come: 20, ..report(0, 300, 0, &["a"]) });
        assert_eq!(l.load(w, 100).active_blocks, 20);
        // Half way through its prefill in chunks: ten in use, ten to come.
        l.report(w, Report { blocks_to_come: 10, ..report(1, 150, 10, &["a"]) });
        assert_eq!(l.load(w, 100).active_blocks, 20);
    }

    #[test]
    fn an_external_engines_metrics_and_the_routers_count_give_the_larger() {
        let w = WorkerId(5);
        let mut l = LoadTracker::new();
        l.sent(w, 1, "a", 100, 10, &[]);
        l.sent(w, 2, "b", 100, 10, &[]);
        // The engine has not seen the router's two yet, but runs three from elsewhere and half its KV is in use.
        l.engine_load(w, EngineLoad { running: 2, waiting: 1, kv_usage: Some(0.5) });
        let now = l.load(w, 400);
        assert_eq!((now.active_requests, now.active_blocks, now.active_prefill_tokens), (3, 200, 200));
        // Its metrics include the router's requests now: still the larger count, not the sum.
        l.engine_load(w, EngineLoad { running: 1, waiting: 0, kv_usage: Some(0.01) });
        assert_eq!((l.load(w, 400).active_requests, l.load(w, 400).active_blocks), (2, 20));
    }

    #[test]
    fn blocks_already_active_on_a_worker_are_known() {
        let (w, h) = (WorkerId(3), |n: u64| SeqHash(n));
        let mut l = LoadTracker::new();
        l.sent(w, 1, "a", 0, 3, &[h(1), h(2), h(3)]);
        l.sent(w, 2, "b", 0, 2, &[h(1), h(2)]);
        assert_eq!(l.active_overlap(w, &[h(1), h(2), h(3), h(4)]), 3);
        l.done(w, 1);
        assert_eq!(l.active_overlap(w, &[h(1), h(2), h(3), h(4)]), 2, "h3 is no longer active; h1, h2 still are");
        l.done(w, 2);
        assert_eq!(l.active_overlap(w, &[h(1)]), 0);
        assert_eq!(l.active_overlap(WorkerId(9), &[h(1)]), 0);
    }

    #[test]
    fn speeds_are_learned_from_the_totals() {
        let w = WorkerId(0);
        let mut l = LoadTracker::new();
        assert_eq!(l.speed(w), Speed::default());
        let totals = |tokens, tnanos, bytes, bnanos| Report {
            computed_tokens_total: tokens,
            compute_nanos_total: tnanos,
            transfer_bytes_total: bytes,
            transfer_nanos_total: bnanos,
            ..Report::default()
        };
        l.report(w, totals(0, 0, 0, 0));
        // 200 tokens in 1 s; 350 MB in 1 s.
        l.report(w, totals(200, 1_000_000_000, 350_000_000, 1_000_000_000));
        assert_eq!(l.speed(w).prefill_tokens_per_sec, Some(200.0));
        assert_eq!(l.speed(w).transfer_bytes_per_sec, Some(350e6));
        // 400 tokens in the next second: the average moves by its weight; nothing new moved: no change.
        l.report(w, totals(600, 2_000_000_000, 350_000_000, 1_000_000_000));
        assert_eq!(l.speed(w).prefill_tokens_per_sec, Some(200.0 + SPEED_WEIGHT * 200.0));
        assert_eq!(l.speed(w).transfer_bytes_per_sec, Some(350e6));
    }

    /// One step of the world: the router sends, the worker takes, computes, finishes, reports; the router learns.
    #[derive(Clone, Debug)]
    enum Op {
        /// The router sends a request with this many uncached prompt tokens.
        Send(u64),
        /// The oldest request on its way arrives at the worker.
        Arrive,
        /// The worker computes some prompt tokens of one of its requests.
        Compute(usize, u64),
        /// The worker finishes one of its requests.
        Finish(usize),
        /// The worker takes a report of its state now; it travels to the router.
        Snapshot,
        /// The oldest report in flight reaches the router.
        Deliver,
        /// The router hears that a finished request ended.
        Ended(usize),
        /// The router sees a request's first token (the worker has computed its prompt).
        FirstToken(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1u64..500).prop_map(Op::Send),
            Just(Op::Arrive),
            (0usize..8, 1u64..300).prop_map(|(i, n)| Op::Compute(i, n)),
            (0usize..8).prop_map(Op::Finish),
            Just(Op::Snapshot),
            Just(Op::Deliver),
            (0usize..8).prop_map(Op::Ended),
            (0usize..8).prop_map(Op::FirstToken),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        /// Prompts of chained blocks, some sharing a start, sent and finished in any order: the blocks active on
        /// the worker are always a prompt's leading ones, so the longest shared prefix counts what a scan of every
        /// request in flight counts.
        #[test]
        fn active_overlap_counts_every_active_block_of_the_prompt(
            ops in proptest::collection::vec((0u64..3, 0usize..6, 1u64..4, 0usize..8, any::<bool>()), 1..60),
        ) {
            let w = WorkerId(0);
            let prompt = |start: u64, shared: usize, own: u64, len: usize| {
                // `shared` blocks of system prompt `start`, then blocks of its own.
                let mut parent = None;
                (0..len.max(1))
                    .map(|i| {
                        let local = if i < shared { start * 100 + i as u64 } else { 1000 + own * 100 + i as u64 };
                        let h = kv_cache::chained(parent, kv_cache::LocalHash(local));
                        parent = Some(h);
                        h
                    })
                    .collect::<Vec<SeqHash>>()
            };
            let mut l = LoadTracker::new();
            let mut live: Vec<u64> = Vec::new();
            for (seq, &(start, shared, own, len, finish)) in ops.iter().enumerate() {
                let p = prompt(start, shared, own, len);
                let active = |h: &SeqHash| l.workers.get(&w).is_some_and(|t| t.sent.values().any(|s| s.hashes.contains(h)));
                let scan = p.iter().filter(|h| active(h)).count();
                prop_assert_eq!(l.active_overlap(w, &p), scan);
                if finish && !live.is_empty() {
                    l.done(w, live.remove(seq % live.len()));
                } else {
                    l.sent(w, seq as u64, "r", 0, p.len() as u64, &p);
                    live.push(seq as u64);
                }
            }
        }

        /// Whatever the interleaving of sends, arrivals, work, reports and completions, the router never
        /// believes the worker has fewer requests, fewer prompt tokens to compute or fewer prompt blocks than it
        /// really has. The worker holds the blocks of the tokens computed so far (it computes prompts in chunks)
        /// and reports those its prompts will still take as `blocks_to_come`.
        #[test]
        fn reconciliation_never_under_counts(ops in proptest::collection::vec(op(), 1..120)) {
            let w = WorkerId(0);
            let mut l = LoadTracker::new();
            let mut next = 0u64;
            // On their way: (seq, tokens). At the worker: (seq, tokens left, prompt tokens). Finished, not yet
            // heard of.
            let mut travelling: VecDeque<(u64, u64)> = VecDeque::new();
            let mut at_worker: Vec<(u64, u64, u64)> = Vec::new();
            let blocks = |tokens: u64| tokens.div_ceil(16);
            let held = |r: &(u64, u64, u64)| blocks(r.2 - r.1);
            let mut finished: Vec<u64> = Vec::new();
            let mut reports: VecDeque<Report> = VecDeque::new();
            for op in ops {
                match op {
                    Op::Send(tokens) => {
                        l.sent(w, next, &format!("r{next}"), tokens, blocks(tokens), &[]);
                        travelling.push_back((next, tokens));
                        next += 1;
                    }
                    Op::Arrive => at_worker.extend(travelling.pop_front().map(|(seq, n)| (seq, n, n))),
                    Op::Compute(i, tokens) => {
                        let len = at_worker.len().max(1);
                        if let Some(r) = at_worker.get_mut(i % len) {
                            r.1 = r.1.saturating_sub(tokens);
                        }
                    }
                    Op::Finish(i) if !at_worker.is_empty() => {
                        finished.push(at_worker.remove(i % at_worker.len()).0);
                    }
                    Op::Finish(_) => {}
                    Op::Snapshot => reports.push_back(Report {
                        running: at_worker.len() as u64,
                        active_prefill_tokens: at_worker.iter().map(|r| r.1).sum(),
                        device_used: at_worker.iter().map(held).sum(),
                        blocks_to_come: at_worker.iter().map(|r| blocks(r.2) - held(r)).sum(),
                        covered: at_worker.iter().map(|r| format!("r{}", r.0)).collect(),
                        ..Report::default()
                    }),
                    Op::Deliver => {
                        if let Some(r) = reports.pop_front() {
                            l.report(w, r);
                        }
                    }
                    Op::Ended(i) if !finished.is_empty() => l.done(w, finished.remove(i % finished.len())),
                    Op::Ended(_) => {}
                    Op::FirstToken(i) => {
                        if let Some(r) = at_worker.iter().filter(|r| r.1 == 0).nth(i) {
                            l.first_token(w, r.0);
                        }
                    }
                }
                let seen = l.load(w, 100);
                let tokens: u64 = at_worker.iter().map(|r| r.1).sum();
                prop_assert!(seen.active_prefill_tokens >= tokens, "{} < {tokens}", seen.active_prefill_tokens);
                let prompt_blocks: u64 = at_worker.iter().map(|r| blocks(r.2)).sum();
                prop_assert!(seen.active_blocks >= prompt_blocks, "{} < {prompt_blocks}", seen.active_blocks);
                prop_assert!(seen.active_requests >= at_worker.len() as u64);
            }
        }
    }
}
