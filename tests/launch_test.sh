#!/bin/bash
# `meshtrain launch` end to end, one scenario per run (each a CTest, see
# cli/CMakeLists.txt):
#   env        3 workers: RANK, WORLD_SIZE, LOCAL_RANK, ... and the "[rank R] "
#              prefix on stdout and stderr; long lines arrive whole
#   failure    a worker exits 3: the launcher exits non-zero naming it, and
#              kills its siblings (one sleeping with a child in the
#              background, one stopped by SIGSTOP); no process remains
#   sigterm    SIGTERM to the launcher: every worker is killed, exit 143
#   output     --output rank0 shows rank 0's lines only
#   restart    --max-restarts 1, a worker that fails only on the first run:
#              exit 0, the restart line, MESHTRAIN_RESTART_COUNT=1 after it
#   restart_flooded  the restart, while 10,000 connections that never say
#              hello are held on the launcher's store port: it still succeeds
#   two_nodes  two launchers (--nnodes 2, one token, loopback): RANK 0..3;
#              then a failure on node 1 stops node 0's workers
#   elastic_shrink  --nnodes 1:2: node 1's launcher is killed (-9); node 0
#              misses its heartbeat, restarts alone (WORLD_SIZE 1) and
#              tells its worker why; exit 0
#   elastic_grow    --nnodes 1:2: node 0 runs alone; node 1 starts and the
#              job regroups onto 2 nodes (not counted as a restart)
#   elastic_too_few --nnodes 2:3 with one node: the round's deadline stops
#              the job with an error naming MIN
#   elastic_taken   --nnodes 1:2 with both nodes running: another launcher
#              with node 1's --node-rank is refused while node 1's heartbeat
#              moves, and the job is not disturbed
#   tests/launch_test.sh path/to/meshtrain scenario
set -u
MT=$1
scenario=$2
tmp=$(mktemp -d /tmp/mt_launch.XXXXXX)
marker=mt_launch_$$_$RANDOM
# A sleep whose command line carries the marker, so pgrep finds every
# process of the job (workers and their children) and nothing else.
ln -s "$(command -v sleep)" "$tmp/sleep_$marker"
SLEEP=$tmp/sleep_$marker
export SLEEP
launchers=()
cleanup() {
  for p in "${launchers[@]}"; do kill -KILL "$p" 2> /dev/null; done
  pkill -KILL -f "$marker" 2> /dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
  echo "FAIL ($scenario): $*"
  for f in "$tmp"/*.out; do
    [ -f "$f" ] && { echo "--- $f"; cat "$f"; }
  done
  exit 1
}
# No process of the job is left (after the launcher returned).
no_leftovers() {
  sleep 0.2
  local left
  left=$(pgrep -f "$marker" | tr '\n' ' ')
  [ -z "$left" ] || { ps -o pid,pgid,stat,args -p "${left// /,}"; fail "processes of the job remain: $left"; }
}
# Waits until file $1 has $2 lines matching $3 (at most 10 s).
wait_for_lines() {
  for _ in $(seq 100); do
    [ "$(grep -c -- "$3" "$1" 2> /dev/null)" -ge "$2" ] && return 0
    sleep 0.1
  done
  fail "no $2 lines '$3' in $1"
}
now() { date +%s.%N; }
elapsed() { awk -v t0="$1" -v t1="$(now)" 'BEGIN { printf "%.1f", t1 - t0 }'; }

# Multi-node scenarios: one job token ($job_token); $1: port, $2: node rank, $3: output
# file, rest: the command. NODE_FLAGS: the job's shape (every node the same).
job_token=launch-test-$RANDOM$RANDOM
NODE_FLAGS=(--nnodes 2 --nproc-per-node 2)
node() {
  local port=$1 rank=$2 out=$3
  shift 3
  MESHTRAIN_JOB_TOKEN=$job_token "$MT" launch "${NODE_FLAGS[@]}" --node-rank "$rank" --master-port "$port" \
    --join-timeout 20 --kill-timeout 2 -- "$@" > "$out" 2>&1
}
# Starts node 0 in the background on a free port ($port, $node0): node 0
# says when it cannot listen; another port is tried.
start_node0() {
  for _ in 1 2 3 4 5; do
    port=$((20000 + RANDOM % 40000))
    node "$port" 0 "$tmp/node0.out" "$@" &
    node0=$!
    launchers+=("$node0")
    sleep 0.3
    grep -q "another process uses this port" "$tmp/node0.out" || return 0
    wait "$node0"
  done
  fail "no free port found"
}
# The worker of the elastic scenarios: a line with its place; in round 0 it
# sleeps (until stopped), in later rounds it ends at once.
elastic_worker='echo "round $MESHTRAIN_RESTART_COUNT rank $RANK of $WORLD_SIZE reason=${MESHTRAIN_RESTART_REASON:-}"
  [ "$MESHTRAIN_RESTART_COUNT" = 0 ] && exec $SLEEP 60; exit 0'

case $scenario in
env)
  long=$(printf 'x%.0s' $(seq 10000))
  "$MT" launch --nproc-per-node 3 --master-port 0 -- sh -c \
    'echo "env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $MASTER_PORT $MESHTRAIN_AGENT_STORE $MESHTRAIN_RESTART_COUNT $MESHTRAIN_JOB_TOKEN"
     echo "to stderr from $RANK" >&2
     for i in 1 2 3 4 5 6 7 8 9 10; do echo "$1"; done
     printf "no newline at the end"' worker "$long" > "$tmp/stdout.out" 2> "$tmp/stderr.out" || fail "exit $?"
  for r in 0 1 2; do
    grep -Eq "^\[rank $r\] env $r 3 $r 3 0 127\.0\.0\.1 [0-9]+ 1 0 [0-9a-f]{32}$" "$tmp/stdout.out" ||
      fail "no environment line for rank $r"
    grep -q "^\[rank $r\] to stderr from $r$" "$tmp/stderr.out" || fail "no stderr line of rank $r"
    [ "$(grep -cx "\[rank $r\] $long" "$tmp/stdout.out")" = 10 ] || fail "rank $r's 10000-byte lines did not arrive whole"
    grep -qx "\[rank $r\] no newline at the end" "$tmp/stdout.out" || fail "rank $r's last partial line is missing"
  done
  [ "$(grep -vc '^\[rank [0-2]\] ' "$tmp/stdout.out")" = 0 ] || fail "a stdout line without its prefix"
  # One port, one token for the whole job; the port is not 0.
  [ "$(grep -o 'env [0-9] .*' "$tmp/stdout.out" | awk '{print $8, $11}' | sort -u | wc -l)" = 1 ] ||
    fail "the workers got different ports or tokens"
  grep -q ' 127\.0\.0\.1 0 ' "$tmp/stdout.out" && fail "MASTER_PORT 0 was passed on"
  ;;
failure)
  t0=$(now)
  "$MT" launch --nproc-per-node 4 --master-port 0 --kill-timeout 2 -- sh -c '
    case $RANK in
      1) $SLEEP 0.5; exit 3 ;;
      2) kill -STOP $$ ;;
      3) $SLEEP 60 & wait ;;
      *) exec $SLEEP 60 ;;
    esac' > "$tmp/launch.out" 2>&1
  rc=$?
  [ $rc -ne 0 ] || fail "the launcher returned 0"
  grep -Eq "^meshtrain launch: rank 1 \(pid [0-9]+\) exited with status 3$" "$tmp/launch.out" ||
    fail "the launcher does not name rank 1 and its status"
  grep -q "^meshtrain launch: rank [023] " "$tmp/launch.out" && fail "a sibling that was stopped on purpose is reported"
  [ "$(awk -v e="$(elapsed "$t0")" 'BEGIN { print (e < 10) }')" = 1 ] || fail "took $(elapsed "$t0") s"
  no_leftovers
  ;;
sigterm)
  "$MT" launch --nproc-per-node 3 --master-port 0 -- sh -c 'echo started; $SLEEP 60 & wait' > "$tmp/launch.out" 2>&1 &
  launcher=$!
  launchers+=("$launcher")
  wait_for_lines "$tmp/launch.out" 3 "started"
  [ "$(pgrep -f "$marker" | wc -l)" -ge 3 ] || fail "the workers' sleeps are not running"
  t0=$(now)
  kill -TERM "$launcher"
  wait "$launcher"
  rc=$?
  [ $rc = 143 ] || fail "exit $rc, not 143 (128 + SIGTERM)"
  grep -q "got SIGTERM: stopping the workers" "$tmp/launch.out" || fail "no line about the signal"
  [ "$(awk -v e="$(elapsed "$t0")" 'BEGIN { print (e < 4) }')" = 1 ] || fail "took $(elapsed "$t0") s"
  no_leftovers
  ;;
output)
  "$MT" launch --nproc-per-node 3 --master-port 0 --output rank0 -- sh -c 'echo "out $RANK"; echo "err $RANK" >&2' \
    > "$tmp/launch.out" 2>&1 || fail "exit $?"
  grep -qx "\[rank 0\] out 0" "$tmp/launch.out" || fail "rank 0's stdout line is missing"
  grep -qx "\[rank 0\] err 0" "$tmp/launch.out" || fail "rank 0's stderr line is missing"
  grep -q "\[rank [12]\]" "$tmp/launch.out" && fail "another rank's lines are shown"
  ;;
restart)
  "$MT" launch --nproc-per-node 2 --master-port 0 --max-restarts 1 -- sh -c '
    echo "run $MESHTRAIN_RESTART_COUNT"
    if [ "$MESHTRAIN_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then exit 1; fi
    [ "$MESHTRAIN_RESTART_COUNT" = 0 ] && exec $SLEEP 60
    exit 0' > "$tmp/launch.out" 2>&1 || fail "exit $?"
  grep -q "^meshtrain launch: rank 1 (pid [0-9]*) exited with status 1$" "$tmp/launch.out" || fail "no failure line"
  grep -qx "meshtrain launch: restarting the group (restart 1 of 1)" "$tmp/launch.out" || fail "no restart line"
  for r in 0 1; do
    grep -qx "\[rank $r\] run 1" "$tmp/launch.out" || fail "rank $r did not run with MESHTRAIN_RESTART_COUNT=1"
  done
  no_leftovers
  ;;
restart_flooded)
  # First run: rank 1 fails once the flood is in place, rank 0 waits; the
  # restarted group exits 0. The flood: a process of the test's own (in no
  # group of the job) opens 10,000 connections to the store and holds them.
  "$MT" launch --nproc-per-node 2 --master-port 0 --max-restarts 1 -- sh -c '
    if [ "$MESHTRAIN_RESTART_COUNT" = 0 ]; then
      [ "$RANK" = 1 ] || exec $SLEEP 120
      while [ ! -e "'"$tmp"'/flooded" ]; do $SLEEP 0.1; done
      exit 1
    fi
    echo "run $MESHTRAIN_RESTART_COUNT"' > "$tmp/launch.out" 2>&1 &
  launcher=$!
  launchers+=("$launcher")
  wait_for_lines "$tmp/launch.out" 1 "; store 127.0.0.1:[0-9]*"
  port=$(sed -n 's/.*; store 127\.0\.0\.1:\([0-9]*\) .*/\1/p' "$tmp/launch.out" | head -1)
  [ -n "$port" ] || fail "no store port in the launcher's first line"
  # 10,000 connections, or as many as this machine's descriptor limit allows.
  hard=$(ulimit -Hn)
  count=10000
  [ "$hard" != unlimited ] && ((hard - 100 < count)) && count=$((hard - 100))
  bash -c '
    ulimit -n "$(ulimit -Hn)"
    for i in $(seq "$4"); do exec {fd}<>"/dev/tcp/127.0.0.1/$1" || exit 1; done
    touch "$2/flooded"
    exec "$3" 120' flood "$port" "$tmp" "$SLEEP" "$count" 2> "$tmp/flood.err" &
  flood=$!
  launchers+=("$flood")
  wait "$launcher" || fail "the launcher exited $? with 10,000 idle connections on its store"
  [ -e "$tmp/flooded" ] || fail "the flood did not open its connections: $(cat "$tmp/flood.err")"
  grep -qx "meshtrain launch: restarting the group (restart 1 of 1)" "$tmp/launch.out" || fail "no restart line"
  for r in 0 1; do
    grep -qx "\[rank $r\] run 1" "$tmp/launch.out" || fail "rank $r did not run after the restart"
  done
  kill -0 "$flood" 2> /dev/null || fail "the flood ended before the restart"
  held=$(ls /proc/"$flood"/fd 2> /dev/null | wc -l)
  ((held >= count)) || fail "the flood holds $held descriptors, not $count"
  echo "the flood held $held descriptors through the restart"
  kill -KILL "$flood" 2> /dev/null
  ;;
elastic_shrink)
  NODE_FLAGS=(--nnodes 1:2 --nproc-per-node 1 --max-restarts 1 --heartbeat-timeout 2 --last-call 10)
  start_node0 sh -c "$elastic_worker"
  node "$port" 1 "$tmp/node1.out" sh -c "$elastic_worker" &
  node1=$!
  launchers+=("$node1")
  wait_for_lines "$tmp/node0.out" 1 "round 0 rank 0 of 2"
  wait_for_lines "$tmp/node1.out" 1 "round 0 rank 1 of 2"
  t0=$(now)
  pkill -KILL -P "$node1"  # the launcher (its workers die with it), not the subshell around it
  wait "$node0" || fail "node 0 exited $?"
  grep -q "^meshtrain launch: node 1 sent no heartbeat for 2 s: stopping the workers" "$tmp/node0.out" ||
    fail "node 0 does not say that node 1 is gone"
  grep -qx "meshtrain launch: restarting the group (restart 1 of 1)" "$tmp/node0.out" || fail "no restart line"
  grep -qx "meshtrain launch: round 1: node 0 -> ranks 0-0 of 1 on this node" "$tmp/node0.out" ||
    fail "no round of node 0 alone"
  grep -qx "\[rank 0\] round 1 rank 0 of 1 reason=node 1 sent no heartbeat for 2 s" "$tmp/node0.out" ||
    fail "the restarted worker did not get WORLD_SIZE 1 and the reason"
  [ "$(awk -v e="$(elapsed "$t0")" 'BEGIN { print (e < 12) }')" = 1 ] || fail "took $(elapsed "$t0") s"
  no_leftovers
  ;;
elastic_grow)
  NODE_FLAGS=(--nnodes 1:2 --nproc-per-node 1 --last-call 0.5)
  start_node0 sh -c "$elastic_worker"
  wait_for_lines "$tmp/node0.out" 1 "round 0 rank 0 of 1"
  node "$port" 1 "$tmp/node1.out" sh -c "$elastic_worker" || fail "node 1 exited $?"
  wait "$node0" || fail "node 0 exited $?"
  grep -qx "meshtrain launch: regrouping: node 1 joined (not counted as a restart)" "$tmp/node0.out" ||
    fail "node 0 did not regroup for node 1"
  grep -qx "\[rank 0\] round 1 rank 0 of 2 reason=node 1 joined" "$tmp/node0.out" || fail "rank 0 of 2"
  grep -qx "\[rank 1\] round 1 rank 1 of 2 reason=" "$tmp/node1.out" || fail "rank 1 of 2"
  no_leftovers
  ;;
elastic_too_few)
  t0=$(now)
  MESHTRAIN_JOB_TOKEN=$job_token "$MT" launch --nnodes 2:3 --master-port $((20000 + RANDOM % 40000)) \
    --join-timeout 2 -- true > "$tmp/node0.out" 2>&1 &&
    fail "the launcher returned 0 with 1 node of at least 2"
  grep -q "^meshtrain launch: only node 0 joined round 0 within 2 s; the job needs at least 2 (--nnodes 2:3)" \
    "$tmp/node0.out" || fail "the error does not say how many nodes are missing"
  [ "$(awk -v e="$(elapsed "$t0")" 'BEGIN { print (e < 5) }')" = 1 ] || fail "took $(elapsed "$t0") s"
  ;;
elastic_taken)
  NODE_FLAGS=(--nnodes 1:2 --nproc-per-node 1 --last-call 10)
  start_node0 sh -c 'echo "rank $RANK of $WORLD_SIZE"; exec $SLEEP 6'
  node "$port" 1 "$tmp/node1.out" sh -c 'echo "rank $RANK of $WORLD_SIZE"; exec $SLEEP 6' &
  node1=$!
  launchers+=("$node1")
  wait_for_lines "$tmp/node1.out" 1 "rank 1 of 2"
  # The same node number again while node 1's launcher runs: refused.
  node "$port" 1 "$tmp/taken.out" true && fail "a second launcher took --node-rank 1"
  grep -q "error: meshtrain launch: --node-rank 1 is taken by a running launcher of this job" "$tmp/taken.out" ||
    fail "the refusal does not name --node-rank"
  wait "$node0" || fail "node 0 exited $?"
  wait "$node1" || fail "node 1 exited $?"
  no_leftovers
  ;;
two_nodes)
  start_node0 sh -c 'echo "env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK"'
  node "$port" 1 "$tmp/node1.out" sh -c 'echo "env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK"' ||
    fail "node 1 exited $?"
  wait "$node0" || fail "node 0 exited $?"
  for r in 0 1 2 3; do
    grep -qx "\[rank $r\] env $r 4 $((r % 2)) 2 $((r / 2))" "$tmp/node$((r / 2)).out" || fail "rank $r's line"
  done
  # A failure on node 1 stops node 0's workers.
  t0=$(now)
  start_node0 sh -c 'exec $SLEEP 60'
  node "$port" 1 "$tmp/node1_fail.out" sh -c '[ "$RANK" = 3 ] && { $SLEEP 0.5; exit 7; }; exec $SLEEP 60'
  rc1=$?
  wait "$node0"
  rc0=$?
  [ $rc0 -ne 0 ] && [ $rc1 -ne 0 ] || fail "exit codes $rc0 (node 0) and $rc1 (node 1)"
  grep -Eq "^meshtrain launch: rank 3 \(pid [0-9]+\) exited with status 7$" "$tmp/node1_fail.out" ||
    fail "node 1 does not name rank 3"
  grep -Eq "^meshtrain launch: rank 3 \(pid [0-9]+\) on node 1 exited with status 7: stopping the workers of node 0$" \
    "$tmp/node0.out" || fail "node 0 does not name the rank that failed on node 1"
  [ "$(awk -v e="$(elapsed "$t0")" 'BEGIN { print (e < 10) }')" = 1 ] || fail "took $(elapsed "$t0") s"
  no_leftovers
  ;;
*)
  echo "unknown scenario $scenario"
  exit 2
  ;;
esac
echo "PASS: launch $scenario"
