// The main of every GoogleTest binary (cmake/Layer.cmake's meshtrain_test):
// GoogleTest's own, after the MESHTRAIN_CPU_ISA limit reaches the libraries
// loaded before main (core/cpu_isa.h: OpenBLAS's core, by a restart).
#include <gtest/gtest.h>

#include <cstdio>
#include <exception>

#include "meshtrain/core/cpu_isa.h"

int main(int argc, char** argv) {
  try {
    meshtrain::prepare_libraries(argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
