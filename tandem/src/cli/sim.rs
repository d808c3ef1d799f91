//! `tandem sim`: a trace through a simulated cluster in virtual time, once per routing policy on the same
//! arrivals, with the client-side figures `tandem bench serve` reports and what the cluster did (prefill work,
//! cache hits by tier, bytes moved, decisions by reason).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use engine::backend::TimingProfile;
use engine::backend::mock::MockSettings;
use engine::generate::{BackendChoice, EngineConfig};
use loadgen::summary::{RunFacts, Slo, Summary};
use router::scheduler::config::{Policy, SchedulerConfig};
use sim::oracle::References;
use sim::{Outcome, Settings};

use super::serve::write;
use super::workload::WorkloadArgs;

/// Stand-in bytes per KV block: none. Transfers are charged at the profile's modelled size and nothing reads the
/// values, so the simulator's blocks hold no bytes (copying stand-ins between tiers was 8% of a run).
const SIM_BLOCK_BYTES: usize = 0;

/// The simulated cluster.
#[derive(Debug, clap::Args)]
pub struct ClusterArgs {
    /// Prefill-only workers.
    #[arg(long, default_value_t = 8)]
    pub prefill: usize,
    /// Decode workers.
    #[arg(long, default_value_t = 8)]
    pub decode: usize,
    /// A router TOML file: its `[scheduler]` table sets the scheduler's settings (default: the router's).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Every worker's timing profile: gpu-default, cpu-smollm2 or a TOML file.
    #[arg(long, default_value = "gpu-default")]
    profile: String,
    /// Device KV blocks per worker (default: the profile's).
    #[arg(long)]
    kv_blocks: Option<usize>,
    /// Host tier blocks per worker (default: twice the device tier, as a worker).
    #[arg(long)]
    host_blocks: Option<usize>,
    /// Disk tier blocks per worker (real files in a temporary directory for the run; slower to simulate).
    #[arg(long, default_value_t = 0)]
    disk_blocks: usize,
    /// Prompt and decode tokens one step computes.
    #[arg(long, default_value_t = engine::generate::DEFAULT_MAX_BATCHED_TOKENS)]
    max_batched_tokens: usize,
    /// Longest prompt plus output.
    #[arg(long, default_value_t = engine::backend::mock::DEFAULT_MOCK_CONTEXT)]
    max_model_len: usize,
    /// Milliseconds from a worker's step to the router applying its KV events.
    #[arg(long, default_value_t = 1.0)]
    event_delay_ms: f64,
    /// Milliseconds from a worker's state change to the router reading its load report.
    #[arg(long, default_value_t = 1.0)]
    report_delay_ms: f64,
    /// The router's tokenizer, prompt tokens per second per slot: a request is routed only once tokenized (0:
    /// routing is instant). A router on a busy 2-core machine managed about 1e6 (docs/simulation.md).
    #[arg(long, default_value_t = 0.0)]
    router_tokens_per_s: f64,
    /// Tokenizer slots per router replica (the real router runs one per core).
    #[arg(long, default_value_t = 2)]
    router_slots: usize,
    /// The host's cores, shared by every worker's compute (one thread each): while k workers compute, each step
    /// advances at min(1, N / k) of its modelled speed. For a `tandem up` of CPU workers on one machine, with a
    /// profile fitted on one thread (engine/profiles/cpu-smollm2-1t.toml); 0 (the default): every worker has its
    /// own hardware.
    #[arg(long, default_value_t = 0)]
    host_cores: usize,
    /// The router streams a long prompt's KV while it computes (as the router's `--stream-kv`, off by default): the
    /// decode worker pulls the leading pieces during the prefill, only the last piece after it.
    #[arg(long, value_name = "BOOL", default_value_t = router::run::defaults::STREAM_KV, action = clap::ArgAction::Set)]
    stream_kv: bool,
    /// Requests each router replica holds at once, from admission to the end of their response (as the router's
    /// `--max-in-flight`; default: the router file's `max_in_flight`, else the router's default); later arrivals
    /// wait for a slot by their trace `priority` (lower first), then in order.
    #[arg(long)]
    max_in_flight: Option<usize>,
    /// Requests waiting for a slot at most (as the router's `--max-queue`); past it an arrival is refused with 429,
    /// unless it outranks the last one waiting, which is refused in its place.
    #[arg(long)]
    max_queue: Option<usize>,
    /// Longest wait for a slot, and then longest run once routed, in milliseconds (as the router's
    /// `--request-timeout-ms`); past either, 504.
    #[arg(long)]
    request_timeout_ms: Option<u64>,
    /// Workers that fail during the run, as NAME@SECONDS on the workload's clock (0: the first arrival; e.g.
    /// `decode-3@120`), comma
    /// separated: from then on the worker computes and reports nothing, and the router fails its requests over as
    /// the real one does (docs/simulation.md, "Failures"). NAME@SECONDS..SECONDS: it comes back then, as a new
    /// process (an empty cache, its share ramped up over the scheduler's `slow_start_secs`).
    #[arg(long, value_delimiter = ',', value_name = "NAME@SECONDS[..SECONDS]")]
    fail: Vec<String>,
    /// Workers that hang during the run, as NAME@SECONDS[..SECONDS], comma separated: the process stops with its
    /// connections open, so the router keeps routing to it until its watchdog finds the worker silent (10 s), and
    /// what it sent there fails over only when HTTP/2 keepalive closes the connection (20 s). With ..SECONDS the
    /// process goes on then, its cache intact: it reads the calls still open, and the router joins it again if
    /// it had dropped it (docs/simulation.md, "A worker that hangs").
    #[arg(long, value_delimiter = ',', value_name = "NAME@SECONDS[..SECONDS]")]
    hang: Vec<String>,
    /// Workers that answer every call with an error during the run (a broken device), as NAME@SECONDS[..SECONDS]
    /// (healed then), comma separated: their streams go on, so the router sees them up, idle and holding their
    /// cache, and only its circuit breaker (5 failures in a row eject a worker for 5 s, doubled each time) keeps
    /// requests away; what reaches them fails over at once (docs/simulation.md, "A worker that answers with errors").
    #[arg(long, value_delimiter = ',', value_name = "NAME@SECONDS[..SECONDS]")]
    errors: Vec<String>,
    /// Workers whose engine hangs during the run (a hung device) while the process answers and reports, as
    /// NAME@SECONDS[..SECONDS] (computing again then), comma separated: the router finds a worker stalled once it
    /// has held work that long without computing (`--stall-after-ms`), gives up its calls (they fail over) and
    /// sends it nothing more until it computes again (docs/simulation.md, "A worker whose engine stalls").
    #[arg(long, value_delimiter = ',', value_name = "NAME@SECONDS[..SECONDS]")]
    stall: Vec<String>,
    /// How long a worker may hold work without computing before the router counts it stalled, in milliseconds (as
    /// the router's `--stall-after-ms`; default: the router file's `stall_after_ms`, else the router's 30 s; 0:
    /// never).
    #[arg(long)]
    stall_after_ms: Option<u64>,
    /// How long the router waits for a prefill call to answer, or a decode stream for its first token, before it
    /// gives up and fails over, in milliseconds (as the router's `--prefill-timeout-ms`; default: the router file's
    /// `prefill_timeout_ms`, else the router's 180 s).
    #[arg(long)]
    prefill_timeout_ms: Option<u64>,
    /// How long a decode stream may go without a token before the router resumes it on another decode worker, in
    /// milliseconds (as the router's `--decode-idle-timeout-ms`; default: the router file's `decode_idle_timeout_ms`,
    /// else the router's 60 s).
    #[arg(long)]
    decode_idle_timeout_ms: Option<u64>,
    /// Router replicas, requests spread over them in turn, each with its own view and its own accounting of what
    /// it sent (the herding question: do they all pick the same "least loaded" worker?).
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    routers: usize,
    /// A mixed prefill pool: speed-ups of the profile, cycled over the prefill workers (e.g. `1,0.5`: every other
    /// worker half as fast).
    #[arg(long, value_delimiter = ',')]
    prefill_speedups: Vec<f64>,
    /// The model file whose vocabulary prompts and outputs are drawn from (default: the embedded model).
    #[arg(long)]
    model: Option<PathBuf>,
}

impl ClusterArgs {
    /// The simulator's settings for this cluster and workload.
    pub fn settings(&self, workload: &WorkloadArgs, seed: u64) -> Result<Settings, String> {
        let profile = TimingProfile::load(&self.profile).map_err(|e| e.to_string())?;
        let router = self.router_file()?;
        if !(self.router_tokens_per_s.is_finite() && self.router_tokens_per_s >= 0.0) {
            return Err("--router-tokens-per-s must be a number >= 0".into());
        }
        Ok(Settings {
            model: match &self.model {
                Some(p) => p.clone(),
                None => super::fetch_default()?,
            },
            prefill: self.prefill,
            decode: self.decode,
            engine: self.engine_config(profile.clone()),
            scheduler: scheduler_config(&router)?,
            event_delay: self.event_delay_ms / 1000.0,
            report_delay: self.report_delay_ms / 1000.0,
            transfer_latency: profile.transfer.latency_ms / 1000.0,
            transfer_bandwidth: profile.transfer.bandwidth_bytes_per_s,
            transfer_block_bytes: profile.transfer.block_bytes,
            trace_block: workload.trace_block()?,
            max_isl: self.max_model_len,
            routers: self.routers,
            prefill_speedups: self.prefill_speedups.clone(),
            replay: false,
            record_candidates: false,
            stall_after: self
                .stall_after_ms
                .or(whole_number(&router, "stall_after_ms")?)
                .map_or(router::resilience::stall_defaults::AFTER.as_secs_f64(), |ms| ms as f64 / 1000.0),
            timeouts: self.timeouts(&router)?,
            router_tokens_per_s: self.router_tokens_per_s,
            router_slots: self.router_slots,
            host_cores: self.host_cores,
            stream_kv: self.stream_kv,
            admission: self.admission(&router)?,
            failures: self.failures()?,
            seed,
        })
    }

    /// `--fail`'s workers, then `--hang`'s, `--errors`' and `--stall`'s.
    fn failures(&self) -> Result<Vec<sim::Failure>, String> {
        let kinds = [
            ("fail", &self.fail, sim::Fault::Crash),
            ("hang", &self.hang, sim::Fault::Hang),
            ("errors", &self.errors, sim::Fault::Errors),
            ("stall", &self.stall, sim::Fault::Stall),
        ];
        kinds
            .into_iter()
            .flat_map(|(flag, texts, fault)| texts.iter().map(move |text| parse_failure(flag, text, fault)))
            .collect()
    }

    /// The `--config` router file, read once (empty without one).
    fn router_file(&self) -> Result<RouterFile, String> {
        match self.config.as_deref() {
            Some(path) => Ok(RouterFile { table: read_table(path)?, name: path.display().to_string() }),
            None => Ok(RouterFile { table: toml::Table::new(), name: String::new() }),
        }
    }

    /// The router's admission limits: the flags, else the router file's top-level keys of the same names, else
    /// the router's defaults.
    fn admission(&self, router: &RouterFile) -> Result<sim::Limits, String> {
        let key = |name: &str| whole_number(router, name);
        let d = sim::Limits::default();
        Ok(sim::Limits {
            max_in_flight: self.max_in_flight.or(key("max_in_flight")?.map(|n| n as usize)).unwrap_or(d.max_in_flight),
            max_queue: self.max_queue.or(key("max_queue")?.map(|n| n as usize)).unwrap_or(d.max_queue),
            request_timeout: self
                .request_timeout_ms
                .or(key("request_timeout_ms")?)
                .map_or(d.request_timeout, |ms| ms as f64 / 1000.0),
        })
    }

    /// The router's limits on each call to a worker: the flags, else the router file's, else the router's defaults.
    fn timeouts(&self, router: &RouterFile) -> Result<sim::CallTimeouts, String> {
        let d = sim::CallTimeouts::default();
        let secs = |flag: Option<u64>, name: &str, default: f64| -> Result<f64, String> {
            match flag.or(whole_number(router, name)?) {
                Some(0) => Err(format!("{name} must be above 0 ms")),
                Some(ms) => Ok(ms as f64 / 1000.0),
                None => Ok(default),
            }
        };
        Ok(sim::CallTimeouts {
            prefill: secs(self.prefill_timeout_ms, "prefill_timeout_ms", d.prefill)?,
            decode_idle: secs(self.decode_idle_timeout_ms, "decode_idle_timeout_ms", d.decode_idle)?,
        })
    }

    /// Every worker's engine: the mock backend in virtual time, tiers as a worker has them.
    fn engine_config(&self, profile: TimingProfile) -> EngineConfig {
        let kv_blocks = self.kv_blocks.or(profile.device_blocks).unwrap_or(engine::generate::DEFAULT_KV_BLOCKS);
        let mock = MockSettings {
            profile,
            speedup: 1.0,
            block_bytes: SIM_BLOCK_BYTES,
            context_len: self.max_model_len,
            virtual_time: true,
            fault: Default::default(),
        };
        EngineConfig {
            backend: BackendChoice::Mock(Box::new(mock)),
            kv_blocks,
            host_blocks: self.host_blocks.unwrap_or(worker::cli::HOST_TIER_FACTOR * kv_blocks),
            disk_blocks: self.disk_blocks,
            max_batched_tokens: self.max_batched_tokens,
            max_model_len: Some(self.max_model_len),
            ..EngineConfig::default()
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Routing policies to compare, each on the same arrivals from a fresh cluster.
    #[arg(long, default_value = "kv,round_robin,least_loaded,power_of_two,random")]
    policies: String,
    /// SLOs per request, e.g. `ttft_ms=2000,tpot_ms=25`.
    #[arg(long, default_value = "")]
    slo: String,
    /// Seed for routing ties and each request's sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write per policy `POLICY/records.jsonl`, `POLICY/summary.json`, `POLICY/placements.jsonl` (each request's
    /// workers) and `POLICY/queues.svg`, and `sim.json`,
    /// `ttft_cdf.svg` and `cache_by_tier.svg`, here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// With `--out`: each line of `placements.jsonl` also has its decision's candidates as scored, as a router's
    /// `--record-candidates` recording has them (to find where the two routers' inputs part).
    #[arg(long)]
    record_candidates: bool,
    /// Print the result as JSON on stdout instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<ExitCode, String> {
    let started = Instant::now();
    let slo = Slo::parse(&args.slo)?;
    let policies = parse_policies(&args.policies)?;
    let base =
        Settings { record_candidates: args.record_candidates, ..args.cluster.settings(&args.workload, args.seed)? };
    let (requests, arrivals) = args.workload.load(args.seed, &base.model)?;
    let starts = loadgen::schedule::plan(&requests, &arrivals);
    let mut results: BTreeMap<String, serde_json::Value> = BTreeMap::new();
    let mut rows: Vec<(String, Outcome, Summary)> = Vec::new();
    // A router recording's own decisions go first, replayed on the same arrivals as every policy.
    let recorded = requests.iter().any(|r| r.recorded.is_some());
    let runs = recorded.then(|| ("recorded".to_string(), Settings { replay: true, ..base.clone() })).into_iter().chain(
        policies.into_iter().map(|policy| {
            let scheduler = SchedulerConfig { policy, ..base.scheduler.clone() };
            (policy.as_str().to_string(), Settings { scheduler, ..base.clone() })
        }),
    );
    for (label, settings) in runs {
        let outcome = sim::simulate(&settings, &requests, &starts).map_err(|e| format!("{label}: {e}"))?;
        if let Some(why) = engine_failures(&outcome.records) {
            eprintln!("warning: {label}: {why}");
        }
        let facts = RunFacts { duration_s: outcome.duration_s, ..RunFacts::default() };
        let summary = loadgen::summary::summarize(&outcome.records, slo, &facts);
        if let Some(dir) = &args.out {
            write_run(&dir.join(&label), &outcome, &summary)?;
        }
        results.insert(label.clone(), policy_json(&outcome, &summary));
        rows.push((label, outcome, summary));
    }
    // The references replay the first policy's arrival order (later turns of a session may arrive in another
    // order under another policy; their prompts are the same).
    let e = &base.engine;
    let capacity = (base.prefill + base.decode) * (e.kv_blocks + e.host_blocks + e.disk_blocks);
    let oracle = rows.first().map(|(_, o, _)| sim::oracle::references(&o.arrivals, e.block_tokens, capacity));
    let out = serde_json::json!({
        "policies": results,
        "oracle": oracle,
        "wall_seconds": started.elapsed().as_secs_f64(),
    });
    if let Some(dir) = &args.out {
        let outcomes: Vec<(&str, &Outcome)> = rows.iter().map(|(p, o, _)| (p.as_str(), o)).collect();
        super::sim_charts::write_charts(dir, &outcomes, base.prefill)?;
        write(dir.join("sim.json"), &serde_json::to_string_pretty(&out).unwrap_or_default())?;
    }
    if args.json {
        println!("{out}");
    } else {
        print_table(&rows, oracle, requests.len(), started.elapsed().as_secs_f64());
    }
    Ok(ExitCode::SUCCESS)
}

/// The router file's top-level key `name`, a whole number >= 0, if it has one.
fn whole_number(router: &RouterFile, name: &str) -> Result<Option<u64>, String> {
    match router.table.get(name) {
        None => Ok(None),
        Some(v) => v
            .as_integer()
            .and_then(|n| u64::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| format!("{}: {name} must be a whole number >= 0", router.name)),
    }
}

/// What to say when simulated engines failed requests (500): in a simulation that is a misconfigured cluster or a
/// bug, never load, and the figures around it mean little. Refusals for load (429), requests no worker could
/// finish after failures (502, 503) and waits for a router slot that ran out (504) are the cluster's answers, not
/// engine failures.
fn engine_failures(records: &[loadgen::summary::Record]) -> Option<String> {
    let mut failed = records.iter().filter(|r| r.status == 500);
    let first = failed.next()?;
    Some(format!(
        "{} of {} requests failed in the engine (first, request {}: {})",
        1 + failed.count(),
        records.len(),
        first.index,
        first.error.as_deref().unwrap_or("no reason given")
    ))
}

fn parse_policies(list: &str) -> Result<Vec<Policy>, String> {
    list.split(',')
        .map(|name| {
            serde_json::from_value(serde_json::Value::String(name.trim().to_string()))
                .map_err(|_| format!("--policies: {name:?} is not a policy (kv, round_robin, least_loaded, power_of_two, random, prefix_hash, sglang_threshold)"))
        })
        .collect()
}

/// A router TOML file as a table, and its name for messages.
struct RouterFile {
    table: toml::Table,
    name: String,
}

/// The router file's `[scheduler]` table (the defaults without one).
fn scheduler_config(router: &RouterFile) -> Result<SchedulerConfig, String> {
    let path = &router.name;
    let config: SchedulerConfig = match router.table.get("scheduler") {
        Some(t) => t.clone().try_into().map_err(|e| format!("{path}: [scheduler]: {e}"))?,
        None => SchedulerConfig::default(),
    };
    config.validate().map_err(|e| format!("{path}: [scheduler]: {}", e.join("; ")))?;
    Ok(config)
}

/// `NAME@SECONDS` or `NAME@SECONDS..SECONDS` (given to `--flag`): a worker's failure of kind `fault`, and when
/// it comes back.
fn parse_failure(flag: &str, text: &str, fault: sim::Fault) -> Result<sim::Failure, String> {
    let bad =
        || format!("--{flag} {text}: NAME@SECONDS or NAME@SECONDS..SECONDS, e.g. decode-3@120 or decode-3@120..180");
    let (worker, times) = text.split_once('@').ok_or_else(bad)?;
    let time = |t: &str| t.trim().parse::<f64>().ok().filter(|t| t.is_finite() && *t >= 0.0).ok_or_else(bad);
    let (at, back) = match times.split_once("..") {
        Some((at, back)) => (time(at)?, Some(time(back)?)),
        None => (time(times)?, None),
    };
    if worker.trim().is_empty() || back.is_some_and(|b| b <= at) {
        return Err(bad());
    }
    Ok(sim::Failure { worker: worker.trim().to_string(), at, back, fault })
}

/// A router TOML file, read as a table.
fn read_table(path: &std::path::Path) -> Result<toml::Table, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn policy_json(o: &Outcome, s: &Summary) -> serde_json::Value {
    let mut v = serde_json::to_value(s).unwrap_or_default();
    if let Some(m) = v.as_object_mut() {
        m.insert("prefill_tokens_computed".into(), o.prefill_tokens_computed.into());
        m.insert("cached_tokens_by_tier".into(), serde_json::json!(o.cached_tokens_by_tier));
        m.insert("transfer_bytes".into(), o.transfer_bytes.into());
        m.insert("decisions".into(), serde_json::json!(o.decisions));
        m.insert("requests_per_worker".into(), serde_json::json!(o.per_worker));
        m.insert("balance".into(), serde_json::json!(o.balance));
    }
    v
}

fn write_run(dir: &std::path::Path, o: &Outcome, s: &Summary) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let lines: Vec<String> = o.records.iter().filter_map(|r| serde_json::to_string(r).ok()).collect();
    write(dir.join("records.jsonl"), &(lines.join("\n") + "\n"))?;
    let placed: Vec<String> = o.placements.iter().map(|p| serde_json::to_string(p).unwrap_or_default()).collect();
    write(dir.join("placements.jsonl"), &(placed.join("\n") + "\n"))?;
    write(dir.join("summary.json"), &serde_json::to_string_pretty(&policy_json(o, s)).unwrap_or_default())
}

fn print_table(rows: &[(String, Outcome, Summary)], oracle: Option<References>, requests: usize, wall: f64) {
    println!(
        "{:<17}{:>10}{:>10}{:>10}{:>9}{:>9}{:>11}{:>9}{:>14}{:>9}{:>7}{:>10}{:>10}",
        "policy",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99",
        "ITL p50",
        "ITL p90",
        "E2E p90",
        "goodput",
        "prefill tok",
        "cached",
        "failed",
        "P CV",
        "D CV"
    );
    for (p, o, s) in rows {
        println!(
            "{:<17}{:>10.1}{:>10.1}{:>10.1}{:>9.1}{:>9.1}{:>11.1}{:>9.2}{:>14}{:>8.1}%{:>7}{:>10.2}{:>10.2}",
            p,
            s.time_to_first_token_ms.p50,
            s.time_to_first_token_ms.p90,
            s.time_to_first_token_ms.p99,
            s.inter_token_latency_ms.p50,
            s.inter_token_latency_ms.p90,
            s.request_latency_ms.p90,
            s.goodput_requests_per_s,
            o.prefill_tokens_computed,
            s.cached_token_fraction * 100.0,
            s.failed,
            o.balance.prefill_cv_mean,
            o.balance.decode_cv_mean
        );
    }
    if let Some(r) = oracle {
        println!(
            "prefill tokens with one pooled cache of the cluster's {} blocks: Belady {}, LRU {}; infinite cache {}",
            r.capacity_blocks, r.belady_prefill_tokens, r.pooled_lru_prefill_tokens, r.infinite_cache_prefill_tokens
        );
        let ratio = |a: u64, b: u64| if b == 0 { f64::NAN } else { a as f64 / b as f64 };
        for (p, o, _) in rows {
            let t = o.prefill_tokens_computed;
            println!(
                "  {:<17} {:.3}x Belady, {:.3}x pooled LRU, {:.3}x infinite",
                p,
                ratio(t, r.belady_prefill_tokens),
                ratio(t, r.pooled_lru_prefill_tokens),
                ratio(t, r.infinite_cache_prefill_tokens)
            );
        }
    }
    let events: Vec<(&String, String)> =
        rows.iter().filter_map(|(p, o, _)| Some((p, events_line(&o.decisions)?))).collect();
    if !events.is_empty() {
        println!("failures, failovers and the router's queue:");
        for (p, line) in events {
            println!("  {p:<17} {line}");
        }
    }
    if let Some((_, _, rec)) = rows.iter().find(|(p, _, _)| p == "recorded") {
        println!("counterfactual: each policy against the recorded decisions on the same arrivals (negative: better)");
        for (p, _, s) in rows.iter().filter(|(p, _, _)| p != "recorded") {
            let pct = |a: f64, b: f64| if b > 0.0 { (a / b - 1.0) * 100.0 } else { f64::NAN };
            println!(
                "  {:<17} TTFT p90 {:+.1}%, E2E p90 {:+.1}%, goodput {:+.1}%",
                p,
                pct(s.time_to_first_token_ms.p90, rec.time_to_first_token_ms.p90),
                pct(s.request_latency_ms.p90, rec.request_latency_ms.p90),
                pct(s.goodput_requests_per_s, rec.goodput_requests_per_s)
            );
        }
    }
    println!(
        "P CV, D CV: coefficient of variation of requests held per prefill and per decode worker, mean over arrivals"
    );
    println!(
        "{requests} requests per policy, times in ms of virtual time, goodput in requests/s; {wall:.1} s of wall time"
    );
}

/// What befell a run besides routing, from its decisions (failures and failovers, the router's queue), in one line;
/// `None` when nothing did.
fn events_line(decisions: &BTreeMap<String, u64>) -> Option<String> {
    const EVENTS: [&str; 17] = [
        "worker_failed",
        "worker_hung",
        "worker_erring",
        "worker_stuck",
        "stall_detected",
        "prefill_timeout",
        "decode_idle_timeout",
        "worker_ejected",
        "worker_back",
        "worker_resumed",
        "worker_rejoined",
        "prefill_refused",
        "prefill_retried",
        "local_prefill_after_failure",
        "decode_resumed",
        "overloaded",
        "deadline",
    ];
    let seen: Vec<String> =
        EVENTS.iter().filter_map(|&e| decisions.get(e).filter(|&&n| n > 0).map(|n| format!("{e} {n}"))).collect();
    (!seen.is_empty()).then(|| seen.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use loadgen::summary::Record;

    #[test]
    fn failures_and_the_routers_queue_get_a_line_of_their_own() {
        let mut d: BTreeMap<String, u64> = [("prefill_remote".to_string(), 40), ("all_busy".to_string(), 3)].into();
        assert_eq!(events_line(&d), None, "routing decisions and refusals are in the table already");
        d.extend([("decode_resumed".to_string(), 11), ("worker_failed".to_string(), 1), ("deadline".to_string(), 0)]);
        assert_eq!(events_line(&d).as_deref(), Some("worker_failed 1, decode_resumed 11"));
    }

    #[test]
    fn engine_failures_are_named_and_load_refusals_are_not() {
        let rec = |index, status: u16, error: Option<&str>| Record {
            index,
            status,
            error: error.map(str::to_string),
            ..Record::default()
        };
        let mut records = vec![
            rec(0, 200, None),
            rec(1, 429, Some("every decode worker is busy")),
            rec(4, 504, Some("the request waited for a router slot until its deadline")),
            rec(5, 502, Some("no decode worker finished the request after 3 attempts")),
        ];
        assert_eq!(engine_failures(&records), None);
        records.push(rec(2, 500, Some("block 0 is outside the KV store")));
        records.push(rec(3, 500, None));
        let why = engine_failures(&records).expect("named");
        assert_eq!(why, "2 of 6 requests failed in the engine (first, request 2: block 0 is outside the KV store)");
    }

    #[test]
    fn a_failure_is_a_name_and_seconds() {
        let failure = |at, back| sim::Failure { worker: "decode-3".into(), at, back, fault: sim::Fault::Crash };
        let parse = |text| parse_failure("fail", text, sim::Fault::Crash);
        assert_eq!(parse("decode-3@120"), Ok(failure(120.0, None)));
        assert_eq!(parse("decode-3@120..180"), Ok(failure(120.0, Some(180.0))));
        assert_eq!(parse("prefill-0@0.5").map(|f| f.at), Ok(0.5));
        let bad = ["decode-3", "decode-3@", "@5", "decode-3@-1", "decode-3@soon", "decode-3@inf", "decode-3@120..90"];
        for bad in bad {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[derive(clap::Parser)]
    struct Cluster {
        #[command(flatten)]
        cluster: ClusterArgs,
    }

    fn admission(args: &[&str]) -> Result<sim::Limits, String> {
        use clap::Parser;
        let parsed =
            Cluster::try_parse_from(std::iter::once("sim").chain(args.iter().copied())).map_err(|e| e.to_string())?;
        parsed.cluster.admission(&parsed.cluster.router_file()?)
    }

    fn failures(args: &[&str]) -> Result<Vec<sim::Failure>, String> {
        use clap::Parser;
        let parsed =
            Cluster::try_parse_from(std::iter::once("sim").chain(args.iter().copied())).map_err(|e| e.to_string())?;
        parsed.cluster.failures()
    }

    #[test]
    fn hangs_and_errors_are_failures_of_their_own_kind() {
        use sim::Fault::*;
        let got =
            failures(&["--fail", "decode-1@3", "--hang", "decode-0@5,prefill-2@7.5..9", "--errors", "decode-2@1..4"])
                .expect("parsed");
        let f = |worker: &str, at, back, fault| sim::Failure { worker: worker.into(), at, back, fault };
        let want = [
            f("decode-1", 3.0, None, Crash),
            f("decode-0", 5.0, None, Hang),
            f("prefill-2", 7.5, Some(9.0), Hang),
            f("decode-2", 1.0, Some(4.0), Errors),
        ];
        assert_eq!(got, want);
        let bad = failures(&["--errors", "decode-0@x"]).expect_err("refused");
        assert!(bad.starts_with("--errors decode-0@x: NAME@SECONDS"), "{bad}");
        let bad = failures(&["--hang", "decode-0"]).expect_err("refused");
        assert!(bad.contains("--hang decode-0: NAME@SECONDS"), "{bad}");
    }

    #[test]
    fn admission_limits_come_from_the_flags_then_the_router_file_then_the_routers_defaults() {
        let d = sim::Limits::default();
        assert_eq!(admission(&[]), Ok(d));
        let dir = std::env::temp_dir().join(format!("tandem-sim-admission-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let file = dir.join("router.toml");
        std::fs::write(&file, "max_in_flight = 5\nrequest_timeout_ms = 2500\n[scheduler]\n").expect("written");
        let path = file.to_str().expect("a UTF-8 path");
        let from_file = sim::Limits { max_in_flight: 5, request_timeout: 2.5, ..d };
        assert_eq!(admission(&["--config", path]), Ok(from_file));
        assert_eq!(
            admission(&["--config", path, "--max-in-flight", "7", "--max-queue", "3"]),
            Ok(sim::Limits { max_in_flight: 7, max_queue: 3, ..from_file })
        );
        std::fs::write(&file, "max_queue = -1\n").expect("written");
        let err = admission(&["--config", path]).expect_err("a negative queue");
        assert!(err.contains("max_queue must be a whole number"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn timeouts(args: &[&str]) -> Result<sim::CallTimeouts, String> {
        use clap::Parser;
        let parsed =
            Cluster::try_parse_from(std::iter::once("sim").chain(args.iter().copied())).map_err(|e| e.to_string())?;
        parsed.cluster.timeouts(&parsed.cluster.router_file()?)
    }

    #[test]
    fn a_cluster_has_at_least_one_router() {
        use clap::Parser;
        let parse = |n: &str| Cluster::try_parse_from(["sim", "--routers", n]).map(|c| c.cluster.routers);
        assert_eq!(parse("3").ok(), Some(3));
        let err = parse("0").expect_err("no router").to_string();
        assert!(err.contains("--routers"), "{err}");
    }

    #[test]
    fn call_timeouts_come_from_the_flags_then_the_router_file_then_the_routers_defaults() {
        let d = sim::CallTimeouts::default();
        assert_eq!((d.prefill, d.decode_idle), (180.0, 60.0));
        assert_eq!(timeouts(&[]), Ok(d));
        let dir = std::env::temp_dir().join(format!("tandem-sim-timeouts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let file = dir.join("router.toml");
        std::fs::write(
            &file,
            "prefill_timeout_ms = 5000
[scheduler]
",
        )
        .expect("written");
        let path = file.to_str().expect("a UTF-8 path");
        assert_eq!(timeouts(&["--config", path]), Ok(sim::CallTimeouts { prefill: 5.0, ..d }));
        assert_eq!(
            timeouts(&["--config", path, "--prefill-timeout-ms", "7000", "--decode-idle-timeout-ms", "2500"]),
            Ok(sim::CallTimeouts { prefill: 7.0, decode_idle: 2.5 })
        );
        let err = timeouts(&["--decode-idle-timeout-ms", "0"]).expect_err("no limit at all");
        assert!(err.contains("decode_idle_timeout_ms must be above 0"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
