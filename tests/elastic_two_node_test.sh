#!/bin/bash
# Elastic training across two "machines" (issue 44): two network namespaces
# joined by a veth pair (10.232.0.1, 10.232.0.2), one `meshtrain launch
# --nnodes 1:2 --nproc-per-node 2` per namespace, the gloo engine between
# them, a run directory both see (as a shared filesystem would be).
#  1. Node 1 is killed (SIGKILL of its launcher and its workers) after the
#     first checkpoints: node 0 restarts alone, the mesh re-planned for its 2
#     devices (the data axis takes the change, micro-batches double) from the
#     newest checkpoint.
#  2. Node 1 starts again once node 0 has resumed: node 0's workers
#     checkpoint and stop, and the job regroups onto both nodes and the
#     first mesh.
#  3. The run finishes; every step's loss is within 1e-5 of an uninterrupted
#     run's (the threads engine, 4 devices, the first mesh) and metrics.jsonl
#     has both layout_change lines with their reasons and the time lost;
#     with --deterministic (mode "deterministic", mesh data=4) the final
#     model is byte-identical to the uninterrupted run's.
# Mode "no_fit": a GPT on fsdp=4 (zero1) with --device-memory 51MiB, which
# no layout on 2 devices fits: after node 1 is killed the job stops within
# twice the heartbeat deadline, the error says how much memory the run
# needs, and its last checkpoint is intact (a resume on 4 devices finishes).
# Needs root and iproute2; exits 77 (skipped) without them.
#   tests/elastic_two_node_test.sh path/to/meshtrain default|deterministic|no_fit
set -u
MT=$1
MODE=$2
case $MODE in
default) MESH=data=2,tensor=2 SMALL="data=1,tensor=2" EXTRA=() ;;
deterministic) MESH=data=4 SMALL="data=2" EXTRA=(--deterministic --deterministic-block 16) ;;
no_fit) MESH=fsdp=4 ;;
*) echo "unknown mode $MODE"; exit 2 ;;
esac
PORT=$((30000 + $$ % 1000))
WORK=$(mktemp -d /tmp/mt_elastic.XXXXXX)
STEPS=4000
pids=()
fail() {
  echo "FAIL ($MODE): $*"
  for f in "$WORK"/*.log; do echo "--- $f"; tail -n 40 "$f"; done
  exit 1
}
. "$(dirname "$0")/two_namespaces.sh" me 10.232.0

HEARTBEAT=3
if [ "$MODE" = no_fit ]; then
  HEARTBEAT=5
  # Predicted peaks (plan::predict_memory): 45.3 MiB per device on fsdp=4;
  # on 2 devices at least 48.9 MiB (4 micro-batches, recompute); 51MiB
  # leaves 45.9 MiB usable.
  args=(train --model gpt --corpus /usr/share/games/fortunes/computers --text-cache "$WORK/text" --vocab 4096
        --layers 4 --heads 4 --width 256 --context 16 --batch-size 8 --max-steps 100000 --log-every 1
        --threads-per-rank 1 --checkpoint-every 20 --fsdp zero1 --device-memory 51MiB)
else
  args=(train --hidden 256,128 --batch-size 256 --epochs 20 --max-steps $STEPS --log-every 1 --threads-per-rank 1
        --checkpoint-every 100 "${EXTRA[@]}")
  "$MT" "${args[@]}" --mesh "$MESH" --run-dir "$WORK/ref" > "$WORK/ref.log" 2>&1 || fail "the uninterrupted run failed"
fi

# $1 namespace, $2 node rank, $3 log; node 1 names its interface for gloo.
launch() {
  local ns=$1 node=$2 log=$3 iface=
  [ "$node" = 1 ] && iface="GLOO_SOCKET_IFNAME=$VB"
  ip netns exec "$ns" env MESHTRAIN_JOB_TOKEN=elastic-$$ $iface timeout 300 \
    "$MT" launch --nnodes 1:2 --nproc-per-node 2 --node-rank "$node" --master-addr "$ADDR_A" --master-port "$PORT" \
    --max-restarts ${MAX_RESTARTS:-2} --heartbeat-timeout $HEARTBEAT --last-call 60 --join-timeout 60 \
    --kill-timeout 30 -- \
    "$MT" "${args[@]}" --engine gloo --mesh "$MESH" --timeout 30 --run-dir "$WORK/run" > "$log" 2>&1
}
metrics=$WORK/run.incomplete/metrics.jsonl
# The newest step in metrics.jsonl (0 before the first).
last_step() { grep -o '"split":"train","step":[0-9]*' "$metrics" 2> /dev/null | tail -1 | grep -o '[0-9]*$' || echo 0; }
# Waits until $1 (a command) succeeds, at most $2 seconds (while node 0 runs).
wait_until() {
  for _ in $(seq $(($2 * 20))); do
    eval "$1" && return 0
    kill -0 "$node0" 2> /dev/null || fail "node 0 ended while waiting for: $1"
    sleep 0.05
  done
  fail "waited $2 s for: $1"
}

[ "$MODE" = no_fit ] && MAX_RESTARTS=1
launch "$A" 0 "$WORK/node0.log" &
node0=$!
pids+=($node0)
launch "$B" 1 "$WORK/node1.log" &
pids+=($!)
if [ "$MODE" = no_fit ]; then
  wait_until '[ -e "$WORK/run.incomplete/checkpoints/latest" ]' 120
else
  wait_until '[ "$(last_step)" -ge 300 ]' 120
fi
for p in $(ip netns pids "$B"); do kill -KILL "$p" 2> /dev/null; done
t_kill=$(date +%s.%N)
killed_at=$(last_step)
echo "killed node 1 (launcher and workers) at step $killed_at"
if [ "$MODE" = no_fit ]; then
  sleep 0.5  # node 0's workers end (their peers are gone)
  cp -r "$WORK/run.incomplete" "$WORK/saved"
  wait "$node0" && fail "node 0 finished a run that does not fit 2 devices"
  took=$(awk -v t0="$t_kill" -v t1="$(date +%s.%N)" 'BEGIN { printf "%.1f", t1 - t0 }')
  echo "node 0 stopped $took s after the kill"
  awk -v t="$took" -v d="$HEARTBEAT" 'BEGIN { exit !(t < 2 * d) }' ||
    fail "the job took $took s to stop (deadline $HEARTBEAT s)"
  grep -q "error: --device-memory: the run needs .* per device on 2 devices (mesh fsdp=2, the planner's predicted" \
    "$WORK/node0.log" || fail "no error saying how much memory the run needs"
  grep -q "the least any layout on 2 devices needs is" "$WORK/node0.log" || fail "the error does not give the least"
  diff -r "$WORK/saved" "$WORK/run.incomplete" > /dev/null || fail "the run directory changed after the refusal"
  "$MT" train --resume "$WORK/run" --engine threads --devices 4 --max-steps $((killed_at + 20)) \
    > "$WORK/resume4.log" 2>&1 ||
    fail "the kept checkpoint does not resume on 4 devices"
  echo "PASS: elastic two nodes ($MODE)"
  exit 0
fi
# Node 0 goes on alone on the re-planned mesh; then node 1 comes back.
# (Node 1's launcher first waits 2.5 s to see that its old self's heartbeat
# has stopped; node 0 alone has thousands of steps left meanwhile.)
wait_until 'grep -q "\"event\":\"layout_change\"" "$metrics" 2> /dev/null' 120
launch "$B" 1 "$WORK/node1_back.log" &
node1=$!
pids+=($node1)
wait "$node0" || fail "node 0 exited $?"
wait "$node1" || fail "node 1 (back) exited $?"

metrics=$WORK/run/metrics.jsonl
[ -f "$metrics" ] || fail "the run was not committed"
grep -q "restarting the group (restart 1 of 2)" "$WORK/node0.log" || fail "node 0 did not restart after the loss"
grep -q "round 1: node 0 -> ranks 0-1 of 2 on this node" "$WORK/node0.log" || fail "no round of node 0 alone"
grep -q "regrouping: node 1 joined (not counted as a restart)" "$WORK/node0.log" || fail "no regroup for node 1"
changes=$(grep '"event":"layout_change"' "$metrics")
[ "$(echo "$changes" | wc -l)" = 2 ] || fail "not 2 layout_change lines: $changes"
echo "$changes" | head -1 | grep -q "\"to\":\"mesh $SMALL " || fail "the first change is not to $SMALL: $changes"
echo "$changes" | tail -1 | grep -q "\"reason\":\"node 1 joined\"" || fail "the second change does not say why"
echo "$changes" | tail -1 | grep -q "\"to\":\"mesh $MESH " || fail "the second change is not back to $MESH"
echo "$changes"
python3 - "$WORK/ref/metrics.jsonl" "$metrics" "$STEPS" << 'EOF' || fail "the losses differ"
import json, sys
def losses(path):
    out = {}
    for line in open(path):
        j = json.loads(line)
        if j.get("split") == "train" and "loss" in j:
            out[j["step"]] = j["loss"]
    return out
ref, run, steps = losses(sys.argv[1]), losses(sys.argv[2]), int(sys.argv[3])
assert sorted(run) == list(range(1, steps + 1)), "steps missing or repeated"
worst = max(range(1, steps + 1), key=lambda s: abs(ref[s] - run[s]))
print(f"{steps} steps, the largest loss difference {abs(ref[worst] - run[worst]):.3g} at step {worst}")
sys.exit(0 if abs(ref[worst] - run[worst]) <= 1e-5 else 1)
EOF
if [ "$MODE" = deterministic ]; then
  cmp "$WORK/ref/model.safetensors" "$WORK/run/model.safetensors" ||
    fail "the final model differs from the uninterrupted run's"
  echo "model.safetensors: byte-identical to the uninterrupted run's"
fi
echo "PASS: elastic two nodes ($MODE)"
