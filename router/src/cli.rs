//! The router's command line and configuration: a TOML file, then `TANDEM_*` environment variables, then flags
//! (later sources win). Unknown keys are errors and every problem is reported at once. The file's `[scheduler]`
//! table is re-read when the file changes, so mounted weights can be edited live.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::Deserialize;

use crate::discovery::{DEFAULT_DNS_REFRESH, WorkerSource};
use crate::run::{RouterConfig, RunningRouter, defaults};
use crate::scheduler::config::SchedulerConfig;
use crate::state::{Limits, RouterState};

/// How often a mounted config file is checked for changes.
const CONFIG_POLL: Duration = Duration::from_secs(2);
/// How long shutdown waits for in-flight requests.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Settings as given by any source; all optional so that sources can be layered.
#[derive(Debug, Default, Deserialize, clap::Args)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// HTTP listen address.
    #[arg(long, env = "TANDEM_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// GGUF file for the tokenizer and chat template (default: the embedded model, fetched when missing).
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: Option<PathBuf>,
    /// The model name clients send.
    #[arg(long, env = "TANDEM_SERVED_MODEL")]
    pub served_model: Option<String>,
    /// Worker gRPC addresses, `ip:port` or a DNS `name:port` re-resolved periodically (comma-separated). Workers
    /// can also register themselves (`POST /admin/workers`).
    #[arg(long, env = "TANDEM_WORKERS", value_delimiter = ',')]
    pub workers: Option<Vec<String>>,
    /// Engine servers Tandem does not own, `http://host:port` (comma-separated): they serve whole requests, and
    /// what they cache is predicted from the prompts sent to them (`docs/external-engines.md`).
    #[arg(long, env = "TANDEM_EXTERNAL_WORKERS", value_delimiter = ',')]
    pub external_workers: Option<Vec<String>>,
    /// Which server the external workers run: `llama-server` (llama.cpp), `vllm` or `sglang`.
    #[arg(long, env = "TANDEM_EXTERNAL_ENGINE")]
    pub external_engine: Option<String>,
    /// Where the external workers publish their KV events, one `tcp://host:port` per `--external-workers` URL in
    /// the same order (empty for one that publishes none: its cache is predicted). vLLM's and SGLang's
    /// `--kv-events-config` `endpoint`.
    #[arg(long, env = "TANDEM_EXTERNAL_KV_EVENTS", value_delimiter = ',')]
    pub external_kv_events: Option<Vec<String>>,
    /// Their replay sockets (`replay_endpoint`), in the same order (empty: none).
    #[arg(long, env = "TANDEM_EXTERNAL_KV_REPLAY", value_delimiter = ',')]
    pub external_kv_replay: Option<Vec<String>>,
    /// Data-parallel ranks each external vLLM or SGLang server runs (its `--data-parallel-size` / `--dp-size`,
    /// default 1): each rank is routed to as a worker of its own, by number, its KV events followed on the
    /// configured ports plus the rank.
    #[arg(long, env = "TANDEM_EXTERNAL_DATA_PARALLEL_SIZE")]
    pub external_data_parallel_size: Option<u32>,
    /// Whether the external vLLM or SGLang servers schedule by priority (vLLM's `--scheduling-policy priority`,
    /// SGLang's `--enable-priority-scheduling`): `off` (default; a request with a priority then goes to Tandem's
    /// workers only), `on`, or the order they were told (`lower-first`: SGLang's
    /// `--schedule-low-priority-values-first`; `higher-first`).
    #[arg(long, env = "TANDEM_EXTERNAL_PRIORITY_SCHEDULING")]
    pub external_priority_scheduling: Option<String>,
    /// External workers one by one (the file's `[[external]]` tables), next to `external_workers`.
    #[arg(skip)]
    pub external: Option<Vec<ExternalWorker>>,
    /// Seconds a block predicted on an external worker is kept without being sent again (default 120).
    #[arg(long, env = "TANDEM_EXTERNAL_PREDICTED_TTL_SECS")]
    pub external_predicted_ttl_secs: Option<u64>,
    /// Blocks predicted per external worker at most (default: as many as its KV holds, from its `/props`).
    #[arg(long, env = "TANDEM_EXTERNAL_PREDICTED_BLOCKS")]
    pub external_predicted_blocks: Option<u64>,
    /// Seconds between DNS resolutions of worker names.
    #[arg(long, env = "TANDEM_DNS_REFRESH_SECS")]
    pub dns_refresh_secs: Option<u64>,
    /// Directory with ca.pem, <name>.pem and <name>.key (default: $TANDEM_HOME/certs).
    #[arg(long, env = "TANDEM_CERTS_DIR")]
    pub certs_dir: Option<PathBuf>,
    /// This router's certificate name (default: router).
    #[arg(long, env = "TANDEM_CERT_NAME")]
    pub cert_name: Option<String>,
    /// Accepted API keys (comma-separated); none: no key needed.
    #[arg(long, env = "TANDEM_API_KEYS", value_delimiter = ',')]
    pub api_keys: Option<Vec<String>>,
    /// API keys bound to tenants, as TENANT:KEY (comma-separated; a tenant may have several keys): each tenant's
    /// prompts are cached apart from everyone else's, so one cannot probe another's cache through its latency.
    #[arg(long, env = "TANDEM_TENANT_KEYS", value_delimiter = ',')]
    pub tenant_keys: Option<Vec<String>>,
    /// Let tenants share cached prompts after all (`true`); by default each tenant is its own cache namespace.
    #[arg(long, env = "TANDEM_SHARE_CACHE_ACROSS_TENANTS")]
    pub share_cache_across_tenants: Option<bool>,
    /// The key `/admin/*` and `/debug/*` require (workers registering themselves send it too); none: those
    /// endpoints answer only on loopback.
    #[arg(long, env = "TANDEM_ADMIN_KEY")]
    pub admin_key: Option<String>,
    /// Workers followed at most (registrations past it are refused).
    #[arg(long, env = "TANDEM_MAX_WORKERS")]
    pub max_workers: Option<usize>,
    #[arg(long, env = "TANDEM_MAX_IN_FLIGHT")]
    pub max_in_flight: Option<usize>,
    #[arg(long, env = "TANDEM_MAX_QUEUE")]
    pub max_queue: Option<usize>,
    /// Whole-request deadline in milliseconds.
    #[arg(long, env = "TANDEM_REQUEST_TIMEOUT_MS")]
    pub request_timeout_ms: Option<u64>,
    /// How long a prefill worker may take to answer before the next candidate is tried, in milliseconds (default
    /// 180 s: an 8k-token prompt on a small CPU).
    #[arg(long, env = "TANDEM_PREFILL_TIMEOUT_MS")]
    pub prefill_timeout_ms: Option<u64>,
    /// How long a decode stream may go without a token before it is resumed on another decode worker, in
    /// milliseconds (default 60 s).
    #[arg(long, env = "TANDEM_DECODE_IDLE_TIMEOUT_MS")]
    pub decode_idle_timeout_ms: Option<u64>,
    /// How long a worker may hold work while its engine computes nothing (a hung device, its process still
    /// answering) before it gets no new requests and its calls move to other workers, in milliseconds (default 30
    /// s; 0: never). Keep it above the longest engine step.
    #[arg(long, env = "TANDEM_STALL_AFTER_MS")]
    pub stall_after_ms: Option<u64>,
    /// Stream a long disaggregated prompt's KV to its decode worker while the prompt computes, piece by piece
    /// (default false: it pays on idle prefill workers and costs busy ones; docs/performance.md).
    #[arg(long, env = "TANDEM_STREAM_KV", value_name = "BOOL")]
    pub stream_kv: Option<bool>,
    #[arg(long, env = "TANDEM_MAX_MODEL_LEN")]
    pub max_model_len: Option<usize>,
    /// Record every request (arrival, lengths, tenant, re-keyed block hashes, decision; no text) to this new file,
    /// a trace `tandem sim` replays.
    #[arg(long, env = "TANDEM_RECORD_TRACE")]
    pub record_trace: Option<PathBuf>,
    /// With `--record-trace`: each decision with its candidates as scored (larger lines; for comparing a
    /// simulator's decisions with the router's, `docs/simulation.md`).
    #[arg(long, env = "TANDEM_RECORD_CANDIDATES", value_name = "BOOL")]
    pub record_candidates: Option<bool>,
    /// How the served model writes tool calls among its text (vLLM's `--tool-call-parser`: `hermes`, `llama3_json`,
    /// `mistral`, `pythonic`, `qwen3_coder`, `gemma4`, `deepseek_v3`, `deepseek_v31`, `deepseek_v32`, `glm45`,
    /// `minimax_m2`, `openai` (with the reasoning parser `openai_gptoss`), `seed_oss`, `kimi_k2`, `granite`, and vLLM's `llama4_json`, `llama4_pythonic`, `qwen3_xml`, `deepseek_v4` and `glm47` for the same
    /// formats): with one,
    /// `tool_choice: auto` (the default when a request has tools) is served and its calls parsed out of the answer;
    /// without one it is refused.
    #[arg(long, env = "TANDEM_TOOL_CALL_PARSER")]
    pub tool_call_parser: Option<crate::http::tools::ToolParser>,
    /// How the served model marks its thinking (vLLM's `--reasoning-parser`: `deepseek_r1`, `qwen3`, `gemma4`,
    /// `deepseek_v3`, `openai_gptoss`, `seed_oss`, `kimi_k2`, and `glm45` and `minimax_m2` for `qwen3`'s and `deepseek_r1`'s ways): with one, chat answers carry the text in `<think>` … `</think>` (Gemma 4's channel) apart, as
    /// `reasoning_content` (and `reasoning`).
    #[arg(long, env = "TANDEM_REASONING_PARSER")]
    pub reasoning_parser: Option<crate::http::reasoning::ReasoningParser>,
    /// The Responses API's stored responses (`store`, `previous_response_id`) are kept in this many MiB of the
    /// router's memory, the oldest dropped first (default 64); 0 keeps none.
    #[arg(long, env = "TANDEM_RESPONSES_STORE_MB", value_name = "MIB")]
    pub responses_store_mb: Option<usize>,
    /// Scheduler weights (the file's `[scheduler]` table; also `PUT /admin/router-config`).
    #[arg(skip)]
    pub scheduler: Option<SchedulerConfig>,
}

/// One external worker as the file's `[[external]]` table gives it.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExternalWorker {
    /// `http://host:port`.
    pub url: String,
    /// `llama-server`, `vllm` or `sglang` (default: `external_engine`, else `llama-server`).
    pub engine: Option<String>,
    /// Its KV event PUB socket, `tcp://host:port`; none: its cache is predicted.
    pub kv_events: Option<String>,
    /// Its replay ROUTER socket.
    pub kv_replay: Option<String>,
    /// The topic it publishes under (default: empty, everything on the socket).
    pub kv_topic: Option<String>,
    /// Its data-parallel ranks (default: `external_data_parallel_size`, else 1).
    pub data_parallel_size: Option<u32>,
    /// Its priority scheduling (default: `external_priority_scheduling`, else `off`).
    pub priority_scheduling: Option<String>,
}

/// Data-parallel ranks one external server may have at most.
const MAX_RANKS: u32 = 1024;

/// The external workers the settings name, or every reason they do not.
fn external_workers(s: &mut Settings, file: &mut Settings, problems: &mut Vec<String>) -> Vec<crate::external::Engine> {
    use crate::external::{Engine, EngineKind, PriorityOrder, events::EventSource};
    let default_kind = s.external_engine.take().or(file.external_engine.take());
    let kind = |name: Option<&str>, problems: &mut Vec<String>| {
        name.or(default_kind.as_deref())
            .map_or(Ok(EngineKind::LlamaServer), EngineKind::parse)
            .map_err(|e| problems.push(e))
            .ok()
    };
    let mut tables = file.external.take().unwrap_or_default();
    let urls: Vec<String> = s
        .external_workers
        .take()
        .or(file.external_workers.take())
        .unwrap_or_default()
        .into_iter()
        .filter(|u| !u.is_empty())
        .collect();
    let events = s.external_kv_events.take().or(file.external_kv_events.take()).unwrap_or_default();
    let replay = s.external_kv_replay.take().or(file.external_kv_replay.take()).unwrap_or_default();
    for (name, list) in [("external_kv_events", &events), ("external_kv_replay", &replay)] {
        if !list.is_empty() && list.len() != urls.len() {
            problems.push(format!("{name} names {} endpoints for {} external workers", list.len(), urls.len()));
        }
    }
    let ranks = s.external_data_parallel_size.take().or(file.external_data_parallel_size.take());
    let priority = s.external_priority_scheduling.take().or(file.external_priority_scheduling.take());
    let nonempty = |v: Option<&String>| v.filter(|e| !e.is_empty()).cloned();
    for (i, url) in urls.into_iter().enumerate() {
        tables.push(ExternalWorker {
            url,
            kv_events: nonempty(events.get(i)),
            kv_replay: nonempty(replay.get(i)),
            ..Default::default()
        });
    }
    let mut engines = Vec::new();
    for t in tables {
        let Some(kind) = kind(t.engine.as_deref(), problems) else { continue };
        let source = match (&t.kv_events, &t.kv_replay) {
            (None, Some(_)) => {
                problems.push(format!("{}: a replay socket without a KV event socket", t.url));
                continue;
            }
            (None, None) => None,
            (Some(endpoint), replay) => {
                let topic = t.kv_topic.as_deref().unwrap_or("");
                match EventSource::new(endpoint, replay.as_deref(), topic) {
                    Ok(source) => Some(source),
                    Err(e) => {
                        problems.push(format!("{}: {e}", t.url));
                        continue;
                    }
                }
            }
        };
        let dp = t.data_parallel_size.or(ranks).unwrap_or(1);
        if !(1..=MAX_RANKS).contains(&dp) {
            problems.push(format!("{}: data_parallel_size is 1 to {MAX_RANKS}, not {dp}", t.url));
            continue;
        }
        let order =
            match t.priority_scheduling.as_deref().or(priority.as_deref()).map(|p| PriorityOrder::parse(kind, p)) {
                Some(Err(e)) => {
                    problems.push(format!("{}: {e}", t.url));
                    continue;
                }
                Some(Ok(order)) => order,
                None => None,
            };
        match Engine::new(&t.url, kind).and_then(|engine| engine.with_events(source).with_priority(order).ranks(dp)) {
            Ok(ranks) => engines.extend(ranks),
            Err(e) => problems.push(e),
        }
    }
    engines
}

/// The router command line.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A TOML file with any of the settings (snake_case keys) and a `[scheduler]` table.
    #[arg(long, env = "TANDEM_CONFIG")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub settings: Settings,
}

fn read_file(path: &Path) -> Result<Settings, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// A resolved configuration, or every reason it is not one.
pub fn resolve(args: Args) -> Result<RouterConfig, String> {
    let mut file = args.config.as_deref().map(read_file).transpose()?.unwrap_or_default();
    let mut s = args.settings;
    let mut problems = Vec::new();
    let external = external_workers(&mut s, &mut file, &mut problems);
    let listen = s.listen.or(file.listen).map_or_else(|| defaults::LISTEN.parse().map_err(|e| format!("{e}")), Ok);
    let certs_dir = match s.certs_dir.or(file.certs_dir) {
        Some(d) => Some(d),
        None => engine::fetch::tandem_home().map(|h| h.join("certs")).map_err(|e| problems.push(e.to_string())).ok(),
    };
    let cert_name = s.cert_name.or(file.cert_name).unwrap_or_else(|| "router".into());
    let certs = certs_dir.clone().map(|dir| kv_transfer::tls::IdentityFiles { dir, name: cert_name.clone() });
    let identity = certs_dir
        .as_deref()
        .and_then(|dir| worker::cli::load_identity(dir, &cert_name).map_err(|e| problems.push(e)).ok());
    let model = match s.model.or(file.model) {
        Some(m) => Some(m),
        None => {
            engine::fetch::ensure_default_model(&engine::fetch::Quiet).map_err(|e| problems.push(e.to_string())).ok()
        }
    };
    let workers: Vec<WorkerSource> = s
        .workers
        .or(file.workers)
        .unwrap_or_default()
        .iter()
        .filter(|w| !w.is_empty())
        .filter_map(|w| WorkerSource::parse(w).map_err(|e| problems.push(e)).ok())
        .collect();
    let external_settings = crate::external::ExternalSettings {
        predicted_ttl: s
            .external_predicted_ttl_secs
            .or(file.external_predicted_ttl_secs)
            .map_or(crate::external::defaults::PREDICTED_TTL, Duration::from_secs),
        predicted_blocks: s.external_predicted_blocks.or(file.external_predicted_blocks),
        ..Default::default()
    };
    let dns_refresh = s.dns_refresh_secs.or(file.dns_refresh_secs).map_or(DEFAULT_DNS_REFRESH, Duration::from_secs);
    let scheduler = file.scheduler.unwrap_or_default();
    if let Err(e) = scheduler.validate() {
        problems.extend(e.into_iter().map(|e| format!("scheduler: {e}")));
    }
    let d = Limits::default();
    let limits = Limits {
        max_in_flight: s.max_in_flight.or(file.max_in_flight).unwrap_or(d.max_in_flight),
        max_queue: s.max_queue.or(file.max_queue).unwrap_or(d.max_queue),
        request_timeout: s
            .request_timeout_ms
            .or(file.request_timeout_ms)
            .map_or(d.request_timeout, Duration::from_millis),
        prefill_timeout: s
            .prefill_timeout_ms
            .or(file.prefill_timeout_ms)
            .map_or(d.prefill_timeout, Duration::from_millis),
        decode_idle_timeout: s
            .decode_idle_timeout_ms
            .or(file.decode_idle_timeout_ms)
            .map_or(d.decode_idle_timeout, Duration::from_millis),
        stream_kv: s.stream_kv.or(file.stream_kv).unwrap_or(d.stream_kv),
        ..d
    };
    let tenant_keys = crate::tenants::parse(&s.tenant_keys.or(file.tenant_keys).unwrap_or_default())
        .map_err(|e| problems.push(format!("tenant_keys: {e}")))
        .unwrap_or_default();
    let tenants = crate::tenants::Tenants::new(
        s.api_keys.or(file.api_keys).unwrap_or_default().into_iter().filter(|k| !k.is_empty()).collect(),
        tenant_keys,
        s.share_cache_across_tenants.or(file.share_cache_across_tenants).unwrap_or(false),
    );
    match (problems.is_empty(), listen, identity, model) {
        (true, Ok(listen), Some(identity), Some(model)) => Ok(RouterConfig {
            listen,
            model,
            served_model: s.served_model.or(file.served_model).unwrap_or_else(|| defaults::SERVED_MODEL.into()),
            workers,
            external,
            external_settings,
            dns_refresh,
            identity,
            certs,
            limits,
            scheduler,
            tenants,
            admin_key: s.admin_key.or(file.admin_key).filter(|k| !k.is_empty()),
            follow: crate::cluster::FollowSettings {
                max_workers: s.max_workers.or(file.max_workers).unwrap_or(crate::cluster::DEFAULT_MAX_WORKERS),
                stall: crate::resilience::StallSettings {
                    after: s
                        .stall_after_ms
                        .or(file.stall_after_ms)
                        .map_or(crate::resilience::stall_defaults::AFTER, Duration::from_millis),
                },
                ..Default::default()
            },
            block_size: defaults::BLOCK_SIZE,
            max_model_len: s.max_model_len.or(file.max_model_len),
            seed: None,
            record_trace: s.record_trace.or(file.record_trace),
            record_candidates: s.record_candidates.or(file.record_candidates).unwrap_or(false),
            tool_call_parser: s.tool_call_parser.or(file.tool_call_parser),
            reasoning_parser: s.reasoning_parser.or(file.reasoning_parser),
            responses_store_mb: s
                .responses_store_mb
                .or(file.responses_store_mb)
                .unwrap_or(crate::response_store::DEFAULT_MB),
        }),
        (_, listen, ..) => {
            problems.extend(listen.err().map(|e| format!("listen address: {e}")));
            Err(problems.join("\n"))
        }
    }
}

/// The scheduler settings a changed config file asks for: `Ok(None)` when it has no `[scheduler]` table (the live
/// weights, perhaps set through the admin API, stay as they are), `Err` when it cannot be read or is invalid.
fn scheduler_update(path: &Path) -> Result<Option<SchedulerConfig>, String> {
    let Some(c) = read_file(path)?.scheduler else { return Ok(None) };
    c.validate().map_err(|e| e.join("; "))?;
    Ok(Some(c))
}

/// Applies the file's `[scheduler]` table whenever the file changes.
pub async fn watch_scheduler(path: PathBuf, state: Arc<RouterState>) {
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let mut seen: Option<SystemTime> = modified(&path);
    loop {
        tokio::time::sleep(CONFIG_POLL).await;
        let now = modified(&path);
        if now == seen {
            continue;
        }
        seen = now;
        match scheduler_update(&path) {
            Ok(Some(c)) => {
                tracing::info!(file = %path.display(), "scheduler config reloaded");
                state.set_scheduler_config(c);
            }
            Ok(None) => tracing::info!(file = %path.display(), "no [scheduler] table; live weights unchanged"),
            Err(e) => tracing::warn!(file = %path.display(), error = %e, "scheduler config refused"),
        }
    }
}

/// Runs a router until SIGINT or SIGTERM.
pub fn run(args: Args) -> ExitCode {
    let file = args.config.clone();
    let config = match resolve(args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let process = match telemetry::Process::start("tandem-router") {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    process.block_on(async move {
        let router = match RunningRouter::start(config).await {
            Ok(r) => r,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        };
        let watcher = file.map(|f| tokio::spawn(watch_scheduler(f, Arc::clone(&router.state))));
        println!("tandem router listening: http://{}", router.addr);
        worker::cli::wait_for_signal().await;
        if let Some(w) = watcher {
            w.abort();
        }
        router.shutdown(SHUTDOWN_GRACE).await;
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::config::Policy;

    fn file(text: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("tandem-router-{}-{}.toml", std::process::id(), text.len()));
        std::fs::write(&p, text).expect("writes");
        p
    }

    #[test]
    fn the_file_carries_settings_and_scheduler_weights() {
        let p = file(
            "listen = \"127.0.0.1:8100\"\nworkers = [\"10.0.0.1:9000\", \"decode.svc:9000\"]\n\
             tool_call_parser = \"hermes\"\nreasoning_parser = \"qwen3\"\nresponses_store_mb = 8\n[scheduler]\npolicy = \"power_of_two\"\nhost_weight = 0.5\n",
        );
        let s = read_file(&p).expect("parses");
        assert_eq!(s.listen, Some(([127, 0, 0, 1], 8100).into()));
        assert_eq!(s.tool_call_parser, Some(crate::http::tools::ToolParser::Hermes));
        assert_eq!(s.reasoning_parser, Some(crate::http::reasoning::ReasoningParser::Qwen3));
        assert_eq!(s.responses_store_mb, Some(8));
        assert_eq!(s.workers.map(|w| w.len()), Some(2));
        let sched = s.scheduler.expect("scheduler table");
        assert_eq!((sched.policy, sched.host_weight, sched.disk_weight), (Policy::PowerOfTwo, 0.5, 0.25));
        let _ = std::fs::remove_file(p);
    }

    #[test]
    fn a_file_without_a_scheduler_table_leaves_the_live_weights_alone() {
        let p = file("listen = \"127.0.0.1:8101\"\nmax_queue = 5\n");
        assert_eq!(scheduler_update(&p), Ok(None));
        std::fs::write(&p, "[scheduler]\npolicy = \"random\"\n").expect("writes");
        assert_eq!(scheduler_update(&p).map(|c| c.map(|c| c.policy)), Ok(Some(Policy::Random)));
        std::fs::write(&p, "[scheduler]\ndecay = -1\n").expect("writes");
        assert!(scheduler_update(&p).is_err(), "an invalid table is refused, not applied");
        let _ = std::fs::remove_file(p);
    }

    #[test]
    fn unknown_keys_are_errors_anywhere() {
        for text in ["listen_addr = \"x\"\n", "[scheduler]\noverlap_weight = 1\n"] {
            let p = file(text);
            let e = read_file(&p).expect_err("refused");
            assert!(e.contains("unknown field"), "{e}");
            let _ = std::fs::remove_file(p);
        }
    }

    /// The external workers `flags` and `file` name, which must have no problem.
    fn resolved(flags: &mut Settings, file: &mut Settings) -> Vec<crate::external::Engine> {
        let mut problems = Vec::new();
        let engines = external_workers(flags, file, &mut problems);
        assert!(problems.is_empty(), "{problems:?}");
        engines
    }

    #[test]
    fn external_workers_from_flags_and_tables() {
        let p = file(
            "external_engine = \"vllm\"\n\
             [[external]]\nurl = \"http://10.0.0.9:30000\"\nengine = \"sglang\"\nkv_events = \"tcp://10.0.0.9:5557\"\n\
             kv_topic = \"kv\"\n",
        );
        let mut file = read_file(&p).expect("parses");
        let mut flags = Settings {
            external_workers: Some(vec!["http://10.0.0.5:8000".into(), "http://10.0.0.6:8000".into()]),
            external_kv_events: Some(vec!["tcp://10.0.0.5:5557".into(), "".into()]),
            external_kv_replay: Some(vec!["tcp://10.0.0.5:5558".into(), "".into()]),
            ..Default::default()
        };
        let engines = resolved(&mut flags, &mut file);
        let summary: Vec<_> = engines
            .iter()
            .map(|e| {
                (
                    e.url.as_str(),
                    e.kind,
                    e.events.as_ref().map(|s| (s.endpoint.as_str(), s.replay.as_deref(), s.topic.as_str())),
                )
            })
            .collect();
        use crate::external::EngineKind::{Sglang, Vllm};
        assert_eq!(
            summary,
            vec![
                ("http://10.0.0.9:30000", Sglang, Some(("tcp://10.0.0.9:5557", None, "kv"))),
                ("http://10.0.0.5:8000", Vllm, Some(("tcp://10.0.0.5:5557", Some("tcp://10.0.0.5:5558"), ""))),
                ("http://10.0.0.6:8000", Vllm, None),
            ]
        );
        // Lists that do not line up with the workers, and endpoints that are not tcp://, are reported.
        let mut bad = Settings {
            external_workers: Some(vec!["http://h:1".into(), "http://h:2".into()]),
            external_kv_events: Some(vec!["ipc:///tmp/kv".into()]),
            ..Default::default()
        };
        let mut problems = Vec::new();
        external_workers(&mut bad, &mut Settings::default(), &mut problems);
        assert_eq!(problems.len(), 2, "{problems:?}");
        let _ = std::fs::remove_file(p);
    }

    #[test]
    fn data_parallel_servers_are_a_worker_per_rank() {
        let p = file(
            "[[external]]\nurl = \"http://10.0.0.9:30000\"\nengine = \"sglang\"\ndata_parallel_size = 3\n\
             kv_events = \"tcp://10.0.0.9:5557\"\nkv_replay = \"tcp://10.0.0.9:6557\"\n",
        );
        let mut file = read_file(&p).expect("parses");
        let _ = std::fs::remove_file(p);
        let mut flags = Settings {
            external_engine: Some("vllm".into()),
            external_workers: Some(vec!["http://10.0.0.5:8000".into()]),
            external_data_parallel_size: Some(2),
            ..Default::default()
        };
        let engines = resolved(&mut flags, &mut file);
        let summary: Vec<_> = engines
            .iter()
            .map(|e| {
                let events = e.events.as_ref().map(|s| (s.endpoint.as_str(), s.replay.as_deref()));
                (e.name.as_str(), e.rank.map(|r| (r.rank, r.of)), events)
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                ("http://10.0.0.9:30000#dp0", Some((0, 3)), Some(("tcp://10.0.0.9:5557", Some("tcp://10.0.0.9:6557")))),
                ("http://10.0.0.9:30000#dp1", Some((1, 3)), Some(("tcp://10.0.0.9:5558", Some("tcp://10.0.0.9:6558")))),
                ("http://10.0.0.9:30000#dp2", Some((2, 3)), Some(("tcp://10.0.0.9:5559", Some("tcp://10.0.0.9:6559")))),
                ("http://10.0.0.5:8000#dp0", Some((0, 2)), None),
                ("http://10.0.0.5:8000#dp1", Some((1, 2)), None),
            ]
        );
        // Priority scheduling per server, a table's over the flag's.
        let p = self::file(
            "[[external]]\nurl = \"http://h:9\"\nengine = \"sglang\"\npriority_scheduling = \"lower-first\"\n",
        );
        let mut file = read_file(&p).expect("parses");
        let _ = std::fs::remove_file(p);
        let mut flags = Settings {
            external_engine: Some("sglang".into()),
            external_workers: Some(vec!["http://h:1".into()]),
            external_priority_scheduling: Some("on".into()),
            ..Default::default()
        };
        let orders: Vec<_> = resolved(&mut flags, &mut file).iter().map(|e| e.priority).collect();
        use crate::external::PriorityOrder::{HigherFirst, LowerFirst};
        assert_eq!(orders, [Some(LowerFirst), Some(HigherFirst)]);
        // llama-server has no ranks; a rank's port past 65535 and a size of 0 are reported.
        for (engine, size, events) in [("llama-server", 2, None), ("vllm", 2, Some("tcp://h:65535")), ("vllm", 0, None)]
        {
            let mut bad = Settings {
                external_engine: Some(engine.into()),
                external_workers: Some(vec!["http://h:1".into()]),
                external_kv_events: events.map(|e: &str| vec![e.to_string()]),
                external_data_parallel_size: Some(size),
                ..Default::default()
            };
            let mut problems = Vec::new();
            assert!(external_workers(&mut bad, &mut Settings::default(), &mut problems).is_empty());
            assert_eq!(problems.len(), 1, "{engine} {size}: {problems:?}");
        }
    }
}
