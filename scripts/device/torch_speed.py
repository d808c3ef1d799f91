#!/usr/bin/env python3
"""PyTorch's speed on the same weights as the CUDA backend (a `tandem model export --safetensors` directory), for
the ratios in docs/performance.md: prefill tokens/s at the given prompt lengths (logits for the last position only,
as the engine computes them), decode tokens/s at the given batch sizes, eager and compiled (transformers' own
`torch.compile` of the decode step over a static KV cache, mode "reduce-overhead", which replays CUDA graphs).

Prints one JSON object at the end and rewrites it to --out after every figure, so a run cut short by a timeout
still leaves what it measured. A measurement that fails is reported with its error instead of a figure.

Usage: python3 scripts/device/torch_speed.py DIR [--out FILE] [--prompts 512,4096] [--batches 1,16,64,256]
       [--compile 1,16] [--steps 128] [--context 128] [--device cuda|cpu]
"""
import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.configuration_utils import CompileConfig


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--out", help="rewritten with the figures so far after each one")
    p.add_argument("--prompts", default="512,4096")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--compile", default="1,16", help="batch sizes also measured compiled (slow to build)")
    p.add_argument("--steps", type=int, default=128, help="decode steps timed (bench engine decodes 128)")
    p.add_argument("--context", type=int, default=128, help="prompt tokens before decoding")
    p.add_argument("--device", default="cuda", help="cpu only to try the script out (f32, no CUDA graphs)")
    args = p.parse_args()
    cuda = args.device == "cuda"
    dtype = torch.float16 if cuda else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=dtype).to(args.device).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator(device=args.device).manual_seed(0)
    out = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "context": args.context,
        "steps": args.steps,
        "prefill": {},
        "decode": {},
    }

    def record(section, key, value):
        out[section][key] = value
        print(f"{section} {key}: {value}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    def ids(batch, n):
        return torch.randint(1000, vocab, (batch, n), device=args.device, generator=gen)

    def attempt(section, key, fn):
        try:
            record(section, key, fn())
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            record(section, key, f"error: {type(e).__name__}: {e}"[:400])

    def prefill(n):
        x = ids(1, n)
        model(x, logits_to_keep=1)
        return n / min(timed(lambda: model(x, logits_to_keep=1)) for _ in range(3))

    def decode(batch, compiled):
        x = ids(batch, args.context)
        kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(x))
        if compiled:
            kw["cache_implementation"] = "static"
            config = CompileConfig(fullgraph=True, mode="reduce-overhead" if cuda else "default")
            config._compile_all_devices = not cuda  # transformers compiles on CUDA devices only, unless told
            kw["compile_config"] = config
        else:
            kw["disable_compile"] = True
        one = dict(kw, max_new_tokens=1, min_new_tokens=1)
        many = dict(kw, max_new_tokens=args.steps + 1, min_new_tokens=args.steps + 1)
        model.generate(x, **many)  # warm-up (and, compiled, the graph build)
        if compiled and not hasattr(model, "_compiled_call"):
            raise RuntimeError("generate did not compile the decode step")
        # Decode alone: the longer run less the one that only prefills and samples once; the faster of two.
        secs = min(timed(lambda: model.generate(x, **many)) - timed(lambda: model.generate(x, **one)) for _ in range(2))
        return batch * args.steps / secs

    batches = [int(b) for b in args.batches.split(",") if b]
    compiled = [int(b) for b in args.compile.split(",") if b]
    with torch.inference_mode():
        for n in [int(x) for x in args.prompts.split(",") if x]:
            attempt("prefill", str(n), lambda: prefill(n))
        # Batch 1 first, both ways: the figures the targets name.
        order = [(1, False)] if 1 in batches else []
        order += [(1, True)] if 1 in compiled else []
        order += [(b, False) for b in batches if b != 1] + [(b, True) for b in compiled if b != 1]
        for b, c in order:
            attempt("decode", f"{'compiled' if c else 'eager'}/{b}", lambda: decode(b, c))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
