// Per-rank memory accounting: bytes in use and peak bytes, per category and in
// total, so that the planner's predictions can be checked against what a run
// really allocated.
//
//   MemoryTracker tracker;                       // one per (simulated) rank
//   Tensor w = Tensor::empty({1024, 1024}, DType::f32, Device{}, &tracker,
//                            MemoryCategory::parameters);
//   tracker.in_use(MemoryCategory::parameters);  // 4 MiB
//   std::cout << tracker.to_string();
//
// There is no global tracker: whoever owns a rank's state owns its tracker and
// passes it explicitly; a tracker must outlive every Storage charged to it.
// total_peak() is the peak of the total, not the sum of per-category peaks
// (categories peak at different times).
//
// Thread-safety: every method may be called concurrently (atomics only).
// Peaks are exact: each allocation raises the peak to the value its own
// atomic increment produced. reset_peak() racing with allocations is safe but
// may miss an allocation made during the reset; call it at a quiet point.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace meshtrain {

// What a byte is for. parameters, gradients and optimizer are the persistent
// model state (the ZeRO formulas count these); working is the transient,
// unsharded copies of the parameters and gradients of the units in use
// (fully sharded data parallelism's gathered units, compute-dtype copies).
enum class MemoryCategory : uint8_t {
  parameters, gradients, optimizer, working, activations, comm_buffers, other
};

inline constexpr MemoryCategory kAllMemoryCategories[] = {
    MemoryCategory::parameters,  MemoryCategory::gradients,    MemoryCategory::optimizer,   MemoryCategory::working,
    MemoryCategory::activations, MemoryCategory::comm_buffers, MemoryCategory::other};
inline constexpr size_t kNumMemoryCategories = std::size(kAllMemoryCategories);

// "parameters", "gradients", ... as printed in reports.
std::string_view memory_category_name(MemoryCategory c);

// Human-readable byte count with binary units: 512 -> "512 B", 1536 -> "1.50 KiB".
std::string format_bytes(uint64_t bytes);

// This machine's physical memory in bytes (sysconf), 0 when unknown: what a
// command checks a size against before it allocates from it.
uint64_t physical_memory_bytes();

class MemoryTracker {
 public:
  MemoryTracker() = default;
  // Storages hold a pointer to their tracker, so it must not move.
  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;

  // Records `bytes` newly in use in `category`; raises peaks.
  void allocate(MemoryCategory category, uint64_t bytes);
  // Records `bytes` no longer in use. Throws InvalidArgument if more bytes are
  // released than are in use in that category (a double release or a release
  // to the wrong category); nothing is changed then.
  void release(MemoryCategory category, uint64_t bytes);

  uint64_t in_use(MemoryCategory category) const;
  uint64_t peak(MemoryCategory category) const;
  uint64_t total_in_use() const;
  uint64_t total_peak() const;
  // What `category` held when the total last reached its peak: the peak's
  // composition (the categories' own peaks come at different times). Under
  // allocations from several threads at once it may mix two moments.
  uint64_t at_total_peak(MemoryCategory category) const;

  // Sets every peak to the current in-use value (e.g. to measure one step).
  void reset_peak();

  // A table with one row per category and a total row: in use and peak.
  std::string to_string() const;

 private:
  std::array<std::atomic<uint64_t>, kNumMemoryCategories> in_use_{};
  std::array<std::atomic<uint64_t>, kNumMemoryCategories> peak_{};
  std::atomic<uint64_t> total_in_use_{0};
  std::atomic<uint64_t> total_peak_{0};
  std::array<std::atomic<uint64_t>, kNumMemoryCategories> at_total_peak_{};
};

}  // namespace meshtrain
