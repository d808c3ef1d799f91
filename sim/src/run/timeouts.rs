//! The router's time limits on each call to a worker (`router::serve`): a prefill call, and a decode stream's wait
//! for its first token, get the prefill timeout; a decode stream then waits at most the decode idle timeout for
//! each next token. A call past its limit gives up and fails over as a failed call does (`DeadlineExceeded`, which
//! counts against the worker's breaker). A request's calls are numbered, so a timer set for an earlier call finds
//! it gone.

use super::{Ev, Sim};

/// The queue's timeout lanes: each kind of timeout is a constant delay after the moment it is set.
pub(super) mod lanes {
    /// The request timeout: a queued request's wait for a slot (`Ev::WaitEnds`), and its deadline (`Ev::Deadline`).
    pub const REQUEST: usize = 0;
    /// A call's first answer.
    pub const FIRST_ANSWER: usize = 1;
    /// A decode stream's next token, armed at its first.
    pub const IDLE: usize = 2;
}

impl Sim<'_> {
    /// The router calls a worker for request `i` (its prefill, its decode stream, a retry or a resumption): the
    /// call's first answer is due within the prefill timeout.
    pub(super) fn call_started(&mut self, now: f64, i: usize) {
        let live = &mut self.live[i];
        live.call += 1;
        let timer = Ev::CallTimer { i, call: live.call, idle: false };
        self.queue.at_in_order(lanes::FIRST_ANSWER, now + self.settings.timeouts.prefill, timer);
    }

    /// Request `i`'s decode stream made its first token: each next one is due within the decode idle timeout.
    pub(super) fn stream_began(&mut self, now: f64, i: usize) {
        let timer = Ev::CallTimer { i, call: self.live[i].call, idle: true };
        self.queue.at_in_order(lanes::IDLE, now + self.settings.timeouts.decode_idle, timer);
    }

    /// A timer of request `i`'s call `call` runs out: the call gives up if it is still the request's and still
    /// waits (for its prefill's answer or its stream's first token; for its stream's next token since the
    /// last one, when `idle`). The worker drops the request, as it does when the router cancels the call.
    pub(super) fn call_timer(&mut self, now: f64, i: usize, call: u32, idle: bool) {
        let live = &self.live[i];
        let Some(w) = live.on.filter(|_| live.call == call) else { return };
        let reason = if idle {
            let due = live.last_at.unwrap_or(now) + self.settings.timeouts.decode_idle;
            if due > now {
                // A token came since the timer was set: the wait counts from it.
                return self.queue.at(due, Ev::CallTimer { i, call, idle: true });
            }
            "decode_idle_timeout"
        } else {
            let streaming = live.prefill != Some(w) && live.attempt_tokens > 0;
            if streaming {
                // Its idle timer watches it now.
                return;
            }
            "prefill_timeout"
        };
        *self.out.decisions.entry(reason.into()).or_default() += 1;
        self.drop_from(now, w, i);
        self.attempt_failed(now, i, w);
    }
}
