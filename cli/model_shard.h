// meshtrain shard --model: every parameter of a built-in model placed on a
// mesh by the seeds' strategies (MultiDimensionalStrategy of DataParallel,
// FSDP and TensorParallel over the mesh's data, fsdp and tensor axes). The
// tensor axis's blocks are the ones the runtime holds: nn/tensor_parallel.h
// takes them from the same TensorParallelStrategy (uneven mode).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

#include "meshtrain/mesh/mesh_shape.h"
#include "meshtrain/sharding/layout.h"

namespace meshtrain::cli {

struct ModelShardFlags {
  std::string model;  // gpt | mlp | vae; "" = shard one tensor (--shape, --spec)
  int vocab = 8192, context = 64, layers = 4, heads = 4, width = 256;  // gpt
  std::string hidden = "512,512,256";                                 // mlp, vae
  int latent = 20;                                                    // vae
  int64_t fsdp_min_weight_size = 1024;
  std::string param;  // one parameter's rank table and picture
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
