//! `tandem up`: a whole local cluster in one process — a router and prefill and decode workers on loopback,
//! mutual TLS between them from a development CA made on first start — until Ctrl-C.

use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use engine::generate::{BackendChoice, EngineConfig};
use kv_transfer::tls::{DevCa, Identity};
use router::discovery::WorkerSource;
use router::run::{RouterConfig, RunningRouter, defaults};
use router::scheduler::config::SchedulerConfig;
use router::state::Limits;
use worker::{Role, RunningWorker, WorkerConfig};

/// How long Ctrl-C waits for requests in flight before stopping them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Prefill workers.
    #[arg(long, default_value_t = 2)]
    prefill: usize,
    /// Decode workers.
    #[arg(long, default_value_t = 2)]
    decode: usize,
    /// Router HTTP port.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Router HTTP address (loopback by default; the workers always stay on loopback).
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// A GGUF model file; the embedded SmolLM2 model when absent (fetched when missing).
    #[arg(long, value_name = "PATH")]
    model: Option<PathBuf>,
    /// Compute threads per worker (default: the cores shared out among the workers, at least one each).
    #[arg(long)]
    threads: Option<NonZeroUsize>,
    /// What computes steps: `cpu` (the model), `mock` (no compute; steps take the timing profile's time, for
    /// routing experiments with many workers) or `cuda[:N]` (the model on CUDA device N, in a build with
    /// `--features cuda`: docs/cuda.md).
    #[arg(long, default_value = "cpu")]
    engine: String,
    /// How cpu workers compute matmuls over quantized weights: `reference` (f32 activations, what the golden
    /// tests check) or `fast` (8-bit activations in decode-sized steps, as llama.cpp; see docs/performance.md).
    #[arg(long, value_name = "fast|reference")]
    precision: Option<String>,
    /// The mock's timing profile: gpu-default, cpu-smollm2 or a TOML file.
    #[arg(long)]
    profile: Option<String>,
    /// The mock divides every modelled duration by this.
    #[arg(long)]
    speedup: Option<f64>,
    /// Bytes of one stand-in KV block of a mock worker.
    #[arg(long)]
    mock_block_bytes: Option<usize>,
    /// Longest prompt plus output (default: the model's context; 131072 for the mock).
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Device KV blocks per worker (default: 1024 for cpu, the profile's for mock).
    #[arg(long)]
    kv_blocks: Option<usize>,
    /// Host tier blocks per worker (0: none; default: twice the device tier).
    #[arg(long)]
    host_blocks: Option<usize>,
    /// Disk tier blocks per worker (0: none; default: four times the device tier).
    #[arg(long)]
    disk_blocks: Option<usize>,
    /// Prompt and decode tokens one step of each worker computes (the engine's default when absent): a smaller
    /// budget makes each step shorter (decodes wait less behind a prompt) but a prompt takes more steps
    /// (docs/simulation.md measures both on CPU workers).
    #[arg(long)]
    max_batched_tokens: Option<usize>,
    /// Directory under which each worker keeps its disk tier (default: $TANDEM_HOME/kv/up).
    #[arg(long)]
    disk_dir: Option<PathBuf>,
    /// Require this API key (`Authorization: Bearer …`) on the router.
    #[arg(long)]
    api_key: Option<String>,
    /// Require this key on `/admin/*` and `/debug/*` (without it they answer only on loopback).
    #[arg(long, env = "TANDEM_ADMIN_KEY")]
    admin_key: Option<String>,
    /// Requests the router runs at once; more wait in its queue.
    #[arg(long, default_value_t = defaults::MAX_IN_FLIGHT)]
    max_in_flight: usize,
    /// Requests that may wait for a place; more get 429 with Retry-After.
    #[arg(long, default_value_t = defaults::MAX_QUEUE)]
    max_queue: usize,
    /// Scheduling policy: kv, round_robin, random, least_loaded, power_of_two, prefix_hash, sglang_threshold.
    #[arg(long, default_value = "kv")]
    policy: String,
    /// Seed the router's random choices (tie-breaks, sampling policies) for reproducible runs.
    #[arg(long)]
    seed: Option<u64>,
    /// Stream a long disaggregated prompt's KV to its decode worker while the prompt computes, piece by piece.
    #[arg(long, value_name = "BOOL", default_value_t = defaults::STREAM_KV, action = clap::ArgAction::Set)]
    stream_kv: bool,
    /// Record the router's traffic to this new file (a trace `tandem sim` replays; no text, re-keyed hashes).
    #[arg(long)]
    record_trace: Option<std::path::PathBuf>,
    /// With `--record-trace`: each decision with its candidates as scored (for comparing `tandem sim`'s decisions
    /// with the router's).
    #[arg(long)]
    record_candidates: bool,
    /// How the served model writes tool calls among its text (`hermes`, `llama3_json`, `mistral`, `pythonic`,
    /// `qwen3_coder`, `gemma4`, `deepseek_v3`, `deepseek_v31`, `deepseek_v32`): with one, `tool_choice: auto` is served.
    #[arg(long)]
    tool_call_parser: Option<router::http::tools::ToolParser>,
    /// How the served model marks its thinking (`deepseek_r1`, `qwen3`, `gemma4`, `deepseek_v3`): with one, chat
    /// answers carry it apart.
    #[arg(long)]
    reasoning_parser: Option<router::http::reasoning::ReasoningParser>,
    /// MiB of the router's memory for the Responses API's stored responses (default 64; 0 keeps none).
    #[arg(long, default_value_t = router::response_store::DEFAULT_MB)]
    responses_store_mb: usize,
}

/// The certificates of a local cluster in `dir`: reused when every component has one, otherwise made anew
/// (only this cluster's own components trust this CA, so replacing it breaks nothing else).
fn identities(dir: &Path, names: &[String]) -> Result<Vec<Identity>, String> {
    if let Ok(all) = names.iter().map(|n| Identity::load(dir, n)).collect::<Result<Vec<_>, _>>() {
        return Ok(all);
    }
    let ca = DevCa::generate().map_err(|e| e.to_string())?;
    ca.write(dir).map_err(|e| e.to_string())?;
    names
        .iter()
        .map(|n| {
            let id = ca.issue(n, &[]).map_err(|e| e.to_string())?;
            id.write(dir, n).map_err(|e| e.to_string())?;
            Ok(id)
        })
        .collect()
}

fn policy(name: &str) -> Result<SchedulerConfig, String> {
    serde_json::from_value(serde_json::json!({ "policy": name }))
        .map_err(|_| format!("unknown policy {name:?}: use kv, round_robin, random, least_loaded, power_of_two, prefix_hash or sglang_threshold"))
}

/// The workers' engine: the flags as `tandem worker` reads them. `disk_dir` is the directory under which each
/// worker gets its own.
fn engine_config(args: &Args, home: &Path, threads: Option<NonZeroUsize>) -> Result<EngineConfig, String> {
    let settings = worker::cli::Settings {
        engine: Some(args.engine.clone()),
        precision: args.precision.clone(),
        profile: args.profile.clone(),
        speedup: args.speedup,
        mock_block_bytes: args.mock_block_bytes,
        max_model_len: args.max_model_len,
        threads,
        kv_blocks: args.kv_blocks,
        host_blocks: args.host_blocks,
        disk_blocks: args.disk_blocks,
        max_batched_tokens: args.max_batched_tokens,
        disk_dir: Some(args.disk_dir.clone().unwrap_or_else(|| home.join("kv").join("up"))),
        ..worker::cli::Settings::default()
    };
    let mut problems = Vec::new();
    let engine = worker::cli::engine_config(&settings, "up", &mut problems);
    if problems.is_empty() { Ok(engine) } else { Err(problems.join("; ")) }
}

pub fn run(args: Args) -> Result<ExitCode, String> {
    if args.decode == 0 {
        return Err("a cluster needs at least one decode worker (--decode)".into());
    }
    // A port already taken is said before the model is fetched and the workers make their pools, not after.
    let listen = SocketAddr::new(args.host, args.port);
    drop(std::net::TcpListener::bind(listen).map_err(|e| format!("router address {listen}: {e}"))?);
    let scheduler = policy(&args.policy)?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => engine::fetch::ensure_default_model(&crate::progress::Bar::new()).map_err(|e| e.to_string())?,
    };
    let home = engine::fetch::tandem_home().map_err(|e| e.to_string())?;
    let roles: Vec<(Role, String)> = (0..args.prefill)
        .map(|i| (Role::Prefill, format!("prefill-{i}")))
        .chain((0..args.decode).map(|i| (Role::Decode, format!("decode-{i}"))))
        .collect();
    let mut names: Vec<String> = roles.iter().map(|(_, n)| n.clone()).collect();
    names.push("router".into());
    let mut ids = identities(&home.join("certs").join("up"), &names)?;
    let router_id = ids.pop().ok_or("no router certificate")?;
    let cores = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
    let threads = args.threads.or(NonZeroUsize::new((cores / roles.len().max(1)).max(1)));
    let process = telemetry::Process::start("tandem")?;
    process.block_on(async move {
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        let mut workers = Vec::new();
        let engine = engine_config(&args, &home, threads)?;
        // The router accepts what the workers do (the model's context unless set; the mock's own).
        let max_model_len = match &engine.backend {
            BackendChoice::Mock(m) => Some(m.context_len),
            BackendChoice::Cpu | BackendChoice::Cuda(_) => engine.max_model_len,
        };
        for ((role, name), identity) in roles.into_iter().zip(ids) {
            let engine = EngineConfig { disk_dir: engine.disk_dir.as_ref().map(|d| d.join(&name)), ..engine.clone() };
            let w = RunningWorker::start(WorkerConfig {
                model_id: defaults::SERVED_MODEL.into(),
                engine,
                metrics: Some(loopback),
                shm_dir: Some(PathBuf::from(kv_transfer::shm::DEFAULT_DIR)).filter(|d| d.is_dir()),
                ..WorkerConfig::local(role, model.clone(), identity)
            })
            .await
            .map_err(|e| format!("{name}: {e}"))?;
            let metrics = w.metrics.map_or_else(String::new, |m| format!(", metrics http://{m}/metrics"));
            eprintln!("  {name:<10} grpc {}, transfer {}{metrics}", w.grpc, w.transfer);
            workers.push(w);
        }
        let router = RunningRouter::start(RouterConfig {
            listen,
            model,
            served_model: defaults::SERVED_MODEL.into(),
            workers: workers.iter().map(|w| WorkerSource::Static(w.grpc)).collect(),
            external: Vec::new(),
            external_settings: Default::default(),
            dns_refresh: router::discovery::DEFAULT_DNS_REFRESH,
            identity: router_id,
            // tandem up made these certificates itself and keeps them for its life.
            certs: None,
            limits: Limits {
                max_in_flight: args.max_in_flight,
                max_queue: args.max_queue,
                stream_kv: args.stream_kv,
                ..Limits::default()
            },
            scheduler,
            tenants: router::tenants::Tenants::open(args.api_key.into_iter().collect()),
            admin_key: args.admin_key,
            follow: Default::default(),
            block_size: defaults::BLOCK_SIZE,
            max_model_len,
            seed: args.seed,
            record_trace: args.record_trace,
            record_candidates: args.record_candidates,
            tool_call_parser: args.tool_call_parser,
            reasoning_parser: args.reasoning_parser,
            responses_store_mb: args.responses_store_mb,
        })
        .await
        .map_err(|e| e.to_string())?;
        for _ in 0..200 {
            if router.state.cluster.up_members().len() == workers.len() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let url = format!("http://{}", router.addr);
        println!("Tandem is up: {url}  (model {}, {} workers; Ctrl-C stops it)", defaults::SERVED_MODEL, workers.len());
        println!(
            "  curl {url}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{}\",\"messages\":[{{\"role\":\"user\",\"content\":\"What is the capital of France?\"}}]}}'",
            defaults::SERVED_MODEL
        );
        worker::cli::wait_for_signal().await;
        eprintln!("stopping…");
        router.shutdown(SHUTDOWN_GRACE).await;
        for w in workers {
            w.shutdown(SHUTDOWN_GRACE).await;
        }
        Ok(ExitCode::SUCCESS)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        up: Args,
    }

    fn args(extra: &[&str]) -> Args {
        Cli::try_parse_from(["up", "--engine", "mock"].iter().chain(extra)).expect("parses").up
    }

    #[test]
    fn the_step_budget_reaches_every_workers_engine() {
        let home = std::env::temp_dir();
        let set = engine_config(&args(&["--max-batched-tokens", "256"]), &home, None).expect("config");
        assert_eq!(set.max_batched_tokens, 256);
        let default = engine_config(&args(&[]), &home, None).expect("config");
        assert_eq!(default.max_batched_tokens, engine::generate::DEFAULT_MAX_BATCHED_TOKENS);
    }
}
