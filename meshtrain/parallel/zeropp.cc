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
  QuantizedReduceScatter(intra, inter, send, recv, count, q).wait();
}

QuantizedReduceScatter::QuantizedReduceScatter(comm::Communicator& intra, comm::Communicator* inter, const float* send,
                                               float* recv, size_t count, const BlockQuant& q)
    : intra_(&intra), inter_(inter != nullptr && inter->size() > 1 ? inter : nullptr), recv_(recv), count_(count),
      q_(q) {
  q.check("quantized_reduce_scatter");
  if (count == 0) {
    stage_ = Stage::done;
    return;
  }
  const int l_ranks = intra.size(), k_ranks = inter_ != nullptr ? inter_->size() : 1;
  // 1. Within the node: for local index l the chunks {k L + l}, k in order.
  const auto group = static_cast<int64_t>(count) * k_ranks;
  const size_t m1 = quantized_message_bytes(group, q);
  out1_.resize(m1 * static_cast<size_t>(l_ranks));
  in1_.resize(out1_.size());
  std::vector<float> gathered(static_cast<size_t>(group));
  for (int l = 0; l < l_ranks; ++l) {
    for (int k = 0; k < k_ranks; ++k)
      std::memcpy(gathered.data() + static_cast<size_t>(k) * count,
                  send + static_cast<size_t>(k * l_ranks + l) * count, count * sizeof(float));
    quantize_message(gathered.data(), group, q, out1_.data() + m1 * static_cast<size_t>(l));
  }
  work_ = intra.all_to_all_async(out1_.data(), in1_.data(), m1, DType::u8);
}

QuantizedReduceScatter::~QuantizedReduceScatter() { work_ = comm::Work(); }  // drains before the buffers go

void QuantizedReduceScatter::after_node_step() {
  const int l_ranks = intra_->size(), k_ranks = inter_ != nullptr ? inter_->size() : 1;
  const auto group = static_cast<int64_t>(count_) * k_ranks;
  const size_t m1 = quantized_message_bytes(group, q_);
  node_sum_.assign(static_cast<size_t>(group), 0.0f);
  for (int s = 0; s < l_ranks; ++s)
    dequantize_message(in1_.data() + m1 * static_cast<size_t>(s), group, q_, node_sum_.data(), true);
  std::vector<uint8_t>().swap(out1_);
  std::vector<uint8_t>().swap(in1_);
  if (inter_ == nullptr) {
    std::memcpy(recv_, node_sum_.data(), count_ * sizeof(float));
    std::vector<float>().swap(node_sum_);
    stage_ = Stage::done;
    return;
  }
  // 2. Across nodes: node k receives chunk k of every node's sum.
  const auto n = static_cast<int64_t>(count_);
  const size_t m2 = quantized_message_bytes(n, q_);
  out2_.resize(m2 * static_cast<size_t>(k_ranks));
  in2_.resize(out2_.size());
  for (int k = 0; k < k_ranks; ++k)
    quantize_message(node_sum_.data() + static_cast<size_t>(k) * count_, n, q_,
                     out2_.data() + m2 * static_cast<size_t>(k));
  std::vector<float>().swap(node_sum_);
  work_ = inter_->all_to_all_async(out2_.data(), in2_.data(), m2, DType::u8);
  stage_ = Stage::across_nodes;
}

void QuantizedReduceScatter::after_cross_step() {
  const int k_ranks = inter_->size();
  const size_t m2 = quantized_message_bytes(static_cast<int64_t>(count_), q_);
  std::memset(recv_, 0, count_ * sizeof(float));
  for (int k = 0; k < k_ranks; ++k)
    dequantize_message(in2_.data() + m2 * static_cast<size_t>(k), static_cast<int64_t>(count_), q_, recv_, true);
  std::vector<uint8_t>().swap(out2_);
  std::vector<uint8_t>().swap(in2_);
  stage_ = Stage::done;
}

bool QuantizedReduceScatter::test() {
  while (stage_ != Stage::done) {
    if (!work_.is_completed()) return false;
    work_.wait();  // rethrows the operation's error
    if (stage_ == Stage::within_node)
      after_node_step();
    else
      after_cross_step();
  }
  return true;
}

void QuantizedReduceScatter::wait() {
  while (stage_ != Stage::done) {
    work_.wait();
    if (stage_ == Stage::within_node)
      after_node_step();
    else
      after_cross_step();
  }
}

}  // namespace meshtrain::parallel
