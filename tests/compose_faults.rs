//! Faults across containers, each under steady load from `tandem bench serve` (mock engines: no compute, steps
//! take their modelled time): a decode worker killed mid-stream, a prefill worker killed before its first tokens,
//! a worker cut off the network and put back, the router restarted, a worker stopped with SIGTERM. Every test
//! prints its figures (`--no-capture` shows them; docs/reliability.md has a run's).

use std::time::{Duration, Instant};

use tandem_tests::compose::{LOAD_TIMEOUT_SECS, Load, Project, request, router_metric, within};

/// Stand-in blocks cost the mock nothing: tiers big enough that no request is refused for KV.
const MOCK: &[(&str, &str)] = &[("TANDEM_KV_BLOCKS", "4096"), ("TANDEM_HOST_BLOCKS", "4096")];

fn sent_failed(summary: &serde_json::Value) -> (u64, u64) {
    (summary["requests"].as_u64().unwrap_or(0), summary["failed"].as_u64().unwrap_or(u64::MAX))
}

#[test]
fn a_decode_worker_killed_mid_stream_loses_no_request() {
    let project = Project::up("mock", MOCK, &[]);
    let router = project.router();
    // 200 tokens a stream: about 2 s each, a dozen in flight on the two decode workers at any time.
    let load = Load::start(router, 40, 6.0, 4, 200);
    std::thread::sleep(Duration::from_secs(3));
    project.docker(&["kill"], "decode-0");
    let summary = load.finish();
    let (sent, failed) = sent_failed(&summary);
    let resumed = router_metric(router, "tandem_router_decode_resumptions_total", "");
    println!("figures: decode worker killed: sent {sent}, failed {failed}, resumed {resumed}");
    assert_eq!(failed, 0, "{summary}\n{}", project.logs());
    assert!(resumed >= 1.0, "the streams on the killed worker resumed on the other one: {summary}");
}

#[test]
fn a_prefill_worker_killed_before_its_first_tokens_loses_no_request() {
    let project = Project::up("mock", MOCK, &["slow-prefill.yml"]);
    let router = project.router();
    // Every prompt new (no decode worker holds a prefix to prefill it itself): all go to the prefill workers.
    let load = Load::start(router, 30, 6.0, 64, 32);
    // Killed while the router has a prompt in flight on it.
    let waiting = Instant::now();
    while router_metric(router, "tandem_router_worker_in_flight", "worker=\"prefill-0\"") < 1.0 {
        assert!(waiting.elapsed() < Duration::from_secs(20), "nothing ever in flight on prefill-0");
        std::thread::sleep(Duration::from_millis(20));
    }
    project.docker(&["kill"], "prefill-0");
    let summary = load.finish();
    let (sent, failed) = sent_failed(&summary);
    let moved = router_metric(router, "tandem_router_prefill_retries_total", "");
    let local = router_metric(router, "tandem_router_local_prefill_fallbacks_total", "");
    let retried = moved + local;
    println!(
        "figures: prefill worker killed: sent {sent}, failed {failed}, prefills retried elsewhere {retried} \
         ({moved} on the other prefill worker, {local} on the decode worker)"
    );
    assert_eq!(failed, 0, "{summary}\n{}", project.logs());
    assert!(retried >= 1.0, "the prompts on the killed worker were prefilled elsewhere: {summary}");
}

#[test]
fn a_worker_cut_off_the_network_is_dropped_then_taken_back_and_nothing_hangs() {
    let project = Project::up("mock", MOCK, &[]);
    let router = project.router();
    let network = project.network_of("decode-0");
    let load = Load::start(router, 120, 4.0, 4, 100);
    std::thread::sleep(Duration::from_secs(3));
    let held = || router_metric(router, "tandem_router_worker_indexed_blocks", "worker=\"decode-0\"");
    // Decode workers keep the prompts' KV they were sent (and the tokens they computed) in their caches.
    assert!(within(Duration::from_secs(10), || held() > 0.0), "the router indexes decode-0's blocks");
    project.disconnect("decode-0", &network);
    let cut = Instant::now();
    // The router stops routing to it once its streams time out (HTTP/2 keepalive) or its name stops resolving.
    let dropped = loop {
        if project.workers_up() == 3 {
            break cut.elapsed();
        }
        assert!(cut.elapsed() < Duration::from_secs(30), "the cut-off worker is still up:\n{}", project.logs());
        std::thread::sleep(Duration::from_millis(250));
    };
    std::thread::sleep(Duration::from_secs(20).saturating_sub(cut.elapsed()));
    project.reconnect("decode-0", &network, "decode");
    let back = project.wait_for_workers(4, Duration::from_secs(60));
    // Dropped, it was forgotten with its blocks (tests/failover.rs checks that in-process: while it is down it has
    // no series here to read); followed anew, it is up once its snapshot is applied, so what it kept while cut off
    // is indexed again at once.
    let indexed = held();
    assert!(indexed > 0.0, "decode-0's blocks came back with its snapshot:\n{}", project.logs());
    let summary = load.finish();
    let (sent, failed) = sent_failed(&summary);
    let resumed = router_metric(router, "tandem_router_decode_resumptions_total", "");
    let slowest = summary["request_latency_ms"]["max"].as_f64().unwrap_or(f64::INFINITY);
    println!(
        "figures: decode worker cut off 20 s: sent {sent}, failed {failed}, resumed {resumed}, dropped after \
         {dropped:.1?}, back {back:.1?} after reconnecting with {indexed} blocks indexed, slowest request \
         {slowest:.0} ms"
    );
    assert_eq!(failed, 0, "{summary}\n{}", project.logs());
    assert!(slowest < (LOAD_TIMEOUT_SECS * 1000) as f64, "no request hangs: {summary}");
}

/// A completion whose prompt is the same long text every time; the tokens the answer says were cached.
fn cached_tokens(router: std::net::SocketAddr) -> Option<u64> {
    let prompt = "The history of lighthouses is a history of light, stone and patience. ".repeat(40);
    let body = serde_json::json!({"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 4}).to_string();
    let reply = request(router, "POST", "/v1/completions", &body, None).filter(|r| r.status == 200)?;
    reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64()
}

#[test]
fn a_restarted_router_rebuilds_its_index_from_snapshots_and_hits_the_cache_again() {
    let project = Project::up("mock", MOCK, &[]);
    let router = project.router();
    assert_eq!(cached_tokens(router), Some(0), "a new prompt");
    // The worker's KV events reach the router a moment after the answer: asked again at once, the prompt may be
    // routed before the index knows where it is (a full suite on a 2-core VM saw that once).
    let again = (0..10).find_map(|_| {
        let c = cached_tokens(router).filter(|&c| c > 0);
        if c.is_none() {
            std::thread::sleep(Duration::from_millis(300));
        }
        c
    });
    assert!(again.is_some(), "the same prompt again is found cached");
    let restarted = Instant::now();
    project.docker(&["restart", "-t", "5"], "router");
    let ready = project.wait_for_workers(4, Duration::from_secs(60));
    // Its port may have moved with the restart.
    let router = project.router();
    let hit = loop {
        if cached_tokens(router).is_some_and(|c| c > 0) {
            break restarted.elapsed();
        }
        assert!(restarted.elapsed() < Duration::from_secs(60), "no cache hit after the restart:\n{}", project.logs());
        std::thread::sleep(Duration::from_millis(100));
    };
    println!(
        "figures: router restarted: all workers up {ready:.1?} after `docker restart` returned, a cache hit {hit:.1?} after it began"
    );
}

#[test]
fn a_worker_stopped_with_sigterm_drains_its_requests() {
    let project = Project::up("mock", MOCK, &[]);
    let router = project.router();
    let load = Load::start(router, 40, 6.0, 4, 200);
    // SIGTERM while the router has streams in flight on the worker: draining means they finish there.
    let in_flight = || router_metric(router, "tandem_router_worker_in_flight", "worker=\"decode-0\"");
    std::thread::sleep(Duration::from_secs(2));
    assert!(within(Duration::from_secs(10), || in_flight() > 0.0), "nothing ever in flight on decode-0");
    let draining = in_flight();
    let stopping = Instant::now();
    // SIGTERM, then SIGKILL after 30 s: the worker's own grace is 30 s too.
    project.docker(&["stop", "-t", "30"], "decode-0");
    let drained = stopping.elapsed();
    let summary = load.finish();
    let (sent, failed) = sent_failed(&summary);
    let resumed = router_metric(router, "tandem_router_decode_resumptions_total", "");
    println!(
        "figures: decode worker stopped (SIGTERM) with {draining} streams in flight: sent {sent}, failed {failed}, \
         resumed {resumed}, exited after {drained:.1?}"
    );
    assert_eq!(failed, 0, "{summary}\n{}", project.logs());
    // A worker killed instead of drained would leave its streams to be resumed elsewhere.
    assert_eq!(resumed, 0.0, "every stream in flight on the stopped worker finished there: {summary}");
}
