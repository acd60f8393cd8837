#!/usr/bin/env bash
# Installs every Debian package meshtrain needs. Idempotent: packages already
# present are skipped, so a second run does no network work.
set -euo pipefail

packages=(
  g++ cmake ninja-build make pkg-config
  libopenblas-dev
  libdnnl-dev  # oneDNN: f32/bf16 matrix products (core/matmul.h); without it OpenBLAS runs them
  ocl-icd-opencl-dev  # oneDNN's CMake config requires OpenCL (a Recommends of libdnnl-dev, not installed here)
  libopenmpi-dev openmpi-bin
  libgloo-dev  # the gloo engine (comm/gloo)
  iproute2  # ip netns: tests/gloo_two_node_test.sh
  libgtest-dev libgmock-dev libbenchmark-dev
  libfmt-dev libcli11-dev libtomlplusplus-dev nlohmann-json3-dev libstb-dev
  zlib1g-dev
  libsentencepiece-dev  # the BPE tokenizer (data/tokenizer.h)
  dataset-fashion-mnist
  fortunes  # the default text corpus, /usr/share/games/fortunes
  procps  # pgrep, for tests/signal_test.sh and tests/checkpoint_crash_test.sh
  clang libclang-rt-14-dev  # libFuzzer and the sanitizers' runtimes for `make fuzz` (docs/fuzzing.md)
  pybind11-dev python3-dev python3-numpy python3-pytest  # the Python module and its tests (docs/python.md)
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
