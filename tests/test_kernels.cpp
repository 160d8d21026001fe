// Tests of the CPU backend's kernels: every backward against central differences in double
// precision, float against double, the semantics the trainer relies on (accumulating parameter
// gradients, causal masking, AdamW's exact update) and bit-exact determinism.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/vector_math.h"
#include "backend/cuda/storage_map.h"
#include "common/error.h"
#include "common/host_pages.h"

namespace malleus::backend {
namespace {

using Vector = std::vector<double>;
using Tensors = std::vector<Vector>;

Vector random_vector(size_t count, uint64_t seed, double low = -1, double high = 1) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> distribution(low, high);
  Vector values(count);
  for (double& value : values) value = distribution(rng);
  return values;
}

std::vector<int32_t> random_tokens(size_t count, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> distribution(0, vocab - 1);
  std::vector<int32_t> tokens(count);
  for (int32_t& token : tokens) token = distribution(rng);
  return tokens;
}

// A backend with helpers to move host vectors in and out of its memory.
template <typename T>
struct Device {
  explicit Device(int threads) : backend(make_cpu_backend<T>(threads)) {}

  template <typename Source>
  Buffer<T> put(const std::vector<Source>& host) {
    std::vector<T> converted(host.begin(), host.end());
    Buffer<T> buffer(*backend, converted.size(), MemoryKind::kWorkspace);
    backend->copy_from_host(buffer.data(), converted.data(), converted.size());
    return buffer;
  }
  Buffer<T, int32_t> put_tokens(const std::vector<int32_t>& host) {
    Buffer<T, int32_t> buffer(*backend, host.size(), MemoryKind::kWorkspace);
    backend->copy_tokens_from_host(buffer.data(), host.data(), host.size());
    return buffer;
  }
  Buffer<T> zeros(size_t count) { return Buffer<T>(*backend, count, MemoryKind::kWorkspace); }
  std::vector<T> get(const Buffer<T>& buffer) {
    std::vector<T> host(buffer.size());
    backend->copy_to_host(host.data(), buffer.data(), buffer.size());
    return host;
  }
  Vector get_double(const Buffer<T>& buffer) {
    const std::vector<T> host = get(buffer);
    return Vector(host.begin(), host.end());
  }

  std::unique_ptr<Backend<T>> backend;
};

double dot(const Vector& a, const Vector& b) {
  double sum = 0;
  for (size_t i = 0; i < a.size(); ++i) sum += a[i] * b[i];
  return sum;
}

// ||a − b|| / ||(|a| + |b|)||: scale-free, and 0 when both vanish.
double relative_error(const Vector& a, const Vector& b) {
  double difference = 0;
  double magnitude = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    difference += (a[i] - b[i]) * (a[i] - b[i]);
    magnitude += (std::abs(a[i]) + std::abs(b[i])) * (std::abs(a[i]) + std::abs(b[i]));
  }
  return magnitude == 0 ? 0 : std::sqrt(difference / magnitude);
}

// Largest elementwise difference relative to the largest magnitude: catches one wrong element
// that the norm would average away.
double max_relative_error(const Vector& a, const Vector& b) {
  double difference = 0;
  double magnitude = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    difference = std::max(difference, std::abs(a[i] - b[i]));
    magnitude = std::max({magnitude, std::abs(a[i]), std::abs(b[i])});
  }
  return magnitude == 0 ? 0 : difference / magnitude;
}

// Checks backward against central differences of L = Σ w ⊙ forward(inputs) for a fixed random w.
// backward(inputs, w) returns dL/d(input) for every input, in order. The tests run backward on two
// threads and the many forward evaluations on one: a parallel region per tiny call only adds
// barrier waits, which get slow when other processes load the cores.
void check_gradients(const std::string& op, const Tensors& inputs, size_t output_size,
                     const std::function<Vector(const Tensors&)>& forward,
                     const std::function<Tensors(const Tensors&, const Vector&)>& backward) {
  const Vector weights = random_vector(output_size, 7, -1, 1);
  ASSERT_EQ(forward(inputs).size(), output_size) << op;
  const Tensors analytic = backward(inputs, weights);
  ASSERT_EQ(analytic.size(), inputs.size()) << op;
  const double eps = 1e-6;
  for (size_t which = 0; which < inputs.size(); ++which) {
    Vector numeric(inputs[which].size());
    Tensors perturbed = inputs;
    for (size_t i = 0; i < numeric.size(); ++i) {
      const double original = perturbed[which][i];
      perturbed[which][i] = original + eps;
      const double plus = dot(weights, forward(perturbed));
      perturbed[which][i] = original - eps;
      const double minus = dot(weights, forward(perturbed));
      perturbed[which][i] = original;
      numeric[i] = (plus - minus) / (2 * eps);
    }
    ASSERT_EQ(analytic[which].size(), numeric.size()) << op << " input " << which;
    EXPECT_LT(relative_error(analytic[which], numeric), 3e-8) << op << " input " << which;
    EXPECT_LT(max_relative_error(analytic[which], numeric), 1e-7) << op << " input " << which;
  }
}

// ---- the ops as functions of host vectors, for any precision ----------------------------------

template <typename T>
Vector matmul(Device<T>& d, const Vector& in, const Vector& weight, int n, int ic, int oc) {
  auto x = d.put(in);
  auto w = d.put(weight);
  auto out = d.zeros(static_cast<size_t>(n) * oc);
  d.backend->matmul_forward(out.data(), x.data(), w.data(), n, ic, oc);
  return d.get_double(out);
}

template <typename T>
Vector rmsnorm(Device<T>& d, const Vector& in, const Vector& weight, int n, int c) {
  auto x = d.put(in);
  auto w = d.put(weight);
  auto out = d.zeros(in.size());
  auto rstd = d.zeros(static_cast<size_t>(n));
  d.backend->rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), n, c, 1e-5f);
  return d.get_double(out);
}

// The whole table, or the slice of rows [vocab_begin, vocab_begin + table.size() / c) of it.
template <typename T>
Vector embedding(Device<T>& d, const std::vector<int32_t>& tokens, const Vector& table, int c,
                 int vocab_begin = 0) {
  auto t = d.put_tokens(tokens);
  auto table_buffer = d.put(table);
  // Garbage in the output first: rows of tokens held elsewhere must be written as zeros.
  auto out = d.put(random_vector(tokens.size() * c, 99, 5, 6));
  d.backend->embedding_forward(out.data(), t.data(), table_buffer.data(), vocab_begin,
                               static_cast<int>(table.size()) / c, static_cast<int>(tokens.size()),
                               c);
  return d.get_double(out);
}

struct RopeShape {
  int batch, seq, heads, head_dim;
  float theta;
  size_t size() const { return static_cast<size_t>(batch) * seq * heads * head_dim; }
};

template <typename T>
Vector rope(Device<T>& d, const Vector& in, const RopeShape& s) {
  auto x = d.put(in);
  d.backend->rope_forward(x.data(), s.batch, s.seq, s.heads, s.head_dim, s.theta, 0);
  return d.get_double(x);
}

struct AttentionShape {
  int batch, seq, q_heads, kv_heads, head_dim;
  size_t q_size() const { return static_cast<size_t>(batch) * seq * q_heads * head_dim; }
  size_t kv_size() const { return static_cast<size_t>(batch) * seq * kv_heads * head_dim; }
  size_t probs_size() const { return static_cast<size_t>(batch) * q_heads * seq * seq; }
};

// Attention's forward on the device, its inputs and probabilities kept there for the backward.
template <typename T>
struct AttentionForward {
  AttentionForward(Device<T>& d, const Vector& q_host, const Vector& k_host, const Vector& v_host,
                   const AttentionShape& s)
      : q(d.put(q_host)),
        k(d.put(k_host)),
        v(d.put(v_host)),
        out(d.zeros(s.q_size())),
        probs(d.zeros(s.probs_size())) {
    d.backend->attention_forward(out.data(), probs.data(), q.data(), k.data(), v.data(), s.batch,
                                 s.seq, 0, s.q_heads, s.kv_heads, s.head_dim);
  }
  Buffer<T> q, k, v, out, probs;
};

// Returns the output and fills `probs` when given.
template <typename T>
Vector attention(Device<T>& d, const Vector& q, const Vector& k, const Vector& v,
                 const AttentionShape& s, Vector* probs = nullptr) {
  const AttentionForward<T> forward(d, q, k, v, s);
  if (probs != nullptr) *probs = d.get_double(forward.probs);
  return d.get_double(forward.out);
}

template <typename T>
Tensors attention_grad(Device<T>& d, const Vector& q, const Vector& k, const Vector& v,
                       const Vector& dout, const AttentionShape& s) {
  const AttentionForward<T> forward(d, q, k, v, s);
  auto dob = d.put(dout);
  auto dq = d.zeros(s.q_size());
  auto dk = d.zeros(s.kv_size());
  auto dv = d.zeros(s.kv_size());
  d.backend->attention_backward(dq.data(), dk.data(), dv.data(), dob.data(), forward.out.data(),
                                forward.probs.data(), forward.q.data(), forward.k.data(),
                                forward.v.data(), s.batch, s.seq, s.q_heads, s.kv_heads,
                                s.head_dim);
  return {d.get_double(dq), d.get_double(dk), d.get_double(dv)};
}

template <typename T>
Vector swiglu(Device<T>& d, const Vector& gate, const Vector& up) {
  auto g = d.put(gate);
  auto u = d.put(up);
  auto out = d.zeros(gate.size());
  d.backend->swiglu_forward(out.data(), g.data(), u.data(), gate.size());
  return d.get_double(out);
}

// Cross-entropy over the whole vocabulary (one slice, so no reduction between the passes): the
// losses, and dlogits for `loss_scale` when `dlogits` is given.
template <typename T>
Vector cross_entropy(Device<T>& d, const Vector& logits, const std::vector<int32_t>& targets,
                     int vocab, Vector* dlogits = nullptr, double loss_scale = 1) {
  const int n = static_cast<int>(targets.size());
  auto x = d.put(logits);
  auto t = d.put_tokens(targets);
  auto top = d.zeros(targets.size());
  auto sums = d.zeros(targets.size());
  auto target_logit = d.zeros(targets.size());
  auto losses = d.zeros(targets.size());
  d.backend->logits_row_max(top.data(), x.data(), n, vocab);
  d.backend->logits_softmax_sums(sums.data(), target_logit.data(), x.data(), top.data(), t.data(),
                                 0, n, vocab);
  d.backend->cross_entropy_loss(losses.data(), top.data(), sums.data(), target_logit.data(), n);
  if (dlogits != nullptr) {
    auto dx = d.zeros(logits.size());
    d.backend->cross_entropy_backward(dx.data(), x.data(), top.data(), sums.data(), t.data(), 0,
                                      static_cast<T>(loss_scale), n, vocab);
    *dlogits = d.get_double(dx);
  }
  return d.get_double(losses);
}

// The same with the vocabulary split at `bounds` (0 = bounds.front() < ... < bounds.back() =
// vocab) between ranks that each hold logits[:, bounds[r], bounds[r + 1]), the all-reduces done
// here on the host: max over the slices, then the sums in slice order. Returns the losses and the
// slices' dlogits, put back together into [n, vocab].
template <typename T>
Vector sliced_cross_entropy(Device<T>& d, const Vector& logits, const std::vector<int32_t>& targets,
                            int vocab, const std::vector<int>& bounds, double loss_scale,
                            Vector* dlogits) {
  const size_t n = targets.size();
  const int rows = static_cast<int>(n);
  const size_t slices = bounds.size() - 1;
  auto t = d.put_tokens(targets);
  std::vector<Buffer<T>> parts;
  for (size_t r = 0; r < slices; ++r) {
    Vector part;
    for (size_t i = 0; i < n; ++i) {
      part.insert(part.end(), logits.begin() + static_cast<long>(i * vocab + bounds[r]),
                  logits.begin() + static_cast<long>(i * vocab + bounds[r + 1]));
    }
    parts.push_back(d.put(part));
  }
  const auto width = [&](size_t r) { return bounds[r + 1] - bounds[r]; };
  // Pass 1 and all-reduce(max).
  std::vector<T> top(n, -std::numeric_limits<T>::infinity());
  for (size_t r = 0; r < slices; ++r) {
    auto local = d.zeros(n);
    d.backend->logits_row_max(local.data(), parts[r].data(), rows, width(r));
    const std::vector<T> host = d.get(local);
    for (size_t i = 0; i < n; ++i) top[i] = std::max(top[i], host[i]);
  }
  auto top_buffer = d.put(top);
  // Pass 2 and all-reduce(sum), of the exponentials and of the target logits.
  std::vector<T> sums(n, T(0)), target_logit(n, T(0));
  for (size_t r = 0; r < slices; ++r) {
    auto local_sums = d.zeros(n);
    auto local_target = d.zeros(n);
    d.backend->logits_softmax_sums(local_sums.data(), local_target.data(), parts[r].data(),
                                   top_buffer.data(), t.data(), bounds[r], rows, width(r));
    const std::vector<T> host_sums = d.get(local_sums), host_target = d.get(local_target);
    for (size_t i = 0; i < n; ++i) {
      sums[i] += host_sums[i];
      target_logit[i] += host_target[i];
    }
  }
  auto sums_buffer = d.put(sums);
  auto target_buffer = d.put(target_logit);
  auto losses = d.zeros(n);
  d.backend->cross_entropy_loss(losses.data(), top_buffer.data(), sums_buffer.data(),
                                target_buffer.data(), rows);
  dlogits->assign(n * vocab, 0.0);
  for (size_t r = 0; r < slices; ++r) {
    auto dx = d.zeros(n * width(r));
    d.backend->cross_entropy_backward(dx.data(), parts[r].data(), top_buffer.data(),
                                      sums_buffer.data(), t.data(), bounds[r],
                                      static_cast<T>(loss_scale), rows, width(r));
    const Vector host = d.get_double(dx);
    for (size_t i = 0; i < n; ++i) {
      std::copy(host.begin() + static_cast<long>(i * width(r)),
                host.begin() + static_cast<long>((i + 1) * width(r)),
                dlogits->begin() + static_cast<long>(i * vocab + bounds[r]));
    }
  }
  return d.get_double(losses);
}

// ---- gradient checks (double) ------------------------------------------------------------------

TEST(Gradients, Matmul) {
  Device<double> d(2);
  Device<double> serial(1);
  const int n = 5, ic = 7, oc = 4;
  check_gradients(
      "matmul", {random_vector(n * ic, 1), random_vector(oc * ic, 2)}, n * oc,
      [&](const Tensors& x) { return matmul(serial, x[0], x[1], n, ic, oc); },
      [&](const Tensors& x, const Vector& dout) -> Tensors {
        auto in = d.put(x[0]);
        auto w = d.put(x[1]);
        auto g = d.put(dout);
        auto din = d.zeros(x[0].size());
        auto dw = d.zeros(x[1].size());
        d.backend->matmul_backward(din.data(), dw.data(), g.data(), in.data(), w.data(), n, ic, oc);
        return {d.get_double(din), d.get_double(dw)};
      });
}

TEST(Gradients, RmsNorm) {
  Device<double> d(2);
  Device<double> serial(1);
  const int n = 6, c = 8;
  check_gradients(
      "rmsnorm", {random_vector(n * c, 3), random_vector(c, 4, 0.5, 1.5)}, n * c,
      [&](const Tensors& x) { return rmsnorm(serial, x[0], x[1], n, c); },
      [&](const Tensors& x, const Vector& dout) -> Tensors {
        auto in = d.put(x[0]);
        auto w = d.put(x[1]);
        auto out = d.zeros(x[0].size());
        auto rstd = d.zeros(n);
        d.backend->rmsnorm_forward(out.data(), rstd.data(), in.data(), w.data(), n, c, 1e-5f);
        auto g = d.put(dout);
        auto din = d.zeros(x[0].size());
        auto dw = d.zeros(x[1].size());
        d.backend->rmsnorm_backward(din.data(), dw.data(), g.data(), in.data(), w.data(),
                                    rstd.data(), n, c);
        return {d.get_double(din), d.get_double(dw)};
      });
}

TEST(Gradients, Embedding) {
  Device<double> d(2);
  Device<double> serial(1);
  const int vocab = 5, c = 3;
  const std::vector<int32_t> tokens = {1, 4, 1, 0, 1, 3, 4};  // repeats must add up
  check_gradients(
      "embedding", {random_vector(vocab * c, 5)}, tokens.size() * c,
      [&](const Tensors& x) { return embedding(serial, tokens, x[0], c); },
      [&](const Tensors& x, const Vector& dout) -> Tensors {
        auto t = d.put_tokens(tokens);
        auto g = d.put(dout);
        auto dtable = d.zeros(x[0].size());
        d.backend->embedding_backward(dtable.data(), g.data(), t.data(), 0, vocab,
                                      static_cast<int>(tokens.size()), c);
        return {d.get_double(dtable)};
      });
}

TEST(Gradients, Rope) {
  Device<double> d(2);
  Device<double> serial(1);
  const RopeShape s{2, 5, 3, 6, 10000.0f};
  check_gradients(
      "rope", {random_vector(s.size(), 6)}, s.size(),
      [&](const Tensors& x) { return rope(serial, x[0], s); },
      [&](const Tensors&, const Vector& dout) -> Tensors {
        auto g = d.put(dout);
        d.backend->rope_backward(g.data(), s.batch, s.seq, s.heads, s.head_dim, s.theta);
        return {d.get_double(g)};
      });
}

void check_attention_gradients(const AttentionShape& s) {
  Device<double> d(2);
  Device<double> serial(1);
  check_gradients(
      "attention",
      {random_vector(s.q_size(), 8), random_vector(s.kv_size(), 9), random_vector(s.kv_size(), 10)},
      s.q_size(), [&](const Tensors& x) { return attention(serial, x[0], x[1], x[2], s); },
      [&](const Tensors& x, const Vector& dout) {
        return attention_grad(d, x[0], x[1], x[2], dout, s);
      });
}

TEST(Gradients, Attention) {
  check_attention_gradients({2, 5, 2, 2, 4});
}
TEST(Gradients, AttentionGroupedQuery) {
  check_attention_gradients({2, 6, 4, 2, 3});
}
// Longer than one causal block of the kernel, so the blocked products are checked too.
TEST(Gradients, AttentionLongSequence) {
  check_attention_gradients({1, 70, 2, 1, 2});
}

TEST(Gradients, SwiGlu) {
  Device<double> d(2);
  Device<double> serial(1);
  const size_t count = 24;
  check_gradients(
      "swiglu", {random_vector(count, 11, -6, 6), random_vector(count, 12)}, count,
      [&](const Tensors& x) { return swiglu(serial, x[0], x[1]); },
      [&](const Tensors& x, const Vector& dout) -> Tensors {
        auto g = d.put(x[0]);
        auto u = d.put(x[1]);
        auto dy = d.put(dout);
        auto dg = d.zeros(count);
        auto du = d.zeros(count);
        d.backend->swiglu_backward(dg.data(), du.data(), dy.data(), g.data(), u.data(), count);
        return {d.get_double(dg), d.get_double(du)};
      });
}

TEST(Gradients, CrossEntropy) {
  Device<double> d(2);
  Device<double> serial(1);
  const int n = 4, vocab = 7;
  const std::vector<int32_t> targets = {3, 0, 6, 3};
  // backward takes one loss scale for all rows, so the objective is the (weighted) total loss and
  // its weight is the loss scale.
  check_gradients(
      "cross_entropy", {random_vector(n * vocab, 13, -3, 3)}, 1,
      [&](const Tensors& x) {
        const Vector losses = cross_entropy(serial, x[0], targets, vocab);
        return Vector{dot(losses, Vector(n, 1.0))};
      },
      [&](const Tensors& x, const Vector& dout) -> Tensors {
        Vector dlogits;
        cross_entropy(d, x[0], targets, vocab, &dlogits, dout[0]);
        return {dlogits};
      });
}

// ---- accumulation of parameter gradients -----------------------------------------------------

TEST(Accumulation, ParameterGradientsAdd) {
  Device<double> d(2);
  const int n = 9, c = 6, oc = 5, vocab = 4;
  const Vector in = random_vector(n * c, 20);
  const Vector weight = random_vector(oc * c, 21);
  const Vector norm_weight = random_vector(c, 22, 0.5, 1.5);
  const Vector dout = random_vector(n * oc, 23);
  const Vector dnorm = random_vector(n * c, 24);
  const std::vector<int32_t> tokens = random_tokens(n, vocab, 25);
  const Vector start = random_vector(oc * c, 26);

  auto x = d.put(in);
  auto w = d.put(weight);
  auto nw = d.put(norm_weight);
  auto g = d.put(dout);
  auto gn = d.put(dnorm);
  auto t = d.put_tokens(tokens);
  auto out = d.zeros(n * c);
  auto rstd = d.zeros(n);
  d.backend->rmsnorm_forward(out.data(), rstd.data(), x.data(), nw.data(), n, c, 1e-5f);

  // Runs each backward `times` times into gradients that start at `initial`.
  const auto run = [&](int times, const Vector& initial) {
    auto dw = d.put(Vector(initial.begin(), initial.begin() + oc * c));
    auto dnw = d.put(Vector(initial.begin(), initial.begin() + c));
    auto dtable = d.put(Vector(initial.begin(), initial.begin() + vocab * c));
    auto din = d.zeros(n * c);
    for (int i = 0; i < times; ++i) {
      // A null din skips the input gradient, as for the first layer.
      d.backend->matmul_backward(i == 0 ? din.data() : nullptr, dw.data(), g.data(), x.data(),
                                 w.data(), n, c, oc);
      d.backend->rmsnorm_backward(din.data(), dnw.data(), gn.data(), x.data(), nw.data(),
                                  rstd.data(), n, c);
      d.backend->embedding_backward(dtable.data(), gn.data(), t.data(), 0, vocab, n, c);
    }
    return Tensors{d.get_double(dw), d.get_double(dnw), d.get_double(dtable)};
  };
  const Tensors once = run(1, Vector(oc * c, 0.0));
  const Tensors twice = run(2, Vector(oc * c, 0.0));
  const Tensors offset = run(1, start);
  for (size_t which = 0; which < once.size(); ++which) {
    for (size_t i = 0; i < once[which].size(); ++i) {
      EXPECT_NEAR(twice[which][i], 2 * once[which][i], 1e-14 * std::abs(once[which][i]))
          << which << " " << i;
      EXPECT_NEAR(offset[which][i], start[i] + once[which][i], 1e-14) << which << " " << i;
    }
  }
}

// ---- float against double --------------------------------------------------------------------

// Inputs are rounded to float first, so both precisions compute the same function of the same
// numbers and only the arithmetic differs.
Vector as_float(const Vector& x) {
  Vector rounded(x.size());
  for (size_t i = 0; i < x.size(); ++i) rounded[i] = static_cast<float>(x[i]);
  return rounded;
}

TEST(FloatMatchesDouble, Forward) {
  Device<float> f(2);
  Device<double> d(2);
  const auto expect_close = [](const Vector& a, const Vector& b, const char* op) {
    ASSERT_EQ(a.size(), b.size()) << op;
    EXPECT_LT(relative_error(a, b), 1e-6) << op;
    EXPECT_LT(max_relative_error(a, b), 1e-5) << op;
  };
  {
    const int n = 33, ic = 70, oc = 50;
    const Vector in = as_float(random_vector(n * ic, 30));
    const Vector w = as_float(random_vector(oc * ic, 31));
    expect_close(matmul(f, in, w, n, ic, oc), matmul(d, in, w, n, ic, oc), "matmul");
  }
  {
    const int n = 17, c = 96;
    const Vector in = as_float(random_vector(n * c, 32));
    const Vector w = as_float(random_vector(c, 33, 0.5, 1.5));
    expect_close(rmsnorm(f, in, w, n, c), rmsnorm(d, in, w, n, c), "rmsnorm");
  }
  {
    const int c = 40;
    const Vector table = as_float(random_vector(11 * c, 34));
    const std::vector<int32_t> tokens = random_tokens(23, 11, 35);
    EXPECT_EQ(embedding(f, tokens, table, c), embedding(d, tokens, table, c));
  }
  {
    const RopeShape s{2, 300, 3, 16, 500000.0f};
    const Vector x = as_float(random_vector(s.size(), 36));
    expect_close(rope(f, x, s), rope(d, x, s), "rope");
  }
  {
    const AttentionShape s{2, 100, 4, 2, 16};
    const Vector q = as_float(random_vector(s.q_size(), 37, -2, 2));
    const Vector k = as_float(random_vector(s.kv_size(), 38, -2, 2));
    const Vector v = as_float(random_vector(s.kv_size(), 39));
    Vector pf, pd;
    expect_close(attention(f, q, k, v, s, &pf), attention(d, q, k, v, s, &pd), "attention");
    expect_close(pf, pd, "attention probs");
  }
  {
    const Vector gate = as_float(random_vector(5000, 40, -20, 20));
    const Vector up = as_float(random_vector(5000, 41));
    expect_close(swiglu(f, gate, up), swiglu(d, gate, up), "swiglu");
  }
  {
    const int n = 9, vocab = 1000;
    const Vector logits = as_float(random_vector(n * vocab, 42, -10, 10));
    const std::vector<int32_t> targets = random_tokens(n, vocab, 43);
    Vector df, dd;
    expect_close(cross_entropy(f, logits, targets, vocab, &df, 0.25),
                 cross_entropy(d, logits, targets, vocab, &dd, 0.25), "cross_entropy");
    expect_close(df, dd, "cross_entropy dlogits");
  }
}

// The float exponential is our own polynomial; hold it against libm.
TEST(FloatMatchesDouble, VectorExp) {
  double worst = 0;
  for (double x = -87.0; x <= 88.0; x += 0.0137) {
    const float xf = static_cast<float>(x);
    const double exact = std::exp(static_cast<double>(xf));
    worst = std::max(worst, std::abs(static_cast<double>(vexp(xf)) - exact) / exact);
  }
  EXPECT_LT(worst, 3e-7);
  EXPECT_EQ(vexp(0.0f), 1.0f);
  EXPECT_EQ(vexp(-1000.0f), 0.0f);
  EXPECT_EQ(vexp(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_TRUE(std::isnan(vexp(std::numeric_limits<float>::quiet_NaN())));
}

// ---- single-op semantics ---------------------------------------------------------------------

TEST(Kernels, MatmulMatchesDefinition) {
  Device<double> d(2);
  const int n = 3, ic = 4, oc = 2;
  const Vector in = random_vector(n * ic, 50);
  const Vector w = random_vector(oc * ic, 51);
  const Vector out = matmul(d, in, w, n, ic, oc);
  for (int i = 0; i < n; ++i) {
    for (int o = 0; o < oc; ++o) {
      double expected = 0;
      for (int j = 0; j < ic; ++j) expected += in[i * ic + j] * w[o * ic + j];
      EXPECT_NEAR(out[i * oc + o], expected, 1e-14);
    }
  }
}

TEST(Kernels, RopeMatchesRotateHalf) {
  Device<double> d(1);
  const RopeShape s{1, 4, 2, 8, 10000.0f};
  const Vector x = random_vector(s.size(), 52);
  const Vector y = rope(d, x, s);
  const int half = s.head_dim / 2;
  for (int t = 0; t < s.seq; ++t) {
    for (int h = 0; h < s.heads; ++h) {
      const size_t base = (static_cast<size_t>(t) * s.heads + h) * s.head_dim;
      for (int i = 0; i < half; ++i) {
        const double angle = t * std::pow(10000.0, -2.0 * i / s.head_dim);
        const double x0 = x[base + i], x1 = x[base + i + half];
        EXPECT_NEAR(y[base + i], x0 * std::cos(angle) - x1 * std::sin(angle), 1e-14);
        EXPECT_NEAR(y[base + i + half], x1 * std::cos(angle) + x0 * std::sin(angle), 1e-14);
      }
    }
  }
  // Backward is the inverse rotation; a longer sequence later reuses and grows the cached table.
  auto buffer = d.put(y);
  d.backend->rope_backward(buffer.data(), s.batch, s.seq, s.heads, s.head_dim, s.theta);
  EXPECT_LT(max_relative_error(d.get_double(buffer), x), 1e-15);
  const RopeShape longer{1, 9, 2, 8, 10000.0f};
  const Vector x2 = random_vector(longer.size(), 53);
  const Vector y2 = rope(d, x2, longer);
  const Vector prefix(x2.begin(), x2.begin() + static_cast<long>(s.size()));
  const Vector y_prefix = rope(d, prefix, s);
  for (size_t i = 0; i < s.size(); ++i) EXPECT_EQ(y2[i], y_prefix[i]);
}

TEST(Kernels, CrossEntropyMatchesDefinitionAndIsStable) {
  Device<double> d(2);
  const int vocab = 5;
  const Vector logits = {1, 2, 3, 4, 5, 1000, 1001, 999, 998, 1000.5};
  const std::vector<int32_t> targets = {2, 1};
  const Vector losses = cross_entropy(d, logits, targets, vocab);
  for (int i = 0; i < 2; ++i) {
    double top = -1e300;
    for (int j = 0; j < vocab; ++j) top = std::max(top, logits[i * vocab + j]);
    double sum = 0;
    for (int j = 0; j < vocab; ++j) sum += std::exp(logits[i * vocab + j] - top);
    EXPECT_NEAR(losses[i], std::log(sum) + top - logits[i * vocab + targets[i]], 1e-12);
  }
  Device<float> f(2);
  Vector dlogits;
  for (double loss : cross_entropy(f, logits, targets, vocab, &dlogits)) {
    EXPECT_TRUE(std::isfinite(loss));
  }
  for (double g : dlogits) EXPECT_TRUE(std::isfinite(g));
  // Each row of dlogits is softmax − one-hot, which sums to zero.
  for (int i = 0; i < 2; ++i) {
    double sum = 0;
    for (int j = 0; j < vocab; ++j) sum += dlogits[i * vocab + j];
    EXPECT_NEAR(sum, 0.0, 1e-6);
  }
}

// Vocabulary parallelism: the logits split into uneven slices, with the all-reduces between the
// passes done on the host, give the single-slice losses and dlogits.
template <typename T>
void check_sliced_cross_entropy(double tolerance) {
  Device<T> d(2);
  const int n = 7, vocab = 37;
  // Large logits too, so the shift by the (global) max matters.
  Vector logits = as_float(random_vector(n * vocab, 44, -8, 8));
  for (int j = 0; j < vocab; ++j) logits[5 * vocab + j] += 500;
  // Targets on both sides of every slice boundary.
  const std::vector<int32_t> targets = {0, 10, 11, 36, 19, 20, 4};
  Vector dfull;
  const Vector full = cross_entropy(d, logits, targets, vocab, &dfull, 0.3);
  for (const std::vector<int>& bounds :
       {std::vector<int>{0, 11, vocab}, std::vector<int>{0, 5, 20, vocab},
        std::vector<int>{0, vocab}}) {
    Vector dsliced;
    const Vector sliced = sliced_cross_entropy(d, logits, targets, vocab, bounds, 0.3, &dsliced);
    EXPECT_LT(max_relative_error(sliced, full), tolerance) << bounds.size() - 1 << " slices";
    EXPECT_LT(max_relative_error(dsliced, dfull), tolerance) << bounds.size() - 1 << " slices";
    for (int i = 0; i < n; ++i) {
      EXPECT_NEAR(sliced[i], full[i], tolerance * std::abs(full[i])) << i;
      for (int j = 0; j < vocab; ++j) {
        const size_t k = static_cast<size_t>(i) * vocab + j;
        EXPECT_NEAR(dsliced[k], dfull[k], tolerance * std::max(std::abs(dfull[k]), 1e-3))
            << i << " " << j;
      }
    }
  }
}

TEST(Kernels, CrossEntropyOverVocabularySlicesDouble) {
  check_sliced_cross_entropy<double>(1e-12);
}
TEST(Kernels, CrossEntropyOverVocabularySlicesFloat) {
  check_sliced_cross_entropy<float>(1e-5);
}

// Vocabulary parallelism of the embedding: ranks holding uneven slices of rows give outputs that
// add up to the full table's, and gradients that put together give the full table's, bit for bit.
TEST(Kernels, EmbeddingOverVocabularySlices) {
  Device<double> d(2);
  const int vocab = 9, c = 70;  // more than two column blocks
  const std::vector<int> bounds = {0, 4, vocab};
  const std::vector<int32_t> tokens = {3, 4, 8, 0, 3, 5, 3, 4, 1, 7, 8, 3};
  const int n = static_cast<int>(tokens.size());
  const Vector table = random_vector(static_cast<size_t>(vocab) * c, 45);
  const Vector dout = random_vector(tokens.size() * c, 46);
  const Vector start = random_vector(table.size(), 47);
  auto t = d.put_tokens(tokens);
  auto g = d.put(dout);

  const Vector full = embedding(d, tokens, table, c);
  auto dfull_buffer = d.put(start);
  d.backend->embedding_backward(dfull_buffer.data(), g.data(), t.data(), 0, vocab, n, c);
  const Vector dfull = d.get_double(dfull_buffer);

  Vector summed(full.size(), 0.0);
  Vector dconcatenated;
  for (size_t r = 0; r + 1 < bounds.size(); ++r) {
    const int rows = bounds[r + 1] - bounds[r];
    const auto first = static_cast<long>(bounds[r]) * c;
    const auto last = static_cast<long>(bounds[r + 1]) * c;
    const Vector slice(table.begin() + first, table.begin() + last);
    const Vector out = embedding(d, tokens, slice, c, bounds[r]);
    for (int i = 0; i < n; ++i) {
      const bool held = tokens[i] >= bounds[r] && tokens[i] < bounds[r + 1];
      for (int j = 0; j < c; ++j) {
        const size_t k = static_cast<size_t>(i) * c + j;
        if (!held) {
          EXPECT_EQ(out[k], 0.0) << "slice " << r << " token " << i;
        }
        summed[k] += out[k];
      }
    }
    // The slice's gradient starts from the same values as the full one, between two guard rows
    // that must stay as they are.
    Vector guarded = random_vector(static_cast<size_t>(rows + 2) * c, 48);
    std::copy(start.begin() + first, start.begin() + last, guarded.begin() + c);
    auto dslice = d.put(guarded);
    d.backend->embedding_backward(dslice.data() + c, g.data(), t.data(), bounds[r], rows, n, c);
    const Vector after = d.get_double(dslice);
    EXPECT_TRUE(std::equal(after.begin(), after.begin() + c, guarded.begin()));
    EXPECT_TRUE(std::equal(after.end() - c, after.end(), guarded.end() - c));
    dconcatenated.insert(dconcatenated.end(), after.begin() + c, after.end() - c);
  }
  EXPECT_EQ(summed, full);
  EXPECT_EQ(dconcatenated, dfull);
  // Rows that no token hits keep their starting values (row 2 and 6 here).
  for (const int row : {2, 6}) {
    for (int j = 0; j < c; ++j) {
      const size_t k = static_cast<size_t>(row) * c + j;
      EXPECT_EQ(dfull[k], start[k]);
    }
  }
  // A rank whose slice holds none of the tokens writes zeros and leaves its gradient alone.
  const std::vector<int32_t> low = {0, 1, 2, 3, 0};
  auto low_tokens = d.put_tokens(low);
  const Vector slice(table.begin() + 4 * c, table.end());
  for (double value : embedding(d, low, slice, c, 4)) EXPECT_EQ(value, 0.0);
  const Vector untouched = random_vector(slice.size(), 49);
  auto dslice = d.put(untouched);
  d.backend->embedding_backward(dslice.data(), g.data(), low_tokens.data(), 4, vocab - 4,
                                static_cast<int>(low.size()), c);
  EXPECT_EQ(d.get_double(dslice), untouched);
}

TEST(Kernels, AttentionIsCausalAndNormalized) {
  for (const bool use_float : {false, true}) {
    const AttentionShape s{2, 80, 4, 2, 8};
    const Vector q = random_vector(s.q_size(), 60, -2, 2);
    const Vector k = random_vector(s.kv_size(), 61, -2, 2);
    const Vector v = random_vector(s.kv_size(), 62);
    Device<float> f(2);
    Device<double> d(2);
    const auto run = [&](const Vector& qq, const Vector& kk, const Vector& vv, Vector* probs) {
      return use_float ? attention(f, qq, kk, vv, s, probs) : attention(d, qq, kk, vv, s, probs);
    };
    Vector probs;
    const Vector out = run(q, k, v, &probs);
    // Every probability row sums to one and is zero above the diagonal.
    for (size_t row = 0; row < static_cast<size_t>(s.batch) * s.q_heads * s.seq; ++row) {
      const size_t t = row % s.seq;
      double sum = 0;
      for (int j = 0; j < s.seq; ++j) {
        const double p = probs[row * s.seq + j];
        if (static_cast<size_t>(j) > t) {
          EXPECT_EQ(p, 0.0);
        }
        sum += p;
      }
      EXPECT_NEAR(sum, 1.0, use_float ? 1e-5 : 1e-13);
    }
    // Changing every token after position `cut` leaves the outputs up to `cut` bit-identical.
    for (const int cut : {0, 37, 63, 64, 78}) {
      Vector q2 = q, k2 = k, v2 = v;
      for (int b = 0; b < s.batch; ++b) {
        for (int t = cut + 1; t < s.seq; ++t) {
          for (int e = 0; e < s.q_heads * s.head_dim; ++e) {
            q2[(static_cast<size_t>(b) * s.seq + t) * s.q_heads * s.head_dim + e] += 3.0;
          }
          for (int e = 0; e < s.kv_heads * s.head_dim; ++e) {
            k2[(static_cast<size_t>(b) * s.seq + t) * s.kv_heads * s.head_dim + e] -= 1.5;
            v2[(static_cast<size_t>(b) * s.seq + t) * s.kv_heads * s.head_dim + e] += 2.5;
          }
        }
      }
      const Vector out2 = run(q2, k2, v2, nullptr);
      const size_t row = static_cast<size_t>(s.q_heads) * s.head_dim;
      for (int b = 0; b < s.batch; ++b) {
        for (int t = 0; t < s.seq; ++t) {
          const size_t begin = (static_cast<size_t>(b) * s.seq + t) * row;
          const bool same = std::equal(out.begin() + static_cast<long>(begin),
                                       out.begin() + static_cast<long>(begin + row),
                                       out2.begin() + static_cast<long>(begin));
          EXPECT_EQ(same, t <= cut) << "cut " << cut << " b " << b << " t " << t;
        }
      }
    }
  }
}

// Cached inference: rotating positions [past, past + seq) of a sequence on their own gives the
// same values as rotating the whole sequence, and attention of those queries over the keys and
// values of all past + seq positions gives the last rows of whole-sequence attention.
TEST(Kernels, RopeAndAttentionWithPastPositionsMatchTheWholeSequence) {
  Device<double> d(2);
  const int seq = 70, heads = 4, kv_heads = 2, head_dim = 8;
  const RopeShape whole{1, seq, heads, head_dim, 10000.0f};
  const Vector x = random_vector(whole.size(), 54);
  const Vector rotated = rope(d, x, whole);
  const AttentionShape s{1, seq, heads, kv_heads, head_dim};
  const Vector q = random_vector(s.q_size(), 55, -2, 2);
  const Vector k = random_vector(s.kv_size(), 56, -2, 2);
  const Vector v = random_vector(s.kv_size(), 57);
  const Vector out = attention(d, q, k, v, s);
  const size_t q_row = static_cast<size_t>(heads) * head_dim;
  for (const int past : {1, 37, 64, 69}) {
    const int fresh = seq - past;
    const long q_begin = static_cast<long>(past * q_row);
    auto tail = d.put(Vector(x.begin() + q_begin, x.end()));
    d.backend->rope_forward(tail.data(), 1, fresh, heads, head_dim, 10000.0f, past);
    const Vector tail_rotated = d.get_double(tail);
    EXPECT_LT(max_relative_error(tail_rotated, Vector(rotated.begin() + q_begin, rotated.end())),
              1e-14)
        << "past " << past;

    auto qb = d.put(Vector(q.begin() + q_begin, q.end()));
    auto kb = d.put(k);
    auto vb = d.put(v);
    auto o = d.zeros(static_cast<size_t>(fresh) * q_row);
    auto p = d.zeros(static_cast<size_t>(heads) * fresh * seq);
    d.backend->attention_forward(o.data(), p.data(), qb.data(), kb.data(), vb.data(), 1, fresh,
                                 past, heads, kv_heads, head_dim);
    EXPECT_LT(max_relative_error(d.get_double(o), Vector(out.begin() + q_begin, out.end())), 1e-12)
        << "past " << past;
  }
}

// ---- AdamW -------------------------------------------------------------------------------------

template <typename T>
void check_adamw(double tolerance) {
  Device<T> d(2);
  AdamWStep step;
  step.lr = 0.01f;
  step.beta1 = 0.9f;
  step.beta2 = 0.95f;
  step.eps = 1e-8f;
  step.weight_decay = 0.1f;
  step.grad_scale = 0.5f;
  const Vector start = {0.5, -1.2, 2.0};
  const Tensors grads = {{0.4, 0.3, -2.0}, {-0.1, 0.25, 1.0}, {0.2, -0.6, 0.0}};
  auto param = d.put(start);
  auto m = d.zeros(3);
  auto v = d.zeros(3);
  // Reference: PyTorch's AdamW, written out with the same (float) hyper-parameters.
  const double lr = step.lr, beta1 = step.beta1, beta2 = step.beta2, eps = step.eps;
  const double wd = step.weight_decay, grad_scale = step.grad_scale;
  Vector p_ref = start, m_ref(3, 0.0), v_ref(3, 0.0);
  for (int s = 1; s <= 3; ++s) {
    step.step = s;
    auto g = d.put(grads[s - 1]);
    d.backend->adamw_update(param.data(), g.data(), m.data(), v.data(), 3, step);
    for (int i = 0; i < 3; ++i) {
      const double gi = grads[s - 1][i] * grad_scale;
      m_ref[i] = beta1 * m_ref[i] + (1 - beta1) * gi;
      v_ref[i] = beta2 * v_ref[i] + (1 - beta2) * gi * gi;
      const double m_hat = m_ref[i] / (1 - std::pow(beta1, s));
      const double v_hat = v_ref[i] / (1 - std::pow(beta2, s));
      p_ref[i] *= 1 - lr * wd;
      p_ref[i] -= lr * m_hat / (std::sqrt(v_hat) + eps);
    }
    const Vector p = d.get_double(param);
    for (int i = 0; i < 3; ++i) {
      EXPECT_NEAR(p[i], p_ref[i], tolerance) << "step " << s << " element " << i;
    }
    if (s == 1) {
      // By hand: after one step m̂ = g', v̂ = g'², so p = p₀(1 − lr·wd) − lr·g'/(|g'| + eps); for
      // p₀ = 0.5, g' = 0.2: 0.4995 − 0.0099999995 = 0.4895000005. The zero gradient of element
      // 2 on step 3 below still moves the parameter through momentum and decay.
      EXPECT_NEAR(p[0], 0.4895000005, 1e-9 + tolerance);
    }
  }
  const Vector m_out = d.get_double(m), v_out = d.get_double(v);
  for (int i = 0; i < 3; ++i) {
    EXPECT_NEAR(m_out[i], m_ref[i], tolerance);
    EXPECT_NEAR(v_out[i], v_ref[i], tolerance);
  }
}

TEST(AdamW, MatchesReferenceDouble) {
  check_adamw<double>(1e-14);
}
TEST(AdamW, MatchesReferenceFloat) {
  check_adamw<float>(1e-6);
}

// ---- determinism -------------------------------------------------------------------------------

template <typename T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Runs rmsnorm_backward, embedding_backward, attention, cross-entropy and matmul on fixed inputs
// and returns all their outputs, concatenated: first those of our own kernels, then those of the
// matmuls.
struct Outputs {
  std::vector<float> kernels, matmuls;
};
Outputs backward_outputs(int threads) {
  Device<float> d(threads);
  const int n = 300, c = 100, vocab = 7;
  auto x = d.put(random_vector(n * c, 70));
  auto w = d.put(random_vector(c, 71, 0.5, 1.5));
  auto dy = d.put(random_vector(n * c, 72));
  auto t = d.put_tokens(random_tokens(n, vocab, 73));
  auto out = d.zeros(n * c);
  auto rstd = d.zeros(n);
  auto din = d.zeros(n * c);
  auto dw = d.zeros(c);
  auto dtable = d.zeros(vocab * c);
  d.backend->rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), n, c, 1e-5f);
  d.backend->rmsnorm_backward(din.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), n,
                              c);
  d.backend->embedding_backward(dtable.data(), dy.data(), t.data(), 0, vocab, n, c);

  const AttentionShape s{2, 130, 4, 2, 16};
  auto q = d.put(random_vector(s.q_size(), 74));
  auto k = d.put(random_vector(s.kv_size(), 75));
  auto v = d.put(random_vector(s.kv_size(), 76));
  auto dout = d.put(random_vector(s.q_size(), 77));
  auto att = d.zeros(s.q_size());
  auto probs = d.zeros(s.probs_size());
  auto dq = d.zeros(s.q_size());
  auto dk = d.zeros(s.kv_size());
  auto dv = d.zeros(s.kv_size());
  d.backend->attention_forward(att.data(), probs.data(), q.data(), k.data(), v.data(), s.batch,
                               s.seq, 0, s.q_heads, s.kv_heads, s.head_dim);
  d.backend->attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), att.data(),
                                probs.data(), q.data(), k.data(), v.data(), s.batch, s.seq,
                                s.q_heads, s.kv_heads, s.head_dim);
  // Large enough for OpenBLAS to split the products between threads.
  const int ic = 300, oc = 200;
  auto mw = d.put(random_vector(oc * ic, 78));
  auto min = d.put(random_vector(n * ic, 79));
  auto mout = d.zeros(n * oc);
  auto mdin = d.zeros(n * ic);
  auto mdw = d.zeros(oc * ic);
  d.backend->matmul_forward(mout.data(), min.data(), mw.data(), n, ic, oc);
  d.backend->matmul_backward(mdin.data(), mdw.data(), mout.data(), min.data(), mw.data(), n, ic,
                             oc);
  Outputs outputs;
  for (const Buffer<float>* b : {&din, &dw, &dtable, &att, &dq, &dk, &dv}) {
    const std::vector<float> host = d.get(*b);
    outputs.kernels.insert(outputs.kernels.end(), host.begin(), host.end());
  }
  // Cross-entropy: the losses and dlogits (float values, exact through double).
  const int logits_vocab = 500;
  Vector dlogits;
  const Vector losses =
      cross_entropy(d, random_vector(static_cast<size_t>(n) * logits_vocab, 80, -5, 5),
                    random_tokens(n, logits_vocab, 81), logits_vocab, &dlogits, 0.01);
  outputs.kernels.insert(outputs.kernels.end(), losses.begin(), losses.end());
  outputs.kernels.insert(outputs.kernels.end(), dlogits.begin(), dlogits.end());
  for (const Buffer<float>* b : {&mout, &mdin, &mdw}) {
    const std::vector<float> host = d.get(*b);
    outputs.matmuls.insert(outputs.matmuls.end(), host.begin(), host.end());
  }
  return outputs;
}

TEST(Determinism, BackwardIsBitExactRunToRun) {
  const Outputs first = backward_outputs(2);
  const Outputs second = backward_outputs(2);
  EXPECT_TRUE(bitwise_equal(first.kernels, second.kernels));
  EXPECT_TRUE(bitwise_equal(first.matmuls, second.matmuls));
  // Our kernels give every output element to one thread and sum over tokens in a fixed order, so
  // they do not even depend on the thread count (a resume on another core count stays exact). The
  // matmuls are OpenBLAS's, which promises no such thing, so they are left out here.
  EXPECT_TRUE(bitwise_equal(first.kernels, backward_outputs(1).kernels));
}

TEST(Determinism, SumSquares) {
  const Vector values = random_vector((size_t{1} << 20) + 12345, 80, -3, 3);
  const auto run = [&](int threads) {
    Device<float> d(threads);
    auto x = d.put(values);
    return d.backend->sum_squares(x.data(), values.size());
  };
  const double two = run(2);
  EXPECT_EQ(two, run(2));
  // Fixed chunks make the sum independent of the thread count, not only repeatable.
  EXPECT_EQ(two, run(1));
  long double exact = 0;
  for (double value : values) {
    const long double rounded = static_cast<float>(value);
    exact += rounded * rounded;
  }
  EXPECT_NEAR(two, static_cast<double>(exact), 1e-12 * static_cast<double>(exact));
}

// ---- small ops and memory
// ------------------------------------------------------------------------

TEST(Kernels, ElementwiseAndMemory) {
  Device<double> d(2);
  const size_t count = 100000;  // long enough to run on several threads
  const Vector a = random_vector(count, 90), b = random_vector(count, 91);
  auto x = d.put(a);
  auto y = d.put(b);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(x.data()) % 64, 0u);
  for (double value : d.get(d.zeros(1000))) EXPECT_EQ(value, 0.0);
  d.backend->add(y.data(), x.data(), count);
  d.backend->scale(y.data(), 0.5, count);
  Vector expected(count);
  for (size_t i = 0; i < count; ++i) expected[i] = (b[i] + a[i]) * 0.5;
  EXPECT_EQ(d.get(y), expected);
  d.backend->copy(y.data(), x.data(), count);
  EXPECT_EQ(d.get(y), a);
  d.backend->fill_zero(y.data(), count);
  EXPECT_EQ(d.get(y), Vector(count, 0.0));
  EXPECT_EQ(d.backend->num_threads(), 2);
  d.backend->set_num_threads(1);
  EXPECT_EQ(d.backend->num_threads(), 1);
}

// Every buffer books its bytes under its kind while it lives; the peak remembers the highest
// total since the last reset, moves do not double-count, and bookings outside buffers count too.
TEST(MemoryLedger, BuffersBookTheirBytesByKindAndThePeakRemembersTheHighest) {
  MemoryLedger& ledger = memory_ledger();
  const MemoryFigures before = ledger.current();
  ledger.reset_peak();
  auto backend = make_cpu_backend<float>(1);
  {
    Buffer<float> params(*backend, 1000, MemoryKind::kParameters);
    Buffer<float, int32_t> tokens(*backend, 10, MemoryKind::kActivations);
    EXPECT_EQ(ledger.current()[MemoryKind::kParameters] - before[MemoryKind::kParameters], 4000);
    EXPECT_EQ(ledger.current()[MemoryKind::kActivations] - before[MemoryKind::kActivations], 40);
    Buffer<float> moved = std::move(params);
    EXPECT_EQ(ledger.current().total() - before.total(), 4040);
    MemoryBooking staging(MemoryKind::kCommunication, 500);
    EXPECT_EQ(ledger.current().total() - before.total(), 4540);
    staging.resize(100);
    EXPECT_EQ(ledger.current()[MemoryKind::kCommunication] - before[MemoryKind::kCommunication],
              100);
  }
  EXPECT_EQ(ledger.current().total(), before.total());
  EXPECT_EQ(ledger.peak_total() - before.total(), 4540);
  EXPECT_EQ(ledger.peak()[MemoryKind::kCommunication] - before[MemoryKind::kCommunication], 500);
  ledger.reset_peak();
  EXPECT_EQ(ledger.peak_total(), before.total());
}

// A backend may store fewer or more bytes than the address range it hands out (a GPU's bf16
// storage: half). Ranges are given in addresses and book their share of what is stored; the
// whole range is what of_kind reports, so giving back everything touches every element.
TEST(MemoryLedger, RangesBookTheirShareOfWhatTheBackendStores) {
  MemoryLedger& ledger = memory_ledger();
  const MemoryFigures before = ledger.current();
  std::vector<float> narrow(1000), wide(1000);
  Allocations allocations;
  allocations.add(narrow.data(), 4000, 2000, MemoryKind::kActivations);  // bf16 behind floats
  allocations.add(wide.data(), 4000, 6000, MemoryKind::kParameters);     // fp32 and a bf16 copy
  const auto booked = [&](MemoryKind kind) { return ledger.current()[kind] - before[kind]; };
  EXPECT_EQ(booked(MemoryKind::kActivations), 2000);
  allocations.uncommit(narrow.data() + 500, 2000);  // the second half of the floats
  EXPECT_EQ(booked(MemoryKind::kActivations), 1000);
  allocations.uncommit(wide.data(), 400);  // 100 floats
  EXPECT_EQ(booked(MemoryKind::kParameters), 5400);
  allocations.commit(wide.data(), 400);
  EXPECT_EQ(booked(MemoryKind::kParameters), 6000);
  EXPECT_THROW(allocations.uncommit(narrow.data() + 900, 800), Error);  // past its end
  const auto found = allocations.of_kind(MemoryKind::kActivations);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].data, static_cast<void*>(narrow.data()));
  EXPECT_EQ(found[0].span, 4000);
  EXPECT_EQ(found[0].booked, 1000);
  allocations.remove(narrow.data());
  allocations.remove(wide.data());
  EXPECT_EQ(ledger.current().total(), before.total());
}

// Whether the kernel gives transparent huge pages to mappings that ask (THP "always" or
// "madvise"); false where it has none.
bool huge_pages_offered() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string setting;
  std::getline(in, setting);
  return setting.find("[always]") != std::string::npos ||
         setting.find("[madvise]") != std::string::npos;
}

// The AnonHugePages line of /proc/self/smaps for the mapping that holds `address`, in bytes.
int64_t huge_bytes_at(const void* address) {
  std::ifstream in("/proc/self/smaps");
  const auto at = reinterpret_cast<uintptr_t>(address);
  bool inside = false;
  for (std::string line; std::getline(in, line);) {
    uintptr_t begin = 0, end = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &begin, &end) == 2) {
      inside = begin <= at && at < end;
    } else if (long kib = 0;
               inside && std::sscanf(line.c_str(), "AnonHugePages: %ld kB", &kib) == 1) {
      return int64_t{kib} * 1024;
    }
  }
  return 0;
}

// Large buffers (the engine's state, a checkpoint's copy) come from map_pages: zero, writable,
// and backed by huge pages where the kernel offers them (the kernel's copies into 4 KiB pages
// made checkpoint loads slow: common/host_pages.h).
TEST(HostPages, LargeBuffersAreZeroMappingsBackedByHugePagesWhereOffered) {
  auto backend = make_cpu_backend<float>(1);
  const size_t count = size_t{16} << 20;  // 64 MiB: several aligned 2 MiB runs
  Buffer<float> state(*backend, count, MemoryKind::kParameters);
  for (size_t i = 0; i < count; i += 1024) EXPECT_EQ(state.data()[i], 0.0f);
  std::fill(state.data(), state.data() + count, 1.0f);
  if (huge_pages_offered()) {
    EXPECT_GT(huge_bytes_at(state.data() + count / 2), 0) << "no huge pages behind the buffer";
  }

  PageBuffer<float> copy(count);
  copy[count - 1] = 2.0f;
  PageBuffer<float> moved = std::move(copy);
  EXPECT_EQ(copy.data(), nullptr);
  EXPECT_EQ(copy.size(), 0u);
  EXPECT_EQ(moved.size(), count);
  EXPECT_EQ(moved[count - 1], 2.0f);
  EXPECT_EQ(moved[0], 0.0f);
  moved = PageBuffer<float>();
  EXPECT_EQ(moved.data(), nullptr);
  EXPECT_EQ(PageBuffer<float>(0).data(), nullptr);
}

}  // namespace
}  // namespace malleus::backend

// ---- the CUDA backend's storage map (plain C++: tested here, used on the GPU) -----------------
namespace malleus::backend::cuda {
namespace {

TEST(CudaStorageMap, ResolvesPointersInsideHandlesToElementsOfTheirStorage) {
  // Stand-ins for device memory: only addresses are compared, nothing is dereferenced.
  std::vector<float> handle_a(100), handle_b(50);
  std::vector<uint16_t> bf16_a(100);
  std::vector<float> wide_b(50);
  StorageMap map;
  map.add({handle_a.data(), 100, Storage::kBf16, bf16_a.data(), nullptr, false});
  map.add({handle_b.data(), 50, Storage::kFloat, wide_b.data(), nullptr, false});

  // Element 37 of a bf16 buffer is 74 bytes into its storage, not 148.
  const Resolved a = map.resolve(handle_a.data() + 37, 10);
  EXPECT_EQ(a.index, 37u);
  EXPECT_EQ(a.address(), static_cast<void*>(bf16_a.data() + 37));
  const Resolved b = map.resolve(handle_b.data() + 49, 1);
  EXPECT_EQ(b.address(), static_cast<void*>(wide_b.data() + 49));
  EXPECT_EQ(map.resolve(handle_a.data(), 100).index, 0u);
  EXPECT_EQ(map.resolve(handle_a.data() + 100, 0).index, 100u);  // an empty range at the end
  EXPECT_TRUE(map.holds(handle_b.data() + 10));
  EXPECT_FALSE(map.holds(handle_b.data() + 50));
}

TEST(CudaStorageMap, RefusesRangesOutsideItsBuffersByAddress) {
  std::vector<float> handle(64);
  std::vector<uint16_t> storage(64);
  StorageMap map;
  map.add({handle.data(), 60, Storage::kBf16, storage.data(), nullptr, false});
  const auto message = [&](const float* pointer, size_t count) -> std::string {
    try {
      map.resolve(pointer, count);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(message(handle.data() + 50, 11).find("not inside a buffer"), std::string::npos);
  // The error says how far past its buffer the range reaches.
  EXPECT_NE(
      message(handle.data() + 50, 11).find("holds 60 elements, and this reaches elements 50 to 61"),
      std::string::npos);
  EXPECT_NE(message(handle.data() + 61, 1), "");
  EXPECT_NE(message(handle.data() - 1, 1), "");
  const char* unaligned = reinterpret_cast<const char*>(handle.data()) + 2;
  EXPECT_NE(message(reinterpret_cast<const float*>(unaligned), 1), "");
  // Released buffers resolve no more, and a second release is refused.
  const StoredBuffer removed = map.remove(handle.data());
  EXPECT_EQ(removed.data, static_cast<void*>(storage.data()));
  EXPECT_NE(message(handle.data() + 3, 1).find("lies in the released buffer"), std::string::npos)
      << message(handle.data() + 3, 1);
  EXPECT_THROW(map.remove(handle.data()), Error);
  EXPECT_TRUE(map.empty());
}

TEST(CudaStorageMap, AddressesTheShadowOfAFloatBufferByTheSameIndex) {
  std::vector<float> values(32);
  std::vector<uint16_t> shadow(32);
  StorageMap map;
  map.add({values.data(), 32, Storage::kFloat, values.data(), shadow.data(), true});
  const Resolved r = map.resolve(values.data() + 5, 3);
  EXPECT_EQ(r.address(), static_cast<void*>(values.data() + 5));
  EXPECT_EQ(r.shadow_address(), static_cast<void*>(shadow.data() + 5));
  EXPECT_TRUE(r.buffer->shadow_stale);
  EXPECT_THROW(map.add({values.data(), 32, Storage::kFloat, values.data(), nullptr, false}), Error);
}

}  // namespace
}  // namespace malleus::backend::cuda
