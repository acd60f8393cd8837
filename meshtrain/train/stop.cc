// StopOnSignals (stop.h).
#include "meshtrain/train/stop.h"

namespace meshtrain::train {
namespace {

std::atomic<StopRequest*> g_stop{nullptr};  // the live StopOnSignals' request
std::atomic<bool> g_installed{false};

extern "C" void on_stop_signal(int sig) {
  StopRequest* stop = g_stop.load();
  if (stop == nullptr || stop->requested()) {  // the second one: die as the signal would have made us
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  stop->request(sig);
}

}  // namespace

StopOnSignals::StopOnSignals(StopRequest& stop, std::initializer_list<int> signals) : signals_(signals) {
  if (g_installed.exchange(true))
    throw InvalidArgument("StopOnSignals", "another StopOnSignals is alive in this process",
                          "stop one run at a time (destroy the first before making a second)");
  g_stop.store(&stop);
  previous_.resize(signals_.size());
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  for (size_t i = 0; i < signals_.size(); ++i) ::sigaction(signals_[i], &sa, &previous_[i]);
}

StopOnSignals::~StopOnSignals() {
  for (size_t i = 0; i < signals_.size(); ++i) ::sigaction(signals_[i], &previous_[i], nullptr);
  g_stop.store(nullptr);
  g_installed.store(false);
}

}  // namespace meshtrain::train
