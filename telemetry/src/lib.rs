//! Metrics, logs and traces shared by the router and the workers (`observability.md`).

#![forbid(unsafe_code)]

mod export;
mod logs;
mod process;
pub mod prom;
pub mod trace;

pub use export::dropped_spans;
pub use logs::{Guard, TraceExport, init, init_with};
pub use process::Process;
