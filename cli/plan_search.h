// meshtrain plan --devices N --hardware H: the layout search
// (plan/layout_search.h) as a table with reasons; and --published, the
// search beside published training runs (docs/planner.md).
#pragma once

#include <string>
#include <vector>

#include "cli/plan_pictures.h"
#include "meshtrain/plan/layout_search.h"

namespace meshtrain::cli {

// Prints the picks, why, and the faster layouts that do not fit; writes
// the top pick's mesh over the hardware's nodes (mesh_svg) to each of
// `pictures` (none when nothing fits). 1 when nothing fits.
int run_plan_search(const plan::GptShape& shape, const plan::SearchOptions& options, const plan::Hardware& hardware,
                    const std::string& model_name, const std::vector<PictureFile>& pictures = {});

// GPT-3 175B on 1024 A100 (Megatron-LM), a 70B model on 64 H100 and a 7B
// model on 8 H100: each published layout priced beside its published
// throughput, and the search's pick for the same model, devices and batch.
int run_published_runs();

}  // namespace meshtrain::cli
