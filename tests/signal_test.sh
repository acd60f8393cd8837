#!/usr/bin/env bash
# A rank of a two-process job is stopped (SIGSTOP) or killed (SIGKILL)
# while the job runs; the launcher (mpirun for the mpi engine, `meshtrain
# launch` for gloo) must return non-zero within 2x the deadline of the
# signal, the output must name the rank, and (gloo) no process of the job
# may remain.
#
#   tests/signal_test.sh MESHTRAIN mpi|gloo STOP|KILL train|collective [DEADLINE_S]
#
# train: `meshtrain train` (MLP, data parallel, fingerprint checks on).
# collective: `meshtrain bench collectives` looping 16 MiB all_reduces with
# fingerprint checks off, so a stop most likely lands mid-transfer (--seconds
# 10: its memcpy reference rounds, which make no MPI call, last at most 1 s).
# --no-peer: the engine's rows only (a stop that lands in one of Gloo's own
# algorithms, timed beside the engine, ends in Gloo's own timeout, which
# names no rank).
set -u
meshtrain=$1 engine=$2 sig=$3 scenario=$4 deadline=${5:-4}
tmp=$(mktemp -d /tmp/meshtrain-signal.XXXXXX)
cleanup() {
  pkill -KILL -f "$tmp" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT

case $scenario in
  train)
    cmd=("$meshtrain" train --engine "$engine" --timeout "$deadline" --epochs 3 --threads-per-rank 1
         --run-dir "$tmp/run")
    started() { grep -q "train \[" "$tmp/out" 2>/dev/null; } ;;
  collective)
    cmd=("$meshtrain" bench collectives --engine "$engine" --timeout "$deadline" --min 16M --max 16M
         --ops all_reduce --seconds 10 --no-peer --json "$tmp/rows.jsonl")
    started() { grep -q "meshtrain bench collectives:" "$tmp/out" 2>/dev/null; } ;;
  *) echo "unknown scenario $scenario"; exit 2 ;;
esac

if [[ $engine == mpi ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  mpirun --oversubscribe -np 2 "${cmd[@]}" >"$tmp/out" 2>&1 &
  rank_var=OMPI_COMM_WORLD_RANK=1
  launcher=mpirun
else
  "$meshtrain" launch --nproc-per-node 2 --master-port 0 -- "${cmd[@]}" >"$tmp/out" 2>&1 &
  rank_var=RANK=1
  launcher="meshtrain launch"
fi
job=$!

# Rank 1: the process whose environment says so.
victim=""
for _ in $(seq 1 600); do
  if started; then
    for p in $(pgrep -f -- "$tmp"); do
      if [[ $p != "$job" ]] && tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "$rank_var"; then
        victim=$p
      fi
    done
  fi
  [[ -n $victim ]] && break
  kill -0 "$job" 2>/dev/null || break
  sleep 0.1
done
if [[ -z $victim ]]; then
  echo "FAIL: the job did not start (or rank 1 was not found)"
  cat "$tmp/out"
  exit 1
fi
sleep 1  # well inside the run: training steps or collective rounds
kill "-$sig" "$victim"
t0=$(date +%s.%N)

limit=$(awk -v d="$deadline" 'BEGIN { print 2 * d }')
rc=""
while :; do
  if ! kill -0 "$job" 2>/dev/null; then
    wait "$job"
    rc=$?
    break
  fi
  if awk -v t0="$t0" -v l="$limit" -v now="$(date +%s.%N)" 'BEGIN { exit !(now - t0 > l + 1) }'; then
    break
  fi
  sleep 0.1
done
elapsed=$(awk -v t0="$t0" -v now="$(date +%s.%N)" 'BEGIN { printf "%.2f", now - t0 }')

fail=0
if [[ -z $rc ]]; then
  echo "FAIL: $launcher still running ${elapsed} s after SIG$sig (deadline ${deadline} s)"
  kill -KILL "$job" 2>/dev/null
  fail=1
else
  [[ $rc -ne 0 ]] || { echo "FAIL: $launcher returned 0"; fail=1; }
  awk -v e="$elapsed" -v l="$limit" 'BEGIN { exit !(e <= l) }' ||
    { echo "FAIL: $launcher returned after ${elapsed} s, more than 2x the deadline (${limit} s)"; fail=1; }
fi
if [[ $engine == gloo && -n $rc ]]; then
  # The launcher reaped every worker: no process of the job is left (the
  # stopped one included), and it named the worker that failed first.
  sleep 0.2
  left=$(pgrep -f -- "$tmp" | tr '\n' ' ')
  [[ -z $left ]] || { echo "FAIL: processes of the job remain after the launcher returned: $left"; ps -o pid,pgid,stat,args -p ${left// /,}; fail=1; }
  grep -E "meshtrain launch: rank [01] " "$tmp/out" >/dev/null ||
    { echo "FAIL: the launcher does not name the worker that failed"; fail=1; }
fi
# The error names rank 1: meshtrain's diagnosis after a stop, the launcher's
# or the engine's after a kill.
if [[ $sig == STOP ]]; then
  grep -E "meshtrain: error on rank 0: .*(did not arrive: \[1\]|rank 1 does not answer)" "$tmp/out" >/dev/null ||
    { echo "FAIL: no error on rank 0 naming rank 1"; fail=1; }
else
  grep -E "rank 1 .*(exited on signal 9|Killed|killed by signal)|process rank 1|connection to rank 1 failed" "$tmp/out" >/dev/null ||
    { echo "FAIL: the output does not name rank 1"; fail=1; }
fi
echo "--- output (tail)"
tail -n 25 "$tmp/out"
echo "---"
if [[ $fail -ne 0 ]]; then
  echo "signal_test $engine $sig $scenario: FAILED (rc=${rc:-none}, ${elapsed} s after the signal)"
  exit 1
fi
echo "signal_test $engine $sig $scenario: $launcher returned $rc ${elapsed} s after SIG$sig of rank 1 (deadline ${deadline} s)"
