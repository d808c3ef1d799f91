#!/usr/bin/env python3
"""Writes a BurstGPT-format CSV of N requests (seeded): Poisson arrivals at RATE per second, log-normal prompt and
output lengths (means about 817 and 300 tokens). For measuring the simulator on long traces without the real file.

    python3 scripts/bench/burstgpt_like.py 300000 > /tmp/burst300k.csv   # [N] [RATE] [SEED]
"""
import random
import sys

n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
rate = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
rng = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 3)
out = sys.stdout
out.write("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n")
t = 0.0
for _ in range(n):
    t += rng.expovariate(rate)
    prompt, output = int(rng.lognormvariate(6.3, 0.9)), int(rng.lognormvariate(5.3, 0.9))
    out.write(f"{int(t)},ChatGPT,{prompt},{output},{prompt + output},Conversation log\n")
