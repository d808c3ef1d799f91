//! Metrics and traces shared by the router and the workers (`observability.md`).

#![forbid(unsafe_code)]

pub mod prom;
