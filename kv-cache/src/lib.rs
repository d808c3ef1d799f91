//! Tandem's KV cache bookkeeping: block identity (chained hashes), the tiered block pool and its event log.
//!
//! A prompt is cut into full blocks of `block_size` tokens. Every block has a *local* hash (its own tokens) and a
//! *sequence* hash that chains the previous block's sequence hash with the local one, so one sequence hash names
//! a whole prefix. Workers and the router compute the same hashes, so the router's index needs no tokens.
//!
//! This crate is pure: no I/O, no clock, no async. The engine drives the pool and performs the copies it asks for.

#![deny(unsafe_code)]

pub mod events;
pub mod fastmap;
mod hash;
pub mod pool;
mod prefetch;
pub mod probemap;
pub mod table;

pub use hash::{
    BlockHashes, BlockSize, CacheNamespace, HashedTokens, LocalHash, SeqHash, block_hashes, chained, first_local_hash,
    local_hash,
};
