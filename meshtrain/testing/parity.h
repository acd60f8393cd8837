// Training-run test support (header-only): a threads-engine configuration
// for a mesh spec, and comparing two training runs: the per-step
// losses and final parameters of a run against a reference run, both from
// run_training (train/trainer.h). Used by the threads parity tests (gtest)
// and their mpirun counterparts (plain mains), so both apply one rule.
//
//   for (const std::string& p : run_differences(zero3, one_device, 1e-5)) ADD_FAILURE() << p;
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "meshtrain/config/distributed_config.h"
#include "meshtrain/mesh/mesh_shape.h"
#include "meshtrain/train/trainer.h"

namespace meshtrain::testing {

// A threads-engine configuration with one simulated device per position of
// `mesh` ("data=2,tensor=2"; "" = one device), its parallel sizes set from
// the mesh (DistributedConfig::set_mesh), as `meshtrain train --mesh` does.

inline config::DistributedConfig threads_mesh_config(const std::string& mesh) {
  config::DistributedConfig dc;
  if (mesh.empty()) return dc;
  const mesh::NamedShape m = mesh::parse_mesh_spec(mesh);
  int ranks = 1;
  for (int s : m.shape) ranks *= s;
  dc.world_size = ranks;
  dc.num_processes_per_node = ranks;
  dc.set_mesh(m);
  return dc;
}

// What differs between `got` and `ref` beyond `rel_tol`: a line per step
// whose loss differs by more than rel_tol relative to the reference's, and a
// line per parameter whose largest element difference exceeds rel_tol times
// the parameter's largest magnitude; plus mismatched step counts, parameter
// names or sizes. Empty when they agree.
inline std::vector<std::string> run_differences(const train::TrainResult& got, const train::TrainResult& ref,
                                                double rel_tol) {
  std::vector<std::string> out;
  if (got.step_losses.size() != ref.step_losses.size() || ref.step_losses.empty())
    return {fmt::format("{} steps against the reference's {}", got.step_losses.size(), ref.step_losses.size())};
  for (size_t s = 0; s < ref.step_losses.size(); ++s) {
    const double r = std::fabs(got.step_losses[s] - ref.step_losses[s]) / std::fabs(ref.step_losses[s]);
    if (!(r <= rel_tol))
      out.push_back(fmt::format("step {}: loss {} against {} ({:.2e} relative)", s, got.step_losses[s],
                                ref.step_losses[s], r));
  }
  if (got.final_parameters.size() != ref.final_parameters.size()) {
    out.push_back(fmt::format("{} parameters against the reference's {}", got.final_parameters.size(),
                              ref.final_parameters.size()));
    return out;
  }
  for (size_t i = 0; i < ref.final_parameters.size(); ++i) {
    const auto& [name, value] = got.final_parameters[i];
    if (name != ref.final_parameters[i].first) {
      out.push_back(fmt::format("parameter {} is {}, the reference's {}", i, name, ref.final_parameters[i].first));
      continue;
    }
    const std::vector<double> a = value.to_vector(), b = ref.final_parameters[i].second.to_vector();
    if (a.size() != b.size()) {
      out.push_back(fmt::format("{}: {} elements against {}", name, a.size(), b.size()));
      continue;
    }
    double diff = 0, scale = 1e-30;
    for (size_t k = 0; k < a.size(); ++k)
      diff = std::max(diff, std::fabs(a[k] - b[k])), scale = std::max(scale, std::fabs(b[k]));
    if (!(diff / scale <= rel_tol)) out.push_back(fmt::format("{}: differs by {:.2e} relative", name, diff / scale));
  }
  return out;
}

}  // namespace meshtrain::testing
