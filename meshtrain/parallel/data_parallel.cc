#include "meshtrain/parallel/data_parallel.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "meshtrain/core/ops.h"
#include "meshtrain/core/random.h"
#include "meshtrain/core/reduction_tree.h"
#include "meshtrain/nn/deterministic.h"

namespace meshtrain::parallel {

namespace {

using Seconds = std::chrono::duration<double>;

// A fast 64-bit hash of a tensor's bytes (word-wise multiply-rotate with a
// splitmix finalizer). Only equality matters: replicas are compared bit-wise.
uint64_t hash_bytes(const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xff51afd7ed558ccdull);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h ^= w * 0x87c37b91114253d5ull;
    h = ((h << 31) | (h >> 33)) * 0x4cf5ad432745937full;
  }
  uint64_t tail = 0;
  if (n > i) std::memcpy(&tail, p + i, n - i);
  h ^= tail * 0x87c37b91114253d5ull;
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  h ^= h >> 31;
  return h;
}

// Length of the union of the [first, second] intervals (seconds), counting
// only the part at or after `from`.
double union_length(std::vector<std::pair<double, double>> iv, double from = -1e300) {
  for (auto& [a, b] : iv) {
    b = std::max(a, b);
    a = std::max(a, from);
    b = std::max(b, from);
  }
  std::sort(iv.begin(), iv.end());
  double total = 0, lo = 0, hi = 0;
  bool open = false;
  for (auto [a, b] : iv) {
    if (open && a <= hi) {
      hi = std::max(hi, b);
      continue;
    }
    if (open) total += hi - lo;
    lo = a;
    hi = b;
    open = true;
  }
  if (open) total += hi - lo;
  return total;
}

double hidden(double comm, double exposed) { return comm > 0 ? std::clamp(1.0 - exposed / comm, 0.0, 1.0) : 0.0; }

}  // namespace

struct DataParallel::Bucket {
  Tensor buffer;            // (numel) f32, the flat gradients of its slots
  Tensor received;          // the deterministic mode's all_to_all receive buffer (more than one rank)
  std::vector<int> params;  // parameter indices, in slot order
  int pending = 0;          // slots not yet ready in this backward (last micro-batch)
  bool launched = false;
  bool done = false;  // observed complete
  comm::Work work;    // declared after buffer: destroyed (drained) first
  comm::Clock::time_point started{}, seen_incomplete{}, completed{};
  bool completed_before_finish = false;
};

struct DataParallel::SlotState {
  int bucket = 0;
  int64_t offset = 0;  // elements into the bucket
  Tensor view;         // bucket.narrow(offset, numel) viewed as the parameter's shape
  bool ready = false;  // grad_ready came in this backward
  bool copied = false; // gradient copied into the bucket: copy the result back
};

// Exact completion times: owns the Works of the buckets in flight and waits
// on them, in issue order, on its own thread. The rank's thread only submits
// and reads results under mu_.
class DataParallel::Watcher {
 public:
  explicit Watcher(size_t num_buckets)
      : done_(num_buckets, 0), completed_(num_buckets), errors_(num_buckets) {
    thread_ = std::thread([this] { loop(); });
  }
  ~Watcher() {
    {
      std::lock_guard l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();  // after draining the queue: every Work is waited
  }

  void reset() {  // between steps: nothing in flight
    std::lock_guard l(mu_);
    std::fill(done_.begin(), done_.end(), 0);
    std::fill(errors_.begin(), errors_.end(), nullptr);
    submitted_ = finished_ = 0;
  }
  void submit(size_t bucket, comm::Work work) {
    {
      std::lock_guard l(mu_);
      queue_.emplace_back(bucket, std::move(work));
      ++submitted_;
    }
    cv_.notify_all();
  }
  bool done(size_t bucket) {
    std::lock_guard l(mu_);
    return done_[bucket] != 0;
  }
  // Blocks until every submitted Work finished; rethrows the first error.
  void wait_all() {
    std::unique_lock l(mu_);
    cv_.wait(l, [&] { return finished_ == submitted_; });
    for (const auto& e : errors_)
      if (e) std::rethrow_exception(e);
  }
  comm::Clock::time_point completed(size_t bucket) {
    std::lock_guard l(mu_);
    return completed_[bucket];
  }

 private:
  void loop() {
    std::unique_lock l(mu_);
    for (;;) {
      cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      auto [bucket, work] = std::move(queue_.front());
      queue_.pop_front();
      l.unlock();
      std::exception_ptr error;
      try {
        work.wait();
      } catch (...) {
        error = std::current_exception();
      }
      const auto t = comm::Clock::now();
      l.lock();
      done_[bucket] = 1;
      completed_[bucket] = t;
      errors_[bucket] = error;
      ++finished_;
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<size_t, comm::Work>> queue_;
  std::vector<char> done_;
  std::vector<comm::Clock::time_point> completed_;
  std::vector<std::exception_ptr> errors_;
  size_t submitted_ = 0, finished_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

ReplicaMismatchError::ReplicaMismatchError(std::string op, std::string detail, std::string hint,
                                           std::string parameter, std::vector<int> ranks)
    : Error(std::move(op), std::move(detail), std::move(hint)),
      parameter_(std::move(parameter)),
      ranks_(std::move(ranks)) {}

DataParallel::DataParallel(nn::Module& model, comm::Communicator& data_comm, DataParallelOptions options)
    : model_(&model), comm_(&data_comm), options_(options) {
  if (options_.bucket_bytes < 1)
    throw InvalidArgument("DataParallel", "bucket_bytes is 0", "use at least 1 (25 MiB is the default)");
  if (options_.deterministic && options_.reduce != GradReduce::sum)
    throw InvalidArgument("DataParallel", "deterministic with reduce avg",
                          "use GradReduce::sum (scale the loss by the global batch instead)");
  params_ = model.parameters();
  for (size_t i = 0; i < params_.size(); ++i) {
    nn::Parameter& p = *params_[i];
    if (!p.value.defined() || p.value.dtype() != DType::f32)
      throw InvalidArgument("DataParallel",
                            fmt::format("parameter '{}' is {}, not an f32 tensor", p.name,
                                        p.value.defined() ? std::string(dtype_name(p.value.dtype())) : "undefined"),
                            "keep f32 master weights in Parameter::value");
    if (p.grad.defined() && p.grad.shape() != p.value.shape())
      throw InvalidArgument("DataParallel",
                            fmt::format("parameter '{}': grad shape {} != value shape {}", p.name,
                                        shape_to_string(p.grad.shape()), shape_to_string(p.value.shape())),
                            "allocate grad with the value's shape");
    if (!index_of_.emplace(&p, static_cast<int>(i)).second)
      throw InvalidArgument("DataParallel", fmt::format("parameter '{}' is listed twice", p.name),
                            "a shared parameter must appear once in parameters()");
  }
  check_structure(params_);
  build_buckets(params_);
  broadcast_parameters();
  verify_replicas();
  // The buckets become the gradients (or receive copies of them).
  for (size_t i = 0; i < params_.size(); ++i) {
    nn::Parameter& p = *params_[i];
    SlotState& s = slots_[i];
    if (p.grad.defined())
      s.view.copy_from(p.grad);
    else
      s.view.fill(0.0);
    if (options_.gradient_as_bucket_view) p.grad = s.view;
    else if (!p.grad.defined()) p.grad = Tensor::zeros(p.value.shape(), DType::f32);
  }
  // Exact timing where a Work may be waited from another thread (see CommTiming).
  stats_.timing = options_.exact_timing && !options_.deterministic && data_comm.capabilities().wait_from_any_thread
                      ? CommTiming::exact
                      : CommTiming::polled;
  if (stats_.timing == CommTiming::exact) watcher_ = std::make_unique<Watcher>(buckets_.size());
  reset_backward();
  model.add_hook(this);
}

DataParallel::~DataParallel() {
  model_->remove_hook(this);
  watcher_.reset();                                  // waits for its Works, joins
  for (Bucket& b : buckets_) b.work = comm::Work();  // drains (errors were or will not be seen)
}

void DataParallel::check_structure(const std::vector<nn::Parameter*>& params) {
  std::string desc = fmt::format("bucket_bytes={};reduce={};", options_.bucket_bytes,
                                 options_.reduce == GradReduce::avg ? "avg" : "sum");
  for (const nn::Parameter* p : params) desc += p->name + shape_to_string(p->value.shape()) + ";";
  const int64_t mine[2] = {static_cast<int64_t>(params.size()), static_cast<int64_t>(key_from_name(desc))};
  const int n = comm_->size();
  std::vector<int64_t> all(2 * static_cast<size_t>(n));
  comm_->all_gather(mine, all.data(), 2, DType::i64);
  std::vector<int> differ;
  for (int r = 1; r < n; ++r)
    if (all[2 * r] != all[0] || all[2 * r + 1] != all[1]) differ.push_back(r);
  if (differ.empty()) return;
  const int r = differ.front();
  throw InvalidArgument(
      "DataParallel",
      fmt::format("rank(s) {} have different parameters or options than rank 0 (rank {}: {} parameters, "
                  "rank 0: {}; the names, shapes, bucket_bytes and reduce are compared)",
                  fmt::join(differ, ", "), r, all[2 * r], all[0]),
      "build the same model with the same DataParallelOptions on every rank of the data axis");
}

void DataParallel::build_buckets(const std::vector<nn::Parameter*>& params) {
  slots_.resize(params.size());
  std::vector<std::vector<int>> groups;
  size_t bytes = 0;
  for (int i = static_cast<int>(params.size()) - 1; i >= 0; --i) {
    const size_t pb = static_cast<size_t>(params[i]->value.numel()) * sizeof(float);
    if (groups.empty() || (bytes > 0 && bytes + pb > options_.bucket_bytes)) {
      groups.emplace_back();
      bytes = 0;
    }
    groups.back().push_back(i);
    bytes += pb;
  }
  buckets_.resize(groups.size());
  bucket_info_.resize(groups.size());
  for (size_t b = 0; b < groups.size(); ++b) {
    int64_t numel = 0;
    for (int i : groups[b]) {
      const nn::Parameter& p = *params[i];
      bucket_info_[b].slots.push_back({p.name, numel, p.value.numel()});
      slots_[i].bucket = static_cast<int>(b);
      slots_[i].offset = numel;
      numel += p.value.numel();
    }
    bucket_info_[b].numel = numel;
    buckets_[b].params = groups[b];
    // The deterministic mode's all_to_all sends the buffer in size() equal
    // chunks: padded (with zeros) to a multiple of them, and a receive buffer.
    const int64_t n = comm_->size();
    const int64_t padded = options_.deterministic ? (numel + n - 1) / n * n : numel;
    buckets_[b].buffer =
        Tensor::zeros({padded}, DType::f32, Device{}, options_.tracker, MemoryCategory::comm_buffers);
    if (options_.deterministic && n > 1)
      buckets_[b].received =
          Tensor::zeros({padded}, DType::f32, Device{}, options_.tracker, MemoryCategory::comm_buffers);
    for (int i : groups[b])
      slots_[i].view = buckets_[b].buffer.narrow(0, slots_[i].offset, params[i]->value.numel())
                           .view(params[i]->value.shape());
  }
}

void DataParallel::broadcast_parameters() {
  // Coalesced: each bucket's buffer carries its parameters' values once.
  const bool root = comm_->rank() == 0;
  for (Bucket& b : buckets_) {
    if (root)
      for (int i : b.params) slots_[i].view.copy_from(params_[i]->value);
    comm_->broadcast(b.buffer.data_ptr(), static_cast<size_t>(b.buffer.numel()), DType::f32, 0);
    if (!root)
      for (int i : b.params) params_[i]->value.copy_from(slots_[i].view);
  }
}

void DataParallel::verify_replicas() {
  const size_t np = params_.size();
  std::vector<int64_t> mine(np);
  for (size_t i = 0; i < np; ++i) {
    const Tensor v = params_[i]->value.contiguous();
    const uint64_t h = hash_bytes(v.data_ptr(), v.nbytes());
    std::memcpy(&mine[i], &h, sizeof h);
  }
  const int n = comm_->size();
  std::vector<int64_t> all(np * static_cast<size_t>(n));
  comm_->all_gather(mine.data(), all.data(), np, DType::i64);
  size_t first = np;
  int num_differ = 0;
  for (size_t i = 0; i < np; ++i) {
    bool differs = false;
    for (int r = 1; r < n; ++r) differs |= all[r * np + i] != all[i];
    if (differs && first == np) first = i;
    num_differ += differs;
  }
  if (first == np) return;
  std::vector<int> ranks;
  for (int r = 1; r < n; ++r)
    if (all[r * np + first] != all[first]) ranks.push_back(r);
  const std::string& name = params_[first]->name;
  throw ReplicaMismatchError(
      "DataParallel::verify_replicas",
      fmt::format("parameter '{}' differs bit-wise from rank 0's on rank(s) {} ({} of {} parameters differ)",
                  name, fmt::join(ranks, ", "), num_differ, np),
      "replicas must stay identical: update every rank with the same all-reduced gradients, and do not "
      "modify parameters on one rank only",
      name, ranks);
}

void DataParallel::reset_backward() {
  for (SlotState& s : slots_) s.ready = false;
  for (Bucket& b : buckets_) {
    b.pending = static_cast<int>(b.params.size());
    b.launched = b.done = b.completed_before_finish = false;
  }
  num_ready_ = 0;
  next_launch_ = next_poll_ = 0;
  if (watcher_) watcher_->reset();
}

void DataParallel::begin_micro_batch(int index, int count) {
  const char* op = "DataParallel::begin_micro_batch";
  if (count < 1 || index < 0 || index >= count)
    throw InvalidArgument(op, fmt::format("index {} of count {}", index, count), "need 0 <= index < count");
  if (next_launch_ > 0)
    throw InvalidArgument(op,
                          fmt::format("micro-batch {} of {} starts while the previous window's buckets are "
                                      "in flight",
                                      index, count),
                          "call finish() after the last micro-batch's backward");
  if (!window_open_) {
    if (index != 0)
      throw InvalidArgument(op, fmt::format("index {} of count {} but no window is open", index, count),
                            "start every window with index 0");
  } else {
    const int want = window_index_ + 1;
    if (index != want || count != window_count_)
      throw InvalidArgument(op,
                            fmt::format("got micro-batch {} of {}, expected {} of {}", index, count, want,
                                        window_count_),
                            "number micro-batches 0..count-1 with one count per window; end a window early "
                            "with finish()");
    if (num_ready_ != static_cast<int>(params_.size())) {
      const auto missing = missing_parameters();
      throw InvalidArgument(op,
                            fmt::format("micro-batch {}'s backward is incomplete: no grad_ready for '{}' "
                                        "({} missing)",
                                        window_index_, missing.front(), missing.size()),
                            "run the whole backward before the next micro-batch");
    }
  }
  reset_backward();
  window_index_ = index;
  window_count_ = count;
  window_open_ = true;
}

void DataParallel::grad_ready(nn::Parameter& p) {
  const auto it = index_of_.find(&p);
  if (it == index_of_.end())
    throw InvalidArgument("DataParallel::grad_ready",
                          fmt::format("parameter '{}' is not one of the {} parameters DataParallel was built "
                                      "with",
                                      p.name, params_.size()),
                          "build DataParallel after the model's parameters exist");
  SlotState& s = slots_[it->second];
  if (s.ready)
    throw InvalidArgument("DataParallel::grad_ready",
                          fmt::format("second grad_ready for '{}' in one backward", p.name),
                          "call finish() (or begin_micro_batch) between two backward passes");
  s.ready = true;
  ++num_ready_;
  window_open_ = true;
  poll();
  if (window_index_ != window_count_ - 1) return;  // accumulate locally: no_sync
  if (p.grad.data_ptr() != s.view.data_ptr() || p.grad.strides() != s.view.strides()) {
    s.view.copy_from(p.grad);  // copy mode, or a module replaced p.grad
    s.copied = true;
  }
  if (--buckets_[s.bucket].pending == 0) launch_ready_buckets();
}

void DataParallel::launch_ready_buckets() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) launch(buckets_[next_launch_++]);
}

void DataParallel::launch(Bucket& b) {
  const auto now = comm::Clock::now();
  if (&b == &buckets_.front()) step_start_ = now;
  b.started = b.seen_incomplete = now;
  b.launched = true;
  if (options_.deterministic) {  // the all_to_all now, the tree and the all_gather in finish()
    if (b.received.defined()) {
      const size_t chunk = static_cast<size_t>(b.buffer.numel() / comm_->size());
      b.work = comm_->all_to_all_async(b.buffer.data_ptr(), b.received.data_ptr(), chunk, DType::f32);
    }
    return;
  }
  const comm::ReduceOp op = options_.reduce == GradReduce::sum ? comm::ReduceOp::sum : comm::ReduceOp::avg;
  comm::Work work = comm_->all_reduce_async(b.buffer.data_ptr(), b.buffer.data_ptr(),
                                            static_cast<size_t>(b.buffer.numel()), DType::f32, op);
  if (watcher_)
    watcher_->submit(static_cast<size_t>(&b - buckets_.data()), std::move(work));
  else
    b.work = std::move(work);
}

void DataParallel::poll() {
  // Ops on one communicator complete in issue order: stop at the first one
  // still running. Testing also drives progress on engines without a
  // progress thread (mpi). The watcher needs no polling.
  if (watcher_) return;
  for (; next_poll_ < next_launch_; ++next_poll_) {
    Bucket& b = buckets_[next_poll_];
    const auto before = comm::Clock::now();
    if (!b.work.is_completed()) {
      b.seen_incomplete = before;
      return;
    }
    b.completed = comm::Clock::now();
    b.done = true;
  }
}

// The deterministic mode, after every bucket's all_to_all: each rank sums
// its chunk of every rank's bucket in the canonical tree over the ranks,
// then an all_gather gives every rank every chunk (comm::tree_all_reduce's
// steps, the first overlapped with backward).
void DataParallel::complete_tree_reductions() {
  const int n = comm_->size();
  for (Bucket& b : buckets_) {
    if (!b.received.defined()) continue;
    const int64_t chunk = b.buffer.numel() / n;
    std::vector<float*> parts;
    for (int r = 0; r < n; ++r) parts.push_back(b.received.data<float>() + r * chunk);
    tree_sum(parts, chunk);
    comm_->all_gather(b.received.data_ptr(), b.buffer.data_ptr(), static_cast<size_t>(chunk), DType::f32);
  }
}

std::vector<std::string> DataParallel::missing_parameters() const {
  std::vector<std::string> names;
  for (size_t i = 0; i < params_.size(); ++i)
    if (!slots_[i].ready) names.push_back(params_[i]->name);
  return names;
}

void DataParallel::finish() {
  if (!window_open_) return;  // no backward since the last finish()
  const auto missing = missing_parameters();
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 5; ++i) list += (i ? ", '" : "'") + missing[i] + "'";
    throw InvalidArgument("DataParallel::finish",
                          fmt::format("no grad_ready in this backward for {} of {} parameters: {}{}",
                                      missing.size(), params_.size(), list, missing.size() > 5 ? ", ..." : ""),
                          "every parameter must get a gradient each backward (the Module contract); run "
                          "backward before finish()");
  }
  const int m = window_index_ + 1;
  const bool flushed = window_index_ != window_count_ - 1;
  if (flushed) {
    // The window ends early: its gradients have not been put in the buckets.
    for (size_t i = 0; i < params_.size(); ++i) {
      SlotState& s = slots_[i];
      if (params_[i]->grad.data_ptr() != s.view.data_ptr() || params_[i]->grad.strides() != s.view.strides()) {
        s.view.copy_from(params_[i]->grad);
        s.copied = true;
      }
    }
    for (Bucket& b : buckets_) b.pending = 0;
    launch_ready_buckets();
  }

  const auto entered = comm::Clock::now();
  if (watcher_) {
    for (size_t i = 0; i < buckets_.size(); ++i) buckets_[i].completed_before_finish = watcher_->done(i);
    watcher_->wait_all();
    for (size_t i = 0; i < buckets_.size(); ++i) {
      buckets_[i].completed = buckets_[i].seen_incomplete = watcher_->completed(i);
      buckets_[i].done = true;
    }
  } else {
    poll();
    for (Bucket& b : buckets_) b.completed_before_finish = b.done;
    for (Bucket& b : buckets_) {
      if (b.done) {
        b.work.wait();  // complete: returns at once, or rethrows the engine's error
        continue;
      }
      b.work.wait();
      b.completed = b.seen_incomplete = comm::Clock::now();  // blocked on it until now
      b.done = true;
    }
  }
  if (options_.deterministic) complete_tree_reductions();
  const auto waited = comm::Clock::now() - entered;

  if (options_.reduce == GradReduce::avg && m > 1)
    for (Bucket& b : buckets_) scale(b.buffer, 1.0 / m);
  for (size_t i = 0; i < params_.size(); ++i) {
    SlotState& s = slots_[i];
    if (!s.copied) continue;
    params_[i]->grad.copy_from(s.view);
    s.copied = false;
  }
  if (options_.deterministic) {
    // A tied parameter's other users: each summed over the ranks on its own, then added.
    for (nn::Parameter* p : params_)
      for (const Tensor& other : nn::take_other_users(*p)) {
        comm::tree_all_reduce(*comm_, other.data<float>(), static_cast<size_t>(other.numel()));
        float* parts[] = {p->grad.data<float>(), other.data<float>()};
        tree_sum(parts, other.numel());
      }
  }

  DataParallelStats& st = stats_;
  st.buckets.assign(buckets_.size(), {});
  std::vector<std::pair<double, double>> hi, lo;
  int64_t bytes = 0;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const Bucket& b = buckets_[i];
    BucketTiming& t = st.buckets[i];
    t.started = Seconds(b.started - step_start_).count();
    t.seen_incomplete = Seconds(b.seen_incomplete - step_start_).count();
    t.completed = Seconds(b.completed - step_start_).count();
    t.completed_before_finish = b.completed_before_finish;
    hi.emplace_back(t.started, t.completed);
    lo.emplace_back(t.started, t.seen_incomplete);
    bytes += static_cast<int64_t>(b.buffer.nbytes());
  }
  const double from = Seconds(entered - step_start_).count();
  st.comm_time = Seconds(union_length(hi));
  st.comm_time_min = Seconds(union_length(lo));
  st.exposed_time = Seconds(union_length(hi, from));
  st.wait_time = waited;
  st.hidden_fraction = hidden(st.comm_time.count(), st.exposed_time.count());
  // Conservative: the least communication that surely ran before finish(),
  // against the most that may have run after it.
  const double hidden_min = st.comm_time_min.count() - union_length(lo, from);
  st.hidden_fraction_min = hidden(hidden_min + st.exposed_time.count(), st.exposed_time.count());
  st.bytes_reduced = bytes;
  st.micro_batches = m;
  st.flushed_early = flushed;
  st.total_comm_time += st.comm_time;
  st.total_exposed_time += st.exposed_time;
  ++st.steps;

  window_open_ = false;
  window_index_ = 0;
  window_count_ = 1;
  reset_backward();
}

Tensor shard_batch(const Tensor& global, int rank, int size) {
  if (!global.defined() || global.dim() < 1)
    throw InvalidArgument("shard_batch", "the batch tensor has no dims", "pass a (B, ...) tensor");
  if (size < 1 || rank < 0 || rank >= size)
    throw InvalidArgument("shard_batch", fmt::format("rank {} of size {}", rank, size),
                          "need size >= 1 and 0 <= rank < size");
  const int64_t b = global.size(0);
  if (b % size != 0)
    throw InvalidArgument("shard_batch",
                          fmt::format("global batch {} is not divisible by the data axis size {}", b, size),
                          fmt::format("use a global batch that is a multiple of {} (pad or drop the last "
                                      "batch)",
                                      size));
  const int64_t local = b / size;
  return global.narrow(0, rank * local, local);
}

Tensor shard_batch(const Tensor& global, const comm::Communicator& comm) {
  return shard_batch(global, comm.rank(), comm.size());
}

}  // namespace meshtrain::parallel
