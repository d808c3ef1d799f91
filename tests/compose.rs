//! The cluster as docker-compose runs it (`deploy/compose/docker-compose.yml`): an image built here without a
//! registry, the router and four workers in containers of their own on a private network, mutual TLS by role
//! identity (one certificate per role, verified by name, not address), KV between containers over QUIC.

use std::process::Command;

use tandem_tests::compose::{ADMIN_KEY, Project, docker, followed, request, run, up, within};

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

    // Every metric the compose file's Grafana dashboard charts is one the router or a worker exports.
    let pages: String = [router, project.port("decode-0", 9200)]
        .into_iter()
        .map(|a| request(a, "GET", "/metrics", "", None).map(|r| r.body).unwrap_or_default())
        .collect();
    let dashboard = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/compose/grafana/dashboards/tandem.json"),
    )
    .expect("the dashboard");
    let charted = metric_names(&dashboard);
    assert!(charted.len() >= 8, "{charted:?}");
    for name in charted {
        assert!(pages.lines().any(|l| l.starts_with(&name)), "the dashboard charts {name}, which nothing exports");
    }
}

/// The `tandem_*` metric names in a text (PromQL expressions), as exported (`_bucket` series included).
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("tandem_") {
        let name: String =
            rest[at..].chars().take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_').collect();
        rest = &rest[at + name.len()..];
        if name.len() > "tandem_".len() {
            names.insert(name);
        }
    }
    names
}

#[test]
fn peers_with_a_foreign_cas_certificate_are_refused_by_the_router_and_by_the_workers() {
    use std::time::Duration;
    let project = Project::up("mock", &[("TANDEM_KV_BLOCKS", "4096"), ("TANDEM_HOST_BLOCKS", "4096")], &[]);
    let router = project.router();
    let dir = std::env::temp_dir().join(format!("tandem-foreign-ca-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (foreign, own, mixed) = (dir.join("foreign"), dir.join("own"), dir.join("mixed"));
    run(Command::new(tandem_tests::binary("tandem", "tandem"))
        .args(["certs", "init", "--components", "router,prefill", "--dir"])
        .arg(&foreign));
    // The cluster's own certificates, and a mix: the cluster's CA trusted, a foreign CA's certificate presented.
    let certs = project.container("certs");
    std::fs::create_dir_all(&mixed).expect("dir");
    docker(&["cp", &format!("{certs}:/certs/."), own.to_str().expect("utf-8")]);
    std::fs::copy(own.join("ca.pem"), mixed.join("ca.pem")).expect("copies");
    for f in ["router.pem", "router.key"] {
        std::fs::copy(foreign.join(f), mixed.join(f)).expect("copies");
    }
    let models = tandem_tests::model().parent().expect("dir").display().to_string();
    let mount = |d: &std::path::Path| format!("{}:/certs:ro", d.display());
    let models_mount = format!("{models}:/var/lib/tandem/models:ro");
    let base: Vec<String> =
        ["--user", "0:0", "-v", &models_mount, "-e", "TANDEM_CERTS_DIR=/certs"].iter().map(|s| s.to_string()).collect();

    // A worker with a foreign CA's certificate, under the name the router resolves for prefill workers: the router
    // finds it and never takes it.
    let mut args = base.clone();
    args.extend(["--network-alias", "prefill", "-v", &mount(&foreign)].map(String::from));
    for e in ["TANDEM_ROLE=prefill", "TANDEM_CERT_NAME=prefill", "TANDEM_ENGINE=mock", "TANDEM_KV_BLOCKS=4096"] {
        args.extend(["-e".to_string(), e.to_string()]);
    }
    args.extend(["-e", "TANDEM_MAX_MODEL_LEN=8192", "-e", "TANDEM_SHM_DIR=off"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let intruder = project.run_beside(&args, &["worker"]);
    let ip = docker(&["inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", &intruder]);
    let address = format!("{ip}:9000");
    assert!(
        within(Duration::from_secs(30), || followed(router).iter().any(|(a, _)| *a == address)),
        "the router never resolved the intruder {address}: {:?}\n{}",
        followed(router),
        project.logs()
    );
    std::thread::sleep(Duration::from_secs(3));
    let now = followed(router);
    assert!(now.iter().any(|(a, up)| *a == address && !up), "found, never up: {now:?}");
    assert_eq!(now.iter().filter(|(_, up)| *up).count(), 4, "{now:?}");

    // A router whose certificate a foreign CA signed: the workers refuse it (it trusts the cluster's CA, so it is
    // the workers that say no). The same router with the cluster's own certificate is taken: the control.
    let router_beside = |certs: &std::path::Path| {
        let mut args = base.clone();
        args.extend(
            ["-v", &mount(certs), "-p", "127.0.0.1::8000", "-e", "TANDEM_WORKERS=decode:9000"].map(String::from),
        );
        args.extend(["-e".to_string(), format!("TANDEM_ADMIN_KEY={ADMIN_KEY}")]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let id = project.run_beside(&args, &["router"]);
        let port = docker(&["port", &id, "8000/tcp"]);
        let addr: std::net::SocketAddr = port.lines().next().unwrap_or_default().parse().expect("published");
        (id, addr)
    };
    let (own_router, at) = router_beside(&own);
    assert!(within(Duration::from_secs(30), || up(at) == 2), "the control router never took the decode workers");
    docker(&["rm", "-f", &own_router]);
    let (_, at) = router_beside(&mixed);
    assert!(within(Duration::from_secs(30), || followed(at).len() == 2), "the second router resolved both");
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(up(at), 0, "a router with a foreign certificate was taken: {:?}", followed(at));
    let _ = std::fs::remove_dir_all(&dir);
}
