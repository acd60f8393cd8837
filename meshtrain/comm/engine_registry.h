// EngineRegistry: engines by name. An engine folder (comm/threads,
// comm/mpi, later comm/gloo, comm/nccl) describes itself with an EngineSpec
// and registers it; comm::launch() and the CLI look engines up by name and
// never include an engine header, so `#ifdef MESHTRAIN_HAVE_<ENGINE>` stays
// inside the engine's folder.
//
//   const EngineSpec& mpi = comm::engines().get("mpi");   // InvalidArgument listing what is built
//   for (const std::string& name : comm::engines().names()) ...
//   comm::launch({.engine = "threads", .ranks = 4}, fn);     // launch() does the lookup
//
// Built-in engines are registered by an explicit function that CMake
// generates for the engines it builds (see builtin_engines.cc.in and
// engines() in launch.h); a program may add its own with add().
// Thread-safety: add() and lookups may run concurrently; an EngineSpec,
// once added, never moves or changes.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/comm/communicator.h"

namespace meshtrain::comm {

struct LaunchOptions;  // launch.h
using SpmdFunction = std::function<void(Communicator&)>;

// Something `bench collectives` times beside the engine in the same run: the
// collectives of the library the engine is built on (OpenMPI's blocking
// MPI_Allreduce, Gloo's own algorithms, ...) or a reference rate (the raw
// TCP rate between the ranks). Blocks until done; no deadline: for
// benchmarks only.
class PeerCollectives {
 public:
  virtual ~PeerCollectives() = default;
  // The label of its rows, e.g. "openmpi", "gloo-ring".
  virtual std::string label() const = 0;
  // Whether run() takes (op, dtype): the benchmark times only these.
  virtual bool supports(CollectiveOp op, DType dtype) const = 0;
  // Layouts as in communicator.h (all_reduce and reduce_scatter sum with
  // equal blocks, broadcast from rank 0 in `recv`); send and recv are
  // distinct; count as Communicator takes it (per rank for all_gather,
  // reduce_scatter and all_to_all). A peer that is a reference rate rather
  // than a collective says what it moves instead. Throws Unsupported for
  // what supports() refuses.
  virtual void run(CollectiveOp op, const void* send, void* recv, size_t count, DType dtype) = 0;
};

// Another configuration of an engine that `bench collectives` times (e.g.
// the mpi engine's ring and native reduce-scatter).
struct EngineVariant {
  std::string label{};              // the rows' label, e.g. "mpi-ring"
  std::string choice{};             // what the variant flag selects, e.g. "ring"
  std::vector<CollectiveOp> ops{};  // the collectives it differs in
  std::unique_ptr<Communicator> comm{};
};

struct EngineSpec {
  std::string name{};         // "threads", "mpi": what --engine and LaunchOptions::engine take
  std::string description{};  // one line, for --help and errors
  // True when every rank is a thread of this process (LaunchOptions::ranks
  // says how many); false when the ranks are processes started by a
  // launcher (mpirun), and LaunchOptions::ranks is 0 or the expected count.
  bool ranks_in_process = false;
  // Runs fn once per rank hosted by this process and returns when all
  // returned; throws the first error (see launch.h). launch() validated the
  // options every engine shares (the timeout) before calling it.
  std::function<void(const LaunchOptions&, const SpmdFunction&)> launch{};
  // Optional (for `bench collectives`). Collective over `world`, a
  // communicator of this engine: what the engine compares with (OpenMPI's
  // collectives; Gloo's algorithms and the TCP rate), timed in this order.
  // Empty when there is nothing to compare with (e.g. one rank).
  std::function<std::vector<std::unique_ptr<PeerCollectives>>(Communicator& world)> native_peers{};
  // Optional (for `bench collectives`). Collective over `world`: variants
  // whose `choice` is in `choices` (all when empty).
  std::function<std::vector<EngineVariant>(const LaunchOptions&, Communicator& world,
                                           const std::vector<std::string>& choices)>
      bench_variants{};
  // The values `choice` may take, for the CLI's help ("ring", "native").
  std::vector<std::string> variant_choices{};
};

class EngineRegistry {
 public:
  // Throws InvalidArgument for an empty name, a spec without launch, or a
  // name already registered.
  void add(EngineSpec spec);
  // nullptr when no engine has that name.
  const EngineSpec* find(std::string_view name) const;
  // Throws InvalidArgument naming the engines this program has (and, for a
  // known engine that was not built in, what building it needs).
  const EngineSpec& get(std::string_view name) const;
  // In registration order.
  std::vector<std::string> names() const;

 private:
  mutable std::mutex mu_;
  std::deque<EngineSpec> specs_;  // a deque: references stay valid as specs are added
};

}  // namespace meshtrain::comm
