//! A Tandem worker: the engine behind the gRPC worker service, KV leases served over QUIC with mutual TLS, and
//! the pull of missing blocks on the decode side. One library for every role; the `prefill-worker` and
//! `decode-worker` binaries and `tandem worker` start it.

#![forbid(unsafe_code)]

pub mod cli;
pub mod convert;
pub mod grpc_tls;
pub mod host;
pub mod leases;
pub mod metrics;
pub mod pull;
pub mod register;
pub mod requests;
mod service;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::generate::{BackendChoice, Engine, EngineConfig, EngineError, EngineHandle, EngineStats, StepHold};
use kv_transfer::quic::{QuicClient, QuicServer, TransferError};
use kv_transfer::tls::Identity;
use proto::worker as pb;
use proto::worker::worker_server::WorkerServer;
use service::WorkerService;
pub use service::{DEFAULT_LOAD_INTERVAL, EVENT_HEARTBEAT};
use tokio::sync::oneshot;

/// How long a prefill worker keeps a prompt's KV for a decode worker: long enough to choose one and pull.
pub const DEFAULT_LEASE_TTL: Duration = kv_transfer::lease::DEFAULT_LEASE;
/// How long a stopping worker still takes new calls after it has told routers it is going (its streams ended).
pub const DRAIN_NOTICE: Duration = Duration::from_millis(500);
/// How long shutdown waits for in-flight requests before it stops them.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// A pull that takes longer than this is abandoned (the router then re-prefills elsewhere).
pub const DEFAULT_PULL_TIMEOUT: Duration = Duration::from_secs(10);

/// What a worker does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
    Both,
}

/// Everything a worker needs to start.
#[derive(Debug)]
pub struct WorkerConfig {
    pub role: Role,
    pub model: PathBuf,
    pub model_id: String,
    pub engine: EngineConfig,
    /// gRPC listen address (port 0: any free port).
    pub grpc: SocketAddr,
    /// KV transfer (QUIC) listen address.
    pub transfer: SocketAddr,
    /// Prometheus metrics (`/metrics`) listen address; `None`: not served.
    pub metrics: Option<SocketAddr>,
    pub identity: Identity,
    pub lease_ttl: Duration,
    pub pull_timeout: Duration,
    /// Shared-memory directory (`/dev/shm`) for the engine's device KV store, which same-host decode workers map
    /// to read leased blocks; `None`: QUIC only.
    pub shm_dir: Option<PathBuf>,
    /// Most bytes of KV held under leases at once (pinned device blocks; never more than half
    /// the device tier pinned, whatever this says); a prefill past it is refused with RESOURCE_EXHAUSTED (the
    /// router tries another worker).
    pub max_leased_bytes: u64,
    /// What the router calls this worker (a pod or container name); empty: its address.
    pub name: String,
    /// The DNS name this worker's certificate carries, which decode workers verify when they pull KV from it:
    /// a role identity shared by every replica, not an address (pods and containers move).
    pub tls_name: String,
    /// Where `identity` was read from: when the files change (a rotation), the worker presents the new
    /// certificates on its next connections without a restart. `None`: the identity is fixed.
    pub certs: Option<kv_transfer::tls::IdentityFiles>,
}

impl WorkerConfig {
    /// A worker on loopback (gRPC and transfer on any free port, no metrics endpoint, no shared memory) with the
    /// default engine, lease and pull settings; change fields with struct update syntax.
    pub fn local(role: Role, model: PathBuf, identity: Identity) -> WorkerConfig {
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        WorkerConfig {
            role,
            model,
            model_id: DEFAULT_MODEL_ID.to_string(),
            engine: EngineConfig::default(),
            grpc: loopback,
            transfer: loopback,
            metrics: None,
            identity,
            lease_ttl: DEFAULT_LEASE_TTL,
            pull_timeout: DEFAULT_PULL_TIMEOUT,
            shm_dir: None,
            max_leased_bytes: leases::default_cap(),
            name: String::new(),
            // Every certificate `DevCa::issue` makes carries it.
            tls_name: "localhost".to_string(),
            certs: None,
        }
    }
}

/// The worker protocol this build speaks (`InfoResponse.protocol_version`). 2: `InfoResponse.name` and
/// `KvHandle.server_name` (peers verified by role identity, not address). 3: `Sampling`'s logits rules (penalties,
/// `logit_bias`, `min_tokens`, `stop_token_ids`, `prior_generated`), which a version-2 worker would ignore. 4:
/// `Sampling.logprobs` (log-probabilities on `Token` and `PrefillResponse`) and `Sampling.grammar` (structured
/// outputs). 5: `Prefetch`, and a prefill's lease reservation credited with the live leases of its own request
/// (a streamed prompt's pieces). 6: `Sampling.min_p`. 7: `Sampling.prompt_logprobs` (on the first `Token` and in
/// `PrefillResponse`). 8: `Sampling.allowed_token_ids` and `Sampling.bad_words`. 9: `Sampling.priority`. 10: `Grammar` of kind "lark". 11:
/// `Grammar.thinking` (a reasoning model's thinking before what the grammar holds). 12: `Grammar` of kind "gbnf".
/// 13: `Thinking.THINKING_CHANNEL` (Gemma 4's thinking channel before what the grammar holds).
/// A router accepts this and the
/// versions back to 4 (`router::cluster::OLDEST_PROTOCOL`), and sends requests that use something newer only to
/// workers that know it.
pub const PROTOCOL_VERSION: u32 = 13;

/// The first protocol whose workers apply `Sampling`'s logits rules.
pub const LOGITS_RULES_PROTOCOL: u32 = 3;

/// The first protocol whose workers report log-probabilities and apply grammars.
pub const LOGPROBS_PROTOCOL: u32 = 4;

/// The first protocol whose workers take a streamed prompt's pieces (`Prefetch` on the decode side, the lease
/// credit on the prefill side).
pub const STREAM_KV_PROTOCOL: u32 = 5;

/// The first protocol whose workers apply `Sampling.min_p`.
pub const MIN_P_PROTOCOL: u32 = 6;

/// The first protocol whose workers report the prompt's log-probabilities (`Sampling.prompt_logprobs`).
pub const PROMPT_LOGPROBS_PROTOCOL: u32 = 7;

/// The first protocol whose workers apply `Sampling.allowed_token_ids` and `Sampling.bad_words`.
pub const TOKEN_RULES_PROTOCOL: u32 = 8;

/// The first protocol whose workers queue by `Sampling.priority`.
pub const PRIORITY_PROTOCOL: u32 = 9;

/// The first protocol whose workers take a grammar in Lark (`Grammar::Lark`; an older one refuses the kind).
pub const LARK_PROTOCOL: u32 = 10;

/// The first protocol whose workers hold a grammar after a reasoning model's thinking (`Grammar.thinking`; an
/// older one would hold it from the first token).
pub const THINKING_PROTOCOL: u32 = 11;

/// The first protocol whose workers take a grammar in GBNF (`Grammar::Gbnf`; an older one refuses the kind).
pub const GBNF_PROTOCOL: u32 = 12;

/// The first protocol whose workers hold a grammar after Gemma 4's thinking channel (`THINKING_CHANNEL`; an older
/// one refuses the value).
pub const CHANNEL_PROTOCOL: u32 = 13;

/// What a worker calls its model when nothing else is said (the embedded one).
pub const DEFAULT_MODEL_ID: &str = "smollm2-135m-instruct";

/// Why a worker could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Transfer(#[from] TransferError),
    #[error("{what}: {source}")]
    Io { what: &'static str, source: std::io::Error },
    #[error("gRPC TLS: {0}")]
    Tls(String),
}

/// A running worker.
#[derive(Debug)]
pub struct RunningWorker {
    pub grpc: SocketAddr,
    pub transfer: SocketAddr,
    pub metrics: Option<SocketAddr>,
    metrics_task: Option<tokio::task::JoinHandle<()>>,
    service: Arc<WorkerService>,
    stop: oneshot::Sender<()>,
    stopping: tokio::sync::watch::Sender<bool>,
    /// Set when the grace period is over: every generation still running is cut off.
    aborting: tokio::sync::watch::Sender<bool>,
    served: tokio::task::JoinHandle<()>,
    transfer_server: QuicServer,
    expiry: tokio::task::JoinHandle<()>,
    /// Follows the certificate files (when they are files).
    reload: Option<tokio::task::JoinHandle<()>>,
}

fn instance_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    format!("{:016x}", h.finish())
}

impl RunningWorker {
    /// Loads the model and starts serving. Must be called inside a multi-threaded tokio runtime.
    pub async fn start(config: WorkerConfig) -> Result<RunningWorker, StartError> {
        let instance = instance_id();
        // Shared memory only where this worker holds its place in the directory (and so sweeps what crashed
        // workers left there).
        let shm = config.shm_dir.as_deref().and_then(|dir| match kv_transfer::shm::ShmDir::open(dir, &instance) {
            Ok(d) => {
                if d.swept() > 0 {
                    tracing::info!(dir = %dir.display(), files = d.swept(), "removed stale shared-memory files");
                }
                Some(Arc::new(d))
            }
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "no shared-memory path; KV moves over QUIC");
                None
            }
        });
        // With a place in a shared-memory directory, the device KV store lives there: same-host decode workers map
        // leased blocks straight out of it (no copy per lease).
        let mut engine_config = config.engine.clone();
        engine_config.device_file = shm.as_ref().map(|d| d.store_path());
        let engine = Engine::open(&config.model, engine_config)?;
        if let Some(why) = engine.device_file_refused() {
            tracing::warn!(error = %why, "the KV store could not be made in shared memory; KV leaves over QUIC");
        }
        let store = engine.device_file().map(std::path::Path::to_path_buf);
        let layout = convert::layout_desc(&engine.kv_layout());
        let fingerprint = engine.fingerprint().to_string();
        let max_model_len = engine.max_model_len() as u32;
        let tiers = [
            (pb::Tier::Device, config.engine.kv_blocks),
            (pb::Tier::Host, config.engine.host_blocks),
            (pb::Tier::Disk, config.engine.disk_blocks),
        ]
        .into_iter()
        .map(|(t, n)| pb::TierCapacity { tier: t as i32, blocks: n as u64 })
        .collect();
        // Leases pin the engine's device blocks: at most half of them, however large the cap.
        let pinnable = leases::pool_cap(config.engine.kv_blocks, engine.block_bytes() as u64);
        let handle =
            Arc::new(EngineHandle::start(engine).map_err(|source| StartError::Io { what: "engine thread", source })?);
        let leases = Arc::new(leases::Leases::new(config.max_leased_bytes.min(pinnable)));
        let transfer_server = QuicServer::bind(config.transfer, &config.identity, Arc::clone(&leases) as _)?;
        let transfer =
            transfer_server.local_addr().map_err(|source| StartError::Io { what: "transfer address", source })?;
        let client_bind = SocketAddr::new(transfer.ip(), 0);
        let client = Arc::new(QuicClient::new(&config.identity, client_bind)?);
        let role = match config.role {
            Role::Prefill => pb::Role::Prefill,
            Role::Decode => pb::Role::Decode,
            Role::Both => pb::Role::Both,
        };
        let info = pb::InfoResponse {
            role: role as i32,
            model_id: config.model_id.clone(),
            model_fingerprint: fingerprint,
            block_size: layout.block_tokens,
            layout: Some(convert::layout_to_pb(&layout)),
            tiers,
            transfer_endpoint: transfer.to_string(),
            instance_id: instance,
            max_model_len,
            max_num_batched_tokens: config.engine.max_batched_tokens as u32,
            host_id: host::host_id(config.shm_dir.as_deref()),
            protocol_version: PROTOCOL_VERSION,
            name: config.name.clone(),
        };
        let (stopping, stopping_rx) = tokio::sync::watch::channel(false);
        let (aborting, aborting_rx) = tokio::sync::watch::channel(false);
        let metrics = Arc::new(metrics::WorkerMetrics::default());
        // Other workers' KV stores this one keeps mapped (on one host): let go soon after their owners stop.
        let stores = Arc::new(kv_transfer::shm::StoreMaps::default());
        let puller = pull::Puller {
            client: Arc::clone(&client),
            timeout: config.pull_timeout,
            fingerprint: info.model_fingerprint.clone(),
            layout,
            same_host: shm.as_ref().map(|d| pull::SameHost {
                host_id: info.host_id.clone(),
                dir: d.dir().to_path_buf(),
                stores: Arc::clone(&stores),
            }),
            metrics: Arc::clone(&metrics),
            modelled: match &config.engine.backend {
                BackendChoice::Mock(m) => {
                    Some(pull::ModelledTransfer { profile: m.profile.clone(), speedup: m.speedup })
                }
                BackendChoice::Cpu | BackendChoice::Cuda(_) => None,
            },
        };
        let service = Arc::new(WorkerService {
            engine: handle,
            info,
            layout,
            leases: Arc::clone(&leases),
            puller,
            lease_ttl: config.lease_ttl,
            in_flight: Default::default(),
            metrics,
            _shm: shm,
            store,
            tls_name: config.tls_name.clone(),
            stopping: stopping_rx,
            aborting: aborting_rx,
        });
        let listener = tokio::net::TcpListener::bind(config.grpc)
            .await
            .map_err(|source| StartError::Io { what: "gRPC address", source })?;
        let grpc = listener.local_addr().map_err(|source| StartError::Io { what: "gRPC address", source })?;
        let mut server = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(grpc_tls::KEEPALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(grpc_tls::KEEPALIVE_TIMEOUT));
        let tls = grpc_tls::server_config(&config.identity).map_err(|e| StartError::Tls(e.to_string()))?;
        let (tls_now, tls_current) = tokio::sync::watch::channel(tls);
        let (stop, stopped) = oneshot::channel::<()>();
        let incoming = grpc_tls::incoming(listener, tls_current);
        // Rotated certificates: the gRPC service, the transfer server and the transfer client take them for their
        // next connections.
        let reload = config.certs.clone().map(|files| {
            let quic = transfer_server.handle();
            let client = Arc::clone(&client);
            tokio::spawn(kv_transfer::tls::watch(files, move |identity| {
                match grpc_tls::server_config(&identity) {
                    Ok(c) => {
                        tls_now.send_replace(c);
                    }
                    Err(e) => tracing::warn!(error = %e, "new certificates refused for gRPC"),
                }
                for (what, r) in [
                    ("transfer server", quic.set_identity(&identity)),
                    ("transfer client", client.set_identity(&identity)),
                ] {
                    if let Err(e) = r {
                        tracing::warn!(error = %e, "new certificates refused for the {what}");
                    }
                }
            }))
        });
        let svc = WorkerServer::from_arc(Arc::clone(&service));
        let served = tokio::spawn(async move {
            let _ = server
                .add_service(svc)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                })
                .await;
        });
        let (metrics, metrics_task) = match config.metrics {
            None => (None, None),
            Some(addr) => {
                let (addr, task) = serve_metrics(addr, Arc::clone(&service)).await?;
                (Some(addr), Some(task))
            }
        };
        let expiry = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                leases.expire(Instant::now());
                // A stat per kept store (a few, on tmpfs).
                stores.sweep();
            }
        });
        Ok(RunningWorker {
            grpc,
            transfer,
            metrics,
            metrics_task,
            service,
            stop,
            stopping,
            aborting,
            served,
            transfer_server,
            expiry,
            reload,
        })
    }

    /// The engine's counters and occupancy (as last published; never waits for a step).
    pub fn stats(&self) -> EngineStats {
        self.service.engine.stats()
    }

    /// Calls in flight (`Prefill` and `Generate`, until each ends).
    pub fn calls_in_flight(&self) -> usize {
        self.service.in_flight.len()
    }

    /// Holds the engine before its next step until the hold is dropped, as a long step would (tests, diagnostics).
    pub fn hold_engine_steps(&self) -> StepHold {
        self.service.engine.hold_steps()
    }

    /// Blocks this worker has pulled from others.
    pub fn pulled_blocks(&self) -> u64 {
        let m = &self.service.metrics;
        m.pulled_blocks(metrics::Transport::Quic) + m.pulled_blocks(metrics::Transport::Shm)
    }

    /// Blocks this worker copied out of another worker's shared-memory region.
    pub fn shm_blocks(&self) -> u64 {
        self.service.metrics.pulled_blocks(metrics::Transport::Shm)
    }

    /// Whether the engine's KV store lives in a shared-memory file (same-host readers map leased blocks from it).
    pub fn shared_store(&self) -> bool {
        self.service.store.is_some()
    }

    /// Leases currently held for readers.
    pub fn live_leases(&self) -> usize {
        self.service.leases.len()
    }

    /// Bytes held under leases (pinned in the engine's device tier).
    pub fn leased_bytes(&self) -> u64 {
        self.service.leases.bytes()
    }

    /// Ends event and load streams (routers drop the worker), takes new calls for [`DRAIN_NOTICE`] more, then
    /// stops accepting them, lets in-flight generations finish within what is left of `grace`, then stops
    /// everything and closes the transfer endpoint.
    pub async fn shutdown(self, grace: Duration) {
        let _ = self.stopping.send(true);
        // Routers drop this worker as soon as its event and load streams end (now), but a call they routed here a
        // moment before still arrives: for a short notice it is taken (and drained) rather than refused and
        // counted as a failed attempt elsewhere. The notice comes out of the grace.
        let notice = DRAIN_NOTICE.min(grace);
        tokio::time::sleep(notice).await;
        let _ = self.stop.send(());
        let mut served = self.served;
        if tokio::time::timeout(grace - notice, &mut served).await.is_err() {
            // Connections run on their own tasks: end their streams, which cancels the sequences behind them.
            let _ = self.aborting.send(true);
            served.abort();
        }
        self.expiry.abort();
        if let Some(t) = self.reload {
            t.abort();
        }
        if let Some(t) = self.metrics_task {
            t.abort();
        }
        self.transfer_server.close().await;
    }
}

/// Serves `/metrics`, `/health` and `/ready` on `addr`.
async fn serve_metrics(
    addr: SocketAddr,
    service: Arc<WorkerService>,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), StartError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Io { what: "metrics address", source })?;
    let bound = listener.local_addr().map_err(|source| StartError::Io { what: "metrics address", source })?;
    let ready = Arc::clone(&service);
    let app = axum::Router::new()
        // Liveness: the process answers. Readiness: it takes work (not draining); probes and health checks use
        // these, since a container image may hold no gRPC client.
        .route("/health", axum::routing::get(|| async { "ok" }))
        .route(
            "/ready",
            axum::routing::get(move || {
                let draining = *ready.stopping.borrow();
                async move {
                    if draining {
                        (axum::http::StatusCode::SERVICE_UNAVAILABLE, "draining")
                    } else {
                        (axum::http::StatusCode::OK, "ready")
                    }
                }
            }),
        )
        .route(
            "/metrics",
            axum::routing::get(move || {
                let service = Arc::clone(&service);
                async move {
                    let held = metrics::Held {
                        leases: service.leases.len(),
                        leased_bytes: service.leases.bytes(),
                        leased_bytes_cap: service.leases.cap(),
                        calls: service.in_flight.len(),
                    };
                    let text = metrics::render(&service.engine.stats(), &service.metrics, held);
                    ([("content-type", "text/plain; version=0.0.4")], text)
                }
            }),
        );
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((bound, task))
}
