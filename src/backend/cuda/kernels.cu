// The CUDA backend's plain kernels (kernels.cuh). Determinism: every output element is written by
// one thread and every sum has a fixed order (block reductions are fixed trees; sums over tokens
// run in token order or in fixed segments summed in order), so results are bit-identical run to
// run on the same device.
#include <cstdio>

#include "backend/cuda/kernels.cuh"

namespace malleus::backend::cuda {

void free_quietly(void* pointer) {
  if (pointer == nullptr) return;
  const cudaError_t status = cudaFree(pointer);
  if (status != cudaSuccess) {
    std::fprintf(stderr, "cuda backend: cudaFree failed: %s\n", cudaGetErrorString(status));
    cudaGetLastError();
  }
}

namespace {

// sum_squares: a fixed grid, so the order of its sum does not depend on the element count.
constexpr int kSumBlocks = 1024;
// rmsnorm's weight gradient: rows are summed in segments of this many, then the segments in order.
constexpr int kRowSegment = 64;
// embedding_backward: vocabulary rows are split over this many residue classes, each owned by
// one thread per column, which walks the tokens in order.
constexpr int kEmbeddingBuckets = 64;

#define GRID_STRIDE_LOOP(i, count)                                            \
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < (count); \
       i += size_t(gridDim.x) * blockDim.x)

// ---- elementwise ---------------------------------------------------------------------------
// Four at a time where every operand allows it (`quads`), one at a time otherwise.
__global__ void convert_kernel(Span y, Span x, size_t count, bool quads) {
  elementwise(
      count, quads, [&](size_t i) { y.store(i, x.load(i)); },
      [&](size_t i) { y.store4(i, x.load4(i)); });
}

__global__ void add_kernel(Span y, Span x, size_t count, bool quads) {
  elementwise(
      count, quads, [&](size_t i) { y.store(i, y.load(i) + x.load(i)); },
      [&](size_t i) {
        const float4 a = y.load4(i), b = x.load4(i);
        y.store4(i, make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w));
      });
}

__global__ void scale_kernel(Span x, float factor, size_t count, bool quads) {
  elementwise(
      count, quads, [&](size_t i) { x.store(i, x.load(i) * factor); },
      [&](size_t i) {
        const float4 a = x.load4(i);
        x.store4(i, make_float4(a.x * factor, a.y * factor, a.z * factor, a.w * factor));
      });
}

__global__ void sum_squares_partial(double* partial, Span x, size_t count) {
  __shared__ double shared[32];
  double sum = 0;
  GRID_STRIDE_LOOP(i, count) {
    const double v = x.load(i);
    sum += v * v;
  }
  sum = block_sum(sum, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

__global__ void sum_partials(double* out, const double* partial, int count) {
  __shared__ double shared[32];
  double sum = 0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) sum += partial[i];
  sum = block_sum(sum, shared);
  if (threadIdx.x == 0) *out = sum;
}

// ---- embedding -----------------------------------------------------------------------------
__global__ void embedding_forward_kernel(Span out, const int32_t* tokens, Span table,
                                         int vocab_begin, int rows, int c) {
  const int i = blockIdx.x;
  const int row = tokens[i] - vocab_begin;
  const bool held = row >= 0 && row < rows;
  for (int j = threadIdx.x; j < c; j += blockDim.x) {
    out.store(size_t(i) * c + j, held ? table.load(size_t(row) * c + j) : 0.f);
  }
}

// Thread (column j, bucket b) adds, in token order, every token whose local row is ≡ b mod
// kEmbeddingBuckets: repeated tokens add up in the order the CPU backend uses, without atomics.
__global__ void embedding_backward_kernel(Span dtable, Span dout, const int32_t* tokens,
                                          int vocab_begin, int rows, int n, int c) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  const int bucket = blockIdx.y;
  if (j >= c) return;
  for (int i = 0; i < n; ++i) {
    const int row = __ldg(tokens + i) - vocab_begin;
    if (row < 0 || row >= rows || row % kEmbeddingBuckets != bucket) continue;
    const size_t at = size_t(row) * c + j;
    dtable.store(at, dtable.load(at) + dout.load(size_t(i) * c + j));
  }
}

// ---- RMSNorm -------------------------------------------------------------------------------
// The row kernels walk a row's c elements four at a time where `quads` (c a multiple of 4 and
// every operand quad-aligned), one at a time otherwise: f(j, width) handles elements j .. j +
// width - 1.
template <typename F>
__device__ void over_row(int c, bool quads, F&& f) {
  if (quads) {
    for (int j = 4 * threadIdx.x; j < c; j += 4 * blockDim.x) f(j, 4);
  } else {
    for (int j = threadIdx.x; j < c; j += blockDim.x) f(j, 1);
  }
}

__device__ __forceinline__ float4 load(const Span& s, size_t i, int width) {
  return width == 4 ? s.load4(i) : make_float4(s.load(i), 0.f, 0.f, 0.f);
}
__device__ __forceinline__ void store(const Span& s, size_t i, int width, float4 value) {
  if (width == 4) {
    s.store4(i, value);
  } else {
    s.store(i, value.x);
  }
}
__device__ __forceinline__ float4 operator*(float4 a, float4 b) {
  return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w);
}
__device__ __forceinline__ float4 operator*(float4 a, float b) {
  return make_float4(a.x * b, a.y * b, a.z * b, a.w * b);
}
__device__ __forceinline__ float4 operator-(float4 a, float4 b) {
  return make_float4(a.x - b.x, a.y - b.y, a.z - b.z, a.w - b.w);
}
__device__ __forceinline__ float dot(float4 a, float4 b) {
  return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

// out = x · r · w for one row whose sum of squares is `sum`; returns r.
__device__ float normalize_row(Span out, Span in, Span weight, size_t offset, int c, float sum,
                               float eps, bool quads) {
  const float r = 1.0f / sqrtf(sum / float(c) + eps);
  over_row(c, quads, [&](int j, int width) {
    store(out, offset + j, width, load(in, offset + j, width) * r * load(weight, j, width));
  });
  return r;
}

__global__ void rmsnorm_forward_kernel(Span out, Span rstd, Span in, Span weight, int c, float eps,
                                       bool quads) {
  __shared__ float shared[32];
  const size_t offset = size_t(blockIdx.x) * c;
  float sum = 0;
  over_row(c, quads, [&](int j, int width) {
    const float4 x = load(in, offset + j, width);
    sum += dot(x, x);
  });
  sum = block_sum(sum, shared);
  const float r = normalize_row(out, in, weight, offset, c, sum, eps, quads);
  if (threadIdx.x == 0) rstd.store(blockIdx.x, r);
}

// The residual add and the norm in one pass: each thread adds its elements, keeps them as stored
// (rounded to the sum's format, which backward reads back) and squares them.
__global__ void add_rmsnorm_forward_kernel(Span sum_out, Span out, Span rstd, Span residual,
                                           Span weight, int c, float eps, bool quads) {
  __shared__ float shared[32];
  const size_t offset = size_t(blockIdx.x) * c;
  float sum = 0;
  over_row(c, quads, [&](int j, int width) {
    float4 x = load(sum_out, offset + j, width);
    const float4 r = load(residual, offset + j, width);
    x = make_float4(sum_out.rounded(x.x + r.x), sum_out.rounded(x.y + r.y),
                    sum_out.rounded(x.z + r.z), sum_out.rounded(x.w + r.w));
    store(sum_out, offset + j, width, x);
    sum += dot(x, x);
  });
  sum = block_sum(sum, shared);  // its barrier also orders the stores above before the reads
  const float r = normalize_row(out, sum_out, weight, offset, c, sum, eps, quads);
  if (threadIdx.x == 0) rstd.store(blockIdx.x, r);
}

// dx = r·w⊙dy − x·r³/c·Σ(dy⊙w⊙x), one row per block.
__global__ void rmsnorm_backward_input(Span din, Span dout, Span in, Span weight, Span rstd, int c,
                                       bool quads) {
  __shared__ float shared[32];
  const size_t offset = size_t(blockIdx.x) * c;
  const float r = rstd.load(blockIdx.x);
  float total = 0;
  over_row(c, quads, [&](int j, int width) {
    total +=
        dot(load(dout, offset + j, width) * load(weight, j, width), load(in, offset + j, width));
  });
  total = block_sum(total, shared);
  const float correction = total * r * r * r / float(c);
  over_row(c, quads, [&](int j, int width) {
    const float4 w = load(weight, j, width);
    store(din, offset + j, width,
          w * load(dout, offset + j, width) * r - load(in, offset + j, width) * correction);
  });
}

// partial[segment, j] = Σ over the segment's rows of dy⊙x·r, in double.
__global__ void rmsnorm_weight_partial(double* partial, Span dout, Span in, Span rstd, int n,
                                       int c) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= c) return;
  const int begin = blockIdx.y * kRowSegment, end = min(n, begin + kRowSegment);
  double sum = 0;
  for (int i = begin; i < end; ++i) {
    sum += double(dout.load(size_t(i) * c + j)) * in.load(size_t(i) * c + j) * rstd.load(i);
  }
  partial[size_t(blockIdx.y) * c + j] = sum;
}

__global__ void rmsnorm_weight_finish(Span dweight, const double* partial, int segments, int c) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= c) return;
  double sum = 0;
  for (int s = 0; s < segments; ++s) sum += partial[size_t(s) * c + j];
  dweight.store(j, dweight.load(j) + float(sum));
}

// ---- RoPE ------------------------------------------------------------------------------------
__global__ void rope_kernel(Span x, const float* cos_table, const float* sin_table, int seq,
                            int heads, int half, int first_position, float direction,
                            size_t pairs) {
  GRID_STRIDE_LOOP(p, pairs) {
    const int i = int(p % half);
    const size_t head_row = p / half;  // (row, head)
    const size_t r = head_row / heads;
    const size_t t = first_position + r % seq;
    const float c = cos_table[t * half + i];
    const float s = direction * sin_table[t * half + i];
    const size_t a = head_row * 2 * half + i;
    const float x0 = x.load(a), x1 = x.load(a + half);
    x.store(a, x0 * c - x1 * s);
    x.store(a + half, x1 * c + x0 * s);
  }
}

// ---- SwiGLU ----------------------------------------------------------------------------------
__device__ __forceinline__ float swiglu(float g, float u) {
  return g / (1.0f + expf(-g)) * u;
}

// dgate and dup of one element.
__device__ __forceinline__ float2 swiglu_grads(float dy, float g, float u) {
  const float s = 1.0f / (1.0f + expf(-g));
  return make_float2(dy * u * s * (1.0f + g * (1.0f - s)), dy * g * s);
}

__global__ void swiglu_forward_kernel(Span out, Span gate, Span up, size_t count, bool quads) {
  elementwise(
      count, quads, [&](size_t i) { out.store(i, swiglu(gate.load(i), up.load(i))); },
      [&](size_t i) {
        const float4 g = gate.load4(i), u = up.load4(i);
        out.store4(
            i, make_float4(swiglu(g.x, u.x), swiglu(g.y, u.y), swiglu(g.z, u.z), swiglu(g.w, u.w)));
      });
}

__global__ void swiglu_backward_kernel(Span dgate, Span dup, Span dout, Span gate, Span up,
                                       size_t count, bool quads) {
  elementwise(
      count, quads,
      [&](size_t i) {
        const float2 d = swiglu_grads(dout.load(i), gate.load(i), up.load(i));
        dgate.store(i, d.x);
        dup.store(i, d.y);
      },
      [&](size_t i) {
        const float4 dy = dout.load4(i), g = gate.load4(i), u = up.load4(i);
        const float2 a = swiglu_grads(dy.x, g.x, u.x), b = swiglu_grads(dy.y, g.y, u.y),
                     c = swiglu_grads(dy.z, g.z, u.z), d = swiglu_grads(dy.w, g.w, u.w);
        dgate.store4(i, make_float4(a.x, b.x, c.x, d.x));
        dup.store4(i, make_float4(a.y, b.y, c.y, d.y));
      });
}

// ---- cross-entropy ---------------------------------------------------------------------------
__global__ void row_max_kernel(Span row_max, Span logits, int vocab) {
  __shared__ float shared[32];
  const size_t offset = size_t(blockIdx.x) * vocab;
  float top = -INFINITY;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) top = fmaxf(top, logits.load(offset + j));
  top = block_max(top, shared);
  if (threadIdx.x == 0) row_max.store(blockIdx.x, top);
}

__global__ void softmax_sums_kernel(Span sum_exp, Span target_logit, Span logits, Span row_max,
                                    const int32_t* targets, int vocab_begin, int vocab) {
  __shared__ float shared[32];
  const size_t offset = size_t(blockIdx.x) * vocab;
  const float top = row_max.load(blockIdx.x);
  float sum = 0;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) sum += expf(logits.load(offset + j) - top);
  sum = block_sum(sum, shared);
  if (threadIdx.x == 0) {
    sum_exp.store(blockIdx.x, sum);
    const int local = targets[blockIdx.x] - vocab_begin;
    target_logit.store(blockIdx.x, local >= 0 && local < vocab ? logits.load(offset + local) : 0.f);
  }
}

__global__ void cross_entropy_loss_kernel(Span losses, Span row_max, Span sum_exp,
                                          Span target_logit, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) losses.store(i, logf(sum_exp.load(i)) + row_max.load(i) - target_logit.load(i));
}

__global__ void cross_entropy_backward_kernel(Span dlogits, Span logits, Span row_max, Span sum_exp,
                                              const int32_t* targets, int vocab_begin,
                                              float loss_scale, int vocab) {
  const size_t offset = size_t(blockIdx.x) * vocab;
  const float top = row_max.load(blockIdx.x);
  const float factor = loss_scale / sum_exp.load(blockIdx.x);
  const int local = targets[blockIdx.x] - vocab_begin;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float d = expf(logits.load(offset + j) - top) * factor;
    dlogits.store(offset + j, j == local ? d - loss_scale : d);
  }
}

// ---- AdamW -----------------------------------------------------------------------------------
struct AdamWState {
  float param, m, v;
};

__device__ __forceinline__ AdamWState adamw_one(float param, float grad, float m, float v,
                                                const AdamWScalars& s) {
  const float g = grad * s.grad_scale;
  const float mi = s.beta1 * m + s.one_minus_beta1 * g;
  const float vi = s.beta2 * v + s.one_minus_beta2 * g * g;
  const float p = param * s.decay;
  return {p - s.step_size * mi / (sqrtf(vi) * s.inv_sqrt_bias2 + s.eps), mi, vi};
}

__global__ void adamw_kernel(Span param, Span shadow, Span grad, Span m, Span v, size_t count,
                             AdamWScalars s, bool quads) {
  const bool copy = shadow.data != nullptr;
  elementwise(
      count, quads,
      [&](size_t i) {
        const AdamWState r = adamw_one(param.load(i), grad.load(i), m.load(i), v.load(i), s);
        m.store(i, r.m);
        v.store(i, r.v);
        param.store(i, r.param);
        if (copy) shadow.store(i, r.param);
      },
      [&](size_t i) {
        const float4 p = param.load4(i), g = grad.load4(i), mm = m.load4(i), vv = v.load4(i);
        const AdamWState a = adamw_one(p.x, g.x, mm.x, vv.x, s),
                         b = adamw_one(p.y, g.y, mm.y, vv.y, s),
                         c = adamw_one(p.z, g.z, mm.z, vv.z, s),
                         d = adamw_one(p.w, g.w, mm.w, vv.w, s);
        const float4 updated = make_float4(a.param, b.param, c.param, d.param);
        m.store4(i, make_float4(a.m, b.m, c.m, d.m));
        v.store4(i, make_float4(a.v, b.v, c.v, d.v));
        param.store4(i, updated);
        if (copy) shadow.store4(i, updated);
      });
}

}  // namespace

void convert(Span destination, Span source, size_t count) {
  if (count == 0) return;
  convert_kernel<<<blocks_for(count), kThreads>>>(destination, source, count,
                                                  quad_aligned({destination, source}));
  launched("convert");
}

void add(Span y, Span x, size_t count) {
  if (count == 0) return;
  add_kernel<<<blocks_for(count), kThreads>>>(y, x, count, quad_aligned({y, x}));
  launched("add");
}

void scale(Span x, float factor, size_t count) {
  if (count == 0) return;
  scale_kernel<<<blocks_for(count), kThreads>>>(x, factor, count, quad_aligned({x}));
  launched("scale");
}

double sum_squares(KernelScratch& scratch, Span x, size_t count) {
  if (count == 0) return 0;
  double* partial = scratch.sums.at_least(kSumBlocks + 1);
  sum_squares_partial<<<kSumBlocks, kThreads>>>(partial, x, count);
  launched("sum_squares");
  sum_partials<<<1, 1024>>>(partial + kSumBlocks, partial, kSumBlocks);
  launched("sum_squares (final)");
  double total = 0;
  cuda_check(cudaMemcpy(&total, partial + kSumBlocks, sizeof(double), cudaMemcpyDeviceToHost),
             "cudaMemcpy (sum_squares)");
  return total;
}

void embedding_forward(Span out, const int32_t* tokens, Span table, int vocab_begin, int rows,
                       int n, int c) {
  if (n == 0 || c == 0) return;
  embedding_forward_kernel<<<n, kThreads>>>(out, tokens, table, vocab_begin, rows, c);
  launched("embedding_forward");
}

void embedding_backward(Span dtable, Span dout, const int32_t* tokens, int vocab_begin, int rows,
                        int n, int c) {
  if (n == 0 || c == 0) return;
  const dim3 grid((c + 127) / 128, kEmbeddingBuckets);
  embedding_backward_kernel<<<grid, 128>>>(dtable, dout, tokens, vocab_begin, rows, n, c);
  launched("embedding_backward");
}

void rmsnorm_forward(Span out, Span rstd, Span in, Span weight, int n, int c, float eps) {
  if (n == 0) return;
  rmsnorm_forward_kernel<<<n, kThreads>>>(out, rstd, in, weight, c, eps,
                                          c % 4 == 0 && quad_aligned({out, in, weight}));
  launched("rmsnorm_forward");
}

void add_rmsnorm_forward(Span sum, Span out, Span rstd, Span residual, Span weight, int n, int c,
                         float eps) {
  if (n == 0) return;
  add_rmsnorm_forward_kernel<<<n, kThreads>>>(
      sum, out, rstd, residual, weight, c, eps,
      c % 4 == 0 && quad_aligned({sum, out, residual, weight}));
  launched("add_rmsnorm_forward");
}

void rmsnorm_backward(KernelScratch& scratch, Span din, Span dweight, Span dout, Span in,
                      Span weight, Span rstd, int n, int c) {
  if (n == 0 || c == 0) return;
  rmsnorm_backward_input<<<n, kThreads>>>(din, dout, in, weight, rstd, c,
                                          c % 4 == 0 && quad_aligned({din, dout, in, weight}));
  launched("rmsnorm_backward");
  const int segments = (n + kRowSegment - 1) / kRowSegment;
  double* partial = scratch.norm.at_least(size_t(segments) * c);
  const int column_blocks = (c + kThreads - 1) / kThreads;
  rmsnorm_weight_partial<<<dim3(column_blocks, segments), kThreads>>>(partial, dout, in, rstd, n,
                                                                      c);
  launched("rmsnorm_backward (weight)");
  rmsnorm_weight_finish<<<column_blocks, kThreads>>>(dweight, partial, segments, c);
  launched("rmsnorm_backward (weight sum)");
}

void rope(Span x, const float* cos_table, const float* sin_table, int batch, int seq, int heads,
          int half, int first_position, float direction) {
  const size_t pairs = size_t(batch) * seq * heads * half;
  if (pairs == 0) return;
  rope_kernel<<<blocks_for(pairs), kThreads>>>(x, cos_table, sin_table, seq, heads, half,
                                               first_position, direction, pairs);
  launched("rope");
}

void swiglu_forward(Span out, Span gate, Span up, size_t count) {
  if (count == 0) return;
  swiglu_forward_kernel<<<blocks_for(count), kThreads>>>(out, gate, up, count,
                                                         quad_aligned({out, gate, up}));
  launched("swiglu_forward");
}

void swiglu_backward(Span dgate, Span dup, Span dout, Span gate, Span up, size_t count) {
  if (count == 0) return;
  swiglu_backward_kernel<<<blocks_for(count), kThreads>>>(
      dgate, dup, dout, gate, up, count, quad_aligned({dgate, dup, dout, gate, up}));
  launched("swiglu_backward");
}

void logits_row_max(Span row_max, Span logits, int n, int vocab) {
  if (n == 0) return;
  row_max_kernel<<<n, kThreads>>>(row_max, logits, vocab);
  launched("logits_row_max");
}

void logits_softmax_sums(Span sum_exp, Span target_logit, Span logits, Span row_max,
                         const int32_t* targets, int vocab_begin, int n, int vocab) {
  if (n == 0) return;
  softmax_sums_kernel<<<n, kThreads>>>(sum_exp, target_logit, logits, row_max, targets, vocab_begin,
                                       vocab);
  launched("logits_softmax_sums");
}

void cross_entropy_loss(Span losses, Span row_max, Span sum_exp, Span target_logit, int n) {
  if (n == 0) return;
  cross_entropy_loss_kernel<<<(n + kThreads - 1) / kThreads, kThreads>>>(losses, row_max, sum_exp,
                                                                         target_logit, n);
  launched("cross_entropy_loss");
}

void cross_entropy_backward(Span dlogits, Span logits, Span row_max, Span sum_exp,
                            const int32_t* targets, int vocab_begin, float loss_scale, int n,
                            int vocab) {
  if (n == 0 || vocab == 0) return;
  cross_entropy_backward_kernel<<<n, kThreads>>>(dlogits, logits, row_max, sum_exp, targets,
                                                 vocab_begin, loss_scale, vocab);
  launched("cross_entropy_backward");
}

void adamw(Span param, bf16* shadow, Span grad, Span m, Span v, size_t count,
           const AdamWScalars& s) {
  if (count == 0) return;
  const Span copy{shadow, true};
  const bool quads =
      quad_aligned({param, grad, m, v}) && (shadow == nullptr || copy.quad_aligned());
  adamw_kernel<<<blocks_for(count), kThreads>>>(param, copy, grad, m, v, count, s, quads);
  launched("adamw_update");
}

}  // namespace malleus::backend::cuda
