//! Prompts whose KV a prefill worker holds for decode workers to pull: the blocks' bytes (copied out of the
//! engine when the prefill finished) under a lease that expires unless released first.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kv_transfer::frame::ErrorCode;
use kv_transfer::lease::{LeaseError, LeaseId, LeaseTable};
use kv_transfer::quic::BlockSource;
use kv_transfer::shm::ShmRegion;

/// Leased prompt KV, served to the transfer transport.
#[derive(Debug, Default)]
pub struct Leases {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    table: LeaseTable,
    blocks: HashMap<LeaseId, Vec<(u64, Bytes)>>,
    /// Shared-memory copies of leased blocks; the file goes when the entry does.
    regions: HashMap<LeaseId, ShmRegion>,
}

impl Leases {
    /// Holds `blocks` (checksum, bytes) under `id` for `ttl`, with their shared-memory copy if one was made.
    pub fn grant(
        &self,
        id: LeaseId,
        blocks: Vec<(u64, Bytes)>,
        region: Option<ShmRegion>,
        now: Instant,
        ttl: Duration,
    ) -> Result<(), LeaseError> {
        let mut inner = self.inner.lock().map_err(|_| LeaseError::NotFound(id.0))?;
        inner.table.grant(id, (0..blocks.len() as u32).collect(), now, ttl)?;
        inner.blocks.insert(id, blocks);
        if let Some(r) = region {
            inner.regions.insert(id, r);
        }
        Ok(())
    }

    /// Drops every expired lease; returns how many.
    pub fn expire(&self, now: Instant) -> usize {
        let Ok(mut inner) = self.inner.lock() else { return 0 };
        let gone = inner.table.expire(now);
        for (id, _) in &gone {
            inner.blocks.remove(id);
            inner.regions.remove(id);
        }
        gone.len()
    }

    /// Ends a lease early (the reader is done).
    pub fn release(&self, id: LeaseId) -> Result<(), LeaseError> {
        let mut inner = self.inner.lock().map_err(|_| LeaseError::NotFound(id.0))?;
        inner.table.release(id)?;
        inner.blocks.remove(&id);
        inner.regions.remove(&id);
        Ok(())
    }

    /// Live leases.
    pub fn len(&self) -> usize {
        self.inner.lock().map_or(0, |i| i.table.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl BlockSource for Leases {
    fn read(&self, lease: LeaseId, index: u32) -> Result<(u64, Bytes), (ErrorCode, String)> {
        let inner = self.inner.lock().map_err(|_| (ErrorCode::Internal, "lease table unavailable".to_string()))?;
        match inner.table.blocks(lease, Instant::now()) {
            Ok(_) => {}
            Err(LeaseError::Expired(_)) => {
                return Err((ErrorCode::LeaseExpired, format!("lease {:032x} expired", lease.0)));
            }
            Err(e) => return Err((ErrorCode::LeaseNotFound, e.to_string())),
        }
        let blocks = inner.blocks.get(&lease).ok_or((ErrorCode::LeaseNotFound, "no blocks".to_string()))?;
        blocks.get(index as usize).cloned().ok_or((ErrorCode::BadRequest, format!("the lease has no block {index}")))
    }

    fn release(&self, lease: LeaseId) {
        let _ = Leases::release(self, lease);
    }
}
