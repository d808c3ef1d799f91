#!/usr/bin/env python3
"""A `tandem up` cluster under the synthetic shared-prefix workload, then each worker's own counters
(docs/simulation.md, "The timing model"): tokens computed, KV pulled (blocks, bytes, seconds, by transport) and
the worker-side time per output token.

Usage:
  python3 scripts/bench/worker_metrics.py --tandem target/release/tandem [--engine cpu] [--prefill 2] [--decode 2]
      [--rate 0.5] [--requests 20]
"""
import argparse
import pathlib
import re
import tempfile
import urllib.request

from mock_cluster import ROOT, bench_serve, mock_cluster

COUNTERS = ("tandem_tokens_computed_total", "tandem_kv_transfer_pulled_blocks_total", "tandem_kv_transfer_bytes_total",
            "tandem_kv_transfer_seconds_total", "tandem_worker_time_per_output_token_seconds_sum",
            "tandem_worker_time_per_output_token_seconds_count")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tandem", default=str(ROOT / "target/release/tandem"))
    p.add_argument("--engine", default="cpu")
    p.add_argument("--prefill", default="2")
    p.add_argument("--decode", default="2")
    p.add_argument("--rate", default="0.5")
    p.add_argument("--requests", default="20")
    args = p.parse_args()
    flags = ["--prefill", args.prefill, "--decode", args.decode, "--seed", "1", "--kv-blocks", "1024",
             "--host-blocks", "2048", "--disk-blocks", "0"]
    with tempfile.TemporaryDirectory(prefix="tandem-metrics-") as tmp:
        log = pathlib.Path(tmp) / "up.log"
        with mock_cluster(args.tandem, flags, engine=args.engine, log=log) as url:
            # Each worker's metrics address, from the lines `tandem up` prints at start.
            workers = re.findall(r"(\S+-\d+)\s+grpc .*metrics (http://\S+)", log.read_text())
            bench_serve(args.tandem, url, ["--rate", args.rate, "--prefixes", "4", "--prefix-len", "512",
                                           "--suffix-len", "512", "--output-len", "16", "--max-requests",
                                           args.requests, "--seed", "1", "--ignore-eos"])
            for name, metrics in workers:
                text = urllib.request.urlopen(metrics, timeout=10).read().decode()
                print(name)
                for line in text.splitlines():
                    if line.startswith(COUNTERS):
                        print("  " + line)


if __name__ == "__main__":
    main()
