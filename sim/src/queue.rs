//! Virtual time: events in time order, ties in the order they were scheduled (so a run is deterministic).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// Pending events of type `E`. The heap orders small keys; the events (some large: a load report, a step's KV
/// events) wait in a slab, so that sifting the heap moves 24 bytes per entry instead of whole events.
#[derive(Debug)]
pub struct Queue<E> {
    heap: BinaryHeap<Entry>,
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
        other.at.total_cmp(&self.at).then(other.order.cmp(&self.order))
    }
}

impl<E> Queue<E> {
    pub fn new() -> Queue<E> {
        Queue { heap: BinaryHeap::new(), scheduled: 0, events: Vec::new(), free: Vec::new() }
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

    /// The next event and its time.
    pub fn pop(&mut self) -> Option<(f64, E)> {
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
}
