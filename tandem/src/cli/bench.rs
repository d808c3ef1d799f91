//! `tandem bench engine`: prefill and decode throughput.

use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use engine::bench::{self, BenchSpec};
use engine::generate::{Engine, EngineConfig};
use engine::model::Model;
use engine::team::Team;

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
    /// Instead, time forward steps over a grid of shapes (prompt chunks with cached context, decode batches,
    /// mixed steps), fit a mock timing profile to them by least squares, and write it here.
    #[arg(long, value_name = "FILE")]
    fit_profile: Option<PathBuf>,
    /// With --fit-profile: fit to steps measured earlier (the `.samples.json` written next to a profile) instead
    /// of measuring again.
    #[arg(long, value_name = "FILE", requires = "fit_profile")]
    samples: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<ExitCode, String> {
    let on_cpu = args.model.device == engine::backend::Device::Cpu;
    if !on_cpu && (!args.concurrency.is_empty() || args.fit_profile.is_some()) {
        return Err("--concurrency and --fit-profile measure the CPU backend only so far (docs/cuda.md)".into());
    }
    if !args.concurrency.is_empty() {
        return run_concurrency(&args);
    }
    if let Some(out) = &args.fit_profile {
        return run_fit(&args, out);
    }
    let path = args.model.path()?;
    let mut model = Model::open(&path).map_err(|e| e.to_string())?;
    model.precision = args.model.precision;
    let threads = args.model.threads.map_or(0, NonZeroUsize::get);
    let team = Team::new(threads, "tandem-compute").map_err(|e| e.to_string())?;
    let spec = BenchSpec {
        prompt_tokens: args.prompt_tokens,
        decode_prompt_tokens: args.decode_prompt_tokens,
        decode_tokens: args.decode_tokens,
        batches: args.batches.iter().map(|b| b.get()).collect(),
    };
    let report = match args.model.device {
        engine::backend::Device::Cpu => bench::run(&model, &team, &spec),
        engine::backend::Device::Cuda(n) => {
            let mut backend = engine::backend::open_cuda(&model, n)?;
            bench::run_backend(&mut *backend, &spec)
        }
    }
    .map_err(|e| format!("{e} (model {})", display(&path)))?;
    if args.json {
        println!("{}", serde_json::to_string(&report).map_err(|e| e.to_string())?);
    } else {
        println!("device             {}", args.model.device);
        println!("threads            {}", report.threads);
        println!("prefill pp{:<6}    {:8.1} tokens/s", report.prefill_tokens, report.prefill_tokens_per_s);
        for d in &report.decode {
            println!("decode batch {:<3}   {:8.1} tokens/s", d.batch, d.tokens_per_s);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One measured shape in three is held out of the fit and used to check it.
const HOLD_OUT_EVERY: usize = 3;

/// Measures the grid, fits on two thirds of it, checks on the rest, writes the profile.
fn run_fit(args: &Args, out: &Path) -> Result<ExitCode, String> {
    use engine::backend::TimingProfile;
    use engine::backend::fit::{self, Kind};
    let path = args.model.path()?;
    let threads = args.model.threads.map_or(0, NonZeroUsize::get);
    let team = Team::new(threads, "tandem-compute").map_err(|e| e.to_string())?;
    let samples_file = out.with_extension("samples.json");
    let samples: Vec<fit::Sample> = match &args.samples {
        Some(file) => {
            let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", file.display()))?
        }
        None => {
            let mut model = Model::open(&path).map_err(|e| e.to_string())?;
            model.precision = args.model.precision;
            eprintln!("timing forward steps on {} threads (a few minutes)…", team.threads());
            let measured = bench::measure_steps(&model, &team, &bench::ShapeGrid::default())
                .map_err(|e| format!("{e} (model {})", display(&path)))?;
            let json = serde_json::to_string_pretty(&measured).map_err(|e| e.to_string())?;
            std::fs::write(&samples_file, json).map_err(|e| format!("{}: {e}", samples_file.display()))?;
            measured
        }
    };
    // Every third shape, the pick shifted by one at each row of the grid (six shapes a row), so that every value of
    // every factor (prompt length, context, batch) is also fitted on at some other setting of the rest.
    let held_out = |i: usize| (i + i / 6) % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1;
    let (held, train): (Vec<_>, Vec<_>) = samples.iter().enumerate().partition(|(i, _)| held_out(*i));
    let held: Vec<fit::Sample> = held.into_iter().map(|(_, s)| *s).collect();
    let train: Vec<fit::Sample> = train.into_iter().map(|(_, s)| *s).collect();
    let f = fit::fit(&train).ok_or("too few shapes to fit")?;
    let base = TimingProfile::load("cpu-smollm2").unwrap_or_default();
    let mut profile = f.apply(&base);
    let errors = fit::relative_errors(&profile, &held);
    let p90 = fit::quantile(&errors, 0.9);
    let command = format!("tandem bench engine --fit-profile {} --threads {}", out.display(), team.threads());
    let refit = format!("tandem bench engine --fit-profile {} --samples {}", out.display(), samples_file.display());
    profile.description = format!("{} on this engine's CPU forward pass", model_name(&path));
    profile.source = format!(
        "fitted by `{command}`; held-out shapes: p90 relative error {:.1}% ({} of {} shapes held out)",
        p90 * 100.0,
        held.len(),
        samples.len()
    );
    let text = toml::to_string(&profile).map_err(|e| e.to_string())?;
    let header = format!(
        "# Re-fit whenever the engine's speed changes:\n#   {command}\n# (the measured steps are in {}; to re-fit \
         from them alone: {refit})\n",
        samples_file.display()
    );
    std::fs::write(out, header + &text).map_err(|e| format!("{}: {e}", out.display()))?;
    let by_kind =
        |k: Kind| -> Vec<f64> { held.iter().zip(&errors).filter(|(s, _)| s.kind() == k).map(|(_, e)| *e).collect() };
    if args.json {
        let report = serde_json::json!({
            "terms": fit::TERMS.iter().zip(f.coefficients.iter().zip(&f.std_errors))
                .map(|(n, (c, e))| serde_json::json!({"term": n, "value": c, "std_error": e})).collect::<Vec<_>>(),
            "held_out_p90_relative_error": p90,
            "held_out": held.iter().zip(&errors).map(|(s, e)| serde_json::json!({"shape": s, "relative_error": e}))
                .collect::<Vec<_>>(),
            "profile": out,
        });
        println!("{report}");
        return Ok(ExitCode::SUCCESS);
    }
    println!("{:<32} {:>14} {:>14}", "term", "value", "std error");
    for (name, (c, e)) in fit::TERMS.iter().zip(f.coefficients.iter().zip(&f.std_errors)) {
        println!("{name:<32} {c:>14.6e} {e:>14.3e}");
    }
    println!("held-out relative error (fitted on {} shapes, checked on {}):", train.len(), held.len());
    for (label, e) in [
        ("prefill", by_kind(Kind::Prefill)),
        ("decode", by_kind(Kind::Decode)),
        ("mixed", by_kind(Kind::Mixed)),
        ("all", errors.clone()),
    ] {
        println!(
            "  {label:<8} p50 {:>5.1}%  p90 {:>5.1}%  max {:>5.1}%  ({} shapes)",
            fit::quantile(&e, 0.5) * 100.0,
            fit::quantile(&e, 0.9) * 100.0,
            fit::quantile(&e, 1.0) * 100.0,
            e.len()
        );
    }
    println!("wrote {}", out.display());
    Ok(ExitCode::SUCCESS)
}

fn model_name(path: &Path) -> String {
    path.file_stem().map_or_else(|| "the model".to_string(), |s| s.to_string_lossy().into_owned())
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
        precision: args.model.precision,
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
    /// The model whose engine imports the blocks in the last measurement (the embedded one when absent, fetched
    /// when missing).
    #[arg(long, value_name = "PATH")]
    model: Option<PathBuf>,
}

/// Moves the same bytes over each transport on loopback, then through the decode worker's shared-memory path
/// into a real engine.
pub fn run_transfer(args: TransferArgs) -> Result<ExitCode, String> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
    let total = args.mib << 20;
    let mut report = runtime
        .block_on(kv_transfer::bench::run(total, args.block_bytes.max(1), args.streams.max(1), args.runs))
        .map_err(|e| e.to_string())?;
    let model = match args.model {
        Some(p) => p,
        None => super::fetch_default()?,
    };
    let imports = super::bench_import::measure(&runtime, &model, total, args.runs)?;
    let tcp = report.transports.iter().find(|t| t.transport == "tcp").map_or(f64::NAN, |t| t.gb_per_s);
    let vs_tcp = |name: &str| imports.iter().find(|f| f.transport == name).map(|f| f.gb_per_s / tcp);
    report.shm_into_engine_vs_tcp = vs_tcp("shm_into_engine");
    report.quic_into_engine_vs_tcp = vs_tcp("quic_into_engine");
    report.transports.extend(imports);
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
            println!("{:<22} {:7.3} GB/s  ({:.1} ms)", t.transport, t.gb_per_s, t.best_ms);
        }
        println!(
            "quic / tcp = {:.2}, shm / tcp = {:.2}, shm into the engine / tcp = {:.2}, quic into the engine / tcp = {:.2}",
            report.quic_vs_tcp,
            report.shm_vs_tcp,
            report.shm_into_engine_vs_tcp.unwrap_or(f64::NAN),
            report.quic_into_engine_vs_tcp.unwrap_or(f64::NAN)
        );
    }
    Ok(ExitCode::SUCCESS)
}
