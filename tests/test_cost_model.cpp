// The cost model's parts: FLOPs against the model's own count, collectives, uneven shares,
// memory and recomputation, the 1F1B closed form, rates and profiles.
#include <gtest/gtest.h>

#include <cmath>

#include "common/error.h"
#include "model/config.h"
#include "plan/cost_model.h"
#include "plan/planner.h"

using namespace malleus;
using plan::CostModel;

namespace {

CostModel a800_70b(int nodes = 8) {
  auto cluster = plan::load_cluster("a800-8x8");
  cluster.nodes = nodes;
  return CostModel(model::load_model_config("llama-70b"), cluster, plan::BatchConfig{64, 1, 4096});
}

// The usual MFU accounting, written independently of the cost model: 6 FLOPs per matmul
// parameter per token, plus causal attention (QKᵀ and PV over seq/2 keys on average, ×3 for
// backward).
double training_flops_per_token(const model::ModelConfig& m, int seq) {
  const double c = m.hidden_size, f = m.ffn_hidden_size, kv = m.kv_dim();
  const double matmul_params =
      m.num_layers * (2 * c * c + 2 * c * kv + 3 * c * f) + m.vocab_size * c;
  return 6.0 * matmul_params + m.num_layers * 3.0 * (2.0 * 2.0 * c * (seq / 2.0));
}

plan::Stage group(const CostModel& cost, std::vector<int> ranks) {
  plan::Stage s;
  s.ranks = std::move(ranks);
  cost.even_shares_of(s);
  return s;
}

}  // namespace

TEST(CostModel, FlopsMatchTheModelsTrainingCount) {
  for (const char* name : {"llama-32b", "llama-70b", "tiny"}) {
    const auto m = model::load_model_config(name);
    const CostModel cost(m, plan::load_cluster("a800-8x8"), plan::BatchConfig{8, 2, m.max_seq_len});
    const double tokens = 2.0 * m.max_seq_len;
    const double expected = training_flops_per_token(m, m.max_seq_len);
    const double ours = 3 * (m.num_layers * cost.layer_forward_flops() + cost.head_forward_flops());
    EXPECT_NEAR(ours / tokens, expected, 1e-9 * expected) << name;
    // The whole model as one shard: the count the runtime divides its measured time by.
    const double shard = plan::shard_training_flops(m, 2, m.max_seq_len, m.num_layers, true);
    EXPECT_NEAR(shard / tokens, expected, 1e-9 * expected) << name;
  }
  // Shards of a tensor-parallel group add up to the whole: the shares split every matmul.
  const auto m = model::load_model_config("llama-70b");
  const double whole = plan::shard_training_flops(m, 1, 4096, 10, true);
  const double a = plan::shard_training_flops(m, 1, 4096, 10, true, {0.25, 0.75, 0.5});
  const double b = plan::shard_training_flops(m, 1, 4096, 10, true, {0.75, 0.25, 0.5});
  EXPECT_NEAR(a + b, whole, 1e-9 * whole);
}

TEST(CostModel, ABatchOfMoreMicroBatchesThanAStepMayHaveIsNamed) {
  plan::BatchConfig batch{
      .global_batch = 2 * plan::BatchConfig::kMaxMicroBatches, .micro_batch = 2, .seq_len = 128};
  EXPECT_NO_THROW(batch.validate("batch"));  // exactly the limit
  batch.micro_batch = 1;
  try {
    batch.validate("batch");
    ADD_FAILURE() << "accepted " << batch.micro_batches() << " micro-batches";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("batch: global batch 2097152 gives 2097152 micro-batches "
                                         "of 1, more than the 1048576 a step may have"),
              std::string::npos)
        << e.what();
  }
}

TEST(CostModel, RingAllReduce) {
  const CostModel cost = a800_70b();
  const auto& c = cost.cluster();
  EXPECT_EQ(cost.allreduce_time({3}, 1e9), 0.0);
  const double bytes = 64e6;
  const double intra = cost.allreduce_time({0, 1, 2, 3, 4, 5, 6, 7}, bytes);
  EXPECT_NEAR(intra, 2.0 * 7 / 8 * bytes / c.intra_node_bandwidth + 14 * c.intra_node_latency,
              1e-12);
  // A group that spans nodes runs at the inter-node pace.
  const double cross = cost.allreduce_time({6, 7, 8, 9}, bytes);
  EXPECT_NEAR(cross, 2.0 * 3 / 4 * bytes / c.inter_node_bandwidth + 6 * c.inter_node_latency,
              1e-12);
  // P2P: intra vs inter node, split over the narrower group's ranks.
  const auto a = group(cost, {0, 1, 2, 3}), b = group(cost, {4, 5}), d = group(cost, {8, 9});
  EXPECT_NEAR(cost.p2p_time(a, b),
              cost.activation_message_bytes() / (2 * c.intra_node_bandwidth) + c.intra_node_latency,
              1e-12);
  EXPECT_GT(cost.p2p_time(b, d), cost.p2p_time(a, b));
}

TEST(CostModel, GroupTimeIsTheSlowestMemberAndUnevenSharesHelp) {
  const CostModel cost = a800_70b();
  plan::Rates rates(64, 1.0);
  const auto even = group(cost, {0, 1, 2, 3, 4, 5, 6, 7});
  const auto healthy = cost.group_cost(even, rates);
  rates[5] = 2.0;
  const auto slow = cost.group_cost(even, rates);
  EXPECT_NEAR(slow.layer_forward, 2 * healthy.layer_forward, 1e-12 * healthy.layer_forward);
  EXPECT_EQ(slow.layer_comm, healthy.layer_comm);  // rates slow compute, not links

  plan::Stage balanced = even;
  cost.balance_shares(balanced, rates);
  int heads = 0, ffn = 0, vocab = 0;
  for (size_t i = 0; i < 8; ++i) {
    heads += balanced.heads[i], ffn += balanced.ffn[i], vocab += balanced.vocab[i];
    EXPECT_GE(balanced.heads[i], 8);  // at least one whole KV group (64 heads / 8 KV)
    EXPECT_EQ(balanced.heads[i] % 8, 0);
  }
  EXPECT_EQ(heads, 64);
  EXPECT_EQ(ffn, 28672);
  EXPECT_EQ(vocab, 32000);
  EXPECT_LT(balanced.ffn[5], balanced.ffn[0]);
  EXPECT_LT(balanced.vocab[5], balanced.vocab[0]);
  const auto uneven = cost.group_cost(balanced, rates);
  EXPECT_LT(uneven.layer_forward, slow.layer_forward);
  EXPECT_GT(uneven.layer_forward, healthy.layer_forward);
  // Healthy members share evenly; the loads say who waits.
  const auto load = cost.member_load(balanced, rates);
  for (double x : load) EXPECT_LE(x, 1.0 + 1e-12);

  // A gone member makes the group unusable.
  rates[5] = std::numeric_limits<double>::infinity();
  EXPECT_TRUE(cost.group_cost(even, rates).gone);
}

TEST(CostModel, MemoryAndStageAwareRecomputation) {
  const CostModel cost = a800_70b();
  const plan::Rates rates(64, 1.0);
  const auto g = cost.group_cost(group(cost, {0, 1, 2, 3, 4, 5, 6, 7}), rates);
  // State: 16 bytes per parameter of the rank's shard.
  const auto m = cost.model();
  const double h = m.hidden_size;
  const double layer_params = 2 * h * h + 2 * h * m.kv_dim() + 3 * h * m.ffn_hidden_size;
  const double state_per_layer =
      g.memory.params_per_layer *
      (g.memory.parameter_bytes + g.memory.gradient_bytes + g.memory.optimizer_bytes);
  EXPECT_NEAR(state_per_layer, (layer_params / 8 + 2 * h) * 16, 1.0);
  // With flash attention and sequence parallelism (the GPU presets), about Korthikanti et al.'s
  // 34·s·h/t bytes per layer and sequence at 2-byte activations.
  EXPECT_NEAR(g.memory.layer_kept[0], 34.0 * 4096 * h / 8, 0.05 * 34.0 * 4096 * h / 8);
  using model::RecomputeMode;
  EXPECT_LT(g.memory.layer_kept[int(RecomputeMode::kSelective)], g.memory.layer_kept[0]);
  EXPECT_LT(g.memory.layer_kept[int(RecomputeMode::kFull)],
            g.memory.layer_kept[int(RecomputeMode::kSelective)]);
  // Few layers and few micro-batches in flight: no recomputation.
  const auto light = cost.stage_cost(g, {.layers = 10});
  EXPECT_TRUE(light.fits);
  EXPECT_EQ(light.recompute, model::Recompute{});
  // 30 layers: the first of 8 stages (8 in flight) must recompute, the seventh (2 in flight)
  // need not.
  const auto first = cost.stage_cost(g, {.layers = 30, .first = true, .in_flight = 8});
  const auto third = cost.stage_cost(g, {.layers = 30, .in_flight = 2});
  EXPECT_EQ(third.recompute, model::Recompute{});
  EXPECT_TRUE(first.fits);
  EXPECT_NE(first.recompute.mode, RecomputeMode::kNone);
  EXPECT_GE(first.recompute.mode, third.recompute.mode);
  if (first.recompute.mode == third.recompute.mode) {
    EXPECT_GE(first.recompute.layers, third.recompute.layers);
  }
  EXPECT_LE(first.memory_bytes, cost.cluster().usable_memory());
  // Recomputing a layer fully costs one more forward of it and one all-reduce.
  const auto none = cost.stage_cost(g, {.layers = 20});
  const auto full = cost.stage_cost(g, {.layers = 20, .planned = {RecomputeMode::kFull, 5}});
  EXPECT_NEAR(full.backward - none.backward, 5 * (g.layer_forward + g.layer_comm),
              1e-9 * full.backward);
  const auto selective =
      cost.stage_cost(g, {.layers = 20, .planned = {RecomputeMode::kSelective, 5}});
  EXPECT_NEAR(selective.backward - none.backward, 5 * g.attention_core_forward,
              1e-9 * selective.backward);
  EXPECT_LT(full.memory_bytes, selective.memory_bytes);
  EXPECT_LT(selective.memory_bytes, none.memory_bytes);
  // A planned recomputation is kept as it is, even where none is needed.
  EXPECT_EQ(full.recompute, (model::Recompute{RecomputeMode::kFull, 5}));
  // Far too many layers for one group even with recomputation.
  EXPECT_FALSE(
      cost.stage_cost(g, {.layers = 80, .first = true, .last = true, .in_flight = 8}).fits);

  // One formula: with even shares every rank of a stage is its fullest, so a prediction's
  // per-device memory is the stage's memory (recomputation included).
  const auto plan = plan::uniform_plan(m, 2, 8, 4, 64, 1, 64);
  const auto pred = cost.predict(plan, plan::Rates(64, 1.0));
  for (size_t p = 0; p < plan.pipelines.size(); ++p) {
    for (size_t j = 0; j < plan.pipelines[p].stages.size(); ++j) {
      const auto& stage = plan.pipelines[p].stages[j];
      const double stage_memory = pred.pipelines[p].stages[j].cost.memory_bytes;
      for (int r : stage.ranks) {
        EXPECT_DOUBLE_EQ(pred.memory_bytes[static_cast<size_t>(r)], stage_memory) << r;
      }
    }
  }
}

TEST(CostModel, OneFOneBClosedForm) {
  std::vector<plan::StagePrediction> stages(4);
  for (auto& s : stages) s.cost.forward = 1, s.cost.backward = 2;
  const auto p = CostModel::pipeline_time(stages, 8);
  EXPECT_DOUBLE_EQ(p.period, 3.0);
  EXPECT_DOUBLE_EQ(p.time, (8 + 4 - 1) * 3.0);
  // A slow stage sets the period.
  stages[2].cost.backward = 5;
  EXPECT_DOUBLE_EQ(CostModel::pipeline_time(stages, 8).period, 6.0);
  EXPECT_DOUBLE_EQ(CostModel::pipeline_time(stages, 0).time, 0.0);
}

// The shifted schedule: a stage before the last recomputes (here 1 of its backward's 3) before its
// gradient arrives. Its own work per micro-batch is the same, so the period too; the first
// micro-batch's trip loses the recomputation, which hides in the wait for the first gradient.
TEST(CostModel, ShiftedRecomputationHidesInTheWaitForTheFirstGradient) {
  std::vector<plan::StagePrediction> stages(2);
  for (auto& s : stages) s.cost.forward = 1, s.cost.backward = 2;
  stages[0].cost.backward = 3;
  stages[0].cost.recompute_time = 1;
  const auto in_backward = CostModel::pipeline_time(stages, 4);
  EXPECT_DOUBLE_EQ(in_backward.first_micro_batch, 7.0);
  EXPECT_DOUBLE_EQ(in_backward.period, 4.0);
  stages[0].cost.recompute_ahead = true;
  const auto shifted = CostModel::pipeline_time(stages, 4);
  EXPECT_DOUBLE_EQ(shifted.first_micro_batch, 6.0);
  EXPECT_DOUBLE_EQ(shifted.period, 4.0);
  EXPECT_DOUBLE_EQ(shifted.time, in_backward.time - 1);
  // Hidden only up to the wait: a recomputation longer than the stages below take shows.
  stages[0].cost.backward = 2 + 5;
  stages[0].cost.recompute_time = 5;
  const double wait = 3 - 1;  // stage 1's F + B, less stage 0's warm-up forward
  EXPECT_DOUBLE_EQ(CostModel::pipeline_time(stages, 4).first_micro_batch, (1 + 7) + 3 - wait);
  // The last stage has no gradient to wait for: recomputation there is never ahead.
  stages = std::vector<plan::StagePrediction>(2);
  for (auto& s : stages) s.cost.forward = 1, s.cost.backward = 3, s.cost.recompute_time = 1;
  stages[1].cost.recompute_ahead = true;
  EXPECT_DOUBLE_EQ(CostModel::pipeline_time(stages, 4).first_micro_batch, 8.0);

  // Through predict: a pp2 plan recomputing fully on both stages. With the shifted schedule the
  // first stage holds a scratch per recomputing layer (more memory), the last stage the same; the
  // iteration is faster by at most the first stage's recomputation of one micro-batch.
  CostModel cost = a800_70b();
  plan::Plan plan = plan::uniform_plan(cost.model(), 1, 8, 2, 64, 1, 64);
  for (auto& s : plan.pipelines[0].stages) s.recompute = {model::RecomputeMode::kFull, 4};
  const auto before = cost.predict(plan, plan::Rates(64, 1.0), false);
  const auto before_memory = cost.memory_by_kind(plan);
  cost.set_shifted_recompute(true);
  const auto after = cost.predict(plan, plan::Rates(64, 1.0), false);
  const auto after_memory = cost.memory_by_kind(plan);
  const auto& first = after.pipelines[0].stages[0].cost;
  EXPECT_TRUE(first.recompute_ahead);
  EXPECT_FALSE(after.pipelines[0].stages[1].cost.recompute_ahead);
  EXPECT_GT(first.recompute_time, 0);
  EXPECT_LT(after.iteration_time, before.iteration_time);
  EXPECT_GE(after.iteration_time, before.iteration_time - first.recompute_time - 1e-12);
  const int first_rank = plan.pipelines[0].stages[0].ranks[0];
  const int last_rank = plan.pipelines[0].stages[1].ranks[0];
  EXPECT_GT(after_memory[size_t(first_rank)].activations,
            before_memory[size_t(first_rank)].activations);
  EXPECT_DOUBLE_EQ(after_memory[size_t(last_rank)].activations,
                   before_memory[size_t(last_rank)].activations);
  EXPECT_DOUBLE_EQ(after.memory_bytes[size_t(first_rank)],
                   after_memory[size_t(first_rank)].total());
}

// The planner's per-plan choice of the shifted schedule: a recomputing stage before the last gets
// recompute_ahead where its ranks fit a scratch per recomputing layer, and the plan is then
// predicted as the global option predicts it (faster, more memory on that stage); where the
// scratch does not fit, the stage keeps recomputing inside its backward.
TEST(CostModel, RecomputeAheadWhereTheMemoryFits) {
  const CostModel cost = a800_70b();
  const plan::Rates rates(64, 1.0);
  plan::Plan plan = plan::uniform_plan(cost.model(), 1, 8, 4, 64, 1, 64);
  for (auto& s : plan.pipelines[0].stages) s.recompute = {model::RecomputeMode::kSelective, 10};
  const auto before = cost.predict(plan, rates, false);
  ASSERT_TRUE(before.fits) << before.problem;
  plan::Plan chosen = plan;
  EXPECT_TRUE(cost.choose_recompute_ahead(chosen));
  const auto& stages = chosen.pipelines[0].stages;
  for (size_t j = 0; j < stages.size(); ++j) EXPECT_EQ(stages[j].recompute_ahead, j < 3) << j;
  const auto after = cost.predict(chosen, rates, false);
  EXPECT_TRUE(after.fits);
  EXPECT_LT(after.iteration_time, before.iteration_time);
  CostModel shifted = cost;
  shifted.set_shifted_recompute(true);
  const auto everywhere = shifted.predict(plan, rates, false);
  EXPECT_DOUBLE_EQ(after.iteration_time, everywhere.iteration_time);
  const int first = stages[0].ranks[0];
  EXPECT_DOUBLE_EQ(after.memory_bytes[size_t(first)], everywhere.memory_bytes[size_t(first)]);
  EXPECT_GT(after.memory_bytes[size_t(first)], before.memory_bytes[size_t(first)]);
  EXPECT_DOUBLE_EQ(cost.memory_by_kind(chosen)[size_t(first)].total(),
                   after.memory_bytes[size_t(first)]);

  // Devices with room for the first stage recomputing in its backward, not for the scratch.
  auto cluster = cost.cluster();
  cluster.memory_bytes =
      (before.memory_bytes[size_t(first)] +
       0.5 * (after.memory_bytes[size_t(first)] - before.memory_bytes[size_t(first)])) /
      cluster.usable_memory_fraction;
  const CostModel tight(cost.model(), cluster, cost.batch());
  plan::Plan kept = plan;
  tight.choose_recompute_ahead(kept);
  EXPECT_FALSE(kept.pipelines[0].stages[0].recompute_ahead);
  EXPECT_TRUE(tight.predict(kept, rates, false).fits);
}

TEST(CostModel, PredictUniformPlanAndStragglers) {
  const CostModel cost = a800_70b();
  const auto plan = plan::uniform_plan(cost.model(), 2, 8, 4, 64, 1, 64);
  plan::Rates rates(64, 1.0);
  const auto healthy = cost.predict(plan, rates);
  EXPECT_TRUE(healthy.fits) << healthy.problem;
  EXPECT_TRUE(std::isfinite(healthy.iteration_time));
  EXPECT_GT(healthy.grad_sync_time, 0);
  EXPECT_GT(healthy.optimizer_time, 0);
  // Useful compute is a good share of the iteration (bubbles (m+S−1)/m and communication).
  const double compute =
      training_flops_per_token(cost.model(), 4096) * 4096 * 64 / (64 * cost.cluster().flops());
  EXPECT_GT(compute / healthy.iteration_time, 0.7);
  EXPECT_LT(compute / healthy.iteration_time, 1.0);
  for (int d = 0; d < 64; ++d) EXPECT_GT(healthy.memory_bytes[static_cast<size_t>(d)], 10e9);

  rates[3] = 2.0;  // pipeline 0, stage 0
  const auto slow = cost.predict(plan, rates);
  EXPECT_GT(slow.pipelines[0].time, 1.5 * healthy.pipelines[0].time);
  EXPECT_DOUBLE_EQ(slow.pipelines[1].time, healthy.pipelines[1].time);

  rates[40] = std::numeric_limits<double>::infinity();
  const auto gone = cost.predict(plan, rates);
  EXPECT_TRUE(std::isinf(gone.iteration_time));
  EXPECT_NE(gone.problem.find("40"), std::string::npos);
}

TEST(CostModel, ProfileReplacesPeakThroughput) {
  const auto m = model::load_model_config("demo");
  const auto cluster = plan::load_cluster("cpu-local");
  plan::Profile p;
  p.micro_batch = 1;
  p.seq_len = 256;
  p.layer_forward_s = p.layer_backward_s = p.head_forward_s = p.head_backward_s = 0.01;
  p.layer_forward_flops_per_s = 1e9;
  p.layer_backward_flops_per_s = 2e9;
  p.head_flops_per_s = 1e9;
  const auto round = plan::Profile::from_json(p.to_json(), "p.json");
  EXPECT_EQ(round.to_json(), p.to_json());
  const CostModel cost(m, cluster, plan::BatchConfig{8, 1, 256}, round);
  plan::Stage s;
  s.ranks = {0};
  cost.even_shares_of(s);
  const auto g = cost.group_cost(s, plan::Rates(cluster.num_devices(), 1.0));
  EXPECT_NEAR(g.layer_forward, cost.layer_forward_flops() / 1e9, 1e-12);
  EXPECT_NEAR(g.layer_backward, 2 * cost.layer_forward_flops() / 2e9, 1e-12);
  Json bad = p.to_json();
  bad["head_flops_per_s"] = 0;
  try {
    plan::Profile::from_json(bad, "p.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_flops_per_s"), std::string::npos);
  }
}

// A slow link (ClusterSpec::link_rates) divides the inter-node bandwidth of the transfers through
// it, and nothing else: intra-node traffic and compute keep their times.
// The link monitor's healthy reference: on the test bed's calibrated 2 x 2 cluster (34 us and
// 0.335 GB/s between hosts) a node's leader sends 512 KiB to another in 34 us + 512 KiB /
// 0.335 GB/s = 1.6 ms; the other ranks do not probe.
TEST(CostModel, TheLinkProbeIsOneMessageBetweenNodeLeaders) {
  const CostModel bed(model::load_model_config("demo"), plan::load_cluster("cpu-bed-2x2"),
                      plan::BatchConfig{16, 1, 128});
  const double bytes = 512 * 1024;
  const std::vector<double> expected = bed.link_probe_seconds_per_byte();
  ASSERT_EQ(expected.size(), 4u);
  EXPECT_NEAR(expected[0] * bytes, 34e-6 + bytes / 0.335e9, 1e-9);
  EXPECT_EQ(expected[2], expected[0]);
  EXPECT_EQ(expected[1], 0.0);
  EXPECT_EQ(expected[3], 0.0);
  // Slow links are what the monitor measures, not the reference: it is the healthy cluster's.
  EXPECT_EQ(bed.with_link_rates({1.0, 10.0}).link_probe_seconds_per_byte(), expected);
}

// The probe's buffer is communication memory on node leaders only, and the planner's stage memory
// (stage_cost, of a group's fullest member) counts it by the same predicate as the per-device
// memory (memory_by_kind): on the 2 x 2 bed a pp4 plan's stages on ranks 1 and 3 hold no probe.
// The demo model's largest tensor (256 x 768 elements) is smaller than the probe's two halves, so
// the probe sets a leader's packing buffer. On devices whose usable memory is exactly what rank 1
// needs, rank 1's stage fits without recomputation (charged the probe, it would have to recompute).
TEST(CostModel, TheLinkProbesBufferCountsOnNodeLeadersOnlyInStagesAsPerDevice) {
  const auto model = model::load_model_config("demo");
  auto cluster = plan::load_cluster("cpu-bed-2x2");
  const plan::BatchConfig batch{16, 1, 128};
  const CostModel bed(model, cluster, batch);
  const plan::Plan plan = plan::uniform_plan(model, 1, 1, 4, 16, 1);
  const plan::Rates rates(4, 1.0);
  const auto by_kind = bed.memory_by_kind(plan);
  ASSERT_EQ(by_kind.size(), 4u);
  const double probe_bytes = 2 * plan::kLinkProbeElements * sizeof(float);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(bed.probes_links(r), r % 2 == 0) << r;
    if (r % 2 == 0) {
      EXPECT_DOUBLE_EQ(by_kind[size_t(r)].communication, probe_bytes) << r;
    } else {
      EXPECT_LT(by_kind[size_t(r)].communication, probe_bytes) << r;
    }
  }
  // Every stage's memory is its (only) rank's, leader or not.
  const auto predicted = bed.predict(plan, rates, false);
  ASSERT_TRUE(predicted.fits) << predicted.problem;
  const auto& stages = plan.pipelines[0].stages;
  for (size_t j = 0; j < stages.size(); ++j) {
    const int rank = stages[j].ranks[0];
    EXPECT_EQ(bed.group_cost(stages[j], rates).probes_links, rank % 2 == 0) << rank;
    EXPECT_DOUBLE_EQ(predicted.pipelines[0].stages[j].cost.memory_bytes,
                     by_kind[size_t(rank)].total())
        << rank;
    EXPECT_DOUBLE_EQ(predicted.memory_bytes[size_t(rank)], by_kind[size_t(rank)].total()) << rank;
  }
  // A TP group holding a leader is charged the probe, as its leader is.
  plan::Stage pair = group(bed, {2, 3});
  pair.layer_begin = 0, pair.layer_end = 4;
  EXPECT_TRUE(bed.group_cost(pair, rates).probes_links);
  // On one node nobody probes.
  auto one_node = cluster;
  one_node.nodes = 1, one_node.devices_per_node = 4;
  EXPECT_FALSE(CostModel(model, one_node, batch).group_cost(stages[0], rates).probes_links);

  // Usable memory exactly rank 1's need (stage 1 of 4: 3 micro-batches in flight).
  cluster.memory_bytes = by_kind[1].total();
  cluster.usable_memory_fraction = 1;
  const CostModel tight(model, cluster, batch);
  const plan::GroupCost g = tight.group_cost(stages[1], rates);
  const plan::StageCost fitted =
      tight.stage_cost(g, {.layers = stages[1].num_layers(), .in_flight = 3});
  EXPECT_TRUE(fitted.fits);
  EXPECT_EQ(fitted.recompute, model::Recompute{});
  EXPECT_DOUBLE_EQ(fitted.memory_bytes, by_kind[1].total());
  // Charged the probe (as every stage on several nodes was before), the same stage would not fit
  // without recomputation: the probe's buffer is more than what rank 1 packs.
  plan::GroupCost as_leader = g;
  as_leader.probes_links = true;
  const plan::StageCost charged =
      tight.stage_cost(as_leader, {.layers = stages[1].num_layers(),
                                   .in_flight = 3,
                                   .choice = plan::RecomputeChoice::kAsPlanned});
  EXPECT_FALSE(charged.fits);
  EXPECT_DOUBLE_EQ(charged.memory_bytes - fitted.memory_bytes,
                   probe_bytes - by_kind[1].communication);
}

// A device the plan leaves idle still holds the compute probe's three matrices and, when it is
// its node's leader, the link probe it exchanges every step (runtime::Engine): the per-device
// memory (memory_by_kind, predict) counts them there, not 0.
TEST(CostModel, IdleDevicesHoldTheirProbes) {
  const auto model = model::load_model_config("demo");
  const auto cluster = plan::load_cluster("cpu-bed-2x2");
  const plan::BatchConfig batch{16, 1, 128};
  const CostModel bed(model, cluster, batch);
  // pp2 on the nodes' second devices: both leaders (0 and 2) idle.
  plan::Plan plan = plan::uniform_plan(model, 1, 1, 2, 16, 1, 4);
  plan.pipelines[0].stages[0].ranks = {1};
  plan.pipelines[0].stages[1].ranks = {3};
  plan::validate(plan, model, 4, 16, "pp2 on 1 and 3");
  const double compute_probe = 3.0 * plan::kComputeProbeSize * plan::kComputeProbeSize * 4;
  const double link_probe = 2 * plan::kLinkProbeElements * 4;
  const auto by_kind = bed.memory_by_kind(plan);
  const auto predicted = bed.predict(plan, plan::Rates(4, 1.0), false);
  for (int r : {0, 2}) {
    const plan::MemoryUse& idle = by_kind[size_t(r)];
    EXPECT_DOUBLE_EQ(idle.workspace, compute_probe) << r;
    EXPECT_DOUBLE_EQ(idle.communication, link_probe) << r;
    EXPECT_DOUBLE_EQ(idle.parameters + idle.gradients + idle.optimizer + idle.activations, 0) << r;
    EXPECT_DOUBLE_EQ(predicted.memory_bytes[size_t(r)], compute_probe + link_probe) << r;
  }
  for (int r : {1, 3}) {
    EXPECT_GT(by_kind[size_t(r)].parameters, 0) << r;
    EXPECT_DOUBLE_EQ(predicted.memory_bytes[size_t(r)], by_kind[size_t(r)].total()) << r;
  }
  // An idle device that leads no node (one node: nobody probes links) holds the compute probe.
  auto one_node = cluster;
  one_node.nodes = 1, one_node.devices_per_node = 4;
  const auto alone = CostModel(model, one_node, batch).memory_by_kind(plan);
  EXPECT_DOUBLE_EQ(alone[0].total(), compute_probe);
}

// The probe's schedule: every pair of nodes meets exactly once, no node twice in a round, an odd
// count gives each node one bye.
TEST(CostModel, TheLinkProbeScheduleMeetsEveryPairOnce) {
  EXPECT_EQ(plan::link_probe_rounds(1), 0);
  for (int nodes = 2; nodes <= 9; ++nodes) {
    std::vector<std::vector<int>> met(static_cast<size_t>(nodes),
                                      std::vector<int>(static_cast<size_t>(nodes), 0));
    std::vector<int> byes(static_cast<size_t>(nodes), 0);
    for (int round = 0; round < plan::link_probe_rounds(nodes); ++round) {
      for (int x = 0; x < nodes; ++x) {
        const int y = plan::link_probe_partner(nodes, round, x);
        if (y < 0) {
          ++byes[static_cast<size_t>(x)];
          continue;
        }
        ASSERT_NE(x, y);
        EXPECT_EQ(plan::link_probe_partner(nodes, round, y), x);  // symmetric: a pair
        ++met[static_cast<size_t>(x)][static_cast<size_t>(y)];
      }
    }
    for (int x = 0; x < nodes; ++x) {
      EXPECT_EQ(byes[static_cast<size_t>(x)], nodes % 2) << nodes << " nodes, node " << x;
      for (int y = 0; y < nodes; ++y) {
        EXPECT_EQ(met[static_cast<size_t>(x)][static_cast<size_t>(y)], x == y ? 0 : 1)
            << nodes << " nodes: " << x << " and " << y;
      }
    }
  }
  EXPECT_THROW(plan::link_probe_partner(3, 3, 0), Error);
}

TEST(CostModel, SlowLinksSlowOnlyTheTransfersThroughThem) {
  const auto model = model::load_model_config("demo");
  plan::ClusterSpec cluster = plan::load_cluster("cpu-local");
  cluster.nodes = 2;
  cluster.devices_per_node = 2;
  cluster.inter_node_bandwidth = 0.25e9;
  const CostModel healthy(model, cluster, plan::BatchConfig{16, 1, 128});
  const CostModel slowed = healthy.with_link_rates({1.0, 10.0});
  EXPECT_DOUBLE_EQ(slowed.cluster().bandwidth(0, 2), 0.025e9);
  EXPECT_DOUBLE_EQ(slowed.cluster().bandwidth(2, 3), cluster.intra_node_bandwidth);
  EXPECT_DOUBLE_EQ(slowed.cluster().bandwidth(0, 1), cluster.intra_node_bandwidth);
  // Data parallelism over both nodes: the gradient sync crosses the slow link.
  const plan::Plan dp4 = plan::uniform_plan(model, 4, 1, 1, 16, 1, 4);
  const plan::Rates rates(4, 1.0);
  const plan::Prediction dp_healthy = healthy.predict(dp4, rates);
  const plan::Prediction dp_slowed = slowed.predict(dp4, rates);
  EXPECT_DOUBLE_EQ(dp_slowed.pipeline_time, dp_healthy.pipeline_time);
  const double latency_part = 2 * (4 - 1) * cluster.inter_node_latency;
  EXPECT_NEAR(dp_slowed.grad_sync_time - latency_part,
              10 * (dp_healthy.grad_sync_time - latency_part), 1e-9);
  // Pipelines inside nodes, data parallelism across: the same; each pipeline stays inside a node,
  // so its hand-offs keep their time.
  const plan::Plan pp2 = plan::uniform_plan(model, 2, 1, 2, 16, 1, 4);
  EXPECT_DOUBLE_EQ(slowed.predict(pp2, rates).pipeline_time,
                   healthy.predict(pp2, rates).pipeline_time);
  EXPECT_GT(slowed.predict(pp2, rates).grad_sync_time, healthy.predict(pp2, rates).grad_sync_time);
  // Rates below 1 or for more nodes than the cluster has are errors naming the link rates.
  EXPECT_THROW(healthy.with_link_rates({1.0, 0.5}), Error);
  EXPECT_THROW(healthy.with_link_rates({1.0, 1.0, 1.0}), Error);
}

// Sub-pipelined tensor parallelism: a layer's 2 forward (and 2 backward) all-reduces become 4 of
// half the activations, each but the last hidden up to the compute of the other half that runs
// meanwhile (cost_model.h). The compute shares are written out here from the model's shapes.
TEST(CostModel, SubpipelinedTensorParallelismHidesHalfReductionsBehindTheOtherHalf) {
  const auto m = model::load_model_config("llama-70b");
  const double h = m.hidden_size, kv = m.kv_dim(), f = m.ffn_hidden_size, s = 4096;
  // Per token on an even tp8 shard: the o projection, q/k/v, the attention core, the MLP.
  const double o = 2 * h * h / 8, qkv = 2 * (h * h + 2 * h * kv) / 8, core = 2 * h * s / 8,
               mlp = 2 * 3 * h * f / 8;
  const double all = o + qkv + core + mlp;
  for (int micro_batch : {1, 2}) {
    auto cluster = plan::load_cluster("a800-8x8");
    CostModel cost(m, cluster, plan::BatchConfig{64, micro_batch, 4096});
    const plan::Stage tp8 = group(cost, {0, 1, 2, 3, 4, 5, 6, 7});
    const auto g = cost.group_cost(tp8, plan::Rates(8, 1.0));
    EXPECT_NEAR(g.attention_share, (o + qkv + core) / all, 1e-12);
    EXPECT_NEAR(g.o_proj_share, o / all, 1e-12);
    EXPECT_NEAR(g.qkv_share, qkv / all, 1e-12);
    EXPECT_DOUBLE_EQ(g.layer_comm_half,
                     cost.allreduce_time(tp8.ranks, cost.activation_message_bytes() / 2));
    const auto plain = cost.stage_cost(g, {.layers = 10});
    EXPECT_DOUBLE_EQ(cost.exposed_layer_comm(g, false), 2 * g.layer_comm);

    cost.set_tp_subpipeline(true);
    const double c2 = g.layer_comm_half, F = g.layer_forward / 2, B = g.layer_backward / 2;
    auto hidden = [&](double compute) { return std::max(0.0, c2 - compute); };
    const double att = (o + qkv + core) / all, ffn = mlp / all;
    const double forward = micro_batch >= 2 ? c2 + hidden(att * F) + 2 * hidden(ffn * F)
                                            : c2 + hidden(o / all * F) + 2 * hidden(ffn * F);
    const double backward =
        micro_batch >= 2 ? c2 + hidden(ffn * B) + 2 * hidden(att * B)
                         : c2 + hidden(ffn * B) + hidden(o / all * B) + hidden(qkv / all * B);
    EXPECT_NEAR(cost.exposed_layer_comm(g, false), forward, 1e-15) << micro_batch;
    EXPECT_NEAR(cost.exposed_layer_comm(g, true), backward, 1e-15) << micro_batch;
    // On NVLink the halves hide almost entirely behind a 70B layer's compute: about one half
    // all-reduce per layer and direction is left, far less than the two whole ones.
    EXPECT_LT(cost.exposed_layer_comm(g, false), g.layer_comm);
    const auto overlapped = cost.stage_cost(g, {.layers = 10});
    EXPECT_NEAR(plain.forward - overlapped.forward,
                10 * (2 * g.layer_comm - cost.exposed_layer_comm(g, false)), 1e-12);
    EXPECT_NEAR(plain.comm - overlapped.comm,
                10 * (4 * g.layer_comm - cost.exposed_layer_comm(g, false) -
                      cost.exposed_layer_comm(g, true)),
                1e-12);

    // A link so slow that no half hides: 4 half-reductions cost more than 2 whole ones (latency
    // counts twice), less the compute they overlap.
    cluster.intra_node_bandwidth /= 1e4;
    CostModel slow(m, cluster, plan::BatchConfig{64, micro_batch, 4096});
    slow.set_tp_subpipeline(true);
    const auto gs = slow.group_cost(tp8, plan::Rates(8, 1.0));
    const double Fs = gs.layer_forward / 2;
    const double overlap = micro_batch >= 2 ? (att + 2 * ffn) * Fs : (o / all + 2 * ffn) * Fs;
    EXPECT_NEAR(slow.exposed_layer_comm(gs, false), 4 * gs.layer_comm_half - overlap,
                1e-9 * gs.layer_comm);
    // Without a tensor-parallel group nothing changes.
    const auto alone = cost.group_cost(group(cost, {0}), plan::Rates(8, 1.0));
    EXPECT_EQ(cost.exposed_layer_comm(alone, false), 0);
  }
}

// Ranks that take turns on one core (cores_per_node < devices_per_node): compute never overlaps
// on a core, a TP group's members on one core add up, and a pipeline's stages on one core fill
// each other's bubbles.
TEST(CostModel, RanksTakingTurnsOnACoreShareItsCompute) {
  auto cluster = plan::load_cluster("cpu-bed-2x2");
  cluster.cores_per_node = 0;  // every rank a core of its own
  const model::ModelConfig demo = model::load_model_config("demo");
  const plan::BatchConfig batch{16, 2, 128};
  const CostModel own(demo, cluster, batch);
  cluster.cores_per_node = 1;  // the two ranks of a host take turns on its one core
  const CostModel shared(demo, cluster, batch);
  ASSERT_NE(shared.shared_cores(), nullptr);
  EXPECT_EQ(shared.shared_cores()->core_of(1), 0);
  EXPECT_EQ(shared.shared_cores()->core_of(2), 1);
  const plan::Rates rates(4, 1.0);
  auto predict = [&](const CostModel& cost, int dp, int tp, int pp) {
    return cost.predict(plan::uniform_plan(demo, dp, tp, pp, 16, 2, 4), rates, false);
  };
  // Work of one micro-batch through a stage, without its TP communication.
  auto work = [](const plan::StagePrediction& s) {
    return s.cost.forward + s.cost.backward - s.cost.comm;
  };

  // A TP group on one core: its members' halves one after the other, a whole layer's time.
  const auto one_core = group(shared, {0, 1});
  const auto two_cores = group(own, {0, 1});
  EXPECT_NEAR(shared.group_cost(one_core, rates).layer_forward,
              2 * own.group_cost(two_cores, rates).layer_forward, 1e-12);

  // dp4: two ranks per core, each pipeline alone would take half the time the core needs.
  const auto dp4_own = predict(own, 4, 1, 1), dp4 = predict(shared, 4, 1, 1);
  EXPECT_NEAR(dp4.pipeline_time, 2 * dp4_own.pipeline_time, 1e-9);
  EXPECT_NEAR(dp4.pipeline_time, 2 * 2 * work(dp4.pipelines[0].stages[0]), 1e-9);

  // pp2 × dp2: each pipeline's two stages share a core, so no bubble: the core's work.
  const auto pp2 = predict(shared, 2, 1, 2);
  const auto& stages = pp2.pipelines[0].stages;
  ASSERT_EQ(stages.size(), 2u);  // the prediction keeps the plan's stages
  EXPECT_NEAR(pp2.pipelines[0].time, 4 * (work(stages[0]) + work(stages[1])), 1e-9);
  // With a core per rank, 1F1B's bubble ((m + S − 1) / m) at half the speed would be slower.
  const auto pp2_half_speed = [&] {
    auto half = cluster;
    half.cores_per_node = 0;
    half.peak_flops /= 2;
    return predict(CostModel(demo, half, batch), 2, 1, 2);
  }();
  EXPECT_GT(pp2_half_speed.pipeline_time, 1.2 * pp2.pipeline_time);

  // pp4 on 2 hosts: stages 0-1 on host 0's core, 2-3 on host 1's: a pipeline of two merged
  // stages. 1F1B: the first micro-batch through both, then 7 more at the slower core's pace, plus
  // the hand-offs between the hosts (at most 2 for the first micro-batch and 1 per later one).
  const auto pp4 = predict(shared, 1, 1, 4);
  const auto& s4 = pp4.pipelines[0].stages;
  const double core0 = work(s4[0]) + work(s4[1]), core1 = work(s4[2]) + work(s4[3]);
  const double without_hand_offs = core0 + core1 + 7 * std::max(core0, core1);
  EXPECT_GE(pp4.pipeline_time, without_hand_offs - 1e-9);
  EXPECT_LE(pp4.pipeline_time, without_hand_offs + 9 * s4[1].p2p_next + 1e-9);
  EXPECT_GT(s4[1].p2p_next, 0);

  // Optimizer steps of ranks on one core run one after the other.
  EXPECT_NEAR(dp4.optimizer_time, 2 * dp4_own.optimizer_time, 1e-12);

  // Without sharing nothing changes: the same cluster with a core per rank and the default.
  auto plain = plan::load_cluster("cpu-bed-2x2");
  plain.cores_per_node = 2;
  EXPECT_FALSE(plain.cores_shared());
  EXPECT_DOUBLE_EQ(predict(CostModel(demo, plain, batch), 1, 1, 4).iteration_time,
                   predict(own, 1, 1, 4).iteration_time);
}

// The 2-core test bed's logic (plan/shared_cores.h) stays behind its seam: on a cluster with a
// compute unit per device (cores_per_node 0, or one per device) the cost model holds no
// SharedCores, and the planner's plans and every figure of their predictions are the same
// whichever way the cluster says so. The same cluster with devices taking turns on fewer units
// predicts otherwise, so the comparison can tell.
TEST(CostModel, DevicePerRankClustersNeverEnterTheSharedCoreSeam) {
  const model::ModelConfig demo = model::load_model_config("demo");
  auto same = [](const plan::Prediction& a, const plan::Prediction& b) {
    ASSERT_EQ(a.iteration_time, b.iteration_time);
    ASSERT_EQ(a.pipeline_time, b.pipeline_time);
    ASSERT_EQ(a.grad_sync_time, b.grad_sync_time);
    ASSERT_EQ(a.optimizer_time, b.optimizer_time);
    ASSERT_EQ(a.memory_bytes, b.memory_bytes);
    ASSERT_EQ(a.pipelines.size(), b.pipelines.size());
    for (size_t p = 0; p < a.pipelines.size(); ++p) {
      ASSERT_EQ(a.pipelines[p].time, b.pipelines[p].time);
      ASSERT_EQ(a.pipelines[p].stages.size(), b.pipelines[p].stages.size());
      for (size_t j = 0; j < a.pipelines[p].stages.size(); ++j) {
        const plan::StageCost &x = a.pipelines[p].stages[j].cost,
                              &y = b.pipelines[p].stages[j].cost;
        ASSERT_EQ(x.forward, y.forward);
        ASSERT_EQ(x.backward, y.backward);
        ASSERT_EQ(x.memory_bytes, y.memory_bytes);
      }
    }
  };
  int contrasted = 0;
  for (const char* name : {"cpu-local", "cpu-bed-2x2", "cpu-bed-3x1", "a800-4x8", "h100-8x8"}) {
    SCOPED_TRACE(name);
    plan::ClusterSpec cluster = plan::load_cluster(name);
    const int devices = cluster.num_devices();
    const plan::BatchConfig batch{4 * devices, 1, 128};
    cluster.cores_per_node = 0;
    const CostModel unset(demo, cluster, batch);
    cluster.cores_per_node = cluster.devices_per_node;
    const CostModel one_each(demo, cluster, batch);
    EXPECT_EQ(unset.shared_cores(), nullptr);
    EXPECT_EQ(one_each.shared_cores(), nullptr);
    plan::Rates slow_one(static_cast<size_t>(devices), 1.0);
    slow_one[static_cast<size_t>(devices - 1)] = 3.0;
    for (const plan::Rates& rates : {plan::Rates(static_cast<size_t>(devices), 1.0), slow_one}) {
      plan::PlanRequest request;
      request.rates = rates;
      const plan::Plan planned = plan::make_strategy("malleus")->plan(unset, request).plan;
      EXPECT_EQ(plan::make_strategy("malleus")->plan(one_each, request).plan.to_json(),
                planned.to_json());
      same(unset.predict(planned, rates), one_each.predict(planned, rates));
      same(unset.predict(planned, rates, false), one_each.predict(planned, rates, false));
      if (cluster.devices_per_node > 1) {
        cluster.cores_per_node = 1;  // the node's devices take turns on one unit
        const CostModel turns(demo, cluster, batch);
        ASSERT_NE(turns.shared_cores(), nullptr);
        // Not slower always: merged stages also leave out their hand-offs.
        EXPECT_NE(turns.predict(planned, rates).iteration_time,
                  unset.predict(planned, rates).iteration_time);
        cluster.cores_per_node = cluster.devices_per_node;
        ++contrasted;
      }
    }
  }
  EXPECT_GT(contrasted, 0);
}

// The vocabulary-parallel loss costs the last stage of a TP group two more all-reduces in the
// forward (each token's logit maximum, then its sum of exponentials and target logit), small and
// latency-bound: on the test bed's links (in turns, ~0.3 ms latency) 8 of them a step for tp2 with
// 4 micro-batches add about 5 ms, which a prediction counting only the activations' all-reduces
// missed (docs/performance.md, "The multi-host test bed").
TEST(CostModel, TheVocabularyParallelLossAddsTwoSmallAllReducesToTheLastStage) {
  const CostModel cost(model::load_model_config("demo"), plan::load_cluster("cpu-bed-2x2"),
                       plan::BatchConfig{16, 2, 128});
  const plan::Stage tp2 = group(cost, {0, 1});
  const auto g = cost.group_cost(tp2, plan::Rates(4, 1.0));
  const double tokens = 2.0 * 128 * cost.cluster().activation_bytes;
  const double loss =
      cost.allreduce_time(tp2.ranks, tokens) + cost.allreduce_time(tp2.ranks, 2 * tokens);
  EXPECT_DOUBLE_EQ(g.loss_comm, loss);
  EXPECT_GT(loss, 4 * cost.cluster().intra_node_latency);  // two collectives of two latencies
  const auto middle = cost.stage_cost(g, {.layers = 2});
  const auto last = cost.stage_cost(g, {.layers = 2, .last = true});
  EXPECT_NEAR(last.forward - middle.forward, g.head_forward + loss, 1e-12);
  EXPECT_NEAR(last.comm - middle.comm, g.layer_comm + loss, 1e-12);  // + the head's backward
  // One rank: no all-reduce at all.
  const auto alone = cost.group_cost(group(cost, {0}), plan::Rates(4, 1.0));
  EXPECT_EQ(alone.loss_comm, 0);
  EXPECT_EQ(cost.stage_cost(alone, {.layers = 4, .first = true, .last = true}).comm, 0);
}
