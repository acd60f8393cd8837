// The rules every optimizer shares (optimizer.h): bf16/f16 grads and the grad
// scale, run through SGD and AdamW.
#include "meshtrain/optim/optimizer.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/core/half.h"
#include "meshtrain/testing/testing.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/optim/clip.h"
#include "meshtrain/optim/sgd.h"
#include "meshtrain/testing/optim.h"

namespace meshtrain::optim {
namespace {

using ::testing::HasSubstr;
using testing::f32_bits;
using testing::make_param;

// Sizes around the chunk edges (the CPU kernels widen 2048 elements at a time).
constexpr int64_t kSizes[] = {1, 2047, 2048, 2049, 5000};

enum class Kind { sgd_nesterov, sgd_dampening, adamw };
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::sgd_nesterov: return "SGD(momentum, nesterov, weight decay)";
    case Kind::sgd_dampening: return "SGD(momentum, dampening, weight decay)";
    case Kind::adamw: return "AdamW";
  }
  return "?";
}
constexpr Kind kKinds[] = {Kind::sgd_nesterov, Kind::sgd_dampening, Kind::adamw};

std::unique_ptr<Optimizer> make_optimizer(Kind k, std::vector<nn::Parameter*> params) {
  switch (k) {
    case Kind::sgd_nesterov:
      return std::make_unique<SGD>(params, 0.05, 0.9, /*nesterov=*/true, /*weight_decay=*/0.01);
    case Kind::sgd_dampening:
      return std::make_unique<SGD>(params, 0.05, 0.8, /*nesterov=*/false, /*weight_decay=*/0.02,
                                   /*dampening=*/0.3);
    case Kind::adamw: return std::make_unique<AdamW>(params, 1e-2, std::pair{0.9, 0.95}, 1e-8, 0.1);
  }
  return nullptr;
}

// Step-t gradient values: signs and magnitudes from 2^-8 to 2^8 (in f16's range).
std::vector<float> grad_values(int t, int64_t n, int64_t salt) {
  std::vector<float> g(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    g[static_cast<size_t>(i)] =
        static_cast<float>(std::sin(1.3 * t + 0.7 * static_cast<double>(i + salt)) * std::exp2(i % 17 - 8));
  return g;
}

std::vector<float> init_values(int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<float>(std::cos(0.37 * i) * 1.5);
  return v;
}

// A decayed weight of n elements and an undecayed bias of 3.
struct Model {
  nn::Parameter w, b;
  explicit Model(int64_t n)
      : w(make_param("w", init_values(n))), b(make_param("b", {0.5f, -0.25f, 2.0f}, /*decay=*/false)) {}
  std::vector<nn::Parameter*> params() { return {&w, &b}; }
};

TEST(OptimizerTest, HalfGradsMatchF32GradsOfTheWidenedValuesBitForBit) {
  for (Kind kind : kKinds) {
    for (DType dtype : {DType::bf16, DType::f16}) {
      for (int64_t n : kSizes) {
        SCOPED_TRACE(::testing::Message() << kind_name(kind) << ", " << dtype_name(dtype) << ", n " << n);
        Model half(n), full(n);
        auto opt_half = make_optimizer(kind, half.params());
        auto opt_full = make_optimizer(kind, full.params());
        for (int t = 1; t <= 3; ++t) {
          half.w.grad = Tensor::from_vector(grad_values(t, n, 0), {n}, dtype);
          half.b.grad = Tensor::from_vector(grad_values(t, 3, 100), {3}, dtype);
          full.w.grad = half.w.grad.to(DType::f32);  // exact
          full.b.grad = half.b.grad.to(DType::f32);
          const std::vector<double> w_grad_before = half.w.grad.to_vector();
          opt_half->step();
          opt_full->step();
          EXPECT_EQ(half.w.grad.dtype(), dtype);
          EXPECT_EQ(half.w.grad.to_vector(), w_grad_before);  // grads are not modified
        }
        EXPECT_EQ(f32_bits(half.w.value), f32_bits(full.w.value));
        EXPECT_EQ(f32_bits(half.b.value), f32_bits(full.b.value));
        EXPECT_NE(half.w.value.to_vector(), Tensor::from_vector(init_values(n), {n}).to_vector());
      }
    }
  }
}

// Mixed precision's working copy (nn::Parameter::rounded): written in the
// same pass as the update, equal to rounding the updated value afterwards,
// for f32 grads read in place and for scaled half grads (the chunked path);
// a parameter without one is left alone.
TEST(OptimizerTest, RoundedCopyEqualsTheUpdatedValueRounded) {
  constexpr int64_t kN = 9000;  // more than two 4096-element pieces
  for (Kind kind : kKinds) {
    for (DType dtype : {DType::bf16, DType::f16}) {
      for (DType grad_dtype : {DType::f32, DType::bf16}) {
        SCOPED_TRACE(::testing::Message() << kind_name(kind) << ", " << dtype_name(dtype) << " copy, "
                                          << dtype_name(grad_dtype) << " grads");
        Model m(kN);
        m.w.rounded = Tensor::zeros({kN}, dtype);
        auto opt = make_optimizer(kind, m.params());
        if (grad_dtype != DType::f32) opt->set_grad_scale(0.5);
        for (int t = 1; t <= 2; ++t) {
          m.w.grad = Tensor::from_vector(grad_values(t, kN, 0), {kN}, grad_dtype);
          m.b.grad = Tensor::from_vector(grad_values(t, 3, 100), {3}, grad_dtype);
          m.w.rounded_fresh = false;
          opt->step();
          EXPECT_TRUE(m.w.rounded_fresh);
          EXPECT_FALSE(m.b.rounded_fresh);  // no copy to write
          EXPECT_EQ(m.w.rounded.to_vector(), m.w.value.to(dtype).to_vector()) << "step " << t;
        }
      }
    }
  }
  nn::Parameter p = make_param("w", {1, 2, 3});
  p.rounded = Tensor::zeros({2}, DType::bf16);
  AdamW opt({&p}, 1e-2);
  EXPECT_THAT([&] { opt.step(); }, ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("rounded is bf16 [2]")));
}

// What the trainer relies on: scaling inside step() equals scaling the grads
// first. f32: any factor. bf16/f16: only where the product scale_grads rounds
// back to the half dtype is exact: a power of two for bf16 (f32's exponent
// range), an upscale for f16 (a downscale would push small grads into f16
// subnormals and lose bits there; set_grad_scale does not).
TEST(OptimizerTest, GradScaleEqualsScaleGradsThenStepBitForBit) {
  struct Case {
    DType dtype;
    double factor;
  };
  const Case cases[] = {{DType::f32, 0.3}, {DType::f32, 1.0 / 3.0}, {DType::f32, 4096.0},
                        {DType::bf16, 1.0 / 1024.0}, {DType::bf16, 8.0}, {DType::f16, 8.0}};
  for (Kind kind : kKinds) {
    for (const Case& c : cases) {
      for (int64_t n : kSizes) {
        SCOPED_TRACE(::testing::Message() << kind_name(kind) << ", " << dtype_name(c.dtype) << ", factor "
                                          << c.factor << ", n " << n);
        Model inside(n), outside(n);
        auto opt_inside = make_optimizer(kind, inside.params());
        auto opt_outside = make_optimizer(kind, outside.params());
        opt_inside->set_grad_scale(c.factor);
        EXPECT_EQ(opt_inside->grad_scale(), c.factor);
        for (int t = 1; t <= 3; ++t) {
          inside.w.grad = Tensor::from_vector(grad_values(t, n, 0), {n}, c.dtype);
          inside.b.grad = Tensor::from_vector(grad_values(t, 3, 100), {3}, c.dtype);
          outside.w.grad = inside.w.grad.clone();
          outside.b.grad = inside.b.grad.clone();
          const std::vector<double> unscaled = inside.w.grad.to_vector();
          scale_grads(outside.params(), c.factor);
          opt_inside->step();
          opt_outside->step();
          EXPECT_EQ(inside.w.grad.to_vector(), unscaled);  // set_grad_scale leaves grads alone
        }
        EXPECT_EQ(f32_bits(inside.w.value), f32_bits(outside.w.value));
        EXPECT_EQ(f32_bits(inside.b.value), f32_bits(outside.b.value));
      }
    }
  }
}

// For a factor that is not a power of two, a half grad is scaled in f32 and
// not rounded back: the same as f32 grads holding float(g) * float(factor).
TEST(OptimizerTest, GradScaleOnHalfGradsMultipliesInF32WithoutRoundingBack) {
  for (Kind kind : kKinds) {
    for (DType dtype : {DType::bf16, DType::f16}) {
      SCOPED_TRACE(::testing::Message() << kind_name(kind) << ", " << dtype_name(dtype));
      constexpr int64_t n = 2500;
      const double factor = 0.3;
      Model half(n), full(n);
      auto opt_half = make_optimizer(kind, half.params());
      auto opt_full = make_optimizer(kind, full.params());
      opt_half->set_grad_scale(factor);
      for (int t = 1; t <= 3; ++t) {
        half.w.grad = Tensor::from_vector(grad_values(t, n, 0), {n}, dtype);
        half.b.grad = Tensor::from_vector(grad_values(t, 3, 100), {3}, dtype);
        full.w.grad = half.w.grad.to(DType::f32);
        full.b.grad = half.b.grad.to(DType::f32);
        const float f = static_cast<float>(factor);
        for (nn::Parameter* p : full.params()) {
          float* g = p->grad.data<float>();
          for (int64_t i = 0; i < p->grad.numel(); ++i) g[i] = g[i] * f;
        }
        opt_half->step();
        opt_full->step();
      }
      EXPECT_EQ(f32_bits(half.w.value), f32_bits(full.w.value));
      EXPECT_EQ(f32_bits(half.b.value), f32_bits(full.b.value));
    }
  }
}

TEST(OptimizerTest, RejectsBadGradDtypesLayoutsAndShapes) {
  for (Kind kind : kKinds) {
    SCOPED_TRACE(kind_name(kind));
    nn::Parameter w = make_param("layers.0.weight", {1.0f, 2.0f});
    auto opt = make_optimizer(kind, {&w});
    const std::string op = kind == Kind::adamw ? "AdamW::step" : "SGD::step";
    for (DType bad : {DType::f64, DType::i32}) {
      w.grad = Tensor::zeros({2}, bad);
      try {
        opt->step();
        FAIL() << "expected InvalidArgument for " << dtype_name(bad);
      } catch (const InvalidArgument& e) {
        EXPECT_EQ(e.op(), op);
        EXPECT_THAT(e.what(), HasSubstr("'layers.0.weight'"));
        EXPECT_THAT(e.what(), HasSubstr("dtype f32, bf16 or f16"));
        EXPECT_THAT(e.what(), HasSubstr(fmt::format("got dtype {}", dtype_name(bad))));
      }
    }
    EXPECT_EQ(w.value.to_vector(), (std::vector<double>{1.0, 2.0}));
    w.grad = Tensor::zeros({3}, DType::bf16);
    EXPECT_THAT(meshtrain::testing::error_of([&] { opt->step(); }), HasSubstr("got dtype bf16, shape [3]"));

    nn::Parameter m;
    m.name = "m";
    m.value = Tensor::zeros({2, 3}, DType::f32);
    m.grad = Tensor::zeros({3, 2}, DType::f16).transpose(0, 1);  // (2, 3), not contiguous
    auto opt_m = make_optimizer(kind, {&m});
    EXPECT_THAT(meshtrain::testing::error_of([&] { opt_m->step(); }), HasSubstr("contiguous=false"));
  }
}

TEST(OptimizerTest, RejectsBadGradScales) {
  nn::Parameter w = make_param("w", {1.0f});
  AdamW opt({&w}, 1e-3);
  opt.set_grad_scale(0.25);
  for (double bad : {0.0, -1.0, -0.0, HUGE_VAL, -HUGE_VAL, double{NAN}, 1e-50, 1e300}) {
    SCOPED_TRACE(bad);
    try {
      opt.set_grad_scale(bad);
      FAIL() << "expected InvalidArgument";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.op(), "AdamW::set_grad_scale");
      EXPECT_THAT(e.what(), HasSubstr("must be finite and > 0"));
    }
    EXPECT_EQ(opt.grad_scale(), 0.25);
  }
  // The extremes of f32 are accepted.
  opt.set_grad_scale(0x1p-149);
  opt.set_grad_scale(3.4e38);
  SGD sgd({&w}, 0.1);
  EXPECT_THAT(meshtrain::testing::error_of([&] { sgd.set_grad_scale(0.0); }),
              HasSubstr("SGD::set_grad_scale: grad scale 0 must be finite and > 0"));
}

}  // namespace
}  // namespace meshtrain::optim
