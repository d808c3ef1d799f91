//! Worker failures, and the router's failover as `router::serve` does it: a lost prefill goes to the decision's
//! next prefill candidate (the chosen one first, then by cost, at most `max_prefill_attempts` of them), and after
//! the last one the decode worker prefills the prompt itself; a lost decode (or the pull its attempt started with)
//! resumes on the least loaded decode worker not yet tried, which computes the prompt and the tokens already sent
//! and makes the rest, at most `max_decode_attempts` attempts in all. Every retry after the first attempt and
//! the local prefill after a lost one come out of the router's retry budget (the real `RetryBudget`, on the
//! virtual clock). A crashed worker computes and reports nothing more: the step it was running produces nothing,
//! its messages on their way to the router are lost, and the routers leave it out of every later decision. A hung
//! one is found out only by the router's watchdog and HTTP/2 keepalive; one that answers with errors only by the
//! circuit breakers (the real `Breaker`, one per worker on each router replica), which every failed call feeds.

use std::time::{Duration, Instant};

use engine::generate::{Engine, Stepper};
use kv_cache::HashedTokens;
use kv_cache::events::Snapshot;
use router::cluster::defaults::SILENCE;
use router::resilience::{BreakerSettings, RetryBudgetSettings};
use router::run::defaults::{MAX_DECODE_ATTEMPTS, MAX_PREFILL_ATTEMPTS};
use router::scheduler::Decision;
use router::scheduler::view::{WorkerId, WorkerRole};
use worker::DEFAULT_PULL_TIMEOUT;
use worker::grpc_tls::{KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT};

use super::{Ev, Job, Sim};
use crate::worker::SimWorker;

/// What a request's failover needs, kept from its decision on.
#[derive(Debug, Default)]
pub(super) struct Retries {
    /// The decision's prefill candidates in the order the router tries them, each with the blocks it held.
    prefill_order: Vec<(usize, u64)>,
    /// Prefill candidates taken so far.
    prefill_next: usize,
    /// The blocks the decided decode worker held (its own prefill, after the last prefill attempt failed).
    decode_held: u64,
    /// Decode workers whose attempt failed.
    pub(super) tried: Vec<usize>,
    /// Tokens sent to the client so far (a resumption computes them after the prompt).
    pub(super) generated: Vec<u32>,
}

impl Retries {
    /// For a decision whose retry order is `order` (none in a replay); `disaggregated` when its first attempt is a
    /// prefill.
    pub(super) fn new(order: Option<(Vec<(usize, u64)>, u64)>, disaggregated: bool) -> Retries {
        let (prefill_order, decode_held) = order.unwrap_or_default();
        Retries { prefill_order, prefill_next: usize::from(disaggregated), decode_held, ..Retries::default() }
    }

    /// The next prefill candidate to try, among the first `max_prefill_attempts` (the router takes no more, failed
    /// or not), with the blocks it held.
    fn next_prefill(&mut self) -> Option<(usize, u64)> {
        let next = *self.prefill_order.get(self.prefill_next).filter(|_| self.prefill_next < MAX_PREFILL_ATTEMPTS)?;
        self.prefill_next += 1;
        Some(next)
    }
}

/// The prefill candidates of `d` in the order `router::serve::prefill` tries them (the chosen one first, then by
/// cost), each with the blocks it held, and the blocks the decided decode worker held.
pub(super) fn retry_order(d: &Decision) -> (Vec<(usize, u64)>, u64) {
    let held = |c: &router::scheduler::Scored| (c.device_blocks + c.host_blocks + c.disk_blocks) as u64;
    let prefill = match &d.prefill {
        Some(choice) if d.disaggregate => {
            choice.by_preference().into_iter().map(|c| (c.id.0 as usize, held(c))).collect()
        }
        _ => Vec::new(),
    };
    (prefill, d.decode.chosen().map_or(0, held))
}

/// The router's default retry budget.
pub(super) fn budget_settings() -> RetryBudgetSettings {
    RetryBudgetSettings::default()
}

impl Sim<'_> {
    /// Virtual time `now` as an instant for the retry budget, which only ever compares two of them.
    pub(super) fn instant(&self, now: f64) -> Instant {
        self.origin + Duration::from_secs_f64(now.max(0.0))
    }

    /// Worker `w` fails: every attempt running there (or pulling from it) fails over.
    pub(super) fn fail_worker(&mut self, now: f64, w: usize) {
        if std::mem::replace(&mut self.workers[w].down, true) {
            return;
        }
        *self.out.decisions.entry("worker_failed".into()).or_default() += 1;
        // What reached it during the step it died in, or while it hung, dies with it; a dead process does not go
        // on.
        let worker = &mut self.workers[w];
        worker.sent.clear();
        worker.frozen.clear();
        worker.hung = false;
        if std::mem::take(&mut worker.held) {
            // The step it was held in (hung, or stuck) is over with it, so that a return need not wait for it.
            worker.pending.clear();
            worker.stepping = false;
        }
        self.forget(now, w);
        let hit = self.on_or_pulling_from(w);
        for i in hit {
            let on = self.live[i].on.unwrap_or(w);
            self.attempt_failed(now, i, on);
        }
    }

    /// The requests whose attempt runs on worker `w` or pulls from it.
    fn on_or_pulling_from(&self, w: usize) -> Vec<usize> {
        (0..self.live.len())
            .filter(|&i| {
                let l = &self.live[i];
                l.on == Some(w) || (l.pulling && l.prefill == Some(w))
            })
            .collect()
    }

    /// The routers drop what worker `w`'s streams told them, and route nothing more there; each counts the loss of
    /// its streams against the worker's breaker, as the real one does.
    fn forget(&mut self, now: f64, w: usize) {
        self.clear_views(w);
        for r in 0..self.routers.len() {
            self.call_failed(now, r, w);
        }
    }

    /// Every router replica forgets worker `w`'s load and blocks.
    fn clear_views(&mut self, w: usize) {
        let id = WorkerId(w as u32);
        for replica in &mut self.routers {
            replica.load.forget(id);
            replica.index.replace(id, &Snapshot { as_of: None, tiers: Default::default() });
        }
    }

    /// Worker `w` starts answering every call with an error (its device broke): what it was running fails over and
    /// leaves its engine, and so do pulls from it; its streams go on, so the routers see it up, idle, and holding
    /// its cache, until their breakers eject it.
    pub(super) fn worker_errs(&mut self, now: f64, w: usize) {
        if self.workers[w].down || std::mem::replace(&mut self.workers[w].erring, true) {
            return;
        }
        *self.out.decisions.entry("worker_erring".into()).or_default() += 1;
        let hit = self.on_or_pulling_from(w);
        for i in hit {
            let on = self.live[i].on.unwrap_or(w);
            if on == w {
                self.drop_from(now, w, i);
            }
            self.attempt_failed(now, i, on);
        }
    }

    /// A call to worker `w` for request `i` succeeded: the worker's breaker on `i`'s router closes.
    pub(super) fn call_succeeded(&mut self, i: usize, w: usize) {
        let r = self.live[i].router;
        self.routers[r].breakers[w].success();
    }

    /// A call from router replica `r` to worker `w` failed in a way that counts against the worker: after
    /// `BreakerSettings`' consecutive failures, the replica ejects it for a while.
    fn call_failed(&mut self, now: f64, r: usize, w: usize) {
        let at = self.instant(now);
        if self.routers[r].breakers[w].failure(at, &BreakerSettings::default()).is_some() {
            *self.out.decisions.entry("worker_ejected".into()).or_default() += 1;
        }
    }

    /// Worker `w` hangs: from now on it computes, sends and answers nothing, but its connections stay open. The
    /// routers keep routing to it until their watchdog finds its streams silent ([`SILENCE`] after the last report,
    /// which came at most one report period ago: `Ev::Silent`); what they sent it waits until HTTP/2 keepalive
    /// closes the connection (a ping [`KEEPALIVE_INTERVAL`] after the last frame read, unanswered for
    /// [`KEEPALIVE_TIMEOUT`]: `Ev::Cut`), and fails over then. A decode worker pulling from it gives up
    /// [`DEFAULT_PULL_TIMEOUT`] after the pull began (`Ev::PullTimeout`).
    pub(super) fn hang_worker(&mut self, now: f64, w: usize) {
        if self.workers[w].down || std::mem::replace(&mut self.workers[w].hung, true) {
            return;
        }
        *self.out.decisions.entry("worker_hung".into()).or_default() += 1;
        self.workers[w].hangs += 1;
        let epoch = self.workers[w].hangs;
        self.queue.at(now + SILENCE.as_secs_f64(), Ev::Silent { w, epoch });
        self.queue.at(now + (KEEPALIVE_INTERVAL + KEEPALIVE_TIMEOUT).as_secs_f64(), Ev::Cut { w, epoch });
        let pull_timeout = DEFAULT_PULL_TIMEOUT.as_secs_f64();
        for i in 0..self.live.len() {
            let l = &self.live[i];
            if l.pulling && l.prefill == Some(w) {
                self.queue.at((l.pull_since + pull_timeout).max(now), Ev::PullTimeout(i));
            }
        }
    }

    /// Whether worker `w` still hangs in its hang number `epoch`.
    fn still_hung(&self, w: usize, epoch: u64) -> bool {
        self.workers[w].hung && self.workers[w].hangs == epoch
    }

    /// The routers' watchdog drops hung worker `w` (still in hang `epoch`): out of every later decision, its blocks
    /// out of the index. The calls they have open on it stay open until the connection closes.
    pub(super) fn worker_silent(&mut self, now: f64, w: usize, epoch: u64) {
        if !self.still_hung(w, epoch) || std::mem::replace(&mut self.workers[w].down, true) {
            return;
        }
        self.forget(now, w);
    }

    /// Hung worker `w`'s connections close (it still hangs, in hang `epoch`): every attempt still waiting on it
    /// fails over.
    pub(super) fn connection_cut(&mut self, now: f64, w: usize, epoch: u64) {
        if !self.still_hung(w, epoch) {
            return;
        }
        let hit: Vec<usize> = (0..self.live.len()).filter(|&i| self.live[i].on == Some(w)).collect();
        for i in hit {
            self.attempt_failed(now, i, w);
        }
    }

    /// Hung worker `w` goes on (its process continued): the step it hung in ends now (what was left of it is not
    /// added), the calls whose connection closed meanwhile leave its engine, those still open reach it, and pulls
    /// from it that stalled end. If the routers' watchdog had dropped it, they join it again first.
    pub(super) fn worker_resumed(&mut self, now: f64, w: usize) {
        if !std::mem::take(&mut self.workers[w].hung) {
            return;
        }
        *self.out.decisions.entry("worker_resumed".into()).or_default() += 1;
        let live = &self.live;
        let worker = &mut self.workers[w];
        let gone: Vec<u64> = worker.engine.ids().filter(|&id| live[id as usize].on != Some(w)).collect();
        worker.cancels.extend(gone);
        worker.sent.retain(|job| live[job.i].on == Some(w));
        let frozen = std::mem::take(&mut worker.frozen);
        if worker.down {
            self.rejoin(now, w);
        }
        for job in frozen {
            if self.live[job.i].on == Some(w) && self.lease_for(now, w, &job) {
                self.workers[w].sent.push(job);
            }
        }
        let stalled: Vec<usize> =
            (0..self.live.len()).filter(|&i| self.live[i].pull_stalled && self.live[i].prefill == Some(w)).collect();
        if std::mem::take(&mut self.workers[w].held) {
            self.step_done(now, w);
        } else if !self.workers[w].stepping {
            self.settle(now, w);
        }
        // (A step still under way takes all that at its end.)
        for i in stalled {
            self.pulled(now, i);
        }
    }

    /// The routers join worker `w` again after their watchdog dropped it, as `router::cluster` does a worker that
    /// answers again (the same process: no restart): each replica applies a snapshot of its blocks (which covers
    /// its events so far), hears its load afresh, and ramps its share up over slow start from now.
    fn rejoin(&mut self, now: f64, w: usize) {
        let worker = &mut self.workers[w];
        worker.down = false;
        worker.joined = now;
        worker.rejoined();
        let _covered = worker.new_events();
        let snapshot = worker.engine.engine().kv_snapshot();
        let id = worker.id;
        for replica in &mut self.routers {
            replica.index.replace(id, &snapshot);
        }
        *self.out.decisions.entry("worker_rejoined".into()).or_default() += 1;
    }

    /// Request `i`'s pull from a prefill worker that hung runs out of time: its decode attempt fails.
    pub(super) fn pull_timed_out(&mut self, now: f64, i: usize) {
        let l = &self.live[i];
        if l.pulling && l.prefill.is_some_and(|p| self.workers[p].hung) {
            let d = l.decode;
            self.attempt_failed(now, i, d);
        }
    }

    /// Failed worker `w` comes back as a new process: a fresh engine (an empty cache; a disk tier in a directory of
    /// its own), which the routers learn of from scratch and ramp up over `slow_start_secs`. When it failed during
    /// a step, that step's end comes first.
    pub(super) fn worker_back(&mut self, now: f64, w: usize) {
        if !self.workers[w].down {
            return;
        }
        if self.workers[w].stepping {
            self.workers[w].back = true;
            return;
        }
        let old = &self.workers[w];
        let mut config = old.config.clone();
        config.disk_dir = config.disk_dir.map(|d| d.with_extension(format!("back-{now}")));
        let text = std::sync::Arc::clone(&self.text);
        let engine = match Engine::open_mock(text, std::sync::Arc::clone(&self.words), config.clone()) {
            Ok(engine) => engine,
            Err(_) => {
                // It stays down.
                *self.out.decisions.entry("worker_not_back".into()).or_default() += 1;
                return;
            }
        };
        let c = old.engine.engine().counters();
        self.retired.0 += c.prefill_tokens;
        for t in 0..3 {
            self.retired.1[t] += c.cached_tokens[t];
        }
        let (id, name, role) = (old.id, old.name.clone(), old.role);
        let mut fresh = SimWorker::new(id, name, role, Stepper::new(engine), self.routers.len(), config);
        fresh.joined = now;
        self.workers[w] = fresh;
        self.clear_views(w);
        *self.out.decisions.entry("worker_back".into()).or_default() += 1;
        self.publish(now, w);
    }

    /// Request `i`'s attempt on worker `w` failed (the worker is gone, or the pull its decode started with).
    pub(super) fn attempt_failed(&mut self, now: f64, i: usize, w: usize) {
        self.routers[self.live[i].router].load.done(WorkerId(w as u32), i as u64);
        self.call_failed(now, self.live[i].router, w);
        if self.live[i].prefill == Some(w) && self.live[i].on == Some(w) {
            self.release_lease(i);
            self.prefill_failed(now, i);
        } else {
            self.decode_failed(now, i, w);
        }
    }

    pub(super) fn prefill_failed(&mut self, now: f64, i: usize) {
        let router = self.live[i].router;
        let at = self.instant(now);
        while let Some((p, held)) = self.live[i].retries.as_mut().and_then(|r| r.next_prefill()) {
            if self.workers[p].down {
                continue;
            }
            if !self.routers[router].budget.try_retry(at, &budget_settings()) {
                break;
            }
            *self.out.decisions.entry("prefill_retried".into()).or_default() += 1;
            let bt = self.block_size.tokens() as u64;
            let uncached = (self.live[i].isl as u64).saturating_sub(held * bt);
            (self.live[i].prefill, self.live[i].on) = (Some(p), Some(p));
            self.send(p, i, uncached);
            self.call_started(now, i);
            let prompt = Some(self.prompt_of(i));
            return self.submit(now, p, Job { i, prompt, max_tokens: 1, export: true, pulled: false });
        }
        // Every prefill attempt failed: the decode worker prefills the prompt itself, within the budget.
        if !self.routers[router].budget.try_retry(at, &budget_settings()) {
            let why = "the prefill failed and the retry budget is spent".to_string();
            return self.finish(now, i, 503, Some(why), None);
        }
        *self.out.decisions.entry("local_prefill_after_failure".into()).or_default() += 1;
        let mut d = self.live[i].decode;
        let mut held = self.live[i].retries.as_ref().map_or(0, |r| r.decode_held);
        if self.workers[d].down {
            d = self.next_decoder(now, i, &[]);
            held = 0;
        }
        let bt = self.block_size.tokens() as u64;
        let uncached = (self.live[i].isl as u64).saturating_sub(held * bt);
        let live = &mut self.live[i];
        (live.prefill, live.decode, live.on, live.attempt_tokens) = (None, d, Some(d), 0);
        let max_tokens = live.max_tokens;
        self.send(d, i, uncached);
        self.call_started(now, i);
        let prompt = Some(self.prompt_of(i));
        self.submit(now, d, Job { i, prompt, max_tokens, export: false, pulled: false });
    }

    fn decode_failed(&mut self, now: f64, i: usize, w: usize) {
        self.end_pull(now, i);
        let Some(r) = self.live[i].retries.as_mut() else {
            return self.finish(now, i, 502, Some("the decode worker failed".into()), None);
        };
        r.tried.push(w);
        let tried = r.tried.clone();
        let at = self.instant(now);
        let router = self.live[i].router;
        if tried.len() >= MAX_DECODE_ATTEMPTS || !self.routers[router].budget.try_retry(at, &budget_settings()) {
            let why = format!("no decode worker finished the request after {} attempts", tried.len());
            return self.finish(now, i, 502, Some(why), None);
        }
        *self.out.decisions.entry("decode_resumed".into()).or_default() += 1;
        let d = self.next_decoder(now, i, &tried);
        // The prompt and every token sent so far, computed there; the rest of the output made there.
        let generated = self.live[i].retries.as_ref().map_or(&[][..], |r| &r.generated[..]);
        let mut tokens = self.prompt_of(i).tokens().to_vec();
        tokens.extend_from_slice(generated);
        let max_tokens = self.live[i].max_tokens.saturating_sub(generated.len() as u32).max(1);
        let prompt = HashedTokens::new(tokens, self.block_size, None);
        let uncached = prompt.tokens().len() as u64;
        // Its prefill worker, if it had one, stays its own: the cached tokens reported are still that one's.
        let live = &mut self.live[i];
        (live.decode, live.on, live.attempt_tokens) = (d, Some(d), 0);
        self.send(d, i, uncached);
        self.call_started(now, i);
        self.submit(now, d, Job { i, prompt: Some(prompt), max_tokens, export: false, pulled: false });
    }

    /// The decode worker a failed-over request goes to, as `router::serve::next_decoder` picks it: the one with the
    /// fewest requests in flight from request `i`'s router among those up, not ejected by its breaker, and not in
    /// `tried` (the lowest number among equals); a worker of `tried` when there is no other (its attempt then fails
    /// at once).
    pub(super) fn next_decoder(&self, now: f64, i: usize, tried: &[usize]) -> usize {
        let r = self.live[i].router;
        let fallback = tried.last().copied().unwrap_or(self.live[i].decode);
        (0..self.workers.len())
            .filter(|&w| self.workers[w].role == WorkerRole::Decode && self.routable(now, r, w) && !tried.contains(&w))
            .min_by_key(|&w| (self.routers[r].load.own_requests(WorkerId(w as u32)), w))
            .unwrap_or(fallback)
    }

    /// Whether router replica `r` may send requests to worker `w`: it has not dropped it, its breaker there has
    /// not ejected it, and it has not found it stalled (`router::cluster::Cluster::is_routable`).
    pub(super) fn routable(&self, now: f64, r: usize, w: usize) -> bool {
        let replica = &self.routers[r];
        !self.workers[w].down && replica.breakers[w].admits(self.instant(now)) && !replica.stalled[w]
    }

    /// Worker `w`'s engine gets stuck (a hung device): no step ends until it is unstuck, while its process answers
    /// and reports. Its reports show no progress, so each router replica finds it stalled once it has held work
    /// for `stall_after` since its last progress (`router::resilience::StallWatch`): the start of the step that
    /// hangs, whether under way now or started later.
    pub(super) fn worker_stuck(&mut self, now: f64, w: usize) {
        let worker = &mut self.workers[w];
        if worker.down || std::mem::replace(&mut worker.stuck, true) {
            return;
        }
        *self.out.decisions.entry("worker_stuck".into()).or_default() += 1;
        if worker.stepping {
            let since = worker.step_started;
            self.check_stall_after(now, since, w);
        }
    }

    /// Schedules each replica's look at stuck worker `w`, whose last progress was at `since`: `stall_after` after
    /// the report of it reached the replica (reports come every 100 ms; the look is at most that early).
    pub(super) fn check_stall_after(&mut self, now: f64, since: f64, w: usize) {
        let after = self.settings.stall_after;
        if after <= 0.0 {
            return;
        }
        let epoch = self.workers[w].stuck_epoch;
        let at = (since + self.settings.report_delay + after).max(now);
        for r in 0..self.routers.len() {
            self.queue.at(at, Ev::StallCheck { w, r, epoch });
        }
    }

    /// Replica `r` finds worker `w` stalled, if it still is and `r` still waits on it: every call `r` has open on it
    /// gives up and fails over (the worker drops those requests when its step ends), and `r` sends it nothing
    /// more until its reports show progress.
    pub(super) fn stall_check(&mut self, now: f64, w: usize, r: usize, epoch: u64) {
        let worker = &self.workers[w];
        if !worker.stuck || worker.stuck_epoch != epoch || !worker.stepping || self.routers[r].stalled[w] {
            return;
        }
        let open: Vec<usize> =
            (0..self.live.len()).filter(|&i| self.live[i].router == r && self.live[i].on == Some(w)).collect();
        // Its frozen report still counts the sequences of the step that hangs: it holds work either way.
        self.routers[r].stalled[w] = true;
        *self.out.decisions.entry("stall_detected".into()).or_default() += 1;
        for i in open {
            self.drop_from(now, w, i);
            self.attempt_failed(now, i, w);
        }
    }

    /// Worker `w` computes again: the step that hung ends now, and each replica sees the progress in the next
    /// report.
    pub(super) fn worker_unstuck(&mut self, now: f64, w: usize) {
        let worker = &mut self.workers[w];
        if !std::mem::take(&mut worker.stuck) {
            return;
        }
        worker.stuck_epoch += 1;
        if std::mem::take(&mut worker.held) {
            self.step_done(now, w);
        }
        for r in 0..self.routers.len() {
            self.queue.at(now + self.settings.report_delay, Ev::StallCleared { w, r });
        }
    }

    /// Request `i`'s prompt: the one it holds, or (once that moved to an engine) the same tokens made again.
    fn prompt_of(&self, i: usize) -> HashedTokens {
        if let Some(p) = &self.live[i].prompt {
            return p.clone();
        }
        HashedTokens::new(self.prompt(i, 0).tokens, self.block_size, None)
    }
}
