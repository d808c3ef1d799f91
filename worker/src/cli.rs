//! The worker's command line and configuration: a TOML file, then `TANDEM_*` environment variables, then flags
//! (later sources win). Unknown keys are errors; every problem is reported at once; every default is a named
//! constant with a reason.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use engine::backend::TimingProfile;
use engine::backend::mock::MockSettings;
use engine::generate::{BackendChoice, EngineConfig};
use kv_transfer::tls::Identity;
use serde::Deserialize;

use crate::{DEFAULT_LEASE_TTL, DEFAULT_PULL_TIMEOUT, DEFAULT_SHUTDOWN_GRACE, Role, RunningWorker, WorkerConfig};

/// Worker gRPC port (`system.md`: 9000+).
pub const DEFAULT_GRPC: &str = "127.0.0.1:9000";
/// Worker KV transfer (QUIC/UDP) port (`system.md`: 9100+).
pub const DEFAULT_TRANSFER: &str = "127.0.0.1:9100";
/// Worker metrics port (`system.md`: 9200+).
pub const DEFAULT_METRICS: &str = "127.0.0.1:9200";

/// Settings as given by any source; all optional so that sources can be layered.
#[derive(Debug, Default, Deserialize, clap::Args)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// prefill, decode or both.
    #[arg(long, env = "TANDEM_ROLE")]
    pub role: Option<String>,
    /// GGUF model file (default: the embedded model, fetched when missing).
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: Option<PathBuf>,
    /// Name the router and clients use for the model.
    #[arg(long, env = "TANDEM_MODEL_ID")]
    pub model_id: Option<String>,
    /// gRPC listen address.
    #[arg(long, env = "TANDEM_GRPC_ADDR")]
    pub grpc_addr: Option<SocketAddr>,
    /// KV transfer (QUIC) listen address.
    #[arg(long, env = "TANDEM_TRANSFER_ADDR")]
    pub transfer_addr: Option<SocketAddr>,
    /// Prometheus metrics listen address (`/metrics`).
    #[arg(long, env = "TANDEM_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Directory with ca.pem, <name>.pem and <name>.key (default: $TANDEM_HOME/certs, made by `tandem certs init`).
    #[arg(long, env = "TANDEM_CERTS_DIR")]
    pub certs_dir: Option<PathBuf>,
    /// This worker's certificate name in the certs directory (default: `<role>-0`).
    #[arg(long, env = "TANDEM_CERT_NAME")]
    pub cert_name: Option<String>,
    /// The DNS name in this worker's certificate that decode workers verify when they pull KV from it: a role
    /// identity such as `prefill` or a headless Service's name, shared by every replica (default: the
    /// certificate name, which `tandem certs init` writes into the certificate).
    #[arg(long, env = "TANDEM_TLS_NAME")]
    pub tls_name: Option<String>,
    /// What the router calls this worker in `/debug/route`, metrics and traces (a pod or container name;
    /// default: its address).
    #[arg(long, env = "TANDEM_WORKER_NAME")]
    pub name: Option<String>,
    /// Compute threads (default: all cores).
    #[arg(long, env = "TANDEM_THREADS")]
    pub threads: Option<NonZeroUsize>,
    /// What computes steps: `cpu` (the model's forward pass), `mock` (no compute; each step takes the time its
    /// timing profile gives), or `cuda[:N]` (the forward pass on CUDA device N, in a build with `--features cuda`;
    /// checked against the CPU engine on an H100, not yet fast: docs/cuda.md).
    #[arg(long, env = "TANDEM_ENGINE")]
    pub engine: Option<String>,
    /// How the cpu engine computes matmuls over quantized weights: `reference` (f32 activations, what the golden
    /// tests check) or `fast` (8-bit activations and integer dot products in decode-sized steps, as llama.cpp;
    /// see docs/performance.md) (default: reference).
    #[arg(long, env = "TANDEM_PRECISION")]
    pub precision: Option<String>,
    /// The mock's timing profile: `gpu-default`, `cpu-smollm2` or a TOML file (default: gpu-default).
    #[arg(long, env = "TANDEM_PROFILE")]
    pub profile: Option<String>,
    /// The mock divides every modelled duration by this (default 1).
    #[arg(long, env = "TANDEM_SPEEDUP")]
    pub speedup: Option<f64>,
    /// Bytes of one stand-in KV block of the mock (transfers are charged for the profile's size).
    #[arg(long, env = "TANDEM_MOCK_BLOCK_BYTES")]
    pub mock_block_bytes: Option<usize>,
    /// What SIGUSR1 does to the mock's stand-in device until SIGUSR2: `errors` (every call fails at once) or
    /// `stall` (its steps hang while the process answers) (default: errors).
    #[arg(long, env = "TANDEM_MOCK_FAULT")]
    pub mock_fault: Option<String>,
    /// Device tier size in blocks (default: 1024 for cpu, the profile's for mock).
    #[arg(long, env = "TANDEM_KV_BLOCKS")]
    pub kv_blocks: Option<usize>,
    /// Host tier size in blocks (0: none; default: twice the device tier).
    #[arg(long, env = "TANDEM_HOST_BLOCKS")]
    pub host_blocks: Option<usize>,
    /// Disk tier size in blocks (0: none; default: four times the device tier).
    #[arg(long, env = "TANDEM_DISK_BLOCKS")]
    pub disk_blocks: Option<usize>,
    /// Disk tier directory, one per worker (default: $TANDEM_HOME/kv/<cert name>).
    #[arg(long, env = "TANDEM_DISK_DIR")]
    pub disk_dir: Option<PathBuf>,
    #[arg(long, env = "TANDEM_MAX_NUM_SEQS")]
    pub max_num_seqs: Option<usize>,
    #[arg(long, env = "TANDEM_MAX_BATCHED_TOKENS")]
    pub max_batched_tokens: Option<usize>,
    #[arg(long, env = "TANDEM_MAX_MODEL_LEN")]
    pub max_model_len: Option<usize>,
    /// Shared-memory directory for the KV store that same-host decode workers read leased KV from; "off": QUIC only.
    #[arg(long, env = "TANDEM_SHM_DIR")]
    pub shm_dir: Option<String>,
    /// How long a prefilled prompt's KV is held for a decode worker, in milliseconds.
    #[arg(long, env = "TANDEM_LEASE_TTL_MS")]
    pub lease_ttl_ms: Option<u64>,
    /// Most bytes of prompt KV held for decode workers at once (default: an eighth of the machine's memory).
    #[arg(long, env = "TANDEM_MAX_LEASED_BYTES")]
    pub max_leased_bytes: Option<u64>,
    /// How long shutdown waits for in-flight requests, in milliseconds.
    #[arg(long, env = "TANDEM_SHUTDOWN_GRACE_MS")]
    pub shutdown_grace_ms: Option<u64>,
    /// Register with the router at this HTTP address (host:port) on start, and leave it on shutdown.
    #[arg(long, env = "TANDEM_REGISTER_WITH")]
    pub register_with: Option<String>,
    /// The gRPC address the router should dial (default: the gRPC listen address).
    #[arg(long, env = "TANDEM_ADVERTISE_ADDR")]
    pub advertise_addr: Option<SocketAddr>,
    /// The router's admin key, sent with registrations (a router without one takes them only from loopback).
    #[arg(long, env = "TANDEM_REGISTER_KEY")]
    pub register_key: Option<String>,
}

/// The worker command line.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A TOML file with any of the settings below (snake_case keys); flags and environment override it.
    #[arg(long, env = "TANDEM_CONFIG")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub settings: Settings,
}

macro_rules! layer {
    ($top:expr, $bottom:expr, $($field:ident),+) => {
        Settings { $($field: $top.$field.or($bottom.$field)),+ }
    };
}

impl Settings {
    /// `self` over `below`: a value set here wins.
    fn over(self, below: Settings) -> Settings {
        layer!(
            self,
            below,
            role,
            model,
            model_id,
            grpc_addr,
            transfer_addr,
            metrics_addr,
            certs_dir,
            cert_name,
            tls_name,
            name,
            threads,
            engine,
            precision,
            profile,
            speedup,
            mock_block_bytes,
            mock_fault,
            kv_blocks,
            host_blocks,
            disk_blocks,
            disk_dir,
            max_num_seqs,
            max_batched_tokens,
            max_model_len,
            shm_dir,
            lease_ttl_ms,
            max_leased_bytes,
            shutdown_grace_ms,
            register_with,
            advertise_addr,
            register_key
        )
    }
}

/// A worker process's resolved settings.
#[derive(Debug)]
pub struct Resolved {
    pub config: WorkerConfig,
    /// What SIGUSR1 does to a mock worker's device.
    pub mock_fault: MockFault,
    pub grace: Duration,
    /// Where to register, with the advertised address still to be settled against the bound one.
    pub register: Option<(String, Option<SocketAddr>, Option<String>)>,
}

/// A resolved configuration, or every reason it is not one.
pub fn resolve(args: Args, default_role: Option<Role>) -> Result<Resolved, String> {
    let file = match &args.config {
        None => Settings::default(),
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
            toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?
        }
    };
    let s = args.settings.over(file);
    let mut problems = Vec::new();
    let role = match (s.role.as_deref(), default_role) {
        (Some("prefill"), _) => Role::Prefill,
        (Some("decode"), _) => Role::Decode,
        (Some("both"), _) => Role::Both,
        (None, Some(r)) => r,
        (Some(other), _) => {
            problems.push(format!("role {other:?} is not one of prefill, decode, both"));
            Role::Both
        }
        (None, None) => {
            problems.push("role is required (prefill, decode or both)".to_string());
            Role::Both
        }
    };
    let role_name = match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Both => "worker",
    };
    let certs_dir = match s.certs_dir.clone() {
        Some(d) => Some(d),
        None => engine::fetch::tandem_home().map(|h| h.join("certs")).map_err(|e| problems.push(e.to_string())).ok(),
    };
    let cert_name = s.cert_name.clone().unwrap_or_else(|| format!("{role_name}-0"));
    // Replicas of a role share a certificate, and may share TANDEM_HOME (one volume in a compose file): the
    // worker's own name keeps their disk tiers apart.
    let engine = engine_config(&s, s.name.as_deref().unwrap_or(&cert_name), &mut problems);
    let identity = certs_dir.as_deref().and_then(|dir| match load_identity(dir, &cert_name) {
        Ok(id) => Some(id),
        Err(e) => {
            problems.push(e);
            None
        }
    });
    let model = match s.model {
        Some(m) => Some(m),
        None => match engine::fetch::ensure_default_model(&engine::fetch::Quiet) {
            Ok(p) => Some(p),
            Err(e) => {
                problems.push(e.to_string());
                None
            }
        },
    };
    let mock_fault = match s.mock_fault.as_deref() {
        None | Some("errors") => MockFault::Errors,
        Some("stall") => MockFault::Stall,
        Some(other) => {
            problems.push(format!("mock_fault {other:?} is not one of errors, stall"));
            MockFault::Errors
        }
    };
    let parse_addr = |a: &str| a.parse::<SocketAddr>().map_err(|e| e.to_string());
    let grpc = s.grpc_addr.map_or_else(|| parse_addr(DEFAULT_GRPC), Ok);
    let transfer = s.transfer_addr.map_or_else(|| parse_addr(DEFAULT_TRANSFER), Ok);
    let metrics = s.metrics_addr.map_or_else(|| parse_addr(DEFAULT_METRICS), Ok);
    match (problems.is_empty(), identity, model, grpc, transfer, metrics) {
        (true, Some(identity), Some(model), Ok(grpc), Ok(transfer), Ok(metrics)) => Ok(Resolved {
            register: s.register_with.map(|r| (r, s.advertise_addr, s.register_key)),
            mock_fault,
            config: WorkerConfig {
                role,
                model,
                model_id: s.model_id.unwrap_or_else(|| "smollm2-135m-instruct".to_string()),
                engine,
                grpc,
                transfer,
                metrics: Some(metrics),
                identity,
                lease_ttl: s.lease_ttl_ms.map_or(DEFAULT_LEASE_TTL, Duration::from_millis),
                pull_timeout: DEFAULT_PULL_TIMEOUT,
                shm_dir: match s.shm_dir.as_deref() {
                    Some("off") => None,
                    Some(dir) => Some(PathBuf::from(dir)),
                    None => Some(PathBuf::from(kv_transfer::shm::DEFAULT_DIR)).filter(|d| d.is_dir()),
                },
                max_leased_bytes: s.max_leased_bytes.unwrap_or_else(crate::leases::default_cap),
                name: s.name.unwrap_or_default(),
                tls_name: s.tls_name.unwrap_or_else(|| cert_name.clone()),
                certs: certs_dir.map(|dir| kv_transfer::tls::IdentityFiles { dir, name: cert_name.clone() }),
            },
            grace: s.shutdown_grace_ms.map_or(DEFAULT_SHUTDOWN_GRACE, Duration::from_millis),
        }),
        (_, _, _, grpc, transfer, metrics) => {
            problems.extend(grpc.err().map(|e| format!("grpc address: {e}")));
            problems.extend(transfer.err().map(|e| format!("transfer address: {e}")));
            problems.extend(metrics.err().map(|e| format!("metrics address: {e}")));
            Err(problems.join("\n"))
        }
    }
}

/// Host tier size as a multiple of the device tier, unless set: room to keep evicted prefixes a while.
pub const HOST_TIER_FACTOR: usize = 2;
/// Disk tier size as a multiple of the device tier, unless set.
pub const DISK_TIER_FACTOR: usize = 4;

/// The engine the settings ask for, with tiers on unless sized to 0: a host tier of [`HOST_TIER_FACTOR`] times the
/// device tier and a disk tier of [`DISK_TIER_FACTOR`] times it under `$TANDEM_HOME/kv/<worker>`.
pub fn engine_config(s: &Settings, worker: &str, problems: &mut Vec<String>) -> EngineConfig {
    let defaults = EngineConfig::default();
    let (backend, device_default) = backend(s, problems);
    let kv_blocks = s.kv_blocks.unwrap_or(device_default);
    let disk_blocks = s.disk_blocks.unwrap_or(DISK_TIER_FACTOR * kv_blocks);
    let disk_dir = match &s.disk_dir {
        Some(d) => Some(d.clone()),
        None if disk_blocks > 0 => engine::fetch::tandem_home()
            .map(|h| h.join("kv").join(worker))
            .map_err(|e| problems.push(e.to_string()))
            .ok(),
        None => None,
    };
    let precision = match s.precision.as_deref().map(str::parse) {
        None => defaults.precision,
        Some(Ok(p)) => p,
        Some(Err(e)) => {
            problems.push(e);
            defaults.precision
        }
    };
    if s.precision.is_some() && !matches!(backend, BackendChoice::Cpu) {
        problems.push("precision applies to the cpu engine only".to_string());
    }
    EngineConfig {
        backend,
        precision,
        threads: s.threads,
        kv_blocks,
        host_blocks: s.host_blocks.unwrap_or(HOST_TIER_FACTOR * kv_blocks),
        disk_blocks,
        disk_dir,
        max_num_seqs: s.max_num_seqs.unwrap_or(defaults.max_num_seqs),
        max_batched_tokens: s.max_batched_tokens.unwrap_or(defaults.max_batched_tokens),
        max_model_len: s.max_model_len,
        ..defaults
    }
}

/// The backend the settings ask for, and the device tier size it implies when none is set.
fn backend(s: &Settings, problems: &mut Vec<String>) -> (BackendChoice, usize) {
    let cpu = (BackendChoice::Cpu, engine::generate::DEFAULT_KV_BLOCKS);
    let mock_only = [
        ("profile", s.profile.is_some()),
        ("speedup", s.speedup.is_some()),
        ("mock_block_bytes", s.mock_block_bytes.is_some()),
        ("mock_fault", s.mock_fault.is_some()),
    ];
    match s.engine.as_deref() {
        None | Some("cpu") => {
            for (name, _) in mock_only.iter().filter(|(_, set)| *set) {
                problems.push(format!("{name} applies to the mock engine only (--engine mock)"));
            }
            cpu
        }
        Some("mock") => {
            let mut mock = MockSettings::gpu_default();
            match TimingProfile::load(s.profile.as_deref().unwrap_or("gpu-default")) {
                Ok(p) => mock.profile = p,
                Err(e) => problems.push(e.to_string()),
            }
            mock.speedup = s.speedup.unwrap_or(1.0);
            mock.block_bytes = s.mock_block_bytes.unwrap_or(mock.block_bytes);
            mock.context_len = s.max_model_len.unwrap_or(mock.context_len);
            let device = mock.profile.device_blocks.unwrap_or(engine::generate::DEFAULT_KV_BLOCKS);
            (BackendChoice::Mock(Box::new(mock)), device)
        }
        Some(other) => match other.parse::<engine::backend::Device>() {
            Ok(device @ engine::backend::Device::Cuda(_)) => {
                for (name, _) in mock_only.iter().filter(|(_, set)| *set) {
                    problems.push(format!("{name} applies to the mock engine only (--engine mock)"));
                }
                if let Err(e) = device.check() {
                    problems.push(e);
                }
                (device.into(), engine::generate::DEFAULT_KV_BLOCKS)
            }
            _ => {
                problems.push(format!("engine {other:?} is not one of cpu, mock, cuda[:N]"));
                cpu
            }
        },
    }
}

/// This component's certificate from `dir`, with what to do when it is missing.
pub fn load_identity(dir: &Path, name: &str) -> Result<Identity, String> {
    Identity::load(dir, name)
        .map_err(|e| format!("certificate {name:?}: {e} (make them with `tandem certs init --dir {}`)", dir.display()))
}

/// Runs a worker until SIGINT or SIGTERM, then shuts it down gracefully.
pub fn run(args: Args, default_role: Option<Role>) -> ExitCode {
    let Resolved { config, grace, register, mock_fault } = match resolve(args, default_role) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let service = match config.role {
        Role::Prefill => "tandem-prefill-worker",
        Role::Decode => "tandem-decode-worker",
        Role::Both => "tandem-worker",
    };
    let process = match telemetry::Process::start(service) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let fault = match &config.engine.backend {
        BackendChoice::Mock(mock) => Some(mock.fault.clone()),
        _ => None,
    };
    process.block_on(async move {
        if let Some(fault) = fault {
            tokio::spawn(follow_fault_signals(fault, mock_fault));
        }
        let worker = match RunningWorker::start(config).await {
            Ok(w) => w,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        };
        // Scripts and tests read the actual addresses from this line (ports may have been 0).
        let metrics = worker.metrics.map_or_else(|| "off".to_string(), |m| m.to_string());
        println!("tandem worker listening: grpc={} transfer={} metrics={metrics}", worker.grpc, worker.transfer);
        let registration = register.map(|(router, advertise, api_key)| crate::register::Registration {
            router,
            advertise: advertise.unwrap_or(worker.grpc),
            api_key,
        });
        let announcing = registration.clone().map(crate::register::Registration::keep_announcing);
        wait_for_signal().await;
        eprintln!("shutting down (grace {grace:?})");
        if let (Some(r), Some(task)) = (registration, announcing) {
            task.abort();
            if let Err(e) = r.withdraw().await {
                eprintln!("warning: {e}");
            }
        }
        worker.shutdown(grace).await;
        ExitCode::SUCCESS
    })
}

/// What a mock worker's device does between SIGUSR1 and SIGUSR2.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MockFault {
    /// Every call fails at once (the simulator's `--errors`).
    Errors,
    /// Its steps hang: the worker computes nothing while its process answers.
    Stall,
}

/// A mock worker's device breaks on SIGUSR1 and is mended on SIGUSR2 (`engine::backend::mock::DeviceFault`), as
/// `mode` says: for testing a router, and the simulator's failure models, against a failed GPU.
async fn follow_fault_signals(fault: engine::backend::mock::DeviceFault, mode: MockFault) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut break_it), Ok(mut mend)) = (signal(SignalKind::user_defined1()), signal(SignalKind::user_defined2()))
    else {
        return;
    };
    loop {
        let broken = tokio::select! {
            Some(()) = break_it.recv() => true,
            Some(()) = mend.recv() => false,
            else => return,
        };
        match mode {
            MockFault::Errors => fault.set_broken(broken),
            MockFault::Stall => fault.set_stuck(broken),
        }
        eprintln!("the mock device is {}", if broken { "broken (SIGUSR1)" } else { "mended (SIGUSR2)" });
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use engine::forward::Precision;

    use super::*;

    #[test]
    fn the_precision_is_read_and_checked() {
        let mut problems = Vec::new();
        assert_eq!(engine_config(&Settings::default(), "w", &mut problems).precision, Precision::Reference);
        let fast = Settings { precision: Some("fast".into()), ..Settings::default() };
        assert_eq!(engine_config(&fast, "w", &mut problems).precision, Precision::Fast);
        assert!(problems.is_empty(), "{problems:?}");
        let unknown = Settings { precision: Some("fastest".into()), ..Settings::default() };
        engine_config(&unknown, "w", &mut problems);
        assert!(problems.iter().any(|p| p.contains("\"fastest\"")), "{problems:?}");
        problems.clear();
        let mock = Settings { engine: Some("mock".into()), precision: Some("fast".into()), ..Settings::default() };
        engine_config(&mock, "w", &mut problems);
        assert!(problems.iter().any(|p| p.contains("cpu engine only")), "{problems:?}");
    }

    #[test]
    fn a_cuda_engine_is_named_by_device_and_checked_at_start() {
        let mut problems = Vec::new();
        let cuda = Settings { engine: Some("cuda:1".into()), ..Settings::default() };
        assert_eq!(engine_config(&cuda, "w", &mut problems).backend, BackendChoice::Cuda(1));
        // Here (no CUDA build, or no driver) the start is refused with the reason; a GPU machine has no problem.
        if !engine::backend::cuda_driver_present() {
            assert!(problems.iter().any(|p| p.contains("--device cpu")), "{problems:?}");
        }
        problems.clear();
        let unknown = Settings { engine: Some("gpu".into()), ..Settings::default() };
        engine_config(&unknown, "w", &mut problems);
        assert!(problems.iter().any(|p| p.contains("cpu, mock, cuda[:N]")), "{problems:?}");
    }
}
