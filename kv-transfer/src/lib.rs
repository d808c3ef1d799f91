//! Moving KV blocks between workers, shaped like RDMA: a worker registers its block storage as regions, pins a
//! finished prompt's blocks under a [`lease`], and hands out a [`KvHandle`](descriptor::KvHandle) describing
//! where each block lives; the reader pulls only the blocks it lacks and verifies each one's checksum.
//!
//! The modules here are pure (no I/O, no clock: time is an argument): descriptors and compatibility checks
//! ([`descriptor`]), the lease table ([`lease`]) and the wire format of a read ([`frame`]). Transports (QUIC with
//! mutual TLS, shared memory) drive them.

#![deny(unsafe_code)]

pub mod bench;
pub mod descriptor;
pub mod fault;
pub mod frame;
pub mod incoming;
pub mod lease;
pub mod paths;
pub mod quic;
pub mod shm;
pub mod tls;

use std::future::Future;
use std::pin::Pin;

/// Blocks pulled and verified (position, bytes), or why none were.
pub type Pulled = Result<Vec<(u32, bytes::Bytes)>, quic::TransferError>;
/// A pull in progress.
pub type PullFuture<'a> = Pin<Box<dyn Future<Output = Pulled> + Send + 'a>>;

/// A way to pull blocks from their owner; callers never know which one runs underneath.
pub trait Transport: Send + Sync {
    /// The transport's name, for metrics and traces (`quic`, `shm`).
    fn name(&self) -> &'static str;

    /// Pulls and verifies every requested block: all of them, or an error and none.
    fn pull<'a>(&'a self, request: quic::PullRequest<'a>) -> PullFuture<'a>;
}

impl Transport for quic::QuicClient {
    fn name(&self) -> &'static str {
        "quic"
    }

    fn pull<'a>(&'a self, request: quic::PullRequest<'a>) -> PullFuture<'a> {
        Box::pin(quic::QuicClient::pull(self, request))
    }
}

/// Checksum of a block's bytes, carried in descriptors and frames.
pub fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}
