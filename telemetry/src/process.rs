//! A process's runtime and telemetry, made in the one order that works: the tokio runtime first (the OTLP client
//! needs one), telemetry inside it, and on the way out telemetry flushed before the runtime stops.

use crate::logs::{Guard, init};

/// The runtime and telemetry of a Tandem process. Fields drop in order: telemetry first, then the runtime.
#[derive(Debug)]
pub struct Process {
    // Never read: it is held so that dropping the process flushes spans before the runtime stops.
    _telemetry: Guard,
    runtime: tokio::runtime::Runtime,
}

impl Process {
    /// A multi-threaded runtime with `service`'s logs and traces set up in it.
    pub fn start(service: &str) -> Result<Process, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the runtime: {e}"))?;
        let telemetry = {
            let _in = runtime.enter();
            init(service)
        };
        Ok(Process { _telemetry: telemetry, runtime })
    }

    /// Runs `f` to completion on the runtime.
    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.runtime.block_on(f)
    }
}
