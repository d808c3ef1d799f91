//! Admission control, deadlines and client cancellation.

use std::time::Duration;

use kv_transfer::tls::DevCa;
use router::run::RunningRouter;
use router::state::Limits;
use tandem_tests::*;
use worker::Role;

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
