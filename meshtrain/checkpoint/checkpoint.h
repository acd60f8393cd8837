// Sharded checkpoints: every rank writes the pieces of the global tensors it
// holds (parameters' f32 masters, optimizer state), with where each lies in
// its tensor, and one index says which file holds which piece; any layout
// reads them back, each rank only the pieces that overlap what it needs
// (torch.distributed.checkpoint's model, with meshtrain's placements).
//
//   std::vector<CheckpointPiece> mine = ...;   // what this rank holds
//   save_checkpoint(world, "RUN/checkpoints", step, mine, metadata, {.keep_last = 3});
//   ...
//   const auto dir = latest_checkpoint("RUN/checkpoints");          // on any mesh
//   const CheckpointIndex index = read_checkpoint_index(*dir);
//   load_checkpoint_pieces(index, wanted);    // fills each wanted piece's data
//
// On disk, under `root`:
//   step_00000100/index.json       the index, written last (format below)
//   step_00000100/rank_00003.bin   rank 3's pieces back to back, each at a
//                                  64-byte aligned offset, raw little-endian f32
//   .step_00000200.tmp/            a save in progress (a crash leaves it; the
//                                  next save removes it, loads never read it)
//   latest                         "step_00000100": the newest complete one
//
// A piece is elements of one global tensor (f32), where a sharding::Placement
// says (sharding/placement.h): the box `box` of the tensor viewed as `view`
// (a reshape of `shape`: a fused q|k|v weight split by heads is a box of its
// (in, 3, C) view), and of the box's row-major elements the range
// [start, start + count). That covers every placement meshtrain makes:
// whole, a tensor-parallel block, a fully sharded flat shard and a flat
// shard of a tensor-parallel block. The index stores each piece's placement
// with its view, box and range written out.
//
// Saving (collective over `world`, every rank with its own pieces, the same
// step and options):
//   1. the ranks exchange their pieces' descriptions; a piece several ranks
//      hold alike (replicas) is written once, by the lowest of them;
//   2. each rank writes its pieces into .step_N.tmp/rank_R.bin, fsyncs the
//      file, reads it back and checks each piece's CRC-32;
//   3. rank 0 writes index.json (every piece: file, offset, bytes, CRC-32,
//      region; the caller's metadata), fsyncs, renames .step_N.tmp to
//      step_N (replacing an older step_N), updates `latest` atomically and
//      removes all but the newest keep_last step_* directories.
// A failure on any rank fails the save on every rank with that rank's
// error (IoError), leaving the previous checkpoints as they were.
//
// Loading (no communication): read_checkpoint_index checks the index
// against itself and the files' sizes; load_checkpoint_pieces copies into
// each wanted piece the elements of every saved piece that overlaps it,
// after checking that saved piece's CRC-32, and fails unless every wanted
// element was found exactly once. Errors (IoError) name the file and the
// tensor: a truncated file, a wrong checksum, a region outside its tensor,
// an index pointing past a file's end, a tensor the checkpoint lacks or
// holds with another shape (a checkpoint of a different model).
//
// Thread-safety: save_checkpoint is collective (one thread per rank); the
// loading functions are reentrant.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/sharding/placement.h"

namespace meshtrain::checkpoint {

struct CheckpointPiece {
  std::string name;               // the global tensor's name, e.g. "model/h.0.attn.c_attn.weight"
  sharding::Placement placement;  // which of its elements (placement.shape: the tensor's shape)
  Tensor data;                    // f32, contiguous, placement.numel() elements (saved from, or loaded into)
};

struct CheckpointOptions {
  int keep_last = 0;  // > 0: remove all but the newest keep_last checkpoints after a save
};

// What a save did: the bytes of tensor data all ranks wrote, and the
// seconds of each phase (the slowest rank's): exchanging the pieces'
// descriptions, writing (with the CRC-32s), fsync, reading back and
// checking, the index and rename (with the ranks' agreement on success).
struct CheckpointSaveStats {
  uint64_t bytes = 0;
  double exchange_s = 0, write_s = 0, sync_s = 0, verify_s = 0, commit_s = 0;
};

// Saves step `step` under `root` (created if missing); see above.
// `metadata` is a JSON object (text) stored in the index as it is.
CheckpointSaveStats save_checkpoint(comm::Communicator& world, const std::string& root, int64_t step,
                     const std::vector<CheckpointPiece>& pieces, const std::string& metadata,
                     const CheckpointOptions& options = {});

// The newest complete checkpoint under root (a step_N directory with an
// index.json), or nullopt when there is none.
std::optional<std::string> latest_checkpoint(const std::string& root);

struct CheckpointIndex {
  struct Piece {
    int file = 0;  // into files
    uint64_t offset = 0, bytes = 0;
    uint32_t crc32 = 0;
    sharding::Placement placement;  // with view, box and count written out
  };
  struct Entry {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<Piece> pieces;
  };
  std::string dir;                 // where it was read from
  int64_t step = 0;
  std::string metadata;            // the saver's JSON object
  std::vector<std::string> files;  // file names within dir
  std::vector<uint64_t> file_bytes;
  std::vector<Entry> tensors;      // sorted by name
  const Entry* find(const std::string& name) const;
};

// Parses and checks an index (the text of index.json) on its own: the
// format and version, every piece's region within its tensor and its bytes
// (count x 4), each piece within the stated size of its file. `path` names
// it in errors. The fuzz target's entry point.
CheckpointIndex parse_checkpoint_index(std::string_view text, const std::string& path);
// Reads dir/index.json, parses it and checks each file's real size.
CheckpointIndex read_checkpoint_index(const std::string& dir);

// Fills every wanted piece's data (defined: written in place; undefined:
// allocated) from the checkpoint; see above.
void load_checkpoint_pieces(const CheckpointIndex& index, std::vector<CheckpointPiece>& wanted);

// Fills piece.data (allocated when undefined) with its region of `whole`
// (the whole tensor, f32, of piece.shape's numel): what a rank takes of a
// tensor read from one file (--init-from). InvalidArgument on a mismatch.
void copy_region(const Tensor& whole, CheckpointPiece& piece);

}  // namespace meshtrain::checkpoint
