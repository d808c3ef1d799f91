//! Admission control, deadlines and client cancellation.

use std::num::NonZeroUsize;
use std::time::Duration;

use engine::backend::TimingProfile;
use engine::backend::mock::MockSettings;
use engine::generate::{BackendChoice, EngineConfig};

use kv_transfer::tls::DevCa;
use router::run::RunningRouter;
use router::state::Limits;
use tandem_tests::*;
use worker::{Role, WorkerConfig};

fn long(stream: bool) -> String {
    serde_json::json!({"model": "smollm2-135m-instruct", "prompt": "Count slowly:", "max_tokens": 400,
                       "ignore_eos": true, "temperature": 0, "stream": stream})
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_router_says_429_with_retry_after_and_a_slow_request_504() {
    let ca = DevCa::generate().expect("ca");
    let d = worker(&ca, Role::Decode, "decode-0").await;
    let mut config = router_config(&ca, vec![d.grpc]);
    config.limits =
        Limits { max_in_flight: 1, max_queue: 0, request_timeout: Duration::from_secs(1), ..Limits::default() };
    let router = RunningRouter::start(config).await.expect("router");
    wait_for_workers(&router, 1).await;
    let addr = router.addr;

    let mut busy = Streaming::open(addr, "/v1/completions", &long(true)).await;
    busy.until(2).await;
    let r = http(addr, "POST", "/v1/completions", &long(false), &[]).await;
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    // The streamed request runs past its deadline: it ends with an error event, not a hang.
    let events = busy.finish().await;
    assert!(events.iter().any(|e| e.contains("deadline")), "{events:?}");

    // With the slot free again, a whole request past its deadline is a 504.
    let r = http(addr, "POST", "/v1/completions", &long(false), &[]).await;
    assert_eq!(r.status, 504, "{}", r.body);
    assert!(r.json()["error"]["message"].as_str().is_some_and(|m| m.contains("deadline")));
    // Nothing was left running on the worker.
    wait_idle(&d).await;
    router.shutdown(Duration::from_secs(5)).await;
    d.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_queued_wait_limit_requests_are_shed_with_429_and_retry_after() {
    let ca = DevCa::generate().expect("ca");
    let (workers, router) = cluster_with(&ca, &[Role::Prefill, Role::Decode], paced, |r| r).await;
    let addr = router.addr;
    let prompt = |i: usize| -> String { (0..200).map(|k| format!("r{i} w{k} ")).collect() };
    let body = |i: usize| {
        serde_json::json!({"model": "smollm2-135m-instruct", "prompt": prompt(i), "max_tokens": 2}).to_string()
    };
    // One request first, so that the router measures the prefill worker's speed from its reports.
    assert_eq!(http(addr, "POST", "/v1/completions", &body(0), &[]).await.status, 200);
    let measured = || {
        let views =
            router.state.cluster.view(&[], router::cluster::Needs::ANY, Duration::ZERO, std::time::Instant::now());
        views.iter().any(|v| v.role.prefills() && v.speed.prefill_tokens_per_sec.is_some())
    };
    for _ in 0..200 {
        if measured() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(measured(), "the router learned the prefill speed");
    // Shed past 300 ms of queued prompts: each prompt is about a second of prefill, so of eight sent at once the
    // first is admitted and most of the rest are refused.
    let live = http(addr, "PUT", "/admin/router-config", r#"{"shed_wait_ms": 300}"#, &[]).await;
    assert_eq!(live.status, 200, "{}", live.body);
    let sent: Vec<_> = (1..=8)
        .map(|i| {
            let b = body(i);
            tokio::spawn(async move { http(addr, "POST", "/v1/completions", &b, &[]).await })
        })
        .collect();
    let (mut ok, mut shed) = (0, 0);
    for s in sent {
        let r = s.await.expect("joins");
        match r.status {
            200 => ok += 1,
            429 => {
                shed += 1;
                let after: u64 = r.header("retry-after").and_then(|v| v.parse().ok()).expect("Retry-After in seconds");
                assert!((1..=60).contains(&after), "{after}");
                assert_eq!(r.json()["error"]["type"], "rate_limit_error");
            }
            other => panic!("unexpected status {other}: {}", r.body),
        }
    }
    assert!(ok >= 1 && shed >= 1, "{ok} served, {shed} shed");
    let m = http(addr, "GET", "/metrics", "", &[]).await.body;
    assert!(m.contains(&format!("tandem_router_decisions_total{{policy=\"kv\",reason=\"shed\"}} {shed}")), "{m}");
    // Every decode worker past the busy KV fraction: refused too, and counted under its own reason.
    let busy = r#"{"shed_wait_ms": null, "busy_kv_fraction": 0.0001}"#;
    assert_eq!(http(addr, "PUT", "/admin/router-config", busy, &[]).await.status, 200);
    let r = http(addr, "POST", "/v1/completions", &body(9), &[]).await;
    assert_eq!((r.status, r.header("retry-after")), (429, Some("1")), "{}", r.body);
    let m = http(addr, "GET", "/metrics", "", &[]).await.body;
    assert!(m.contains("tandem_router_decisions_total{policy=\"kv\",reason=\"all_busy\"} 1"), "{m}");
    // A shed request never reached a worker and left nothing behind.
    for w in &workers {
        wait_idle(w).await;
    }
    stop(router, workers).await;
}

/// Waits until the worker runs nothing and holds no KV blocks for sequences.
async fn wait_idle(w: &worker::RunningWorker) {
    for _ in 0..200 {
        let s = w.stats();
        if s.running == 0 && s.waiting == 0 && s.usage[0].used == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the worker still runs work: {:?}", w.stats());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_cancels_its_work() {
    let ca = DevCa::generate().expect("ca");
    let (workers, router) = cluster(&ca, &[Role::Decode]).await;
    let d = &workers[0];
    let mut s = Streaming::open(router.addr, "/v1/completions", &long(true)).await;
    s.until(3).await;
    assert_eq!(d.stats().running, 1);
    drop(s);
    wait_idle(d).await;
    let stats = d.stats();
    assert!(stats.counters.prefill_tokens < 300, "stopped long before 400 tokens: {stats:?}");
    stop(router, workers).await;
}

/// Opens a request and leaves before any answer: writes it, then closes the connection.
async fn abandon(addr: std::net::SocketAddr, body: &str) {
    use tokio::io::AsyncWriteExt;
    let mut sock = tokio::net::TcpStream::connect(addr).await.expect("connects");
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(req.as_bytes()).await.expect("writes");
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(sock);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_requests_whose_clients_leave_give_their_places_back() {
    let ca = DevCa::generate().expect("ca");
    let (workers, router) = cluster_with(
        &ca,
        &[Role::Decode],
        |w| w,
        |r| router::run::RouterConfig { limits: Limits { max_in_flight: 1, max_queue: 2, ..r.limits.clone() }, ..r },
    )
    .await;
    let addr = router.addr;
    let mut busy = Streaming::open(addr, "/v1/completions", &long(true)).await;
    busy.until(2).await;
    // More clients than the queue holds come and go while the slot is taken.
    for _ in 0..5 {
        abandon(addr, &long(false)).await;
    }
    for _ in 0..100 {
        if router.state.admission.queued() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(router.state.admission.queued(), 0, "every abandoned place was given back");
    drop(busy);
    // The router takes requests again: nothing counts against the queue.
    let short = serde_json::json!({"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 2}).to_string();
    let r = http(addr, "POST", "/v1/completions", &short, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let m = http(addr, "GET", "/metrics", "", &[]).await.body;
    assert!(m.contains("tandem_router_queue_depth 0\n") && m.contains("tandem_router_requests_in_flight 0\n"), "{m}");
    stop(router, workers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_client_that_leaves_during_prefill_cancels_it() {
    let ca = DevCa::generate().expect("ca");
    // Prefill in steps of 64 tokens, so that a cancelled prefill stops long before its end.
    let chunked = |w: WorkerConfig| WorkerConfig {
        engine: EngineConfig { prefill_chunk: NonZeroUsize::new(64), ..w.engine },
        ..w
    };
    let (workers, router) = cluster_with(&ca, &[Role::Prefill, Role::Decode], chunked, |r| r).await;
    let prompt: String = (0..700).map(|i| format!("w{i} ")).collect();
    let model = "smollm2-135m-instruct";
    // A text completion, and a Responses API request (served as a chat completion, counted under its own route).
    for (path, body, route) in [
        (
            "/v1/completions",
            serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 20, "stream": true}),
            "/v1/completions",
        ),
        (
            "/v1/responses",
            serde_json::json!({"model": model, "input": prompt, "max_output_tokens": 20, "stream": true}),
            "/v1/responses",
        ),
    ] {
        let p = &workers[0];
        let before = p.stats().counters.prefill_tokens;
        let s = Streaming::open(router.addr, path, &body.to_string()).await;
        // Wait until the prefill worker is computing the prompt, then leave before the first token.
        for _ in 0..500 {
            if p.stats().counters.prefill_tokens > before {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(p.stats().counters.prefill_tokens > before, "{path}: the prefill started");
        drop(s);
        for _ in 0..500 {
            let st = p.stats();
            if st.running + st.waiting == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let st = p.stats();
        assert_eq!(st.running + st.waiting, 0, "{path}: the prefill worker runs nothing: {st:?}");
        let computed = st.counters.prefill_tokens - before;
        assert!(computed < 1000, "{path}: it stopped before the end of the prompt: {st:?}");
        assert_eq!(p.live_leases(), 0, "{path}: and leased nothing");
        for w in &workers {
            assert_eq!(w.stats().usage[0].used, 0, "{path}: no KV block is held anywhere");
        }
        // Counted once, as a client that left (its work is dropped with the response's body).
        let counted = format!("tandem_router_requests_total{{route=\"{route}\",status=\"499\"}} 1\n");
        let mut m = String::new();
        for _ in 0..100 {
            m = http(router.addr, "GET", "/metrics", "", &[]).await.body;
            if m.contains(&counted) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(m.contains(&counted), "{path}: {m}");
    }
    stop(router, workers).await;
}

#[tokio::test(flavor = "current_thread")]
async fn a_huge_prompt_is_tokenized_off_the_runtime_and_health_answers_meanwhile() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let ca = DevCa::generate().expect("ca");
    // One runtime thread for the router and this test: anything CPU-bound left on it would stall everything.
    let router = RunningRouter::start(router_config(&ca, vec![])).await.expect("router");
    let addr = router.addr;
    // Long words of letters, 1.7 MB: tokenizing them takes a few hundred milliseconds.
    let mut x = 12345u64;
    let prompt: String = (0..1_700_000)
        .map(|i| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            if i % 40 == 39 { ' ' } else { (b'a' + (x >> 59) as u8 % 26) as char }
        })
        .collect();
    let body = serde_json::json!({"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 1}).to_string();
    assert!(body.len() < 2 << 20, "within the body limit: {}", body.len());
    let done = Arc::new(AtomicBool::new(false));
    let finished = Arc::clone(&done);
    let big = tokio::spawn(async move {
        let r = http(addr, "POST", "/v1/completions", &body, &[]).await;
        finished.store(true, Ordering::SeqCst);
        r.status
    });
    // Once the prompt is being tokenized, health checks keep coming back while it lasts.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let mut answered_meanwhile = 0;
    while !done.load(Ordering::SeqCst) {
        let health = http(addr, "GET", "/health", "", &[]).await;
        assert_eq!(health.status, 200);
        if !done.load(Ordering::SeqCst) {
            answered_meanwhile += 1;
        }
    }
    assert_eq!(big.await.expect("joins"), 400, "the prompt was then refused as too long");
    assert!(answered_meanwhile > 0, "no health check was answered while the prompt was tokenized");
    router.shutdown(Duration::from_secs(5)).await;
}

/// A mock worker whose prefill takes 1 ms per prompt token: a known speed, and no compute on this machine.
fn paced(w: WorkerConfig) -> WorkerConfig {
    let profile = TimingProfile::parse("test", "[prefill]\nper_token_ms = 1.0\n").expect("profile");
    let mock = MockSettings { profile, context_len: 8192, ..MockSettings::gpu_default() };
    WorkerConfig { engine: EngineConfig { backend: BackendChoice::Mock(Box::new(mock)), ..w.engine }, ..w }
}

/// Sends a streamed completion of `words` prompt words and returns what the first read brought, and when.
async fn first_read(addr: std::net::SocketAddr, words: usize) -> (String, Duration) {
    use tokio::io::AsyncReadExt as _;
    let prompt: String = (0..words).map(|k| format!("w{k} ")).collect();
    let body = serde_json::json!({"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 2,
                                  "stream": true})
    .to_string();
    let started = std::time::Instant::now();
    let mut s = Streaming::open(addr, "/v1/completions", &body).await;
    let mut buf = vec![0u8; 16384];
    let n = s.socket().read(&mut buf).await.expect("reads");
    (String::from_utf8_lossy(&buf[..n]).into_owned(), started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streams_head_leaves_with_its_first_event_and_a_slow_one_goes_ahead_alone() {
    let ca = DevCa::generate().expect("ca");
    let (workers, router) = cluster_with(&ca, &[Role::Both], paced, |r| r).await;
    // Tens of milliseconds of prefill: the head waits for the first token, and both arrive in one read (before, the
    // head went out at once and the client woke twice).
    let (read, _) = first_read(router.addr, 10).await;
    assert!(read.starts_with("HTTP/1.1 200"), "{read}");
    assert!(read.contains("text/event-stream"), "{read}");
    assert!(read.contains("data: {"), "the first event came with the head: {read}");
    // Seconds of prefill (1,500 words, more tokens than that at 1 ms each): the head does not wait for it (a proxy in
    // front would be left without headers).
    let (read, after) = first_read(router.addr, 1500).await;
    assert!(read.starts_with("HTTP/1.1 200"), "{read}");
    assert!(!read.contains("data: "), "the head went ahead alone: {read}");
    assert!(after < Duration::from_millis(1200), "the head came before the first token: {after:?}");
    stop(router, workers).await;
}

/// Sends a request of priority 5, then one of priority -1, while `busy` holds the one place they need; waits until
/// `queued` counts each in turn, frees the place, and returns their priorities in the order their answers came.
async fn served_order(addr: std::net::SocketAddr, queued: impl Fn() -> usize) -> Vec<i64> {
    let wait_for = |n: usize| {
        let queued = &queued;
        async move {
            for _ in 0..400 {
                if queued() == n {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("{} queued, not {n}", queued());
        }
    };
    let mut busy = Streaming::open(addr, "/v1/completions", &long(true)).await;
    busy.until(2).await;
    let mut answers = Vec::new();
    for (k, priority) in [5i64, -1].into_iter().enumerate() {
        let body = serde_json::json!({"model": "smollm2-135m-instruct", "prompt": "Say hi", "max_tokens": 3,
                                      "priority": priority});
        answers.push(tokio::spawn(async move {
            let r = http(addr, "POST", "/v1/completions", &body.to_string(), &[]).await;
            assert_eq!(r.status, 200, "{}", r.body);
            (std::time::Instant::now(), priority)
        }));
        wait_for(k + 1).await;
    }
    drop(busy);
    let mut done = Vec::new();
    for a in answers {
        done.push(a.await.expect("answered"));
    }
    done.sort();
    done.into_iter().map(|(_, p)| p).collect()
}

/// vLLM's `priority`: lower values are served first, in the router's admission queue (one request in flight) and
/// in a worker's queue (one sequence at a time), whatever the order they came in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_of_a_higher_priority_is_served_first_by_the_router_and_the_worker() {
    let ca = DevCa::generate().expect("ca");
    let one_in_flight = |r: router::run::RouterConfig| router::run::RouterConfig {
        limits: Limits { max_in_flight: 1, ..r.limits.clone() },
        ..r
    };
    let (workers, router) = cluster_with(&ca, &[Role::Decode], |w| w, one_in_flight).await;
    let order = served_order(router.addr, || router.state.admission.queued()).await;
    assert_eq!(order, vec![-1, 5], "the router's queue");
    stop(router, workers).await;

    let one_sequence = |w: WorkerConfig| WorkerConfig { engine: EngineConfig { max_num_seqs: 1, ..w.engine }, ..w };
    let (workers, router) = cluster_with(&ca, &[Role::Decode], one_sequence, |r| r).await;
    let order = served_order(router.addr, || workers[0].stats().waiting).await;
    assert_eq!(order, vec![-1, 5], "the worker's queue");
    stop(router, workers).await;
}
