//! Moving KV blocks between workers, shaped like RDMA: a worker registers its block storage as regions, pins a
//! finished prompt's blocks under a [`lease`], and hands out a [`KvHandle`](descriptor::KvHandle) describing
//! where each block lives; the reader pulls only the blocks it lacks and verifies each one's checksum.
//!
//! The modules here are pure (no I/O, no clock: time is an argument): descriptors and compatibility checks
//! ([`descriptor`]), the lease table ([`lease`]) and the wire format of a read ([`frame`]). Transports (QUIC with
//! mutual TLS, shared memory) drive them.

#![forbid(unsafe_code)]

pub mod bench;
pub mod descriptor;
pub mod frame;
pub mod lease;
pub mod quic;
pub mod tls;

/// Checksum of a block's bytes, carried in descriptors and frames.
pub fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}
