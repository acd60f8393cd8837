// DistributedMetrics: scalar metrics combined over any communicator (a mesh
// axis, a group of axes or the world), with the same result on every rank.
//
//   DistributedMetrics metrics(mesh.comm("data"));
//   metrics.register_reduction("range", [](const std::vector<double>& v) {
//     return *std::max_element(v.begin(), v.end()) - *std::min_element(v.begin(), v.end());
//   });
//   metrics.add("loss", loss);                         // mean (the default)
//   metrics.add("tokens", n, Reduction::sum);
//   metrics.add("step_time", t, "range");              // a registered reduction
//   std::map<std::string, double> m = metrics.reduce(); // collective; clears
//   if (mesh.rank() == 0) log(m);
//   std::vector<double> per_rank = metrics.gather("mem_peak", peak);  // collective
//
// Semantics: every add() since the last reduce() contributes one value. For a
// key, reduce() combines the values of every rank that added it (a key added
// on only some ranks is combined over those):
//   mean  sum of values / number of values   sum  sum of values
//   max / min  over all values (NaN if any value is NaN)
//   custom     fn(values in rank order, then add order on each rank)
// A key must use one reduction on every rank; a different one anywhere is an
// InvalidArgument raised by reduce() on every rank. An unknown reduction name
// is an InvalidArgument from add() that names it (never silently skipped).
//
// Communication: reduce() packs every key into one byte buffer and costs two
// all_gathers (lengths, then the padded buffers) whatever the number of keys;
// gather() costs one. Both are collectives: every rank of the communicator
// calls them in the same order, even with nothing added.
// Determinism: results are computed from the same gathered bytes in the same
// order on every rank, so they are bit-identical across ranks.
// Thread-safety: belongs to one rank's thread, like its communicator.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/comm/communicator.h"

namespace meshtrain::parallel {

enum class Reduction : uint8_t { mean, sum, max, min };
// "mean", "sum", "max", "min".
std::string_view reduction_name(Reduction r);

class DistributedMetrics {
 public:
  using ReduceFn = std::function<double(const std::vector<double>&)>;

  // `comm` is borrowed and must outlive this object.
  explicit DistributedMetrics(comm::Communicator& comm);

  // Registers a custom reduction for add(key, value, name). Throws
  // InvalidArgument when name is empty, a built-in name or already
  // registered, or fn is empty. Register the same names on every rank.
  void register_reduction(const std::string& name, ReduceFn fn);

  // Records one value of `key` (any non-empty string). Throws InvalidArgument
  // when the key already has another reduction since the last reduce(), or
  // (string form) when `reduction` is neither built in nor registered.
  void add(const std::string& key, double value, Reduction reduction = Reduction::mean);
  void add(const std::string& key, double value, const std::string& reduction);

  // Collective. Every key added on any rank -> its combined value, identical
  // on every rank. Clears the recorded values (also when it throws).
  std::map<std::string, double> reduce();

  // Collective, immediate: every rank's `value`, in rank order. Every rank
  // must pass the same key (checked: InvalidArgument naming the ranks whose
  // key differs from rank 0's).
  std::vector<double> gather(const std::string& key, double value);

  // Drops every recorded value without communicating.
  void clear() { entries_.clear(); }
  bool empty() const { return entries_.empty(); }
  comm::Communicator& comm() const { return *comm_; }

 private:
  struct Entry {
    std::string reduction;
    int64_t count = 0;
    double sum = 0, max = 0, min = 0;
    bool has_nan = false;
    std::vector<double> values;  // custom reductions only
  };

  comm::Communicator* comm_;  // borrowed
  std::map<std::string, ReduceFn> custom_;
  std::map<std::string, Entry> entries_;
};

}  // namespace meshtrain::parallel
