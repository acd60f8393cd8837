// The CPU's instruction-set level and the MESHTRAIN_CPU_ISA limit (see cpu_isa.h).
#include "meshtrain/core/cpu_isa.h"

#include <fmt/format.h>
#include <cblas.h>
#include <strings.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "meshtrain/core/error.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#if MESHTRAIN_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace meshtrain {
namespace {

constexpr const char* kVariable = "MESHTRAIN_CPU_ISA";
constexpr std::array<CpuIsa, 5> kLevels = {CpuIsa::sse41, CpuIsa::avx2, CpuIsa::avx512, CpuIsa::avx512_bf16,
                                           CpuIsa::amx};

#if defined(__x86_64__)
// XCR0: the register state the operating system saves on a context switch.
uint64_t xcr0() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0 || (c & (1u << 27)) == 0) return 0;  // no OSXSAVE
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t{hi} << 32) | lo;
}

CpuIsa detect() {
  // __builtin_cpu_supports checks the OS saves YMM/ZMM state too.
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return CpuIsa::sse41;
  unsigned a = 0, b = 0, c = 0, d = 0;
  __get_cpuid(1, &a, &b, &c, &d);
  if ((c & (1u << 29)) == 0) return CpuIsa::sse41;  // no F16C (every AVX2 CPU has it)
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq"))
    return CpuIsa::avx2;
  // CPUID leaf 7: subleaf 1 EAX bit 5 AVX512_BF16; subleaf 0 EDX bits 22
  // and 24 AMX-BF16 and AMX-TILE, usable when XCR0 saves the tile state
  // (bits 17 and 18). clang 14's __builtin_cpu_supports knows neither.
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d) == 0 || (a & (1u << 5)) == 0) return CpuIsa::avx512;
  __get_cpuid_count(7, 0, &a, &b, &c, &d);
  const bool amx = (d & (1u << 22)) != 0 && (d & (1u << 24)) != 0 && (xcr0() & 0x60000) == 0x60000;
  return amx ? CpuIsa::amx : CpuIsa::avx512_bf16;
}

bool is_amd() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  __get_cpuid(0, &a, &b, &c, &d);
  return b == 0x68747541;  // "Auth"(enticAMD)
}
#else
CpuIsa detect() { return CpuIsa::sse41; }
bool is_amd() { return false; }
#endif

#if MESHTRAIN_HAVE_ONEDNN
dnnl::cpu_isa onednn_isa(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::sse41: return dnnl::cpu_isa::sse41;
    case CpuIsa::avx2: return dnnl::cpu_isa::avx2;
    case CpuIsa::avx512: return dnnl::cpu_isa::avx512_core;
    case CpuIsa::avx512_bf16: return dnnl::cpu_isa::avx512_core_bf16;
    case CpuIsa::amx: return dnnl::cpu_isa::avx512_core_amx;
  }
  return dnnl::cpu_isa::all;
}
#endif

// The variable, read once; oneDNN capped in the same step, before anything
// can have asked it for its ISA (every oneDNN user in meshtrain calls
// cpu_isa() first).
struct Limit {
  std::optional<CpuIsa> level;
  std::string text;  // the variable's value, "" when unset
};

Limit read_limit() {
  Limit l;
  if (const char* v = std::getenv(kVariable)) l.text = v;
  if (l.text.empty()) return l;
  l.level = parse_cpu_isa(l.text, kVariable);
#if MESHTRAIN_HAVE_ONEDNN
  if (l.level && *l.level < detect()) {
    try {
      dnnl::set_max_cpu_isa(onednn_isa(*l.level));
    } catch (const dnnl::error& e) {
      throw Error(kVariable, fmt::format("oneDNN could not be limited to {}: {}", l.text, e.what()),
                  "call meshtrain::cpu_isa() before using oneDNN directly");
    }
  }
#endif
  return l;
}

const Limit& limit() {
  static const Limit l = read_limit();  // a throw leaves it to the next call
  return l;
}

}  // namespace

std::string_view cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::sse41: return "sse41";
    case CpuIsa::avx2: return "avx2";
    case CpuIsa::avx512: return "avx512";
    case CpuIsa::avx512_bf16: return "avx512_bf16";
    case CpuIsa::amx: return "amx";
  }
  return "?";
}

std::optional<CpuIsa> parse_cpu_isa(std::string_view text, std::string_view source) {
  if (text == "native") return std::nullopt;
  for (CpuIsa isa : kLevels)
    if (text == cpu_isa_name(isa)) return isa;
  throw InvalidArgument(std::string(source), fmt::format("'{}' is not a CPU instruction-set level", text),
                        "use one of sse41, avx2, avx512, avx512_bf16, amx, native (docs/core.md)");
}

CpuIsa cpu_isa_detected() {
  static const CpuIsa isa = detect();
  return isa;
}

std::optional<CpuIsa> cpu_isa_limit() { return limit().level; }

CpuIsa cpu_isa() {
  const std::optional<CpuIsa> l = cpu_isa_limit();
  return l && *l < cpu_isa_detected() ? *l : cpu_isa_detected();
}

std::string cpu_isa_summary() {
  const CpuIsa isa = cpu_isa();
  if (isa == cpu_isa_detected()) return fmt::format("{} (the CPU's own)", cpu_isa_name(isa));
  return fmt::format("{} ({}={}; the CPU has {})", cpu_isa_name(isa), kVariable, limit().text,
                     cpu_isa_name(cpu_isa_detected()));
}

std::string cpu_isa_openblas_core() {
  switch (cpu_isa()) {
    case CpuIsa::sse41: return "Nehalem";
    case CpuIsa::avx2: return is_amd() ? "Zen" : "Haswell";
    case CpuIsa::avx512: return "SkylakeX";
    case CpuIsa::avx512_bf16:
    case CpuIsa::amx: return "Cooperlake";
  }
  return {};
}

CpuIsa openblas_core_level(std::string_view core) {
  std::string c(core);
  for (char& ch : c) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (c == "sapphirerapids") return CpuIsa::amx;
  if (c == "cooperlake") return CpuIsa::avx512_bf16;
  if (c == "skylakex") return CpuIsa::avx512;
  if (c == "haswell" || c == "zen" || c == "skylake" || c == "excavator") return CpuIsa::avx2;
  return CpuIsa::sse41;
}

std::string openblas_core_running() {
  const char* name = openblas_get_corename();
  return name ? name : "";
}

std::string openblas_core_note() {
  const std::string running = openblas_core_running();
  const char* set = std::getenv("OPENBLAS_CORETYPE");
  if (!set || cpu_isa() < cpu_isa_detected() || openblas_core_level(running) >= std::min(cpu_isa(), CpuIsa::avx512_bf16))
    return "";
  return fmt::format("OpenBLAS runs its {} kernels ({}) because OPENBLAS_CORETYPE={} is set, though this CPU has {}: "
                     "unset it to let OpenBLAS pick its {} kernels (up to 1.9x faster f32 GEMMs)",
                     running, cpu_isa_name(openblas_core_level(running)), set, cpu_isa_name(cpu_isa()),
                     cpu_isa_openblas_core());
}

std::string idle_waits_summary() {
  std::vector<std::string> out;
  for (const LibraryVariable& v : kIdleWaits)
    for (const std::string_view name : {v.name, v.unless})
      if (const char* value = name.empty() ? nullptr : std::getenv(std::string(name).c_str()))
        out.push_back(fmt::format("{}={}", name, value));
  return out.empty() ? "unset" : fmt::format("{}", fmt::join(out, " "));
}

void prepare_libraries(char** argv) {
  std::vector<std::string> set;  // "NAME=value", what this start changes
  auto put = [&](const char* name, const std::string& value) {
    if (setenv(name, value.c_str(), 1) != 0)
      throw Error("prepare_libraries", fmt::format("could not set {}: {}", name, std::strerror(errno)));
    set.push_back(fmt::format("{}={}", name, value));
  };
  const std::string core = cpu_isa_openblas_core();  // reads the limit, caps oneDNN
  const char* have = std::getenv("OPENBLAS_CORETYPE");
  if (cpu_isa() < cpu_isa_detected() && !(have && strcasecmp(have, core.c_str()) == 0))
    put("OPENBLAS_CORETYPE", core);
  // Idle GEMM threads sleep instead of spinning (docs/core.md, "Idle GEMM
  // threads sleep"): a spinning pool takes the cores another pool, the data
  // loader or another process needs. The user's own settings win.
  for (const LibraryVariable& v : kIdleWaits) {
    const std::string name(v.name), unless(v.unless);
    if (!std::getenv(name.c_str()) && (unless.empty() || !std::getenv(unless.c_str())))
      put(name.c_str(), std::string(v.value));
  }
  if (set.empty()) return;
  std::fflush(nullptr);
  execv("/proc/self/exe", argv);
  throw Error("prepare_libraries",
              fmt::format("could not start {} again with {}: {}", argv && argv[0] ? argv[0] : "the program",
                          fmt::join(set, " "), std::strerror(errno)),
              fmt::format("set {} yourself", fmt::join(set, " ")));
}

}  // namespace meshtrain
