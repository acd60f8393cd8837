#!/bin/bash
# meshtrain as a library others build on (docs/install.md), checked from
# outside the source tree (a CTest, see tests/CMakeLists.txt):
#   1. cmake --install into a temporary prefix: the headers, libraries,
#      CMake package and pkg-config file are there; every
#      #include "meshtrain/..." of an installed header is installed too; no
#      installed CMake, pkg-config or header file names the source or
#      build tree; docs/stability.md lists every installed header.
#   2. examples/consumer, copied out of the source tree, configured with
#      only CMAKE_PREFIX_PATH=<prefix> and built; nothing in its build names
#      the source or build tree; run on 2 simulated devices, its loss falls
#      (data parallel and ZeRO-3, the same numbers) and it prints its result.
#   3. pkg-config --cflags --libs meshtrain against the prefix, and a
#      program built with just those flags (the README's all_reduce on 2
#      threads-engine ranks, and the recipe registry) runs.
#   4. find_package(meshtrain COMPONENTS <every engine of the build>) in a
#      C and C++ project works; COMPONENTS nccl (an engine no build has
#      yet) and a version 0.3 request (0.x: a minor version may break) fail,
#      saying why.
#   tests/install_test.sh <source dir> <build dir>
set -u
src=$(cd "$1" && pwd)
build=$(cd "$2" && pwd)
tmp=$(mktemp -d /tmp/meshtrain_install_test.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
fail() {
  echo "FAIL: $*"
  exit 1
}
# Files under $1 (any kind) that name the source or the build tree.
tree_refs() {
  grep -rlF -e "$src" -e "$build" "$@" 2> /dev/null
}
step() {
  echo "== $* ($SECONDS s)"
}

step "1. cmake --install $build --prefix $prefix"
cmake --install "$build" --prefix "$prefix" > "$tmp/install.log" || { cat "$tmp/install.log"; fail "cmake --install"; }
for f in bin/meshtrain include/meshtrain/version.h include/meshtrain/train/model_recipe.h lib/libmeshtrain_core.a \
         lib/cmake/meshtrain/meshtrainConfig.cmake lib/cmake/meshtrain/meshtrainConfigVersion.cmake \
         lib/cmake/meshtrain/meshtrainTargets.cmake lib/pkgconfig/meshtrain.pc; do
  [ -e "$prefix/$f" ] || fail "$f is not installed"
done
for f in include/meshtrain/comm/threads include/meshtrain/comm/internal include/meshtrain/testing; do
  [ -e "$prefix/$f" ] && fail "$f is installed (engine, internal and test headers stay private)"
done
echo "installed: $(find "$prefix/include" -name '*.h' | wc -l) headers, $(find "$prefix/lib" -maxdepth 1 -name '*.a' | wc -l) libraries"
missing=0
while read -r header; do
  while read -r inc; do
    if [ ! -f "$prefix/include/$inc" ]; then
      echo "${header#"$prefix"/} includes $inc, which is not installed"
      missing=1
    fi
  done < <(sed -n 's/^#include "\(meshtrain\/[^"]*\)".*/\1/p' "$header")
done < <(find "$prefix/include" -name '*.h')
[ $missing = 0 ] || fail "installed headers include headers that are not installed"
# docs/stability.md lists every public header in its layer's row.
while read -r header; do
  layer=$(dirname "$header")
  [ "$layer" = . ] && layer="(top)"
  grep -F "| $layer | " "$src/docs/stability.md" | grep -qwF "$(basename "$header")" ||
    { echo "docs/stability.md does not list $header"; missing=1; }
done < <(cd "$prefix/include/meshtrain" && find . -name '*.h' | sed 's|^\./||')
[ $missing = 0 ] || fail "docs/stability.md misses public headers"
refs=$(tree_refs "$prefix/include" "$prefix/lib/cmake" "$prefix/lib/pkgconfig")
[ -z "$refs" ] || fail "installed files name the source or build tree: $refs"

step "2. examples/consumer against $prefix"
cp -r "$src/examples/consumer" "$tmp/consumer"
cmake -S "$tmp/consumer" -B "$tmp/consumer-build" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" > "$tmp/configure.log" 2>&1 ||
  { cat "$tmp/configure.log"; fail "configuring the consumer"; }
grep "meshtrain 0.2" "$tmp/configure.log"
cmake --build "$tmp/consumer-build" > "$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; fail "building the consumer"; }
grep -i "warning" "$tmp/build.log" && fail "the consumer's build warns"
refs=$(tree_refs "$tmp/consumer-build")
[ -z "$refs" ] || fail "the consumer's build names the source or build tree: $refs"
"$tmp/consumer-build/consumer" --devices 2 --out "$tmp/runs" > "$tmp/consumer.out" 2>&1
rc=$?
grep -v "^train \[" "$tmp/consumer.out" | grep -v "^epoch " | grep -v "^memory per rank" | grep -v "^run directory"
[ $rc = 0 ] || fail "the consumer exited $rc"
grep -q "^result: PASS" "$tmp/consumer.out" || fail "the consumer did not print its result"

step "3. pkg-config --cflags --libs meshtrain"
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
flags=$(pkg-config --cflags --libs meshtrain) || fail "pkg-config --cflags --libs meshtrain"
echo "$flags"
[ "$(pkg-config --modversion meshtrain)" = "$(sed -n 's/^#define MESHTRAIN_VERSION_STRING "\(.*\)"/\1/p' "$prefix/include/meshtrain/version.h")" ] ||
  fail "pkg-config --modversion differs from meshtrain/version.h"
cat > "$tmp/pc_program.cc" << 'EOF'
#include <cstdio>
#include <vector>

#include "meshtrain/comm/launch.h"
#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/train/model_recipe.h"
#include "meshtrain/version.h"
using namespace meshtrain;

int main() {
  float sum = 0;
  comm::launch({.engine = comm::Engine::threads, .ranks = 2}, [&](comm::Communicator& world) {
    mesh::DeviceMesh mesh(world, {2}, {"data"});
    std::vector<float> grad(1024, static_cast<float>(world.rank() + 1));
    mesh.comm("data").all_reduce(grad.data(), grad.data(), grad.size(), DType::f32, comm::ReduceOp::sum);
    if (world.rank() == 0) sum = grad[0];
  });
  std::printf("meshtrain %s: all_reduce on 2 ranks: %g; %zu model recipes built in\n", meshtrain::version_string, sum,
              train::model_recipe_names().size());
  return sum == 3 ? 0 : 1;
}
EOF
# shellcheck disable=SC2086  # the flags are words
g++ -std=c++20 -Wall -Wextra -o "$tmp/pc_program" "$tmp/pc_program.cc" $flags > "$tmp/pc_build.log" 2>&1 ||
  { cat "$tmp/pc_build.log"; fail "building with pkg-config's flags"; }
"$tmp/pc_program" || fail "the program built with pkg-config's flags"

step "4. find_package components and version"
mkdir -p "$tmp/components"
cat > "$tmp/components/CMakeLists.txt" << 'EOF'
cmake_minimum_required(VERSION 3.20)
project(components LANGUAGES C CXX)
find_package(meshtrain ${WANT_VERSION} REQUIRED COMPONENTS ${WANT_ENGINES})
message(STATUS "found meshtrain ${meshtrain_VERSION} with ${meshtrain_ENGINES}")
EOF
engines=$(pkg-config --variable=engines meshtrain | tr ' ' ';')
configure() {
  cmake -S "$tmp/components" -B "$tmp/components-build" -DCMAKE_PREFIX_PATH="$prefix" "$@" > "$tmp/components.log" 2>&1
}
configure -DWANT_VERSION=0.2 "-DWANT_ENGINES=$engines" || { cat "$tmp/components.log"; fail "COMPONENTS $engines"; }
grep "found meshtrain" "$tmp/components.log"
if configure -DWANT_VERSION=0.2 -DWANT_ENGINES=nccl; then
  fail "COMPONENTS nccl was found"
fi
grep -q "no meshtrain has the nccl engine yet" "$tmp/components.log" || { cat "$tmp/components.log"; fail "no reason for nccl"; }
grep -B2 -A1 "nccl engine" "$tmp/components.log"
if configure -DWANT_VERSION=0.3 "-DWANT_ENGINES=threads"; then
  fail "version 0.3 was found"
fi
grep -q "compatible with requested version" "$tmp/components.log" || { cat "$tmp/components.log"; fail "no reason for version 0.3"; }
grep -A4 "compatible with requested version" "$tmp/components.log" | grep -v "^ *$"
echo "PASS: install ($SECONDS s)"
