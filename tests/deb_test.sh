#!/bin/bash
# The Debian package (cmake/Package.cmake, `make deb`; docs/install.md), built
# from the build tree and checked without touching the system (a CTest, see
# tests/CMakeLists.txt; skipped, exit 77, without dpkg-deb):
#   1. cpack builds meshtrain_<version>_<arch>.deb; its control file has the
#      version, the Depends this build needs (the -dev packages the CMake
#      package finds again, and dpkg-shlibdeps' libraries of the command),
#      each of them installed here (what apt would install on a fresh machine).
#   2. Unpacked into an empty directory (dpkg-deb -x): usr/bin/meshtrain
#      --help and --version run from it; the package holds the CMake
#      package, the pkg-config file and the headers under usr/.
#   3. The consumer the package carries (usr/share/doc/meshtrain/examples/
#      consumer) builds against that directory and runs on 2 simulated
#      devices; pkg-config finds the unpacked meshtrain.pc's own prefix.
#   4. With the Python module (MESHTRAIN_PYTHON names the interpreter):
#      `import meshtrain` from the unpacked package's dist-packages, in a
#      directory outside the build tree, runs a 2-rank all_reduce.
#   tests/deb_test.sh <build dir>
set -u
build=$(cd "$1" && pwd)
command -v dpkg-deb > /dev/null || { echo "SKIP: no dpkg-deb"; exit 77; }
tmp=$(mktemp -d /tmp/meshtrain_deb_test.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail() {
  echo "FAIL: $*"
  exit 1
}
step() {
  echo "== $* ($SECONDS s)"
}

step "1. cpack -G DEB"
cpack --config "$build/CPackConfig.cmake" -G DEB -B "$tmp/package" > "$tmp/cpack.log" 2>&1 ||
  { cat "$tmp/cpack.log"; fail "cpack"; }
debs=("$tmp"/package/meshtrain_*.deb)
deb=${debs[0]}
[ -f "$deb" ] || { cat "$tmp/cpack.log"; fail "no meshtrain_*.deb"; }
echo "$(basename "$deb"): $(stat -c %s "$deb") bytes"
dpkg-deb -f "$deb" Package Version Architecture Depends Recommends Suggests
version=$(sed -n 's/^#define MESHTRAIN_VERSION_STRING "\(.*\)"/\1/p' "$build/include/meshtrain/version.h")
[ "$(dpkg-deb -f "$deb" Version)" = "$version" ] || fail "the package's version is not $version"
depends=$(dpkg-deb -f "$deb" Depends)
names=$(tr ',|' '\n' <<< "$depends" | awk '{print $1}')
for p in libopenblas-dev libfmt-dev libsentencepiece-dev libc6 libstdc++6; do
  grep -qxF "$p" <<< "$names" || fail "Depends lacks $p"
done
# Each dependency (one of its alternatives) is installed here, as apt would on a fresh machine.
IFS=',' read -ra deps <<< "$depends"
for dep in "${deps[@]}"; do
  ok=0
  IFS='|' read -ra alternatives <<< "$dep"
  for alt in "${alternatives[@]}"; do
    name=$(awk '{print $1}' <<< "$alt")
    if dpkg-query -W -f='${Status}\n' "$name" 2> /dev/null | grep -q "install ok installed" ||
       dpkg-query -W -f='${Provides}\n' '*' 2> /dev/null | grep -qw "$name"; then
      ok=1
    fi
  done
  [ $ok = 1 ] || fail "the dependency '$dep' is not installed here: does it exist?"
done

step "2. dpkg-deb -x into an empty directory"
root=$tmp/root
dpkg-deb -x "$deb" "$root" || fail "dpkg-deb -x"
for f in usr/bin/meshtrain usr/lib/cmake/meshtrain/meshtrainConfig.cmake usr/lib/pkgconfig/meshtrain.pc \
         usr/include/meshtrain/version.h usr/share/doc/meshtrain/examples/consumer/CMakeLists.txt; do
  [ -e "$root/$f" ] || fail "the package lacks $f"
done
"$root/usr/bin/meshtrain" --help > "$tmp/help.out" 2>&1 || { cat "$tmp/help.out"; fail "meshtrain --help"; }
head -3 "$tmp/help.out"
[ "$("$root/usr/bin/meshtrain" --version)" = "meshtrain $version" ] || fail "meshtrain --version is not $version"
"$root/usr/bin/meshtrain" --version

step "3. the packaged consumer against the unpacked package"
cp -r "$root/usr/share/doc/meshtrain/examples/consumer" "$tmp/consumer"
cmake -S "$tmp/consumer" -B "$tmp/consumer-build" -G Ninja -DCMAKE_PREFIX_PATH="$root/usr" > "$tmp/configure.log" 2>&1 ||
  { cat "$tmp/configure.log"; fail "configuring the consumer"; }
grep "meshtrain 0" "$tmp/configure.log"
grep -q "at $root/usr/lib/cmake/meshtrain" "$tmp/configure.log" || fail "the consumer did not find the unpacked package"
cmake --build "$tmp/consumer-build" > "$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; fail "building the consumer"; }
"$tmp/consumer-build/consumer" --devices 2 --out "$tmp/runs" > "$tmp/consumer.out" 2>&1 ||
  { cat "$tmp/consumer.out"; fail "the consumer"; }
grep "^result:" "$tmp/consumer.out"
cflags=$(PKG_CONFIG_PATH=$root/usr/lib/pkgconfig pkg-config --cflags meshtrain) || fail "pkg-config"
grep -q -- "-I$root/usr/lib/pkgconfig/../../include" <<< "$cflags" || fail "pkg-config's flags are not the unpacked prefix: $cflags"

if [ -n "${MESHTRAIN_PYTHON:-}" ]; then
  step "4. import meshtrain from the unpacked package, outside the build tree"
  site=$(cd "$root" && ls -d usr/lib/python3*/*-packages 2> /dev/null | head -1)
  [ -n "$site" ] && [ -f "$root/$site/meshtrain/__init__.py" ] || fail "the package lacks the Python module"
  (cd "$tmp" && PYTHONPATH="$root/$site" "$MESHTRAIN_PYTHON" -c \
    "import meshtrain, numpy; print('import meshtrain', meshtrain.__version__, 'from', meshtrain.__file__); \
print(meshtrain.launch(lambda w: w.all_reduce(numpy.ones(2)) or w.rank, ranks=2))") > "$tmp/python.out" 2>&1 ||
    { cat "$tmp/python.out"; fail "import meshtrain"; }
  cat "$tmp/python.out"
  grep -q "from $root/$site/meshtrain/__init__.py" "$tmp/python.out" || fail "meshtrain was not imported from the package"
fi
echo "PASS: deb ($SECONDS s)"
