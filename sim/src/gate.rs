//! The router's admission control in virtual time, as `router::admission::Admission` applies it in real time: a
//! router holds at most `max_in_flight` requests from admission to their response's end; later arrivals wait by
//! priority (a trace's `priority`, lower first), then in arrival order, at most `max_queue` of them; past that one is
//! refused, unless it outranks the last one waiting, which is refused in its place; one that waits longer than the
//! request timeout is answered with a timeout instead. Each router replica has its own gate.

use std::collections::VecDeque;

/// The limits, as the router's `--max-in-flight`, `--max-queue` and `--request-timeout-ms` set them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    pub max_in_flight: usize,
    pub max_queue: usize,
    /// Seconds a request may wait for a slot.
    pub request_timeout: f64,
}

impl Default for Limits {
    /// The router's defaults.
    fn default() -> Limits {
        use router::run::defaults;
        Limits {
            max_in_flight: defaults::MAX_IN_FLIGHT,
            max_queue: defaults::MAX_QUEUE,
            request_timeout: defaults::REQUEST_TIMEOUT.as_secs_f64(),
        }
    }
}

/// What became of an arrival.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// It holds a slot: on to tokenizing and routing.
    Admitted,
    /// It waits for a slot; answered with a timeout if none comes within the request timeout.
    Queued,
    /// The queue is full: refused for load (429).
    Refused,
    /// It waits, in the place of this request, which is refused for load (429).
    QueuedInPlaceOf(usize),
}

/// One router's slots and queue.
#[derive(Debug)]
pub struct Gate {
    limits: Limits,
    in_flight: usize,
    /// Requests waiting for a slot, as (priority, index), in the order they get one.
    waiting: VecDeque<(i32, usize)>,
}

impl Gate {
    pub fn new(limits: Limits) -> Gate {
        // As the router: at least one slot.
        let limits = Limits { max_in_flight: limits.max_in_flight.max(1), ..limits };
        Gate { limits, in_flight: 0, waiting: VecDeque::new() }
    }

    /// Request `i`, of `priority`, arrives.
    pub fn arrive(&mut self, i: usize, priority: i32) -> Arrival {
        if self.in_flight < self.limits.max_in_flight {
            self.in_flight += 1;
            return Arrival::Admitted;
        }
        let mut arrival = Arrival::Queued;
        if self.waiting.len() >= self.limits.max_queue {
            match self.waiting.back() {
                Some(&(last, j)) if last > priority => {
                    self.waiting.pop_back();
                    arrival = Arrival::QueuedInPlaceOf(j);
                }
                _ => return Arrival::Refused,
            }
        }
        let at = self.waiting.partition_point(|&(p, _)| p <= priority);
        self.waiting.insert(at, (priority, i));
        arrival
    }

    /// An admitted request's response ended, giving its slot back: the next waiting request, which now holds it.
    pub fn leave(&mut self) -> Option<usize> {
        match self.waiting.pop_front() {
            Some((_, next)) => Some(next),
            None => {
                self.in_flight = self.in_flight.saturating_sub(1);
                None
            }
        }
    }

    /// Request `i`'s wait ran out: true (and it leaves the queue) when it was still waiting.
    pub fn expire(&mut self, i: usize) -> bool {
        match self.waiting.iter().position(|&(_, w)| w == i) {
            Some(at) => {
                self.waiting.remove(at);
                true
            }
            None => false,
        }
    }

    pub fn timeout(&self) -> f64 {
        self.limits.request_timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(max_in_flight: usize, max_queue: usize) -> Gate {
        Gate::new(Limits { max_in_flight, max_queue, request_timeout: 1.0 })
    }

    #[test]
    fn arrivals_past_the_slots_queue_in_order_and_past_the_queue_are_refused() {
        let mut g = gate(2, 2);
        let got: Vec<Arrival> = (0..5).map(|i| g.arrive(i, 0)).collect();
        use Arrival::*;
        assert_eq!(got, [Admitted, Admitted, Queued, Queued, Refused]);
        // Slots pass to the waiting requests first come first; then they are free.
        assert_eq!(g.leave(), Some(2));
        assert_eq!(g.leave(), Some(3));
        assert_eq!(g.leave(), None);
        assert_eq!(g.arrive(5, 0), Admitted);
        assert_eq!(g.arrive(6, 0), Queued);
    }

    #[test]
    fn an_expired_wait_leaves_its_place_and_is_never_handed_a_slot() {
        let mut g = gate(1, 1);
        assert_eq!(g.arrive(0, 0), Arrival::Admitted);
        assert_eq!(g.arrive(1, 0), Arrival::Queued);
        assert_eq!(g.arrive(2, 0), Arrival::Refused);
        assert!(g.expire(1));
        assert!(!g.expire(1), "gone already");
        assert_eq!(g.arrive(3, 0), Arrival::Queued, "the place is free again");
        assert_eq!(g.leave(), Some(3));
        assert_eq!(g.leave(), None);
        assert_eq!(g.arrive(4, 0), Arrival::Admitted);
    }

    /// As the router's queue: lower priorities first, then arrival; a full queue refuses an arrival unless it
    /// outranks the last one waiting, which is refused in its place.
    #[test]
    fn waiting_requests_go_by_priority_and_a_full_queue_refuses_the_last_ranked() {
        let mut g = gate(1, 3);
        assert_eq!(g.arrive(0, 9), Arrival::Admitted);
        assert_eq!([g.arrive(1, 5), g.arrive(2, 0), g.arrive(3, 5)], [Arrival::Queued; 3]);
        assert_eq!(g.arrive(4, 5), Arrival::Refused, "not above the last one waiting");
        assert_eq!(g.arrive(5, -1), Arrival::QueuedInPlaceOf(3));
        assert!(!g.expire(3), "it left the queue");
        assert_eq!([g.leave(), g.leave(), g.leave(), g.leave()], [Some(5), Some(2), Some(1), None]);
    }

    #[test]
    fn at_least_one_slot() {
        let mut g = gate(0, 0);
        assert_eq!(g.arrive(0, 0), Arrival::Admitted);
        assert_eq!(g.arrive(1, 0), Arrival::Refused);
    }
}
