//! `tandem bench engine`: prefill and decode throughput.

use std::num::NonZeroUsize;
use std::process::ExitCode;

use engine::bench::{self, BenchSpec};
use engine::generate::{Engine, EngineConfig};
use engine::model::Model;

use super::{ModelArgs, display};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Prompt length of each sequence in the decode measurement.
    #[arg(long, default_value_t = 128)]
    decode_prompt_tokens: usize,
    /// Tokens each sequence generates in the decode measurement.
    #[arg(long, default_value_t = 128)]
    decode_tokens: usize,
    /// Batch sizes for the decode measurement.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    batches: Vec<NonZeroUsize>,
    /// Instead of the raw forward-pass figures, run this many concurrent requests through the engine's
    /// scheduler and report their total decode tokens/s (comma-separated list).
    #[arg(long, value_delimiter = ',')]
    concurrency: Vec<NonZeroUsize>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<ExitCode, String> {
    if !args.concurrency.is_empty() {
        return run_concurrency(&args);
    }
    let path = args.model.path()?;
    let model = Model::open(&path).map_err(|e| e.to_string())?;
    let threads = args.model.threads.map_or(0, NonZeroUsize::get);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().map_err(|e| e.to_string())?;
    let spec = BenchSpec {
        prompt_tokens: args.prompt_tokens,
        decode_prompt_tokens: args.decode_prompt_tokens,
        decode_tokens: args.decode_tokens,
        batches: args.batches.iter().map(|b| b.get()).collect(),
    };
    let report = pool.install(|| bench::run(&model, &spec)).map_err(|e| format!("{e} (model {})", display(&path)))?;
    if args.json {
        println!("{}", serde_json::to_string(&report).map_err(|e| e.to_string())?);
    } else {
        println!("threads            {}", report.threads);
        println!("prefill pp{:<6}    {:8.1} tokens/s", report.prefill_tokens, report.prefill_tokens_per_s);
        for d in &report.decode {
            println!("decode batch {:<3}   {:8.1} tokens/s", d.batch, d.tokens_per_s);
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(serde::Serialize)]
struct ConcurrencyReport {
    threads: usize,
    prompt_tokens: usize,
    decode_tokens: usize,
    concurrency: Vec<bench::ConcurrencyFigure>,
}

/// Concurrent requests through the scheduler (continuous batching, as a worker runs them).
fn run_concurrency(args: &Args) -> Result<ExitCode, String> {
    let path = args.model.path()?;
    let most = args.concurrency.iter().map(|c| c.get()).max().unwrap_or(1);
    let blocks_per_seq = (args.decode_prompt_tokens + args.decode_tokens).div_ceil(16) + 1;
    let config = EngineConfig {
        threads: args.model.threads,
        kv_blocks: (most * blocks_per_seq).max(EngineConfig::default().kv_blocks),
        max_num_seqs: most,
        ..EngineConfig::default()
    };
    let mut engine = Engine::open(&path, config).map_err(|e| e.to_string())?;
    let mut figures = Vec::new();
    for n in &args.concurrency {
        let f = bench::concurrency(&mut engine, n.get(), args.decode_prompt_tokens, args.decode_tokens)
            .map_err(|e| format!("{e} (model {})", display(&path)))?;
        figures.push(f);
    }
    let report = ConcurrencyReport {
        threads: engine.threads(),
        prompt_tokens: args.decode_prompt_tokens,
        decode_tokens: args.decode_tokens,
        concurrency: figures,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report).map_err(|e| e.to_string())?);
    } else {
        println!("threads            {}", report.threads);
        for f in &report.concurrency {
            println!(
                "{:>3} concurrent     {:8.1} decode tokens/s   (all prompts prefilled after {:.0} ms)",
                f.sequences, f.decode_tokens_per_s, f.all_first_tokens_ms
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, clap::Args)]
pub struct TransferArgs {
    /// Mebibytes to move per run.
    #[arg(long, default_value_t = 64)]
    mib: usize,
    /// Bytes per block (SmolLM2's f16 block by default).
    #[arg(long, default_value_t = 368_640)]
    block_bytes: usize,
    /// Parallel QUIC streams.
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// Runs per transport; the best is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Moves the same bytes over each transport on loopback.
pub fn run_transfer(args: TransferArgs) -> Result<ExitCode, String> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
    let total = args.mib << 20;
    let report = runtime
        .block_on(kv_transfer::bench::run(total, args.block_bytes.max(1), args.streams.max(1), args.runs))
        .map_err(|e| e.to_string())?;
    if args.json {
        println!("{}", serde_json::to_string(&report).map_err(|e| e.to_string())?);
    } else {
        println!(
            "{} blocks of {} bytes ({:.1} MiB), best of {}",
            report.blocks,
            report.block_bytes,
            report.bytes as f64 / 1048576.0,
            report.runs
        );
        for t in &report.transports {
            println!("{:<6} {:7.3} GB/s  ({:.1} ms)", t.transport, t.gb_per_s, t.best_ms);
        }
        println!("quic / tcp = {:.2}, shm / tcp = {:.2}", report.quic_vs_tcp, report.shm_vs_tcp);
    }
    Ok(ExitCode::SUCCESS)
}
