// meshtrain shard --model: every parameter of a built-in model placed on a
// mesh: the seeds' per-dimension spec (MultiDimensionalStrategy of
// DataParallel, FSDP and TensorParallel over the data, fsdp and tensor
// axes) and what a rank holds by the placement rule
// (layout/placement_rule.h: its pipeline stages, tensor blocks and fsdp's
// flat ranges of each unit, the units the trainer uses), which is what
// training holds (tests/placement_property_test.cc compares the two rank
// by rank). The models come from train/model_parameters.h (the recipes'
// own stage cuts), so a pipeline axis places the gpt and the mlp too; the
// gpt's blocks take train's flags (--arch llama, --kv-heads, --experts N
// with an expert axis, ...) and its start-up checks.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <memory>
#include <string>

#include "cli/train_field_flags.h"
#include "meshtrain/mesh/mesh_shape.h"
#include "meshtrain/sharding/layout.h"

namespace meshtrain::cli {

struct ModelShardFlags {
  std::string model;  // gpt | mlp | vae; "" = shard one tensor (--shape, --spec)
  int vocab = 8192, context = 64, layers = 4, heads = 4, width = 256;  // gpt
  std::string hidden = "512,512,256";                                 // mlp, vae
  int latent = 20;                                                    // vae
  int virtual_stages = 1;  // with a pipeline axis: model chunks per pipeline rank (interleaved)
  int64_t fsdp_min_weight_size = 1024;
  std::string fsdp;   // fsdp mode (layout::parse_fsdp_mode); "" = full with an fsdp axis > 1
  int rank = 0;       // whose holdings the table lists
  bool json = false;  // the rank's holdings as JSON instead of the table
  std::string param;  // one parameter's rank table and picture
  std::shared_ptr<TrainFieldFlags> decoder;  // gpt: --arch, --kv-heads, --experts, ... (train's)
  void add(CLI::App* app);
};

// Prints the model's parameters' specs and rank 0's blocks on `mesh` (and
// with --param that parameter's rank table and picture, also as SVG to
// `svg`). InvalidArgument for an unknown model, axis or parameter, or a
// split the strategies refuse (heads the tensor axis does not divide).
int run_shard_model(const ModelShardFlags& f, const std::string& mesh, int width, const std::string& svg);

// The rank table and picture of one layout (layout_commands.cc).
void print_layout(const sharding::Layout& layout, const mesh::NamedShape& named, int width, const std::string& svg);

}  // namespace meshtrain::cli
