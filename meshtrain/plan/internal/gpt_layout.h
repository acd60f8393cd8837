// What the GPT's parameters are on one device of a layout, shared by the
// planner's memory and traffic models: the trainer's cut of the blocks into
// pipeline stages and the parameters a (stage, tensor rank) holds, each with
// its fully sharded unit. Not for use outside plan.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "meshtrain/plan/activation_memory.h"

namespace meshtrain::plan::internal {

// torch.chunk's rule (nn::shard_range): n over k ranks, ceil(n / k) each,
// the last ones shorter or empty.
int64_t chunk_size(int64_t n, int rank, int k);

// One parameter a device holds: its local element count and the fully
// sharded unit it belongs to (0..blocks-1: the blocks; blocks: wte as a unit
// of its own; blocks + 1: the rest of the stage). `replicated`: the same on
// every tensor rank (LayerNorms, row-parallel biases, wpe).
struct StageParam {
  int64_t numel = 0;
  int unit = 0;
  bool replicated = false;
};

// The blocks [first, last) of each of `stages` stages: the trainer's cut by
// forward FLOPs per token (train/gpt_recipe.cc: 24 C^2 + 2 T C per block,
// the tied head's 2 C V on the last).
std::vector<std::pair<int, int>> stage_blocks(const GptShape& g, int stages);

// What stage first..last (with the embeddings / the head) of tensor rank r
// of k holds, in the module's parameter order (nn/gpt.h: column-parallel
// q|k|v and c_fc, row-parallel projections with replicated biases,
// vocabulary-parallel wte). `pipelined`: wte is a unit of its own.
std::vector<StageParam> stage_params(const GptShape& g, int first, int last, bool embed, bool head, int r, int k,
                                     bool pipelined);

}  // namespace meshtrain::plan::internal
