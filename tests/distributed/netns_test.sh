#!/usr/bin/env bash
# Two ranks in two network namespaces joined by a veth pair with their own addresses: the
# rendezvous and the UCX collectives cross a real (virtual) link, as between two nodes.
# Usage: netns_test.sh RANK_BINARY. Needs root and iproute2; exits 77 (ctest: skipped) when
# network namespaces cannot be made here.
set -u
bin="$1"
# shellcheck source=tests/distributed/netns_lib.sh
source "$(dirname "$0")/netns_lib.sh" 254

port=29500
# TCP over the veth: the namespaces share /dev/shm, but each rank may only reach the other
# through its own interface, as on two nodes.
export UCX_TLS=tcp
ip netns exec "$a" "$bin" --rank=0 --world_size=2 --leader="$ip_a:$port" >"$dir/rank0.log" 2>&1 &
pa=$!
pids+=("$pa")
ip netns exec "$b" "$bin" --rank=1 --world_size=2 --leader="$ip_a:$port" >"$dir/rank1.log" 2>&1 &
pb=$!
pids+=("$pb")
fail=0
for p in "$pa" "$pb"; do
  for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$p" 2>/dev/null; then echo "a rank hangs after 10 s"; fail=1; fi
done
wait "$pa"; ra=$?
wait "$pb"; rb=$?
pids=()
cat "$dir/rank0.log" "$dir/rank1.log"
if [ "$fail" = 0 ] && [ "$ra" = 0 ] && [ "$rb" = 0 ] && grep -q "every collective matched" "$dir/rank1.log"; then
  echo "PASS: ranks in namespaces $a ($ip_a) and $b ($ip_b) ran every collective"
  exit 0
fi
echo "FAIL: rank 0 exit $ra, rank 1 exit $rb"
exit 1
