"""A soak of a whole local cluster: `tandem up` under steady streaming load for a while, with a share of the
clients leaving at random moments (before the first token too), then checks that nothing was left behind.

At the end every worker must report zero running and waiting sequences, zero calls in flight and zero leases; no
`tandem-kv-*` region file may remain in the shared-memory directory (a running worker's own `-store` file, its
KV store, and its `.lock` stay); the router's in-flight and queue gauges must
read zero; and the cluster process's resident memory must be within 10% of what it was after the warm-up.

Usage: python3 scripts/soak/soak.py [--tandem target/release/tandem] [--minutes 10] [--warmup 60] [--clients 6]
                                   [--leave 0.2] [--json]
It starts its own `tandem up` (port 0, 2 prefill and 2 decode workers) and stops it at the end. Standard library
only. Exit status 1 when a check fails.
"""
import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

SHM_DIR = "/dev/shm"
WORDS = "harbor lamp storm keeper tide rock signal night fog bell ship rope island wave beacon watch".split()


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def metrics(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def shm_regions():
    try:
        return [
            f
            for f in os.listdir(SHM_DIR)
            if f.startswith("tandem-kv-") and not f.endswith(".lock") and not f.endswith("-store")
        ]
    except FileNotFoundError:
        return []


class Stats:
    def __init__(self):
        self.done = self.left = self.failed = 0
        self.statuses = {}


async def one_request(host, port, body, leave_after, stats):
    """Sends one streamed chat request; leaves after `leave_after` events (0: before any answer), or reads to the end
    when it is None."""
    reader, writer = await asyncio.open_connection(host, port)
    payload = json.dumps(body).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n"
                 + f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n".encode() + payload)
    await writer.drain()
    try:
        if leave_after == 0:
            await asyncio.sleep(random.uniform(0, 0.5))
            stats.left += 1
            return
        status_line = await reader.readline()
        status = status_line.split(b" ")[1].decode() if status_line else "none"
        stats.statuses[status] = stats.statuses.get(status, 0) + 1
        events = 0
        while True:
            line = await reader.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                events += 1
                if line.strip() == b"data: [DONE]":
                    break
                if leave_after is not None and events >= leave_after:
                    stats.left += 1
                    return
        if status == "200":
            stats.done += 1
        else:
            stats.failed += 1
    finally:
        writer.close()


async def client_loop(host, port, until, leave, stats, rng):
    prefixes = [f"You are assistant {i}. " + " ".join(rng.choice(WORDS) for _ in range(120)) for i in range(6)]
    while time.monotonic() < until:
        body = {"model": "smollm2-135m-instruct", "stream": True, "temperature": 0.7,
                "max_tokens": rng.randint(4, 48), "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": rng.choice(prefixes)},
                             {"role": "user", "content": f"Tell me about {rng.choice(WORDS)} number {rng.randint(0, 999)}."}]}
        # A leaving client goes before the first token or after a few events.
        leave_after = (0 if rng.random() < 0.5 else rng.randint(1, 6)) if rng.random() < leave else None
        try:
            await one_request(host, port, body, leave_after, stats)
        except (ConnectionError, OSError):
            stats.failed += 1


async def load(host, port, seconds, clients, leave, seed):
    stats = Stats()
    until = time.monotonic() + seconds
    await asyncio.gather(*(client_loop(host, port, until, leave, stats, random.Random(seed + i)) for i in range(clients)))
    return stats


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tandem", default="target/release/tandem")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=60.0, help="seconds of load before the memory baseline")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--leave", type=float, default=0.2, help="share of clients that disconnect early")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    before_regions = set(shm_regions())
    up = subprocess.Popen([a.tandem, "up", "--port", "0", "--prefill", "2", "--decode", "2"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # tandem up names each worker's metrics address on stderr, then prints the router's URL on stdout.
    worker_metrics = []
    while len(worker_metrics) < 4:
        line = up.stderr.readline()
        if not line:
            sys.exit("tandem up exited before its workers were up")
        m = re.search(r"metrics (http://\S+/metrics)", line)
        if m:
            worker_metrics.append(m.group(1))
    url = re.search(r"(http://\S+)", up.stdout.readline()).group(1)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    port = int(port)
    # Drain the cluster's output so that it never blocks on a full pipe.
    for stream in (up.stdout, up.stderr):
        threading.Thread(target=lambda s=stream: [None for _ in s], daemon=True).start()
    try:
        started = time.time()
        warm = asyncio.run(load(host, port, a.warmup, a.clients, a.leave, 1))
        time.sleep(5)
        rss_warm = rss_bytes(up.pid)
        soak = asyncio.run(load(host, port, a.minutes * 60 - a.warmup, a.clients, a.leave, 1000))
        # Let the last cancellations and lease releases land.
        deadline = time.time() + 60
        while True:
            workers = [metrics(u) for u in worker_metrics]
            router = metrics(f"{url}/metrics")
            busy = sum(w.get("tandem_worker_running_sequences", 0) + w.get("tandem_worker_waiting_sequences", 0)
                       + w.get("tandem_worker_calls_in_flight", 0) + w.get("tandem_kv_leases", 0) for w in workers)
            gauges = router.get("tandem_router_requests_in_flight", 0) + router.get("tandem_router_queue_depth", 0)
            regions = set(shm_regions()) - before_regions
            if (busy == 0 and gauges == 0 and not regions) or time.time() > deadline:
                break
            time.sleep(1)
        time.sleep(5)
        rss_end = rss_bytes(up.pid)
        result = {
            "seconds": round(time.time() - started),
            "requests_finished": warm.done + soak.done,
            "clients_left_early": warm.left + soak.left,
            "requests_failed": warm.failed + soak.failed,
            "statuses": {k: warm.statuses.get(k, 0) + soak.statuses.get(k, 0)
                         for k in set(warm.statuses) | set(soak.statuses)},
            "workers_running_waiting_calls_leases": busy,
            "router_in_flight_and_queue": gauges,
            "shm_region_files_left": len(regions),
            "rss_after_warmup_mib": round(rss_warm / 2**20, 1),
            "rss_after_soak_mib": round(rss_end / 2**20, 1),
            "rss_growth": round(rss_end / rss_warm - 1, 4) if rss_warm else None,
        }
        checks = {
            "nothing running, in flight or leased on any worker": busy == 0,
            "router in-flight and queue gauges at zero": gauges == 0,
            "no shared-memory region left": not regions,
            "resident memory within 10% of the warm-up's": rss_warm and abs(rss_end / rss_warm - 1) <= 0.10,
        }
        if a.json:
            print(json.dumps({**result, "checks": checks}, indent=2))
        else:
            for k, v in result.items():
                print(f"{k:40s} {v}")
            for k, ok in checks.items():
                print(f"{'PASS' if ok else 'FAIL'}  {k}")
        sys.exit(0 if all(checks.values()) else 1)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()


if __name__ == "__main__":
    main()
