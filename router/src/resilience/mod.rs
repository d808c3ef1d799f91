//! Keeping a sick cluster from being hit twice as hard (the background article, 9.1–9.3): a circuit breaker per
//! worker that ejects one failing again and again for a growing time (outlier ejection), and a retry budget that
//! caps retries and failovers at a fraction of recent requests. Both are pure: `now` is an input.

mod breaker;
mod budget;
mod stall;

pub use breaker::{Breaker, BreakerSettings};
pub use budget::{RetryBudget, RetryBudgetSettings};
pub use stall::{Change as StallChange, StallSettings, StallWatch, defaults as stall_defaults};

/// Whether a worker's answer says something about the worker's health (as opposed to the request's).
pub fn counts_against_worker(code: tonic::Code) -> bool {
    use tonic::Code::*;
    matches!(code, Unavailable | Internal | Unknown | DeadlineExceeded | Aborted | DataLoss | Unimplemented)
}
