#!/usr/bin/env bash
# Builds llama.cpp's programs once, from the vendored copy in llama-cpp-python's source package on PyPI, and prints
# the directory that holds them. What the comparisons and the external-engine tests run Tandem against.
#
#   scripts/llama-cpp.sh TARGET...        # e.g. llama-server; llama-bench llama-batched-bench
#   LLAMA_CPP_CPU=avx2 scripts/llama-cpp.sh TARGET...   # built for AVX2 + FMA + F16C only (no AVX-512), in a
#                                                       # directory of its own: what a CPU without AVX-512 runs
#
# Cached under $TANDEM_HOME/llama.cpp/<version> (default ~/.cache/tandem); a target already built is not built
# again. Needs python3 with pip and a C++ compiler; cmake and ninja are installed with pip when missing. The first
# llama-server build took 13.6 minutes (17 CPU-minutes) on a 2-core VM with other builds running.
set -euo pipefail

LLAMA_CPP_PYTHON=0.3.36
[ $# -gt 0 ] || { echo "usage: $0 TARGET..." >&2; exit 2; }

home=${TANDEM_HOME:-$HOME/.cache/tandem}
prefix="$home/llama.cpp/$LLAMA_CPP_PYTHON"
# Built for this CPU, but without AMX: on the Sapphire Rapids VMs here (2026-12-02) the kernel grants the tile
# state, yet ggml's AMX matmul faults on its first `ldtilecfg` and llama-bench dies; without AMX it takes its
# AVX-512 VNNI kernels. A build directory of its own, so that a build with AMX is not reused.
build="$prefix/build-noamx"
cpu_flags=(-DGGML_NATIVE=ON)
case "${LLAMA_CPP_CPU:-native}" in
  native) ;;
  avx2)
    build="$prefix/build-avx2"
    cpu_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
      -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF) ;;
  *) echo "LLAMA_CPP_CPU is native or avx2, not ${LLAMA_CPP_CPU}" >&2; exit 2 ;;
esac
bin="$build/bin"

missing=()
for t in "$@"; do
  [ -x "$bin/$t" ] || missing+=("$t")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "building llama.cpp ${missing[*]} (once; cached in $prefix)" >&2
  command -v cmake >/dev/null && command -v ninja >/dev/null || python3 -m pip install --quiet cmake ninja >&2
  if [ ! -f "$prefix/src/CMakeLists.txt" ]; then
    work=$(mktemp -d)
    python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_CPP_PYTHON" \
      -d "$work" >&2
    mkdir -p "$prefix"
    tar -xzf "$work/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$work"
    rm -rf "$prefix/src"
    mv "$work/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp" "$prefix/src"
    rm -rf "$work"
  fi
  no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  cmake -S "$prefix/src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF "${cpu_flags[@]}" -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" >&2
  cmake --build "$build" --target "${missing[@]}" >&2
fi
echo "$bin"
