#!/usr/bin/env bash
# Prepares what the GPU machine's check needs, here (it has no Rust toolchain, no network, and 64 MiB carried):
# a stripped `tandem` built with the CUDA backend, the synthetic model's fingerprint, and the CPU reference logits
# on that model. Writes target/device/; then, with the device tool:
#   run(command="scripts/device/check.sh target/device", carry=["target/device"])
# CANDIDATE=REF (a commit or branch) also builds that commit's binary into target/device/candidate/, so that one
# device run checks and times both side by side (check.sh runs it after this checkout's).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=target/device
SEED=${SEED:-1}
mkdir -p "$OUT"
cargo build --release -p tandem --features cuda
strip -o "$OUT/tandem" target/release/tandem
# The synthetic model is made on both machines from the seed (the same bytes); only its fingerprint travels.
"$OUT/tandem" model synth --seed "$SEED" --out "$OUT/synth.gguf" | awk '{print $2}' > "$OUT/synth.fingerprint"
"$OUT/tandem" model parity --model "$OUT/synth.gguf" --write "$OUT/parity.bin"
rm "$OUT/synth.gguf"
echo "$SEED" > "$OUT/seed"
rm -rf "$OUT/candidate"
if [ -n "${CANDIDATE:-}" ]; then
    tree=target/candidate-tree
    rm -rf "$tree"
    git worktree prune
    git worktree add --detach "$tree" "$CANDIDATE"
    (cd "$tree" && CARGO_TARGET_DIR=../candidate-build cargo build --release -p tandem --features cuda)
    mkdir -p "$OUT/candidate"
    strip -o "$OUT/candidate/tandem" target/candidate-build/release/tandem
    git -C "$tree" log -1 --format='%h %s' > "$OUT/candidate/commit"
    git worktree remove --force "$tree"
fi
du -sh "$OUT"
size=$(du -sb "$OUT" | cut -f1)
if [ "$size" -gt $((60 * 1024 * 1024)) ]; then
    echo "target/device is $size bytes: over what the device tool carries" >&2
    exit 1
fi
