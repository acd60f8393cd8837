// shard_batch_dim tests on the threads engine: each rank's rows on 2- and
// 4-rank meshes (replicated over the other axes), another batch axis and
// mesh axis, scalars, uneven batches (refused, or split by the uneven rule
// when allowed), named batches, and the errors.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <mutex>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/error.h"
#include "meshtrain/sharding/batch_sharding.h"
#include "meshtrain/testing/mesh.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::testing {
namespace {

using mesh::DeviceMesh;
using sharding::PartitionSpec;
using sharding::ShardedTensor;
using ::testing::HasSubstr;
using I64 = std::vector<int64_t>;


// (rows, cols) with element (r, c) = 100 r + c.
Tensor rows_tensor(int64_t rows, int64_t cols) {
  std::vector<double> v;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) v.push_back(static_cast<double>(100 * r + c));
  return Tensor::from_vector(v, {rows, cols}, DType::f32);
}

using testing::Failures;

// The rows [first, first + count) of rows_tensor(...), all columns.
bool holds_rows(const Tensor& local, int64_t first, int64_t count, int64_t cols) {
  if (local.shape() != I64{count, cols}) return false;
  for (int64_t r = 0; r < count; ++r)
    for (int64_t c = 0; c < cols; ++c)
      if (local.item({r, c}) != static_cast<double>(100 * (first + r) + c)) return false;
  return true;
}

TEST(ShardBatchDim, TwoRanksEachGetHalfTheRows) {
  const Tensor batch = rows_tensor(8, 3);
  Failures f;
  on_mesh({2}, {"data"}, [&](DeviceMesh& mesh) {
    const ShardedTensor x = sharding::shard_batch_dim(batch, mesh);
    const int me = mesh.rank();
    if (!holds_rows(x.local(), 4 * me, 4, 3)) f.add(fmt::format("rank {}: {}", me, x.to_string()));
    if (x.layout().spec() != PartitionSpec::parse("data,None")) f.add(x.layout().to_string());
    if (x.global_shape() != I64{8, 3}) f.add("global shape");
  });
  f.report();
}

TEST(ShardBatchDim, FourRanksDataByTensorReplicatesOverTensor) {
  const Tensor batch = rows_tensor(6, 2);
  Failures f;
  on_mesh({2, 2}, {"data", "tensor"}, [&](DeviceMesh& mesh) {
    const ShardedTensor x = sharding::shard_batch_dim(batch, mesh);
    const int me = mesh.rank(), d = mesh.axis_rank("data");
    // Ranks 0, 1 (data 0) hold rows 0..2; ranks 2, 3 (data 1) rows 3..5.
    if (d != me / 2 || !holds_rows(x.local(), 3 * d, 3, 2)) f.add(fmt::format("rank {}: {}", me, x.to_string()));
  });
  f.report();
}

TEST(ShardBatchDim, FourRanksOneAxis) {
  const Tensor batch = rows_tensor(8, 5);
  Failures f;
  on_mesh({4}, {"data"}, [&](DeviceMesh& mesh) {
    const int me = mesh.rank();
    const ShardedTensor x = sharding::shard_batch_dim(batch, mesh);
    if (!holds_rows(x.local(), 2 * me, 2, 5)) f.add(fmt::format("rank {}: {}", me, x.to_string()));
  });
  f.report();
}

TEST(ShardBatchDim, OtherBatchAxisAndMeshAxis) {
  // (time, batch) = (3, 4): batch is dim 1, split over "fsdp".
  const Tensor batch = rows_tensor(3, 4);
  Failures f;
  on_mesh({2, 2}, {"data", "fsdp"}, [&](DeviceMesh& mesh) {
    const ShardedTensor x = sharding::shard_batch_dim(batch, mesh, /*batch_axis=*/1, "fsdp");
    const int k = mesh.axis_rank("fsdp");
    bool ok = x.local().shape() == I64{3, 2};
    for (int64_t r = 0; ok && r < 3; ++r)
      for (int64_t c = 0; ok && c < 2; ++c) ok = x.local().item({r, c}) == static_cast<double>(100 * r + 2 * k + c);
    if (!ok) f.add(fmt::format("rank {}: {}", mesh.rank(), x.to_string()));
    if (x.layout().spec() != PartitionSpec::parse("None,fsdp")) f.add(x.layout().to_string());
  });
  f.report();
}

TEST(ShardBatchDim, ScalarsAreReplicated) {
  const Tensor step = Tensor::full({}, 7.0, DType::i64);
  Failures f;
  on_mesh({2}, {"data"}, [&](DeviceMesh& mesh) {
    const ShardedTensor s = sharding::shard_batch_dim(step, mesh);
    if (s.local().shape() != I64{} || s.local().item({}) != 7.0 || !s.layout().is_replicated())
      f.add(fmt::format("rank {}: {}", mesh.rank(), s.to_string()));
  });
  f.report();
}

TEST(ShardBatchDim, UnevenBatchIsRefusedUnlessAllowed) {
  const Tensor batch = rows_tensor(5, 2);
  Failures f;
  on_mesh({2}, {"data"}, [&](DeviceMesh& mesh) {
    const std::string e = error_of([&] { sharding::shard_batch_dim(batch, mesh); });
    if (e.find("batch dimension 0 of shape (5, 2) has 5 rows, not divisible by mesh axis 'data' of size 2") ==
            std::string::npos ||
        e.find("a multiple of 2 (e.g. 6)") == std::string::npos)
      f.add("error: " + e);
    // Allowed: the uneven rule, 3 rows then 2.
    const ShardedTensor x = sharding::shard_batch_dim(batch, mesh, 0, "data", /*allow_uneven=*/true);
    const int me = mesh.rank();
    if (!holds_rows(x.local(), 3 * me, me == 0 ? 3 : 2, 2)) f.add(fmt::format("rank {}: {}", me, x.to_string()));
  });
  f.report();
}

TEST(ShardBatchDim, NamedBatch) {
  const Tensor images = rows_tensor(4, 3);
  const Tensor labels = Tensor::from_vector(std::vector<int64_t>{10, 11, 12, 13}, {4}, DType::i64);
  Failures f;
  on_mesh({2}, {"data"}, [&](DeviceMesh& mesh) {
    const int me = mesh.rank();
    auto b = sharding::shard_batch_dim({{"images", images}, {"labels", labels}}, mesh);
    if (!holds_rows(b.at("images").local(), 2 * me, 2, 3)) f.add("images");
    const Tensor& l = b.at("labels").local();
    if (l.shape() != I64{2} || l.item({0}) != 10 + 2 * me || l.item({1}) != 11 + 2 * me) f.add("labels");
    // An error names the entry.
    const std::string e = error_of([&] {
      sharding::shard_batch_dim({{"images", images}, {"odd", rows_tensor(3, 1)}}, mesh);
    });
    if (e.find("entry 'odd': batch dimension 0 of shape (3, 1) has 3 rows") == std::string::npos)
      f.add("named error: " + e);
  });
  f.report();
}

TEST(ShardBatchDim, Errors) {
  const Tensor batch = rows_tensor(4, 2);
  Failures f;
  on_mesh({2}, {"data"}, [&](DeviceMesh& mesh) {
    const std::string axis = error_of([&] { sharding::shard_batch_dim(batch, mesh, 2); });
    if (axis.find("batch_axis 2 is not a dimension of a tensor of shape (4, 2)") == std::string::npos)
      f.add("batch_axis: " + axis);
    const std::string negative = error_of([&] { sharding::shard_batch_dim(batch, mesh, -1); });
    if (negative.find("batch_axis -1") == std::string::npos) f.add("negative: " + negative);
    const std::string name = error_of([&] { sharding::shard_batch_dim(batch, mesh, 0, "batch"); });
    if (name.find("the mesh (data) has no axis 'batch'") == std::string::npos) f.add("mesh axis: " + name);
    const std::string undefined = error_of([&] { sharding::shard_batch_dim(Tensor(), mesh); });
    if (undefined.find("undefined") == std::string::npos) f.add("undefined: " + undefined);
  });
  f.report();
}

}  // namespace
}  // namespace meshtrain::testing
