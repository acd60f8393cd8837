#!/bin/bash
# Two "machines" on one host: two network namespaces joined by a veth pair
# (10.231.0.1 and 10.231.0.2), one `meshtrain launch` per namespace with 2
# workers each, the gloo engine between them. Checks:
#  1. a launcher with the wrong job token is refused (and the store logs it);
#  2. data-parallel MLP training over the 4 ranks for 50 steps equals one
#     device within 1e-5 (dp_parity_mpi_test compares on rank 0); node 1
#     names its interface (GLOO_SOCKET_IFNAME), node 0 finds its own;
#  3. a store bound to loopback cannot be reached from the other namespace
#     (while it is reachable on loopback inside its own).
# Needs root and iproute2; exits 77 (skipped) without them.
#   tests/gloo_two_node_test.sh path/to/meshtrain path/to/dp_parity_mpi_test
set -u
MT=$1
PARITY=$2
PORT=$((29000 + $$ % 1000))
WORK=$(mktemp -d /tmp/mt_two_node.XXXXXX)
pids=()
fail() {
  echo "FAIL: $*"
  for f in "$WORK"/*.log; do echo "--- $f"; cat "$f"; done
  exit 1
}
. "$(dirname "$0")/two_namespaces.sh" mt 10.231.0

# A launcher per namespace; $1 namespace, $2 node rank, $3 token, $4 log,
# $5 master address, rest: the command.
launch() {
  local ns=$1 node=$2 token=$3 log=$4 master=$5
  shift 5
  mkdir -p "$WORK/tmp$node"
  ip netns exec "$ns" env MESHTRAIN_JOB_TOKEN="$token" TMPDIR="$WORK/tmp$node" ${EXTRA_ENV:-} \
    timeout 240 "$MT" launch --nnodes 2 --nproc-per-node 2 --node-rank "$node" \
    --master-addr "$master" --master-port "$PORT" -- "$@" > "$log" 2>&1
}

# 1 and 2: node 0 hosts the store; a node with the wrong token is refused,
# then the right one trains.
launch "$A" 0 secret-token "$WORK/node0.log" "$ADDR_A" "$PARITY" &
pids+=($!)
node0=$!
start=$(date +%s)
launch "$B" 1 wrong-token "$WORK/intruder.log" "$ADDR_A" true
[ $? -ne 0 ] || fail "a launcher with the wrong token was accepted"
grep -qi "token" "$WORK/intruder.log" || fail "the refused launcher does not say why"
[ $(($(date +%s) - start)) -lt 60 ] || fail "the refusal took more than 60 s"
# Node 1's workers pick their interface by name (GLOO_SOCKET_IFNAME); node
# 0's find theirs from the route to the store.
EXTRA_ENV="GLOO_SOCKET_IFNAME=$VB" launch "$B" 1 secret-token "$WORK/node1.log" "$ADDR_A" "$PARITY" ||
  fail "node 1 failed"
wait "$node0" || fail "node 0 failed"
grep -q "refused a connection from $ADDR_B" "$WORK/node0.log" || fail "the store did not log the refused connection"
grep -q "gloo data parallel (4 ranks) vs 1 rank over 50 steps: PASS" "$WORK/node0.log" ||
  fail "no parity line from rank 0"
echo "two-node training over gloo: parity with one device (node 0 log: $(grep -c . "$WORK/node0.log") lines)"

# 3: a store bound to loopback in A is unreachable from B.
PORT=$((PORT + 1))
launch "$A" 0 secret-token "$WORK/loopback.log" 127.0.0.1 sleep 30 &
pids+=($!)
for _ in $(seq 50); do
  ip netns exec "$A" bash -c "exec 3<> /dev/tcp/127.0.0.1/$PORT" 2> /dev/null && break
  sleep 0.1
done
ip netns exec "$A" bash -c "exec 3<> /dev/tcp/127.0.0.1/$PORT" 2> /dev/null ||
  fail "the loopback store is not listening inside its namespace"
if ip netns exec "$B" timeout 3 bash -c "exec 3<> /dev/tcp/$ADDR_A/$PORT" 2> /dev/null; then
  fail "a store bound to 127.0.0.1 accepted a connection from the other namespace"
fi
echo "a store bound to loopback refuses the other namespace"
echo PASS
