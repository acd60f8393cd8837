#include "meshtrain/core/memory.h"

#include <fmt/format.h>
#include <unistd.h>

#include "meshtrain/core/error.h"

namespace meshtrain {
namespace {

size_t slot(MemoryCategory c) { return static_cast<size_t>(c); }

// Raises `peak` to at least `value` (lock-free max); true if it did.
bool raise_to(std::atomic<uint64_t>& peak, uint64_t value) {
  uint64_t cur = peak.load(std::memory_order_relaxed);
  while (cur < value) {
    if (peak.compare_exchange_weak(cur, value, std::memory_order_relaxed)) return true;
  }
  return false;
}

}  // namespace

std::string_view memory_category_name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::parameters: return "parameters";
    case MemoryCategory::gradients: return "gradients";
    case MemoryCategory::optimizer: return "optimizer";
    case MemoryCategory::activations: return "activations";
    case MemoryCategory::working: return "working";
    case MemoryCategory::comm_buffers: return "comm_buffers";
    case MemoryCategory::other: return "other";
  }
  return "?";
}

uint64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : 0;
}

std::string format_bytes(uint64_t bytes) {
  if (bytes < 1024) return fmt::format("{} B", bytes);
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes) / 1024.0;
  size_t u = 0;
  while (v >= 1024.0 && u + 1 < std::size(kUnits)) {
    v /= 1024.0;
    ++u;
  }
  return fmt::format("{:.2f} {}", v, kUnits[u]);
}

void MemoryTracker::allocate(MemoryCategory category, uint64_t bytes) {
  const size_t i = slot(category);
  const uint64_t now = in_use_[i].fetch_add(bytes, std::memory_order_relaxed) + bytes;
  raise_to(peak_[i], now);
  const uint64_t total = total_in_use_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  if (raise_to(total_peak_, total))
    for (size_t c = 0; c < kNumMemoryCategories; ++c)
      at_total_peak_[c].store(in_use_[c].load(std::memory_order_relaxed), std::memory_order_relaxed);
}

uint64_t MemoryTracker::at_total_peak(MemoryCategory category) const {
  return at_total_peak_[slot(category)].load(std::memory_order_relaxed);
}

void MemoryTracker::release(MemoryCategory category, uint64_t bytes) {
  const size_t i = slot(category);
  uint64_t cur = in_use_[i].load(std::memory_order_relaxed);
  do {
    if (bytes > cur)
      throw InvalidArgument("MemoryTracker::release",
                            fmt::format("releasing {} bytes of {} but only {} are in use", bytes,
                                        memory_category_name(category), cur),
                            "release exactly what was allocated, once, to the same category");
  } while (!in_use_[i].compare_exchange_weak(cur, cur - bytes, std::memory_order_relaxed));
  total_in_use_.fetch_sub(bytes, std::memory_order_relaxed);
}

uint64_t MemoryTracker::in_use(MemoryCategory category) const {
  return in_use_[slot(category)].load(std::memory_order_relaxed);
}

uint64_t MemoryTracker::peak(MemoryCategory category) const {
  return peak_[slot(category)].load(std::memory_order_relaxed);
}

uint64_t MemoryTracker::total_in_use() const { return total_in_use_.load(std::memory_order_relaxed); }

uint64_t MemoryTracker::total_peak() const { return total_peak_.load(std::memory_order_relaxed); }

void MemoryTracker::reset_peak() {
  for (size_t i = 0; i < kNumMemoryCategories; ++i)
    peak_[i].store(in_use_[i].load(std::memory_order_relaxed), std::memory_order_relaxed);
  total_peak_.store(total_in_use_.load(std::memory_order_relaxed), std::memory_order_relaxed);
  for (size_t i = 0; i < kNumMemoryCategories; ++i)
    at_total_peak_[i].store(in_use_[i].load(std::memory_order_relaxed), std::memory_order_relaxed);
}

std::string MemoryTracker::to_string() const {
  std::string s = fmt::format("{:<14}{:>14}{:>14}\n", "category", "in use", "peak");
  for (MemoryCategory c : kAllMemoryCategories)
    s += fmt::format("{:<14}{:>14}{:>14}\n", memory_category_name(c), format_bytes(in_use(c)),
                     format_bytes(peak(c)));
  s += fmt::format("{:<14}{:>14}{:>14}\n", "total", format_bytes(total_in_use()),
                   format_bytes(total_peak()));
  return s;
}

}  // namespace meshtrain
