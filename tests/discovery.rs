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
    config.tenants = router::tenants::Tenants::open(vec!["sk-reg".into()]);
    config.admin_key = Some("adm-reg".into());
    let router = RunningRouter::start(config).await.expect("router");
    let auth = [("authorization", "Bearer sk-reg")];
    let admin = [("authorization", "Bearer adm-reg")];
    assert_eq!(http(router.addr, "GET", "/ready", "", &[]).await.status, 503, "no workers yet");
    let r = http(router.addr, "POST", "/v1/chat/completions", CHAT, &auth).await;
    assert_eq!(r.status, 503, "{}", r.body);

    let d = worker(&ca, Role::Decode, "decode-0").await;
    let reg =
        Registration { router: format!("http://{}", router.addr), advertise: d.grpc, api_key: Some("adm-reg".into()) };
    for key in [None, Some("sk-reg".to_string())] {
        let wrong = Registration { api_key: key, ..reg.clone() };
        assert!(wrong.announce().await.is_err(), "registration needs the admin key, not a client's");
    }
    reg.announce().await.expect("registers");
    reg.announce().await.expect("registering twice is harmless");
    wait_for_workers(&router, 1).await;
    // Slow start: just joined, the worker may take only a small share of requests for now.
    let views =
        router.state.cluster.view(&[], router::cluster::Needs::ANY, Duration::from_secs(60), std::time::Instant::now());
    assert!(views[0].ramp < 0.2, "a newcomer's share ramps up: {}", views[0].ramp);
    assert_eq!(http(router.addr, "GET", "/admin/workers", "", &auth).await.status, 401, "a client key is not enough");
    let listed = http(router.addr, "GET", "/admin/workers", "", &admin).await.json();
    assert_eq!(listed["workers"].as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(http(router.addr, "POST", "/v1/chat/completions", CHAT, &auth).await.status, 200);

    reg.withdraw().await.expect("leaves");
    assert!(router.state.cluster.up_members().is_empty());
    assert_eq!(http(router.addr, "GET", "/ready", "", &[]).await.status, 503);
    router.shutdown(Duration::from_secs(5)).await;
    d.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_are_checked_bounded_and_forgotten_when_silent() {
    let ca = DevCa::generate().expect("ca");
    let mut config = router_config(&ca, vec![]);
    config.admin_key = Some("adm".into());
    config.follow = router::cluster::FollowSettings {
        max_workers: 2,
        forget_registered_after: Duration::from_secs(1),
        ..Default::default()
    };
    let router = RunningRouter::start(config).await.expect("router");
    let admin = [("authorization", "Bearer adm")];
    let register = |a: &str| format!("{{\"address\":\"{a}\"}}");
    for (path, method, body) in
        [("/admin/router-config", "GET", String::new()), ("/admin/workers", "POST", register("127.0.0.1:1"))]
    {
        assert_eq!(http(router.addr, method, path, &body, &[]).await.status, 401, "{path} without the key");
    }
    assert_eq!(http(router.addr, "POST", "/debug/route", CHAT, &[]).await.status, 401);
    assert_eq!(http(router.addr, "GET", "/admin/router-config", "", &admin).await.status, 200);
    // Addresses no worker can have are refused.
    for bad in ["0.0.0.0:9000", "127.0.0.1:0", "224.0.0.1:9000", "nonsense"] {
        let r = http(router.addr, "POST", "/admin/workers", &register(bad), &admin).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
    }
    // Two silent workers register; a third is one too many.
    for port in [1, 2] {
        let r = http(router.addr, "POST", "/admin/workers", &register(&format!("127.0.0.1:{port}")), &admin).await;
        assert_eq!(r.status, 202, "{}", r.body);
    }
    let r = http(router.addr, "POST", "/admin/workers", &register("127.0.0.1:3"), &admin).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("at most 2"), "{}", r.body);
    // They never answer: after a second they are forgotten, and there is room again.
    let mut left = 2;
    for _ in 0..200 {
        left = router.state.cluster.followed().len();
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(left, 0, "silent registered workers are not followed forever");
    let r = http(router.addr, "POST", "/admin/workers", &register("127.0.0.1:3"), &admin).await;
    assert_eq!(r.status, 202, "{}", r.body);
    router.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_takes_workers_one_protocol_version_older_and_refuses_newer_ones() {
    use tandem_tests::fake::{Behaviour, FakeWorker};
    let ca = DevCa::generate().expect("ca");
    let role = proto::worker::Role::Decode;
    let ours = worker::PROTOCOL_VERSION;
    // Version 1 sent no version at all: two versions back, refused like a newer one.
    let silent = FakeWorker::speaking(&ca, role, Behaviour::Fail, vec![], 0).await;
    let older = FakeWorker::speaking(&ca, role, Behaviour::Fail, vec![], ours - 1).await;
    let current = FakeWorker::speaking(&ca, role, Behaviour::Fail, vec![], ours).await;
    let newer = FakeWorker::speaking(&ca, role, Behaviour::Fail, vec![], ours + 1).await;
    let workers = vec![silent.grpc, older.grpc, current.grpc, newer.grpc];
    let router = RunningRouter::start(router_config(&ca, workers)).await.expect("router");
    wait_for_workers(&router, 2).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let up: Vec<std::net::SocketAddr> = router.state.cluster.up_members().into_iter().map(|(_, m)| m.addr).collect();
    assert!(up.contains(&older.grpc) && up.contains(&current.grpc), "{up:?}");
    assert!(!up.contains(&newer.grpc), "a newer worker needs a newer router: {up:?}");
    assert!(!up.contains(&silent.grpc), "two versions back is too old: {up:?}");
    // A request asking for what the older protocol does not carry goes only to workers that know it; a plain one
    // may go to either.
    let candidates = |extra: serde_json::Value| {
        let mut body = serde_json::json!({"model": "smollm2-135m-instruct", "prompt": "Hello there", "max_tokens": 2});
        for (k, v) in extra.as_object().expect("object") {
            body[k] = v.clone();
        }
        let router = router.addr;
        async move {
            let v = http(router, "POST", "/debug/route", &body.to_string(), &[]).await.json();
            let mut names: Vec<String> = v["decode"]["candidates"]
                .as_array()
                .unwrap_or_else(|| panic!("{v}"))
                .iter()
                .map(|c| c["worker"].as_str().expect("name").to_string())
                .collect();
            names.sort();
            names
        }
    };
    assert_eq!(candidates(serde_json::json!({})).await.len(), 2);
    let name_of = |addr| {
        let up = router.state.cluster.up_members();
        up.into_iter().find(|(_, m)| m.addr == addr).map(|(_, m)| m.name).expect("up")
    };
    let current_name = name_of(current.grpc);
    // Sampling rules came with version 3, before the older worker's: both take them. Log-probabilities came with
    // version 4: only workers that speak it may be asked (an older one would answer without them).
    for rules in [
        serde_json::json!({"frequency_penalty": 0.5}),
        serde_json::json!({"logit_bias": {"5": 1}}),
        serde_json::json!({"stop_token_ids": [2]}),
    ] {
        assert_eq!(candidates(rules.clone()).await.len(), 2, "{rules}");
    }
    let logprobs = candidates(serde_json::json!({"logprobs": 1})).await;
    if ours > worker::LOGPROBS_PROTOCOL {
        assert_eq!(logprobs.len(), 2, "both speak version 4 or later: {logprobs:?}");
    } else {
        assert_eq!(logprobs, vec![current_name.clone()]);
    }
    // `min_p` came with version 6: an older worker would sample without it.
    let min_p = candidates(serde_json::json!({"min_p": 0.1})).await;
    if ours > worker::MIN_P_PROTOCOL {
        assert_eq!(min_p.len(), 2, "{min_p:?}");
    } else {
        assert_eq!(min_p, vec![current_name.clone()]);
    }
    assert_eq!(candidates(serde_json::json!({"min_p": 0})).await.len(), 2, "min_p 0 asks for nothing");
    // Priorities came with version 9: an older worker would queue the request in arrival order.
    let prioritized = candidates(serde_json::json!({"priority": -1})).await;
    if ours > worker::PRIORITY_PROTOCOL {
        assert_eq!(prioritized.len(), 2, "{prioritized:?}");
    } else {
        assert_eq!(prioritized, vec![current_name.clone()]);
    }
    assert_eq!(candidates(serde_json::json!({"priority": 0})).await.len(), 2, "priority 0 asks for nothing");
    // Lark grammars came with version 10: an older worker would refuse the grammar's kind.
    let lark = candidates(serde_json::json!({"guided_grammar": "start: \"a\""})).await;
    if ours > worker::LARK_PROTOCOL {
        assert_eq!(lark.len(), 2, "{lark:?}");
    } else {
        assert_eq!(lark, vec![current_name.clone()]);
    }
    // GBNF grammars came with version 12: an older worker would refuse the grammar's kind.
    let gbnf = candidates(serde_json::json!({"guided_grammar": "root ::= \"a\""})).await;
    if ours > worker::GBNF_PROTOCOL {
        assert_eq!(gbnf.len(), 2, "{gbnf:?}");
    } else {
        assert_eq!(gbnf, vec![current_name.clone()]);
    }
    router.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_takes_rotated_certificates_without_a_restart() {
    use kv_transfer::tls::{Identity, IdentityFiles};
    let dir = std::env::temp_dir().join(format!("tandem-router-rotation-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (old, new) = (DevCa::generate().expect("ca"), DevCa::generate().expect("the next ca"));
    old.write(&dir).expect("writes");
    old.issue("router", &[]).expect("cert").write(&dir, "router").expect("writes");
    // The worker already has the next CA's certificate; the router cannot take it until it has one too.
    let d = worker(&new, Role::Decode, "decode-0").await;
    let mut config = router_config(&old, vec![d.grpc]);
    config.identity = Identity::load(&dir, "router").expect("reads");
    config.certs = Some(IdentityFiles { dir: dir.clone(), name: "router".into() });
    let router = RunningRouter::start(config).await.expect("router");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(router.state.cluster.up_members().is_empty(), "another CA's worker was taken");
    new.write(&dir).expect("writes");
    new.issue("router", &[]).expect("cert").write(&dir, "router").expect("writes");
    wait_for_workers(&router, 1).await;
    router.shutdown(Duration::from_secs(5)).await;
    d.shutdown(Duration::from_secs(5)).await;
    let _ = std::fs::remove_dir_all(&dir);
}
