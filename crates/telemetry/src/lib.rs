//! Metrics, logs and traces shared by the router and the workers (`observability.md`).

#![forbid(unsafe_code)]

mod logs;
pub mod prom;
pub mod trace;

pub use logs::{Guard, TraceExport, init, init_with};
