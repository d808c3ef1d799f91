#!/usr/bin/env bash
# Builds Tandem's image on a machine that cannot pull from any registry: a base image made here from nothing
# (`FROM scratch` plus the shared libraries `ldd` lists for the binary, a passwd entry and /tmp), then
# deploy/docker/Dockerfile's `base` stage on it, then an already built `tandem` binary added. Seconds, not a build.
#
#   deploy/docker/build-local.sh [--binary PATH] [--tag NAME]
#
# Defaults: target/release/tandem (build it first: cargo build --release -p tandem), tag tandem:local.
set -euo pipefail
cd "$(dirname "$0")/../.."

binary=target/release/tandem
tag=tandem:local
while [ $# -gt 0 ]; do
    case "$1" in
        --binary) binary="$2"; shift 2 ;;
        --tag) tag="$2"; shift 2 ;;
        *) echo "usage: $0 [--binary PATH] [--tag NAME]" >&2; exit 2 ;;
    esac
done
[ -x "$binary" ] || { echo "$binary: no such binary (cargo build --release -p tandem)" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root="$work/rootfs"
mkdir -p "$root/etc" "$root/tmp"
chmod 1777 "$root/tmp"
# Every library the dynamic loader will open, at the path it will look for it.
for lib in $(ldd "$binary" | grep -o '/[^ ]*'); do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
done
printf 'root:x:0:0:root:/root:/sbin/nologin\ntandem:x:10001:10001:tandem:/var/lib/tandem:/sbin/nologin\n' > "$root/etc/passwd"
printf 'root:x:0:\ntandem:x:10001:\n' > "$root/etc/group"
printf 'hosts: files dns\n' > "$root/etc/nsswitch.conf"
printf 'FROM scratch\nCOPY rootfs/ /\n' > "$work/Dockerfile"
libs="${tag%%:*}-libs:local"
DOCKER_BUILDKIT=0 docker build -q -t "$libs" "$work" >/dev/null

# Contexts of their own (only the paths the stage copies; then the binary): builds may run side by side.
base="${tag%%:*}-base:local"
ctx="$work/context"
mkdir -p "$ctx/deploy/docker"
cp -r deploy/docker/home deploy/docker/certs "$ctx/deploy/docker/"
DOCKER_BUILDKIT=0 docker build -q -f deploy/docker/Dockerfile --target base \
    --build-arg RUNTIME_IMAGE="$libs" -t "$base" "$ctx" >/dev/null
bin="$work/binary"
mkdir -p "$bin"
cp "$binary" "$bin/tandem"
# Debug symbols are not needed in an image (and would make the context bigger than the binary itself).
strip "$bin/tandem" 2>/dev/null || true
printf 'FROM %s\nCOPY tandem /usr/local/bin/tandem\n' "$base" > "$bin/Dockerfile"
DOCKER_BUILDKIT=0 docker build -q -t "$tag" "$bin" >/dev/null
echo "$tag"
