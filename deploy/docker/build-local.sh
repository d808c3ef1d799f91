#!/usr/bin/env bash
# Builds Tandem's image on a machine that cannot pull from any registry: a base image made here from nothing
# (`FROM scratch` plus the shared libraries `ldd` lists for the binary, a passwd entry and /tmp), then
# deploy/docker/Dockerfile's `prebuilt` stage on it with an already built `tandem` binary. Seconds, not a build.
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
base="${tag%%:*}-base:local"
DOCKER_BUILDKIT=0 docker build -q -t "$base" "$work" >/dev/null

# A context of its own (the Dockerfile's paths, the binary in place of a build): builds may run side by side.
ctx="$work/context"
mkdir -p "$ctx/deploy/docker/.prebuilt"
cp -r deploy/docker/home deploy/docker/certs "$ctx/deploy/docker/"
cp "$binary" "$ctx/deploy/docker/.prebuilt/tandem"
# Debug symbols are not needed in an image (and would make the context bigger than the binary itself).
strip "$ctx/deploy/docker/.prebuilt/tandem" 2>/dev/null || true
DOCKER_BUILDKIT=0 docker build -q -f deploy/docker/Dockerfile --target prebuilt \
    --build-arg RUNTIME_IMAGE="$base" -t "$tag" "$ctx" >/dev/null
echo "$tag"
