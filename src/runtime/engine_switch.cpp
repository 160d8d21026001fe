// The overlapped switch (Engine::switch_to): the parameters move before the new plan's first step,
// the Adam moments while it computes. See engine.h and docs/design.md, "Live migration".
#include <algorithm>
#include <chrono>

#include "common/error.h"
#include "layout/migration.h"
#include "layout/staged_redistribution.h"
#include "runtime/engine.h"
#include "runtime/engine_background.h"

namespace malleus::runtime {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Above every micro-batch's activation tags (2 × micro-batch + 1) and below the link probe's.
constexpr int kBackgroundTag = 31000;

// Bytes of `rank`'s old parts in bands [first, end) of a one-kind staged plan of `unit` bytes per
// element.
int64_t old_bytes(const layout::StagedRedistribution& staged, size_t first, size_t end, int rank,
                  int64_t unit) {
  int64_t bytes = 0;
  for (size_t b = first; b < end; ++b) {
    for (const layout::BandRange& p : staged.bands[b].old_parts) {
      if (p.rank == rank) bytes += p.count * unit;
    }
  }
  return bytes;
}

// The first band from which every rank's old parts still to be sent fit under `budget` bytes:
// the bands before it move before the new plan's first step, the rest during it.
size_t first_background_band(const layout::StagedRedistribution& staged, int world_size,
                             int64_t unit, int64_t budget) {
  const size_t bands = staged.bands.size();
  std::vector<int64_t> left(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) left[size_t(r)] = old_bytes(staged, 0, bands, r, unit);
  size_t first = 0;
  while (first<bands&& * std::max_element(left.begin(), left.end())> budget) {
    for (const layout::BandRange& p : staged.bands[first].old_parts) {
      left[size_t(p.rank)] -= p.count * unit;
    }
    ++first;
  }
  return first;
}

// Bytes sent between ranks (every rank's, every buffer) in a one-kind staged plan.
int64_t bytes_between_ranks(const layout::StagedRedistribution& staged, int64_t unit) {
  int64_t bytes = 0;
  for (const layout::Band& band : staged.bands) {
    for (const layout::BandMove& m : band.moves) {
      if (m.source != m.destination) bytes += m.elements * unit;
    }
  }
  return bytes;
}

}  // namespace

Engine::~Engine() = default;

std::unique_ptr<Engine> Engine::switch_to(std::unique_ptr<Engine> old, const plan::Plan& plan,
                                          MigrationStats* stats) {
  check(old != nullptr, "Engine::switch_to: no engine to switch from");
  old->finish_background();
  const auto start = Clock::now();
  backend::MemoryLedger& ledger = backend::memory_ledger();
  auto background = std::make_unique<Background>();
  background->total_before = ledger.current().total();
  old->give_back_working_memory();
  ledger.reset_peak();
  const int64_t state_before = ledger.current().total();
  std::unique_ptr<Engine> next(
      new Engine(old->model_config_, plan, old->state_->world(), old->options_, true));
  background->kinds = old->migrated_kinds(*next);
  const auto& kinds = background->kinds;
  const model::ModelConfig& model = old->model_config_;
  const int64_t bucket = old->options_.migration_bucket_bytes;
  const auto moves =
      layout::plan_redistribution(model, old->state_->layout(), next->state_->layout());
  const auto params = layout::stage_redistribution(model, moves, {kinds[0]}, bucket);
  const auto moments = layout::stage_redistribution(model, moves, {kinds[1]}, bucket);
  const int world_size = old->state_->world().size(), me = old->state_->rank();
  // Parameters first, then the moments up to the budget, blocking; the rest in the background.
  const size_t bands = moments.bands.size();
  size_t split = first_background_band(moments, world_size, kinds[1].unit(),
                                       old->options_.migration_overlap_bytes);
  // Local copies alone are not worth keeping the old engine alive through the next step for.
  if (bytes_between_ranks(layout::band_range(moments, split, bands), kinds[1].unit()) == 0) {
    split = bands;
  }
  int64_t received = old->move_kind(*next, params, kinds[0], 0);
  received += old->move_kind(*next, layout::band_range(moments, 0, split), kinds[1], 1);
  const int64_t state_peak = ledger.peak_total();
  next->set_steps_done(old->steps_done_);
  // The old engine keeps its moments only; the new one books all of its memory, the moments
  // still to arrive included.
  old->model_.reset();
  old->probe_a_ = {};
  old->probe_b_ = {};
  old->probe_c_ = {};
  next->backend_->allocations().commit_all();
  const int64_t still_held = old_bytes(moments, split, bands, me, kinds[1].unit());
  background->total_after = ledger.current().total() - still_held;
  const auto background_part = layout::band_range(moments, split, bands);
  const int64_t background_bytes = bytes_between_ranks(background_part, kinds[1].unit());
  if (stats != nullptr) {
    comm::Communicator& world = old->state_->world();
    stats->bytes_received = received;
    stats->bytes_moved = world.all_reduce_sum(received);
    stats->background_bytes = background_bytes;
    auto most = [&](int64_t bytes) {
      return static_cast<int64_t>(
          world.all_reduce_max(static_cast<double>(std::max<int64_t>(0, bytes))));
    };
    stats->peak_extra_bytes =
        most(state_peak - std::max(background->total_before, background->total_after));
    stats->state_extra_bytes = most(state_peak - std::max(state_before, background->total_after));
    stats->predicted_extra_bytes = std::max(
        *std::max_element(params.predicted_extra_bytes.begin(), params.predicted_extra_bytes.end()),
        *std::max_element(moments.predicted_extra_bytes.begin(),
                          moments.predicted_extra_bytes.end()));
  }
  if (split < bands) {
    next->start_background(std::move(background), std::move(old), background_part);
  }
  if (stats != nullptr) stats->seconds = seconds_since(start);
  return next;
}

void Engine::start_background(std::unique_ptr<Background> background, std::unique_ptr<Engine> old,
                              layout::StagedRedistribution part) {
  Engine& from = *old;
  const auto old_moments = from.state_buffers(1);
  layout::StateMemory memory;
  memory.commit = [](int, int64_t, int64_t) {};  // booked with the rest (commit_all)
  memory.release = [&from, old_moments](int, int64_t offset, int64_t count) {
    for (float* buffer : old_moments) from.backend_->decommit_range(buffer + offset, size_t(count));
  };
  const auto me = static_cast<size_t>(state_->rank());
  const layout::StateKind& moments = background->kinds[1];
  const int64_t window = std::max<int64_t>(1, options_.migration_bucket_bytes / 2);
  background->move = std::make_unique<layout::BackgroundRedistribution<float>>(
      std::move(part), state_->world(),
      std::vector<layout::KindState<const float>>{{&moments.from[me],
                                                   {old_moments.begin(), old_moments.end()},
                                                   from.backend_->device_memory().get()}},
      std::vector<layout::KindState<float>>{
          {&moments.to[me], state_buffers(1), backend_->device_memory().get()}},
      std::move(memory), window, kBackgroundTag);
  background->old = std::move(old);
  background_ = std::move(background);
  poll_background();  // the first bands leave now
}

void Engine::poll_background() {
  if (!background_) return;
  const auto start = Clock::now();
  background_->move->poll();
  background_->stats.poll_seconds += seconds_since(start);
}

void Engine::finish_background() {
  if (!background_) return;
  const auto start = Clock::now();
  background_->move->finish();
  BackgroundStats stats = background_->stats;
  stats.bytes_received = background_->move->received_bytes();
  stats.peak_extra_bytes =
      std::max<int64_t>(0, backend::memory_ledger().peak_total() -
                               std::max(background_->total_before, background_->total_after));
  background_.reset();  // the old engine, and the rest of its memory, with it
  stats.wait_seconds = seconds_since(start);
  background_stats_ = stats;
}

std::optional<BackgroundStats> Engine::take_background_stats() {
  std::optional<BackgroundStats> stats;
  std::swap(stats, background_stats_);
  return stats;
}

}  // namespace malleus::runtime
