"""Shared helpers of the deployment tests: render the chart with helm, walk the rendered pods."""
import os
import subprocess
import sys

import yaml

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHART = os.path.join(REPO, "deploy", "helm", "mobius-serve")
CI_VALUES = sorted(
    os.path.join(CHART, "ci", f) for f in os.listdir(os.path.join(CHART, "ci")) if f.endswith(".yaml"))
TOOLS = os.environ.get("MOBIUS_TOOLS", "/opt/mobius-tools")
HELM = os.path.join(TOOLS, "bin", "helm")


def need_tools():
    if not os.access(HELM, os.X_OK):
        sys.exit(f"no helm at {HELM}: run `bash tests/deploy/install_tools.sh` (or .ci/run --setup-only)")


def helm(*args, check=True):
    return subprocess.run([HELM, *args], capture_output=True, text=True, check=check)


def render(values_file, sets=(), release="mobius", namespace="serving"):
    args = ["template", release, CHART, "--namespace", namespace, "-f", values_file]
    for s in sets:
        args += ["--set", s]
    out = helm(*args, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"helm template -f {values_file} {' '.join(sets)} failed:\n{out.stderr}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def pod_templates(docs):
    """(workload, role, pod template) for every pod template in the manifests."""
    for d in docs:
        spec = d.get("spec", {})
        if d["kind"] in ("Deployment", "StatefulSet"):
            yield d, d["kind"], spec["template"]
        elif d["kind"] == "LeaderWorkerSet":
            t = spec["leaderWorkerTemplate"]
            if "leaderTemplate" in t:
                yield d, "leader", t["leaderTemplate"]
            yield d, "worker", t["workerTemplate"]


def flag_args(container):
    """{flag name with underscores: value} of a container's --flag=value arguments."""
    flags = {}
    for a in container.get("args", []):
        assert a.startswith("--"), f"{container['name']}: argument {a!r} is not a --flag"
        name, _, value = a[2:].partition("=")
        flags.setdefault(name.replace("-", "_"), []).append(value)
    return flags


def binary_name(container):
    return os.path.basename((container.get("command") or [""])[0])


def check(cond, message, failures):
    if not cond:
        failures.append(message)
    return cond


def finish(failures, what):
    for f in failures:
        print("FAIL:", f)
    print(f"{what}: {len(failures)} failure(s)")
    sys.exit(1 if failures else 0)
