//! The Responses API's stored responses (`store`, `previous_response_id`, `GET`/`DELETE /v1/responses/{id}`): each
//! response with the conversation it ends, in this router's memory, up to a budget of bytes (the oldest dropped
//! first), each readable only by the tenant that made it. Router replicas do not share them.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::Value;

/// What the store keeps by default, in MiB of conversations and responses (as JSON text).
pub const DEFAULT_MB: usize = 64;

/// A stored response and the conversation up to and including its answer (chat messages, without the
/// instructions, which a following response does not inherit).
#[derive(Clone, Debug)]
pub struct Stored {
    pub conversation: Arc<Vec<Value>>,
    pub response: Arc<Value>,
}

#[derive(Debug)]
struct Entry {
    tenant: Option<String>,
    stored: Stored,
    bytes: usize,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<String, Entry>,
    /// Ids in the order they were stored (an id deleted since is skipped when its turn comes).
    order: VecDeque<String>,
    bytes: usize,
}

/// The stored responses.
#[derive(Debug)]
pub struct ResponseStore {
    inner: Mutex<Inner>,
    budget: usize,
}

impl ResponseStore {
    pub fn new(budget: usize) -> ResponseStore {
        ResponseStore { inner: Mutex::new(Inner::default()), budget }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves the maps consistent (each change is one insert or remove).
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `stored` under `id` for `tenant`, dropping the oldest responses past the budget (one larger than the
    /// whole budget is not kept).
    pub fn put(&self, id: &str, tenant: Option<&str>, stored: Stored) {
        let bytes = id.len()
            + stored.conversation.iter().map(|m| m.to_string().len()).sum::<usize>()
            + stored.response.to_string().len();
        if bytes > self.budget {
            return;
        }
        let mut inner = self.lock();
        let entry = Entry { tenant: tenant.map(str::to_string), stored, bytes };
        if let Some(old) = inner.entries.insert(id.to_string(), entry) {
            inner.bytes -= old.bytes;
        }
        inner.bytes += bytes;
        inner.order.push_back(id.to_string());
        while inner.bytes > self.budget {
            let Some(oldest) = inner.order.pop_front() else { break };
            if let Some(gone) = inner.entries.remove(&oldest) {
                inner.bytes -= gone.bytes;
            }
        }
    }

    /// The response stored under `id`, if `tenant` made it.
    pub fn get(&self, id: &str, tenant: Option<&str>) -> Option<Stored> {
        let inner = self.lock();
        inner.entries.get(id).filter(|e| e.tenant.as_deref() == tenant).map(|e| e.stored.clone())
    }

    /// Drops the response stored under `id`, if `tenant` made it; whether there was one.
    pub fn delete(&self, id: &str, tenant: Option<&str>) -> bool {
        let mut inner = self.lock();
        if inner.entries.get(id).is_none_or(|e| e.tenant.as_deref() != tenant) {
            return false;
        }
        let gone = inner.entries.remove(id).map_or(0, |e| e.bytes);
        inner.bytes -= gone;
        true
    }

    /// Whether it keeps anything (a budget of 0 keeps nothing).
    pub fn keeps(&self) -> bool {
        self.budget > 0
    }

    /// Bytes kept now.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn stored(text: &str) -> Stored {
        Stored { conversation: Arc::new(vec![json!({"role": "user", "content": text})]), response: Arc::new(json!({})) }
    }

    #[test]
    fn responses_are_kept_per_tenant_and_the_oldest_go_first() {
        let one = stored(&"x".repeat(100));
        let size = "a".len() + one.conversation[0].to_string().len() + 2;
        let store = ResponseStore::new(size * 2);
        store.put("a", None, one.clone());
        store.put("b", Some("t1"), one.clone());
        assert!(store.get("a", None).is_some());
        assert!(store.get("b", None).is_none() && store.get("b", Some("t2")).is_none(), "another tenant's");
        assert!(store.get("b", Some("t1")).is_some());
        assert!(!store.delete("b", Some("t2")), "nor deleted by another");
        store.put("c", None, one.clone());
        assert!(store.get("a", None).is_none(), "the oldest dropped past the budget");
        assert!(store.get("c", None).is_some());
        assert!(store.delete("c", None) && store.get("c", None).is_none());
        assert_eq!(store.bytes(), size, "b alone");
        store.put("d", None, stored(&"y".repeat(10 * size)));
        assert!(store.get("d", None).is_none(), "larger than the whole budget: not kept");
        assert_eq!(store.bytes(), size);
    }
}
