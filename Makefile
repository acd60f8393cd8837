# The two commands of the README, plus sanitizer runs and benchmarks.
# Each target installs what it needs (Debian packages) and builds from scratch
# in build/<preset>; ninja rebuilds only what changed.
.PHONY: demo demo-collectives test test-avx2 deps build cli asan tsan bench deb clean

JOBS ?= $(shell nproc)

deps:
	./scripts/install-deps.sh

build/release/build.ninja: | deps
	cmake --preset release

build: deps build/release/build.ninja
	cmake --build build/release -j $(JOBS)

# The meshtrain command alone (no tests, benchmarks' extras or Python module):
# what the demos run.
cli: deps build/release/build.ninja
	cmake --build build/release --target meshtrain -j $(JOBS)

# Main job: train the MLP on Fashion-MNIST on 4 simulated devices (data parallel).
demo: cli
	./build/release/cli/meshtrain train --config examples/mlp_fashion.toml --devices 4 --mesh data=4

# A mesh on 4 simulated devices, every collective checked, the benchmark table.
demo-collectives: cli
	./build/release/cli/meshtrain demo

# Every test: unit, multi-rank (threads 1..8 ranks, mpirun -np 2 and 4), fault tests.
test: build
	ctest --preset release

# The CPU-sensitive tests (label isa: core, nn, goldens, parity, fusions, the
# memory, activation and traffic models, the planner's check) again as an
# AVX2 CPU runs them, whatever this CPU has (docs/core.md, "CPU instruction
# sets"); .ci/run runs it after `make test`.
test-avx2: build
	MESHTRAIN_CPU_ISA=avx2 ctest --preset release -L isa

asan: deps
	cmake --preset asan && cmake --build build/asan -j $(JOBS) && ctest --preset asan -LE mpi

tsan: deps
	cmake --preset tsan && cmake --build build/tsan -j $(JOBS) && ctest --preset tsan

# libFuzzer targets for the file readers under ASan + UBSan (docs/fuzzing.md):
# builds build/fuzz with clang and runs each target FUZZ_SECONDS on its corpus.
.PHONY: fuzz
FUZZ_SECONDS ?= 60
fuzz: deps
	./fuzz/run.sh --time $(FUZZ_SECONDS)

# The Debian package (cmake/Package.cmake, docs/install.md):
# build/release/package/meshtrain_<version>_<arch>.deb, for `apt install ./<it>`.
deb: build
	cpack --config build/release/CPackConfig.cmake -G DEB -B build/release/package
	@ls -l build/release/package/meshtrain_*.deb

bench: cli
	./build/release/cli/meshtrain bench collectives --engine threads --ranks 2 --min 4K --max 256M

clean:
	rm -rf build
