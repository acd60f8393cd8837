#include "meshtrain/comm/internal/fingerprint.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

namespace meshtrain::comm::internal {
namespace {

constexpr size_t kMaxReasonBytes = 2048;

struct NoticeHeader {
  uint64_t channel = 0;
  uint64_t seq = 0;
  uint32_t entries = 0;  // rows of the mismatch table that follow
  uint32_t pad = 0;
};

}  // namespace

std::string format_ranks(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += j == i ? fmt::format("{}", ranks[i])
                  : fmt::format("{}{}{}", ranks[i], j == i + 1 ? ", " : "-", ranks[j]);
    i = j + 1;
  }
  return (ranks.size() == 1 ? "rank " : "ranks ") + out;
}

Fingerprint fingerprint_to(const Op& op, int peer) {
  Fingerprint f = op.fingerprint();
  if (op.kind == CollectiveOp::all_to_all_v) f.count = op.send_counts[static_cast<size_t>(peer)];
  return f;
}

Fingerprint canonical(Fingerprint f) {
  if (f.op == CollectiveOp::all_to_all_v) f.count = 0;
  return f;
}

Fingerprint check_from(const Op& op, int self, int peer, const Fingerprint& theirs) {
  const Fingerprint mine = op.fingerprint(), same = canonical(theirs);
  if (op.kind == CollectiveOp::all_to_all_v && same == mine &&
      theirs.count != op.recv_counts[static_cast<size_t>(peer)])
    throw MismatchError(std::string(collective_op_name(op.kind)),
                        fmt::format("{}: rank {} sends {} elements to rank {}, which expects {}", mine.to_string(),
                                    peer, theirs.count, self, op.recv_counts[static_cast<size_t>(peer)]),
                        "rank r's send_counts[p] must equal rank p's recv_counts[r]: exchange the counts first "
                        "(all_to_all_counts)",
                        {self, peer});
  return same;
}

WireFingerprint WireFingerprint::from(const Fingerprint& f) {
  return {f.seq, f.count, f.root, static_cast<uint8_t>(f.op), static_cast<uint8_t>(f.dtype),
          static_cast<uint8_t>(f.reduce), 1};
}

Fingerprint WireFingerprint::to() const {
  return {seq, static_cast<CollectiveOp>(op), static_cast<DType>(dtype),
          static_cast<ReduceOp>(reduce), static_cast<size_t>(count), root};
}

MismatchError mismatch_error(const std::string& op, const FingerprintTable& table, int self) {
  std::vector<std::pair<Fingerprint, std::vector<int>>> groups;
  std::vector<int> differ, missing;
  const Fingerprint& mine = *table[static_cast<size_t>(self)];
  for (int r = 0; r < static_cast<int>(table.size()); ++r) {
    const auto& f = table[static_cast<size_t>(r)];
    if (!f) {
      missing.push_back(r);
      continue;
    }
    if (*f != mine) differ.push_back(r);
    auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& x) { return x.first == *f; });
    if (g == groups.end()) {
      groups.push_back({*f, {r}});
    } else {
      g->second.push_back(r);
    }
  }
  std::string detail;
  for (size_t i = 0; i < groups.size(); ++i) {
    detail += i == 0 ? "" : (i == 1 ? " but " : " and ");
    detail += fmt::format("{} called {}", format_ranks(groups[i].second), groups[i].first.to_string());
  }
  if (!missing.empty())
    detail += fmt::format("; ranks that did not arrive: [{}]", fmt::join(missing, ", "));
  return MismatchError(op, detail,
                       "every rank must issue the same collectives in the same order, with the "
                       "same dtype, count, reduce op and root",
                       differ);
}

std::string encode_notice(const Notice& notice) {
  const NoticeHeader h{notice.channel, notice.seq, static_cast<uint32_t>(notice.mismatch.size()), 0};
  std::string out(reinterpret_cast<const char*>(&h), sizeof h);
  for (const auto& f : notice.mismatch) {
    WireFingerprint w = f ? WireFingerprint::from(*f) : WireFingerprint{};
    w.present = f ? 1 : 0;
    out.append(reinterpret_cast<const char*>(&w), sizeof w);
  }
  out += notice.reason.substr(0, kMaxReasonBytes);
  return out;
}

Notice decode_notice(std::string_view bytes) {
  Notice n;
  NoticeHeader h;
  const size_t table_bytes = bytes.size() >= sizeof h
                                 ? (std::memcpy(&h, bytes.data(), sizeof h),
                                    size_t{h.entries} * sizeof(WireFingerprint))
                                 : 0;
  if (bytes.size() < sizeof h || bytes.size() < sizeof h + table_bytes) {
    n.reason = "(unreadable notice)";
    return n;
  }
  n.channel = h.channel;
  n.seq = h.seq;
  n.mismatch.resize(h.entries);
  for (size_t r = 0; r < h.entries; ++r) {
    WireFingerprint w;
    std::memcpy(&w, bytes.data() + sizeof h + r * sizeof w, sizeof w);
    if (w.present) n.mismatch[r] = w.to();
  }
  n.reason = std::string(bytes.substr(sizeof h + table_bytes));
  return n;
}

std::string reason_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

void report_rank_error(const std::exception& error, int world_rank) {
  std::fflush(stdout);
  std::fprintf(stderr, "meshtrain: error on rank %d: %s\n", world_rank, error.what());
  std::fflush(stderr);
  if (dynamic_cast<const AbortedError*>(&error)) std::this_thread::sleep_for(std::chrono::milliseconds(500));
}

}  // namespace meshtrain::comm::internal
