#include "bench/checkpoint_bench.h"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/error.h"
#include "meshtrain/nn/gpt.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/parallel/fully_sharded.h"
#include "meshtrain/train/internal/checkpointing.h"

namespace meshtrain::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Drops the page cache (root only); false when it cannot.
bool drop_page_cache() {
  ::sync();
  std::ofstream f("/proc/sys/vm/drop_caches");
  if (!f) return false;
  f << "3\n";
  return static_cast<bool>(f.flush());
}

// `bytes` written to `path` in 8 MiB writes, then fsync.
void write_stream(const std::string& path, uint64_t bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw IoError("bench checkpoint", fmt::format("create '{}'", path), "check --dir");
  std::vector<char> buf(8 << 20, 1);
  for (uint64_t done = 0; done < bytes;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), bytes - done));
    const ssize_t w = ::write(fd, buf.data(), n);
    if (w <= 0) {
      ::close(fd);
      throw IoError("bench checkpoint", fmt::format("write '{}'", path), "check free space in --dir");
    }
    done += static_cast<uint64_t>(w);
  }
  ::fsync(fd);
  ::close(fd);
}

uint64_t read_stream(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError("bench checkpoint", fmt::format("open '{}'", path), "");
  std::vector<char> buf(8 << 20);
  uint64_t total = 0;
  for (ssize_t r; (r = ::read(fd, buf.data(), buf.size())) > 0;) total += static_cast<uint64_t>(r);
  ::close(fd);
  return total;
}

}  // namespace

CheckpointBenchResult run_checkpoint_bench(const CheckpointBenchOptions& o) {
  if (o.ranks < 1 || o.reps < 1)
    throw InvalidArgument("bench checkpoint", "ranks and reps must be >= 1", "pass positive counts");
  CheckpointBenchResult r;
  const std::string root = (fs::path(o.dir) / "checkpoints").string();
  fs::remove_all(o.dir);
  fs::create_directories(o.dir);
  std::mutex mu;
  comm::launch({.engine = comm::Engine::threads, .ranks = o.ranks, .timeout = std::chrono::seconds(600)},
               [&](comm::Communicator& world) {
                 nn::GPTConfig cfg{.vocab = o.vocab, .block_size = o.context, .layers = o.layers, .heads = o.heads,
                                   .width = o.width, .seed = 1, .defer_init = true};
                 nn::GPT gpt(cfg);
                 parallel::FullyShardedDataParallel fsdp(
                     gpt, world, nullptr, {.stage = parallel::ZeroStage::zero3, .unit_modules = gpt.fsdp_units()});
                 optim::AdamW opt(fsdp.optimizer_parameters(), 1e-3);
                 train::internal::TrainingCheckpoint ckpt(fsdp.optimizer_parameters(), opt);
                 int64_t params = fsdp.sharded_elements() + fsdp.replicated_elements();
                 std::vector<double> saves, loads;
                 checkpoint::CheckpointSaveStats stats;
                 for (int rep = 0; rep < o.reps; ++rep) {
                   world.barrier();
                   auto t0 = Clock::now();
                   stats = ckpt.save(world, root,
                                     {.step = rep, .scaler = std::nullopt, .model = "gpt", .saved_from = "bench", .dir = ""}, 1);
                   world.barrier();
                   saves.push_back(seconds_since(t0));
                   if (world.rank() == 0 && o.drop_caches) (void)drop_page_cache();
                   world.barrier();
                   t0 = Clock::now();
                   (void)ckpt.resume(root, "gpt");
                   world.barrier();
                   loads.push_back(seconds_since(t0));
                 }
                 if (world.rank() != 0) return;
                 std::lock_guard lock(mu);
                 r.parameters = params;
                 r.bytes = stats.bytes;
                 r.exchange_s = stats.exchange_s;
                 r.write_s = stats.write_s;
                 r.sync_s = stats.sync_s;
                 r.verify_s = stats.verify_s;
                 r.commit_s = stats.commit_s;
                 r.save_s = saves;
                 r.load_s = loads;
               });
  // The disk: one stream, `ranks` streams, one stream read.
  const std::string probe = (fs::path(o.dir) / "probe").string();
  auto t0 = Clock::now();
  write_stream(probe + "0", r.bytes);
  r.disk_write_1 = static_cast<double>(r.bytes) / seconds_since(t0);
  fs::remove(probe + "0");
  std::vector<std::thread> writers;
  t0 = Clock::now();
  for (int i = 0; i < o.ranks; ++i)
    writers.emplace_back([&, i] { write_stream(probe + std::to_string(i), r.bytes / static_cast<uint64_t>(o.ranks)); });
  for (auto& w : writers) w.join();
  r.disk_write_n = static_cast<double>(r.bytes / static_cast<uint64_t>(o.ranks) * static_cast<uint64_t>(o.ranks)) /
                   seconds_since(t0);
  r.caches_dropped = o.drop_caches && drop_page_cache();
  t0 = Clock::now();
  const uint64_t read = read_stream(probe + "0");
  r.disk_read_1 = static_cast<double>(read) / seconds_since(t0);
  fs::remove_all(o.dir);
  return r;
}

std::string format_checkpoint_bench(const CheckpointBenchResult& r, const CheckpointBenchOptions& o) {
  const double gb = 1e9;
  auto rate = [&](double s) { return static_cast<double>(r.bytes) / s / gb; };
  std::string s = fmt::format(
      "GPT {} layers, width {}, vocabulary {}, context {} ({} parameters), zero3 over {} ranks (threads engine), "
      "AdamW: one checkpoint = {:.3f} GB (f32 masters and both moments) under {}\n\n",
      o.layers, o.width, o.vocab, o.context, r.parameters, o.ranks, static_cast<double>(r.bytes) / gb, o.dir);
  s += "| | seconds | GB/s | of the disk's write (1 stream / " + std::to_string(o.ranks) + " streams) |\n";
  s += "|---|---:|---:|---:|\n";
  for (size_t i = 0; i < r.save_s.size(); ++i)
    s += fmt::format("| save {} | {:.2f} | {:.2f} | {:.0f}% / {:.0f}% |\n", i + 1, r.save_s[i], rate(r.save_s[i]),
                     100 * rate(r.save_s[i]) * gb / r.disk_write_1, 100 * rate(r.save_s[i]) * gb / r.disk_write_n);
  for (size_t i = 0; i < r.load_s.size(); ++i)
    s += fmt::format("| load {} | {:.2f} | {:.2f} | |\n", i + 1, r.load_s[i], rate(r.load_s[i]));
  s += fmt::format("| disk write, 1 stream + fsync | | {:.2f} | |\n", r.disk_write_1 / gb);
  s += fmt::format("| disk write, {} streams + fsync | | {:.2f} | |\n", o.ranks, r.disk_write_n / gb);
  s += fmt::format("| disk read, 1 stream{} | | {:.2f} | |\n", r.caches_dropped ? " (page cache dropped)" : " (page cache)",
                   r.disk_read_1 / gb);
  s += fmt::format(
      "\nThe last save's phases (each the slowest rank's): exchanging the pieces' descriptions {:.2f} s, writing "
      "with CRC-32s {:.2f} s (the kernel holds writers back once enough pages are dirty: the disk's pace), fsync "
      "{:.2f} s, reading back and checking {:.2f} s, index, rename and agreement {:.2f} s.\n",
      r.exchange_s, r.write_s, r.sync_s, r.verify_s, r.commit_s);
  s += fmt::format(
      "\nA save writes every rank's pieces (fsync each file), reads them back to check their CRC-32, then writes "
      "the index and renames: {} bytes cross the file system twice. Loads {}.\n",
      r.bytes, o.drop_caches ? "read the disk (the page cache is dropped before each)" : "read the page cache");
  return s;
}

}  // namespace meshtrain::bench
