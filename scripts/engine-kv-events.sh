#!/usr/bin/env bash
# Fetches vLLM's and SGLang's own KV event publishers (the `kv_events.py` of each project's package on PyPI) once,
# and prints the directory that holds them: `vllm/kv_events.py`, `sglang/kv_events.py`. What tests/engine_events.rs
# runs the router's decoder against (scripts/e2e/engine_kv_publisher.py loads them; they need pyzmq and msgspec,
# from scripts/e2e/requirements.txt). Neither engine is installed: only that file is taken out of each package
# (vLLM's source archive, 47 MB; SGLang's wheel, 39 MB), after its sha256 is checked.
#
# Cached under $TANDEM_HOME/engine-kv-events (default ~/.cache/tandem).
set -euo pipefail

home=${TANDEM_HOME:-$HOME/.cache/tandem}
dir="$home/engine-kv-events"
mkdir -p "$dir"

fetch() { # name url sha256 member
  local name=$1 url=$2 sha=$3 member=$4
  [ -f "$dir/$name/kv_events.py" ] && return 0
  echo "fetching $name's KV event publisher (once; cached in $dir)" >&2
  local work
  work=$(mktemp -d)
  curl -fsSL --retry 3 -o "$work/package" "$url"
  echo "$sha  $work/package" | sha256sum -c --quiet - >&2
  mkdir -p "$dir/$name"
  python3 - "$work/package" "$member" "$dir/$name/kv_events.py" <<'PY'
import sys, tarfile, zipfile
package, member, out = sys.argv[1:]
if zipfile.is_zipfile(package):
    data = zipfile.ZipFile(package).read(member)
else:
    data = tarfile.open(package).extractfile(member).read()
open(out, "wb").write(data)
PY
  rm -rf "$work"
}

fetch vllm \
  https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz \
  f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112 \
  vllm-0.33.0/vllm/distributed/kv_events.py
fetch sglang \
  https://files.pythonhosted.org/packages/57/dd/0206d00b2ea5b163bbdd216e91cc4f23ea90fde8620db0a6272d4236b68e/sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl \
  00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937 \
  sglang/srt/disaggregation/kv_events.py
echo "$dir"
