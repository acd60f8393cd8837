# Two "machines" on one host for the multi-node tests: network namespaces
# $A and $B joined by a veth pair ($VA in A at $ADDR_A, $VB in B at
# $ADDR_B, a /24), loopback up in each. Sourced after the test defines
# WORK (its scratch directory), an array pids (processes to kill) and
# fail(); on exit every process in either namespace and in pids is killed,
# the namespaces and WORK are removed. Exits 77 (skipped) without root,
# iproute2 or namespaces.
#   . "$(dirname "$0")/two_namespaces.sh" mt 10.231.0    # names mtA<pid>, mva<pid>, ...; 10.231.0.1 and .2
two_namespaces() {
  local prefix=$1 subnet=$2 id=$$
  A=${prefix}A$id B=${prefix}B$id VA=${prefix:0:1}va$id VB=${prefix:0:1}vb$id
  ADDR_A=$subnet.1 ADDR_B=$subnet.2
  ip netns add "$A" && ip netns add "$B" || { echo "SKIP: cannot create network namespaces"; exit 77; }
  ip link add "$VA" type veth peer name "$VB" || { echo "SKIP: cannot create a veth pair"; exit 77; }
  ip link set "$VA" netns "$A" && ip link set "$VB" netns "$B" || fail "moving the veth ends"
  ip -n "$A" addr add "$ADDR_A/24" dev "$VA" && ip -n "$B" addr add "$ADDR_B/24" dev "$VB" || fail "addresses"
  for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
  ip -n "$A" link set "$VA" up && ip -n "$B" link set "$VB" up || fail "links up"
}
two_namespaces_cleanup() {
  for ns in "$A" "$B"; do
    for p in $(ip netns pids "$ns" 2> /dev/null); do kill -KILL "$p" 2> /dev/null; done
  done
  for p in "${pids[@]}"; do kill -KILL "$p" 2> /dev/null; done
  ip netns del "$A" 2> /dev/null
  ip netns del "$B" 2> /dev/null
  ip link del "$VA" 2> /dev/null
  rm -rf "$WORK"
}
trap two_namespaces_cleanup EXIT
if [ "$(id -u)" != 0 ] || ! command -v ip > /dev/null; then
  echo "SKIP: needs root and iproute2 (ip netns)"
  exit 77
fi
two_namespaces "$@"
