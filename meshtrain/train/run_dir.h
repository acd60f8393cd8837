// RunDirectory: the directory that holds one training run's artifacts
// (config.toml, metrics.jsonl, model.safetensors, loss.svg, pictures), and
// the rule that it only ever holds one complete run.
//
//   RunDirectory dir = RunDirectory::create("runs/mlp", /*overwrite=*/false);  // throws if runs/mlp holds a run
//   write_file_atomic(dir.file("config.toml"), text);   // goes to runs/mlp.incomplete/config.toml
//   ...                                                  // train, log, save
//   dir.commit();                                        // runs/mlp now holds exactly this run
//
// - create() refuses a path that exists and is not an empty directory,
//   unless `overwrite`; overwrite only replaces a directory that holds
//   nothing but run artifacts (kRunArtifacts and the names a model recipe
//   declares, `more_artifacts`), so a mistyped --run-dir never deletes a
//   user's files. A path that does not exist is created empty at
//   once (reserved), so two runs cannot pick the same one.
// - Until commit(), every file goes to the staging directory
//   "<path>.incomplete" next to it (the same file system, so renames are
//   atomic); the run directory keeps its previous contents (nothing, or the
//   run being overwritten).
// - commit() swaps the staging directory in: one rename onto the empty
//   directory, or an atomic exchange with the old run (renameat2
//   RENAME_EXCHANGE; where the file system lacks it, two renames), then
//   removes the old run and fsyncs the parent.
// - A RunDirectory destroyed without commit() (the run failed) removes its
//   staging directory and the empty directory it reserved: the path is left
//   as it was before the run. A staging directory left by a killed process
//   is removed by the next create() of the same path.
// - Checkpoints (checkpoint.h) go to staging()/checkpoints, and a staging
//   directory holding a complete one is never removed by failure: the
//   destructor keeps it, and create() refuses it (naming --resume) unless
//   `overwrite`. resume() continues such a run: it adopts the staging
//   directory of an interrupted run, or stages a copy of a committed run
//   that holds checkpoints (its checkpoint files hard-linked, not copied),
//   so the continued run is committed over it like any other.
//
// - One owner at a time: a RunDirectory holds an OS file lock (flock) on
//   "<path>.lock" beside the directory from its creation to its
//   destruction, so a second run or resume of the same path, in this
//   process or any other on a file system with locks, is refused at once
//   naming the owner's process and host; the staging directory is touched
//   only under the lock. The kernel drops the lock when its process dies:
//   a killed run never blocks the next, and its staging directory is then
//   cleaned up (or resumed) as above. check() refuses a locked path too.
//
// Thread-safety: one object per run, used by one thread (rank 0's).
#pragma once

#include <array>
#include <span>
#include <string>
#include <string_view>

namespace meshtrain::train {

// What a run writes into its directory; the only names an --overwrite may delete.
inline constexpr std::array<std::string_view, 11> kRunArtifacts = {
    "config.toml", "metrics.jsonl",       "model.safetensors", "trainer_state.json",  "loss.svg",
    "checkpoints", "reconstructions.png", "samples.png",       "pipeline.trace.json", "pipeline.svg",
    "expert_load.svg"};

// The config.toml a resumed run continues with: its interrupted staging
// directory's ("<run>.incomplete/config.toml") first, else the run's own.
// InvalidArgument naming --resume when neither exists.
std::string resume_config(const std::string& run);
// True when `run` or its interrupted staging directory holds a checkpoint:
// a worker that `meshtrain launch --max-restarts` restarted continues it.
bool holds_checkpoint(const std::string& run);

class RunDirectory {
 public:
  // See above. Throws InvalidArgument (the path holds a run or other files,
  // is a file, names no directory, or another live RunDirectory holds it)
  // or IoError.
  static RunDirectory create(const std::string& path, bool overwrite,
                             std::span<const std::string> more_artifacts = {});
  // The next free "<parent>/version_<N>" (N = 1 + the largest existing N,
  // from 0), reserved as create() does. What a run without --run-dir gets.
  static RunDirectory create_versioned(const std::string& parent);
  // Continues the run at `path` (see above): its interrupted staging
  // directory, else a staged copy of the committed run. Throws
  // InvalidArgument when neither holds a complete checkpoint.
  static RunDirectory resume(const std::string& path);
  // Throws as create() would, without creating anything (for a CLI that
  // wants to fail before printing its start-up dump).
  static void check(const std::string& path, bool overwrite, std::span<const std::string> more_artifacts = {});

  RunDirectory(RunDirectory&& other) noexcept;
  RunDirectory& operator=(RunDirectory&&) = delete;
  RunDirectory(const RunDirectory&) = delete;
  ~RunDirectory();

  const std::string& path() const { return path_; }        // where the run ends up
  const std::string& staging() const { return staging_; }  // where files go until commit()
  std::string file(std::string_view name) const;           // staging() / name
  std::string checkpoints() const { return file("checkpoints"); }
  // resume(): the run continued was interrupted (its staging adopted) or committed.
  bool resumed_interrupted() const { return adopted_; }
  // Moves the staged run into path() (see above). Throws IoError; after a
  // failed commit the previous contents of path() are intact.
  void commit();

 private:
  enum class Staging : uint8_t { fresh, fresh_discarding_checkpoints, adopt };
  RunDirectory(std::string path, bool reserved, Staging staging);

  std::string path_;
  std::string staging_;
  std::string lock_path_;   // "<path>.lock", flock'ed while this object lives
  int lock_fd_ = -1;
  bool reserved_ = false;   // path_ was created (empty) by this object
  bool committed_ = false;
  bool adopted_ = false;    // resume() took over an interrupted run's staging directory
  bool moved_from_ = false;
};

}  // namespace meshtrain::train
