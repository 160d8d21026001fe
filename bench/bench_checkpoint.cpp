// Checkpoint I/O against the disk it runs on, in one run (bench/bench_checkpoint.sh):
//
// - the disk's own sequential speed: every rank writes (and fsyncs) a plain file as large as its
//   part of a save, all at once, then reads one as large as its part of a load with the page
//   cache dropped for it (the same bytes per rank as the save and the load it is held against);
// - sharded saves of a 106M-parameter model (parameters and both Adam moments, 1.27 GB) under the
//   data-parallel plan of the job with the distributed optimizer (every rank holds the whole
//   model's parameters and writes the pieces of them it owns, and its optimizer shard's slice of
//   the moments), synchronous: bytes over the time from the start of the save to its commit;
// - loads of that checkpoint under a pipeline plan (each rank reads the pieces of its own stage,
//   page cache dropped first) into buffers allocated as the engine allocates its state
//   (common/host_pages.h), fresh in the first round and reused after: bytes read over time;
// - the stall of an asynchronous save (the copy to host memory the step waits for) against the
//   whole time of a synchronous one.
//
// Figures are medians over ROUNDS rounds with their range; run it under mpirun:
//   mpirun -np 2 build/bench/bench_checkpoint [ROUNDS] [DIR]
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "bench_args.h"
#include "bench_models.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_writer.h"
#include "comm/communicator.h"
#include "comm/mpi_session.h"
#include "common/error.h"
#include "common/host_pages.h"
#include "common/json.h"
#include "common/stats.h"
#include "layout/layout.h"
#include "layout/optimizer_shard.h"
#include "model/config.h"
#include "model/parameters.h"
#include "plan/cost_model.h"
#include "plan/plan.h"

using namespace malleus;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Drops a file's pages from the page cache (after an fsync they are clean), so the next read
// comes from the disk.
void evict(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  check(fd >= 0, "cannot open " + path.string());
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void evict_tree(const fs::path& dir) {
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) evict(e.path());
  }
}

// Writes `bytes` to `path` with plain write() calls from one buffer, and fsyncs it.
void write_plain(const fs::path& path, const std::vector<char>& block, int64_t bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  check(fd >= 0, "cannot create " + path.string());
  for (int64_t done = 0; done < bytes;) {
    const auto n = static_cast<size_t>(std::min<int64_t>(block.size(), bytes - done));
    check(::write(fd, block.data(), n) == static_cast<ssize_t>(n), "write failed");
    done += static_cast<int64_t>(n);
  }
  ::fsync(fd);
  ::close(fd);
}

// The disk's sequential write and read on this rank (all ranks at once), in seconds: writing
// `write_bytes` (what the rank writes in a save), and reading `read_bytes` (what it reads in a
// load) with the page cache dropped, so each is compared with the same bytes per rank.
std::pair<double, double> raw_disk(const fs::path& path, const std::vector<char>& block,
                                   int64_t write_bytes, int64_t read_bytes,
                                   const comm::Communicator& world) {
  world.barrier();
  auto start = Clock::now();
  write_plain(path, block, write_bytes);
  world.barrier();
  const double write_s = world.all_reduce_max(since(start));
  if (read_bytes != write_bytes) write_plain(path, block, read_bytes);  // not timed
  evict(path);
  world.barrier();
  start = Clock::now();
  {
    std::vector<char> in(block.size());
    const int fd = ::open(path.c_str(), O_RDONLY);
    while (::read(fd, in.data(), in.size()) > 0) {
    }
    ::close(fd);
  }
  world.barrier();
  const double read_s = world.all_reduce_max(since(start));
  fs::remove(path);
  return {write_s, read_s};
}

// A stand-in for a training step on the state a rank holds: the "forward and backward" read the
// parameters once and then compute (fixed work, `compute` rounds of arithmetic on a block that
// stays in cache); the "update" writes every element of the parameters and both moments, as AdamW
// does. `before_update` runs between the two, where the trainer waits for a background copy.
struct StandInStep {
  PageBuffer<float>* params;
  PageBuffer<float>* adam_m;
  PageBuffer<float>* adam_v;
  int64_t compute = 0;
  std::vector<float> block = std::vector<float>(size_t{16} << 10, 1.0f);
  float sink = 0;

  void compute_rounds(int64_t rounds) {
    for (int64_t k = 0; k < rounds; ++k) {
      for (float& x : block) x = x * 0.999f + 0.001f;
    }
  }

  void run(const std::function<void()>& before_update = {}) {
    float sum = 0;
    for (size_t i = 0; i < params->size(); ++i) sum += (*params)[i];
    compute_rounds(compute);
    sink += sum + block[0];
    if (before_update) before_update();
    PageBuffer<float>&p = *params, &m = *adam_m, &v = *adam_v;
    for (size_t i = 0; i < m.size(); ++i) {
      m[i] = 0.9f * m[i] + 1e-3f;
      v[i] = 0.999f * v[i] + 1e-6f;
    }
    for (size_t i = 0; i < p.size(); ++i) p[i] -= 1e-6f * p[i];
  }
};

std::string range(const std::vector<double>& values, double scale, const char* format) {
  const Summary s = summarize(values);
  char text[96];
  std::snprintf(text, sizeof text, format, s.median * scale, s.min * scale, s.max * scale);
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  comm::MpiSession session(&argc, &argv);
  comm::Communicator world = comm::Communicator::world();
  const int rounds = bench::positive_arg(argc, argv, 1, 3);
  const fs::path dir = argc > 2 ? fs::path(argv[2]) : fs::path("bench-checkpoint");
  const int me = world.rank(), ranks = world.size();
  const model::ModelConfig model = bench::model_106m();
  const model::ParameterLayout full(model);

  // Saving plan: data parallel, every rank holds everything. Loading plan: one pipeline, a
  // stage per rank.
  layout::Layout saving;
  saving.shards.assign(static_cast<size_t>(ranks), model::ShardSpec::full(model));
  saving.replica_group.resize(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) saving.replica_group[static_cast<size_t>(r)] = r;
  const plan::Plan loading = plan::uniform_plan(model, 1, 1, ranks, 2 * ranks, 1);
  const layout::Layout loading_layout = layout::plan_layout(loading, model);
  const model::ParameterLayout stage(model, *loading_layout.shards[static_cast<size_t>(me)]);

  // The distributed optimizer (ZeRO-1, as a run with several pipelines has it): each rank keeps
  // its slice of the Adam moments, its optimizer shard.
  const layout::GradSyncPlan sync = layout::plan_grad_sync(model, saving);
  const layout::OptimizerShard shard =
      layout::optimizer_shard(sync, me, plan::kGradSyncChunkElements);
  const layout::Blocks moment_blocks = layout::shard_blocks(full, sync, shard);
  const auto total = static_cast<size_t>(full.total_size());
  // The state lies where the engine keeps it: in the backend's buffers, which come from
  // map_pages (huge pages where the kernel has them); so do the buffers a load reads into.
  PageBuffer<float> params(total), adam_m(static_cast<size_t>(shard.elements)),
      adam_v(adam_m.size());
  for (size_t i = 0; i < total; ++i) params[i] = static_cast<float>(i % 1021) * 1e-3f;
  for (size_t i = 0; i < adam_m.size(); ++i) {
    adam_m[i] = static_cast<float>(i % 977) * 1e-5f;
    adam_v[i] = static_cast<float>(i % 911) * 1e-7f;
  }
  const auto refinement = layout::common_refinement(model, {&saving});
  const std::vector<checkpoint::SavedKind> state =
      checkpoint::saved_state(model, refinement, me, full, params.data(), &moment_blocks,
                              adam_m.data(), adam_v.data(), /*moments_split=*/true);
  int64_t owned = 0;  // bytes this rank writes
  for (const checkpoint::SavedKind& kind : state) {
    for (const checkpoint::OwnedPart& p : kind.parts) {
      owned += p.part.elements * 4 * static_cast<int64_t>(kind.buffers.size());
    }
  }
  const double most_owned = world.all_reduce_max(static_cast<double>(owned));
  const double least_owned = -world.all_reduce_max(-static_cast<double>(owned));
  const int64_t checkpoint_bytes = 12 * full.num_parameters();
  // A load reads whole stored pieces: under dp every tensor is stored whole, and a pipeline stage
  // holds whole tensors, so a rank reads its stage's parameters and moments (checked below).
  const int64_t load_bytes = 12 * stage.total_size();

  if (me == 0) {
    fs::create_directories(dir);
    std::printf(
        "model %s: %.1fM parameters, checkpoint %.2f GB (parameters + Adam moments, fp32)\n"
        "%d ranks; saved under dp%d with the distributed optimizer (rank 0 writes %.0f MB; "
        "ranks write %.0f to %.0f MB), loaded under pp%d (rank 0 reads %.0f MB); the disk alone "
        "writes and reads the same bytes per rank; %d rounds, medians [min, max]\n",
        model.name.c_str(), static_cast<double>(full.num_parameters()) / 1e6,
        static_cast<double>(checkpoint_bytes) / 1e9, ranks, ranks, static_cast<double>(owned) / 1e6,
        least_owned / 1e6, most_owned / 1e6, ranks, static_cast<double>(load_bytes) / 1e6, rounds);
    std::fflush(stdout);
  }
  world.barrier();

  const std::vector<char> block(size_t{8} << 20, 'x');
  std::vector<double> disk_write, disk_read, save, load, sync_stall, async_stall, async_total;
  // The saving step's extra time, against a step without a save, for each kind of save.
  std::vector<double> plain_step, sync_extra, async_extra, deferred_extra;
  StandInStep stand_in{&params, &adam_m, &adam_v};
  {
    // Fixed work for the stand-in step's compute, about 1 s of this machine (the compute timed
    // on its own, once; the same on every rank).
    const auto start = Clock::now();
    stand_in.compute_rounds(1000);
    const double per_round = world.all_reduce_max(since(start)) / 1000;
    stand_in.compute = static_cast<int64_t>(
        world.all_reduce_max(static_cast<double>(static_cast<int64_t>(1.0 / per_round))));
  }
  checkpoint::Checkpoint header;
  header.model = model;
  header.train_config = Json::object();
  checkpoint::CheckpointWriter writer(world);
  PageBuffer<float> p(static_cast<size_t>(stage.total_size())), m(p.size()), v(p.size());
  int64_t step = 0;
  for (int round = 0; round < rounds; ++round) {
    // The disk alone: each rank writes what it writes in a save.
    const auto [w, r] =
        raw_disk(dir / ("raw_" + std::to_string(me)), block, owned, load_bytes, world);
    disk_write.push_back(static_cast<double>(checkpoint_bytes) / w);
    disk_read.push_back(static_cast<double>(checkpoint_bytes) / r);

    // A synchronous save.
    header.step = ++step;
    world.barrier();
    auto start = Clock::now();
    writer.begin(dir, header, state, /*background=*/false);
    const double sync_s = world.all_reduce_max(since(start));
    save.push_back(static_cast<double>(checkpoint_bytes) / sync_s);
    sync_stall.push_back(sync_s);

    // Loading it under the pipeline plan, from the disk.
    const fs::path saved = checkpoint::checkpoint_dir(dir, step);
    if (me == 0) evict_tree(saved);
    world.barrier();
    start = Clock::now();
    const checkpoint::CheckpointIndex index(saved);
    const int64_t read = index.read(stage, {p.data(), m.data(), v.data()});
    const double load_s = world.all_reduce_max(since(start));
    check(read == load_bytes, "the load read " + std::to_string(read) + " bytes, expected " +
                                  std::to_string(load_bytes));
    load.push_back(static_cast<double>(world.all_reduce_sum(read)) / load_s);

    // An asynchronous save: the step waits for the copy only.
    header.step = ++step;
    world.barrier();
    start = Clock::now();
    writer.begin(dir, header, state, /*background=*/true);
    async_stall.push_back(world.all_reduce_max(since(start)));
    writer.wait();
    async_total.push_back(world.all_reduce_max(since(start)));

    // The same saves between stand-in training steps: the saving step's extra time is the save
    // plus the next step, less a step without a save, so it counts the next step's compute
    // slowed down by the copy and the writing going on beside it.
    auto timed_step = [&](const std::function<void()>& before_update = {}) {
      world.barrier();
      const auto begin = Clock::now();
      stand_in.run(before_update);
      return world.all_reduce_max(since(begin));
    };
    timed_step();
    plain_step.push_back(std::min(timed_step(), timed_step()));
    const double plain = plain_step.back();
    for (int kind = 0; kind < 3; ++kind) {
      timed_step();
      header.step = ++step;
      world.barrier();
      start = Clock::now();
      writer.begin(dir, header, state, /*background=*/kind > 0,
                   /*copy_in_background=*/kind == 2);
      stand_in.run([&] { writer.wait_for_copy(); });
      const double extra = world.all_reduce_max(since(start)) - plain;
      (kind == 0 ? sync_extra : kind == 1 ? async_extra : deferred_extra).push_back(extra);
      writer.wait();
      world.barrier();
      if (me == 0) fs::remove_all(checkpoint::checkpoint_dir(dir, step));
    }
    if (me == 0) {
      std::printf(
          "round %d: disk write %.0f MB/s, save %.0f MB/s, disk read %.0f MB/s, load %.0f MB/s, "
          "stall sync %.2f s, async %.3f s; step %.2f s, extra sync %.2f s, copy at save %.2f "
          "s, copy during next step %.2f s\n",
          round + 1, disk_write.back() / 1e6, save.back() / 1e6, disk_read.back() / 1e6,
          load.back() / 1e6, sync_stall.back(), async_stall.back(), plain, sync_extra.back(),
          async_extra.back(), deferred_extra.back());
      std::fflush(stdout);
    }
    if (me == 0) {
      fs::remove_all(checkpoint::checkpoint_dir(dir, step - 4));
      fs::remove_all(checkpoint::checkpoint_dir(dir, step - 3));
    }
    world.barrier();
  }
  if (me == 0) {
    fs::remove_all(dir);
    const double write_ratio = summarize(save).median / summarize(disk_write).median;
    const double read_ratio = summarize(load).median / summarize(disk_read).median;
    const double stall_ratio = summarize(async_stall).median / summarize(sync_stall).median;
    std::printf("| figure | median [min, max] |\n|---|---|\n");
    std::printf("| disk sequential write, all ranks at once | %s |\n",
                range(disk_write, 1e-6, "%.0f [%.0f, %.0f] MB/s").c_str());
    std::printf("| sharded save (synchronous, to commit) | %s (%.0f %% of the disk) |\n",
                range(save, 1e-6, "%.0f [%.0f, %.0f] MB/s").c_str(), 100 * write_ratio);
    std::printf("| disk sequential read, page cache dropped | %s |\n",
                range(disk_read, 1e-6, "%.0f [%.0f, %.0f] MB/s").c_str());
    std::printf("| load under pp%d (each rank its stage's pieces) | %s (%.0f %% of the disk) |\n",
                ranks, range(load, 1e-6, "%.0f [%.0f, %.0f] MB/s").c_str(), 100 * read_ratio);
    // Each round's load next to the disk read just before it; the first round's load lands in
    // buffers never touched before (as a resuming process's does), later rounds reuse them.
    std::vector<double> load_of_disk;
    for (size_t i = 0; i < load.size(); ++i) load_of_disk.push_back(load[i] / disk_read[i]);
    std::printf("| load / disk read, each round | %s |\n",
                range(load_of_disk, 100.0, "%.0f [%.0f, %.0f] %%").c_str());
    std::printf(
        "| load in round 1 (into fresh buffers) | %.0f MB/s (%.0f %% of that round's disk "
        "read) |\n",
        load[0] * 1e-6, 100 * load_of_disk[0]);
    std::printf("| step stall, synchronous save | %s |\n",
                range(sync_stall, 1.0, "%.2f [%.2f, %.2f] s").c_str());
    std::printf(
        "| step stall, asynchronous save (copy to host memory) | %s (%.1f %% of "
        "synchronous) |\n",
        range(async_stall, 1.0, "%.3f [%.3f, %.3f] s").c_str(), 100 * stall_ratio);
    std::printf("| asynchronous save, start to commit | %s |\n",
                range(async_total, 1.0, "%.2f [%.2f, %.2f] s").c_str());
    std::printf(
        "\nBetween stand-in training steps (%s each without a save): the saving step's "
        "extra time\n| save | median [min, max] |\n|---|---|\n",
        range(plain_step, 1.0, "%.2f [%.2f, %.2f] s").c_str());
    const double sync_median = summarize(sync_extra).median;
    std::printf("| synchronous | %s |\n", range(sync_extra, 1.0, "%.3f [%.3f, %.3f] s").c_str());
    std::printf("| asynchronous, copy at the save | %s (%.1f %% of synchronous) |\n",
                range(async_extra, 1.0, "%.3f [%.3f, %.3f] s").c_str(),
                100 * summarize(async_extra).median / sync_median);
    std::printf(
        "| asynchronous, copy during the next step's forward and backward | %s (%.1f %% "
        "of synchronous) |\n",
        range(deferred_extra, 1.0, "%.3f [%.3f, %.3f] s").c_str(),
        100 * summarize(deferred_extra).median / sync_median);
  }
  return 0;
}
