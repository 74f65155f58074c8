# Sourced by the network-namespace tests: two namespaces $a and $b joined by a veth pair, with
# addresses $ip_a and $ip_b on 10.$1.x.0/24, a scratch folder $dir, and a cleanup on exit that
# kills the PIDs in $pids and removes the namespaces. Exits 77 (ctest: skipped) when namespaces
# cannot be made here (needs root and iproute2).
netns_prefix="$1"  # second octet of the test network
a="mobius-${netns_prefix}a-$$" b="mobius-${netns_prefix}b-$$"
va="m${netns_prefix}a$$" vb="m${netns_prefix}b$$"
net="10.${netns_prefix}.$(($$ % 250)).0"
ip_a="${net%.0}.1" ip_b="${net%.0}.2"
dir=$(mktemp -d /tmp/mobius-netns-XXXXXX)
pids=()
netns_cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  ip netns del "$a" 2>/dev/null
  ip netns del "$b" 2>/dev/null
  rm -rf "$dir"
}
trap netns_cleanup EXIT

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
