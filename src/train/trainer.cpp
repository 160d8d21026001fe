#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>

#include "common/error.h"
#include "metrics/metrics.h"
#include "train/stop_signal.h"
#include "train/watchdog.h"

namespace malleus::train {

using checkpoint::Checkpoint;
using metrics::EvalRecord;
using metrics::MetricsLog;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

Trainer::Trainer(const TrainConfig& config, const model::ModelConfig& requested_model,
                 comm::Communicator world, InitialState initial)
    : config_(config),
      tokenizer_(data_tokenizer(config.train_data)),
      model_config_(fit_model_to_tokenizer(requested_model, tokenizer_.get())),
      world_(std::move(world)),
      schedule_{config.lr, config.min_lr_ratio, config.warmup_steps, config.steps},
      stragglers_(injected_stragglers(config, world_.size())),
      train_data_(config.train_data, model_config_.vocab_size),
      sampler_(train_data_, config.seq_len, config.seed),
      checkpoints_(world_, config) {
  const model::ModelConfig& model_config = model_config_;
  if (is_root() && tokenizer_ && requested_model.vocab_size != model_config.vocab_size) {
    std::printf("model vocab_size %d -> %d for the training data's %s\n",
                requested_model.vocab_size, model_config.vocab_size,
                tokenizer_->describe().c_str());
  }
  EngineSetup setup = set_up_engine(config_, model_config, world_);
  engine_options_ = std::move(setup.options);
  devices_line_ = std::move(setup.devices_line);
  cores_ = std::move(setup.cores);
  const plan::Plan& plan = setup.plan;
  // On several hosts, the links between them are monitored too, per node of the cluster the
  // controller plans for (ranks fill nodes in order, as `--map-by ppr:K:node` starts them).
  checkpoints_.start_memory_checkpoints(engine_options_.hosts);
  loop_ = make_straggler_loop(config_, model_config, plan, engine_options_.hosts,
                              engine_options_.threads);
  if (!loop_->monitors_links()) engine_options_.hosts.clear();
  engine_ = std::make_unique<runtime::Engine>(model_config, plan, world_, engine_options_);
  if (initial == InitialState::kFromSeed) {
    engine_->init_parameters(config.seed);
    state_ready_ = true;
  }
}

void Trainer::check_state_ready(const char* what) const {
  check(state_ready_, std::string(what) +
                          ": the model state was neither initialised nor restored from a "
                          "checkpoint (the trainer was made to be restored, and no restore "
                          "succeeded)");
}

void Trainer::restore(const Checkpoint& checkpoint) {
  checkpoints_.wait_for_copy();  // the state is about to change
  tokenizer_ = check_resumable(checkpoint, model_config_, tokenizer_, config_.train_data);
  if (checkpoint.sharded) state_ready_ = false;  // until every rank has read all of its part
  load_engine_state(*engine_, checkpoint, model_config_, world_);
  state_ready_ = true;
  step_ = checkpoint.step;
  consumed_samples_ = checkpoint.consumed_samples;
}

Checkpoint Trainer::snapshot() {
  check_state_ready("snapshot");
  checkpoints_.wait_for_copy();  // the gather reuses (and gives back) what a background copy reads
  runtime::FullState full = engine_->gather();
  Checkpoint c = checkpoint_header();
  c.params = std::move(full.params);
  c.adam_m = std::move(full.adam_m);
  c.adam_v = std::move(full.adam_v);
  return c;
}

// The straggler loop, between steps: every rank's measurements into `stats` and the loop (one
// observation: compute times and link probes), and when it switches, the migration to its plan.
void Trainer::straggler_loop(const runtime::StepResult& r, StepStats* out) {
  StepStats& stats = *out;
  record_step_figures(r, &stats);
  elastic::Observation observation{.step = step_, .remaining_steps = config_.steps - step_};
  for (size_t i = 0; i < r.measurements.size(); i += 2) {
    observation.seconds.push_back(r.measurements[i]);
    observation.flops.push_back(r.measurements[i + 1]);
  }
  if (loop_->monitors_links()) {
    observation.link_measurements = r.link_measurements;
    for (size_t i = 0; i < r.link_measurements.size(); i += 2)
      stats.link_s.push_back(r.link_measurements[i]);
  }
  const std::optional<elastic::Decision> decision =
      loop_->observe(observation, elastic::Transport::over(world_));
  stats.rates = loop_->rates();
  stats.link_rates = loop_->link_rates();
  if (!decision) return;
  stats.replan = decision->record;
  if (!decision->plan) return;
  runtime::MigrationStats migration;
  // A phase of its own for the watchdog: a migration's time is not a step's.
  if (watchdog_) watchdog_->enter("migration", step_);
  // Timed here, the old engine's end included: what training waits for (an overlapped switch's
  // background part shows in the next step's time).
  const auto start = Clock::now();
  engine_ = config_.overlap_switch
                ? runtime::Engine::switch_to(std::move(engine_), *decision->plan, &migration)
                : engine_->migrate(*decision->plan, &migration);
  migration.seconds = seconds_since(start);
  loop_->note_migration_seconds(migration.seconds);
  stats.replan->bytes_moved = migration.bytes_moved;
  stats.replan->migration_s = migration.seconds;
  stats.replan->migration_peak_extra_bytes = migration.peak_extra_bytes;
  stats.replan->migration_bucket_bytes = config_.migration_bucket_bytes;
  stats.replan->migration_background_bytes = migration.background_bytes;
}

// The background part of an overlapped switch, once the step after it has finished it (the same
// step on every rank): every rank's figures, summed or the most of any.
void Trainer::collect_switch_background(StepStats* out) {
  std::optional<runtime::BackgroundStats> mine = engine_->take_background_stats();
  if (!mine) return;
  runtime::BackgroundStats all;
  all.bytes_received = world_.all_reduce_sum(mine->bytes_received);
  all.poll_seconds = world_.all_reduce_max(mine->poll_seconds);
  all.wait_seconds = world_.all_reduce_max(mine->wait_seconds);
  all.peak_extra_bytes =
      static_cast<int64_t>(world_.all_reduce_max(static_cast<double>(mine->peak_extra_bytes)));
  out->switch_background = all;
}

StepStats Trainer::train_step() {
  check_state_ready("train_step");
  const auto start = Clock::now();
  const int64_t first = consumed_samples_;
  const runtime::SampleFn sample = [&](int index, int32_t* inputs, int32_t* targets) {
    sampler_.sample(first + index, inputs, targets);
  };
  const double lr = schedule_.at(step_);
  StepStats stats;
  stats.injected = stragglers_.rates(world_.size(), step_ + 1);
  // A save's copy still reading the state (a background copy, CheckpointWriter) holds the
  // optimizer's update back until it is done.
  std::function<void()> before_update;
  if (checkpoints_.copying()) before_update = [this] { checkpoints_.wait_for_copy(); };
  const runtime::StepResult r =
      engine_->step(sample, static_cast<float>(lr), config_.grad_clip,
                    stats.injected[static_cast<size_t>(world_.rank())], before_update);
  consumed_samples_ += config_.global_batch_size;
  ++step_;
  collect_switch_background(&stats);

  // The straggler loop, between steps: measure, and re-plan when the rates moved enough.
  const auto loop_start = Clock::now();
  straggler_loop(r, &stats);
  stats.monitor_overhead_s = seconds_since(loop_start);
  stats.consumed_samples = consumed_samples_;

  stats.step = step_;
  stats.loss = r.loss;
  stats.lr = lr;
  stats.grad_norm = r.grad_norm;
  stats.step_time_s = seconds_since(start);
  stats.tokens_per_s = static_cast<double>(config_.tokens_per_step()) / stats.step_time_s;
  return stats;
}

double Trainer::evaluate(const data::TokenDataset& dataset, int max_samples) {
  check_state_ready("evaluate");
  // A fixed seed: evaluation sees the same windows whatever the training seed.
  data::Sampler sampler(dataset, config_.seq_len, /*seed=*/0);
  const int64_t count = std::min<int64_t>(max_samples, sampler.windows_per_epoch());
  return engine_->evaluate(
      [&](int index, int32_t* inputs, int32_t* targets) { sampler.sample(index, inputs, targets); },
      static_cast<int>(count));
}

double Trainer::evaluate(const std::string& pattern, int max_samples) {
  data::TokenDataset dataset(pattern, model_config_.vocab_size);
  return evaluate(dataset, max_samples);
}

Checkpoint Trainer::checkpoint_header() const {
  Checkpoint header;
  header.model = model_config_;
  header.train_config = config_.to_json();
  header.step = step_;
  header.consumed_samples = consumed_samples_;
  header.tokenizer = tokenizer_;
  return header;
}

std::vector<checkpoint::SavedKind> Trainer::saved_state() const {
  return train::saved_state(*engine_, model_config_, world_.rank());
}

RunEnd Trainer::run_end() {
  return {.world = world_,
          .checkpoints = checkpoints_,
          .out = config_.out_dir,
          .step = step_,
          .steps = config_.steps};
}

int Trainer::run() {
  check_state_ready("run");
  const std::filesystem::path out(config_.out_dir);
  const auto checkpoints = out / "checkpoints";
  std::optional<MetricsLog> metrics;
  if (is_root()) metrics.emplace(out / "metrics.jsonl");
  std::optional<data::TokenDataset> val_data;
  if (!config_.val_data.empty()) val_data.emplace(config_.val_data, model_config_.vocab_size);
  std::string plan_text = engine_->plan().summary();

  if (is_root()) {
    announce(out, model_config_, config_,
             RunHeader{.train_tokens = train_data_.num_tokens(),
                       .world_size = world_.size(),
                       .threads = engine_options_.threads,
                       .plan_text = plan_text,
                       .cores = &cores_,
                       .devices = devices_line_});
  }
  std::optional<Watchdog> watchdog;
  if (config_.watchdog && world_.size() > 1) {  // one rank waits for nobody
    start_watchdog(out, world_,
                   {.floor_s = config_.watchdog_floor_s,
                    .multiple = config_.watchdog_multiple,
                    .cut_after_s = config_.watchdog_cut_after_s,
                    .network = config_.watchdog_network},
                   &watchdog);
  }
  watchdog_ = watchdog ? &*watchdog : nullptr;
  struct Unwatch {  // run() may leave by a return or an exception
    Trainer* trainer;
    ~Unwatch() { trainer->watchdog_ = nullptr; }
  } unwatch{this};
  const auto watch = [&](const char* phase, int64_t step) {
    if (watchdog) watchdog->enter(phase, step);
  };
  // A fresh run supersedes any memory copies an earlier run in this directory left.
  if (step_ == 0) checkpoints_.clear_memory();

  double recent_step_time = 0;  // exponential moving average, for the ETA
  while (step_ < config_.steps) {
    watch("step", step_ + 1);
    const StepStats s = train_step();
    if (!std::isfinite(s.loss) || !std::isfinite(s.grad_norm)) {
      stop_diverged(run_end(), s.loss, s.grad_norm);
    }
    checkpoints_.poll();  // commits a background save once every rank has written its part
    recent_step_time =
        recent_step_time == 0 ? s.step_time_s : 0.9 * recent_step_time + 0.1 * s.step_time_s;
    const double eta = recent_step_time * static_cast<double>(config_.steps - step_);
    if (is_root()) log_step(s, eta, plan_text, config_.steps, restarts_, *metrics);
    plan_text = engine_->plan().summary();

    const bool last = step_ == config_.steps;
    if (val_data && ((config_.eval_every > 0 && step_ % config_.eval_every == 0) || last)) {
      watch("eval", step_);
      const double val_loss = evaluate(*val_data, config_.eval_samples);
      if (is_root()) {
        std::printf("eval  %5lld | val loss %.4f (%.3f bits/token)\n",
                    static_cast<long long>(step_), val_loss, val_loss / std::log(2.0));
        metrics->write(EvalRecord{step_, val_loss});
      }
    }
    const bool saved =
        (config_.checkpoint_every > 0 && step_ % config_.checkpoint_every == 0) || last;
    if (saved) {
      watch("checkpoint", step_);
      checkpoints_.save(checkpoints, checkpoint_header(), saved_state());
    }
    if (!last) {
      watch("checkpoint", step_);
      if (checkpoints_.memory_due(step_)) {
        checkpoints_.save_to_memory(checkpoint_header(), saved_state(), recent_step_time);
      }
    }

    // A stop request on any rank stops every rank here, after the same step. One small
    // all-reduce per step; the checkpoint is of the step every rank has finished.
    const int signal = agreed_stop_signal(world_);
    if (signal != 0 && !last) {
      if (!saved) watch("checkpoint", step_);
      std::function<void()> save;
      if (!saved)
        save = [&] { checkpoints_.save(checkpoints, checkpoint_header(), saved_state()); };
      stop_with_checkpoint(run_end(), signal, save);
      return signal;
    }
  }
  checkpoints_.finish();
  checkpoints_.clear_memory();  // the run is over
  checkpoints_.report_memory();
  return 0;
}

}  // namespace malleus::train
