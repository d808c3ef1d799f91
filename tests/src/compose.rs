//! `deploy/compose/docker-compose.yml` brought up as a user would, from an image of this build's `tandem` made
//! without a registry (`deploy/docker/build-local.sh`), with `tests/compose/test.yml` over it; and the means to
//! hurt it: kill, stop, cut off and restart containers. Needs a Docker Engine and Compose, as CI has.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

pub const ADMIN_KEY: &str = "compose-test-admin";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the repository").to_path_buf()
}

/// Runs `cmd`, which must succeed.
pub fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?} could not run: {e} (is Docker installed?)"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let hint = if stderr.contains("Cannot connect to the Docker daemon") {
        "\n(the Docker Engine is not running: scripts/docker-ready.sh starts it where it may)"
    } else {
        ""
    };
    assert!(out.status.success(), "{cmd:?} failed: {}{stderr}{hint}", String::from_utf8_lossy(&out.stdout));
    out
}

/// `docker compose` where the plugin is installed, else the standalone `docker-compose`.
pub fn compose_program() -> Vec<String> {
    let plugin = Command::new("docker").args(["compose", "version"]).output().is_ok_and(|o| o.status.success());
    if plugin { vec!["docker".into(), "compose".into()] } else { vec!["docker-compose".into()] }
}

/// `docker <args>`, which must succeed; its stdout, trimmed.
pub fn docker(args: &[&str]) -> String {
    String::from_utf8_lossy(&run(Command::new("docker").args(args)).stdout).trim().to_string()
}

/// Polls `check` every 250 ms for up to `limit`; whether it held.
pub fn within(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    false
}

/// The image of this build's `tandem`, built without a registry under a tag of this process's own.
pub fn image() -> String {
    let tag = format!("tandem-test:{}", std::process::id());
    let binary = crate::binary("tandem", "tandem");
    run(Command::new(repo().join("deploy/docker/build-local.sh")).arg("--binary").arg(&binary).args(["--tag", &tag]));
    tag
}

/// A compose project of its own, taken down with its volumes (and its image removed) however the test ends.
pub struct Project {
    name: String,
    image: String,
    program: Vec<String>,
    env: Vec<(String, String)>,
    /// More override files under tests/compose/, after test.yml.
    overrides: Vec<String>,
    /// Containers started beside the project's (`Project::run_beside`), removed with it.
    beside: std::sync::Mutex<Vec<String>>,
}

impl Project {
    /// Brings the cluster up on `engine` (`cpu` or `mock`) with `env` over the defaults and the override files
    /// `overrides` (in tests/compose/), and waits until the router follows all four workers.
    pub fn up(engine: &str, env: &[(&str, &str)], overrides: &[&str]) -> Project {
        let p = Project {
            name: format!("tandem-test-{}", std::process::id()),
            image: image(),
            program: compose_program(),
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            overrides: overrides.iter().map(|o| o.to_string()).collect(),
            beside: Default::default(),
        };
        run(p.command().env("TANDEM_ENGINE", engine).args(["up", "-d", "--no-build"]));
        p.wait_for_workers(4, Duration::from_secs(120));
        p
    }

    /// The compose command for this project.
    pub fn command(&self) -> Command {
        let models = crate::model().parent().expect("the model's directory").to_path_buf();
        let mut c = Command::new(&self.program[0]);
        c.args(&self.program[1..])
            .args(["-p", &self.name, "-f"])
            .arg(repo().join("deploy/compose/docker-compose.yml"))
            .arg("-f")
            .arg(repo().join("tests/compose/test.yml"));
        for o in &self.overrides {
            c.arg("-f").arg(repo().join("tests/compose").join(o));
        }
        c.env("TANDEM_IMAGE", &self.image)
            .env("TANDEM_TEST_MODELS", models)
            .env("TANDEM_PUBLISH", "127.0.0.1:0")
            .env("TANDEM_ADMIN_KEY", ADMIN_KEY)
            // Small tiers: four engines on a 2-core CI machine.
            .env("TANDEM_KV_BLOCKS", "512")
            .env("TANDEM_HOST_BLOCKS", "512")
            .env("TANDEM_DISK_BLOCKS", "0")
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        c
    }

    /// `service`'s container id (a one-shot's too, after it exited).
    pub fn container(&self, service: &str) -> String {
        let out = run(self.command().args(["ps", "-a", "-q", service]));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Where `service`'s container `port` is published on this machine (again after a restart: it may move).
    pub fn port(&self, service: &str, port: u16) -> SocketAddr {
        let out = run(self.command().args(["port", service, &port.to_string()]));
        let text = String::from_utf8_lossy(&out.stdout);
        text.trim().parse().unwrap_or_else(|e| panic!("{service}:{port} published at {text:?}: {e}"))
    }

    pub fn router(&self) -> SocketAddr {
        self.port("router", 8000)
    }

    /// The last lines of every container's log, for a failure message.
    pub fn logs(&self) -> String {
        self.command().args(["logs", "--no-color", "--tail", "30"]).output().map_or_else(
            |e| e.to_string(),
            |o| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)),
        )
    }

    /// Workers the router has up (`GET /admin/workers`); 0 while it does not answer.
    pub fn workers_up(&self) -> usize {
        let out = self.command().args(["port", "router", "8000"]).output();
        let Some(router) = out.ok().and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok()) else {
            return 0;
        };
        up(router)
    }

    /// Waits until the router has `n` workers up.
    pub fn wait_for_workers(&self, n: usize, limit: Duration) -> Duration {
        let start = Instant::now();
        loop {
            let up = self.workers_up();
            if up == n {
                return start.elapsed();
            }
            assert!(start.elapsed() < limit, "{up} of {n} workers up after {limit:?}:\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// A worker metric summed over `services`' published metrics ports (decode workers only, see test.yml).
    pub fn counter(&self, services: &[&str], name: &str, label: &str) -> f64 {
        services
            .iter()
            .map(|s| {
                let page = request(self.port(s, 9200), "GET", "/metrics", "", None);
                counter(&page.map(|r| r.body).unwrap_or_default(), name, label)
            })
            .sum()
    }

    /// `docker <verb> <args...> <service's container>`.
    pub fn docker(&self, args: &[&str], service: &str) {
        let id = self.container(service);
        run(Command::new("docker").args(args).arg(&id));
    }
}

impl Drop for Project {
    fn drop(&mut self) {
        for id in self.beside.lock().map(|b| b.clone()).unwrap_or_default() {
            let _ = Command::new("docker").args(["rm", "-f", &id]).output();
        }
        let _ = self.command().args(["down", "-v", "--remove-orphans", "--timeout", "5"]).output();
        let _ = Command::new("docker").args(["rmi", "-f", &self.image]).output();
    }
}

/// One HTTP/1.1 request on a fresh connection (with the admin key when given: the router's admin endpoints
/// answer others only on its own loopback); `None` when nothing answers within 10 s.
pub fn request(addr: SocketAddr, method: &str, path: &str, body: &str, key: Option<&str>) -> Option<crate::Reply> {
    use std::io::{Read, Write};
    let limit = Duration::from_secs(10);
    let mut sock = std::net::TcpStream::connect_timeout(&addr, limit).ok()?;
    sock.set_read_timeout(Some(limit)).ok()?;
    let auth = key.map(|k| format!("authorization: Bearer {k}\r\n")).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n{auth}\r\n{body}",
        body.len()
    );
    sock.write_all(req.as_bytes()).ok()?;
    let mut raw = Vec::new();
    sock.read_to_end(&mut raw).ok()?;
    crate::parse_reply(&String::from_utf8_lossy(&raw))
}

/// Sum of a metric's samples whose line contains `label`, from a `/metrics` page.
pub fn counter(page: &str, name: &str, label: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

impl Project {
    /// The Docker network `service`'s container is on (the project's one).
    pub fn network_of(&self, service: &str) -> String {
        let id = self.container(service);
        let out = run(Command::new("docker").args([
            "inspect",
            "-f",
            "{{range $name, $_ := .NetworkSettings.Networks}}{{$name}} {{end}}",
            &id,
        ]));
        let text = String::from_utf8_lossy(&out.stdout);
        text.split_whitespace().next().unwrap_or_else(|| panic!("{service} is on no network")).to_string()
    }

    /// Cuts `service`'s container off its network (`docker network disconnect`): its peers hear nothing more.
    pub fn disconnect(&self, service: &str, network: &str) {
        let id = self.container(service);
        run(Command::new("docker").args(["network", "disconnect", network, &id]));
    }

    /// Puts `service`'s container back on `network` under its role's name `alias` (the name the router resolves).
    pub fn reconnect(&self, service: &str, network: &str, alias: &str) {
        let id = self.container(service);
        run(Command::new("docker").args(["network", "connect", "--alias", alias, network, &id]));
    }
}

impl Project {
    /// `docker run -d <args> <the image> <command>` on the project's network, removed with the project; its id.
    pub fn run_beside(&self, args: &[&str], command: &[&str]) -> String {
        let network = self.network_of("router");
        let out = run(Command::new("docker")
            .args(["run", "-d", "--network", &network])
            .args(args)
            .arg(&self.image)
            .args(command));
        let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
        self.beside.lock().expect("not poisoned").push(id.clone());
        id
    }
}

/// Steady load from `tandem bench serve` against the router, in the background: bounded in requests and in each
/// request's time (a hung request shows as a failure, not a hung test).
pub struct Load {
    child: std::process::Child,
    out: PathBuf,
}

/// Longest a request of the fault tests' load may take before `bench serve` counts it failed.
pub const LOAD_TIMEOUT_SECS: u64 = 25;

impl Load {
    /// `requests` completions at `rate` per second, each a 512-token shared prefix (one of `prefixes`) and 512
    /// tokens of its own, answered with exactly `output_len` tokens.
    pub fn start(router: SocketAddr, requests: usize, rate: f64, prefixes: usize, output_len: usize) -> Load {
        let out = std::env::temp_dir().join(format!("tandem-compose-load-{}-{}", std::process::id(), router.port()));
        let _ = std::fs::remove_dir_all(&out);
        let child = Command::new(crate::binary("tandem", "tandem"))
            .args(["bench", "serve", "--quiet", "--ignore-eos", "--seed", "1", "--prefixes", &prefixes.to_string()])
            .args(["--prefix-len", "512", "--suffix-len", "512", "--url", &format!("http://{router}")])
            .args(["--rate", &rate.to_string(), "--max-requests", &requests.to_string()])
            .args(["--output-len", &output_len.to_string(), "--timeout", &LOAD_TIMEOUT_SECS.to_string(), "--out"])
            .arg(&out)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("tandem bench serve starts");
        Load { child, out }
    }

    /// Waits for every request to end; `bench serve`'s summary.
    pub fn finish(mut self) -> serde_json::Value {
        let status = self.child.wait().expect("bench serve runs");
        assert!(status.success(), "tandem bench serve failed: {status}");
        let text = std::fs::read_to_string(self.out.join("summary.json")).expect("summary.json");
        let _ = std::fs::remove_dir_all(&self.out);
        serde_json::from_str(&text).expect("a summary")
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A router metric's samples whose line contains `label` (`""`: all of them), summed (`GET /metrics`).
pub fn router_metric(router: SocketAddr, name: &str, label: &str) -> f64 {
    let page = request(router, "GET", "/metrics", "", None).map(|r| r.body).unwrap_or_default();
    counter(&page, name, label)
}

/// Every worker the router at `router` follows (`GET /admin/workers`, with the test's admin key), with whether
/// it is up; empty while the router does not answer.
pub fn followed(router: SocketAddr) -> Vec<(String, bool)> {
    let Some(reply) = request(router, "GET", "/admin/workers", "", Some(ADMIN_KEY)).filter(|r| r.status == 200) else {
        return Vec::new();
    };
    let list = reply.json()["workers"].as_array().cloned().unwrap_or_default();
    list.iter().map(|w| (w["address"].as_str().unwrap_or_default().to_string(), w["up"] == true)).collect()
}

/// How many workers the router at `router` has up.
pub fn up(router: SocketAddr) -> usize {
    followed(router).iter().filter(|(_, up)| *up).count()
}
