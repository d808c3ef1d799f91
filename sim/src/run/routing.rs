//! Routing a request: it arrives past its router replica's admission control, is tokenized, and the real
//! scheduler (or the recorded decision) places it over the replica's view of the workers; the replica then counts
//! it on the workers it sent it to, and its first worker gets it.

use kv_cache::{HashedTokens, SeqHash};
use router::scheduler::view::{RouteRequest, WorkerId, WorkerView};
use router::scheduler::{Candidates, RouteError, route};

use super::timeouts::lanes;
use super::{Ev, Job, Placed, Replica, Sim, failover};
use crate::gate::Arrival;

/// Where a request goes, as indices of the simulated workers.
pub(super) struct Placement {
    /// The prefill worker when disaggregated.
    pub(super) prefill: Option<usize>,
    pub(super) decode: usize,
    pub(super) reason: String,
    pub(super) margin: Option<f64>,
    pub(super) candidates: Option<Candidates>,
    /// The prefill candidates in the order the router tries them, each with the blocks it held, and the decode
    /// worker's held blocks ([`failover::Retries`]); `None` for a recorded decision without its candidates.
    pub(super) retry_order: Option<(Vec<(usize, u64)>, u64)>,
}

impl Sim<'_> {
    pub(super) fn view(&self, r: usize, hashes: &[SeqHash], now: f64) -> Vec<WorkerView> {
        let slow_start = self.settings.scheduler.slow_start_secs;
        let Replica { index, load, .. } = &self.routers[r];
        let overlap = index.overlap(hashes);
        let capacity = self.settings.engine.kv_blocks as u64;
        self.workers
            .iter()
            .enumerate()
            .filter(|&(k, _)| self.routable(now, r, k))
            .map(|(_, w)| w)
            .map(|w| WorkerView {
                id: w.id,
                name: w.name.clone(),
                role: w.role,
                overlap: overlap.get(&w.id).copied().unwrap_or_default(),
                active_overlap: load.active_overlap(w.id, hashes),
                load: load.load(w.id, capacity),
                // As the router ramps a worker that joined: one that came back after a failure (the others have
                // been up since before the run).
                ramp: if slow_start > 0.0 { ((now - w.joined) / slow_start).clamp(0.05, 1.0) } else { 1.0 },
                max_num_batched_tokens: self.settings.engine.max_batched_tokens as u64,
                block_bytes: self.settings.transfer_block_bytes,
                speed: load.speed(w.id),
                predicted: false,
            })
            .collect()
    }

    /// Request `i` reaches its router replica: past the replica's admission control (at once, after a wait for a
    /// slot, or refused), then routed once the router has tokenized it.
    pub(super) fn arrive(&mut self, now: f64, i: usize) {
        let r = &self.workload[i];
        // Room for the output: the engine's sequence takes this vector over.
        let prompt = self.prompt(i, r.output_length.clamp(1, 2048));
        let hashed = HashedTokens::new(prompt.tokens, self.block_size, None);
        let router = i % self.routers.len();
        let live = &mut self.live[i];
        live.router = router;
        live.max_tokens = r.output_length.max(1) as u32;
        live.arrival = now;
        live.clipped = prompt.clipped;
        live.isl = hashed.tokens().len();
        self.out.arrivals.push(crate::oracle::Prompt { tokens: live.isl, blocks: hashed.hashes().seq.clone() });
        live.prompt = Some(hashed);
        let priority = r.priority;
        match self.routers[router].gate.arrive(i, priority) {
            Arrival::Admitted => {
                self.live[i].slot = true;
                self.tokenize(now, i);
            }
            arrival @ (Arrival::Queued | Arrival::QueuedInPlaceOf(_)) => {
                self.live[i].waiting = true;
                let timeout = self.routers[router].gate.timeout();
                self.queue.at_in_order(lanes::REQUEST, now + timeout, Ev::WaitEnds(i));
                if let Arrival::QueuedInPlaceOf(j) = arrival {
                    // Its wait's end finds it gone from the queue and does nothing.
                    self.live[j].waiting = false;
                    *self.out.decisions.entry("overloaded".into()).or_default() += 1;
                    self.finish(now, j, 429, Some("a request of a higher priority took its place".into()), None);
                }
            }
            Arrival::Refused => {
                *self.out.decisions.entry("overloaded".into()).or_default() += 1;
                self.finish(now, i, 429, Some("the router's queue is full".into()), None);
            }
        }
    }

    /// Request `i`'s prompt, cut to leave room for its output within `max_isl`, in a vector with room for `room`
    /// more tokens.
    pub(super) fn prompt(&self, i: usize, room: usize) -> loadgen::prompt::Prompt {
        let r = &self.workload[i];
        let max_isl = self.settings.max_isl.saturating_sub(r.output_length.max(1)).max(1);
        self.prompts.prompt_with_room(r, i, Some(max_isl), room)
    }

    /// Request `i`, holding a router slot, is routed once the router has tokenized it (at once when the tokenizer
    /// is not modelled).
    pub(super) fn tokenize(&mut self, now: f64, i: usize) {
        let router = self.live[i].router;
        let rate = self.settings.router_tokens_per_s;
        if rate > 0.0 {
            // The replica's first free tokenizer slot takes it.
            let slots = &mut self.routers[router].tokenizers;
            let slot = (0..slots.len()).min_by(|&a, &b| slots[a].total_cmp(&slots[b])).unwrap_or(0);
            let done = now.max(slots[slot]) + self.live[i].isl as f64 / rate;
            slots[slot] = done;
            self.queue.at(done, Ev::Route(i));
        } else {
            self.route(now, i);
        }
    }

    /// Routes request `i`: the real scheduler over this replica's view (or the recorded decision), then starts it.
    pub(super) fn route(&mut self, now: f64, i: usize) {
        let router = self.live[i].router;
        let cfg = &self.settings.scheduler;
        let bs = self.block_size.tokens() as u64;
        let req = RouteRequest {
            priority: self.workload[i].priority,
            ..RouteRequest::new(self.live[i].isl as u64, bs, self.hashes(i), cfg.prefix_hash_blocks)
        };
        self.sample_balance(now);
        let views = self.view(router, self.hashes(i), now);
        let placed = if self.settings.replay {
            self.replayed(i)
        } else {
            let explain = self.settings.record_candidates;
            route(&req, &views, cfg, &mut self.routers[router].state).map(|d| Placement {
                margin: d.prefill_margin(),
                candidates: explain.then(|| d.candidates()),
                retry_order: Some(failover::retry_order(&d)),
                prefill: d.prefill.filter(|_| d.disaggregate).map(|c| c.id.0 as usize),
                decode: d.decode.id.0 as usize,
                reason: d.reason.as_str().to_string(),
            })
        };
        let mut placed = match placed {
            Ok(p) => p,
            Err(e) => return self.refuse(now, i, e),
        };
        *self.out.decisions.entry(placed.reason.clone()).or_default() += 1;
        self.out.placements[i] = Some(Placed {
            prefill: placed.prefill.map(|p| self.workers[p].name.clone()),
            decode: self.workers[placed.decode].name.clone(),
            margin: placed.margin,
            candidates: placed.candidates.take(),
        });
        self.start(now, i, &placed, &views);
    }

    pub(super) fn refuse(&mut self, now: f64, i: usize, e: RouteError) {
        *self.out.decisions.entry(e.kind().to_string()).or_default() += 1;
        let status = if matches!(e, RouteError::NoDecodeWorkers) { 503 } else { 429 };
        self.finish(now, i, status, Some(e.to_string()), None);
    }

    pub(super) fn start(&mut self, now: f64, i: usize, d: &Placement, views: &[WorkerView]) {
        let decode = d.decode;
        self.live[i].decode = decode;
        let target = d.prefill.unwrap_or(decode);
        let held = views
            .iter()
            .find(|v| v.id.0 as usize == target)
            .map_or(0, |v| (v.overlap.device + v.overlap.host + v.overlap.disk) as u64);
        self.live[i].retries = Some(Box::new(failover::Retries::new(d.retry_order.clone(), target != decode)));
        let at = self.instant(now);
        self.routers[self.live[i].router].budget.request(at, &failover::budget_settings());
        (self.live[i].on, self.live[i].attempt_tokens) = (Some(target), 0);
        // As the router's: the whole request, from here, within the request timeout.
        let timeout = self.routers[self.live[i].router].gate.timeout();
        self.queue.at_in_order(lanes::REQUEST, now + timeout, Ev::Deadline(i));
        let isl = self.live[i].isl as u64;
        let uncached = isl.saturating_sub(held * self.block_size.tokens() as u64);
        let export = target != decode;
        let max_tokens = if export { 1 } else { self.live[i].max_tokens };
        if export {
            self.live[i].prefill = Some(target);
        }
        self.send(target, i, uncached);
        self.call_started(now, i);
        if export && self.settings.scheduler.reserve_decode {
            self.send(decode, i, 0);
        }
        // After a disaggregated prefill the decode worker needs the prompt again.
        let prompt = if export { self.live[i].prompt.clone() } else { self.live[i].prompt.take() };
        self.submit(now, target, Job { i, prompt, max_tokens, export, pulled: false });
    }

    /// The router's own accounting of work it sent `w` for request `i`.
    pub(super) fn send(&mut self, w: usize, i: usize, uncached: u64) {
        let blocks = self.prompt_blocks(i);
        let live = &self.live[i];
        let load = &mut self.routers[live.router].load;
        let hashes = live.prompt.as_ref().map_or(&[][..], |p| &p.hashes().seq);
        load.sent(WorkerId(w as u32), i as u64, &i.to_string(), uncached, blocks, hashes);
    }

    /// The blocks request `i`'s whole prompt takes.
    pub(super) fn prompt_blocks(&self, i: usize) -> u64 {
        (self.live[i].isl as u64).div_ceil(self.block_size.tokens() as u64)
    }

    /// Request `i`'s prompt's block hashes (none once the prompt has moved to its last engine).
    pub(super) fn hashes(&self, i: usize) -> &[SeqHash] {
        self.live[i].prompt.as_ref().map_or(&[], |p| &p.hashes().seq)
    }
}
