#!/usr/bin/env python3
"""Writes engine/tests/data/golden.json: greedy continuations of the embedded model from the numpy oracle
(np_llama.py, float64, weights dequantized by the `gguf` package), with the oracle's top-1 margin at every step,
first-position logits (the top 100 and every 97th id), and at every step the top 10 log-probabilities (log-softmax
over the whole vocabulary).

    pip install -r scripts/reference/requirements.txt
    python3 scripts/reference/golden.py [GGUF] > engine/tests/data/golden.json   # a few minutes
"""
import json
import sys

import numpy as np

from common import default_model_path, reference_tokenizer
from np_llama import Model

STEPS = 24
TOP_LOGPROBS = 10
PROMPTS = [
    {"name": "chat-capital", "chat": [{"role": "user", "content": "What is the capital of France?"}]},
    {"name": "raw-fox", "raw": "The quick brown fox jumps over the lazy dog. The dog"},
    {"name": "chat-pirate", "chat": [{"role": "system", "content": "You are a pirate."},
                                     {"role": "user", "content": "Tell me about the sea."}]},
    {"name": "raw-code", "raw": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"},
    {"name": "chat-translate", "chat": [{"role": "user", "content": "Translate to French: I love programming."}]},
    {"name": "raw-long", "raw": (
        "Large language model serving splits every request into two phases. Prefill reads the whole prompt at "
        "once and fills the key-value cache; it is limited by arithmetic. Decode then produces one token at a "
        "time, reading the whole cache and all the weights for every token; it is limited by memory bandwidth. "
        "Because the two phases stress different resources, some systems run them on different machines and "
        "move the cache between them. The router that decides where each request goes must therefore know")},
    {"name": "chat-multiturn", "chat": [{"role": "user", "content": "Hi! Who are you?"},
                                        {"role": "assistant", "content": "I am a helpful assistant."},
                                        {"role": "user", "content": "Great. Name three fruits."}]},
    {"name": "raw-unicode", "raw": "Café, naïve, jalapeño — 東京は日本の首都です。 Emoji: 🚀🔥 and then"},
    {"name": "raw-json", "raw": '{"name": "Alice", "age": 30, "skills": ["python", "rust"], "address": {"city": "'},
    # Over 400 tokens: a prompt of dozens of KV blocks, its answer read from far back in it.
    {"name": "chat-long", "chat": [{"role": "user", "content": (
        "Read the notes below and answer the question at the end.\n\n"
        "1. The lighthouse on the northern cape was built in 1871 from granite quarried two miles inland. Its lamp "
        "burned whale oil until 1890, then kerosene, and it was electrified in 1934 when a cable reached the cape.\n"
        "2. Three keepers lived there at a time. They kept a log of every ship that passed, the weather at dawn and "
        "dusk, and the hours the lamp was lit. The logs from 1871 to 1952 survive in the county archive.\n"
        "3. In the winter of 1903 a storm cut the cape off for nineteen days. The keepers rationed flour and salted "
        "fish, and one of them, Margaret Hale, wrote that the wind never dropped below a gale in that time.\n"
        "4. The fog signal was a steam siren until 1921, when it was replaced by a diaphone driven by compressed air. "
        "Fishermen said the diaphone could be heard eleven miles out on a still night.\n"
        "5. The station was automated in 1986. The keepers' cottages became a small museum that opens from May to "
        "September, and volunteers repaint the tower every seven years.\n"
        "6. A second, smaller light stood on the reef to the east from 1899 until a wave destroyed it in 1962; its "
        "foundations can still be seen at low tide.\n"
        "7. Visitors can climb the 114 steps to the gallery on weekends. The view covers the bay, the reef and, on "
        "clear days, the mountains on the far shore.\n\n"
        "Question: how many years passed between the lighthouse being built and its automation, and what replaced "
        "the steam siren?")}]},
]


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else default_model_path()
    tk, fast = reference_tokenizer(path)
    model = Model(path, np.float64)
    out = []
    for p in PROMPTS:
        if "chat" in p:
            text = fast.apply_chat_template(p["chat"], tokenize=False, add_generation_prompt=True)
        else:
            text = p["raw"]
        ids = tk.encode(text, add_special_tokens=False).ids
        model.reset()
        logits = model.forward(ids)[-1]
        first = logits.copy()
        generated, margins, top_logprobs = [], [], []
        for step in range(STEPS):
            shifted = logits - logits.max()
            logprobs = shifted - np.log(np.exp(shifted).sum())
            best = np.argsort(-logprobs, kind="stable")[:TOP_LOGPROBS]
            top_logprobs.append([[int(i), float(logprobs[i])] for i in best])
            top2 = np.sort(logits)[-2:]
            margins.append(float(top2[1] - top2[0]))
            nxt = int(np.argmax(logits))
            generated.append(nxt)
            if step + 1 < STEPS:
                logits = model.forward([nxt])[-1]
        picked = sorted(set(np.argsort(-first)[:100].tolist()) | set(range(0, len(first), 97)))
        out.append({
            "name": p["name"],
            "messages": p.get("chat"),
            "prompt_ids": ids,
            "generated_ids": generated,
            "margins": margins,
            "first_logits": [[i, float(first[i])] for i in picked],
            "top_logprobs": top_logprobs,
        })
        print(p["name"], len(ids), tk.decode(generated), file=sys.stderr)
    json.dump({"generator": "scripts/reference/golden.py", "oracle": "np_llama.py float64", "steps": STEPS,
               "prompts": out}, sys.stdout, indent=0)
    print()


if __name__ == "__main__":
    main()
