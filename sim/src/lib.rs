//! `tandem sim`: whole traces through a simulated cluster in virtual time. Single-threaded, deterministic for a
//! seed, no sleeping and no sockets. Each worker is the real engine (scheduler, tiered block pool with its events,
//! export and import) over the mock backend, whose steps return their modelled duration instead of sleeping; the
//! router side is the real `route` over the real indexer and load tracker, fed with KV events and load reports
//! after modelled delays. Requests come out as `tandem bench serve` records, so the same summary applies.

mod cores;
mod gate;
pub mod oracle;
mod queue;
mod run;
pub mod tune;
mod worker;

pub use gate::Limits;
pub use run::{Balance, CallTimeouts, Failure, Fault, Outcome, Placed, Settings, SimError, simulate};
