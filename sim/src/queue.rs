//! Virtual time: events in time order, ties in the order they were scheduled (so a run is deterministic).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// Pending events of type `E`.
#[derive(Debug)]
pub struct Queue<E> {
    heap: BinaryHeap<Entry<E>>,
    scheduled: u64,
}

#[derive(Debug)]
struct Entry<E> {
    at: f64,
    order: u64,
    event: E,
}

impl<E> PartialEq for Entry<E> {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl<E> Eq for Entry<E> {}

impl<E> PartialOrd for Entry<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<E> Ord for Entry<E> {
    // Reversed: the heap's top is the earliest event, the first scheduled among equals.
    fn cmp(&self, other: &Self) -> Ordering {
        other.at.total_cmp(&self.at).then(other.order.cmp(&self.order))
    }
}

impl<E> Queue<E> {
    pub fn new() -> Queue<E> {
        Queue { heap: BinaryHeap::new(), scheduled: 0 }
    }

    /// Schedules `event` at `at` seconds.
    pub fn at(&mut self, at: f64, event: E) {
        self.heap.push(Entry { at, order: self.scheduled, event });
        self.scheduled += 1;
    }

    /// The next event and its time.
    pub fn pop(&mut self) -> Option<(f64, E)> {
        self.heap.pop().map(|e| (e.at, e.event))
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
}
