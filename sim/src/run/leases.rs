//! Lease room on prefill workers, as `worker::leases` keeps it: a prefill call sets aside its prompt's blocks as it
//! arrives, before any compute, and is refused (`ResourceExhausted`) when they do not fit beside the prompts
//! already set aside or leased; the room comes back when the prefill fails or the lease ends (the decode worker's
//! engine took the pulled blocks, or nobody will pull them). The router then tries its next prefill candidate, and
//! after the last one the decode worker computes the prompt itself; a refusal says nothing about the worker's
//! health, so no breaker counts it.

use router::scheduler::view::WorkerId;

use super::Sim;

impl Sim<'_> {
    /// Prefill worker `p` sets aside room for request `i`'s prompt KV (all its blocks, cached ones too, as the
    /// worker reserves them); false when it does not fit.
    fn reserve_lease(&mut self, i: usize, p: usize) -> bool {
        self.release_lease(i);
        let blocks = self.prompt_blocks(i);
        let w = &mut self.workers[p];
        if w.leased + blocks > w.lease_room {
            return false;
        }
        w.leased += blocks;
        self.live[i].lease = Some((p, blocks));
        true
    }

    /// Request `i`'s room on its prefill worker comes back (its prefill failed, or its lease ended); nothing when it
    /// holds none.
    pub(super) fn release_lease(&mut self, i: usize) {
        if let Some((p, blocks)) = self.live[i].lease.take() {
            let w = &mut self.workers[p];
            w.leased = w.leased.saturating_sub(blocks);
        }
    }

    /// Worker `w` reads call `job`: a prefill call sets its prompt's room aside, or is refused for want of it (and
    /// fails over); false when refused.
    pub(super) fn lease_for(&mut self, now: f64, w: usize, job: &super::Job) -> bool {
        if job.export && !self.reserve_lease(job.i, w) {
            self.prefill_refused(now, job.i, w);
            return false;
        }
        true
    }

    /// Prefill worker `p` refused request `i`'s prefill for want of lease room.
    pub(super) fn prefill_refused(&mut self, now: f64, i: usize, p: usize) {
        *self.out.decisions.entry("prefill_refused".into()).or_default() += 1;
        self.routers[self.live[i].router].load.done(WorkerId(p as u32), i as u64);
        self.prefill_failed(now, i);
    }
}
