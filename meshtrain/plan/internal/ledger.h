// The running sum of the bytes a MemoryTracker charges, replayed without
// any tensor: the activation estimate (activation_memory.cc) walks nn's
// allocations through it. Not for use outside plan.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/plan/activation_memory.h"

namespace meshtrain::plan::internal {

// The running sum of the tracked bytes, with handles counted like Tensor
// storages: alloc gives one reference, ref adds one, unref drops one and
// frees at zero. Id -1 is an untracked tensor (ignored).
class Ledger {
 public:
  int alloc(const std::string& term, int64_t bytes) {
    const int id = static_cast<int>(items_.size());
    items_.push_back({term, bytes, 1, ++event_, kNever});
    now_ += bytes;
    if (!moments_.empty()) moments_.back().peak = std::max(moments_.back().peak, static_cast<double>(now_));
    if (now_ > peak_) {
      peak_ = now_;
      peak_at_ = phase_ + ": " + term;
      if (watch_) peak_event_ = event_;
    }
    return id;
  }
  int ref(int id) {
    if (id >= 0) ++items_[static_cast<size_t>(id)].refs;
    return id;
  }
  void unref(int& id) {
    if (id < 0) return;
    Item& it = items_[static_cast<size_t>(id)];
    if (--it.refs == 0) {
      now_ -= it.bytes;
      it.died = ++event_;
    }
    id = -1;
  }
  // dst = src: dst takes the reference src carries, then drops its old one.
  void assign(int& dst, int src) {
    int old = dst;
    dst = src;
    unref(old);
  }
  // internal::reuse_or_allocate: keep the slot's storage when the slot is its
  // only holder, else a new one (the old lives on in its other holders).
  void buffer(int& slot, const std::string& term, int64_t bytes) {
    if (slot >= 0 && items_[static_cast<size_t>(slot)].refs == 1) return;
    unref(slot);
    slot = alloc(term, bytes);
  }
  // What was live at `event` (every item born by then and not yet dead).
  std::vector<ActivationTerm> live_terms(int64_t event = kNever - 1) const {
    std::map<std::string, ActivationTerm> by;
    for (const Item& it : items_)
      if (it.born <= event && it.died > event) {
        ActivationTerm& t = by[it.term];
        t.name = it.term;
        ++t.count;
        t.bytes += static_cast<double>(it.bytes);
      }
    std::vector<ActivationTerm> out;
    for (auto& [name, t] : by) out.push_back(t);
    std::sort(out.begin(), out.end(), [](const ActivationTerm& a, const ActivationTerm& b) {
      return a.bytes != b.bytes ? a.bytes > b.bytes : a.name < b.name;
    });
    return out;
  }
  void set_phase(std::string p) { phase_ = std::move(p); }
  // The timeline (ActivationEstimate::timeline): start a new one here, a
  // moment at each hook, take it at the end.
  void begin_timeline() {
    moments_.clear();
    moments_.push_back({.at = static_cast<double>(now_), .peak = static_cast<double>(now_)});
  }
  void mark(ScopeEvent event, ScopePass pass, int64_t block) {
    const double at = static_cast<double>(now_);
    moments_.push_back({.event = event, .pass = pass, .block = block, .at = at, .peak = at});
  }
  std::vector<ActivationMoment> take_timeline() { return std::exchange(moments_, {}); }
  // Starts a new peak from the current level; watch: record its terms.
  void reset_peak(bool watch) {
    peak_ = now_;
    peak_at_.clear();
    watch_ = watch;
    peak_event_ = -1;
  }
  int64_t now() const { return now_; }
  int64_t peak() const { return peak_; }
  const std::string& peak_at() const { return peak_at_; }
  // What was live at the peak since reset_peak(true); empty when none rose.
  std::vector<ActivationTerm> peak_terms() const {
    return peak_event_ < 0 ? std::vector<ActivationTerm>{} : live_terms(peak_event_);
  }

 private:
  static constexpr int64_t kNever = INT64_MAX;
  // born, died: the events (allocations and frees, counted) that made and
  // freed it, so the peak's terms are found once, not at every new peak.
  struct Item {
    std::string term;
    int64_t bytes;
    int refs;
    int64_t born, died;
  };
  std::vector<Item> items_;
  int64_t now_ = 0, peak_ = 0, event_ = 0, peak_event_ = -1;
  bool watch_ = false;
  std::string phase_, peak_at_;
  std::vector<ActivationMoment> moments_;
};

}  // namespace meshtrain::plan::internal
