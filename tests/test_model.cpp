// The whole model's backward against finite differences, in double precision, and float/double
// agreement of the forward pass.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <utility>

#include "model/transformer.h"
#include "test_models.h"

using namespace malleus;
using malleus::testing::gradcheck_model;

namespace {

struct Batch {
  std::vector<int32_t> inputs, targets;
};

Batch random_batch(const model::ModelConfig& c, int micro, int seq, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Batch b;
  for (int i = 0; i < micro * seq; ++i) {
    b.inputs.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(c.vocab_size)));
    b.targets.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(c.vocab_size)));
  }
  return b;
}

}  // namespace

TEST(Model, WholeModelGradientMatchesFiniteDifferences) {
  const auto config = gradcheck_model();
  const int micro = 2, seq = 6;
  auto backend = backend::make_cpu_backend<double>(2);
  model::Transformer<double> m(config, *backend, micro, seq);
  m.init_parameters(7);
  const Batch batch = random_batch(config, micro, seq, 11);
  const double scale = 1.0 / (micro * seq);

  m.zero_grads();
  m.forward(batch.inputs.data(), batch.targets.data());
  m.backward(scale);

  const auto& layout = m.layout();
  std::vector<double> grads(static_cast<size_t>(layout.total_size()));
  backend->copy_to_host(grads.data(), m.grads(), grads.size());
  std::vector<double> params(grads.size());
  backend->copy_to_host(params.data(), m.params(), params.size());

  auto loss_at = [&](size_t index, double value) {
    const double saved = params[index];
    params[index] = value;
    backend->copy_from_host(m.params(), params.data(), params.size());
    const double loss = m.forward(batch.inputs.data(), batch.targets.data()) * scale;
    params[index] = saved;
    backend->copy_from_host(m.params(), params.data(), params.size());
    return loss;
  };

  std::mt19937_64 rng(3);
  const double h = 1e-5;
  double worst = 0;
  for (const auto& t : layout.tensors()) {
    // Several elements of every tensor, so every op's backward is on some checked path.
    for (int k = 0; k < 6; ++k) {
      const size_t index = static_cast<size_t>(t.offset) + rng() % static_cast<size_t>(t.size);
      const double numeric =
          (loss_at(index, params[index] + h) - loss_at(index, params[index] - h)) / (2 * h);
      const double analytic = grads[index];
      // Central differences in double are accurate to ~1e-10 absolute (rounding of a loss of
      // order one over h, plus h² truncation); the bound leaves room for both.
      const double error = std::abs(analytic - numeric);
      const double bound = 1e-6 * std::max(std::abs(analytic), std::abs(numeric)) + 1e-9;
      worst = std::max(worst, error / std::max(std::abs(numeric), 1e-12));
      EXPECT_LE(error, bound) << t.name << " element " << index - t.offset << ": analytic "
                              << analytic << " numeric " << numeric;
    }
  }
  RecordProperty("worst_relative_error", std::to_string(worst));
}

TEST(Model, GradientsAccumulateAcrossMicroBatches) {
  const auto config = gradcheck_model();
  auto backend = backend::make_cpu_backend<double>(2);
  model::Transformer<double> m(config, *backend, 2, 6);
  m.init_parameters(1);
  const Batch batch = random_batch(config, 2, 6, 5);
  const size_t total = static_cast<size_t>(m.layout().total_size());

  m.zero_grads();
  m.forward(batch.inputs.data(), batch.targets.data());
  m.backward(1.0);
  std::vector<double> once(total);
  backend->copy_to_host(once.data(), m.grads(), total);
  m.forward(batch.inputs.data(), batch.targets.data());
  m.backward(1.0);
  std::vector<double> twice(total);
  backend->copy_to_host(twice.data(), m.grads(), total);
  for (size_t i = 0; i < total; ++i)
    ASSERT_NEAR(twice[i], 2 * once[i], 1e-12 + 1e-12 * std::abs(once[i]));
}

TEST(Model, FloatForwardAgreesWithDouble) {
  const auto config = gradcheck_model();
  auto bf = backend::make_cpu_backend<float>(2);
  auto bd = backend::make_cpu_backend<double>(2);
  model::Transformer<float> mf(config, *bf, 2, 6);
  model::Transformer<double> md(config, *bd, 2, 6);
  mf.init_parameters(9);
  md.init_parameters(9);
  const Batch batch = random_batch(config, 2, 6, 4);
  const double lf = mf.forward(batch.inputs.data(), batch.targets.data());
  const double ld = md.forward(batch.inputs.data(), batch.targets.data());
  EXPECT_NEAR(lf, ld, 1e-4 * std::abs(ld));
}

TEST(Model, InitialisationIsSeededAndPerTensor) {
  const auto config = gradcheck_model();
  auto backend = backend::make_cpu_backend<float>(1);
  model::Transformer<float> a(config, *backend, 1, 4), b(config, *backend, 1, 4),
      c(config, *backend, 1, 4);
  a.init_parameters(42);
  b.init_parameters(42);
  c.init_parameters(43);
  const size_t total = static_cast<size_t>(a.layout().total_size());
  std::vector<float> pa(total), pb(total), pc(total);
  backend->copy_to_host(pa.data(), a.params(), total);
  backend->copy_to_host(pb.data(), b.params(), total);
  backend->copy_to_host(pc.data(), c.params(), total);
  EXPECT_EQ(pa, pb);
  EXPECT_NE(pa, pc);
  // Norm gains start at one; the initial loss is close to log(vocab) (an untrained model).
  const auto& norm = a.layout().tensor(a.layout().final_norm());
  EXPECT_EQ(pa[static_cast<size_t>(norm.offset)], 1.0f);
}

TEST(Model, RefusesOutOfRangeTokensAndSequences) {
  const auto config = gradcheck_model();
  auto backend = backend::make_cpu_backend<float>(1);
  EXPECT_THROW(model::Transformer<float>(config, *backend, 1, config.max_seq_len + 1), Error);
  model::Transformer<float> m(config, *backend, 1, 4);
  std::vector<int32_t> inputs{1, 2, 3, 13}, targets{1, 2, 3, 4};
  EXPECT_THROW(m.forward(inputs.data(), targets.data()), Error);
}

namespace {

using Model = model::Transformer<float>;

// Two micro-batches of the small model in flight: a full model of two activation slots
// (initialised with seed 5, gradients zeroed) with `recompute` (and recomputation ahead) run
// through a schedule, which returns the losses of its forwards; run() gives them and the
// gradients it accumulated, on the host.
struct TwoSlots {
  model::ModelConfig config = gradcheck_model();
  int micro = 2, seq = 6;
  std::unique_ptr<backend::Backend<float>> backend = backend::make_cpu_backend<float>(1);
  Batch first = random_batch(config, micro, seq, 3), second = random_batch(config, micro, seq, 4);

  std::pair<std::vector<double>, std::vector<float>> run(
      model::Recompute recompute, bool ahead,
      const std::function<std::vector<double>(Model&)>& schedule) {
    Model m(config, model::ShardSpec::full(config), *backend, micro, seq, 2, nullptr, recompute,
            ahead);
    m.init_parameters(5);
    m.zero_grads();
    const std::vector<double> losses = schedule(m);
    std::vector<float> grads(static_cast<size_t>(m.layout().total_size()));
    backend->copy_to_host(grads.data(), m.grads(), grads.size());
    return {losses, grads};
  }
};

}  // namespace

// Recomputation repeats the same operations on the same inputs, so losses and gradients are
// bit-identical to keeping every activation: with two micro-batches in flight (two slots, both
// forwards before either backward, as 1F1B's warm-up does), for each mode and layer count.
TEST(Model, RecomputationGivesBitIdenticalLossesAndGradients) {
  TwoSlots slots;
  const auto& [config, micro, seq, backend, first, second] = slots;
  auto run = [&](model::Recompute recompute) {
    return slots.run(recompute, /*ahead=*/false, [&](Model& m) {
      std::vector<double> losses;
      losses.push_back(m.forward(0, first.inputs.data(), first.targets.data()));
      losses.push_back(m.forward(1, second.inputs.data(), second.targets.data()));
      m.backward(0, 0.01f);
      m.backward(1, 0.01f);
      return losses;
    });
  };
  const auto plain = run({});
  using model::RecomputeMode;
  for (RecomputeMode mode : {RecomputeMode::kSelective, RecomputeMode::kFull}) {
    for (int layers = 1; layers <= config.num_layers; ++layers) {
      const auto recomputed = run({mode, layers});
      EXPECT_EQ(recomputed.first, plain.first) << model::recompute_mode_name(mode) << " " << layers;
      EXPECT_EQ(recomputed.second, plain.second)
          << model::recompute_mode_name(mode) << " " << layers;
    }
  }
}

// The shifted schedule's recomputation ahead of the backward (a scratch per recomputing block,
// filled before the gradient is needed) gives the same bits as recomputing inside the backward,
// whether or not a slot was recomputed ahead; it costs one scratch per recomputing block (what
// such a block does not keep per slot).
TEST(Model, RecomputationAheadGivesBitIdenticalLossesAndGradients) {
  TwoSlots slots;
  const auto& [config, micro, seq, backend, first, second] = slots;
  auto run = [&](model::Recompute recompute, bool ahead) {
    return slots.run(recompute, ahead, [&](Model& m) {
      std::vector<double> losses;
      losses.push_back(m.forward(0, first.inputs.data(), first.targets.data()));
      losses.push_back(m.forward(1, second.inputs.data(), second.targets.data()));
      if (ahead) m.recompute_ahead(0);
      m.backward(0, 0.01f);
      // The second slot without recomputation ahead: the backward recomputes as usual.
      m.backward(1, 0.01f);
      // Again, both ahead, the later slot first (its scratch is filled, then the earlier one's
      // replaces it only after the backward that used it).
      losses.push_back(m.forward(0, second.inputs.data(), second.targets.data()));
      losses.push_back(m.forward(1, first.inputs.data(), first.targets.data()));
      if (ahead) m.recompute_ahead(1);
      m.backward(1, 0.01f);
      if (ahead) m.recompute_ahead(0);
      m.backward(0, 0.01f);
      return losses;
    });
  };
  using model::RecomputeMode;
  for (RecomputeMode mode : {RecomputeMode::kSelective, RecomputeMode::kFull}) {
    for (int layers = 1; layers <= config.num_layers; ++layers) {
      const auto inline_run = run({mode, layers}, false);
      const auto ahead_run = run({mode, layers}, true);
      EXPECT_EQ(ahead_run.first, inline_run.first)
          << model::recompute_mode_name(mode) << " " << layers;
      EXPECT_EQ(ahead_run.second, inline_run.second)
          << model::recompute_mode_name(mode) << " " << layers;
    }
  }
  // Memory: a scratch per recomputing block instead of one.
  auto activations = [&](model::Recompute recompute, bool ahead) {
    const auto before = backend::memory_ledger().current()[backend::MemoryKind::kActivations];
    model::Transformer<float> m(config, model::ShardSpec::full(config), *backend, 2, 8, 2, nullptr,
                                recompute, ahead);
    return backend::memory_ledger().current()[backend::MemoryKind::kActivations] - before;
  };
  for (RecomputeMode mode : {RecomputeMode::kSelective, RecomputeMode::kFull}) {
    const int64_t one = activations({mode, 1}, false), two = activations({mode, 2}, false),
                  one_ahead = activations({mode, 1}, true),
                  two_ahead = activations({mode, 2}, true);
    EXPECT_EQ(one_ahead, one);  // one recomputing block: one scratch either way
    EXPECT_GT(two_ahead, two);
    // The second block's scratch is what a recomputing block stops keeping per slot (two slots).
    EXPECT_EQ(two_ahead - two, (one - two) / 2) << model::recompute_mode_name(mode);
  }
  EXPECT_THROW(
      {
        model::Transformer<float> m(config, model::ShardSpec::full(config), *backend, 2, 8, 2,
                                    nullptr, {RecomputeMode::kFull, 1}, false);
        m.recompute_ahead(0);
      },
      Error);
}

// What a slot keeps shrinks with the mode: selective drops the attention core, full all but each
// layer's input; the memory ledger sees it.
TEST(Model, RecomputationKeepsLessActivationMemory) {
  const auto config = gradcheck_model();
  auto backend = backend::make_cpu_backend<float>(1);
  auto activations = [&](model::Recompute recompute) {
    const auto before = backend::memory_ledger().current()[backend::MemoryKind::kActivations];
    model::Transformer<float> m(config, model::ShardSpec::full(config), *backend, 2, 8, 3, nullptr,
                                recompute);
    return backend::memory_ledger().current()[backend::MemoryKind::kActivations] - before;
  };
  using model::RecomputeMode;
  const int64_t none = activations({}), selective = activations({RecomputeMode::kSelective, 2}),
                full = activations({RecomputeMode::kFull, 2}),
                one_full = activations({RecomputeMode::kFull, 1});
  EXPECT_LT(selective, none);
  EXPECT_LT(full, selective);
  EXPECT_LT(full, one_full);
  EXPECT_LT(one_full, none);
  EXPECT_THROW(model::Transformer<float>(config, model::ShardSpec::full(config), *backend, 1, 4, 1,
                                         nullptr, {RecomputeMode::kFull, 3}),
               Error);
}
