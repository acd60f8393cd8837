// Prints the mesh-planning table committed in docs/mesh-planning.md.
//   mesh_planning_table [max_devices]   (default 128)
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "meshtrain/plan/mesh_planning.h"

int main(int argc, char** argv) {
  try {
    const int n = argc > 1 ? std::atoi(argv[1]) : 128;
    std::fputs(meshtrain::plan::mesh_planning_table(n).c_str(), stdout);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mesh_planning_table: %s\n", e.what());
    return 1;
  }
  return 0;
}
