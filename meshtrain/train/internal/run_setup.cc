// The run directory's set-up (run_setup.h).
#include "meshtrain/train/internal/run_setup.h"

#include <cstdint>
#include <exception>

#include "meshtrain/core/atomic_file.h"

namespace meshtrain::train::internal {

bool prepare_run_directory(comm::Communicator& world, const ResolvedTraining& resolved,
                           const config::DistributedConfig& dc, const std::vector<std::string>& artifacts,
                           std::optional<RunDirectory>& dir, std::string& checkpoints) {
  const TrainConfig& tc = resolved.config;
  std::exception_ptr error;
  if (world.rank() == 0) {
    try {
      if (!tc.resume.empty())
        dir.emplace(RunDirectory::resume(tc.resume));
      else
        dir.emplace(tc.run_dir.empty() ? RunDirectory::create_versioned("runs/" + tc.model)
                                       : RunDirectory::create(tc.run_dir, tc.overwrite, artifacts));
      checkpoints = dir->checkpoints();
      std::string notes;
      for (const auto& n : resolved.notes) notes += "# " + n + "\n";
      write_file_atomic(dir->file("config.toml"), tc.to_toml() + notes + "\n" + dc.to_toml());
    } catch (...) {
      error = std::current_exception();
    }
  }
  uint8_t failed = error ? 1 : 0;
  world.broadcast(&failed, 1, DType::u8, 0);
  if (error) std::rethrow_exception(error);
  if (failed != 0) return false;
  // Every rank writes its checkpoint pieces there (one file system).
  int64_t len = static_cast<int64_t>(checkpoints.size());
  world.broadcast(&len, 1, DType::i64, 0);
  checkpoints.resize(static_cast<size_t>(len));
  world.broadcast(checkpoints.data(), static_cast<size_t>(len), DType::u8, 0);
  return true;
}

}  // namespace meshtrain::train::internal
