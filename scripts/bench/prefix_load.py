"""Shared-prefix load through a running Tandem router, one policy after another: the routing probe of
docs/performance.md.

Each run sends N chat requests, closed loop at concurrency C, streamed, max_tokens 8. Every request opens with one
of K system prompts (~250 tokens each) picked with Zipf weights (prompt i with weight 1/(i+1)), then a short
question. Runs with the same seed send the same workload shape; each run's prompts start with their own tag, so no
run finds another's prefixes cached. The policy is switched live (PUT /admin/router-config: on loopback, or with
--admin-key) before each run; policies take turns within each seed so that a drifting machine favours none.

With --tandem PATH every run gets a fresh `tandem up` (2 prefill and 2 decode workers), so that no run starts with
caches and load left by the one before (what docs/performance.md reports); otherwise runs share the cluster at
BASE.

Usage:
  python3 scripts/bench/prefix_load.py --tandem target/release/tandem --policies kv,round_robin,least_loaded --seeds 1,2,3
  python3 scripts/bench/prefix_load.py http://127.0.0.1:8000 --policies kv --seeds 1   # a running cluster
Needs the openai package (scripts/e2e/requirements.txt).
"""
import argparse
import asyncio
import json
import random
import re
import signal
import statistics
import subprocess
import threading
import time
import urllib.request

from openai import AsyncOpenAI

WORDS = "harbor lamp storm keeper tide rock signal night fog bell ship rope island wave beacon watch".split()


def set_policy(base, policy, admin_key):
    headers = {"content-type": "application/json"}
    if admin_key:
        headers["authorization"] = f"Bearer {admin_key}"
    req = urllib.request.Request(f"{base}/admin/router-config", data=json.dumps({"policy": policy}).encode(),
                                 headers=headers, method="PUT")
    with urllib.request.urlopen(req) as r:
        r.read()


async def run(base, seed, tag, n, concurrency, k):
    rng = random.Random(seed)
    systems = [f"[{tag}-{i}] You are assistant {i}. " + " ".join(rng.choice(WORDS) for _ in range(220)) for i in range(k)]
    picks = rng.choices(range(k), [1 / (i + 1) for i in range(k)], k=n)
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=900)
    gate = asyncio.Semaphore(concurrency)
    results = []

    async def one(i):
        async with gate:
            start = time.perf_counter()
            ttft, usage = None, None
            stream = await client.chat.completions.create(
                model="smollm2-135m-instruct", stream=True, max_tokens=8, temperature=0,
                stream_options={"include_usage": True},
                messages=[{"role": "system", "content": systems[picks[i]]},
                          {"role": "user", "content": f"Question {i}: what now?"}])
            async for chunk in stream:
                if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                    ttft = time.perf_counter() - start
                if chunk.usage:
                    usage = chunk.usage
            cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
            results.append((ttft, usage.prompt_tokens, cached))

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - started
    ttfts = sorted(r[0] for r in results)
    return {
        "ttft_mean": statistics.mean(ttfts),
        "ttft_p50": ttfts[len(ttfts) // 2],
        "ttft_p90": ttfts[int(len(ttfts) * 0.9)],
        "cached_fraction": sum(r[2] for r in results) / sum(r[1] for r in results),
        "wall": wall,
    }


class Cluster:
    """A fresh `tandem up` on a free port, stopped on exit."""

    def __init__(self, tandem):
        self.proc = subprocess.Popen([tandem, "up", "--port", "0"], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        self.base = re.search(r"(http://\S+)", self.proc.stdout.readline()).group(1)
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{self.base}/ready") as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=60)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", nargs="?", help="a running router's URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--tandem", help="start a fresh `tandem up` from this binary for every run")
    p.add_argument("--policies", default="kv,round_robin,least_loaded")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--prompts", type=int, default=4, help="distinct system prompts (K)")
    p.add_argument("--admin-key", default=None)
    p.add_argument("--json", action="store_true", help="one JSON object per run instead of a table")
    a = p.parse_args()
    if not (a.base or a.tandem):
        p.error("give a running router's URL or --tandem")
    stamp = int(time.time())
    if not a.json:
        print(f"{'seed':>4} {'policy':<13} {'ttft mean':>9} {'p50':>6} {'p90':>6} {'cached':>6} {'wall':>6}")
    runs = 0
    for seed in [int(s) for s in a.seeds.split(",")]:
        for policy in a.policies.split(","):
            runs += 1
            if a.tandem:
                with Cluster(a.tandem) as c:
                    set_policy(c.base, policy, a.admin_key)
                    r = asyncio.run(run(c.base, seed, f"{stamp}-{runs}", a.requests, a.concurrency, a.prompts))
            else:
                set_policy(a.base, policy, a.admin_key)
                r = asyncio.run(run(a.base, seed, f"{stamp}-{runs}", a.requests, a.concurrency, a.prompts))
            if a.json:
                print(json.dumps({"seed": seed, "policy": policy, **r}), flush=True)
            else:
                print(f"{seed:>4} {policy:<13} {r['ttft_mean']:>8.2f}s {r['ttft_p50']:>5.2f}s {r['ttft_p90']:>5.2f}s "
                      f"{r['cached_fraction']:>6.3f} {r['wall']:>5.0f}s", flush=True)


if __name__ == "__main__":
    main()
