#!/usr/bin/env python3
"""Prints, as JSON, the pods a Kubernetes overlay would run, as `docker run` needs them: per replica of every
Deployment its Service names (the DNS aliases Kubernetes would give it), image, args, user, environment (with
`fieldRef: metadata.name` resolved to the pod's name, and Secret and ConfigMap references resolved from
`--secret NAME/KEY=VALUE` or dropped when optional), ports, probes (path and port) and volume mounts (with the
Secret or ConfigMap each comes from). tests/k8s_wiring.rs runs them as containers.

    python3 scripts/deploy/pods.py deploy/k8s/overlays/cpu [--secret tandem-keys/admin-key=K ...]
"""

import json
import subprocess
import sys

import yaml


def main():
    overlay = sys.argv[1]
    secrets = {}
    args = sys.argv[2:]
    for i, a in enumerate(args):
        if a == "--secret":
            ref, value = args[i + 1].split("=", 1)
            secrets[ref] = value
    docs = [d for d in yaml.safe_load_all(subprocess.run(["kubectl", "kustomize", overlay], check=True,
                                                         capture_output=True, text=True).stdout) if d]
    services = [d for d in docs if d["kind"] == "Service"]
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    pods = []
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        template = d["spec"]["template"]
        labels = template["metadata"]["labels"]
        aliases = [s["metadata"]["name"] for s in services if s["spec"].get("selector", {}).items() <= labels.items()]
        spec = template["spec"]
        for replica in range(d["spec"].get("replicas", 1)):
            name = f"{d['metadata']['name']}-{replica}"
            (c,) = spec["containers"]
            env = {}
            for e in c.get("env", []):
                if "value" in e:
                    env[e["name"]] = e["value"]
                    continue
                src = e["valueFrom"]
                if "fieldRef" in src and src["fieldRef"]["fieldPath"] == "metadata.name":
                    env[e["name"]] = name
                elif "secretKeyRef" in src or "configMapKeyRef" in src:
                    ref = src.get("secretKeyRef") or src.get("configMapKeyRef")
                    key = f"{ref['name']}/{ref['key']}"
                    data = config_maps.get(ref["name"], {}) if "configMapKeyRef" in src else {}
                    value = secrets.get(key, data.get(ref["key"]))
                    if value is not None:
                        env[e["name"]] = value
                    elif not ref.get("optional"):
                        sys.exit(f"{name}: {key} is not given")
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            mounts = []
            for m in c.get("volumeMounts", []):
                v = volumes[m["name"]]
                source = ("secret", v["secret"]["secretName"]) if "secret" in v else \
                    ("configMap", v["configMap"]["name"]) if "configMap" in v else ("emptyDir", "")
                mounts.append({"path": m["mountPath"], "kind": source[0], "source": source[1],
                               "files": config_maps.get(source[1], {}) if source[0] == "configMap" else {}})
            probes = {}
            ports = {p["name"]: p for p in c.get("ports", [])}
            for kind in ["startupProbe", "readinessProbe", "livenessProbe"]:
                g = c[kind]["httpGet"]
                port = g["port"] if isinstance(g["port"], int) else ports[g["port"]]["containerPort"]
                probes[kind] = f"http://127.0.0.1:{port}{g['path']}"
            sc = spec.get("securityContext", {})
            pods.append({
                "name": name,
                "component": labels["app.kubernetes.io/component"],
                "aliases": aliases,
                "image": c["image"],
                "args": c.get("args", []),
                "user": f"{sc.get('runAsUser', 0)}:{sc.get('runAsGroup', 0)}",
                "env": env,
                "ports": [{"port": p["containerPort"], "protocol": p.get("protocol", "TCP")} for p in c.get("ports", [])],
                "probes": probes,
                "mounts": mounts,
            })
    json.dump(pods, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
