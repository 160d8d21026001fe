#include "train/checkpointing.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "common/error.h"
#include "common/format.h"
#include "model/parameters.h"

namespace malleus::train {

namespace {

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

}  // namespace

Checkpointing::Checkpointing(comm::Communicator world, const TrainConfig& config)
    : world_(world), config_(config), writer_(std::move(world)) {
  writer_.set_keep(config_.keep_checkpoints);  // older checkpoints go after each commit
}

void Checkpointing::start_memory_checkpoints(const std::vector<int>& hosts) {
  if (!config_.memory_checkpoints) return;
  memory_ = std::make_unique<checkpoint::MemoryCheckpointer>(world_, config_.out_dir, hosts);
  memory_every_ = std::max<int64_t>(1, config_.memory_checkpoint_every);
}

void Checkpointing::save(const std::filesystem::path& root, const checkpoint::Checkpoint& header,
                         std::vector<checkpoint::SavedKind> state) {
  // Asynchronous saves copy the state in the background too, while the next step's forward and
  // backward run; its update waits for the copy (Trainer::train_step).
  writer_.begin(root, header, std::move(state), config_.async_checkpoints,
                /*copy_in_background=*/config_.async_checkpoints);
  report_saved();
}

void Checkpointing::save_to_memory(const checkpoint::Checkpoint& header,
                                   const std::vector<checkpoint::SavedKind>& state, double step_s) {
  const int64_t step = header.step;
  checkpoint::MemorySaveStats stats;
  try {
    stats = memory_->save(header, state);
  } catch (const Error& e) {
    // Every rank has the same error (the save agrees on it).
    if (is_root()) {
      std::fprintf(stderr,
                   "warning: memory checkpoint of step %lld failed: %s; memory checkpoints are off "
                   "for the rest of this run (disk checkpoints go on)\n",
                   static_cast<long long>(step), e.what());
    }
    memory_.reset();
    return;
  }
  // The step waits for the slowest rank's save; every rank takes the same figures.
  double figures[2] = {stats.seconds, step_s};
  world_.all_reduce_max(figures, 2);
  memory_save_s_.push_back(figures[0]);
  memory_step_s_.push_back(figures[1]);
  const int64_t before = memory_every_;
  if (config_.memory_checkpoint_every == 0 && memory_save_s_.size() >= kMemoryCheckpointProbes) {
    // The medians so far: the first save also faults its buffers in and opens the connection to
    // the peer (seconds on a loaded machine, for a save that then takes milliseconds), the first
    // steps warm up.
    const double ratio =
        median(memory_save_s_) / (kMemoryCheckpointBudget * std::max(1e-6, median(memory_step_s_)));
    const auto k = static_cast<int64_t>(std::ceil(std::min(ratio, 1e9)));
    const int64_t most = config_.checkpoint_every > 0 ? config_.checkpoint_every : config_.steps;
    memory_every_ = std::clamp<int64_t>(k, 1, std::max<int64_t>(1, most));
  }
  if (is_root() && (memory_save_s_.size() == 1 || memory_every_ != before)) {
    std::printf(
        "memory checkpoint of step %lld: %s per rank in %.3f s (step %.3f s); every %s%s; rank "
        "0's copy on rank %d\n",
        static_cast<long long>(step), format_bytes(static_cast<double>(stats.bytes)).c_str(),
        figures[0], figures[1], format_counted(memory_every_, "step").c_str(),
        config_.memory_checkpoint_every == 0 ? " (chosen from the cost)" : "",
        memory_->holders().peer);
    std::fflush(stdout);
  }
}

void Checkpointing::clear_memory() {
  if (memory_) memory_->clear();
}

void Checkpointing::report_memory() const {
  if (!is_root() || memory_save_s_.empty()) return;
  std::printf(
      "memory checkpoints: %zu saves, median %.3f s (max %.3f s), against a median step of "
      "%.3f s\n",
      memory_save_s_.size(), median(memory_save_s_),
      *std::max_element(memory_save_s_.begin(), memory_save_s_.end()), median(memory_step_s_));
  std::fflush(stdout);
}

void Checkpointing::poll() {
  if (writer_.poll()) report_saved();
}

void Checkpointing::finish() {
  if (!writer_.in_flight()) return;
  writer_.wait();
  report_saved();
}

void Checkpointing::report_saved() {
  if (writer_.in_flight() || !writer_.last() || !is_root()) return;
  const checkpoint::SaveStats& s = *writer_.last();
  std::printf("saved checkpoint %s (%s; step held %s, written in %s)\n", s.dir.c_str(),
              format_bytes(static_cast<double>(s.bytes)).c_str(),
              format_duration(s.stall_s).c_str(), format_duration(s.total_s).c_str());
  for (const std::filesystem::path& removed : s.removed) {
    std::printf("removed checkpoint %s (--keep-checkpoints %d)\n", removed.c_str(),
                config_.keep_checkpoints);
  }
  std::fflush(stdout);
  for (const std::string& left : s.left) {
    std::fprintf(stderr, "warning: checkpoint %s; kept past --keep-checkpoints %d for now\n",
                 left.c_str(), config_.keep_checkpoints);
  }
}

std::vector<checkpoint::SavedKind> saved_state(runtime::Engine& engine,
                                               const model::ModelConfig& model, int rank) {
  const runtime::HeldState held = engine.held_state();
  if (held.layout == nullptr) return {};
  return checkpoint::saved_state(model, engine.state().grad_sync().pieces, rank, *held.layout,
                                 held.params, held.moment_blocks, held.adam_m, held.adam_v,
                                 held.moments_split);
}

void load_engine_state(runtime::Engine& engine, const checkpoint::Checkpoint& checkpoint,
                       const model::ModelConfig& model, comm::Communicator& world) {
  if (checkpoint.sharded) {
    // Straight into where each rank keeps its state (the Adam moments into its optimizer shard
    // when they are split); nothing goes through rank 0 or is scattered. On a device the
    // pointers are a host copy, which goes to the device once read.
    comm::agree_on_error(
        world, comm::error_of([&] {
          engine.restore_held_state([&](const runtime::HeldState& held) {
            if (held.layout == nullptr) return;
            const layout::Blocks params =
                layout::local_blocks(model::ParameterLayout(model), *held.layout);
            const checkpoint::StateTarget moments{held.moment_blocks, {held.adam_m, held.adam_v}};
            checkpoint.sharded->read({&params, {held.params}}, &moments);
          });
        }));
    engine.set_steps_done(checkpoint.step);
    return;
  }
  runtime::FullState full;
  if (world.rank() == 0) {
    full.params = checkpoint.params;
    full.adam_m = checkpoint.adam_m;
    full.adam_v = checkpoint.adam_v;
  }
  engine.scatter(full, checkpoint.step);
}

}  // namespace malleus::train
