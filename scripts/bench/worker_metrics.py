#!/usr/bin/env python3
"""A `tandem up` cluster under the synthetic shared-prefix workload, then each worker's own counters
(docs/simulation.md, "The timing model"): tokens computed, KV pulled (blocks, bytes, seconds, by transport) and
the worker-side time per output token.

Usage:
  python3 scripts/bench/worker_metrics.py --tandem target/release/tandem [--engine cpu] [--prefill 2] [--decode 2]
      [--rate 0.5] [--requests 20]
"""
import argparse
import os
import pathlib
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
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
    home = pathlib.Path(tempfile.mkdtemp(prefix="tandem-metrics-"))
    models = pathlib.Path(os.environ.get("TANDEM_HOME", pathlib.Path.home() / ".cache/tandem")) / "models"
    if models.is_dir():
        (home / "models").symlink_to(models)
    log = home / "up.log"
    with open(log, "w") as err:
        up = subprocess.Popen([args.tandem, "up", "--engine", args.engine, "--port", "0", "--prefill", args.prefill,
                               "--decode", args.decode, "--seed", "1", "--kv-blocks", "1024", "--host-blocks", "2048",
                               "--disk-blocks", "0"], stdout=subprocess.PIPE, stderr=err, text=True,
                              env={**os.environ, "TANDEM_HOME": str(home)})
    try:
        url = next(w for w in up.stdout.readline().split() if w.startswith("http://"))
        time.sleep(2)
        workers = re.findall(r"(\S+-\d+)\s+grpc .*metrics (http://\S+)", log.read_text())
        subprocess.run([args.tandem, "bench", "serve", "--url", url, "--rate", args.rate, "--prefixes", "4",
                        "--prefix-len", "512", "--suffix-len", "512", "--output-len", "16", "--max-requests",
                        args.requests, "--seed", "1", "--ignore-eos", "--quiet", "--json"], check=True,
                       capture_output=True)
        for name, metrics in workers:
            text = urllib.request.urlopen(metrics, timeout=10).read().decode()
            values = [line for line in text.splitlines() if line.startswith(COUNTERS)]
            print(name)
            for line in values:
                print("  " + line)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
