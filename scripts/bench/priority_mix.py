#!/usr/bin/env python3
"""Request priorities under load, in `tandem sim` (the real router queue and engine scheduler in virtual time).

Marks every `--every`-th request of a trace with priority -1 (vLLM's meaning: served before the default 0), runs the
simulator on it and on the same trace unmarked, and prints the time to first token of the marked requests and of the
others in both runs: what the priority buys them, and what it costs the rest.

    python3 scripts/bench/priority_mix.py --tandem target/release/tandem [--trace FILE] [--every 5] \
        [--speedup 2] [--decode 6] [--max-in-flight N] [--out runs/priority]
"""

import argparse
import json
import pathlib
import subprocess
import sys


def percentile(values, q):
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def run(args, trace, out):
    cmd = [args.tandem, "sim", "--trace", str(trace), "--speedup", str(args.speedup), "--prefill", "0",
           "--decode", str(args.decode), "--policies", "kv", "--out", str(out), "--json"]
    if args.max_in_flight:
        cmd += ["--max-in-flight", str(args.max_in_flight)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out / "kv" / "records.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tandem", default="target/release/tandem")
    p.add_argument("--trace", default="data/traces/mooncake_conversation_1k.jsonl")
    p.add_argument("--every", type=int, default=5, help="every k-th request gets priority -1")
    p.add_argument("--speedup", type=float, default=2.0)
    p.add_argument("--decode", type=int, default=6, help="workers serving both phases")
    p.add_argument("--max-in-flight", type=int, default=0, help="the router's slots (default: the router's)")
    p.add_argument("--out", default="runs/priority")
    args = p.parse_args()

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [json.loads(line) for line in open(args.trace) if line.strip()]
    marked = set(range(0, len(lines), args.every))
    plain_trace, mixed_trace = out / "plain.jsonl", out / "mixed.jsonl"
    with open(plain_trace, "w") as f:
        for line in lines:
            f.write(json.dumps({k: v for k, v in line.items() if k != "priority"}) + "\n")
    with open(mixed_trace, "w") as f:
        for i, line in enumerate(lines):
            f.write(json.dumps({**line, "priority": -1} if i in marked else line) + "\n")

    rows = []
    for name, trace in [("no priorities", plain_trace), ("priority -1 on every %d-th" % args.every, mixed_trace)]:
        records = run(args, trace, out / name.split()[0])
        for group, pick in [("marked", lambda r: r["index"] in marked), ("others", lambda r: r["index"] not in marked)]:
            ttft = [r["time_to_first_token_ms"] for r in records if pick(r) and r["status"] == 200]
            failed = sum(1 for r in records if pick(r) and r["status"] != 200)
            rows.append((name, group, len(ttft), failed, percentile(ttft, 0.5), percentile(ttft, 0.9)))
    print("| run | which requests | served | failed | TTFT p50 ms | TTFT p90 ms |")
    print("|---|---|---:|---:|---:|---:|")
    for name, group, n, failed, p50, p90 in rows:
        print(f"| {name} | {group} | {n} | {failed} | {p50:.1f} | {p90:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
