#!/usr/bin/env bash
# Kernel micro-benchmarks on a GPU host: our CUDA backend's ops (mobius_kernel_bench) and the
# peer kernels (peers.py: flash-linear-attention's Triton gated delta rule, PyTorch SDPA) at the
# same shapes, then one combined table (ours vs peer vs bound). The table goes into
# docs/performance.md ("Kernel micro-benchmarks").
#
#   bench/kernels/run_on_device.sh BUNDLE_DIR [OUT_DIR]
#
# BUNDLE_DIR holds mobius_kernel_bench bundled with its libraries (scripts/bundle_gpu.sh), built
# here from the commit being measured:
#   ninja -C build-kbench mobius_kernel_bench
#   scripts/bundle_gpu.sh .device/kbench build-kbench/bin/mobius_kernel_bench
#   git rev-parse --short HEAD > .device/kbench/COMMIT
# On the lent device machine (see /work/.library/device/): run tool, carry [".device/kbench",
# ".peers"], command
#   bash bench/kernels/run_on_device.sh .device/kbench $OUT 2>&1 | tee $OUT/kbench.log
# OUT_DIR (default ./kbench-out) receives kbench.md (the tables in Markdown), kbench.json (every
# number of both sides) and, with KBENCH_SAVE_TRITON_CACHE=1, triton-cache.tgz (put it in
# BUNDLE_DIR for the next run: Triton then skips compiling and autotuning fla's kernels).
#
# Peers: python3 with PyTorch + Triton (the GPU host's), and flash-linear-attention's Python
# source on PYTHONPATH: .peers/fla by default (git-ignored copy of fla-org/flash-linear-attention,
# commit in .peers/FLA_COMMIT), or KBENCH_FLA_PATH. fla needs einops and transformers.
#
# Environment: KBENCH_ITERS (default 100), KBENCH_MAX_CASE_MS (default 1000), KBENCH_ONLY (a bash
# regex: only the groups of our cases and of peer cases whose name or pattern matches it, for
# example 'gdr' for the gated delta rule; the ceilings are measured all the same), KBENCH_PEERS=0
# to skip the peers, KBENCH_PEER_TIMEOUT_S (default 90 per group of peer cases: the first run
# compiles and autotunes fla's Triton kernels), KBENCH_GROUP_TIMEOUT_S (default 150 per group of
# our cases).
#
# Our cases run in groups, one process each, so that a kernel that aborts (the CUDA backend aborts
# on misuse or a failed launch) loses only its group; the ceilings are measured once, in the first
# process, and handed to the others.
set -uo pipefail
if [ $# -lt 1 ] || [ "$1" = "--help" ]; then
  sed -n '2,34p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
bundle=$1
out=${2:-kbench-out}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
iters=${KBENCH_ITERS:-100}
max_case_ms=${KBENCH_MAX_CASE_MS:-1000}
group_timeout=${KBENCH_GROUP_TIMEOUT_S:-150}
mkdir -p "$out"
work=$(mktemp -d /tmp/kbench.XXXXXX)

# The commit the binary was built from: BUNDLE_DIR/COMMIT, else this checkout's HEAD.
commit=$(cat "$bundle/COMMIT" 2>/dev/null || git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)
note="commit $commit"
echo "== kernel micro-benchmarks, $note, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv 2>/dev/null || echo "(nvidia-smi unavailable)"

# KBENCH_ARGS: extra options for every mobius_kernel_bench call (for example "--device cpu --smoke"
# to check this script on a machine without a GPU, with KBENCH_PEERS=0).
bench() {
  # shellcheck disable=SC2086
  timeout "$group_timeout" "$bundle/run.sh" mobius_kernel_bench --iters "$iters" \
    --max-case-ms "$max_case_ms" --note "$note" ${KBENCH_ARGS:-} "$@"
}

# 1. The ceilings (copy bandwidth, cuBLASLt bf16 matrix rate) and the dense projections.
echo "== ours: ceilings + linear"
bench --filter '^linear\.' --json "$work/ours_0_linear.json"
ceil=$(python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print(j['copy_bandwidth_bytes_per_s']/1e9, j['matrix_flops_per_s']/1e12)" \
  "$work/ours_0_linear.json" 2>/dev/null) || { echo "the first group failed: no ceilings"; ceil=""; }
read -r bw tf <<<"$ceil"
ceil_args=()
if [ -n "${bw:-}" ]; then ceil_args=(--bandwidth "$bw" --matrix-tflops "$tf"); fi

# 2. Our ops, group by group.
groups=(
  'gdr:^gdr\.'
  'conv:^conv\.'
  'deltanet_small:^(gates|gated_rmsnorm)\.'
  'attn_small:^(qknorm_rope|write_kv|mul_sigmoid)\.'
  'attn:^attn\.'
  'topk:^topk_softmax\.'
  'moe:^moe\.'
  'dense:^(rmsnorm1p|add_rmsnorm1p|add|add_sigmoid_scaled|silu_mul|embedding|gather_rows)\.'
)
i=1
only=${KBENCH_ONLY:-}
for g in "${groups[@]}"; do
  name=${g%%:*}
  re=${g#*:}
  if [ -n "$only" ] && ! [[ $name =~ $only || $re =~ $only ]]; then i=$((i + 1)); continue; fi
  echo "== ours: $name"
  bench --filter "$re" "${ceil_args[@]}" --json "$work/ours_${i}_$name.json" ||
    echo "!! group $name failed (exit $?): its cases are missing from the tables"
  i=$((i + 1))
done

# 3. Peers at the same shapes, with the same ceilings.
peers_args=()
if [ "${KBENCH_PEERS:-1}" != 0 ]; then
  echo "== peers"
  export PYTHONPATH="${KBENCH_FLA_PATH:-$repo/.peers}${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1
  export TRITON_CACHE_DIR=$work/triton-cache
  mkdir -p "$TRITON_CACHE_DIR"
  if [ -f "$bundle/triton-cache.tgz" ]; then tar xzf "$bundle/triton-cache.tgz" -C "$TRITON_CACHE_DIR"; fi
  [ -f "$repo/.peers/FLA_COMMIT" ] && export FLA_COMMIT=$(cat "$repo/.peers/FLA_COMMIT")
  ceil_from=()
  [ -f "$work/ours_0_linear.json" ] && ceil_from=(--ceilings-from "$work/ours_0_linear.json")
  # fla's tensor cache keeps results keyed by input tensors across calls; with CUDA-graph capture
  # in the timing loop that is unsafe, so it is off (it only saves host work).
  export FLA_DISABLE_TENSOR_CACHE=1
  # One process per group: a kernel fault (illegal address) poisons the CUDA context, so it must
  # lose only its own group. fla's fused_recurrent kernel faulted that way here (Triton 3.6): at
  # T = 4096 in both tries, in a process's second decode case in 2 of 3; so each fla case runs alone.
  peer_groups=(
    'gdr.decode.B1 '
    'gdr.decode.B8 '
    'gdr.decode.B64 '
    'gdr.decode.B256 '
    'gdr.prefill.1x4K fla.fused_recurrent'
    'gdr.prefill.8x1K fla.fused_recurrent'
    'gdr.prefill.1x4K fla.chunk'
    'gdr.prefill.8x1K fla.chunk'
    'attn.decode.* '
    'attn.prefill.* '
  )
  peer_timeout=${KBENCH_PEER_TIMEOUT_S:-90}
  i=0
  for re in "${peer_groups[@]}"; do
    if [ -n "$only" ] && ! [[ $re =~ $only ]]; then i=$((i + 1)); continue; fi
    echo "== peers: $re"
    timeout "$peer_timeout" python3 "$here/peers.py" "${ceil_from[@]}" --filter "^$re" \
      --json "$work/peers_$i.json" || echo "!! peers.py group '$re' failed or timed out (exit $?)"
    [ -f "$work/peers_$i.json" ] && peers_args+=("$work/peers_$i.json")
    i=$((i + 1))
  done
  [ ${#peers_args[@]} -gt 0 ] && peers_args=(--peers "${peers_args[@]}")
  if [ "${KBENCH_SAVE_TRITON_CACHE:-0}" = 1 ]; then
    tar czf "$out/triton-cache.tgz" -C "$TRITON_CACHE_DIR" . && echo "saved $out/triton-cache.tgz"
  fi
fi

# 4. The combined tables.
echo "== results"
python3 "$here/compare.py" --ours "$work"/ours_*.json "${peers_args[@]}" \
  --markdown "$out/kbench.md" --json "$out/kbench.json"
rm -rf "$work"
