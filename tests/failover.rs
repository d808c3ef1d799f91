//! Workers that die or restart under a running router: no request is lost.

use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use engine::generate::{Engine, EngineConfig, Request};
use engine::sampling::{RawSampling, SamplingParams};
use kv_transfer::tls::DevCa;
use router::run::RunningRouter;
use tandem_tests::fake::{Behaviour, FakeWorker};
use tandem_tests::*;
use worker::{Role, RunningWorker};

const MODEL: &str = "smollm2-135m-instruct";

fn completion(prompt: &str, max_tokens: u32, stream: bool) -> String {
    serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": true, "stream": stream})
    .to_string()
}

/// The engine's own greedy continuation, ignoring end-of-generation.
fn greedy(prompt: &str, max_tokens: u32) -> String {
    greedy_with_logprobs(prompt, max_tokens).0
}

/// The engine's own greedy continuation and each token's log-probability.
fn greedy_with_logprobs(prompt: &str, max_tokens: u32) -> (String, Vec<f32>) {
    let mut e = Engine::open(&model(), EngineConfig::default()).expect("engine");
    let raw =
        RawSampling { temperature: 0.0, max_tokens, ignore_eos: true, logprobs: Some(2), ..RawSampling::default() };
    let req = Request::new(e.tokenizer().encode(prompt), SamplingParams::new(raw).expect("ok"));
    let done = e.run(&[req], &AtomicBool::new(false), |_| {}).expect("runs").remove(0);
    (done.text, done.logprobs.iter().map(|l| l.logprob).collect())
}

fn completion_text(events: &[String]) -> String {
    events
        .iter()
        .filter(|e| *e != "[DONE]")
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
        .collect()
}

/// Streams `body` and, five events in, kills whichever of the two decode workers runs it; the stream's events (it
/// must have finished) and the surviving worker.
async fn stream_through_a_decode_death(
    router: std::net::SocketAddr,
    d1: RunningWorker,
    d2: RunningWorker,
    body: &serde_json::Value,
) -> (Vec<String>, RunningWorker) {
    let mut s = Streaming::open(router, "/v1/completions", &body.to_string()).await;
    s.until(5).await;
    let running_on_d1 = d1.stats().running > 0;
    let (dying, survivor) = if running_on_d1 { (d1, d2) } else { (d2, d1) };
    dying.shutdown(Duration::ZERO).await;
    let events = s.finish().await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "the stream finished: {events:?}");
    (events, survivor)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_lost_mid_stream_is_replaced_without_a_break() {
    let ca = DevCa::generate().expect("ca");
    let (mut workers, router) = cluster(&ca, &[Role::Decode, Role::Decode]).await;
    let (d1, d2) = (workers.remove(0), workers.remove(0));
    let prompt = "The history of the bicycle begins in the early nineteenth century, when";
    let (want, want_logprobs) = greedy_with_logprobs(prompt, 40);

    // With log-probabilities: the resumed stream's are the uninterrupted run's too.
    let mut body: serde_json::Value = serde_json::from_str(&completion(prompt, 40, true)).expect("json");
    body["logprobs"] = 2.into();
    let (events, survivor) = stream_through_a_decode_death(router.addr, d1, d2, &body).await;
    assert_eq!(completion_text(&events), want, "the client saw one unbroken, correct answer");
    let logprobs: Vec<f64> = events
        .iter()
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .filter_map(|c| c["choices"][0]["logprobs"]["token_logprobs"].as_array().cloned())
        .flatten()
        .map(|l| l.as_f64().expect("a logprob"))
        .collect();
    assert_eq!(logprobs.len(), want_logprobs.len(), "one per token");
    for (got, want) in logprobs.iter().zip(&want_logprobs) {
        assert!((got - f64::from(*want)).abs() < 1e-4, "{logprobs:?} against {want_logprobs:?}");
    }
    let stats = survivor.stats();
    assert!(stats.counters.prefill_tokens > 0, "the survivor re-prefilled prompt + tokens so far");
    let metrics = http(router.addr, "GET", "/metrics", "", &[]).await.body;
    assert!(metrics.contains("tandem_router_decode_resumptions_total 1"), "{metrics}");
    stop(router, vec![survivor]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_killed_under_load_costs_no_request() {
    let ca = DevCa::generate().expect("ca");
    let (mut workers, router) = cluster(&ca, &[Role::Prefill, Role::Prefill, Role::Decode]).await;
    let p1 = workers.remove(0);
    let addr = router.addr;
    let prompts: Vec<String> = (0..6)
        .map(|i| format!("Request number {i} asks about rivers, mountains and the sea. Describe them:"))
        .collect();
    let mut tasks = Vec::new();
    for p in &prompts {
        let body = completion(p, 8, false);
        tasks.push(tokio::spawn(async move { http(addr, "POST", "/v1/completions", &body, &[]).await }));
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    p1.shutdown(Duration::ZERO).await;
    for (t, prompt) in tasks.into_iter().zip(&prompts) {
        let r = t.await.expect("task");
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["choices"][0]["text"], greedy(prompt, 8).as_str());
    }
    // The kill cut work off: some request moved to the other prefill worker, to local prefill, or to a retry.
    let m = &router.state.metrics;
    let moved = [&m.prefill_retries, &m.local_prefill_fallbacks, &m.decode_resumptions]
        .iter()
        .map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
        .sum::<u64>();
    assert!(moved > 0, "the killed worker had work in flight");
    stop(router, workers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_is_reindexed_from_its_snapshot() {
    let ca = DevCa::generate().expect("ca");
    let d = worker(&ca, Role::Decode, "decode-0").await;
    let grpc = d.grpc;
    let router = RunningRouter::start(router_config(&ca, vec![grpc])).await.expect("router");
    wait_for_workers(&router, 1).await;
    let body = completion(&"A long shared preamble about the weather in spring. ".repeat(6), 2, false);
    let held = || async {
        let v = http(router.addr, "POST", "/debug/route", &body, &[]).await.json();
        v["decode"]["candidates"][0]["device_blocks"].as_u64().expect("blocks")
    };
    assert_eq!(held().await, 0);
    assert_eq!(http(router.addr, "POST", "/v1/completions", &body, &[]).await.status, 200);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(held().await >= 4, "the index learned the prompt's blocks from the event stream");

    // Restart on the same address: a new instance with an empty cache.
    d.shutdown(Duration::from_secs(1)).await;
    let restarted = worker_at(&ca, Role::Decode, "decode-0", grpc).await;
    let mut seen_empty = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if router.state.cluster.up_members().len() == 1 && held().await == 0 {
            seen_empty = true;
            break;
        }
    }
    assert!(seen_empty, "the old instance's blocks were dropped and the new snapshot is empty");
    assert_eq!(http(router.addr, "POST", "/v1/completions", &body, &[]).await.status, 200);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(held().await >= 4, "and the restarted worker's new blocks are indexed");
    router.shutdown(Duration::from_secs(5)).await;
    restarted.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_stops_reporting_is_marked_down_and_its_blocks_dropped() {
    let ca = DevCa::generate().expect("ca");
    let hung = FakeWorker::start(&ca, proto::worker::Role::Decode, Behaviour::Hang, vec![11, 12, 13]).await;
    let d = worker(&ca, Role::Decode, "decode-0").await;
    let mut config = router_config(&ca, vec![hung.grpc, d.grpc]);
    // Short, so the test is quick, but well past the idle worker's heartbeat (`EVENT_HEARTBEAT`, 1 s): at exactly
    // the heartbeat's period the healthy worker raced the watchdog and went down now and then too.
    config.follow.silence = worker::EVENT_HEARTBEAT * 5 / 2;
    let router = RunningRouter::start(config).await.expect("router");
    wait_for_workers(&router, 2).await;
    // It joined and its snapshot's blocks are indexed; then it says nothing more, and its connection stays open.
    let held = |r: &RunningRouter| {
        r.state.cluster.view(&[kv_cache::SeqHash(11)], router::cluster::Needs::ANY, Duration::ZERO, Instant::now())
    };
    assert!(held(&router).iter().any(|v| v.overlap.device == 1), "the hung worker's snapshot was applied");
    // Once silent past the watchdog it is down and its blocks are out of the index (it answers Info again, so
    // it rejoins and goes down again, one silence at a time: look for the down state).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (up, indexed) = (router.state.cluster.up_members().len(), router.state.cluster.index_stats().0);
        if up == 1 && indexed == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the silent worker was never marked down and dropped ({up} up, {indexed} blocks)"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Requests go to the worker that answers.
    assert_eq!(http(router.addr, "POST", "/v1/completions", &completion("Hi", 3, false), &[]).await.status, 200);
    router.shutdown(Duration::from_secs(5)).await;
    d.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_stream_that_stalls_is_resumed_on_another_worker() {
    let ca = DevCa::generate().expect("ca");
    let hung = FakeWorker::start(&ca, proto::worker::Role::Decode, Behaviour::Hang, vec![]).await;
    let d = worker(&ca, Role::Decode, "decode-0").await;
    // Round robin starts with the first worker followed: the hung one takes the request and stalls after a token.
    let mut config = router_config(&ca, vec![hung.grpc, d.grpc]);
    config.scheduler.policy = router::scheduler::config::Policy::RoundRobin;
    config.limits.decode_idle_timeout = Duration::from_secs(1);
    let router = RunningRouter::start(config).await.expect("router");
    wait_for_workers(&router, 2).await;
    let started = Instant::now();
    let r = http(router.addr, "POST", "/v1/completions", &completion("The sea is", 6, false), &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let text = r.json()["choices"][0]["text"].as_str().expect("text").to_string();
    assert!(text.starts_with("The"), "the token the stalled worker sent is kept: {text:?}");
    assert_eq!(r.json()["usage"]["completion_tokens"], 6, "{}", r.body);
    assert!(started.elapsed() < Duration::from_secs(30), "resumed after the idle timeout, not the request deadline");
    let m = http(router.addr, "GET", "/metrics", "", &[]).await.body;
    assert!(m.contains("tandem_router_decode_resumptions_total 1\n"), "{m}");
    router.shutdown(Duration::from_secs(5)).await;
    d.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_is_ready_only_once_it_knows_what_every_worker_holds() {
    let ca = DevCa::generate().expect("ca");
    let p = worker(&ca, Role::Prefill, "prefill-0").await;
    let d = worker(&ca, Role::Decode, "decode-0").await;
    // The prefill worker is in a long step: a snapshot waits for the step's end, as after a router restart in
    // front of a busy cluster.
    let hold = p.hold_engine_steps();
    let mut pc = worker::grpc_tls::connect(p.grpc, &ca.issue("router", &[]).expect("cert")).await.expect("connects");
    let busy = tokio::spawn(async move {
        let sampling = proto::worker::Sampling { top_p: 1.0, max_tokens: 1, ..Default::default() };
        let req = proto::worker::PrefillRequest {
            request_id: "busy".into(),
            tokens: (100..200).collect(),
            sampling: Some(sampling),
            ..Default::default()
        };
        pc.prefill(req).await.map(|_| ())
    });
    let router = RunningRouter::start(router_config(&ca, vec![p.grpc, d.grpc])).await.expect("router");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !router.state.cluster.up_members().iter().any(|(_, m)| m.role.decodes()) {
        assert!(Instant::now() < deadline, "the decode worker joined");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let r = http(router.addr, "GET", "/ready", "", &[]).await;
    assert_eq!(r.status, 503, "a decode worker is up, but the index does not know the prefill worker yet: {}", r.body);
    assert_eq!(r.json()["waiting_for_snapshots"], serde_json::json!([p.grpc.to_string()]), "{}", r.body);
    drop(hold);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = http(router.addr, "GET", "/ready", "", &[]).await;
        if r.status == 200 {
            assert_eq!(r.json()["index_synced"], true);
            break;
        }
        assert!(Instant::now() < deadline, "never ready: {}", r.body);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    busy.await.expect("joins").expect("the held prefill finished");
    router.shutdown(Duration::from_secs(5)).await;
    p.shutdown(Duration::from_secs(5)).await;
    d.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_fails_again_and_again_is_ejected() {
    let ca = DevCa::generate().expect("ca");
    let sick = FakeWorker::start(&ca, proto::worker::Role::Prefill, Behaviour::Fail, vec![]).await;
    let p = worker(&ca, Role::Prefill, "prefill-0").await;
    let d = worker(&ca, Role::Decode, "decode-0").await;
    // Round robin sends every other prompt to the sick worker first (it is followed first).
    let mut config = router_config(&ca, vec![sick.grpc, p.grpc, d.grpc]);
    config.scheduler.policy = router::scheduler::config::Policy::RoundRobin;
    config.follow.breaker = router::resilience::BreakerSettings { failures: 2, ..Default::default() };
    let router = RunningRouter::start(config).await.expect("router");
    wait_for_workers(&router, 3).await;
    for i in 0..6 {
        let r = http(router.addr, "POST", "/v1/completions", &completion(&format!("Prompt {i}:"), 2, false), &[]).await;
        assert_eq!(r.status, 200, "every request is served, by failing over: {}", r.body);
    }
    // Two failures in a row eject it: after that, no prompt is sent there first.
    assert_eq!(sick.calls(), 2, "the sick worker was tried until its breaker opened, then left alone");
    let m = http(router.addr, "GET", "/metrics", "", &[]).await.body;
    assert!(m.contains("tandem_router_worker_ejections_total 1\n"), "{m}");
    assert!(m.contains("tandem_router_workers_ejected 1\n"), "{m}");
    assert!(m.contains("tandem_router_prefill_retries_total 2\n"), "each failure moved to the other worker: {m}");
    router.shutdown(Duration::from_secs(5)).await;
    p.shutdown(Duration::from_secs(5)).await;
    d.shutdown(Duration::from_secs(5)).await;
}

/// A fake decode worker failing every call (followed first), a prefill and a decode worker, and a router over them
/// that disaggregates every prompt, its config set by `tweak`.
async fn behind_a_failing_decode_worker(
    tweak: impl FnOnce(&mut router::run::RouterConfig),
) -> (FakeWorker, Vec<RunningWorker>, RunningRouter) {
    let ca = DevCa::generate().expect("ca");
    let sick = FakeWorker::start(&ca, proto::worker::Role::Decode, Behaviour::Fail, vec![]).await;
    let p = worker(&ca, Role::Prefill, "prefill-0").await;
    let d = worker(&ca, Role::Decode, "decode-0").await;
    let mut config = router_config(&ca, vec![sick.grpc, p.grpc, d.grpc]);
    config.scheduler.disaggregation = router::scheduler::config::DisaggregationRule::Always;
    tweak(&mut config);
    let router = RunningRouter::start(config).await.expect("router");
    wait_for_workers(&router, 3).await;
    (sick, vec![p, d], router)
}

/// A decode worker ejected by its breaker while a prompt prefills for it is not tried: another decode worker takes
/// the request as its first attempt, pulling the prefilled KV, rather than the ejected one failing it and another
/// resuming it (computing the prompt again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_ejected_while_the_prompt_prefills_is_passed_over() {
    use router::http::completions::{Ident, plan};
    use router::http::openai::{Endpoint, check_completion};
    let (sick, workers, router) = behind_a_failing_decode_worker(|c| {
        c.scheduler.ties = router::scheduler::config::Ties::Hashed;
        c.follow.breaker = router::resilience::BreakerSettings { failures: 1, ..Default::default() };
    })
    .await;
    let state = &router.state;
    let members = state.cluster.up_members();
    let sick_id = members.iter().find(|(_, m)| m.addr == sick.grpc).expect("followed").0;
    // A prompt whose decode goes to the sick worker: the idle decode workers tie, and hashed ties pick by the
    // prompt's blocks (so the prompts differ within their first block).
    let mut routed = None;
    for i in 0..64 {
        let prompt = format!("Prompt {i}: the river runs past the mill and the bridge, then on to the sea.");
        let checked = check_completion(completion(&prompt, 4, false).as_bytes()).expect("valid");
        let r = plan(state, checked, Ident::new(state, Endpoint::Completion), None, true).await.expect("routed");
        if r.decision.decode.id == sick_id {
            routed = Some(r);
            break;
        }
    }
    let routed = routed.expect("some prompt's decode goes to the sick worker");
    assert!(routed.decision.disaggregate, "{:?}", routed.decision);
    // While the prompt prefills, the sick worker fails another request's call and is ejected.
    assert!(state.cluster.outcome(sick_id, Err(tonic::Code::Internal)).is_some(), "ejected");
    let mut pieces = router::serve::start(std::sync::Arc::clone(state), routed.job, routed.decision);
    let mut tokens = 0;
    while let Some(piece) = tokio::time::timeout(Duration::from_secs(60), pieces.recv()).await.expect("no hang") {
        match piece.expect("served") {
            router::serve::Piece::Token(..) => tokens += 1,
            router::serve::Piece::Finished { .. } => break,
            router::serve::Piece::Prompt(_) => panic!("the prompt's log-probabilities were not asked for"),
        }
    }
    assert_eq!(tokens, 4);
    assert_eq!(sick.calls(), 0, "the ejected worker was not tried");
    let m = http(router.addr, "GET", "/metrics", "", &[]).await.body;
    assert!(m.contains("tandem_router_decode_resumptions_total 0\n"), "{m}");
    stop(router, workers).await;
}

/// A worker whose engine is stuck while its process still answers (a hung device): its reports go on, so neither the
/// silence watchdog nor keepalive notices, but they show no tokens computed while it holds the router's request.
/// After the stall limit the router gives that call up and resumes it elsewhere, and sends the worker nothing more
/// (the request used to wait out the prefill timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_engine_stalls_is_given_up_and_left_alone() {
    let ca = DevCa::generate().expect("ca");
    let stuck = FakeWorker::start(&ca, proto::worker::Role::Decode, Behaviour::Stalled, vec![]).await;
    let d = worker(&ca, Role::Decode, "decode-0").await;
    // Round robin sends the first prompt to the stuck worker (it is followed first).
    let mut config = router_config(&ca, vec![stuck.grpc, d.grpc]);
    config.scheduler.policy = router::scheduler::config::Policy::RoundRobin;
    config.limits.prefill_timeout = Duration::from_secs(120);
    config.follow.stall = router::resilience::StallSettings { after: Duration::from_secs(1) };
    let router = RunningRouter::start(config).await.expect("router");
    wait_for_workers(&router, 2).await;
    let started = Instant::now();
    let r = tokio::time::timeout(
        Duration::from_secs(30),
        http(router.addr, "POST", "/v1/completions", &completion("Prompt 0:", 2, false), &[]),
    )
    .await
    .expect("answered well before the prefill timeout");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(stuck.calls(), 1);
    assert!(started.elapsed() >= Duration::from_secs(1), "given up after the stall limit, not before");
    for i in 1..5 {
        let r = http(router.addr, "POST", "/v1/completions", &completion(&format!("Prompt {i}:"), 2, false), &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert_eq!(stuck.calls(), 1, "a stalled worker gets no new requests");
    let m = http(router.addr, "GET", "/metrics", "", &[]).await.body;
    assert!(m.contains("tandem_router_worker_stalls_total 1\n"), "{m}");
    assert!(m.contains("tandem_router_workers_stalled 1\n"), "{m}");
    assert!(m.contains("tandem_router_decode_resumptions_total 1\n"), "{m}");
    stop(router, vec![d]).await;
}

/// A decode attempt that fails before pulling its prompt's KV gives the prefill worker's lease back at once: the
/// resumption computes the prompt itself, and nobody else will pull it (it used to wait for its expiry, 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_decode_attempt_releases_its_prompts_lease_at_once() {
    let (sick, workers, router) =
        behind_a_failing_decode_worker(|c| c.scheduler.policy = router::scheduler::config::Policy::RoundRobin).await;
    let prefill = &workers[0];
    // Round robin gives the failing worker one of the first two decodes.
    for i in 0..2 {
        let r = http(router.addr, "POST", "/v1/completions", &completion(&format!("Prompt {i}:"), 4, false), &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert_eq!(sick.calls(), 1, "one decode attempt went to the failing worker");
    let waiting = Instant::now();
    while prefill.live_leases() > 0 {
        assert!(waiting.elapsed() < Duration::from_secs(5), "{} leases still live", prefill.live_leases());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop(router, workers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_a_worker_refuses_as_invalid_is_answered_400_at_once_not_retried() {
    let ca = DevCa::generate().expect("ca");
    let refusing = FakeWorker::start(&ca, proto::worker::Role::Decode, Behaviour::Refuse, vec![]).await;
    let p = worker(&ca, Role::Prefill, "prefill-0").await;
    let router = RunningRouter::start(router_config(&ca, vec![refusing.grpc, p.grpc])).await.expect("router");
    wait_for_workers(&router, 2).await;
    let r = http(router.addr, "POST", "/v1/completions", &completion("Prompt:", 4, false), &[]).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("longer than this worker's context"), "the worker's reason reaches the client: {}", r.body);
    assert_eq!(refusing.calls(), 1, "another attempt would be refused too");
    router.shutdown(Duration::from_secs(5)).await;
    p.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failovers_stop_when_the_retry_budget_is_spent() {
    let ca = DevCa::generate().expect("ca");
    let sick = FakeWorker::start(&ca, proto::worker::Role::Prefill, Behaviour::Fail, vec![]).await;
    let d = worker(&ca, Role::Decode, "decode-0").await;
    let mut config = router_config(&ca, vec![sick.grpc, d.grpc]);
    // Room for one retry per ten requests, and no floor: the first failover spends it.
    config.limits.retry_budget =
        router::resilience::RetryBudgetSettings { ratio: 0.1, min_per_sec: 0.0, window: Duration::from_secs(60) };
    config.follow.breaker = router::resilience::BreakerSettings { failures: 100, ..Default::default() };
    let router = RunningRouter::start(config).await.expect("router");
    wait_for_workers(&router, 2).await;
    let mut statuses = Vec::new();
    for i in 0..10 {
        let r = http(router.addr, "POST", "/v1/completions", &completion(&format!("Prompt {i}:"), 2, false), &[]).await;
        statuses.push(r.status);
    }
    // Each prompt fails on the prefill worker; falling back to the decode worker is a retry. One in ten fits.
    assert_eq!(statuses.iter().filter(|&&s| s == 200).count(), 1, "{statuses:?}");
    assert!(statuses.iter().all(|&s| s == 200 || s == 503), "{statuses:?}");
    let m = http(router.addr, "GET", "/metrics", "", &[]).await.body;
    assert!(m.contains("tandem_router_retries_denied_total 9\n"), "{m}");
    // No prompt moved to another prefill worker (there is none): every failover here is the decode worker's own
    // prefill. The counter once took each failed attempt, the last one too.
    assert!(m.contains("tandem_router_prefill_retries_total 0\n"), "{m}");
    assert!(m.contains("tandem_router_local_prefill_fallbacks_total 1\n"), "{m}");
    router.shutdown(Duration::from_secs(5)).await;
    d.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_out_of_lease_room_costs_no_request() {
    let ca = DevCa::generate().expect("ca");
    // The prefill worker may lease no KV at all: every prefill there is refused with RESOURCE_EXHAUSTED.
    let full = |w: worker::WorkerConfig| {
        if w.role == Role::Prefill { worker::WorkerConfig { max_leased_bytes: 0, ..w } } else { w }
    };
    let (workers, router) = cluster_with(&ca, &[Role::Prefill, Role::Decode], full, |r| r).await;
    let r = http(router.addr, "POST", "/v1/completions", &completion("The sea is", 4, false), &[]).await;
    assert_eq!(r.status, 200, "the decode worker prefilled it instead: {}", r.body);
    assert_eq!(workers[0].stats().counters.prefill_tokens, 0, "the prefill worker computed nothing");
    let m = http(router.addr, "GET", "/metrics", "", &[]).await.body;
    assert!(m.contains("tandem_router_local_prefill_fallbacks_total 1\n"), "{m}");
    assert!(m.contains("tandem_router_workers_ejected 0\n"), "a full lease table is load, not sickness: {m}");
    stop(router, workers).await;
}

/// A grammar-constrained stream survives its decode worker's death: the worker that resumes it rebuilds the
/// grammar's state from the tokens already sent and the client gets the uninterrupted run's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_constrained_stream_resumed_elsewhere_keeps_its_grammar() {
    let ca = DevCa::generate().expect("ca");
    let (mut workers, router) = cluster(&ca, &[Role::Decode, Role::Decode]).await;
    let (d1, d2) = (workers.remove(0), workers.remove(0));
    let prompt = "The history of the bicycle begins in the early nineteenth century, when";
    // Mid-object, a matcher that forgot what was generated would ask for a fresh '{'.
    let schema =
        r#"{"type": "object", "properties": {"story": {"type": "string", "maxLength": 400}}, "required": ["story"]}"#;
    let want = {
        let mut e = Engine::open(&model(), EngineConfig::default()).expect("engine");
        let raw = RawSampling {
            temperature: 0.0,
            max_tokens: 40,
            grammar: Some(engine::grammar::Grammar::JsonSchema(schema.into())),
            ..RawSampling::default()
        };
        let req = Request::new(e.tokenizer().encode(prompt), SamplingParams::new(raw).expect("ok"));
        e.run(&[req], &AtomicBool::new(false), |_| {}).expect("runs").remove(0).text
    };
    assert!(want.starts_with("{\"story\":\""), "{want:?}");
    let mut body: serde_json::Value = serde_json::from_str(&completion(prompt, 40, true)).expect("json");
    body["guided_json"] = schema.into();
    body["ignore_eos"] = false.into();
    let (events, survivor) = stream_through_a_decode_death(router.addr, d1, d2, &body).await;
    assert_eq!(completion_text(&events), want, "one unbroken answer under the grammar");
    let metrics = http(router.addr, "GET", "/metrics", "", &[]).await.body;
    assert!(metrics.contains("tandem_router_decode_resumptions_total 1"), "{metrics}");
    stop(router, vec![survivor]).await;
}
