//! The cluster as docker-compose runs it (`deploy/compose/docker-compose.yml`): an image built here without a
//! registry, the router and four workers in containers of their own on a private network, mutual TLS by role
//! identity (one certificate per role, verified by name, not address), KV between containers over QUIC.

use std::process::Command;

use tandem_tests::compose::{ADMIN_KEY, Project, request, run};

const PROMPT: &str = "Write a long story about a lighthouse keeper who finds a message in a bottle that was sent \
                      from the future, and explain what the message says in detail.";

#[test]
fn a_request_crosses_containers_over_quic_with_workers_verified_by_role_name() {
    let project = Project::up("cpu", &[], &[]);
    let router = project.router();
    let body = serde_json::json!({
        "model": "smollm2-135m-instruct",
        "max_tokens": 12,
        "temperature": 0,
        "messages": [{"role": "user", "content": PROMPT}],
    })
    .to_string();
    let route = request(router, "POST", "/debug/route", &body, Some(ADMIN_KEY)).expect("the router answers").json();
    assert_eq!(route["disaggregate"], true, "{route}");
    let prefill = route["prefill"]["worker"].as_str().unwrap_or_default().to_string();
    let decode = route["decode"]["worker"].as_str().unwrap_or_default().to_string();
    assert!(["prefill-0", "prefill-1"].contains(&prefill.as_str()), "named by service: {route}");
    assert!(["decode-0", "decode-1"].contains(&decode.as_str()), "named by service: {route}");

    let reply = request(router, "POST", "/v1/chat/completions", &body, None).expect("the router answers");
    assert_eq!(reply.status, 200, "{}\n{}", reply.body, project.logs());
    let got = reply.json();

    // The same answer as one engine computing the whole request here.
    let want = run(Command::new(tandem_tests::binary("tandem", "tandem"))
        .args(["generate", "--chat", "--json", "--max-tokens", "12", "--model"])
        .arg(tandem_tests::model())
        .arg(PROMPT));
    let want: serde_json::Value = serde_json::from_slice(&want.stdout).expect("generate --json");
    assert_eq!(got["choices"][0]["message"]["content"], want["text"], "{got}");

    // The prompt's KV went from the prefill container to the decode container over QUIC: containers share no
    // memory, so never over the shared-memory path.
    let decoders = ["decode-0", "decode-1"];
    let quic = project.counter(&decoders, "tandem_kv_transfer_pulled_blocks_total", "transport=\"quic\"");
    let shm = project.counter(&decoders, "tandem_kv_transfer_pulled_blocks_total", "transport=\"shm\"");
    assert!(quic >= 3.0, "the 61-token prompt's 3 full blocks crossed over QUIC: {quic}\n{}", project.logs());
    assert_eq!(shm, 0.0);
}
