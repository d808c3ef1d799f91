#!/usr/bin/env bash
# The simulator against a real mock cluster on the same trace sample (docs/simulation.md).
# Builds the release binary first; arguments go to scripts/bench/sim_vs_cluster.py (--help).
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p tandem
exec python3 scripts/bench/sim_vs_cluster.py --tandem target/release/tandem "$@"
