#!/usr/bin/env bash
# A flipped byte in one rank's checkpoint file: --resume fails on every rank
# (exit 1, no hang), and the rank that read the damaged file prints its own
# error (the file, the tensor) before the collective verdict, which names
# that rank: on the threads engine, under mpirun and under meshtrain launch.
#
#   tests/damaged_checkpoint_test.sh MESHTRAIN threads|mpi|gloo
set -u
meshtrain=$1 engine=$2
tmp=$(mktemp -d /tmp/meshtrain-damaged.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
run() {
  if [[ $engine == mpi ]]; then
    mpirun --oversubscribe -np 2 "$meshtrain" "$@" --engine mpi
  elif [[ $engine == gloo ]]; then
    "$meshtrain" launch --nproc-per-node 2 --master-port 0 -- "$meshtrain" "$@" --engine gloo
  else
    "$meshtrain" "$@" --mesh fsdp=2
  fi
}
args=(train --fsdp zero3 --hidden 64,32 --threads-per-rank 1)
[[ $engine != threads ]] && args+=(--mesh fsdp=2)
run "${args[@]}" --max-steps 4 --checkpoint-every 2 --run-dir "$tmp/run" >"$tmp/first.out" 2>&1 ||
  { cat "$tmp/first.out"; echo "FAIL: the first run failed"; exit 1; }
file=$tmp/run/checkpoints/step_00000004/rank_00000.bin
printf '\377\377\377\377' | dd of="$file" bs=1 seek=200 conv=notrunc 2>/dev/null
run "${args[@]}" --max-steps 6 --resume "$tmp/run" >"$tmp/resume.out" 2>&1
rc=$?
cat "$tmp/resume.out" | grep -v "^[a-z_]* = "
((rc == 1)) || { echo "FAIL: --resume exited $rc, not 1"; exit 1; }
grep -q "meshtrain: rank 0: load checkpoint: '.*rank_00000.bin': the piece of '.*' at byte [0-9]* fails its checksum" \
  "$tmp/resume.out" || { echo "FAIL: rank 0 did not print its error"; exit 1; }
# Every process prints its rank's error; the threads engine's one process
# ends with whichever rank's came first (rank 0's own, or rank 1's naming it).
grep -q "rank 0 could not load its part" "$tmp/resume.out" ||
  { [[ $engine == threads ]] && grep -q "^meshtrain: error: load checkpoint: .*rank_00000.bin" "$tmp/resume.out"; } ||
  { echo "FAIL: the verdict does not name rank 0"; exit 1; }
echo "PASS: damaged_checkpoint $engine"
