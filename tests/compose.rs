//! The cluster as docker-compose runs it (`deploy/compose/docker-compose.yml`): an image built here without a
//! registry (`deploy/docker/build-local.sh`, from this build's `tandem` binary), the router and four workers in
//! containers of their own on a private network, mutual TLS by role identity (one certificate per role, verified by
//! name, not address), KV between containers over QUIC. Needs a Docker Engine and Compose, as CI has.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const ADMIN_KEY: &str = "compose-test-admin";
const PROMPT: &str = "Write a long story about a lighthouse keeper who finds a message in a bottle that was sent \
                      from the future, and explain what the message says in detail.";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the repository").to_path_buf()
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?} could not run: {e} (is Docker installed?)"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `docker compose` where the plugin is installed, else the standalone `docker-compose`.
fn compose_program() -> Vec<String> {
    let plugin = Command::new("docker").args(["compose", "version"]).output().is_ok_and(|o| o.status.success());
    if plugin { vec!["docker".into(), "compose".into()] } else { vec!["docker-compose".into()] }
}

/// A compose project of its own, taken down with its volumes (and its image removed) however the test ends.
struct Project {
    name: String,
    image: String,
    program: Vec<String>,
}

impl Project {
    fn up(image: String, models: &Path) -> Project {
        let p = Project { name: format!("tandem-test-{}", std::process::id()), image, program: compose_program() };
        let mut up = p.command();
        up.env("TANDEM_TEST_MODELS", models).args(["up", "-d", "--no-build"]);
        run(&mut up);
        p
    }

    fn command(&self) -> Command {
        let mut c = Command::new(&self.program[0]);
        c.args(&self.program[1..])
            .args(["-p", &self.name, "-f"])
            .arg(repo().join("deploy/compose/docker-compose.yml"))
            .arg("-f")
            .arg(repo().join("tests/compose/test.yml"))
            .env("TANDEM_IMAGE", &self.image)
            .env("TANDEM_PUBLISH", "127.0.0.1:0")
            .env("TANDEM_ADMIN_KEY", ADMIN_KEY)
            .env("TANDEM_ENGINE", "cpu")
            // Small tiers: four engines on a 2-core CI machine, one short request.
            .env("TANDEM_KV_BLOCKS", "512")
            .env("TANDEM_HOST_BLOCKS", "512")
            .env("TANDEM_DISK_BLOCKS", "0")
            .env("TANDEM_TEST_MODELS", "/nonexistent");
        c
    }

    /// Where `service`'s container `port` is published on this machine.
    fn port(&self, service: &str, port: u16) -> SocketAddr {
        let out = run(self.command().args(["port", service, &port.to_string()]));
        let text = String::from_utf8_lossy(&out.stdout);
        text.trim().parse().unwrap_or_else(|e| panic!("{service}:{port} published at {text:?}: {e}"))
    }

    fn logs(&self) -> String {
        self.command().args(["logs", "--no-color", "--tail", "40"]).output().map_or_else(
            |e| e.to_string(),
            |o| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)),
        )
    }
}

impl Drop for Project {
    fn drop(&mut self) {
        let _ = self.command().args(["down", "-v", "--remove-orphans", "--timeout", "5"]).output();
        let _ = Command::new("docker").args(["rmi", "-f", &self.image]).output();
    }
}

/// The image of this build's `tandem`, built without a registry.
fn image() -> String {
    let tag = format!("tandem-test:{}", std::process::id());
    let binary = tandem_tests::binary("tandem", "tandem");
    run(Command::new(repo().join("deploy/docker/build-local.sh")).arg("--binary").arg(&binary).args(["--tag", &tag]));
    tag
}

async fn admin(router: SocketAddr, method: &str, path: &str, body: &str) -> tandem_tests::Reply {
    let auth = format!("Bearer {ADMIN_KEY}");
    tandem_tests::http(router, method, path, body, &[("authorization", auth.as_str())]).await
}

/// Sum of a counter's samples with `label` in their label set, from a `/metrics` page.
fn counter(page: &str, name: &str, label: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_crosses_containers_over_quic_with_workers_verified_by_role_name() {
    let model = tandem_tests::model();
    let project = Project::up(image(), model.parent().expect("the model's directory"));
    let router = project.port("router", 8000);

    // Every worker joins: the router found them under their role's name and verified that name.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let reply = tokio::time::timeout(Duration::from_secs(5), admin(router, "GET", "/admin/workers", "")).await;
        let up = reply.ok().filter(|r| r.status == 200).map_or(0, |r| r.body.matches("\"up\":true").count());
        if up == 4 {
            break;
        }
        assert!(Instant::now() < deadline, "{up} of 4 workers up after 120 s:\n{}", project.logs());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    let body = serde_json::json!({
        "model": "smollm2-135m-instruct",
        "max_tokens": 12,
        "temperature": 0,
        "messages": [{"role": "user", "content": PROMPT}],
    })
    .to_string();
    let route = admin(router, "POST", "/debug/route", &body).await.json();
    assert_eq!(route["disaggregate"], true, "{route}");
    let prefill = route["prefill"]["worker"].as_str().unwrap_or_default().to_string();
    let decode = route["decode"]["worker"].as_str().unwrap_or_default().to_string();
    assert!(["prefill-0", "prefill-1"].contains(&prefill.as_str()), "named by service: {route}");
    assert!(["decode-0", "decode-1"].contains(&decode.as_str()), "named by service: {route}");

    let reply = tandem_tests::http(router, "POST", "/v1/chat/completions", &body, &[]).await;
    assert_eq!(reply.status, 200, "{}\n{}", reply.body, project.logs());
    let got = reply.json();

    // The same answer as one engine computing the whole request here.
    let want = run(Command::new(tandem_tests::binary("tandem", "tandem"))
        .args(["generate", "--chat", "--json", "--max-tokens", "12", "--model"])
        .arg(&model)
        .arg(PROMPT));
    let want: serde_json::Value = serde_json::from_slice(&want.stdout).expect("generate --json");
    assert_eq!(got["choices"][0]["message"]["content"], want["text"], "{got}");

    // The prompt's KV went from the prefill container to the decode container over QUIC: containers share no
    // memory, so never over the shared-memory path.
    let (mut quic, mut shm) = (0.0, 0.0);
    for service in ["decode-0", "decode-1"] {
        let page = tandem_tests::http(project.port(service, 9200), "GET", "/metrics", "", &[]).await.body;
        quic += counter(&page, "tandem_kv_transfer_pulled_blocks_total", "transport=\"quic\"");
        shm += counter(&page, "tandem_kv_transfer_pulled_blocks_total", "transport=\"shm\"");
    }
    assert!(quic >= 3.0, "the 61-token prompt's 3 full blocks crossed over QUIC: {quic}\n{}", project.logs());
    assert_eq!(shm, 0.0);
}
