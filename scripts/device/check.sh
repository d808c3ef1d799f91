#!/usr/bin/env bash
# The CUDA backend's check on the GPU machine, from what scripts/device/prepare.sh wrote (DIR, default
# target/device): the synthetic model made here from the same seed (its fingerprint must match); for each CUDA
# forward pass in FORWARDS (default "plain fused graphs graphs-mv graphs-mv-tc", TANDEM_CUDA_FORWARD), the parity of its logits
# with the CPU reference's on fixed steps (the exit status), `generate` against the CPU's tokens, and its prefill
# and decode speed; a profile of the fused passes' device time by kernel; a cluster on the GPU (`tandem up
# --engine cuda:0` with CLUSTER_FORWARD's pass, default graphs) serving one completion; then PyTorch on the same
# weights (scripts/device/torch_speed.py; TORCH=0 leaves it out). Results under $OUT (the device tool's folder) or
# DIR/out, the log in check.txt. The whole ran in 137 s on an H100 with the first pass alone, PyTorch included;
# the limits now add to more than the device tool's 600 s, of which a few minutes should run. A candidate binary
# (prepare.sh's CANDIDATE) is checked and timed the same way after this checkout's (265 s more of limits, about
# 30 s of running). docs/cuda.md.
set -uo pipefail
DIR=${1:-target/device}
RESULTS=${OUT:-$DIR/out}
FORWARDS=${FORWARDS:-plain fused graphs graphs-mv graphs-mv-tc}
mkdir -p "$RESULTS"
T="$DIR/tandem"
# CUDA's libraries where the machine keeps them: a toolkit, or the nvidia-* wheels next to PyTorch.
for d in /usr/local/cuda/lib64 $(python3 -c "import nvidia, os, glob
for b in nvidia.__path__:
    print(' '.join(glob.glob(os.path.join(b, '*', 'lib'))))" 2>/dev/null); do
    [ -d "$d" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" RUST_BACKTRACE=1
# Seconds since the check began, before each part: where the minutes go, to plan the next run.
t0=$(date +%s)
part() { echo "== [$(($(date +%s) - t0)) s] $*"; }
# How many leading tokens two `tandem generate --json` outputs share: same_tokens A B "A's name" "B's name".
same_tokens() {
    python3 -c "import json, sys
try:
    a, b = (json.load(open(f))['token_ids'] for f in sys.argv[1:3])
except (OSError, ValueError, KeyError) as e:
    sys.exit(f'no comparison: {e!r}')
same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
print(f'{len(a)} tokens {sys.argv[3]}, {len(b)} {sys.argv[4]}; the first {same} the same (random weights: small margins)')" "$@"
}
{
    part "machine"
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm,clocks.max.mem --format=csv 2>&1 | head -5
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    # Which CUDA libraries the loader will find, and their versions.
    ldconfig -p 2>/dev/null | grep -E "libcuda\.so|libnvrtc\.so|libcublas\.so" | head -6
    for d in ${LD_LIBRARY_PATH//:/ }; do ls "$d" 2>/dev/null | grep -E "^lib(nvrtc|cublas)\.so" | sed "s|^|$d/|"; done
    part "synthetic model (seed $(cat "$DIR/seed"))"
    got=$("$T" model synth --seed "$(cat "$DIR/seed")" --out "$RESULTS/synth.gguf" | awk '{print $2}') || exit 1
    want=$(cat "$DIR/synth.fingerprint")
    if [ "$got" != "$want" ]; then
        echo "FAIL: the synthetic model differs from the one the reference was computed on ($got, expected $want)"
        exit 1
    fi
    echo "same bytes as the reference's model: $got"
    prompt=$(printf 'word %.0s' $(seq 300))
    timeout 60 "$T" generate --model "$RESULTS/synth.gguf" --device cpu --max-tokens 32 --prefill-chunk 64 \
        --json "$prompt" > "$RESULTS/generate-cpu.json"
    status=0
    # Each forward pass of the CUDA backend (TANDEM_CUDA_FORWARD, docs/cuda.md), one after the other: parity with
    # the CPU reference (the exit status: the check fails when any pass's parity does), the engine's scheduler
    # over it (tandem generate, greedy, a chunked prompt) against the CPU's tokens, then its speed. The 4,096-token
    # prefill is timed for the passes whose prefill differs (graphs and graphs-mv change decode steps only;
    # graphs-mv-tc puts prompts' attention on tensor cores).
    for forward in $FORWARDS; do
        export TANDEM_CUDA_FORWARD=$forward
        part "$forward: parity with the CPU reference"
        timeout 60 "$T" model parity --model "$RESULTS/synth.gguf" --check "$DIR/parity.bin" --device cuda:0
        got=$?
        [ "$got" = 0 ] || status=$got
        part "$forward: tandem generate on the GPU against the CPU"
        timeout 60 "$T" generate --model "$RESULTS/synth.gguf" --device cuda:0 --max-tokens 32 --prefill-chunk 64 \
            --json "$prompt" > "$RESULTS/generate-$forward.json"
        echo "exit $?"
        same_tokens "$RESULTS/generate-$forward.json" "$RESULTS/generate-cpu.json" "on the GPU ($forward)" "on the CPU"
        part "$forward: speed on the synthetic model (SmolLM2-135M's shapes)"
        if [ "$forward" = plain ] || [ "$forward" = fused ] || [ "$forward" = graphs-mv-tc ]; then
            timeout 45 "$T" bench engine --model "$RESULTS/synth.gguf" --device cuda:0 --prompt-tokens 4096 \
                --batches 1 --decode-tokens 16 --json | tee "$RESULTS/speed-4096-$forward.json"
        fi
        timeout 90 "$T" bench engine --model "$RESULTS/synth.gguf" --device cuda:0 --prompt-tokens 512 \
            --batches 1,16,64,256 --json | tee "$RESULTS/speed-512-$forward.json"
    done
    # Where the device time goes, kernel by kernel (TANDEM_CUDA_PROFILE: an event around every launch, graphs off):
    # a 4,096-token prompt and batch-1 decode, through the matmuls and through the matrix-vector kernels, and the
    # prompt's attention on tensor cores.
    for forward in fused graphs-mv graphs-mv-tc; do
        case " $FORWARDS " in *" $forward "*) ;; *) continue ;; esac
        part "$forward: the device time by kernel (TANDEM_CUDA_PROFILE=1)"
        TANDEM_CUDA_PROFILE=1 TANDEM_CUDA_FORWARD=$forward timeout 60 "$T" bench engine --model "$RESULTS/synth.gguf" \
            --device cuda:0 --prompt-tokens 4096 --decode-prompt-tokens 512 --batches 1 --decode-tokens 32 --json
    done
    part "${CLUSTER_FORWARD:=graphs}: a cluster on the GPU (tandem up --engine cuda:0, a prefill and a decode worker)"
    # The workers' own path: the engine's scheduler in a worker process, the KV export a decode worker pulls, the
    # router in front. The same prompt and greedy tokens as `generate`, through the OpenAI API.
    TANDEM_CUDA_FORWARD=$CLUSTER_FORWARD "$T" up --engine cuda:0 --model "$RESULTS/synth.gguf" --prefill 1 \
        --decode 1 --port 18080 > "$RESULTS/up.log" 2>&1 &
    up=$!
    for _ in $(seq 90); do curl -sf localhost:18080/v1/models > "$RESULTS/models.json" && break; sleep 1; done
    served=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['data'][0]['id'])" "$RESULTS/models.json")
    timeout 60 curl -s localhost:18080/v1/completions -H 'content-type: application/json' \
        -d "{\"model\": \"$served\", \"prompt\": \"$prompt\", \"max_tokens\": 32, \"temperature\": 0}" \
        > "$RESULTS/up-completion.json"
    python3 -c "import json, sys
got = json.load(open(sys.argv[1]))
want = json.load(open(sys.argv[2]))
text = got['choices'][0]['text']
print(f\"cluster: {got['usage']}, the same text as generate on the CPU: {text == want.get('text')}\")" \
        "$RESULTS/up-completion.json" "$RESULTS/generate-cpu.json" || head -c 600 "$RESULTS/up-completion.json"
    # Whether the prompt went through a prefill worker and its KV to the decode worker (reason prefill_remote).
    curl -s localhost:18080/metrics | grep -E "^tandem_router_decisions_total"
    # Stopped, and killed if it has not stopped after 30 s (a hung cluster must not hold the device call).
    kill "$up"
    for _ in $(seq 30); do kill -0 "$up" 2>/dev/null || break; sleep 1; done
    kill -9 "$up" 2>/dev/null
    wait "$up"
    tail -5 "$RESULTS/up.log"
    unset TANDEM_CUDA_FORWARD
    if [ -x "$DIR/candidate/tandem" ]; then
        C="$DIR/candidate/tandem"
        part "the candidate: $(cat "$DIR/candidate/commit" 2>/dev/null) (prepare.sh's CANDIDATE)"
        timeout 60 "$C" model parity --model "$RESULTS/synth.gguf" --check "$DIR/parity.bin" --device cuda:0
        candidate_status=$?
        timeout 60 "$C" generate --model "$RESULTS/synth.gguf" --device cuda:0 --max-tokens 32 --prefill-chunk 64 \
            --json "$prompt" > "$DIR/candidate/generate.json"
        same_tokens "$DIR/candidate/generate.json" "$RESULTS/generate-cpu.json" "from the candidate" "on the CPU"
        timeout 45 "$C" bench engine --model "$RESULTS/synth.gguf" --device cuda:0 --prompt-tokens 4096 --batches 1 \
            --decode-tokens 16 --json
        timeout 60 "$C" bench engine --model "$RESULTS/synth.gguf" --device cuda:0 --prompt-tokens 512 \
            --batches 1,16,64,256 --json
        # The check fails when either binary's parity does.
        [ "$candidate_status" = 0 ] || status=$candidate_status
    fi
    if [ "${TORCH:-1}" = 0 ]; then
        rm -rf "$RESULTS/synth.gguf"
        part "done (PyTorch left out: TORCH=0)"
        exit $status
    fi
    part "speed: PyTorch on the same weights (eager; torch.compile with a static cache)"
    "$T" model export --safetensors "$RESULTS/hf" --model "$RESULTS/synth.gguf" >/dev/null &&
        timeout 60 python3 "$(dirname "$0")/export_parity.py" "$RESULTS/hf" "$DIR/parity.bin" 2>&1 | grep -v Loading
    PYTHONUNBUFFERED=1 timeout 180 python3 "$(dirname "$0")/torch_speed.py" "$RESULTS/hf" \
            --out "$RESULTS/torch.json"
    rm -rf "$RESULTS/synth.gguf" "$RESULTS/hf"
    part "done"
    exit $status
} 2>&1 | tee "$RESULTS/check.txt"
exit "${PIPESTATUS[0]}"
