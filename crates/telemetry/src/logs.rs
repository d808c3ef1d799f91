//! Logs and traces for a process: `tracing` with `RUST_LOG` levels, text or JSON lines
//! (`TANDEM_LOG_FORMAT=json`), on stderr.

use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Level when `RUST_LOG` is unset: our own crates at info, everything else at warn.
const DEFAULT_FILTER: &str = "warn,router=info,worker=info,tandem=info,kv_transfer=info,engine=info";

/// Keeps telemetry running; drop it last (it flushes what is buffered).
#[derive(Debug)]
pub struct Guard(());

/// Installs the process-wide subscriber once; later calls (tests, an embedding program) change nothing.
pub fn init(service: &str) -> Guard {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    let json = std::env::var("TANDEM_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json"));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry().with(filter);
    let installed = if json { registry.with(fmt.json()).try_init() } else { registry.with(fmt).try_init() };
    if installed.is_ok() {
        tracing::debug!(service, "telemetry started");
    }
    Guard(())
}
