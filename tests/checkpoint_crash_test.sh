#!/usr/bin/env bash
# kill -9 a training run at a random moment after its first checkpoint,
# resume it with --resume; 10 trials (at least one killed inside a save: if
# none has landed in one by the last trial, that trial waits for a save to
# begin and kills then, and trials go on until one does): every time the
# final model is the uninterrupted run's, byte for byte.
#
#   tests/checkpoint_crash_test.sh MESHTRAIN threads|mpi|gloo [TRIALS [TRAIN FLAGS...]]
#
# TRAIN FLAGS go to every run (e.g. --async-checkpoint: saves written in the
# background, the kill often landing while one is in flight). RESUME_MESH
# (threads only) resumes on another mesh: with --deterministic the final
# model is still the uninterrupted run's, byte for byte.
#
# The run: the MLP (784 -> 64 -> 32 -> 10), data=2, 60 steps, a checkpoint
# every step (so a random kill often lands inside a save: a save leaves
# checkpoints/.step_N.tmp behind when it is cut short). threads: one
# process, 2 simulated devices; mpi: mpirun -np 2, and the victim is rank 1's
# process (mpirun then ends rank 0). gloo: `meshtrain launch --nproc-per-node
# 2 --max-restarts 1`, the victim is rank 1's worker, and the launcher
# restarts the group, whose workers resume by themselves
# (MESHTRAIN_RESTART_COUNT): no --resume by hand.
set -u
meshtrain=$1 engine=$2 trials=${3:-10}
shift $(($# < 3 ? $# : 3))
extra=("$@")
tmp=$(mktemp -d /tmp/meshtrain-crash.XXXXXX)
cleanup() {
  pkill -KILL -f -- "$tmp" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

args=(train --hidden 64,32 --batch-size 64 --max-steps 60 --log-every 10 --threads-per-rank 1
      --checkpoint-every 1 --keep-last 2 "${extra[@]}")
launch() {  # launch OUT ARGS...: start a run in the background, its pid in $job
  local out=$1
  shift
  if [[ $engine == mpi ]]; then
    mpirun --oversubscribe -np 2 "$meshtrain" "$@" --engine mpi >"$out" 2>&1 &
  elif [[ $engine == gloo ]]; then
    "$meshtrain" launch --nproc-per-node 2 --master-port 0 --max-restarts 1 -- \
      "$meshtrain" "$@" --engine gloo >"$out" 2>&1 &
  else
    "$meshtrain" "$@" >"$out" 2>&1 &
  fi
  job=$!
}
mesh=()
[[ $engine == threads ]] && mesh=(--mesh data=2)

# Every run here must compute the same bits, so every process must run each
# GEMM shape on the same backend: the auto policy measures per process
# (core/matmul.h), so one process measures first and writes the choices to a
# cache file that every later process reads (a run of 2 threads-engine
# ranks has the per-rank shapes of every engine's run here).
export MESHTRAIN_GEMM_CACHE=$tmp/gemm.json
if ! "$meshtrain" "${args[@]}" --mesh data=2 --run-dir "$tmp/warm" >"$tmp/warm.out" 2>&1; then
  echo "FAIL: the run that measures the GEMMs failed"
  cat "$tmp/warm.out"
  exit 1
fi

# The uninterrupted run.
launch "$tmp/ref.out" "${args[@]}" "${mesh[@]}" --run-dir "$tmp/ref"
if ! wait "$job"; then
  echo "FAIL: the uninterrupted run failed"
  cat "$tmp/ref.out"
  exit 1
fi

good=0 in_save=0 attempts=0
while ((good < trials || in_save == 0)); do
  ((attempts++))
  if ((attempts > 4 * trials)); then
    echo "FAIL: $good good trials, $in_save inside a save, after $attempts attempts"
    exit 1
  fi
  run="$tmp/run$attempts"
  launch "$tmp/out$attempts" "${args[@]}" "${mesh[@]}" --run-dir "$run"
  # After the first checkpoint, a random moment of the run.
  for _ in $(seq 1 600); do
    [[ -e $run.incomplete/checkpoints/latest ]] && break
    kill -0 "$job" 2>/dev/null || break
    sleep 0.01
  done
  if ((good + 1 >= trials && in_save == 0)); then
    # No kill has landed inside a save yet, and this is the last trial:
    # aim for one (wait until a save has begun, i.e. its .tmp exists).
    for _ in $(seq 1 20000); do
      compgen -G "$run.incomplete/checkpoints/.step_*.tmp" >/dev/null && break
      kill -0 "$job" 2>/dev/null || break
    done
  else
    sleep "0.$((RANDOM % 40))"
  fi
  victim=$job
  if [[ $engine != threads ]]; then
    rank_var=OMPI_COMM_WORLD_RANK=1
    [[ $engine == gloo ]] && rank_var=RANK=1
    victim=""
    for p in $(pgrep -f -- "$run"); do
      if [[ $p != "$job" ]] && tr '\0' '\n' 2>/dev/null <"/proc/$p/environ" | grep -qx "$rank_var"; then
        victim=$p
      fi
    done
  fi
  if [[ -z $victim ]] || ! kill -KILL "$victim" 2>/dev/null; then
    wait "$job" 2>/dev/null
    continue  # it finished first: not a trial
  fi
  killed_in_save=0
  if [[ $engine == gloo ]]; then
    # The launcher restarts the group and the workers resume on their own;
    # a save cut short leaves its .tmp until the restarted run replaces it.
    for _ in $(seq 1 200); do
      compgen -G "$run.incomplete/checkpoints/.step_*.tmp" >/dev/null && { killed_in_save=1; break; }
      grep -q "restarting the group" "$tmp/out$attempts" 2>/dev/null && break
      sleep 0.005
    done
    if ! wait "$job"; then
      echo "FAIL: trial $attempts: the restarted group failed"
      cat "$tmp/out$attempts"
      exit 1
    fi
    cp "$tmp/out$attempts" "$tmp/resume$attempts"
    grep -q "resuming .* from its latest checkpoint" "$tmp/resume$attempts" ||
      continue  # the kill landed after the run ended: not a trial
  else
    wait "$job" 2>/dev/null
    if [[ -e $run/model.safetensors ]]; then
      continue  # killed after the commit: not a trial
    fi
    compgen -G "$run.incomplete/checkpoints/.step_*.tmp" >/dev/null && killed_in_save=1
    # Resume (the same mesh, the run's own config.toml, unless RESUME_MESH).
    resume_mesh=()
    [[ -n ${RESUME_MESH:-} && $engine == threads ]] && resume_mesh=(--mesh "$RESUME_MESH")
    launch "$tmp/resume$attempts" train --resume "$run" "${resume_mesh[@]}"
    if ! wait "$job"; then
      echo "FAIL: trial $attempts: the resumed run failed"
      cat "$tmp/out$attempts" "$tmp/resume$attempts"
      exit 1
    fi
  fi
  if ! cmp -s "$run/model.safetensors" "$tmp/ref/model.safetensors"; then
    echo "FAIL: trial $attempts: the resumed run's model differs from the uninterrupted run's"
    grep -h "resumed from" "$tmp/resume$attempts"
    exit 1
  fi
  ((good++))
  ((in_save += killed_in_save))
  echo "trial $good: killed $( ((killed_in_save)) && echo "inside a save" || echo "between saves"), $(grep -ho 'resumed from.*' "$tmp/resume$attempts"): model identical"
  rm -rf "$run" "$run.incomplete"
done
echo "PASS: $good trials ($in_save killed inside a save), every resumed model identical to the uninterrupted run's"
