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
// scale / 2 of the sender's (its block's scale).
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

}  // namespace meshtrain::parallel
