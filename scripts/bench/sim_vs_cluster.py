#!/usr/bin/env python3
"""The simulator against a real mock cluster on the same trace sample (docs/simulation.md).

Runs the first N requests of a Mooncake trace (`--trace`, by default the committed sample) once through `tandem
sim` and once through a fresh `tandem up --engine mock` driven by `tandem bench serve`, with the same profile
(gpu-default), worker counts, tiers (device and host; no disk tier, to keep both fast), policy and seed, on the
trace's own arrivals (`--speedup S`: S times faster in both). Prints, for TTFT, TPOT and E2E, the simulated and measured p50 and p90 with their relative difference and
a two-sample Kolmogorov-Smirnov test, the cached token fraction of both, and the share of requests prefilled on the
same worker in both (the real router records its decisions with --record-trace; workers are matched one to one,
the pairing that agrees most, since which of two idle workers gets the first request is a coin toss in both). The
real run's validity (schedule lag, mock step overrun) is printed too: an invalid real run is no reference. With
`--repeat K` (K real runs) it also prints how often each pair of real runs prefilled a request on the same worker:
the real cluster's agreement with itself, against which the simulator's is read.

With `--engine cpu` the real side is `tandem up` on the embedded model on this machine's CPU (`--prefill 2
--decode 2`, one compute thread per worker), the simulator uses `--sim-profile` (default `cpu-smollm2-1t`, fitted on
one thread) with `--host-cores` (the cores the workers share, default this machine's; 0: none shared), and the workload is the synthetic shared-prefix one at `--rate` (the same prompts for
both): this measures the timing model itself, which the mock shares with the simulator.

With `--fail decode-0@40` the real cluster runs as separate processes (`tandem worker` each, then `tandem router`)
and the named worker is killed 40 s after the router recorded its first request; the simulator fails the same
worker at the same time on the workload's clock: this checks the simulated failover against the router's own.
`--hang decode-0@40` stops the worker instead (SIGSTOP: its connections stay open, so the router finds out through
its watchdog and HTTP/2 keepalive; `--hang decode-0@40..70` continues it at 70 s, SIGCONT), and the simulator
gets the same `--hang`. `--errors decode-0@40..70` breaks the
mock worker's stand-in device (SIGUSR1; SIGUSR2 mends it at 70 s): it answers every call with an error while its
streams go on, so only the router's circuit breaker keeps requests away; the simulator gets the same `--errors`.
`--stall decode-0@30..70` runs every worker with `--mock-fault stall`, so that SIGUSR1 makes the worker's steps hang
(its process answering and reporting) until SIGUSR2; the router finds it stalled after `--stall-after-ms`, and the
simulator gets the same `--stall`. With `--stall-after-ms 0` only the routers' call timeouts (`--prefill-timeout-ms`,
`--decode-idle-timeout-ms`, given to both) give up on the stalled worker.

Usage:
  python3 scripts/bench/sim_vs_cluster.py --tandem target/release/tandem [--engine mock|cpu] [--requests 200] [--policy kv]
      [--trace FILE] [--speedup 1] [--prefill 8] [--decode 8] [--seed 1] [--router-tokens-per-s 1e6|measured] [--ties random|hashed]
      [--sim-profile cpu-smollm2-1t] [--host-cores N] [--repeat K] [--max-batched-tokens N] [--max-in-flight N]
      [--fail NAME@SECONDS,...] [--hang NAME@SECONDS[..SECONDS],...] [--errors NAME@SECONDS[..SECONDS],...]
      [--stall NAME@SECONDS[..SECONDS],...] [--stall-after-ms MS] [--prefill-timeout-ms MS] [--decode-idle-timeout-ms MS]
      [--parted 3]
      [--out runs/sim-vs-cluster]
"""
import argparse
import os
import json
import math
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

from mock_cluster import TRACE, add_cluster_args, bench_serve, mock_cluster, process_cluster, set_router_config

SLO = "ttft_ms=2000,tpot_ms=25"


def signal_later(proc, seconds, recording, sig):
    """A thread that sends `proc` the signal `sig` (SIGKILL: a crash, no goodbye; SIGSTOP: a hang, its connections
    left open) `seconds` after the router recorded its first request (the workload's time 0, as the simulator counts
    it)."""
    def run():
        while True:
            try:
                if len(pathlib.Path(recording).read_text().splitlines()) > 1:
                    break
            except FileNotFoundError:
                pass
            time.sleep(0.002)
        time.sleep(seconds)
        proc.send_signal(sig)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def quantile(values, q):
    """The sample quantile by linear interpolation between closest ranks."""
    v = sorted(values)
    if not v:
        return float("nan")
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def ks_test(a, b):
    """Two-sample Kolmogorov-Smirnov statistic D and its asymptotic p-value."""
    a, b = sorted(a), sorted(b)
    n, m = len(a), len(b)
    if n == 0 or m == 0:
        return float("nan"), float("nan")
    i = j = 0
    d = 0.0
    while i < n and j < m:
        x = min(a[i], b[j])
        while i < n and a[i] <= x:
            i += 1
        while j < m and b[j] <= x:
            j += 1
        d = max(d, abs(i / n - j / m))
    en = math.sqrt(n * m / (n + m))
    lam = (en + 0.12 + 0.11 / en) * d
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return d, min(max(p, 0.0), 1.0)


def tokenizer_rate(url):
    """The router's tokens per second of tokenizing, from its metrics (`None` when it made no tokens)."""
    import urllib.request
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    value = {}
    for name in ("tandem_router_tokenized_tokens_total", "tandem_router_tokenize_seconds_total"):
        m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        value[name] = float(m.group(1)) if m else 0.0
    seconds = value["tandem_router_tokenize_seconds_total"]
    return value["tandem_router_tokenized_tokens_total"] / seconds if seconds > 0 else None


FAILOVER = {"decode_resumed": "tandem_router_decode_resumptions_total",
            "prefill_retried": "tandem_router_prefill_retries_total",
            "local_prefill_after_failure": "tandem_router_local_prefill_fallbacks_total",
            "worker_ejected": "tandem_router_worker_ejections_total",
            "stall_detected": "tandem_router_worker_stalls_total"}


def failovers(url):
    """The router's failover counters from its metrics, under the simulator's decision names."""
    import urllib.request
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = {}
    for key, name in FAILOVER.items():
        m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        found[key] = int(float(m.group(1))) if m else 0
    return found


def records(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]


def metrics(recs):
    ok = [r for r in recs if r["status"] == 200 and not r.get("error")]
    return {
        "TTFT ms": [r["time_to_first_token_ms"] for r in ok if r.get("time_to_first_token_ms") is not None],
        "TPOT ms": [r["time_per_output_token_ms"] for r in ok if r.get("time_per_output_token_ms") is not None],
        "E2E ms": [r["request_latency_ms"] for r in ok],
    }


def prefilled_on(decision):
    """The worker that computed the prompt: the prefill worker when disaggregated, else the decode worker."""
    return decision.get("prefill") or decision.get("decode")


def worker_names(log):
    """The workers' names by address, from the lines `tandem up` prints at start (`  prefill-0  grpc 127.0.0.1:…,
    …`; `process_cluster` writes the same), and by name too: a router names a worker by its address, unless the
    worker was started with a name (`tandem worker --name`)."""
    found = re.findall(r"^\s*(\S+-\d+)\s+grpc (\S+?),", pathlib.Path(log).read_text(), re.MULTILINE)
    return {**{addr: name for name, addr in found}, **{name: name for name, _ in found}}


def request_lines(recording):
    """A recording's request lines: past its header, without the lines giving requests' actual outputs."""
    lines = [json.loads(line) for line in pathlib.Path(recording).read_text().splitlines()[1:] if line.strip()]
    return [l for l in lines if "tandem_output" not in l]


def retimed(recording, trace, n, path):
    """The first `n` requests of `trace` at the times and in the order the real router routed them (its recording,
    matched by prompt length): the simulator's input when only the routing is compared."""
    requests = [json.loads(line) for line in pathlib.Path(trace).read_text().splitlines()[:n]]
    lines = request_lines(recording)
    unmatched = list(range(len(requests)))
    with open(path, "w") as f:
        for l in lines:
            k = next((k for k, i in enumerate(unmatched) if requests[i]["input_length"] == l["input_length"]), None)
            if k is not None:
                f.write(json.dumps({**requests[unmatched.pop(k)], "timestamp": l["timestamp"]}) + "\n")


def matched_decisions(recording, placements, sim_records):
    """The real router's routed requests, and each matched to the simulator's placement of the same request: in the
    router's arrival order, where requests sent in the same instant may have swapped places, each recorded request
    goes with the earliest unmatched simulated request of the same prompt length."""
    real = [l for l in request_lines(recording) if "refused" not in l["tandem"]["decision"]]
    sim_by_index = {r["index"]: r for r in sim_records}
    placed = [json.loads(line) for line in pathlib.Path(placements).read_text().splitlines()]
    unmatched = [i for i, p in enumerate(placed) if p is not None and i in sim_by_index]
    matched = []
    for l in real:
        k = next((k for k, i in enumerate(unmatched) if sim_by_index[i]["prompt_tokens"] == l["input_length"]), None)
        if k is not None:
            matched.append((l, placed[unmatched.pop(k)]))
    return real, matched


TERMS = ["device_blocks", "host_blocks", "active_prefill_tokens", "active_blocks", "active_overlap_blocks",
         "active_requests", "cost"]


def parted(matched, names, limit):
    """The first `limit` of the `matched_decisions` the two routers prefilled on different workers, with what each
    router saw of every candidate (both record their candidates as scored): where their inputs part."""
    shown = 0
    for n, (l, p) in enumerate(matched):
        if shown == limit:
            break
        d = l["tandem"]["decision"]
        real_worker, sim_worker = names.get(prefilled_on(d), prefilled_on(d)), prefilled_on(p)
        if real_worker == sim_worker:
            continue
        shown += 1
        pool = "prefill" if d.get("disaggregate") or p.get("prefill") else "decode"
        print(f"  request {n} (arrived {l['timestamp']:.0f} ms, {l['input_length']} tokens): real {real_worker} "
              f"({d.get('reason')}), simulated {sim_worker}; {pool} candidates, real / simulated:")
        print("    " + " ".join(f"{t:>24}" for t in ["worker"] + TERMS))
        sim_by_name = {c["worker"]: c for c in (p.get("candidates") or {}).get(pool, [])}
        for c in (d.get("candidates") or {}).get(pool, []):
            name = names.get(c["worker"], c["worker"])
            other = sim_by_name.get(name, {})
            print("    " + f"{name:>24} " + " ".join(f"{str(c.get(t)) + ' / ' + str(other.get(t)):>24}" for t in TERMS))


def agreement(real, matched, names=None):
    """Share of requests prefilled on the same worker in the real cluster and the simulator, given
    `matched_decisions`' answer: workers matched by name when `names` (address → name) is known, else under the
    one-to-one pairing of real and simulated workers that agrees most (greedy on the largest counts)."""
    pairs = [(prefilled_on(l["tandem"]["decision"]), prefilled_on(p)) for l, p in matched]
    # Whether the real router's choice was clear (margin over the runner-up) rather than a tie.
    decided = [(l["tandem"]["decision"].get("margin") or 0) > 1e-9 for l, _ in matched]
    counts = {}
    for pair in pairs:
        counts[pair] = counts.get(pair, 0) + 1
    pairing = dict(names) if names is not None else {}
    if names is None:
        for (r, s), n in sorted(counts.items(), key=lambda kv: -kv[1]):
            if r not in pairing and s not in pairing.values():
                pairing[r] = s
    agreed = sum(n for (r, s), n in counts.items() if pairing.get(r) == s)
    clear = [pair for pair, d in zip(pairs, decided) if d]
    clear_agreed = sum(1 for r, s in clear if pairing.get(r) == s)
    return agreed, len(pairs), len(real), clear_agreed, len(clear)


def run_to_run(recording_a, names_a, recording_b, names_b):
    """Share of requests prefilled on the same worker (by name) in two real runs of the same command: the real
    cluster's own spread, the yardstick for a simulator's agreement from the trace alone (if every run strayed from
    one routing independently, a simulator following that routing would agree with a run about as often as the
    square root of this share; a stray decision changes the caches and so later decisions too). Requests are matched as `agreement` matches them: in the router's arrival order, by prompt length."""
    def placed(recording, names):
        lines = request_lines(recording)
        return [(l["input_length"], names.get(prefilled_on(l["tandem"]["decision"]), "?")) for l in lines
                if "refused" not in l["tandem"]["decision"]]
    a, b = placed(recording_a, names_a), placed(recording_b, names_b)
    agreed = matched = 0
    for length, worker in a:
        k = next((k for k, (other, _) in enumerate(b) if other == length), None)
        if k is not None:
            matched += 1
            agreed += b.pop(k)[1] == worker
    return agreed, matched


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--policy", default="kv")
    p.add_argument("--stream-kv", default="false", choices=["true", "false"],
                   help="the routers stream long prompts' KV while they compute (the real one and the simulated one)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--engine", choices=["mock", "cpu"], default="mock")
    p.add_argument("--rate", default="0.5", help="requests/s of the synthetic workload (--engine cpu)")
    p.add_argument("--router-tokens-per-s", default="0",
                   help="the simulated router's tokenizer speed per slot (0: routing is instant; `measured`: the real "
                        "routers' own, tokens over time spent from their metrics, mean over the real runs; "
                        "docs/simulation.md)")
    p.add_argument("--sim-profile", default="cpu-smollm2-1t",
                   help="the simulator's profile with --engine cpu (cpu-smollm2-1t: fitted on one thread, as each "
                        "worker of tandem up runs on a machine with no more cores than workers)")
    p.add_argument("--host-cores", default=str(os.cpu_count() or 1),
                   help="the cores the simulated CPU workers share (default: this machine's; 0: a machine each)")
    p.add_argument("--repeat", type=int, default=1,
                   help="real runs of the same command: latencies compared with the runs pooled, each run's range "
                        "printed (one real run differs from the next by 10-20%% at TTFT p90 on a 2-core machine)")
    p.add_argument("--ties", choices=["random", "hashed"], default="hashed",
                   help="how both routers break ties (the scheduler's `ties`; docs/simulation.md)")
    p.add_argument("--max-in-flight", type=int,
                   help="requests the router holds at once, in both clusters (default: the router's); past it "
                        "arrivals wait in its queue")
    p.add_argument("--fail", metavar="NAME@SECONDS",
                   help="workers that fail, comma-separated (e.g. decode-0@40): the real cluster runs as separate "
                        "processes and the named one is killed (SIGKILL) that long after the router saw the first "
                        "request; the simulator gets the same --fail (mock engine only)")
    p.add_argument("--hang", metavar="NAME@SECONDS[..SECONDS]",
                   help="workers that hang, comma-separated, as --fail but stopped (SIGSTOP) instead of killed, and "
                        "continued (SIGCONT) at the second time if given; the simulator gets the same --hang (mock "
                        "engine only)")
    p.add_argument("--errors", metavar="NAME@SECONDS[..SECONDS]",
                   help="workers whose mock device breaks, comma-separated: SIGUSR1 at the first time, SIGUSR2 "
                        "(mended) at the second if given; the simulator gets the same --errors (mock engine only)")
    p.add_argument("--stall", metavar="NAME@SECONDS[..SECONDS]",
                   help="workers whose mock device hangs, as --errors but every worker runs with --mock-fault stall "
                        "(so not with --errors); the simulator gets the same --stall (mock engine only)")
    p.add_argument("--stall-after-ms", type=int,
                   help="the stall limit, in both routers (default: the router's, 30 s; 0: off)")
    p.add_argument("--prefill-timeout-ms", type=int,
                   help="the router's limit on a prefill call and a decode stream's first token, in both routers "
                        "(default: the router's, 180 s)")
    p.add_argument("--decode-idle-timeout-ms", type=int,
                   help="the router's limit on a decode stream's silence, in both routers (default: the router's, 60 s)")
    p.add_argument("--max-batched-tokens", type=int,
                   help="tokens one step of each worker computes, in both clusters (default: the engine's)")
    p.add_argument("--parted", type=int, default=3,
                   help="print this many of the first requests the two routers prefilled on different workers, with "
                        "every candidate's terms as each router saw them")
    p.add_argument("--trace", default=str(TRACE),
                   help="the trace both clusters replay (Mooncake JSONL, as `tandem sim --trace` reads it; default "
                        "the committed sample): its first --requests requests, the first arrival at time 0")
    p.add_argument("--speedup", type=float, default=1.0,
                   help="the trace's arrivals come this much faster in both clusters (more load; the mock's steps "
                        "keep their modelled durations)")
    add_cluster_args(p, workers=8, out="runs/sim-vs-cluster", mock_speedup=False)
    args = p.parse_args()
    out = pathlib.Path(args.out)
    cpu = args.engine == "cpu"
    blocks = 1024 if cpu else 16384
    tiers = ["--kv-blocks", str(blocks), "--host-blocks", str(2 * blocks), "--disk-blocks", "0"]
    # The CPU cluster gets a small synthetic workload (4 system prompts of 512 tokens, 512 of its own, 16 out);
    # the mock cluster the trace sample.
    workload = (["--rate", args.rate, "--prefixes", "4", "--prefix-len", "512", "--suffix-len", "512",
                 "--output-len", "16"] if cpu else ["--trace", args.trace, "--speedup", str(args.speedup)]) + [
                    "--max-requests", str(args.requests)]
    budget = ["--max-batched-tokens", str(args.max_batched_tokens)] if args.max_batched_tokens else []
    admission = ["--max-in-flight", str(args.max_in_flight)] if args.max_in_flight else []
    flags = ["--prefill", str(args.prefill), "--decode", str(args.decode), "--policy", args.policy,
             "--seed", str(args.seed), "--stream-kv", args.stream_kv, *tiers, *budget, *admission]
    failures = [(*f.split("@"), signal.SIGKILL) for f in args.fail.split(",")] if args.fail else []
    if any(len(f) != 3 or ".." in f[1] for f in failures):
        sys.exit("--fail takes NAME@SECONDS here: a failed worker is not started again")
    for f in args.hang.split(",") if args.hang else []:
        # A hung worker goes on (SIGCONT) at the second time, if given.
        name, _, times = f.partition("@")
        at, _, back = times.partition("..")
        failures.append((name, at, signal.SIGSTOP))
        if back:
            failures.append((name, back, signal.SIGCONT))
    if args.errors and args.stall:
        sys.exit("--errors and --stall both use SIGUSR1: one of them at a time")
    signalled = args.errors or args.stall
    for f in signalled.split(",") if signalled else []:
        name, _, times = f.partition("@")
        at, _, mended = times.partition("..")
        failures.append((name, at, signal.SIGUSR1))
        if mended:
            failures.append((name, mended, signal.SIGUSR2))
    if failures and cpu:
        sys.exit("--fail, --hang, --errors and --stall run the mock cluster only")
    if cpu and (args.trace != str(TRACE) or args.speedup != 1.0):
        sys.exit("--trace and --speedup replay a trace on the mock cluster; --engine cpu runs the synthetic workload "
                 "at --rate")
    # The router's limits on its calls, the same in both routers.
    call_limits = [flag for name, value in (("--stall-after-ms", args.stall_after_ms),
                                            ("--prefill-timeout-ms", args.prefill_timeout_ms),
                                            ("--decode-idle-timeout-ms", args.decode_idle_timeout_ms))
                   if value is not None for flag in (name, str(value))]
    runs = []  # (directory, bench serve's summary) per real run
    rates = []  # per real run, its router's tokenizer speed (tokens/s), when it reported one
    real_failovers = []  # per real run with failures, its router's failover counters
    for k in range(args.repeat):
        d = out / ("cluster" if k == 0 else f"cluster-{k}")
        d.mkdir(parents=True, exist_ok=True)
        (d / "recording.jsonl").unlink(missing_ok=True)
        recording = ["--record-trace", str(d / "recording.jsonl"), "--record-candidates", "true"]
        if failures:
            # The mock's context (`engine::backend::mock::DEFAULT_MOCK_CONTEXT`), which `tandem up` gives its router
            # too: a router left at the embedded model's context would cut the trace's long prompts.
            context = ["--max-model-len", "131072"]
            worker_flags = [*tiers, *budget, *context, *(["--mock-fault", "stall"] if args.stall else [])]
            router_flags = [*recording, "--stream-kv", args.stream_kv, *admission, *context, *call_limits]
            cluster = process_cluster(args.tandem, args.prefill, args.decode, worker_flags, router_flags, d / "up.log")
        else:
            cluster = mock_cluster(args.tandem, [*flags, *recording[:3]], engine=args.engine, log=d / "up.log")
        with cluster as up:
            url, procs = up if failures else (up, {})
            # The simulator's workers start warm: no slow start for the real ones either.
            set_router_config(url, {"ties": args.ties, "slow_start_secs": 0, "policy": args.policy})
            signallers = [signal_later(procs[name], float(at), d / "recording.jsonl", sig)
                          for name, at, sig in failures]
            runs.append((d, bench_serve(args.tandem, url, [
                *workload, "--seed", str(args.seed), "--slo", SLO, "--ignore-eos", "--out", str(d)])))
            for signaller in signallers:
                signaller.join()
            rates.append(tokenizer_rate(url))
            if failures:
                real_failovers.append(failovers(url))
    print("the real routers' tokenizer, tokens/s as requests met it: "
          + ", ".join(f"{r:.3g}" if r else "unknown" for r in rates))
    measured = [r for r in rates if r]
    if args.router_tokens_per_s == "measured":
        if not measured:
            sys.exit("no real run reported its tokenizer's speed")
        args.router_tokens_per_s = f"{sum(measured) / len(measured):.6g}"
    profile = ["--profile", args.sim_profile, "--max-model-len", "8192", "--host-cores", args.host_cores] if cpu else []
    config = out / "sim" / "router.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    # As the real routers are set (slow start off: a worker that joins again mid-run ramps in neither).
    config.write_text(f'[scheduler]\nties = "{args.ties}"\nslow_start_secs = 0\n')
    fail = [arg for flag in ("fail", "hang", "errors", "stall") if getattr(args, flag)
            for arg in (f"--{flag}", getattr(args, flag))]
    sim = subprocess.run([args.tandem, "sim", *workload, *profile, *budget, *admission, *fail, *call_limits,
                          "--prefill", str(args.prefill), "--decode", str(args.decode), "--policies", args.policy,
                          "--seed", str(args.seed), "--kv-blocks", str(blocks), "--host-blocks", str(2 * blocks),
                          "--slo", SLO, "--config", str(config), "--stream-kv", args.stream_kv,
                          "--router-tokens-per-s", args.router_tokens_per_s,
                          "--out", str(out / "sim"), "--record-candidates", "--json"], capture_output=True, text=True)
    if sim.returncode != 0:
        sys.exit(f"tandem sim failed: {sim.stderr}")
    simulated = json.loads(sim.stdout)["policies"][args.policy]
    a = metrics(records(out / "sim" / args.policy / "records.jsonl"))
    # An invalid real run (the client or a mock worker fell behind) is no reference: only valid runs are pooled,
    # unless none is.
    valid = [(d, r) for d, r in runs if r["valid"]]
    per_run = [metrics(records(d / "records.jsonl")) for d, _ in (valid or runs)]
    b = {name: [v for m in per_run for v in m[name]] for name in a}
    print(f"{args.engine}: {args.requests} requests, {args.prefill}+{args.decode} workers, policy {args.policy}, "
          f"ties {args.ties}, seed {args.seed}, simulated tokenizer {args.router_tokens_per_s} tokens/s a slot; "
          "real runs valid: "
          + ", ".join(f"{r['valid']} {r.get('invalid_reasons') or ''}".strip() for _, r in runs))
    pooled = (f" (the {len(per_run)} {'valid ' if valid else ''}real runs pooled)" if len(per_run) > 1
              else "" if valid else " (no real run was valid)")
    print(f"{'metric':<9}{'sim p50':>10}{'real p50':>10}{'diff':>8}{'sim p90':>10}{'real p90':>10}{'diff':>8}"
          f"{'KS D':>7}{'KS p':>8}{pooled}")
    for name in a:
        s50, r50 = quantile(a[name], 0.5), quantile(b[name], 0.5)
        s90, r90 = quantile(a[name], 0.9), quantile(b[name], 0.9)
        d, pv = ks_test(a[name], b[name])
        print(f"{name:<9}{s50:>10.1f}{r50:>10.1f}{100 * (s50 / r50 - 1):>7.1f}%{s90:>10.1f}{r90:>10.1f}"
              f"{100 * (s90 / r90 - 1):>7.1f}%{d:>7.3f}{pv:>8.3f}")
    if len(per_run) > 1:
        for name in a:
            p50s = [quantile(m[name], 0.5) for m in per_run]
            p90s = [quantile(m[name], 0.9) for m in per_run]
            print(f"  {name} of each real run: p50 {min(p50s):.1f}-{max(p50s):.1f}, p90 {min(p90s):.1f}-{max(p90s):.1f}")
    if failures:
        print("failover: sim " + ", ".join(f"{k} {simulated['decisions'].get(k, 0)}" for k in FAILOVER) + "; real "
              + "; ".join(", ".join(f"{k} {v}" for k, v in f.items()) for f in real_failovers))
    print(f"cached token fraction: sim {100 * simulated['cached_token_fraction']:.1f}%, real "
          + ", ".join(f"{100 * r['cached_token_fraction']:.1f}%" for _, r in runs))
    sim_placements, sim_records = out / "sim" / args.policy / "placements.jsonl", records(
        out / "sim" / args.policy / "records.jsonl")
    for d, _ in runs:
        recording = d / "recording.jsonl"
        names = worker_names(d / "up.log")
        real, decisions = matched_decisions(recording, sim_placements, sim_records)
        agreed, matched, recorded, clear_agreed, clear = agreement(real, decisions, names)
        print(f"{d.name}: same prefill worker: {agreed} of {matched} requests ({100 * agreed / max(matched, 1):.1f}%; "
              f"{recorded} recorded, {matched} matched to a simulated request by prompt length; workers matched by "
              f"name); where the real router's choice was not a tie: {clear_agreed} of {clear} "
              f"({100 * clear_agreed / max(clear, 1):.1f}%)")
        parted(decisions, names, args.parted)
        if cpu:
            continue
        # The routing alone: the simulator given the real router's own arrival order and routing times.
        again = out / f"sim-retimed-{d.name}"
        again.mkdir(parents=True, exist_ok=True)
        retimed(recording, args.trace, args.requests, again / "trace.jsonl")
        done = subprocess.run([args.tandem, "sim", "--trace", str(again / "trace.jsonl"),
                               "--prefill", str(args.prefill), "--decode", str(args.decode), "--policies", args.policy,
                               "--seed", str(args.seed), *tiers[:4], *budget, *fail, "--config", str(config),
                               "--stream-kv", args.stream_kv, "--out", str(again), "--json"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"tandem sim failed: {done.stderr}")
        real, decisions = matched_decisions(
            recording, again / args.policy / "placements.jsonl", records(again / args.policy / "records.jsonl"))
        agreed, matched, _, clear_agreed, clear = agreement(real, decisions, names)
        print(f"{d.name}: same prefill worker given the real router's arrival order and times (its recording): "
              f"{agreed} of {matched} ({100 * agreed / max(matched, 1):.1f}%); not a tie: {clear_agreed} of {clear}")

    # How far the real cluster agrees with itself.
    for i in range(len(runs)):
        for j in range(i + 1, len(runs)):
            (da, _), (db, _) = runs[i], runs[j]
            agreed, matched = run_to_run(da / "recording.jsonl", worker_names(da / "up.log"),
                                         db / "recording.jsonl", worker_names(db / "up.log"))
            print(f"{da.name} vs {db.name}: same prefill worker in both real runs: {agreed} of {matched} "
                  f"({100 * agreed / max(matched, 1):.1f}%)")


if __name__ == "__main__":
    main()
