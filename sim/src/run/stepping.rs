//! The workers' side: a request sent to a worker reaches its engine between steps, each engine steps in virtual
//! time (on the host's shared cores when it has them), and what a step made goes out: tokens to the requests, KV
//! events and load reports to the routers after their delays, exports to the transfers.

use engine::generate::Output;
use router::scheduler::view::WorkerId;

use super::{Ev, Job, Sim};

impl Sim<'_> {
    /// Sends worker `w` a request. Its engine takes it between steps, as a worker's engine thread takes its
    /// commands: while a step runs, the request waits for its end, out of the worker's load reports (a long CPU
    /// step kept a newly sent prompt out of the real workers' reports for seconds; the router counts it by its own
    /// figures meanwhile).
    pub(super) fn submit(&mut self, now: f64, w: usize, job: Job) {
        if self.workers[w].down {
            // A call to a worker that is gone fails at once.
            return self.attempt_failed(now, job.i, w);
        }
        *self.out.per_worker.entry(self.workers[w].name.clone()).or_default() += 1;
        if self.workers[w].erring {
            // It answers at once with an error.
            return self.attempt_failed(now, job.i, w);
        }
        if self.workers[w].hung {
            // A call to a worker that hangs but is not known to: it waits, unanswered, until the connection closes
            // or the worker goes on.
            self.workers[w].frozen.push(job);
            return;
        }
        if !self.lease_for(now, w, &job) {
            // Refused before its engine sees it: the worker's `ResourceExhausted`.
            return;
        }
        if self.workers[w].stepping {
            self.workers[w].sent.push(job);
            return;
        }
        self.admit(now, w, job);
        self.publish(now, w);
        self.kick(now, w);
    }

    /// Worker `w`'s engine takes a request; with the blocks its pull brought, whose lease then ends.
    pub(super) fn admit(&mut self, now: f64, w: usize, job: Job) {
        let i = job.i;
        let sampling = self.sampling(i, job.max_tokens);
        let pull = if job.pulled { self.live[i].pull.take() } else { None };
        let blocks: Vec<(usize, &[u8])> = match &pull {
            Some((kv, range)) => range.clone().map(|k| (k, kv.block(k))).collect(),
            None => Vec::new(),
        };
        let submitted = match job.prompt {
            Some(prompt) => self.workers[w]
                .engine
                .submit_hashed(i as u64, prompt, sampling, self.workload[i].priority, job.export, &blocks.as_slice())
                .map_err(|e| e.to_string()),
            // Not reached: each request's prompt moves to an engine once, at its last submission.
            None => Err("the request's prompt had already gone to its last worker".to_string()),
        };
        // The pulled blocks are in the engine: the lease ends and the prefill worker's blocks are its own again.
        if let (Some(_), Some(p)) = (pull, self.live[i].prefill) {
            self.release_lease(i);
            self.unpinned(now, p);
        }
        if let Err(e) = submitted {
            self.routers[self.live[i].router].load.done(WorkerId(w as u32), i as u64);
            self.finish(now, i, 500, Some(e), None);
        }
    }

    /// Starts worker `w`'s next step when it is idle and has work.
    pub(super) fn kick(&mut self, now: f64, w: usize) {
        let worker = &mut self.workers[w];
        if worker.stepping || !worker.engine.busy() {
            return;
        }
        // The step's outputs go into the buffer the last step's were read from.
        let secs = worker.engine.step_into(&mut worker.pending);
        worker.stepping = true;
        worker.step_started = now;
        if worker.stuck {
            // It will not end: the routers' stall checks count from here, its last progress.
            self.check_stall_after(now, now, w);
        }
        match &mut self.cores {
            None => self.queue.at(now + secs, Ev::StepEnd { w, turn: 0 }),
            Some(cores) => {
                for e in cores.start(now, w, secs) {
                    self.queue.at(e.at, Ev::StepEnd { w: e.worker, turn: e.turn });
                }
            }
        }
    }

    /// Sends what worker `w`'s state change tells the router: new KV events and, when due, a load report.
    pub(super) fn publish(&mut self, now: f64, w: usize) {
        if self.workers[w].down || self.workers[w].hung {
            return;
        }
        let events = self.workers[w].new_events();
        if !events.is_empty() {
            self.queue.at(now + self.settings.event_delay, Ev::Events(w, events));
        }
        for (r, report) in self.workers[w].reports_due(now) {
            self.queue.at(now + self.settings.report_delay, Ev::Report { w, r, report });
        }
    }

    pub(super) fn step_end(&mut self, now: f64, w: usize, turn: u64) {
        if let Some(cores) = &mut self.cores {
            // A stale end (another step started or ended since), or the others' new ends.
            let Some(ends) = cores.end(now, w, turn) else { return };
            for e in ends {
                self.queue.at(e.at, Ev::StepEnd { w: e.worker, turn: e.turn });
            }
        }
        if self.workers[w].hung {
            // It hung during the step: the step ends when the worker goes on, if it does.
            self.workers[w].held = true;
            return;
        }
        if self.workers[w].down {
            // It failed during the step: nothing of it comes out, and nothing more runs there (until it comes back,
            // which waited for this).
            self.workers[w].pending.clear();
            self.workers[w].stepping = false;
            if std::mem::take(&mut self.workers[w].back) {
                self.worker_back(now, w);
            }
            return;
        }
        if self.workers[w].stuck {
            // Its device hangs: the step ends only when it is unstuck.
            self.workers[w].held = true;
            return;
        }
        self.step_done(now, w);
    }

    /// Worker `w`'s step is over: its outputs go out, and the engine takes what came meanwhile and plans the next.
    pub(super) fn step_done(&mut self, now: f64, w: usize) {
        // The step's outputs go out while the worker still counts as stepping: what they cause on this worker
        // (a request sent back to it, a lease ended) queues behind what came during the step.
        let mut pending = std::mem::take(&mut self.workers[w].pending);
        for out in pending.drain(..) {
            self.output(now, w, out);
        }
        // The emptied buffer goes back for the next step.
        self.workers[w].pending = pending;
        self.workers[w].stepping = false;
        self.settle(now, w);
    }

    /// Worker `w`'s engine, between steps, takes what came (in the order it came) and plans its next step.
    pub(super) fn settle(&mut self, now: f64, w: usize) {
        if std::mem::take(&mut self.workers[w].reclaim) {
            self.workers[w].engine.reclaim_pinned();
        }
        for id in std::mem::take(&mut self.workers[w].cancels) {
            self.workers[w].engine.cancel(id);
        }
        for job in std::mem::take(&mut self.workers[w].sent) {
            self.admit(now, w, job);
        }
        self.publish(now, w);
        self.kick(now, w);
    }

    pub(super) fn output(&mut self, now: f64, w: usize, out: Output) {
        let worker = WorkerId(w as u32);
        let id = match &out {
            Output::Token { id, .. } | Output::Finished { id, .. } | Output::Failed { id, .. } => *id as usize,
        };
        if self.live[id].on != Some(w) {
            // The request ended (its deadline passed) while the step ran: what the step made for it goes nowhere,
            // and a prompt it exported is nobody's to pull.
            if let Output::Finished { exported: Some(_), .. } = out {
                self.unpinned(now, w);
            }
            return;
        }
        match out {
            Output::Token { id, token } => {
                let live = &mut self.live[id as usize];
                let began = live.prefill != Some(w) && live.attempt_tokens == 0;
                if live.prefill == Some(w) {
                    live.first_token = Some(token);
                } else {
                    if began {
                        // The decode attempt's first token (after the prefill worker's, when there was one).
                        self.routers[live.router].load.first_token(worker, id);
                    }
                    live.attempt_tokens += 1;
                }
                if let Some(r) = live.retries.as_mut() {
                    // The tokens sent so far, for a resumption (after a failure or a call's timeout).
                    if r.generated.capacity() == 0 {
                        r.generated.reserve_exact(live.max_tokens as usize);
                    }
                    r.generated.push(token);
                }
                if let Some(last) = live.last_at {
                    if live.gaps.capacity() == 0 {
                        // Room for every gap of the output at once (the trace's lengths are budgets the engine
                        // keeps to): growing it by doubling copied millions of gaps over a whole trace.
                        live.gaps.reserve_exact(live.max_tokens.saturating_sub(1) as usize);
                    }
                    live.gaps.push((now - last) * 1000.0);
                }
                live.first_at.get_or_insert(now);
                live.last_at = Some(now);
                live.produced += 1;
                if began {
                    self.stream_began(now, id as usize);
                }
            }
            Output::Finished { id, completion, exported } => {
                let i = id as usize;
                self.routers[self.live[i].router].load.done(worker, id);
                self.call_succeeded(i, w);
                if self.live[i].prefill == Some(w) {
                    self.live[i].cached = completion.cached_tokens;
                    match exported {
                        Some(kv) if self.live[i].max_tokens > 1 => self.transfer(now, i, w, kv),
                        unread => {
                            drop(unread);
                            self.unpinned(now, w);
                            self.finish(now, i, 200, None, Some("length"));
                        }
                    }
                } else {
                    if self.live[i].prefill.is_none() {
                        self.live[i].cached = completion.cached_tokens;
                    }
                    self.finish(now, i, 200, None, Some(completion.finish_reason.as_str()));
                }
            }
            Output::Failed { id, why } => {
                self.routers[self.live[id as usize].router].load.done(worker, id);
                self.finish(now, id as usize, 500, Some(why), None);
            }
        }
    }

    /// Worker `w`'s engine drops request `i` between steps (one sent during the step never reaches it).
    pub(super) fn drop_from(&mut self, now: f64, w: usize, i: usize) {
        let worker = &mut self.workers[w];
        let waiting = worker.sent.len() + worker.frozen.len();
        worker.sent.retain(|job| job.i != i);
        worker.frozen.retain(|job| job.i != i);
        if worker.sent.len() + worker.frozen.len() == waiting {
            if worker.stepping || worker.hung {
                worker.cancels.push(i as u64);
            } else {
                worker.engine.cancel(i as u64);
                self.publish(now, w);
            }
        }
    }
}
