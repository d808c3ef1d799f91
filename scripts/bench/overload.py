#!/usr/bin/env python3
"""Goodput against offered load, with and without shedding, on a mock cluster (docs/performance.md).

For every router setting (a name and a JSON patch of the scheduler's settings, sent with
`PUT /admin/router-config` before the load starts) and every open-loop rate, it starts a fresh
`tandem up --engine mock` (so no point inherits another's cache or backlog) and runs `tandem bench serve` on the
committed Mooncake sample with Poisson arrivals at that rate for DURATION seconds, then waits for every request
to end. Goodput counts the requests that met the SLO, per second of the whole run (draining included). It prints
one row per point (with the mean trace prompt length of the served and of the refused requests: which requests
shedding picks) and, per setting, the peak goodput and the goodput at the highest rate as a share of it.

The default settings: `default` (no patch: the router refuses only at `max_queue` and when every decode worker is
near KV exhaustion) and `shed` (`shed_wait_ms` 1000 against queued prefill work, `busy_kv_fraction` 0.3 against
decode batches whose step time would pass the TPOT target: at 30% of the device tier `gpu-default`'s decode step
is 20 ms, leaving room for the batch's growth as it decodes).

Usage:
  python3 scripts/bench/overload.py --tandem target/release/tandem [--rates 1,2,3,4,6,8]
      [--setting 'NAME={"shed_wait_ms": 1000}' ...] [--duration 60] [--seeds 1] [--prefill 2] [--decode 2]
      [--speedup 1] [--out runs/overload]
  python3 scripts/bench/overload.py --table runs/overload     # the table again, from the saved summaries
"""
import argparse
import json
import pathlib
import statistics

from mock_cluster import TRACE, add_cluster_args, bench_serve, mock_cluster, set_router_config

SLO = "ttft_ms=2000,tpot_ms=25"
SETTINGS = ["default={}", 'shed={"shed_wait_ms": 1000, "busy_kv_fraction": 0.3}']


def run_point(args, patch, rate, seed, out):
    flags = ["--prefill", str(args.prefill), "--decode", str(args.decode), "--speedup", str(args.speedup),
             "--seed", str(seed)]
    with mock_cluster(args.tandem, flags) as url:
        if patch:
            set_router_config(url, patch)
        return bench_serve(args.tandem, url, [
            "--trace", str(TRACE), "--rate", str(rate), "--duration", str(args.duration), "--seed", str(seed),
            "--slo", SLO, "--ignore-eos", "--out", str(out)])


def cell(values, digits):
    """The median, with [min, max] when there is more than one value."""
    m = f"{statistics.median(values):.{digits}f}"
    return m if len(values) == 1 else f"{m} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def prompt_means(run):
    """Mean trace prompt length of the served and of the refused (429) requests of one run: what shedding picks."""
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    mean = lambda rs: statistics.mean(r["input_length"] for r in rs) if rs else float("nan")
    return mean([r for r in records if r["status"] == 200]), mean([r for r in records if r["status"] == 429])


def table(out):
    points = {}
    for f in pathlib.Path(out).glob("*/summary.json"):
        name, rate, seed = f.parent.name.rsplit("-", 2)
        summary = {**json.loads(f.read_text()), "prompt_means": prompt_means(f.parent)}
        points.setdefault(name, {}).setdefault(float(rate.lstrip("r")), []).append(summary)
    print(f"SLO {SLO}; goodput = requests meeting it per second of the run; median over seeds [min, max]")
    print(f"{'setting':>10} {'rate/s':>7} {'goodput/s':>20} {'SLO met %':>20} {'TTFT p90 ms':>12} {'sent':>6} "
          f"{'429':>5} {'other failed':>13} {'prompt ok/429':>14} {'valid':>6}")
    for name, rates in sorted(points.items()):
        goodput = {}
        for rate, runs in sorted(rates.items()):
            goodput[rate] = statistics.median(s["goodput_requests_per_s"] for s in runs)
            refused = [s.get("errors_by_status", {}).get("429", 0) for s in runs]
            print(f"{name:>10} {rate:>7g} {cell([s['goodput_requests_per_s'] for s in runs], 2):>20} "
                  f"{cell([100 * s['slo_attainment'] for s in runs], 1):>20} "
                  f"{statistics.median(s['time_to_first_token_ms']['p90'] for s in runs):>12.1f} "
                  f"{statistics.median(s['requests'] for s in runs):>6g} {statistics.median(refused):>5g} "
                  f"{statistics.median(s['failed'] - r for s, r in zip(runs, refused)):>13g} "
                  f"{statistics.median(s['prompt_means'][0] for s in runs):>7.0f}/"
                  f"{statistics.median(s['prompt_means'][1] for s in runs):<6.0f} "
                  f"{sum(s['valid'] for s in runs):>4}/{len(runs)}")
        peak_rate = max(goodput, key=goodput.get)
        top = max(goodput)
        share = goodput[top] / goodput[peak_rate] if goodput[peak_rate] > 0 else 0.0
        print(f"{name:>10}: peak goodput {goodput[peak_rate]:.2f}/s (at {peak_rate:g}/s); at {top:g}/s "
              f"{goodput[top]:.2f}/s = {100 * share:.0f}% of the peak")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rates", default="1,2,3,4,6,8")
    p.add_argument("--setting", action="append", metavar="NAME=JSON",
                   help="router settings to compare (repeatable; default: %s)" % " and ".join(SETTINGS))
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--seeds", default="1", help="comma-separated; each point runs once per seed")
    add_cluster_args(p, workers=2, out="runs/overload")
    args = p.parse_args()
    if args.table:
        table(args.table)
        return
    for setting in args.setting or SETTINGS:
        name, patch = setting.split("=", 1)
        for rate, seed in [(float(r), int(x)) for r in args.rates.split(",") for x in args.seeds.split(",")]:
            out = pathlib.Path(args.out) / f"{name}-r{rate:g}-s{seed}"
            s = run_point(args, json.loads(patch), rate, seed, out)
            print(f"{name:>10}, seed {seed}, rate {rate:g}/s: goodput {s['goodput_requests_per_s']:.2f}/s, "
                  f"TTFT p90 {s['time_to_first_token_ms']['p90']:.0f} ms, failed {s['failed']}, valid {s['valid']}",
                  flush=True)
    table(args.out)


if __name__ == "__main__":
    main()
