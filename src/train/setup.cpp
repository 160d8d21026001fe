#include "train/setup.h"

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <thread>

#include "checkpoint/checkpoint.h"
#include "checkpoint/memory_checkpoint.h"
#include "comm/staging.h"
#include "common/error.h"
#include "common/files.h"
#include "common/format.h"
#include "common/slurm_lists.h"
#include "common/system.h"
#include "device/device.h"
#include "layout/grad_sync_plan.h"
#include "layout/layout.h"
#include "layout/optimizer_shard.h"
#include "plan/planner.h"

namespace malleus::train {

int ranks_on_this_node(int world_size) {
  if (const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE"))
    return std::max(1, std::atoi(local));
  // srun: this node's entry (SLURM_NODEID, counted in the step) of the step's tasks per node.
  const char* per_node = std::getenv("SLURM_STEP_TASKS_PER_NODE");
  const char* node = std::getenv("SLURM_NODEID");
  if (per_node != nullptr && node != nullptr) {
    const std::vector<int> tasks = expand_counts(per_node, "SLURM_STEP_TASKS_PER_NODE");
    const int index = std::atoi(node);
    if (index >= 0 && index < static_cast<int>(tasks.size())) return std::max(1, tasks[index]);
  }
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

std::string open_devices(const TrainConfig& c, const comm::Communicator& world,
                         runtime::EngineOptions* options) {
  device::Device device;
  comm::agree_on_error(world, comm::error_of([&] {
                         device = device::open_device(c.backend_choice(), device::local_rank());
                       }));
  options->make_backend = device.make_backend;
  const std::vector<std::string> all = world.gather_text(device.description, 0);
  if (world.rank() != 0 || device.kind == device::BackendKind::kCpu) return "";
  // Ranks on the same device in one entry: "ranks 0, 1: cuda device 0 (...)".
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (size_t r = 0; r < all.size(); ++r) {
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == all[r]; });
    if (it == groups.end()) it = groups.insert(groups.end(), {all[r], {}});
    it->second.push_back(static_cast<int>(r));
  }
  std::string line = "devices:";
  for (const auto& [what, ranks] : groups) {
    if (line.size() > 8) line += ';';
    line += ranks.size() == 1 ? " rank " : " ranks ";
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (i > 0) line += ", ";
      line += std::to_string(ranks[i]);
    }
    line += ": ";
    line += what;
  }
  // How the device's buffers meet MPI: staged through host memory, or given to a CUDA-aware MPI.
  if (device.memory) line += "\ncommunication: " + comm::transport_text(*device.memory);
  return line;
}

EngineSetup set_up_engine(const TrainConfig& config, const model::ModelConfig& model,
                          const comm::Communicator& world) {
  config.validate("training config");
  check(config.seq_len <= model.max_seq_len, "\"seq_len\" " + std::to_string(config.seq_len) +
                                                 " exceeds the model's max_seq_len " +
                                                 std::to_string(model.max_seq_len));
  EngineSetup setup;
  setup.plan = resolve_plan(config, model, world.size());
  setup.options = engine_options(config, world.size());
  setup.devices_line = open_devices(config, world, &setup.options);
  // Collective: each rank's host, which the memory check needs too (where the memory copies go).
  setup.options.hosts = runtime::host_indices(world);
  if (const int64_t available = available_memory_bytes(); available > 0) {
    check_model_state_fits(model, setup.plan, world.rank(), config.distributed_optimizer, available,
                           ranks_on_this_node(world.size()),
                           config.memory_checkpoints ? &setup.options.hosts : nullptr);
  }
  setup.cores = runtime::CoreSharing::detect(world, setup.options.threads);
  setup.options.core_lease = setup.cores.lease;
  return setup;
}

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
  const std::vector<checkpoint::SavedKind> saved =
      checkpoint::saved_state(model, sync.pieces, rank, *mine, nullptr, &moment_blocks, nullptr,
                              nullptr, bytes.moments_split);
  bytes.checkpoint_copy = kFloat * checkpoint::snapshot_elements(saved);
  return bytes;
}

namespace {

// The memory copies' part of what rank `rank` holds (checkpoint::memory_copy_bytes).
checkpoint::MemoryCopyBytes memory_copies_need(const model::ModelConfig& model,
                                               const plan::Plan& plan, int rank,
                                               bool distributed_optimizer,
                                               const ModelStateBytes& need,
                                               const std::vector<int>& hosts) {
  // Its own shard, and the shard of the rank whose copy it receives: the only two it holds.
  const checkpoint::MemoryHolders holders = checkpoint::memory_holders(hosts, rank);
  std::vector<int64_t> shards(hosts.size(), 0);
  shards.at(static_cast<size_t>(rank)) = need.checkpoint_copy;
  if (holders.source != rank) {
    shards.at(static_cast<size_t>(holders.source)) =
        model_state_bytes(model, plan, holders.source, distributed_optimizer).checkpoint_copy;
  }
  return checkpoint::memory_copy_bytes(hosts, rank, shards);
}

}  // namespace

void check_model_state_fits(const model::ModelConfig& model, const plan::Plan& plan, int rank,
                            bool distributed_optimizer, int64_t available_bytes, int ranks_here,
                            const std::vector<int>* memory_hosts) {
  const ModelStateBytes need = model_state_bytes(model, plan, rank, distributed_optimizer);
  const checkpoint::MemoryCopyBytes copies =
      memory_hosts
          ? memory_copies_need(model, plan, rank, distributed_optimizer, need, *memory_hosts)
          : checkpoint::MemoryCopyBytes{};
  const double share = static_cast<double>(available_bytes) / std::max(1, ranks_here);
  if (static_cast<double>(need.total() + copies.total()) <= share) return;
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
  throw Error(
      "model \"" + model.name + "\" (" + format_count(static_cast<double>(model.num_parameters())) +
      " parameters) does not fit: under this plan rank " + std::to_string(rank) + " holds " +
      format_count(held) + " parameter elements, " + parts + " (plus " +
      format_bytes(static_cast<double>(need.checkpoint_copy)) + " for its part of a checkpoint" +
      (memory_hosts
           ? ", and " + format_bytes(static_cast<double>(copies.total())) +
                 " for memory checkpoints: " + format_bytes(static_cast<double>(copies.buffers)) +
                 " of host buffers and " + format_bytes(static_cast<double>(copies.files)) +
                 " of copies in host memory, two steps' while a save replaces "
                 "the last"
           : std::string()) +
      "), but this machine has " + format_bytes(static_cast<double>(available_bytes)) +
      " available" +
      (ranks_here > 1 ? ", " + format_bytes(share) + " for each of its " +
                            std::to_string(ranks_here) + " ranks"
                      : "") +
      ": use more ranks, a plan that shards the model further, or a smaller model" +
      (memory_hosts ? std::string(" (or --no-memory-checkpoints)") : std::string()));
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

plan::BatchConfig batch_config(const TrainConfig& config) {
  plan::BatchConfig batch;
  batch.global_batch = config.global_batch_size;
  batch.micro_batch = config.micro_batch_size;
  batch.seq_len = config.seq_len;
  return batch;
}

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

std::unique_ptr<elastic::StragglerLoop> make_straggler_loop(const TrainConfig& config,
                                                            const model::ModelConfig& model,
                                                            const plan::Plan& plan,
                                                            const std::vector<int>& hosts,
                                                            int threads) {
  const auto world_size = static_cast<int>(hosts.size());
  elastic::LoopOptions options;
  options.monitor.window = config.monitor_window;
  options.controller.horizon_steps = config.replan_horizon;
  options.controller.min_samples = config.monitor_window;
  options.replan = config.replan;
  options.plan_links = config.replan_links;
  std::optional<plan::Profile> profile;
  if (!config.profile.empty()) {
    const int ranks = ranks_on_this_node(world_size);
    const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    profile = elastic::shared_profile(
        plan::Profile::from_json(read_json_file(config.profile), config.profile),
        std::min(1.0, static_cast<double>(cores) / (ranks * threads)));
  }
  const plan::ClusterSpec cluster = elastic::local_cluster(config.cluster, world_size);
  // Ranks fill nodes in order, as `--map-by ppr:K:node` starts them. The reference of a healthy
  // link is what the cluster file says the probe takes, so busy first steps cannot set one that
  // hides a link slowed later.
  if (*std::max_element(hosts.begin(), hosts.end()) > 0) {
    for (int r = 0; r < world_size; ++r) options.node_of_rank.push_back(cluster.node_of(r));
  }
  plan::CostModel cost(model, cluster, batch_config(config), profile);
  cost.set_shifted_recompute(config.shifted_recompute);
  cost.set_tp_subpipeline(config.tp_subpipeline);
  cost.use_distributed_optimizer(config.distributed_optimizer);
  return std::make_unique<elastic::StragglerLoop>(std::move(cost), plan, std::move(options));
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

std::shared_ptr<const tokenizer::Tokenizer> check_resumable(
    const checkpoint::Checkpoint& checkpoint, const model::ModelConfig& model,
    std::shared_ptr<const tokenizer::Tokenizer> tokenizer, const std::string& train_data) {
  if (checkpoint.tokenizer && tokenizer) {
    check(tokenizer::same_tokenizer(*checkpoint.tokenizer, *tokenizer),
          "the checkpoint's model was trained with a " + checkpoint.tokenizer->describe() +
              ", but the training data " + train_data + " was made with a different " +
              tokenizer->describe());
  } else if (checkpoint.tokenizer) {
    tokenizer = checkpoint.tokenizer;  // data from elsewhere (e.g. llm.c): keep the record
  }
  model::ModelConfig expected = model;
  if (!checkpoint.tokenizer && tokenizer) {
    // Written before its data recorded a tokenizer: its config has no special ids yet, and the
    // run goes on with the fitted ones.
    expected.bos_token_id = checkpoint.model.bos_token_id;
    expected.eos_token_id = checkpoint.model.eos_token_id;
    expected.pad_token_id = checkpoint.model.pad_token_id;
  }
  check(checkpoint.model.to_json() == expected.to_json(),
        "checkpoint model " + checkpoint.model.to_json().dump() +
            " differs from the configured model " + expected.to_json().dump());
  return tokenizer;
}

}  // namespace malleus::train
