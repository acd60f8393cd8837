// Step time per device of training the GPT under a layout on given
// hardware: compute from the step's FLOPs and bytes, communication from
// plan::predict_traffic's calls priced per link, overlap where the runtime
// overlaps, and the pipeline's bubble per schedule. Pure arithmetic; the
// rates come from a Hardware, either a preset with published figures
// (hardware_preset("H100")) or one measured on this machine
// (meshtrain plan --calibrate, which writes it as JSON).
//
//   plan::Hardware hw = plan::hardware_preset("H100");
//   plan::TimePrediction t = plan::predict_time(g, l, hw);
//   t.step;                    // seconds per optimizer step (the slowest device)
//   t.devices[0].comm_exposed; // communication not hidden under compute
//
// The model, per device (p, tensor rank) and step, m micro-batches of B
// samples, t = T / context tokens, k = tensor, C width, V vocab:
//   GEMMs        per block and micro-batch q|k|v, the projection, c_fc and
//                c_proj: 24 B t C^2 / k FLOPs forward, twice that backward
//                (a recomputed forward again); the tied head 2 B t C V / k
//                forward and twice that backward. Each GEMM takes
//                (FLOPs + gemm_overhead_flops) / gemm_flops seconds (the
//                overhead models small GEMMs' lower rate).
//   attention    causal: 4 B (C / k) T (T + 1) / 2 / context FLOPs forward,
//                2.5 times that backward (flash attention's five products
//                against two), at gemm_flops x attention_efficiency.
//   elementwise  what the LayerNorms, GELU, residual adds, copies, softmax
//                and cross-entropy read and write, per token: (10 C +
//                16 C / k) elements per block forward (4 bytes, 2 under a
//                sharded strategy with bf16 parameters) and twice that
//                backward, 5 V / k x 4 bytes for the loss, 3 C x 4 for the
//                embedding; the optimizer 32 bytes per element it updates
//                (AdamW reads p, g, m, v and writes p, m, v; the gradient
//                is zeroed). At elementwise_bandwidth.
//   communication each call: latency + wire bytes / bandwidth, with wire
//                = 2 (n - 1) / n x bytes (all_reduce), (n - 1) x bytes
//                (all_gather's send block, reduce_scatter's received
//                block), (n - 1) x bytes (all_to_all: one peer's block), bytes (a send;
//                recvs pair with sends and are not counted again). The link is intra-node when the group's
//                ranks lie within devices_per_node consecutive ranks (the
//                runtime's rank order, TrainingLayout::rank_order: --mesh's
//                order, by default tensor fastest), inter-node otherwise.
//   overlap      with Hardware::overlap (devices with their own copy
//                engines), gradient reductions hide under the backward
//                (the blocks' and the head's backward GEMMs, attention and
//                block elementwise work), zero3's gathers under all the
//                step's compute, ring attention's exchanges under
//                attention; whatever exceeds the compute they hide under
//                is exposed. Tensor
//                parallelism, pipeline sends, the loss and zero1/2's
//                post-step gathers are always exposed. Without overlap
//                (the threads engine on a few cores: copies compete with
//                compute for the same cores) every call is exposed.
//   pipeline     per rank F + B per micro-batch (compute and the exposed
//                calls CommCall::per_micro_batch marks), step = m max_r(F + B) / (1 - bubble)
//                with parallel::theoretical_bubble's share for the
//                schedule, plus the step's own work (optimizer, gradient
//                reductions, post-step gathers).
//   shared cores Hardware::cores > 0 (simulated devices of the threads
//                engine): n <= c devices run with c / n threads each, each
//                thread at thread_efficiency (GEMMs) or
//                other_thread_efficiency (the rest) of one alone; n > c
//                devices share the cores in time, one thread each, and a
//                device that waits (a pipeline bubble) leaves its core to
//                the others: the step is the larger of the critical path
//                and all devices' work over c cores.
// docs/planner.md sets predictions beside measured steps (meshtrain plan
// --check) and beside published runs.
// Thread-safety: pure functions. Errors: InvalidArgument naming the value.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshtrain/layout/vocabulary.h"
#include "meshtrain/plan/memory_model.h"

namespace meshtrain::plan {

struct LinkRate {
  double latency = 0;    // seconds per call
  double bandwidth = 0;  // bytes per second on the wire, per rank
};

struct Hardware {
  std::string name;
  double gemm_flops = 0;           // sustained f32 GEMM rate of one device (GPUs: TF32)
  double gemm_flops_bf16 = 0;      // with bf16 operands; 0: as f32
  double gemm_overhead_flops = 0;  // per GEMM call (see the top)
  double attention_efficiency = 1;
  double elementwise_bandwidth = 0;  // bytes per second
  int devices_per_node = 8;
  LinkRate intra, inter;
  bool overlap = true;
  int cores = 0;                   // > 0: simulated devices share this many cores
  // More than one thread per device: each thread's rate relative to one
  // thread alone, for the GEMMs and for the rest (elementwise, attention).
  double thread_efficiency = 1;
  double other_thread_efficiency = 1;
  std::string source;              // where the figures come from
};

// Published figures: "A100" (SXM 80 GB, DGX A100: NVLink 3, 200 Gb/s
// InfiniBand per GPU) and "H100" (SXM, DGX H100: NVLink 4, 400 Gb/s per
// GPU). InvalidArgument naming the presets otherwise.
Hardware hardware_preset(std::string_view name);
std::vector<std::string> hardware_preset_names();

struct DeviceTime {
  int stage = 0, tensor_rank = 0;
  // Seconds per step on this device.
  double gemm = 0, attention = 0, elementwise = 0, optimizer = 0;
  double comm = 0;          // every call, as if nothing overlapped
  double comm_exposed = 0;  // what the step waits for
  double bubble = 0;        // idle in the pipeline's fill and drain
  double bytes = 0;         // what the elementwise kernels and the optimizer move
  double step = 0;          // compute + exposed communication + bubble
  // Communication seconds per step by communicator (CommCall::group).
  std::vector<std::pair<std::string, double>> comm_by_group;
  double compute() const { return gemm + attention + elementwise + optimizer; }
};

struct TimePrediction {
  std::vector<DeviceTime> devices;  // per (stage, tensor rank), stage-major
  double step = 0;                  // the slowest device's step
  double model_flops = 0;           // per step, all devices: 6 N tokens + attention (bench gpt's count)
  const DeviceTime& slowest() const;
};

// The idle share of a pipeline step under `schedule` (gpipe, 1f1b,
// interleaved, zb) for p ranks, m micro-batches and v chunks per rank, with
// a micro-batch's forward, backward-input and backward-weight passes equal
// (parallel::theoretical_bubble, which checks the shape, gives the
// derivations): (p - 1) / (m + p - 1) for gpipe and 1f1b, (p - 1) /
// (v m + p - 1) interleaved, 1 - 3 m / (2 m + p - 1 + max(m, p)) for zb.
// InvalidArgument for another schedule.
double pipeline_bubble(layout::ScheduleKind schedule, int p, int m, int v = 1);

TimePrediction predict_time(const GptShape& shape, const TrainingLayout& layout, const Hardware& hardware);

}  // namespace meshtrain::plan
