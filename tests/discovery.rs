//! Workers found by DNS name, and workers that register and leave on their own, while the router runs.

use std::time::Duration;

use kv_transfer::tls::DevCa;
use router::discovery::WorkerSource;
use router::run::RunningRouter;
use tandem_tests::*;
use worker::Role;
use worker::register::Registration;

const CHAT: &str = r#"{"model":"smollm2-135m-instruct","max_tokens":3,"messages":[{"role":"user","content":"Hello"}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_name_brings_in_the_workers_it_resolves_to() {
    let ca = DevCa::generate().expect("ca");
    let d = worker(&ca, Role::Decode, "decode-0").await;
    let mut config = router_config(&ca, vec![]);
    config.workers = vec![WorkerSource::Dns(format!("localhost:{}", d.grpc.port()))];
    let router = RunningRouter::start(config).await.expect("router");
    wait_for_workers(&router, 1).await;
    assert_eq!(http(router.addr, "POST", "/v1/chat/completions", CHAT, &[]).await.status, 200);
    router.shutdown(Duration::from_secs(5)).await;
    d.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_register_themselves_and_leave() {
    let ca = DevCa::generate().expect("ca");
    let mut config = router_config(&ca, vec![]);
    config.api_keys = vec!["sk-reg".into()];
    let router = RunningRouter::start(config).await.expect("router");
    let auth = [("authorization", "Bearer sk-reg")];
    assert_eq!(http(router.addr, "GET", "/ready", "", &[]).await.status, 503, "no workers yet");
    let r = http(router.addr, "POST", "/v1/chat/completions", CHAT, &auth).await;
    assert_eq!(r.status, 503, "{}", r.body);

    let d = worker(&ca, Role::Decode, "decode-0").await;
    let reg =
        Registration { router: format!("http://{}", router.addr), advertise: d.grpc, api_key: Some("sk-reg".into()) };
    let wrong = Registration { api_key: None, ..reg.clone() };
    assert!(wrong.announce().await.is_err(), "registration needs the key");
    reg.announce().await.expect("registers");
    reg.announce().await.expect("registering twice is harmless");
    wait_for_workers(&router, 1).await;
    // Slow start: just joined, the worker may take only a small share of requests for now.
    let views = router.state.cluster.view(&[], Duration::from_secs(60), std::time::Instant::now());
    assert!(views[0].ramp < 0.2, "a newcomer's share ramps up: {}", views[0].ramp);
    let listed = http(router.addr, "GET", "/admin/workers", "", &auth).await.json();
    assert_eq!(listed["workers"].as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(http(router.addr, "POST", "/v1/chat/completions", CHAT, &auth).await.status, 200);

    reg.withdraw().await.expect("leaves");
    assert!(router.state.cluster.up_members().is_empty());
    assert_eq!(http(router.addr, "GET", "/ready", "", &[]).await.status, 503);
    router.shutdown(Duration::from_secs(5)).await;
    d.shutdown(Duration::from_secs(5)).await;
}
