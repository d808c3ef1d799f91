//! A disaggregated request's prompt KV on its way from its prefill worker to its decode worker: the pull over both
//! workers' links, the decode worker's engine taking the pulled blocks, and the lease on the prefill worker's
//! blocks, which ends when they are taken or no longer wanted.

use kv_cache::SeqHash;

use super::{Ev, Job, Sim};

impl Sim<'_> {
    /// Moves request `i`'s prompt KV from prefill worker `p` to its decode worker: only the leading full blocks
    /// the decode worker does not hold, over both workers' links, charged at the modelled block size.
    pub(super) fn transfer(&mut self, now: f64, i: usize, p: usize, kv: engine::generate::ExportedKv) {
        if !self.routable(now, self.live[i].router, self.live[i].decode) {
            // The decided decode worker failed, or its breaker ejected it, while the prompt prefilled: nothing ran
            // there, so another takes the request as its first decode attempt (not a resumption), as the real
            // router does.
            let tried = self.live[i].retries.as_ref().map(|r| r.tried.clone()).unwrap_or_default();
            self.live[i].decode = self.next_decoder(now, i, &tried);
        }
        let d = self.live[i].decode;
        (self.live[i].on, self.live[i].pulling, self.live[i].attempt_tokens) = (Some(d), true, 0);
        self.live[i].pull_since = now;
        let hashes: Vec<SeqHash> = kv.metas.iter().map_while(|b| b.map(|m| m.seq)).collect();
        let m = self.workers[d].engine.lookup(&hashes);
        let held = (m.device + m.host + m.disk).min(hashes.len());
        let pulled = hashes.len() - held;
        let bytes = pulled as u64 * self.settings.transfer_block_bytes;
        // Streamed: the leading pieces' blocks came over while the later pieces computed (each piece a pull of
        // its own), so what is left after the prefill is what the last piece added. The modelled simplification:
        // the pieces' pulls are taken to have ended by now, whatever else held the links meanwhile.
        let ends = self.piece_ends(i);
        let streamed = ends.last().map_or(0, |end| end / self.block_size.tokens()).min(hashes.len());
        let ahead = streamed.saturating_sub(held).min(pulled);
        let pull_secs = |blocks: usize| match blocks {
            0 => 0.0,
            n => {
                let bytes = n as u64 * self.settings.transfer_block_bytes;
                self.settings.transfer_latency + bytes as f64 / self.settings.transfer_bandwidth
            }
        };
        let secs = pull_secs(pulled - ahead);
        // Every pull the decode worker made, for its measured link speed: one per leading piece, then the rest.
        let piece_latencies = if ahead > 0 { ends.len() - 1 } else { 0 };
        let total_secs = secs + pull_secs(ahead) + self.settings.transfer_latency * piece_latencies as f64;
        let begin = now.max(self.workers[p].link_free).max(self.workers[d].link_free);
        let end = begin + secs;
        self.workers[p].link_free = end;
        self.workers[d].link_free = end;
        self.workers[d].pulled_bytes += bytes;
        self.workers[d].pulled_nanos += (total_secs * 1e9) as u64;
        self.out.transfer_bytes += bytes;
        if pulled > 0 {
            self.live[i].pull = Some((kv, held..hashes.len()));
        } else {
            drop(kv);
            self.release_lease(i);
            self.unpinned(now, p);
        }
        // The router calls the decode worker as soon as the prefill answers; the pull happens inside that call.
        self.send(d, i, 0);
        self.call_started(now, i);
        self.queue.at(end, Ev::Pulled(i));
    }

    /// Where the router cuts request `i`'s prompt when it streams its KV (`router::stream_kv::piece_ends`, from
    /// what its prefill worker held of it); empty when it does not.
    pub(super) fn piece_ends(&self, i: usize) -> Vec<usize> {
        let live = &self.live[i];
        if !self.settings.stream_kv || live.max_tokens <= 1 {
            return Vec::new();
        }
        let bt = self.block_size.tokens();
        router::stream_kv::piece_ends(live.isl, live.cached, bt, self.settings.engine.max_batched_tokens)
    }

    /// Prefill worker `p` takes back the blocks of exports that nobody reads any more (its lease ended): its
    /// engine does between steps, so one under way first ends (and until then nothing of the step's own effects,
    /// which the simulated engine has already applied, may reach the router).
    pub(super) fn unpinned(&mut self, now: f64, p: usize) {
        if self.workers[p].stepping || self.workers[p].hung {
            self.workers[p].reclaim = true;
            return;
        }
        self.workers[p].engine.reclaim_pinned();
        self.publish(now, p);
    }

    pub(super) fn pulled(&mut self, now: f64, i: usize) {
        if self.live[i].pulling && self.live[i].prefill.is_some_and(|p| self.workers[p].hung) {
            // Its prefill worker hung before the pull ended: it stalls until the worker goes on or the pull times
            // out.
            self.live[i].pull_stalled = true;
            return;
        }
        self.live[i].pull_stalled = false;
        if !std::mem::take(&mut self.live[i].pulling) {
            // The attempt it was for failed meanwhile.
            return;
        }
        let d = self.live[i].decode;
        // The last submission: the prompt (made with room for the output) moves to the engine.
        let mut prompt = self.live[i].prompt.take();
        if let Some(p) = &mut prompt {
            p.extend(self.live[i].first_token);
        }
        let max_tokens = self.live[i].max_tokens - 1;
        self.submit(now, d, Job { i, prompt, max_tokens, export: false, pulled: true });
    }

    /// The prompt's KV on its way to request `i`'s decode attempt (pulling, or pulled and waiting for the engine) is
    /// not wanted any more: the lease ends, and its prefill worker takes the blocks back (unless it is gone).
    pub(super) fn end_pull(&mut self, now: f64, i: usize) {
        self.release_lease(i);
        let live = &mut self.live[i];
        live.pulling = false;
        if let (Some(p), Some(_)) = (live.prefill, live.pull.take())
            && !self.workers[p].down
        {
            self.unpinned(now, p);
        }
    }
}
