// The mpi engine's entry in the engine registry: launch() on
// MPI_COMM_WORLD, OpenMPI's own collectives as the benchmark peer, and the
// reduce-scatter algorithms as benchmark variants.
#include <fmt/format.h>

#include <algorithm>

#include "meshtrain/comm/engine_registry.h"
#include "meshtrain/comm/launch.h"
#include "meshtrain/comm/mpi/communicator.h"
#include "meshtrain/comm/mpi/native.h"
#include "meshtrain/core/error.h"

namespace meshtrain::comm::mpi {
namespace {

Options options_of(const LaunchOptions& options) {
  Options mo{.check_fingerprints = options.check_fingerprints};
  if (options.abort_on_error) mo.on_error = report_and_abort;
  return mo;
}

void launch_mpi(const LaunchOptions& options, const SpmdFunction& fn) {
  initialize();
  auto world = create_world(options_of(options));
  world->set_timeout(options.timeout);
  if (options.ranks != 0 && options.ranks != world->size())
    throw InvalidArgument("comm::launch",
                          fmt::format("asked for {} ranks but mpirun started {}", options.ranks, world->size()),
                          "pass the same count to mpirun -np and --ranks, or --ranks 0");
  if (!options.abort_on_error || world->size() == 1) return fn(*world);
  try {
    fn(*world);
  } catch (const std::exception& e) {
    report_and_abort(e, world->rank());
  }
}

class OpenMpiPeer final : public PeerCollectives {
 public:
  std::string label() const override { return "openmpi"; }
  bool supports(CollectiveOp op, DType dtype) const override {
    switch (op) {
      case CollectiveOp::all_reduce:
      case CollectiveOp::reduce_scatter: return dtype != DType::bf16 && dtype != DType::f16;  // no 16-bit sum in MPI
      case CollectiveOp::all_gather:
      case CollectiveOp::broadcast:
      case CollectiveOp::all_to_all: return true;
      default: return false;
    }
  }
  void run(CollectiveOp op, const void* send, void* recv, size_t count, DType dtype) override {
    native_.run(op, send, recv, count, dtype);
  }

 private:
  NativeCollectives native_;  // collective: dups MPI_COMM_WORLD
};

std::vector<EngineVariant> reduce_scatter_variants(const LaunchOptions& options, Communicator& world,
                                                   const std::vector<std::string>& choices) {
  std::vector<EngineVariant> out;
  for (auto algo : {ReduceScatterAlgorithm::native, ReduceScatterAlgorithm::ring}) {
    const std::string choice(reduce_scatter_algorithm_name(algo));
    if (!choices.empty() && std::find(choices.begin(), choices.end(), choice) == choices.end()) continue;
    Options mo = options_of(options);
    mo.reduce_scatter = algo;
    auto c = create_world(mo);
    c->set_timeout(world.timeout());
    out.push_back({.label = "mpi-" + choice, .choice = choice, .ops = {CollectiveOp::reduce_scatter},
                   .comm = std::move(c)});
  }
  return out;
}

}  // namespace

void register_engine(EngineRegistry& registry) {
  registry.add({.name = "mpi",
                .description = "OpenMPI: one process per rank, started by mpirun/srun, any number of nodes",
                .ranks_in_process = false,
                .launch = launch_mpi,
                .native_peers = [](Communicator&) {
                  std::vector<std::unique_ptr<PeerCollectives>> peers;
                  peers.push_back(std::make_unique<OpenMpiPeer>());
                  return peers;
                },
                .bench_variants = reduce_scatter_variants,
                .variant_choices = {"native", "ring"}});
}

}  // namespace meshtrain::comm::mpi
