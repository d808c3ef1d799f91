//! The KV indexer lives in its own crate (`kv-index`, no async runtime) so the simulator and the benchmark
//! against Dynamo's indexer use the very code the router runs.

pub use kv_index::{ApplyError, IndexStats, Overlaps, PrefixIndex};
