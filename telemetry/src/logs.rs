//! Logs and traces for a process: `tracing` with `RUST_LOG` levels, text or JSON lines
//! (`TANDEM_LOG_FORMAT=json`) on stderr, and OpenTelemetry spans exported over OTLP/gRPC when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES` and
//! `OTEL_TRACES_SAMPLER` work as usual).

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Level when `RUST_LOG` is unset: our own crates at info, everything else at warn.
const DEFAULT_FILTER: &str = "warn,router=info,worker=info,tandem=info,kv_transfer=info,engine=info";
/// How long finished spans wait before they are sent in a batch (the SDK's default).
const EXPORT_DELAY: Duration = Duration::from_secs(5);
/// Spans wait at most this long for the collector on shutdown.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// Where spans go.
#[derive(Clone, Debug, Default)]
pub struct TraceExport {
    /// OTLP/gRPC endpoint (`http://host:4317`); `None`: spans are not exported.
    pub endpoint: Option<String>,
    /// Per-export timeout; the exporter's default (10 s) when `None`.
    pub timeout: Option<Duration>,
}

impl TraceExport {
    /// From the standard environment variables.
    pub fn from_env() -> TraceExport {
        let endpoint = std::env::var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT"))
            .ok()
            .filter(|e| !e.is_empty());
        TraceExport { endpoint, timeout: None }
    }
}

/// Keeps telemetry running; dropping it flushes buffered spans. Drop it inside the runtime it was made in.
#[derive(Debug)]
pub struct Guard {
    provider: Option<SdkTracerProvider>,
}

impl Guard {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports every finished span now.
    pub fn flush(&self) {
        if let Some(p) = &self.provider {
            let _ = p.force_flush();
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown_with_timeout(FLUSH_TIMEOUT);
        }
    }
}

/// Installs the process-wide subscriber, exporting spans as the environment says. Call it inside a tokio runtime
/// (the OTLP client needs one). Later calls change nothing.
pub fn init(service: &str) -> Guard {
    init_with(service, TraceExport::from_env())
}

fn provider(service: &str, export: &TraceExport) -> Option<SdkTracerProvider> {
    let endpoint = export.endpoint.as_ref()?;
    let mut builder = opentelemetry_otlp::SpanExporter::builder().with_tonic().with_endpoint(endpoint.clone());
    if let Some(t) = export.timeout {
        builder = builder.with_timeout(t);
    }
    let exporter = match builder.build() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("warning: traces are not exported: {e}");
            return None;
        }
    };
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(service.to_string());
    }
    // Export never blocks a request: spans wait in a bounded queue and leave on the batch thread; a span that
    // finds the queue full is dropped and counted.
    let gate = crate::export::Gate::new(exporter, crate::export::QUEUE_LIMIT, EXPORT_DELAY);
    Some(SdkTracerProvider::builder().with_span_processor(gate).with_resource(resource.build()).build())
}

/// Whether log lines get terminal colours: only on a terminal, and not when `NO_COLOR` is set (no-color.org). A log
/// read from a pipe or a file (Docker, Kubernetes, a collector) would otherwise carry escape codes in every line.
fn colour() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// The level filter for `spec` (`RUST_LOG`; the default when unset, empty or invalid): one of the two. A plain list
/// of `target=level` directives (the default, and the usual `RUST_LOG`) is a [`Targets`], which decides from the
/// callsite alone; directives on spans or fields (`[...]`, `{...}`) need an [`EnvFilter`], which also looks up every
/// span in a table behind a lock at each entry, exit and recorded field (on a router at 64 streams, a few percent
/// of its processor time).
fn level_filter(spec: Option<&str>) -> (Option<Targets>, Option<EnvFilter>) {
    let spec = spec.map(str::trim).filter(|s| !s.is_empty()).unwrap_or(DEFAULT_FILTER);
    if !spec.contains(['[', '{'])
        && let Ok(targets) = spec.parse::<Targets>()
    {
        return (Some(targets), None);
    }
    (None, Some(EnvFilter::try_new(spec).unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER))))
}

/// [`init`] with an explicit export target (tests, embedding programs).
pub fn init_with(service: &str, export: TraceExport) -> Guard {
    let (targets, filter) = level_filter(std::env::var("RUST_LOG").ok().as_deref());
    let json = std::env::var("TANDEM_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json"));
    let provider = provider(service, &export);
    let otel = provider.as_ref().map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("tandem")));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(colour());
    let registry = tracing_subscriber::registry().with(otel).with(targets).with(filter);
    let installed = if json { registry.with(fmt.json()).try_init() } else { registry.with(fmt).try_init() };
    if installed.is_err() {
        // Someone else installed a subscriber first; ours would export nothing.
        if let Some(p) = provider {
            let _ = p.shutdown();
        }
        return Guard { provider: None };
    }
    Guard { provider }
}

#[cfg(test)]
mod tests {
    use tracing::Level;

    use super::*;

    #[test]
    fn plain_level_lists_take_the_lock_free_filter_and_span_directives_the_full_one() {
        for unset in [None, Some(""), Some("  ")] {
            let (targets, env) = level_filter(unset);
            let t = targets.expect("the default is a plain list");
            assert!(env.is_none());
            assert!(t.would_enable("router::http", &Level::INFO));
            assert!(!t.would_enable("router::http", &Level::DEBUG));
            assert!(!t.would_enable("hyper::proto", &Level::INFO), "others only from warn");
            assert!(t.would_enable("hyper::proto", &Level::WARN));
        }
        let (targets, env) = level_filter(Some("debug,h2=off"));
        let t = targets.expect("a plain list");
        assert!(env.is_none());
        assert!(t.would_enable("worker", &Level::DEBUG) && !t.would_enable("h2::codec", &Level::ERROR));
        for dynamic in ["router[request]=debug", "router[{request_id}]=trace", "[request{user=x}]=debug"] {
            let (targets, env) = level_filter(Some(dynamic));
            assert!(targets.is_none() && env.is_some(), "{dynamic}");
        }
        // Not a filter at all: the default, as before.
        let (targets, env) = level_filter(Some("router=loud"));
        assert!(targets.is_none());
        assert_eq!(env.expect("the default").to_string(), EnvFilter::new(DEFAULT_FILTER).to_string());
    }
}
