#include "meshtrain/data/sampler.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <utility>

#include "meshtrain/core/error.h"
#include "meshtrain/core/random.h"

namespace meshtrain::data {
namespace {

void check_epoch(const char* op, int64_t epoch) {
  if (epoch < 0 || epoch > int64_t{0xffffffff})
    throw InvalidArgument(op, fmt::format("epoch {} is outside [0, 2^32)", epoch), "epochs count from 0");
}

// j uniform in [0, bound) for Fisher-Yates step i (bound = i + 1): Lemire's
// multiply-shift with rejection over the 64-bit values of the documented
// Philox stream.
uint64_t draw_below(uint64_t bound, uint64_t i, uint32_t epoch, const PhiloxKey& key) {
  const uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
  for (uint32_t attempt = 0;; ++attempt) {
    const PhiloxCounter w = philox4x32_10(
        {static_cast<uint32_t>(i), static_cast<uint32_t>(i >> 32), epoch, kSamplerStream + attempt}, key);
    for (int half = 0; half < 2; ++half) {
      const uint64_t x = uint64_t{w[2 * half]} | (uint64_t{w[2 * half + 1]} << 32);
      const unsigned __int128 m = static_cast<unsigned __int128>(x) * bound;
      if (static_cast<uint64_t>(m) >= threshold) return static_cast<uint64_t>(m >> 64);
    }
  }
}

// Start of rank r's slice of a batch of `size` samples split over d ranks.
int64_t slice_start(int64_t size, int r, int d) {
  return r * (size / d) + std::min<int64_t>(r, size % d);
}

}  // namespace

std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int64_t epoch) {
  check_epoch("epoch_permutation", epoch);
  if (n < 0) throw InvalidArgument("epoch_permutation", fmt::format("n = {} < 0", n), "pass the dataset size");
  std::vector<int64_t> perm(static_cast<size_t>(n));
  std::iota(perm.begin(), perm.end(), int64_t{0});
  const PhiloxKey key{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  for (int64_t i = n - 1; i >= 1; --i) {
    const uint64_t j = draw_below(static_cast<uint64_t>(i) + 1, static_cast<uint64_t>(i),
                                  static_cast<uint32_t>(epoch), key);
    std::swap(perm[static_cast<size_t>(i)], perm[j]);
  }
  return perm;
}

struct DistributedSampler::Cache {
  std::mutex mu;
  int64_t epoch = -1;
  std::shared_ptr<const std::vector<int64_t>> perm;
};

DistributedSampler::DistributedSampler(int64_t dataset_size, int64_t global_batch, uint64_t seed, bool drop_last,
                                       int rank_in_data_axis, int data_axis_size)
    : dataset_size_(dataset_size),
      global_batch_(global_batch),
      seed_(seed),
      drop_last_(drop_last),
      rank_(rank_in_data_axis),
      data_axis_size_(data_axis_size),
      num_batches_(0),
      cache_(std::make_shared<Cache>()) {
  const char* op = "DistributedSampler";
  if (dataset_size < 1)
    throw InvalidArgument(op, fmt::format("dataset_size {} < 1", dataset_size), "the dataset is empty");
  if (global_batch < 1)
    throw InvalidArgument(op, fmt::format("global_batch {} < 1", global_batch), "use a positive batch size");
  if (data_axis_size < 1 || rank_in_data_axis < 0 || rank_in_data_axis >= data_axis_size)
    throw InvalidArgument(op,
                          fmt::format("rank {} is not in a data axis of size {}", rank_in_data_axis, data_axis_size),
                          "pass the rank's coordinate on the data axis and the axis size");
  if (global_batch % data_axis_size != 0) {
    const int64_t lower = global_batch / data_axis_size * data_axis_size;
    throw InvalidArgument(
        op,
        fmt::format("global batch {} is not divisible by the data-parallel size {}", global_batch, data_axis_size),
        lower > 0 ? fmt::format("use a multiple of {}, e.g. {} or {}", data_axis_size, lower, lower + data_axis_size)
                  : fmt::format("use a multiple of {}, e.g. {}", data_axis_size, data_axis_size));
  }
  if (drop_last && global_batch > dataset_size)
    throw InvalidArgument(op,
                          fmt::format("drop_last with global batch {} > dataset size {} leaves no batch", global_batch,
                                      dataset_size),
                          "use a smaller global batch or drop_last=false");
  num_batches_ = dataset_size / global_batch + (!drop_last && dataset_size % global_batch != 0 ? 1 : 0);
}

int64_t DistributedSampler::samples_per_epoch() const {
  return drop_last_ ? num_batches_ * global_batch_ : dataset_size_;
}

void DistributedSampler::check_batch(const char* op, int64_t b) const {
  if (b < 0 || b >= num_batches_)
    throw InvalidArgument(op, fmt::format("batch {} is outside [0, {})", b, num_batches_),
                          "num_batches() gives the batches per epoch");
}

std::vector<int64_t> DistributedSampler::permutation(int64_t epoch) const {
  return *cached_permutation(epoch);
}

std::shared_ptr<const std::vector<int64_t>> DistributedSampler::cached_permutation(int64_t epoch) const {
  check_epoch("DistributedSampler::permutation", epoch);
  std::lock_guard<std::mutex> lock(cache_->mu);
  if (cache_->epoch != epoch || !cache_->perm) {
    cache_->perm = std::make_shared<const std::vector<int64_t>>(epoch_permutation(dataset_size_, seed_, epoch));
    cache_->epoch = epoch;
  }
  return cache_->perm;
}

int64_t DistributedSampler::global_batch_size(int64_t b) const {
  check_batch("DistributedSampler::global_batch_size", b);
  return std::min(global_batch_, dataset_size_ - b * global_batch_);
}

int64_t DistributedSampler::first_global_sample(int64_t b) const {
  return slice_start(global_batch_size(b), rank_, data_axis_size_);
}

int64_t DistributedSampler::local_batch_size(int64_t b) const {
  const int64_t size = global_batch_size(b);
  return slice_start(size, rank_ + 1, data_axis_size_) - slice_start(size, rank_, data_axis_size_);
}

std::vector<int64_t> DistributedSampler::global_batch(int64_t epoch, int64_t b) const {
  const int64_t size = global_batch_size(b);
  const auto perm = cached_permutation(epoch);
  const auto first = perm->begin() + b * global_batch_;
  return std::vector<int64_t>(first, first + size);
}

std::vector<int64_t> DistributedSampler::batch(int64_t epoch, int64_t b) const {
  const int64_t size = global_batch_size(b);
  const int64_t lo = slice_start(size, rank_, data_axis_size_);
  const int64_t hi = slice_start(size, rank_ + 1, data_axis_size_);
  const auto perm = cached_permutation(epoch);
  const auto first = perm->begin() + b * global_batch_;
  return std::vector<int64_t>(first + lo, first + hi);
}

DataPosition DataPosition::at_step(const DistributedSampler& sampler, int64_t step) {
  if (step < 0)
    throw InvalidArgument("DataPosition::at_step", fmt::format("step {} < 0", step), "steps count from 0");
  const int64_t per_epoch = sampler.num_batches();
  DataPosition at{step / per_epoch, step % per_epoch};
  check_epoch("DataPosition::at_step", at.epoch);
  return at;
}

int64_t DataPosition::step(const DistributedSampler& sampler) const {
  check_epoch("DataPosition::step", epoch);
  if (batch < 0 || batch >= sampler.num_batches())
    throw InvalidArgument("DataPosition::step",
                          fmt::format("batch {} is outside [0, {}) (epoch {})", batch, sampler.num_batches(), epoch),
                          "restore a position saved with a sampler of the same dataset size and global batch");
  return epoch * sampler.num_batches() + batch;
}

DataPosition DataPosition::next(const DistributedSampler& sampler) const {
  return at_step(sampler, step(sampler) + 1);
}

const Tensor& Batch::operator[](std::string_view name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return t;
  std::string held;
  for (const auto& [n, t] : tensors) held += (held.empty() ? "" : ", ") + n;
  throw InvalidArgument("Batch", fmt::format("the batch has no tensor '{}' (it holds: {})", name,
                                             held.empty() ? std::string("none") : held),
                        "the model recipe and its DataSource must agree on the tensor names");
}

bool Batch::has(std::string_view name) const {
  return std::any_of(tensors.begin(), tensors.end(), [&](const auto& e) { return e.first == name; });
}

void Batch::add(std::string name, Tensor t) {
  if (has(name))
    throw InvalidArgument("Batch::add", fmt::format("the batch already holds a tensor '{}'", name),
                          "give every tensor of a batch its own name");
  if (!tensors.empty() && (t.dim() == 0 || t.size(0) != size()))
    throw InvalidArgument("Batch::add",
                          fmt::format("tensor '{}' has shape {}, but the batch holds {} samples along dim 0", name,
                                      shape_to_string(t.shape()), size()),
                          "put the samples along dim 0 of every tensor");
  tensors.emplace_back(std::move(name), std::move(t));
}

int64_t Batch::size() const {
  return tensors.empty() ? static_cast<int64_t>(indices.size()) : tensors.front().second.size(0);
}

Batch Batch::rows(int64_t lo, int64_t hi) const {
  if (lo < 0 || lo > hi || hi > size())
    throw InvalidArgument("Batch::rows", fmt::format("rows [{}, {}) of a batch of {}", lo, hi, size()),
                          "pick rows inside the batch");
  Batch out;
  out.epoch = epoch;
  out.index = index;
  if (static_cast<int64_t>(indices.size()) >= hi) out.indices.assign(indices.begin() + lo, indices.begin() + hi);
  out.global_size = global_size;
  out.first_global_sample = first_global_sample + lo;
  for (const auto& [n, t] : tensors) out.tensors.emplace_back(n, t.narrow(0, lo, hi - lo));
  return out;
}

void ImageDataSource::load(std::span<const int64_t> rows_wanted, Batch& batch, MemoryTracker* tracker) const {
  const int64_t rows = static_cast<int64_t>(rows_wanted.size());
  const int64_t features = data_->features();
  Tensor images = Tensor::empty({rows, features}, DType::f32, Device::cpu(), tracker, MemoryCategory::activations);
  Tensor labels = Tensor::empty({rows}, DType::i64, Device::cpu(), tracker, MemoryCategory::activations);
  const uint8_t* pixels = data_->images.data<uint8_t>();
  const uint8_t* stored = data_->labels.data<uint8_t>();
  float* x = images.data<float>();
  int64_t* y = labels.data<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = rows_wanted[static_cast<size_t>(r)];
    const uint8_t* src = pixels + row * features;
    float* dst = x + r * features;
    for (int64_t k = 0; k < features; ++k) dst[k] = normalize_pixel(src[k]);  // as evaluation (idx.h)
    y[r] = stored[row];
  }
  batch.add("images", std::move(images));
  batch.add("labels", std::move(labels));
}

Batch load_batch(const DataSource& data, const DistributedSampler& sampler, int64_t epoch, int64_t b,
                 MemoryTracker* tracker) {
  if (sampler.dataset_size() != data.size())
    throw InvalidArgument("load_batch",
                          fmt::format("the sampler covers {} samples but the dataset '{}' has {}",
                                      sampler.dataset_size(), data.source(), data.size()),
                          "build the sampler with dataset.size()");
  Batch out;
  out.epoch = epoch;
  out.index = b;
  out.indices = sampler.batch(epoch, b);
  out.global_size = sampler.global_batch_size(b);
  out.first_global_sample = sampler.first_global_sample(b);
  data.load(out.indices, out, tracker);
  return out;
}

Batch load_batch(const DataSource& data, const DistributedSampler& sampler, const DataPosition& at,
                 MemoryTracker* tracker) {
  return load_batch(data, sampler, at.epoch, at.batch, tracker);
}

Batch load_batch(const Dataset& data, const DistributedSampler& sampler, int64_t epoch, int64_t b,
                 MemoryTracker* tracker) {
  return load_batch(ImageDataSource(data), sampler, epoch, b, tracker);
}

namespace {

meshtrain::Prefetcher<Batch>::Source batches(Prefetcher::LoadFn load, int64_t begin, int64_t end) {
  if (begin > end)
    throw InvalidArgument("Prefetcher", fmt::format("begin {} > end {}", begin, end), "pass a range [begin, end)");
  if (!load) throw InvalidArgument("Prefetcher", "the load function is empty", "pass a callable");
  return [load = std::move(load), i = begin, end]() mutable -> std::optional<Batch> {
    if (i == end) return std::nullopt;
    return load(i++);
  };
}

}  // namespace

Prefetcher::Prefetcher(LoadFn load, int64_t begin, int64_t end)
    : queue_(batches(std::move(load), begin, end), {.buffer_size = 1}) {}

}  // namespace meshtrain::data
