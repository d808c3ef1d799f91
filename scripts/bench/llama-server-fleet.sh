#!/usr/bin/env bash
# Tandem's router in front of llama.cpp servers it does not own: N `llama-server` processes on the embedded model
# (prompt caching on, as by default), `tandem router --external-workers` in front, and `tandem bench serve` with
# a shared-prefix workload under each routing policy. Every policy gets fresh servers (empty caches) and the same
# arrivals. Prints one line per policy: TTFT p50/p90 and the prompt tokens llama.cpp served from its cache (its
# own `timings.cache_n`, passed through as `usage.prompt_tokens_details.cached_tokens`).
#
#   scripts/bench/llama-server-fleet.sh [--servers N] [--threads T] [--requests R] [--rate RPS] [--prefixes K]
#                                       [--cache-ram MIB] [--policies kv,round_robin,least_loaded] [--out DIR]
#
# llama-server is built once by scripts/llama-cpp.sh. Defaults: 2 servers of 1 thread each, 40 requests at 0.25/s,
# 4 prefixes of 256 tokens (Zipf 1), 64-token suffixes, 16 output tokens; llama-server's own prompt cache in host
# memory (`--cache-ram`) as it ships (8 GiB: every server soon holds every prefix). A smaller one makes the
# servers' cache capacity scarce, as long prompts make it in production.
set -euo pipefail
cd "$(dirname "$0")/../.."

servers=2 threads=1 requests=40 rate=0.25 prefixes=4 cache_ram="" policies=kv,round_robin,least_loaded out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --servers) servers=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --requests) requests=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --prefixes) prefixes=$2; shift 2 ;;
    --cache-ram) cache_ram=$2; shift 2 ;;
    --policies) policies=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "usage: $0 [--servers N] [--threads T] [--requests R] [--rate RPS] [--prefixes K] [--cache-ram MIB]" \
         "[--policies P,...] [--out DIR]" >&2
       exit 2 ;;
  esac
done

server="$(scripts/llama-cpp.sh llama-server)/llama-server"
cargo build --release --quiet -p tandem >&2
tandem=target/release/tandem
model=$("$tandem" model path)
work=$(mktemp -d)
out=${out:-$work/out}
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
"$tandem" certs init --dir "$work/certs" --components router >/dev/null

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 1 600); do "$tandem" probe --timeout-ms 500 "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done; return 1; }

for policy in ${policies//,/ }; do
  pids=()
  urls=()
  for _ in $(seq 1 "$servers"); do
    port=$(free_port)
    "$server" -m "$model" --host 127.0.0.1 --port "$port" -c 8192 -np 1 -t "$threads" --metrics \
      ${cache_ram:+--cache-ram "$cache_ram"} >/dev/null 2>&1 &
    pids+=($!)
    urls+=("http://127.0.0.1:$port")
    wait_http "http://127.0.0.1:$port/health"
  done
  printf '[scheduler]\npolicy = "%s"\n' "$policy" > "$work/router.toml"
  rport=$(free_port)
  "$tandem" router --config "$work/router.toml" --listen "127.0.0.1:$rport" --certs-dir "$work/certs" \
    --external-workers "$(IFS=,; echo "${urls[*]}")" >"$work/router-$policy.log" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$rport/ready"
  mkdir -p "$out/$policy"
  "$tandem" bench serve --url "http://127.0.0.1:$rport" --endpoint completions --rate "$rate" \
    --max-requests "$requests" --prefixes "$prefixes" --prefix-len 256 --suffix-len 64 --output-len 16 --ignore-eos \
    --trace-block-size 64 --seed 1 --quiet --json --out "$out/$policy" > "$out/$policy/stdout.json"
  python3 - "$policy" "$out/$policy/summary.json" "$servers" "$prefixes" "$cache_ram" <<'PY'
import json, sys
policy, path, servers = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = json.load(open(path))
print(json.dumps({"policy": policy, "servers": servers, "prefixes": int(sys.argv[4]), "cache_ram_mib": sys.argv[5] or None, "requests": s["requests"], "failed": s["failed"],
                  "ttft_ms_p50": round(s["time_to_first_token_ms"]["p50"], 1),
                  "ttft_ms_p90": round(s["time_to_first_token_ms"]["p90"], 1),
                  "cached_token_fraction": round(s["cached_token_fraction"], 3), "valid": s["valid"]}))
PY
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
done
