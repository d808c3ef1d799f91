#!/usr/bin/env python3
"""Checks deploy/ offline: every Kubernetes overlay renders (`kubectl kustomize`), validates strictly against the
bundled schemas (`kubernetes-validate --strict`; cert-manager's custom resources left out), and keeps the
invariants operators check first; the YAML files pass yamllint and the Dockerfile hadolint, and every stage of
the Dockerfile builds from a fresh clone.

    pip install -r deploy/requirements.txt && python3 scripts/deploy/check.py

Prints each problem and exits 1 when there is any."""

import os
import subprocess
import sys
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OVERLAYS = ["cpu", "gpu", "cert-manager", "autoscaling"]
ROLES = ["router", "prefill", "decode"]
# The worker's drain (TANDEM_SHUTDOWN_GRACE_MS in the base) must end before Kubernetes kills the pod.
WORKER_DRAIN_S = 30

problems = []


def problem(where, what):
    problems.append(f"{where}: {what}")


def render(overlay):
    out = subprocess.run(["kubectl", "kustomize", os.path.join(ROOT, "deploy/k8s/overlays", overlay)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        problem(overlay, f"kubectl kustomize failed: {out.stderr.strip()}")
        return []
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def validate(overlay, docs):
    core = [d for d in docs if not d["apiVersion"].startswith("cert-manager.io/")]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump_all(core, f)
    out = subprocess.run(["kubernetes-validate", "--strict", "--quiet", f.name], capture_output=True, text=True)
    os.unlink(f.name)
    if out.returncode != 0:
        problem(overlay, f"kubernetes-validate --strict: {out.stdout.strip()} {out.stderr.strip()}")


def component(labels):
    return (labels or {}).get("app.kubernetes.io/component")


def env(container, name):
    return next((e.get("value") for e in container.get("env", []) if e["name"] == name), None)


def check(overlay, docs):
    kinds = {}
    for d in docs:
        kinds.setdefault(d["kind"], []).append(d)
    deployments = {component(d["spec"]["template"]["metadata"]["labels"]): d for d in kinds.get("Deployment", [])}
    if sorted(deployments) != sorted(ROLES):
        problem(overlay, f"one Deployment per role, found {sorted(deployments)}")
    for role, d in deployments.items():
        where = f"{overlay}/Deployment/{d['metadata']['name']}"
        pod = d["spec"]["template"]
        spec = pod["spec"]
        if d["spec"]["selector"]["matchLabels"].items() - pod["metadata"]["labels"].items():
            problem(where, "the selector does not match the pod labels")
        if pod["metadata"].get("annotations", {}).get("prometheus.io/scrape") != "true":
            problem(where, "no Prometheus scrape annotation")
        if not spec.get("topologySpreadConstraints"):
            problem(where, "no topology spread across nodes")
        for c in spec["containers"]:
            for probe in ["startupProbe", "readinessProbe", "livenessProbe"]:
                if probe not in c:
                    problem(where, f"container {c['name']} has no {probe}")
            for p in c.get("ports", []):
                if p["containerPort"] == 9100 and p.get("protocol") != "UDP":
                    problem(where, "port 9100 (QUIC) is not UDP")
            for m in c.get("volumeMounts", []):
                if "subPath" in m:
                    problem(where, f"{m['name']} is mounted with subPath: updates would never arrive")
            resources = c.get("resources", {})
            requests, limits = resources.get("requests", {}), resources.get("limits", {})
            if overlay == "gpu" and role != "router":
                if requests.get("nvidia.com/gpu") is None or requests.get("nvidia.com/gpu") != limits.get("nvidia.com/gpu"):
                    problem(where, f"GPU requests must equal limits: {requests} / {limits}")
                # The overlay for GPU nodes (and those over it) computes on the GPU it reserves.
                if not (env(c, "TANDEM_ENGINE") or "").startswith("cuda"):
                    problem(where, f"a worker on a GPU node with TANDEM_ENGINE {env(c, 'TANDEM_ENGINE')!r}")
            if env(c, "TANDEM_ROLE") and env(c, "TANDEM_ROLE") != role:
                problem(where, f"TANDEM_ROLE {env(c, 'TANDEM_ROLE')} in the {role} Deployment")
        if role != "router" and spec.get("terminationGracePeriodSeconds", 30) <= WORKER_DRAIN_S:
            problem(where, "terminationGracePeriodSeconds is not longer than the worker's drain")
    for s in kinds.get("Service", []):
        where = f"{overlay}/Service/{s['metadata']['name']}"
        sel = s["spec"].get("selector", {})
        if not any(sel.items() <= d["spec"]["template"]["metadata"]["labels"].items() for d in deployments.values()):
            problem(where, f"the selector {sel} matches no pod template")
        for p in s["spec"].get("ports", []):
            if p["port"] == 9100 and p.get("protocol") != "UDP":
                problem(where, "port 9100 (QUIC) is not UDP")
        if component(sel) in ("prefill", "decode") and s["spec"].get("clusterIP") != "None":
            problem(where, "a worker role's Service must be headless (the router resolves every pod)")
    router = deployments.get("router")
    if router:
        workers = env(router["spec"]["template"]["spec"]["containers"][0], "TANDEM_WORKERS") or ""
        names = {w.rsplit(":", 1)[0] for w in workers.split(",") if w}
        headless = {s["metadata"]["name"] for s in kinds.get("Service", []) if s["spec"].get("clusterIP") == "None"}
        if names != headless:
            problem(overlay, f"the router follows {sorted(names)}, the headless Services are {sorted(headless)}")
    exported = open(os.path.join(ROOT, "router/src/metrics.rs")).read()
    for h in kinds.get("HorizontalPodAutoscaler", []):
        where = f"{overlay}/HorizontalPodAutoscaler/{h['metadata']['name']}"
        target = h["spec"]["scaleTargetRef"]["name"]
        if not any(d["metadata"]["name"] == target for d in kinds.get("Deployment", [])):
            problem(where, f"scales {target}, which is not rendered")
        for m in h["spec"]["metrics"]:
            name = m.get("external", {}).get("metric", {}).get("name", "")
            if f'"{name}"' not in exported:
                problem(where, f"scales on {name}, which the router does not export")
    budgets = [component(p["spec"]["selector"]["matchLabels"]) for p in kinds.get("PodDisruptionBudget", [])]
    if sorted(budgets) != sorted(ROLES):
        problem(overlay, f"one PodDisruptionBudget per role, found {sorted(budgets)}")


def lint():
    out = subprocess.run(["yamllint", "-c", os.path.join(ROOT, "deploy/.yamllint.yaml"),
                          os.path.join(ROOT, "deploy"), os.path.join(ROOT, "tests/compose")],
                         capture_output=True, text=True)
    if out.returncode != 0:
        problem("yamllint", out.stdout.strip())
    out = subprocess.run(["hadolint", "--config", os.path.join(ROOT, "deploy/docker/.hadolint.yaml"),
                          os.path.join(ROOT, "deploy/docker/Dockerfile")], capture_output=True, text=True)
    if out.returncode != 0:
        problem("hadolint", out.stdout.strip())


def dockerfile_sources():
    """The classic builder (docker-compose v1, DOCKER_BUILDKIT=0) builds every stage before the target, used or not:
    each stage's COPY must find its sources in a fresh clone."""
    path = os.path.join(ROOT, "deploy/docker/Dockerfile")
    with open(path) as f:
        text = f.read().replace("\\\n", " ")
    for line in text.splitlines():
        words = line.split()
        if not words or words[0].upper() not in ("COPY", "ADD"):
            continue
        args = words[1:]
        if any(a.startswith("--from") for a in args):
            continue
        for src in [a for a in args if not a.startswith("--")][:-1]:
            tracked = subprocess.run(["git", "-C", ROOT, "ls-files", "--", src], capture_output=True, text=True)
            if not tracked.stdout.strip():
                problem("Dockerfile", f"{words[0]} {src}: not in a fresh clone (the classic builder builds this stage)")


def main():
    for overlay in OVERLAYS:
        docs = render(overlay)
        if docs:
            validate(overlay, docs)
            check(overlay, docs)
    lint()
    dockerfile_sources()
    for p in problems:
        print(p)
    if problems:
        sys.exit(1)
    print(f"deploy/ checks passed: {', '.join(OVERLAYS)} rendered, validated and checked; yamllint and hadolint clean")


if __name__ == "__main__":
    main()
