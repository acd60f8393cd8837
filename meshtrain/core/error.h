// meshtrain errors: one hierarchy, rooted at meshtrain::Error.
//
// Every error names the operation that failed, the values involved and, where
// there is one, a hint on how to fix it:
//
//   throw InvalidArgument("Tensor::narrow",
//                         fmt::format("start {} + length {} > size {} of dim {}", s, l, n, d),
//                         "narrow within the dimension");
//
// what() reads "Tensor::narrow: start 3 + length 4 > size 5 of dim 0 (hint: ...)".
// The library never calls exit or abort; the CLI maps these to exit codes.
// Thread-safety: error objects are immutable after construction.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace meshtrain {

class Error : public std::runtime_error {
 public:
  Error(std::string op, std::string detail, std::string hint = {});

  const std::string& op() const noexcept { return op_; }
  const std::string& detail() const noexcept { return detail_; }
  const std::string& hint() const noexcept { return hint_; }

 private:
  std::string op_;
  std::string detail_;
  std::string hint_;
};

// A caller broke a documented precondition (bad shape, dtype, rank, size...).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A feature the engine or build does not have (see Communicator::capabilities).
class Unsupported : public Error {
 public:
  using Error::Error;
};

// An allocation failed (the device or host is out of memory).
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// Reading or writing a file failed, or its contents are corrupt.
class IoError : public Error {
 public:
  using Error::Error;
};

// Errors from a communicator. `ranks` lists the ranks the error is about (the
// ranks that did not arrive, the rank whose call differs, the rank that failed).
class CommError : public Error {
 public:
  CommError(std::string op, std::string detail, std::string hint, std::vector<int> ranks = {});
  const std::vector<int>& ranks() const noexcept { return ranks_; }

 private:
  std::vector<int> ranks_;
};

// A wait passed its deadline.
class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};

// Ranks called different collectives at the same sequence number.
class MismatchError : public CommError {
 public:
  using CommError::CommError;
};

// The communicator was aborted (a peer failed, timed out or mismatched earlier);
// it cannot be used again.
class AbortedError : public CommError {
 public:
  using CommError::CommError;
};

// The engine (e.g. MPI) reported a failure.
class EngineError : public CommError {
 public:
  using CommError::CommError;
};

}  // namespace meshtrain
