//! Admission control: past `max_in_flight` requests wait for a slot in a queue ordered by priority (lower values
//! first, vLLM's meaning) and then arrival; past `max_queue` a request is refused, unless it outranks the last one
//! queued, which is refused in its place. A slot freed goes straight to the first one queued.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::http::error::ApiError;

/// Told to clients refused for load.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// Requests in flight and waiting.
#[derive(Debug)]
pub struct Admission {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    max_in_flight: usize,
    max_queue: usize,
    slots: Mutex<Slots>,
}

/// A waiter's place: its priority, then its arrival number.
type Place = (i32, u64);

/// What a waiter is sent: a slot, or a refusal when a request of a higher priority took its place.
type Answer = Result<Permit, ApiError>;

#[derive(Debug)]
struct Slots {
    free: usize,
    waiting: BTreeMap<Place, oneshot::Sender<Answer>>,
    arrivals: u64,
}

impl Shared {
    fn slots(&self) -> MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A slot, held until the request ends; dropping it hands the slot to the first one queued.
#[derive(Debug)]
pub struct Permit {
    shared: Option<Arc<Shared>>,
}

impl Permit {
    fn new(shared: &Arc<Shared>) -> Permit {
        Permit { shared: Some(Arc::clone(shared)) }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let Some(shared) = self.shared.take() else { return };
        loop {
            let next = {
                let mut slots = shared.slots();
                match slots.waiting.pop_first() {
                    Some((_, tx)) => tx,
                    None => {
                        slots.free += 1;
                        return;
                    }
                }
            };
            // A waiter that left before its turn cannot take the slot: it goes to the next one. (One that leaves
            // after it was sent drops it with its channel, which hands it on from there.)
            match next.send(Ok(Permit::new(&shared))) {
                Ok(()) => return,
                Err(Ok(mut unsent)) => unsent.shared = None,
                Err(Err(_)) => unreachable!("only slots are sent here"),
            }
        }
    }
}

/// Leaves the queue when the waiter does (admitted, refused, timed out, or its client gone).
struct Queued<'a> {
    shared: &'a Shared,
    place: Place,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.shared.slots().waiting.remove(&self.place);
    }
}

impl Admission {
    pub fn new(max_in_flight: usize, max_queue: usize) -> Admission {
        let max_in_flight = max_in_flight.max(1);
        let slots = Slots { free: max_in_flight, waiting: BTreeMap::new(), arrivals: 0 };
        Admission { shared: Arc::new(Shared { max_in_flight, max_queue, slots: Mutex::new(slots) }) }
    }

    /// A slot for a request of `priority`, waiting in the queue for one for at most `wait` (the request's
    /// deadline): `Overloaded` when the queue is full of requests of the same or a higher priority (or when this
    /// one is pushed out by one of a higher priority), `Deadline` when the wait runs out. Cancel-safe: a caller
    /// dropped while queued leaves the queue.
    pub async fn admit(&self, priority: i32, wait: Duration) -> Result<Permit, ApiError> {
        let (place, rx, pushed_out) = {
            let mut slots = self.shared.slots();
            if slots.free > 0 {
                slots.free -= 1;
                return Ok(Permit::new(&self.shared));
            }
            let mut pushed_out = None;
            if slots.waiting.len() >= self.shared.max_queue {
                match slots.waiting.last_key_value() {
                    Some((&(last, _), _)) if last > priority => pushed_out = slots.waiting.pop_last(),
                    _ => return Err(ApiError::Overloaded(RETRY_AFTER)),
                }
            }
            let place = (priority, slots.arrivals);
            slots.arrivals += 1;
            let (tx, rx) = oneshot::channel();
            slots.waiting.insert(place, tx);
            (place, rx, pushed_out)
        };
        if let Some((_, tx)) = pushed_out {
            let _ = tx.send(Err(ApiError::Overloaded(RETRY_AFTER)));
        }
        let _queued = Queued { shared: &self.shared, place };
        match tokio::time::timeout(wait, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(ApiError::Unavailable("the router is shutting down".into())),
            Err(_) => Err(ApiError::Deadline(wait)),
        }
    }

    pub fn queued(&self) -> usize {
        self.shared.slots().waiting.len()
    }

    /// Requests holding a slot.
    pub fn in_flight(&self) -> usize {
        self.shared.max_in_flight.saturating_sub(self.shared.slots().free)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    #[tokio::test(start_paused = true)]
    async fn a_queued_request_that_leaves_gives_its_place_back() {
        let a = Admission::new(1, 2);
        let held = a.admit(0, MINUTE).await.expect("a slot");
        for _ in 0..5 {
            // The client goes away while queued: its future is dropped mid-wait.
            let waiting = a.admit(0, MINUTE);
            assert!(tokio::time::timeout(Duration::from_millis(10), waiting).await.is_err());
            assert_eq!(a.queued(), 0);
        }
        // The queue still takes two; a third is refused.
        let (first, second) = (a.admit(0, MINUTE), a.admit(0, MINUTE));
        tokio::pin!(first, second);
        assert!(futures_util::poll!(&mut first).is_pending() && futures_util::poll!(&mut second).is_pending());
        assert_eq!(a.queued(), 2);
        assert!(matches!(a.admit(0, MINUTE).await, Err(ApiError::Overloaded(_))));
        drop(held);
        let p = first.await.expect("admitted in turn");
        assert_eq!(a.queued(), 1);
        // The queue wait counts against the deadline.
        assert!(matches!(second.await, Err(ApiError::Deadline(_))));
        assert_eq!((a.queued(), a.in_flight()), (0, 1));
        drop(p);
        assert_eq!(a.in_flight(), 0);
    }

    /// Polls each pending admission once, in order, and returns the indices of those that completed.
    async fn ready<F: std::future::Future + Unpin>(waiting: &mut [Option<F>]) -> Vec<(usize, F::Output)> {
        let mut done = Vec::new();
        for (i, slot) in waiting.iter_mut().enumerate() {
            if let Some(f) = slot
                && let std::task::Poll::Ready(out) = futures_util::poll!(f)
            {
                done.push((i, out));
                *slot = None;
            }
        }
        done
    }

    #[tokio::test(start_paused = true)]
    async fn slots_go_by_priority_then_arrival() {
        let a = Admission::new(1, 8);
        let mut held = a.admit(9, MINUTE).await.expect("a free slot, whatever the priority");
        let priorities = [5, 0, 5, -2, 0];
        let mut waiting: Vec<_> = priorities.iter().map(|&p| Some(Box::pin(a.admit(p, MINUTE)))).collect();
        assert!(ready(&mut waiting).await.is_empty());
        let mut order = Vec::new();
        for _ in 0..priorities.len() {
            drop(held);
            let mut done = ready(&mut waiting).await;
            assert_eq!(done.len(), 1, "one slot, one admission");
            let (i, permit) = done.pop().expect("one");
            order.push(i);
            held = permit.expect("a slot");
        }
        assert_eq!(order, vec![3, 1, 4, 0, 2]);
        drop(held);
        assert_eq!((a.queued(), a.in_flight()), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_refuses_the_last_ranked_request() {
        let a = Admission::new(1, 2);
        let held = a.admit(0, MINUTE).await.expect("a slot");
        let mut waiting = vec![Some(Box::pin(a.admit(3, MINUTE))), Some(Box::pin(a.admit(1, MINUTE)))];
        assert!(ready(&mut waiting).await.is_empty());
        // Not above the last one queued (3): refused itself.
        assert!(matches!(a.admit(3, MINUTE).await, Err(ApiError::Overloaded(_))));
        // Above it: it takes the place of the request of priority 3, which is refused.
        waiting.push(Some(Box::pin(a.admit(2, MINUTE))));
        // The first round queues it (it is polled last), the second sees the refusal it sent.
        let mut done = ready(&mut waiting).await;
        done.extend(ready(&mut waiting).await);
        assert!(matches!(done.as_slice(), [(0, Err(ApiError::Overloaded(_)))]), "{done:?}");
        assert_eq!(a.queued(), 2);
        drop(held);
        let done = ready(&mut waiting).await;
        assert!(matches!(done.as_slice(), [(1, Ok(_))]), "priority 1 first: {done:?}");
        drop(done);
        let done = ready(&mut waiting).await;
        assert!(matches!(done.as_slice(), [(2, Ok(_))]), "{done:?}");
    }

    /// A waiter whose slot was sent but who left before taking it (its deadline, its client) hands it on.
    #[tokio::test(start_paused = true)]
    async fn a_slot_sent_to_a_waiter_that_left_goes_to_the_next() {
        let a = Admission::new(1, 4);
        let held = a.admit(0, MINUTE).await.expect("a slot");
        let mut first = Box::pin(a.admit(0, MINUTE));
        let mut second = Box::pin(a.admit(0, MINUTE));
        assert!(futures_util::poll!(&mut first).is_pending() && futures_util::poll!(&mut second).is_pending());
        drop(held);
        // The slot is in `first`'s channel; `first` goes away without polling again.
        drop(first);
        let p = second.await.expect("the slot moved on");
        assert_eq!((a.queued(), a.in_flight()), (0, 1));
        drop(p);
        assert_eq!(a.in_flight(), 0);
    }
}
