#!/usr/bin/env python3
"""PyTorch's speed on the same weights as the CUDA backend (a `tandem model export --safetensors` directory), for
the ratios in docs/performance.md: prefill tokens/s at the given prompt lengths, decode tokens/s at the given batch
sizes, eager and with `torch.compile` over a static KV cache. Prints one JSON object; a measurement that fails is
reported with its error instead of a figure.

Usage: python3 scripts/device/torch_speed.py DIR [--prompts 512,4096] [--batches 1,16,64,256] [--steps 64]
"""
import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--prompts", default="512,4096")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--compile", default="1,16", help="batch sizes also measured with torch.compile (slow to build)")
    args = p.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.dir, torch_dtype=torch.float16).cuda().eval()
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "prefill": {}, "decode": {}}

    def ids(batch, n):
        return torch.randint(1000, vocab, (batch, n), device="cuda", generator=gen)

    with torch.inference_mode():
        for n in [int(x) for x in args.prompts.split(",")]:
            x = ids(1, n)
            model(x)
            out["prefill"][n] = n / timed(lambda: model(x))

        def decode(batch, compiled):
            x = ids(batch, 128)
            kw = dict(do_sample=False, pad_token_id=0)
            if compiled:
                kw["cache_implementation"] = "static"
            one = dict(kw, max_new_tokens=1, min_new_tokens=1)
            many = dict(kw, max_new_tokens=args.steps + 1, min_new_tokens=args.steps + 1)
            model.generate(x, **many)  # warm-up (and, compiled, the graph build)
            # Decode alone: the longer run less the one that only prefills and samples once.
            secs = timed(lambda: model.generate(x, **many)) - timed(lambda: model.generate(x, **one))
            return batch * args.steps / secs

        for b in [int(x) for x in args.batches.split(",")]:
            try:
                out["decode"][f"eager/{b}"] = decode(b, False)
            except Exception as e:  # noqa: BLE001 - reported, not hidden
                out["decode"][f"eager/{b}"] = f"error: {e}"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        for b in [int(x) for x in args.compile.split(",") if x]:
            try:
                out["decode"][f"compiled/{b}"] = decode(b, True)
            except Exception as e:  # noqa: BLE001
                out["decode"][f"compiled/{b}"] = f"error: {e}"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
