// Training behaviour on one rank (the runtime with the 1-rank plan): the loss falls, resume is
// bit-exact, the gradient does not depend on how the global batch is cut into micro-batches, and
// the run leaves metrics and checkpoints behind.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_writer.h"
#include "comm/communicator.h"
#include "layout/layout.h"
#include "test_util.h"
#include "train/schedule.h"
#include "train/trainer.h"
#include "train_config_samples.h"

using namespace malleus;
using malleus::testing::ScratchDir;
namespace fs = std::filesystem;

namespace {

train::TrainConfig tiny_run(const ScratchDir& dir) {
  malleus::testing::write_synthetic_corpus(dir / "data");
  train::TrainConfig c = malleus::testing::synthetic_corpus_config(dir.path(), "tiny");
  c.val_data = (dir / "data" / "val_*.bin").string();
  c.seq_len = 32;
  c.micro_batch_size = 4;
  c.global_batch_size = 8;
  c.steps = 60;
  c.lr = 1e-2f;
  c.warmup_steps = 5;
  c.eval_every = 0;
  c.eval_samples = 16;
  c.checkpoint_every = 0;
  c.threads = 2;
  return c;
}

std::vector<float> host_params(train::Trainer& t) {
  return t.snapshot().params;
}

// The single rank of this test process.
comm::Communicator world() {
  return comm::Communicator::world();
}

}  // namespace

TEST(Training, LossFallsClearly) {
  ScratchDir dir;
  const auto config = tiny_run(dir);
  train::Trainer trainer(config, model::load_model_config(config.model), world());
  const double initial_val = trainer.evaluate(config.val_data, 16);
  EXPECT_NEAR(initial_val, std::log(257.0), 0.3);  // an untrained model guesses uniformly
  double first = 0, last = 0;
  for (int s = 0; s < config.steps; ++s) {
    const double loss = trainer.train_step().loss;
    if (s == 0) first = loss;
    last = loss;
  }
  const double final_val = trainer.evaluate(config.val_data, 16);
  EXPECT_LT(last, 0.5 * first) << "first " << first << " last " << last;
  EXPECT_LT(final_val, 0.5 * initial_val) << "val " << initial_val << " -> " << final_val;
}

TEST(Training, ResumeIsBitExact) {
  ScratchDir dir;
  auto config = tiny_run(dir);
  config.steps = 10;
  const auto model = model::load_model_config(config.model);

  train::Trainer straight(config, model, world());
  std::vector<double> straight_losses;
  for (int s = 0; s < 10; ++s) {
    straight_losses.push_back(straight.train_step().loss);
    if (s == 4) checkpoint::save_checkpoint(dir / "ckpt5", straight.snapshot());
  }

  train::Trainer resumed(config, model, world());
  resumed.restore(checkpoint::load_checkpoint(dir / "ckpt5"));
  EXPECT_EQ(resumed.step(), 5);
  EXPECT_EQ(resumed.consumed_samples(), 5 * config.global_batch_size);
  for (int s = 5; s < 10; ++s) {
    const double loss = resumed.train_step().loss;
    EXPECT_EQ(loss, straight_losses[static_cast<size_t>(s)]) << "step " << s + 1;
  }
  EXPECT_EQ(host_params(resumed), host_params(straight));
  const auto a = straight.snapshot(), b = resumed.snapshot();
  EXPECT_EQ(a.adam_m, b.adam_m);
  EXPECT_EQ(a.adam_v, b.adam_v);
}

// An asynchronous save copies the state in the background during the next step (CheckFreq): the
// step's update waits for the copy, so the checkpoint holds exactly the state of its own step.
TEST(Training, AsynchronousCheckpointHoldsTheStateOfItsStep) {
  ScratchDir dir;
  auto config = tiny_run(dir);
  config.steps = 7;
  config.checkpoint_every = 5;
  ASSERT_TRUE(config.async_checkpoints);
  const auto model = model::load_model_config(config.model);
  train::Trainer straight(config, model, world());
  for (int s = 0; s < 5; ++s) straight.train_step();
  const checkpoint::Checkpoint at5 = straight.snapshot();

  train::Trainer run(config, model, world());
  run.run();  // saves at step 5 (copied while step 6 runs) and at step 7
  const checkpoint::Checkpoint saved =
      checkpoint::load_checkpoint(dir / "run" / "checkpoints" / "step_00000005");
  EXPECT_EQ(saved.step, 5);
  EXPECT_EQ(saved.params, at5.params);
  EXPECT_EQ(saved.adam_m, at5.adam_m);
  EXPECT_EQ(saved.adam_v, at5.adam_v);
}

// The writer's own promise: once wait_for_copy() returns, the buffers may change and the
// checkpoint still holds what they held at begin().
TEST(CheckpointWriter, BackgroundCopyIsTheStateAtBegin) {
  ScratchDir dir;
  const auto model = model::load_model_config("tiny");
  const model::ParameterLayout full(model);
  const auto total = static_cast<size_t>(full.total_size());
  std::vector<float> p(total), m(total), v(total);
  for (size_t i = 0; i < total; ++i) {
    p[i] = static_cast<float>(i);
    m[i] = static_cast<float>(i) * 0.5f;
    v[i] = static_cast<float>(i) * 0.25f;
  }
  const std::vector<float> p0 = p, m0 = m, v0 = v;
  layout::Layout whole;
  whole.shards = {model::ShardSpec::full(model)};
  whole.replica_group = {0};
  const auto refinement = layout::common_refinement(model, {&whole});
  const layout::Blocks blocks = layout::local_blocks(full, full);
  checkpoint::Checkpoint header;
  header.model = model;
  header.train_config = Json::object();
  checkpoint::CheckpointWriter writer(world());
  for (int64_t step = 1; step <= 3; ++step) {
    header.step = step;
    writer.begin(dir / "ckpt", header,
                 checkpoint::saved_state(model, refinement, 0, full, p.data(), &blocks, m.data(),
                                         v.data(), /*moments_split=*/false),
                 /*background=*/true, /*copy_in_background=*/true);
    writer.wait_for_copy();
    EXPECT_FALSE(writer.copying());
    // The next update, while the file is still being written.
    for (size_t i = 0; i < total; ++i) {
      p[i] = -p[i];
      m[i] = -m[i];
      v[i] = -v[i];
    }
    writer.wait();
    ASSERT_TRUE(writer.last().has_value());
    EXPECT_GE(writer.last()->stall_s, 0.0);
    const checkpoint::Checkpoint saved =
        checkpoint::load_checkpoint(checkpoint::checkpoint_dir(dir / "ckpt", step));
    const float sign = step % 2 == 1 ? 1.0f : -1.0f;
    for (size_t i = 0; i < total; ++i) {
      ASSERT_EQ(saved.params[i], sign * p0[i]) << "step " << step << " element " << i;
      ASSERT_EQ(saved.adam_m[i], sign * m0[i]) << "step " << step << " element " << i;
      ASSERT_EQ(saved.adam_v[i], sign * v0[i]) << "step " << step << " element " << i;
    }
  }
}

TEST(Training, MicroBatchSplitDoesNotChangeTheStep) {
  // The same global batch of 8 sequences as 1 × 8 or 4 × 2 micro-batches: per-token loss
  // weighting makes both the gradient of the same mean loss (up to fp32 summation order).
  ScratchDir dir;
  auto config = tiny_run(dir);
  const auto model = model::load_model_config(config.model);
  config.micro_batch_size = 8;
  train::Trainer whole(config, model, world());
  config.micro_batch_size = 2;
  train::Trainer split(config, model, world());
  for (int s = 0; s < 3; ++s) {
    const auto a = whole.train_step(), b = split.train_step();
    EXPECT_NEAR(a.loss, b.loss, 1e-5 * a.loss);
    EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-4 * a.grad_norm);
  }
  const auto pa = host_params(whole), pb = host_params(split);
  double max_diff = 0;
  for (size_t i = 0; i < pa.size(); ++i)
    max_diff = std::max(max_diff, double(std::abs(pa[i] - pb[i])));
  EXPECT_LT(max_diff, 1e-4);
}

TEST(Training, RunWritesMetricsAndCheckpoints) {
  ScratchDir dir;
  auto config = tiny_run(dir);
  config.steps = 4;
  config.checkpoint_every = 2;
  config.eval_every = 2;
  train::Trainer trainer(config, model::load_model_config(config.model), world());
  trainer.run();
  std::ifstream metrics(dir / "run" / "metrics.jsonl");
  int step_lines = 0, eval_lines = 0;
  for (std::string line; std::getline(metrics, line);) {
    const Json j = Json::parse(line);
    if (j.contains("val_loss")) {
      ++eval_lines;
      continue;
    }
    ++step_lines;
    for (const char* key :
         {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "eta_s"}) {
      EXPECT_TRUE(j.contains(key)) << key;
    }
  }
  EXPECT_EQ(step_lines, 4);
  EXPECT_EQ(eval_lines, 2);
  const auto latest = checkpoint::latest_checkpoint(dir / "run" / "checkpoints");
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->filename(), "step_00000004");
  EXPECT_TRUE(fs::exists(dir / "run" / "checkpoints" / "step_00000002" / "manifest.json"));
}

TEST(TrainConfig, DemoFileIsTheBuiltInDefault) {
  const std::string file = std::string(MALLEUS_SOURCE_DIR) + "/configs/train/demo.json";
  const auto from_file = train::TrainConfig::from_json(read_json_file(file), file);
  EXPECT_EQ(from_file.to_json(), train::TrainConfig{}.to_json());
}

TEST(LrSchedule, WarmupThenCosineToTheFloor) {
  const train::LrSchedule s{1.0, 0.1, 10, 110};
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.at(9), 1.0);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_NEAR(s.at(60), 0.55, 0.01);
  EXPECT_DOUBLE_EQ(s.at(109), 0.1);
  for (int64_t i = 11; i < 110; ++i) EXPECT_LE(s.at(i), s.at(i - 1));
}

// The memory check counts what the runtime will hold: with the distributed optimizer a rank of a
// dp2 plan keeps half the Adam moments (and a gradient shard of half the gradients) and its
// checkpoint copy is its optimizer shard's rows, so a plan the whole-moment count (16 bytes per
// element held, 12 per element of the refinement's pieces it owns) refuses may fit; with the
// distributed optimizer off the same plan is refused. (That the counts equal what the engine
// books and a checkpoint writes: Runtime.MemoryCheckCountsWhatTheRuntimeHolds.)
TEST(MemoryCheck, DistributedOptimizerFitsWhatWholeMomentsDoNot) {
  const model::ModelConfig model = malleus::testing::parallel_test_model();
  const plan::Plan plan = plan::Plan::from_json(Json::parse(R"({"world_size": 2, "pipelines": [
      {"micro_batches": 5, "stages": [{"layers": [0, 4], "ranks": [0]}]},
      {"micro_batches": 3, "stages": [{"layers": [0, 4], "ranks": [1]}]}]})"),
                                                model, "dp2");
  const auto whole_model = static_cast<int64_t>(model.num_parameters());
  for (int rank = 0; rank < 2; ++rank) {
    const train::ModelStateBytes split = train::model_state_bytes(model, plan, rank, true);
    const train::ModelStateBytes whole = train::model_state_bytes(model, plan, rank, false);
    EXPECT_TRUE(split.moments_split);
    EXPECT_FALSE(whole.moments_split);
    EXPECT_EQ(split.held_elements, whole_model);
    EXPECT_EQ(whole.held_elements, whole_model);
    // The two ranks' optimizer shards cover the model once, about half each (cut at rows).
    EXPECT_NEAR(double(split.moment_elements), double(whole_model) / 2, 0.05 * double(whole_model));
    EXPECT_EQ(whole.moment_elements, whole_model);
    EXPECT_EQ(split.optimizer, 8 * split.moment_elements);
    EXPECT_EQ(split.gradient_shard, 4 * split.moment_elements);
    EXPECT_EQ(split.checkpoint_copy, 12 * split.moment_elements);
    EXPECT_EQ(whole.gradient_shard, 0);
    // The count before the distributed optimizer was counted: every held element's moments, and
    // the pieces of the common refinement this rank owns in a checkpoint.
    const layout::Layout layout = layout::plan_layout(plan, model);
    const model::ParameterLayout full(model);
    int64_t owned = 0;
    for (const auto& p :
         checkpoint::owned_pieces(layout::common_refinement(model, {&layout}), rank)) {
      owned += layout::piece_elements(full, p.piece);
    }
    const int64_t old_count = 16 * whole.held_elements + 12 * owned;
    EXPECT_EQ(whole.total(), old_count);  // whole moments: what was counted before
    EXPECT_LT(split.total(), old_count);
    // Memory between the two: the plan fits with the distributed optimizer only.
    const int64_t available = (split.total() + old_count) / 2;
    EXPECT_NO_THROW(train::check_model_state_fits(model, plan, rank, true, available, 1));
    try {
      train::check_model_state_fits(model, plan, rank, false, available, 1);
      ADD_FAILURE() << "whole moments fit in " << available << " bytes";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("does not fit"), std::string::npos) << message;
      EXPECT_NE(message.find("rank " + std::to_string(rank)), std::string::npos) << message;
      EXPECT_NE(message.find("parameters, gradients and Adam moments take"), std::string::npos)
          << message;
    }
    // Too little even for the shards: the message names the optimizer shard.
    try {
      train::check_model_state_fits(model, plan, rank, true, split.total() - 1, 1);
      ADD_FAILURE() << "the shards fit in less than they need";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("of its optimizer shard"), std::string::npos) << message;
      EXPECT_NE(message.find("distributed optimizer"), std::string::npos) << message;
    }
    // The share is per rank on the node.
    EXPECT_THROW(train::check_model_state_fits(model, plan, rank, true, split.total(), 2), Error);
    EXPECT_NO_THROW(train::check_model_state_fits(model, plan, rank, true, 2 * split.total(), 2));
  }
  // One pipeline: nothing to split, whether asked or not.
  const plan::Plan single = plan::uniform_plan(model, 1, 1, 1, 8, 1, 1);
  const train::ModelStateBytes one = train::model_state_bytes(model, single, 0, true);
  EXPECT_FALSE(one.moments_split);
  EXPECT_EQ(one.optimizer, 8 * whole_model);
  EXPECT_EQ(one.checkpoint_copy, 12 * whole_model);
  EXPECT_EQ(one.total(), 28 * whole_model);
}

// Memory checkpoints count too: a rank holds two host buffers (its own shard's snapshot, the
// shard it receives) and writes the received shard, and its own where its peer is on another
// host (or it is alone), into host memory, twice over while a save replaces the last.
TEST(MemoryCheck, MemoryCopiesAndTheirBuffersCount) {
  const model::ModelConfig model = malleus::testing::parallel_test_model();
  const auto whole_model = static_cast<int64_t>(model.num_parameters());
  // One rank alone: its own shard (the whole state, 12 bytes a parameter) in a buffer, and twice
  // in host memory.
  const plan::Plan single = plan::uniform_plan(model, 1, 1, 1, 8, 1, 1);
  const int64_t state = train::model_state_bytes(model, single, 0, true).total();
  const int64_t copies = 3 * 12 * whole_model;
  const std::vector<int> one_host{0};
  EXPECT_NO_THROW(train::check_model_state_fits(model, single, 0, true, state, 1));
  EXPECT_NO_THROW(
      train::check_model_state_fits(model, single, 0, true, state + copies, 1, &one_host));
  try {
    train::check_model_state_fits(model, single, 0, true, state + copies - 1, 1, &one_host);
    ADD_FAILURE() << "the memory copies were not counted";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("for memory checkpoints: "), std::string::npos) << message;
    EXPECT_NE(message.find("--no-memory-checkpoints"), std::string::npos) << message;
  }
  // Two ranks on one host, dp2: each receives the other's shard (half the moments' rows each)
  // and holds it in memory; its own copy lives on its peer.
  const plan::Plan dp2 = plan::uniform_plan(model, 2, 1, 1, 8, 1, 2);
  const std::vector<int> host{0, 0};
  for (int rank = 0; rank < 2; ++rank) {
    const train::ModelStateBytes need = train::model_state_bytes(model, dp2, rank, true);
    const int64_t other = train::model_state_bytes(model, dp2, 1 - rank, true).checkpoint_copy;
    const int64_t total = need.total() + need.checkpoint_copy + other + 2 * other;
    EXPECT_NO_THROW(train::check_model_state_fits(model, dp2, rank, true, total, 1, &host));
    EXPECT_THROW(train::check_model_state_fits(model, dp2, rank, true, total - 1, 1, &host), Error);
  }
}
