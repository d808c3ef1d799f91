#!/usr/bin/env bash
# Makes the two public bases deploy/docker/Dockerfile names (RUNTIME_IMAGE and RUST_IMAGE) on a machine that
# cannot pull them, so that the image builds from source there exactly as it would anywhere else:
#
#   - the runtime base: a minimal Debian root made by `debootstrap` from the machine's own Debian mirror, imported
#     with `docker import`;
#   - the Rust base: that root with gcc and libc6-dev from the same mirror, and this machine's Rust toolchain
#     (`rustc --print sysroot`) in /usr/local/rust. Its version must be the one the image's tag names.
#
# Certificate authorities this machine adds to its own trust (/usr/local/share/ca-certificates, such as an
# egress proxy's) are placed in the root too, so crates.io, PyPI and the Debian mirror are reached from inside
# the build as from the machine. The images are tagged with the public names (that is the point: the
# Dockerfile's defaults and `docker compose up` resolve to them); `docker rmi` them before pulling the real ones.
#
#   deploy/docker/stand-in-bases.sh        # needs root (debootstrap), docker, rustc; a few minutes
set -euo pipefail
cd "$(dirname "$0")/../.."

default_of() { sed -n "s/^ARG $1=//p" deploy/docker/Dockerfile; }
runtime_image=$(default_of RUNTIME_IMAGE)
rust_image=$(default_of RUST_IMAGE)
suite=${runtime_image##*:}
suite=${suite%-slim}

# The toolchain must be the one the tag promises (rust:1.95-... holds 1.95.x).
wanted=${rust_image#*:}
wanted=${wanted%%-*}
have=$(rustc --version | awk '{print $2}')
case "$have" in
    "$wanted" | "$wanted".*) ;;
    *) echo "rustc $have here, but $rust_image promises $wanted" >&2; exit 1 ;;
esac

# The first Debian mirror this machine's apt uses (deb822 or one-line sources), else Debian's own.
mirror=$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | grep -v security | head -1 || true)
if [ -z "$mirror" ]; then
    mirror=$(awk '$1 == "deb" && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
fi
mirror=${mirror:-http://deb.debian.org/debian}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

root="$work/root"
debootstrap --variant=minbase "$suite" "$root" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
mkdir -p "$root/usr/local/share/ca-certificates"
cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2>/dev/null || true
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb "$root"/usr/share/doc/* \
    "$root"/usr/share/man/* "$root"/usr/share/locale/*
tar -C "$root" -c . | docker import -c 'CMD ["bash"]' - "$runtime_image" >/dev/null
echo "$runtime_image"

ctx="$work/rust"
mkdir -p "$ctx/rust"
sysroot=$(rustc --print sysroot)
# The compiler, cargo and the standard library; not the documentation (share/).
for part in bin lib libexec etc; do
    [ -d "$sysroot/$part" ] && cp -r "$sysroot/$part" "$ctx/rust/"
done
cat >"$ctx/Dockerfile" <<EOF
FROM $runtime_image
RUN apt-get update \\
    && apt-get install -y --no-install-recommends gcc libc6-dev ca-certificates \\
    && rm -rf /var/lib/apt/lists/*
COPY rust /usr/local/rust
ENV CARGO_HOME=/usr/local/cargo PATH=/usr/local/cargo/bin:/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
EOF
DOCKER_BUILDKIT=0 docker build -q -t "$rust_image" "$ctx" >/dev/null
echo "$rust_image"
