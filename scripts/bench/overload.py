#!/usr/bin/env python3
"""Goodput against offered load, with and without shedding, on a mock cluster (docs/performance.md).

For every router setting (a name and a JSON patch of the scheduler's settings, sent with
`PUT /admin/router-config` before the load starts) and every open-loop rate, it starts a fresh
`tandem up --engine mock` (so no point inherits another's cache or backlog) and runs `tandem bench serve` on the
committed Mooncake sample with Poisson arrivals at that rate for DURATION seconds, then waits for every request
to end. Goodput counts the requests that met the SLO, per second of the whole run (draining included). It prints
one row per point and, per setting, the peak goodput and the goodput at the highest rate as a share of it.

The default settings: `default` (no patch: the router refuses only at `max_queue` and when every decode worker is
near KV exhaustion) and `shed` (`shed_wait_ms` 1000 against queued prefill work, `busy_kv_fraction` 0.3 against
decode batches whose step time would pass the TPOT target: at 30% of the device tier `gpu-default`'s decode step
is 20 ms, leaving room for the batch's growth as it decodes).

Usage:
  python3 scripts/bench/overload.py --tandem target/release/tandem [--rates 1,2,3,4,6,8]
      [--setting 'NAME={"shed_wait_ms": 1000}' ...] [--duration 60] [--prefill 2] [--decode 2] [--speedup 1]
      [--seed 1] [--out runs/overload]
  python3 scripts/bench/overload.py --table runs/overload     # the table again, from the saved summaries
"""
import argparse
import json
import pathlib

from mock_cluster import TRACE, add_cluster_args, bench_serve, mock_cluster, set_router_config

SLO = "ttft_ms=2000,tpot_ms=25"
SETTINGS = ["default={}", 'shed={"shed_wait_ms": 1000, "busy_kv_fraction": 0.3}']


def run_point(args, patch, rate, out):
    flags = ["--prefill", str(args.prefill), "--decode", str(args.decode), "--speedup", str(args.speedup),
             "--seed", str(args.seed)]
    with mock_cluster(args.tandem, flags) as url:
        if patch:
            set_router_config(url, patch)
        return bench_serve(args.tandem, url, [
            "--trace", str(TRACE), "--rate", str(rate), "--duration", str(args.duration), "--seed", str(args.seed),
            "--slo", SLO, "--ignore-eos", "--out", str(out)])


def table(out):
    points = {}
    for f in pathlib.Path(out).glob("*/summary.json"):
        name, rate = f.parent.name.rsplit("-r", 1)
        points.setdefault(name, []).append((float(rate), json.loads(f.read_text())))
    print(f"SLO {SLO}; goodput = requests meeting it per second of the run")
    print(f"{'setting':>10} {'rate/s':>7} {'goodput/s':>10} {'SLO met':>8} {'TTFT p90 ms':>12} {'sent':>6} "
          f"{'429':>5} {'other failed':>13} {'valid':>6}")
    for name, runs in sorted(points.items()):
        runs.sort(key=lambda p: p[0])
        for rate, s in runs:
            refused = s.get("errors_by_status", {}).get("429", 0)
            print(f"{name:>10} {rate:>7g} {s['goodput_requests_per_s']:>10.2f} {100 * s['slo_attainment']:>7.1f}% "
                  f"{s['time_to_first_token_ms']['p90']:>12.1f} {s['requests']:>6} {refused:>5} "
                  f"{s['failed'] - refused:>13} {str(s['valid']):>6}")
        peak = max(s["goodput_requests_per_s"] for _, s in runs)
        top_rate, top = runs[-1]
        share = top["goodput_requests_per_s"] / peak if peak > 0 else 0.0
        print(f"{name:>10}: peak goodput {peak:.2f}/s; at {top_rate:g}/s {top['goodput_requests_per_s']:.2f}/s "
              f"= {100 * share:.0f}% of the peak")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rates", default="1,2,3,4,6,8")
    p.add_argument("--setting", action="append", metavar="NAME=JSON",
                   help="router settings to compare (repeatable; default: %s)" % " and ".join(SETTINGS))
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=1)
    add_cluster_args(p, workers=2, out="runs/overload")
    args = p.parse_args()
    if args.table:
        table(args.table)
        return
    for setting in args.setting or SETTINGS:
        name, patch = setting.split("=", 1)
        for rate in [float(r) for r in args.rates.split(",")]:
            out = pathlib.Path(args.out) / f"{name}-r{rate:g}"
            s = run_point(args, json.loads(patch), rate, out)
            print(f"{name:>10}, rate {rate:g}/s: goodput {s['goodput_requests_per_s']:.2f}/s, "
                  f"TTFT p90 {s['time_to_first_token_ms']['p90']:.0f} ms, failed {s['failed']}, valid {s['valid']}",
                  flush=True)
    table(args.out)


if __name__ == "__main__":
    main()
