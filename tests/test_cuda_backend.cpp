// The CUDA backend against the CPU backend (built with -DMALLEUS_BUILD_CUDA=ON; skipped where no
// CUDA device is found). Every operation runs on the same random inputs on both backends, its
// outputs poisoned with NaN beforehand so that an element the GPU leaves unwritten fails, and is
// compared by ‖gpu − cpu‖ / ‖cpu‖. Then a whole training step of a small LLaMA (loss, every
// gradient, the parameters after AdamW), bit-exact determinism of that step on the GPU, and the
// fast modes within their stated tolerances: tf32 products, and bf16 mode (bf16 storage of
// activations and product inputs, fp32 master weights, flash attention on tensor cores).
//
// Tolerances, exact mode (fp32 arithmetic everywhere, only the summation order differs):
// elementwise 1e-6, reductions and products 1e-5, a whole step's gradients 1e-4.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_device.h"
#include "common/error.h"
#include "model/transformer.h"
#include "test_models.h"

namespace malleus::backend {
namespace {

using Host = std::vector<float>;
constexpr float kPoison = std::numeric_limits<float>::quiet_NaN();

Host random_vector(size_t count, uint64_t seed, float low = -1, float high = 1) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> distribution(low, high);
  Host values(count);
  for (float& v : values) v = distribution(rng);
  return values;
}

std::vector<int32_t> random_tokens(size_t count, int low, int high, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> distribution(low, high - 1);
  std::vector<int32_t> tokens(count);
  for (int32_t& t : tokens) t = distribution(rng);
  return tokens;
}

// ‖a − b‖ / ‖b‖ in double; infinity when a holds a non-finite value (an unwritten element).
double relative_error(const Host& a, const Host& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (!std::isfinite(a[i])) return std::numeric_limits<double>::infinity();
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return norm == 0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

// x rounded to the nearest bf16 (ties to even), as the GPU stores it.
float round_bf16(float x) {
  uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  bits &= 0xffff0000u;
  std::memcpy(&x, &bits, sizeof(bits));
  return x;
}

Host rounded_bf16(Host values) {
  for (float& v : values) v = round_bf16(v);
  return values;
}

// One backend and the buffers a test put into it.
struct Side {
  std::unique_ptr<Backend<float>> backend;
  std::vector<Buffer<float>> buffers;
  std::vector<Buffer<float, int32_t>> token_buffers;

  // A buffer in the compute format (bf16 in bf16 mode), holding `host`.
  float* put(const Host& host, Precision precision = Precision::kCompute) {
    buffers.emplace_back(*backend, host.size(), MemoryKind::kWorkspace, precision);
    backend->copy_from_host(buffers.back().data(), host.data(), host.size());
    return buffers.back().data();
  }
  float* put_exact(const Host& host) { return put(host, Precision::kExact); }
  float* poisoned(size_t count) { return put(Host(count, kPoison)); }
  int32_t* put_tokens(const std::vector<int32_t>& host) {
    token_buffers.emplace_back(*backend, host.size(), MemoryKind::kWorkspace);
    backend->copy_tokens_from_host(token_buffers.back().data(), host.data(), host.size());
    return token_buffers.back().data();
  }
  Host get(const float* data, size_t count) {
    Host host(count);
    backend->copy_to_host(host.data(), data, count);
    return host;
  }
};

// The outputs of one operation, by name.
using Outputs = std::vector<std::pair<std::string, Host>>;

class CudaBackend : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }

  // Runs `op` on the CPU backend and on the CUDA backend in `math` mode and compares every output.
  static void compare(const std::function<Outputs(Side&)>& op, double tolerance,
                      CudaMath math = CudaMath::kExact) {
    Side cpu{make_cpu_backend<float>(2), {}, {}};
    Side gpu{make_cuda_backend(math), {}, {}};
    const Outputs expected = op(cpu);
    const Outputs got = op(gpu);
    ASSERT_EQ(expected.size(), got.size());
    for (size_t i = 0; i < got.size(); ++i) {
      const double error = relative_error(got[i].second, expected[i].second);
      EXPECT_LE(error, tolerance) << got[i].first;
      std::printf("  %-28s relative error %.3g (tolerance %.0e)\n", got[i].first.c_str(), error,
                  tolerance);
    }
  }
};

TEST_F(CudaBackend, ElementwiseOpsAndSumSquaresMatchTheCpu) {
  const size_t count = 100003;
  const Host x = random_vector(count, 1), y = random_vector(count, 2);
  compare(
      [&](Side& s) {
        float* a = s.put(y);
        float* b = s.put(x);
        s.backend->add(a, b, count);
        s.backend->scale(a, 0.37f, count);
        float* c = s.poisoned(count);
        s.backend->copy(c, a, count);
        float* z = s.put(x);
        s.backend->fill_zero(z, count);
        const double squares = s.backend->sum_squares(a, count);
        return Outputs{{"add, scale", s.get(a, count)},
                       {"copy", s.get(c, count)},
                       {"fill_zero", s.get(z, count)},
                       {"sum_squares", Host{float(squares)}}};
      },
      1e-6);
}

// A strided piece in one call (Backend::copy_rows, one 2-D copy): columns 7..7+50 of a 300 x 90
// matrix out to a packed buffer and back into another matrix's columns, between buffers of the
// same storage and (bf16 mode, an exact-precision source) of different storage.
TEST_F(CudaBackend, CopyRowsMovesAStridedPieceLikeTheCpu) {
  const size_t rows = 300, cols = 90, count = 50, first = 7;
  const Host x = random_vector(rows * cols, 41);
  for (const CudaMath math : {CudaMath::kExact, CudaMath::kBf16}) {
    compare(
        [&](Side& s) {
          float* matrix = s.put(x);
          float* exact = s.put_exact(x);
          float* packed = s.poisoned(rows * count);
          float* packed_exact = s.poisoned(rows * count);
          s.backend->copy_rows(
              packed, matrix + first,
              {.count = count, .rows = rows, .source_stride = cols, .destination_stride = count});
          s.backend->copy_rows(
              packed_exact, exact + first,
              {.count = count, .rows = rows, .source_stride = cols, .destination_stride = count});
          float* back = s.put(Host(rows * cols, 0.0f));
          s.backend->copy_rows(
              back + first, packed,
              {.count = count, .rows = rows, .source_stride = count, .destination_stride = cols});
          return Outputs{{"packed", s.get(packed, rows * count)},
                         {"packed from exact", s.get(packed_exact, rows * count)},
                         {"unpacked", s.get(back, rows * cols)}};
        },
        math == CudaMath::kExact ? 0.0 : 4e-3, math);
  }
}

TEST_F(CudaBackend, SumSquaresIsTheSameEveryRun) {
  auto backend = make_cuda_backend(CudaMath::kExact);
  const Host x = random_vector(3000017, 3);
  Buffer<float> buffer(*backend, x.size(), MemoryKind::kWorkspace);
  backend->copy_from_host(buffer.data(), x.data(), x.size());
  const double first = backend->sum_squares(buffer.data(), x.size());
  for (int run = 0; run < 3; ++run) EXPECT_EQ(backend->sum_squares(buffer.data(), x.size()), first);
  double exact = 0;
  for (float v : x) exact += double(v) * v;
  EXPECT_NEAR(first, exact, 1e-12 * exact);
}

TEST_F(CudaBackend, SwigluAndAdamWMatchTheCpu) {
  const size_t count = 70001;
  const Host gate = random_vector(count, 4, -6, 6), up = random_vector(count, 5),
             dout = random_vector(count, 6), param = random_vector(count, 7),
             grad = random_vector(count, 8);
  compare(
      [&](Side& s) {
        float *g = s.put(gate), *u = s.put(up), *dy = s.put(dout);
        float *out = s.poisoned(count), *dg = s.poisoned(count), *du = s.poisoned(count);
        s.backend->swiglu_forward(out, g, u, count);
        s.backend->swiglu_backward(dg, du, dy, g, u, count);
        float *p = s.put(param), *gr = s.put(grad), *m = s.put(Host(count, 0)),
              *v = s.put(Host(count, 0));
        for (int64_t step = 1; step <= 3; ++step) {
          s.backend->adamw_update(p, gr, m, v, count,
                                  {1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, step});
        }
        return Outputs{{"swiglu out", s.get(out, count)}, {"swiglu dgate", s.get(dg, count)},
                       {"swiglu dup", s.get(du, count)},  {"adamw param", s.get(p, count)},
                       {"adamw m", s.get(m, count)},      {"adamw v", s.get(v, count)}};
      },
      1e-6);
}

TEST_F(CudaBackend, EmbeddingOfAVocabularySliceMatchesTheCpu) {
  const int n = 513, c = 200, vocab_begin = 10, rows = 40;
  const auto tokens = random_tokens(n, 0, 60, 9);  // some outside the slice, many repeats
  const Host table = random_vector(size_t(rows) * c, 10), dout = random_vector(size_t(n) * c, 11),
             dtable = random_vector(table.size(), 12);
  compare(
      [&](Side& s) {
        int32_t* t = s.put_tokens(tokens);
        float *w = s.put(table), *out = s.poisoned(size_t(n) * c), *dw = s.put(dtable);
        s.backend->embedding_forward(out, t, w, vocab_begin, rows, n, c);
        s.backend->embedding_backward(dw, s.put(dout), t, vocab_begin, rows, n, c);
        return Outputs{{"embedding out", s.get(out, size_t(n) * c)},
                       {"embedding dtable (+=)", s.get(dw, table.size())}};
      },
      1e-6);
}

TEST_F(CudaBackend, RmsNormMatchesTheCpu) {
  const int n = 301, c = 257;
  const Host in = random_vector(size_t(n) * c, 13), weight = random_vector(c, 14, 0.5f, 1.5f),
             dout = random_vector(in.size(), 15), dweight = random_vector(c, 16);
  compare(
      [&](Side& s) {
        float *x = s.put(in), *w = s.put(weight), *out = s.poisoned(in.size()),
              *rstd = s.poisoned(n), *dx = s.poisoned(in.size()), *dw = s.put(dweight);
        s.backend->rmsnorm_forward(out, rstd, x, w, n, c, 1e-5f);
        s.backend->rmsnorm_backward(dx, dw, s.put(dout), x, w, rstd, n, c);
        return Outputs{{"rmsnorm out", s.get(out, in.size())},
                       {"rmsnorm rstd", s.get(rstd, n)},
                       {"rmsnorm din", s.get(dx, in.size())},
                       {"rmsnorm dweight (+=)", s.get(dw, c)}};
      },
      1e-5);
}

TEST_F(CudaBackend, FusedAddAndRmsNormMatchesTheCpu) {
  const int n = 97, c = 2048;
  const Host sum = random_vector(size_t(n) * c, 25), residual = random_vector(sum.size(), 26),
             weight = random_vector(c, 27, 0.5f, 1.5f);
  compare(
      [&](Side& s) {
        float *a = s.put(sum), *r = s.put(residual), *w = s.put_exact(weight);
        float *out = s.poisoned(sum.size()), *rstd = s.put_exact(Host(n, kPoison));
        s.backend->add_rmsnorm_forward(a, out, rstd, r, w, n, c, 1e-5f);
        return Outputs{{"sum", s.get(a, sum.size())},
                       {"norm out", s.get(out, sum.size())},
                       {"rstd", s.get(rstd, n)}};
      },
      1e-6);
}

// The bytes the memory ledger holds for the allocation at `data`.
int64_t booked(Backend<float>& backend, const void* data, MemoryKind kind) {
  for (const Allocations::Allocation& a : backend.allocations().of_kind(kind)) {
    if (a.data == data) return a.booked;
  }
  return -1;
}

// bf16 mode stores compute buffers in bf16: values read back rounded to nearest even, slices are
// a pointer plus an offset in floats, and copies convert between the two formats both ways.
TEST_F(CudaBackend, Bf16StorageRoundsSlicesAndConverts) {
  auto gpu = make_cuda_backend(CudaMath::kBf16);
  const size_t count = 10007;
  const Host x = random_vector(count, 28, -3, 3);
  Buffer<float> narrow(*gpu, count, MemoryKind::kActivations);
  Buffer<float> wide(*gpu, count, MemoryKind::kActivations, Precision::kExact);
  EXPECT_EQ(booked(*gpu, narrow.data(), MemoryKind::kActivations), int64_t(count * 2));
  gpu->copy_from_host(narrow.data(), x.data(), count);
  Host back(count);
  gpu->copy_to_host(back.data(), narrow.data(), count);
  EXPECT_EQ(back, rounded_bf16(x));
  // A slice: the second half, through pointer arithmetic in floats.
  Host half(count - 5000);
  gpu->copy_to_host(half.data(), narrow.data() + 5000, half.size());
  EXPECT_EQ(half, Host(back.begin() + 5000, back.end()));
  // bf16 -> fp32 and fp32 -> bf16 copies, and a zeroed slice.
  gpu->copy(wide.data(), narrow.data(), count);
  Host widened(count);
  gpu->copy_to_host(widened.data(), wide.data(), count);
  EXPECT_EQ(widened, back);
  gpu->copy_from_host(wide.data(), x.data(), count);
  gpu->copy(narrow.data(), wide.data(), count);
  gpu->fill_zero(narrow.data() + 100, 50);
  gpu->copy_to_host(back.data(), narrow.data(), count);
  Host expected = rounded_bf16(x);
  std::fill(expected.begin() + 100, expected.begin() + 150, 0.f);
  EXPECT_EQ(back, expected);
}

// The products read a bf16 copy of the fp32 parameters: a write to the parameters (a checkpoint
// load, a migration) must reach the next product.
TEST_F(CudaBackend, ProductsSeeParametersWrittenSinceTheLastUpdate) {
  auto gpu = make_cuda_backend(CudaMath::kBf16);
  const int n = 64, ic = 128, oc = 96;
  Buffer<float> weight(*gpu, size_t(oc) * ic, MemoryKind::kParameters);
  Buffer<float> in(*gpu, size_t(n) * ic, MemoryKind::kActivations);
  Buffer<float> out(*gpu, size_t(n) * oc, MemoryKind::kActivations);
  EXPECT_EQ(booked(*gpu, weight.data(), MemoryKind::kParameters), int64_t(weight.size() * 6));
  const Host x = rounded_bf16(random_vector(in.size(), 29));
  gpu->copy_from_host(in.data(), x.data(), x.size());
  Host result(out.size());
  for (float value : {0.5f, -2.0f}) {
    const Host w(weight.size(), value);
    gpu->copy_from_host(weight.data(), w.data(), w.size());
    gpu->matmul_forward(out.data(), in.data(), weight.data(), n, ic, oc);
    gpu->copy_to_host(result.data(), out.data(), result.size());
    double row = 0;
    for (int i = 0; i < ic; ++i) row += double(x[i]) * value;
    EXPECT_NEAR(result[0], row, 1e-2 * std::abs(row) + 1e-3) << "weights " << value;
  }
}

// What MPI's staging and the runtime's migration see (Backend::device_memory): a bf16 buffer
// reads as the floats it stands for and takes floats, rounded; rows apart by a pitch too; a write
// into parameters reaches the next product (their bf16 copy goes stale).
TEST_F(CudaBackend, ItsDeviceMemoryReadsAndWritesBf16BuffersAsFloats) {
  auto gpu = make_cuda_backend(CudaMath::kBf16);
  ASSERT_NE(gpu->device_memory(), nullptr);
  const DeviceMemory& memory = *gpu->device_memory();
  const size_t rows = 8, columns = 300, pitch = 512;
  Buffer<float> narrow(*gpu, rows * pitch, MemoryKind::kActivations);
  EXPECT_TRUE(memory.holds(narrow.data() + 17));
  const Host x = random_vector(rows * pitch, 31, -3, 3);
  gpu->copy_from_host(narrow.data(), x.data(), x.size());
  Host all(x.size());
  memory.to_host(all.data(), narrow.data(), all.size() * sizeof(float));
  EXPECT_EQ(all, rounded_bf16(x));
  // Columns [5, 5 + columns) of every row, out and back in.
  Host piece(rows * columns);
  memory.to_host(piece.data(), narrow.data() + 5, columns * sizeof(float), rows,
                 pitch * sizeof(float));
  for (size_t r = 0; r < rows; ++r) {
    for (size_t c = 0; c < columns; ++c) ASSERT_EQ(piece[r * columns + c], all[r * pitch + 5 + c]);
  }
  const Host y = random_vector(piece.size(), 32, -3, 3);
  memory.from_host(narrow.data() + 5, y.data(), columns * sizeof(float), rows,
                   pitch * sizeof(float));
  Host back(x.size());
  gpu->copy_to_host(back.data(), narrow.data(), back.size());
  const Host y_rounded = rounded_bf16(y);
  for (size_t r = 0; r < rows; ++r) {
    EXPECT_EQ(back[r * pitch + 4], all[r * pitch + 4]);  // untouched beside the piece
    for (size_t c = 0; c < columns; ++c)
      ASSERT_EQ(back[r * pitch + 5 + c], y_rounded[r * columns + c]);
  }
  // Parameters written through it: the product after sees them.
  const int n = 16, ic = 64, oc = 32;
  Buffer<float> weight(*gpu, size_t(oc) * ic, MemoryKind::kParameters);
  Buffer<float> in(*gpu, size_t(n) * ic, MemoryKind::kActivations);
  Buffer<float> out(*gpu, size_t(n) * oc, MemoryKind::kActivations);
  const Host ones(in.size(), 1.0f);
  gpu->copy_from_host(in.data(), ones.data(), ones.size());
  Host result(out.size());
  for (float value : {0.5f, -2.0f}) {
    const Host w(weight.size(), value);
    memory.from_host(weight.data(), w.data(), w.size() * sizeof(float));
    gpu->matmul_forward(out.data(), in.data(), weight.data(), n, ic, oc);
    gpu->copy_to_host(result.data(), out.data(), result.size());
    EXPECT_FLOAT_EQ(result[0], value * ic) << "weights " << value;
  }
}

// An engine's switch copies from the old engine's buffers into the new one's, each allocated by
// the engine's own backend: one backend reaches another's buffers, and ending one frees its own.
TEST_F(CudaBackend, OneBackendReachesAnothersBuffers) {
  auto old_backend = make_cuda_backend(CudaMath::kBf16);
  auto new_backend = make_cuda_backend(CudaMath::kBf16);
  const Host x = random_vector(1000, 33, -3, 3);
  Buffer<float> from(*old_backend, x.size(), MemoryKind::kActivations);
  Buffer<float> to(*new_backend, x.size(), MemoryKind::kActivations, Precision::kExact);
  old_backend->copy_from_host(from.data(), x.data(), x.size());
  new_backend->copy(to.data(), from.data(), x.size());
  from = {};
  old_backend.reset();
  Host back(x.size());
  new_backend->copy_to_host(back.data(), to.data(), back.size());
  EXPECT_EQ(back, rounded_bf16(x));
}

Outputs matmul_outputs(Side& s, int n, int ic, int oc, uint64_t seed) {
  const Host in = random_vector(size_t(n) * ic, seed),
             weight = random_vector(size_t(oc) * ic, seed + 1),
             dout = random_vector(size_t(n) * oc, seed + 2),
             dweight = random_vector(weight.size(), seed + 3);
  float *x = s.put(in), *w = s.put(weight), *out = s.poisoned(size_t(n) * oc),
        *dx = s.poisoned(in.size()), *dw = s.put(dweight), *dy = s.put(dout);
  s.backend->matmul_forward(out, x, w, n, ic, oc);
  s.backend->matmul_backward(dx, dw, dy, x, w, n, ic, oc);
  float* dw_only = s.put(dweight);
  s.backend->matmul_backward(nullptr, dw_only, dy, x, w, n, ic, oc);
  return {{"matmul out", s.get(out, size_t(n) * oc)},
          {"matmul din", s.get(dx, in.size())},
          {"matmul dweight (+=)", s.get(dw, weight.size())},
          {"matmul dweight, no din", s.get(dw_only, weight.size())}};
}

TEST_F(CudaBackend, MatmulMatchesTheCpu) {
  compare([](Side& s) { return matmul_outputs(s, 67, 129, 45, 17); }, 1e-5);
}

// The tensor-core modes: within their rounding of the inputs (tf32: 10 mantissa bits, bf16: 7),
// and visibly not exact, which shows the mode took effect.
TEST_F(CudaBackend, FastMatmulModesStayWithinTheirRounding) {
  const auto op = [](Side& s) { return matmul_outputs(s, 512, 1024, 768, 18); };
  compare(op, 2e-3, CudaMath::kTf32);
  compare(op, 1.5e-2, CudaMath::kBf16);
  Side cpu{make_cpu_backend<float>(2), {}, {}};
  Side gpu{make_cuda_backend(CudaMath::kBf16), {}, {}};
  const Outputs expected = op(cpu), got = op(gpu);
  EXPECT_GT(relative_error(got[0].second, expected[0].second), 1e-5) << "bf16 mode looks exact";
}

TEST_F(CudaBackend, RopeMatchesTheCpu) {
  const int batch = 2, seq = 33, heads = 3, head_dim = 16;
  const Host x = random_vector(size_t(batch) * seq * heads * head_dim, 19);
  compare(
      [&](Side& s) {
        float *a = s.put(x), *b = s.put(x);
        s.backend->rope_forward(a, batch, seq, heads, head_dim, 10000.f, 0);
        s.backend->rope_forward(b, 1, seq, heads, head_dim, 500000.f, 7);
        float* d = s.put(x);
        s.backend->rope_backward(d, batch, seq, heads, head_dim, 10000.f);
        return Outputs{{"rope forward", s.get(a, x.size())},
                       {"rope forward, past 7", s.get(b, x.size() / 2)},
                       {"rope backward", s.get(d, x.size())}};
      },
      1e-6);
}

struct AttentionShape {
  int batch, seq, past, q_heads, kv_heads, head_dim;
};

// Attention's output and, without past positions, its gradients. The state is each backend's
// own (the CPU keeps the softmax, the GPU a log-sum-exp per row), so it is not compared. With
// `rounded`, the inputs are bf16 values, as the GPU's bf16 mode stores them.
Outputs attention_outputs(Side& s, const AttentionShape& a, uint64_t seed, bool rounded = false) {
  const int keys = a.past + a.seq;
  const size_t q_size = size_t(a.batch) * a.seq * a.q_heads * a.head_dim;
  const size_t kv_size = size_t(a.batch) * keys * a.kv_heads * a.head_dim;
  const auto input = [&](size_t count, uint64_t at, float low, float high) {
    const Host values = random_vector(count, at, low, high);
    return s.put(rounded ? rounded_bf16(values) : values);
  };
  float *q = input(q_size, seed, -2, 2), *k = input(kv_size, seed + 1, -2, 2),
        *v = input(kv_size, seed + 2, -1, 1);
  const size_t state_size = s.backend->attention_state_size(a.batch, a.seq, keys, a.q_heads);
  float *out = s.poisoned(q_size), *state = s.put_exact(Host(state_size, kPoison));
  s.backend->attention_forward(out, state, q, k, v, a.batch, a.seq, a.past, a.q_heads, a.kv_heads,
                               a.head_dim);
  Outputs outputs{{"attention out", s.get(out, q_size)}};
  if (a.past == 0) {
    float *dq = s.poisoned(q_size), *dk = s.poisoned(kv_size), *dv = s.poisoned(kv_size);
    s.backend->attention_backward(dq, dk, dv, input(q_size, seed + 3, -1, 1), out, state, q, k, v,
                                  a.batch, a.seq, a.q_heads, a.kv_heads, a.head_dim);
    outputs.push_back({"attention dq", s.get(dq, q_size)});
    outputs.push_back({"attention dk", s.get(dk, kv_size)});
    outputs.push_back({"attention dv", s.get(dv, kv_size)});
  }
  return outputs;
}

// Exact mode runs the fp32 kernels (any head_dim): the same arithmetic as the CPU's up to order.
TEST_F(CudaBackend, GroupedCausalAttentionMatchesTheCpu) {
  compare([](Side& s) { return attention_outputs(s, {2, 77, 0, 6, 2, 16}, 20); }, 1e-5);
  compare([](Side& s) { return attention_outputs(s, {3, 40, 0, 4, 4, 32}, 21); }, 1e-5);
  compare([](Side& s) { return attention_outputs(s, {1, 5, 11, 8, 2, 16}, 22); }, 1e-5);
  compare([](Side& s) { return attention_outputs(s, {2, 130, 0, 4, 2, 64}, 23); }, 1e-5);
}

// bf16 mode with head_dim 64 or 128 runs the tensor-core kernels: bf16 inputs (the same values on
// both sides), the probabilities rounded to bf16 before their product, bf16 outputs. Sequences
// that are not a multiple of the 64-row tiles, grouped heads, and cached positions (past > 0).
TEST_F(CudaBackend, FlashAttentionOnTensorCoresStaysNearTheCpu) {
  for (const AttentionShape shape :
       {AttentionShape{2, 200, 0, 8, 2, 64}, AttentionShape{1, 129, 0, 4, 4, 128},
        AttentionShape{2, 64, 0, 4, 1, 64}, AttentionShape{1, 3, 250, 8, 2, 64},
        AttentionShape{1, 70, 60, 4, 2, 128}}) {
    std::printf("  batch %d seq %d past %d heads %d/%d head_dim %d\n", shape.batch, shape.seq,
                shape.past, shape.q_heads, shape.kv_heads, shape.head_dim);
    compare([&](Side& s) { return attention_outputs(s, shape, 24, true); }, 1.5e-2,
            CudaMath::kBf16);
  }
}

TEST_F(CudaBackend, CrossEntropyOfAVocabularySliceMatchesTheCpu) {
  const int n = 97, vocab = 1000, vocab_begin = 300;
  const Host logits = random_vector(size_t(n) * vocab, 23, -8, 8);
  const auto targets = random_tokens(n, 0, 1500, 24);  // some outside the slice
  compare(
      [&](Side& s) {
        float* x = s.put(logits);
        int32_t* t = s.put_tokens(targets);
        float *top = s.poisoned(n), *sum = s.poisoned(n), *target = s.poisoned(n),
              *losses = s.poisoned(n), *dx = s.poisoned(logits.size());
        s.backend->logits_row_max(top, x, n, vocab);
        s.backend->logits_softmax_sums(sum, target, x, top, t, vocab_begin, n, vocab);
        s.backend->cross_entropy_loss(losses, top, sum, target, n);
        s.backend->cross_entropy_backward(dx, x, top, sum, t, vocab_begin, 0.25f, n, vocab);
        return Outputs{{"row max", s.get(top, n)},
                       {"sum exp", s.get(sum, n)},
                       {"target logit", s.get(target, n)},
                       {"losses", s.get(losses, n)},
                       {"dlogits", s.get(dx, logits.size())}};
      },
      1e-5);
}

// ---- a whole training step ---------------------------------------------------------------------
// head_dim 16: the fp32 attention kernels in every mode.
model::ModelConfig small_llama() {
  return malleus::testing::cuda_test_model();
}

// head_dim 64: bf16 mode's tensor-core attention, sequences longer than one 64-row tile.
model::ModelConfig small_llama_64() {
  model::ModelConfig c = small_llama();
  c.name = "cuda-test-64";
  c.hidden_size = 256;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.ffn_hidden_size = 704;
  c.max_seq_len = 160;
  return c;
}

struct StepResult {
  double loss = 0;
  Host grads, params;
};

// Two micro-batches of forward and backward, the gradient norm, one AdamW update.
StepResult training_step(Backend<float>& backend,
                         const model::ModelConfig& config = small_llama()) {
  const int micro = 2, seq = config.max_seq_len, tokens = micro * seq;
  model::Transformer<float> model(config, backend, micro, seq);
  model.init_parameters(7);
  const size_t size = size_t(model.layout().total_size());
  Buffer<float> m(backend, size, MemoryKind::kOptimizer), v(backend, size, MemoryKind::kOptimizer);
  StepResult result;
  model.zero_grads();
  for (int micro_batch = 0; micro_batch < 2; ++micro_batch) {
    const auto inputs = random_tokens(size_t(tokens), 0, config.vocab_size, 30 + micro_batch);
    const auto targets = random_tokens(size_t(tokens), 0, config.vocab_size, 40 + micro_batch);
    result.loss += model.forward(inputs.data(), targets.data());
    model.backward(1.0f / float(2 * tokens));
  }
  result.grads.resize(size);
  backend.copy_to_host(result.grads.data(), model.grads(), size);
  const double norm = std::sqrt(backend.sum_squares(model.grads(), size));
  backend.adamw_update(model.params(), model.grads(), m.data(), v.data(), size,
                       {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, float(norm > 1 ? 1 / norm : 1), 1});
  result.params.resize(size);
  backend.copy_to_host(result.params.data(), model.params(), size);
  return result;
}

TEST_F(CudaBackend, ATrainingStepMatchesTheCpu) {
  auto cpu = make_cpu_backend<float>(2);
  auto gpu = make_cuda_backend(CudaMath::kExact);
  const StepResult expected = training_step(*cpu), got = training_step(*gpu);
  std::printf("  loss cpu %.9g gpu %.9g\n", expected.loss, got.loss);
  EXPECT_NEAR(got.loss, expected.loss, 1e-5 * std::abs(expected.loss));
  const double grads = relative_error(got.grads, expected.grads);
  const double params = relative_error(got.params, expected.params);
  std::printf("  gradients relative error %.3g, parameters after AdamW %.3g\n", grads, params);
  EXPECT_LE(grads, 1e-4);
  EXPECT_LE(params, 1e-5);
}

TEST_F(CudaBackend, ATrainingStepIsBitIdenticalEveryRun) {
  for (CudaMath math : {CudaMath::kExact, CudaMath::kBf16}) {
    auto gpu = make_cuda_backend(math);
    const StepResult first = training_step(*gpu, small_llama_64()),
                     second = training_step(*gpu, small_llama_64());
    EXPECT_EQ(first.loss, second.loss) << cuda_math_name(math);
    EXPECT_EQ(first.grads, second.grads) << cuda_math_name(math);
    EXPECT_EQ(first.params, second.params) << cuda_math_name(math);
  }
}

// bf16 storage of activations and product inputs, fp32 master weights, gradients and moments.
TEST_F(CudaBackend, ABf16TrainingStepStaysNearTheCpu) {
  for (const auto& config : {small_llama(), small_llama_64()}) {
    auto cpu = make_cpu_backend<float>(2);
    auto gpu = make_cuda_backend(CudaMath::kBf16);
    const StepResult expected = training_step(*cpu, config), got = training_step(*gpu, config);
    const double grads = relative_error(got.grads, expected.grads);
    const double params = relative_error(got.params, expected.params);
    std::printf(
        "  %s bf16: loss cpu %.9g gpu %.9g, gradients relative error %.3g, parameters %.3g\n",
        config.name.c_str(), expected.loss, got.loss, grads, params);
    EXPECT_NEAR(got.loss, expected.loss, 2e-3 * std::abs(expected.loss)) << config.name;
    EXPECT_LE(grads, 1e-1) << config.name;
    EXPECT_LE(params, 1e-2) << config.name;
  }
}

// A plan switch gives back every activation and workspace buffer (Backend::decommit_all), the
// token buffers (plain device memory, outside the bf16 storage map) among them: each reads as
// zeros afterwards, in both math modes.
TEST_F(CudaBackend, GivingBackActivationsZeroesTokenAndValueBuffers) {
  for (const CudaMath math : {CudaMath::kExact, CudaMath::kBf16}) {
    auto gpu = make_cuda_backend(math);
    Buffer<float, int32_t> tokens(*gpu, 512, MemoryKind::kActivations);
    Buffer<float> values(*gpu, 300, MemoryKind::kActivations);
    const std::vector<int32_t> ids(512, 7);
    const std::vector<float> ones(300, 1.0f);
    gpu->copy_tokens_from_host(tokens.data(), ids.data(), ids.size());
    gpu->copy_from_host(values.data(), ones.data(), ones.size());
    EXPECT_NO_THROW(gpu->decommit_all(MemoryKind::kActivations));
    std::vector<float> read(300, -1.0f);
    gpu->copy_to_host(read.data(), values.data(), read.size());
    EXPECT_EQ(read, std::vector<float>(300, 0.0f));
    std::vector<int32_t> ids_read(512, -1);
    const size_t bytes = ids_read.size() * sizeof(int32_t);
    gpu->device_memory()->to_host(ids_read.data(), tokens.data(), bytes, 1, bytes);
    EXPECT_EQ(ids_read, std::vector<int32_t>(512, 0));
  }
}

// An injected straggler's extra work (RegionTimer::keep_busy) runs on the device, so the events
// that time a region count it, as they count a slow device's own kernels.
TEST_F(CudaBackend, TheEventTimerCountsTheBusyWorkItQueues) {
  cuda_use_device(0);
  const auto timer = make_cuda_event_timer();
  timer->begin();
  timer->keep_busy(0.050);
  const double seconds = timer->elapsed();
  std::printf("  keep_busy(0.050) timed by events: %.4f s\n", seconds);
  EXPECT_GE(seconds, 0.049);
  EXPECT_LE(seconds, 0.5);
}

TEST(CudaBackendMath, ModeNamesParseAndBadOnesAreRefused) {
  EXPECT_EQ(parse_cuda_math("bf16"), CudaMath::kBf16);
  EXPECT_EQ(cuda_math_name(parse_cuda_math("tf32")), "tf32");
  try {
    parse_cuda_math("fp8");
    FAIL() << "fp8 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"fp8\""), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace malleus::backend
