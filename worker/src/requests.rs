//! Requests in flight on this worker, by the router's request id: what `Cancel` reaches, and which requests a load
//! report covers (each call's key is the [`Tag`] its engine work carries, so a report names the ids of exactly the
//! sequences its figures count). One entry per call, removed when the call ends for any reason (its [`Ticket`] is
//! dropped), so the table never outgrows the work in flight. Two calls may carry the same id (a misbehaving client, a restarted
//! router): each has an entry of its own, and neither can end the other.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use engine::generate::Tag;
use tokio::sync::oneshot;

#[derive(Debug)]
struct Entry {
    key: Tag,
    cancel: Option<oneshot::Sender<()>>,
}

#[derive(Debug, Default)]
struct Table {
    next: Tag,
    by_id: HashMap<String, Vec<Entry>>,
}

/// The table of calls in flight.
#[derive(Debug, Default)]
pub struct InFlight {
    table: Mutex<Table>,
}

/// One call's place in the table; dropping it removes the entry.
#[derive(Debug)]
pub struct Ticket {
    table: Arc<InFlight>,
    id: String,
    key: Tag,
}

impl InFlight {
    fn lock(&self) -> MutexGuard<'_, Table> {
        // The table holds no invariant a panic elsewhere could break half-way.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Enters a call with request id `id`; the receiver fires when `Cancel` names the id.
    pub fn enter(self: &Arc<Self>, id: &str) -> (Ticket, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        let mut t = self.lock();
        let key = t.next;
        t.next += 1;
        t.by_id.entry(id.to_string()).or_default().push(Entry { key, cancel: Some(tx) });
        (Ticket { table: Arc::clone(self), id: id.to_string(), key }, rx)
    }

    /// Cancels every call with request id `id`; whether there was one. An empty id names nothing.
    pub fn cancel(&self, id: &str) -> bool {
        if id.is_empty() {
            return false;
        }
        let mut t = self.lock();
        let Some(entries) = t.by_id.get_mut(id) else { return false };
        let mut found = false;
        for e in entries.iter_mut() {
            found |= e.cancel.take().is_some_and(|tx| tx.send(()).is_ok());
        }
        found
    }

    /// Calls in flight.
    pub fn len(&self) -> usize {
        self.lock().by_id.values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The ids of the calls whose tags are among `tags` (sorted: the engine's published [`EngineStats::tags`]),
    /// each once, for a load report whose figures are the ones published with those tags.
    ///
    /// [`EngineStats::tags`]: engine::generate::EngineStats::tags
    pub fn ids_of(&self, tags: &[Tag]) -> Vec<String> {
        let t = self.lock();
        t.by_id
            .iter()
            .filter(|(id, entries)| !id.is_empty() && entries.iter().any(|e| tags.binary_search(&e.key).is_ok()))
            .map(|(id, _)| id.clone())
            .collect()
    }

    fn remove(&self, id: &str, key: Tag) {
        let mut t = self.lock();
        if let Some(entries) = t.by_id.get_mut(id) {
            entries.retain(|e| e.key != key);
            if entries.is_empty() {
                t.by_id.remove(id);
            }
        }
    }
}

impl Ticket {
    /// What the call's engine work is submitted with, so that load reports name the call while the engine counts
    /// its work.
    pub fn tag(&self) -> Tag {
        self.key
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.table.remove(&self.id, self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_go_when_their_calls_end_and_duplicates_stay_apart() {
        let t = Arc::new(InFlight::default());
        let (a, mut a_cancel) = t.enter("r1");
        let (b, mut b_cancel) = t.enter("r1");
        assert_eq!(t.len(), 2);
        // The second call with the same id did not end the first.
        assert!(a_cancel.try_recv().is_err_and(|e| e == oneshot::error::TryRecvError::Empty));
        drop(b);
        assert!(b_cancel.try_recv().is_err_and(|e| e == oneshot::error::TryRecvError::Closed));
        assert!(a_cancel.try_recv().is_err_and(|e| e == oneshot::error::TryRecvError::Empty));
        assert!(t.ids_of(&[]).is_empty());
        assert_eq!(t.ids_of(&[a.tag()]), vec!["r1".to_string()]);
        assert!(t.cancel("r1"));
        assert_eq!(a_cancel.try_recv(), Ok(()));
        assert!(!t.cancel("r1"), "a cancel reaches a call once");
        drop(a);
        assert!(t.is_empty());
        assert!(!t.cancel("r1") && !t.cancel(""));
    }
}
