//! Prompts whose KV a prefill worker holds for decode workers to pull: the engine's own KV blocks, pinned where
//! they lie (neither written, freed nor evicted while a lease or a read in flight holds them; a same-host reader
//! maps them out of the engine's store when it is a shared-memory file), under a lease that expires unless
//! released first.
//!
//! Leased KV is capped in bytes: a prefill reserves what its prompt's KV will take before it computes anything,
//! and is refused when the reservation does not fit, so a burst of prefills cannot pin the whole device tier; the
//! router then tries another worker. A prompt streamed in pieces (the router's `stream_kv`) leases each leading
//! piece under the same request id before the whole prompt: the whole prompt's reservation is credited with those
//! leases, whose blocks (each piece a prefix of the next) it pins again rather than adds to.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kv_transfer::frame::ErrorCode;
use kv_transfer::lease::{LeaseError, LeaseId, LeaseTable};
use kv_transfer::quic::BlockSource;

/// Leased prompt KV, served to the transfer transport.
#[derive(Debug)]
pub struct Leases {
    inner: Mutex<Inner>,
    /// Most bytes held under leases and reservations together.
    cap: u64,
}

#[derive(Debug, Default)]
struct Inner {
    table: LeaseTable,
    leased: HashMap<LeaseId, Leased>,
    /// Bytes reserved or leased.
    bytes: u64,
}

#[derive(Debug)]
struct Leased {
    blocks: Vec<(u64, Bytes)>,
    bytes: u64,
    /// The router's request id the lease was granted for.
    request: String,
}

/// Bytes set aside for one prefill's KV until it is leased or given up (dropping it gives them back).
#[derive(Debug)]
pub struct Reservation {
    leases: Arc<Leases>,
    bytes: u64,
}

/// Leasing this prompt's KV would pass the cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("leased KV would pass its cap: {held} of {cap} bytes held, {want} more wanted")]
pub struct LeaseCapExceeded {
    pub held: u64,
    pub want: u64,
    pub cap: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut inner = self.leases.lock();
        inner.bytes = inner.bytes.saturating_sub(self.bytes);
    }
}

impl Leases {
    /// No more than `cap` bytes of KV leased at once.
    pub fn new(cap: u64) -> Leases {
        Leases { inner: Mutex::default(), cap }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The table's invariants hold between calls; a panic elsewhere cannot leave it half-changed.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets `bytes` aside for request `request`'s prompt KV, or says why not. Live leases of the same request (a
    /// streamed prompt's leading pieces, whose blocks this prompt's lease pins again) are taken off what is set
    /// aside. An empty id names no request.
    pub fn reserve(self: &Arc<Self>, bytes: u64, request: &str) -> Result<Reservation, LeaseCapExceeded> {
        let mut inner = self.lock();
        let pieces = inner.leased.values().filter(|l| !request.is_empty() && l.request == request);
        let bytes = bytes.saturating_sub(pieces.map(|l| l.bytes).sum());
        if inner.bytes.saturating_add(bytes) > self.cap {
            return Err(LeaseCapExceeded { held: inner.bytes, want: bytes, cap: self.cap });
        }
        inner.bytes += bytes;
        Ok(Reservation { leases: Arc::clone(self), bytes })
    }

    /// Holds `blocks` (checksum, bytes) under `id` for request `request` for `ttl`, in the room `reserved` set
    /// aside (what the blocks take beyond it is counted too).
    pub fn grant(
        &self,
        id: LeaseId,
        request: &str,
        blocks: Vec<(u64, Bytes)>,
        mut reserved: Reservation,
        now: Instant,
        ttl: Duration,
    ) -> Result<(), LeaseError> {
        let bytes: u64 = blocks.iter().map(|(_, b)| b.len() as u64).sum();
        let mut inner = self.lock();
        inner.table.grant(id, (0..blocks.len() as u32).collect(), now, ttl)?;
        // The reservation's bytes now belong to the lease (the reservation, emptied, gives nothing back).
        let set_aside = std::mem::take(&mut reserved.bytes);
        inner.bytes = inner.bytes.saturating_sub(set_aside) + bytes;
        inner.leased.insert(id, Leased { blocks, bytes, request: request.to_string() });
        drop(inner);
        drop(reserved);
        Ok(())
    }

    fn drop_lease(inner: &mut Inner, id: LeaseId) {
        if let Some(l) = inner.leased.remove(&id) {
            inner.bytes = inner.bytes.saturating_sub(l.bytes);
        }
    }

    /// Drops every expired lease; returns how many.
    pub fn expire(&self, now: Instant) -> usize {
        let mut inner = self.lock();
        let gone = inner.table.expire(now);
        for (id, _) in &gone {
            Leases::drop_lease(&mut inner, *id);
        }
        gone.len()
    }

    /// Ends a lease early (the reader is done).
    pub fn release(&self, id: LeaseId) -> Result<(), LeaseError> {
        let mut inner = self.lock();
        inner.table.release(id)?;
        Leases::drop_lease(&mut inner, id);
        Ok(())
    }

    /// Live leases.
    pub fn len(&self) -> usize {
        self.lock().table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held under leases and reservations.
    pub fn bytes(&self) -> u64 {
        self.lock().bytes
    }

    /// The cap on [`bytes`](Self::bytes).
    pub fn cap(&self) -> u64 {
        self.cap
    }
}

impl BlockSource for Leases {
    fn read(&self, lease: LeaseId, index: u32) -> Result<(u64, Bytes), (ErrorCode, String)> {
        let inner = self.lock();
        match inner.table.blocks(lease, Instant::now()) {
            Ok(_) => {}
            Err(LeaseError::Expired(_)) => {
                return Err((ErrorCode::LeaseExpired, format!("lease {:032x} expired", lease.0)));
            }
            Err(e) => return Err((ErrorCode::LeaseNotFound, e.to_string())),
        }
        let leased = inner.leased.get(&lease).ok_or((ErrorCode::LeaseNotFound, "no blocks".to_string()))?;
        leased
            .blocks
            .get(index as usize)
            .cloned()
            .ok_or((ErrorCode::BadRequest, format!("the lease has no block {index}")))
    }

    fn release(&self, lease: LeaseId) {
        let _ = Leases::release(self, lease);
    }
}

/// The default cap on leased KV: an eighth of the machine's memory, or 1 GiB when the machine does not say. The
/// worker also keeps it within [`pool_cap`] (half the device tier: 188.7 MB for SmolLM2's default 1,024 blocks).
pub fn default_cap() -> u64 {
    cap_from_meminfo(&std::fs::read_to_string("/proc/meminfo").unwrap_or_default())
}

/// The most leased bytes that pin no more than half of a device tier of `blocks` blocks of `block_bytes` each, so
/// prefills always find blocks to compute in however many leases wait to be pulled.
pub fn pool_cap(blocks: usize, block_bytes: u64) -> u64 {
    (blocks as u64 / 2) * block_bytes
}

/// An eighth of `MemTotal` in a `/proc/meminfo` text, or 1 GiB when it does not say.
fn cap_from_meminfo(meminfo: &str) -> u64 {
    let total = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|line| line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kib| kib * 1024));
    total.map_or(1 << 30, |t| t / 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(n: usize, len: usize) -> Vec<(u64, Bytes)> {
        (0..n).map(|i| (i as u64, Bytes::from(vec![0u8; len]))).collect()
    }

    #[test]
    fn leased_bytes_stay_under_the_cap_and_come_back() {
        let leases = Arc::new(Leases::new(10_000));
        let now = Instant::now();
        let r = leases.reserve(4_000, "r1").expect("fits");
        assert_eq!(leases.bytes(), 4_000);
        let refused = leases.reserve(7_000, "r2").expect_err("past the cap");
        assert_eq!(refused, LeaseCapExceeded { held: 4_000, want: 7_000, cap: 10_000 });
        leases.grant(LeaseId(1), "r1", blocks(4, 1_000), r, now, Duration::from_secs(30)).expect("granted");
        assert_eq!(leases.bytes(), 4_000);
        // A reservation given up (the prefill failed) gives its room back.
        drop(leases.reserve(6_000, "r2").expect("fits exactly"));
        assert_eq!(leases.bytes(), 4_000);
        let r = leases.reserve(2_000, "r2").expect("fits");
        leases.grant(LeaseId(2), "r2", blocks(2, 1_000), r, now, Duration::from_secs(1)).expect("granted");
        assert_eq!((leases.len(), leases.bytes()), (2, 6_000));
        leases.release(LeaseId(1)).expect("released");
        assert_eq!(leases.bytes(), 2_000);
        assert_eq!(leases.expire(now + Duration::from_secs(2)), 1);
        assert_eq!((leases.len(), leases.bytes()), (0, 0));
    }

    #[test]
    fn a_streamed_prompt_is_credited_with_its_own_pieces_leases() {
        let leases = Arc::new(Leases::new(10_000));
        let now = Instant::now();
        let ttl = Duration::from_secs(30);
        // Two leading pieces of request "r1" leased: 3,000 and 6,000 bytes, 9,000 counted.
        for (id, n) in [(1, 3), (2, 6)] {
            let r = leases.reserve(n * 1_000, "r1").expect("fits");
            leases.grant(LeaseId(id), "r1", blocks(n as usize, 1_000), r, now, ttl).expect("granted");
        }
        assert_eq!(leases.bytes(), 9_000);
        // Another request's 2,000 bytes do not fit; the whole prompt of "r1" pins the pieces' blocks again, so it
        // sets aside only what passes its pieces' leases.
        assert!(leases.reserve(2_000, "r2").is_err());
        assert!(leases.reserve(2_000, "").is_err(), "an empty id names no request");
        drop(leases.reserve(10_000, "r1").expect("credited with the pieces' 9,000 bytes"));
        assert!(leases.reserve(11_000, "r1").is_err(), "past the cap even so");
        let whole = leases.reserve(8_000, "r1").expect("credited");
        assert_eq!(leases.bytes(), 9_000);
        leases.grant(LeaseId(3), "r1", blocks(8, 1_000), whole, now, ttl).expect("granted");
        // Once the pieces are pulled and released, only the whole prompt's lease is counted.
        leases.release(LeaseId(1)).expect("released");
        leases.release(LeaseId(2)).expect("released");
        assert_eq!(leases.bytes(), 8_000);
        leases.release(LeaseId(3)).expect("released");
        assert_eq!(leases.bytes(), 0);
    }

    #[test]
    fn the_default_cap_is_an_eighth_of_memory() {
        let meminfo = "MemTotal:       24576000 kB\nMemFree:        20000000 kB\n";
        assert_eq!(cap_from_meminfo(meminfo), 24_576_000 * 1024 / 8);
        assert_eq!(cap_from_meminfo("nothing useful\n"), 1 << 30, "a machine that does not say gets 1 GiB");
        assert_eq!(cap_from_meminfo("MemTotal: lots kB\n"), 1 << 30);
    }
}
