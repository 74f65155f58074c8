#!/usr/bin/env python3
"""scripts/gpu_tests.py end to end in the build tree: the plan holds ctest's GPU tests with their
variants' environments, the bundle holds their binaries, and `run` runs a subset (skipped without
a GPU, passed with one) and exits 0.

    gpu_tests_script_test.py SCRIPT BUILD_DIR
"""
import json
import os
import subprocess
import sys
import tempfile


def main():
    script, build_dir = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as bundle:
        subprocess.run([sys.executable, script, "plan", build_dir, bundle], check=True,
                       capture_output=True)
        with open(os.path.join(bundle, "gpu_tests.json")) as f:
            tests = json.load(f)["tests"]
        names = {t["name"] for t in tests}
        assert len(tests) >= 50, f"only {len(tests)} GPU tests planned"
        for variant, env in [("CudaFixtureTest.PoisonedTemporaries", "MOBIUS_UNINITIALIZED_FILL"),
                             ("CudaKernelsTest.TopKWarpKernelForced", "MOBIUS_TOPK")]:
            assert variant in names, f"{variant} missing from the plan"
            entry = next(t for t in tests if t["name"] == variant)
            assert env in entry["env"], f"{variant} lost its environment: {entry['env']}"
        for t in tests:
            assert os.path.exists(os.path.join(bundle, "bin", t["binary"])), t["binary"]
        done = subprocess.run([sys.executable, os.path.join(bundle, "gpu_tests.py"), "run",
                               bundle, "--filter", "PoisonedTemporaries|CopyRowsAgrees"],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "of 4 GPU tests" in done.stdout, done.stdout
    print("ok")


if __name__ == "__main__":
    main()
