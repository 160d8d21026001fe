// Plan invariance, the runtime's central property (DESIGN.md, "Numerics"): training under any
// valid plan — unlike pipelines, uneven layer splits, uneven tensor-parallel shares, uneven
// micro-batch counts, idle ranks — gives the per-step losses and final parameters of one rank
// training alone, up to fp32 summation order. Also: resuming a checkpoint under another plan.
//
// Run under mpirun with 1 to 8 ranks; every rank runs every test (they are collective), rank 0
// computes the single-rank reference in a communicator of its own and compares.
#include <gtest/gtest.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>
#include <random>
#include <set>

#include "comm/communicator.h"
#include "elastic/controller.h"
#include "layout/migration.h"
#include "layout/optimizer_shard.h"
#include "layout/redistribution.h"
#include "plan/cost_model.h"
#include "plan/planner.h"
#include "replan/replan.h"
#include "runtime/core_lease.h"
#include "runtime/step_exchange.h"
#include "test_util.h"
#include "train/trainer.h"
#include "train_config_samples.h"

using namespace malleus;
using comm::Communicator;
namespace fs = std::filesystem;

namespace {

// Shared by all ranks: one scratch directory named by rank 0.
fs::path shared_dir(Communicator& world) {
  std::string path;
  if (world.rank() == 0) {
    path = (fs::temp_directory_path() / ("malleus_runtime_" + std::to_string(::getpid()))).string();
    fs::remove_all(path);
    malleus::testing::write_synthetic_corpus(fs::path(path) / "data");
  }
  int64_t length = static_cast<int64_t>(path.size());
  world.broadcast(&length, sizeof length, 0);
  path.resize(static_cast<size_t>(length));
  world.broadcast(path.data(), path.size(), 0);
  return path;
}

train::TrainConfig base_config(const fs::path& dir) {
  train::TrainConfig c = malleus::testing::synthetic_corpus_config(dir, "parallel-test");
  c.seq_len = 16;
  c.micro_batch_size = 1;
  c.global_batch_size = 8;
  c.steps = 10;
  c.lr = 3e-3f;
  c.warmup_steps = 2;
  // The plans as given: a loaded machine (sanitizers, 4 ranks on 2 cores beside another test)
  // reads timings that would have the controller re-plan, and a test of one plan's behaviour
  // (which ranks start tensor-parallel sums, what each allocates) needs that plan throughout.
  // The tests of re-planning turn it on.
  c.replan = false;
  return c;
}

struct TrainingRun {
  std::vector<double> losses;
  std::vector<float> params;  // full layout, rank 0 only
};

// `total` split into `parts` random multiples of `unit`, each at least one unit.
std::vector<int> random_split(std::mt19937& rng, int total, int parts, int unit = 1) {
  std::vector<int> split(static_cast<size_t>(parts), unit);
  for (int left = total / unit - parts; left > 0; --left) {
    split[std::uniform_int_distribution<size_t>(0, split.size() - 1)(rng)] += unit;
  }
  return split;
}

// A random valid plan of the parallel test model on `world` ranks: some ranks idle, pipelines of
// different depths, tensor-parallel groups of 1 to 4 ranks with uneven shares.
plan::Plan random_plan(std::mt19937& rng, int world, int global_batch) {
  const auto model = malleus::testing::parallel_test_model();
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<int> ranks(static_cast<size_t>(world));
  std::iota(ranks.begin(), ranks.end(), 0);
  std::shuffle(ranks.begin(), ranks.end(), rng);
  ranks.resize(static_cast<size_t>(pick(1, world)));
  std::vector<std::vector<int>> groups;
  for (size_t i = 0; i < ranks.size();) {
    const size_t t = static_cast<size_t>(pick(1, std::min<int>(4, int(ranks.size() - i))));
    groups.emplace_back(ranks.begin() + long(i), ranks.begin() + long(i + t));
    i += t;
  }
  plan::Plan plan;
  plan.world_size = world;
  plan.micro_batch_size = 1;
  for (size_t g = 0; g < groups.size() && int(plan.pipelines.size()) < global_batch;) {
    const int stages = pick(1, std::min<int>(model.num_layers, int(groups.size() - g)));
    const auto layers = random_split(rng, model.num_layers, stages);
    plan::Pipeline pipeline;
    int begin = 0;
    for (int j = 0; j < stages; ++j, ++g) {
      plan::Stage stage;
      stage.ranks = groups[g];
      stage.layer_begin = begin;
      stage.layer_end = begin += layers[size_t(j)];
      const int t = stage.tp();
      stage.heads = random_split(rng, model.num_heads, t, model.num_heads / model.num_kv_heads);
      stage.ffn = random_split(rng, model.ffn_hidden_size, t);
      stage.vocab = random_split(rng, model.vocab_size, t);
      pipeline.stages.push_back(std::move(stage));
    }
    plan.pipelines.push_back(std::move(pipeline));
  }
  const auto micro_batches = random_split(rng, global_batch, int(plan.pipelines.size()));
  for (size_t p = 0; p < plan.pipelines.size(); ++p) {
    plan.pipelines[p].micro_batches = micro_batches[p];
  }
  plan::validate(plan, model, world, global_batch, "random plan");
  return plan;
}

TrainingRun train_steps(train::Trainer& trainer, int steps) {
  TrainingRun run;
  for (int s = 0; s < steps; ++s) run.losses.push_back(trainer.train_step().loss);
  run.params = trainer.snapshot().params;
  return run;
}

TrainingRun single_rank_reference(const train::TrainConfig& config, int steps) {
  Communicator alone = Communicator::world().subgroup({0});
  train::TrainConfig c = config;
  c.plan = "";
  c.dp = c.tp = c.pp = 1;
  // Injected slowness does not change the numerics, and ranks beyond 0 do not exist here.
  c.stragglers.clear();
  c.straggler_trace.clear();
  train::Trainer trainer(c, malleus::testing::parallel_test_model(), alone);
  return train_steps(trainer, steps);
}

// fp32 reduction order: the sums over tensor-parallel ranks and pipelines run in another order
// than on one rank (relative rounding ~1e-7 per operation); Adam normalises the update, so the
// parameters drift apart by at most ~lr × steps × 1e-3 in the worst (near-zero gradient)
// elements. 1e-4 relative on the losses, 2e-5 absolute on the parameters leaves room for both.
void expect_matches(const TrainingRun& run, const TrainingRun& reference, const std::string& what) {
  ASSERT_EQ(run.losses.size(), reference.losses.size());
  for (size_t s = 0; s < run.losses.size(); ++s) {
    EXPECT_NEAR(run.losses[s], reference.losses[s], 1e-4 * reference.losses[s])
        << what << ": step " << s + 1;
  }
  ASSERT_EQ(run.params.size(), reference.params.size()) << what;
  double worst = 0, worst_loss = 0;
  for (size_t i = 0; i < run.params.size(); ++i) {
    worst = std::max(worst, double(std::abs(run.params[i] - reference.params[i])));
  }
  for (size_t s = 0; s < run.losses.size(); ++s) {
    worst_loss = std::max(worst_loss, std::abs(run.losses[s] / reference.losses[s] - 1));
  }
  EXPECT_LT(worst, 2e-5) << what << ": largest parameter difference";
  std::printf("  %-28s largest relative loss difference %.1e, parameter difference %.1e\n",
              what.c_str(), worst_loss, worst);
}

// The plan file dir/name.json holding `text`, for every rank: rank 0 writes it, and no rank goes
// on (to read it) before it exists. Returns its path.
std::string share_plan(Communicator& world, const fs::path& dir, const std::string& name,
                       const std::string& text) {
  const auto path = dir / (name + ".json");
  if (world.rank() == 0) std::ofstream(path) << text;
  world.barrier();
  return path.string();
}

// A plan of one pipeline over `world_size` ranks: `stages` is its list of stages in the plan
// format's JSON, without the brackets.
std::string one_pipeline_plan(int world_size, int micro_batch_size, int micro_batches,
                              const std::string& stages) {
  return R"({"world_size": )" + std::to_string(world_size) + R"(, "micro_batch_size": )" +
         std::to_string(micro_batch_size) + R"(, "pipelines": [{"micro_batches": )" +
         std::to_string(micro_batches) + R"(, "stages": [)" + stages + "]}]}";
}

// The end of a test using shared_dir(): every rank done with it, rank 0 removes it.
void remove_shared_dir(Communicator& world, const fs::path& dir) {
  world.barrier();
  if (world.rank() == 0) fs::remove_all(dir);
}

// Plans exercising each kind of unevenness, for the number of ranks running.
std::vector<std::pair<std::string, std::string>> plans_for(int world) {
  std::vector<std::pair<std::string, std::string>> plans;
  if (world == 2) {
    plans.push_back({"dp2-uneven-microbatches", R"({"world_size": 2, "pipelines": [
      {"micro_batches": 5, "stages": [{"layers": [0, 4], "ranks": [0]}]},
      {"micro_batches": 3, "stages": [{"layers": [0, 4], "ranks": [1]}]}]})"});
    plans.push_back({"pp2-uneven-layers", R"({"world_size": 2, "pipelines": [
      {"micro_batches": 8, "stages": [{"layers": [0, 3], "ranks": [1]}, {"layers": [3, 4], "ranks": [0]}]}]})"});
    plans.push_back({"tp2-uneven-shares", R"({"world_size": 2, "pipelines": [
      {"micro_batches": 8, "stages": [{"layers": [0, 4], "ranks": [0, 1], "heads": [6, 2],
                                       "ffn": [30, 18], "vocab": [200, 57]}]}]})"});
    plans.push_back({"one-idle", R"({"world_size": 2, "pipelines": [
      {"micro_batches": 8, "stages": [{"layers": [0, 4], "ranks": [1]}]}]})"});
  }
  if (world == 4) {
    plans.push_back({"unlike-pipelines", R"({"world_size": 4, "pipelines": [
      {"micro_batches": 6, "stages": [
        {"layers": [0, 3], "ranks": [0, 1], "heads": [2, 6], "ffn": [20, 28], "vocab": [100, 157]},
        {"layers": [3, 4], "ranks": [2]}]},
      {"micro_batches": 2, "stages": [{"layers": [0, 4], "ranks": [3]}]}]})"});
    plans.push_back({"tp2-pp2", R"({"world_size": 4, "pipelines": [
      {"micro_batches": 8, "stages": [{"layers": [0, 2], "ranks": [0, 1]},
                                      {"layers": [2, 4], "ranks": [2, 3]}]}]})"});
    plans.push_back({"pp3-idle", R"({"world_size": 4, "pipelines": [
      {"micro_batches": 8, "stages": [{"layers": [0, 1], "ranks": [2]}, {"layers": [1, 3], "ranks": [0]},
                                      {"layers": [3, 4], "ranks": [1]}]}]})"});
  }
  if (world == 8) {
    plans.push_back({"three-unlike-pipelines", R"({"world_size": 8, "pipelines": [
      {"micro_batches": 4, "stages": [
        {"layers": [0, 2], "ranks": [0, 1], "heads": [6, 2], "ffn": [24, 24], "vocab": [128, 129]},
        {"layers": [2, 4], "ranks": [2, 3], "heads": [4, 4], "ffn": [40, 8], "vocab": [57, 200]}]},
      {"micro_batches": 3, "stages": [{"layers": [0, 3], "ranks": [4]}, {"layers": [3, 4], "ranks": [5]}]},
      {"micro_batches": 1, "stages": [{"layers": [0, 4], "ranks": [6]}]}]})"});
  }
  return plans;
}

}  // namespace

TEST(Runtime, AnyPlanTrainsLikeOneRank) {
  Communicator world = Communicator::world();
  const fs::path dir = shared_dir(world);
  const auto plans = plans_for(world.size());
  if (plans.empty()) GTEST_SKIP() << "no plans for " << world.size() << " ranks";
  const train::TrainConfig base = base_config(dir);
  TrainingRun reference;
  if (world.rank() == 0) reference = single_rank_reference(base, 10);
  for (const auto& [name, text] : plans) {
    train::TrainConfig config = base;
    config.plan = share_plan(world, dir, name, text);
    train::Trainer trainer(config, malleus::testing::parallel_test_model(), world);
    const TrainingRun run = train_steps(trainer, 10);
    if (world.rank() == 0) expect_matches(run, reference, name);
  }
  remove_shared_dir(world, dir);
}

// Saved with the distributed optimizer on and resumed with it off, and the other way round.
TEST(Runtime, CheckpointResumesUnderAnotherPlan) {
  Communicator world = Communicator::world();
  for (const bool saved_split : {true, false}) {
    const fs::path dir = shared_dir(world);
    train::TrainConfig a = base_config(dir);  // plan A: the uniform plan over all ranks
    a.dp = world.size() >= 2 ? 2 : 1;
    a.tp = world.size() >= 4 ? 2 : 1;
    a.pp = world.size() >= 8 ? 2 : 1;
    a.distributed_optimizer = saved_split;
    TrainingRun straight;
    {
      train::Trainer trainer(a, malleus::testing::parallel_test_model(), world);
      for (int s = 0; s < 5; ++s) straight.losses.push_back(trainer.train_step().loss);
      const checkpoint::Checkpoint c = trainer.snapshot();
      if (world.rank() == 0) checkpoint::save_checkpoint(dir / "ckpt", c);
      for (int s = 5; s < 10; ++s) straight.losses.push_back(trainer.train_step().loss);
      straight.params = trainer.snapshot().params;
    }
    world.barrier();
    // Plan B: another shape on the same ranks (pipeline-parallel over all of them, or one rank).
    train::TrainConfig b = base_config(dir);
    b.dp = 1;
    b.tp = 1;
    b.pp = std::min(world.size(), 4);
    b.dp = world.size() / b.pp;
    if (!saved_split) {  // to split moments: pipelines of whole models on every rank
      b.pp = 1;
      b.dp = world.size();
    }
    b.distributed_optimizer = !saved_split;
    TrainingRun resumed{std::vector<double>(straight.losses.begin(), straight.losses.begin() + 5),
                        {}};
    {
      train::Trainer trainer(b, malleus::testing::parallel_test_model(), world);
      trainer.restore(checkpoint::load_checkpoint(dir / "ckpt", world));
      EXPECT_EQ(trainer.step(), 5);
      EXPECT_EQ(trainer.consumed_samples(), 5 * b.global_batch_size);
      for (int s = 5; s < 10; ++s) resumed.losses.push_back(trainer.train_step().loss);
      resumed.params = trainer.snapshot().params;
    }
    if (world.rank() == 0) {
      expect_matches(resumed, straight,
                     saved_split ? "resumed, split moments to whole" : "resumed, whole to split");
    }
    remove_shared_dir(world, dir);
    world.barrier();
  }
}

TEST(Runtime, ReplanningAroundAStragglerKeepsTheNumerics) {
  // A rank slowed 5× for a few steps, then another 20×: the monitor notices, the controller
  // re-plans each time; the state migrates each time, and the losses and final parameters are
  // still those of one rank training alone.
  Communicator world = Communicator::world();
  if (world.size() < 4) GTEST_SKIP() << "needs 4 ranks";
  const fs::path dir = shared_dir(world);
  train::TrainConfig config = base_config(dir);
  config.steps = 28;
  config.replan = true;
  // A window of 3 steps: a rank whose first step alone is slow (under the sanitizers, 8 ranks
  // sharing 2 cores, one first step read 20x) is not taken for a device slow from the start,
  // which would make the controller idle it before the episodes and leave them nothing to do.
  config.monitor_window = 3;
  // Two episodes, each slow enough that switching pays off by a wide margin even on a loaded
  // machine (the controller rightly declines switches whose gain is marginal).
  config.stragglers = {"1:5:5-11", "2:20:15-28"};
  // Plan for devices whose links are cheap, so the healthy plan uses every rank and each episode
  // calls for another plan (on this machine's real latency a model this small is best on one),
  // and whose compute is slow, so a switch's predicted gain dwarfs its measured migration time
  // in any build (sanitizer builds migrate ten times slower than the cost model assumes).
  config.cluster = (dir / "fast-links.json").string();
  if (world.rank() == 0) {
    Json cluster = read_json_file(MALLEUS_SOURCE_DIR "/configs/clusters/cpu-local.json");
    cluster["intra_node_latency_us"] = cluster["inter_node_latency_us"] = 1;
    cluster["intra_node_bandwidth_gbs"] = cluster["inter_node_bandwidth_gbs"] = 100;
    cluster["peak_tflops"] = 0.001;
    std::ofstream(config.cluster) << cluster.dump();
  }
  world.barrier();
  TrainingRun reference;
  if (world.rank() == 0) reference = single_rank_reference(config, 28);
  train::Trainer trainer(config, malleus::testing::parallel_test_model(), world);
  TrainingRun run;
  int replans = 0;
  std::set<std::string> searches;  // how each switch's plan was searched
  std::set<std::string> plans{trainer.engine().plan().summary()};
  for (int s = 0; s < 28; ++s) {
    const train::StepStats stats = trainer.train_step();
    run.losses.push_back(stats.loss);
    if (stats.replan && stats.replan->switched) {
      ++replans;
      searches.insert(stats.replan->search);
    }
    if (stats.replan && world.rank() == 0) {
      std::printf("  step %d: %s\n", s + 1, metrics::to_json(*stats.replan).dump().c_str());
    }
    plans.insert(trainer.engine().plan().summary());
  }
  run.params = trainer.snapshot().params;
  EXPECT_GE(replans, 2);
  EXPECT_GE(plans.size(), 2u);
  // Every switch says how its plan was searched: from the running plan (few rates moved), or the
  // full search, which on small clusters also checks an incremental plan short of the capacity
  // left (Controller.ReplansIncrementallyWhenFewRatesMoved shows the incremental one chosen).
  // The record's planner figures are rank 0's.
  for (const std::string& search : world.rank() == 0 ? searches : std::set<std::string>{}) {
    EXPECT_TRUE(search == "incremental" || search == "full") << search;
  }
  std::printf("  re-plans: %d, plans used: %zu\n", replans, plans.size());
  if (world.rank() == 0) expect_matches(run, reference, "with re-plans");
  remove_shared_dir(world, dir);
}

TEST(Runtime, MigrationKeepsTheStateAndMovesOnlyWhatIsMissing) {
  Communicator world = Communicator::world();
  if (world.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const auto model = malleus::testing::parallel_test_model();
  runtime::EngineOptions options;
  options.seq_len = 16;
  // Whole moments: every dp rank holds all of them (split, each holds a slice of them, and the
  // pipeline stages below take the rest from the other ranks: the next test counts those).
  options.distributed_optimizer = false;
  const auto a = plan::uniform_plan(model, world.size(), 1, 1, 8, 1);
  const auto b = plan::uniform_plan(model, 1, 1, std::min(world.size(), 4), 8, 1, world.size());
  auto engine = std::make_unique<runtime::Engine>(model, a, world, options);
  engine->init_parameters(5);
  const runtime::FullState before = engine->gather();
  const auto expected = layout::plan_redistribution(model, layout::plan_layout(a, model),
                                                    layout::plan_layout(b, model));
  runtime::MigrationStats stats;
  engine = engine->migrate(b, &stats);
  const runtime::FullState after = engine->gather();
  if (world.rank() == 0) {
    EXPECT_EQ(before.params, after.params);
    EXPECT_EQ(before.adam_m, after.adam_m);
  }

  // Under dp every rank held everything, so the only cost is none: each new holder copies locally.
  EXPECT_EQ(stats.bytes_moved, expected.elements_moved() * layout::kMigratedBytesPerElement);
  EXPECT_EQ(stats.bytes_moved, 0);
  // And back: pipeline stages each hold part; the ranks that now need everything receive exactly
  // the pieces they lacked.
  const auto back = layout::plan_redistribution(model, layout::plan_layout(b, model),
                                                layout::plan_layout(a, model));
  engine = engine->migrate(a, &stats);
  EXPECT_EQ(stats.bytes_moved, back.elements_moved() * layout::kMigratedBytesPerElement);
  EXPECT_GT(stats.bytes_moved, 0);
  const runtime::FullState again = engine->gather();
  if (world.rank() == 0) {
    EXPECT_EQ(before.params, again.params);
  }
}

TEST(Runtime, MigrationSendsExactlyTheEstimatedBytes) {
  // Random pairs of plans: the estimate the controller and the simulator weigh
  // (replan::estimate_migration) against the bytes the engine's messages carried, with the
  // distributed optimizer on (the default; plans of several pipelines split the moments, which
  // then travel from slice to slice) and off.
  Communicator world = Communicator::world();
  const auto model = malleus::testing::parallel_test_model();
  for (const bool split : {true, false}) {
    runtime::EngineOptions options;
    options.seq_len = 16;
    options.distributed_optimizer = split;
    plan::CostModel cost(model, elastic::local_cluster("cpu-local", world.size()),
                         plan::BatchConfig{8, 1, 16});
    cost.use_distributed_optimizer(split);
    std::mt19937 rng(2024);  // the same seed on every rank: the same plans
    plan::Plan current = random_plan(rng, world.size(), 8);
    auto engine = std::make_unique<runtime::Engine>(model, current, world, options);
    engine->init_parameters(7);
    const runtime::FullState before = engine->gather();
    int64_t moved = 0;
    for (int pair = 0; pair < 8; ++pair) {
      const plan::Plan next = random_plan(rng, world.size(), 8);
      const replan::MigrationEstimate estimate = replan::estimate_migration(cost, current, next);
      const layout::MigrationVolume volume = layout::migration_volume(model, current, next, split);
      runtime::MigrationStats stats;
      engine = engine->migrate(next, &stats);
      EXPECT_EQ(stats.bytes_moved, estimate.total_bytes)
          << current.summary() << " -> " << next.summary();
      EXPECT_EQ(stats.bytes_received, volume.received_bytes[size_t(world.rank())]);
      EXPECT_EQ(static_cast<int64_t>(world.all_reduce_max(double(stats.bytes_received))),
                estimate.max_rank_bytes);
      moved += stats.bytes_moved;
      current = next;
    }
    if (world.size() > 1) {
      EXPECT_GT(moved, 0);
    }
    const runtime::FullState after = engine->gather();
    if (world.rank() == 0) {
      EXPECT_EQ(before.params, after.params);
      EXPECT_EQ(before.adam_v, after.adam_v);
    }
  }
}

// A live migration moves state band by band (layout/staged_redistribution.h): each rank's memory,
// as its ledger books it, never rises more than the bucket above max(before, after), whatever
// the plans (idle ranks, unlike pipelines, uneven tensor-parallel shares), and the state arrives
// bit for bit. With the distributed optimizer too: the moments move from the old plan's optimizer
// shards to the new one's (or whole, where a plan of one pipeline keeps them whole) under the
// same bound, and arrive as they were, compared with the gathered state (Engine::gather, which
// collects the slices by all-gathers of their own).
TEST(Runtime, MigrationExtraMemoryStaysUnderTheBucket) {
  Communicator world = Communicator::world();
  if (world.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const auto model = malleus::testing::parallel_test_model();
  for (const bool split : {false, true}) {
    for (const int64_t bucket : {int64_t{16} << 10, int64_t{64} << 20}) {
      SCOPED_TRACE(std::string(split ? "distributed optimizer, " : "whole moments, ") + "bucket " +
                   std::to_string(bucket));
      runtime::EngineOptions options;
      options.seq_len = 16;
      options.migration_bucket_bytes = bucket;
      options.distributed_optimizer = split;
      std::mt19937 rng(77);  // the same seed on every rank: the same plans
      plan::Plan current = random_plan(rng, world.size(), 8);
      auto engine = std::make_unique<runtime::Engine>(model, current, world, options);
      engine->init_parameters(11);
      const runtime::FullState before = engine->gather();
      // Adam moments that differ from the parameters, so a mix-up between buffers shows.
      const auto sample = [](int index, int32_t* inputs, int32_t* targets) {
        for (int t = 0; t < 16; ++t) {
          inputs[t] = (index * 31 + t * 7) % 257;
          targets[t] = (index * 17 + t * 5 + 1) % 257;
        }
      };
      engine->step(sample, 1e-3f, 1.0f);
      const runtime::FullState trained = engine->gather();
      int64_t largest_state = 0;  // the most state a rank held on either side
      int64_t largest_extra = 0;
      int split_plans = 0;  // migrations from or to a plan whose moments are split
      for (int pair = 0; pair < 8; ++pair) {
        // With the distributed optimizer every other plan is one that splits the moments.
        plan::Plan next = random_plan(rng, world.size(), 8);
        while (split && pair % 2 == 0 && !layout::splits_moments(next, true)) {
          next = random_plan(rng, world.size(), 8);
        }
        const auto& shard = engine->state().shard();
        const int64_t params = shard ? model::ParameterLayout(model, *shard).total_size() : 0;
        largest_state = std::max(largest_state, (params + 2 * engine->optimizer_elements()) * 4);
        split_plans += engine->distributed_optimizer() || layout::splits_moments(next, split);
        runtime::MigrationStats stats;
        engine = engine->migrate(next, &stats);
        EXPECT_LE(stats.peak_extra_bytes, bucket) << current.summary() << " -> " << next.summary();
        // Without the room the old engine's gradients and activations leave: the state move's own
        // peak, as the ledger saw it, within the order's prediction and the bucket.
        EXPECT_LE(stats.state_extra_bytes, stats.predicted_extra_bytes);
        EXPECT_LE(stats.predicted_extra_bytes, bucket);
        largest_extra = std::max(largest_extra, stats.state_extra_bytes);
        current = next;
      }
      const runtime::FullState after = engine->gather();
      if (world.rank() == 0) {
        EXPECT_NE(before.params, trained.params);
        EXPECT_EQ(trained.params, after.params);
        EXPECT_EQ(trained.adam_m, after.adam_m);
        EXPECT_EQ(trained.adam_v, after.adam_v);
      }
      // The small bucket binds: states are several buckets large.
      if (bucket < (int64_t{1} << 20)) {
        EXPECT_GT(world.all_reduce_max(double(largest_state)), 4.0 * double(bucket));
      }
      // The bound is reached for: the state move does hold more than either side alone.
      EXPECT_GT(largest_extra, 0);
      // And training goes on after the migrations.
      EXPECT_TRUE(std::isfinite(engine->step(sample, 1e-3f, 1.0f).loss));
      // The random plans do split moments (several pipelines), on both sides of migrations.
      if (split) {
        EXPECT_GT(split_plans, 0);
      }
    }
  }
}

// The overlapped switch (Engine::switch_to) moves the same state through the same staged plan as
// the synchronous one (Engine::migrate), only the Adam moments later, during the new plan's first
// step: training that switches either way gives the same losses and the same parameters and
// moments, bit for bit, over a sequence of random plans (idle ranks, unlike pipelines, uneven
// tensor-parallel shares), with the distributed optimizer on and off, and with all the moments in
// the background or only the last of them (a budget below the moments: the rest move first). While
// the old moments are still held, a rank's memory stays within the budget and the bucket above
// max(before the switch, after it), besides the communication staging the step uses anyway.
TEST(Runtime, OverlappedSwitchTrainsLikeTheSynchronousSwitch) {
  Communicator world = Communicator::world();
  if (world.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const auto model = malleus::testing::parallel_test_model();
  const auto sample = [](int index, int32_t* inputs, int32_t* targets) {
    for (int t = 0; t < 16; ++t) {
      inputs[t] = (index * 29 + t * 11) % 257;
      targets[t] = (index * 13 + t * 3 + 2) % 257;
    }
  };
  struct Setting {
    bool distributed_optimizer;
    int64_t overlap_bytes;
  };
  enum class Switch { kSynchronous, kOverlapped };
  for (const Setting setting :
       {Setting{false, int64_t{256} << 20}, Setting{true, int64_t{256} << 20},
        Setting{true, int64_t{16} << 10}}) {
    SCOPED_TRACE(std::string(setting.distributed_optimizer ? "distributed optimizer" : "whole") +
                 ", overlap budget " + std::to_string(setting.overlap_bytes));
    runtime::EngineOptions options;
    options.seq_len = 16;
    options.distributed_optimizer = setting.distributed_optimizer;
    options.migration_bucket_bytes = int64_t{64} << 10;
    options.migration_overlap_bytes = setting.overlap_bytes;
    std::mt19937 rng(91);  // the same seed on every rank: the same plans
    std::vector<plan::Plan> plans;
    for (int p = 0; p < 6; ++p) plans.push_back(random_plan(rng, world.size(), 8));
    int64_t background_bytes = 0;
    // Per switch: a step of the old plan, the switch, the new plan's first step (the moments
    // arriving) and its second (the memory the step uses anyway, to compare with).
    auto train = [&](Switch how, std::vector<double>* losses) {
      auto engine = std::make_unique<runtime::Engine>(model, plans[0], world, options);
      engine->init_parameters(13);
      for (size_t p = 1; p < plans.size(); ++p) {
        losses->push_back(engine->step(sample, 1e-3f, 1.0f).loss);
        runtime::MigrationStats stats;
        engine = how == Switch::kOverlapped
                     ? runtime::Engine::switch_to(std::move(engine), plans[p], &stats)
                     : engine->migrate(plans[p], &stats);
        losses->push_back(engine->step(sample, 1e-3f, 1.0f).loss);
        const auto background = engine->take_background_stats();
        const runtime::StepResult second = engine->step(sample, 1e-3f, 1.0f);
        losses->push_back(second.loss);
        if (how == Switch::kSynchronous) {
          EXPECT_FALSE(background.has_value());
          continue;
        }
        background_bytes += stats.background_bytes;
        if (stats.background_bytes > 0) {
          EXPECT_TRUE(background.has_value())
              << plans[p - 1].summary() << " -> " << plans[p].summary();
        }
        if (!background) continue;
        const int64_t staging =
            second.peak_memory[size_t(world.rank())][backend::MemoryKind::kCommunication];
        EXPECT_LE(background->peak_extra_bytes,
                  setting.overlap_bytes + options.migration_bucket_bytes + staging)
            << plans[p - 1].summary() << " -> " << plans[p].summary();
      }
      return engine->gather();
    };
    std::vector<double> overlapped_losses, synchronous_losses;
    const runtime::FullState overlapped = train(Switch::kOverlapped, &overlapped_losses);
    const runtime::FullState synchronous = train(Switch::kSynchronous, &synchronous_losses);
    EXPECT_EQ(overlapped_losses, synchronous_losses);
    if (world.rank() == 0) {
      EXPECT_EQ(overlapped.params, synchronous.params);
      EXPECT_EQ(overlapped.adam_m, synchronous.adam_m);
      EXPECT_EQ(overlapped.adam_v, synchronous.adam_v);
    }
    // Something did move in the background (the random plans trade pieces between ranks).
    EXPECT_GT(world.all_reduce_sum(background_bytes), 0);
  }
}

// The distributed optimizer (ZeRO-1) changes where Adam's moments live and the order of the
// gradient sums (a reduce-scatter instead of an all-reduce), not the math: with it on and off the
// same plan gives the same losses and parameters within the plan-invariance tolerance
// (expect_matches: 1e-4 relative on each loss, 2e-5 absolute on each parameter), on dp2, dp4 and
// plans of unlike pipelines with uneven tensor-parallel shares. And each rank's optimizer memory
// (the ledger's kOptimizer peak) is 1/P of what it is without, P the pipelines (every piece has
// one holder per pipeline), up to the slices' rounding.
TEST(Runtime, DistributedOptimizerTrainsLikeWholeMomentsInAFractionOfTheMemory) {
  Communicator world = Communicator::world();
  std::vector<std::pair<std::string, std::string>> plans;
  if (world.size() == 2) {
    for (const auto& plan : plans_for(2)) {
      if (plan.first == "dp2-uneven-microbatches") plans.push_back({"zero-dp2", plan.second});
    }
  }
  if (world.size() == 4) {
    plans.push_back({"zero-dp4", R"({"world_size": 4, "pipelines": [
      {"micro_batches": 2, "stages": [{"layers": [0, 4], "ranks": [0]}]},
      {"micro_batches": 2, "stages": [{"layers": [0, 4], "ranks": [1]}]},
      {"micro_batches": 3, "stages": [{"layers": [0, 4], "ranks": [2]}]},
      {"micro_batches": 1, "stages": [{"layers": [0, 4], "ranks": [3]}]}]})"});
    for (const auto& plan : plans_for(4)) {
      if (plan.first == "unlike-pipelines") plans.push_back({"zero-" + plan.first, plan.second});
    }
  }
  if (world.size() == 8) {
    for (const auto& plan : plans_for(8)) plans.push_back({"zero-" + plan.first, plan.second});
  }
  if (plans.empty()) GTEST_SKIP() << "no plans for " << world.size() << " ranks";
  const fs::path dir = shared_dir(world);
  train::TrainConfig base = base_config(dir);
  base.weight_decay = 0.1f;  // norm gains exempt, per tensor, in the shards too
  for (const auto& [name, text] : plans) {
    const int pipelines = static_cast<int>(Json::parse(text)["pipelines"].size());
    TrainingRun runs[2];
    std::vector<double> optimizer_bytes[2];
    for (int on = 0; on < 2; ++on) {
      train::TrainConfig config = base;
      config.distributed_optimizer = on == 1;
      config.plan = share_plan(world, dir, name, text);
      train::Trainer trainer(config, malleus::testing::parallel_test_model(), world);
      EXPECT_EQ(trainer.engine().distributed_optimizer(), on == 1) << name;
      for (int s = 0; s < 8; ++s) {
        const train::StepStats stats = trainer.train_step();
        runs[on].losses.push_back(stats.loss);
        optimizer_bytes[on] = stats.peak_optimizer_bytes;
      }
      runs[on].params = trainer.snapshot().params;
    }
    if (world.rank() != 0) continue;
    expect_matches(runs[1], runs[0], name + " on vs off");
    for (int r = 0; r < world.size(); ++r) {
      const double whole = optimizer_bytes[0][size_t(r)], split = optimizer_bytes[1][size_t(r)];
      std::printf("  %s rank %d: optimizer %.0f bytes without, %.0f with (%.3f)\n", name.c_str(), r,
                  whole, split, split / whole);
      if (whole == 0) continue;  // idle
      EXPECT_NEAR(split, whole / pipelines, 0.01 * whole / pipelines + 64) << name << " rank " << r;
    }
  }
  remove_shared_dir(world, dir);
}

// The trainer's memory check counts what the runtime holds (train::model_state_bytes): each
// rank's memory ledger rises by exactly its parameters, gradients (and gradient shard) and Adam
// moments when the trainer is built, and its file of a checkpoint is exactly the host copy
// counted, with the distributed optimizer on (moments split on plans of several pipelines) and off.
TEST(Runtime, MemoryCheckCountsWhatTheRuntimeHolds) {
  Communicator world = Communicator::world();
  std::vector<std::pair<std::string, std::string>> plans;
  if (world.size() == 2) {
    for (const auto& plan : plans_for(2)) {
      if (plan.first == "dp2-uneven-microbatches" || plan.first == "one-idle" ||
          plan.first == "tp2-uneven-shares") {
        plans.push_back(plan);
      }
    }
  }
  if (world.size() == 4) {
    for (const auto& plan : plans_for(4)) {
      if (plan.first == "unlike-pipelines") plans.push_back(plan);
    }
  }
  if (plans.empty()) GTEST_SKIP() << "no plans for " << world.size() << " ranks";
  const fs::path dir = shared_dir(world);
  const auto model = malleus::testing::parallel_test_model();
  using backend::MemoryKind;
  auto state_bytes = [] {
    const backend::MemoryFigures now = backend::memory_ledger().current();
    return now[MemoryKind::kParameters] + now[MemoryKind::kGradients] + now[MemoryKind::kOptimizer];
  };
  for (const auto& [name, text] : plans) {
    for (const bool distributed : {true, false}) {
      const std::string what = name + (distributed ? " split" : " whole");
      train::TrainConfig config = base_config(dir);
      config.distributed_optimizer = distributed;
      config.plan = share_plan(world, dir, name, text);
      config.steps = 1;
      config.eval_every = 0;
      config.checkpoint_every = 0;  // one at the end
      config.out_dir = (dir / ("run-" + name + (distributed ? "-split" : "-whole"))).string();
      const plan::Plan plan = train::resolve_plan(config, model, world.size());
      const train::ModelStateBytes counted =
          train::model_state_bytes(model, plan, world.rank(), distributed);
      const int64_t before = state_bytes();
      {
        train::Trainer trainer(config, model, world);
        EXPECT_EQ(trainer.engine().distributed_optimizer(), counted.moments_split) << what;
        EXPECT_EQ(state_bytes() - before, counted.engine_state())
            << what << " rank " << world.rank();
        ASSERT_EQ(trainer.run(), 0) << what;
      }
      const fs::path file = fs::path(config.out_dir) / "checkpoints" / "step_00000001" /
                            checkpoint::shard_file_name(world.rank());
      const int64_t written = fs::exists(file) ? int64_t(fs::file_size(file)) : 0;
      EXPECT_EQ(written, counted.checkpoint_copy) << what << " rank " << world.rank();
      std::printf("  %s rank %d: engine %lld bytes, checkpoint copy %lld\n", what.c_str(),
                  world.rank(), static_cast<long long>(counted.engine_state()),
                  static_cast<long long>(counted.checkpoint_copy));
    }
  }
  remove_shared_dir(world, dir);
}

// Migration with the distributed optimizer: between plans of several pipelines (moments split)
// and of one (moments whole), both ways. The state gathered before and after each migration is
// bit for bit the same (parameters and both moments), and training on goes as without it.
TEST(Runtime, MigrationCarriesTheDistributedOptimizersMoments) {
  Communicator world = Communicator::world();
  if (world.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const auto model = malleus::testing::parallel_test_model();
  const runtime::SampleFn sample = [&](int index, int32_t* inputs, int32_t* targets) {
    for (int t = 0; t < 16; ++t) {
      inputs[t] = (index * 31 + t * 7) % model.vocab_size;
      targets[t] = (index * 37 + t * 11 + 1) % model.vocab_size;
    }
  };
  std::vector<plan::Plan> plans{
      plan::uniform_plan(model, world.size(), 1, 1, 8, 1),
      plan::uniform_plan(model, 1, 1, std::min(world.size(), 4), 8, 1, world.size())};
  if (world.size() >= 4) plans.push_back(plan::uniform_plan(model, 2, 1, 2, 8, 1, world.size()));
  plans.push_back(plans.front());
  std::vector<double> losses[2];
  for (int on = 0; on < 2; ++on) {
    runtime::EngineOptions options;
    options.seq_len = 16;
    options.adamw.weight_decay = 0.1f;
    options.distributed_optimizer = on == 1;
    auto engine = std::make_unique<runtime::Engine>(model, plans.front(), world, options);
    engine->init_parameters(5);
    for (size_t p = 0; p < plans.size(); ++p) {
      if (p > 0) {
        const runtime::FullState before = engine->gather();
        engine = engine->migrate(plans[p]);
        const runtime::FullState after = engine->gather();
        if (world.rank() == 0) {
          EXPECT_EQ(before.params, after.params) << plans[p].summary();
          EXPECT_EQ(before.adam_m, after.adam_m) << plans[p].summary();
          EXPECT_EQ(before.adam_v, after.adam_v) << plans[p].summary();
          EXPECT_GT(std::abs(after.adam_v.front()) + std::abs(after.adam_v.back()), 0);
        }
      }
      EXPECT_EQ(engine->distributed_optimizer(), on == 1 && plans[p].pipelines.size() > 1);
      for (int s = 0; s < 2; ++s) losses[on].push_back(engine->step(sample, 1e-2f, 1.0f).loss);
    }
  }
  for (size_t s = 0; s < losses[0].size(); ++s) {
    EXPECT_NEAR(losses[1][s], losses[0][s], 1e-4 * losses[0][s]) << "step " << s + 1;
  }
}

// Activation recomputation (per stage: none / selective / full, some or all of its layers) leaves
// the numerics unchanged: the same plan without it gives the same losses and parameters, on
// plans with pp >= 2 and on tensor-parallel stages (whose recomputed forward repeats its
// all-reduces).
TEST(Runtime, RecomputationTrainsLikeKeepingActivations) {
  Communicator world = Communicator::world();
  if (world.size() != 2 && world.size() != 4) GTEST_SKIP() << "plans for 2 and 4 ranks";
  const fs::path dir = shared_dir(world);
  const train::TrainConfig base = base_config(dir);
  // Stage texts: {plain, recomputing}.
  std::vector<std::pair<std::string, std::string>> stages;
  if (world.size() == 2) {
    stages = {{R"({"layers": [0, 3], "ranks": [0]}, {"layers": [3, 4], "ranks": [1]})",
               R"({"layers": [0, 3], "ranks": [0], "recompute": "full", "recompute_layers": 2},
                  {"layers": [3, 4], "ranks": [1], "recompute": "selective"})"},
              {R"({"layers": [0, 2], "ranks": [1]}, {"layers": [2, 4], "ranks": [0]})",
               R"({"layers": [0, 2], "ranks": [1], "recompute": "selective", "recompute_layers": 1},
                  {"layers": [2, 4], "ranks": [0], "recompute": "full"})"}};
  } else {
    stages = {
        {R"({"layers": [0, 2], "ranks": [0, 1]}, {"layers": [2, 4], "ranks": [2, 3]})",
         R"({"layers": [0, 2], "ranks": [0, 1], "recompute": "full"},
                  {"layers": [2, 4], "ranks": [2, 3], "recompute": "selective"})"},
        {R"({"layers": [0, 1], "ranks": [2]}, {"layers": [1, 3], "ranks": [0]}, {"layers": [3, 4], "ranks": [1, 3]})",
         R"({"layers": [0, 1], "ranks": [2], "recompute": "selective"},
                  {"layers": [1, 3], "ranks": [0], "recompute": "full", "recompute_layers": 1},
                  {"layers": [3, 4], "ranks": [1, 3], "recompute": "full"})"}};
  }
  auto run = [&](const std::string& name, const std::string& stage_list) {
    train::TrainConfig config = base;
    config.plan = share_plan(world, dir, name, one_pipeline_plan(world.size(), 1, 8, stage_list));
    train::Trainer trainer(config, malleus::testing::parallel_test_model(), world);
    return train_steps(trainer, 6);
  };
  for (size_t i = 0; i < stages.size(); ++i) {
    const TrainingRun plain = run("plain" + std::to_string(i), stages[i].first);
    const TrainingRun recomputed = run("recomputed" + std::to_string(i), stages[i].second);
    // Within the runtime tests' tolerance, not bit for bit: the same plan run twice on several
    // ranks, recomputing or not, differed in the low bits once in six runs on 4 ranks and on 2
    // hosts over TCP, so the multi-rank runtime is not bit-reproducible from run to run (cause
    // not yet found). Recomputation itself is bit-exact on one rank:
    // Model.RecomputationGivesBitIdenticalLossesAndGradients.
    if (world.rank() == 0) expect_matches(recomputed, plain, stages[i].second);
  }
  remove_shared_dir(world, dir);
}

// The shifted critical path (Merak): stages before the last recompute a micro-batch's forward
// while its gradient is on its way instead of inside the backward. The same operations on the
// same inputs in another order, so bit-identical losses and parameters, on pp2 and pp4, with
// selective and full recomputation (no gradient clipping: the global norm is summed over ranks
// in an order MPI chooses, the one part of a step whose bits may vary from run to run). The same
// with the option off and the plan marking those stages (recompute_ahead, as the planner does).
TEST(Runtime, ShiftedRecomputationTrainsBitIdenticallyToRecomputingInBackward) {
  Communicator world = Communicator::world();
  if (world.size() != 2 && world.size() != 4) GTEST_SKIP() << "pp2 and pp4 plans";
  const fs::path dir = shared_dir(world);
  train::TrainConfig base = base_config(dir);
  base.grad_clip = 0;
  std::vector<std::string> stage_lists;
  if (world.size() == 2) {
    stage_lists = {
        R"({"layers": [0, 3], "ranks": [0], "recompute": "selective"},
           {"layers": [3, 4], "ranks": [1], "recompute": "selective"})",
        R"({"layers": [0, 2], "ranks": [1], "recompute": "full"},
           {"layers": [2, 4], "ranks": [0], "recompute": "full", "recompute_layers": 1})",
        R"({"layers": [0, 3], "ranks": [0], "recompute": "full", "recompute_layers": 2},
           {"layers": [3, 4], "ranks": [1]})"};
  } else {
    stage_lists = {
        R"({"layers": [0, 1], "ranks": [0], "recompute": "selective"},
           {"layers": [1, 2], "ranks": [1], "recompute": "selective"},
           {"layers": [2, 3], "ranks": [2], "recompute": "selective"},
           {"layers": [3, 4], "ranks": [3], "recompute": "selective"})",
        R"({"layers": [0, 1], "ranks": [3], "recompute": "full"},
           {"layers": [1, 2], "ranks": [2], "recompute": "full"},
           {"layers": [2, 3], "ranks": [1], "recompute": "selective"},
           {"layers": [3, 4], "ranks": [0], "recompute": "full"})"};
  }
  struct Run {
    TrainingRun training;
    std::vector<double> ahead_s;  // per rank, summed over the steps
  };
  auto run = [&](const std::string& name, const std::string& stage_list, bool shifted,
                 bool marked = false) {
    train::TrainConfig config = base;
    config.shifted_recompute = shifted;
    std::string text = one_pipeline_plan(world.size(), 1, 8, stage_list);
    if (marked) {
      plan::Plan p =
          plan::Plan::from_json(Json::parse(text), malleus::testing::parallel_test_model(), "plan");
      auto& stages = p.pipelines[0].stages;
      for (size_t j = 0; j + 1 < stages.size(); ++j) {
        stages[j].recompute_ahead = stages[j].recompute.layers > 0;
      }
      text = p.to_json().dump();
    }
    config.plan = share_plan(world, dir, name, text);
    train::Trainer trainer(config, malleus::testing::parallel_test_model(), world);
    Run result;
    result.ahead_s.assign(size_t(world.size()), 0.0);
    for (int s = 0; s < 4; ++s) {
      const train::StepStats step = trainer.train_step();
      result.training.losses.push_back(step.loss);
      for (size_t r = 0; r < step.recompute_ahead_s.size(); ++r)
        result.ahead_s[r] += step.recompute_ahead_s[r];
    }
    result.training.params = trainer.snapshot().params;
    return result;
  };
  for (size_t i = 0; i < stage_lists.size(); ++i) {
    const Run in_backward = run("backward" + std::to_string(i), stage_lists[i], false);
    const Run shifted = run("shifted" + std::to_string(i), stage_lists[i], true);
    const Run marked = run("marked" + std::to_string(i), stage_lists[i], false, true);
    if (world.rank() != 0) continue;
    EXPECT_EQ(shifted.training.losses, in_backward.training.losses) << stage_lists[i];
    EXPECT_EQ(shifted.training.params, in_backward.training.params) << stage_lists[i];
    EXPECT_EQ(marked.training.losses, in_backward.training.losses) << stage_lists[i];
    EXPECT_EQ(marked.training.params, in_backward.training.params) << stage_lists[i];
    // Only stages before the last that recompute do it ahead; nothing without the option.
    const plan::Plan plan =
        plan::Plan::from_json(read_json_file(dir / ("shifted" + std::to_string(i) + ".json")),
                              malleus::testing::parallel_test_model(), "plan");
    const auto& stages = plan.pipelines[0].stages;
    for (size_t j = 0; j < stages.size(); ++j) {
      for (int r : stages[j].ranks) {
        const bool ahead = j + 1 < stages.size() && stages[j].recompute.layers > 0;
        EXPECT_EQ(shifted.ahead_s[size_t(r)] > 0, ahead) << stage_lists[i] << " rank " << r;
        EXPECT_EQ(marked.ahead_s[size_t(r)] > 0, ahead) << stage_lists[i] << " rank " << r;
        EXPECT_EQ(in_backward.ahead_s[size_t(r)], 0.0) << stage_lists[i] << " rank " << r;
      }
    }
  }
  remove_shared_dir(world, dir);
}

// Sub-pipelined tensor parallelism (each micro-batch as two parts inside a TP block, one part's
// all-reduce in flight while the other computes) trains like whole micro-batches: split along
// token rows (micro-batch of one sequence) and along sequences (two), with uneven shares, with
// recomputation, and on tp2 x pp2. Within the runtime tests' tolerance: the weight gradients are
// summed part by part, a different fp32 order.
TEST(Runtime, SubpipelinedTensorParallelismTrainsLikeWholeMicroBatches) {
  Communicator world = Communicator::world();
  if (world.size() != 2 && world.size() != 4) GTEST_SKIP() << "plans for 2 and 4 ranks";
  const fs::path dir = shared_dir(world);
  struct Case {
    int micro_batch;
    std::string stages;
  };
  std::vector<Case> cases;
  if (world.size() == 2) {
    const std::string uneven = R"("heads": [6, 2], "ffn": [30, 18], "vocab": [200, 57])";
    cases = {
        {1, R"({"layers": [0, 4], "ranks": [0, 1], )" + uneven + "}"},
        {2, R"({"layers": [0, 4], "ranks": [0, 1], )" + uneven + "}"},
        {1, R"({"layers": [0, 4], "ranks": [1, 0], "recompute": "full", "recompute_layers": 2})"},
        {2, R"({"layers": [0, 4], "ranks": [0, 1], "recompute": "selective"})"}};
  } else {
    cases = {
        {1, R"({"layers": [0, 2], "ranks": [0, 1], "recompute": "full"},
                   {"layers": [2, 4], "ranks": [2, 3], "heads": [2, 6], "ffn": [20, 28], "vocab": [100, 157]})"},
        {2,
         R"({"layers": [0, 3], "ranks": [2, 3]}, {"layers": [3, 4], "ranks": [1, 0], "recompute": "selective"})"}};
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    auto run = [&](bool subpipelined) {
      train::TrainConfig config = base_config(dir);
      config.micro_batch_size = cases[i].micro_batch;
      config.tp_subpipeline = subpipelined;
      const std::string name = "subpipeline" + std::to_string(i) + (subpipelined ? "on" : "off");
      const std::string text = one_pipeline_plan(world.size(), cases[i].micro_batch,
                                                 8 / cases[i].micro_batch, cases[i].stages);
      config.plan = share_plan(world, dir, name, text);
      train::Trainer trainer(config, malleus::testing::parallel_test_model(), world);
      TrainingRun result = train_steps(trainer, 5);
      // The split path ran (nonblocking sums) exactly when asked for.
      const auto* tp = trainer.engine().state().tensor_parallel();
      if (tp != nullptr) {
        if (subpipelined) {
          EXPECT_GT(tp->started_sums(), 0) << cases[i].stages;
        } else {
          EXPECT_EQ(tp->started_sums(), 0) << cases[i].stages;
        }
      }
      return result;
    };
    const TrainingRun whole = run(false);
    const TrainingRun parts = run(true);
    if (world.rank() == 0) {
      expect_matches(
          parts, whole,
          "mb" + std::to_string(cases[i].micro_batch) + " " + cases[i].stages.substr(0, 40));
      // A measurement, not a requirement: the first step's loss is the forward alone, so it
      // shows whether splitting the GEMMs' rows changed the forward's rounding (BLAS kernels).
      std::printf("  first-step loss %s\n", parts.losses.front() == whole.losses.front()
                                                ? "bit-identical"
                                                : "differs in the low bits");
    }
  }
  remove_shared_dir(world, dir);
}

// Memory truth: the cost model's per-rank prediction (one formula, parameterised by the plan's
// recomputation) against what each rank's runtime allocated at its peak during a step, kind by
// kind (backend::memory_ledger, as metrics.jsonl records it). Within 10 % of the total for every
// rank of every plan; activations, parameters, gradients and optimizer state kind by kind.
TEST(Runtime, PredictedMemoryMatchesWhatEachRankAllocates) {
  Communicator world = Communicator::world();
  if (world.size() != 2 && world.size() != 4) GTEST_SKIP() << "plans for 2 and 4 ranks";
  const fs::path dir = shared_dir(world);
  train::TrainConfig base = base_config(dir);
  base.micro_batch_size = 2;
  std::vector<std::string> plans;
  if (world.size() == 2) {
    plans = {
        R"({"world_size": 2, "micro_batch_size": 2, "pipelines": [{"micro_batches": 4, "stages": [
               {"layers": [0, 3], "ranks": [0]}, {"layers": [3, 4], "ranks": [1]}]}]})",
        R"({"world_size": 2, "micro_batch_size": 2, "pipelines": [{"micro_batches": 4, "stages": [
               {"layers": [0, 3], "ranks": [0], "recompute": "selective"},
               {"layers": [3, 4], "ranks": [1], "recompute": "full"}]}]})",
        R"({"world_size": 2, "micro_batch_size": 2, "pipelines": [{"micro_batches": 4, "stages": [
               {"layers": [0, 2], "ranks": [1], "recompute": "full", "recompute_layers": 1},
               {"layers": [2, 4], "ranks": [0]}]}]})",
        R"({"world_size": 2, "micro_batch_size": 2, "pipelines": [
               {"micro_batches": 3, "stages": [{"layers": [0, 4], "ranks": [0], "recompute": "selective"}]},
               {"micro_batches": 1, "stages": [{"layers": [0, 4], "ranks": [1]}]}]})",
        // Rank 0 idle: it holds its probe (CostModel::idle_memory).
        R"({"world_size": 2, "micro_batch_size": 2, "pipelines": [{"micro_batches": 4, "stages": [
               {"layers": [0, 4], "ranks": [1]}]}]})"};
  } else {
    plans = {
        R"({"world_size": 4, "micro_batch_size": 2, "pipelines": [{"micro_batches": 4, "stages": [
               {"layers": [0, 2], "ranks": [0, 1]}, {"layers": [2, 4], "ranks": [2, 3]}]}]})",
        R"({"world_size": 4, "micro_batch_size": 2, "pipelines": [{"micro_batches": 4, "stages": [
               {"layers": [0, 1], "ranks": [0], "recompute": "full"},
               {"layers": [1, 2], "ranks": [1], "recompute": "selective"},
               {"layers": [2, 3], "ranks": [2]}, {"layers": [3, 4], "ranks": [3]}]}]})",
        R"({"world_size": 4, "micro_batch_size": 2, "pipelines": [
               {"micro_batches": 3, "stages": [{"layers": [0, 2], "ranks": [0, 1], "heads": [6, 2],
                  "ffn": [30, 18], "vocab": [200, 57], "recompute": "selective"},
                  {"layers": [2, 4], "ranks": [2]}]},
               {"micro_batches": 1, "stages": [{"layers": [0, 4], "ranks": [3]}]}]})",
        // Ranks 0 and 2 idle: on the multi-host bed (2 x 2) the hosts' leaders, which still
        // exchange the link probe.
        R"({"world_size": 4, "micro_batch_size": 2, "pipelines": [{"micro_batches": 4, "stages": [
               {"layers": [0, 2], "ranks": [1]}, {"layers": [2, 4], "ranks": [3]}]}]})"};
  }
  const auto model = malleus::testing::parallel_test_model();
  plan::ClusterSpec cluster = plan::load_cluster("cpu-local");
  // The nodes the job runs on (on the multi-host test bed ranks also hold the link probe).
  const std::vector<int> hosts = runtime::host_indices(world);
  cluster.nodes = *std::max_element(hosts.begin(), hosts.end()) + 1;
  cluster.devices_per_node = world.size() / cluster.nodes;
  plan::CostModel cost(
      model, cluster,
      plan::BatchConfig{base.global_batch_size, base.micro_batch_size, base.seq_len});
  // Every plan with the recomputation inside the backward, then the recomputing ones again under
  // the shifted schedule (a scratch per recomputing layer on stages before the last).
  const size_t plain_plans = plans.size();
  for (size_t i = 1; i < plain_plans; ++i) plans.push_back(plans[i]);
  for (size_t i = 0; i < plans.size(); ++i) {
    train::TrainConfig config = base;
    config.shifted_recompute = i >= plain_plans;
    cost.set_shifted_recompute(config.shifted_recompute);
    const std::string name = "memory" + std::to_string(i);
    config.plan = share_plan(world, dir, name, plans[i]);
    train::Trainer trainer(config, model, world);
    trainer.train_step();
    const train::StepStats step = trainer.train_step();
    if (world.rank() != 0) continue;
    const plan::Plan plan = plan::Plan::from_json(Json::parse(plans[i]), model, name);
    const auto predicted = cost.memory_by_kind(plan);
    for (int r = 0; r < world.size(); ++r) {
      const auto& p = predicted[size_t(r)];
      const double measured = step.peak_memory_bytes[size_t(r)];
      std::printf("  plan %zu rank %d: predicted %.0f, measured %.0f bytes (%+.1f%%)\n", i, r,
                  p.total(), measured, 100 * (p.total() / measured - 1));
      EXPECT_NEAR(p.total(), measured, 0.10 * measured) << name << " rank " << r;
      const std::pair<double, double> kinds[] = {
          {p.parameters, step.peak_parameters_bytes[size_t(r)]},
          {p.gradients, step.peak_gradients_bytes[size_t(r)]},
          {p.optimizer, step.peak_optimizer_bytes[size_t(r)]},
          {p.activations, step.peak_activations_bytes[size_t(r)]},
          {p.workspace, step.peak_workspace_bytes[size_t(r)]}};
      for (const auto& [predicted_kind, measured_kind] : kinds) {
        EXPECT_NEAR(predicted_kind, measured_kind, 0.02 * measured_kind + 64) << name << " " << r;
      }
    }
  }
  remove_shared_dir(world, dir);
}

// Stage-aware recomputation (Merak): on a cluster whose memory the plain pp2 plan exceeds on its
// first stage (two micro-batches in flight), the planner makes the plan fit by recomputing where
// memory requires it, writes that into the plan, and the plan runs: with each rank's measured
// peak under the budget and the losses of the plain run.
TEST(Runtime, StageAwareRecomputationMakesAnInfeasiblePlanFitAndRun) {
  Communicator world = Communicator::world();
  if (world.size() != 2) GTEST_SKIP() << "a pp2 plan on 2 ranks";
  const fs::path dir = shared_dir(world);
  train::TrainConfig base = base_config(dir);
  base.micro_batch_size = 2;
  const auto model = malleus::testing::parallel_test_model();
  plan::ClusterSpec cluster = plan::load_cluster("cpu-local");
  cluster.devices_per_node = 2;
  cluster.usable_memory_fraction = 1;
  const plan::BatchConfig batch{base.global_batch_size, base.micro_batch_size, base.seq_len};
  const plan::Plan plain =
      plan::uniform_plan(model, 1, 1, 2, batch.global_batch, batch.micro_batch);
  plan::Plan full = plain;
  for (auto& s : full.pipelines[0].stages)
    s.recompute = {model::RecomputeMode::kFull, s.num_layers()};
  auto fullest = [&](const plan::Plan& p) {
    double most = 0;
    for (const auto& use : plan::CostModel(model, cluster, batch).memory_by_kind(p)) {
      most = std::max(most, use.total());
    }
    return most;
  };
  // Halfway between what the plain and the fully recomputing plan need.
  cluster.memory_bytes = 0.5 * (fullest(plain) + fullest(full));
  const plan::CostModel cost(model, cluster, batch);
  EXPECT_FALSE(cost.predict(plain, {}, /*choose_recompute=*/false).fits);

  plan::PlanRequest request;
  request.base = plan::Shape{1, 1, 2};
  const plan::PlanResult planned = plan::make_strategy("uniform")->plan(cost, request);
  ASSERT_TRUE(planned.prediction.fits) << planned.prediction.problem;
  const auto& stages = planned.plan.pipelines.at(0).stages;
  ASSERT_EQ(stages.size(), 2u);
  // A stage recomputes exactly when it does not fit without; the plan as written fits as it is,
  // and is faster than recomputing everything.
  const auto plain_memory = cost.memory_by_kind(plain);
  int recomputing = 0;
  for (size_t j = 0; j < stages.size(); ++j) {
    const bool fits_plain =
        plain_memory[size_t(stages[j].ranks[0])].total() <= cluster.memory_bytes;
    EXPECT_EQ(stages[j].recompute.mode == model::RecomputeMode::kNone, fits_plain) << j;
    recomputing += fits_plain ? 0 : 1;
  }
  EXPECT_GE(recomputing, 1);
  EXPECT_TRUE(cost.predict(planned.plan, {}, false).fits);
  EXPECT_LT(planned.prediction.iteration_time, cost.predict(full, {}, false).iteration_time);
  if (world.rank() == 0) {
    std::printf("  budget %.0f bytes: stage 0 %s %d layers, stage 1 %s %d layers\n",
                cluster.memory_bytes, model::recompute_mode_name(stages[0].recompute.mode),
                stages[0].recompute.layers, model::recompute_mode_name(stages[1].recompute.mode),
                stages[1].recompute.layers);
  }

  auto run = [&](const std::string& name, const plan::Plan& p, double* peak) {
    train::TrainConfig config = base;
    config.plan = share_plan(world, dir, name, p.to_json().dump());
    train::Trainer trainer(config, model, world);
    TrainingRun result;
    for (int s = 0; s < 3; ++s) {
      const train::StepStats step = trainer.train_step();
      result.losses.push_back(step.loss);
      for (double bytes : step.peak_memory_bytes) *peak = std::max(*peak, bytes);
    }
    return result;
  };
  double plain_peak = 0, planned_peak = 0;
  const TrainingRun plain_run = run("plain", plain, &plain_peak);
  const TrainingRun planned_run = run("stage-aware", planned.plan, &planned_peak);
  if (world.rank() == 0) {
    EXPECT_EQ(planned_run.losses, plain_run.losses);
    EXPECT_GT(plain_peak, cluster.memory_bytes);
    EXPECT_LE(planned_peak, cluster.memory_bytes);
    std::printf("  measured peak: plain %.0f, stage-aware %.0f bytes\n", plain_peak, planned_peak);
  }
  remove_shared_dir(world, dir);
}

TEST(Runtime, BadPlanIsRefusedOnEveryRankBeforeWork) {
  Communicator world = Communicator::world();
  const fs::path dir = shared_dir(world);
  train::TrainConfig config = base_config(dir);
  config.plan = share_plan(world, dir, "bad", R"({"world_size": 1000, "pipelines": [
      {"micro_batches": 8, "stages": [{"layers": [0, 4], "ranks": [0]}]}]})");
  try {
    train::Trainer trainer(config, malleus::testing::parallel_test_model(), world);
    ADD_FAILURE() << "a plan for 1000 ranks was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the plan is for 1000 ranks"), std::string::npos)
        << e.what();
  }
  remove_shared_dir(world, dir);
}

TEST(Runtime, RanksThatOutnumberTheirCoresAreBoundAndTakeTurns) {
  // mpirun --oversubscribe leaves ranks unbound: every rank may run on all the CPUs. When they
  // outnumber the CPUs they may use, detection binds each to one CPU (unless an earlier
  // detection in this process did) and gives every rank a lease; otherwise no rank gets one.
  Communicator world = Communicator::world();
  cpu_set_t before;
  ASSERT_EQ(sched_getaffinity(0, sizeof before, &before), 0);
  std::vector<double> used(64, 0.0);  // which CPUs some rank may use (tests run on one host)
  for (int c = 0; c < 64; ++c) used[static_cast<size_t>(c)] = CPU_ISSET(c, &before) ? 1 : 0;
  world.all_reduce_max(used.data(), used.size());
  const int cpus = static_cast<int>(std::count(used.begin(), used.end(), 1.0));
  const runtime::CoreSharing sharing = runtime::CoreSharing::detect(world, 1);
  ASSERT_EQ(sharing.pids.size(), static_cast<size_t>(world.size()));
  EXPECT_EQ(sharing.pids[static_cast<size_t>(world.rank())], ::getpid());
  if (world.size() <= cpus) {
    EXPECT_EQ(sharing.lease, nullptr) << sharing.summary;
    GTEST_SKIP() << "ranks do not outnumber their CPUs here: " << sharing.summary;
  }
  cpu_set_t after;
  ASSERT_EQ(sched_getaffinity(0, sizeof after, &after), 0);
  EXPECT_EQ(CPU_COUNT(&after), 1);
  EXPECT_NE(sharing.summary.find("take turns"), std::string::npos) << sharing.summary;
  ASSERT_NE(sharing.lease, nullptr);
  runtime::CoreLease& lease = *sharing.lease;
  {
    runtime::CoreLease::Hold turn(&lease);
    EXPECT_TRUE(lease.held());
    {
      runtime::CoreLease::Gap wait(&lease);
      EXPECT_FALSE(lease.held());
    }
    EXPECT_TRUE(lease.held());
  }
  EXPECT_FALSE(lease.held());
  // Collectives through the lease match across ranks, with and without a turn held.
  double value = 1;
  runtime::all_reduce_sum(world, &value, 1, &lease);
  EXPECT_EQ(value, world.size());
  {
    runtime::CoreLease::Hold turn(&lease);
    value = 1;
    runtime::all_reduce_sum(world, &value, 1, &lease);
    EXPECT_EQ(value, world.size());
  }
}

// The step's one all-reduce: each rank fills only its own figures, and after the sum every rank
// reads every rank's figures back exactly, with the loss and squared norm summed.
TEST(Runtime, StepExchangeHandsEveryRankEveryRanksFigures) {
  Communicator world = Communicator::world();
  const size_t ranks = static_cast<size_t>(world.size()), me = static_cast<size_t>(world.rank());
  // Rank r's figure number f: distinct for every rank and field, exact in a double.
  auto figure = [](size_t r, int f) { return 1000.0 * double(r + 1) + f + 0.25; };
  runtime::StepExchange exchange(ranks);
  exchange.loss_sum = double(me + 1);
  exchange.norm_squares = 0.5 * double(me + 1);
  runtime::StepExchange::RankFigures& mine = exchange.ranks[me];
  mine.compute_seconds = figure(me, 0);
  mine.flops = figure(me, 1);
  mine.link_seconds = figure(me, 2);
  mine.link_bytes = figure(me, 3);
  for (size_t k = 0; k < mine.peak_memory.bytes.size(); ++k) {
    mine.peak_memory.bytes[k] = (int64_t{1} << 40) + int64_t(1000 * (me + 1) + k);
  }
  mine.peak_memory_total = figure(me, 4);
  mine.recompute_ahead_seconds = figure(me, 5);
  mine.recompute_overlapped_seconds = figure(me, 6);
  std::vector<double> packed = exchange.pack();
  ASSERT_EQ(packed.size(), 2 + ranks * runtime::StepExchange::kRankFields);
  // The wire order: loss, squared norm, then every rank's compute time and FLOPs.
  EXPECT_EQ(packed[0], double(me + 1));
  EXPECT_EQ(packed[2 + 2 * me], figure(me, 0));
  EXPECT_EQ(packed[3 + 2 * me], figure(me, 1));
  runtime::all_reduce_sum(world, packed.data(), packed.size(), nullptr);
  runtime::StepExchange all(ranks);
  all.unpack(packed);
  EXPECT_EQ(all.loss_sum, double(ranks * (ranks + 1) / 2));
  EXPECT_EQ(all.norm_squares, 0.25 * double(ranks * (ranks + 1)));
  for (size_t r = 0; r < ranks; ++r) {
    const runtime::StepExchange::RankFigures& theirs = all.ranks[r];
    EXPECT_EQ(theirs.compute_seconds, figure(r, 0));
    EXPECT_EQ(theirs.flops, figure(r, 1));
    EXPECT_EQ(theirs.link_seconds, figure(r, 2));
    EXPECT_EQ(theirs.link_bytes, figure(r, 3));
    for (size_t k = 0; k < theirs.peak_memory.bytes.size(); ++k) {
      EXPECT_EQ(theirs.peak_memory.bytes[k], (int64_t{1} << 40) + int64_t(1000 * (r + 1) + k));
    }
    EXPECT_EQ(theirs.peak_memory_total, figure(r, 4));
    EXPECT_EQ(theirs.recompute_ahead_seconds, figure(r, 5));
    EXPECT_EQ(theirs.recompute_overlapped_seconds, figure(r, 6));
  }
  packed.pop_back();
  EXPECT_THROW(all.unpack(packed), Error);
}
