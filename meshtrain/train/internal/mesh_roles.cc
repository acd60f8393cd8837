#include "meshtrain/train/internal/mesh_roles.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <utility>

#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"
#include "meshtrain/parallel/data_parallel.h"
#include "meshtrain/parallel/fully_sharded.h"

namespace meshtrain::train::internal {

std::vector<std::string> mesh_axes(const mesh::NamedShape& m, std::initializer_list<std::string_view> names) {
  std::vector<std::string> axes;
  for (const std::string_view name : names)
    for (const auto& a : m.axis_names)
      if (a == name) axes.push_back(a);
  for (size_t i = 0; i < m.shape.size(); ++i) {
    const std::string& a = m.axis_names[i];
    if (!mesh::is_known_axis(a) && m.shape[i] != 1)
      throw Unsupported("meshtrain train", fmt::format("mesh {} has axis '{}' of size {}", m.to_spec(), a, m.shape[i]),
                        fmt::format("training uses {} axes (--mesh data=2,pipeline=2)", mesh::known_axes_list()));
  }
  return axes;
}
std::vector<std::string> data_parallel_axes(const mesh::NamedShape& m) {
  return mesh_axes(m, {mesh::kData, mesh::kNode, mesh::kFsdp, mesh::kExpert});
}
std::vector<std::string> gradient_axes(const mesh::NamedShape& m) {
  return mesh_axes(m, {mesh::kData, mesh::kNode, mesh::kFsdp, mesh::kExpert, mesh::kContext});
}
std::vector<std::string> replica_axes(const mesh::NamedShape& m) {
  return mesh_axes(m, {mesh::kData, mesh::kNode, mesh::kFsdp, mesh::kContext});
}

NamedComms training_communicators(const mesh::DeviceMesh& mesh, const parallel::Parallelism& strategy) {
  NamedComms out = mesh.communicators();
  for (const auto& named : strategy.own_communicators()) out.push_back(named);
  return out;
}

void reset_traffic(const NamedComms& comms) {
  for (const auto& [name, c] : comms)
    if (c) c->reset_traffic();
}

void record_training_figures(const MemoryTracker& memory, const NamedComms& comms, comm::Communicator& world,
                             TrainResult* result) {
  const size_t per_rank = comms.size() * comm::kNumCollectiveOps * 2;
  std::vector<uint64_t> mine;
  mine.reserve(per_rank);
  for (const auto& [name, c] : comms)
    for (size_t op = 0; op < comm::kNumCollectiveOps; ++op) {
      const comm::TrafficCounter t = c ? c->traffic(static_cast<comm::CollectiveOp>(op)) : comm::TrafficCounter{};
      mine.push_back(t.calls);
      mine.push_back(t.bytes);
    }
  constexpr size_t k = kNumMemoryCategories + 1;
  std::array<uint64_t, k> peaks{};
  for (size_t c = 0; c < kNumMemoryCategories; ++c) peaks[c] = memory.at_total_peak(kAllMemoryCategories[c]);
  peaks[kNumMemoryCategories] = memory.total_peak();
  const size_t ranks = static_cast<size_t>(world.size());
  std::vector<uint64_t> all(per_rank * ranks);
  std::vector<std::array<uint64_t, k>> all_peaks(ranks);
  world.all_gather(mine.data(), all.data(), per_rank, DType::i64);
  world.all_gather(peaks.data(), all_peaks.data(), k, DType::i64);  // peaks stay far below 2^63
  if (!result) return;
  result->train_memory_by_rank = std::move(all_peaks);
  result->traffic_by_rank.assign(ranks, {});
  for (size_t r = 0; r < ranks; ++r)
    for (size_t c = 0; c < comms.size(); ++c)
      for (size_t op = 0; op < comm::kNumCollectiveOps; ++op) {
        const uint64_t* v = &all[r * per_rank + (c * comm::kNumCollectiveOps + op) * 2];
        if (v[0] > 0) result->traffic_by_rank[r].push_back({comms[c].first, static_cast<comm::CollectiveOp>(op), v[0], v[1]});
      }
  result->traffic_steps = static_cast<int64_t>(result->step_seconds.size());
}

void gather_placements(const parallel::Parallelism& strategy, comm::Communicator& world, TrainResult* result) {
  nlohmann::json mine = nlohmann::json::array();
  for (const parallel::ParamShard& s : strategy.parameter_shards()) {
    const sharding::Placement& p = s.placement;
    mine.push_back({s.name, s.replicated, p.shape, p.view, p.box.offsets, p.box.sizes, p.start, p.count});
  }
  const std::vector<std::string> all = comm::all_gather_bytes(world, mine.dump());
  if (!result) return;
  result->placements_by_rank.clear();
  for (const std::string& text : all) {
    std::vector<parallel::ParamShard>& rank = result->placements_by_rank.emplace_back();
    for (const nlohmann::json& e : nlohmann::json::parse(text))
      rank.push_back({e[0], {e[2], e[3], {e[4], e[5]}, e[6], e[7]}, e[1]});
  }
}

std::string tensor_parallel_summary(const std::vector<nn::Parameter*>& params, const nn::TensorParallelGroup& tp) {
  std::vector<std::pair<std::string, std::string>> rows;
  for (const nn::Parameter* p : params)
    rows.emplace_back(p->name, p->placement.is_block() ? p->placement.to_string()
                               : p->sequence_parallel ? std::string("replicated, sequence-parallel gradient")
                                                      : std::string("replicated"));
  std::string out = fmt::format("tensor parallel over {} ranks{} (rank 0's blocks):\n", tp.size(),
                                tp.splits_sequence() ? ", sequence parallel" : "");
  for (const auto& [name, where] : nn::fold_layer_rows(rows)) out += fmt::format("  {:<28} {}\n", name, where);
  return out;
}

int axis_size(const mesh::NamedShape& m, std::string_view name) {
  for (size_t i = 0; i < m.shape.size(); ++i)
    if (m.axis_names[i] == name) return m.shape[i];
  return 0;  // absent
}

namespace {

// Moves each parameter's untracked value (or gradient) to a tracked copy.
void track(const std::vector<nn::Parameter*>& params, MemoryTracker* memory, MemoryCategory category) {
  if (memory == nullptr) return;
  for (nn::Parameter* p : params) {
    Tensor& t = category == MemoryCategory::parameters ? p->value : p->grad;
    if (!t.defined() || t.storage()->tracker() != nullptr) continue;
    Tensor copy = Tensor::empty(t.shape(), t.dtype(), t.device(), memory, category);
    copy.copy_from(t);
    t = std::move(copy);
  }
}

}  // namespace

std::unique_ptr<parallel::Parallelism> make_parallelism(const TrainConfig& tc, const layout::TrainingLayout& layout,
                                                       nn::Module& model, std::vector<nn::Module*> units,
                                                       mesh::DeviceMesh& mesh, comm::Communicator& dp_comm,
                                                       MemoryTracker* memory) {
  if (layout.fsdp) {
    const parallel::FsdpMode mode = *layout.fsdp;
    comm::Communicator& shard = mode.hybrid ? mesh.comm(mesh::kFsdp) : dp_comm;
    comm::Communicator* replicate = mode.hybrid ? &mesh.comm(mesh::kData) : nullptr;
    // Node-aware collectives (ZeRO++; resolve_training checked its mesh)
    // need node x fsdp: the fsdp axis is a node's ranks. A node axis without
    // an fsdp axis is one more data-parallel axis that fsdp shards over.
    const auto& names = mesh.axis_names();
    const auto has = [&](std::string_view a) { return std::find(names.begin(), names.end(), a) != names.end(); };
    const bool nodes = has(mesh::kNode) && has(mesh::kFsdp);
    const auto [qwz, qgz, hpz] = layout.zeropp;
    return std::make_unique<parallel::FullyShardedDataParallel>(
        model, shard, replicate,
        parallel::FullyShardedOptions{.stage = mode.stage,
                                      .min_weight_size = layout.fsdp_min_weight_size,
                                      .param_dtype = layout.param_dtype,
                                      .reduce_dtype = layout.reduce_dtype,
                                      .reduce = parallel::GradReduce::sum,
                                      .forward_prefetch = tc.forward_prefetch,
                                      .backward_prefetch = tc.backward_prefetch,
                                      .reshard_after_forward = tc.reshard_after_forward,
                                      .unit_modules = std::move(units),
                                      .tracker = memory,
                                      .quantize_weights = qwz,
                                      .quantize_gradients = qgz,
                                      .hierarchical_partition = hpz,
                                      .weight_quant = {.bits = tc.zeropp_bits, .block = tc.zeropp_block},
                                      .grad_quant = {.bits = tc.zeropp_grad_bits != 0 ? tc.zeropp_grad_bits
                                                                                      : tc.zeropp_bits,
                                                     .block = tc.zeropp_block},
                                      .node_local = nodes ? &mesh.comm(mesh::kFsdp) : nullptr,
                                      .cross_node = nodes ? &mesh.comm(mesh::kNode) : nullptr,
                                      .deterministic = tc.deterministic});
  }
  // The model builds its f32 values and gradients untracked (fully sharded
  // data parallelism moves them into tracked storage of its own). Here the
  // values move to tracked copies, and the gradients become views of the
  // tracked buckets, so the rank's peak counts the whole model state (the
  // planner's predictions are checked against it).
  track(model.parameters(), memory, MemoryCategory::parameters);
  auto dp = std::make_unique<parallel::DataParallel>(
      model, dp_comm,
      parallel::DataParallelOptions{.bucket_bytes = static_cast<size_t>(tc.bucket_mb * (1 << 20)),
                                    .reduce = parallel::GradReduce::sum,
                                    .tracker = memory,
                                    .deterministic = tc.deterministic});
  track(model.parameters(), memory, MemoryCategory::gradients);
  return dp;
}

}  // namespace meshtrain::train::internal
