//! A mock worker process whose stand-in device breaks on SIGUSR1 and is mended on SIGUSR2: it answers every call
//! with an error meanwhile, behind a real router process, and serves again after (what `tandem sim --errors` models
//! and `scripts/bench/sim_vs_cluster.py --errors` checks against).

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mock_worker_broken_by_a_signal_fails_every_request_until_mended() {
    let dir = std::env::temp_dir().join(format!("tandem-mock-fault-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let certs = dir.join("certs");
    let tandem = binary("tandem", "tandem");
    let made = Command::new(&tandem)
        .args(["certs", "init", "--dir"])
        .arg(&certs)
        .args(["--components", "decode-0,router"])
        .output()
        .expect("certs init runs");
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let stderr = std::fs::File::create(dir.join("worker.log")).expect("a log file");
    let worker = Process::start(
        Command::new(&tandem)
            .args(["worker", "--role", "decode", "--engine", "mock", "--name", "decode-0", "--threads", "1"])
            .args(["--grpc-addr", "127.0.0.1:0", "--transfer-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0"])
            .arg("--certs-dir")
            .arg(&certs)
            .args(["--cert-name", "decode-0", "--model"])
            .arg(model())
            .stderr(stderr),
    );
    let grpc = worker.word("grpc=");
    let router = Process::start(
        Command::new(&tandem)
            .args(["router", "--listen", "127.0.0.1:0", "--cert-name", "router", "--workers", &grpc])
            .arg("--certs-dir")
            .arg(&certs)
            .arg("--model")
            .arg(model())
            .stderr(Stdio::null()),
    );
    let addr: SocketAddr = router.word("http://").trim_end_matches('/').parse().expect("the router's address");
    // The first answer that `done` accepts, asking again every 50 ms for up to 30 s.
    let answer_until = |done: fn(u16) -> bool, what: &'static str| async move {
        let waiting = Instant::now();
        loop {
            let r = http(addr, "POST", "/v1/completions", &completion(), &[]).await;
            if done(r.status) {
                return r;
            }
            assert!(waiting.elapsed() < Duration::from_secs(30), "{what}: {} {}", r.status, r.body);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    // Served once the router has the worker.
    answer_until(|s| s == 200, "never served").await;

    worker.signal("USR1");
    let broken = answer_until(|s| s != 200, "the signal broke nothing").await;
    assert_eq!(broken.status, 502, "the only decode worker failed every attempt: {}", broken.body);
    let log = std::fs::read_to_string(dir.join("worker.log")).expect("the worker's log");
    assert!(log.contains("the mock device is broken (SIGUSR1)"), "{log}");

    worker.signal("USR2");
    answer_until(|s| s == 200, "never mended").await;
    drop((router, worker));
    let _ = std::fs::remove_dir_all(&dir);
}
