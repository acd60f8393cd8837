// DataParallel on the threads engine (1, 2 and 4 ranks): gradient parity with
// one rank for several bucket sizes, bucket assignment, overlap, gradient
// accumulation (full and partial windows), parameter broadcast and replica
// verification, and the error paths.
#include "meshtrain/parallel/data_parallel.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <thread>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/activations.h"
#include "meshtrain/nn/linear.h"
#include "meshtrain/nn/sequential.h"

namespace meshtrain::parallel {
namespace {

using ::testing::HasSubstr;

// y = tanh(x W1 + b1) W2 + b2, with explicit backward that reports gradients
// in reverse parameter order. Weights are (in, out) (the strategies'
// convention). `pause` sleeps between the two layers' backward, standing in
// for the compute of a deeper model.
class TinyMlp final : public nn::Module {
 public:
  TinyMlp(int64_t in, int64_t hidden, int64_t out, uint64_t seed,
          std::chrono::milliseconds pause = std::chrono::milliseconds(0))
      : pause_(pause) {
    init(w1_, "fc1.weight", {in, hidden}, seed);
    init(b1_, "fc1.bias", {hidden}, seed);
    init(w2_, "fc2.weight", {hidden, out}, seed);
    init(b2_, "fc2.bias", {out}, seed);
  }

  std::vector<nn::Parameter*> parameters() override { return {&w1_, &b1_, &w2_, &b2_}; }

  void skip_fc1_bias_hook() { skip_fc1_bias_ = true; }

 protected:
  Tensor do_forward(const Tensor& x, nn::Saved&) override {  // x (B, in) -> (B, out)
    x_ = x;
    a_ = matmul(x, w1_.value);  // (B, hidden)
    add_bias(a_, b1_.value);
    float* a = a_.data<float>();
    for (int64_t i = 0; i < a_.numel(); ++i) a[i] = std::tanh(a[i]);
    Tensor y = matmul(a_, w2_.value);  // (B, out)
    add_bias(y, b2_.value);
    return y;
  }

  Tensor do_backward_input(const Tensor&, nn::Saved&) override {
    throw Unsupported("TinyMlp", "no split backward", "use backward");
  }
  Tensor do_backward(const Tensor& dy, nn::Saved&) override {  // dy (B, out) -> dx (B, in)
    col_sum_into(dy, b2_.grad);
    notify_grad_ready(b2_);
    matmul(a_, dy, w2_.grad, true, false, 1.0, 1.0);  // += a^T dy
    notify_grad_ready(w2_);
    if (pause_.count() > 0) std::this_thread::sleep_for(pause_);
    Tensor dh = matmul(dy, w2_.value.transpose(0, 1));  // (B, hidden)
    const float* a = a_.data<float>();
    float* d = dh.data<float>();
    for (int64_t i = 0; i < dh.numel(); ++i) d[i] *= 1.0f - a[i] * a[i];
    col_sum_into(dh, b1_.grad);
    if (!skip_fc1_bias_) notify_grad_ready(b1_);
    matmul(x_, dh, w1_.grad, true, false, 1.0, 1.0);
    notify_grad_ready(w1_);
    return matmul(dh, w1_.value.transpose(0, 1));
  }

 private:
  static void init(nn::Parameter& p, const std::string& name, std::vector<int64_t> shape, uint64_t seed) {
    p.name = name;
    p.value = Tensor::empty(shape, DType::f32);
    fill_uniform(p.value.data<float>(), static_cast<size_t>(p.value.numel()), seed, key_from_name(name), 0,
                 -0.5f, 0.5f);
    p.grad = Tensor::zeros(shape, DType::f32);
    p.weight_decay = name.ends_with("weight");
  }
  static void add_bias(const Tensor& y, const Tensor& b) {
    float* py = y.data<float>();
    const float* pb = b.data<float>();
    const int64_t n = y.size(1);
    for (int64_t i = 0; i < y.numel(); ++i) py[i] += pb[i % n];
  }
  static void col_sum_into(const Tensor& dy, const Tensor& g) {  // g += sum over rows
    const Tensor c = dy.contiguous();
    const float* p = c.data<float>();
    float* pg = g.data<float>();
    const int64_t n = c.size(1);
    for (int64_t i = 0; i < c.numel(); ++i) pg[i % n] += p[i];
  }

  nn::Parameter w1_, b1_, w2_, b2_;
  Tensor x_, a_;
  std::chrono::milliseconds pause_;
  bool skip_fc1_bias_ = false;
};

constexpr int64_t kIn = 4, kHidden = 8, kOut = 3;
constexpr uint64_t kSeed = 100;  // rank 0's seed; rank r uses kSeed + r

Tensor uniform(std::vector<int64_t> shape, uint64_t seed, const char* what) {
  Tensor t = Tensor::empty(std::move(shape), DType::f32);
  fill_uniform(t.data<float>(), static_cast<size_t>(t.numel()), seed, key_from_name(what), 0, -1.0f, 1.0f);
  return t;
}

// Gradient of L = (1 / norm) * sum over samples of 0.5 * |y - t|^2.
Tensor loss_grad(const Tensor& y, const Tensor& t, double norm) {
  Tensor g = y.clone();
  axpy(-1.0, t, g);
  scale(g, 1.0 / norm);
  return g;
}

// max |a - b| <= rel * max |b|.
void expect_close(const Tensor& a, const Tensor& b, const std::string& what, double rel = 1e-6) {
  const auto va = a.to_vector(), vb = b.to_vector();
  ASSERT_EQ(va.size(), vb.size()) << what;
  double diff = 0, mag = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    diff = std::max(diff, std::abs(va[i] - vb[i]));
    mag = std::max(mag, std::abs(vb[i]));
  }
  EXPECT_LE(diff, rel * mag) << what << ": max abs diff " << diff << ", max abs " << mag;
}

// One rank's reference: rank 0's model on `rows` of the global batch, loss
// normalized by `norm`.
std::vector<Tensor> reference_grads(const Tensor& x, const Tensor& t, double norm) {
  TinyMlp ref(kIn, kHidden, kOut, kSeed);
  ref.backward(loss_grad(ref.forward(x), t, norm));
  std::vector<Tensor> g;
  for (nn::Parameter* p : ref.parameters()) g.push_back(p->grad.clone());
  return g;
}

void run_ranks(int n, const std::function<void(comm::Communicator&)>& fn) {
  comm::launch({.engine = comm::Engine::threads, .ranks = n, .timeout = std::chrono::seconds(30)}, fn);
}

TEST(DataParallel, GradientsEqualOneRankForEveryBucketSize) {
  constexpr int64_t kBatch = 8;
  const Tensor x = uniform({2 * kBatch, kIn}, 1, "x"), t = uniform({2 * kBatch, kOut}, 2, "t");
  for (int ranks : {1, 2, 4})
    for (size_t bucket : {size_t{4}, size_t{128}, size_t{25} << 20})
      for (auto [as_view, exact] : {std::pair{true, true}, {false, true}, {true, false}})
        for (GradReduce reduce : {GradReduce::avg, GradReduce::sum}) {
          SCOPED_TRACE(testing::Message() << ranks << " ranks, bucket_bytes " << bucket << ", view " << as_view
                                          << ", exact " << exact << ", reduce "
                                          << (reduce == GradReduce::avg ? "avg" : "sum"));
          run_ranks(ranks, [&](comm::Communicator& comm) {
            TinyMlp model(kIn, kHidden, kOut, kSeed + comm.rank());  // broadcast makes them equal
            DataParallel dp(model, comm,
                            {.bucket_bytes = bucket, .reduce = reduce, .gradient_as_bucket_view = as_view,
                             .exact_timing = exact});
            EXPECT_EQ(dp.buckets().size(), bucket == 4 ? 4u : bucket == 128 ? 3u : 1u);
            for (int step = 0; step < 2; ++step) {  // two steps: state resets, zero_grad reaches the buckets
              const Tensor gx = x.narrow(0, step * kBatch, kBatch), gt = t.narrow(0, step * kBatch, kBatch);
              const Tensor lx = shard_batch(gx, comm), lt = shard_batch(gt, comm);
              const double norm = reduce == GradReduce::avg ? double(lx.size(0)) : double(kBatch);
              model.zero_grad();
              model.backward(loss_grad(model.forward(lx), lt, norm));
              dp.finish();
              const auto want = reference_grads(gx, gt, kBatch);
              const auto params = model.parameters();
              for (size_t i = 0; i < params.size(); ++i) expect_close(params[i]->grad, want[i], params[i]->name);
              EXPECT_EQ(dp.stats().steps, step + 1);
              EXPECT_EQ(dp.stats().bytes_reduced, 4 * (32 + 8 + 24 + 3));
            }
          });
        }
}

TEST(DataParallel, BucketsFollowReverseParameterOrder) {
  run_ranks(1, [](comm::Communicator& comm) {
    auto names = [](const BucketInfo& b) {
      std::vector<std::string> v;
      for (const auto& s : b.slots) v.push_back(s.name);
      return v;
    };
    using V = std::vector<std::string>;
    {
      TinyMlp model(kIn, kHidden, kOut, kSeed);
      DataParallel dp(model, comm);  // 25 MiB: one bucket
      ASSERT_EQ(dp.buckets().size(), 1u);
      EXPECT_EQ(names(dp.buckets()[0]), (V{"fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"}));
      EXPECT_EQ(dp.buckets()[0].slots[2].offset, 3 + 24);
      EXPECT_EQ(dp.buckets()[0].numel, 67);
    }
    {
      // 100 bytes: fc2.bias (12 B) then fc2.weight (96 B) overflows; fc1.weight
      // (128 B) is larger than a bucket and gets its own.
      TinyMlp model(kIn, kHidden, kOut, kSeed);
      MemoryTracker tracker;
      {
        DataParallel dp(model, comm, {.bucket_bytes = 100, .tracker = &tracker});
        ASSERT_EQ(dp.buckets().size(), 4u);
        EXPECT_EQ(names(dp.buckets()[0]), V{"fc2.bias"});
        EXPECT_EQ(names(dp.buckets()[3]), V{"fc1.weight"});
        EXPECT_EQ(dp.buckets()[3].bytes(), 128u);
        EXPECT_EQ(tracker.in_use(MemoryCategory::comm_buffers), 4u * 67);
        // The gradients are views into the buckets.
        const auto params = model.parameters();
        for (nn::Parameter* p : params) {
          EXPECT_EQ(p->grad.storage()->tracker(), &tracker) << p->name;
          EXPECT_EQ(p->grad.storage()->category(), MemoryCategory::comm_buffers) << p->name;
        }
      }
      // The grads still use the buckets' storage after DataParallel is gone.
      EXPECT_EQ(tracker.in_use(MemoryCategory::comm_buffers), 4u * 67);
    }
    {
      TinyMlp model(kIn, kHidden, kOut, kSeed);
      DataParallel dp(model, comm, {.bucket_bytes = 128});
      ASSERT_EQ(dp.buckets().size(), 3u);
      EXPECT_EQ(names(dp.buckets()[0]), (V{"fc2.bias", "fc2.weight"}));
      EXPECT_EQ(names(dp.buckets()[1]), V{"fc1.bias"});
      EXPECT_EQ(names(dp.buckets()[2]), V{"fc1.weight"});
      const auto params = model.parameters();  // w1, b1, w2, b2
      EXPECT_EQ(params[2]->grad.storage(), params[3]->grad.storage());  // one bucket, one buffer
      EXPECT_EQ(params[2]->grad.storage_offset(), 3);                    // after fc2.bias
      EXPECT_NE(params[1]->grad.storage(), params[2]->grad.storage());
    }
  });
}

TEST(DataParallel, AllReduceOverlapsTheRestOfBackward) {
  // fc2's buckets are launched, then backward pauses 40 ms (the "rest of the
  // model"); they must complete during the pause.
  for (int ranks : {2, 4})
  for (bool exact : {true, false}) {
    std::vector<DataParallelStats> stats(ranks);
    run_ranks(ranks, [&](comm::Communicator& comm) {
      TinyMlp model(256, 512, 256, kSeed, std::chrono::milliseconds(40));
      DataParallel dp(model, comm, {.bucket_bytes = 1, .exact_timing = exact});
      const Tensor x = shard_batch(uniform({8, 256}, 1, "x"), comm), t = shard_batch(uniform({8, 256}, 2, "t"), comm);
      for (int step = 0; step < 3; ++step) {
        comm.barrier();  // start backward together, as a real step would
        model.zero_grad();
        model.backward(loss_grad(model.forward(x), t, 8));
        dp.finish();
      }
      stats[comm.rank()] = dp.stats();
    });
    for (int r = 0; r < ranks; ++r) {
      const DataParallelStats& s = stats[r];
      ASSERT_EQ(s.buckets.size(), 4u);
      if (exact) {
        EXPECT_EQ(s.timing, CommTiming::exact);  // the threads engine allows it
        EXPECT_EQ(s.comm_time_min.count(), s.comm_time.count());
      } else {
        EXPECT_EQ(s.timing, CommTiming::polled);
      }
      EXPECT_TRUE(s.buckets[0].completed_before_finish) << "rank " << r;
      EXPECT_TRUE(s.buckets[1].completed_before_finish) << "rank " << r;
      EXPECT_GT(s.hidden_fraction, 0.0);
      EXPECT_LE(s.hidden_fraction, 1.0);
      EXPECT_LE(s.hidden_fraction_min, s.hidden_fraction);
      EXPECT_LE(s.comm_time_min.count(), s.comm_time.count());
      EXPECT_LT(s.exposed_time.count(), s.comm_time.count());  // bucket 0 ran before finish()
      EXPECT_GE(s.wait_time.count(), 0.0);
      EXPECT_EQ(s.steps, 3);
      std::printf("[overlap] %s, %d ranks, rank %d: comm %.3f ms (>= %.3f ms), exposed %.3f ms, finish waited "
                  "%.3f ms, hidden %.4f (>= %.4f)\n",
                  exact ? "exact" : "polled", ranks, r, 1e3 * s.comm_time.count(), 1e3 * s.comm_time_min.count(),
                  1e3 * s.exposed_time.count(), 1e3 * s.wait_time.count(), s.hidden_fraction, s.hidden_fraction_min);
    }
  }
}

// k micro-batches of `kMicro` global samples each; reduce/normalization per mode.
struct AccumCase {
  GradReduce reduce;
  bool as_view;
  int count;      // the window's declared count
  int run;        // micro-batches actually run (< count: ended early by finish)
};

void run_accumulation(int ranks, const AccumCase& c) {
  constexpr int64_t kMicro = 8;
  const Tensor x = uniform({4 * kMicro, kIn}, 3, "x"), t = uniform({4 * kMicro, kOut}, 4, "t");
  const int64_t total = c.run * kMicro;
  const auto want = reference_grads(x.narrow(0, 0, total), t.narrow(0, 0, total), double(total));
  run_ranks(ranks, [&](comm::Communicator& comm) {
    TinyMlp model(kIn, kHidden, kOut, kSeed);
    DataParallel dp(model, comm, {.bucket_bytes = 128, .reduce = c.reduce, .gradient_as_bucket_view = c.as_view});
    const uint64_t seq0 = comm.seq();
    for (int i = 0; i < c.run; ++i) {
      dp.begin_micro_batch(i, c.count);
      const Tensor lx = shard_batch(x.narrow(0, i * kMicro, kMicro), comm);
      const Tensor lt = shard_batch(t.narrow(0, i * kMicro, kMicro), comm);
      // sum: normalize by the window's global sample count; avg: per-micro-batch local mean.
      const double norm = c.reduce == GradReduce::sum ? double(total) : double(lx.size(0));
      model.backward(loss_grad(model.forward(lx), lt, norm));
      const bool last = i == c.count - 1;
      EXPECT_EQ(comm.seq(), seq0 + (last ? dp.buckets().size() : 0)) << "micro-batch " << i;
    }
    dp.finish();
    EXPECT_EQ(dp.stats().micro_batches, c.run);
    EXPECT_EQ(dp.stats().flushed_early, c.run < c.count);
    const auto params = model.parameters();
    for (size_t i = 0; i < params.size(); ++i) expect_close(params[i]->grad, want[i], params[i]->name);
  });
}

TEST(DataParallel, AccumulationEqualsOneLargerBatch) {
  for (int ranks : {1, 2, 4})
    for (GradReduce reduce : {GradReduce::avg, GradReduce::sum})
      for (bool as_view : {true, false}) {
        SCOPED_TRACE(testing::Message() << ranks << " ranks, reduce " << (reduce == GradReduce::avg ? "avg" : "sum")
                                        << ", view " << as_view);
        run_accumulation(ranks, {reduce, as_view, 4, 4});  // k = 4 == one 4x batch
      }
}

// Counts grad_ready calls: a second hook stacked with DataParallel's.
class CountingHook : public nn::ParamHook {
 public:
  void grad_ready(nn::Parameter&) override { ++ready; }
  int ready = 0;
};

TEST(DataParallel, GPipeOrderSplitBackwardAndAStackedHookEqualOneRank) {
  constexpr int64_t kMicro = 8, kM = 2;
  const Tensor x = uniform({kM * kMicro, kIn}, 3, "x"), t = uniform({kM * kMicro, kOut}, 4, "t");
  auto build = [](nn::Sequential& net) {
    net.add(std::make_unique<nn::Linear>(kIn, kHidden, net.next_name(), kSeed));
    net.add(std::make_unique<nn::Tanh>());
    net.add(std::make_unique<nn::Linear>(kHidden, kOut, net.next_name(), kSeed));
  };
  nn::Sequential ref;
  build(ref);
  ref.backward(loss_grad(ref.forward(x), t, double(kM * kMicro)));
  for (int ranks : {1, 2}) {
    run_ranks(ranks, [&](comm::Communicator& comm) {
      nn::Sequential model;
      build(model);
      CountingHook counter;
      model.add_hook(&counter);
      DataParallel dp(model, comm, {.bucket_bytes = 64, .reduce = GradReduce::sum});
      nn::Saved saved[kM];
      std::vector<Tensor> dys;
      for (int i = 0; i < kM; ++i) {  // every forward first (GPipe), then every backward
        const Tensor lx = shard_batch(x.narrow(0, i * kMicro, kMicro), comm);
        const Tensor lt = shard_batch(t.narrow(0, i * kMicro, kMicro), comm);
        dys.push_back(loss_grad(model.forward(lx, saved[i]), lt, double(kM * kMicro)));
      }
      for (int i = 0; i < kM; ++i) {
        dp.begin_micro_batch(i, kM);
        model.backward_input(dys[static_cast<size_t>(i)], saved[i]);
        model.backward_weight(saved[i]);
      }
      dp.finish();
      EXPECT_EQ(counter.ready, kM * 4);  // both hooks saw every gradient of every micro-batch
      const auto got = model.parameters(), want = ref.parameters();
      for (size_t k = 0; k < got.size(); ++k) expect_close(got[k]->grad, want[k]->grad, got[k]->name, 1e-5);
    });
  }
}

TEST(DataParallel, PartialWindowDividesByItsRealCount) {
  for (int ranks : {1, 2, 4})
    for (GradReduce reduce : {GradReduce::avg, GradReduce::sum})
      for (bool as_view : {true, false}) {
        SCOPED_TRACE(testing::Message() << ranks << " ranks, reduce " << (reduce == GradReduce::avg ? "avg" : "sum")
                                        << ", view " << as_view);
        run_accumulation(ranks, {reduce, as_view, 4, 2});  // 2 of k = 4, ended by finish()
        run_accumulation(ranks, {reduce, as_view, 2, 2});  // declared as a 2-window
      }
}

TEST(DataParallel, BroadcastsFromRankZeroAndCatchesACorruptedReplica) {
  std::vector<std::string> errors(4);
  std::vector<std::vector<int>> error_ranks(4);
  std::vector<std::string> error_params(4);
  run_ranks(4, [&](comm::Communicator& comm) {
    TinyMlp model(kIn, kHidden, kOut, kSeed + 7 * comm.rank());
    TinyMlp rank0(kIn, kHidden, kOut, kSeed);
    DataParallel dp(model, comm);
    for (size_t i = 0; i < 4; ++i)
      EXPECT_EQ(model.parameters()[i]->value.to_vector(), rank0.parameters()[i]->value.to_vector());
    dp.verify_replicas();  // equal: no error
    if (comm.rank() == 2) {
      float* w = model.parameters()[2]->value.data<float>();  // fc2.weight
      w[5] = std::nextafter(w[5], 1.0f);                      // one ulp
    }
    try {
      dp.verify_replicas();
    } catch (const ReplicaMismatchError& e) {
      errors[comm.rank()] = e.what();
      error_ranks[comm.rank()] = e.ranks();
      error_params[comm.rank()] = e.parameter();
    }
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_THAT(errors[r], HasSubstr("'fc2.weight'")) << "rank " << r;
    EXPECT_THAT(errors[r], HasSubstr("rank(s) 2")) << "rank " << r;
    EXPECT_EQ(error_ranks[r], std::vector<int>{2});
    EXPECT_EQ(error_params[r], "fc2.weight");
  }
}

TEST(DataParallel, DifferentModelsAcrossRanksAreRejected) {
  std::vector<std::string> errors(2);
  run_ranks(2, [&](comm::Communicator& comm) {
    TinyMlp model(kIn, comm.rank() == 1 ? kHidden + 1 : kHidden, kOut, kSeed);
    try {
      DataParallel dp(model, comm);
    } catch (const InvalidArgument& e) {
      errors[comm.rank()] = e.what();
    }
  });
  for (const auto& e : errors) EXPECT_THAT(e, HasSubstr("rank(s) 1 have different parameters"));
}

TEST(DataParallel, MisuseIsAnError) {
  run_ranks(1, [](comm::Communicator& comm) {
    const Tensor x = uniform({4, kIn}, 1, "x"), t = uniform({4, kOut}, 2, "t");
    {
      TinyMlp model(kIn, kHidden, kOut, kSeed);
      DataParallel dp(model, comm);
      EXPECT_THROW(dp.begin_micro_batch(1, 4), InvalidArgument);  // no window open
      EXPECT_THROW(dp.begin_micro_batch(0, 0), InvalidArgument);
      dp.begin_micro_batch(0, 4);
      EXPECT_THROW(dp.begin_micro_batch(1, 4), InvalidArgument);  // micro-batch 0 had no backward
      model.backward(loss_grad(model.forward(x), t, 4));
      EXPECT_THROW(dp.begin_micro_batch(2, 4), InvalidArgument);  // skips 1
      EXPECT_THROW(dp.begin_micro_batch(1, 3), InvalidArgument);  // other count
      dp.begin_micro_batch(1, 4);
      model.backward(loss_grad(model.forward(x), t, 4));
      try {
        model.backward(loss_grad(model.forward(x), t, 4));  // no finish/begin between
        ADD_FAILURE() << "expected an error";
      } catch (const InvalidArgument& e) {
        EXPECT_THAT(e.what(), HasSubstr("second grad_ready for 'fc2.bias'"));
      }
    }
    {
      TinyMlp model(kIn, kHidden, kOut, kSeed);
      model.skip_fc1_bias_hook();
      DataParallel dp(model, comm);
      model.backward(loss_grad(model.forward(x), t, 4));
      try {
        dp.finish();
        ADD_FAILURE() << "expected an error";
      } catch (const InvalidArgument& e) {
        EXPECT_THAT(e.what(), HasSubstr("1 of 4 parameters: 'fc1.bias'"));
      }
    }
    {
      TinyMlp model(kIn, kHidden, kOut, kSeed);
      EXPECT_THROW({ DataParallel bad(model, comm, {.bucket_bytes = 0}); }, InvalidArgument);
      nn::Parameter stranger;
      stranger.name = "stranger";
      stranger.value = stranger.grad = Tensor::zeros({2}, DType::f32);
      DataParallel dp(model, comm);
      EXPECT_THROW(dp.grad_ready(stranger), InvalidArgument);
      dp.finish();  // nothing ran: a no-op
      EXPECT_EQ(dp.stats().steps, 0);
    }
  });
}

TEST(DataParallel, ShardBatchTakesThisRanksRows) {
  const Tensor x = Tensor::from_vector(std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7}, {4, 2});
  EXPECT_EQ(shard_batch(x, 1, 2).to_vector(), (std::vector<double>{4, 5, 6, 7}));
  EXPECT_EQ(shard_batch(x, 3, 4).to_vector(), (std::vector<double>{6, 7}));
  EXPECT_EQ(shard_batch(x, 0, 1).storage(), x.storage());  // a view
  try {
    shard_batch(x, 0, 3);
    ADD_FAILURE() << "expected an error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("global batch 4 is not divisible by the data axis size 3"));
  }
  EXPECT_THROW(shard_batch(x, 2, 2), InvalidArgument);
  EXPECT_THROW(shard_batch(Tensor(), 0, 1), InvalidArgument);
}

}  // namespace
}  // namespace meshtrain::parallel
