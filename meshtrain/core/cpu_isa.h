// The CPU's instruction-set level as meshtrain's kernels and its libraries
// (oneDNN, OpenBLAS) use it, and the one switch that makes a machine behave as
// a lesser one: MESHTRAIN_CPU_ISA=avx2 on an AVX-512 machine runs the kernels,
// the oneDNN primitives and the OpenBLAS core that an AVX2 machine runs, so a
// suite green under the switch is green there (docs/core.md, "CPU instruction
// sets").
//
//   if (cpu_isa() >= CpuIsa::avx512) { ... }   // levels are ordered
//   fmt::print("{}\n", cpu_isa_summary());     // "avx2 (MESHTRAIN_CPU_ISA=avx2; the CPU has avx512_bf16)"
//   int main(int argc, char** argv) { prepare_libraries(argv); ... }
//
// Levels, each including the ones before it:
//   sse41        x86-64 with SSE4.1, no AVX2
//   avx2         AVX2, FMA and F16C (Haswell, AMD Zen 1-3)
//   avx512       AVX-512 F/BW/VL/DQ (Skylake-SP, Ice Lake)
//   avx512_bf16  AVX-512 with bf16 dot products (Cooper Lake, AMD Zen 4/5)
//   amx          AMX tiles with bf16 (Sapphire Rapids)
//
// The limit is read from MESHTRAIN_CPU_ISA once, at the first call of any
// function here: every kernel asks before it picks a path, so it holds from
// the first product on. "native" or a level at or above the CPU's own changes
// nothing. oneDNN is capped in-process (dnnl::set_max_cpu_isa, before its
// first primitive). OpenBLAS picks its core while it loads, before main, from
// OPENBLAS_CORETYPE: prepare_libraries() sets that variable and starts the
// program again; the CLI, the test mains and the benchmarks call it first.
// Thread-safe: the values are computed once and never change.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace meshtrain {

enum class CpuIsa : uint8_t { sse41, avx2, avx512, avx512_bf16, amx };

// "sse41", "avx2", "avx512", "avx512_bf16", "amx".
std::string_view cpu_isa_name(CpuIsa isa);
// A level by its name; "native" is nullopt (no limit). InvalidArgument
// naming `source` (the variable or flag it came from) and the choices
// otherwise.
std::optional<CpuIsa> parse_cpu_isa(std::string_view text, std::string_view source);

// The level this CPU (and its operating system's saved register state) has.
CpuIsa cpu_isa_detected();
// The limit MESHTRAIN_CPU_ISA sets, or nullopt when unset or "native".
// Throws InvalidArgument when the variable holds no level's name.
std::optional<CpuIsa> cpu_isa_limit();
// The level kernels use: the detected one, capped by the limit.
CpuIsa cpu_isa();
// One line for start-up dumps and benchmark headers:
// "avx512_bf16 (this CPU's own)" or
// "avx2 (MESHTRAIN_CPU_ISA=avx2; the CPU has avx512_bf16)".
std::string cpu_isa_summary();

// The OpenBLAS core whose kernels use cpu_isa()'s instructions: "Nehalem",
// "Haswell" ("Zen" on AMD), "SkylakeX", "Cooperlake" (avx512_bf16 and amx).
std::string cpu_isa_openblas_core();
// The level an OpenBLAS core's kernels use, by its name as OpenBLAS spells
// it (any case): sse41 for a core it does not place higher.
CpuIsa openblas_core_level(std::string_view core);
// The core OpenBLAS runs in this process ("Haswell"; OpenBLAS's own name).
std::string openblas_core_running();
// "" unless OpenBLAS runs a core of a lower level than cpu_isa() because
// OPENBLAS_CORETYPE says so; then one line for start-up dumps and benchmark
// headers saying so and what unsetting it gives (on the AMD EPYC Zen 5 of
// docs/benchmarks.md, OPENBLAS_CORETYPE=Haswell ran the GPT-2 GEMMs at 42%
// of the FMA peak against 73-82% with OpenBLAS's own choice).
std::string openblas_core_note();

// Applies what the libraries loaded before main read from the environment
// while they load, by setting it and re-executing /proc/self/exe with the
// same argv (same process id; it does not return then):
// - OPENBLAS_CORETYPE = cpu_isa_openblas_core() when the limit lowers the
//   level (a user's OPENBLAS_CORETYPE is otherwise left as it is:
//   openblas_core_note() says when it slows OpenBLAS down);
// - idle GEMM threads that sleep rather than spin: OMP_WAIT_POLICY=passive
//   (libgomp, oneDNN's threads; unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is
//   set) and OPENBLAS_THREAD_TIMEOUT=10 (2^10 cycles; unless set). With
//   libgomp's and OpenBLAS's defaults (spinning for 300000 iterations and
//   2^28 cycles) the two pools and the data loader took each other's cores:
//   a GPT-2 124M step on 2 threads took 1.5x as long, a small GPT run 12x,
//   and 10x beside two busy processes (docs/core.md, "Idle GEMM threads
//   sleep"; the table is kIdleWaits below).
// Nothing is re-executed when every variable already holds its value. Call it
// first in main, before threads start. Throws InvalidArgument on a bad
// MESHTRAIN_CPU_ISA and Error when the re-execution fails.
void prepare_libraries(char** argv);

// The idle-wait settings prepare_libraries applies: `name`=`value` unless
// `name` or `unless` (when not empty) is set. The Python package applies the
// same before its module loads (python/meshtrain/__init__.py; a test keeps
// the two equal).
struct LibraryVariable {
  std::string_view name, value, unless;
};
inline constexpr LibraryVariable kIdleWaits[] = {{"OMP_WAIT_POLICY", "passive", "GOMP_SPINCOUNT"},
                                                 {"OPENBLAS_THREAD_TIMEOUT", "10", ""}};
// The idle-wait variables as this process has them, for start-up dumps:
// "OMP_WAIT_POLICY=passive OPENBLAS_THREAD_TIMEOUT=10" ("unset" for none).
std::string idle_waits_summary();

}  // namespace meshtrain
