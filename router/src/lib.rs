//! Tandem's router: OpenAI-compatible HTTP in front, a KV-aware scheduler in the middle, workers behind.

#![forbid(unsafe_code)]

pub mod admission;
pub mod cli;
pub mod cluster;
pub mod discovery;
pub mod external;
pub mod http;
pub mod ids;
pub mod indexer;
pub mod load;
pub mod metrics;
pub mod record;
pub mod resilience;
pub mod response_store;
pub mod run;
pub mod scheduler;
pub mod serve;
pub mod state;
pub mod stream_kv;
pub mod tenants;
