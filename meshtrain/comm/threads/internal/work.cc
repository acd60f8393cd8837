#include "meshtrain/comm/threads/internal/work.h"

#include <fmt/format.h>

#include <algorithm>

#include "meshtrain/core/error.h"

namespace meshtrain::comm::threads::internal {

void P2PWork::wait() {
  for (;;) {
    if (e_->done.load(std::memory_order_acquire)) break;
    auto lost = g_->lost({peer_});
    const bool late = Clock::now() >= deadline_;
    if (late || lost) {
      std::lock_guard l(mb_->mu);
      if (e_->done.load(std::memory_order_acquire)) break;  // matched meanwhile
      auto& q = is_send_ ? mb_->sends : mb_->recvs;
      q.erase(std::find(q.begin(), q.end(), e_));
      const std::string what = fmt::format("{} {} {} (tag {}, {} x {})", is_send_ ? "send to" : "recv from",
                                           g_->name(peer_), "", e_->tag, dtype_name(e_->dtype), e_->count);
      if (lost)
        throw AbortedError("threads::" + std::string(is_send_ ? "send" : "recv"), what + ": " + lost->first,
                           "the peer stopped before posting the matching call", lost->second);
      throw TimeoutError("threads::" + std::string(is_send_ ? "send" : "recv"),
                         fmt::format("{}: {} did not post the matching {} within {} ms", what, g_->name(peer_),
                                     is_send_ ? "recv" : "send", timeout_.count()),
                         "check that the peer calls the matching send/recv with the same tag", {peer_});
    }
    auto rem = std::min<Clock::duration>(deadline_ - Clock::now(), kMaxSleep);
    comm::internal::futex_wait(e_->done, 0, rem);
  }
  if (!e_->error.empty())
    throw MismatchError(is_send_ ? "threads::send" : "threads::recv", e_->error,
                        "send and recv must agree on count and dtype", {peer_});
}

}  // namespace meshtrain::comm::threads::internal
