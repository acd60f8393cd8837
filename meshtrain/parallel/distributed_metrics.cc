#include "meshtrain/parallel/distributed_metrics.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include <fmt/format.h>

#include "meshtrain/core/error.h"
#include "meshtrain/core/random.h"

namespace meshtrain::parallel {

namespace {

constexpr std::string_view kBuiltins[] = {"mean", "sum", "max", "min"};

bool is_builtin(std::string_view name) {
  return std::find(std::begin(kBuiltins), std::end(kBuiltins), name) != std::end(kBuiltins);
}

// Little helpers for the packed byte format (host byte order: every rank of a
// communicator runs the same build on the same kind of machine).
class Writer {
 public:
  template <typename T>
  void put(const T& v) {
    const auto* p = reinterpret_cast<const unsigned char*>(&v);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  void put_string(const std::string& s) {
    put(static_cast<uint32_t>(s.size()));
    bytes_.insert(bytes_.end(), s.begin(), s.end());
  }
  std::vector<unsigned char>& bytes() { return bytes_; }

 private:
  std::vector<unsigned char> bytes_;
};

class Reader {
 public:
  Reader(const unsigned char* p, size_t n) : p_(p), n_(n) {}
  bool done() const { return pos_ >= n_; }
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string get_string() {
    const auto len = get<uint32_t>();
    need(len);
    std::string s(reinterpret_cast<const char*>(p_ + pos_), len);
    pos_ += len;
    return s;
  }

 private:
  void need(size_t k) const {
    if (pos_ + k > n_)
      throw InvalidArgument("DistributedMetrics::reduce", "a rank's packed metrics are truncated",
                            "every rank must run the same meshtrain build");
  }
  const unsigned char* p_;
  size_t n_;
  size_t pos_ = 0;
};

// NaN-propagating max/min.
double nan_max(double a, double b) { return std::isnan(a) || std::isnan(b) ? std::nan("") : std::max(a, b); }
double nan_min(double a, double b) { return std::isnan(a) || std::isnan(b) ? std::nan("") : std::min(a, b); }

}  // namespace

std::string_view reduction_name(Reduction r) { return kBuiltins[static_cast<int>(r)]; }

DistributedMetrics::DistributedMetrics(comm::Communicator& comm) : comm_(&comm) {}

void DistributedMetrics::register_reduction(const std::string& name, ReduceFn fn) {
  const char* op = "DistributedMetrics::register_reduction";
  if (name.empty()) throw InvalidArgument(op, "empty reduction name", "name the reduction, e.g. \"median\"");
  if (is_builtin(name))
    throw InvalidArgument(op, fmt::format("'{}' is a built-in reduction", name), "choose another name");
  if (!fn) throw InvalidArgument(op, fmt::format("reduction '{}' has no function", name), "pass a callable");
  if (!custom_.emplace(name, std::move(fn)).second)
    throw InvalidArgument(op, fmt::format("reduction '{}' is already registered", name),
                          "register each name once");
}

void DistributedMetrics::add(const std::string& key, double value, Reduction reduction) {
  add(key, value, std::string(reduction_name(reduction)));
}

void DistributedMetrics::add(const std::string& key, double value, const std::string& reduction) {
  const char* op = "DistributedMetrics::add";
  if (key.empty()) throw InvalidArgument(op, "empty metric key", "name the metric, e.g. \"loss\"");
  if (!is_builtin(reduction) && !custom_.count(reduction)) {
    std::string known = "mean, sum, max, min";
    for (const auto& [name, fn] : custom_) known += ", " + name;
    throw InvalidArgument(op, fmt::format("unknown reduction '{}' for metric '{}'", reduction, key),
                          fmt::format("use one of: {}; or register_reduction(\"{}\", fn) first", known,
                                      reduction));
  }
  auto [it, fresh] = entries_.try_emplace(key);
  Entry& e = it->second;
  if (fresh) {
    e.reduction = reduction;
    e.max = -std::numeric_limits<double>::infinity();
    e.min = std::numeric_limits<double>::infinity();
  } else if (e.reduction != reduction) {
    throw InvalidArgument(op,
                          fmt::format("metric '{}' was added with reduction '{}', now '{}'", key, e.reduction,
                                      reduction),
                          "use one reduction per key");
  }
  ++e.count;
  e.sum += value;
  e.max = std::max(e.max, value);
  e.min = std::min(e.min, value);
  e.has_nan |= std::isnan(value);
  if (!is_builtin(reduction)) e.values.push_back(value);
}

std::map<std::string, double> DistributedMetrics::reduce() {
  const char* op = "DistributedMetrics::reduce";
  Writer w;
  for (const auto& [key, e] : entries_) {
    w.put_string(key);
    w.put_string(e.reduction);
    w.put(e.count);
    w.put(e.sum);
    w.put(e.has_nan ? std::nan("") : e.max);
    w.put(e.has_nan ? std::nan("") : e.min);
    w.put(static_cast<uint64_t>(e.values.size()));
    for (double v : e.values) w.put(v);
  }
  entries_.clear();

  // Two collectives for any number of keys: the lengths, then the bytes.
  const int n = comm_->size();
  std::vector<unsigned char>& mine = w.bytes();
  const int64_t len = static_cast<int64_t>(mine.size());
  std::vector<int64_t> lens(static_cast<size_t>(n));
  comm_->all_gather(&len, lens.data(), 1, DType::i64);
  const size_t width = static_cast<size_t>(*std::max_element(lens.begin(), lens.end()));
  mine.resize(width, 0);
  std::vector<unsigned char> all(width * static_cast<size_t>(n));
  comm_->all_gather(mine.data(), all.data(), width, DType::u8);

  struct Combined {
    std::string reduction;
    int first_rank = 0;
    int64_t count = 0;
    double sum = 0;
    double max = -std::numeric_limits<double>::infinity();
    double min = std::numeric_limits<double>::infinity();
    std::vector<double> values;
  };
  std::map<std::string, Combined> combined;
  for (int r = 0; r < n; ++r) {  // rank order: every rank combines identically
    Reader rd(all.data() + static_cast<size_t>(r) * width, static_cast<size_t>(lens[r]));
    while (!rd.done()) {
      const std::string key = rd.get_string();
      const std::string red = rd.get_string();
      const auto count = rd.get<int64_t>();
      const auto sum = rd.get<double>();
      const auto mx = rd.get<double>();
      const auto mn = rd.get<double>();
      const auto nv = rd.get<uint64_t>();
      auto [it, fresh] = combined.try_emplace(key);
      Combined& c = it->second;
      if (fresh) {
        c.reduction = red;
        c.first_rank = r;
      } else if (c.reduction != red) {
        throw InvalidArgument(op,
                              fmt::format("metric '{}' uses reduction '{}' on rank {} but '{}' on rank {}", key,
                                          c.reduction, c.first_rank, red, r),
                              "add each key with the same reduction on every rank");
      }
      c.count += count;
      c.sum += sum;
      c.max = nan_max(c.max, mx);
      c.min = nan_min(c.min, mn);
      for (uint64_t i = 0; i < nv; ++i) c.values.push_back(rd.get<double>());
    }
  }

  std::map<std::string, double> out;
  for (auto& [key, c] : combined) {
    double v;
    if (c.reduction == "mean") v = c.sum / static_cast<double>(c.count);
    else if (c.reduction == "sum") v = c.sum;
    else if (c.reduction == "max") v = c.max;
    else if (c.reduction == "min") v = c.min;
    else {
      const auto it = custom_.find(c.reduction);
      if (it == custom_.end())
        throw InvalidArgument(op,
                              fmt::format("metric '{}' uses reduction '{}' (from rank {}), which is not "
                                          "registered on rank {}",
                                          key, c.reduction, c.first_rank, comm_->rank()),
                              "register the same reductions on every rank");
      v = it->second(c.values);
    }
    out.emplace(key, v);
  }
  return out;
}

std::vector<double> DistributedMetrics::gather(const std::string& key, double value) {
  const int n = comm_->size();
  const uint64_t h = key_from_name(key);
  unsigned char mine[16];
  std::memcpy(mine, &h, 8);
  std::memcpy(mine + 8, &value, 8);
  std::vector<unsigned char> all(16 * static_cast<size_t>(n));
  comm_->all_gather(mine, all.data(), 16, DType::u8);
  std::vector<double> values(static_cast<size_t>(n));
  std::vector<int> differ;
  for (int r = 0; r < n; ++r) {
    uint64_t hr;
    std::memcpy(&hr, all.data() + 16 * r, 8);
    std::memcpy(&values[r], all.data() + 16 * r + 8, 8);
    uint64_t h0;
    std::memcpy(&h0, all.data(), 8);
    if (hr != h0) differ.push_back(r);
  }
  if (!differ.empty()) {
    std::string ranks;
    for (int r : differ) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    throw InvalidArgument("DistributedMetrics::gather",
                          fmt::format("rank(s) {} gathered a different key than rank 0 (this rank: '{}')", ranks,
                                      key),
                          "call gather with the same keys in the same order on every rank");
  }
  return values;
}

}  // namespace meshtrain::parallel
