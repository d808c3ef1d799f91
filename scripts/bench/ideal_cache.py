#!/usr/bin/env python3
"""The share of a Mooncake trace's prompt tokens that an infinite cache would serve: for each request, the
longest run of leading hash ids seen in any earlier request, times the block size (capped at the prompt)."""
import json
import sys

def main(path, block=512):
    seen, cached, total = set(), 0, 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            k = 0
            for h in r["hash_ids"]:
                if h not in seen:
                    break
                k += 1
            cached += min(k * block, r["input_length"])
            total += r["input_length"]
            seen.update(r["hash_ids"])
    print(f"{cached / total:.4f} of {total} prompt tokens ({path}, {block}-token blocks, infinite cache)")

if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 512)
