#!/usr/bin/env python3
"""Splits texts by pre-tokenizer patterns with Python's `regex` module, which applies their look-aheads itself: the
reference for Tandem's pre-tokenizers (engine/tests/hf_vocabularies.rs), which apply theirs by hand. Reads
{"patterns": [...], "texts": [...]} on stdin; each pattern is an isolating split (as Hugging Face's `Split` with
`Isolated` cuts: each match a piece, and the text between matches a piece too) applied to every piece the one
before made. Writes the pieces of each text as a JSON list of lists.
"""

import json
import sys

import regex


def isolate(pattern, text):
    pieces, pos = [], 0
    for m in pattern.finditer(text):
        if m.start() > pos:
            pieces.append(text[pos : m.start()])
        if m.end() > m.start():
            pieces.append(m.group())
        pos = m.end()
    if pos < len(text):
        pieces.append(text[pos:])
    return pieces


def main():
    job = json.load(sys.stdin)
    # A class written with `&&` (Kimi K2's) is an intersection in tiktoken's dialect, and in this module's VERSION1.
    patterns = [regex.compile(p, regex.V1 if "&&" in p else 0) for p in job["patterns"]]
    out = []
    for text in job["texts"]:
        pieces = [text]
        for p in patterns:
            pieces = [q for piece in pieces for q in isolate(p, piece)]
        out.append(pieces)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
