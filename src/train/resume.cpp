#include "train/resume.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "checkpoint/memory_checkpoint.h"
#include "checkpoint/memory_gather.h"
#include "common/error.h"
#include "runtime/parallel_state.h"

namespace malleus::train {

namespace fs = std::filesystem;

std::optional<fs::path> usable_memory_copy(const fs::path& memory, int64_t disk_step,
                                           std::string* refused) {
  try {
    checkpoint::check_memory_copy_dir(memory);  // never a copy another user could have placed
    const checkpoint::CheckpointIndex index(memory);
    check(index.sharded(), "checkpoint " + memory.string() + ": not a sharded checkpoint");
    if (index.header().step <= disk_step) {
      *refused = "memory checkpoint " + memory.string() + " is of step " +
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

std::optional<fs::path> usable_memory_checkpoint(const fs::path& run_dir, int64_t disk_step,
                                                 std::string* refused) {
  std::optional<fs::path> memory;
  try {
    memory = checkpoint::latest_memory_checkpoint(run_dir);
  } catch (const Error& e) {
    *refused = e.what();  // another user's folder
    return std::nullopt;
  }
  if (!memory) return std::nullopt;
  return usable_memory_copy(*memory, disk_step, refused);
}

std::optional<int64_t> restart_step(const fs::path& run_dir, MemoryHosts hosts) {
  std::optional<int64_t> step;
  if (auto latest = checkpoint::latest_checkpoint(run_dir / "checkpoints")) {
    step = checkpoint::checkpoint_dir_step(*latest).value_or(0);
  }
  std::optional<fs::path> memory;
  if (hosts == MemoryHosts::kSeveral) {
    try {
      memory = checkpoint::latest_memory_checkpoint(run_dir);
    } catch (const Error&) {
      // another user's folder: not the run's copies (the restarted job says so)
    }
  } else {
    std::string refused;
    memory = usable_memory_checkpoint(run_dir, step.value_or(-1), &refused);
  }
  if (memory) {
    step = std::max(step.value_or(-1), checkpoint::checkpoint_dir_step(*memory).value_or(0));
  }
  return step;
}

namespace {

// Collective: the hosts' memory copies gathered (checkpoint::gather_memory_copies) and the step
// of the one rank 0 then finds usable (its own host's copy checked as usable_memory_copy does),
// or nothing, with a line saying why a copy was not taken. Every rank reads the step's directory
// on its own host.
std::optional<int64_t> choose_memory(const ResumePoint& point, const fs::path& given,
                                     comm::Communicator& world) {
  std::error_code ec;
  const bool names_run = !fs::exists(given / "manifest.json", ec) && point.run_dir;
  // Rank 0's view decides, so that every rank enters the collectives below or none does.
  int64_t consider = world.rank() == 0 && names_run ? 1 : 0;
  if (world.size() > 1) world.broadcast(&consider, sizeof consider, 0);
  if (consider == 0) return std::nullopt;
  const int64_t disk_step =
      point.disk ? checkpoint::checkpoint_dir_step(*point.disk).value_or(0) : -1;
  const auto start = std::chrono::steady_clock::now();
  checkpoint::MemoryCopyPlan plan;
  try {
    plan = checkpoint::gather_memory_copies(
        world, *point.run_dir, runtime::host_leaders(runtime::host_indices(world)), disk_step);
  } catch (const Error& e) {
    plan.refused = e.what();  // every rank has the same error
  }
  int64_t chosen = -1;
  if (world.rank() == 0) {
    std::string refused = plan.refused;
    if (plan.step && !plan.transfers.empty()) {
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      std::printf(
          "memory checkpoint of step %lld completed on every host: %zu files, %.2f MiB "
          "sent between hosts in %.3f s\n",
          static_cast<long long>(*plan.step), plan.transfers.size(),
          static_cast<double>(plan.bytes) / (1 << 20), took.count());
    }
    if (plan.step) {
      const fs::path dir = checkpoint::checkpoint_dir(
          checkpoint::memory_checkpoint_root(*point.run_dir), *plan.step);
      if (usable_memory_copy(dir, disk_step, &refused)) chosen = *plan.step;
    }
    if (chosen < 0 && !refused.empty()) {
      std::printf("not resuming from memory: %s\n", refused.c_str());
    }
  }
  if (world.size() > 1) world.broadcast(&chosen, sizeof chosen, 0);
  return chosen < 0 ? std::nullopt : std::optional<int64_t>(chosen);
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
  if (const std::optional<int64_t> step = choose_memory(point, given, world)) {
    const fs::path chosen =
        checkpoint::checkpoint_dir(checkpoint::memory_checkpoint_root(*point.run_dir), *step);
    try {
      point.checkpoint = checkpoint::load_checkpoint(chosen, world);
      point.memory = chosen;
      return point;
    } catch (const Error& e) {
      if (world.rank() == 0) std::printf("not resuming from memory: %s\n", e.what());
    }
  }
  check(point.disk.has_value(), no_disk);
  point.checkpoint = checkpoint::load_checkpoint(*point.disk, world);
  return point;
}

void restore_resume_point(Trainer& trainer, ResumePoint& point, comm::Communicator& world) {
  // Once read, the checkpoint's index (and its read lock, checkpoint/retention.h) goes: the run's
  // retention may then remove it like any other.
  if (!point.memory) {
    trainer.restore(point.checkpoint);
    point.checkpoint.sharded.reset();
    return;
  }
  try {
    trainer.restore(point.checkpoint);
    point.checkpoint.sharded.reset();
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
  point.checkpoint = checkpoint::load_checkpoint(*point.disk, world);
  trainer.restore(point.checkpoint);
  point.checkpoint.sharded.reset();
}

}  // namespace malleus::train
