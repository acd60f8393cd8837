#include "meshtrain/core/error.h"

#include <utility>

namespace meshtrain {
namespace {

std::string compose(const std::string& op, const std::string& detail, const std::string& hint) {
  std::string s = op + ": " + detail;
  if (!hint.empty()) s += " (hint: " + hint + ")";
  return s;
}

}  // namespace

Error::Error(std::string op, std::string detail, std::string hint)
    : std::runtime_error(compose(op, detail, hint)),
      op_(std::move(op)),
      detail_(std::move(detail)),
      hint_(std::move(hint)) {}

CommError::CommError(std::string op, std::string detail, std::string hint, std::vector<int> ranks)
    : Error(std::move(op), std::move(detail), std::move(hint)), ranks_(std::move(ranks)) {}

}  // namespace meshtrain
