//! Tandem's router: OpenAI-compatible HTTP in front, a KV-aware scheduler in the middle, workers behind.

#![forbid(unsafe_code)]

pub mod cluster;
pub mod indexer;
pub mod load;
pub mod scheduler;
