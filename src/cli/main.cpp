// The `malleus` command: one binary, one subcommand per job.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <optional>

#include "common/error.h"
#include "common/json.h"
#include "data/dataset.h"
#include "data/prepare.h"
#include "model/config.h"
#include "train/checkpoint.h"
#include "train/export.h"
#include "train/metrics.h"
#include "train/trainer.h"

namespace fs = std::filesystem;
using namespace malleus;

namespace {

// Flags that override single fields of a training config; unset flags leave the config alone.
struct TrainOverrides {
  std::optional<std::string> model, train_data, val_data, out_dir;
  std::optional<int> seq_len, micro_batch, global_batch, threads;
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
    if (seed) c.seed = *seed;
  }
};

// A checkpoint directory, or a run directory / checkpoint root whose latest checkpoint is meant.
fs::path resolve_checkpoint(const fs::path& path) {
  if (fs::exists(path / "manifest.json")) return path;
  for (const fs::path& root : {path / "checkpoints", path}) {
    if (auto latest = train::latest_checkpoint(root)) return *latest;
  }
  throw Error(path.string() + " is not a checkpoint and holds no checkpoints/latest");
}

void run_train(const std::string& config_file, const std::string& resume,
               const TrainOverrides& overrides) {
  std::optional<train::Checkpoint> checkpoint;
  train::TrainConfig config;
  if (!resume.empty()) {
    const fs::path dir = resolve_checkpoint(resume);
    checkpoint = train::load_checkpoint(dir);
    config =
        train::TrainConfig::from_json(checkpoint->train_config, (dir / "manifest.json").string());
    std::printf("resuming from %s at step %lld\n", dir.c_str(),
                static_cast<long long>(checkpoint->step));
  } else if (!config_file.empty()) {
    config = train::TrainConfig::from_json(read_json_file(config_file), config_file);
  }
  overrides.apply(config);
  config.validate("training config");
  const model::ModelConfig model =
      checkpoint ? checkpoint->model : model::load_model_config(config.model);
  train::Trainer trainer(config, model);
  if (checkpoint) trainer.restore(*checkpoint);
  trainer.run();
}

void run_eval(const std::string& checkpoint_path, const std::string& data, int samples,
              int micro_batch, int seq_len, int threads) {
  const fs::path dir = resolve_checkpoint(checkpoint_path);
  const train::Checkpoint checkpoint = train::load_checkpoint(dir, /*with_optimizer=*/false);
  if (seq_len == 0) {
    seq_len = train::TrainConfig::from_json(checkpoint.train_config, dir.string()).seq_len;
  }
  auto backend = backend::make_cpu_backend<float>(train::resolve_threads(threads));
  model::Transformer<float> model(checkpoint.model, *backend, micro_batch, seq_len);
  backend->copy_from_host(model.params(), checkpoint.params.data(), checkpoint.params.size());
  data::TokenDataset dataset(data, checkpoint.model.vocab_size);
  const double loss = train::evaluate_loss(model, dataset, samples);
  std::printf("checkpoint %s (step %lld) on %s: mean loss %.6f over %d-token sequences\n",
              dir.c_str(), static_cast<long long>(checkpoint.step), data.c_str(), loss, seq_len);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"malleus: hybrid-parallel, straggler-tolerant LLM training (single-rank trainer)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "malleus 0.1.0");

  // train
  auto* train_cmd = app.add_subcommand("train",
                                       "Train a model (default: the demo model on the "
                                       "fortunes corpus prepared by prepare-data)");
  std::string config_file, resume;
  TrainOverrides overrides;
  train_cmd->add_option("--config", config_file, "Training config JSON (default: built-in demo)")
      ->check(CLI::ExistingFile);
  train_cmd->add_option("--resume", resume,
                        "Continue from a checkpoint, or the latest one of a run directory");
  overrides.add_to(*train_cmd);

  // prepare-data
  auto* prepare_cmd = app.add_subcommand("prepare-data", "Tokenize text files into token shards");
  data::PrepareOptions prepare;
  prepare.inputs = {"/usr/share/games/fortunes"};
  prepare.output_dir = "data/fortunes";
  prepare.document_separator = "%";
  prepare_cmd->add_option("--input", prepare.inputs, "Text files or directories")
      ->capture_default_str();
  prepare_cmd->add_option("--output", prepare.output_dir, "Output directory")
      ->capture_default_str();
  prepare_cmd
      ->add_option("--separator", prepare.document_separator,
                   "A line equal to this ends a document (\"\": one file, one document)")
      ->capture_default_str();
  prepare_cmd
      ->add_option("--val-fraction", prepare.val_fraction, "Share of documents for validation")
      ->check(CLI::Range(0.0, 0.5))
      ->capture_default_str();
  prepare_cmd->add_option("--shard-tokens", prepare.shard_tokens, "Maximum tokens per shard")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();

  // eval
  auto* eval_cmd =
      app.add_subcommand("eval", "Print the mean loss of a checkpoint on token shards");
  std::string eval_checkpoint, eval_data = "data/fortunes/val_*.bin";
  int eval_samples = 1 << 30, eval_micro = 8, eval_seq = 0, eval_threads = 0;
  eval_cmd->add_option("--checkpoint", eval_checkpoint, "Checkpoint, or run directory")->required();
  eval_cmd->add_option("--data", eval_data, "Shards (file or wildcard pattern)")
      ->capture_default_str();
  eval_cmd->add_option("--samples", eval_samples, "At most this many sequences (default: all)");
  eval_cmd->add_option("--micro-batch", eval_micro, "Sequences per forward pass")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  eval_cmd->add_option("--seq-len", eval_seq, "Tokens per sequence (default: the training one)");
  eval_cmd->add_option("--threads", eval_threads, "Compute threads (0: all cores)");

  // export
  auto* export_cmd = app.add_subcommand(
      "export", "Write a checkpoint as Hugging Face LlamaForCausalLM (safetensors + config.json)");
  std::string export_checkpoint, export_dir;
  export_cmd->add_option("--checkpoint", export_checkpoint, "Checkpoint, or run directory")
      ->required();
  export_cmd->add_option("--output", export_dir, "Output directory")->required();

  // models
  auto* models_cmd = app.add_subcommand("models", "List the built-in model presets");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  try {
    if (*train_cmd) {
      run_train(config_file, resume, overrides);
    } else if (*prepare_cmd) {
      const data::PrepareSummary s = data::prepare_data(prepare);
      std::printf(
          "prepared %lld documents from %lld files: %lld train tokens, %lld val tokens in "
          "%zu shards under %s\n",
          static_cast<long long>(s.documents), static_cast<long long>(s.files),
          static_cast<long long>(s.train_tokens), static_cast<long long>(s.val_tokens),
          s.shards.size(), prepare.output_dir.c_str());
    } else if (*eval_cmd) {
      run_eval(eval_checkpoint, eval_data, eval_samples, eval_micro, eval_seq, eval_threads);
    } else if (*export_cmd) {
      const fs::path dir = resolve_checkpoint(export_checkpoint);
      train::export_hf(train::load_checkpoint(dir, /*with_optimizer=*/false), export_dir);
      std::printf("exported %s to %s (model.safetensors, config.json)\n", dir.c_str(),
                  export_dir.c_str());
    } else if (*models_cmd) {
      std::printf("%-12s %10s %7s %7s %6s %5s %7s %7s\n", "preset", "params", "layers", "hidden",
                  "heads", "kv", "ffn", "vocab");
      for (const auto& name : model::model_preset_names()) {
        const auto c = model::load_model_config(name);
        std::printf("%-12s %10s %7d %7d %6d %5d %7d %7d\n", name.c_str(),
                    train::format_count(static_cast<double>(c.num_parameters())).c_str(),
                    c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.ffn_hidden_size,
                    c.vocab_size);
      }
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
