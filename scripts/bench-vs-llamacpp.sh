#!/usr/bin/env bash
# Measures Tandem's engine and llama.cpp side by side on the same model and thread count, and prints one JSON
# object with both sides and the ratios (Tandem / llama.cpp; above 1 means Tandem is faster).
#
#   scripts/bench-vs-llamacpp.sh [--threads N] [--model PATH] [--precision fast|reference] [--rounds N] [--cpu avx2]
#                                [--tandem BIN]
#
# --rounds N measures both sides N times, alternating which goes first, and reports each figure's best (default 1).
# --precision is Tandem's (`reference` by default: f32 activations; `fast`: 8-bit activations in matmuls over
# quantized weights, as llama.cpp computes them).
# --cpu avx2 runs both sides as on a CPU without AVX-512: Tandem with `TANDEM_CPU=avx2` (its AVX2 kernels), llama.cpp
# built for AVX2 + FMA + F16C only (`LLAMA_CPP_CPU=avx2 scripts/llama-cpp.sh`, a build of its own).
# --tandem BIN measures that tandem binary (an earlier build kept aside, say) instead of building this checkout's.
#
# llama.cpp is built once by scripts/llama-cpp.sh (from the source package of llama-cpp-python on PyPI, cached
# under $TANDEM_HOME/llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."

threads=$(nproc)
model=""
precision=reference
rounds=1
cpu=native
tandem=""
while [ $# -gt 0 ]; do
  case "$1" in
    --threads) threads=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --precision) precision=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --cpu) cpu=$2; shift 2 ;;
    --tandem) tandem=$2; shift 2 ;;
    *) echo "usage: $0 [--threads N] [--model PATH] [--precision fast|reference] [--rounds N] [--cpu avx2]" \
      "[--tandem BIN]" >&2
      exit 2 ;;
  esac
done

case "$cpu" in
  native) ;;
  avx2) export TANDEM_CPU=avx2 LLAMA_CPP_CPU=avx2 ;;
  *) echo "--cpu is native or avx2, not $cpu" >&2; exit 2 ;;
esac
bin=$(scripts/llama-cpp.sh llama-bench llama-batched-bench)

if [ -z "$tandem" ]; then
  cargo build --release --quiet -p tandem >&2
  tandem=target/release/tandem
fi
if [ -z "$model" ]; then
  model=$("$tandem" model path)
fi

# Each round measures both sides, Tandem first in odd rounds and llama.cpp first in even ones; every figure is the
# best of its rounds (a shared VM's noise only slows a run down, and its speed drifts over minutes, so one side
# measured minutes after the other can be caught in a slower spell).
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
ours() {
  echo "tandem: bench engine, $threads threads, $precision precision (round $1)" >&2
  "$tandem" bench engine --model "$model" --threads "$threads" --precision "$precision" --json > "$out/ours.$1"
  echo "tandem: bench engine --concurrency 4,16 (through the scheduler), $threads threads, $precision precision" \
    "(round $1)" >&2
  "$tandem" bench engine --model "$model" --threads "$threads" --precision "$precision" --concurrency 4,16 --json \
    > "$out/conc.$1"
}
theirs() {
  echo "llama.cpp: llama-bench -p 512 -n 128, $threads threads (round $1)" >&2
  "$bin/llama-bench" -m "$model" -t "$threads" -p 512 -n 128 -o json 2>/dev/null > "$out/bench.$1"
  echo "llama.cpp: llama-batched-bench -npp 128 -ntg 128 -npl 1,4,16, $threads threads (round $1)" >&2
  "$bin/llama-batched-bench" -m "$model" -t "$threads" -c 4096 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,4,16 \
    2>/dev/null > "$out/batched.$1"
}
for round in $(seq 1 "$rounds"); do
  if [ $((round % 2)) -eq 1 ]; then ours "$round"; theirs "$round"; else theirs "$round"; ours "$round"; fi
done

OUT="$out" CPU="$cpu" ROUNDS="$rounds" THREADS="$threads" PRECISION="$precision" python3 - <<'PY'
import json, os
out, rounds = os.environ["OUT"], range(1, int(os.environ["ROUNDS"]) + 1)
read = lambda name, r: open(f"{out}/{name}.{r}").read()
runs = [json.loads(read("ours", r)) for r in rounds]
concs = [json.loads(read("conc", r))["concurrency"] for r in rounds]
# Tandem's figures, each the best of the rounds.
ours = runs[0]
ours["prefill_tokens_per_s"] = max(r["prefill_tokens_per_s"] for r in runs)
for i, d in enumerate(ours["decode"]):
    d["tokens_per_s"] = max(r["decode"][i]["tokens_per_s"] for r in runs)
ours["scheduler"] = concs[0]
for i, c in enumerate(ours["scheduler"]):
    c["decode_tokens_per_s"] = max(r[i]["decode_tokens_per_s"] for r in concs)
    c["all_first_tokens_ms"] = min(r[i]["all_first_tokens_ms"] for r in concs)
pp = tg = 0.0
batched = {}
for r in rounds:
    bench = json.loads(read("bench", r))
    pp = max(pp, next(x["avg_ts"] for x in bench if x["n_prompt"] == 512 and x["n_gen"] == 0))
    tg = max(tg, next(x["avg_ts"] for x in bench if x["n_gen"] == 128 and x["n_prompt"] == 0))
    # llama-batched-bench prints a markdown table: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | ...
    for line in read("batched", r).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0].isdigit():
            batched[int(cells[2])] = max(batched.get(int(cells[2]), 0.0), float(cells[7]))
theirs = {"prefill_tokens_per_s": pp, "tg128_tokens_per_s": tg,
          "decode": [{"batch": b, "tokens_per_s": t} for b, t in sorted(batched.items())]}
ratios = {"prefill": ours["prefill_tokens_per_s"] / pp}
for d in ours["decode"]:
    if d["batch"] in batched:
        ratios[f"decode_batch_{d['batch']}"] = d["tokens_per_s"] / batched[d["batch"]]
for c in ours["scheduler"]:
    if c["sequences"] in batched:
        ratios[f"scheduler_concurrency_{c['sequences']}"] = c["decode_tokens_per_s"] / batched[c["sequences"]]
print(json.dumps({"threads": int(os.environ["THREADS"]), "cpu": os.environ["CPU"], "precision": os.environ["PRECISION"], "rounds": len(rounds), "tandem": ours, "llama_cpp": theirs, "ratios": ratios}, indent=1))
PY
