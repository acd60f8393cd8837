#include "meshtrain/core/cpu_isa.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>

#include "meshtrain/core/error.h"
#include "meshtrain/core/internal/convert.h"
#include "meshtrain/core/matmul.h"

namespace meshtrain {
namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

TEST(CpuIsa, NamesParseBackAndBadNamesSayTheChoices) {
  for (CpuIsa isa : {CpuIsa::sse41, CpuIsa::avx2, CpuIsa::avx512, CpuIsa::avx512_bf16, CpuIsa::amx})
    EXPECT_EQ(parse_cpu_isa(cpu_isa_name(isa), "test"), isa);
  EXPECT_EQ(parse_cpu_isa("native", "test"), std::nullopt);
  try {
    parse_cpu_isa("avx3", "MESHTRAIN_CPU_ISA");
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.op(), "MESHTRAIN_CPU_ISA");
    EXPECT_NE(std::string(e.what()).find("'avx3'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("sse41, avx2, avx512, avx512_bf16, amx, native"), std::string::npos);
  }
  EXPECT_THROW(parse_cpu_isa("", "x"), InvalidArgument);
  EXPECT_LT(CpuIsa::avx2, CpuIsa::avx512);  // levels are ordered
}

// What this process runs with: the level, meshtrain's own kernels, oneDNN and
// OpenBLAS agree with it. Run as `ctest` runs it and again under
// MESHTRAIN_CPU_ISA=avx2 (.ci/run), this checks the switch reaches every
// library: OpenBLAS's core through the test main's restart.
TEST(CpuIsa, KernelsAndLibrariesFollowTheLevel) {
  const CpuIsa isa = cpu_isa();
  std::printf("CPU ISA: %s\n", cpu_isa_summary().c_str());
  EXPECT_LE(isa, cpu_isa_detected());
  const std::optional<CpuIsa> limit = cpu_isa_limit();
  EXPECT_EQ(isa, limit ? std::min(*limit, cpu_isa_detected()) : cpu_isa_detected());
  EXPECT_EQ(cpu_isa_summary().rfind(std::string(cpu_isa_name(isa)) + " (", 0), 0u) << cpu_isa_summary();

  EXPECT_EQ(internal::have_avx512_bf16_rounding(), isa >= CpuIsa::avx512);
  EXPECT_EQ(internal::have_f16c(), isa >= CpuIsa::avx2);

  // OpenBLAS runs the core of the level (the test main's restart), or one
  // of a higher level where OpenBLAS knows the CPU (amx's SapphireRapids).
  const std::string core = cpu_isa_openblas_core();
  const std::string running = openblas_core_running();
  const std::string blas = matmul_backend_description(MatmulBackend::openblas);
  EXPECT_NE(lower(blas).find(" " + lower(running) + " "), std::string::npos) << blas;
  const std::string note = openblas_core_note();
  if (isa < cpu_isa_detected()) {
    EXPECT_EQ(lower(running), lower(core)) << blas;
    EXPECT_EQ(note, "");
  } else if (openblas_core_level(running) < std::min(isa, CpuIsa::avx512_bf16)) {
    // Only a user's OPENBLAS_CORETYPE holds OpenBLAS below the CPU's level, and then it says so.
    EXPECT_NE(note.find("OPENBLAS_CORETYPE=" + running), std::string::npos) << note << " / " << blas;
  } else {
    EXPECT_EQ(note, "");
  }
  EXPECT_EQ(openblas_core_level("SkylakeX"), CpuIsa::avx512);
  EXPECT_EQ(openblas_core_level("haswell"), CpuIsa::avx2);
  EXPECT_EQ(openblas_core_level("Prescott"), CpuIsa::sse41);
  if (matmul_backend_available(MatmulBackend::onednn)) {
    const std::string dnn = matmul_backend_description(MatmulBackend::onednn);
    const char* want = isa == CpuIsa::avx2 ? "CPU ISA avx2)" : isa == CpuIsa::avx512 ? "CPU ISA avx512_core)" : nullptr;
    if (want) {
      EXPECT_NE(dnn.find(want), std::string::npos) << dnn;
    } else if (isa == CpuIsa::avx512_bf16) {
      EXPECT_NE(dnn.find("CPU ISA avx512_core_bf16)"), std::string::npos) << dnn;
    }
  }
  // The products give the same values on every path (f32 accumulation of
  // the same operands; the kernels differ only in order).
  const Tensor a = Tensor::from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
  const Tensor b = Tensor::full({3, 2}, 0.5, DType::f32);
  EXPECT_EQ(matmul(a.to(DType::bf16), b.to(DType::bf16)).to_vector(), (std::vector<double>{3, 3, 7.5, 7.5}));
}

}  // namespace
}  // namespace meshtrain
