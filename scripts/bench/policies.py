#!/usr/bin/env python3
"""Routing policies compared on the committed Mooncake sample, on a mock cluster (docs/performance.md).

For every (load, seed, policy) it starts a fresh `tandem up --engine mock` (8 prefill + 8 decode workers by
default, so no run finds another's cache warm), replays the trace sample with `tandem bench serve` at the trace's
own arrival rate times LOAD (arrivals sped up by SPEEDUP x LOAD while the mock's step times are sped up by
SPEEDUP), and keeps the summary. Policies take turns within each (load, seed) so a drifting machine favours none.
At the end it prints one table per load: each metric's median over the valid runs' seeds with their range, and
how many runs were valid (client schedule lag and mock step overrun within 5%); invalid runs make no figure.

Usage:
  python3 scripts/bench/policies.py --tandem target/release/tandem [--requests 500] [--speedup 1] [--loads 1,2]
      [--seeds 1,2,3] [--policies kv,round_robin,least_loaded,power_of_two,prefix_hash,sglang_threshold]
      [--prefill 8] [--decode 8] [--out runs/policies]
  python3 scripts/bench/policies.py --table runs/policies     # the table again, from the saved summaries
"""
import argparse
import json
import pathlib
import statistics
import urllib.request

from mock_cluster import TRACE, add_cluster_args, bench_serve, mock_cluster

POLICIES = "kv,round_robin,least_loaded,power_of_two,prefix_hash,sglang_threshold"
SLO = "ttft_ms=2000,tpot_ms=25"


def run_one(args, policy, load, seed, out):
    flags = ["--prefill", str(args.prefill), "--decode", str(args.decode), "--speedup", str(args.speedup),
             "--policy", policy, "--seed", str(seed)]
    with mock_cluster(args.tandem, flags) as url:
        summary = bench_serve(args.tandem, url, [
            "--trace", str(TRACE), "--max-requests", str(args.requests), "--speedup", str(args.speedup * load),
            "--seed", str(seed), "--slo", SLO, "--ignore-eos", "--out", str(out)])
        # The router's own counts (decisions by reason, retries) explain what the client saw.
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            (out / "router-metrics.txt").write_bytes(r.read())
        return summary


METRICS = [
    ("TTFT p50 ms", lambda s: s["time_to_first_token_ms"]["p50"]),
    ("TTFT p90 ms", lambda s: s["time_to_first_token_ms"]["p90"]),
    ("TTFT p99 ms", lambda s: s["time_to_first_token_ms"]["p99"]),
    ("ITL p50 ms", lambda s: s["inter_token_latency_ms"]["p50"]),
    ("ITL p90 ms", lambda s: s["inter_token_latency_ms"]["p90"]),
    ("TPOT p50 ms", lambda s: s["time_per_output_token_ms"]["p50"]),
    ("SLO met %", lambda s: 100 * s["slo_attainment"]),
    ("goodput req/s", lambda s: s["goodput_requests_per_s"]),
    ("cached %", lambda s: 100 * s["cached_token_fraction"]),
    ("failed", lambda s: s["failed"]),
]


def table(out):
    runs = {}
    for f in sorted(pathlib.Path(out).glob("*/summary.json")):
        policy, load, seed = f.parent.name.rsplit("-", 2)
        runs.setdefault((float(load.lstrip("x")), policy), []).append(json.loads(f.read_text()))
    for load in sorted({l for l, _ in runs}):
        print(f"\nload x{load:g} (median over seeds [min, max]; SLO {SLO}):")
        print(f"{'policy':<17}" + "".join(f"{m:>22}" for m, _ in METRICS) + "   valid")
        for (l, policy), summaries in sorted(runs.items(), key=lambda kv: kv[0][1]):
            if l != load:
                continue
            # Only valid runs make the figures; an invalid one is reported by count.
            valid = [s for s in summaries if s["valid"]]
            cells = []
            for _, f in METRICS:
                v = [f(s) for s in valid] or [float("nan")]
                cells.append(f"{statistics.median(v):.1f} [{min(v):.1f}, {max(v):.1f}]")
            print(f"{policy:<17}" + "".join(f"{c:>22}" for c in cells) + f"   {len(valid)}/{len(summaries)}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--loads", default="1,2")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--policies", default=POLICIES)
    add_cluster_args(p, workers=8, out="runs/policies")
    args = p.parse_args()
    if args.table:
        table(args.table)
        return
    for load in [float(x) for x in args.loads.split(",")]:
        for seed in [int(x) for x in args.seeds.split(",")]:
            for policy in args.policies.split(","):
                out = pathlib.Path(args.out) / f"{policy}-x{load:g}-{seed}"
                s = run_one(args, policy, load, seed, out)
                print(f"{policy:<17} x{load:g} seed {seed}: TTFT p90 {s['time_to_first_token_ms']['p90']:8.1f} ms, "
                      f"cached {100 * s['cached_token_fraction']:5.1f}%, failed {s['failed']}, valid {s['valid']}",
                      flush=True)
    table(args.out)


if __name__ == "__main__":
    main()
