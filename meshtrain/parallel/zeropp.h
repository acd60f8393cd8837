// ZeRO++'s quantized collectives (DeepSpeed ZeRO++, Wang et al. 2023), on
// any Communicator: block-quantized codes and scales on the wire
// (core/quantize.h), f32 values in and out, values never summed as codes.
//
//   const BlockQuant q{.bits = 8, .block = 256};
//   quantized_all_gather(shard_comm, shard, full, count, q);              // qwZ
//   quantized_reduce_scatter(node_comm, &cross_comm, grad, mine, count, q);  // qgZ
//
// quantized_all_gather (qwZ): every rank's `count` values quantized, the
// codes and scales all-gathered, each rank's part dequantized into recv
// (size() * count values, rank r's at r * count). Each value is within
// scale / 2 of the sender's (its block's scale; up to f32 rounding, see
// core/quantize.h).
//
// quantized_reduce_scatter (qgZ's hierarchical all-to-all): ranks are
// numbered node-major, world rank = node * L + local, where `intra` holds
// the L ranks of this node (rank = local) and `inter` the K ranks with this
// local index on every node (rank = node; null: one node). send holds the
// K L chunks of `count` values; recv gets chunk (node * L + local) summed
// over all K L ranks, as a reduce-scatter over the whole group would:
//   1. within the node: for each local index l, the chunks {k L + l} (in k
//      order) are quantized as one message and all-to-all'd; each rank
//      dequantizes the L messages it receives and adds them in f32: its
//      node's sum of those K chunks;
//   2. across nodes: that sum's K chunks are quantized one by one and
//      all-to-all'd over `inter`; each rank dequantizes and adds the K it
//      receives: the global sum of its own chunk.
// So the bytes crossing nodes are 1/K of the node's sums, quantized (about
// 1/4 of f32's at 8 bits); the error per element is at most the sum of
// half a scale per quantization it went through (L in step 1, K in
// step 2). Sizes need not divide the block (the last block is short), and
// count may be anything >= 1.
//
// Wire format of one message of n values: the codes (q.code_bytes(n),
// padded to 4 bytes), then the q.blocks(n) f32 scales: message_bytes(n, q).
// Collective over the communicators given (every rank, same count and q).
// Thread-safety: one thread per rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/core/quantize.h"

namespace meshtrain::parallel {

size_t quantized_message_bytes(int64_t n, const BlockQuant& q);
// One message: n values quantized into `wire` (quantized_message_bytes(n)
// bytes), and back (accumulate: added to out).
void quantize_message(const float* x, int64_t n, const BlockQuant& q, uint8_t* wire);
void dequantize_message(const uint8_t* wire, int64_t n, const BlockQuant& q, float* out, bool accumulate = false);

void quantized_all_gather(comm::Communicator& c, const float* send, float* recv, size_t count, const BlockQuant& q);

void quantized_reduce_scatter(comm::Communicator& intra, comm::Communicator* inter, const float* send, float* recv,
                              size_t count, const BlockQuant& q);

// The same reduce-scatter, asynchronous: the constructor quantizes `send`
// (which may be freed once it returns) and starts step 1's all-to-all;
// test() (never blocks) and wait() do the local work between the steps as
// each all-to-all arrives, starting step 2's, and finally write recv (which
// must stay valid until then). Several may be in flight; advance them in
// the order they were started on every rank (step 2 runs on `inter` in that
// order), e.g. test the oldest first and stop at the first not done. The
// destructor waits for the all-to-all in flight (not for later steps).
class QuantizedReduceScatter {
 public:
  QuantizedReduceScatter(comm::Communicator& intra, comm::Communicator* inter, const float* send, float* recv,
                         size_t count, const BlockQuant& q);
  ~QuantizedReduceScatter();
  QuantizedReduceScatter(const QuantizedReduceScatter&) = delete;
  QuantizedReduceScatter& operator=(const QuantizedReduceScatter&) = delete;
  // True once recv holds the result; rethrows a step's error.
  bool test();
  void wait();

 private:
  enum class Stage : uint8_t { within_node, across_nodes, done };
  void after_node_step();   // sums the node's messages, starts step 2 (or finishes)
  void after_cross_step();  // sums the nodes' messages into recv

  comm::Communicator* intra_;
  comm::Communicator* inter_;  // null: one node
  float* recv_;
  size_t count_;
  BlockQuant q_;
  Stage stage_ = Stage::within_node;
  std::vector<uint8_t> out1_, in1_, out2_, in2_;
  std::vector<float> node_sum_;
  comm::Work work_;
};

}  // namespace meshtrain::parallel
