//! Metrics, logs and traces shared by the router and the workers (`observability.md`).

#![forbid(unsafe_code)]

mod logs;
pub mod prom;

pub use logs::{Guard, init};
