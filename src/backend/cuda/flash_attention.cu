// Fused causal attention: see flash_attention.cuh.
//
// Tensor-core kernels. A block has 4 warps and takes 64 rows (queries in the forward and dq
// kernels, keys in the dk/dv kernel), 16 per warp; the other side is walked in tiles of 64 rows
// staged in shared memory with cp.async. Fragments follow PTX's m16n8k16 layouts: the accumulator
// of a 16 × 8 product (rows g, g + 8, columns 2t, 2t + 1 of lane 4g + t) is, once rounded to bf16,
// half of the A operand of the next product, so the probabilities go from one product to the
// next without leaving registers. Rows in shared memory are padded by 16 bytes so that ldmatrix's
// eight row addresses fall in distinct banks.
#include <cmath>
#include <initializer_list>
#include <numbers>

#include "backend/cuda/flash_attention.cuh"

namespace malleus::backend::cuda {
namespace {

constexpr int kRows = 64;           // rows per block and per tile
constexpr int kWarps = 4;           // 16 rows each
constexpr int kMaxScalarDim = 256;  // the fp32 kernels' largest head_dim

// ---- PTX wrappers --------------------------------------------------------------------------
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);  // .x (lo) is the low half
  return *reinterpret_cast<uint32_t*>(&pair);
}

// c += a · b, a 16 × 16 (row-major fragment), b 16 × 8 (column-major fragment), fp32 c.
__device__ __forceinline__ void mma(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ unsigned shared_address(const void* pointer) {
  return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}

// Four 8 × 8 matrices; lanes 8i .. 8i + 7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix(uint32_t* r, const bf16* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}

__device__ __forceinline__ void ldmatrix_transposed(uint32_t* r, const bf16* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}

// 16 bytes from global to shared memory, or 16 zero bytes when !valid (`source` must still be a
// valid address).
__device__ __forceinline__ void copy_async(void* target, const void* source, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(target)),
               "l"(source), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void commit_copies() {
  asm volatile("cp.async.commit_group;\n" ::);
}
// Waits until at most `pending` of the committed groups are still in flight.
template <int pending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending));
}

// ---- tiles and fragments -------------------------------------------------------------------
template <int D>
struct Tile {
  static constexpr int kStride = D + 8;  // padded row, in elements
  static constexpr int kElements = kRows * kStride;
};

// Stages rows [first, first + 64) of a [rows, ld] bf16 matrix (rows at or past `limit` as zeros)
// into a padded tile.
template <int D>
__device__ void stage(bf16* tile, const bf16* matrix, int ld, int first, int limit) {
  constexpr int kChunks = D / 8;  // 16-byte pieces per row
  for (int i = threadIdx.x; i < kRows * kChunks; i += blockDim.x) {
    const int r = i / kChunks, piece = i % kChunks;
    const bool valid = first + r < limit;
    const bf16* source = matrix + size_t(valid ? first + r : 0) * ld + piece * 8;
    copy_async(tile + r * Tile<D>::kStride + piece * 8, source, valid);
  }
}

// Lane addresses for ldmatrix, for the 16 × 16 square at (row0, col0) of a padded tile:
// as the A operand (matrices: rows 0-7/8-15 × cols 0-7, then × cols 8-15) ...
template <int D>
__device__ __forceinline__ const bf16* a_rows(const bf16* tile, int row0, int col0) {
  const int lane = threadIdx.x % 32;
  return tile + (row0 + (lane & 7) + ((lane >> 3) & 1) * 8) * Tile<D>::kStride + col0 +
         (lane >> 4) * 8;
}
// ... as two B operands stored [n][k] (rows n 0-7 × k 0-7, k 8-15, then rows n 8-15): r[0..1] is
// the B of columns n 0-7, r[2..3] of n 8-15 ...
template <int D>
__device__ __forceinline__ const bf16* b_rows(const bf16* tile, int n0, int k0) {
  const int lane = threadIdx.x % 32;
  return tile + (n0 + (lane & 7) + (lane >> 4) * 8) * Tile<D>::kStride + k0 + ((lane >> 3) & 1) * 8;
}
// ... and, transposed, as two B operands stored [k][n]: r[0..1] is the B of columns n0 .. n0 + 7,
// r[2..3] of n0 + 8 .. n0 + 15 (the same addresses as the A operand).

// The A operand of rows 16·kk .. of a product from accumulators s[8][4] of 64 columns: columns
// 16·kk .. 16·kk + 15, rounded to bf16.
__device__ __forceinline__ void accumulator_as_a(uint32_t* a, const float (*s)[4], int kk) {
  a[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
  a[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
  a[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// acc[8][4] (16 × 64) = A (16 × D, fragments in registers) · Bᵀ where B's 64 rows × D are a
// padded tile.
template <int D>
__device__ __forceinline__ void product_nt(float (*acc)[4], const uint32_t (*a)[4],
                                           const bf16* tile) {
  for (int n = 0; n < 8; ++n)
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
#pragma unroll
  for (int np = 0; np < 4; ++np) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t b[4];
      ldmatrix(b, b_rows<D>(tile, np * 16, ks * 16));
      mma(acc[2 * np], a[ks], b);
      mma(acc[2 * np + 1], a[ks], b + 2);
    }
  }
}

// The same with A's fragments read from a padded tile, rows row0 .. row0 + 15.
template <int D>
__device__ __forceinline__ void product_nt_shared(float (*acc)[4], const bf16* a_tile, int row0,
                                                  const bf16* tile) {
  for (int n = 0; n < 8; ++n)
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t a[4];
    ldmatrix(a, a_rows<D>(a_tile, row0, ks * 16));
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t b[4];
      ldmatrix(b, b_rows<D>(tile, np * 16, ks * 16));
      mma(acc[2 * np], a, b);
      mma(acc[2 * np + 1], a, b + 2);
    }
  }
}

// out[D/8][4] (16 × D) += P (16 × 64, accumulators p[8][4]) · B where B's 64 rows × D are a padded
// tile (read transposed).
template <int D>
__device__ __forceinline__ void product_nn(float (*out)[4], const float (*p)[4], const bf16* tile) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t a[4];
    accumulator_as_a(a, p, kk);
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b[4];
      ldmatrix_transposed(b, a_rows<D>(tile, kk * 16, dp * 16));
      mma(out[2 * dp], a, b);
      mma(out[2 * dp + 1], a, b + 2);
    }
  }
}

template <int D>
__device__ __forceinline__ void load_a(uint32_t (*a)[4], const bf16* tile, int row0) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) ldmatrix(a[ks], a_rows<D>(tile, row0, ks * 16));
}

// Writes a warp's 16 × D accumulators (times `factor`) as bf16 rows row0 + g, row0 + g + 8 of a
// [rows, ld] matrix, rows at or past `limit` skipped.
template <int D>
__device__ void store_rows(bf16* matrix, int ld, int row0, int limit, const float (*acc)[4],
                           const float* factor) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + g + half * 8;
    if (row >= limit) continue;
    uint32_t* out = reinterpret_cast<uint32_t*>(matrix + size_t(row) * ld);
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      out[(n * 8 + 2 * t) / 2] =
          pack_bf16(acc[n][2 * half] * factor[half], acc[n][2 * half + 1] * factor[half]);
    }
  }
}

// ---- forward -------------------------------------------------------------------------------
struct Geometry {
  int seq, past, q_heads, kv_heads;
  float scale_log2;  // 1/sqrt(d) · log2(e): scores in log2 units
};

template <int D>
__global__ void __launch_bounds__(kWarps * 32)
    forward_kernel(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                   Geometry geo) {
  extern __shared__ __align__(16) unsigned char shared[];
  bf16* sq = reinterpret_cast<bf16*>(shared);
  bf16* sk = sq + Tile<D>::kElements;
  bf16* sv = sk + Tile<D>::kElements;
  const int block = gridDim.x - 1 - blockIdx.x;  // the longest rows (most keys) first
  const int h = blockIdx.y, b = blockIdx.z;
  const int kvh = h / (geo.q_heads / geo.kv_heads);
  const int keys = geo.past + geo.seq;
  const int q0 = block * kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int q_ld = geo.q_heads * D, kv_ld = geo.kv_heads * D;
  const bf16* qm = q + (size_t(b) * geo.seq * geo.q_heads + h) * D;
  const bf16* km = k + (size_t(b) * keys * geo.kv_heads + kvh) * D;
  const bf16* vm = v + (size_t(b) * keys * geo.kv_heads + kvh) * D;
  // Keys up to the block's last query's position.
  const int key_end = min(keys, geo.past + min(geo.seq, q0 + kRows));
  const int tiles = (key_end + kRows - 1) / kRows;

  stage<D>(sq, qm, q_ld, q0, geo.seq);
  commit_copies();
  stage<D>(sk, km, kv_ld, 0, keys);
  commit_copies();
  stage<D>(sv, vm, kv_ld, 0, keys);
  commit_copies();
  wait_copies<2>();
  __syncthreads();
  uint32_t qf[D / 16][4];
  load_a<D>(qf, sq, warp * 16);

  float o[D / 8][4];
  for (int n = 0; n < D / 8; ++n)
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int position = geo.past + q0 + warp * 16 + g;  // of the lane's first row; +8 the second

  for (int j = 0; j < tiles; ++j) {
    wait_copies<1>();  // K_j is here (V_j may not be)
    __syncthreads();
    float s[8][4];
    product_nt<D>(s, qf, sk);
    __syncthreads();  // every warp is done with sk
    if (j + 1 < tiles) stage<D>(sk, km, kv_ld, (j + 1) * kRows, keys);
    commit_copies();

    const int k0 = j * kRows;
    const bool masked = k0 + kRows - 1 > geo.past + q0 || k0 + kRows > keys;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float top = -INFINITY;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          const int key = k0 + n * 8 + 2 * t + (e & 1);
          float x = s[n][e] * geo.scale_log2;
          if (masked && (key > position + half * 8 || key >= keys)) x = -INFINITY;
          s[n][e] = x;
          top = fmaxf(top, x);
        }
      }
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
      const float m_new = fmaxf(m[half], top);
      const float base = m_new == -INFINITY ? 0.f : m_new;
      const float correction = exp2f(m[half] - base);
      m[half] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          s[n][e] = exp2f(s[n][e] - base);
          sum += s[n][e];
        }
      }
      l[half] = l[half] * correction + sum;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[n][2 * half] *= correction;
        o[n][2 * half + 1] *= correction;
      }
    }

    wait_copies<1>();  // V_j is here (K_{j+1} may not be)
    __syncthreads();
    product_nn<D>(o, s, sv);
    __syncthreads();  // every warp is done with sv
    if (j + 1 < tiles) stage<D>(sv, vm, kv_ld, (j + 1) * kRows, keys);
    commit_copies();
  }
  wait_copies<0>();

  float inverse[2];
  for (int half = 0; half < 2; ++half) {
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 1);
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 2);
    inverse[half] = 1.f / l[half];
    const int row = q0 + warp * 16 + g + half * 8;
    if (t == 0 && row < geo.seq) {
      lse[(size_t(b) * geo.q_heads + h) * geo.seq + row] = m[half] + log2f(l[half]);
    }
  }
  store_rows<D>(out + (size_t(b) * geo.seq * geo.q_heads + h) * D, q_ld, q0 + warp * 16, geo.seq, o,
                inverse);
}

// ---- backward: delta = rowsum(dout ⊙ out), one warp per row ----------------------------------
__global__ void delta_kernel(float* delta, Span dout, Span out, int seq, int heads, int d,
                             size_t rows) {
  const size_t row = (size_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps leave together
  float sum = 0.f;
  for (int i = lane; i < d; i += 32) sum += dout.load(row * d + i) * out.load(row * d + i);
  sum = warp_sum(sum);
  sum = __shfl_sync(0xffffffffu, sum, 0);
  // row = (b · seq + t) · heads + h  ->  delta[(b · heads + h) · seq + t]
  const size_t h = row % heads, bt = row / heads, b = bt / seq, t = bt % seq;
  if (lane == 0) delta[(b * heads + h) * seq + t] = sum;
}

// ---- backward: dq over query blocks --------------------------------------------------------
template <int D>
__global__ void __launch_bounds__(kWarps * 32)
    dq_kernel(bf16* dq, const float* lse, const float* delta, const bf16* q, const bf16* k,
              const bf16* v, const bf16* dout, Geometry geo, float scale) {
  extern __shared__ __align__(16) unsigned char shared[];
  // Two stages of (K, V); stage 0 first holds (Q, dout).
  bf16* stage_k[2] = {reinterpret_cast<bf16*>(shared),
                      reinterpret_cast<bf16*>(shared) + 2 * Tile<D>::kElements};
  const int block = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int kvh = h / (geo.q_heads / geo.kv_heads);
  const int seq = geo.seq;
  const int q0 = block * kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int q_ld = geo.q_heads * D, kv_ld = geo.kv_heads * D;
  const size_t q_at = (size_t(b) * seq * geo.q_heads + h) * D;
  const size_t kv_at = (size_t(b) * seq * geo.kv_heads + kvh) * D;
  const int tiles = (min(seq, q0 + kRows) + kRows - 1) / kRows;

  stage<D>(stage_k[0], q + q_at, q_ld, q0, seq);
  stage<D>(stage_k[0] + Tile<D>::kElements, dout + q_at, q_ld, q0, seq);
  commit_copies();
  stage<D>(stage_k[1], k + kv_at, kv_ld, 0, seq);
  stage<D>(stage_k[1] + Tile<D>::kElements, v + kv_at, kv_ld, 0, seq);
  commit_copies();
  wait_copies<1>();
  __syncthreads();
  uint32_t qf[D / 16][4], df[D / 16][4];
  load_a<D>(qf, stage_k[0], warp * 16);
  load_a<D>(df, stage_k[0] + Tile<D>::kElements, warp * 16);
  __syncthreads();  // stage 0 is free

  float row_lse[2], row_delta[2];
  for (int half = 0; half < 2; ++half) {
    const int row = q0 + warp * 16 + g + half * 8;
    const size_t at = (size_t(b) * geo.q_heads + h) * seq + row;
    row_lse[half] = row < seq ? lse[at] : 0.f;
    row_delta[half] = row < seq ? delta[at] : 0.f;
  }
  float acc[D / 8][4];
  for (int n = 0; n < D / 8; ++n)
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;

  for (int j = 0; j < tiles; ++j) {
    // Tile j is in stage (j + 1) % 2; prefetch tile j + 1 into the other.
    bf16* next = stage_k[j % 2];
    if (j + 1 < tiles) {
      stage<D>(next, k + kv_at, kv_ld, (j + 1) * kRows, seq);
      stage<D>(next + Tile<D>::kElements, v + kv_at, kv_ld, (j + 1) * kRows, seq);
    }
    commit_copies();
    wait_copies<1>();
    __syncthreads();
    const bf16* sk = stage_k[(j + 1) % 2];
    const bf16* sv = sk + Tile<D>::kElements;
    float s[8][4], dp[8][4];
    product_nt<D>(s, qf, sk);
    product_nt<D>(dp, df, sv);
    const int k0 = j * kRows;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int half = e >> 1;
        const int key = k0 + n * 8 + 2 * t + (e & 1);
        const int row = q0 + warp * 16 + g + half * 8;
        const float p =
            key <= row && row < seq ? exp2f(s[n][e] * geo.scale_log2 - row_lse[half]) : 0.f;
        s[n][e] = p * (dp[n][e] - row_delta[half]);  // dS
      }
    }
    product_nn<D>(acc, s, sk);
    __syncthreads();  // every warp is done with this stage
  }
  wait_copies<0>();
  const float factor[2] = {scale, scale};
  store_rows<D>(dq + q_at, q_ld, q0 + warp * 16, seq, acc, factor);
}

// ---- backward: dk and dv over key blocks ---------------------------------------------------
// A block takes 64 keys and ONE query head (so that grouped heads give as many blocks as the
// forward has). With one query head per kv head it writes dk and dv; with a group of several it
// writes its head's share in fp32 to [batch, seq, q_heads, d] partials, which sum_members_kernel
// then adds up in head order (deterministic, no atomics).
template <int D>
struct KeyStage {
  // Q and dout of a tile of 64 queries, and their lse and delta.
  static constexpr size_t kBytes =
      2 * Tile<D>::kElements * sizeof(bf16) + 2 * kRows * sizeof(float);
};

// Writes a warp's 16 × D fp32 accumulators (times `factor`) as rows row0 + g, row0 + g + 8 of a
// [rows, ld] fp32 matrix, rows at or past `limit` skipped.
template <int D>
__device__ void store_rows_fp32(float* matrix, int ld, int row0, int limit, const float (*acc)[4],
                                float factor) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + g + half * 8;
    if (row >= limit) continue;
    float2* out = reinterpret_cast<float2*>(matrix + size_t(row) * ld);
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      out[(n * 8 + 2 * t) / 2] =
          make_float2(acc[n][2 * half] * factor, acc[n][2 * half + 1] * factor);
    }
  }
}

struct KeyOutputs {
  bf16 *dk, *dv;                   // [batch, seq, kv_heads, d]: written when the group is one head
  float *partial_dk, *partial_dv;  // [batch, seq, q_heads, d]: written otherwise
};

template <int D>
__global__ void __launch_bounds__(kWarps * 32)
    dkv_kernel(KeyOutputs outputs, const float* lse, const float* delta, const bf16* q,
               const bf16* k, const bf16* v, const bf16* dout, Geometry geo, float scale) {
  extern __shared__ __align__(16) unsigned char shared[];
  bf16* sk = reinterpret_cast<bf16*>(shared);  // this block's keys and values, kept throughout
  bf16* sv = sk + Tile<D>::kElements;
  unsigned char* stages = shared + 2 * Tile<D>::kElements * sizeof(bf16);
  const int block = blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int group = geo.q_heads / geo.kv_heads;
  const int kvh = h / group;
  const int seq = geo.seq;
  const int k0 = block * kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int q_ld = geo.q_heads * D, kv_ld = geo.kv_heads * D;
  const size_t kv_at = (size_t(b) * seq * geo.kv_heads + kvh) * D;
  const size_t q_at = (size_t(b) * seq * geo.q_heads + h) * D;
  const int steps = (seq + kRows - 1) / kRows - block;  // query tiles at or after this key block

  // Stages the queries of step `i` (query tile block + i).
  auto stage_step = [&](int i) {
    unsigned char* at = stages + (i % 2) * KeyStage<D>::kBytes;
    bf16* sq = reinterpret_cast<bf16*>(at);
    float* s_lse = reinterpret_cast<float*>(at + 2 * Tile<D>::kElements * sizeof(bf16));
    const int q0 = (block + i) * kRows;
    stage<D>(sq, q + q_at, q_ld, q0, seq);
    stage<D>(sq + Tile<D>::kElements, dout + q_at, q_ld, q0, seq);
    for (int r = threadIdx.x; r < kRows; r += blockDim.x) {
      const bool valid = q0 + r < seq;
      const size_t row = (size_t(b) * geo.q_heads + h) * seq + q0 + r;
      s_lse[r] = valid ? lse[row] : 0.f;
      s_lse[kRows + r] = valid ? delta[row] : 0.f;
    }
  };

  stage<D>(sk, k + kv_at, kv_ld, k0, seq);
  stage<D>(sv, v + kv_at, kv_ld, k0, seq);
  commit_copies();
  float dk_acc[D / 8][4], dv_acc[D / 8][4];
  for (int n = 0; n < D / 8; ++n)
    for (int e = 0; e < 4; ++e) dk_acc[n][e] = dv_acc[n][e] = 0.f;

  stage_step(0);
  commit_copies();
  for (int i = 0; i < steps; ++i) {
    if (i + 1 < steps) stage_step(i + 1);
    commit_copies();
    wait_copies<1>();
    __syncthreads();
    const unsigned char* at = stages + (i % 2) * KeyStage<D>::kBytes;
    const bf16* sq = reinterpret_cast<const bf16*>(at);
    const bf16* sdo = sq + Tile<D>::kElements;
    const float* s_lse = reinterpret_cast<const float*>(at + 2 * Tile<D>::kElements * sizeof(bf16));
    const int q0 = (block + i) * kRows;
    // Sᵀ (this warp's 16 keys × 64 queries) = K Qᵀ, dPᵀ = V doutᵀ.
    float st[8][4], dpt[8][4];
    product_nt_shared<D>(st, sk, warp * 16, sq);
    product_nt_shared<D>(dpt, sv, warp * 16, sdo);
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int column = n * 8 + 2 * t + (e & 1);
        const int query = q0 + column;
        const int key = k0 + warp * 16 + g + (e >> 1) * 8;
        const float p =
            key <= query && query < seq ? exp2f(st[n][e] * geo.scale_log2 - s_lse[column]) : 0.f;
        st[n][e] = p;
        dpt[n][e] = p * (dpt[n][e] - s_lse[kRows + column]);  // dSᵀ
      }
    }
    product_nn<D>(dv_acc, st, sdo);
    product_nn<D>(dk_acc, dpt, sq);
    __syncthreads();  // every warp is done with this stage
  }
  wait_copies<0>();
  if (group == 1) {
    const float one[2] = {1.f, 1.f}, factor[2] = {scale, scale};
    store_rows<D>(outputs.dk + kv_at, kv_ld, k0 + warp * 16, seq, dk_acc, factor);
    store_rows<D>(outputs.dv + kv_at, kv_ld, k0 + warp * 16, seq, dv_acc, one);
  } else {
    store_rows_fp32<D>(outputs.partial_dk + q_at, q_ld, k0 + warp * 16, seq, dk_acc, scale);
    store_rows_fp32<D>(outputs.partial_dv + q_at, q_ld, k0 + warp * 16, seq, dv_acc, 1.f);
  }
}

// dk[b, key, kvh, i] = Σ over the group's heads m, in order, of partial[b, key, kvh·group + m, i];
// the same for dv.
__global__ void sum_members_kernel(Span dk, Span dv, const float* partial_dk,
                                   const float* partial_dv, int q_heads, int kv_heads, int d,
                                   size_t count) {
  const int group = q_heads / kv_heads;
  for (size_t e = blockIdx.x * size_t(blockDim.x) + threadIdx.x; e < count;
       e += size_t(gridDim.x) * blockDim.x) {
    const size_t i = e % d, kvh = (e / d) % kv_heads, row = e / (size_t(d) * kv_heads);
    const size_t first = (row * q_heads + kvh * group) * d + i;
    float sum_k = 0.f, sum_v = 0.f;
    for (int m = 0; m < group; ++m) {
      sum_k += partial_dk[first + size_t(m) * d];
      sum_v += partial_dv[first + size_t(m) * d];
    }
    dk.store(e, sum_k);
    dv.store(e, sum_v);
  }
}

// ---- fp32 kernels: one thread per row, any storage, head_dim up to kMaxScalarDim ------------
constexpr int kScalarTile = 16;  // keys (or queries) staged in shared memory at a time

// Thread i of a block of 64 takes query q0 + i of head h, sequence b.
__global__ void scalar_forward_kernel(Span out, float* lse, Span q, Span k, Span v, Geometry geo,
                                      int d) {
  extern __shared__ float tile[];  // [kScalarTile][d] keys, then values
  float* tk = tile;
  float* tv = tile + kScalarTile * d;
  const int h = blockIdx.y, b = blockIdx.z;
  const int kvh = h / (geo.q_heads / geo.kv_heads);
  const int keys = geo.past + geo.seq;
  const int q0 = blockIdx.x * kRows;
  const int row = q0 + threadIdx.x;
  const bool valid = row < geo.seq;
  const int position = geo.past + row;
  const size_t q_at = ((size_t(b) * geo.seq + row) * geo.q_heads + h) * d;
  float qv[kMaxScalarDim], acc[kMaxScalarDim];
  for (int i = 0; i < d; ++i) {
    qv[i] = valid ? q.load(q_at + i) * geo.scale_log2 : 0.f;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  const int key_end = min(keys, geo.past + min(geo.seq, q0 + kRows));
  for (int k0 = 0; k0 < key_end; k0 += kScalarTile) {
    __syncthreads();
    for (int i = threadIdx.x; i < kScalarTile * d; i += blockDim.x) {
      const int key = k0 + i / d;
      const size_t at = ((size_t(b) * keys + key) * geo.kv_heads + kvh) * d + i % d;
      tk[i] = key < keys ? k.load(at) : 0.f;
      tv[i] = key < keys ? v.load(at) : 0.f;
    }
    __syncthreads();
    for (int j = 0; j < kScalarTile; ++j) {
      const int key = k0 + j;
      if (!valid || key >= key_end || key > position) continue;
      float x = 0.f;
      for (int i = 0; i < d; ++i) x += qv[i] * tk[j * d + i];
      const float m_new = fmaxf(m, x);
      const float correction = exp2f(m - m_new), p = exp2f(x - m_new);
      l = l * correction + p;
      for (int i = 0; i < d; ++i) acc[i] = acc[i] * correction + p * tv[j * d + i];
      m = m_new;
    }
  }
  if (!valid) return;
  for (int i = 0; i < d; ++i) out.store(q_at + i, acc[i] / l);
  lse[(size_t(b) * geo.q_heads + h) * geo.seq + row] = m + log2f(l);
}

__global__ void scalar_dq_kernel(Span dq, const float* lse, const float* delta, Span q, Span k,
                                 Span v, Span dout, Geometry geo, int d, float scale) {
  extern __shared__ float tile[];
  float* tk = tile;
  float* tv = tile + kScalarTile * d;
  const int h = blockIdx.y, b = blockIdx.z;
  const int kvh = h / (geo.q_heads / geo.kv_heads);
  const int seq = geo.seq;
  const int q0 = blockIdx.x * kRows;
  const int row = q0 + threadIdx.x;
  const bool valid = row < seq;
  const size_t q_at = ((size_t(b) * seq + row) * geo.q_heads + h) * d;
  const size_t stat = (size_t(b) * geo.q_heads + h) * seq + row;
  const float row_lse = valid ? lse[stat] : 0.f, row_delta = valid ? delta[stat] : 0.f;
  float qv[kMaxScalarDim], dov[kMaxScalarDim], acc[kMaxScalarDim];
  for (int i = 0; i < d; ++i) {
    qv[i] = valid ? q.load(q_at + i) * geo.scale_log2 : 0.f;
    dov[i] = valid ? dout.load(q_at + i) : 0.f;
    acc[i] = 0.f;
  }
  const int key_end = min(seq, q0 + kRows);
  for (int k0 = 0; k0 < key_end; k0 += kScalarTile) {
    __syncthreads();
    for (int i = threadIdx.x; i < kScalarTile * d; i += blockDim.x) {
      const int key = k0 + i / d;
      const size_t at = ((size_t(b) * seq + key) * geo.kv_heads + kvh) * d + i % d;
      tk[i] = key < seq ? k.load(at) : 0.f;
      tv[i] = key < seq ? v.load(at) : 0.f;
    }
    __syncthreads();
    for (int j = 0; j < kScalarTile; ++j) {
      const int key = k0 + j;
      if (!valid || key > row) continue;
      float x = 0.f, dp = 0.f;
      for (int i = 0; i < d; ++i) {
        x += qv[i] * tk[j * d + i];
        dp += dov[i] * tv[j * d + i];
      }
      const float ds = exp2f(x - row_lse) * (dp - row_delta);
      for (int i = 0; i < d; ++i) acc[i] += ds * tk[j * d + i];
    }
  }
  if (!valid) return;
  for (int i = 0; i < d; ++i) dq.store(q_at + i, acc[i] * scale);
}

// Thread i of a block of 64 takes key k0 + i of kv head kvh; the query heads of its group add
// into it in order.
__global__ void scalar_dkv_kernel(Span dk, Span dv, const float* lse, const float* delta, Span q,
                                  Span k, Span v, Span dout, Geometry geo, int d, float scale) {
  extern __shared__ float tile[];  // [kScalarTile][d] queries, then dout, then lse and delta
  float* tq = tile;
  float* tdo = tile + kScalarTile * d;
  float* tstat = tile + 2 * kScalarTile * d;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int group = geo.q_heads / geo.kv_heads;
  const int seq = geo.seq;
  const int k0 = blockIdx.x * kRows;
  const int key = k0 + threadIdx.x;
  const bool valid = key < seq;
  const size_t kv_at = ((size_t(b) * seq + key) * geo.kv_heads + kvh) * d;
  float kv[kMaxScalarDim], vv[kMaxScalarDim], dk_acc[kMaxScalarDim], dv_acc[kMaxScalarDim];
  for (int i = 0; i < d; ++i) {
    kv[i] = valid ? k.load(kv_at + i) * geo.scale_log2 : 0.f;
    vv[i] = valid ? v.load(kv_at + i) : 0.f;
    dk_acc[i] = dv_acc[i] = 0.f;
  }
  for (int member = 0; member < group; ++member) {
    const int h = kvh * group + member;
    for (int t0 = k0; t0 < seq; t0 += kScalarTile) {
      __syncthreads();
      for (int i = threadIdx.x; i < kScalarTile * d; i += blockDim.x) {
        const int row = t0 + i / d;
        const size_t at = ((size_t(b) * seq + row) * geo.q_heads + h) * d + i % d;
        tq[i] = row < seq ? q.load(at) : 0.f;
        tdo[i] = row < seq ? dout.load(at) : 0.f;
      }
      for (int i = threadIdx.x; i < kScalarTile; i += blockDim.x) {
        const size_t stat = (size_t(b) * geo.q_heads + h) * seq + t0 + i;
        tstat[i] = t0 + i < seq ? lse[stat] : 0.f;
        tstat[kScalarTile + i] = t0 + i < seq ? delta[stat] : 0.f;
      }
      __syncthreads();
      for (int j = 0; j < kScalarTile; ++j) {
        const int row = t0 + j;
        if (!valid || row >= seq || row < key) continue;
        float x = 0.f, dp = 0.f;
        for (int i = 0; i < d; ++i) {
          x += kv[i] * tq[j * d + i];
          dp += vv[i] * tdo[j * d + i];
        }
        const float p = exp2f(x - tstat[j]);
        const float ds = p * (dp - tstat[kScalarTile + j]);
        for (int i = 0; i < d; ++i) {
          dv_acc[i] += p * tdo[j * d + i];
          dk_acc[i] += ds * tq[j * d + i];
        }
      }
    }
  }
  if (!valid) return;
  for (int i = 0; i < d; ++i) {
    dk.store(kv_at + i, dk_acc[i] * scale);
    dv.store(kv_at + i, dv_acc[i]);
  }
}

// ---- launches ------------------------------------------------------------------------------
Geometry geometry(const AttentionShape& s) {
  const double scale = 1.0 / std::sqrt(double(s.head_dim));
  return {s.seq, s.past, s.q_heads, s.kv_heads, float(scale * std::numbers::log2e)};
}

float natural_scale(const AttentionShape& s) {
  return float(1.0 / std::sqrt(double(s.head_dim)));
}

// Opts a kernel in to more than 48 KiB of dynamic shared memory (once per kernel and size).
template <typename Kernel>
void allow_shared(Kernel kernel, size_t bytes) {
  cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
             "cudaFuncSetAttribute (shared memory)");
}

template <int D>
void tensor_core_forward(const AttentionForwardArgs& a) {
  const AttentionShape& s = a.shape;
  const dim3 grid((s.seq + kRows - 1) / kRows, s.q_heads, s.batch);
  const size_t bytes = 3 * Tile<D>::kElements * sizeof(bf16);
  allow_shared(forward_kernel<D>, bytes);
  forward_kernel<D><<<grid, kWarps * 32, bytes>>>(
      static_cast<bf16*>(a.out.data), a.lse, static_cast<const bf16*>(a.q.data),
      static_cast<const bf16*>(a.k.data), static_cast<const bf16*>(a.v.data), geometry(s));
  launched("flash attention forward");
}

template <int D>
void tensor_core_backward(const AttentionBackwardArgs& a) {
  const AttentionShape& s = a.shape;
  const dim3 q_grid((s.seq + kRows - 1) / kRows, s.q_heads, s.batch);
  const size_t q_bytes = 4 * Tile<D>::kElements * sizeof(bf16);
  allow_shared(dq_kernel<D>, q_bytes);
  dq_kernel<D><<<q_grid, kWarps * 32, q_bytes>>>(
      static_cast<bf16*>(a.dq.data), a.lse, a.delta, static_cast<const bf16*>(a.q.data),
      static_cast<const bf16*>(a.k.data), static_cast<const bf16*>(a.v.data),
      static_cast<const bf16*>(a.dout.data), geometry(s), natural_scale(s));
  launched("flash attention backward (dq)");
  const dim3 k_grid((s.seq + kRows - 1) / kRows, s.q_heads, s.batch);
  const size_t k_bytes = 2 * Tile<D>::kElements * sizeof(bf16) + 2 * KeyStage<D>::kBytes;
  allow_shared(dkv_kernel<D>, k_bytes);
  const bool grouped = s.q_heads != s.kv_heads;
  const KeyOutputs outputs{static_cast<bf16*>(a.dk.data), static_cast<bf16*>(a.dv.data),
                           grouped ? a.partials : nullptr,
                           grouped ? a.partials + a.shape_q_size() : nullptr};
  dkv_kernel<D><<<k_grid, kWarps * 32, k_bytes>>>(
      outputs, a.lse, a.delta, static_cast<const bf16*>(a.q.data),
      static_cast<const bf16*>(a.k.data), static_cast<const bf16*>(a.v.data),
      static_cast<const bf16*>(a.dout.data), geometry(s), natural_scale(s));
  launched("flash attention backward (dk, dv)");
  if (grouped) {
    const size_t count = size_t(s.batch) * s.seq * s.kv_heads * D;
    sum_members_kernel<<<blocks_for(count), kThreads>>>(
        a.dk, a.dv, outputs.partial_dk, outputs.partial_dv, s.q_heads, s.kv_heads, D, count);
    launched("flash attention backward (dk, dv of grouped heads)");
  }
}

}  // namespace

void check_attention_shape(const AttentionShape& s) {
  check(s.kv_heads > 0 && s.q_heads % s.kv_heads == 0,
        "attention: q_heads (" + std::to_string(s.q_heads) +
            ") must be a positive multiple of kv_heads (" + std::to_string(s.kv_heads) + ")");
  check(s.past >= 0, "attention: past must not be negative, got " + std::to_string(s.past));
  check(s.head_dim > 0 && s.head_dim <= kMaxScalarDim,
        "attention: the CUDA backend takes head_dim 1 to " + std::to_string(kMaxScalarDim) +
            ", got " + std::to_string(s.head_dim));
}

size_t attention_partials_size(const AttentionShape& shape) {
  if (shape.q_heads == shape.kv_heads) return 0;
  return 2 * size_t(shape.batch) * shape.seq * shape.q_heads * shape.head_dim;
}

bool flash_tensor_cores_apply(const AttentionShape& shape, std::initializer_list<Span> operands) {
  if (shape.head_dim != 64 && shape.head_dim != 128) return false;
  for (const Span& span : operands) {
    if (!span.bf16 || reinterpret_cast<uintptr_t>(span.data) % 16 != 0) return false;
  }
  return true;
}

void flash_attention_forward(const AttentionForwardArgs& a) {
  const AttentionShape& s = a.shape;
  check_attention_shape(s);
  if (s.batch == 0 || s.seq == 0 || s.q_heads == 0) return;
  if (flash_tensor_cores_apply(s, {a.out, a.q, a.k, a.v})) {
    return s.head_dim == 64 ? tensor_core_forward<64>(a) : tensor_core_forward<128>(a);
  }
  const dim3 grid((s.seq + kRows - 1) / kRows, s.q_heads, s.batch);
  const size_t bytes = 2 * kScalarTile * size_t(s.head_dim) * sizeof(float);
  scalar_forward_kernel<<<grid, kRows, bytes>>>(a.out, a.lse, a.q, a.k, a.v, geometry(s),
                                                s.head_dim);
  launched("attention forward (fp32)");
}

void flash_attention_backward(const AttentionBackwardArgs& a) {
  const AttentionShape& s = a.shape;
  check_attention_shape(s);
  check(s.past == 0, "attention backward: past must be 0");
  if (s.batch == 0 || s.seq == 0 || s.q_heads == 0) return;
  const size_t rows = size_t(s.batch) * s.seq * s.q_heads;
  delta_kernel<<<int((rows * 32 + kThreads - 1) / kThreads), kThreads>>>(
      a.delta, a.dout, a.out, s.seq, s.q_heads, s.head_dim, rows);
  launched("attention backward (delta)");
  if (flash_tensor_cores_apply(s, {a.dq, a.dk, a.dv, a.dout, a.q, a.k, a.v})) {
    check(attention_partials_size(s) == 0 || a.partials != nullptr,
          "attention backward: grouped heads need the partials scratch");
    return s.head_dim == 64 ? tensor_core_backward<64>(a) : tensor_core_backward<128>(a);
  }
  const dim3 q_grid((s.seq + kRows - 1) / kRows, s.q_heads, s.batch);
  const size_t q_bytes = 2 * kScalarTile * size_t(s.head_dim) * sizeof(float);
  scalar_dq_kernel<<<q_grid, kRows, q_bytes>>>(a.dq, a.lse, a.delta, a.q, a.k, a.v, a.dout,
                                               geometry(s), s.head_dim, natural_scale(s));
  launched("attention backward (dq, fp32)");
  const dim3 k_grid((s.seq + kRows - 1) / kRows, s.kv_heads, s.batch);
  const size_t k_bytes = (2 * kScalarTile * size_t(s.head_dim) + 2 * kScalarTile) * sizeof(float);
  scalar_dkv_kernel<<<k_grid, kRows, k_bytes>>>(a.dk, a.dv, a.lse, a.delta, a.q, a.k, a.v, a.dout,
                                                geometry(s), s.head_dim, natural_scale(s));
  launched("attention backward (dk, dv, fp32)");
}

}  // namespace malleus::backend::cuda
