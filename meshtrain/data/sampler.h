// Distributed sampling: which samples form each global batch of an epoch,
// which contiguous slice of it each data-parallel rank takes, the typed
// Batch a DataSource assembles from those samples, and a background
// Prefetcher that assembles the next batch while a step runs.
//
//   ImageDataSource data(load_fashion_mnist());    // "images", "labels"
//   DistributedSampler sampler(/*dataset_size=*/data.size(), /*global_batch=*/256, /*seed=*/42,
//                              /*drop_last=*/true, mesh.axis_rank("data"), mesh.axis_size("data"));
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     Prefetcher batches([&](int64_t b) { return load_batch(data, sampler, epoch, b); },
//                        0, sampler.num_batches());
//     while (std::optional<Batch> batch = batches.next()) {
//       // (*batch)["images"] (B_local, 784) f32, (*batch)["labels"] (B_local) i64;
//       // divide the summed loss by batch->global_size.
//     }
//   }
//
// A batch is a list of named tensors with the local samples along dim 0, so
// a new kind of data is a new DataSource, not a change to the trainer (the
// token batches of text_data.h: "tokens" and "targets", (B_local, T) i64).
//
// Rules (N = dataset_size, G = global_batch, d = data_axis_size, r = rank):
// - Epoch order: perm_e, a permutation of 0..N-1 that depends only on
//   (seed, epoch): Fisher-Yates, for i = N-1 down to 1 swap perm[i] with
//   perm[j], j uniform in [0, i] drawn from philox4x32_10 (counter {i lo32,
//   i hi32, epoch, kSamplerStream + attempt}, key {seed lo32, seed hi32}),
//   the 64-bit value (w0 | w1 << 32) then (w2 | w3 << 32) mapped to [0, i] by
//   Lemire's multiply-shift with rejection (exactly uniform). Every rank
//   computes the same permutation; nothing is communicated.
// - Global batch b of epoch e = perm_e[b*G, min((b+1)*G, N)). Batches 0 ..
//   N/G - 1 are full. When G does not divide N the remaining N % G samples form
//   a last, partial batch: drop_last = true drops it (those samples are skipped
//   this epoch; different ones each epoch), drop_last = false keeps it.
// - Rank r's slice of a global batch of size S is the contiguous range
//   [r*(S/d) + min(r, S%d), (r+1)*(S/d) + min(r+1, S%d)): full batches split
//   exactly (G % d == 0 is required), a partial batch splits as evenly as
//   possible, the first S % d ranks getting one more sample; when S < d the
//   last d - S ranks get empty slices. The slices, in rank order, concatenate to
//   the global batch, so any d sees the same global batches as one device.
// - Losses are divided by the global batch size S (global_size in Batch), not
//   by the local slice size, so the all-reduced sum equals the 1-device mean.
//
// Thread-safety: a DistributedSampler is immutable apart from an internal,
// mutex-guarded cache of the last epoch's permutation; all methods may be
// called concurrently. A Prefetcher belongs to one consumer thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshtrain/core/memory.h"
#include "meshtrain/core/prefetch.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/data/idx.h"

namespace meshtrain::data {

// Philox counter word 3 of the sampler's stream (its "name"); attempt k of a
// draw adds k.
inline constexpr uint32_t kSamplerStream = 0x53504c52;  // "SPLR"

// A deterministic permutation of 0..n-1 for (seed, epoch), by the rule above.
// Needs n >= 0 and 0 <= epoch < 2^32.
std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int64_t epoch);

class DistributedSampler {
 public:
  // Needs dataset_size >= 1, global_batch >= 1, data_axis_size >= 1,
  // 0 <= rank_in_data_axis < data_axis_size, global_batch % data_axis_size == 0,
  // and (with drop_last) global_batch <= dataset_size. Throws InvalidArgument
  // otherwise, naming the values.
  DistributedSampler(int64_t dataset_size, int64_t global_batch, uint64_t seed, bool drop_last,
                     int rank_in_data_axis = 0, int data_axis_size = 1);

  // Batches per epoch: N / G, plus one when !drop_last and N % G != 0.
  int64_t num_batches() const { return num_batches_; }
  // Samples that appear in an epoch: num_batches() * G, or N when the last
  // partial batch is kept.
  int64_t samples_per_epoch() const;

  // The whole epoch order (the same on every rank). Needs 0 <= epoch < 2^32.
  std::vector<int64_t> permutation(int64_t epoch) const;
  // Dataset indices of global batch b of `epoch` (all ranks' samples).
  // Needs 0 <= b < num_batches().
  std::vector<int64_t> global_batch(int64_t epoch, int64_t b) const;
  // Dataset indices of this rank's slice of global batch b (may be empty for
  // the last partial batch).
  std::vector<int64_t> batch(int64_t epoch, int64_t b) const;

  // Real size of global batch b: G, or N % G for a kept partial last batch.
  int64_t global_batch_size(int64_t b) const;
  // Position of this rank's first sample within global batch b (the index of
  // batch(e, b)[0] in global_batch(e, b)); for dropout keys and the like.
  int64_t first_global_sample(int64_t b) const;
  // Size of this rank's slice of batch b.
  int64_t local_batch_size(int64_t b) const;

  int64_t dataset_size() const { return dataset_size_; }
  int64_t global_batch() const { return global_batch_; }
  uint64_t seed() const { return seed_; }
  bool drop_last() const { return drop_last_; }
  int rank() const { return rank_; }
  int data_axis_size() const { return data_axis_size_; }

 private:
  struct Cache;
  void check_batch(const char* op, int64_t b) const;
  std::shared_ptr<const std::vector<int64_t>> cached_permutation(int64_t epoch) const;

  int64_t dataset_size_;
  int64_t global_batch_;
  uint64_t seed_;
  bool drop_last_;
  int rank_;
  int data_axis_size_;
  int64_t num_batches_;
  std::shared_ptr<Cache> cache_;  // shared by copies (the contents are deterministic)
};

// Where a run is in its data: the next global batch it trains on, as
// (epoch, batch within the epoch). Under the rules above the batches are a
// pure function of the sampler's (N, G, seed, drop_last) and this position,
// so saving it and building the same sampler on resume (any data-parallel
// degree) gives exactly the batches that came next. Step s of a run that
// starts at epoch 0 trains on at_step(sampler, s).
struct DataPosition {
  int64_t epoch = 0;
  int64_t batch = 0;  // in [0, sampler.num_batches())

  // The position of optimizer step `step` (>= 0): epoch step / num_batches(),
  // batch step % num_batches().
  static DataPosition at_step(const DistributedSampler& sampler, int64_t step);
  // The inverse: epoch * num_batches() + batch. Throws InvalidArgument when
  // batch is outside [0, num_batches()) or epoch outside [0, 2^32).
  int64_t step(const DistributedSampler& sampler) const;
  // The position after this one (the next epoch after its last batch).
  DataPosition next(const DistributedSampler& sampler) const;
  friend bool operator==(const DataPosition&, const DataPosition&) = default;
};

// One rank's part of one global batch, ready for a step: named tensors,
// each with this rank's samples along dim 0.
struct Batch {
  int64_t epoch = 0;
  int64_t index = 0;                // b
  std::vector<int64_t> indices;     // dataset rows of this rank's slice
  int64_t global_size = 0;          // samples in the whole global batch
  int64_t first_global_sample = 0;  // position of row 0 in the global batch
  // In the order the DataSource adds them; names are unique.
  std::vector<std::pair<std::string, Tensor>> tensors;

  // The tensor named `name`; throws InvalidArgument naming it and the
  // tensors the batch holds.
  const Tensor& operator[](std::string_view name) const;
  bool has(std::string_view name) const;
  // Adds a tensor; throws InvalidArgument when the name is taken or dim 0
  // differs from the tensors already present.
  void add(std::string name, Tensor t);
  // Local samples: dim 0 of the tensors (the number of indices when the
  // batch holds no tensor).
  int64_t size() const;
  // Rows [lo, hi) of every tensor, as views (a micro-batch): indices are
  // sliced and first_global_sample advances by lo; needs 0 <= lo <= hi <=
  // size().
  Batch rows(int64_t lo, int64_t hi) const;
};

// Samples by dataset row, assembled into a Batch: what a model recipe
// (model_recipe.h) trains and evaluates on.
// Thread-safety: load() is called from a Prefetcher's thread while the
// training thread uses earlier batches; implementations must only read.
class DataSource {
 public:
  virtual ~DataSource() = default;
  virtual int64_t size() const = 0;
  // Where the samples come from, for messages (a file, "synthetic", ...).
  virtual std::string source() const = 0;
  // Adds the samples at dataset rows `rows` (each in [0, size())) to
  // batch.tensors, charged to `tracker` (may be null) under
  // MemoryCategory::activations.
  virtual void load(std::span<const int64_t> rows, Batch& batch, MemoryTracker* tracker) const = 0;
};

// An image-classification Dataset (idx.h) as a DataSource: "images"
// (B, features) f32 by normalize_pixel, "labels" (B) i64. Borrows `data`
// (it must outlive the source).
class ImageDataSource final : public DataSource {
 public:
  explicit ImageDataSource(const Dataset& data) : data_(&data) {}
  int64_t size() const override { return data_->size(); }
  std::string source() const override { return data_->source; }
  void load(std::span<const int64_t> rows, Batch& batch, MemoryTracker* tracker) const override;
  const Dataset& dataset() const { return *data_; }

 private:
  const Dataset* data_;
};

// Gathers this rank's slice of batch b of `epoch` from `data` (through
// DataSource::load). Throws InvalidArgument when the sampler's dataset_size
// differs from data.size().
Batch load_batch(const DataSource& data, const DistributedSampler& sampler, int64_t epoch, int64_t b,
                 MemoryTracker* tracker = nullptr);
// load_batch(data, sampler, at.epoch, at.batch, tracker).
Batch load_batch(const DataSource& data, const DistributedSampler& sampler, const DataPosition& at,
                 MemoryTracker* tracker = nullptr);
// load_batch(ImageDataSource(data), ...): u8 pixels -> f32 x / 255 as
// "images", u8 labels -> i64 as "labels".
Batch load_batch(const Dataset& data, const DistributedSampler& sampler, int64_t epoch, int64_t b,
                 MemoryTracker* tracker = nullptr);

// Runs load(i) for i = begin, begin + 1, ..., end - 1 on one background
// thread, one batch ahead of the consumer: while the caller works on batch i,
// batch i + 1 is being loaded; the thread then sleeps (no busy waiting) until
// next() takes it (core/prefetch.h's Prefetcher with a buffer of 1).
//
// - next() returns the batches in order, then std::nullopt. It blocks until
//   the next batch is ready.
// - If load throws, the batches before it are still delivered; then next()
//   rethrows that exception (on every later call too).
// - The destructor stops the thread and joins it; a load in progress is
//   finished first (load cannot be interrupted).
// `load` runs on the background thread: it must not race with what the
// consumer does between next() calls (load_batch only reads the Dataset and
// the sampler, which is safe).
class Prefetcher {
 public:
  using LoadFn = std::function<Batch(int64_t)>;

  // Needs begin <= end. Starts loading load(begin) at once.
  Prefetcher(LoadFn load, int64_t begin, int64_t end);

  std::optional<Batch> next() { return queue_.next(); }

 private:
  meshtrain::Prefetcher<Batch> queue_;
};

}  // namespace meshtrain::data
