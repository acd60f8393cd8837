#include "bench/zeropp_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <mutex>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/random.h"
#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/nn/mlp.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/parallel/fully_sharded.h"
#include "meshtrain/parallel/zeropp.h"

namespace meshtrain::bench {
namespace {

using Clock = std::chrono::steady_clock;

double bytes(const comm::Communicator& c, comm::CollectiveOp op) { return static_cast<double>(c.traffic(op).bytes); }

struct Config {
  std::string name;
  bool qwz = false, qgz = false, hpz = false;
  DType dtype = DType::f32;  // parameters and gradients
  int grad_bits = 0;         // qgZ's code width; 0: the options' bits
};

// One configuration's measurements on rank 0 (ranks are alike).
ZeroppBenchRow run_config(const ZeroppBenchOptions& o, const Config& cfg, int64_t* sharded) {
  const int k = o.nodes, l = o.ranks_per_node, n = k * l;
  const int grad_bits = cfg.grad_bits != 0 ? cfg.grad_bits : o.bits;
  ZeroppBenchRow row{.config = cfg.name};
  std::mutex mu;
  comm::launch({.engine = comm::Engine::threads, .ranks = n, .timeout = std::chrono::seconds(300)},
               [&](comm::Communicator& world) {
                 mesh::DeviceMesh grid(world, {k, l}, {std::string(mesh::kNode), std::string(mesh::kFsdp)});
                 comm::Communicator& shard = grid.comm({mesh::kNode, mesh::kFsdp});
                 comm::Communicator& local = grid.comm(mesh::kFsdp);
                 comm::Communicator& cross = grid.comm(mesh::kNode);
                 std::vector<int64_t> sizes = {784};
                 sizes.insert(sizes.end(), o.hidden.begin(), o.hidden.end());
                 sizes.push_back(10);
                 nn::MLPConfig mc;
                 mc.sizes = sizes;
                 mc.seed = 1;
                 mc.defer_init = true;
                 nn::MLP model(mc);
                 parallel::FullyShardedOptions fo;
                 fo.stage = parallel::ZeroStage::zero3;
                 fo.param_dtype = cfg.dtype;
                 fo.quantize_weights = cfg.qwz;
                 fo.quantize_gradients = cfg.qgz;
                 fo.hierarchical_partition = cfg.hpz;
                 fo.weight_quant = {.bits = o.bits, .block = o.block};
                 fo.grad_quant = {.bits = grad_bits, .block = o.block};
                 fo.node_local = &local;
                 fo.cross_node = k > 1 ? &cross : nullptr;
                 parallel::FullyShardedDataParallel fsdp(model, shard, nullptr, fo);
                 optim::AdamW opt(fsdp.optimizer_parameters(), 1e-3);
                 nn::CrossEntropyLoss ce;
                 Tensor x = Tensor::empty({o.batch, 784}, DType::f32);
                 fill_normal(x, 7, static_cast<uint64_t>(world.rank()), 0.0, 1.0);
                 Tensor y = Tensor::empty({o.batch}, DType::i64);
                 for (int64_t i = 0; i < o.batch; ++i) y.data<int64_t>()[i] = (i * 7 + world.rank()) % 10;
                 const auto step = [&] {
                   fsdp.begin_micro_batch(0, 1);
                   ce.forward(model.forward(x), y, static_cast<double>(o.batch) * n);
                   model.backward(ce.backward());
                   fsdp.finish();
                   opt.step();
                   fsdp.after_step();
                   fsdp.zero_grad();
                 };
                 step();  // warm-up
                 for (comm::Communicator* c : {&shard, &local, &cross}) c->reset_traffic();
                 std::vector<double> ms;
                 for (int s = 0; s < o.steps; ++s) {
                   world.barrier();
                   const auto t0 = Clock::now();
                   step();
                   ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
                 }
                 if (world.rank() != 0) return;
                 // Least bytes received per rank, by where the peers are (see the header).
                 const double flat = bytes(shard, comm::CollectiveOp::all_gather) +
                                     bytes(shard, comm::CollectiveOp::reduce_scatter);
                 const double ring = bytes(shard, comm::CollectiveOp::all_reduce) * 2.0 / n;
                 std::lock_guard lock(mu);
                 row.cross_node_bytes = (flat * (n - l) + ring * (n - l) +
                                         bytes(cross, comm::CollectiveOp::all_to_all) * (k - 1)) /
                                        o.steps;
                 row.within_node_bytes = (flat * (l - 1) + ring * (l - 1) +
                                          (bytes(local, comm::CollectiveOp::all_to_all) +
                                           bytes(local, comm::CollectiveOp::all_gather)) *
                                              (l - 1)) /
                                         o.steps;
                 row.secondary_bytes = static_cast<double>(fsdp.secondary_bytes());
                 std::sort(ms.begin(), ms.end());
                 row.step_ms = ms[ms.size() / 2];
                 *sharded = fsdp.sharded_elements();
               });
  // The paper's count for the sharded elements (replicated biases left out).
  const double p = static_cast<double>(*sharded), full = static_cast<double>(dtype_size(cfg.dtype)) * p;
  const auto quant = [&](int bits) { return p * bits / 8.0 + 4.0 * p / static_cast<double>(o.block); };
  const double other = static_cast<double>(n - l) / n;
  const double gather = (cfg.qwz ? quant(o.bits) : full) * other;
  row.formula_cross_bytes = gather * (cfg.hpz ? 1 : 2) + (cfg.qgz ? quant(grad_bits) * (k - 1) / n : full * other);
  return row;
}

}  // namespace

ZeroppBenchResult run_zeropp_bench(const ZeroppBenchOptions& o) {
  if (o.nodes < 1 || o.ranks_per_node < 1 || o.batch < 1 || o.steps < 1 || o.hidden.empty())
    throw InvalidArgument("bench zeropp", "nodes, ranks per node, batch, steps >= 1 and hidden sizes",
                          "pass positive sizes");
  BlockQuant{.bits = o.bits, .block = o.block}.check("bench zeropp");
  ZeroppBenchResult r;
  std::vector<Config> configs = {{.name = "ZeRO-3"}, {.name = "ZeRO-3 bf16", .dtype = DType::bf16}};
  for (int mask = 1; mask < 8; ++mask) {  // every combination of the three
    Config c{.name = "", .qwz = (mask & 1) != 0, .qgz = (mask & 2) != 0, .hpz = (mask & 4) != 0};
    for (auto [on, part] : {std::pair{c.qwz, "qwZ"}, {c.qgz, "qgZ"}, {c.hpz, "hpZ"}})
      if (on) c.name += c.name.empty() ? part : std::string("+") + part;
    configs.push_back(c);
  }
  if (o.bits == 8)  // the paper's setting: int8 weights, int4 gradients
    configs.push_back({.name = "qwZ+qgZ int4+hpZ", .qwz = true, .qgz = true, .hpz = true, .grad_bits = 4});
  for (const Config& c : configs) r.rows.push_back(run_config(o, c, &r.sharded_elements));
  return r;
}

std::string format_zeropp_bench(const ZeroppBenchResult& r, const ZeroppBenchOptions& o) {
  const double mb = 1 << 20;
  std::string s = fmt::format(
      "ZeRO-3 and ZeRO++ on {} node(s) x {} ranks (threads engine, simulated nodes), MLP 784 -> {} -> 10 ({} sharded "
      "elements), {} samples per rank, int{} codes per {} values, median of {} steps\n\n",
      o.nodes, o.ranks_per_node, fmt::join(o.hidden, " -> "), r.sharded_elements, o.batch, o.bits, o.block, o.steps);
  s += "| config | cross-node MiB / rank / step | formula | f32 ZeRO-3 / this | bf16 ZeRO-3 / this | within-node "
       "MiB | hpZ secondary MiB / rank | step ms |\n";
  s += "|---|---:|---:|---:|---:|---:|---:|---:|\n";
  const auto base = [&](size_t i) { return r.rows.size() > i ? r.rows[i].cross_node_bytes : 0.0; };
  const auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
  for (const ZeroppBenchRow& row : r.rows)
    s += fmt::format("| {} | {:.3f} | {:.3f} | {:.2f}x | {:.2f}x | {:.3f} | {:.3f} | {:.1f} |\n", row.config,
                     row.cross_node_bytes / mb, row.formula_cross_bytes / mb, ratio(base(0), row.cross_node_bytes),
                     ratio(base(1), row.cross_node_bytes), row.within_node_bytes / mb, row.secondary_bytes / mb,
                     row.step_ms);
  s += "\nBytes: what each rank receives per step at least, from the communicators' counters (the block each rank "
       "contributes per operation) and where its peers are; formula: ZeRO++'s count for the sharded elements "
       "(2 gathers + 1 reduce-scatter per step, hpZ: the backward gather within the node; biases stay "
       "replicated). The paper's baseline is fp16 ZeRO-3 (the bf16 column). hpZ's secondary copy is f32 under "
       "qwZ (the dequantized values the layers compute with). qgZ runs synchronously (the f32 reduce-scatters "
       "overlap backward), hence its step time.\n";
  return s;
}

}  // namespace meshtrain::bench
