//! Tandem's wire contract: the `.proto` files under `proto/` and the code tonic and prost generate from them.
//!
//! Only generated types live here. Every consumer converts them into its own domain types with typed errors
//! at its edge; no policy, no conversions, no logic.

#![forbid(unsafe_code)]

/// The worker service (`tandem.worker.v1`).
pub mod worker {
    #![allow(missing_docs, clippy::all, clippy::pedantic, clippy::unwrap_used)]
    tonic::include_proto!("tandem.worker.v1");
}
