#include "meshtrain/plan/internal/gpt_layout.h"

#include <algorithm>

#include "meshtrain/sharding/stage_assignment.h"

namespace meshtrain::plan::internal {

int64_t chunk_size(int64_t n, int rank, int k) {
  const int64_t c = (n + k - 1) / k;
  return std::clamp<int64_t>(n - rank * c, 0, c);
}

std::vector<std::pair<int, int>> stage_blocks(const GptShape& g, int stages) {
  const double c = static_cast<double>(g.width), t = static_cast<double>(g.seq);
  std::vector<double> costs(static_cast<size_t>(g.layers), 24 * c * c + 2 * t * c);
  costs.back() += 2 * c * static_cast<double>(g.vocab);
  const sharding::PipelineParallelStrategy pp(mesh::kPipeline, stages);
  const std::vector<int> counts = pp.assign_layers_to_stages(costs);
  std::vector<std::pair<int, int>> out;
  for (int s = 0; s < stages; ++s) out.push_back(pp.layer_range(s, counts));
  return out;
}

std::vector<StageParam> stage_params(const GptShape& g, int first, int last, bool embed, bool head, int r, int k,
                                     bool pipelined) {
  const int64_t C = g.width;
  const int own_wte = pipelined && embed != head ? 1 : 0;
  const int blocks = last - first;
  const int rest = blocks + 1;
  std::vector<StageParam> ps;
  const int64_t wte = chunk_size(g.vocab, r, k) * C;
  // wte first (the model lists it first: the embedding, or the tied head's
  // copy on a last stage without the embedding).
  if (embed || head) ps.push_back({wte, own_wte ? blocks : rest, false});
  if (embed) ps.push_back({g.seq * C, rest, true});  // wpe: block_size rows (the run's sequence length)
  for (int b = 0; b < blocks; ++b) {
    const std::pair<int64_t, bool> block[] = {
        {C, true},          {C, true},           // ln_1
        {C * 3 * C / k, false}, {3 * C / k, false},  // c_attn
        {C / k * C, false}, {C, true},           // attn.c_proj (bias replicated)
        {C, true},          {C, true},           // ln_2
        {C * 4 * C / k, false}, {4 * C / k, false},  // c_fc
        {4 * C / k * C, false}, {C, true}};      // mlp.c_proj
    for (const auto& [n, replicated] : block) ps.push_back({n, b, replicated});
  }
  if (head) {
    ps.push_back({C, rest, true});  // ln_f
    ps.push_back({C, rest, true});
  }
  return ps;
}

}  // namespace meshtrain::plan::internal
