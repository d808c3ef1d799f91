//! A mock worker process whose stand-in device breaks on SIGUSR1 and is mended on SIGUSR2, behind a real router
//! process: it answers every call with an error meanwhile (what `tandem sim --errors` models, and
//! `scripts/bench/sim_vs_cluster.py --errors` checks against), or with `--mock-fault stall` its steps hang while the
//! process answers; either way it serves again after.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tandem_tests::{binary, http, model};

/// A child process killed when dropped, with the first line it printed.
struct Process {
    child: Child,
    first_line: String,
}

impl Process {
    fn start(command: &mut Command) -> Process {
        let mut child = command.stdout(Stdio::piped()).spawn().expect("starts");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let first_line = lines.next().and_then(Result::ok).unwrap_or_default();
        // The rest of its output is drained so that it never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        Process { child, first_line }
    }

    /// The value of `key=` (or the first word starting with `prefix`) in its first line.
    fn word(&self, prefix: &str) -> String {
        let word = self.first_line.split_whitespace().find(|w| w.starts_with(prefix));
        word.unwrap_or_else(|| panic!("no {prefix} in {:?}", self.first_line)).trim_start_matches(prefix).to_string()
    }

    fn signal(&self, name: &str) {
        let sent = Command::new("kill").args([&format!("-{name}"), &self.child.id().to_string()]).status();
        assert!(sent.expect("kill runs").success(), "kill -{name}");
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn completion() -> String {
    serde_json::json!({"model": "smollm2-135m-instruct", "prompt": "The lighthouse keeper wrote", "max_tokens": 4,
                       "ignore_eos": true})
    .to_string()
}

/// A scratch directory with certificates for `components`, and the `tandem` binary.
fn setup(test: &str, components: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("tandem-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let tandem = binary("tandem", "tandem");
    let made = Command::new(&tandem)
        .args(["certs", "init", "--dir"])
        .arg(dir.join("certs"))
        .args(["--components", components])
        .output()
        .expect("certs init runs");
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    (dir, tandem)
}

/// A mock decode worker process named `name`, logging to `<dir>/<name>.log`, with `extra` flags.
fn mock_worker(tandem: &std::path::Path, dir: &std::path::Path, name: &str, extra: &[&str]) -> Process {
    let stderr = std::fs::File::create(dir.join(format!("{name}.log"))).expect("a log file");
    Process::start(
        Command::new(tandem)
            .args(["worker", "--role", "decode", "--engine", "mock", "--name", name, "--threads", "1"])
            .args(["--grpc-addr", "127.0.0.1:0", "--transfer-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0"])
            .arg("--certs-dir")
            .arg(dir.join("certs"))
            .args(["--cert-name", name])
            // Its own disk tier: tests run at once, and workers of the same name would share the default one.
            .arg("--disk-dir")
            .arg(dir.join(format!("kv-{name}")))
            .args(extra)
            .arg("--model")
            .arg(model())
            .stderr(stderr),
    )
}

/// A router process in front of `workers` (their gRPC addresses), with `extra` flags, and its HTTP address.
fn router(
    tandem: &std::path::Path,
    dir: &std::path::Path,
    workers: &[&Process],
    extra: &[&str],
) -> (Process, SocketAddr) {
    let grpc: Vec<String> = workers.iter().map(|w| w.word("grpc=")).collect();
    let router = Process::start(
        Command::new(tandem)
            .args(["router", "--listen", "127.0.0.1:0", "--cert-name", "router", "--workers", &grpc.join(",")])
            .arg("--certs-dir")
            .arg(dir.join("certs"))
            .args(extra)
            .arg("--model")
            .arg(model())
            .stderr(Stdio::null()),
    );
    let addr = router.word("http://").trim_end_matches('/').parse().expect("the router's address");
    (router, addr)
}

/// The first answer from `addr` that `done` accepts, asking again every 50 ms for up to 30 s.
async fn answer_until(addr: SocketAddr, done: fn(u16) -> bool, what: &str) -> tandem_tests::Reply {
    let waiting = Instant::now();
    loop {
        let r = http(addr, "POST", "/v1/completions", &completion(), &[]).await;
        if done(r.status) {
            return r;
        }
        assert!(waiting.elapsed() < Duration::from_secs(30), "{what}: {} {}", r.status, r.body);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mock_worker_broken_by_a_signal_fails_every_request_until_mended() {
    let (dir, tandem) = setup("mock-fault-test", "decode-0,router");
    let worker = mock_worker(&tandem, &dir, "decode-0", &[]);
    let (router, addr) = router(&tandem, &dir, &[&worker], &[]);
    // Served once the router has the worker.
    answer_until(addr, |s| s == 200, "never served").await;

    worker.signal("USR1");
    let broken = answer_until(addr, |s| s != 200, "the signal broke nothing").await;
    assert_eq!(broken.status, 502, "the only decode worker failed every attempt: {}", broken.body);
    let log = std::fs::read_to_string(dir.join("decode-0.log")).expect("the worker's log");
    assert!(log.contains("the mock device is broken (SIGUSR1)"), "{log}");

    worker.signal("USR2");
    answer_until(addr, |s| s == 200, "never mended").await;
    drop((router, worker));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The value of the unlabelled metric `name` on the router at `addr`.
async fn metric(addr: SocketAddr, name: &str) -> f64 {
    let m = http(addr, "GET", "/metrics", "", &[]).await.body;
    let line = m.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')));
    line.and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("no {name} in {m}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mock_worker_stalled_by_a_signal_is_given_up_until_it_computes_again() {
    let (dir, tandem) = setup("mock-stall-test", "decode-0,decode-1,router");
    let stuck = mock_worker(&tandem, &dir, "decode-0", &["--mock-fault", "stall"]);
    let healthy = mock_worker(&tandem, &dir, "decode-1", &[]);
    let (router, addr) = router(&tandem, &dir, &[&stuck, &healthy], &["--stall-after-ms", "1000"]);
    answer_until(addr, |s| s == 200, "never served").await;
    let waiting = Instant::now();
    while !http(addr, "GET", "/ready", "", &[]).await.body.contains("\"workers_up\":2") {
        assert!(waiting.elapsed() < Duration::from_secs(30), "both workers up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Round robin goes to each worker in turn (in the order given), so one of two requests meets the stuck one.
    let rr = r#"{"policy": "round_robin"}"#;
    assert_eq!(http(addr, "PUT", "/admin/router-config", rr, &[]).await.status, 200);

    stuck.signal("USR1");
    let body = completion();
    for k in 0..4 {
        let asked = http(addr, "POST", "/v1/completions", &body, &[]);
        let r = tokio::time::timeout(Duration::from_secs(30), asked).await.expect("no request waits out a timeout");
        assert_eq!(r.status, 200, "request {k}: {}", r.body);
    }
    assert_eq!(metric(addr, "tandem_router_worker_stalls_total").await, 1.0);
    assert_eq!(metric(addr, "tandem_router_workers_stalled").await, 1.0);
    assert!(metric(addr, "tandem_router_decode_resumptions_total").await >= 1.0);

    // Mended, its stuck step ends: it has computed, and the router takes it back.
    stuck.signal("USR2");
    let waiting = Instant::now();
    while metric(addr, "tandem_router_workers_stalled").await != 0.0 {
        assert!(waiting.elapsed() < Duration::from_secs(30), "taken back once it computes");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop((router, stuck, healthy));
    let _ = std::fs::remove_dir_all(&dir);
}
