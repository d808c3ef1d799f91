//! The CPU overlay's wiring, run as Kubernetes would wire it: every replica of every rendered Deployment runs as a
//! container of this build's image with the pod's args, user, environment, ports and mounts, on a network whose
//! aliases are the Services' DNS names (`scripts/deploy/pods.py` reads them off `kubectl kustomize`), with the
//! certificates made as `deploy/k8s/base/kustomization.yaml` says. Then every probe the manifests name answers, both
//! router replicas follow all four workers through the headless Services (verifying each worker's certificate
//! for the Service's name), and a request is served across pods. Not exercised: the init container's model fetch
//! (the image built here has no pip; the model is mounted where it would put it).

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tandem_tests::compose::{ADMIN_KEY, docker, image, request, run, up, within};

/// Containers, network and image of one run, removed however the test ends.
struct Cluster {
    containers: Vec<String>,
    network: String,
    image: String,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in &self.containers {
            let _ = Command::new("docker").args(["rm", "-f", c]).output();
        }
        let _ = Command::new("docker").args(["network", "rm", &self.network]).output();
        let _ = Command::new("docker").args(["rmi", "-f", &self.image]).output();
    }
}

#[test]
fn the_cpu_overlays_pods_wired_as_kubernetes_would_serve_a_request_across_pods() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("repo").to_path_buf();
    let python = std::env::var("TANDEM_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let out = run(Command::new(&python)
        .arg(repo.join("scripts/deploy/pods.py"))
        .arg(repo.join("deploy/k8s/overlays/cpu"))
        .args(["--secret", &format!("tandem-keys/admin-key={ADMIN_KEY}")]));
    let pods: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("pods.py's JSON");
    assert_eq!(pods.len(), 6, "two replicas of each role");

    let id = std::process::id();
    let mut cluster = Cluster { containers: Vec::new(), network: format!("tandem-k8s-{id}"), image: image() };
    docker(&["network", "create", &cluster.network]);

    // The Secret, as the base's instructions make it; files owned by the pods' user, as fsGroup would.
    let dir = std::env::temp_dir().join(format!("tandem-k8s-{id}"));
    let _ = std::fs::remove_dir_all(&dir);
    let certs = dir.join("certs");
    run(Command::new(tandem_tests::binary("tandem", "tandem"))
        .args(["certs", "init", "--components", "tandem-router,tandem-prefill,tandem-decode", "--dir"])
        .arg(&certs));
    run(Command::new("chown").args(["-R", "10001:10001"]).arg(&certs));
    let models = tandem_tests::model().parent().expect("dir").display().to_string();

    let mut routers = Vec::new();
    for pod in &pods {
        let name = pod["name"].as_str().expect("name");
        let mut args: Vec<String> = ["run", "-d", "--name", &format!("{name}-{id}"), "--hostname", name]
            .into_iter()
            .map(String::from)
            .collect();
        let user = pod["user"].as_str().expect("user").to_string();
        args.extend(["--network".into(), cluster.network.clone(), "--user".into(), user]);
        for alias in pod["aliases"].as_array().expect("aliases") {
            args.extend(["--network-alias".into(), alias.as_str().expect("alias").to_string()]);
        }
        for (k, v) in pod["env"].as_object().expect("env") {
            args.extend(["-e".into(), format!("{k}={}", v.as_str().expect("a string"))]);
        }
        for m in pod["mounts"].as_array().expect("mounts") {
            let path = m["path"].as_str().expect("path");
            match m["kind"].as_str() {
                Some("secret") => args.extend(["-v".into(), format!("{}:{path}:ro", certs.display())]),
                Some("configMap") => {
                    let cm = dir.join(m["source"].as_str().expect("source"));
                    std::fs::create_dir_all(&cm).expect("dir");
                    for (file, text) in m["files"].as_object().expect("files") {
                        std::fs::write(cm.join(file), text.as_str().expect("text")).expect("writes");
                    }
                    args.extend(["-v".into(), format!("{}:{path}:ro", cm.display())]);
                }
                // An emptyDir: the container's own; the model where the init container would fetch it.
                _ => args.extend(["-v".into(), format!("{models}:{path}/models:ro")]),
            }
        }
        if pod["component"] == "router" {
            args.extend(["-p".into(), "127.0.0.1::8000".into()]);
        }
        args.push(cluster.image.clone());
        args.extend(pod["args"].as_array().expect("args").iter().map(|a| a.as_str().expect("arg").to_string()));
        let container = docker(&args.iter().map(String::as_str).collect::<Vec<_>>());
        cluster.containers.push(container.clone());
        if pod["component"] == "router" {
            let port = docker(&["port", &container, "8000/tcp"]);
            routers.push(port.lines().next().unwrap_or_default().parse::<SocketAddr>().expect("published"));
        }
    }
    let logs = |c: &str| docker(&["logs", "--tail", "20", c]);

    // Every probe the manifests name answers from inside its pod, as the kubelet would ask it.
    for (pod, container) in pods.iter().zip(&cluster.containers) {
        for (kind, url) in pod["probes"].as_object().expect("probes") {
            let url = url.as_str().expect("url");
            let ok = within(Duration::from_secs(120), || {
                Command::new("docker")
                    .args(["exec", container, "tandem", "probe", url])
                    .status()
                    .is_ok_and(|s| s.success())
            });
            assert!(ok, "{} {kind} {url} never passed:\n{}", pod["name"], logs(container));
        }
    }

    // Both router replicas follow every worker through the headless Services, certificates verified by name.
    for r in &routers {
        assert!(within(Duration::from_secs(60), || up(*r) == 4), "router at {r} has {} of 4 workers up", up(*r));
    }
    let body = serde_json::json!({
        "model": "smollm2-135m-instruct",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Describe a lighthouse at night in three long sentences, please."}],
    })
    .to_string();
    let route = request(routers[0], "POST", "/debug/route", &body, Some(ADMIN_KEY)).expect("answers").json();
    assert_eq!(route["disaggregate"], true, "{route}");
    let prefill = route["prefill"]["worker"].as_str().unwrap_or_default();
    assert!(prefill.starts_with("tandem-prefill-"), "named by pod: {route}");
    for r in &routers {
        let reply = request(*r, "POST", "/v1/chat/completions", &body, None).expect("answers");
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
