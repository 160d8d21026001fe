// train, prepare-data, eval, export, models.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>

#include "cli/commands.h"
#include "comm/communicator.h"
#include "comm/mpi_session.h"
#include "common/error.h"
#include "common/json.h"
#include "data/dataset.h"
#include "data/prepare.h"
#include "model/config.h"
#include "plan/plan.h"
#include "runtime/engine.h"
#include "train/checkpoint.h"
#include "train/export.h"
#include "train/metrics.h"
#include "train/trainer.h"

namespace malleus::cli {

namespace fs = std::filesystem;

namespace {

// Flags that override single fields of a training config; unset flags leave the config alone.
struct TrainOverrides {
  std::optional<std::string> model, train_data, val_data, out_dir;
  std::optional<std::string> plan, cluster, profile, straggler_trace;
  std::vector<std::string> stragglers;
  bool no_replan = false;
  std::optional<int> seq_len, micro_batch, global_batch, threads, dp, tp, pp;
  std::optional<int64_t> steps, warmup_steps, eval_every, checkpoint_every;
  std::optional<float> lr;
  std::optional<uint64_t> seed;

  void add_to(CLI::App& app) {
    // A flag given twice takes its last value, so scripts can append overrides.
    app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    app.add_option("--model", model, "Model preset or JSON file");
    app.add_option("--train-data", train_data, "Training shards (file or wildcard pattern)");
    app.add_option("--val-data", val_data, "Validation shards; \"\" disables evaluation");
    app.add_option("--out", out_dir, "Run directory: metrics.jsonl and checkpoints/");
    app.add_option("--seq-len", seq_len, "Tokens per sequence");
    app.add_option("--micro-batch", micro_batch, "Sequences per micro-batch");
    app.add_option("--global-batch", global_batch, "Sequences per optimizer step");
    app.add_option("--threads", threads, "Compute threads (0: all cores)");
    app.add_option("--steps", steps, "Total optimizer steps of the run");
    app.add_option("--warmup-steps", warmup_steps, "Linear LR warmup steps");
    app.add_option("--eval-every", eval_every, "Evaluate every N steps (0: only at the end)");
    app.add_option("--checkpoint-every", checkpoint_every,
                   "Checkpoint every N steps (0: at the end)");
    app.add_option("--lr", lr, "Peak learning rate");
    app.add_option("--plan", plan, "Parallel plan file (docs/plan-format.md)");
    app.add_option("--dp", dp, "Pipelines of the uniform plan (default: as many as fit)");
    app.add_option("--tp", tp, "Tensor-parallel degree of the uniform plan");
    app.add_option("--pp", pp, "Pipeline stages of the uniform plan");
    app.add_option("--straggler", stragglers,
                   "Inject a straggler: RANK:RATE:FROM-TO (steps, inclusive); repeatable")
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
    app.add_option("--straggler-trace", straggler_trace, "Injected straggler trace (JSON)");
    app.add_flag("--no-replan", no_replan, "Keep the starting plan whatever the rates");
    app.add_option("--cluster", cluster, "Cluster preset or file the controller plans for");
    app.add_option("--profile", profile,
                   "Measured layer times (malleus profile) for the controller");
    app.add_option("--seed", seed, "Seed of initialisation and data order");
  }
  void apply(train::TrainConfig& c) const {
    if (model) c.model = *model;
    if (train_data) c.train_data = *train_data;
    if (val_data) c.val_data = *val_data;
    if (out_dir) c.out_dir = *out_dir;
    if (seq_len) c.seq_len = *seq_len;
    if (micro_batch) c.micro_batch_size = *micro_batch;
    if (global_batch) c.global_batch_size = *global_batch;
    if (threads) c.threads = *threads;
    if (steps) c.steps = *steps;
    if (warmup_steps) c.warmup_steps = *warmup_steps;
    if (eval_every) c.eval_every = *eval_every;
    if (checkpoint_every) c.checkpoint_every = *checkpoint_every;
    if (lr) c.lr = *lr;
    if (plan) c.plan = *plan;
    if (dp) c.dp = *dp;
    if (tp) c.tp = *tp;
    if (pp) c.pp = *pp;
    if (!stragglers.empty()) c.stragglers = stragglers;
    if (straggler_trace) c.straggler_trace = *straggler_trace;
    if (no_replan) c.replan = false;
    if (cluster) c.cluster = *cluster;
    if (profile) c.profile = *profile;
    if (seed) c.seed = *seed;
  }
};

// Runs `body` with MPI up. On error with several ranks, every rank stops (MPI_Abort) so none is
// left waiting in a collective; a single rank just reports the error.
template <typename Body>
void with_mpi(Body&& body) {
  comm::MpiSession session;
  comm::Communicator world = comm::Communicator::world();
  try {
    body(world);
  } catch (const std::exception& e) {
    if (world.size() == 1) throw;
    std::fprintf(stderr, "error: [rank %d] %s\n", world.rank(), e.what());
    std::fflush(stderr);
    world.abort(1);
  }
}

void run_train(const std::string& config_file, const std::string& resume,
               const TrainOverrides& overrides) {
  with_mpi([&](comm::Communicator& world) {
    std::optional<train::Checkpoint> checkpoint;
    train::TrainConfig config;
    if (!resume.empty()) {
      const fs::path dir = train::resolve_checkpoint(resume);
      checkpoint = train::load_checkpoint_on_root(dir, world);
      config =
          train::TrainConfig::from_json(checkpoint->train_config, (dir / "manifest.json").string());
      if (world.rank() == 0) {
        std::printf("resuming from %s at step %lld\n", dir.c_str(),
                    static_cast<long long>(checkpoint->step));
      }
    } else if (!config_file.empty()) {
      config = train::TrainConfig::from_json(read_json_file(config_file), config_file);
    }
    overrides.apply(config);
    config.validate("training config");
    const model::ModelConfig model =
        checkpoint ? checkpoint->model : model::load_model_config(config.model);
    train::Trainer trainer(config, model, world);
    if (checkpoint) trainer.restore(*checkpoint);
    trainer.run();
  });
}

void run_eval(const std::string& checkpoint_path, const std::string& data, int samples,
              int micro_batch, int seq_len, int threads) {
  with_mpi([&](comm::Communicator& world) {
    check(world.size() == 1, "eval runs on one rank");
    const fs::path dir = train::resolve_checkpoint(checkpoint_path);
    train::Checkpoint checkpoint = train::load_checkpoint(dir, /*with_optimizer=*/false);
    if (seq_len == 0) {
      seq_len = train::TrainConfig::from_json(checkpoint.train_config, dir.string()).seq_len;
    }
    const auto plan = plan::uniform_plan(checkpoint.model, 1, 1, 1, micro_batch, micro_batch);
    runtime::EngineOptions options;
    options.seq_len = seq_len;
    options.threads = train::resolve_threads(threads, 1);
    runtime::Engine engine(checkpoint.model, plan, world, options);
    runtime::FullState state;
    state.adam_m.assign(checkpoint.params.size(), 0.0f);  // evaluation needs no moments
    state.adam_v.assign(checkpoint.params.size(), 0.0f);
    state.params = std::move(checkpoint.params);
    engine.scatter(state, checkpoint.step);
    data::TokenDataset dataset(data, checkpoint.model.vocab_size);
    data::Sampler sampler(dataset, seq_len, /*seed=*/0);
    const int count = static_cast<int>(std::min<int64_t>(samples, sampler.windows_per_epoch()));
    const double loss =
        engine.evaluate([&](int index, int32_t* inputs,
                            int32_t* targets) { sampler.sample(index, inputs, targets); },
                        count);
    std::printf("checkpoint %s (step %lld) on %s: mean loss %.6f over %d sequences of %d tokens\n",
                dir.c_str(), static_cast<long long>(checkpoint.step), data.c_str(), loss, count,
                seq_len);
  });
}

}  // namespace

void add_training_commands(CLI::App& app) {
  // train
  struct TrainArgs {
    std::string config_file, resume;
    TrainOverrides overrides;
  };
  auto train_args = std::make_shared<TrainArgs>();
  auto* train_cmd = app.add_subcommand("train",
                                       "Train a model (default: the demo model on the "
                                       "fortunes corpus prepared by prepare-data)");
  train_cmd
      ->add_option("--config", train_args->config_file,
                   "Training config JSON (default: built-in demo)")
      ->check(CLI::ExistingFile);
  train_cmd->add_option("--resume", train_args->resume,
                        "Continue from a checkpoint, or the latest one of a run directory");
  train_args->overrides.add_to(*train_cmd);
  train_cmd->callback([train_args] {
    run_train(train_args->config_file, train_args->resume, train_args->overrides);
  });

  // prepare-data
  auto prepare = std::make_shared<data::PrepareOptions>();
  prepare->inputs = {"/usr/share/games/fortunes"};
  prepare->output_dir = "data/fortunes";
  prepare->document_separator = "%";
  auto* prepare_cmd = app.add_subcommand("prepare-data", "Tokenize text files into token shards");
  prepare_cmd->add_option("--input", prepare->inputs, "Text files or directories")
      ->capture_default_str();
  prepare_cmd->add_option("--output", prepare->output_dir, "Output directory")
      ->capture_default_str();
  prepare_cmd
      ->add_option("--separator", prepare->document_separator,
                   "A line equal to this ends a document (\"\": one file, one document)")
      ->capture_default_str();
  prepare_cmd
      ->add_option("--val-fraction", prepare->val_fraction, "Share of documents for validation")
      ->check(CLI::Range(0.0, 0.5))
      ->capture_default_str();
  prepare_cmd->add_option("--shard-tokens", prepare->shard_tokens, "Maximum tokens per shard")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  auto tokenizer_name = std::make_shared<std::string>("byte");
  prepare_cmd
      ->add_option("--tokenizer", *tokenizer_name,
                   "\"byte\" or a SentencePiece .model file (e.g. from train-tokenizer)")
      ->capture_default_str();
  prepare_cmd->callback([prepare, tokenizer_name] {
    prepare->tokenizer = tokenizer::load_tokenizer(*tokenizer_name);
    const data::PrepareSummary s = data::prepare_data(*prepare);
    std::printf(
        "prepared %lld documents from %lld files: %lld train tokens, %lld val tokens in %zu "
        "shards under %s (%s)\n",
        static_cast<long long>(s.documents), static_cast<long long>(s.files),
        static_cast<long long>(s.train_tokens), static_cast<long long>(s.val_tokens),
        s.shards.size(), prepare->output_dir.c_str(), prepare->tokenizer->describe().c_str());
  });

  // eval
  struct EvalArgs {
    std::string checkpoint, data = "data/fortunes/val_*.bin";
    int samples = 1 << 30, micro_batch = 8, seq_len = 0, threads = 0;
  };
  auto eval_args = std::make_shared<EvalArgs>();
  auto* eval_cmd =
      app.add_subcommand("eval", "Print the mean loss of a checkpoint on token shards");
  eval_cmd->add_option("--checkpoint", eval_args->checkpoint, "Checkpoint, or run directory")
      ->required();
  eval_cmd->add_option("--data", eval_args->data, "Shards (file or wildcard pattern)")
      ->capture_default_str();
  eval_cmd->add_option("--samples", eval_args->samples,
                       "At most this many sequences (default: all)");
  eval_cmd->add_option("--micro-batch", eval_args->micro_batch, "Sequences per forward pass")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  eval_cmd->add_option("--seq-len", eval_args->seq_len,
                       "Tokens per sequence (default: the training one)");
  eval_cmd->add_option("--threads", eval_args->threads, "Compute threads (0: all cores)");
  eval_cmd->callback([eval_args] {
    run_eval(eval_args->checkpoint, eval_args->data, eval_args->samples, eval_args->micro_batch,
             eval_args->seq_len, eval_args->threads);
  });

  // export
  struct ExportArgs {
    std::string checkpoint, output;
  };
  auto export_args = std::make_shared<ExportArgs>();
  auto* export_cmd = app.add_subcommand(
      "export", "Write a checkpoint as Hugging Face LlamaForCausalLM (safetensors + config.json)");
  export_cmd->add_option("--checkpoint", export_args->checkpoint, "Checkpoint, or run directory")
      ->required();
  export_cmd->add_option("--output", export_args->output, "Output directory")->required();
  export_cmd->callback([export_args] {
    const fs::path dir = train::resolve_checkpoint(export_args->checkpoint);
    train::export_hf(train::load_checkpoint(dir, /*with_optimizer=*/false), export_args->output);
    std::printf("exported %s to %s\n", dir.c_str(), export_args->output.c_str());
  });

  // models
  app.add_subcommand("models", "List the built-in model presets")->callback([] {
    std::printf("%-12s %10s %7s %7s %6s %5s %7s %7s\n", "preset", "params", "layers", "hidden",
                "heads", "kv", "ffn", "vocab");
    for (const auto& name : model::model_preset_names()) {
      const auto c = model::load_model_config(name);
      std::printf("%-12s %10s %7d %7d %6d %5d %7d %7d\n", name.c_str(),
                  train::format_count(static_cast<double>(c.num_parameters())).c_str(),
                  c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.ffn_hidden_size,
                  c.vocab_size);
    }
  });
}

}  // namespace malleus::cli
