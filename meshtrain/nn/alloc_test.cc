// Steady-state training steps allocate no tensor storage: every output and
// gradient buffer of the MLP (with dropout), the VAE and the losses is reused.
// Its own executable, because it replaces the global aligned operator new
// (the one Storage::allocate uses) to count calls.
#include <gtest/gtest.h>

#include <cstdlib>
#include <new>
#include <vector>

#include "meshtrain/core/random.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/nn/mlp.h"
#include "meshtrain/nn/vae.h"

namespace {
long g_aligned_allocations = 0;  // test-only counter; the test is single-threaded

void* counted_aligned_alloc(std::size_t n, std::align_val_t a) noexcept {
  ++g_aligned_allocations;
  const std::size_t align = static_cast<std::size_t>(a);
  const std::size_t size = n == 0 ? align : (n + align - 1) / align * align;  // aligned_alloc's rule
  return std::aligned_alloc(align, size);
}
}  // namespace

void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return counted_aligned_alloc(n, a);
}
void* operator new(std::size_t n, std::align_val_t a) {
  void* p = counted_aligned_alloc(n, a);
  if (!p) throw std::bad_alloc();
  return p;
}
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }

namespace meshtrain::nn {
namespace {

TEST(Buffers, SteadyStateStepsAllocateNoTensorStorage) {
  MLP mlp(MLPConfig{.sizes = {48, 32, 32, 10}, .dropout = 0.1, .seed = 1, .prefix = ""});
  VAE vae(VAEConfig{.input = 48, .hidden = {32, 16}, .latent = 4, .seed = 2, .prefix = "vae"});
  CrossEntropyLoss ce;
  Tensor x = Tensor::empty({16, 48}, DType::f32);
  fill_uniform(x, 1, 2, 0.0, 1.0);
  Tensor y = Tensor::from_vector(std::vector<int64_t>(16, 3), {16});
  long warm = 0;
  for (uint64_t step = 0; step < 6; ++step) {
    if (step == 2) warm = g_aligned_allocations;
    mlp.set_batch_context(step, 0);
    vae.set_batch_context(step, 0);
    ce.forward(mlp.forward(x), y);
    mlp.backward(ce.backward());
    vae.forward_backward(x);
  }
  EXPECT_GT(warm, 0);  // the counter sees Storage allocations at all
  EXPECT_EQ(g_aligned_allocations - warm, 0);
}

}  // namespace
}  // namespace meshtrain::nn
