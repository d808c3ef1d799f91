//! The worker service's promises to its callers beyond producing tokens: it keeps answering while the engine is in
//! a long step, every call leaves its bookkeeping when it ends, a duplicate request id never ends another call,
//! and leased KV stays under its cap.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{http_get, model};
use engine::generate::EngineConfig;
use kv_transfer::tls::DevCa;
use proto::worker as pb;
use proto::worker::worker_client::WorkerClient;
use tonic::transport::Channel;
use worker::{Role, RunningWorker, WorkerConfig};

/// The longest any of the worker's own answers may take while its engine is busy.
const ANSWER_WITHIN: Duration = Duration::from_secs(2);

async fn start(config: impl FnOnce(WorkerConfig) -> WorkerConfig) -> (RunningWorker, WorkerClient<Channel>) {
    let ca = DevCa::generate().expect("ca");
    let base = WorkerConfig {
        metrics: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        engine: EngineConfig { threads: std::num::NonZeroUsize::new(1), ..EngineConfig::default() },
        ..WorkerConfig::local(Role::Both, model(), ca.issue("worker-0", &[]).expect("cert"))
    };
    let w = RunningWorker::start(config(base)).await.expect("starts");
    let client = worker::grpc_tls::connect(w.grpc, &ca.issue("router", &[]).expect("cert")).await.expect("connects");
    (w, client)
}

fn generate_request(id: &str, tokens: Vec<u32>, max_tokens: u32) -> pb::GenerateRequest {
    let sampling =
        pb::Sampling { temperature: 0.0, top_p: 1.0, max_tokens, ignore_eos: true, ..pb::Sampling::default() };
    pb::GenerateRequest { request_id: id.into(), tokens, sampling: Some(sampling), ..Default::default() }
}

fn prefill(id: &str, tokens: Vec<u32>) -> pb::PrefillRequest {
    pb::PrefillRequest {
        request_id: id.into(),
        tokens,
        sampling: Some(pb::Sampling { top_p: 1.0, max_tokens: 8, ..pb::Sampling::default() }),
        ..Default::default()
    }
}

/// Reads a Generate stream to its end: the tokens, and whether it ended with `Finished`.
async fn drain(mut s: tonic::Streaming<pb::GenerateResponse>) -> (usize, bool) {
    let mut tokens = 0;
    while let Ok(Some(msg)) = s.message().await {
        match msg.event {
            Some(pb::generate_response::Event::Token(_)) => tokens += 1,
            Some(pb::generate_response::Event::Finished(_)) => return (tokens, true),
            None => {}
        }
    }
    (tokens, false)
}

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(ANSWER_WITHIN, f).await.unwrap_or_else(|_| panic!("{what} did not answer within 2 s"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_metrics_and_load_reports_answer_while_a_step_runs_long() {
    let (w, mut c) = start(|c| c).await;
    let mut load = c.watch_load(pb::WatchLoadRequest { interval_ms: 100 }).await.expect("watch").into_inner();
    within("the first load report", load.message()).await.expect("stream").expect("a report");
    // The engine holds before its next step for as long as the test says, as a very long prefill would.
    let hold = w.hold_engine_steps();
    let stream = c.generate(generate_request("held", (100..400).collect(), 4)).await.expect("accepted").into_inner();
    let started = Instant::now();
    let health = within("Health", c.health(pb::HealthRequest {})).await.expect("health").into_inner();
    assert!(health.serving);
    let metrics = within("/metrics", http_get(w.metrics.expect("metrics address"), "/metrics")).await;
    assert!(metrics.contains("tandem_worker_"), "{metrics}");
    // Reports keep coming, and they count the request that waits for the step, naming it as covered.
    let report = loop {
        let r = within("a load report", load.message()).await.expect("stream").expect("a report");
        if !r.request_ids.is_empty() {
            break r;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "the held request never showed in a report: {r:?}");
    };
    assert_eq!(report.request_ids, vec!["held".to_string()]);
    assert_eq!((report.waiting, report.running, report.active_prefill_tokens), (1, 0, 300));
    drop(hold);
    assert_eq!(drain(stream).await, (4, true));
    w.shutdown(Duration::from_secs(5)).await;
}

/// A report that counts a request's work names the request, so that a router adds its own record of it on top
/// only while no report counts it. The engine publishes a new request's state before the call hears it was taken:
/// a report read then counted the request without naming it, and the router counted it twice until the next
/// period (100 ms), in every burst.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_report_that_counts_a_request_names_it() {
    let (w, mut c) = start(|c| c).await;
    // A period longer than the test: past the first report, only a change of the load makes one.
    let mut load = c.watch_load(pb::WatchLoadRequest { interval_ms: 600_000 }).await.expect("watch").into_inner();
    within("the first load report", load.message()).await.expect("stream").expect("a report");
    let hold = w.hold_engine_steps();
    let stream = c.generate(generate_request("counted", (100..400).collect(), 4)).await.expect("accepted").into_inner();
    let report = loop {
        let r = within("a report counting the request", load.message()).await.expect("stream").expect("a report");
        if r.waiting + r.running > 0 {
            break r;
        }
    };
    assert_eq!(report.request_ids, vec!["counted".to_string()], "{report:?}");
    // Its 300 tokens' 19 blocks count from the report that names it on, before the engine holds them.
    let used = report.usage.iter().find(|u| u.tier == pb::Tier::Device as i32).map_or(0, |u| u.used);
    assert_eq!(used + report.blocks_to_come, 19, "{report:?}");
    drop(hold);
    assert_eq!(drain(stream).await, (4, true));
    w.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_request_id_never_ends_another_stream_and_ended_calls_leave_no_entry() {
    let (w, mut c) = start(|c| c).await;
    let first = c.generate(generate_request("same", (100..140).collect(), 12)).await.expect("accepted").into_inner();
    let second = c.generate(generate_request("same", (200..240).collect(), 12)).await.expect("accepted").into_inner();
    let (a, b) = tokio::join!(drain(first), drain(second));
    assert_eq!((a, b), ((12, true), (12, true)), "both streams ran to the end");
    // Many calls, finished, cancelled and abandoned: none stays in the table.
    for i in 0..6 {
        let s = c.generate(generate_request(&format!("r{i}"), (100..130).collect(), 40)).await.expect("ok");
        let mut s = s.into_inner();
        s.message().await.expect("stream").expect("a first token");
        match i % 3 {
            0 => assert!(drain(s).await.1),
            1 => {
                let found = c.cancel(pb::CancelRequest { request_id: format!("r{i}") }).await.expect("cancel");
                assert!(found.into_inner().found);
                assert!(!drain(s).await.1, "a cancelled stream ends without finishing");
            }
            _ => drop(s),
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while w.calls_in_flight() > 0 || w.stats().running > 0 {
        assert!(Instant::now() < deadline, "{} calls still in the table", w.calls_in_flight());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    w.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_past_the_lease_cap_is_refused_before_any_compute() {
    // Room for one 40-token prompt's KV (3 blocks of 368,640 bytes), not two.
    let cap = 4 * 368_640;
    let (w, mut c) =
        start(|c| WorkerConfig { role: Role::Prefill, max_leased_bytes: cap, lease_ttl: Duration::from_secs(30), ..c })
            .await;
    let first = c.prefill(prefill("a", (100..140).collect())).await.expect("the first fits").into_inner();
    assert!(first.handle.is_some());
    let computed = w.stats().counters.prefill_tokens;
    let refused = c.prefill(prefill("b", (200..240).collect())).await.expect_err("past the cap");
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused:?}");
    assert_eq!(w.stats().counters.prefill_tokens, computed, "nothing was computed for it");
    assert_eq!(w.live_leases(), 1);
    w.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_pins_its_blocks_in_the_engine_and_they_come_back_when_it_expires() {
    // Eight device blocks: leases may pin four of them, however large the cap on leased bytes.
    let (w, mut c) = start(|c| WorkerConfig {
        role: Role::Prefill,
        max_leased_bytes: u64::MAX,
        lease_ttl: Duration::from_millis(300),
        engine: EngineConfig { kv_blocks: 8, max_model_len: Some(128), ..c.engine.clone() },
        ..c
    })
    .await;
    c.prefill(prefill("a", (100..140).collect())).await.expect("three blocks fit");
    let s = w.stats();
    assert_eq!((s.usage[0].used, s.leased_blocks), (3, 3), "the lease holds the prompt's own blocks");
    assert_eq!(w.leased_bytes(), 3 * 368_640);
    let refused = c.prefill(prefill("b", (200..240).collect())).await.expect_err("six blocks would pass four");
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused:?}");
    // The lease expires (checked every second) and the engine takes its blocks back, cached for the next prompt.
    let deadline = Instant::now() + Duration::from_secs(5);
    while (w.live_leases() > 0 || w.stats().usage[0].used > 0) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let s = w.stats();
    assert_eq!((w.live_leases(), s.usage[0].used, s.leased_blocks, s.usage[0].cached), (0, 0, 0, 2));
    c.prefill(prefill("c", (200..240).collect())).await.expect("room again");
    w.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_accepts_and_says_nothing_fails_the_connection_in_time() {
    // A TCP listener that takes connections and never speaks TLS: a hung process.
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await.expect("binds");
    let addr = listener.local_addr().expect("address");
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((c, _)) = listener.accept().await {
            conns.push(c);
        }
    });
    let ca = DevCa::generate().expect("ca");
    let started = Instant::now();
    let err = worker::grpc_tls::connect(addr, &ca.issue("router", &[]).expect("cert")).await.expect_err("hangs");
    assert!(matches!(err, worker::grpc_tls::ConnectError::Timeout(..)), "{err}");
    assert!(started.elapsed() < worker::grpc_tls::CONNECT_TIMEOUT + Duration::from_secs(3));
    held.abort();
}

fn unix_ms_in(d: Duration) -> u64 {
    let at = std::time::SystemTime::now() + d;
    at.duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_millis() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_past_its_deadline_is_dropped() {
    let (w, mut c) = start(|c| c).await;
    // Already past: refused before any compute.
    let late = pb::GenerateRequest {
        deadline_unix_ms: Some(unix_ms_in(Duration::ZERO).saturating_sub(1)),
        ..generate_request("late", (100..140).collect(), 5)
    };
    let refused = c.generate(late).await.expect_err("past its deadline");
    assert_eq!(refused.code(), tonic::Code::DeadlineExceeded);
    assert_eq!(w.stats().counters.prefill_tokens, 0, "nothing was computed for it");
    // Due in half a second, with far more work than that: dropped when the deadline passes.
    let long = pb::GenerateRequest {
        deadline_unix_ms: Some(unix_ms_in(Duration::from_millis(500))),
        ..generate_request("long", (100..140).collect(), 2000)
    };
    let started = Instant::now();
    let mut s = c.generate(long).await.expect("accepted").into_inner();
    let end = loop {
        match s.message().await {
            Ok(Some(_)) => continue,
            other => break other,
        }
    };
    let status = end.expect_err("ends with an error");
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    assert!(started.elapsed() < Duration::from_secs(5), "dropped near its deadline: {:?}", started.elapsed());
    let deadline = Instant::now() + Duration::from_secs(5);
    while w.stats().running + w.stats().waiting > 0 || w.stats().usage[0].used > 0 {
        assert!(Instant::now() < deadline, "the worker still runs it: {:?}", w.stats());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    w.shutdown(Duration::from_secs(5)).await;
}
