#!/usr/bin/env bash
# Makes sure the Docker Engine answers before the tests that build images and start containers (tests/compose.rs,
# compose_faults.rs, k8s_wiring.rs). Where it does not answer and this shell may start it (root), a daemon that is
# not running is started, and one that hangs is stopped and started again; else it fails with what it saw. It never
# skips anything: a machine without Docker fails the tests that need it.
set -euo pipefail

LOG=/var/log/dockerd-ci.log
answers() { timeout 20 docker info > /dev/null 2>&1; }
ready() { echo "Docker Engine answers: $(docker version --format '{{.Server.Version}}' 2>/dev/null)"; }

if answers; then
    ready
    exit 0
fi
if ! command -v docker > /dev/null; then
    echo "docker is not installed: the container tests need a Docker Engine with Compose" >&2
    exit 1
fi
if [ "$(id -u)" -ne 0 ] || ! command -v dockerd > /dev/null; then
    echo "the Docker Engine does not answer (docker info) and this user cannot start it" >&2
    exit 1
fi

# Stops a dockerd that does not answer, and the containerd it started, so a new one does not wait on the old one's.
stop() {
    pkill -x dockerd || true
    for _ in $(seq 1 15); do pgrep -x dockerd > /dev/null || break; sleep 1; done
    pkill -9 -x dockerd || true
    pkill -9 -f 'containerd --config /var/run/docker/containerd' || true
    sleep 1
    rm -f /var/run/docker.pid /var/run/docker/containerd/containerd.pid
}

for attempt in 1 2; do
    if pgrep -x dockerd > /dev/null; then
        echo "dockerd runs but does not answer: stopping it"
    fi
    stop
    echo "starting the Docker Engine (attempt $attempt)"
    nohup dockerd > "$LOG" 2>&1 &
    for _ in $(seq 1 45); do
        if answers; then
            ready
            exit 0
        fi
        sleep 1
    done
done
echo "the Docker Engine did not answer after two starts; its log:" >&2
tail -20 "$LOG" >&2 || true
exit 1
