#include "meshtrain/train/internal/gather_parameters.h"

#include "meshtrain/nn/moe.h"

#include <algorithm>
#include <map>
#include <string_view>

namespace meshtrain::train::internal {

std::vector<NamedTensors> gather_named_tensors(comm::Communicator& c, const NamedTensors& mine, int tag) {
  std::vector<NamedTensors> out;
  if (c.rank() != 0) {
    // [count, then per tensor: name length, rank, dims...], the names, the values.
    std::vector<int64_t> meta = {static_cast<int64_t>(mine.size())};
    std::string names;
    for (const auto& [name, t] : mine) {
      meta.push_back(static_cast<int64_t>(name.size()));
      meta.push_back(t.dim());
      for (int64_t d : t.shape()) meta.push_back(d);
      names += name;
    }
    int64_t sizes[2] = {static_cast<int64_t>(meta.size()), static_cast<int64_t>(names.size())};
    c.send(sizes, 2, DType::i64, 0, tag);
    c.send(meta.data(), meta.size(), DType::i64, 0, tag);
    c.send(names.data(), names.size(), DType::u8, 0, tag);
    for (const auto& [name, t] : mine) {
      const Tensor v = t.to(DType::f32).contiguous();
      c.send(v.data_ptr(), static_cast<size_t>(v.numel()), DType::f32, 0, tag);
    }
    return out;
  }
  out.emplace_back(mine);
  for (int r = 1; r < c.size(); ++r) {
    int64_t sizes[2] = {0, 0};
    c.recv(sizes, 2, DType::i64, r, tag);
    std::vector<int64_t> meta(static_cast<size_t>(sizes[0]));
    std::string names(static_cast<size_t>(sizes[1]), '\0');
    c.recv(meta.data(), meta.size(), DType::i64, r, tag);
    c.recv(names.data(), names.size(), DType::u8, r, tag);
    NamedTensors theirs;
    size_t at = 1, name_at = 0;
    for (int64_t i = 0; i < meta.at(0); ++i) {
      const auto len = static_cast<size_t>(meta.at(at++));
      const auto rank = static_cast<size_t>(meta.at(at++));
      std::vector<int64_t> shape(meta.begin() + static_cast<std::ptrdiff_t>(at),
                                 meta.begin() + static_cast<std::ptrdiff_t>(at + rank));
      at += rank;
      Tensor v = Tensor::empty(shape, DType::f32);
      c.recv(v.data_ptr(), static_cast<size_t>(v.numel()), DType::f32, r, tag);
      theirs.emplace_back(names.substr(name_at, len), std::move(v));
      name_at += len;
    }
    out.push_back(std::move(theirs));
  }
  return out;
}

NamedTensors merge_expert_parameters(comm::Communicator& expert_axis, const NamedTensors& mine,
                                     const std::vector<bool>& expert) {
  constexpr int kTag = (1 << 14) + 1;  // below MPI's smallest tag bound, beside the pipeline's
  NamedTensors experts;
  for (size_t i = 0; i < mine.size(); ++i)
    if (expert[i]) experts.push_back(mine[i]);
  const std::vector<NamedTensors> all = gather_named_tensors(expert_axis, experts, kTag);
  if (all.empty()) return {};
  // Each layer's experts, every rank's in rank order.
  const auto layer_of = [](const std::string& name) { return name.substr(0, name.find(".experts.")); };
  std::map<std::string, NamedTensors> by_layer;
  for (const NamedTensors& rank : all)
    for (const auto& named : rank) by_layer[layer_of(named.first)].push_back(named);
  NamedTensors out;
  for (size_t i = 0; i < mine.size(); ++i) {
    if (!expert[i]) {
      out.push_back(mine[i]);
      continue;
    }
    const auto it = by_layer.find(layer_of(mine[i].first));
    if (it == by_layer.end()) continue;  // this layer's run is already out
    for (auto& named : it->second) out.push_back(std::move(named));
    by_layer.erase(it);
  }
  return out;
}

void insert_moe_biases(NamedTensors& params, const MoELayers& layers) {
  constexpr std::string_view kBias = "e_score_correction_bias";
  for (const auto& [block, layer] : layers) {
    const std::string bias = layer->bias_name();
    const std::string router = bias.substr(0, bias.size() - kBias.size()) + "weight";
    const auto at = std::find_if(params.begin(), params.end(), [&](const auto& p) { return p.first == router; });
    if (at != params.end()) params.insert(at + 1, {bias, layer->bias()});
  }
}

}  // namespace meshtrain::train::internal
