#!/usr/bin/env python3
"""Herding: several router replicas, each with its own view, in `tandem sim` (docs/simulation.md).

For each number of routers and each seed, replays the first N requests of the committed Mooncake sample through
`tandem sim --routers R` with the given policies, and prints per policy and router count the median over seeds
of TTFT p90 and of the prefill and decode pools' load spread (coefficient of variation of requests held per
worker, mean over arrivals), with [min, max].

Usage:
  python3 scripts/bench/herding.py --tandem target/release/tandem [--requests 300] [--routers 1,2,4,8]
      [--seeds 1,2,3] [--policies kv,least_loaded,power_of_two,random] [--config router.toml]
"""
import argparse
import json
import statistics
import subprocess
import sys

from mock_cluster import ROOT, TRACE


def cell(values, digits):
    m = statistics.median(values)
    return f"{m:.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tandem", default=str(ROOT / "target/release/tandem"))
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--routers", default="1,2,4,8")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--policies", default="kv,least_loaded,power_of_two,random")
    p.add_argument("--config", help="a router TOML whose [scheduler] table applies to every run")
    args = p.parse_args()
    rows = {}
    for routers in args.routers.split(","):
        for seed in args.seeds.split(","):
            cmd = [args.tandem, "sim", "--trace", str(TRACE), "--max-requests", str(args.requests), "--routers",
                   routers, "--seed", seed, "--policies", args.policies, "--json"]
            if args.config:
                cmd += ["--config", args.config]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"tandem sim failed: {done.stderr}")
            for policy, s in json.loads(done.stdout)["policies"].items():
                rows.setdefault((policy, int(routers)), []).append(s)
    print(f"{'policy':<15}{'routers':>8}{'TTFT p90 ms':>28}{'prefill CV':>22}{'decode CV':>22}")
    for (policy, routers), runs in sorted(rows.items()):
        print(f"{policy:<15}{routers:>8}"
              f"{cell([r['time_to_first_token_ms']['p90'] for r in runs], 1):>28}"
              f"{cell([r['balance']['prefill_cv_mean'] for r in runs], 2):>22}"
              f"{cell([r['balance']['decode_cv_mean'] for r in runs], 2):>22}")


if __name__ == "__main__":
    main()
