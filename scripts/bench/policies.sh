#!/usr/bin/env bash
# Routing policies on the committed Mooncake sample, each on a fresh 8+8 mock cluster (docs/performance.md).
# Builds the release binary first; arguments go to scripts/bench/policies.py (--help).
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p tandem
exec python3 scripts/bench/policies.py --tandem target/release/tandem "$@"
