// Test support: a device mesh on the threads engine (header-only; not part
// of the library's API).
//
//   testing::on_mesh({2, 2}, {"data", "tensor"}, [&](mesh::DeviceMesh& m) { ... });
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "meshtrain/comm/launch.h"
#include "meshtrain/mesh/device_mesh.h"

namespace meshtrain::testing {

// Runs fn(mesh) on every rank of a threads world of the mesh's size.
inline void on_mesh(const std::vector<int>& shape, const std::vector<std::string>& names,
                    const std::function<void(mesh::DeviceMesh&)>& fn) {
  comm::launch({.engine = comm::Engine::threads, .ranks = static_cast<int>(mesh::num_ranks(shape)),
                .timeout = std::chrono::seconds(30)},
               [&](comm::Communicator& world) {
                 mesh::DeviceMesh m(world, shape, names);
                 fn(m);
               });
}

}  // namespace meshtrain::testing
