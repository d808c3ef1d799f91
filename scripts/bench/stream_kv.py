#!/usr/bin/env python3
"""Streaming a long prompt's KV while it computes, measured (docs/performance.md, "Stream while computing").

One prefill and one decode worker behind the router (`tandem up`), the router's `--stream-kv` on and off in turn on
fresh clusters; each round sends the same cold prompts (distinct, nothing shared) one at a time with two output
tokens, so each request's figures are: TTFT (the prefill worker's first token), the gap to the second token (the
decode worker's pull of what it does not hold, then one decode step) and their sum, E2E: the time until decoding
can go on, which streaming is meant to cut. Modes alternate within each round so a drifting machine favours none.

Usage:
  python3 scripts/bench/stream_kv.py [--engine mock --profile gpu-default | --engine cpu]
      [--prompt-blocks 16] [--requests 10] [--rounds 2] [--out runs/stream-kv]
"""
import argparse
import json
import pathlib
import statistics

from mock_cluster import ROOT, bench_serve, mock_cluster

FIGURES = [
    ("TTFT p50 ms", lambda s: s["time_to_first_token_ms"]["p50"]),
    ("2nd-token gap p50 ms", lambda s: s["inter_token_latency_ms"]["p50"]),
    ("E2E p50 ms", lambda s: s["request_latency_ms"]["p50"]),
    ("E2E p90 ms", lambda s: s["request_latency_ms"]["p90"]),
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tandem", default=str(ROOT / "target/release/tandem"))
    p.add_argument("--engine", default="mock")
    p.add_argument("--profile", default="gpu-default", help="the mock's timing profile")
    p.add_argument("--prompt-blocks", type=int, default=16, help="prompt length in 512-token blocks (16: 8,192)")
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="runs/stream-kv")
    args = p.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--prefill", "1", "--decode", "1"]
    if args.engine == "mock":
        flags += ["--profile", args.profile]
    runs = {"on": [], "off": []}
    for rnd in range(args.rounds):
        # The same prompts for both modes of a round; each round its own.
        order = ["on", "off"] if rnd % 2 == 0 else ["off", "on"]
        for mode in order:
            with mock_cluster(args.tandem, flags + ["--stream-kv", "true" if mode == "on" else "false"],
                              engine=args.engine) as url:
                # Every prompt distinct and cold: a prefix of its own (of thousands), one block of suffix.
                summary = bench_serve(args.tandem, url, [
                    "--concurrency", "1", "--max-requests", str(args.requests), "--prefixes", "100000",
                    "--zipf", "0", "--prefix-len", str(512 * (args.prompt_blocks - 1)), "--suffix-len", "512",
                    "--output-len", "2", "--ignore-eos", "--seed", str(rnd + 1)])
            (out / f"{mode}-{rnd}.json").write_text(json.dumps(summary, indent=1))
            if summary["failed"]:
                raise SystemExit(f"{mode}, round {rnd}: {summary['failed']} requests failed")
            runs[mode].append(summary)
            cells = "  ".join(f"{name} {f(summary):.1f}" for name, f in FIGURES)
            print(f"round {rnd} stream_kv {mode:<3}  {cells}", flush=True)
    print(f"\n{args.engine} engine{' (' + args.profile + ')' if args.engine == 'mock' else ''}, "
          f"{512 * args.prompt_blocks}-token prompts, {args.requests} per run, {args.rounds} rounds "
          "(median of the runs' figures):")
    print(f"{'figure':<22}{'stream_kv off':>15}{'stream_kv on':>15}{'on / off':>10}")
    for name, f in FIGURES:
        off = statistics.median(f(s) for s in runs["off"])
        on = statistics.median(f(s) for s in runs["on"])
        print(f"{name:<22}{off:>15.1f}{on:>15.1f}{on / off:>10.2f}")


if __name__ == "__main__":
    main()
