"""Time to first token through a running cluster for 8 requests sharing a system prompt, under round_robin and kv.

Usage: python scripts/bench/policy_ttft.py http://127.0.0.1:8000   (with `tandem up` running)
"""
import json, sys, time, urllib.request
base = sys.argv[1]
def post(path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}, method="PUT" if path.startswith("/admin") else "POST")
    t = time.perf_counter()
    with urllib.request.urlopen(req) as r:
        out = json.load(r)
    return out, time.perf_counter() - t
def run(policy, topic):
    post("/admin/router-config", {"policy": policy})
    system = (f"You are an expert on {topic}. Answer carefully, with facts, in plain words, and never in lists. " * 14)
    times, cached = [], []
    for i in range(8):
        q = f"Question {i}: tell me one thing about {topic} number {i}."
        out, dt = post("/v1/chat/completions", {"model": "smollm2-135m-instruct", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]})
        times.append(dt); cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
    prompt = out["usage"]["prompt_tokens"]
    print(f"{policy:12s} prompt {prompt} tokens: mean time to first token {sum(times[1:])/7*1000:.0f} ms after the first "
          f"(first {times[0]*1000:.0f} ms); cached tokens per request {cached}")
run("round_robin", "volcanoes")
run("kv", "glaciers")
run("round_robin", "deserts")
run("kv", "forests")
