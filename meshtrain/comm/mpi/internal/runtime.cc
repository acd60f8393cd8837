#include "meshtrain/comm/mpi/internal/runtime.h"

#include <sys/prctl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "meshtrain/comm/mpi/internal/channel.h"
#include "meshtrain/comm/mpi/internal/mpi_util.h"

namespace meshtrain::comm::mpi::internal {

namespace {

constexpr int kRequestTag = 1;     // on ctl_: "where are you on channel X?"
constexpr int kFirstAnswerTag = 2;  // answers use a tag per probe, from here up

struct WireRequest {
  uint64_t channel = 0;
  int32_t answer_tag = 0;
  int32_t unused = 0;
};
struct WireAnswer {
  uint64_t issued = 0, finished = 0;
  uint8_t known = 0, last_op = 0, waiting = 0, aborted = 0;
  uint32_t unused = 0;
};
static_assert(sizeof(WireRequest) == 16 && sizeof(WireAnswer) == 24);

// The process's runtime. MPI is process-global, so is this (see the header).
std::mutex g_mu;
std::unique_ptr<Runtime> g_runtime;
std::atomic<int64_t> g_failed_timeout_ms{-1};  // -1: no communicator failed

}  // namespace

Runtime& Runtime::start() {
  std::lock_guard lock(g_mu);
  if (!g_runtime) g_runtime.reset(new Runtime());
  return *g_runtime;
}

Runtime* Runtime::get() {
  std::lock_guard lock(g_mu);
  return g_runtime.get();
}

void Runtime::stop() {
  std::unique_ptr<Runtime> r;
  {
    std::lock_guard lock(g_mu);
    r = std::move(g_runtime);
  }
}

void Runtime::note_failure(std::chrono::milliseconds timeout) {
  // Generous: peers that recovered may still be finishing (draining their own
  // aborted communicators) when this process reaches MPI_Finalize.
  int64_t t = std::clamp<int64_t>(2 * timeout.count(), 30'000, 600'000), cur = g_failed_timeout_ms.load();
  while (cur < t && !g_failed_timeout_ms.compare_exchange_weak(cur, t)) {
  }
}

void Runtime::finalize_with_deadline() {
  stop();
  const int64_t ms = g_failed_timeout_ms.load();
  if (ms >= 0) {
    std::thread([ms] {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      std::fprintf(stderr,
                   "meshtrain: MPI_Finalize did not return within %lld ms after a communicator "
                   "failed (a peer is stopped or gone); exiting without it\n",
                   static_cast<long long>(ms));
      std::_Exit(1);
    }).detach();
  }
  MPI_Finalize();
}

Runtime::Runtime() {
  check(MPI_Comm_dup(MPI_COMM_WORLD, &ctl_), "MPI_Comm_dup", "create_world");
  MPI_Comm_set_errhandler(ctl_, MPI_ERRORS_RETURN);
  void* attr = nullptr;
  int flag = 0;
  if (MPI_Comm_get_attr(ctl_, MPI_TAG_UB, &attr, &flag) == MPI_SUCCESS && flag && attr)
    tag_ub_ = *static_cast<int*>(attr);
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  threaded_ = provided == MPI_THREAD_MULTIPLE;
}

void Runtime::stop_thread() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(wake_mu_);
    stop_ = true;
  }
  wake_cv_.notify_all();
  thread_.join();
  stop_ = false;
}

Runtime::~Runtime() {
  {
    std::lock_guard lock(thread_mu_);
    stop_thread();
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  // Answers and requests still in flight go to peers that stopped reading;
  // MPI completes (or drops) them on its own.
  for (Pending& p : sends_) MPI_Request_free(&p.request);
  MPI_Comm_free(&ctl_);
}

void Runtime::attach(Channel* c) {
  std::lock_guard lock(thread_mu_);
  {
    std::lock_guard poll(poll_mu_);
    channels_.push_back(c);
  }
  if (threaded_ && !thread_.joinable()) thread_ = std::thread([this] { loop(); });
}

void Runtime::detach(Channel* c) {
  std::lock_guard lock(thread_mu_);
  bool empty = false;
  {
    std::lock_guard poll(poll_mu_);
    std::erase(channels_, c);
    empty = channels_.empty();
  }
  // No communicator left: no MPI call from this thread may race a
  // MPI_Finalize the program makes next.
  if (empty) stop_thread();
}

void Runtime::wake() {
  {
    std::lock_guard lock(wake_mu_);
    woken_ = true;
  }
  wake_cv_.notify_one();
}

void Runtime::loop() {
  // Sleeps of tens of microseconds need a timer slack below the default 50 us.
  prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
  for (;;) {
    answer_requests();
    test_sends();
    bool busy = false;
    {
      std::lock_guard lock(poll_mu_);
      for (Channel* c : channels_) busy = c->poll() || busy;
    }
    std::unique_lock lock(wake_mu_);
    if (busy) {
      wake_cv_.wait_for(lock, kBusyPoll, [&] { return stop_; });
    } else {
      wake_cv_.wait_for(lock, kIdlePoll, [&] { return stop_ || woken_; });
    }
    woken_ = false;
    if (stop_) return;
  }
}

ChannelStatus Runtime::status_of(uint64_t id, bool& known) {
  std::lock_guard lock(poll_mu_);
  for (Channel* c : channels_)
    if (c->id() == id) {
      known = true;
      return c->status();
    }
  known = false;
  return {};
}

void Runtime::answer_requests() {
  for (;;) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kRequestTag, ctl_, &flag, &st) != MPI_SUCCESS || !flag) return;
    WireRequest req;
    if (MPI_Recv(&req, sizeof(req), MPI_BYTE, st.MPI_SOURCE, kRequestTag, ctl_, MPI_STATUS_IGNORE) !=
        MPI_SUCCESS)
      return;
    bool known = false;
    const ChannelStatus s = status_of(req.channel, known);
    auto answer = std::make_shared<WireAnswer>();
    answer->known = known ? 1 : 0;
    answer->issued = s.issued;
    answer->finished = s.finished;
    answer->last_op = s.last_op;
    answer->waiting = s.waiting ? 1 : 0;
    answer->aborted = s.aborted ? 1 : 0;
    MPI_Request r = MPI_REQUEST_NULL;
    if (MPI_Isend(answer.get(), sizeof(WireAnswer), MPI_BYTE, st.MPI_SOURCE, req.answer_tag, ctl_, &r) ==
        MPI_SUCCESS) {
      std::lock_guard lock(send_mu_);
      sends_.push_back({r, answer});
    }
  }
}

void Runtime::test_sends() {
  std::lock_guard lock(send_mu_);
  std::erase_if(sends_, [](Pending& p) {
    int flag = 0;
    if (MPI_Test(&p.request, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) return true;
    return flag != 0;
  });
}

std::vector<PeerStatus> Runtime::probe(uint64_t id, const std::vector<int>& world_ranks,
                                       std::chrono::milliseconds grace) {
  const size_t n = world_ranks.size();
  std::vector<PeerStatus> out(n);
  if (n == 0) return out;
  const int tag = kFirstAnswerTag +
                  static_cast<int>(probes_.fetch_add(1) % static_cast<uint32_t>(tag_ub_ - kFirstAnswerTag));
  auto request = std::make_shared<WireRequest>();
  request->channel = id;
  request->answer_tag = tag;
  std::vector<WireAnswer> answers(n);
  std::vector<MPI_Request> recvs(n, MPI_REQUEST_NULL);
  for (size_t i = 0; i < n; ++i) {
    MPI_Irecv(&answers[i], sizeof(WireAnswer), MPI_BYTE, world_ranks[i], tag, ctl_, &recvs[i]);
    MPI_Request r = MPI_REQUEST_NULL;
    if (MPI_Isend(request.get(), sizeof(WireRequest), MPI_BYTE, world_ranks[i], kRequestTag, ctl_, &r) ==
        MPI_SUCCESS) {
      std::lock_guard lock(send_mu_);
      sends_.push_back({r, request});
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + grace;
  for (;;) {
    // This process's own requests may be waiting for this thread to answer
    // (two ranks probing each other): answer them too if there is no thread.
    if (!threaded_) answer_requests();
    int done = 0;
    MPI_Testall(static_cast<int>(n), recvs.data(), &done, MPI_STATUSES_IGNORE);
    if (done || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  for (size_t i = 0; i < n; ++i) {
    if (recvs[i] != MPI_REQUEST_NULL) {
      int flag = 0;
      MPI_Test(&recvs[i], &flag, MPI_STATUS_IGNORE);
      if (!flag) {
        // No answer: cancel (a receive can be), then complete the request.
        MPI_Cancel(&recvs[i]);
        MPI_Status st;
        MPI_Wait(&recvs[i], &st);
        int cancelled = 0;
        MPI_Test_cancelled(&st, &cancelled);
        if (cancelled) continue;  // out[i] stays no_answer
      }
    }
    const WireAnswer& a = answers[i];
    PeerStatus& s = out[i];
    s.state = a.known ? PeerStatus::State::answered : PeerStatus::State::unknown_channel;
    s.issued = a.issued;
    s.finished = a.finished;
    s.last_op = a.last_op;
    s.waiting = a.waiting != 0;
    s.aborted = a.aborted != 0;
  }
  return out;
}

}  // namespace meshtrain::comm::mpi::internal
