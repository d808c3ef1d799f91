//! Virtual time: events in time order, ties in the order they were scheduled (so a run is deterministic).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};

/// Pending events of type `E`. The heap orders small keys; the events (some large: a load report, a step's KV
/// events) wait in a slab, so that sifting the heap moves 24 bytes per entry instead of whole events. Events known
/// before the run starts (a trace's arrivals: thousands) wait in a sorted lane of their own, so the heap holds only
/// what the run schedules as it goes (tens: each worker's step end, messages in flight) and each pop sifts through
/// a few levels instead of a dozen.
#[derive(Debug)]
pub struct Queue<E> {
    heap: BinaryHeap<Entry>,
    /// The events scheduled up front, earliest first (ties in scheduling order).
    lane: VecDeque<(f64, u64, E)>,
    /// Events scheduled in time order as the run goes ([`Queue::at_in_order`]: timeouts, each a constant delay
    /// after the moment it is set), earliest first: a lane per kind of timeout (each its own delay).
    timeouts: Vec<VecDeque<(f64, u64, E)>>,
    scheduled: u64,
    events: Vec<Option<E>>,
    /// Slab entries free for reuse.
    free: Vec<usize>,
}

#[derive(Debug)]
struct Entry {
    at: f64,
    order: u64,
    /// Where the event waits in the slab.
    slot: usize,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Entry {}

impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Entry {
    // Reversed: the heap's top is the earliest event, the first scheduled among equals.
    fn cmp(&self, other: &Self) -> Ordering {
        sooner((other.at, other.order), (self.at, self.order))
    }
}

/// How two events, each (time, scheduling order), come out: the earlier first, ties to the one scheduled first.
fn sooner(a: (f64, u64), b: (f64, u64)) -> Ordering {
    a.0.total_cmp(&b.0).then(a.1.cmp(&b.1))
}

impl<E> Queue<E> {
    pub fn new() -> Queue<E> {
        Queue {
            heap: BinaryHeap::new(),
            lane: VecDeque::new(),
            timeouts: Vec::new(),
            scheduled: 0,
            events: Vec::new(),
            free: Vec::new(),
        }
    }

    /// Schedules many `events` (each at its time) at once, to wait in the lane: they come out exactly as if each
    /// were scheduled with [`Queue::at`] in this order. While an earlier lane still waits they go to the heap.
    pub fn up_front(&mut self, events: impl IntoIterator<Item = (f64, E)>) {
        if !self.lane.is_empty() {
            for (at, e) in events {
                self.at(at, e);
            }
            return;
        }
        let first = self.scheduled;
        let mut lane: Vec<(f64, u64, E)> =
            events.into_iter().enumerate().map(|(k, (at, e))| (at, first + k as u64, e)).collect();
        // Stable: equal times keep their scheduling order.
        lane.sort_by(|a, b| a.0.total_cmp(&b.0));
        self.scheduled += lane.len() as u64;
        self.lane = lane.into();
    }

    /// Schedules `event` at `at` seconds.
    pub fn at(&mut self, at: f64, event: E) {
        let slot = match self.free.pop() {
            Some(slot) => {
                self.events[slot] = Some(event);
                slot
            }
            None => {
                self.events.push(Some(event));
                self.events.len() - 1
            }
        };
        self.heap.push(Entry { at, order: self.scheduled, slot });
        self.scheduled += 1;
    }

    /// Schedules `event` at `at` seconds on timeout lane `lane` (one per kind of timeout), normally no earlier than
    /// every event scheduled on that lane before it (a constant delay after the current time, as a timeout is): it
    /// waits in the lane instead of the heap, and comes out exactly where [`Queue::at`] would have put it. One out of
    /// order goes to the heap.
    pub fn at_in_order(&mut self, lane: usize, at: f64, event: E) {
        if self.timeouts.len() <= lane {
            self.timeouts.resize_with(lane + 1, VecDeque::new);
        }
        if self.timeouts[lane].back().is_some_and(|b| b.0 > at) {
            return self.at(at, event);
        }
        self.timeouts[lane].push_back((at, self.scheduled, event));
        self.scheduled += 1;
    }

    /// The next event and its time.
    pub fn pop(&mut self) -> Option<(f64, E)> {
        // Whichever comes out first of the up-front lane's front, the timeout lanes' fronts and the heap's top.
        let lane = self.lane.front().map(|f| (f.0, f.1));
        let heap = self.heap.peek().map(|h| (h.at, h.order));
        let before = |a: Option<(f64, u64)>, b: Option<(f64, u64)>| match (a, b) {
            (Some(a), Some(b)) => sooner(a, b).is_lt(),
            (Some(_), None) => true,
            (None, _) => false,
        };
        // The earliest of the timeout lanes' fronts.
        let mut timeout: Option<(usize, (f64, u64))> = None;
        for (k, t) in self.timeouts.iter().enumerate() {
            let front = t.front().map(|f| (f.0, f.1));
            if before(front, timeout.map(|(_, f)| f)) {
                timeout = front.map(|f| (k, f));
            }
        }
        let first_timeout = timeout.map(|(_, f)| f);
        if before(lane, first_timeout) && before(lane, heap) {
            return self.lane.pop_front().map(|(at, _, e)| (at, e));
        }
        if let Some((k, _)) = timeout.filter(|(_, f)| before(Some(*f), heap)) {
            return self.timeouts[k].pop_front().map(|(at, _, e)| (at, e));
        }
        let e = self.heap.pop()?;
        self.free.push(e.slot);
        // Every slot the heap names holds its event: it is emptied only here.
        self.events[e.slot].take().map(|event| (e.at, event))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_come_in_time_order_and_equal_times_in_scheduling_order() {
        let mut q = Queue::new();
        q.at(2.0, "c");
        q.at(1.0, "a");
        q.at(2.0, "d");
        q.at(1.0, "b");
        let order: Vec<&str> = std::iter::from_fn(|| q.pop().map(|(_, e)| e)).collect();
        assert_eq!(order, ["a", "b", "c", "d"]);
    }

    #[test]
    fn events_up_front_interleave_as_if_scheduled_first() {
        let mut lane = Queue::new();
        let mut heap = Queue::new();
        let first = [(3.0, "x"), (1.0, "y"), (1.0, "z"), (2.0, "w")];
        lane.up_front(first);
        for (at, e) in first {
            heap.at(at, e);
        }
        for q in [&mut lane, &mut heap] {
            q.at(1.0, "late-1");
            q.at(0.5, "early");
            q.at(3.0, "late-3");
        }
        let drain = |q: &mut Queue<&'static str>| -> Vec<(f64, &str)> { std::iter::from_fn(|| q.pop()).collect() };
        let (a, b) = (drain(&mut lane), drain(&mut heap));
        assert_eq!(a, b);
        assert_eq!(a.iter().map(|(_, e)| *e).collect::<Vec<_>>(), ["early", "y", "z", "late-1", "w", "x", "late-3"]);
    }

    #[test]
    fn events_in_order_come_out_where_the_heap_would_put_them() {
        let (mut fifo, mut heap) = (Queue::new(), Queue::new());
        for q in [&mut fifo, &mut heap] {
            q.up_front([(1.0, "a"), (3.0, "b")]);
            q.at(2.0, "c");
        }
        // Interleaved with the heap's events, ties included: each in its place by time, then by scheduling order.
        let steps: [(f64, &str, bool); 5] =
            [(2.0, "d", true), (2.5, "e", false), (2.0, "f", false), (3.0, "g", true), (3.0, "h", true)];
        for (at, e, timeout) in steps {
            if timeout {
                fifo.at_in_order(0, at, e);
            } else {
                fifo.at(at, e);
            }
            heap.at(at, e);
        }
        let drain = |q: &mut Queue<&'static str>| std::iter::from_fn(|| q.pop().map(|(_, e)| e)).collect::<Vec<_>>();
        let order = drain(&mut fifo);
        assert_eq!(order, drain(&mut heap));
        assert_eq!(order, ["a", "c", "d", "f", "e", "b", "g", "h"]);
    }

    #[test]
    fn timeouts_of_several_delays_each_in_a_lane_come_out_where_the_heap_would_put_them() {
        let (mut lanes, mut heap) = (Queue::new(), Queue::new());
        // Three kinds of timeout (delays 5, 2 and 1 after their moment), set at moments 0, 1, 2, 3, with other
        // events between; then one out of its lane's order (to the heap).
        let mut scheduled = Vec::new();
        for now in 0..4 {
            let now = now as f64;
            for (lane, delay) in [(0, 5.0), (1, 2.0), (2, 1.0)] {
                scheduled.push((Some(lane), now + delay));
            }
            scheduled.push((None, now + 1.5));
        }
        scheduled.push((Some(1), 2.5));
        for (k, (lane, at)) in scheduled.iter().enumerate() {
            match lane {
                Some(l) => lanes.at_in_order(*l, *at, k),
                None => lanes.at(*at, k),
            }
            heap.at(*at, k);
        }
        let drain = |q: &mut Queue<usize>| -> Vec<(f64, usize)> { std::iter::from_fn(|| q.pop()).collect() };
        let order = drain(&mut lanes);
        assert_eq!(order, drain(&mut heap));
        assert_eq!(order.len(), scheduled.len());
    }

    #[test]
    fn a_lane_given_after_other_events_keeps_the_scheduling_order() {
        let (mut lane, mut heap) = (Queue::new(), Queue::new());
        for q in [&mut lane, &mut heap] {
            q.at(1.0, "a");
            q.at(2.0, "b");
        }
        let later = [(2.0, "c"), (1.0, "d"), (0.5, "e")];
        lane.up_front(later);
        // A second batch while the first still waits: into the heap, in order all the same.
        lane.up_front([(1.0, "f")]);
        for (at, e) in later.into_iter().chain([(1.0, "f")]) {
            heap.at(at, e);
        }
        let drain = |q: &mut Queue<&'static str>| -> Vec<(f64, &str)> { std::iter::from_fn(|| q.pop()).collect() };
        let (a, b) = (drain(&mut lane), drain(&mut heap));
        assert_eq!(a, b);
        assert_eq!(a.iter().map(|(_, e)| *e).collect::<Vec<_>>(), ["e", "a", "d", "f", "b", "c"]);
    }
}
