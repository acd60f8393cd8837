#!/usr/bin/env bash
# Ctrl-C (SIGINT) to a training run: every rank stops after the same step,
# saves a checkpoint (--checkpoint-every is set), says where the run stands
# and exits 130 without committing the run directory; --resume then finishes
# the run.
#
#   tests/interrupt_test.sh MESHTRAIN threads|gloo
#
# threads: `meshtrain train` on 2 simulated devices gets the signal; gloo:
# `meshtrain launch --nproc-per-node 2`, which forwards it to its workers.
set -u
meshtrain=$1 engine=$2
tmp=$(mktemp -d /tmp/meshtrain-interrupt.XXXXXX)
cleanup() {
  pkill -KILL -f -- "$tmp" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  cat "$tmp/out"
  exit 1
}

args=(train --hidden 64,32 --batch-size 64 --max-steps 100000 --log-every 1 --threads-per-rank 1
      --checkpoint-every 100000 --run-dir "$tmp/run")
if [[ $engine == gloo ]]; then
  "$meshtrain" launch --nproc-per-node 2 --master-port 0 -- "$meshtrain" "${args[@]}" --engine gloo >"$tmp/out" 2>&1 &
else
  "$meshtrain" "${args[@]}" --devices 2 >"$tmp/out" 2>&1 &
fi
job=$!
for _ in $(seq 600); do  # the first step logged
  grep -q '"split":"train"' "$tmp/run.incomplete/metrics.jsonl" 2>/dev/null && break
  sleep 0.1
done
kill -INT "$job"
wait "$job"
rc=$?
[[ $rc == 130 ]] || fail "exit status $rc, not 130"
step=$(grep -o 'stopped after step [0-9]*' "$tmp/out" | head -1 | grep -o '[0-9]*$')
[[ -n $step ]] || fail "no 'stopped after step N' line"
# Every rank that reports names the same step.
[[ $(grep -o 'stopped after step [0-9]*' "$tmp/out" | sort -u | wc -l) == 1 ]] || fail "ranks stopped at different steps"
grep -q "continue with --resume $tmp/run" "$tmp/out" || fail "no --resume hint"
[[ ! -e $tmp/run/metrics.jsonl ]] || fail "the run directory was committed"
[[ -d $tmp/run.incomplete/checkpoints/$(printf 'step_%08d' "$step") ]] || fail "no checkpoint of step $step"

if [[ $engine == gloo ]]; then
  "$meshtrain" launch --nproc-per-node 2 --master-port 0 -- \
    "$meshtrain" train --resume "$tmp/run" --max-steps $((step + 2)) --engine gloo >"$tmp/out" 2>&1
else
  "$meshtrain" train --resume "$tmp/run" --max-steps $((step + 2)) --devices 2 >"$tmp/out" 2>&1
fi
rc=$?
[[ $rc == 0 ]] || fail "the resumed run exited $rc"
[[ -e $tmp/run/metrics.jsonl ]] || fail "the resumed run was not committed"
echo "PASS: stopped after step $step, resumed to step $((step + 2))"
