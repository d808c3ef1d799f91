//! Starting and stopping a router: the text model, the cluster followers and the HTTP server, under one stop
//! signal.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use engine::text::{TextError, TextModel};
use kv_transfer::tls::Identity;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::admission::Admission;
use crate::cluster::{Cluster, ModelIdentity};
use crate::discovery::WorkerSource;
use crate::metrics::RouterMetrics;
use crate::record::Recording;
use crate::scheduler::RouteState;
use crate::scheduler::config::SchedulerConfig;
use crate::state::{Limits, RouterState};

/// Named defaults, each with its reason.
pub mod defaults {
    use std::time::Duration;

    /// `system.md`: router HTTP on 8000 (loopback unless told otherwise).
    pub const LISTEN: &str = "127.0.0.1:8000";
    /// What clients call the embedded model.
    pub const SERVED_MODEL: &str = "smollm2-135m-instruct";
    /// Far above what a CPU cluster runs at once, so only a real flood is refused.
    pub const MAX_IN_FLIGHT: usize = 256;
    pub const MAX_QUEUE: usize = 1024;
    /// A long answer on CPU takes minutes; a hung request must still end.
    pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);
    /// Prefilling 8k tokens on a small CPU takes about 100 s.
    pub const PREFILL_TIMEOUT: Duration = Duration::from_secs(180);
    pub const MAX_PREFILL_ATTEMPTS: usize = 2;
    /// A CPU engine step with a full 2048-token prefill chunk in it takes ~12 s on two cores; five of those.
    pub const DECODE_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
    /// The first decode worker plus two resumptions elsewhere.
    pub const MAX_DECODE_ATTEMPTS: usize = 3;
    /// Output budget when a request names none.
    pub const DEFAULT_MAX_TOKENS: u32 = 512;
    /// Off: streaming a long prompt's KV while it computes cuts the time to decoding on an idle prefill worker,
    /// but each piece boundary costs a busy one a step, which raised TTFT p90 on a real trace (docs/performance.md).
    pub const STREAM_KV: bool = false;
    /// The engine's and `routing.md`'s block size.
    pub const BLOCK_SIZE: u32 = 16;
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_in_flight: defaults::MAX_IN_FLIGHT,
            max_queue: defaults::MAX_QUEUE,
            request_timeout: defaults::REQUEST_TIMEOUT,
            prefill_timeout: defaults::PREFILL_TIMEOUT,
            decode_idle_timeout: defaults::DECODE_IDLE_TIMEOUT,
            max_prefill_attempts: defaults::MAX_PREFILL_ATTEMPTS,
            max_decode_attempts: defaults::MAX_DECODE_ATTEMPTS,
            default_max_tokens: defaults::DEFAULT_MAX_TOKENS,
            retry_budget: Default::default(),
            stream_kv: defaults::STREAM_KV,
        }
    }
}

/// Everything a router needs to start.
#[derive(Debug)]
pub struct RouterConfig {
    pub listen: SocketAddr,
    /// The GGUF file whose tokenizer and chat template the router uses (the weights are not read).
    pub model: PathBuf,
    pub served_model: String,
    /// Workers known at start (more may register themselves later).
    pub workers: Vec<WorkerSource>,
    /// Engine servers Tandem does not own (`crate::external`).
    pub external: Vec<crate::external::Engine>,
    pub external_settings: crate::external::ExternalSettings,
    /// How often DNS names among `workers` are resolved again.
    pub dns_refresh: Duration,
    pub identity: Identity,
    /// Where `identity` was read from: when the files change, new connections present the new certificates.
    pub certs: Option<kv_transfer::tls::IdentityFiles>,
    pub limits: Limits,
    pub scheduler: SchedulerConfig,
    /// Accepted API keys and the tenants they name.
    pub tenants: crate::tenants::Tenants,
    /// The key `/admin/*` and `/debug/*` require; `None`: they answer only on loopback.
    pub admin_key: Option<String>,
    /// How workers are followed (limits, liveness).
    pub follow: crate::cluster::FollowSettings,
    pub block_size: u32,
    /// Longest prompt plus output accepted; default: the model's context.
    pub max_model_len: Option<usize>,
    /// Seed of the scheduler's random choices (ties, temperature); default: from the clock.
    pub seed: Option<u64>,
    /// Record the traffic to this new file from the start (`crate::record`); also `POST /admin/recording`.
    pub record_trace: Option<PathBuf>,
    /// How the served model writes tool calls among its text (vLLM's `--tool-call-parser`): set, `tool_choice:
    /// auto` (the default with tools) is served, its calls parsed out of the answer; `None`: refused by name.
    pub tool_call_parser: Option<crate::http::tools::ToolParser>,
    /// How the served model marks its thinking (vLLM's `--reasoning-parser`): set, chat answers carry it apart as
    /// `reasoning_content` (and `reasoning`); `None`: the answer is all content.
    pub reasoning_parser: Option<crate::http::reasoning::ReasoningParser>,
    /// The Responses API's stored responses, at most this many MiB of JSON (`response_store`); 0 keeps none.
    pub responses_store_mb: usize,
    /// The recording started with `record_trace` writes each decision's candidates as scored.
    pub record_candidates: bool,
}

/// Why a router could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("model file: {0}")]
    Text(#[from] TextError),
    #[error("router address {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
    #[error("invalid scheduler config: {0}")]
    Scheduler(String),
    #[error("the model file does not state its context length; set max_model_len")]
    NoContextLength,
    #[error("recording the traffic: {0}")]
    Record(String),
    #[error("external worker {0}")]
    External(String),
    #[error(
        "the tool-call parser openai reads gpt-oss's calls as the reasoning parser openai_gptoss hands them on: set that reasoning parser too"
    )]
    Parsers,
}

/// A running router.
#[derive(Debug)]
pub struct RunningRouter {
    pub addr: SocketAddr,
    pub state: Arc<RouterState>,
    stop: watch::Sender<bool>,
    served: tokio::task::JoinHandle<()>,
}

fn clock_seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// `listener` with TCP_NODELAY on every connection it accepts. Streamed tokens are small writes: without it each
/// waits for the client's delayed ACK of the one before (about 40 ms on Linux); axum leaves the option as it is.
fn without_delay(listener: TcpListener) -> axum::serve::TapIo<TcpListener, fn(&mut tokio::net::TcpStream)> {
    fn set(tcp: &mut tokio::net::TcpStream) {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY not set");
        }
    }
    axum::serve::ListenerExt::tap_io(listener, set as fn(&mut tokio::net::TcpStream))
}

impl RunningRouter {
    /// Opens the text model, starts following every worker and serves HTTP. Call inside a tokio runtime.
    pub async fn start(config: RouterConfig) -> Result<RunningRouter, StartError> {
        config.scheduler.validate().map_err(|e| StartError::Scheduler(e.join("; ")))?;
        let harmony = config.reasoning_parser == Some(crate::http::reasoning::ReasoningParser::GptOss);
        if config.tool_call_parser == Some(crate::http::tools::ToolParser::OpenAi) && !harmony {
            return Err(StartError::Parsers);
        }
        let text = Arc::new(TextModel::open(&config.model)?);
        let max_model_len = config.max_model_len.or(text.context_len()).ok_or(StartError::NoContextLength)?;
        let (stop, stop_rx) = watch::channel(false);
        let model = ModelIdentity { fingerprint: text.fingerprint().to_string(), block_size: config.block_size };
        // A lease client; without one, unused leases simply expire on the prefill worker.
        let leases = kv_transfer::quic::QuicClient::new(&config.identity, SocketAddr::from(([0, 0, 0, 0], 0)))
            .map_err(|e| tracing::warn!(error = %e, "no KV lease client; unused leases will expire"))
            .ok()
            .map(Arc::new);
        let cluster = Cluster::new(model, config.identity, config.follow, stop_rx.clone());
        crate::discovery::start(&cluster, &config.workers, config.dns_refresh, stop_rx.clone());
        for engine in config.external {
            let addr = tokio::net::lookup_host(engine.authority())
                .await
                .map_err(|e| StartError::External(format!("{}: {e}", engine.url)))?
                .next()
                .ok_or_else(|| StartError::External(format!("{}: no address", engine.url)))?;
            let settings = config.external_settings.clone();
            let engine = engine.isolated(config.tenants.isolated());
            if let Err(e) = cluster.follow_external(addr, Arc::new(engine), settings) {
                return Err(StartError::External(e.to_string()));
            }
        }
        if let Some(files) = config.certs {
            let (cluster, leases, mut stop) = (Arc::clone(&cluster), leases.clone(), stop_rx.clone());
            tokio::spawn(async move {
                let apply = move |identity: Identity| {
                    if let Some(Err(e)) = leases.as_ref().map(|l| l.set_identity(&identity)) {
                        tracing::warn!(error = %e, "new certificates refused for the lease client");
                    }
                    cluster.set_identity(identity);
                };
                tokio::select! {
                    _ = kv_transfer::tls::watch(files, apply) => {}
                    _ = stop.wait_for(|&s| s) => {}
                }
            });
        }
        let recording = match &config.record_trace {
            Some(path) => Some(
                Recording::start(path, config.block_size, config.record_candidates)
                    .map_err(|e| StartError::Record(e.to_string()))?,
            ),
            None => None,
        };
        let state = Arc::new(RouterState {
            cluster,
            grammars: engine::grammar::Grammars::new(Arc::clone(&text)),
            text,
            served_model: config.served_model,
            tool_call_parser: config.tool_call_parser,
            reasoning_parser: config.reasoning_parser,
            max_model_len,
            scheduler: RwLock::new(config.scheduler),
            admission: Admission::new(config.limits.max_in_flight, config.limits.max_queue),
            limits: config.limits,
            tenants: config.tenants,
            responses: crate::response_store::ResponseStore::new(config.responses_store_mb << 20),
            admin_key: config.admin_key,
            route_state: Mutex::new(RouteState::seeded(config.seed.unwrap_or_else(clock_seed))),
            instance: crate::ids::instance_id(),
            sequence: AtomicU64::new(0),
            metrics: RouterMetrics::default(),
            leases,
            retry_budget: Default::default(),
            recording: Mutex::new(recording),
            tokenize_slots: tokio::sync::Semaphore::new(
                std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get),
            ),
        });
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|source| StartError::Listen { addr: config.listen, source })?;
        let addr = listener.local_addr().map_err(|source| StartError::Listen { addr: config.listen, source })?;
        let app = crate::http::app(Arc::clone(&state));
        let mut rx = stop_rx;
        let listener = without_delay(listener);
        let served = tokio::spawn(async move {
            let _ = axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
                .with_graceful_shutdown(async move {
                    let _ = rx.wait_for(|&s| s).await;
                })
                .await;
        });
        Ok(RunningRouter { addr, state, stop, served })
    }

    /// Stops accepting, lets in-flight requests finish for up to `grace`, then stops everything.
    pub async fn shutdown(self, grace: Duration) {
        let _ = self.stop.send(true);
        let mut served = self.served;
        if tokio::time::timeout(grace, &mut served).await.is_err() {
            served.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use axum::serve::Listener;

    use super::*;

    /// The HTTP listener's connections carry TCP_NODELAY (streamed tokens are small writes).
    #[tokio::test]
    async fn accepted_connections_send_small_writes_at_once() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let mut listener = without_delay(listener);
        let dial = tokio::spawn(tokio::net::TcpStream::connect(addr));
        let (tcp, _) = listener.accept().await;
        assert!(tcp.nodelay().expect("the option reads"), "TCP_NODELAY on the accepted socket");
        dial.await.expect("joins").expect("connected");
    }
}
