#include "meshtrain/data/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <filesystem>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/core/random.h"

namespace meshtrain::data {
namespace {

std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), int64_t{0});
  return v;
}

std::vector<int64_t> sorted(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

// A tiny in-memory dataset: image i has every pixel equal to i % 256 and label i % 10.
Dataset make_dataset(int64_t n, int64_t h = 2, int64_t w = 2) {
  Dataset d;
  d.height = h;
  d.width = w;
  d.num_classes = 10;
  d.source = "synthetic";
  d.images = Tensor::empty({n, h * w}, DType::u8);
  d.labels = Tensor::empty({n}, DType::u8);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t k = 0; k < h * w; ++k) d.images.data<uint8_t>()[i * h * w + k] = static_cast<uint8_t>(i % 256);
    d.labels.data<uint8_t>()[i] = static_cast<uint8_t>(i % 10);
  }
  return d;
}

TEST(EpochPermutationTest, CoversTheDatasetOnceAndDependsOnSeedAndEpoch) {
  for (int64_t n : {1, 2, 7, 1000}) {
    for (int64_t epoch : {0, 1, 5}) {
      const std::vector<int64_t> p = epoch_permutation(n, 42, epoch);
      EXPECT_EQ(sorted(p), iota(n)) << n << " " << epoch;
      EXPECT_EQ(p, epoch_permutation(n, 42, epoch));  // deterministic
    }
  }
  const std::vector<int64_t> e0 = epoch_permutation(1000, 42, 0);
  EXPECT_NE(e0, epoch_permutation(1000, 42, 1));
  EXPECT_NE(e0, epoch_permutation(1000, 43, 0));
  EXPECT_NE(e0, iota(1000));
  EXPECT_TRUE(epoch_permutation(0, 1, 0).empty());
  EXPECT_THROW(epoch_permutation(10, 1, -1), InvalidArgument);
  EXPECT_THROW(epoch_permutation(10, 1, int64_t{1} << 32), InvalidArgument);
}

// Pins the documented stream: n = 3, epoch 2, seed 7.
TEST(EpochPermutationTest, FollowsTheDocumentedFisherYatesStream) {
  const uint64_t seed = 0x0000000700000003ull;
  const PhiloxKey key{3, 7};
  std::vector<int64_t> expected{0, 1, 2};
  for (uint64_t i = 2; i >= 1; --i) {
    const PhiloxCounter w = philox4x32_10({static_cast<uint32_t>(i), 0, 2, kSamplerStream}, key);
    const uint64_t x = uint64_t{w[0]} | (uint64_t{w[1]} << 32);
    // Rejection happens only with probability < 3 / 2^64: the first value is used.
    const uint64_t j = static_cast<uint64_t>((static_cast<unsigned __int128>(x) * (i + 1)) >> 64);
    std::swap(expected[i], expected[j]);
  }
  EXPECT_EQ(epoch_permutation(3, seed, 2), expected);
}

TEST(EpochPermutationTest, IsRoughlyUniform) {
  // Each of the 6 orders of 3 elements over 6000 epochs: ~1000 each.
  std::vector<int> counts(6, 0);
  const std::vector<std::vector<int64_t>> orders{{0, 1, 2}, {0, 2, 1}, {1, 0, 2}, {1, 2, 0}, {2, 0, 1}, {2, 1, 0}};
  for (int64_t e = 0; e < 6000; ++e) {
    const auto p = epoch_permutation(3, 9, e);
    ++counts[static_cast<size_t>(std::find(orders.begin(), orders.end(), p) - orders.begin())];
  }
  for (int c : counts) EXPECT_NEAR(c, 1000, 130);  // > 4 sigma
}

TEST(DistributedSamplerTest, RankSlicesConcatenateToTheGlobalBatch) {
  const int64_t n = 1000, g = 40;
  for (bool drop_last : {true, false}) {
    const DistributedSampler one(n, g, 7, drop_last);
    for (int d : {1, 2, 4}) {
      std::vector<DistributedSampler> ranks;
      for (int r = 0; r < d; ++r) ranks.emplace_back(n, g, 7, drop_last, r, d);
      for (int64_t epoch : {0, 3}) {
        for (int64_t b = 0; b < one.num_batches(); ++b) {
          std::vector<int64_t> joined;
          for (int r = 0; r < d; ++r) {
            const std::vector<int64_t> part = ranks[static_cast<size_t>(r)].batch(epoch, b);
            EXPECT_EQ(ranks[static_cast<size_t>(r)].first_global_sample(b), static_cast<int64_t>(joined.size()));
            EXPECT_EQ(static_cast<int64_t>(part.size()), g / d);
            EXPECT_EQ(ranks[static_cast<size_t>(r)].local_batch_size(b), g / d);
            joined.insert(joined.end(), part.begin(), part.end());
          }
          EXPECT_EQ(joined, one.global_batch(epoch, b)) << "d=" << d << " b=" << b;
          EXPECT_EQ(joined, one.batch(epoch, b));
        }
      }
    }
  }
}

TEST(DistributedSamplerTest, EpochCoversTheDatasetExactlyOnceAndEpochsDiffer) {
  const DistributedSampler s(100, 10, 3, true);
  EXPECT_EQ(s.num_batches(), 10);
  std::vector<int64_t> all0, all1;
  for (int64_t b = 0; b < s.num_batches(); ++b) {
    const auto b0 = s.global_batch(0, b), b1 = s.global_batch(1, b);
    all0.insert(all0.end(), b0.begin(), b0.end());
    all1.insert(all1.end(), b1.begin(), b1.end());
  }
  EXPECT_EQ(sorted(all0), iota(100));
  EXPECT_EQ(sorted(all1), iota(100));
  EXPECT_EQ(all0, s.permutation(0));
  EXPECT_NE(all0, all1);
  EXPECT_NE(s.global_batch(0, 0), s.global_batch(1, 0));
  // A copy (sharing the cache) and a fresh sampler agree.
  const DistributedSampler copy = s;
  EXPECT_EQ(copy.global_batch(1, 4), DistributedSampler(100, 10, 3, true).global_batch(1, 4));
}

TEST(DistributedSamplerTest, DropLastDropsThePartialBatch) {
  // 103 samples, G = 10: 10 full batches; 3 samples left out, different ones per epoch.
  const DistributedSampler s(103, 10, 11, /*drop_last=*/true, 1, 2);
  EXPECT_EQ(s.num_batches(), 10);
  EXPECT_EQ(s.samples_per_epoch(), 100);
  EXPECT_EQ(s.global_batch_size(9), 10);
  EXPECT_THROW(s.batch(0, 10), InvalidArgument);
  const auto p0 = s.permutation(0), p1 = s.permutation(1);
  EXPECT_NE(std::vector<int64_t>(p0.begin() + 100, p0.end()), std::vector<int64_t>(p1.begin() + 100, p1.end()));
}

TEST(DistributedSamplerTest, KeptPartialBatchSplitsAsEvenlyAsPossible) {
  // 103 samples, G = 20, d = 4: 5 full batches of 20 (5 per rank), then a last
  // batch of 3: ranks 0..2 get one sample each, rank 3 an empty slice.
  const int d = 4;
  const DistributedSampler one(103, 20, 5, /*drop_last=*/false);
  EXPECT_EQ(one.num_batches(), 6);
  EXPECT_EQ(one.samples_per_epoch(), 103);
  EXPECT_EQ(one.global_batch_size(4), 20);
  EXPECT_EQ(one.global_batch_size(5), 3);
  const auto last = one.global_batch(2, 5);
  const auto perm = one.permutation(2);
  EXPECT_EQ(last, std::vector<int64_t>(perm.begin() + 100, perm.end()));
  const std::vector<int64_t> sizes{1, 1, 1, 0}, firsts{0, 1, 2, 3};
  std::vector<int64_t> joined;
  for (int r = 0; r < d; ++r) {
    const DistributedSampler s(103, 20, 5, false, r, d);
    EXPECT_EQ(s.global_batch_size(5), 3);
    EXPECT_EQ(s.local_batch_size(5), sizes[static_cast<size_t>(r)]) << r;
    EXPECT_EQ(s.first_global_sample(5), firsts[static_cast<size_t>(r)]) << r;
    const auto part = s.batch(2, 5);
    joined.insert(joined.end(), part.begin(), part.end());
  }
  EXPECT_EQ(joined, last);

  // 10 left over on 4 ranks: 3, 3, 2, 2 starting at 0, 3, 6, 8.
  for (int r = 0; r < d; ++r) {
    const DistributedSampler s(50, 40, 5, false, r, d);
    EXPECT_EQ(s.global_batch_size(1), 10);
    EXPECT_EQ(s.local_batch_size(1), (std::vector<int64_t>{3, 3, 2, 2})[static_cast<size_t>(r)]);
    EXPECT_EQ(s.first_global_sample(1), (std::vector<int64_t>{0, 3, 6, 8})[static_cast<size_t>(r)]);
  }
  // A dataset smaller than one batch: a single partial batch.
  const DistributedSampler tiny(5, 8, 1, false);
  EXPECT_EQ(tiny.num_batches(), 1);
  EXPECT_EQ(tiny.global_batch_size(0), 5);
  EXPECT_EQ(sorted(tiny.batch(0, 0)), iota(5));
}

TEST(DistributedSamplerTest, ErrorsNameTheValues) {
  try {
    DistributedSampler(100, 10, 0, true, 0, 4);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()),
              "DistributedSampler: global batch 10 is not divisible by the data-parallel size 4 (hint: use a "
              "multiple of 4, e.g. 8 or 12)");
  }
  try {
    DistributedSampler(5, 8, 0, true);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()),
              "DistributedSampler: drop_last with global batch 8 > dataset size 5 leaves no batch (hint: use a "
              "smaller global batch or drop_last=false)");
  }
  EXPECT_THROW(DistributedSampler(100, 10, 0, true, 2, 2), InvalidArgument);
  EXPECT_THROW(DistributedSampler(100, 10, 0, true, -1, 2), InvalidArgument);
  EXPECT_THROW(DistributedSampler(0, 10, 0, false), InvalidArgument);
  EXPECT_THROW(DistributedSampler(100, 0, 0, false), InvalidArgument);
  const DistributedSampler s(100, 10, 0, true);
  try {
    s.batch(0, 10);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()),
              "DistributedSampler::global_batch_size: batch 10 is outside [0, 10) (hint: num_batches() gives the "
              "batches per epoch)");
  }
  EXPECT_THROW(s.batch(-1, 0), InvalidArgument);
}

// Training batches and evaluation (normalize_pixels of the dataset's rows)
// turn every byte value into the same float: x / 255, as ToTensor.
TEST(LoadBatchTest, TrainingAndEvaluationNormalizePixelsIdentically) {
  const Dataset data = make_dataset(256, 1, 2);  // image i has pixels i, i
  const DistributedSampler s(256, 256, 3, false, 0, 1);
  const Batch batch = load_batch(data, s, 0, 0);
  const Tensor eval = normalize_pixels(data.images.narrow(0, 0, 256));
  ASSERT_EQ(eval.shape(), (std::vector<int64_t>{256, 2}));
  ASSERT_EQ(eval.dtype(), DType::f32);
  int differs_from_multiply = 0;
  for (int64_t r = 0; r < 256; ++r) {
    const int64_t row = batch.indices[static_cast<size_t>(r)];
    for (int64_t k = 0; k < 2; ++k) {
      const float train = batch["images"].data<float>()[r * 2 + k];
      const float test = eval.data<float>()[row * 2 + k];
      ASSERT_EQ(std::bit_cast<uint32_t>(train), std::bit_cast<uint32_t>(test)) << "pixel " << row;
      ASSERT_EQ(train, static_cast<float>(row) / 255.0f) << "pixel " << row;
    }
    differs_from_multiply += normalize_pixel(static_cast<uint8_t>(row)) !=
                             static_cast<float>(row) * static_cast<float>(1.0 / 255.0);
  }
  EXPECT_GT(differs_from_multiply, 0);  // why one rule matters: x * f32(1/255) is not x / 255
  EXPECT_THROW(normalize_pixels(Tensor::zeros({2}, DType::f32)), InvalidArgument);
}

TEST(LoadBatchTest, GathersAndConvertsTheLocalSlice) {
  const Dataset data = make_dataset(30);
  const DistributedSampler s(30, 8, 2, false, 1, 2);
  MemoryTracker tracker;
  const Batch batch = load_batch(data, s, 1, 0, &tracker);
  EXPECT_EQ(batch.indices, s.batch(1, 0));
  EXPECT_EQ(batch.global_size, 8);
  EXPECT_EQ(batch.first_global_sample, 4);
  EXPECT_EQ(batch["images"].shape(), (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(batch["images"].dtype(), DType::f32);
  EXPECT_EQ(batch["labels"].dtype(), DType::i64);
  for (int64_t r = 0; r < 4; ++r) {
    const int64_t row = batch.indices[static_cast<size_t>(r)];
    EXPECT_EQ(batch["labels"].item({r}), static_cast<double>(row % 10));
    for (int64_t k = 0; k < 4; ++k)
      EXPECT_EQ(batch["images"].item({r, k}), static_cast<double>(static_cast<float>(row % 256) / 255.0f));
  }
  EXPECT_EQ(tracker.in_use(MemoryCategory::activations), 4u * 4u * 4u + 4u * 8u);
  // The last batch (30 = 3 * 8 + 6) on rank 1 of 2: samples 3..5 of 6.
  const Batch last = load_batch(data, s, 1, 3);
  EXPECT_EQ(last.global_size, 6);
  EXPECT_EQ(last.first_global_sample, 3);
  EXPECT_EQ(last["images"].size(0), 3);
  EXPECT_THROW(load_batch(make_dataset(31), s, 0, 0), InvalidArgument);
}

TEST(BatchTest, NamedTensorsSliceIntoMicroBatches) {
  Batch b;
  b.indices = {10, 11, 12, 13};
  b.global_size = 8;
  b.first_global_sample = 4;
  b.add("tokens", Tensor::from_vector(std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8}, {4, 2}));
  b.add("targets", Tensor::from_vector(std::vector<int64_t>{2, 3, 4, 5, 6, 7, 8, 9}, {4, 2}));
  EXPECT_EQ(b.size(), 4);
  const Batch m = b.rows(1, 3);
  EXPECT_EQ(m.size(), 2);
  EXPECT_EQ(m.first_global_sample, 5);
  EXPECT_EQ(m.global_size, 8);
  EXPECT_EQ(m.indices, (std::vector<int64_t>{11, 12}));
  EXPECT_EQ(m["targets"].to_vector(), (std::vector<double>{4, 5, 6, 7}));
  EXPECT_THROW(b.add("tokens", Tensor::zeros({4, 2}, DType::i64)), InvalidArgument);  // name taken
  EXPECT_THROW(b.add("mask", Tensor::zeros({3, 2}, DType::i64)), InvalidArgument);    // 3 samples, not 4
  EXPECT_THROW((void)b.rows(2, 5), InvalidArgument);
  try {
    (void)b["images"];
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("no tensor 'images' (it holds: tokens, targets)"), std::string::npos)
        << e.what();
  }
}

TEST(PrefetcherTest, DeliversBatchesInOrderEqualToSynchronousLoading) {
  const Dataset data = make_dataset(200);
  const DistributedSampler s(200, 16, 9, false, 1, 4);
  for (int64_t epoch : {0, 1}) {
    Prefetcher pf([&](int64_t b) { return load_batch(data, s, epoch, b); }, 0, s.num_batches());
    int64_t b = 0;
    while (std::optional<Batch> batch = pf.next()) {
      const Batch sync = load_batch(data, s, epoch, b);
      EXPECT_EQ(batch->index, b);
      EXPECT_EQ(batch->epoch, epoch);
      EXPECT_EQ(batch->indices, sync.indices);
      EXPECT_EQ((*batch)["images"].to_vector(), sync["images"].to_vector());
      EXPECT_EQ((*batch)["labels"].to_vector(), sync["labels"].to_vector());
      EXPECT_EQ(batch->global_size, sync.global_size);
      ++b;
    }
    EXPECT_EQ(b, s.num_batches());
    EXPECT_FALSE(pf.next().has_value());
  }
  Prefetcher empty([](int64_t) -> Batch { throw std::logic_error("never called"); }, 3, 3);
  EXPECT_FALSE(empty.next().has_value());
  EXPECT_THROW(Prefetcher([](int64_t) { return Batch{}; }, 2, 1), InvalidArgument);
}

// Polls until `value` reaches `target` (at most 10 s); returns the value seen.
int64_t wait_until(const std::atomic<int64_t>& value, int64_t target) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (value.load() < target && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return value.load();
}

TEST(PrefetcherTest, LoadsOneBatchAheadWhileTheStepRuns) {
  std::atomic<int64_t> loaded{0};
  Prefetcher pf(
      [&](int64_t b) {
        Batch batch;
        batch.index = b;
        loaded = b + 1;
        return batch;
      },
      0, 10);
  // Before any next(): batch 0 gets loaded (one ahead), and then no more.
  EXPECT_EQ(wait_until(loaded, 1), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(loaded.load(), 1);
  ASSERT_EQ(pf.next()->index, 0);
  // While "the step" for batch 0 runs, batch 1 gets loaded, and no more.
  EXPECT_EQ(wait_until(loaded, 2), 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(loaded.load(), 2);
  // Destroying it mid-range joins cleanly.
}

TEST(PrefetcherTest, PropagatesTheLoaderExceptionAfterEarlierBatches) {
  Prefetcher pf(
      [](int64_t b) {
        if (b == 2) throw IoError("load", "disk fell off", "plug it in");
        Batch batch;
        batch.index = b;
        return batch;
      },
      0, 5);
  EXPECT_EQ(pf.next()->index, 0);
  EXPECT_EQ(pf.next()->index, 1);
  try {
    pf.next();
    FAIL();
  } catch (const IoError& e) {
    EXPECT_EQ(std::string(e.what()), "load: disk fell off (hint: plug it in)");
  }
  EXPECT_THROW(pf.next(), IoError);  // and again: the epoch did not end normally
}

TEST(PrefetcherTest, StopsWhileTheConsumerIsGone) {
  // Destroyed while a slow load is in flight: the destructor waits for it, then joins.
  std::atomic<int> calls{0};
  {
    Prefetcher pf(
        [&](int64_t b) {
          ++calls;
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          Batch batch;
          batch.index = b;
          return batch;
        },
        0, 1000);
    EXPECT_EQ(pf.next()->index, 0);
  }
  EXPECT_LE(calls.load(), 2);
}

TEST(RealFashionMnistTest, ShardedEpochOverTheTrainingSet) {
  if (!std::filesystem::exists(std::filesystem::path(kFashionMnistDir) / "train-labels-idx1-ubyte.gz"))
    GTEST_SKIP() << "Fashion-MNIST is not installed (" << kFashionMnistInstallHint << ")";
  const Dataset data = load_fashion_mnist();
  const int d = 4;
  std::vector<int64_t> seen;
  int64_t label_sum = 0;
  for (int r = 0; r < d; ++r) {
    const DistributedSampler s(data.size(), 1024, 1, false, r, d);
    EXPECT_EQ(s.num_batches(), 59);  // 58 full batches + 608 samples
    Prefetcher pf([&](int64_t b) { return load_batch(data, s, 0, b); }, 0, s.num_batches());
    while (std::optional<Batch> batch = pf.next()) {
      seen.insert(seen.end(), batch->indices.begin(), batch->indices.end());
      for (double y : (*batch)["labels"].to_vector()) label_sum += static_cast<int64_t>(y);
      EXPECT_EQ(batch->global_size, batch->index == 58 ? 608 : 1024);
    }
  }
  EXPECT_EQ(sorted(seen), iota(60000));
  EXPECT_EQ(label_sum, 6000 * 45);  // 6000 samples of each label 0..9
}

}  // namespace
}  // namespace meshtrain::data
