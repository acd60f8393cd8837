#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan, preset "fuzz", in
# build/fuzz) and runs each on its corpus (docs/fuzzing.md). Exits non-zero
# on the first finding; the crashing input is left in build/fuzz/findings/.
#
#   fuzz/run.sh --smoke 30                     # CI: every target for 30 s
#   fuzz/run.sh --time 600 idx_fuzzer          # one target for 10 minutes
#   fuzz/run.sh --runs 10000000 token_file_fuzzer
#   fuzz/run.sh --build                        # build only
#
# Options: --smoke S / --time S (-max_total_time=S), --runs N (-runs=N),
# --build (no run). Targets default to all five. Environment: FUZZ_MAX_LEN
# (-max_len, default 4096), JOBS (build jobs, default nproc), FUZZ_ARGS
# (more libFuzzer flags). New inputs go to build/fuzz/corpus/<target> (a
# scratch directory); fuzz/corpus/<target> (the seeds) is only read.
set -euo pipefail
cd "$(dirname "$0")/.."

all_targets=(checkpoint_index_fuzzer safetensors_fuzzer token_file_fuzzer idx_fuzzer store_wire_fuzzer)
mode=time
amount=60
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke | --time) mode=time; amount="${2:?$1 needs SECONDS}"; shift 2 ;;
    --runs) mode=runs; amount="${2:?--runs needs N}"; shift 2 ;;
    --build) mode=build; shift ;;
    -h | --help) sed -n '2,17p' "$0"; exit 0 ;;
    -*) echo "run.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=("${all_targets[@]}")
for t in "${targets[@]}"; do
  [[ " ${all_targets[*]} " == *" $t "* ]] || { echo "run.sh: no fuzz target '$t' (${all_targets[*]})" >&2; exit 2; }
done

if ! command -v clang++ >/dev/null; then
  echo "run.sh: clang++ not found: sudo apt install clang libclang-rt-14-dev" >&2
  exit 2
fi

build=build/fuzz
[ -f "$build/build.ninja" ] || cmake --preset fuzz
cmake --build "$build" --target fuzzers -j "${JOBS:-$(nproc)}"
[ "$mode" = build ] && exit 0

# Dictionaries of the formats' keywords (libFuzzer -dict).
mkdir -p "$build/dict"
cat >"$build/dict/checkpoint_index_fuzzer.dict" <<'DICT'
"\"format\""
"\"meshtrain.checkpoint\""
"\"version\""
"\"step\""
"\"metadata\""
"\"files\""
"\"tensors\""
"\"name\""
"\"bytes\""
"\"dtype\""
"\"f32\""
"\"shape\""
"\"pieces\""
"\"file\""
"\"offset\""
"\"crc32\""
"\"view\""
"\"offsets\""
"\"sizes\""
"\"start\""
"\"count\""
"-1"
"9223372036854775807"
"-9223372036854775808"
"18446744073709551615"
"1e300"
"rank_00000.bin"
DICT
cat >"$build/dict/safetensors_fuzzer.dict" <<'DICT'
"\"dtype\""
"\"shape\""
"\"data_offsets\""
"\"__metadata__\""
"\"F32\""
"\"F64\""
"\"BF16\""
"\"F16\""
"\"I8\""
"\"I32\""
"\"I64\""
"\"U8\""
"9223372036854775807"
"18446744073709551615"
"4294967296"
"1e300"
DICT
cat >"$build/dict/token_file_fuzzer.dict" <<'DICT'
"MTTOKENS"
"\x01\x00\x00\x00"
"\x02\x00\x00\x00"
"\x04\x00\x00\x00"
"\x00\x00\x01\x00\x00\x00\x00\x00"
"\x01\x00\x01\x00\x00\x00\x00\x00"
"\x00\x00\x00\x80\x00\x00\x00\x00"
"\xff\xff\xff\xff\xff\xff\xff\xff"
DICT
cat >"$build/dict/store_wire_fuzzer.dict" <<'DICT'
"\x07"
"\x01"
"\x02"
"\x05"
"\x0a\x00\x00\x00fuzz-token"
"\x00\x00\x00\x00"
"\xff\xff\xff\xff"
"\xe8\x03\x00\x00\x00\x00\x00\x00"
DICT
cat >"$build/dict/idx_fuzzer.dict" <<'DICT'
"\x00\x00\x08\x01"
"\x00\x00\x08\x03"
"\x00\x00\x08\x04"
"\x1f\x8b\x08\x00"
"\xff\xff\xff\xff"
"\x00\x00\x00\x00"
"\x00\x04\x00\x00"
DICT

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
status=0
for t in "${targets[@]}"; do
  work="$build/corpus/$t"
  findings="$build/findings/$t"
  mkdir -p "$work" "$findings"
  if [ "$mode" = runs ]; then limit=(-runs="$amount"); else limit=(-max_total_time="$amount"); fi
  # shellcheck disable=SC2206
  cmd=("$build/fuzz/$t" "${limit[@]}" -max_len="${FUZZ_MAX_LEN:-4096}" -timeout=25 -rss_limit_mb=2048
       -print_final_stats=1 -dict="$build/dict/$t.dict" -artifact_prefix="$findings/" ${FUZZ_ARGS:-}
       "$work" "fuzz/corpus/$t")
  echo "== $t: ${cmd[*]}"
  if ! "${cmd[@]}"; then
    echo "run.sh: $t found a problem; the input is in $findings/" >&2
    status=1
  fi
done
exit $status
