//! The worker binaries as processes: start on port 0, report their addresses, answer over mutual TLS, stop
//! cleanly on SIGTERM; configuration problems are reported all at once.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kv_transfer::tls::DevCa;
use proto::worker as pb;

fn certs(names: &[&str]) -> (std::path::PathBuf, DevCa) {
    let dir = std::env::temp_dir().join(format!("tandem-worker-proc-{}-{}", std::process::id(), names.join("-")));
    let _ = std::fs::remove_dir_all(&dir);
    let ca = DevCa::generate().expect("ca");
    ca.write(&dir).expect("ca written");
    for n in names {
        ca.issue(n, &[]).expect("cert").write(&dir, n).expect("written");
    }
    (dir, ca)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_process_serves_and_stops_on_sigterm() {
    let model = engine::fetch::ensure_default_model(&engine::fetch::Quiet).expect("model");
    let (dir, ca) = certs(&["prefill-0"]);
    // Its own shared-memory directory, where it keeps its KV store while it runs.
    let shm = dir.join("shm");
    std::fs::create_dir_all(&shm).expect("shm dir");
    let mut child = Command::new(tandem_tests::binary("prefill-worker", "prefill-worker"))
        .args([
            "--grpc-addr",
            "127.0.0.1:0",
            "--transfer-addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
            "--kv-blocks",
            "600",
        ])
        .arg("--certs-dir")
        .arg(&dir)
        .arg("--model")
        .arg(&model)
        .arg("--shm-dir")
        .arg(&shm)
        // Debug lines too, so that the log has lines whatever the machine (the libraries log the TLS connection).
        .env("RUST_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawns");
    // The log is read while the worker runs: a pipe nobody drains fills up and stalls the writer.
    let mut stderr = child.stderr.take().expect("stderr");
    let log = std::thread::spawn(move || {
        let mut log = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut log);
        log
    });
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("a line");
    let grpc: SocketAddr = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("grpc="))
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    let mut client = worker::grpc_tls::connect(grpc, &ca.issue("router", &[]).expect("cert")).await.expect("connects");
    let info = client.info(pb::InfoRequest {}).await.expect("info").into_inner();
    assert_eq!(info.role(), pb::Role::Prefill);
    assert!(info.model_fingerprint.starts_with("xxh3:"));
    drop(client);
    let killed = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
    assert!(killed.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(Instant::now() < deadline, "the worker did not stop within 20 s of SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "clean exit after SIGTERM: {status}");
    // Its log, written to a pipe (as under Docker or Kubernetes), is plain text: no terminal colour codes.
    let log = log.join().expect("the log");
    assert!(log.contains("DEBUG"), "the worker logged: {log:?}");
    assert!(!log.contains('\u{1b}'), "no escape codes in a piped log: {log:?}");
    // Stopped cleanly, it leaves nothing in shared memory (a KV store there is host memory until removed).
    let left: Vec<_> =
        std::fs::read_dir(&shm).expect("shm dir").filter_map(|e| e.ok()).map(|e| e.file_name()).collect();
    assert!(left.is_empty(), "left in shared memory: {left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
