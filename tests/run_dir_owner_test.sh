#!/usr/bin/env bash
# Two runs into one run directory (issue: a second run removed the first's
# staging directory and the first lost its work): while a run trains into R,
# a second `train --run-dir R` and then, on a checkpointed run, a second
# `--resume R` are refused at once, naming the live run's process; the
# first runs to the end and commits its model.
#
#   tests/run_dir_owner_test.sh MESHTRAIN threads|mpi|gloo
set -u
meshtrain=$1 engine=$2
tmp=$(mktemp -d /tmp/meshtrain-owner.XXXXXX)
cleanup() {
  pkill -KILL -f -- "$tmp" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# Long enough (several seconds) that the second run starts while the first
# trains; the test fails, not passes, if the first ends too soon.
args=(train --hidden 256,256 --batch-size 128 --epochs 100 --log-every 500 --threads-per-rank 1 --checkpoint-every 1000)
run() {  # run OUT ARGS...: a run in the foreground; its exit code
  local out=$1
  shift
  if [[ $engine == mpi ]]; then
    mpirun --oversubscribe -np 2 "$meshtrain" "$@" --engine mpi >"$out" 2>&1
  elif [[ $engine == gloo ]]; then
    "$meshtrain" launch --nproc-per-node 2 --master-port 0 -- "$meshtrain" "$@" --engine gloo >"$out" 2>&1
  else
    "$meshtrain" "$@" --mesh data=2 >"$out" 2>&1
  fi
}
fail() {
  echo "FAIL: $*"
  for f in "$tmp"/*.out; do echo "--- $f"; cat "$f"; done
  exit 1
}
# wait_for_lock R PID: until R.lock exists while PID runs (60 s at most).
wait_for_lock() {
  for _ in $(seq 600); do
    [[ -e $1.lock ]] && return 0
    kill -0 "$2" 2>/dev/null || fail "the first run ended before it took $1"
    sleep 0.1
  done
  fail "no lock $1.lock after 60 s"
}
# second FIRST_PID OUT WHAT ARGS...: runs while the first holds R; must be refused.
second() {
  local pid=$1 out=$2 what=$3
  shift 3
  run "$out" "$@"
  local rc=$?
  kill -0 "$pid" 2>/dev/null || fail "inconclusive: the first run ended before the second $what did"
  ((rc == 1)) || fail "the second $what exited $rc, not 1"
  grep -q "run directory '$tmp/run' is in use by process [0-9]\+ on host " "$out" ||
    fail "the second $what did not name the live run"
}

# A run, and a second one into the same directory while it trains.
run "$tmp/first.out" "${args[@]}" --max-steps 3000 --run-dir "$tmp/run" &
first=$!
wait_for_lock "$tmp/run" "$first"
second "$first" "$tmp/second.out" "run" "${args[@]}" --max-steps 3000 --run-dir "$tmp/run"
second "$first" "$tmp/second_overwrite.out" "run with --overwrite" "${args[@]}" --max-steps 3000 --run-dir "$tmp/run" --overwrite
wait "$first" || fail "the first run failed after the second was refused"
[[ -s $tmp/run/model.safetensors ]] || fail "the first run left no model"
[[ -e $tmp/run.lock || -e $tmp/run.incomplete ]] && fail "the first run left its lock or staging behind"

# Two resumes of the same checkpointed run.
run "$tmp/resume.out" "${args[@]}" --max-steps 6000 --resume "$tmp/run" &
first=$!
wait_for_lock "$tmp/run" "$first"
second "$first" "$tmp/second_resume.out" "resume" "${args[@]}" --max-steps 6000 --resume "$tmp/run"
wait "$first" || fail "the first resume failed after the second was refused"
grep -q '"step":6000' "$tmp/run/metrics.jsonl" || fail "the resumed run did not reach step 6000"
echo "PASS: run_dir_owner $engine"
