//! `tandem bench router`: what the router adds to the time to the first token. One mock worker whose steps take no
//! time (the profile's durations divided by a large speed-up) serves the same requests (one token each unless
//! `--max-tokens`) two ways, side by side at each concurrency: straight to its gRPC `Generate` (token ids, mutual
//! TLS, one HTTP/2 channel), and through a router (`POST /v1/completions` with the prompt as text on a kept-alive
//! HTTP/1.1 connection per stream: parse, tokenize, route, the router's own gRPC call, SSE back). The difference of
//! the two is the router's overhead. The router runs on a runtime of its own, whose threads' processor time is read
//! apart from the client's and the worker's: what a router on cores of its own would spend per request.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv_transfer::tls::{DevCa, Identity};
use proto::worker as pb;
use router::discovery::WorkerSource;
use router::run::{RouterConfig, RunningRouter, defaults};
use router::state::Limits;
use worker::{Role, RunningWorker, WorkerConfig};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Concurrent streams, each level measured in turn.
    #[arg(long, value_delimiter = ',', default_value = "1,64,512")]
    concurrency: Vec<usize>,
    /// Requests per level and path (spread over its streams).
    #[arg(long, default_value_t = 2000)]
    requests: usize,
    /// Prompt length in tokens (plain words, one token each).
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Tokens each request generates (the latency is to the first; the processor time covers them all, so a
    /// longer answer shows what the router spends per streamed token).
    #[arg(long, default_value_t = 1)]
    max_tokens: u32,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

/// One path at one concurrency: latencies to the first token in milliseconds, sorted, and the processor time the
/// whole process (client, router and worker alike) spent meanwhile, and the router's threads alone.
struct Sample {
    latencies: Vec<f64>,
    cpu: Cpu,
}

impl Sample {
    /// Processor microseconds per request, the whole process.
    fn cpu_us(&self) -> f64 {
        self.per_request_us(self.cpu.process)
    }

    /// Processor microseconds per request on the router's threads (`None` where they cannot be read).
    fn router_threads_us(&self) -> Option<f64> {
        self.cpu.router.map(|s| self.per_request_us(s))
    }

    fn per_request_us(&self, seconds: f64) -> f64 {
        seconds * 1e6 / self.latencies.len().max(1) as f64
    }

    fn quantile(&self, q: f64) -> f64 {
        let v = &self.latencies;
        if v.is_empty() {
            return f64::NAN;
        }
        v[((q * (v.len() - 1) as f64).round() as usize).min(v.len() - 1)]
    }
}

/// The benchmark's prompt: `tokens` plain words (one token each, spread over the vocabulary), as ids and as text.
pub fn bench_prompt(tokenizer: &engine::tokenizer::Tokenizer, tokens: usize) -> (Vec<u32>, String) {
    let words = tokenizer.plain_words();
    let ids: Vec<u32> = (0..tokens).map(|i| words[(i * 7919) % words.len()]).collect();
    let text = tokenizer.decode(&ids);
    (ids, text)
}

fn identity(ca: &DevCa, name: &str) -> Result<Identity, String> {
    ca.issue(name, &[]).map_err(|e| e.to_string())
}

pub fn run(args: Args) -> Result<ExitCode, String> {
    if args.concurrency.contains(&0) || args.requests == 0 || args.prompt_tokens == 0 || args.max_tokens == 0 {
        return Err("--concurrency, --requests, --prompt-tokens and --max-tokens must be at least 1".into());
    }
    let model = super::fetch_default()?;
    let text = engine::text::TextModel::open(&model).map_err(|e| e.to_string())?;
    let (ids, prompt) = bench_prompt(text.tokenizer(), args.prompt_tokens);
    let ca = DevCa::generate().map_err(|e| e.to_string())?;
    let (worker_id, router_id, client_id) =
        (identity(&ca, "worker")?, identity(&ca, "router")?, identity(&ca, "bench")?);
    let process = telemetry::Process::start("tandem")?;
    let clocks = Clocks::default();
    let router_runtime = clocks.router_runtime().map_err(|e| format!("cannot start the router's runtime: {e}"))?;
    let on_router = router_runtime.handle().clone();
    let result = process.block_on(async move {
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        let settings = worker::cli::Settings {
            engine: Some("mock".into()),
            // Steps take the profile's time divided by this: nothing measurable.
            speedup: Some(1e9),
            ..worker::cli::Settings::default()
        };
        let mut problems = Vec::new();
        let engine = worker::cli::engine_config(&settings, "bench", &mut problems);
        if !problems.is_empty() {
            return Err(problems.join("; "));
        }
        let worker =
            RunningWorker::start(WorkerConfig { engine, ..WorkerConfig::local(Role::Both, model.clone(), worker_id) })
                .await
                .map_err(|e| format!("worker: {e}"))?;
        let most = args.concurrency.iter().copied().max().unwrap_or(1);
        let config = RouterConfig {
            listen: loopback,
            model,
            served_model: defaults::SERVED_MODEL.into(),
            workers: vec![WorkerSource::Static(worker.grpc)],
            external: Vec::new(),
            external_settings: Default::default(),
            dns_refresh: router::discovery::DEFAULT_DNS_REFRESH,
            identity: router_id,
            certs: None,
            limits: Limits {
                max_in_flight: most.max(defaults::MAX_IN_FLIGHT),
                max_queue: most * 2,
                ..Limits::default()
            },
            scheduler: Default::default(),
            tenants: Default::default(),
            admin_key: None,
            follow: Default::default(),
            block_size: defaults::BLOCK_SIZE,
            max_model_len: None,
            seed: Some(1),
            record_trace: None,
            record_candidates: false,
            tool_call_parser: None,
            reasoning_parser: None,
            responses_store_mb: router::response_store::DEFAULT_MB,
        };
        let router = on_router.spawn(RunningRouter::start(config)).await.map_err(|e| e.to_string())?;
        let router = router.map_err(|e| e.to_string())?;
        for _ in 0..200 {
            if !router.state.cluster.up_members().is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let client = worker::grpc_tls::connect(worker.grpc, &client_id).await.map_err(|e| e.to_string())?;
        let target = router.addr.to_string();
        // Warm both paths (the first request pays for connections, caches and the worker's first step).
        direct(&clocks, &client, &ids, args.max_tokens, 1, 16).await?;
        through(&clocks, &target, &prompt, args.max_tokens, 1, 16).await?;
        let mut rows = Vec::new();
        for &c in &args.concurrency {
            let d = direct(&clocks, &client, &ids, args.max_tokens, c, args.requests).await?;
            let r = through(&clocks, &target, &prompt, args.max_tokens, c, args.requests).await?;
            rows.push((c, d, r));
        }
        report(&args, &rows);
        let _ = on_router.spawn(async move { router.shutdown(Duration::from_secs(5)).await }).await;
        worker.shutdown(Duration::from_secs(5)).await;
        Ok(ExitCode::SUCCESS)
    });
    router_runtime.shutdown_timeout(Duration::from_secs(5));
    result
}

/// Where processor time is read: the whole process, and the router's runtime threads (each thread's entry under
/// `/proc`, recorded as it starts).
#[derive(Default)]
struct Clocks {
    router_threads: Arc<Mutex<Vec<PathBuf>>>,
}

/// Processor seconds: the whole process's, and the router's threads' where they can be read.
#[derive(Clone, Copy)]
struct Cpu {
    process: f64,
    router: Option<f64>,
}

impl Clocks {
    /// The router's runtime: as many threads as a router started alone would have, which record themselves. Idle
    /// blocking threads are kept, so that the time they spent can still be read.
    fn router_runtime(&self) -> std::io::Result<tokio::runtime::Runtime> {
        let seen = Arc::clone(&self.router_threads);
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("bench-router")
            .thread_keep_alive(Duration::from_secs(24 * 3600))
            .on_thread_start(move || {
                if let Ok(entry) = std::fs::canonicalize("/proc/thread-self") {
                    seen.lock().unwrap_or_else(|p| p.into_inner()).push(entry);
                }
            })
            .build()
    }

    fn read(&self) -> Cpu {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
        let threads = self.router_threads.lock().unwrap_or_else(|p| p.into_inner());
        // A thread's `schedstat` starts with its nanoseconds on a processor (Linux).
        let router = threads.iter().try_fold(0u64, |sum, entry| {
            let stat = std::fs::read_to_string(entry.join("schedstat")).ok()?;
            Some(sum + stat.split_whitespace().next()?.parse::<u64>().ok()?)
        });
        Cpu {
            process: t.tv_sec as f64 + t.tv_nsec as f64 / 1e9,
            router: router.filter(|_| !threads.is_empty()).map(|ns| ns as f64 / 1e9),
        }
    }

    /// Processor seconds since `before`.
    fn since(&self, before: Cpu) -> Cpu {
        let now = self.read();
        Cpu { process: now.process - before.process, router: now.router.zip(before.router).map(|(a, b)| a - b) }
    }
}

/// `requests` requests over `streams` concurrent loops; each loop's latencies as `ask` measures them.
async fn spread<F, Fut>(clocks: &Clocks, streams: usize, requests: usize, ask: F) -> Result<Sample, String>
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<f64, String>> + Send,
{
    let left = Arc::new(AtomicUsize::new(requests));
    let cpu_before = clocks.read();
    let tasks: Vec<_> = (0..streams)
        .map(|_| {
            let (left, ask) = (Arc::clone(&left), ask.clone());
            tokio::spawn(async move {
                let mut out = Vec::new();
                while left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok() {
                    out.push(ask().await?);
                }
                Ok::<_, String>(out)
            })
        })
        .collect();
    gather(clocks, tasks, requests, cpu_before).await
}

/// Every stream's latencies, sorted, and the processor time since `cpu_before` (read before the tasks were
/// spawned).
async fn gather(
    clocks: &Clocks,
    tasks: Vec<tokio::task::JoinHandle<Result<Vec<f64>, String>>>,
    requests: usize,
    cpu_before: Cpu,
) -> Result<Sample, String> {
    let mut all = Vec::with_capacity(requests);
    for t in tasks {
        all.extend(t.await.map_err(|e| e.to_string())??);
    }
    let cpu = clocks.since(cpu_before);
    all.sort_by(f64::total_cmp);
    Ok(Sample { latencies: all, cpu })
}

/// Straight to the worker: `Generate` with the token ids, timed to the first token message.
async fn direct(
    clocks: &Clocks,
    client: &pb::worker_client::WorkerClient<tonic::transport::Channel>,
    ids: &[u32],
    max_tokens: u32,
    streams: usize,
    requests: usize,
) -> Result<Sample, String> {
    let next = Arc::new(AtomicUsize::new(0));
    let (client, ids) = (client.clone(), ids.to_vec());
    spread(clocks, streams, requests, move || {
        let (mut client, ids, n) = (client.clone(), ids.clone(), next.fetch_add(1, Ordering::Relaxed));
        async move {
            let req = pb::GenerateRequest {
                request_id: format!("bench-{n}"),
                tokens: ids,
                sampling: Some(pb::Sampling { max_tokens, top_p: 1.0, ignore_eos: true, ..Default::default() }),
                ..Default::default()
            };
            let started = Instant::now();
            let mut stream = client.generate(req).await.map_err(|e| e.to_string())?.into_inner();
            loop {
                match stream.message().await.map_err(|e| e.to_string())? {
                    Some(pb::GenerateResponse { event: Some(pb::generate_response::Event::Token(_)) }) => {
                        let ms = started.elapsed().as_secs_f64() * 1000.0;
                        // Read to the end, so the worker is done with it before the next.
                        while stream.message().await.map_err(|e| e.to_string())?.is_some() {}
                        return Ok(ms);
                    }
                    Some(_) => {}
                    None => return Err("the worker's stream ended without a token".into()),
                }
            }
        }
    })
    .await
}

/// Through the router: a streamed completion of the prompt's text, timed to its first content chunk. Each stream
/// keeps one HTTP/1.1 connection for its requests, as a client's connection pool does.
async fn through(
    clocks: &Clocks,
    authority: &str,
    prompt: &str,
    max_tokens: u32,
    streams: usize,
    requests: usize,
) -> Result<Sample, String> {
    let body = serde_json::json!({"model": defaults::SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                  "ignore_eos": true, "stream": true})
    .to_string();
    let left = Arc::new(AtomicUsize::new(requests));
    let cpu_before = clocks.read();
    let tasks: Vec<_> = (0..streams)
        .map(|_| {
            let (left, authority, body) = (Arc::clone(&left), authority.to_string(), body.clone());
            tokio::spawn(async move { one_connection(&authority, &body, &left).await })
        })
        .collect();
    gather(clocks, tasks, requests, cpu_before).await
}

/// One stream's requests on one connection, until `left` runs out; each one's milliseconds to its first chunk.
async fn one_connection(authority: &str, body: &str, left: &AtomicUsize) -> Result<Vec<f64>, String> {
    use http_body_util::BodyExt;
    let tcp = tokio::net::TcpStream::connect(authority).await.map_err(|e| format!("connect: {e}"))?;
    let _ = tcp.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let driver = tokio::spawn(conn);
    let mut out = Vec::new();
    while left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok() {
        sender.ready().await.map_err(|e| format!("connection: {e}"))?;
        let request = hyper::Request::post("/v1/completions")
            .header("host", authority)
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(body.to_string())))
            .map_err(|e| e.to_string())?;
        let started = Instant::now();
        let response = sender.send_request(request).await.map_err(|e| format!("sending: {e}"))?;
        if response.status() != 200 {
            return Err(format!("through the router: HTTP {}", response.status()));
        }
        let mut first = None;
        let mut stream = response.into_body();
        while let Some(frame) = stream.frame().await {
            let frame = frame.map_err(|e| format!("reading: {e}"))?;
            if first.is_none() && frame.data_ref().is_some_and(|d| d.windows(7).any(|w| w == b"data: {")) {
                first = Some(started.elapsed().as_secs_f64() * 1000.0);
            }
        }
        out.push(first.ok_or("the router's stream had no chunk")?);
    }
    driver.abort();
    Ok(out)
}

/// Processor time per request the router adds (the path through it against the direct one), and what that alone
/// makes the added latency at `streams` closed-loop streams when the machine's `cores` are all busy: each request
/// then waits for the work of the requests ahead of it, `streams × added CPU / cores`.
fn added_cpu(d: &Sample, r: &Sample, streams: usize, cores: usize) -> (f64, f64) {
    let added_us = r.cpu_us() - d.cpu_us();
    (added_us, streams as f64 * added_us / cores.max(1) as f64 / 1000.0)
}

/// Processor time per request on the router's own threads that the path through it adds (what they spend during the
/// direct path is their background work: the worker's events and load reports), and the queue that makes on one
/// core at `streams` closed-loop streams, ms.
fn router_own(d: &Sample, r: &Sample, streams: usize) -> Option<(f64, f64)> {
    let own = r.router_threads_us()? - d.router_threads_us()?;
    Some((own, streams as f64 * own / 1000.0))
}

fn report(args: &Args, rows: &[(usize, Sample, Sample)]) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if args.json {
        let levels: Vec<serde_json::Value> = rows
            .iter()
            .map(|(c, d, r)| {
                let (added_us, floor_ms) = added_cpu(d, r, *c, cores);
                serde_json::json!({
                    "concurrency": c,
                    "direct_p50_ms": d.quantile(0.5), "direct_p99_ms": d.quantile(0.99),
                    "router_p50_ms": r.quantile(0.5), "router_p99_ms": r.quantile(0.99),
                    "added_p50_ms": r.quantile(0.5) - d.quantile(0.5), "added_p99_ms": r.quantile(0.99) - d.quantile(0.99),
                    "direct_cpu_us_per_request": d.cpu_us(), "router_cpu_us_per_request": r.cpu_us(),
                    "added_cpu_us_per_request": added_us, "added_cpu_queue_ms": floor_ms,
                    "direct_router_threads_cpu_us_per_request": d.router_threads_us(),
                    "router_router_threads_cpu_us_per_request": r.router_threads_us(),
                    "router_own_cpu_us_per_request": router_own(d, r, *c).map(|o| o.0),
                })
            })
            .collect();
        let out = serde_json::json!({"requests": args.requests, "prompt_tokens": args.prompt_tokens,
                                     "max_tokens": args.max_tokens, "cores": cores,
                                     "levels": levels});
        println!("{out}");
        return;
    }
    println!(
        "time to first token, ms ({} requests of {} tokens per path and level, {}-token prompts; mock worker, no step \
         time)",
        args.requests, args.max_tokens, args.prompt_tokens
    );
    println!(
        "{:>11} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "streams", "direct p50", "direct p99", "router p50", "router p99", "added p50", "added p99"
    );
    for (c, d, r) in rows {
        let (d50, d99, r50, r99) = (d.quantile(0.5), d.quantile(0.99), r.quantile(0.5), r.quantile(0.99));
        println!("{c:>11} {d50:>10.3} {d99:>10.3} {r50:>10.3} {r99:>10.3} {:>10.3} {:>10.3}", r50 - d50, r99 - d99);
    }
    println!(
        "processor time per request, us (the whole process: client, router and worker; {cores} cores), and the queue \
         the router's share alone makes at each level once every core is busy (streams x added / cores), ms"
    );
    println!("{:>11} {:>10} {:>10} {:>10} {:>10}", "streams", "direct", "router", "added", "queue ms");
    for (c, d, r) in rows {
        let (added_us, floor_ms) = added_cpu(d, r, *c, cores);
        println!("{c:>11} {:>10.1} {:>10.1} {added_us:>10.1} {floor_ms:>10.3}", d.cpu_us(), r.cpu_us());
    }
    // Each level's router threads during each path, and what the path through it adds; none where unreadable.
    let threads: Option<Vec<_>> = rows
        .iter()
        .map(|(c, d, r)| Some((c, d.router_threads_us()?, r.router_threads_us()?, router_own(d, r, *c)?)))
        .collect();
    let Some(threads) = threads else {
        println!("(the router's threads' processor time could not be read: no /proc/thread-self/schedstat)");
        return;
    };
    println!(
        "processor time per request on the router's own threads, us (during each path; through it less direct: what \
         it spends per request), and the queue that alone makes on one core (streams x own), ms"
    );
    println!("{:>11} {:>10} {:>10} {:>10} {:>10}", "streams", "direct", "router", "own", "queue ms");
    for (c, dt, rt, (own, queue)) in threads {
        println!("{c:>11} {dt:>10.1} {rt:>10.1} {own:>10.1} {queue:>10.3}");
    }
}
