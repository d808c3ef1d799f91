#!/usr/bin/env python3
"""Checks that a `tandem model export --safetensors` directory is the model the engine runs: transformers' logits
on it (f32, CPU) against the CPU engine's reference logits in a `tandem model parity --write` file, for the
parity's whole prefills (prompt lengths 1, 17, 129 and 600, the ids of engine::bench::prompt_token). The export's
weights are f16, so the two differ by that rounding; fails past 1% of the step's largest logit or on another top
token. The PyTorch speed figures are only a comparison if this holds.

Usage: python3 scripts/device/export_parity.py HF_DIR PARITY_FILE
"""
import struct
import sys

import torch
from transformers import AutoModelForCausalLM

PROMPTS = [1, 17, 129, 600]


def read(path):
    """The parity file: per entry, name length (u32) and name, value count (u32) and f32 values, little-endian."""
    data, i, out = open(path, "rb").read(), 0, {}
    while i < len(data):
        (n,) = struct.unpack_from("<I", data, i)
        name = data[i + 4 : i + 4 + n].decode()
        i += 4 + n
        (count,) = struct.unpack_from("<I", data, i)
        out[name] = torch.frombuffer(bytearray(data[i + 4 : i + 4 + 4 * count]), dtype=torch.float32)
        i += 4 + 4 * count
    return out


def main():
    hf_dir, parity = sys.argv[1], sys.argv[2]
    reference = read(parity)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    ok = True
    for seq, n in enumerate(PROMPTS):
        ids = torch.tensor([[100 + (i * 7919 + seq * 104_729) % (vocab - 100) for i in range(n)]])
        with torch.inference_mode():
            got = model(ids, logits_to_keep=1).logits[0, -1]
        want = reference[f"prefill/{n}"]
        rel = (got - want).abs().max().item() / want.abs().max().item()
        same = got.argmax().item() == want.argmax().item()
        ok &= rel <= 0.01 and same
        print(f"prefill/{n}: max error {rel * 100:.3f}% of the largest logit, top token {'same' if same else 'DIFFERS'}")
    print("the export computes the engine's model" if ok else "FAIL: the export is not the engine's model")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
