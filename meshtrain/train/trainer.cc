#include "meshtrain/train/trainer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <deque>
#include <cmath>
#include <memory>
#include <mutex>
#include <optional>

#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/parallel_for.h"
#include "meshtrain/core/random.h"
#include "meshtrain/core/reduction_tree.h"
#include "meshtrain/core/strings.h"
#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/nn/deterministic.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/nn/parallel/tensor_parallel.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/optim/clip.h"
#include "meshtrain/optim/loss_scaler.h"
#include "meshtrain/optim/schedule.h"
#include "meshtrain/optim/sgd.h"
#include "meshtrain/parallel/expert_parallel.h"
#include "meshtrain/parallel/parallelism.h"
#include "meshtrain/parallel/pipeline_parallel.h"
#include "meshtrain/parallel/tensor_parallel.h"
#include "meshtrain/train/artifacts.h"
#include "meshtrain/train/export.h"
#include "meshtrain/train/internal/checkpointing.h"
#include "meshtrain/train/internal/gather_parameters.h"
#include "meshtrain/train/internal/mesh_roles.h"
#include "meshtrain/train/internal/moe_report.h"
#include "meshtrain/train/internal/pipeline_run.h"
#include "meshtrain/train/internal/run_setup.h"
#include "meshtrain/train/model_recipe.h"
#include "meshtrain/train/progress.h"
#include "meshtrain/train/run_dir.h"
#include "meshtrain/data/sampler.h"

namespace meshtrain::train {

using data::DataPosition;
using data::DistributedSampler;
using data::Prefetcher;
using data::load_batch;
namespace {

using internal::axis_size;
using internal::data_parallel_axes;
using internal::gradient_axes;
using internal::replica_axes;
using internal::make_parallelism;
using internal::record_training_figures;
using internal::reset_traffic;
using internal::tensor_parallel_summary;
using Clock = std::chrono::steady_clock;
// Steps of history before the loss-spike guard judges (or the whole
// window, if shorter).
constexpr size_t kLossSpikeMinHistory = 10;

// An untracked f32 copy (a clone would stay charged to the rank's tracker,
// which dies with the rank).
Tensor detached_f32(const Tensor& t) {
  Tensor out = Tensor::empty(t.shape(), DType::f32);
  out.copy_from(t.contiguous().to(DType::f32));
  return out;
}

// A number for a message: "nan" rather than fmt's "-nan".
std::string number(double v) { return std::isnan(v) ? std::string("nan") : fmt::format("{:.6g}", v); }

struct Shared {  // results and files of world rank 0
  std::mutex mu;
  TrainResult result;
  std::optional<RunDirectory> dir;  // world rank 0's process only
  const StopRequest* stop = nullptr;  // read by every rank once per step
  config::DistributedConfig::Restart restart;  // a launcher's restart: why and when (metrics.jsonl)
};

// What one optimizer step did.
struct StepOutcome {
  double loss = 0;         // the global mean loss of the batch (unscaled)
  bool applied = true;     // false: skipped
  std::string why_skipped;  // for the log line
};

class Run {
 public:
  Run(const ResolvedTraining& resolved, const ModelRecipe& recipe, comm::Communicator& world, Shared& shared,
      std::string checkpoints)
      : Run(resolved.config, resolved.layout, recipe, world, resolved.layout.mesh, shared, std::move(checkpoints)) {}

  Run(const TrainConfig& tc, const layout::TrainingLayout& layout, const ModelRecipe& recipe,
      comm::Communicator& world, const mesh::NamedShape& mesh_shape, Shared& shared, std::string checkpoints)
      : tc_(tc), recipe_(recipe), train_(recipe.train_data()), test_(recipe.test_data()),
        metrics_(recipe.metrics()), shared_(shared), mesh_(world, mesh_shape.shape, mesh_shape.axis_names),
        main_(world.rank() == 0), world_(&world), checkpoints_(std::move(checkpoints)) {
    // Collective splits (all ranks, same order).
    writer_ = std::make_unique<internal::CheckpointWriter>(world, checkpoints_, tc.keep_last,
                                                          tc.async_checkpoint && tc.checkpoint_every > 0);
    batch_comm_ = &mesh_.comm(data_parallel_axes(mesh_shape));
    dp_comm_ = &mesh_.comm(gradient_axes(mesh_shape));
    replica_comm_ = &mesh_.comm(replica_axes(mesh_shape));  // dp_comm_ itself without an expert axis
    if (axis_size(mesh_shape, mesh::kTensor) > 1) tp_.comm = &mesh_.comm(mesh::kTensor);
    if (axis_size(mesh_shape, mesh::kExpert) > 1) ep_.comm = &mesh_.comm(mesh::kExpert);
    tp_.sequence_parallel = tc.sequence_parallel;
    tp_.overlap = tc.tp_overlap;
    if (axis_size(mesh_shape, mesh::kContext) > 1)
      cp_ = {&mesh_.comm(mesh::kContext), tc.cp_comm, tc.cp_load_balance};
    const bool sharded = layout.fsdp.has_value();
    compute_dtype_ = sharded ? layout.param_dtype : DType::f32;
    ModelOptions options{.seed = tc.seed,
                         .defer_init = sharded,  // the wrapper builds each rank's part alone
                         .compute_dtype = sharded ? layout.param_dtype : DType::f32,
                         .tracker = &memory_,  // activation buffers
                         .tensor = tp_,
                         .context = cp_,
                         .expert = ep_};
    std::optional<parallel::Schedule> schedule;
    if (axis_size(mesh_shape, mesh::kPipeline) > 1) {
      pp_ = &mesh_.comm(mesh::kPipeline);
      schedule = parallel::make_schedule(tc.pipeline_schedule, pp_->size(),
                                         tc.micro_batches, tc.virtual_stages);
      options.pipeline_stages = schedule->num_stages();
      for (int s = 0; s < schedule->num_stages(); ++s)
        if (schedule->stage_rank(s) == pp_->rank()) options.stages.push_back(s);
    }
    model_ = recipe.build(options);
    std::vector<RecipeStage*> stages = model_->stages();
    if (pp_ != nullptr && stages.size() != options.stages.size())
      throw InvalidArgument("meshtrain train",
                            fmt::format("model '{}' built {} pipeline stages for pipeline rank {}, which holds {}",
                                        tc.model, stages.size(), pp_->rank(), options.stages.size()),
                            "build ModelOptions::stages (see model_recipe.h)");
    if (pp_ == nullptr) {
      modules_ = {&model_->module()};
    } else {
      for (RecipeStage* st : stages) modules_.push_back(&st->module());
    }
    // The whole model's size (a tensor-parallel block counts its global
    // tensor; read before wrapping: stage 3 leaves values undefined; a
    // parameter two stages hold counts once).
    std::vector<nn::Parameter*> params;
    int64_t expert_parameters = 0;  // this expert rank's experts: the others hold the rest
    for (size_t k = 0; k < modules_.size(); ++k) {
      if (pp_ != nullptr) {
        stage_index_.push_back(options.stages[k]);
        tied_.push_back(stages[k]->tied_parameters());
      }
      for (nn::Parameter* p : modules_[k]->parameters()) {
        params.push_back(p);
        if (tied_copy(k, p->name)) continue;
        int64_t n = 1;
        for (int64_t d : p->placement.shape) n *= d;
        num_parameters_ += n;
        if (p->info.routed_expert()) expert_parameters += n;
      }
    }
    if (ep_.size() > 1) {
      int64_t all_experts = expert_parameters;
      ep_.comm->all_reduce(&all_experts, &all_experts, 1, DType::i64, comm::ReduceOp::sum);
      num_parameters_ += all_experts - expert_parameters;
    }
    if (pp_ != nullptr) pp_->all_reduce(&num_parameters_, &num_parameters_, 1, DType::i64, comm::ReduceOp::sum);
    if (main_ && tp_.size() > 1) tensor_split_ = tensor_parallel_summary(params, tp_);
    std::vector<std::pair<std::string, comm::Communicator*>> partial;  // replicated key/value heads' gradients
    for (const nn::Parameter* p : params) {
      if (p->sequence_parallel) sequence_parallel_.push_back(p->name);
      if (p->partial_over != nullptr) partial.emplace_back(p->name, p->partial_over);
    }
    if (pp_ == nullptr) {
      parallel_ =
          make_parallelism(tc, layout, model_->module(), model_->fsdp_units(), mesh_, *replica_comm_, &memory_);
    } else {
      std::vector<parallel::PipelineParallel::Stage> per_stage;
      for (size_t k = 0; k < stages.size(); ++k)
        per_stage.push_back({.index = options.stages[k],
                             .strategy = make_parallelism(tc, layout, stages[k]->module(), stages[k]->fsdp_units(), mesh_,
                                                          *replica_comm_, &memory_),
                             .tied = stages[k]->tied_parameters()});
      auto pipeline = std::make_unique<parallel::PipelineParallel>(std::move(per_stage), *pp_);
      pipeline_ = std::make_unique<internal::PipelineRun>(*schedule, *pp_, stages, *pipeline);
      stage_cut_ = pipeline_->describe_stages();  // collective; "" off pipeline rank 0
      parallel_ = std::move(pipeline);
    }
    // Tensor (and sequence) parallelism's once-per-step reductions wrap the
    // strategy over the data-parallel ranks (collective over the tensor axis).
    if (tp_.size() > 1)
      parallel_ =
          std::make_unique<parallel::TensorParallel>(std::move(parallel_), tp_, sequence_parallel_, std::move(partial));
    // Expert parallelism's: the replicated parameters' gradients over the expert axis.
    if (ep_.size() > 1) parallel_ = std::make_unique<parallel::ExpertParallel>(std::move(parallel_), *ep_.comm, params);
    // Mixture-of-experts layers, every rank's (collective).
    MoELayers moe;
    if (pp_ == nullptr) {
      moe = model_->moe_layers();
    } else {
      for (RecipeStage* st : stages)
        for (const auto& layer : st->moe_layers()) moe.push_back(layer);
    }
    moe_.emplace(std::move(moe), world);
    // fp16 anywhere (compute or gradients) needs a loss scaler; bf16 has f32's range.
    if (parallel_->needs_loss_scaling()) scaler_ = std::make_unique<optim::DynamicLossScaler>();
    opt_params_ = parallel_->optimizer_parameters();
    if (tc.optimizer == "adamw")
      opt_ = std::make_unique<optim::AdamW>(opt_params_, tc.lr, std::pair{0.9, 0.999}, 1e-8, tc.weight_decay,
                                            &memory_);
    else
      opt_ = std::make_unique<optim::SGD>(opt_params_, tc.lr, tc.momentum, false, tc.weight_decay, 0.0, &memory_);
  }

  void run() {
    const nn::functional::DeterministicRowsScope deterministic(
        tc_.deterministic ? tc_.deterministic_block * rows_per_sample(tc_) : 0);
    DistributedSampler sampler(train_.size(), tc_.batch_size, tc_.seed, tc_.drop_last, batch_comm_->rank(),
                               batch_comm_->size());
    const int64_t per_epoch = sampler.num_batches();
    const int64_t full = per_epoch * tc_.epochs;
    const int64_t total = tc_.max_steps > 0 ? std::min(full, tc_.max_steps) : full;
    // The schedule's length never depends on max_steps: a short run is a prefix of the full one.
    schedule_steps_ = tc_.lr_decay_steps > 0 ? tc_.lr_decay_steps : full;
    const auto schedule =
        tc_.schedule == "cosine"
            ? optim::LrSchedule::cosine_with_warmup(tc_.lr, std::min<int64_t>(tc_.warmup_steps, schedule_steps_),
                                                    schedule_steps_, tc_.min_lr_ratio)
            : optim::LrSchedule::constant(tc_.lr);
    total_ = total;
    if (tc_.resume.empty() && !tc_.init_from.empty()) init_from_file();
    const auto load_start = Clock::now();
    const std::optional<int64_t> resumed = tc_.resume.empty() ? std::nullopt : std::optional<int64_t>(resume());
    load_seconds_ = std::chrono::duration<double>(Clock::now() - load_start).count();
    std::unique_ptr<MetricsLog> log;
    if (main_) {
      log = std::make_unique<MetricsLog>(shared_.dir->file("metrics.jsonl"), resumed);
      const std::string steps =
          total < full ? fmt::format("{} epochs x {} batches of {} samples = {} steps, stopping at step {} (max_steps)",
                                     tc_.epochs, per_epoch, tc_.batch_size, full, total)
                       : fmt::format("{} epochs x {} batches of {} samples = {} steps", tc_.epochs, per_epoch,
                                     tc_.batch_size, full);
      const std::string lr =
          tc_.schedule == "cosine"
              ? fmt::format("lr {} cosine over {} steps (warmup {}{})", tc_.lr, schedule_steps_,
                            schedule.warmup_steps(),
                            tc_.min_lr_ratio > 0 ? fmt::format(", floor {}", tc_.lr * tc_.min_lr_ratio) : "")
              : fmt::format("lr {} constant", tc_.lr);
      fmt::print("model {}: {} parameters; {}; {}; {}\n", tc_.model, num_parameters_, steps, lr,
                 parallel_->describe());
      if (const std::string note = gemm_dtype_note(compute_dtype_); !note.empty()) fmt::print("note: {}\n", note);
      if (cp_.active())
        fmt::print("context parallel over {} ranks: {} attention, each sample's {} tokens in {} chunks of {}{}; "
                   "gradients summed over the {} ranks above\n",
                   cp_.size(), nn::context_comm_name(cp_.kind), tc_.context, cp_.chunks(), tc_.context / cp_.chunks(),
                   cp_.load_balance ? " (zig-zag: rank r holds chunks r and 2n-1-r)" : " (in order)", dp_comm_->size());
      if (!tensor_split_.empty()) fmt::print("{}", tensor_split_);
      if (!stage_cut_.empty())
        fmt::print("pipeline {} over {} ranks, {} micro-batches (stages cut by cost; global sizes):\n{}",
                   layout::to_string(tc_.pipeline_schedule), pp_->size(), tc_.micro_batches, stage_cut_);
      fmt::print("run directory: {} (written to {} until the run succeeds)\n", shared_.dir->path(),
                 shared_.dir->staging());
      std::fflush(stdout);
    }
    ProgressBar bar(total, main_);
    bar.set_rate_unit(metrics_.rate_unit);
    const double units = metrics_.units_per_sample;  // per sample, in the rate's unit
    Series train_curve{"train loss", {}, {}}, test_curve{metrics_.test_curve, {}, {}};
    if (main_ && resumed) read_curves(shared_.dir->file("metrics.jsonl"), train_curve, test_curve);
    int64_t step = resumed.value_or(0), samples = 0;
    int64_t last_saved = resumed.value_or(-1);
    double window_loss = 0, hidden_sum = 0;
    int window_n = 0;
    internal::gather_placements(*parallel_, *world_, main_ ? &shared_.result : nullptr);
    const internal::NamedComms comms = internal::training_communicators(mesh_, *parallel_);
    reset_traffic(comms);
    const auto t0 = Clock::now();
    const int first_epoch = static_cast<int>(step / per_epoch);
    for (int epoch = first_epoch; epoch < tc_.epochs && step < total; ++epoch) {
      const int64_t first = step - per_epoch * epoch;  // 0, or where a resumed run stopped
      const int64_t batches = std::min(per_epoch, first + total - step);
      Prefetcher pre([&, epoch](int64_t b) { return load_batch(train_, sampler, epoch, b, &memory_); }, first,
                     batches);
      set_training(true);
      while (auto batch = pre.next()) {
        opt_->set_lr(schedule.lr(step));
        const auto step_start = Clock::now();
        const StepOutcome out = train_step(*batch, step);
        if (main_) shared_.result.step_seconds.push_back(std::chrono::duration<double>(Clock::now() - step_start).count());
        const double loss = out.loss;
        ++step;
        samples += batch->global_size;
        if (out.applied) ++updates_;
        if (!out.applied) {
          ++skipped_;
          ++consecutive_skips_;
          if (main_) {
            bar.note(fmt::format("step {}: skipped, {}; {} skipped so far", step, out.why_skipped, skipped_));
            log->write({{"step", static_cast<double>(step)},
                        {"skipped_steps", static_cast<double>(skipped_)},
                        {"consecutive_skips", static_cast<double>(consecutive_skips_)}},
                       {{"split", "train"}, {"event", "skipped_step"}, {"reason", out.why_skipped}});
          }
          if (consecutive_skips_ >= tc_.max_consecutive_skips) throw too_many_skips(step, out.why_skipped);
        } else {
          consecutive_skips_ = 0;
        }
        if (const auto h = parallel_->hidden_fraction()) hidden_sum += *h;
        if (step == 1 && main_) print_memory();
        if (main_ && resumed && step == *resumed + 1) log_layout_change(*log, *resumed, step_start);
        window_loss += loss;
        ++window_n;
        if (main_) {
          shared_.result.step_losses.push_back(loss);
          train_curve.x.push_back(static_cast<double>(step));
          train_curve.y.push_back(loss);
        }
        const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
        std::vector<std::pair<std::string, double>> shown = {{"loss", loss}, {"lr", opt_->lr()}};
        if (scaler_) shown.emplace_back("scale", scaler_->scale());
        moe_->add_progress(shown, tc_.moe.capacity_factor > 0, tc_.moe.aux_loss_coef > 0);  // the expert load
        bar.update(step, shown, units * samples / elapsed);
        if (step % tc_.log_every == 0 || step == total) {
          if (log) {
            std::vector<std::pair<std::string, double>> numbers = {
                {"step", static_cast<double>(step)}, {"epoch", static_cast<double>(epoch)},
                {"loss", window_loss / window_n},    {"lr", opt_->lr()},
                {"samples_per_s", samples / elapsed}};
            if (const auto h = parallel_->hidden_fraction()) numbers.emplace_back("hidden_fraction", *h);
            if (scaler_) numbers.emplace_back("loss_scale", scaler_->scale());
            if (scaler_ || tc_.on_nonfinite == NonFinitePolicy::skip)
              numbers.emplace_back("skipped_steps", static_cast<double>(skipped_));
            moe_->add_metrics(numbers);  // this step's expert load
            log->write(numbers, {{"split", "train"}});
          }
          if (main_) shared_.result.final_train_loss = window_loss / window_n;
          window_loss = 0;
          window_n = 0;
        }
        if (tc_.checksum_every > 0 && step % tc_.checksum_every == 0) {
          parallel_->gather_full_parameters();
          const internal::NamedTensors whole = whole_model();  // collective
          if (log) log->write({{"step", static_cast<double>(step)}}, {{"checksum", parameters_checksum(whole)}});
          parallel_->reshard();
        }
        if (tc_.checkpoint_every > 0 && step % tc_.checkpoint_every == 0) {
          save(step, bar);
          last_saved = step;
        }
        if (stop_after_step_) {
          if (tc_.checkpoint_every > 0 && last_saved != step) save(step, bar, /*last=*/true);
          finish_saves(bar);
          if (main_) bar.finish();
          throw interrupted(step, total);
        }
      }
      if (epoch == first_epoch) record_training_figures(memory_, comms, *world_, main_ ? &shared_.result : nullptr);
      check_parameters(step);
      const Evaluation ev = evaluate();  // the same numbers on every rank
      if (!std::isfinite(ev.loss))  // finite parameters whose outputs overflow are no model either
        throw diverged(step - 1, fmt::format("the test {} after step {} is {}", metrics_.test_loss, step,
                                             number(ev.loss)),
                       false);
      if (main_) {
        bar.finish();
        test_curve.x.push_back(static_cast<double>(step));
        test_curve.y.push_back(ev.loss);
        fmt::print("epoch {:>2}: {}\n", epoch + 1, ev.epoch_line);
        std::vector<std::pair<std::string, double>> numbers = {{"step", static_cast<double>(step)},
                                                               {"epoch", static_cast<double>(epoch + 1)}};
        numbers.insert(numbers.end(), ev.metrics.begin(), ev.metrics.end());
        log->write(numbers, {{"split", "test"}});
        std::fflush(stdout);
        record_evaluation(ev, shared_.result);
      }
    }
    if (tc_.checkpoint_every > 0 && last_saved != step) save(step, bar, /*last=*/true);  // the final one
    finish_saves(bar);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (pipeline_) write_pipeline_timeline();  // collective over the pipeline axis
    finish_run(train_curve, test_curve);  // collective under fsdp
    if (!main_) return;
    log->close();  // fsync before the run directory is committed
    auto& r = shared_.result;
    r.steps = step;
    r.seconds = seconds;
    r.samples_per_second = samples / r.seconds;
    r.rate_unit = metrics_.rate_unit;
    r.units_per_second = r.samples_per_second * metrics_.units_per_sample;
    r.hidden_fraction = step ? hidden_sum / step : 0;
    r.run_dir = shared_.dir->path();
    r.fsdp = tc_.fsdp.name;
    r.parallelism = parallel_->describe();
    r.schedule_steps = schedule_steps_;
    r.skipped_steps = skipped_;
    if (scaler_) r.loss_scale = scaler_->scale();
    r.state = {.step = step,
               .data = DataPosition::at_step(sampler, step),
               .seed = tc_.seed,
               .loss_scale = r.loss_scale,
               .skipped_steps = skipped_};
    write_file_atomic(shared_.dir->file("trainer_state.json"), r.state.to_json());
    for (MemoryCategory c : kAllMemoryCategories) r.memory_peak[static_cast<size_t>(c)] = memory_.peak(c);
    r.memory_total_peak = memory_.total_peak();
  }

 private:
  // One optimizer step over one global batch: forward and backward of this
  // rank's rows, the gradient reduction, then one decision that every rank
  // makes alike from globally reduced values: stop (TrainingDiverged), skip
  // the update, or apply it.
  StepOutcome train_step(const Batch& batch, int64_t step) {
    const int m = tc_.micro_batches;
    const int64_t local = batch.size();
    // fp16: the loss gradient is multiplied by the scale S (a power of two:
    // scaling and unscaling are exact); the optimizer unscales (and clips)
    // through its grad scale.
    const double s = scaler_ ? scaler_->scale() : 1.0;
    const double norm = static_cast<double>(batch.global_size) / s;
    double loss = 0;
    if (tc_.deterministic) {
      const int64_t block = tc_.deterministic_block;
      nn::begin_deterministic_step(block, batch.global_size / block,
                                   {batch.first_global_sample / block, local / block});
    }
    if (pipeline_) {
      loss = pipeline_->step(batch, step, norm);  // the last stage's; 0 on the others
    } else {
      std::vector<double> losses;  // the micro-batches', summed in the canonical tree when deterministic
      for (int i = 0; i < m; ++i) {
        parallel_->begin_micro_batch(i, m);
        losses.push_back(model_->loss_step(batch.rows(local * i / m, local * (i + 1) / m), step, norm));
      }
      if (tc_.deterministic) {
        loss = tree_sum(losses);
      } else {
        for (double l : losses) loss += l;
      }
    }
    parallel_->finish();
    // {loss, ranks whose parameters are not finite}: one reduction, so every
    // rank sees the same numbers. The parameters checked are the ones the
    // previous step produced (this rank's shards under fsdp); the gradients
    // are checked by the strategy's collective grads_finite().
    // A stop request rides along, so every rank stops after the same step.
    double v[3] = {loss / s, optim::values_finite(opt_params_) ? 0.0 : 1.0,
                   shared_.stop != nullptr && shared_.stop->requested() ? 1.0 : 0.0};
    const double tree_loss = tc_.deterministic ? comm::tree_all_reduce(*dp_comm_, v[0]) : 0.0;
    dp_comm_->all_reduce(v, v, 3, DType::f64, comm::ReduceOp::sum);
    if (tc_.deterministic) v[0] = tree_loss;  // the canonical tree's sum, not the engine's
    any_over_tensor(v + 1, 2);  // tensor-parallel ranks hold different blocks; the loss is the same on each
    if (pp_ != nullptr) pp_->all_reduce(v, v, 3, DType::f64, comm::ReduceOp::sum);  // the last stage's loss
    stop_after_step_ = v[2] > 0;
    const bool grads_finite = parallel_->grads_finite();
    StepOutcome out;
    out.loss = v[0];
    bool overflow = false;  // fp16: the scaler's business
    if (v[1] > 0)
      throw diverged(step, fmt::format("the parameters are not finite on {} of {} data-parallel ranks: the update "
                                       "of step {} overflowed",
                                       v[1], dp_comm_->size(), step),
                     false);
    if (!std::isfinite(out.loss)) {
      if (tc_.on_nonfinite == NonFinitePolicy::error)
        throw diverged(step, fmt::format("the loss is {} (the mean over a global batch of {})", number(out.loss),
                                         batch.global_size),
                       true);
      out.applied = false;
      out.why_skipped = fmt::format("the loss is {}", number(out.loss));
    } else if (!grads_finite) {
      if (scaler_) {
        overflow = true;
        out.applied = false;
        out.why_skipped = fmt::format("gradients overflowed fp16 at loss scale {}", s);
      } else if (tc_.on_nonfinite == NonFinitePolicy::error) {
        throw diverged(step, fmt::format("the gradients are not finite (the loss is {})", number(out.loss)), true);
      } else {
        out.applied = false;
        out.why_skipped = fmt::format("the gradients are not finite (the loss is {})", number(out.loss));
      }
    }
    if (std::isfinite(out.loss)) check_loss_spike(step, out.loss, batch.global_size);
    if (out.applied) apply_update(s);
    moe_->step(step + 1, out.applied, tc_.moe.bias_update_rate, *dp_comm_, pp_, main_);
    if (scaler_ && std::isfinite(out.loss)) {  // a non-finite loss is no overflow of the scaled gradients
      scaler_->update(overflow);
      if (overflow) out.why_skipped += fmt::format(", scale now {}", scaler_->scale());
    }
    parallel_->zero_grad();
    return out;
  }

  // The loss-spike guard (TrainConfig::loss_spike): a finite loss far above
  // the recent ones stops the run before its update, as a non-finite one
  // does. The loss is the same on every rank (reduced above), so every rank
  // stops at the same step.
  void check_loss_spike(int64_t step, double loss, int64_t global_batch) {
    if (tc_.loss_spike <= 0) return;
    const size_t window = static_cast<size_t>(tc_.loss_spike_window);
    if (recent_losses_.size() >= std::min<size_t>(window, kLossSpikeMinHistory)) {
      double sum = 0;
      for (double l : recent_losses_) sum += l;
      const double mean = sum / static_cast<double>(recent_losses_.size());
      if (loss > tc_.loss_spike * mean && loss - mean > 1e-6)
        throw diverged(step,
                       fmt::format("the loss is {:.6g}, more than {:g} times the mean of the last {} steps ({:.6g}; "
                                   "--loss-spike, the mean over a global batch of {})",
                                   loss, tc_.loss_spike, recent_losses_.size(), mean, global_batch),
                       false);
    }
    recent_losses_.push_back(loss);
    if (recent_losses_.size() > window) recent_losses_.pop_front();
  }

  // The optimizer step on finite gradients scaled by s.
  // The clip factor multiplies the gradients inside the optimizer (for f32
  // gradients bit for bit what optim::clip_grad_norm's in-place scaling
  // gives, see optim/optimizer.h).
  void apply_update(double s) {
    double factor = 1.0 / s;
    if (tc_.clip_norm > 0) {
      // The deterministic mode: the norm from exact squares (the same bits on any layout).
      const auto all = [](const nn::Parameter&) { return true; };
      const double norm =
          tc_.deterministic ? std::sqrt(parallel_->grad_squares_exact(all).value()) : parallel_->grad_norm();
      factor = optim::clip_factor(norm / s, tc_.clip_norm) / s;
    }
    opt_->set_grad_scale(factor);
    opt_->step();
    parallel_->after_step();
  }

  // The error that stops a run whose numbers went wrong before (0-based)
  // step `step`; `nonfinite_policy`: the on_nonfinite option applies.
  TrainingDiverged diverged(int64_t step, const std::string& what, bool nonfinite_policy) const {
    std::string hint = fmt::format("lower the learning rate (lr = {:.6g} now), or clip gradients (--clip-norm 1.0)",
                                   opt_->lr());
    if (scaler_) hint += ", or train in bf16 (--precision bf16: f32's range, no loss scaling)";
    if (nonfinite_policy)
      hint += fmt::format("; --on-nonfinite skip skips such steps instead (at most --max-consecutive-skips {} in "
                          "a row)",
                          tc_.max_consecutive_skips);
    return TrainingDiverged("meshtrain train",
                            fmt::format("step {} of {}: {}; training stopped and saved nothing", step + 1, total_,
                                        what),
                            hint);
  }

  TrainingDiverged too_many_skips(int64_t step, const std::string& last) const {
    std::string hint = fmt::format("lower the learning rate (lr = {:.6g} now) or clip gradients (--clip-norm 1.0)",
                                   opt_->lr());
    if (scaler_) hint += "; with fp16, bf16 (--precision bf16) needs no loss scale";
    hint += fmt::format("; --max-consecutive-skips {} sets the limit", tc_.max_consecutive_skips);
    return TrainingDiverged("meshtrain train",
                            fmt::format("step {} of {}: {} steps in a row were skipped (the last: {}); {} skipped "
                                        "in all; training stopped and saved nothing",
                                        step, total_, consecutive_skips_, last, skipped_),
                            hint);
  }

  // A resume on another layout (another mesh or strategy, e.g. fewer
  // devices after a failure) is a line of its own ("layout_change"; a
  // launcher's restart on the same layout: "restart"), written after its
  // first step: why (a launcher's restart says; else "resumed") and, after a
  // launcher's restart, the time lost from the failure to the end of that
  // step: the rendezvous (to this process's start), the re-plan, the
  // checkpoint load, the rest of the start-up (the process, the model, the
  // data) and the first step; and the steps redone since the checkpoint.
  void log_layout_change(MetricsLog& log, int64_t resumed, Clock::time_point first_step_start) const {
    const std::string now = layout_summary();
    const config::DistributedConfig::Restart& r = shared_.restart;
    // A launcher's restart on the same layout (a worker failed, or a node
    // was replaced) is recorded too, as a "restart".
    if (now == resumed_from_ && r.reason.empty()) return;
    // The steps since the checkpoint that the run redoes (as far as its
    // log, every log_every steps, had reached).
    std::vector<std::pair<std::string, double>> numbers = {
        {"step", static_cast<double>(resumed)}, {"steps_redone", static_cast<double>(log.dropped_through() - resumed)}};
    if (r.event_unix_ms > 0) {
      const double lost =
          static_cast<double>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                  std::chrono::system_clock::now().time_since_epoch())
                                  .count() -
                              r.event_unix_ms) /
          1000;
      const double first = std::chrono::duration<double>(Clock::now() - first_step_start).count();
      const double rendezvous = static_cast<double>(r.rendezvous_ms) / 1000;
      numbers.insert(numbers.end(),
                     {{"time_lost_s", lost},
                      {"rendezvous_s", rendezvous},
                      {"replan_s", r.replan_s},
                      {"checkpoint_load_s", load_seconds_},
                      {"startup_s", std::max(0.0, lost - rendezvous - r.replan_s - load_seconds_ - first)},
                      {"first_step_s", first}});
    }
    log.write(numbers, {{"event", now == resumed_from_ ? "restart" : "layout_change"},
                        {"from", resumed_from_},
                        {"to", now},
                        {"reason", r.reason.empty() ? std::string("resumed") : r.reason}});
  }

  // "mesh data=2 (data parallel 2)": what a checkpoint records as saved_from.
  std::string layout_summary() const {
    return fmt::format("mesh {} ({})", mesh::NamedShape{mesh_.shape(), mesh_.axis_names()}.to_spec(),
                       parallel_->describe());
  }

  internal::ResumePoint resume_point(int64_t step) const {
    internal::ResumePoint p{.step = step,
                            .skipped_steps = skipped_,
                            .consecutive_skips = consecutive_skips_,
                            .optimizer_steps = updates_,
                            .scaler = std::nullopt,
                            .model = tc_.model,
                            .saved_from = layout_summary(),
                            .dir = ""};
    if (scaler_) p.scaler = scaler_->state();
    return p;
  }

  internal::TrainingCheckpoint checkpoint() {
    std::vector<std::pair<std::string, Tensor>> buffers;  // the MoE layers' selection biases
    for (const auto& [block, layer] : moe_->layers()) buffers.emplace_back(layer->bias_name(), layer->bias());
    return internal::TrainingCheckpoint(opt_params_, *opt_, std::move(buffers));
  }

  // Collective: a sharded checkpoint of `step` (internal::CheckpointWriter:
  // in the background with --async-checkpoint); `last` (the run's final or
  // interrupted save) finishes before the run does.
  void save(int64_t step, ProgressBar& bar, bool last = false) {
    for (const std::string& line : writer_->save(checkpoint(), resume_point(step), last))
      if (main_) bar.note(line);
  }
  // Waits for a background save in flight, if any (rethrowing its error).
  void finish_saves(ProgressBar& bar) {
    for (const std::string& line : writer_->finish())
      if (main_) bar.note(line);
  }

  // --init-from, or --resume (returns the step it resumes from); then the
  // loaded masters are published (rounded copies, zero1/2's full parameters).
  void init_from_file() {
    const NamedTensors tensors = load_model_file(tc_.init_from, torch_layout_model(tc_));
    std::vector<int32_t> used(tensors.size(), 0);  // per tensor: some rank took a part of it
    internal::on_every_rank(*world_, "--init-from", used, [&] { used = checkpoint().load_model(tensors, tc_.init_from); });
    parallel_->after_step();
    std::vector<std::string> unused;
    for (size_t i = 0; i < tensors.size(); ++i)
      if (used[i] == 0) unused.push_back(tensors[i].first);
    if (main_)
      fmt::print("initialized from {} ({} tensors{})\n", tc_.init_from, tensors.size() - unused.size(),
                 unused.empty() ? std::string() : fmt::format("; not in this model: {}", fmt::join(unused, ", ")));
  }
  int64_t resume() {
    internal::ResumePoint point;
    std::vector<int32_t> none;
    internal::on_every_rank(*world_, "--resume", none, [&] { point = checkpoint().resume(checkpoints_, tc_.model); });
    parallel_->after_step();
    if (scaler_ && point.scaler) scaler_->load_state(*point.scaler);
    skipped_ = point.skipped_steps;
    consecutive_skips_ = point.consecutive_skips;
    updates_ = point.optimizer_steps;
    resumed_from_ = point.saved_from;
    if (main_) fmt::print("resumed from {} (step {}, saved on {})\n", point.dir, point.step, point.saved_from);
    return point.step;
  }

  // The last step's timeline of every pipeline rank: pipeline.trace.json
  // (Perfetto), pipeline.svg, and its measured bubble beside the theory.
  void write_pipeline_timeline() {
    const internal::PipelineReport p = pipeline_->write_timeline(main_ ? &*shared_.dir : nullptr, total_);
    if (!main_) return;
    auto& r = shared_.result;
    r.pipeline_schedule = p.schedule;
    r.pipeline_bubble = p.bubble;
    r.pipeline_bubble_theory = p.theory;
    r.pipeline_peak_in_flight = p.peak_in_flight;
    fmt::print("pipeline {}: idle {:.1f}% of the last step (theory {:.1f}% for equal stages); rank 0 held {} "
               "micro-batches' activations at once; timeline in pipeline.svg and pipeline.trace.json\n",
               r.pipeline_schedule, 100 * r.pipeline_bubble, 100 * r.pipeline_bubble_theory,
               r.pipeline_peak_in_flight);
    std::fflush(stdout);
  }

  // Collective over the world: every rank's peaks so far, kept by rank 0.
  void print_memory() const {
    std::string parts;
    for (MemoryCategory c : kAllMemoryCategories)
      if (memory_.peak(c) > 0) parts += fmt::format("{} {}, ", memory_category_name(c), format_bytes(memory_.peak(c)));
    fmt::print("memory per rank (rank 0, peak through step 1): {}total {}\n", parts,
               format_bytes(memory_.total_peak()));
    std::fflush(stdout);
  }

  // The test set, each rank on its slice. Every rank runs the same number of
  // forwards (its slice in equal chunks of at most about kChunk rows): under
  // fsdp each forward is collective. Each chunk is a Batch whose
  // first_global_sample is its first test-sample index, so sampled noise
  // (the VAE's z) does not depend on the data-parallel split.
  Evaluation evaluate() {
    // Evaluation chunks are not the deterministic mode's blocks (and change
    // no parameter): the default kernels there.
    const nn::functional::DeterministicRowsScope plain(0);
    set_training(false);
    const int64_t n = test_.size(), d = batch_comm_->size(), r = batch_comm_->rank();
    const int64_t lo = n * r / d, hi = n * (r + 1) / d;
    std::vector<double> sums;  // the recipe's, added over chunks
    const int64_t kChunk = std::max<int64_t>(1, model_->evaluation_rows());
    const int64_t chunks = std::max<int64_t>(1, ((n + d - 1) / d + kChunk - 1) / kChunk);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t a = lo + (hi - lo) * c / chunks, b = lo + (hi - lo) * (c + 1) / chunks;
      Batch chunk;
      chunk.indices.resize(static_cast<size_t>(b - a));
      for (int64_t i = a; i < b; ++i) chunk.indices[static_cast<size_t>(i - a)] = i;
      chunk.global_size = n;
      chunk.first_global_sample = a;
      test_.load(chunk.indices, chunk, nullptr);
      const std::vector<double> part = pipeline_ ? pipeline_->evaluate(chunk, n) : model_->evaluate(chunk, n);
      if (c == 0) sums.assign(part.size(), 0.0);
      if (part.size() != sums.size())
        throw InvalidArgument("meshtrain train",
                              fmt::format("model '{}': evaluate() returned {} sums for one chunk and {} for another",
                                          tc_.model, sums.size(), part.size()),
                              "return the same sums for every chunk (see model_recipe.h)");
      for (size_t k = 0; k < sums.size(); ++k) sums[k] += part[k];
    }
    parallel_->reshard();
    if (pipeline_) pipeline_->share_sums(sums);  // the last stage's
    dp_comm_->all_reduce(sums.data(), sums.data(), sums.size(), DType::f64, comm::ReduceOp::sum);
    set_training(true);
    return model_->summarize(sums, n);
  }

  // The result's test numbers; the well-known metrics also fill their own fields.
  static void record_evaluation(const Evaluation& ev, TrainResult& r) {
    r.test_loss = ev.loss;
    r.test_metrics = ev.metrics;
    r.test_summary = ev.final_line;
    for (const auto& [name, value] : ev.metrics) {
      if (name == "accuracy") r.test_accuracy = value;
      if (name == "reconstruction") r.test_reconstruction = value;
      if (name == "kl") r.test_kl = value;
    }
  }

  // x = the sum of x over the tensor axis (a count of ranks that saw a
  // problem: every rank then decides alike).
  void any_over_tensor(double* x, size_t n) {
    if (tp_.size() > 1) tp_.comm->all_reduce(x, x, n, DType::f64, comm::ReduceOp::sum);
  }

  // What every rank throws after the step a stop request ended the run at.
  TrainingInterrupted interrupted(int64_t step, int64_t total) const {
    const int sig = shared_.stop != nullptr ? shared_.stop->signal() : 0;
    const std::string why = sig == SIGINT ? " (SIGINT)" : sig == SIGTERM ? " (SIGTERM)" : "";
    const std::string run = shared_.dir ? shared_.dir->path() : tc_.run_dir.empty() ? "the run directory" : tc_.run_dir;
    if (tc_.checkpoint_every > 0)
      return TrainingInterrupted(step, sig, "meshtrain train",
                                 fmt::format("stopped after step {} of {}{}: {} was not committed; its staging "
                                             "directory keeps the checkpoint of step {}",
                                             step, total, why, run, step),
                                 fmt::format("continue with --resume {}", run));
    return TrainingInterrupted(step, sig, "meshtrain train",
                               fmt::format("stopped after step {} of {}{}: {} was not committed and nothing was "
                                           "kept",
                                           step, total, why, run),
                               "set --checkpoint-every N to keep checkpoints that --resume continues from");
  }

  // Collective: stops the run when this rank's parameters (its shards under
  // fsdp) are not finite on any rank after `steps` steps. Before every
  // evaluation, so the last update is checked before anything is saved.
  void check_parameters(int64_t steps) {
    double bad = optim::values_finite(opt_params_) ? 0.0 : 1.0;
    dp_comm_->all_reduce(&bad, &bad, 1, DType::f64, comm::ReduceOp::sum);
    any_over_tensor(&bad, 1);
    if (pp_ != nullptr) pp_->all_reduce(&bad, &bad, 1, DType::f64, comm::ReduceOp::sum);
    if (bad > 0)
      throw diverged(steps - 1,
                     fmt::format("the parameters are not finite on {} of {} data-parallel ranks after step {}", bad,
                                 dp_comm_->size(), steps),
                     false);
  }

  // The final parameters (the result and model.safetensors), loss.svg and
  // the recipe's own files (the VAE's pictures), into the run directory's
  // staging area. Every rank calls it after the last evaluation
  // (check_parameters passed): gathering the parameters under fsdp and the
  // recipe's forwards are collective; rank 0 writes.
  void finish_run(const Series& train_curve, const Series& test_curve) {
    const nn::functional::DeterministicRowsScope plain(0);  // the recipe's samples are not training blocks
    parallel_->gather_full_parameters();
    internal::NamedTensors whole = whole_model();
    std::unique_ptr<RecipeModel> assembled;
    if (pipeline_ && main_) assembled = internal::assemble_model(recipe_, tc_.seed, tc_.model, whole);
    if (main_) {
      auto& params = shared_.result.final_parameters;
      for (const auto& [name, value] : whole) params.emplace_back(name, detached_f32(value));
      save_safetensors(shared_.dir->file("model.safetensors"), params,
                       {{"format", "meshtrain"}, {"model", tc_.model}, {"weights", "(in, out)"}});
      write_file_atomic(shared_.dir->file("loss.svg"),
                        line_chart_svg(metrics_.chart_title, "step", {train_curve, test_curve}));
      if (const std::string svg = moe_->picture(tc_.layers - tc_.moe.first_dense); !svg.empty()) {
        shared_.result.artifacts.push_back("expert_load.svg");
        write_file_atomic(shared_.dir->file("expert_load.svg"), svg);
      }
    }
    if (assembled)
      assembled->write_artifacts(&*shared_.dir);
    else if (!pipeline_)
      model_->write_artifacts(main_ ? &*shared_.dir : nullptr);
    parallel_->reshard();
  }

  // Collective, between gather_full_parameters() and reshard(): the whole
  // model's parameters on world rank 0, in model.safetensors' order
  // (tensor-parallel blocks gathered, the expert axis's experts merged, the
  // pipeline's stages collected); views of the live values.
  internal::NamedTensors whole_model() {
    internal::NamedTensors whole;
    std::vector<bool> expert;
    for (size_t k = 0; k < modules_.size(); ++k)
      for (nn::Parameter* p : modules_[k]->parameters())
        if (!tied_copy(k, p->name)) {
          whole.emplace_back(p->name, nn::gather_parameter(*p, tp_));
          expert.push_back(p->info.routed_expert());
        }
    // Expert parallelism: each expert rank 0 puts every expert of its stage in place.
    if (ep_.size() > 1) whole = internal::merge_expert_parameters(*ep_.comm, whole, expert);
    internal::insert_moe_biases(whole, moe_->layers());  // buffers: replicated, beside their routers
    // Pipeline: world rank 0 assembles the whole model from every stage's
    // parameters (its pipeline group's ranks send theirs).
    if (pipeline_ && dp_comm_->rank() == 0 && (tp_.size() == 1 || tp_.comm->rank() == 0))
      whole = pipeline_->collect_parameters(whole);
    return whole;
  }

  void set_training(bool training) {
    for (nn::Module* m : modules_) m->set_training(training);
  }

  // A parameter of this rank's k-th stage that a lower stage holds and
  // counts (RecipeStage::tied_parameters).
  bool tied_copy(size_t k, const std::string& name) const {
    return pp_ != nullptr && stage_index_[k] > 0 && std::find(tied_[k].begin(), tied_[k].end(), name) != tied_[k].end();
  }

  const TrainConfig& tc_;
  const ModelRecipe& recipe_;
  const DataSource& train_;
  const DataSource& test_;
  const MetricsDescription metrics_;
  Shared& shared_;
  MemoryTracker memory_;
  mesh::DeviceMesh mesh_;
  bool main_;
  comm::Communicator* batch_comm_ = nullptr;  // the batch's split: data x fsdp
  std::optional<internal::MoeReport> moe_;  // mixture-of-experts layers: their load per step
  comm::Communicator* dp_comm_ = nullptr;     // loss sums: data x fsdp x expert x context
  comm::Communicator* replica_comm_ = nullptr;  // the data-parallel strategy's: dp_comm_'s axes but expert
  nn::ExpertParallelGroup ep_;                 // the mesh's expert axis (none: one rank)
  nn::ContextParallelGroup cp_;               // the mesh's context axis (none: one rank)
  nn::TensorParallelGroup tp_;  // the mesh's tensor axis (none: one rank)
  std::string tensor_split_;    // rank 0: how the tensor axis splits the parameters (start-up dump)
  std::string stage_cut_;       // rank 0: which parameters each pipeline stage holds (start-up dump)
  std::vector<std::string> sequence_parallel_;  // parameters whose gradients are partial over the tensor axis
  comm::Communicator* pp_ = nullptr;  // the pipeline axis (none: one stage)
  std::unique_ptr<RecipeModel> model_;
  std::vector<nn::Module*> modules_;  // the model, or this rank's pipeline stages
  std::vector<int> stage_index_;                // pipeline: modules_' stage indices
  std::vector<std::vector<std::string>> tied_;  // pipeline: their tied parameters
  std::unique_ptr<internal::PipelineRun> pipeline_;  // pipeline: the stages' executor
  int64_t num_parameters_ = 0;
  std::unique_ptr<parallel::Parallelism> parallel_;   // data parallel or fully sharded; after model_
  std::unique_ptr<optim::DynamicLossScaler> scaler_;  // fp16 only
  std::unique_ptr<optim::Optimizer> opt_;
  std::vector<nn::Parameter*> opt_params_;  // what the optimizer updates (this rank's shards under fsdp)
  int64_t total_ = 0;           // steps this run takes
  int64_t schedule_steps_ = 0;  // the learning-rate schedule's length
  int64_t skipped_ = 0;         // optimizer steps skipped, any reason
  int64_t consecutive_skips_ = 0;
  std::deque<double> recent_losses_;  // the loss-spike guard's window
  int64_t updates_ = 0;  // optimizer updates applied (skipped steps excluded)
  comm::Communicator* world_;
  std::string checkpoints_;  // <staging>/checkpoints, on every rank
  std::string resumed_from_;  // a resumed run: the layout its checkpoint was saved on
  double load_seconds_ = 0;   // reading the checkpoint (a resumed run)
  std::unique_ptr<internal::CheckpointWriter> writer_;  // the checkpoints' saves
  bool stop_after_step_ = false;  // a stop request reached some rank during this step
  DType compute_dtype_ = DType::f32;  // what the layers' products run in
};

}  // namespace

TrainResult run_training(const TrainConfig& tc, const config::DistributedConfig& dc,
                         const comm::LaunchOptions& launch, const StopRequest* stop) {
  return run_training(resolve_training(tc, dc), dc, launch, stop);
}

TrainResult run_training(const ResolvedTraining& resolved, const config::DistributedConfig& dc,
                         const comm::LaunchOptions& launch, const StopRequest* stop) {
  const TrainConfig& tc = resolved.config;
  const int ranks_here = launch.engine == comm::Engine::threads ? launch.ranks : 1;
  set_blas_threads(tc.threads_per_rank > 0 ? tc.threads_per_rank : std::max(1, available_cores() / ranks_here));
  // The recipe and its data, once per process; the threads engine's ranks
  // share them read-only.
  const std::unique_ptr<ModelRecipe> recipe = make_model_recipe(tc);
  Shared shared;
  shared.stop = stop;
  shared.restart = dc.restart;
  comm::launch(launch, [&](comm::Communicator& world) {
    std::string checkpoints;
    if (!internal::prepare_run_directory(world, resolved, dc, recipe->artifacts(), shared.dir, checkpoints)) return;
    Run run(resolved, *recipe, world, shared, checkpoints);
    run.run();
  });
  // Every rank finished: the run directory now holds this run. On any error
  // above, shared.dir's destructor removes the staging directory instead.
  if (shared.dir) {
    shared.dir->commit();
    std::vector<std::string> files = recipe->artifacts();  // then the trainer's own pictures (expert_load.svg)
    files.insert(files.end(), shared.result.artifacts.begin(), shared.result.artifacts.end());
    shared.result.artifacts = std::move(files);
  }
  return shared.result;
}

}  // namespace meshtrain::train
