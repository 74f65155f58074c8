#!/usr/bin/env bash
# Two ranks in two network namespaces joined by a veth pair with their own addresses: the
# rendezvous and the UCX collectives cross a real (virtual) link, as between two nodes.
# Usage: netns_test.sh RANK_BINARY. Needs root and iproute2; exits 77 (ctest: skipped) when
# network namespaces cannot be made here.
set -u
bin="$1"
a="mobius-a-$$" b="mobius-b-$$" va="mva$$" vb="mvb$$"
net="10.254.$(($$ % 250)).0"
ip_a="${net%.0}.1" ip_b="${net%.0}.2"
dir=$(mktemp -d /tmp/mobius-netns-XXXXXX)
cleanup() {
  [ -n "${pa:-}" ] && kill -9 "$pa" 2>/dev/null
  [ -n "${pb:-}" ] && kill -9 "$pb" 2>/dev/null
  ip netns del "$a" 2>/dev/null
  ip netns del "$b" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT

if ! command -v ip >/dev/null || ! ip netns add "$a" 2>"$dir/err"; then
  echo "SKIP: cannot create a network namespace (needs root and iproute2): $(cat "$dir/err" 2>/dev/null)"
  exit 77
fi
set -e
ip netns add "$b"
ip link add "$va" type veth peer name "$vb"
ip link set "$va" netns "$a"
ip link set "$vb" netns "$b"
ip -n "$a" addr add "$ip_a/24" dev "$va"
ip -n "$b" addr add "$ip_b/24" dev "$vb"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "$va" up
ip -n "$b" link set "$vb" up
set +e

port=29500
# TCP over the veth: the namespaces share /dev/shm, but each rank may only reach the other
# through its own interface, as on two nodes.
export UCX_TLS=tcp
ip netns exec "$a" "$bin" --rank=0 --world_size=2 --leader="$ip_a:$port" >"$dir/rank0.log" 2>&1 &
pa=$!
ip netns exec "$b" "$bin" --rank=1 --world_size=2 --leader="$ip_a:$port" >"$dir/rank1.log" 2>&1 &
pb=$!
fail=0
for p in "$pa" "$pb"; do
  for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$p" 2>/dev/null; then echo "a rank hangs after 10 s"; fail=1; fi
done
wait "$pa"; ra=$?; pa=""
wait "$pb"; rb=$?; pb=""
cat "$dir/rank0.log" "$dir/rank1.log"
if [ "$fail" = 0 ] && [ "$ra" = 0 ] && [ "$rb" = 0 ] && grep -q "every collective matched" "$dir/rank1.log"; then
  echo "PASS: ranks in namespaces $a ($ip_a) and $b ($ip_b) ran every collective"
  exit 0
fi
echo "FAIL: rank 0 exit $ra, rank 1 exit $rb"
exit 1
