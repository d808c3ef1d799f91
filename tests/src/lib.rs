//! What the whole-cluster and whole-process tests share: a small real cluster on 127.0.0.1 (workers in-process,
//! mutual TLS from one dev CA), an HTTP/1.1 client that reads SSE as it arrives, and the workspace's binaries.

pub mod compose;
pub mod fake;

use std::net::SocketAddr;
use std::time::Duration;

use engine::generate::EngineConfig;
use kv_transfer::tls::DevCa;
use router::discovery::WorkerSource;
use router::run::{RouterConfig, RunningRouter};
use router::scheduler::config::SchedulerConfig;
use router::state::Limits;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use worker::{Role, RunningWorker, WorkerConfig};

/// Where `scripts/llama-cpp.sh` keeps llama.cpp's llama-server (it builds it the first time: minutes).
pub fn llama_server() -> std::path::PathBuf {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = std::process::Command::new(root.join("scripts/llama-cpp.sh"))
        .arg("llama-server")
        .output()
        .expect("runs the script");
    assert!(
        out.status.success(),
        "scripts/llama-cpp.sh llama-server failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("llama-server")
}

/// llama.cpp's `models` directory (its test vocabularies, and its copies of models' chat templates in `templates`),
/// from the source `scripts/llama-cpp.sh` keeps beside its build.
pub fn llama_cpp_models() -> std::path::PathBuf {
    // .../llama.cpp/<version>/build-*/bin/llama-server -> .../llama.cpp/<version>/src/models
    let server = llama_server();
    server.ancestors().nth(3).expect("the cache's layout").join("src/models")
}

/// The path of the workspace binary `name` (package `package`), built first so that it is current: a test in
/// another package cannot ask Cargo for it (`CARGO_BIN_EXE_*` names only its own package's binaries).
pub fn binary(package: &str, name: &str) -> std::path::PathBuf {
    use std::path::Path;
    // This test runs as target/<profile>/deps/<test>; binaries sit in target/<profile>.
    let exe = std::env::current_exe().expect("the test's own path");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>").to_path_buf();
    let target_dir = profile_dir.parent().expect("target").to_path_buf();
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".to_string(),
        Some(other) => other.to_string(),
    };
    let built = std::process::Command::new(env!("CARGO"))
        .args(["build", "--quiet", "-p", package, "--bin", name, "--profile", &profile, "--target-dir"])
        .arg(&target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("cargo runs");
    assert!(built.success(), "cargo build -p {package} --bin {name} failed");
    profile_dir.join(name)
}

/// `tandem up` as a separate process with `TANDEM_HOME` at `home`, killed when dropped.
pub struct Up {
    pub child: std::process::Child,
    /// The router's base URL, from the line `tandem up` prints when ready.
    pub url: String,
    /// Its stdout, kept open: `tandem up` goes on writing to it, and a closed pipe would end it.
    _stdout: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

impl Up {
    /// Starts `tandem up <args> --port 0 --model <the embedded model>` and waits for its first line.
    pub fn start(args: &[&str], home: &std::path::Path) -> Up {
        use std::io::{BufRead, BufReader};
        use std::process::{Command, Stdio};
        let mut child = Command::new(binary("tandem", "tandem"))
            .arg("up")
            .args(args)
            .args(["--port", "0", "--model"])
            .arg(model())
            .env("TANDEM_HOME", home)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("tandem up starts");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let first = lines.next().and_then(Result::ok).unwrap_or_default();
        let url = first.split_whitespace().find(|w| w.starts_with("http://")).map(String::from);
        let Some(url) = url else {
            let _ = child.kill();
            panic!("tandem up printed no URL: {first:?}");
        };
        Up { child, url, _stdout: lines }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn model() -> std::path::PathBuf {
    engine::fetch::ensure_default_model(&engine::fetch::Quiet).expect("the embedded model")
}

pub async fn worker(ca: &DevCa, role: Role, name: &str) -> RunningWorker {
    worker_at(ca, role, name, SocketAddr::from(([127, 0, 0, 1], 0))).await
}

/// The engine the tests' workers run: one compute thread each (the machine has two cores).
pub fn test_engine() -> EngineConfig {
    EngineConfig { threads: std::num::NonZeroUsize::new(1), ..EngineConfig::default() }
}

/// A worker whose gRPC service listens on `grpc`.
pub async fn worker_at(ca: &DevCa, role: Role, name: &str, grpc: SocketAddr) -> RunningWorker {
    worker_with(ca, role, name, |c| WorkerConfig { grpc, ..c }).await
}

/// A worker with the tests' defaults changed by `config`.
pub async fn worker_with(
    ca: &DevCa,
    role: Role,
    name: &str,
    config: impl FnOnce(WorkerConfig) -> WorkerConfig,
) -> RunningWorker {
    let base = WorkerConfig {
        engine: test_engine(),
        pull_timeout: Duration::from_secs(5),
        ..WorkerConfig::local(role, model(), ca.issue(name, &[]).expect("cert"))
    };
    RunningWorker::start(config(base)).await.expect("worker starts")
}

pub fn router_config(ca: &DevCa, workers: Vec<SocketAddr>) -> RouterConfig {
    let workers = workers.into_iter().map(WorkerSource::Static).collect();
    RouterConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        model: model(),
        served_model: "smollm2-135m-instruct".into(),
        workers,
        external: Vec::new(),
        external_settings: Default::default(),
        dns_refresh: Duration::from_millis(200),
        identity: ca.issue("router", &[]).expect("cert"),
        certs: None,
        limits: Limits { request_timeout: Duration::from_secs(120), ..Limits::default() },
        scheduler: SchedulerConfig { slow_start_secs: 0.0, ..SchedulerConfig::default() },
        tenants: Default::default(),
        admin_key: None,
        follow: Default::default(),
        block_size: 16,
        max_model_len: None,
        seed: Some(1),
        record_trace: None,
        record_candidates: false,
        tool_call_parser: None,
        reasoning_parser: None,
        responses_store_mb: router::response_store::DEFAULT_MB,
    }
}

/// Waits until the router routes to `n` workers.
pub async fn wait_for_workers(router: &RunningRouter, n: usize) {
    for _ in 0..400 {
        if router.state.cluster.up_members().len() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the router never saw {n} workers");
}

/// An HTTP/1.1 reply: status, headers (lower-case names) and body.
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// The `data:` payloads of an SSE body.
    pub fn events(&self) -> Vec<String> {
        self.body.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
    }
}

/// One request on a fresh connection; reads until the server closes it.
pub async fn http(addr: SocketAddr, method: &str, path: &str, body: &str, headers: &[(&str, &str)]) -> Reply {
    let mut sock = tokio::net::TcpStream::connect(addr).await.expect("connects");
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n{extra}\r\n{body}",
        body.len()
    );
    sock.write_all(req.as_bytes()).await.expect("writes");
    let mut raw = Vec::new();
    sock.read_to_end(&mut raw).await.expect("reads");
    let text = String::from_utf8_lossy(&raw).to_string();
    parse_reply(&text).unwrap_or_else(|| panic!("not an HTTP reply: {text:?}"))
}

/// A whole HTTP/1.1 reply read off a connection the server closed; `None` when it is not one.
pub fn parse_reply(text: &str) -> Option<Reply> {
    let (head, body) = text.split_once("\r\n\r\n")?;
    let mut lines = head.lines();
    let status = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|s| s.parse().ok())?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let chunked = headers.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked { dechunk(body) } else { body.to_string() };
    Some(Reply { status, headers, body })
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// A streamed request read as it arrives.
pub struct Streaming {
    sock: tokio::net::TcpStream,
    buf: String,
}

impl Streaming {
    pub async fn open(addr: SocketAddr, path: &str, body: &str) -> Streaming {
        let mut sock = tokio::net::TcpStream::connect(addr).await.expect("connects");
        let req = format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        sock.write_all(req.as_bytes()).await.expect("writes");
        Streaming { sock, buf: String::new() }
    }

    /// The connection, for a test that reads it its own way.
    pub fn socket(&mut self) -> &mut tokio::net::TcpStream {
        &mut self.sock
    }

    /// `data:` payloads seen so far (the chunk framing is skipped: each event is on its own lines).
    pub fn events(&self) -> Vec<String> {
        self.buf.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
    }

    /// Reads until at least `n` events have arrived or the stream ends.
    pub async fn until(&mut self, n: usize) {
        let mut chunk = [0u8; 4096];
        while self.events().len() < n {
            match self.sock.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(k) => self.buf.push_str(&String::from_utf8_lossy(&chunk[..k])),
            }
        }
    }

    /// Reads to the end.
    pub async fn finish(&mut self) -> Vec<String> {
        self.until(usize::MAX).await;
        self.events()
    }
}

/// The text of a streamed chat answer, from its chunks.
pub fn streamed_text(events: &[String]) -> String {
    events
        .iter()
        .filter(|e| *e != "[DONE]")
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_string))
        .collect()
}

/// Workers of the given roles (named `prefill-N` / `decode-N`) and a router in front of them, all up.
pub async fn cluster(ca: &DevCa, roles: &[Role]) -> (Vec<RunningWorker>, RunningRouter) {
    cluster_with(ca, roles, |c| c, |c| c).await
}

/// [`cluster`], with each worker's and the router's configuration changed first.
pub async fn cluster_with(
    ca: &DevCa,
    roles: &[Role],
    worker_config: impl Fn(WorkerConfig) -> WorkerConfig,
    router: impl FnOnce(RouterConfig) -> RouterConfig,
) -> (Vec<RunningWorker>, RunningRouter) {
    let mut workers = Vec::new();
    for (i, role) in roles.iter().enumerate() {
        let name = match role {
            Role::Prefill => format!("prefill-{i}"),
            Role::Decode => format!("decode-{i}"),
            Role::Both => format!("worker-{i}"),
        };
        workers.push(worker_with(ca, *role, &name, &worker_config).await);
    }
    let config = router(router_config(ca, workers.iter().map(|w| w.grpc).collect()));
    let router = RunningRouter::start(config).await.expect("router starts");
    wait_for_workers(&router, workers.len()).await;
    (workers, router)
}

/// Stops the router, then every worker.
pub async fn stop(router: RunningRouter, workers: Vec<RunningWorker>) {
    router.shutdown(Duration::from_secs(5)).await;
    for w in workers {
        w.shutdown(Duration::from_secs(5)).await;
    }
}
