// Fused causal attention (FlashAttention, Dao et al. 2022; the FA2 work split, Dao 2023): the
// softmax is computed block by block with a running maximum and sum and never written out; the
// forward keeps one log-sum-exp per query row (the backend's attention state) and the backward
// recomputes the probabilities from it.
//
// Two implementations of the same arithmetic:
//  - tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate): q, k, v, out and their gradients
//    stored in bf16, head_dim 64 or 128, rows 16-byte aligned;
//  - plain fp32 (one thread per query or key row): any storage and head_dim up to 256, the
//    reference the exact mode and the tests use.
// Both are deterministic: the backward computes dq in one kernel (over query blocks) and dk, dv
// in another (over key blocks, the query heads of a group in order), with no atomics.
//
// Layouts as backend.h: q, out [batch, seq, q_heads, d]; k, v [batch, keys, kv_heads, d] with keys
// = past + seq; lse [batch, q_heads, seq] in fp32, in log2 units of the scaled scores.
#pragma once

#include "backend/cuda/cuda_common.cuh"

namespace malleus::backend::cuda {

struct AttentionShape {
  int batch = 0, seq = 0, past = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  int keys() const { return past + seq; }
};

struct AttentionForwardArgs {
  Span out;
  float* lse = nullptr;
  Span q, k, v;
  AttentionShape shape;
};

struct AttentionBackwardArgs {
  Span dq, dk, dv;
  Span dout, out;
  const float* lse = nullptr;
  Span q, k, v;
  AttentionShape shape;    // past = 0
  float* delta = nullptr;  // scratch: [batch, q_heads, seq] fp32 (rowsum(dout ⊙ out))
  // Scratch for grouped heads on tensor cores: 2 × q_size() fp32 (each query head's share of dk
  // and dv, summed over the group afterwards); may be null otherwise.
  float* partials = nullptr;
  size_t shape_q_size() const {
    return size_t(shape.batch) * shape.seq * shape.q_heads * shape.head_dim;
  }
};

// Elements of AttentionBackwardArgs::partials the backward of `shape` needs (0: none).
size_t attention_partials_size(const AttentionShape& shape);

// Throws, naming the value, unless the heads group evenly, past >= 0 and head_dim is in 1..256.
void check_attention_shape(const AttentionShape& shape);
// Whether the tensor-core kernels take these operands.
bool flash_tensor_cores_apply(const AttentionShape& shape, std::initializer_list<Span> operands);

void flash_attention_forward(const AttentionForwardArgs& args);
void flash_attention_backward(const AttentionBackwardArgs& args);

}  // namespace malleus::backend::cuda
