#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <thread>

#include "common/error.h"
#include "common/files.h"
#include "common/format.h"
#include "common/system.h"
#include "layout/grad_sync_plan.h"
#include "layout/layout.h"
#include "layout/optimizer_shard.h"
#include "metrics/metrics.h"
#include "plan/planner.h"
#include "train/stop_signal.h"
#include "train/watchdog.h"

namespace malleus::train {

using checkpoint::Checkpoint;
using checkpoint::CheckpointIndex;
using checkpoint::load_checkpoint;
using checkpoint::saved_state;
using checkpoint::SavedKind;
using checkpoint::SaveStats;
using checkpoint::snapshot_elements;
using checkpoint::StateTarget;
using metrics::EvalRecord;
using metrics::MetricsLog;
using metrics::ReplanRecord;
using metrics::StepRecord;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Ranks sharing this machine: OpenMPI says so in the environment; otherwise assume all of them.
int ranks_on_this_node(int world_size) {
  if (const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE"))
    return std::max(1, std::atoi(local));
  return world_size;
}

runtime::EngineOptions engine_options(const TrainConfig& c, int world_size) {
  runtime::EngineOptions options;
  options.seq_len = c.seq_len;
  options.threads = resolve_threads(c.threads, ranks_on_this_node(world_size));
  options.adamw = {c.beta1, c.beta2, c.adam_eps, c.weight_decay};
  options.shifted_recompute = c.shifted_recompute;
  options.migration_bucket_bytes = c.migration_bucket_bytes;
  options.migration_overlap_bytes = c.migration_overlap_bytes;
  options.tp_subpipeline = c.tp_subpipeline;
  options.distributed_optimizer = c.distributed_optimizer;
  return options;
}

// The injected stragglers of a config. Built before the data is read (member order), so a bad
// trace or a rank outside the job is reported first.
elastic::StragglerSchedule injected_stragglers(const TrainConfig& c, int world_size) {
  elastic::StragglerSchedule schedule;
  auto check_ranks = [&](const std::string& what) {
    const int rank = schedule.highest_rank();
    check(rank < world_size, what + " names rank " + std::to_string(rank) + ", but the job has " +
                                 std::to_string(world_size) +
                                 (world_size == 1 ? " rank" : " ranks (0 to ") +
                                 (world_size == 1 ? "" : std::to_string(world_size - 1) + ")"));
  };
  for (const auto& spec : c.stragglers) {
    schedule.add(spec);
    check_ranks("straggler \"" + spec + "\"");
  }
  if (!c.straggler_trace.empty()) {
    schedule.add_trace(c.straggler_trace);
    check_ranks("straggler trace " + c.straggler_trace);
  }
  return schedule;
}

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// The metrics record of a controller decision (its numbers are rank 0's).
ReplanRecord replan_record(const elastic::Decision& d) {
  ReplanRecord r;
  r.switched = d.plan.has_value();
  r.step = d.step;
  r.rates = d.rates;
  r.link_rates = d.link_rates;
  r.old_plan = d.old_plan;
  r.new_plan = d.new_plan;
  r.reason = d.verdict.reason;
  if (!d.new_plan.empty()) {  // a plan was found and weighed
    r.predicted_old_s = d.question.current_step_s;
    r.predicted_new_s = d.question.proposed_step_s;
    r.predicted_gain_s = d.question.current_step_s - d.question.proposed_step_s;
    r.predicted_migration_s = d.question.switch_s;
    r.horizon_steps = static_cast<int64_t>(d.question.horizon_steps);
    r.planning_s = d.planning_s;
    r.search = d.incremental ? "incremental" : "full";
  }
  return r;
}

}  // namespace

ModelStateBytes model_state_bytes(const model::ModelConfig& model, const plan::Plan& plan, int rank,
                                  bool distributed_optimizer) {
  const layout::Layout layout = layout::plan_layout(plan, model);
  const auto local = layout::local_layouts(model, layout);
  const auto& mine = local.at(static_cast<size_t>(rank));
  ModelStateBytes bytes;
  if (!mine) return bytes;  // idle: no model state
  constexpr int64_t kFloat = sizeof(float);
  const layout::GradSyncPlan sync = layout::plan_grad_sync(model, layout);
  const model::ParameterLayout full(model);
  bytes.held_elements = mine->total_size();
  bytes.moments_split = layout::splits_moments(plan, distributed_optimizer);
  // Where the engine keeps the moments (Engine's constructor and held_state).
  layout::Blocks moment_blocks;
  if (bytes.moments_split) {
    const layout::OptimizerShard shard =
        layout::optimizer_shard(sync, rank, plan::kGradSyncChunkElements);
    moment_blocks = layout::shard_blocks(full, sync, shard);
    bytes.moment_elements = shard.elements;
    bytes.gradient_shard = kFloat * shard.elements;
  } else {
    moment_blocks = layout::local_blocks(full, *mine);
    bytes.moment_elements = bytes.held_elements;
  }
  bytes.parameters = kFloat * bytes.held_elements;
  bytes.gradients = kFloat * bytes.held_elements;
  bytes.optimizer = 2 * kFloat * bytes.moment_elements;
  // What Trainer::save hands the checkpoint writer; only the parts' sizes are read.
  const std::vector<SavedKind> saved =
      saved_state(model, sync.pieces, rank, *mine, nullptr, &moment_blocks, nullptr, nullptr,
                  bytes.moments_split);
  bytes.checkpoint_copy = kFloat * snapshot_elements(saved);
  return bytes;
}

void check_model_state_fits(const model::ModelConfig& model, const plan::Plan& plan, int rank,
                            bool distributed_optimizer, int64_t available_bytes, int ranks_here) {
  const ModelStateBytes need = model_state_bytes(model, plan, rank, distributed_optimizer);
  const double share = static_cast<double>(available_bytes) / std::max(1, ranks_here);
  if (static_cast<double>(need.total()) <= share) return;
  const auto held = static_cast<double>(need.held_elements);
  std::string parts;
  if (need.moments_split) {
    parts = "whose parameters and gradients take " +
            format_bytes(static_cast<double>(need.parameters + need.gradients)) +
            ", and the Adam moments and summed gradients of its optimizer shard (" +
            format_count(static_cast<double>(need.moment_elements)) +
            " elements: the distributed optimizer splits them among the holders) " +
            format_bytes(static_cast<double>(need.optimizer + need.gradient_shard));
  } else {
    parts = "whose parameters, gradients and Adam moments take " +
            format_bytes(static_cast<double>(need.parameters + need.gradients + need.optimizer));
  }
  throw Error("model \"" + model.name + "\" (" +
              format_count(static_cast<double>(model.num_parameters())) +
              " parameters) does not fit: under this plan rank " + std::to_string(rank) +
              " holds " + format_count(held) + " parameter elements, " + parts + " (plus " +
              format_bytes(static_cast<double>(need.checkpoint_copy)) +
              " for its part of a checkpoint), but this machine has " +
              format_bytes(static_cast<double>(available_bytes)) + " available" +
              (ranks_here > 1 ? ", " + format_bytes(share) + " for each of its " +
                                    std::to_string(ranks_here) + " ranks"
                              : "") +
              ": use more ranks, a plan that shards the model further, or a smaller model");
}

int resolve_threads(int configured, int ranks) {
  const int cpus = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  if (configured > 0) {
    // More threads than the machine has CPUs never helps, and far more crash OpenBLAS.
    check(configured <= cpus, "\"threads\" is " + std::to_string(configured) +
                                  ", but this machine has " + std::to_string(cpus) +
                                  " CPUs: give at most " + std::to_string(cpus) +
                                  " (0: the node's cores shared among its ranks)");
    return configured;
  }
  return std::max(1, cpus / std::max(1, ranks));
}

namespace {

plan::BatchConfig batch_config(const TrainConfig& config) {
  plan::BatchConfig batch;
  batch.global_batch = config.global_batch_size;
  batch.micro_batch = config.micro_batch_size;
  batch.seq_len = config.seq_len;
  return batch;
}

}  // namespace

plan::Plan resolve_plan(const TrainConfig& config, const model::ModelConfig& model,
                        int world_size) {
  if (config.plan == kPlannerPlan) {
    // Every rank plans from the same inputs (the cluster preset, no measured profile, every rank
    // healthy), and the planner is deterministic, so all ranks arrive at the same plan.
    plan::CostModel cost(model, elastic::local_cluster(config.cluster, world_size),
                         batch_config(config));
    cost.set_shifted_recompute(config.shifted_recompute);
    cost.set_tp_subpipeline(config.tp_subpipeline);
    cost.use_distributed_optimizer(config.distributed_optimizer);
    plan::Plan p = plan::make_strategy("malleus")->plan(cost, {}).plan;
    plan::validate(p, model, world_size, config.global_batch_size, "the planner's plan");
    return p;
  }
  if (!config.plan.empty()) {
    plan::Plan p = plan::Plan::from_json(read_json_file(config.plan), model, config.plan);
    plan::validate(p, model, world_size, config.global_batch_size, config.plan);
    check(p.micro_batch_size == config.micro_batch_size,
          config.plan + ": \"micro_batch_size\" is " + std::to_string(p.micro_batch_size) +
              " but the training config's is " + std::to_string(config.micro_batch_size));
    return p;
  }
  const int tp = config.tp, pp = config.pp;
  check(world_size % (tp * pp) == 0 || config.dp > 0,
        "tp × pp = " + std::to_string(tp * pp) + " does not divide the " +
            std::to_string(world_size) + " ranks; give --dp or a plan file");
  const int dp = config.dp > 0 ? config.dp : world_size / (tp * pp);
  return plan::uniform_plan(model, dp, tp, pp, config.global_batch_size, config.micro_batch_size,
                            world_size);
}

std::shared_ptr<const tokenizer::Tokenizer> data_tokenizer(const std::string& pattern) {
  const std::filesystem::path dir = std::filesystem::path(pattern).parent_path();
  return tokenizer::load_saved_tokenizer(dir.empty() ? std::filesystem::path(".") : dir);
}

model::ModelConfig fit_model_to_tokenizer(model::ModelConfig model,
                                          const tokenizer::Tokenizer* tokenizer) {
  if (tokenizer == nullptr) return model;
  const tokenizer::SpecialTokens special = tokenizer->special_tokens();
  model.vocab_size = std::max(model.vocab_size, tokenizer->vocab_size());
  model.bos_token_id = special.bos;
  model.eos_token_id = special.eos;
  model.pad_token_id = special.pad;
  return model;
}

Trainer::Trainer(const TrainConfig& config, const model::ModelConfig& requested_model,
                 comm::Communicator world, InitialState initial)
    : config_(config),
      tokenizer_(data_tokenizer(config.train_data)),
      model_config_(fit_model_to_tokenizer(requested_model, tokenizer_.get())),
      world_(std::move(world)),
      schedule_{config.lr, config.min_lr_ratio, config.warmup_steps, config.steps},
      stragglers_(injected_stragglers(config, world_.size())),
      monitor_(world_.size(), elastic::MonitorOptions{.window = config.monitor_window}),
      train_data_(config.train_data, model_config_.vocab_size),
      sampler_(train_data_, config.seq_len, config.seed),
      writer_(world_) {
  const model::ModelConfig& model_config = model_config_;
  if (is_root() && tokenizer_ && requested_model.vocab_size != model_config.vocab_size) {
    std::printf("model vocab_size %d -> %d for the training data's %s\n",
                requested_model.vocab_size, model_config.vocab_size,
                tokenizer_->describe().c_str());
  }
  config_.validate("training config");
  check(config.seq_len <= model_config.max_seq_len,
        "\"seq_len\" " + std::to_string(config.seq_len) + " exceeds the model's max_seq_len " +
            std::to_string(model_config.max_seq_len));
  // The plan and the limits are checked completely before any rank allocates or communicates.
  const plan::Plan plan = resolve_plan(config_, model_config, world_.size());
  engine_options_ = engine_options(config_, world_.size());
  // Before anything is allocated: the model state must fit this rank's share of the machine.
  if (const int64_t available = available_memory_bytes(); available > 0) {
    check_model_state_fits(model_config, plan, world_.rank(), config_.distributed_optimizer,
                           available, ranks_on_this_node(world_.size()));
  }
  // One rank has no other plan to switch to: the monitor still reports its rate, but nobody is
  // asked to re-plan (the step lines would otherwise say "declined" whenever the rate moved).
  if (config_.replan && world_.size() > 1) {
    const plan::BatchConfig batch = batch_config(config_);
    elastic::ControllerOptions options;
    options.horizon_steps = config_.replan_horizon;
    options.min_samples = config_.monitor_window;
    std::optional<plan::Profile> profile;
    if (!config_.profile.empty()) {
      const int ranks = ranks_on_this_node(world_.size());
      const int threads = engine_options_.threads;
      const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
      profile = elastic::shared_profile(
          plan::Profile::from_json(read_json_file(config_.profile), config_.profile),
          std::min(1.0, static_cast<double>(cores) / (ranks * threads)));
    }
    plan::CostModel cost(model_config, elastic::local_cluster(config_.cluster, world_.size()),
                         batch, profile);
    cost.set_shifted_recompute(config_.shifted_recompute);
    cost.set_tp_subpipeline(config_.tp_subpipeline);
    cost.use_distributed_optimizer(config_.distributed_optimizer);
    controller_ = std::make_unique<elastic::Controller>(std::move(cost), options);
  }
  // Ranks that share cores take turns on them, so each rank's measured compute time is its
  // time on a whole core (runtime/core_lease.h).
  cores_ = runtime::CoreSharing::detect(world_, engine_options_.threads);
  engine_options_.core_lease = cores_.lease;
  // On several hosts, the links between them are monitored too, per node of the cluster the
  // controller plans for (ranks fill nodes in order, as `--map-by ppr:K:node` starts them).
  engine_options_.hosts = runtime::host_indices(world_);
  if (config_.memory_checkpoints) {
    memory_ = std::make_unique<checkpoint::MemoryCheckpointer>(world_, config_.out_dir,
                                                               engine_options_.hosts);
    memory_every_ = std::max<int64_t>(1, config_.memory_checkpoint_every);
  }
  if (*std::max_element(engine_options_.hosts.begin(), engine_options_.hosts.end()) > 0) {
    const plan::ClusterSpec cluster = elastic::local_cluster(config_.cluster, world_.size());
    std::vector<int> node_of_rank;
    for (int r = 0; r < world_.size(); ++r) node_of_rank.push_back(cluster.node_of(r));
    // The reference of a healthy link is also what the cluster file says the probe takes, so
    // busy first steps cannot set one that hides a link slowed later.
    const plan::CostModel cost(model_config, cluster, batch_config(config_));
    link_monitor_ = std::make_unique<elastic::LinkMonitor>(
        node_of_rank, elastic::MonitorOptions{.window = config.monitor_window},
        cost.link_probe_seconds_per_byte());
  } else {
    engine_options_.hosts.clear();
  }
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
  writer_.wait_for_copy();  // the state is about to change
  if (checkpoint.tokenizer && tokenizer_) {
    check(tokenizer::same_tokenizer(*checkpoint.tokenizer, *tokenizer_),
          "the checkpoint's model was trained with a " + checkpoint.tokenizer->describe() +
              ", but the training data " + config_.train_data + " was made with a different " +
              tokenizer_->describe());
  } else if (checkpoint.tokenizer) {
    tokenizer_ = checkpoint.tokenizer;  // data from elsewhere (e.g. llm.c): keep the record
  }
  model::ModelConfig expected = model_config_;
  if (!checkpoint.tokenizer && tokenizer_) {
    // Written before its data recorded a tokenizer: its config has no special ids yet, and the
    // run goes on with the fitted ones.
    expected.bos_token_id = checkpoint.model.bos_token_id;
    expected.eos_token_id = checkpoint.model.eos_token_id;
    expected.pad_token_id = checkpoint.model.pad_token_id;
  }
  check(checkpoint.model.to_json() == expected.to_json(),
        "checkpoint model " + checkpoint.model.to_json().dump() +
            " differs from the configured model " + expected.to_json().dump());
  if (checkpoint.sharded) {
    // Every rank reads the pieces its own shard needs under this plan, whatever the plan and
    // world size that wrote them, straight into where it keeps them (the Adam moments into its
    // optimizer shard when they are split); nothing goes through rank 0 or is scattered.
    const runtime::HeldState held = engine_->held_state();
    state_ready_ = false;  // until every rank has read all of its part
    // One rank's damaged or missing file stops every rank with its message.
    comm::agree_on_error(
        world_, comm::error_of([&] {
          if (held.layout == nullptr) return;
          const layout::Blocks params =
              layout::local_blocks(model::ParameterLayout(model_config_), *held.layout);
          const StateTarget moments{held.moment_blocks, {held.adam_m, held.adam_v}};
          checkpoint.sharded->read({&params, {held.params}}, &moments);
        }));
    engine_->set_steps_done(checkpoint.step);
  } else {
    runtime::FullState full;
    if (is_root()) {
      full.params = checkpoint.params;
      full.adam_m = checkpoint.adam_m;
      full.adam_v = checkpoint.adam_v;
    }
    engine_->scatter(full, checkpoint.step);
  }
  state_ready_ = true;
  step_ = checkpoint.step;
  consumed_samples_ = checkpoint.consumed_samples;
}

Checkpoint Trainer::snapshot() {
  check_state_ready("snapshot");
  writer_.wait_for_copy();  // the gather reuses (and gives back) what a background copy reads
  runtime::FullState full = engine_->gather();
  Checkpoint c;
  c.model = model_config_;
  c.train_config = config_.to_json();
  c.step = step_;
  c.consumed_samples = consumed_samples_;
  c.params = std::move(full.params);
  c.adam_m = std::move(full.adam_m);
  c.adam_v = std::move(full.adam_v);
  c.tokenizer = tokenizer_;
  return c;
}

// Every rank's measurements of the step into `stats`: the monitors' rates, compute and link
// times, peak memory by kind, the recomputation issued ahead.
void Trainer::record_measurements(const runtime::StepResult& r, StepStats* out) {
  StepStats& stats = *out;
  stats.rates =
      monitor_.observe(r.measurements, elastic::work_geometries(engine_->state().layout()));
  for (size_t i = 0; i < r.measurements.size(); i += 2)
    stats.compute_s.push_back(r.measurements[i]);
  {
    using backend::MemoryKind;
    stats.peak_memory_bytes = r.peak_memory_total;
    const std::pair<std::vector<double>*, MemoryKind> kinds[] = {
        {&stats.peak_parameters_bytes, MemoryKind::kParameters},
        {&stats.peak_gradients_bytes, MemoryKind::kGradients},
        {&stats.peak_optimizer_bytes, MemoryKind::kOptimizer},
        {&stats.peak_activations_bytes, MemoryKind::kActivations},
        {&stats.peak_workspace_bytes, MemoryKind::kWorkspace},
        {&stats.peak_communication_bytes, MemoryKind::kCommunication}};
    for (const auto& [field, kind] : kinds) {
      for (const auto& figures : r.peak_memory) field->push_back(double(figures[kind]));
    }
  }
  for (size_t i = 0; i < r.recompute_ahead_measurements.size(); i += 2) {
    if (r.recompute_ahead_measurements[i] <= 0) continue;
    // Some rank recomputed ahead: every rank's figures.
    for (size_t k = 0; k < r.recompute_ahead_measurements.size(); k += 2) {
      stats.recompute_ahead_s.push_back(r.recompute_ahead_measurements[k]);
      stats.recompute_overlapped_s.push_back(r.recompute_ahead_measurements[k + 1]);
    }
    break;
  }
  if (link_monitor_) {
    stats.link_rates = link_monitor_->observe(r.link_measurements);
    for (size_t i = 0; i < r.link_measurements.size(); i += 2)
      stats.link_s.push_back(r.link_measurements[i]);
  }
}

// Asks the controller whether to re-plan on the rates just measured; migrates when it says so.
void Trainer::replan_if_asked(StepStats* out) {
  StepStats& stats = *out;
  // --no-replan-links: the links are measured and logged, the controller plans as if healthy.
  const std::vector<double> no_links;
  controller_->note_step_rates(monitor_.step_rates());  // what its switches realised
  const elastic::Decision decision = controller_->decide(
      world_, engine_->plan(), stats.rates, monitor_.samples(), step_, config_.steps - step_,
      config_.replan_links ? stats.link_rates : no_links);
  if (decision.asked) stats.replan = replan_record(decision);
  if (decision.plan) {
    plan::validate(*decision.plan, model_config_, world_.size(), config_.global_batch_size,
                   "re-plan");
    runtime::MigrationStats migration;
    // Timed here, the old engine's end included: what training waits for (an overlapped switch's
    // background part shows in the next step's time).
    const auto start = Clock::now();
    engine_ = config_.overlap_switch
                  ? runtime::Engine::switch_to(std::move(engine_), *decision.plan, &migration)
                  : engine_->migrate(*decision.plan, &migration);
    migration.seconds = seconds_since(start);
    controller_->note_migration_seconds(migration.seconds);
    monitor_.note_replan();
    stats.replan->bytes_moved = migration.bytes_moved;
    stats.replan->migration_s = migration.seconds;
    stats.replan->migration_peak_extra_bytes = migration.peak_extra_bytes;
    stats.replan->migration_bucket_bytes = config_.migration_bucket_bytes;
    stats.replan->migration_background_bytes = migration.background_bytes;
  }
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
  if (writer_.copying()) before_update = [this] { writer_.wait_for_copy(); };
  const runtime::StepResult r =
      engine_->step(sample, static_cast<float>(lr), config_.grad_clip,
                    stats.injected[static_cast<size_t>(world_.rank())], before_update);
  consumed_samples_ += config_.global_batch_size;
  ++step_;
  collect_switch_background(&stats);

  // The straggler loop, between steps: measure, and re-plan when the rates moved enough.
  const auto loop_start = Clock::now();
  record_measurements(r, &stats);
  if (controller_) replan_if_asked(&stats);
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

std::vector<SavedKind> Trainer::saved_state() const {
  // Each rank copies the pieces it owns straight out of where it keeps them: its parameters'
  // owned pieces, and its Adam moments' (the blocks of its optimizer shard when they are split):
  // nothing gathered, no moments of the whole local layout allocated.
  const runtime::HeldState held = engine_->held_state();
  if (held.layout == nullptr) return {};
  return checkpoint::saved_state(model_config_, engine_->state().grad_sync().pieces, world_.rank(),
                                 *held.layout, held.params, held.moment_blocks, held.adam_m,
                                 held.adam_v, held.moments_split);
}

void Trainer::save(const std::filesystem::path& root) {
  // Asynchronous saves copy the state in the background too, while the next step's forward and
  // backward run; its update waits for the copy (train_step).
  writer_.begin(root, checkpoint_header(), saved_state(), config_.async_checkpoints,
                /*copy_in_background=*/config_.async_checkpoints);
  report_saved();
}

void Trainer::save_to_memory_if_due(double step_s) {
  if (!memory_ || step_ % memory_every_ != 0) return;
  checkpoint::MemorySaveStats stats;
  try {
    stats = memory_->save(checkpoint_header(), saved_state());
  } catch (const Error& e) {
    // Every rank has the same error (the save agrees on it).
    if (is_root()) {
      std::fprintf(stderr,
                   "warning: memory checkpoint of step %lld failed: %s; memory checkpoints are off "
                   "for the rest of this run (disk checkpoints go on)\n",
                   static_cast<long long>(step_), e.what());
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
        static_cast<long long>(step_), format_bytes(static_cast<double>(stats.bytes)).c_str(),
        figures[0], figures[1], format_counted(memory_every_, "step").c_str(),
        config_.memory_checkpoint_every == 0 ? " (chosen from the cost)" : "",
        memory_->holders().peer);
    std::fflush(stdout);
  }
}

void Trainer::clear_memory_checkpoints() {
  if (memory_) memory_->clear();
}

void Trainer::report_memory_checkpoints() const {
  if (!is_root() || memory_save_s_.empty()) return;
  std::printf(
      "memory checkpoints: %zu saves, median %.3f s (max %.3f s), against a median step of "
      "%.3f s\n",
      memory_save_s_.size(), median(memory_save_s_),
      *std::max_element(memory_save_s_.begin(), memory_save_s_.end()), median(memory_step_s_));
  std::fflush(stdout);
}

void Trainer::poll_checkpoint() {
  if (writer_.poll()) report_saved();
}

void Trainer::finish_checkpoint() {
  if (!writer_.in_flight()) return;
  writer_.wait();
  report_saved();
}

void Trainer::report_saved() {
  if (writer_.in_flight() || !writer_.last() || !is_root()) return;
  const SaveStats& s = *writer_.last();
  std::printf("saved checkpoint %s (%s; step held %s, written in %s)\n", s.dir.c_str(),
              format_bytes(static_cast<double>(s.bytes)).c_str(),
              format_duration(s.stall_s).c_str(), format_duration(s.total_s).c_str());
  std::fflush(stdout);
}

void Trainer::log_step(StepStats s, double eta, const std::string& plan_text, MetricsLog& metrics) {
  s.eta_s = eta;
  s.plan = plan_text;
  std::string rates;
  for (double r : s.rates) {
    char text[16];
    std::snprintf(text, sizeof text, rates.empty() ? "%.1f" : " %.1f", r);
    rates += text;
  }
  const std::string restarts =
      restarts_ > 0 ? " | restarts " + std::to_string(restarts_) : std::string();
  // Links between nodes, when measured: " | links 1.0 9.6" (one rate per node).
  std::string links;
  for (double r : s.link_rates) {
    char text[16];
    std::snprintf(text, sizeof text, links.empty() ? " | links %.1f" : " %.1f", r);
    links += text;
  }
  std::printf(
      "step %5lld/%lld | loss %.4f | lr %.2e | grad norm %.3f | %s tok/s | %.3f s | ETA %s | %s | "
      "rates %s%s%s\n",
      static_cast<long long>(s.step), static_cast<long long>(config_.steps), s.loss, s.lr,
      s.grad_norm, format_count(s.tokens_per_s).c_str(), s.step_time_s,
      format_duration(eta).c_str(), plan_text.c_str(), rates.c_str(), links.c_str(),
      restarts.c_str());
  metrics.write(static_cast<const StepRecord&>(s));
  if (s.replan) {
    const ReplanRecord& d = *s.replan;
    if (d.switched) {
      std::printf(
          "re-plan at step %lld: %s -> %s | predicted %.3f -> %.3f s/step | moved %s in %.3f s "
          "(planning %.3f s, %s search)%s\n",
          static_cast<long long>(s.step), d.old_plan.c_str(), d.new_plan.c_str(), d.predicted_old_s,
          d.predicted_new_s, format_bytes(static_cast<double>(d.bytes_moved)).c_str(),
          d.migration_s, d.planning_s, d.search.c_str(),
          d.migration_background_bytes > 0
              ? ("; " + format_bytes(static_cast<double>(d.migration_background_bytes)) +
                 " of Adam moments move in the background of the next step")
                    .c_str()
              : "");
    } else {
      std::printf("re-plan declined at step %lld: %s\n", static_cast<long long>(s.step),
                  d.reason.c_str());
    }
    metrics.write(d);
  }
  if (s.switch_background) {
    const runtime::BackgroundStats& b = *s.switch_background;
    std::printf(
        "switch finished in step %lld: %s of Adam moments moved in the background (%s between "
        "micro-batches, %s waiting before the update; memory %s above before/after)\n",
        static_cast<long long>(s.step), format_bytes(static_cast<double>(b.bytes_received)).c_str(),
        format_duration(b.poll_seconds).c_str(), format_duration(b.wait_seconds).c_str(),
        format_bytes(static_cast<double>(b.peak_extra_bytes)).c_str());
  }
  std::fflush(stdout);
}

// The run's header on stdout (model, data, plan, cores) and where each rank runs (ranks.json).
void Trainer::announce(const std::filesystem::path& out, const std::string& plan_text) {
  const auto& mc = model_config_;
  std::printf(
      "model %s: %s parameters (%d layers, hidden %d, %d heads / %d kv, ffn %d, vocab %d)\n"
      "data %s: %s tokens; global batch %d × %d tokens (micro-batches of %d)\n"
      "plan on %s × %s: %s\n"
      "cores: %s\n",
      mc.name.c_str(), format_count(static_cast<double>(mc.num_parameters())).c_str(),
      mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.ffn_hidden_size,
      mc.vocab_size, config_.train_data.c_str(),
      format_count(static_cast<double>(train_data_.num_tokens())).c_str(),
      config_.global_batch_size, config_.seq_len, config_.micro_batch_size,
      format_counted(world_.size(), "rank").c_str(),
      format_counted(engine_options_.threads, "thread").c_str(), plan_text.c_str(),
      cores_.summary.c_str());
  std::fflush(stdout);
  // Where each rank runs, for tools that slow a rank from outside (scripts/slow_rank.sh).
  Json ranks = Json::array();
  for (size_t r = 0; r < cores_.pids.size(); ++r) {
    ranks.push_back({{"rank", r}, {"pid", cores_.pids[r]}, {"cpus", cores_.cpus[r]}});
  }
  write_file_atomic(out / "ranks.json", Json{{"ranks", ranks}}.dump(2) + "\n");
}

void Trainer::start_watchdog(const std::filesystem::path& out, std::optional<Watchdog>* watchdog) {
  // Hang detection: only with several ranks (one rank waits for nobody). Rank 0 clears the
  // previous run's heartbeats; the barrier keeps the others from writing theirs before rank 0
  // has taken the run directory (run_directory.h) and cleared it.
  if (is_root()) Watchdog::clear(out);
  world_.barrier();
  watchdog->emplace(
      out, world_.rank(), world_.size(),
      WatchdogOptions{.floor_s = config_.watchdog_floor_s, .multiple = config_.watchdog_multiple});
  if (is_root()) {
    std::printf(
        "watchdog: a step, evaluation or checkpoint over max(%g s, %g × its median) ends the "
        "job, naming the ranks that did not arrive (%s)\n",
        static_cast<double>(config_.watchdog_floor_s),
        static_cast<double>(config_.watchdog_multiple), hang_report_path(out).c_str());
    std::fflush(stdout);
  }
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

  if (is_root()) announce(out, plan_text);
  std::optional<Watchdog> watchdog;
  if (config_.watchdog && world_.size() > 1) start_watchdog(out, &watchdog);
  const auto watch = [&](const char* phase, int64_t step) {
    if (watchdog) watchdog->enter(phase, step);
  };
  // A fresh run supersedes any memory copies an earlier run in this directory left.
  if (step_ == 0) clear_memory_checkpoints();

  double recent_step_time = 0;  // exponential moving average, for the ETA
  while (step_ < config_.steps) {
    watch("step", step_ + 1);
    const StepStats s = train_step();
    if (!std::isfinite(s.loss) || !std::isfinite(s.grad_norm)) stop_diverged(s);
    poll_checkpoint();  // commits a background save once every rank has written its part
    recent_step_time =
        recent_step_time == 0 ? s.step_time_s : 0.9 * recent_step_time + 0.1 * s.step_time_s;
    const double eta = recent_step_time * static_cast<double>(config_.steps - step_);
    if (is_root()) log_step(s, eta, plan_text, *metrics);
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
      save(checkpoints);
    }
    if (!last) {
      watch("checkpoint", step_);
      save_to_memory_if_due(recent_step_time);
    }

    // A stop request on any rank stops every rank here, after the same step. One small
    // all-reduce per step; the checkpoint is of the step every rank has finished.
    const int signal = agreed_stop_signal();
    if (signal != 0 && !last) {
      if (!saved) watch("checkpoint", step_);
      stop_for_signal(signal, saved, out);
      return signal;
    }
  }
  finish_checkpoint();
  clear_memory_checkpoints();  // the run is over
  report_memory_checkpoints();
  return 0;
}

void Trainer::stop_for_signal(int signal, bool saved, const std::filesystem::path& out) {
  StopSignals::unblock_output();
  if (!saved) save(out / "checkpoints");
  finish_checkpoint();
  clear_memory_checkpoints();  // the checkpoint of this step supersedes them
  if (is_root()) {
    std::printf("stopped by %s after step %lld of %lld; continue with: malleus train --resume %s\n",
                StopSignals::name(signal).c_str(), static_cast<long long>(step_),
                static_cast<long long>(config_.steps), out.c_str());
    std::fflush(stdout);
  }
  // Every rank exits only once rank 0 has written the checkpoint: mpirun ends the whole job as
  // soon as one rank exits with a non-zero status.
  world_.barrier();
}

void Trainer::stop_diverged(const StepStats& s) {
  // Every rank sees the same loss and norm (the step's all-reduce), so every rank is here. The
  // save in flight holds an earlier step's state (the update waited for its copy): commit it.
  finish_checkpoint();
  char figures[128];
  std::snprintf(figures, sizeof figures, "the %s is not finite (loss %g, gradient norm %g)",
                std::isfinite(s.loss) ? "gradient norm" : "loss", s.loss, s.grad_norm);
  const std::string resume =
      writer_.last() ? "the last checkpoint, " + writer_.last()->dir.string() +
                           ", is intact: continue from it with malleus train --resume " +
                           config_.out_dir + " (with a lower --lr or a --grad-clip)"
                     : "this run saved no checkpoint";
  clear_memory_checkpoints();  // the run is over: its last checkpoint is where to go on from
  world_.barrier();            // no rank leaves while another still commits
  throw Diverged("step " + std::to_string(s.step) + " of " + std::to_string(config_.steps) + ": " +
                 figures + "; training stopped without updating the model or saving this step; " +
                 resume);
}

int Trainer::agreed_stop_signal() {
  return static_cast<int>(world_.all_reduce_max(static_cast<double>(StopSignals::received())));
}

Checkpoint load_checkpoint_on_root(const std::filesystem::path& dir, comm::Communicator& world,
                                   bool with_optimizer) {
  // Rank 0 reads the manifest and sends its text: no rank opens a checkpoint's files before
  // rank 0 has found it complete. A single-file checkpoint is then read on rank 0 whole; a
  // sharded one by every rank for itself (Trainer::restore).
  std::string text, error;
  if (world.rank() == 0) {
    try {
      text = CheckpointIndex(dir).manifest_text();
    } catch (const Error& e) {
      error = e.what();
    }
  }
  if (world.size() > 1) {
    error = world.broadcast_text(error, 0);
    if (error.empty()) text = world.broadcast_text(text, 0);
  }
  if (!error.empty()) throw Error(error);
  auto index = std::make_shared<const CheckpointIndex>(dir, text);
  Checkpoint checkpoint;
  error.clear();
  if (world.rank() == 0) {
    try {
      if (index->sharded()) {
        check(!with_optimizer || index->has_optimizer(),
              "checkpoint " + dir.string() + ": has no optimizer state");
        checkpoint = index->header();
        checkpoint.tokenizer = tokenizer::load_saved_tokenizer(dir);
      } else {
        checkpoint = load_checkpoint(dir, with_optimizer);
      }
    } catch (const Error& e) {
      error = e.what();
    }
  }
  if (world.size() > 1) error = world.broadcast_text(error, 0);
  if (!error.empty()) throw Error(error);
  if (world.rank() != 0) checkpoint = index->header();
  if (index->sharded()) checkpoint.sharded = index;
  return checkpoint;
}

}  // namespace malleus::train
