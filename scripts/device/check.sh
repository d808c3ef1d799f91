#!/usr/bin/env bash
# The CUDA backend's check on the GPU machine, from what scripts/device/prepare.sh wrote (DIR, default
# target/device): the synthetic model made here from the same seed (its fingerprint must match), then the parity
# of the CUDA backend's logits with the CPU reference's on fixed steps. Results under $OUT (the device tool's
# folder) or DIR/out. docs/cuda.md.
set -uo pipefail
DIR=${1:-target/device}
RESULTS=${OUT:-$DIR/out}
mkdir -p "$RESULTS"
T="$DIR/tandem"
# CUDA's libraries where the machine keeps them: a toolkit, or the nvidia-* wheels next to PyTorch.
for d in /usr/local/cuda/lib64 $(python3 -c "import nvidia, os, glob
for b in nvidia.__path__:
    print(' '.join(glob.glob(os.path.join(b, '*', 'lib'))))" 2>/dev/null); do
    [ -d "$d" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
export LD_LIBRARY_PATH
{
    echo "== machine"
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1 | head -5
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    echo "== synthetic model (seed $(cat "$DIR/seed"))"
    got=$("$T" model synth --seed "$(cat "$DIR/seed")" --out "$RESULTS/synth.gguf" | awk '{print $2}') || exit 1
    want=$(cat "$DIR/synth.fingerprint")
    if [ "$got" != "$want" ]; then
        echo "FAIL: the synthetic model differs from the one the reference was computed on ($got, expected $want)"
        exit 1
    fi
    echo "same bytes as the reference's model: $got"
    echo "== parity with the CPU reference"
    "$T" model parity --model "$RESULTS/synth.gguf" --check "$DIR/parity.bin" --device cuda:0
    status=$?
    rm -f "$RESULTS/synth.gguf"
    exit $status
} 2>&1 | tee "$RESULTS/check.txt"
exit "${PIPESTATUS[0]}"
