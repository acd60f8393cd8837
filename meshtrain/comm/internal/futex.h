// Sleep on a 32-bit atomic until it changes, with a deadline (Linux futex).
// std::atomic::wait has no timeout, and every wait in meshtrain needs one.
// Spurious wake-ups are allowed; callers re-check their condition.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <ctime>

namespace meshtrain::comm::internal {

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));

// Sleeps while `word` == `expected`, at most `max_sleep`.
inline void futex_wait(std::atomic<uint32_t>& word, uint32_t expected,
                       std::chrono::nanoseconds max_sleep) {
  if (max_sleep.count() <= 0) return;
  timespec ts{static_cast<time_t>(max_sleep.count() / 1'000'000'000),
              static_cast<long>(max_sleep.count() % 1'000'000'000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, &ts,
          nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace meshtrain::comm::internal
