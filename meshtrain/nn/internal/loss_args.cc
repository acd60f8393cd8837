#include "meshtrain/nn/internal/loss_args.h"

#include <fmt/format.h>

#include <cmath>
#include <string>

#include "meshtrain/core/error.h"

namespace meshtrain::nn::internal {

double resolve_normalizer(std::optional<double> normalizer, double fallback, const char* op) {
  if (!normalizer) return fallback > 0.0 ? fallback : 1.0;  // empty input: the sum is 0 anyway
  if (!(*normalizer > 0.0) || !std::isfinite(*normalizer))
    throw InvalidArgument(op, fmt::format("normalizer {}", *normalizer),
                          "pass a finite normalizer > 0 (e.g. the global batch size), or omit it");
  return *normalizer;
}

void check_forward_done(double normalizer, const char* op) {
  if (normalizer == 0.0) throw InvalidArgument(op, "no forward to go back through", "call forward first");
}

void read_labels(const Tensor& labels, int64_t n, int64_t classes, const char* op, Tensor& out) {
  if (!labels.defined() || labels.dim() != 1 || labels.size(0) != n ||
      (labels.dtype() != DType::i64 && labels.dtype() != DType::i32))
    throw InvalidArgument(op,
                          fmt::format("labels {} for {} rows", labels.defined()
                                                                    ? fmt::format("{} {}", dtype_name(labels.dtype()),
                                                                                  shape_to_string(labels.shape()))
                                                                    : std::string("undefined"),
                                      n),
                          "pass labels as a 1-d i64 or i32 tensor with one entry per row of logits");
  if (labels.dtype() == DType::i64 && labels.is_contiguous()) {
    out = labels;
  } else {
    out = labels.contiguous().to(DType::i64);  // a contiguous i64 copy
  }
  (void)classes;  // the functional kernels check the range and name the row
}

}  // namespace meshtrain::nn::internal
