// Durable, all-or-nothing file writes: what every artifact and checkpoint of
// a run goes through.
//
//   write_file_atomic("runs/mlp/config.toml", text);   // old file or new file, never half of one
//   fsync_directory("runs/mlp");                       // make a rename itself durable
//
// write_file_atomic writes to a fresh temporary name in the destination's
// directory (".<name>.tmp.<pid>.<n>", created with O_EXCL), fsyncs the file,
// renames it over `path` (atomic on POSIX file systems) and fsyncs the
// directory, so after a crash or power loss `path` holds either its previous
// contents or the new ones. On any failure the temporary file is removed and
// IoError names the path, the system error and a hint; `path` is untouched.
//
// Thread-safety: reentrant (distinct temporary names per call); two writers
// of the same path race as rename does: the last rename wins.
#pragma once

#include <string>
#include <string_view>

namespace meshtrain {

// Replaces `path` with `contents` atomically and durably (see above). The
// directory of `path` must exist.
void write_file_atomic(const std::string& path, std::string_view contents);

// fsync(2) on a directory, so that entries created, renamed or removed in it
// survive a crash. Throws IoError naming the directory.
void fsync_directory(const std::string& dir);

}  // namespace meshtrain
