#include "meshtrain/parallel/zeropp.h"

#include <cstring>
#include <vector>

#include "meshtrain/core/error.h"

namespace meshtrain::parallel {

namespace {

size_t padded_codes(int64_t n, const BlockQuant& q) { return (q.code_bytes(n) + 3) / 4 * 4; }

}  // namespace

void quantize_message(const float* x, int64_t n, const BlockQuant& q, uint8_t* wire) {
  std::vector<float> scales(static_cast<size_t>(q.blocks(n)));
  std::memset(wire, 0, padded_codes(n, q));
  quantize_blocks(x, n, q, wire, scales.data());
  std::memcpy(wire + padded_codes(n, q), scales.data(), scales.size() * sizeof(float));
}

void dequantize_message(const uint8_t* wire, int64_t n, const BlockQuant& q, float* out, bool accumulate) {
  std::vector<float> scales(static_cast<size_t>(q.blocks(n)));
  std::memcpy(scales.data(), wire + padded_codes(n, q), scales.size() * sizeof(float));
  dequantize_blocks(wire, scales.data(), n, q, out, accumulate);
}

size_t quantized_message_bytes(int64_t n, const BlockQuant& q) {
  return padded_codes(n, q) + static_cast<size_t>(q.blocks(n)) * sizeof(float);
}

void quantized_all_gather(comm::Communicator& c, const float* send, float* recv, size_t count, const BlockQuant& q) {
  q.check("quantized_all_gather");
  if (count == 0) return;
  const auto n = static_cast<int64_t>(count);
  const size_t m = quantized_message_bytes(n, q);
  std::vector<uint8_t> mine(m), all(m * static_cast<size_t>(c.size()));
  quantize_message(send, n, q, mine.data());
  c.all_gather(mine.data(), all.data(), m, DType::u8);
  for (int r = 0; r < c.size(); ++r) dequantize_message(all.data() + m * static_cast<size_t>(r), n, q, recv + count * static_cast<size_t>(r), false);
}

void quantized_reduce_scatter(comm::Communicator& intra, comm::Communicator* inter, const float* send, float* recv,
                              size_t count, const BlockQuant& q) {
  q.check("quantized_reduce_scatter");
  if (count == 0) return;
  const int l_ranks = intra.size(), k_ranks = inter != nullptr ? inter->size() : 1;
  const auto n = static_cast<int64_t>(count);
  // 1. Within the node: for local index l the chunks {k L + l}, k in order.
  const int64_t group = n * k_ranks;
  const size_t m1 = quantized_message_bytes(group, q);
  std::vector<uint8_t> out1(m1 * static_cast<size_t>(l_ranks)), in1(out1.size());
  std::vector<float> gathered(static_cast<size_t>(group));
  for (int l = 0; l < l_ranks; ++l) {
    for (int k = 0; k < k_ranks; ++k)
      std::memcpy(gathered.data() + static_cast<size_t>(k) * count,
                  send + static_cast<size_t>(k * l_ranks + l) * count, count * sizeof(float));
    quantize_message(gathered.data(), group, q, out1.data() + m1 * static_cast<size_t>(l));
  }
  intra.all_to_all(out1.data(), in1.data(), m1, DType::u8);
  std::vector<float> node_sum(static_cast<size_t>(group), 0.0f);
  for (int s = 0; s < l_ranks; ++s) dequantize_message(in1.data() + m1 * static_cast<size_t>(s), group, q, node_sum.data(), true);
  if (inter == nullptr || k_ranks == 1) {
    std::memcpy(recv, node_sum.data(), count * sizeof(float));
    return;
  }
  // 2. Across nodes: node k receives chunk k of every node's sum.
  const size_t m2 = quantized_message_bytes(n, q);
  std::vector<uint8_t> out2(m2 * static_cast<size_t>(k_ranks)), in2(out2.size());
  for (int k = 0; k < k_ranks; ++k) quantize_message(node_sum.data() + static_cast<size_t>(k) * count, n, q, out2.data() + m2 * static_cast<size_t>(k));
  inter->all_to_all(out2.data(), in2.data(), m2, DType::u8);
  std::memset(recv, 0, count * sizeof(float));
  for (int k = 0; k < k_ranks; ++k) dequantize_message(in2.data() + m2 * static_cast<size_t>(k), n, q, recv, true);
}

}  // namespace meshtrain::parallel
