#!/usr/bin/env bash
# A run saved on 4 devices resumes on 2 (as after losing a node): the data
# axis takes the change (data=4 -> data=2), micro-batches double so each
# keeps its size, and with --deterministic the final model and the checksum
# log are the uninterrupted 4-device run's, byte for byte; back on 4
# devices the micro-batches divide back. A GPT that no longer fits
# --device-memory on fewer devices is re-planned.
#
#   tests/elastic_resume_test.sh MESHTRAIN
set -u
meshtrain=$1
tmp=$(mktemp -d /tmp/meshtrain-elastic.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
args=(train --hidden 64,32 --batch-size 64 --deterministic --deterministic-block 16 --checksum-every 5
      --threads-per-rank 1 --log-every 5)
fail() {
  echo "FAIL: $*"
  exit 1
}
"$meshtrain" "${args[@]}" --mesh data=4 --max-steps 20 --run-dir "$tmp/ref" >"$tmp/ref.out" 2>&1 ||
  { cat "$tmp/ref.out"; fail "the uninterrupted run failed"; }
"$meshtrain" "${args[@]}" --mesh data=4 --max-steps 10 --checkpoint-every 10 --run-dir "$tmp/run" \
  >"$tmp/first.out" 2>&1 || { cat "$tmp/first.out"; fail "the first part failed"; }
"$meshtrain" train --resume "$tmp/run" --devices 2 --max-steps 20 >"$tmp/resume.out" 2>&1 ||
  { cat "$tmp/resume.out"; fail "the resume on 2 devices failed"; }
grep -q "resuming on 2 devices: mesh data=4 -> data=2" "$tmp/resume.out" ||
  { cat "$tmp/resume.out"; fail "no re-planned mesh"; }
grep -q "micro_batches = 2 (was 1)" "$tmp/resume.out" || fail "the micro-batches did not double"
grep -q '"event":"layout_change".*"from":"mesh data=4 (data parallel 4)".*"to":"mesh data=2 (data parallel 2)"' \
  "$tmp/run/metrics.jsonl" || { grep layout "$tmp/run/metrics.jsonl"; fail "metrics.jsonl has no layout_change line"; }
cmp -s "$tmp/ref/model.safetensors" "$tmp/run/model.safetensors" ||
  fail "the resumed model differs from the uninterrupted run's"
"$meshtrain" checksums "$tmp/ref" "$tmp/run" || fail "the checksum logs differ"
# A launcher's restart on the same layout (its variables set by hand) is a
# "restart" line with the reason and the time lost.
MESHTRAIN_RESTART_REASON="rank 1 (pid 42) on node 0 exited with status 1" \
  MESHTRAIN_RESTART_EVENT_MS=$(($(date +%s%3N) - 1500)) MESHTRAIN_RESTART_RENDEZVOUS_MS=1000 \
  "$meshtrain" train --resume "$tmp/run" --max-steps 25 >"$tmp/same.out" 2>&1 ||
  { cat "$tmp/same.out"; fail "the resume on the same mesh failed"; }
grep -q '"event":"restart","from":"mesh data=2 (data parallel 2)","to":"mesh data=2 (data parallel 2)","reason":"rank 1' \
  "$tmp/run/metrics.jsonl" || { grep event "$tmp/run/metrics.jsonl"; fail "no restart line"; }
grep '"event":"restart"' "$tmp/run/metrics.jsonl" | grep -q '"rendezvous_s":1,' || fail "the restart line has no times"
# Back on 4 devices (a node returned): the micro-batches divide back.
"$meshtrain" train --resume "$tmp/run" --devices 4 --max-steps 35 >"$tmp/back.out" 2>&1 ||
  { cat "$tmp/back.out"; fail "the resume on 4 devices failed"; }
grep -q "micro_batches = 1 (was 2): each micro-batch keeps its size on 4 data-parallel ranks instead of 2" \
  "$tmp/back.out" || { grep "^#" "$tmp/back.out"; fail "the micro-batches did not divide back"; }
# Axes that do not divide the devices: refused, naming --mesh.
"$meshtrain" train --hidden 64,32 --batch-size 64 --mesh data=2,pipeline=2 --max-steps 5 --checkpoint-every 5 \
  --threads-per-rank 1 --run-dir "$tmp/pp" >"$tmp/pp.out" 2>&1 || { cat "$tmp/pp.out"; fail "the pipeline run failed"; }
if "$meshtrain" train --resume "$tmp/pp" --devices 3 --max-steps 10 >"$tmp/pp3.out" 2>&1; then
  fail "a pipeline=2 run resumed on 3 devices"
fi
grep -q "give --mesh for 3 devices" "$tmp/pp3.out" ||
  { cat "$tmp/pp3.out"; fail "the refusal does not say how to fix it"; }
# --device-memory: a GPT saved on fsdp=4 (zero1, predicted 45.3 MiB per
# device) resumes on 2 devices, where fsdp=2 with 2 micro-batches needs
# 53.3 MiB, more than 58MiB's 52.2 usable: the planner's memory model
# re-plans it (4 micro-batches, 50.8 MiB) and the run finishes.
gpt=(train --model gpt --corpus /usr/share/games/fortunes/computers --text-cache "$tmp/text" --vocab 4096 --layers 4
     --heads 4 --width 256 --context 16 --batch-size 8 --threads-per-rank 1 --fsdp zero1 --device-memory 58MiB)
"$meshtrain" "${gpt[@]}" --mesh fsdp=4 --max-steps 10 --checkpoint-every 10 --run-dir "$tmp/gpt" >"$tmp/gpt.out" 2>&1 ||
  { cat "$tmp/gpt.out"; fail "the GPT run failed"; }
"$meshtrain" train --resume "$tmp/gpt" --devices 2 --max-steps 20 >"$tmp/gpt2.out" 2>&1 ||
  { cat "$tmp/gpt2.out"; fail "the GPT did not resume on 2 devices"; }
grep -q "re-planned: mesh fsdp=2, 4 micro-batches, predicted peak" "$tmp/gpt2.out" ||
  { grep "^#" "$tmp/gpt2.out"; fail "no re-plan for the devices' memory"; }
echo "PASS: elastic resume: data=4 -> data=2, identical bytes and checksums; pipeline=2 on 3 devices refused;" \
  "a GPT re-planned to fit --device-memory"
