#include "meshtrain/comm/store.h"

#include <fmt/format.h>

#include <charconv>

#include "meshtrain/core/error.h"

namespace meshtrain::comm {

Store::Store(std::chrono::milliseconds timeout) : timeout_(timeout) { check_timeout("Store", timeout); }

void Store::set_timeout(std::chrono::milliseconds timeout) {
  check_timeout("Store::set_timeout", timeout);
  timeout_ = timeout;
}

void Store::check_key(std::string_view op, std::string_view key) {
  if (key.empty()) throw InvalidArgument(std::string(op), "empty key", "name every key, e.g. \"rank0/addr\"");
  if (key.size() > kMaxStoreKeyBytes)
    throw InvalidArgument(std::string(op), fmt::format("key of {} bytes, more than {}", key.size(), kMaxStoreKeyBytes),
                          "keys are names; put data in the value");
}

void Store::check_value(std::string_view op, std::string_view key, std::string_view value) {
  if (value.size() > kMaxStoreValueBytes)
    throw InvalidArgument(std::string(op),
                          fmt::format("value of key {} is {} bytes, more than {}", internal::quote_keys({std::string(key)}),
                                      value.size(), kMaxStoreValueBytes),
                          "the store is for rendezvous; move bulk data through a communicator");
}

void Store::check_keys(std::string_view op, const std::vector<std::string>& keys) {
  if (keys.size() > kMaxStoreKeys)
    throw InvalidArgument(std::string(op), fmt::format("{} keys, more than {}", keys.size(), kMaxStoreKeys),
                          "wait for a counter (add) instead of one key per participant");
  for (const auto& k : keys) check_key(op, k);
}

void Store::check_timeout(std::string_view op, std::chrono::milliseconds timeout) {
  if (timeout < kMinStoreTimeout || timeout > kMaxStoreTimeout)
    throw InvalidArgument(std::string(op),
                          fmt::format("timeout {} ms is outside [{}, {}] ms", timeout.count(), kMinStoreTimeout.count(),
                                      kMaxStoreTimeout.count()),
                          "give every wait a deadline between 1 ms and 7 days");
}

// --- InProcessStore -----------------------------------------------------------

void InProcessStore::set(std::string_view key, std::string_view value) {
  check_key("InProcessStore::set", key);
  check_value("InProcessStore::set", key, value);
  {
    std::lock_guard l(mu_);
    data_.insert_or_assign(std::string(key), std::string(value));
  }
  cv_.notify_all();
}

std::string InProcessStore::get(std::string_view key, std::chrono::milliseconds timeout) {
  check_key("InProcessStore::get", key);
  check_timeout("InProcessStore::get", timeout);
  std::unique_lock l(mu_);
  wait_locked(l, "InProcessStore::get", {std::string(key)}, timeout);
  return data_.find(key)->second;
}

int64_t InProcessStore::add(std::string_view key, int64_t delta) {
  check_key("InProcessStore::add", key);
  int64_t v;
  {
    std::lock_guard l(mu_);
    auto it = data_.find(key);
    v = internal::add_to_counter("InProcessStore::add", key, it == data_.end() ? nullptr : &it->second, delta);
    data_.insert_or_assign(std::string(key), std::to_string(v));
  }
  cv_.notify_all();
  return v;
}

bool InProcessStore::check(const std::vector<std::string>& keys) {
  check_keys("InProcessStore::check", keys);
  std::lock_guard l(mu_);
  for (const auto& k : keys)
    if (!data_.contains(k)) return false;
  return true;
}

void InProcessStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  check_keys("InProcessStore::wait", keys);
  check_timeout("InProcessStore::wait", timeout);
  std::unique_lock l(mu_);
  wait_locked(l, "InProcessStore::wait", keys, timeout);
}

bool InProcessStore::delete_key(std::string_view key) {
  check_key("InProcessStore::delete_key", key);
  std::lock_guard l(mu_);
  auto it = data_.find(key);
  if (it == data_.end()) return false;
  data_.erase(it);
  return true;
}

void InProcessStore::wait_locked(std::unique_lock<std::mutex>& lock, std::string_view op,
                                 const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  const auto start = std::chrono::steady_clock::now();
  auto all_there = [&] {
    for (const auto& k : keys)
      if (!data_.contains(k)) return false;
    return true;
  };
  if (cv_.wait_until(lock, start + timeout, all_there)) return;
  std::vector<std::string> missing;
  for (const auto& k : keys)
    if (!data_.contains(k)) missing.push_back(k);
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  internal::throw_store_timeout(op, missing, waited, "an in-process store");
}

// --- shared helpers -------------------------------------------------------------

namespace internal {

std::string quote_keys(const std::vector<std::string>& keys) {
  constexpr size_t kShown = 5;
  auto quote = [](const std::string& k) {
    std::string s = "'";
    for (unsigned char c : k.substr(0, 200)) {
      if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') s += static_cast<char>(c);
      else s += fmt::format("\\x{:02x}", c);
    }
    if (k.size() > 200) s += "...";
    return s + "'";
  };
  std::string out;
  const size_t shown = std::min(keys.size(), kShown);
  for (size_t i = 0; i < shown; ++i) {
    if (i > 0) out += (i + 1 == shown && keys.size() == shown) ? " and " : ", ";
    out += quote(keys[i]);
  }
  if (keys.size() > shown) out += fmt::format(" and {} more", keys.size() - shown);
  return out;
}

void throw_store_timeout(std::string_view op, const std::vector<std::string>& missing,
                         std::chrono::milliseconds waited, std::string_view where) {
  const bool one = missing.size() == 1;
  throw TimeoutError(
      std::string(op),
      fmt::format("{} {} {} not set in {} after waiting {} ms", one ? "key" : "keys", quote_keys(missing),
                  one ? "was" : "were", where, waited.count()),
      fmt::format("{} set by another rank or process of the job (the one that publishes {}, e.g. rank 0 for "
                  "its address); check that it started, reached that point without an error, and uses the same "
                  "store (address and port) and key names, or give this wait a longer timeout",
                  one ? "this key is" : "these keys are", one ? "it" : "them"));
}

int64_t add_to_counter(std::string_view op, std::string_view key, const std::string* current, int64_t delta) {
  int64_t v = 0;
  if (current) {
    const char* first = current->data();
    const char* last = first + current->size();
    auto [ptr, ec] = std::from_chars(first, last, v);
    if (ec != std::errc() || ptr != last || current->empty())
      throw InvalidArgument(std::string(op),
                            fmt::format("key {} holds {} bytes that are not a decimal integer",
                                        quote_keys({std::string(key)}), current->size()),
                            "add() counts in keys that only add() writes; use another key for data");
  }
  int64_t sum;
  if (__builtin_add_overflow(v, delta, &sum))
    throw InvalidArgument(std::string(op),
                          fmt::format("{} + {} overflows the counter {}", v, delta, quote_keys({std::string(key)})),
                          "counters are int64");
  return sum;
}

}  // namespace internal
}  // namespace meshtrain::comm
