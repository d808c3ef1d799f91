//! `tandem bench serve`: replays a trace or a synthetic workload against an OpenAI-compatible endpoint and
//! reports what its clients saw; `--sweep-rate` finds the highest open-loop rate that still meets the SLO.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use loadgen::client::{Endpoint, Target};
use loadgen::prompt::PromptBuilder;
use loadgen::run::{RunConfig, Text};
use loadgen::schedule::Arrivals;
use loadgen::summary::{Record, Slo, Summary};

use super::workload::{WorkloadArgs, untimed_error};

/// Share of requests that must meet the SLO for a rate to count as sustained in a sweep.
const DEFAULT_ATTAINMENT: f64 = 0.9;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The server's base URL (http only; loopback or a server you run).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// Model name to request (default: the first one `/v1/models` lists).
    #[arg(long)]
    model: Option<String>,
    /// Bearer key for the server.
    #[arg(long, env = "OPENAI_API_KEY")]
    api_key: Option<String>,
    /// `completions` (exact prompt lengths) or `chat`.
    #[arg(long, default_value = "completions")]
    endpoint: String,
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Closed loop: keep this many requests in flight (cannot show overload).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Open-loop rates START:END:STEPS run in turn; reports the goodput curve and the effective capacity.
    #[arg(long)]
    sweep_rate: Option<String>,
    /// Share of requests meeting the SLO for a swept rate to count as sustained.
    #[arg(long, default_value_t = DEFAULT_ATTAINMENT)]
    attainment: f64,
    /// Stop sending new requests after this many seconds.
    #[arg(long)]
    duration: Option<f64>,
    /// Ask for exactly the trace's output lengths (no early end of text).
    #[arg(long)]
    ignore_eos: bool,
    /// Cut longer prompts to this many tokens (counted in the report; default: what fits the server's context
    /// from `/v1/models` `max_model_len`).
    #[arg(long)]
    max_isl: Option<usize>,
    /// SLOs per request, e.g. `ttft_ms=2000,tpot_ms=25`.
    #[arg(long, default_value = "")]
    slo: String,
    /// Seed for arrivals, synthetic workloads and each request's sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Per-request time limit in seconds.
    #[arg(long, default_value_t = 600.0)]
    timeout: f64,
    /// Write records.jsonl and summary.json (and sweep.json, sweep.svg) here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print the summary as JSON on stdout instead of the table.
    #[arg(long)]
    json: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// A GGUF file whose tokenizer builds the prompts (the embedded model's by default).
    #[arg(long, value_name = "PATH")]
    tokenizer_model: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<ExitCode, String> {
    let slo = Slo::parse(&args.slo)?;
    let endpoint = match args.endpoint.as_str() {
        "completions" => Endpoint::Completions,
        "chat" => Endpoint::Chat,
        other => return Err(format!("endpoint {other:?} is not one of completions, chat")),
    };
    let w = &args.workload;
    let picks = [w.rate.is_some(), args.concurrency.is_some(), args.sweep_rate.is_some()];
    if picks.iter().filter(|p| **p).count() > 1 {
        return Err("give at most one of --rate, --concurrency, --sweep-rate".into());
    }
    if w.trace.is_none() && !picks.iter().any(|p| *p) {
        return Err("a synthetic workload needs --rate, --concurrency or --sweep-rate (or give --trace)".into());
    }
    w.check_numbers()?;
    let block = w.trace_block()?;
    let mut requests = w.requests(args.seed, block)?;
    if !picks.iter().any(|p| *p)
        && let Some(k) = loadgen::schedule::untimed(&requests, &Arrivals::Trace { speedup: w.speedup })
    {
        return Err(untimed_error(k, "--rate, --concurrency or --sweep-rate"));
    }
    let (authority, base_path) = Target::parse_url(&args.url)?;
    let path = match &args.tokenizer_model {
        Some(p) => p.clone(),
        None => super::fetch_default()?,
    };
    let tokenizer = engine::tokenizer::Tokenizer::from_gguf(
        &engine::gguf::GgufFile::open(&path).map_err(|e| format!("{}: {e}", path.display()))?,
    )
    .map_err(|e| e.to_string())?;
    loadgen::trace::tokenize_literals(&mut requests, &tokenizer);
    let text = Text { builder: PromptBuilder::new(tokenizer.plain_words(), block), tokenizer: Arc::new(tokenizer) };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
    runtime.block_on(async move {
        let mut target = Target {
            authority,
            base_path,
            model: args.model.clone().unwrap_or_default(),
            api_key: args.api_key.clone(),
            endpoint,
            timeout: Duration::from_secs_f64(args.timeout),
        };
        let (listed, context) = served_model(&target).await?;
        if target.model.is_empty() {
            target.model = listed.ok_or("the server lists no model; pass --model")?;
        }
        let base = RunConfig {
            target,
            requests,
            arrivals: Arrivals::Trace { speedup: args.workload.speedup },
            duration: args.duration.map(Duration::from_secs_f64),
            ignore_eos: args.ignore_eos,
            max_isl: args.max_isl,
            context,
            slo,
            seed: args.seed,
            progress: !args.quiet,
        };
        match &args.sweep_rate {
            Some(spec) => sweep(&args, base, text, spec).await,
            None => {
                let arrivals = match (args.workload.rate, args.concurrency) {
                    (Some(rate), _) => Arrivals::Rate { rate, burstiness: args.workload.burstiness, seed: args.seed },
                    (_, Some(c)) => Arrivals::Concurrency(c),
                    _ => base.arrivals.clone(),
                };
                let (records, summary) = loadgen::run::run(RunConfig { arrivals, ..base }, text).await?;
                report(&args, &records, &summary)?;
                Ok(ExitCode::SUCCESS)
            }
        }
    })
}

/// The first model `/v1/models` lists and its `max_model_len`, when the server says.
async fn served_model(target: &Target) -> Result<(Option<String>, Option<usize>), String> {
    let text = loadgen::client::get(target, &format!("{}/v1/models", target.base_path)).await?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("/v1/models: {e}"))?;
    let first = &v["data"][0];
    Ok((first["id"].as_str().map(String::from), first["max_model_len"].as_u64().map(|n| n as usize)))
}

/// Runs each rate of `START:END:STEPS` in turn; the effective capacity is the highest that meets the SLO.
async fn sweep(args: &Args, base: RunConfig, text: Text, spec: &str) -> Result<ExitCode, String> {
    let rates = parse_sweep(spec)?;
    let mut points = Vec::new();
    for rate in rates {
        let arrivals = Arrivals::Rate { rate, burstiness: args.workload.burstiness, seed: args.seed };
        let (_, summary) = loadgen::run::run(RunConfig { arrivals, ..base.clone() }, text.clone()).await?;
        if !args.quiet {
            eprintln!(
                "rate {rate:>7.2}/s: goodput {:>7.2}/s, SLO met by {:>5.1}%, TTFT p90 {:>8.1} ms, failed {}{}",
                summary.goodput_requests_per_s,
                summary.slo_attainment * 100.0,
                summary.time_to_first_token_ms.p90,
                summary.failed,
                if summary.valid { "" } else { " (invalid run)" }
            );
        }
        points.push(SweepPoint { rate, summary });
    }
    let capacity = points
        .iter()
        .filter(|p| p.summary.valid && p.summary.slo_attainment >= args.attainment)
        .map(|p| p.rate)
        .fold(None, |m: Option<f64>, r| Some(m.map_or(r, |m| m.max(r))));
    let peak = points.iter().map(|p| p.summary.goodput_requests_per_s).fold(0.0, f64::max);
    let out = serde_json::json!({
        "slo": base.slo,
        "attainment": args.attainment,
        "effective_capacity_requests_per_s": capacity,
        "peak_goodput_requests_per_s": peak,
        "points": points.iter().map(|p| serde_json::json!({"rate": p.rate, "summary": p.summary})).collect::<Vec<_>>(),
    });
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        write(dir.join("sweep.json"), &serde_json::to_string_pretty(&out).unwrap_or_default())?;
        write(dir.join("sweep.svg"), &chart(&points))?;
    }
    if args.json {
        println!("{out}");
    } else {
        println!("{:>10} {:>12} {:>10} {:>12} {:>8}", "rate/s", "goodput/s", "SLO met", "TTFT p90 ms", "failed");
        for p in &points {
            let s = &p.summary;
            println!(
                "{:>10.2} {:>12.2} {:>9.1}% {:>12.1} {:>8}",
                p.rate,
                s.goodput_requests_per_s,
                s.slo_attainment * 100.0,
                s.time_to_first_token_ms.p90,
                s.failed
            );
        }
        match capacity {
            Some(c) => println!("effective capacity: {c:.2} requests/s ({:.0}% meet the SLO)", args.attainment * 100.0),
            None => println!("no swept rate met the SLO for {:.0}% of requests", args.attainment * 100.0),
        }
    }
    Ok(ExitCode::SUCCESS)
}

struct SweepPoint {
    rate: f64,
    summary: Summary,
}

fn parse_sweep(spec: &str) -> Result<Vec<f64>, String> {
    let bad = || format!("--sweep-rate {spec:?}: expected START:END:STEPS, e.g. 1:10:5");
    let parts: Vec<&str> = spec.split(':').collect();
    let [start, end, steps] = parts[..] else { return Err(bad()) };
    let (start, end): (f64, f64) = (start.parse().map_err(|_| bad())?, end.parse().map_err(|_| bad())?);
    let steps: usize = steps.parse().map_err(|_| bad())?;
    if !(start > 0.0 && end >= start && steps >= 1) {
        return Err(bad());
    }
    Ok((0..steps)
        .map(|i| if steps == 1 { start } else { start + (end - start) * i as f64 / (steps - 1) as f64 })
        .collect())
}

/// Goodput and offered rate against rate, as a small SVG line chart.
fn chart(points: &[SweepPoint]) -> String {
    let (w, h, pad) = (640.0, 360.0, 50.0);
    let max_x = points.iter().map(|p| p.rate).fold(1e-9, f64::max);
    let max_y = points.iter().map(|p| p.rate.max(p.summary.goodput_requests_per_s)).fold(1e-9, f64::max);
    let xy = |x: f64, y: f64| (pad + x / max_x * (w - 2.0 * pad), h - pad - y / max_y * (h - 2.0 * pad));
    let line = |f: &dyn Fn(&SweepPoint) -> f64| {
        points
            .iter()
            .map(|p| {
                let (x, y) = xy(p.rate, f(p));
                format!("{x:.1},{y:.1}")
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <line x1=\"{pad}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <line x1=\"{pad}\" y1=\"{pad}\" x2=\"{pad}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <polyline fill=\"none\" stroke=\"#999\" stroke-dasharray=\"4\" points=\"{offered}\"/>\n\
         <polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"2\" points=\"{goodput}\"/>\n\
         <text x=\"{cx}\" y=\"{h2}\" text-anchor=\"middle\">offered rate (requests/s), max {max_x:.2}</text>\n\
         <text x=\"12\" y=\"{pad}\">goodput (blue) vs offered (dashed), max {max_y:.2}/s</text>\n</svg>\n",
        b = h - pad,
        r = w - pad,
        offered = line(&|p| p.rate),
        goodput = line(&|p| p.summary.goodput_requests_per_s),
        cx = w / 2.0,
        h2 = h - 15.0,
    )
}

pub(super) fn write(path: PathBuf, text: &str) -> Result<(), String> {
    std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Writes the records and summary when asked, and prints the summary (table or JSON).
fn report(args: &Args, records: &[Record], summary: &Summary) -> Result<(), String> {
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let lines: Vec<String> = records.iter().filter_map(|r| serde_json::to_string(r).ok()).collect();
        write(dir.join("records.jsonl"), &(lines.join("\n") + "\n"))?;
        write(dir.join("summary.json"), &serde_json::to_string_pretty(summary).unwrap_or_default())?;
    }
    if args.json {
        println!("{}", serde_json::to_string(summary).unwrap_or_default());
    } else {
        print_table(summary);
    }
    Ok(())
}

fn print_table(s: &Summary) {
    println!("{:<28} {:>10} {:>10} {:>10} {:>10} {:>10}", "metric (ms)", "mean", "p50", "p90", "p99", "max");
    for (name, d) in [
        ("time to first token", &s.time_to_first_token_ms),
        ("time per output token", &s.time_per_output_token_ms),
        ("inter-token latency", &s.inter_token_latency_ms),
        ("request latency", &s.request_latency_ms),
        ("schedule lag", &s.schedule_lag_ms),
    ] {
        println!("{name:<28} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}", d.mean, d.p50, d.p90, d.p99, d.max);
    }
    println!(
        "requests {} (failed {}{}), {:.1} s{}",
        s.requests,
        s.failed,
        if s.errors_by_status.is_empty() { String::new() } else { format!(": {:?}", s.errors_by_status) },
        s.duration_s,
        if s.closed_loop { ", closed loop (cannot show overload)" } else { "" }
    );
    println!(
        "output {:.1} tokens/s, goodput {:.2} requests/s (SLO met by {:.1}%), cached prompt tokens {:.1}%, clipped \
         prompts {}",
        s.output_tokens_per_s,
        s.goodput_requests_per_s,
        s.slo_attainment * 100.0,
        s.cached_token_fraction * 100.0,
        s.clipped_prompts
    );
    if let Some(o) = s.step_overrun_p99 {
        println!("mock step overrun p99: at most {o}");
    }
    if !s.valid {
        println!("INVALID RUN: {}", s.invalid_reasons.join("; "));
    }
}
