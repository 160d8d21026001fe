// What a run leaves on disk when things go wrong: a full disk during a save or a metrics line
// (the right error, no half-written file or line), a torn metrics line from a crash, a run
// directory wanted by two runs. The full-disk tests mount a small tmpfs (root only) and skip,
// saying why, where mounting is not allowed.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/files.h"
#include "common/json.h"
#include "model/parameters.h"
#include "test_util.h"
#include "checkpoint/checkpoint.h"
#include "metrics/metrics.h"
#include "train/run_directory.h"

using namespace malleus;
using malleus::testing::error_of;
using malleus::testing::ScratchDir;
using malleus::testing::SmallFilesystem;

namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

checkpoint::Checkpoint tiny_checkpoint(bool with_optimizer) {
  checkpoint::Checkpoint c;
  c.model = model::load_model_config("tiny");
  const auto size = static_cast<size_t>(model::ParameterLayout(c.model).total_size());
  c.train_config = Json{{"note", "test"}};
  c.step = 3;
  c.params.assign(size, 0.5f);
  if (with_optimizer) {
    c.adam_m.assign(size, 0.25f);
    c.adam_v.assign(size, 0.125f);
  }
  return c;
}

// Every line of a metrics file is a whole JSON object (what `malleus report` needs).
void expect_whole_lines(const fs::path& path, size_t expected_lines) {
  const std::string text = read_file(path);
  ASSERT_TRUE(text.empty() || text.back() == '\n') << "torn last line: " << text;
  std::istringstream lines(text);
  size_t count = 0;
  for (std::string line; std::getline(lines, line); ++count) {
    EXPECT_NO_THROW(parse_json(line, "metrics")) << line;
  }
  EXPECT_EQ(count, expected_lines);
}

}  // namespace

TEST(FullDisk, AtomicFileReportsNoSpaceAndLeavesNothing) {
  ScratchDir dir;
  SmallFilesystem small(dir / "mnt", 64 * 1024);
  MALLEUS_REQUIRE_SMALL_FILESYSTEM(small);
  write_file_atomic(small / "kept.txt", "previous contents");
  const std::string message =
      error_of([&] { write_file_atomic(small / "kept.txt", std::string(1 << 20, 'x')); });
  // It used to say "No such file or directory", from a stale errno.
  EXPECT_TRUE(contains(message, "No space left on device")) << message;
  EXPECT_TRUE(contains(message, "kept.txt")) << message;
  EXPECT_EQ(read_file(small / "kept.txt"), "previous contents");
  EXPECT_EQ(entries(small / ""), std::vector<std::string>{"kept.txt"});
}

TEST(FullDisk, CheckpointSaveReportsNoSpaceAndKeepsTheOldOne) {
  ScratchDir dir;
  // Room for parameters only (the tiny model's 35k floats, 140 KB), not for the Adam moments too.
  SmallFilesystem small(dir / "mnt", 256 * 1024);
  MALLEUS_REQUIRE_SMALL_FILESYSTEM(small);
  checkpoint::save_checkpoint(small / "step_00000002", tiny_checkpoint(false));
  const std::string message =
      error_of([&] { checkpoint::save_checkpoint(small / "step_00000003", tiny_checkpoint(true)); });
  EXPECT_TRUE(contains(message, "No space left on device")) << message;
  EXPECT_EQ(entries(small / ""), std::vector<std::string>{"step_00000002"});
  EXPECT_EQ(checkpoint::load_checkpoint(small / "step_00000002", false).step, 3);
}

TEST(FullDisk, MetricsLinesAreWholeOrAbsent) {
  ScratchDir dir;
  SmallFilesystem small(dir / "mnt", 16 * 1024);
  MALLEUS_REQUIRE_SMALL_FILESYSTEM(small);
  const fs::path path = small / "metrics.jsonl";
  metrics::StepRecord record;
  record.step = 1;
  record.plan = std::string(300, 'x');
  size_t written = 0;
  std::string message;
  {
    metrics::MetricsLog log(path);
    for (; written < 1000 && message.empty(); ++written) {
      message = error_of([&] { log.write(record); });
    }
    --written;  // the last attempt failed
  }
  EXPECT_TRUE(contains(message, "No space left on device")) << message;
  EXPECT_TRUE(contains(message, "metrics.jsonl")) << message;
  EXPECT_GT(written, 10u);
  expect_whole_lines(path, written);
  // With room again, a later run appends after the whole lines.
  fs::resize_file(path, 0);
  {
    metrics::MetricsLog log(path);
    log.write(record);
  }
  expect_whole_lines(path, 1);
}

TEST(Metrics, TornLastLineIsRemovedWithAWarning) {
  ScratchDir dir;
  const fs::path path = dir / "metrics.jsonl";
  write_file_atomic(path, "{\"step\": 1}\n{\"step\": 2}\n{\"step\": 3, \"lo");
  ::testing::internal::CaptureStderr();
  {
    metrics::MetricsLog log(path);
    log.write(metrics::EvalRecord{3, 1.5});
  }
  const std::string warning = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(
      contains(warning, "warning: " + path.string() + " ended in an incomplete line (15 bytes"))
      << warning;
  EXPECT_EQ(read_file(path), "{\"step\": 1}\n{\"step\": 2}\n{\"step\":3,\"val_loss\":1.5}\n");
  // A file that is nothing but a torn line becomes empty; a whole file is left alone.
  write_file_atomic(path, "{\"st");
  { metrics::MetricsLog log(path); }
  EXPECT_EQ(read_file(path), "");
  write_file_atomic(path, "{}\n");
  ::testing::internal::CaptureStderr();
  { metrics::MetricsLog log(path); }
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(read_file(path), "{}\n");
}

TEST(RunDirectory, OneRunAtATime) {
  ScratchDir dir;
  const fs::path run = dir / "run";
  std::optional<train::RunDirectory> first(std::in_place, run, std::nullopt);
  // flock locks belong to open files, so a second open in this process conflicts too.
  std::string message = error_of([&] { train::RunDirectory second(run, std::nullopt); });
  EXPECT_TRUE(contains(
      message, "run directory " + run.string() + " is in use by pid " + std::to_string(::getpid())))
      << message;
  message = error_of([&] { train::RunDirectory second(run, run); });
  EXPECT_TRUE(contains(message, "is in use")) << message;
  first.reset();
  // Released: the same run may go on (it holds only the lock file so far).
  EXPECT_EQ(error_of([&] { train::RunDirectory again(run, std::nullopt); }), "");
}

TEST(RunDirectory, AnotherRunsFilesAreRefusedUnlessResumingThem) {
  ScratchDir dir;
  const fs::path run = dir / "run";
  fs::create_directories(run / "checkpoints");
  write_file_atomic(run / "metrics.jsonl", "{}\n");
  std::string message = error_of([&] { train::RunDirectory fresh(run, std::nullopt); });
  EXPECT_TRUE(contains(message, "run directory " + run.string() + " already holds a run"))
      << message;
  EXPECT_TRUE(contains(message, "checkpoints")) << message;
  EXPECT_TRUE(contains(message, "metrics.jsonl")) << message;
  // Resuming another run into it is refused as well; resuming this run is not.
  message = error_of([&] { train::RunDirectory other(run, dir / "elsewhere"); });
  EXPECT_TRUE(contains(message, "already holds a run")) << message;
  EXPECT_EQ(error_of([&] { train::RunDirectory same(run, dir / "." / "run"); }), "");
  EXPECT_EQ(read_file(run / "metrics.jsonl"), "{}\n");
}
