//! Leases: a prefill worker pins a sequence's blocks until the reader is done or the lease expires. Pure: the
//! caller supplies ids (random, so they cannot be guessed) and the current time.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Default lifetime of a lease: long enough for a decode worker to be chosen and pull a long prompt.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// A lease's id: 128 random bits from the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub u128);

/// Why a lease operation failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    #[error("lease {0:032x} is unknown or was released")]
    NotFound(u128),
    #[error("lease {0:032x} has expired")]
    Expired(u128),
    #[error("lease id {0:032x} is already in use")]
    Duplicate(u128),
}

#[derive(Clone, Debug)]
struct Lease {
    blocks: Vec<u32>,
    expires: Instant,
}

/// Live leases and the blocks each pins.
#[derive(Clone, Debug, Default)]
pub struct LeaseTable {
    leases: HashMap<LeaseId, Lease>,
}

impl LeaseTable {
    pub fn new() -> LeaseTable {
        LeaseTable::default()
    }

    /// Pins `blocks` under `id` until `now + ttl`.
    pub fn grant(&mut self, id: LeaseId, blocks: Vec<u32>, now: Instant, ttl: Duration) -> Result<(), LeaseError> {
        if self.leases.contains_key(&id) {
            return Err(LeaseError::Duplicate(id.0));
        }
        self.leases.insert(id, Lease { blocks, expires: now + ttl });
        Ok(())
    }

    /// The blocks of a live lease.
    pub fn blocks(&self, id: LeaseId, now: Instant) -> Result<&[u32], LeaseError> {
        let lease = self.leases.get(&id).ok_or(LeaseError::NotFound(id.0))?;
        if now >= lease.expires {
            return Err(LeaseError::Expired(id.0));
        }
        Ok(&lease.blocks)
    }

    /// Pushes a live lease's expiry to `now + ttl`.
    pub fn extend(&mut self, id: LeaseId, now: Instant, ttl: Duration) -> Result<(), LeaseError> {
        let lease = self.leases.get_mut(&id).ok_or(LeaseError::NotFound(id.0))?;
        if now >= lease.expires {
            return Err(LeaseError::Expired(id.0));
        }
        lease.expires = now + ttl;
        Ok(())
    }

    /// Ends a lease (expired or not) and returns the blocks to unpin.
    pub fn release(&mut self, id: LeaseId) -> Result<Vec<u32>, LeaseError> {
        self.leases.remove(&id).map(|l| l.blocks).ok_or(LeaseError::NotFound(id.0))
    }

    /// Ends every lease that has expired by `now`, returning the blocks to unpin.
    pub fn expire(&mut self, now: Instant) -> Vec<(LeaseId, Vec<u32>)> {
        let gone: Vec<LeaseId> = self.leases.iter().filter(|(_, l)| now >= l.expires).map(|(id, _)| *id).collect();
        gone.into_iter().filter_map(|id| self.leases.remove(&id).map(|l| (id, l.blocks))).collect()
    }

    /// When the next lease expires, for the caller's timer.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.leases.values().map(|l| l.expires).min()
    }

    pub fn len(&self) -> usize {
        self.leases.len()
    }

    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_live_extend_expire_and_release() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut table = LeaseTable::new();
        table.grant(LeaseId(1), vec![4, 5], t0, s(30)).expect("granted");
        assert_eq!(table.grant(LeaseId(1), vec![], t0, s(30)), Err(LeaseError::Duplicate(1)));
        assert_eq!(table.blocks(LeaseId(1), t0 + s(29)), Ok(&[4, 5][..]));
        assert_eq!(table.blocks(LeaseId(1), t0 + s(30)), Err(LeaseError::Expired(1)));
        assert_eq!(table.blocks(LeaseId(2), t0), Err(LeaseError::NotFound(2)));
        table.extend(LeaseId(1), t0 + s(20), s(30)).expect("extended");
        assert!(table.blocks(LeaseId(1), t0 + s(45)).is_ok());
        table.grant(LeaseId(3), vec![9], t0, s(10)).expect("granted");
        assert_eq!(table.next_expiry(), Some(t0 + s(10)));
        assert_eq!(table.expire(t0 + s(11)), vec![(LeaseId(3), vec![9])]);
        assert_eq!(table.release(LeaseId(1)), Ok(vec![4, 5]));
        assert_eq!(table.release(LeaseId(1)), Err(LeaseError::NotFound(1)));
        assert!(table.is_empty());
    }
}
