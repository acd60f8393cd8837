// Store: a rendezvous key-value store (c10d's Store), how processes of a job
// that share no communicator yet find each other: rank 0 publishes an
// address, the others wait for it; ranks count arrivals with add().
//
//   meshtrain::comm::InProcessStore store;                    // threads of one process
//   store.set("rank0/addr", "10.0.0.1:29600");
//   std::string addr = store.get("rank0/addr");                // blocks until set (deadline)
//   int64_t arrived = store.add("arrived", 1);                 // atomic counter: the new value
//   store.wait({"rank1/ready", "rank2/ready"}, std::chrono::seconds(10));
//
// Contracts shared by every implementation (InProcessStore here, TcpStore in
// tcp_store.h):
// - Keys are non-empty byte strings of at most kMaxStoreKeyBytes; values are
//   byte strings (std::string holds any bytes, NULs included) of at most
//   kMaxStoreValueBytes. set() overwrites.
// - add(key, delta) treats the value as a decimal int64 (a missing key is 0),
//   stores the sum back as decimal text and returns it: get() of a counter
//   reads e.g. "3". A value that is not such a number, or a sum that
//   overflows int64, is an InvalidArgument and leaves the value unchanged.
// - get() and wait() block until every key exists, at most until their
//   deadline: the store's timeout() unless the call passes its own. Past
//   it they throw TimeoutError naming the keys that never appeared and how
//   long the call waited, and saying what to check (the process that should
//   set them). The deadline lies in [kMinStoreTimeout, kMaxStoreTimeout].
// - check() and delete_key() never block on other processes (TcpStore: at
//   most timeout() for the server's answer).
// Thread-safety: InProcessStore may be shared by any number of threads;
// see tcp_store.h for TcpStore.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace meshtrain::comm {

inline constexpr size_t kMaxStoreKeyBytes = 4096;
inline constexpr size_t kMaxStoreValueBytes = size_t{64} << 20;
// At most this many keys in one wait() or check().
inline constexpr size_t kMaxStoreKeys = 65536;
inline constexpr std::chrono::milliseconds kDefaultStoreTimeout = std::chrono::minutes(5);
inline constexpr std::chrono::milliseconds kMinStoreTimeout{1};
inline constexpr std::chrono::milliseconds kMaxStoreTimeout = std::chrono::hours(24 * 7);

class Store {
 public:
  explicit Store(std::chrono::milliseconds timeout = kDefaultStoreTimeout);
  virtual ~Store() = default;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Deadline of get() and wait() without their own (and of each TcpStore
  // request). Throws InvalidArgument outside [kMinStoreTimeout, kMaxStoreTimeout].
  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds timeout);

  virtual void set(std::string_view key, std::string_view value) = 0;
  std::string get(std::string_view key) { return get(key, timeout_); }
  virtual std::string get(std::string_view key, std::chrono::milliseconds timeout) = 0;
  virtual int64_t add(std::string_view key, int64_t delta) = 0;
  // True when every key exists now.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  // Removes the key; returns whether it existed.
  virtual bool delete_key(std::string_view key) = 0;

 protected:
  // For implementations: throw InvalidArgument (op `op`) for a key, value,
  // key list or timeout outside the limits above.
  static void check_key(std::string_view op, std::string_view key);
  static void check_value(std::string_view op, std::string_view key, std::string_view value);
  static void check_keys(std::string_view op, const std::vector<std::string>& keys);
  static void check_timeout(std::string_view op, std::chrono::milliseconds timeout);

 private:
  std::chrono::milliseconds timeout_;
};

// Keys in one process, shared by threads: a map under a mutex, waits on a
// condition variable. For the threads engine and tests.
class InProcessStore final : public Store {
 public:
  explicit InProcessStore(std::chrono::milliseconds timeout = kDefaultStoreTimeout) : Store(timeout) {}

  using Store::get;
  using Store::wait;
  void set(std::string_view key, std::string_view value) override;
  std::string get(std::string_view key, std::chrono::milliseconds timeout) override;
  int64_t add(std::string_view key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool delete_key(std::string_view key) override;

 private:
  // Blocks until every key exists (mu_ held); throws TimeoutError otherwise.
  void wait_locked(std::unique_lock<std::mutex>& lock, std::string_view op, const std::vector<std::string>& keys,
                   std::chrono::milliseconds timeout);

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string, std::less<>> data_;
};

namespace internal {
// The TimeoutError every store throws when keys did not appear: names them
// (the first few, then a count), the time waited and `where` (the store),
// and says who should have set them.
[[noreturn]] void throw_store_timeout(std::string_view op, const std::vector<std::string>& missing,
                                      std::chrono::milliseconds waited, std::string_view where);
// add()'s arithmetic on a stored value: throws InvalidArgument (op `op`) when
// `current` is not a decimal int64 or the sum overflows.
int64_t add_to_counter(std::string_view op, std::string_view key, const std::string* current, int64_t delta);
// "'a', 'b' and 3 more": keys for messages, non-printable bytes escaped.
std::string quote_keys(const std::vector<std::string>& keys);
}  // namespace internal

}  // namespace meshtrain::comm
