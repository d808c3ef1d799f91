//! `tandem tune`: searches the scheduler's settings in the simulator on the first part of a trace, reports the
//! winner on the held-out rest against the defaults and round robin, and writes (or applies) its `[scheduler]`
//! table.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use loadgen::summary::Slo;
use router::scheduler::config::SchedulerConfig;
use sim::tune::space::{PREFILL_WORKERS, Sampler, default_space};
use sim::tune::{Objective, Report, TuneSettings};

use super::chart::{Chart, Mark, Series};
use super::serve::write;
use super::sim::ClusterArgs;
use super::workload::WorkloadArgs;

#[derive(Debug, clap::Args)]
#[command(after_help = "Example: tandem tune --trace data/traces/mooncake_conversation_1k.jsonl --objective ttft_p90 \
--out runs/tune  (then --apply http://127.0.0.1:8000 to send the winner to a router). docs/simulation.md explains \
the search and the report.")]
pub struct Args {
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Also search how to split this many workers between the prefill and decode pools (instead of keeping
    /// `--prefill` and `--decode`, which are then the defaults' split).
    #[arg(long)]
    workers: Option<usize>,
    /// What to optimise: `goodput` (requests/s meeting every `--slo`), or a latency percentile such as
    /// `ttft_p90`, `tpot_p50`, `itl_p99`, `e2e_p90`.
    #[arg(long, default_value = "goodput")]
    objective: String,
    /// SLOs per request for goodput, e.g. `ttft_ms=2000,tpot_ms=50`.
    #[arg(long, default_value = "ttft_ms=2000,tpot_ms=50")]
    slo: String,
    /// Settings drawn (the current ones are tried too).
    #[arg(long, default_value_t = 26)]
    samples: usize,
    /// How they are drawn: `lhs` (Latin hypercube) or `random`.
    #[arg(long, default_value = "lhs")]
    sampler: String,
    /// Successive-halving rounds: each keeps the best 1/eta on an eta-times longer window of the training part,
    /// the last on all of it.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    #[arg(long, default_value_t = 3)]
    eta: usize,
    /// The first round's window holds at least this many requests.
    #[arg(long, default_value_t = 100)]
    min_window: usize,
    /// The leading share of the trace, by arrival, tuned on; the rest is held out for the report.
    #[arg(long, default_value_t = 0.7)]
    train_fraction: f64,
    /// Seeds every evaluation is averaged over (routing ties, sampling): `--seed`, `--seed + 1`, …
    #[arg(long, default_value_t = 3)]
    seeds: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Simulations run at once (default: the machine's cores).
    #[arg(long)]
    jobs: Option<usize>,
    /// Write `tuned.toml`, `search.jsonl` (every evaluation), `search.svg` and `report.json` here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Send the tuned settings to a running router: `PUT URL/admin/router-config`, e.g. `http://127.0.0.1:8000`.
    #[arg(long)]
    apply: Option<String>,
    /// The router's admin key for `--apply`.
    #[arg(long, env = "TANDEM_ADMIN_KEY", hide_env_values = true)]
    admin_key: Option<String>,
    /// Print the report as JSON on stdout instead of the text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<ExitCode, String> {
    let started = Instant::now();
    let objective: Objective = args.objective.parse()?;
    let slo = Slo::parse(&args.slo)?;
    let sampler = match args.sampler.as_str() {
        "lhs" => Sampler::LatinHypercube,
        "random" => Sampler::Random,
        other => return Err(format!("--sampler: {other:?} is not lhs or random")),
    };
    let mut base = args.cluster.settings(&args.workload, args.seed)?;
    if !base.failures.is_empty() {
        // A failure is a time on one trace's clock; the search runs windows of the trace, each from its own start.
        return Err(
            "--fail, --hang and --errors are for tandem sim: tune searches windows of the trace, each on its own clock"
                .into(),
        );
    }
    let (requests, arrivals) = args.workload.load(args.seed, &base.model)?;
    if let Some(n) = args.workers {
        if n < 2 {
            return Err("--workers: at least 2 (one prefill, one decode)".into());
        }
        // The defaults' split of the budget: as even as it goes, the odd one decoding.
        (base.prefill, base.decode) = (n / 2, n - n / 2);
    }
    let space = default_space(args.workers, base.engine.disk_blocks > 0);
    let settings = TuneSettings {
        base,
        arrivals,
        space,
        sampler,
        samples: args.samples,
        rounds: args.rounds,
        eta: args.eta,
        min_window: args.min_window,
        train_fraction: args.train_fraction,
        seeds: (0..args.seeds.max(1) as u64).map(|k| args.seed + k).collect(),
        objective,
        slo,
        jobs: args.jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
    };
    let report = sim::tune::tune(&settings, &requests)?;
    let toml = tuned_toml(&report, &settings);
    let json = report_json(&report, &settings, started.elapsed());
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        write(dir.join("tuned.toml"), &toml)?;
        let lines: Vec<String> =
            report.search.evaluations.iter().filter_map(|e| serde_json::to_string(e).ok()).collect();
        write(dir.join("search.jsonl"), &(lines.join("\n") + "\n"))?;
        write(dir.join("search.svg"), &search_chart(&report, objective).svg())?;
        write(dir.join("report.json"), &serde_json::to_string_pretty(&json).unwrap_or_default())?;
    }
    if args.json {
        println!("{json}");
    } else {
        print_report(&report, &settings, &toml, started.elapsed());
    }
    if let Some(url) = &args.apply {
        apply(url, args.admin_key.clone(), &report.best().scheduler)?;
        if args.workers.is_some() {
            eprintln!(
                "the split ({} prefill, {} decode) is not a router setting: deploy it with the workers",
                report.best().prefill,
                report.best().decode
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The winner as a router TOML file: its whole `[scheduler]` table, the changed fields and split noted above it.
fn tuned_toml(report: &Report, t: &TuneSettings) -> String {
    let best = report.best();
    let mut head = format!(
        "# tandem tune: best {} on {} training requests over {} seeds",
        t.objective,
        report.train_requests,
        t.seeds.len()
    );
    if best.changes.is_empty() {
        head.push_str("\n# no drawn setting beat the current one");
    }
    if let Some(p) = best.changes.get(PREFILL_WORKERS) {
        head.push_str(&format!("\n# workers: {p} prefill, {} decode", best.decode));
    }
    let mut table = toml::Table::new();
    match toml::Table::try_from(&best.scheduler) {
        Ok(s) => {
            table.insert("scheduler".into(), toml::Value::Table(s));
        }
        Err(e) => head.push_str(&format!("\n# could not write the table: {e}")),
    }
    format!("{head}\n{}", toml::to_string(&table).unwrap_or_default())
}

fn report_json(report: &Report, t: &TuneSettings, wall: Duration) -> serde_json::Value {
    let best = report.best();
    let held_out: serde_json::Map<String, serde_json::Value> = report
        .held_out
        .iter()
        .map(|h| {
            let v = serde_json::json!({ "mean": h.mean(), "std_dev": h.std_dev(), "per_seed": h.values, "summary": h.summary });
            (h.name.to_string(), v)
        })
        .collect();
    serde_json::json!({
        "objective": t.objective.to_string(),
        "train_requests": report.train_requests,
        "test_requests": report.test_requests,
        "candidates": report.candidates.len(),
        "evaluations": report.search.evaluations.len(),
        "best": {
            "changes": best.changes,
            "prefill": best.prefill,
            "decode": best.decode,
            "scheduler": best.scheduler,
            "train_per_seed": report.best_train,
        },
        "current_train_per_seed": report.current_train,
        "held_out": held_out,
        "wall_seconds": wall.as_secs_f64(),
    })
}

fn print_report(report: &Report, t: &TuneSettings, toml: &str, wall: Duration) {
    let best = report.best();
    let o = t.objective;
    let unit = if o.higher_is_better() { "req/s" } else { "ms" };
    println!(
        "searched {} settings ({} evaluations, {} rounds on windows of {} requests) on the first {} requests; {} held out",
        report.candidates.len(),
        report.search.evaluations.len(),
        report.search.rounds.len(),
        report
            .search
            .evaluations
            .iter()
            .map(|e| e.window.to_string())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect::<Vec<_>>()
            .join("/"),
        report.train_requests,
        report.test_requests
    );
    if best.changes.is_empty() {
        println!("best: the current settings (no drawn setting beat them)");
    } else {
        println!("best: {}", serde_json::Value::Object(best.changes.clone()));
    }
    let spread = |v: &[f64]| format!("{:.3} ± {:.3}", sim::tune::search::mean(v), sim::tune::search::std_dev(v));
    println!(
        "  {o} on the training part: {} {unit} (the current settings: {}; mean ± sd over {} seeds)",
        spread(&report.best_train),
        spread(&report.current_train),
        t.seeds.len()
    );
    println!("held-out part ({} requests), {o} in {unit}, mean ± sd over seeds:", report.test_requests);
    let tuned = report.held_out.first().map(|h| h.mean()).unwrap_or(f64::NAN);
    for h in &report.held_out {
        let gain = if h.name == "tuned" {
            String::new()
        } else {
            let g = if o.higher_is_better() { tuned / h.mean() - 1.0 } else { 1.0 - tuned / h.mean() };
            match g {
                g if g.abs() < 0.0005 => "   the same".to_string(),
                g if g > 0.0 => format!("   tuned {:.1}% better", g * 100.0),
                g => format!("   tuned {:.1}% worse", -g * 100.0),
            }
        };
        println!("  {:<12} {}{gain}", h.name, spread(&h.values));
    }
    println!("\n{toml}");
    println!("{:.1} s of wall time on {} threads", wall.as_secs_f64(), t.jobs);
}

/// Every evaluation's objective by the order it ran in, one colour per round, the winner's runs on top.
fn search_chart(report: &Report, o: Objective) -> Chart {
    let mut series: Vec<Series> = Vec::new();
    for (k, e) in report.search.evaluations.iter().enumerate() {
        let name = format!("round {} ({} requests)", e.round + 1, e.window);
        if series.last().is_none_or(|s| s.name != name) {
            series.push(Series { name, points: Vec::new(), mark: Mark::Dots });
        }
        if let Some(s) = series.last_mut() {
            s.points.push((k as f64, o.from_loss(e.loss)));
        }
    }
    let best: Vec<(f64, f64)> = report
        .search
        .evaluations
        .iter()
        .enumerate()
        .filter(|(_, e)| e.candidate == report.search.best)
        .map(|(k, e)| (k as f64, o.from_loss(e.loss)))
        .collect();
    series.push(Series { name: "the winner".into(), points: best, mark: Mark::Dots });
    Chart {
        title: format!("tandem tune: {o} of every evaluation"),
        x_label: "evaluation".into(),
        y_label: o.to_string(),
        series,
    }
}

/// `PUT URL/admin/router-config` with the whole tuned table.
fn apply(url: &str, admin_key: Option<String>, scheduler: &SchedulerConfig) -> Result<(), String> {
    let (authority, base_path) = loadgen::client::Target::parse_url(url)?;
    let target = loadgen::client::Target {
        authority,
        base_path: base_path.clone(),
        model: String::new(),
        api_key: admin_key,
        endpoint: loadgen::client::Endpoint::Completions,
        timeout: Duration::from_secs(10),
    };
    let body = serde_json::to_value(scheduler).map_err(|e| e.to_string())?;
    let path = format!("{base_path}/admin/router-config");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let answer = runtime.block_on(loadgen::client::call(&target, loadgen::client::Method::PUT, &path, Some(&body)))?;
    eprintln!("applied to {url}: {answer}");
    Ok(())
}
