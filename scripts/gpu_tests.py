#!/usr/bin/env python3
"""The GPU tests (ctest label "gpu") on a host without ctest or a build tree.

On the development machine, `plan` asks ctest for every test labelled "gpu" (the command, its
environment, its skip pattern) and writes them to a JSON plan inside a bundle directory
(scripts/bundle_gpu.sh), together with this script; on the GPU host, `run` runs each entry
through the bundle's run.sh and prints one line per test and a summary, as ctest would:

    scripts/gpu_tests.py plan build /tmp/gpu-bundle      # also bundles the test binaries
    python3 /tmp/gpu-bundle/gpu_tests.py run /tmp/gpu-bundle [--filter REGEX] [--timeout S]

ctest stays the one list of GPU tests and their variants (the poisoned temporaries, the forced
warp top-k, bf16 pair rows): the plan is read from it, not written twice. Exit status of `run`:
0 when every test passed or skipped, 1 otherwise. Tests that fail by design are not hidden:
they are reported as failed like any other (docs/cuda-backend.md names the documented ones).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

PLAN = "gpu_tests.json"


def plan(build_dir, bundle_dir):
    listing = subprocess.run(
        ["ctest", "-L", "gpu", "--show-only=json-v1"], cwd=build_dir, check=True,
        capture_output=True, text=True).stdout
    tests = []
    for test in json.loads(listing)["tests"]:
        command = test.get("command")
        if not command:
            continue
        entry = {"name": test["name"], "binary": command[0], "args": command[1:], "env": {},
                 "skip_regex": []}
        for prop in test.get("properties", []):
            if prop["name"] == "ENVIRONMENT":
                for assignment in prop["value"]:
                    key, _, value = assignment.partition("=")
                    entry["env"][key] = value
            elif prop["name"] == "SKIP_REGULAR_EXPRESSION":
                entry["skip_regex"] = prop["value"]
        tests.append(entry)
    binaries = sorted({t["binary"] for t in tests})
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([os.path.join(here, "bundle_gpu.sh"), bundle_dir] + binaries, check=True)
    for t in tests:
        t["binary"] = os.path.basename(t["binary"])
    with open(os.path.join(bundle_dir, PLAN), "w") as f:
        json.dump({"tests": tests}, f, indent=1)
    subprocess.run(["cp", os.path.abspath(__file__), os.path.join(bundle_dir, "gpu_tests.py")],
                   check=True)
    print(f"planned {len(tests)} GPU tests of {len(binaries)} binaries into {bundle_dir}/{PLAN}")


def run(bundle_dir, pattern, timeout):
    with open(os.path.join(bundle_dir, PLAN)) as f:
        tests = json.load(f)["tests"]
    if pattern:
        tests = [t for t in tests if re.search(pattern, t["name"])]
    runner = os.path.join(bundle_dir, "run.sh")
    passed, skipped, failed = [], [], []
    start = time.time()
    for i, test in enumerate(tests, 1):
        env = dict(os.environ)
        env.update(test["env"])
        began = time.time()
        try:
            done = subprocess.run([runner, test["binary"]] + test["args"], env=env,
                                  capture_output=True, text=True, timeout=timeout)
            output, code = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as e:
            output, code = (e.stdout or "") + (e.stderr or ""), None
            if isinstance(output, bytes):
                output = output.decode(errors="replace")
        seconds = time.time() - began
        if code is None:
            verdict = "Timeout"
        elif any(re.search(p, output) for p in test["skip_regex"]):
            verdict = "Skipped"
        else:
            verdict = "Passed" if code == 0 else "Failed"
        {"Passed": passed, "Skipped": skipped}.get(verdict, failed).append(test["name"])
        print(f"{i:3d}/{len(tests)} {test['name']:<90} {verdict:8} {seconds:6.2f} s", flush=True)
        if verdict in ("Failed", "Timeout"):
            lines = [l for l in output.splitlines() if "Failure" in l or "FAILED" in l
                     or "error" in l.lower()]
            for line in lines[:8]:
                print(f"      {line}")
    print(f"\n{len(passed)} passed, {len(skipped)} skipped, {len(failed)} failed of {len(tests)} "
          f"GPU tests in {time.time() - start:.0f} s")
    for name in skipped:
        print(f"  skipped: {name}")
    for name in failed:
        print(f"  failed: {name}")
    return 0 if not failed else 1


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="write the GPU test plan and bundle its binaries")
    p.add_argument("build_dir")
    p.add_argument("bundle_dir")
    r = sub.add_parser("run", help="run the planned GPU tests of a bundle")
    r.add_argument("bundle_dir")
    r.add_argument("--filter", default="", help="only tests whose name matches this regex")
    r.add_argument("--timeout", type=float, default=600, help="seconds per test (default 600)")
    args = parser.parse_args()
    if args.command == "plan":
        plan(args.build_dir, args.bundle_dir)
        return 0
    return run(args.bundle_dir, args.filter, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
