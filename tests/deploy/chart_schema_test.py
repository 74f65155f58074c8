"""Validates the manifests rendered from every ci/ values file, and from variants that switch on
the chart's other branches, against the Kubernetes API schemas (validate_k8s.mjs: npm's
kubernetes-models, Prometheus Operator and KEDA models, strict field names), and decodes the
built-in kinds into kubectl's own Go types (`kubectl set env --local`, no API server needed).

usage: chart_schema_test.py NODE"""
import json
import os
import subprocess
import sys

import chart
import yaml

# Kinds kubectl 1.30 knows (its scheme): core v1 and these API groups.
BUILTIN_GROUPS = {"v1", "apps", "policy", "autoscaling"}
KUBECTL = os.path.join(chart.TOOLS, "bin", "kubectl")

VARIANTS = {
    "cpu-values.yaml": [
        ["model.source=hostPath", "model.hostPath.path=/data/models", "model.path=tiny",
         "worker.podAntiAffinity=soft", "metrics.serviceMonitor.enabled=true",
         "autoscaling.worker.enabled=true", "autoscaling.router.enabled=true"],
        ["autoscaling.engine=hpa", "autoscaling.worker.enabled=true", "worker.podAntiAffinity=hard",
         "podDisruptionBudget.enabled=false", "serviceAccount.create=false",
         "worker.parallel.ep=2", "worker.leaderWorkerSet.enabled=true"],
    ],
    "multinode-lws-values.yaml": [["autoscaling.engine=hpa", "worker.replicas=2"]],
}

chart.need_tools()
node_modules = os.path.join(chart.TOOLS, "node", "node_modules")
validator = os.path.join(os.path.dirname(os.path.abspath(__file__)), "validate_k8s.mjs")
failures = []
all_docs = []
for values in chart.CI_VALUES:
    for sets in [[]] + VARIANTS.get(os.path.basename(values), []):
        try:
            docs = chart.render(values, sets)
        except RuntimeError as e:
            failures.append(str(e))
            continue
        kinds = {d["kind"] for d in docs}
        chart.check({"Deployment", "Service"} <= kinds, f"{values} {sets}: no router", failures)
        print(f"rendered {len(docs)} objects: {os.path.basename(values)} {' '.join(sets)}")
        all_docs += docs
        builtin = [d for d in docs if d["apiVersion"].split("/")[0] in BUILTIN_GROUPS]
        out = subprocess.run([KUBECTL, "set", "env", "--local", "-f", "-", "--dry-run=client",
                              "-o", "name", "MOBIUS_DECODE_CHECK=1"],
                             input=yaml.safe_dump_all(builtin), capture_output=True, text=True)
        decoded = sum(f"/{d['metadata']['name']}" in out.stdout + out.stderr for d in builtin)
        chart.check("unable to decode" not in out.stderr and decoded == len(builtin),
                    f"kubectl decoded {decoded} of {len(builtin)} objects:\n{out.stderr}", failures)
# One node process for all (loading the schemas takes most of its time).
out = subprocess.run([sys.argv[1], validator, node_modules], input=json.dumps(all_docs),
                     capture_output=True, text=True, timeout=120)
print(out.stdout + out.stderr, end="")
validated = sum(line.startswith("ok ") for line in out.stdout.splitlines())
chart.check(out.returncode == 0 and validated == len(all_docs),
            f"{validated} of {len(all_docs)} objects valid", failures)
chart.finish(failures, "Kubernetes schema validation")
