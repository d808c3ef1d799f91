//! `tandem bench leases`: whether a prefill's latency grows with the KV leases a prefill worker holds. One real
//! prefill worker (the CPU engine) answers `Prefill` calls for distinct prompts of the same length; none of their
//! leases is released, so they pile up, and at each level of live leases a few prefills are timed from the call to
//! its answer (compute, export, checksums, the lease's grant: everything a router waits for). Leases pin their
//! blocks in the engine's device tier, so the tier is sized to hold every lease the bench makes.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use kv_transfer::tls::DevCa;
use proto::worker as pb;
use serde::Serialize;
use worker::{Role, RunningWorker, WorkerConfig};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Live leases at which prefills are timed, in rising order (the warm-up prefill's lease is the first).
    #[arg(long, value_delimiter = ',', default_value = "1,32,128")]
    leases: Vec<usize>,
    /// Prefills timed at each level.
    #[arg(long, default_value_t = 8)]
    samples: usize,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 64)]
    prompt_tokens: usize,
    /// A shared-memory directory for the worker (as `tandem worker --shm-dir`): its KV store lives there, where
    /// same-host readers map leased blocks.
    #[arg(long)]
    shm_dir: Option<std::path::PathBuf>,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Level {
    /// Leases live when each timed prefill started.
    leases: usize,
    /// Leased bytes then.
    leased_bytes: u64,
    /// The process's resident memory then (MB; bench, worker and engine together): leases that copied their KV
    /// would grow it by their bytes.
    rss_mb: Option<f64>,
    p50_ms: f64,
    max_ms: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    prompt_tokens: usize,
    /// Whether the worker's KV store lived in shared memory.
    shared_store: bool,
    levels: Vec<Level>,
}

pub fn run(args: Args) -> Result<ExitCode, String> {
    if args.samples == 0 || args.prompt_tokens < 2 || args.leases.windows(2).any(|w| w[0] > w[1]) {
        return Err("--samples must be at least 1, --prompt-tokens at least 2, --leases in rising order".into());
    }
    let model = super::fetch_default()?;
    let ca = DevCa::generate().map_err(|e| e.to_string())?;
    let (worker_id, client_id) = (ca.issue("worker", &[]), ca.issue("bench", &[]));
    let (worker_id, client_id) = (worker_id.map_err(|e| e.to_string())?, client_id.map_err(|e| e.to_string())?);
    let process = telemetry::Process::start("tandem")?;
    process.block_on(async move {
        let mut config = WorkerConfig {
            // No lease expires or is refused while the bench runs.
            lease_ttl: Duration::from_secs(3600),
            max_leased_bytes: u64::MAX,
            shm_dir: args.shm_dir.clone(),
            ..WorkerConfig::local(Role::Prefill, model, worker_id)
        };
        // Leases pin their blocks in the device tier, at most half of it: room for every lease the bench makes.
        let per_prompt = args.prompt_tokens.div_ceil(config.engine.block_tokens);
        let leases = args.leases.last().copied().unwrap_or(0) + args.samples + 1;
        config.engine.kv_blocks = config.engine.kv_blocks.max(2 * leases * per_prompt + 2 * per_prompt);
        let worker = RunningWorker::start(config).await.map_err(|e| format!("worker: {e}"))?;
        let mut client = worker::grpc_tls::connect(worker.grpc, &client_id).await.map_err(|e| e.to_string())?;
        let mut made = 0usize;
        let mut prefill = async |n: usize| -> Result<f64, String> {
            // Distinct from every other prompt from the first token on: nothing is found cached.
            let tokens: Vec<u32> =
                (0..args.prompt_tokens).map(|t| 300 + ((n * 997 + t * 31) % 20_000) as u32).collect();
            let req = pb::PrefillRequest {
                request_id: format!("bench-{n}"),
                tokens,
                sampling: Some(pb::Sampling { max_tokens: 2, top_p: 1.0, ..Default::default() }),
                ..Default::default()
            };
            let started = Instant::now();
            client.prefill(req).await.map_err(|e| e.to_string())?;
            Ok(started.elapsed().as_secs_f64() * 1000.0)
        };
        // The first prefill pays for warming up.
        prefill(made).await?;
        made += 1;
        let mut levels = Vec::new();
        for &want in &args.leases {
            while worker.live_leases() < want {
                prefill(made).await?;
                made += 1;
            }
            let (leases, leased_bytes, rss_mb) = (worker.live_leases(), worker.leased_bytes(), resident_mb());
            let mut times = Vec::with_capacity(args.samples);
            for _ in 0..args.samples {
                times.push(prefill(made).await?);
                made += 1;
            }
            times.sort_by(f64::total_cmp);
            let (p50_ms, max_ms) = (times[times.len() / 2], times[times.len() - 1]);
            levels.push(Level { leases, leased_bytes, rss_mb, p50_ms, max_ms });
        }
        let report = Report { prompt_tokens: args.prompt_tokens, shared_store: worker.shared_store(), levels };
        if args.json {
            println!("{}", serde_json::to_string(&report).map_err(|e| e.to_string())?);
        } else {
            let store = if report.shared_store { "in shared memory" } else { "in the process's memory" };
            println!("prefill of {} tokens, {} timed per level, KV store {store}", report.prompt_tokens, args.samples);
            for l in &report.levels {
                println!(
                    "{:>5} live leases ({:>7.1} MB)   resident {:>7.1} MB   p50 {:8.2} ms   max {:8.2} ms",
                    l.leases,
                    l.leased_bytes as f64 / 1e6,
                    l.rss_mb.unwrap_or(f64::NAN),
                    l.p50_ms,
                    l.max_ms
                );
            }
        }
        worker.shutdown(Duration::from_secs(5)).await;
        Ok(ExitCode::SUCCESS)
    })
}

/// This process's resident memory in MB (`VmRSS`), where the system says.
fn resident_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: f64 = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.split_whitespace().next()?.parse().ok()?;
    Some(kib * 1024.0 / 1e6)
}
