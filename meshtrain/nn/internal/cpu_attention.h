// CPU kernels for attention and embeddings behind nn::functional (see
// functional.h for the contracts). Not for use outside nn.
// Thread-safety: stateless; scratch space is per call.
#pragma once

#include "meshtrain/core/tensor.h"

namespace meshtrain::nn::internal {

// Blockwise attention with an online softmax (flash-attention style):
// q, k, v, out (N, T, D) contiguous f32 with N = batch * heads; lse (N, T).
void attention_forward_cpu(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                           const Tensor& out, const Tensor& lse);
// dq, dk, dv written (accumulate: added to) from dout and the forward's out, lse.
void attention_backward_cpu(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                            const Tensor& dout, bool causal, double scale, const Tensor& dq, const Tensor& dk,
                            const Tensor& dv, bool accumulate);
// (out, lse) merged with another key block's (out_b, lse_b), row by row.
void attention_merge_cpu(const Tensor& out, const Tensor& lse, const Tensor& out_b, const Tensor& lse_b);
// The plain T x T reference (for tests and the kernel benchmark).
void attention_reference_cpu(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                             const Tensor& out);

}  // namespace meshtrain::nn::internal
