// The per-shape choice of GEMM backend (core/matmul.h, "Which backend runs a
// product"; internal/gemm_choice.h): the policy, the process's table, the
// measurement and the cache file.
#include "meshtrain/core/internal/gemm_choice.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "meshtrain/core/atomic_file.h"
#include "meshtrain/core/cpu_isa.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/internal/onednn_gemm.h"

namespace meshtrain {
namespace {

constexpr const char* kPolicyVariable = "MESHTRAIN_GEMM_BACKEND";
constexpr const char* kCacheVariable = "MESHTRAIN_GEMM_CACHE";
constexpr const char* kCacheFormat = "meshtrain GEMM choices 1";

// What the environment says, read once (at the first product or dump).
struct Settings {
  GemmPolicy policy = GemmPolicy::automatic;
  bool from_variable = false;
  std::string cache_path;
};

const Settings& settings() {
  static const Settings s = [] {
    Settings r;
    if (const char* v = std::getenv(kPolicyVariable); v && *v) {
      r.policy = parse_gemm_policy(v, kPolicyVariable);
      r.from_variable = true;
    }
    if (const char* v = std::getenv(kCacheVariable)) r.cache_path = v;
    return r;
  }();
  return s;
}

// set_gemm_policy's value, -1 when never called.
std::atomic<int> g_policy_override{-1};

std::string cpu_brand() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned regs[12] = {};
  unsigned top = 0, b = 0, c = 0, d = 0;
  __get_cpuid(0x80000000u, &top, &b, &c, &d);
  if (top < 0x80000004u) return "unknown CPU";
  for (unsigned i = 0; i < 3; ++i)
    __get_cpuid(0x80000002u + i, &regs[4 * i], &regs[4 * i + 1], &regs[4 * i + 2], &regs[4 * i + 3]);
  std::string s(reinterpret_cast<const char*>(regs), sizeof(regs));
  s.erase(std::find(s.begin(), s.end(), '\0'), s.end());
  const auto first = s.find_first_not_of(' ');
  const auto last = s.find_last_not_of(' ');
  return first == std::string::npos ? "unknown CPU" : s.substr(first, last - first + 1);
#else
  return "unknown CPU";
#endif
}

// What a cached choice is valid for: the CPU, the level its kernels run at,
// and the two libraries' builds.
const std::string& machine_id() {
  static const std::string id =
      fmt::format("{} | {} | {} | {}", cpu_brand(), cpu_isa_name(cpu_isa()),
                  matmul_backend_description(MatmulBackend::onednn), matmul_backend_description(MatmulBackend::openblas));
  return id;
}

struct KeyHash {
  size_t operator()(const internal::GemmKey& k) const {
    uint64_t h = static_cast<uint64_t>(k.in) | static_cast<uint64_t>(k.out) << 8 | uint64_t{k.trans_a} << 16 |
                 uint64_t{k.trans_b} << 17 | static_cast<uint64_t>(k.threads) << 32;
    for (int64_t v : {k.m, k.n, k.k}) h = (h ^ static_cast<uint64_t>(v)) * 0x100000001b3ull;
    return static_cast<size_t>(h);
  }
};

internal::GemmKey key_of(const GemmChoice& c) {
  return {.in = c.in, .out = c.out, .m = c.m, .n = c.n, .k = c.k, .trans_a = c.trans_a, .trans_b = c.trans_b,
          .threads = c.threads};
}

std::string op_name(bool trans_a, bool trans_b) { return std::string(trans_a ? "T" : "N") + (trans_b ? "T" : "N"); }

nlohmann::ordered_json to_json(const GemmChoice& c) {
  return {{"in", dtype_name(c.in)},
          {"out", dtype_name(c.out)},
          {"m", c.m},
          {"n", c.n},
          {"k", c.k},
          {"op", op_name(c.trans_a, c.trans_b)},
          {"threads", c.threads},
          {"backend", matmul_backend_name(c.backend)},
          {"onednn_us", c.onednn_seconds * 1e6},
          {"openblas_us", c.openblas_seconds * 1e6}};
}

// InvalidArgument naming the cache file, for anything in it that is not a
// table this code wrote.
[[noreturn]] void bad_cache(const std::string& path, const std::string& what) {
  throw InvalidArgument(kCacheVariable, fmt::format("{} is not a GEMM cache: {}", path, what),
                        "delete the file (meshtrain measures again and writes a new one) or point " +
                            std::string(kCacheVariable) + " elsewhere");
}

GemmChoice from_json(const nlohmann::ordered_json& j, const std::string& path) {
  try {
    GemmChoice c;
    c.in = parse_dtype(j.at("in").get<std::string>());
    c.out = parse_dtype(j.at("out").get<std::string>());
    c.m = j.at("m").get<int64_t>();
    c.n = j.at("n").get<int64_t>();
    c.k = j.at("k").get<int64_t>();
    const std::string op = j.at("op").get<std::string>();
    if (op.size() != 2 || (op[0] != 'N' && op[0] != 'T') || (op[1] != 'N' && op[1] != 'T'))
      bad_cache(path, fmt::format("op '{}' (use NN, NT, TN or TT)", op));
    c.trans_a = op[0] == 'T';
    c.trans_b = op[1] == 'T';
    c.threads = j.at("threads").get<int>();
    const std::string b = j.at("backend").get<std::string>();
    if (b == "onednn") c.backend = MatmulBackend::onednn;
    else if (b == "openblas") c.backend = MatmulBackend::openblas;
    else bad_cache(path, fmt::format("backend '{}' (use onednn or openblas)", b));
    c.onednn_seconds = j.value("onednn_us", 0.0) / 1e6;
    c.openblas_seconds = j.value("openblas_us", 0.0) / 1e6;
    c.from_cache = true;
    if (c.m < 1 || c.n < 1 || c.k < 1 || c.threads < 1)
      bad_cache(path, fmt::format("a shape {}x{}x{} on {} threads", c.m, c.n, c.k, c.threads));
    return c;
  } catch (const nlohmann::ordered_json::exception& e) {
    bad_cache(path, e.what());
  } catch (const InvalidArgument& e) {
    if (e.op() == kCacheVariable) throw;
    bad_cache(path, e.what());
  }
}

// The file's JSON, or an empty document when it does not exist yet.
nlohmann::ordered_json read_cache_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return nlohmann::ordered_json::object();
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(text.str());
  } catch (const nlohmann::ordered_json::exception& e) {
    bad_cache(path, e.what());
  }
  if (!j.is_object() || j.value("format", std::string()) != kCacheFormat || !j.contains("machines") ||
      !j["machines"].is_array())
    bad_cache(path, fmt::format("no \"format\": \"{}\" with a \"machines\" list", kCacheFormat));
  return j;
}

// One entry of the table: being measured by one thread, or decided.
struct Entry {
  GemmChoice choice;
  bool decided = false;
  bool abandoned = false;  // its measurement threw; the key was removed
};

class Table {
 public:
  // The decided backend of `key`, measuring it (or waiting for the thread
  // that does) when it is new.
  // `key` is the product's own shape (measured and recorded); the table
  // is indexed by its class.
  MatmulBackend get(const internal::GemmKey& key, const internal::GemmTimer& time_on) {
    const internal::GemmKey cls = internal::gemm_class_key(key);
    std::unique_lock lock(mu_);
    load_cache_locked();
    for (auto it = index_.find(cls); it != index_.end(); it = index_.find(cls)) {
      const size_t slot = it->second;
      cv_.wait(lock, [&] { return entries_[slot].decided; });
      if (!entries_[slot].abandoned) return entries_[slot].choice.backend;
      // Its measurement failed: measure it here.
    }
    const size_t slot = entries_.size();
    entries_.push_back({.choice = {.in = key.in, .out = key.out, .m = key.m, .n = key.n, .k = key.k,
                                   .trans_a = key.trans_a, .trans_b = key.trans_b, .threads = key.threads}});
    index_.emplace(cls, slot);
    GemmChoice measured = entries_[slot].choice;
    lock.unlock();
    try {
      measure(measured, time_on);
    } catch (...) {
      lock.lock();
      index_.erase(cls);
      entries_[slot].decided = entries_[slot].abandoned = true;
      cv_.notify_all();
      throw;
    }
    lock.lock();
    entries_[slot].choice = measured;
    entries_[slot].decided = true;
    cv_.notify_all();
    if (!settings().cache_path.empty()) save_locked();
    return measured.backend;
  }

  std::vector<GemmChoice> choices() {
    std::lock_guard lock(mu_);
    std::vector<GemmChoice> out;
    for (const Entry& e : entries_)
      if (e.decided && !e.abandoned) out.push_back(e.choice);
    return out;
  }

  size_t read_from_cache() {
    std::lock_guard lock(mu_);
    load_cache_locked();
    return from_cache_;
  }

 private:
  // Times each candidate in interleaved rounds (the order alternating); a
  // run under 20 ms in the first round is a warm-up (primitive creation,
  // first touch) and not kept. Stops once each candidate has three kept runs
  // and 50 ms have passed, or after 10 rounds; the fastest kept run decides
  // (two runs each let a shared machine's noise pick a backend 13% slower).
  static void measure(GemmChoice& c, const internal::GemmTimer& time_on) {
    constexpr double kWarmupBelow = 0.020, kBudget = 0.050;
    constexpr int kMaxRounds = 10, kKeep = 3;
    const std::vector<MatmulBackend> candidates{MatmulBackend::onednn, MatmulBackend::openblas};
    std::vector<double> best(candidates.size(), 0.0);
    std::vector<int> kept(candidates.size(), 0);
    const auto t0 = std::chrono::steady_clock::now();
    for (int round = 0; round < kMaxRounds; ++round) {
      for (size_t j = 0; j < candidates.size(); ++j) {
        const size_t i = round % 2 == 0 ? j : candidates.size() - 1 - j;
        const double t = time_on(candidates[i]);
        if (round == 0 && t < kWarmupBelow) continue;
        best[i] = kept[i] == 0 ? t : std::min(best[i], t);
        ++kept[i];
      }
      const bool enough = *std::min_element(kept.begin(), kept.end()) >= kKeep;
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (enough && elapsed >= kBudget) break;
    }
    size_t pick = 0;
    for (size_t i = 0; i < candidates.size(); ++i) {
      if (candidates[i] == MatmulBackend::onednn) c.onednn_seconds = best[i];
      else c.openblas_seconds = best[i];
      if (best[i] < best[pick]) pick = i;
    }
    c.backend = candidates[pick];
  }

  void load_cache_locked() {
    if (loaded_) return;
    const std::string& path = settings().cache_path;
    const nlohmann::ordered_json j = path.empty() ? nlohmann::ordered_json::object() : read_cache_file(path);
    if (j.contains("machines"))
      for (const nlohmann::ordered_json& m : j["machines"]) {
        if (!m.is_object() || m.value("machine", std::string()) != machine_id() || !m.contains("choices")) continue;
        for (const nlohmann::ordered_json& e : m["choices"]) {
          const GemmChoice c = from_json(e, path);
          if (index_.emplace(internal::gemm_class_key(key_of(c)), entries_.size()).second) {
            entries_.push_back({.choice = c, .decided = true});
            ++from_cache_;
          }
        }
      }
    loaded_ = true;
  }

  // Merges this process's choices into the file (other machines' tables and
  // choices other processes wrote since are kept) and replaces it atomically.
  void save_locked() {
    const std::string& path = settings().cache_path;
    nlohmann::ordered_json j = read_cache_file(path);
    j["format"] = kCacheFormat;
    j["note"] = "GEMM backends measured per product shape by meshtrain (MESHTRAIN_GEMM_CACHE); delete to re-measure";
    if (!j.contains("machines")) j["machines"] = nlohmann::ordered_json::array();
    nlohmann::ordered_json* mine = nullptr;
    for (nlohmann::ordered_json& m : j["machines"])
      if (m.is_object() && m.value("machine", std::string()) == machine_id()) mine = &m;
    if (!mine) {
      j["machines"].push_back({{"machine", machine_id()}, {"choices", nlohmann::ordered_json::array()}});
      mine = &j["machines"].back();
    }
    std::unordered_map<internal::GemmKey, size_t, KeyHash> in_file;
    nlohmann::ordered_json& list = (*mine)["choices"];
    for (size_t i = 0; i < list.size(); ++i) in_file.emplace(key_of(from_json(list[i], path)), i);
    for (const Entry& e : entries_) {
      if (!e.decided || e.abandoned || e.choice.from_cache || in_file.count(key_of(e.choice))) continue;
      list.push_back(to_json(e.choice));
    }
    write_file_atomic(path, j.dump(1) + "\n");
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Entry> entries_;
  std::unordered_map<internal::GemmKey, size_t, KeyHash> index_;
  bool loaded_ = false;
  size_t from_cache_ = 0;
};

Table& table() {
  static Table* t = new Table;  // never destroyed: products may run while the process exits
  return *t;
}

// Decided keys of this thread, so a product seen before takes no lock.
thread_local std::unordered_map<internal::GemmKey, MatmulBackend, KeyHash> t_decided;

}  // namespace

std::string_view gemm_policy_name(GemmPolicy p) {
  switch (p) {
    case GemmPolicy::automatic: return "auto";
    case GemmPolicy::onednn: return "onednn";
    case GemmPolicy::openblas: return "openblas";
    case GemmPolicy::fixed: return "fixed";
  }
  return "?";
}

GemmPolicy parse_gemm_policy(std::string_view text, std::string_view source) {
  for (GemmPolicy p : {GemmPolicy::automatic, GemmPolicy::onednn, GemmPolicy::openblas, GemmPolicy::fixed})
    if (text == gemm_policy_name(p)) {
      if (p == GemmPolicy::onednn && !matmul_backend_available(MatmulBackend::onednn))
        throw InvalidArgument(std::string(source), "onednn: this build has no oneDNN",
                              "use auto or openblas, or install libdnnl-dev (scripts/install-deps.sh) and rebuild");
      return p;
    }
  throw InvalidArgument(std::string(source), fmt::format("'{}' is no GEMM backend policy", text),
                        "use auto (measure per shape), onednn, openblas or fixed");
}

GemmPolicy gemm_policy() {
  const int o = g_policy_override.load(std::memory_order_relaxed);
  return o >= 0 ? static_cast<GemmPolicy>(o) : settings().policy;
}

void set_gemm_policy(GemmPolicy p) {
  if (p == GemmPolicy::onednn && !matmul_backend_available(MatmulBackend::onednn))
    throw InvalidArgument("set_gemm_policy", "onednn: this build has no oneDNN", "use auto or openblas");
  g_policy_override.store(static_cast<int>(p), std::memory_order_relaxed);
}

std::string gemm_policy_summary() {
  const std::string libraries = fmt::format("[{}; {}]", matmul_backend_description(MatmulBackend::onednn),
                                            matmul_backend_description(MatmulBackend::openblas));
  if (!matmul_backend_available(MatmulBackend::onednn)) return "openblas (this build has no oneDNN) " + libraries;
  const GemmPolicy p = gemm_policy();
  const std::string source = g_policy_override.load(std::memory_order_relaxed) >= 0 ? " (set_gemm_policy)"
                             : settings().from_variable ? fmt::format(" ({})", kPolicyVariable)
                                                        : std::string();
  std::string what;
  switch (p) {
    case GemmPolicy::automatic: {
      const std::string& path = settings().cache_path;
      what = fmt::format("auto{}: oneDNN or OpenBLAS per shape, the faster measured{}", source,
                         path.empty() ? std::string()
                                      : fmt::format(" (cache {}, {} shapes read)", path, table().read_from_cache()));
      break;
    }
    case GemmPolicy::fixed: what = "fixed" + source + ": oneDNN, f32 weight gradients on OpenBLAS"; break;
    default: what = std::string(gemm_policy_name(p)) + source;
  }
  return what + " " + libraries;
}

std::vector<GemmChoice> gemm_choices() { return table().choices(); }

bool gemm_covers(const GemmChoice& c, DType in, int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b,
                 int threads) {
  const internal::GemmKey asked{.in = in, .out = c.out, .m = m, .n = n, .k = k, .trans_a = trans_a,
                                .trans_b = trans_b, .threads = threads};
  return internal::gemm_class_key(asked) == internal::gemm_class_key(key_of(c));
}

namespace internal {

int64_t gemm_size_class(int64_t d) {
  if (d <= 16) return d;
  int64_t octave = 16;  // d in (octave, 2 octave]
  while (2 * octave < d) octave *= 2;
  const int64_t step = octave / 4;
  return (d + step - 1) / step * step;
}

GemmKey gemm_class_key(const GemmKey& key) {
  GemmKey c = key;
  c.m = gemm_size_class(key.m);
  c.n = gemm_size_class(key.n);
  c.k = gemm_size_class(key.k);
  return c;
}

MatmulBackend fixed_rule_backend(const GemmKey& key, bool onednn_candidate) {
  const bool weight_gradient = key.in == DType::f32 && key.trans_a && !key.trans_b;
  return onednn_candidate && !weight_gradient ? MatmulBackend::onednn : MatmulBackend::openblas;
}

MatmulBackend gemm_backend_for(const GemmKey& key, bool onednn_candidate, const GemmTimer& time_on) {
  switch (gemm_policy()) {
    case GemmPolicy::onednn: return onednn_candidate ? MatmulBackend::onednn : MatmulBackend::openblas;
    case GemmPolicy::openblas: return MatmulBackend::openblas;
    case GemmPolicy::fixed: return fixed_rule_backend(key, onednn_candidate);
    case GemmPolicy::automatic: break;
  }
  if (!onednn_candidate) return MatmulBackend::openblas;
  const GemmKey cls = gemm_class_key(key);
  if (auto it = t_decided.find(cls); it != t_decided.end()) return it->second;
  const MatmulBackend b = table().get(key, time_on);
  t_decided.emplace(cls, b);
  return b;
}

}  // namespace internal
}  // namespace meshtrain
