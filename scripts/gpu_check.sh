#!/bin/bash
# Checks a build on a GPU host in one go: the GPU test suite, then the engine benchmark's table at
# the given config, each with its output kept under OUT. Meant for machines lent for minutes at a
# time (docs/gpu-hosts.md): everything is time-guarded, so that one start of the machine yields
# as much as its time allows, and the summary lines are printed as they come.
set -u

usage() {
  cat <<'EOF'
Usage: scripts/gpu_check.sh --bundle TAR --out DIR [options]

  --bundle TAR      the GPU bundle packed on the development machine (docs/gpu-hosts.md:
                    scripts/gpu_tests.py plan, then tar -I 'xz -T2 -9e'); unpacked under /tmp
  --out DIR         where the logs go: tests.txt, table.txt, table.json, check.log
  --fixtures DIR    the reference fixtures for the tests (default: $MOBIUS_FIXTURES_DIR)
  --config FILE     config.json of the model the table runs with dummy weights; without it, no
                    table
  --filter REGEX    only the GPU tests whose names match (default: every test)
  --limit SECONDS   the time the whole check may take (default 540); the table is skipped when
                    less than 120 s are left after the tests
  --skip-tests      only the table
  -h, --help        this text
EOF
}

bundle="" out="" fixtures="${MOBIUS_FIXTURES_DIR:-}" config="" filter="" limit=540 tests=1
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) bundle="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --fixtures) fixtures="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    --filter) filter="$2"; shift 2 ;;
    --limit) limit="$2"; shift 2 ;;
    --skip-tests) tests=0; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (--help lists them)" >&2; exit 2 ;;
  esac
done
if [ -z "$bundle" ] || [ -z "$out" ]; then
  echo "gpu_check: --bundle and --out are required (--help lists the options)" >&2
  exit 2
fi
if [ ! -f "$bundle" ]; then
  echo "gpu_check: --bundle '$bundle': no such file" >&2
  exit 2
fi
if [ -n "$config" ] && [ ! -f "$config" ]; then
  echo "gpu_check: --config '$config': no such file" >&2
  exit 2
fi
case "$limit" in
  '' | *[!0-9]*) echo "gpu_check: --limit '$limit': expected whole seconds" >&2; exit 2 ;;
esac

mkdir -p "$out"
exec > >(tee -a "$out/check.log") 2>&1
start=$(date +%s)
elapsed() { echo $(($(date +%s) - start)); }
say() { echo "[gpu_check t=$(elapsed)s] $*"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader ||
  say "nvidia-smi failed: is this a GPU host?"
dir=$(mktemp -d /tmp/gpu_check.XXXXXX)
say "unpacking $bundle"
tar -xJf "$bundle" -C "$dir" || { say "cannot unpack $bundle"; exit 1; }
root=$(dirname "$(find "$dir" -maxdepth 2 -name run.sh | head -1)")
if [ ! -x "$root/run.sh" ]; then
  say "no run.sh in $bundle: not a bundle made by scripts/bundle_gpu.sh"
  exit 1
fi

status=0
if [ "$tests" = 1 ]; then
  if [ ! -f "$root/gpu_tests.json" ]; then
    say "the bundle has no gpu_tests.json (made without scripts/gpu_tests.py plan): no tests"
  else
    if [ -n "$filter" ]; then say "GPU tests matching $filter"; else say "every GPU test"; fi
    args=(run "$root")
    [ -n "$filter" ] && args+=(--filter "$filter")
    # Each test may take what is left, less the table's share.
    per_test=$((limit - $(elapsed) - 120))
    [ "$per_test" -lt 60 ] && per_test=60
    args+=(--timeout "$per_test")
    MOBIUS_FIXTURES_DIR="$fixtures" timeout $((limit - $(elapsed))) \
      python3 "$root/gpu_tests.py" "${args[@]}" > "$out/tests.txt" 2>&1
    rc=$?
    [ "$rc" != 0 ] && status=1
    if [ "$rc" = 124 ]; then
      # Stopped at the limit before its summary: what ran is in the per-test lines.
      say "the tests ran out of time after $(grep -cE '^ *[0-9]+/[0-9]+ ' "$out/tests.txt") of them; the last:"
      tail -3 "$out/tests.txt"
    else
      # The summary: the counts line and every skipped or failed test.
      sed -n '/ GPU tests in /,$p' "$out/tests.txt"
    fi
  fi
fi

if [ -n "$config" ]; then
  if [ $((limit - $(elapsed))) -lt 120 ]; then
    say "less than 120 s left: no table"
  else
    say "table: $config"
    timeout $((limit - $(elapsed))) "$root/run.sh" mobius bench engine --config "$config" \
      --load-format dummy --device cuda --batches 1,8,64,256 --contexts 1024,8192 \
      --prefill-lengths 1024,8192 --steps 20 --json-out "$out/table.json" \
      > "$out/table.txt" 2>&1 || { status=1; say "the table failed; its last lines:"; tail -5 "$out/table.txt"; }
    grep -E "^bench: (backend|matrix|model ready)|^phase|^decode|^prefill" "$out/table.txt"
  fi
fi
rm -rf "$dir"
say "done (exit $status)"
exit $status
