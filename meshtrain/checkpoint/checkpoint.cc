#include "meshtrain/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <system_error>
#include <utility>

#include "meshtrain/core/atomic_file.h"
#include "meshtrain/core/error.h"

namespace meshtrain::checkpoint {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kFormat = "meshtrain.checkpoint";
constexpr int kVersion = 1;
constexpr uint64_t kAlign = 64;
constexpr const char* kSave = "save_checkpoint";
constexpr const char* kLoad = "load checkpoint";
using Clock = std::chrono::steady_clock;

std::string step_name(int64_t step) { return fmt::format("step_{:08d}", step); }

uint32_t crc_of(const void* data, uint64_t bytes) {
  uLong c = crc32(0L, Z_NULL, 0);
  const auto* p = static_cast<const Bytef*>(data);
  while (bytes > 0) {
    const auto chunk = static_cast<uInt>(std::min<uint64_t>(bytes, 1u << 30));
    c = crc32(c, p, chunk);
    p += chunk;
    bytes -= chunk;
  }
  return static_cast<uint32_t>(c);
}

// A piece's region with its defaults filled in; InvalidArgument (save) or
// IoError (load) naming `what` when it does not lie in its tensor.
// Box::to_string for a box read from a file, not checked yet (to_string
// indexes offsets by sizes and adds the two: out of bounds or overflowing here).
std::string box_string(const sharding::Box& box) {
  if (box.offsets.size() != box.sizes.size())
    return fmt::format("(offsets [{}], sizes [{}])", fmt::join(box.offsets, ", "), fmt::join(box.sizes, ", "));
  std::vector<std::string> parts;
  for (size_t d = 0; d < box.sizes.size(); ++d)
    parts.push_back(fmt::format("{}:{}", box.offsets[d], static_cast<__int128>(box.offsets[d]) + box.sizes[d]));
  return fmt::format("[{}]", fmt::join(parts, ", "));
}

// The placement checked against its tensor, with view, box and count
// written out (a region read from a file is checked before anything indexes
// with it, so the messages format raw values).
template <typename Err>
sharding::Placement check_region(const sharding::Placement& where, const char* op, const std::string& what,
                                 const std::string& hint) {
  auto fail = [&](const std::string& why) { throw Err(op, fmt::format("{}: {}", what, why), hint); };
  const std::vector<int64_t>& shape = where.shape;
  std::vector<int64_t> view = where.view;
  sharding::Box box = where.box;
  const int64_t start = where.start;
  int64_t count = where.count;
  constexpr int64_t kMaxElements = int64_t{1} << 48;
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && n > kMaxElements / d)) fail(fmt::format("shape {} is not a tensor's", fmt::join(shape, "x")));
    n *= d;
  }
  if (view.empty()) view = shape;
  int64_t vn = 1;
  for (int64_t d : view) {
    if (d < 0 || (d > 0 && vn > kMaxElements / d)) fail(fmt::format("view {} is not a shape", fmt::join(view, "x")));
    vn *= d;
  }
  if (vn != n) fail(fmt::format("view {} does not hold the {} elements of shape [{}]", fmt::join(view, "x"), n,
                                fmt::join(shape, ", ")));
  if (box.offsets.empty() && box.sizes.empty()) box = {std::vector<int64_t>(view.size(), 0), view};
  if (box.offsets.size() != view.size() || box.sizes.size() != view.size())
    fail(fmt::format("box {} has not the {} dimensions of view [{}]", box_string(box), view.size(),
                     fmt::join(view, ", ")));
  for (size_t d = 0; d < view.size(); ++d)
    if (box.offsets[d] < 0 || box.sizes[d] < 0 || box.offsets[d] > view[d] - box.sizes[d])
      fail(fmt::format("box {} is not inside view [{}]", box_string(box), fmt::join(view, ", ")));
  const int64_t bn = box.numel();
  if (count < 0 && start >= 0) count = bn - start;  // the default: the rest of the box
  if (start < 0 || start > bn || count > bn - start)
    fail(fmt::format("elements [{}, {}) are not inside box {} ({} elements)", start,
                     static_cast<__int128>(start) + count, box.to_string(), bn));
  return {shape, std::move(view), std::move(box), start, count};
}

// A JSON integer as T; nullopt for anything else: get<T> converts a float
// out of T's range with undefined behavior and wraps an integer out of range.
template <typename T>
std::optional<T> integer_of(const json& v) {
  if (v.is_number_unsigned()) {
    if (const uint64_t u = v.get<uint64_t>(); std::in_range<T>(u)) return static_cast<T>(u);
  } else if (v.is_number_integer()) {
    if (const int64_t i = v.get<int64_t>(); std::in_range<T>(i)) return static_cast<T>(i);
  }
  return std::nullopt;
}

// A contiguous stretch of a piece: global row-major elements
// [global, global + length) are the piece's [local, local + length).
struct Run {
  int64_t global = 0, length = 0, local = 0;
};

// The runs of a region, in increasing global (and local) order.
std::vector<Run> runs_of(const sharding::Placement& r) {
  std::vector<Run> out;
  if (r.count == 0) return out;
  const size_t dims = r.view.size();
  if (dims == 0) return {{0, 1, 0}};
  std::vector<int64_t> stride(dims, 1);
  for (size_t d = dims - 1; d > 0; --d) stride[d - 1] = stride[d] * r.view[d];
  const int64_t row = r.box.sizes.back();
  const int64_t first_row = r.start / row, last_row = (r.start + r.count - 1) / row;  // rows of the box touched
  std::vector<int64_t> idx(dims, 0);  // the row's index within the box (the last dim stays 0)
  int64_t rem = first_row;
  for (size_t d = dims - 1; d-- > 0;) {
    idx[d] = rem % r.box.sizes[d];
    rem /= r.box.sizes[d];
  }
  for (int64_t k = first_row; k <= last_row; ++k) {
    int64_t g = 0;
    for (size_t d = 0; d < dims; ++d) g += (r.box.offsets[d] + idx[d]) * stride[d];
    const int64_t lo = std::max(k * row, r.start), hi = std::min((k + 1) * row, r.start + r.count);
    const Run run{g + (lo - k * row), hi - lo, lo - r.start};
    if (!out.empty() && out.back().global + out.back().length == run.global)
      out.back().length += run.length;  // local runs are consecutive too
    else
      out.push_back(run);
    for (size_t d = dims - 1; d-- > 0;) {  // next row
      if (++idx[d] < r.box.sizes[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

json describe(const CheckpointPiece& p, const sharding::Placement& r) {
  return json{{"name", p.name}, {"shape", r.shape},     {"view", r.view},       {"offsets", r.box.offsets},
              {"sizes", r.box.sizes}, {"start", r.start}, {"count", r.count}};
}

// What failed on this rank, if anything.
struct Failure {
  std::string text;
  std::exception_ptr error;
  void set(const std::exception& e) {
    const auto* own = dynamic_cast<const Error*>(&e);
    text = own != nullptr ? own->detail() : std::string(e.what());
    error = std::current_exception();
  }
};

// Collective: when any rank failed, the rank that failed rethrows its error
// and every other rank throws IoError naming the first that failed.
void agree(comm::Communicator& c, const Failure& mine) {
  const std::vector<std::string> all = comm::all_gather_bytes(c, mine.text);
  if (mine.error) std::rethrow_exception(mine.error);
  for (size_t r = 0; r < all.size(); ++r)
    if (!all[r].empty())
      throw IoError(kSave, fmt::format("rank {}: {}", r, all[r]),
                    "check the checkpoint directory's free space and permissions; the previous checkpoints are "
                    "kept");
}

void throw_errno(const char* op, const std::string& what, int err, const std::string& hint) {
  throw IoError(op, fmt::format("{}: {}", what, std::generic_category().message(err)), hint);
}

void write_all(int fd, const void* data, uint64_t bytes, uint64_t offset, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t w = ::pwrite(fd, p, std::min<uint64_t>(bytes, 1u << 30), static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw_errno(kSave, fmt::format("write '{}'", path), errno, "check free space");
    }
    p += w;
    bytes -= static_cast<uint64_t>(w);
    offset += static_cast<uint64_t>(w);
  }
}

void read_all(const char* op, int fd, void* data, uint64_t bytes, uint64_t offset, const std::string& path,
              const std::string& what) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t r = ::pread(fd, p, std::min<uint64_t>(bytes, 1u << 30), static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw_errno(op, fmt::format("read {} from '{}'", what, path), errno, "check the file");
    if (r == 0)
      throw IoError(op, fmt::format("'{}' ends before {} (truncated)", path, what),
                    "the file is damaged: load an older checkpoint (remove this step_N directory)");
    p += r;
    bytes -= static_cast<uint64_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

// This rank's file: its pieces at aligned offsets. Returns, per piece, its
// offset, bytes and CRC-32 (as JSON), after reading the file back.
json write_rank_file(const std::string& path, const std::vector<const CheckpointPiece*>& pieces,
                     const std::vector<sharding::Placement>& regions, CheckpointSaveStats& stats) {
  auto t = Clock::now();
  auto lap = [&t](double& into) {
    const auto now = Clock::now();
    into += std::chrono::duration<double>(now - t).count();
    t = now;
  };
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw_errno(kSave, fmt::format("create '{}'", path), errno, "check the directory's permissions");
  json out = json::array();
  std::vector<uint32_t> crcs;
  uint64_t offset = 0;
  try {
    for (size_t i = 0; i < pieces.size(); ++i) {
      const Tensor& t = pieces[i]->data;
      const uint64_t bytes = static_cast<uint64_t>(regions[i].count) * sizeof(float);
      const uint32_t crc = crc_of(t.data_ptr(), bytes);
      write_all(fd, t.data_ptr(), bytes, offset, path);
      out.push_back(json{{"offset", offset}, {"bytes", bytes}, {"crc32", crc}});
      crcs.push_back(crc);
      offset = (offset + bytes + kAlign - 1) / kAlign * kAlign;
    }
    lap(stats.write_s);
    if (::ftruncate(fd, static_cast<off_t>(offset)) != 0 || ::fsync(fd) != 0)
      throw_errno(kSave, fmt::format("flush '{}'", path), errno, "check free space");
    lap(stats.sync_s);
    // Verify: read every piece back.
    std::vector<char> buf;
    for (size_t i = 0; i < pieces.size(); ++i) {
      const uint64_t bytes = out[i]["bytes"].get<uint64_t>();
      buf.resize(bytes);
      read_all(kSave, fd, buf.data(), bytes, out[i]["offset"].get<uint64_t>(), path, pieces[i]->name);
      if (crc_of(buf.data(), bytes) != crcs[i])
        throw IoError(kSave, fmt::format("'{}' reads back differently from what was written ({})", path,
                                         pieces[i]->name),
                      "the storage is unreliable");
    }
    lap(stats.verify_s);
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (::close(fd) != 0) throw_errno(kSave, fmt::format("close '{}'", path), errno, "check free space");
  return out;
}

void remove_tree(const fs::path& p) {
  std::error_code ec;
  fs::remove_all(p, ec);
}

std::vector<int64_t> steps_under(const std::string& root) {
  std::vector<int64_t> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() != 13 || name.rfind("step_", 0) != 0) continue;
    int64_t s = 0;
    bool digits = true;
    for (char ch : name.substr(5)) {
      digits &= ch >= '0' && ch <= '9';
      s = s * 10 + (ch - '0');
    }
    if (digits && fs::exists(e.path() / "index.json", ec)) out.push_back(s);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

// ---- saving ----

CheckpointSaveStats save_checkpoint(comm::Communicator& world, const std::string& root, int64_t step,
                     const std::vector<CheckpointPiece>& pieces, const std::string& metadata,
                     const CheckpointOptions& options) {
  if (step < 0 || step > 99'999'999)
    throw InvalidArgument(kSave, fmt::format("step {}", step), "steps are numbered 0 to 99999999");
  // 1. Check, describe, exchange, and decide who writes what.
  CheckpointSaveStats stats;
  auto t = Clock::now();
  Failure failure;
  json meta;
  std::vector<sharding::Placement> regions;
  json mine = json::array();
  try {
    try {
      meta = json::parse(metadata);
    } catch (const json::exception& e) {
      throw InvalidArgument(kSave, fmt::format("metadata is not JSON: {}", e.what()), "pass a JSON object");
    }
    if (!meta.is_object()) throw InvalidArgument(kSave, "metadata is not a JSON object", "pass a JSON object");
    for (const CheckpointPiece& p : pieces) {
      regions.push_back(check_region<InvalidArgument>(p.placement, kSave, fmt::format("piece of '{}'", p.name),
                                                      "describe the block this rank holds"));
      if (!p.data.defined() || p.data.dtype() != DType::f32 || !p.data.is_contiguous() ||
          p.data.numel() != regions.back().count)
        throw InvalidArgument(kSave,
                              fmt::format("piece of '{}': data is not {} contiguous f32 values", p.name,
                                          regions.back().count),
                              "pass the piece's values");
      mine.push_back(describe(p, regions.back()));
    }
  } catch (const std::exception& e) {
    failure.set(e);
  }
  agree(world, failure);
  const std::vector<std::string> all = comm::all_gather_bytes(world, mine.dump());
  std::map<std::string, int> writer;  // description -> the lowest rank holding it
  std::vector<json> described;
  for (int r = 0; r < world.size(); ++r) {
    described.push_back(json::parse(all[static_cast<size_t>(r)]));
    for (const json& d : described.back()) writer.emplace(d.dump(), r);
  }
  std::vector<const CheckpointPiece*> writes;
  std::vector<sharding::Placement> write_regions;
  std::map<std::string, bool> seen;  // a piece held twice by this rank (tied copies) is written once
  for (size_t i = 0; i < pieces.size(); ++i) {
    const std::string key = mine[i].dump();
    if (writer.at(key) != world.rank() || !seen.emplace(key, true).second) continue;
    writes.push_back(&pieces[i]);
    write_regions.push_back(regions[i]);
  }
  stats.exchange_s = std::chrono::duration<double>(Clock::now() - t).count();
  // 2. Write this rank's file into the temporary directory.
  const fs::path tmp = fs::path(root) / fmt::format(".{}.tmp", step_name(step));
  if (world.rank() == 0) {
    try {
      std::error_code ec;
      fs::create_directories(root, ec);
      if (ec) throw IoError(kSave, fmt::format("create '{}': {}", root, ec.message()), "");
      remove_tree(tmp);  // a crashed save's
      fs::create_directory(tmp, ec);
      if (ec) throw IoError(kSave, fmt::format("create '{}': {}", tmp.string(), ec.message()), "");
    } catch (const std::exception& e) {
      failure.set(e);
    }
  }
  agree(world, failure);
  const std::string file = fmt::format("rank_{:05d}.bin", world.rank());
  json written;
  try {
    if (!writes.empty()) written = write_rank_file((tmp / file).string(), writes, write_regions, stats);
  } catch (const std::exception& e) {
    failure.set(e);
  }
  agree(world, failure);
  // 3. The index, by rank 0, from every rank's placements and checksums.
  t = Clock::now();
  const std::vector<std::string> sums =
      comm::all_gather_bytes(world, written.is_null() ? std::string("[]") : written.dump());
  for (const std::string& placed : sums)
    for (const json& at : json::parse(placed)) stats.bytes += at["bytes"].get<uint64_t>();
  if (world.rank() == 0) {
    try {
      json index{{"format", kFormat}, {"version", kVersion}, {"step", step}, {"metadata", meta}};
      std::map<std::string, json> tensors;
      json files = json::array();
      std::map<std::string, bool> taken;
      for (int r = 0; r < world.size(); ++r) {
        const json placed = json::parse(sums[static_cast<size_t>(r)]);
        if (placed.empty()) continue;
        const int file_index = static_cast<int>(files.size());
        uint64_t end = 0;
        size_t k = 0;
        for (const json& d : described[static_cast<size_t>(r)]) {
          const std::string key = d.dump();
          if (writer.at(key) != r || !taken.emplace(key, true).second) continue;
          const json& at = placed.at(k++);
          json piece = d;
          piece.erase("name");
          piece.erase("shape");
          piece["file"] = file_index;
          piece["offset"] = at["offset"];
          piece["bytes"] = at["bytes"];
          piece["crc32"] = at["crc32"];
          end = std::max(end, at["offset"].get<uint64_t>() + at["bytes"].get<uint64_t>());
          json& t = tensors[d["name"].get<std::string>()];
          if (t.is_null()) t = json{{"name", d["name"]}, {"dtype", "f32"}, {"shape", d["shape"]}, {"pieces", json::array()}};
          t["pieces"].push_back(piece);
        }
        files.push_back(json{{"name", fmt::format("rank_{:05d}.bin", r)},
                             {"bytes", (end + kAlign - 1) / kAlign * kAlign}});
      }
      index["files"] = files;
      json list = json::array();
      for (auto& [name, t] : tensors) list.push_back(std::move(t));
      index["tensors"] = std::move(list);
      write_file_atomic((tmp / "index.json").string(), index.dump(1));
      fsync_directory(tmp.string());
      const fs::path final_dir = fs::path(root) / step_name(step);
      remove_tree(final_dir);  // an older save of the same step
      if (::rename(tmp.c_str(), final_dir.c_str()) != 0)
        throw_errno(kSave, fmt::format("rename '{}' -> '{}'", tmp.string(), final_dir.string()), errno, "");
      fsync_directory(root);
      write_file_atomic((fs::path(root) / "latest").string(), step_name(step) + "\n");
      if (options.keep_last > 0) {
        std::vector<int64_t> steps = steps_under(root);
        for (size_t i = 0; i + static_cast<size_t>(options.keep_last) < steps.size(); ++i)
          remove_tree(fs::path(root) / step_name(steps[i]));
        fsync_directory(root);
      }
    } catch (const std::exception& e) {
      failure.set(e);
    }
  }
  agree(world, failure);
  stats.commit_s = std::chrono::duration<double>(Clock::now() - t).count();
  double phases[5] = {stats.exchange_s, stats.write_s, stats.sync_s, stats.verify_s, stats.commit_s};
  world.all_reduce(phases, phases, 5, DType::f64, comm::ReduceOp::max);
  stats.exchange_s = phases[0];
  stats.write_s = phases[1];
  stats.sync_s = phases[2];
  stats.verify_s = phases[3];
  stats.commit_s = phases[4];
  return stats;
}

// ---- loading ----

std::optional<std::string> latest_checkpoint(const std::string& root) {
  const std::vector<int64_t> steps = steps_under(root);
  if (steps.empty()) return std::nullopt;
  return (fs::path(root) / step_name(steps.back())).string();
}

const CheckpointIndex::Entry* CheckpointIndex::find(const std::string& name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const Entry& e, const std::string& n) { return e.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

CheckpointIndex parse_checkpoint_index(std::string_view text, const std::string& path) {
  const std::string hint = "the checkpoint is damaged or not meshtrain's: load an older one (remove this step_N "
                           "directory)";
  auto fail = [&](const std::string& why) -> IoError { return IoError(kLoad, fmt::format("{}: {}", path, why), hint); };
  // Integer fields: JSON integers within their C++ type.
  auto integer = [&](const json& v, auto type, const char* field) {
    const auto x = integer_of<decltype(type)>(v);
    if (!x) throw fail(fmt::format("{} is {}, not an integer in range", field, v.dump()));
    return *x;
  };
  auto integers = [&](const json& v, const char* field) {
    if (!v.is_array()) throw fail(fmt::format("{} is a JSON {}, not a list of integers", field, v.type_name()));
    std::vector<int64_t> list;
    for (const json& x : v) list.push_back(integer(x, int64_t{}, field));
    return list;
  };
  CheckpointIndex out;
  try {
    const json j = json::parse(text);
    if (!j.is_object() || j.value("format", "") != kFormat)
      throw fail(fmt::format("not a checkpoint index (format is not \"{}\")", kFormat));
    if (const int version = integer(j.at("version"), int{}, "version"); version != kVersion)
      throw fail(fmt::format("index version {} (this build reads {})", version, kVersion));
    out.step = integer(j.at("step"), int64_t{}, "step");
    if (out.step < 0) throw fail(fmt::format("step {}", out.step));
    out.metadata = j.at("metadata").dump();
    for (const json& f : j.at("files")) {
      const std::string name = f.at("name").get<std::string>();
      if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
        throw fail(fmt::format("file name '{}' is not a file of the checkpoint's directory", name));
      out.files.push_back(name);
      out.file_bytes.push_back(integer(f.at("bytes"), uint64_t{}, "bytes"));
    }
    for (const json& t : j.at("tensors")) {
      CheckpointIndex::Entry e;
      e.name = t.at("name").get<std::string>();
      if (t.at("dtype").get<std::string>() != "f32")
        throw fail(fmt::format("tensor '{}' has dtype {} (checkpoints hold f32)", e.name, t.at("dtype").dump()));
      e.shape = integers(t.at("shape"), "shape");
      for (const json& p : t.at("pieces")) {
        CheckpointIndex::Piece piece;
        piece.file = integer(p.at("file"), int{}, "file");
        piece.offset = integer(p.at("offset"), uint64_t{}, "offset");
        piece.bytes = integer(p.at("bytes"), uint64_t{}, "bytes");
        piece.crc32 = integer(p.at("crc32"), uint32_t{}, "crc32");
        const std::string what = fmt::format("a piece of tensor '{}'", e.name);
        piece.placement = check_region<IoError>(
            {e.shape, integers(p.at("view"), "view"),
             {integers(p.at("offsets"), "offsets"), integers(p.at("sizes"), "sizes")},
             integer(p.at("start"), int64_t{}, "start"), integer(p.at("count"), int64_t{}, "count")},
            kLoad, fmt::format("{}: {}", path, what), hint);
        const int64_t count = piece.placement.count;
        if (piece.file < 0 || static_cast<size_t>(piece.file) >= out.files.size())
          throw fail(fmt::format("{} names file #{} of {}", what, piece.file, out.files.size()));
        if (piece.bytes != static_cast<uint64_t>(count) * sizeof(float))
          throw fail(fmt::format("{} has {} bytes for {} f32 values", what, piece.bytes, count));
        const uint64_t size = out.file_bytes[static_cast<size_t>(piece.file)];
        if (piece.offset > size || piece.bytes > size - piece.offset)
          throw fail(fmt::format("{} lies at bytes [{}, {}) past the end of '{}' ({} bytes)", what, piece.offset,
                                 piece.offset + piece.bytes, out.files[static_cast<size_t>(piece.file)], size));
        e.pieces.push_back(std::move(piece));
      }
      out.tensors.push_back(std::move(e));
    }
  } catch (const json::exception& e) {
    throw fail(fmt::format("malformed index: {}", e.what()));
  }
  std::sort(out.tensors.begin(), out.tensors.end(),
            [](const CheckpointIndex::Entry& a, const CheckpointIndex::Entry& b) { return a.name < b.name; });
  for (size_t i = 1; i < out.tensors.size(); ++i)
    if (out.tensors[i].name == out.tensors[i - 1].name)
      throw fail(fmt::format("tensor '{}' is listed twice", out.tensors[i].name));
  return out;
}

CheckpointIndex read_checkpoint_index(const std::string& dir) {
  const std::string path = (fs::path(dir) / "index.json").string();
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw IoError(kLoad, fmt::format("cannot open '{}'", path), "give a checkpoint directory (step_N, with index.json)");
  std::stringstream ss;
  ss << in.rdbuf();
  CheckpointIndex index = parse_checkpoint_index(ss.str(), path);
  index.dir = dir;
  for (size_t f = 0; f < index.files.size(); ++f) {
    const std::string file = (fs::path(dir) / index.files[f]).string();
    struct stat st {};
    if (::stat(file.c_str(), &st) != 0)
      throw IoError(kLoad, fmt::format("'{}' (listed in {}) is missing", file, path),
                    "the checkpoint is incomplete: load an older one");
    if (static_cast<uint64_t>(st.st_size) < index.file_bytes[f])
      throw IoError(kLoad, fmt::format("'{}' has {} bytes, the index says {} (truncated)", file, st.st_size,
                                       index.file_bytes[f]),
                    "the checkpoint is damaged: load an older one (remove this step_N directory)");
  }
  return index;
}

void load_checkpoint_pieces(const CheckpointIndex& index, std::vector<CheckpointPiece>& wanted) {
  std::map<int, int> fds;  // file -> descriptor, opened on first use
  auto fd_of = [&](int f) {
    auto it = fds.find(f);
    if (it != fds.end()) return it->second;
    const std::string path = (fs::path(index.dir) / index.files[static_cast<size_t>(f)]).string();
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw_errno(kLoad, fmt::format("open '{}'", path), errno, "check the checkpoint directory");
    fds[f] = fd;
    return fd;
  };
  std::vector<float> buf;
  try {
    for (CheckpointPiece& w : wanted) {
      const sharding::Placement need = check_region<InvalidArgument>(
          w.placement, kLoad, fmt::format("wanted piece of '{}'", w.name), "describe the block this rank needs");
      const CheckpointIndex::Entry* e = index.find(w.name);
      if (e == nullptr)
        throw IoError(kLoad,
                      fmt::format("checkpoint {} (step {}) has no tensor '{}' ({} tensors)", index.dir, index.step,
                                  w.name, index.tensors.size()),
                      "resume with the model the checkpoint was saved from (same --model and sizes)");
      if (e->shape != need.shape)
        throw IoError(kLoad,
                      fmt::format("checkpoint {} holds '{}' as [{}], this model needs [{}]", index.dir, w.name,
                                  fmt::join(e->shape, ", "), fmt::join(need.shape, ", ")),
                      "resume with the model the checkpoint was saved from (same --model and sizes)");
      if (!w.data.defined()) w.data = Tensor::empty({need.count}, DType::f32);
      if (w.data.dtype() != DType::f32 || !w.data.is_contiguous() || w.data.numel() != need.count)
        throw InvalidArgument(kLoad, fmt::format("wanted piece of '{}': data is not {} contiguous f32 values", w.name,
                                                 need.count),
                              "pass an undefined tensor or one of the piece's size");
      float* out = w.data.data<float>();
      const std::vector<Run> want = runs_of(need);
      int64_t found = 0;
      for (const CheckpointIndex::Piece& p : e->pieces) {
        const std::vector<Run> have = runs_of(p.placement);
        // The overlap of two increasing run lists.
        bool loaded = false;
        size_t a = 0, b = 0;
        while (a < want.size() && b < have.size()) {
          const int64_t lo = std::max(want[a].global, have[b].global);
          const int64_t hi = std::min(want[a].global + want[a].length, have[b].global + have[b].length);
          if (lo < hi) {
            if (!loaded) {  // read and check the whole piece once
              const std::string path = (fs::path(index.dir) / index.files[static_cast<size_t>(p.file)]).string();
              buf.resize(static_cast<size_t>(p.placement.count));
              read_all(kLoad, fd_of(p.file), buf.data(), p.bytes, p.offset, path,
                       fmt::format("a piece of '{}'", w.name));
              if (crc_of(buf.data(), p.bytes) != p.crc32)
                throw IoError(kLoad,
                              fmt::format("'{}': the piece of '{}' at byte {} fails its checksum", path, w.name,
                                          p.offset),
                              "the checkpoint is damaged: load an older one (remove this step_N directory)");
              loaded = true;
            }
            std::memcpy(out + want[a].local + (lo - want[a].global), buf.data() + have[b].local + (lo - have[b].global),
                        static_cast<size_t>(hi - lo) * sizeof(float));
            found += hi - lo;
          }
          if (want[a].global + want[a].length < have[b].global + have[b].length)
            ++a;
          else
            ++b;
        }
      }
      if (found != need.count)
        throw IoError(kLoad,
                      fmt::format("checkpoint {} holds {} of the {} elements of '{}' this rank needs{}", index.dir,
                                  found, need.count, w.name, found > need.count ? " (its pieces overlap)" : ""),
                      "the checkpoint is damaged or incomplete: load an older one");
    }
  } catch (...) {
    for (auto& [f, fd] : fds) ::close(fd);
    throw;
  }
  for (auto& [f, fd] : fds) ::close(fd);
}

void copy_region(const Tensor& whole, CheckpointPiece& piece) {
  const sharding::Placement r =
      check_region<InvalidArgument>(piece.placement, "copy_region", fmt::format("piece of '{}'", piece.name), "");
  int64_t n = 1;
  for (int64_t d : r.shape) n *= d;
  if (!whole.defined() || whole.dtype() != DType::f32 || !whole.is_contiguous() || whole.numel() != n)
    throw InvalidArgument("copy_region",
                          fmt::format("'{}': the whole tensor is not {} contiguous f32 values", piece.name, n),
                          "pass the tensor the piece is part of");
  if (!piece.data.defined()) piece.data = Tensor::empty({r.count}, DType::f32);
  if (piece.data.dtype() != DType::f32 || !piece.data.is_contiguous() || piece.data.numel() != r.count)
    throw InvalidArgument("copy_region", fmt::format("'{}': data is not {} contiguous f32 values", piece.name, r.count),
                          "");
  const float* in = whole.data<float>();
  float* out = piece.data.data<float>();
  for (const Run& run : runs_of(r))
    std::memcpy(out + run.local, in + run.global, static_cast<size_t>(run.length) * sizeof(float));
}

}  // namespace meshtrain::checkpoint
