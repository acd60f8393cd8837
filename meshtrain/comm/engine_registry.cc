#include "meshtrain/comm/engine_registry.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "meshtrain/core/error.h"

namespace meshtrain::comm {

void EngineRegistry::add(EngineSpec spec) {
  if (spec.name.empty())
    throw InvalidArgument("EngineRegistry::add", "engine without a name", "name it as --engine will take it");
  if (!spec.launch)
    throw InvalidArgument("EngineRegistry::add", fmt::format("engine '{}' has no launch function", spec.name),
                          "an engine must be able to run an SPMD function");
  std::lock_guard l(mu_);
  for (const auto& s : specs_)
    if (s.name == spec.name)
      throw InvalidArgument("EngineRegistry::add", fmt::format("engine '{}' is already registered", spec.name),
                            "register each engine once (built-in engines are registered by engines())");
  specs_.push_back(std::move(spec));
}

const EngineSpec* EngineRegistry::find(std::string_view name) const {
  std::lock_guard l(mu_);
  for (const auto& s : specs_)
    if (s.name == name) return &s;
  return nullptr;
}

const EngineSpec& EngineRegistry::get(std::string_view name) const {
  if (const EngineSpec* s = find(name)) return *s;
  const std::string available = fmt::format("{}", fmt::join(names(), ", "));
  // The engines meshtrain knows of, built in or not: say what building one takes.
  for (Engine e : {Engine::threads, Engine::mpi, Engine::gloo, Engine::nccl}) {
    if (engine_name(e) != name) continue;
    const std::string how =
        e == Engine::mpi    ? "the mpi engine needs OpenMPI when meshtrain is built (libopenmpi-dev, "
                              "scripts/install-deps.sh; then reconfigure)"
        : e == Engine::gloo ? "the gloo engine needs Gloo when meshtrain is built (libgloo-dev, "
                              "scripts/install-deps.sh; then reconfigure with -DMESHTRAIN_WITH_GLOO=ON)"
                            : fmt::format("the {} engine is not implemented yet", name);
    throw InvalidArgument("comm::engine", fmt::format("engine '{}' is not built into this program", name),
                          fmt::format("use one of: {}; {}", available, how));
  }
  throw InvalidArgument("comm::engine", fmt::format("unknown engine '{}'", name),
                        fmt::format("use one of: {}", available));
}

std::vector<std::string> EngineRegistry::names() const {
  std::lock_guard l(mu_);
  std::vector<std::string> out;
  for (const auto& s : specs_) out.push_back(s.name);
  return out;
}

}  // namespace meshtrain::comm
