#include "train/resume.h"

#include <cstdio>

#include "checkpoint/memory_checkpoint.h"
#include "common/error.h"

namespace malleus::train {

namespace fs = std::filesystem;

std::optional<fs::path> usable_memory_checkpoint(const fs::path& run_dir, int64_t disk_step,
                                                 std::string* refused) {
  const std::optional<fs::path> memory = checkpoint::latest_memory_checkpoint(run_dir);
  if (!memory) return std::nullopt;
  try {
    const checkpoint::CheckpointIndex index(*memory);
    check(index.sharded(), "checkpoint " + memory->string() + ": not a sharded checkpoint");
    if (index.header().step <= disk_step) {
      *refused = "memory checkpoint " + memory->string() + " is of step " +
                 std::to_string(index.header().step) + ", not later than the disk's " +
                 std::to_string(disk_step);
      return std::nullopt;
    }
    index.check_files();
  } catch (const Error& e) {
    *refused = e.what();
    return std::nullopt;
  }
  return memory;
}

int64_t checkpoint_dir_step(const fs::path& dir) {
  const std::string name = dir.filename().string();
  if (name.size() <= 5 || name.rfind("step_", 0) != 0) return 0;
  if (name.find_first_not_of("0123456789", 5) != std::string::npos) return 0;
  return std::stoll(name.substr(5));
}

std::optional<int64_t> restart_step(const fs::path& run_dir) {
  std::optional<int64_t> step;
  if (auto latest = checkpoint::latest_checkpoint(run_dir / "checkpoints")) {
    step = checkpoint_dir_step(*latest);
  }
  std::string refused;
  if (auto memory = usable_memory_checkpoint(run_dir, step.value_or(-1), &refused)) {
    step = checkpoint_dir_step(*memory);
  }
  return step;
}

namespace {

// Rank 0's choice of a memory copy for `point` (its path, or ""), and why one was refused.
std::string choose_memory(const ResumePoint& point, const fs::path& given,
                          comm::Communicator& world) {
  std::string chosen, refused;
  std::error_code ec;
  const bool names_run = !fs::exists(given / "manifest.json", ec) && point.run_dir;
  if (world.rank() == 0 && names_run) {
    const int64_t disk_step = point.disk ? checkpoint_dir_step(*point.disk) : -1;
    if (auto memory = usable_memory_checkpoint(*point.run_dir, disk_step, &refused)) {
      chosen = memory->string();
    } else if (!refused.empty()) {
      std::printf("not resuming from memory: %s\n", refused.c_str());
    }
  }
  return world.size() > 1 ? world.broadcast_text(chosen, 0) : chosen;
}

}  // namespace

ResumePoint find_resume_point(const fs::path& given, comm::Communicator& world) {
  ResumePoint point;
  std::string no_disk;
  try {
    const checkpoint::CheckpointSource source = checkpoint::locate_checkpoint(given);
    point.disk = source.checkpoint;
    point.run_dir = source.run_dir;
  } catch (const Error& e) {
    // No checkpoint on disk yet: a run directory may still have a memory copy.
    no_disk = e.what();
    std::error_code ec;
    if (fs::is_directory(given, ec)) point.run_dir = given;
  }
  if (const std::string chosen = choose_memory(point, given, world); !chosen.empty()) {
    try {
      point.checkpoint = load_checkpoint_on_root(chosen, world);
      point.memory = fs::path(chosen);
      return point;
    } catch (const Error& e) {
      if (world.rank() == 0) std::printf("not resuming from memory: %s\n", e.what());
    }
  }
  check(point.disk.has_value(), no_disk);
  point.checkpoint = load_checkpoint_on_root(*point.disk, world);
  return point;
}

void restore_resume_point(Trainer& trainer, ResumePoint& point, comm::Communicator& world) {
  if (!point.memory) {
    trainer.restore(point.checkpoint);
    return;
  }
  try {
    trainer.restore(point.checkpoint);
    return;
  } catch (const Error& e) {
    // Every rank has the same error (restore agrees on it).
    if (!point.disk) throw;
    if (world.rank() == 0) {
      std::printf("memory checkpoint refused: %s; resuming from %s instead\n", e.what(),
                  point.disk->c_str());
      std::fflush(stdout);
    }
  }
  point.memory.reset();
  point.checkpoint = load_checkpoint_on_root(*point.disk, world);
  trainer.restore(point.checkpoint);
}

}  // namespace malleus::train
