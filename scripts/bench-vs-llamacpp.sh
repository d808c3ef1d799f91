#!/usr/bin/env bash
# Measures Tandem's engine and llama.cpp side by side on the same model and thread count, and prints one JSON
# object with both sides and the ratios (Tandem / llama.cpp; above 1 means Tandem is faster).
#
#   scripts/bench-vs-llamacpp.sh [--threads N] [--model PATH] [--precision fast|reference]
#
# --precision is Tandem's (`reference` by default: f32 activations; `fast`: 8-bit activations in matmuls over
# quantized weights, as llama.cpp computes them: every step where the CPU has AVX-512 VNNI, decode steps elsewhere).
#
# llama.cpp is built once by scripts/llama-cpp.sh (from the source package of llama-cpp-python on PyPI, cached
# under $TANDEM_HOME/llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."

threads=$(nproc)
model=""
precision=reference
while [ $# -gt 0 ]; do
  case "$1" in
    --threads) threads=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --precision) precision=$2; shift 2 ;;
    *) echo "usage: $0 [--threads N] [--model PATH] [--precision fast|reference]" >&2; exit 2 ;;
  esac
done

bin=$(scripts/llama-cpp.sh llama-bench llama-batched-bench)

cargo build --release --quiet -p tandem >&2
tandem=target/release/tandem
if [ -z "$model" ]; then
  model=$("$tandem" model path)
fi

echo "tandem: bench engine, $threads threads, $precision precision" >&2
ours=$("$tandem" bench engine --model "$model" --threads "$threads" --precision "$precision" --json)
echo "tandem: bench engine --concurrency 4,16 (through the scheduler), $threads threads, $precision precision" >&2
conc=$("$tandem" bench engine --model "$model" --threads "$threads" --precision "$precision" --concurrency 4,16 --json)
echo "llama.cpp: llama-bench -p 512 -n 128, $threads threads" >&2
bench=$("$bin/llama-bench" -m "$model" -t "$threads" -p 512 -n 128 -o json 2>/dev/null)
echo "llama.cpp: llama-batched-bench -npp 128 -ntg 128 -npl 1,4,16, $threads threads" >&2
batched=$("$bin/llama-batched-bench" -m "$model" -t "$threads" -c 4096 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,4,16 2>/dev/null)

OURS="$ours" CONC="$conc" BENCH="$bench" BATCHED="$batched" THREADS="$threads" PRECISION="$precision" python3 - <<'PY'
import json, os
ours = json.loads(os.environ["OURS"])
ours["scheduler"] = json.loads(os.environ["CONC"])["concurrency"]
bench = json.loads(os.environ["BENCH"])
pp = next(r["avg_ts"] for r in bench if r["n_prompt"] == 512 and r["n_gen"] == 0)
tg = next(r["avg_ts"] for r in bench if r["n_gen"] == 128 and r["n_prompt"] == 0)
# llama-batched-bench prints a markdown table: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | ...
batched = {}
for line in os.environ["BATCHED"].splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) >= 8 and cells[0].isdigit():
        batched[int(cells[2])] = float(cells[7])
theirs = {"prefill_tokens_per_s": pp, "tg128_tokens_per_s": tg,
          "decode": [{"batch": b, "tokens_per_s": t} for b, t in sorted(batched.items())]}
ratios = {"prefill": ours["prefill_tokens_per_s"] / pp}
for d in ours["decode"]:
    if d["batch"] in batched:
        ratios[f"decode_batch_{d['batch']}"] = d["tokens_per_s"] / batched[d["batch"]]
for c in ours["scheduler"]:
    if c["sequences"] in batched:
        ratios[f"scheduler_concurrency_{c['sequences']}"] = c["decode_tokens_per_s"] / batched[c["sequences"]]
print(json.dumps({"threads": int(os.environ["THREADS"]), "precision": os.environ["PRECISION"], "tandem": ours, "llama_cpp": theirs, "ratios": ratios}, indent=1))
PY
