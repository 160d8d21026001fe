// The CUDA backend's kernels other than attention's and cuBLAS's products, as host launchers on
// Spans (each operand fp32 or bf16; arithmetic in fp32, sums in fixed order). All run on the
// legacy default stream. Semantics as the Backend methods of the same name (backend.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/cuda/cuda_common.cuh"

namespace malleus::backend::cuda {

// Scratch the kernels below need, owned by the backend.
struct KernelScratch {
  Scratch<double> sums;  // sum_squares: kSumBlocks partials and the total
  Scratch<double> norm;  // rmsnorm_backward: per-segment weight-gradient partials
};

void convert(Span destination, Span source, size_t count);
void add(Span y, Span x, size_t count);
void scale(Span x, float factor, size_t count);
double sum_squares(KernelScratch& scratch, Span x, size_t count);

void embedding_forward(Span out, const int32_t* tokens, Span table, int vocab_begin, int rows,
                       int n, int c);
void embedding_backward(Span dtable, Span dout, const int32_t* tokens, int vocab_begin, int rows,
                        int n, int c);

void rmsnorm_forward(Span out, Span rstd, Span in, Span weight, int n, int c, float eps);
// sum += residual (rounded as sum is stored), then out = rmsnorm(sum) · weight.
void add_rmsnorm_forward(Span sum, Span out, Span rstd, Span residual, Span weight, int n, int c,
                         float eps);
void rmsnorm_backward(KernelScratch& scratch, Span din, Span dweight, Span dout, Span in,
                      Span weight, Span rstd, int n, int c);

// Rotates every (i, i + half) pair of x[batch, seq, heads, 2·half] by direction × its angle;
// cos/sin tables [position, half].
void rope(Span x, const float* cos_table, const float* sin_table, int batch, int seq, int heads,
          int half, int first_position, float direction);

void swiglu_forward(Span out, Span gate, Span up, size_t count);
void swiglu_backward(Span dgate, Span dup, Span dout, Span gate, Span up, size_t count);

void logits_row_max(Span row_max, Span logits, int n, int vocab);
void logits_softmax_sums(Span sum_exp, Span target_logit, Span logits, Span row_max,
                         const int32_t* targets, int vocab_begin, int n, int vocab);
void cross_entropy_loss(Span losses, Span row_max, Span sum_exp, Span target_logit, int n);
void cross_entropy_backward(Span dlogits, Span logits, Span row_max, Span sum_exp,
                            const int32_t* targets, int vocab_begin, float loss_scale, int n,
                            int vocab);

// AdamW's scalars, computed on the host in double as the CPU backend does.
struct AdamWScalars {
  float decay, beta1, beta2, one_minus_beta1, one_minus_beta2, grad_scale, step_size,
      inv_sqrt_bias2, eps;
};
// Updates param (fp32 master weights), m and v; writes the bf16 copy too when `shadow` is set.
void adamw(Span param, bf16* shadow, Span grad, Span m, Span v, size_t count,
           const AdamWScalars& s);

}  // namespace malleus::backend::cuda
