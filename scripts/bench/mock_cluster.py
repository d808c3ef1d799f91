"""A fresh `tandem up --engine mock` cluster for one benchmark run (shared by policies.py, overload.py and
sim_vs_cluster.py), or the same cluster as separate processes (`process_cluster`: each worker a `tandem worker`,
then `tandem router`), which is what lets a benchmark kill one worker.

Each cluster gets its own TANDEM_HOME (the model directory linked in, so nothing is fetched again), so no run
finds another's cache warm; leaving the `with` block stops it and removes that home.
"""
import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRACE = ROOT / "data/traces/mooncake_conversation_1k.jsonl"


def add_cluster_args(p, workers, out, mock_speedup=True):
    """The flags every mock-cluster benchmark takes: the binary, `workers` prefill and decode workers each, the
    mock's speed-up (unless `mock_speedup` is false: the caller gives `--speedup` a meaning of its own), the output
    directory, and `--table` to reprint an earlier run."""
    p.add_argument("--tandem", default=str(ROOT / "target/release/tandem"))
    p.add_argument("--prefill", type=int, default=workers)
    p.add_argument("--decode", type=int, default=workers)
    if mock_speedup:
        p.add_argument("--speedup", type=float, default=1.0,
                       help="the mock divides every modelled duration by this, and the trace's arrivals come this "
                            "much faster")
    p.add_argument("--out", default=out)
    p.add_argument("--table", metavar="DIR", help="print the table of an earlier run and stop")


def fresh_home():
    """A TANDEM_HOME of the run's own, the model directory linked in."""
    home = pathlib.Path(tempfile.mkdtemp(prefix="tandem-bench-"))
    models = pathlib.Path(os.environ.get("TANDEM_HOME", pathlib.Path.home() / ".cache/tandem")) / "models"
    if models.is_dir():
        (home / "models").symlink_to(models)
    return home


def stop(procs):
    """SIGINT to every process still running (continued first, if it was stopped), then a wait (SIGKILL past 30 s)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


@contextlib.contextmanager
def process_cluster(tandem, prefill, decode, worker_flags, router_flags, log):
    """Yields (the router's URL, each worker's process by name) of a mock cluster run as separate processes: a dev
    CA and certificates, `prefill` + `decode` `tandem worker --engine mock` processes named as `tandem up` names
    them (each given `worker_flags`), then `tandem router` in front of them (`router_flags`). The file `log` gets
    each worker's name and addresses in `tandem up`'s form, then every process's stderr."""
    home = fresh_home()
    env = {**os.environ, "TANDEM_HOME": str(home)}
    names = [f"prefill-{k}" for k in range(prefill)] + [f"decode-{k}" for k in range(decode)]
    certs = home / "certs"
    subprocess.run([tandem, "certs", "init", "--dir", str(certs), "--components", ",".join([*names, "router"])],
                   check=True, capture_output=True, env=env)
    err = open(log, "w")
    procs = {}
    try:
        addresses = {}
        for name in names:
            p = subprocess.Popen([tandem, "worker", "--role", name.split("-")[0], "--engine", "mock", "--name", name,
                                  "--grpc-addr", "127.0.0.1:0", "--transfer-addr", "127.0.0.1:0",
                                  "--metrics-addr", "127.0.0.1:0", "--certs-dir", str(certs), "--cert-name", name,
                                  "--threads", "1", *worker_flags],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
            procs[name] = p
            line = p.stdout.readline()
            grpc = next((w[len("grpc="):] for w in line.split() if w.startswith("grpc=")), None)
            if grpc is None:
                sys.exit(f"{name} did not start: {line!r}")
            addresses[name] = grpc
            err.write(f"  {name:<10} grpc {grpc}, transfer -\n")
        err.flush()
        router = subprocess.Popen([tandem, "router", "--listen", "127.0.0.1:0", "--certs-dir", str(certs),
                                   "--cert-name", "router", "--workers", ",".join(addresses.values()), *router_flags],
                                  stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        procs["router"] = router
        line = router.stdout.readline()
        url = next((w for w in line.split() if w.startswith("http://")), None)
        if url is None:
            sys.exit(f"tandem router did not start: {line!r}")
        time.sleep(2)  # the router's first snapshots
        yield url, procs
    finally:
        stop(list(procs.values()))
        shutil.rmtree(home, ignore_errors=True)
        err.close()


@contextlib.contextmanager
def mock_cluster(tandem, flags, engine="mock", log=None):
    """Yields the router's URL of `tandem up --engine ENGINE FLAGS` (mock by default) once it is up; its stderr
    (each worker's name and addresses) goes to the file `log` when given."""
    home = fresh_home()
    cmd = [tandem, "up", "--engine", engine, "--port", "0", *flags]
    err = open(log, "w") if log else subprocess.DEVNULL
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                          env={**os.environ, "TANDEM_HOME": str(home)})
    try:
        line = up.stdout.readline()
        url = next((w for w in line.split() if w.startswith("http://")), None)
        if url is None:
            sys.exit(f"tandem up did not start: {line!r}")
        time.sleep(2)  # the router's first snapshots
        yield url
    finally:
        stop([up])
        shutil.rmtree(home, ignore_errors=True)
        if log:
            err.close()


def set_router_config(url, patch):
    """`PUT /admin/router-config` with the JSON object `patch` (open to loopback clients)."""
    import json
    import urllib.request
    req = urllib.request.Request(f"{url}/admin/router-config", data=json.dumps(patch).encode(), method="PUT",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def bench_serve(tandem, url, flags):
    """`tandem bench serve --url URL FLAGS --quiet --json`: the summary."""
    import json
    done = subprocess.run([tandem, "bench", "serve", "--url", url, *flags, "--quiet", "--json"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench serve failed: {done.stderr}")
    return json.loads(done.stdout)
