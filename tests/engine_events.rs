//! Exact mode against the engines' own publishers: vLLM's and SGLang's `kv_events.py` (fetched by
//! `scripts/engine-kv-events.sh` from their packages on PyPI; neither engine is installed) publish KV events over
//! ZeroMQ with msgspec, exactly as each engine does (`scripts/e2e/engine_kv_publisher.py`), and Tandem's router,
//! which follows them over its own ZMTP client and MessagePack reader, must know what the engine holds: history
//! from the replay socket on connecting, blocks stored in engine blocks of the engine's size (vLLM's 16 with
//! SHA-256 byte hashes, SGLang's page of 1 token with integer hashes), removals, a hole no replay can fill (the
//! view is dropped and rebuilt), a clear, and the server going away.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use kv_transfer::tls::DevCa;
use router::external::events::EventSource;
use router::external::{Engine, EngineKind, ExternalSettings};
use router::run::{RouterConfig, RunningRouter};
use serde_json::{Value, json};
use tandem_tests::*;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Where `scripts/engine-kv-events.sh` keeps the engines' publishers (fetched the first time: seconds).
fn sources() -> String {
    let out = Command::new(root().join("scripts/engine-kv-events.sh")).output().expect("runs the script");
    assert!(out.status.success(), "scripts/engine-kv-events.sh failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// An engine's publisher in a Python process, killed when dropped.
struct Publisher {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    health: SocketAddr,
    events: String,
    replay: String,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Publisher {
    /// The publisher binds its ports itself, each one the system picks, and says which: ports found free here
    /// beforehand were sometimes taken by a test running alongside before the publisher bound them.
    fn start(engine: &str) -> Publisher {
        Publisher::start_ranks(engine, 1)
    }

    /// A server of `ranks` data-parallel ranks, a publisher each (`events` and `replay` are rank 0's endpoints).
    fn start_ranks(engine: &str, ranks: u32) -> Publisher {
        let mut child = Command::new("python3")
            .arg(root().join("scripts/e2e/engine_kv_publisher.py"))
            .args(["--engine", engine, "--source", &sources(), "--ranks", &ranks.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 starts");
        let stdin = child.stdin.take().expect("stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut ready = String::new();
        stdout.read_line(&mut ready).expect("reads");
        let said: Vec<&str> = ready.split_whitespace().collect();
        let [_, events, replay, health] = said[..] else {
            panic!("the publisher starts (pyzmq and msgspec from scripts/e2e/requirements.txt); it said {ready:?}")
        };
        assert_eq!(said[0], "ready", "{ready}");
        let health = SocketAddr::from(([127, 0, 0, 1], health.parse().expect("the health port")));
        Publisher { events: events.to_string(), replay: replay.to_string(), child, stdin, stdout, health }
    }

    fn line(&mut self) -> String {
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("reads");
        line.trim().to_string()
    }

    /// Publishes one batch with the engine's own classes and publisher.
    fn send(&mut self, command: Value) {
        writeln!(self.stdin, "{command}").expect("writes");
        self.stdin.flush().expect("flushes");
        assert_eq!(self.line(), "ok", "{command}");
    }

    /// Stores `tokens` (whole engine blocks) after the engine block `parent`, naming block i `first + i`.
    fn store(&mut self, tokens: &[u32], block: usize, first: u64, parent: Option<u64>, bytes: bool) {
        self.store_with(tokens, block, first, parent, bytes, json!({}));
    }

    /// The same with the command's other fields `more` (`salt`, `rank`).
    fn store_with(&mut self, tokens: &[u32], block: usize, first: u64, parent: Option<u64>, bytes: bool, more: Value) {
        let hashes: Vec<Value> = (0..(tokens.len() / block) as u64).map(|i| hash(first + i, bytes)).collect();
        let mut command = json!({
            "op": "store", "hashes": hashes, "parent": parent.map(|p| hash(p, bytes)),
            "tokens": tokens, "block_size": block, "medium": "GPU",
        });
        for (k, v) in more.as_object().expect("an object") {
            command[k] = v.clone();
        }
        self.send(command);
    }
}

/// An engine block's name: an integer (SGLang), or 32 bytes like vLLM's SHA-256 hashes (sent as a list, turned into
/// bytes by the publisher script).
fn hash(n: u64, bytes: bool) -> Value {
    if bytes { json!({"bytes": n}) } else { json!(n) }
}

/// The router's view of the worker for a completion of `prompt`: (device blocks, predicted).
async fn view(router: SocketAddr, prompt: &str) -> Option<(u64, bool)> {
    view_salted(router, prompt, None).await
}

/// The same for a completion with the cache salt `salt`.
async fn view_salted(router: SocketAddr, prompt: &str, salt: Option<&str>) -> Option<(u64, bool)> {
    let mut body = json!({"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 1});
    if let Some(salt) = salt {
        body["cache_salt"] = salt.into();
    }
    let body = body.to_string();
    let explained = http(router, "POST", "/debug/route", &body, &[]).await;
    if explained.status != 200 {
        return None;
    }
    let v = explained.json();
    let candidate = v["decode"]["candidates"].as_array().and_then(|c| c.first().cloned())?;
    Some((candidate["device_blocks"].as_u64().unwrap_or(0), candidate["predicted"].as_bool().unwrap_or(false)))
}

/// Waits until the router's view of the worker for `prompt` shows `blocks` device blocks.
async fn expect_blocks(router: SocketAddr, prompt: &str, blocks: u64, what: &str) {
    expect_salted(router, prompt, None, blocks, what).await
}

/// The same for a completion with the cache salt `salt`.
async fn expect_salted(router: SocketAddr, prompt: &str, salt: Option<&str>, blocks: u64, what: &str) {
    let started = Instant::now();
    loop {
        let seen = view_salted(router, prompt, salt).await;
        if seen == Some((blocks, false)) {
            return;
        }
        assert!(started.elapsed() < Duration::from_secs(15), "{what}: wanted {blocks} device blocks, saw {seen:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn prompt(topic: &str) -> String {
    (0..12).map(|i| format!("Line {i} of the {topic} notes: keep every answer short and exact. ")).collect()
}

async fn scenario(engine: &str, kind: EngineKind, block: usize, bytes: bool) {
    let text = engine::text::TextModel::open(&model()).expect("the model");
    let (a, b) = (prompt("first"), prompt("second"));
    let tokens_a = text.tokenizer().encode(&a);
    let tokens_b = text.tokenizer().encode(&b);
    let whole = |n: usize| n / 16;
    let mut publisher = Publisher::start(engine);

    // Before the router exists: the first 64 tokens of A. The router must learn them from the replay buffer.
    publisher.store(&tokens_a[..64], block, 0, None, bytes);

    let ca = DevCa::generate().expect("ca");
    let source = EventSource::new(&publisher.events, Some(&publisher.replay), "").expect("endpoints");
    let config = RouterConfig {
        external: vec![
            Engine::new(&format!("http://{}", publisher.health), kind).expect("url").with_events(Some(source)),
        ],
        external_settings: ExternalSettings { health_period: Duration::from_millis(200), ..Default::default() },
        ..router_config(&ca, Vec::new())
    };
    let router = RunningRouter::start(config).await.expect("router starts");
    wait_for_workers(&router, 1).await;
    let addr = router.addr;
    expect_blocks(addr, &a, 4, "history from the replay socket").await;

    // The rest of A's whole engine blocks, chained on: every whole router block of them is known.
    let n = tokens_a.len() / block * block;
    let last = (n / block) as u64 - 1;
    publisher.store(&tokens_a[64..n], block, 64 / block as u64, Some(64 / block as u64 - 1), bytes);
    expect_blocks(addr, &a, whole(n) as u64, "live events").await;

    // The engine evicts A's last engine block: the router blocks ending in it go.
    publisher.send(json!({"op": "remove", "hashes": [hash(last, bytes)], "medium": "GPU"}));
    expect_blocks(addr, &a, whole(n - block) as u64, "a removal").await;

    // A batch goes missing and the replay buffer cannot return it: the router drops what it knew and rebuilds
    // from what follows (B).
    publisher.send(json!({"op": "skip"}));
    publisher.store(&tokens_b[..32], block, 10_000, None, bytes);
    expect_blocks(addr, &b, 2, "events after a hole").await;
    expect_blocks(addr, &a, 0, "the view before the hole is dropped").await;

    // A salted request's chain (vLLM: the salt as the first block's extra key; SGLang: the events' field), in two
    // events: the router indexes it in that salt's namespace, where a request with the same salt finds it, and
    // nowhere else.
    let (c, tokens_c) = (&a, &tokens_a);
    let half = 64 / block;
    let salted = json!({"salt": "team-a"});
    publisher.store_with(&tokens_c[..64], block, 20_000, None, bytes, salted.clone());
    publisher.store_with(&tokens_c[64..n], block, 20_000 + half as u64, Some(20_000 + half as u64 - 1), bytes, salted);
    expect_salted(addr, c, Some("team-a"), whole(n) as u64, "a salted chain, with its salt").await;
    assert_eq!(view_salted(addr, c, Some("team-b")).await, Some((0, false)), "a salted chain, another salt");
    assert_eq!(view(addr, c).await, Some((0, false)), "a salted chain, no salt");

    // The engine clears its cache.
    publisher.send(json!({"op": "clear"}));
    expect_blocks(addr, &b, 0, "a clear").await;
    expect_salted(addr, c, Some("team-a"), 0, "a clear, salted").await;

    // The server goes away: the worker leaves the rotation.
    drop(publisher);
    let started = Instant::now();
    while view(addr, &a).await.is_some() {
        assert!(started.elapsed() < Duration::from_secs(15), "the worker is still routed to");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    router.shutdown(Duration::from_secs(1)).await;
}

/// A router following the two data-parallel ranks of the server at `url`, whose events are at `events` and `replay`
/// (rank 0's; rank 1's on the next ports).
async fn two_ranks(ca: &DevCa, url: &str, kind: EngineKind, events: &str, replay: &str) -> RunningRouter {
    let source = EventSource::new(events, Some(replay), "").expect("endpoints");
    let ranks = Engine::new(url, kind).expect("url").with_events(Some(source)).ranks(2).expect("two ranks");
    let config = RouterConfig {
        external: ranks,
        external_settings: ExternalSettings { health_period: Duration::from_millis(200), ..Default::default() },
        ..router_config(ca, Vec::new())
    };
    let router = RunningRouter::start(config).await.expect("router starts");
    wait_for_workers(&router, 2).await;
    router
}

/// A server of two data-parallel ranks (each its own KV cache, publishing on the configured ports plus its rank):
/// each rank is a worker of its own, and a prompt cached on one rank is routed there.
async fn data_parallel(engine: &str, kind: EngineKind, block: usize, bytes: bool) {
    let text = engine::text::TextModel::open(&model()).expect("the model");
    let (a, b) = (prompt("first"), prompt("second"));
    let (tokens_a, tokens_b) = (text.tokenizer().encode(&a), text.tokenizer().encode(&b));
    let mut publisher = Publisher::start_ranks(engine, 2);
    let ca = DevCa::generate().expect("ca");
    let url = format!("http://{}", publisher.health);
    let router = two_ranks(&ca, &url, kind, &publisher.events, &publisher.replay).await;
    let (na, nb) = (tokens_a.len() / block * block, tokens_b.len() / block * block);
    publisher.store_with(&tokens_a[..na], block, 0, None, bytes, json!({"rank": 0}));
    publisher.store_with(&tokens_b[..nb], block, 5_000, None, bytes, json!({"rank": 1}));
    for (prompt, rank, n) in [(&a, 0, na), (&b, 1, nb)] {
        let body = json!({"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 1}).to_string();
        let started = Instant::now();
        loop {
            let v = http(router.addr, "POST", "/debug/route", &body, &[]).await.json();
            let held = |name: String| {
                v["decode"]["candidates"].as_array().and_then(|c| c.iter().find(|c| c["worker"] == name).cloned())
            };
            let own = held(format!("{url}#dp{rank}")).map(|c| c["device_blocks"].clone());
            let other = held(format!("{url}#dp{}", 1 - rank)).map(|c| c["device_blocks"].clone());
            if own == Some(json!(n / 16)) && other == Some(json!(0)) {
                assert_eq!(v["decode"]["worker"], format!("{url}#dp{rank}"), "routed to the rank holding it: {v}");
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(15), "rank {rank}: {v}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    router.shutdown(Duration::from_secs(1)).await;

    // Ports configured one too high: rank 0 is followed on rank 1's ports, whose batches say rank 1, so nothing is
    // taken for rank 0 (rather than rank 1's cache taken for rank 0's), and the metrics say why.
    let shifted = |endpoint: &str| {
        let (host, port) = endpoint.rsplit_once(':').expect("a port");
        format!("{host}:{}", port.parse::<u16>().expect("a port") + 1)
    };
    let router = two_ranks(&ca, &url, kind, &shifted(&publisher.events), &shifted(&publisher.replay)).await;
    publisher.store_with(&tokens_b[..nb], block, 9_000, None, bytes, json!({"rank": 1}));
    let refused =
        format!("tandem_router_worker_event_batches_refused_total{{worker=\"{url}#dp0\",reason=\"other_rank\"}}");
    let started = Instant::now();
    loop {
        let metrics = http(router.addr, "GET", "/metrics", "", &[]).await.body;
        if metrics.lines().any(|l| l.starts_with(&refused)) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "rank 1's batch is refused on rank 0's follower:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let body = json!({"model": "smollm2-135m-instruct", "prompt": &b, "max_tokens": 1}).to_string();
    let v = http(router.addr, "POST", "/debug/route", &body, &[]).await.json();
    let candidates = v["decode"]["candidates"].as_array().expect("candidates").clone();
    assert!(candidates.iter().all(|c| c["device_blocks"] == 0), "another rank's batches are not applied: {v}");
    drop(publisher);
    router.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_data_parallel_ranks_are_workers_of_their_own() {
    data_parallel("vllm", EngineKind::Vllm, 16, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_data_parallel_ranks_are_workers_of_their_own() {
    data_parallel("sglang", EngineKind::Sglang, 1, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_publisher_16_token_blocks_with_sha256_hashes() {
    scenario("vllm", EngineKind::Vllm, 16, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_publisher_one_token_pages_with_integer_hashes() {
    scenario("sglang", EngineKind::Sglang, 1, false).await;
}
