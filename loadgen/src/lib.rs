//! Tandem's load generator (`tandem bench serve`): replays real serving traces (Mooncake/aiperf
//! `mooncake_trace`, Azure) or synthetic shared-prefix workloads against any OpenAI-compatible endpoint, on a
//! fixed schedule, open-loop arrivals or a fixed concurrency, and measures each request from the client's side.
//!
//! Pure cores: [`trace`] parses workloads, [`synthetic`] makes them, [`prompt`] turns block ids into tokens,
//! [`schedule`] decides send times, [`summary`] reduces records. [`client`] and [`run`] do the I/O.

pub mod client;
pub mod overrun;
pub mod prompt;
pub mod rng;
pub mod run;
pub mod schedule;
pub mod summary;
pub mod synthetic;
pub mod trace;
