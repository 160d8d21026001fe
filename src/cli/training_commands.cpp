// train, prepare-data, eval, export, models.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <thread>
#include <type_traits>

#include "checkpoint/checkpoint.h"
#include "checkpoint/memory_checkpoint.h"
#include "cli/commands.h"
#include "comm/communicator.h"
#include "comm/mpi_session.h"
#include "common/error.h"
#include "common/format.h"
#include "common/json.h"
#include "data/dataset.h"
#include "data/prepare.h"
#include "hf/export.h"
#include "launch/slurm.h"
#include "metrics/metrics.h"
#include "model/config.h"
#include "plan/plan.h"
#include "runtime/engine.h"
#include "train/resume.h"
#include "train/run_directory.h"
#include "train/stop_signal.h"
#include "train/trainer.h"

namespace malleus::cli {

namespace fs = std::filesystem;

namespace {

// The flags of every training-config field, registered from the field table
// (train::TrainConfig::fields()), so a field added there is a flag here too.
class TrainOverrides {
 public:
  void add_to(CLI::App& app) {
    const train::TrainConfig defaults;
    for (const train::ConfigField& f : train::TrainConfig::fields()) {
      CLI::Option* option = nullptr;
      switch (f.kind) {
        case train::ConfigField::Kind::kSwitch:
          option = app.add_flag(f.flag + ",!--no-" + f.flag.substr(2));
          break;
        case train::ConfigField::Kind::kList:
          option = app.add_option(f.flag)->expected(1)->multi_option_policy(
              CLI::MultiOptionPolicy::TakeAll);
          break;
        case train::ConfigField::Kind::kValue:
          // A flag given twice takes its last value, so scripts can append overrides.
          option = app.add_option(f.flag)
                       ->type_name(f.type_name)
                       ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
          break;
      }
      option->description(f.help);
      const Json fallback = f.write(defaults);
      if (fallback.is_string()) {
        option->default_str(fallback.get<std::string>());
      } else if (fallback.is_number_float()) {
        char text[32];  // 0.002, not the float's exact 0.0020000000949949026
        std::snprintf(text, sizeof text, "%g", fallback.get<double>());
        option->default_str(text);
      } else if (!fallback.is_array()) {
        option->default_str(fallback.dump());
      }
      options_.emplace_back(&f, option);
    }
  }

  // The flags given, each converted and checked on its own: a malformed value (a straggler spec,
  // a number) is reported before any file is read.
  train::ConfigValues values() const {
    train::ConfigValues values;
    for (const auto& [field, option] : options_) {
      if (option->count() == 0) continue;
      values.push_back({field, field->from_texts(option->results(), field->flag), field->flag});
      train::TrainConfig scratch;
      field->read(scratch, values.back().value, field->flag);
    }
    return values;
  }

 private:
  std::vector<std::pair<const train::ConfigField*, CLI::Option*>> options_;
};

// Runs `body` with MPI up and returns what it returns. On error with several ranks, every rank
// stops (MPI_Abort) so none is left waiting in a collective; a single rank just reports the
// error. On success the ranks meet in a barrier before MPI_Finalize: Open MPI 4.1's finalize can
// crash in its TCP transport's teardown when ranks reach it apart (open-mpi/ompi#10313; seen
// once here, rank 1 of a restarted job in mca_btl_tcp_finalize).
template <typename Body>
auto with_mpi(Body&& body) {
  comm::MpiSession session;
  comm::Communicator world = comm::Communicator::world();
  const auto meet = [&world] {
    if (world.size() > 1) world.barrier();
  };
  try {
    if constexpr (std::is_void_v<std::invoke_result_t<Body&, comm::Communicator&>>) {
      body(world);
      meet();
    } else {
      auto result = body(world);
      meet();
      return result;
    }
  } catch (const std::exception& e) {
    if (world.size() == 1) throw;
    std::fprintf(stderr, "error: [rank %d] %s\n", world.rank(), e.what());
    std::fflush(stderr);
    world.abort(1);
  }
}

// The first rank on each host removes the memory copies of runs whose processes are all gone
// (checkpoint/memory_folder.h), never those of `run_dir`, the run starting. The local rank:
// mpirun's, or srun's (SLURM_LOCALID) for ranks srun started.
void sweep_abandoned_memory_copies(const std::string& run_dir) {
  const char* local_rank = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  if (local_rank == nullptr) local_rank = std::getenv("SLURM_LOCALID");
  if (local_rank != nullptr && std::string(local_rank) != "0") return;
  for (const std::string& line :
       checkpoint::remove_abandoned_memory_copies(checkpoint::memory_checkpoint_root(run_dir))) {
    std::printf("%s\n", line.c_str());
  }
  std::fflush(stdout);
}

struct TrainArgs {
  std::string config_file, resume;
  bool print_config = false;
  int restarts = 0;
  TrainOverrides overrides;
};

bool gives(const train::ConfigValues& values, const std::string& key) {
  return std::any_of(values.begin(), values.end(),
                     [&](const train::ConfigValue& v) { return v.field->key == key; });
}

// A requeued Slurm job (preempted, `scontrol requeue`, a failed node under --requeue) runs its
// batch script again with the same arguments. The run in --out then goes on from its newest
// complete checkpoint, on disk or in any host's memory, as with --resume <out>; when it has none
// yet (stopped before its first), it starts again in that directory. Collective: the ranks agree.
struct Requeued {
  fs::path run;
  bool checkpointed = false;
};
std::optional<Requeued> requeued_run(const TrainArgs& args, const train::ConfigValues& flags,
                                     comm::Communicator& world) {
  const int restarts = launch::slurm_restart_count();
  if (restarts == 0 || !args.resume.empty()) return std::nullopt;
  train::TrainConfig config;
  if (!args.config_file.empty()) {
    config = train::TrainConfig::from_json(read_json_file(args.config_file), args.config_file);
  }
  config.apply(flags);
  Requeued r{config.out_dir};
  // Each rank looks at the disk and its own host's memory: a host that kept a copy counts.
  const int64_t here = train::restart_step(r.run, train::MemoryHosts::kSeveral) ? 1 : 0;
  r.checkpointed = (world.size() > 1 ? world.all_reduce_sum(here) : here) > 0;
  if (world.rank() == 0 && !args.print_config) {
    const char* job = std::getenv("SLURM_JOB_ID");
    const std::string what = r.checkpointed
                                 ? "continuing " + r.run.string() + " from its newest checkpoint"
                                 : r.run.string() + " holds no checkpoint: starting the run again";
    std::printf("requeued Slurm job %s (restart %d): %s\n", job ? job : "?", restarts,
                what.c_str());
    std::fflush(stdout);
  }
  return r;
}

// `malleus train` run straight from a batch script of several tasks trains on one rank: say how
// to use the allocation.
void warn_if_alone_in_allocation(const comm::Communicator& world) {
  const char* tasks = std::getenv("SLURM_NTASKS");
  if (world.size() != 1 || std::getenv("SLURM_STEP_ID") != nullptr || tasks == nullptr ||
      std::atoi(tasks) <= 1) {
    return;
  }
  std::fprintf(stderr,
               "warning: Slurm job %s has %s tasks, but this is one rank started without srun: "
               "start the ranks with srun --mpi=pmix malleus train ..., or malleus launch -- "
               "train ... (docs/slurm.md)\n",
               std::getenv("SLURM_JOB_ID") ? std::getenv("SLURM_JOB_ID") : "?", tasks);
}

void run_train(const TrainArgs& args) {
  // The cheap, purely syntactic checks first: every flag's value, straggler specs included,
  // before any file is read.
  const train::ConfigValues flags = args.overrides.values();
  std::string diverged;  // Trainer::run's message when a step was not finite (every rank's)
  bool said = false;     // ... and rank 0 has printed it already (several ranks)
  bool root = true;
  const int stop_signal = with_mpi([&](comm::Communicator& world) -> int {
    // Installed before the long setup: a stop asked for meanwhile acts after the first step.
    train::StopSignals stop_signals;
    std::optional<train::ResumePoint> resume;
    std::optional<fs::path> resumed_run;
    train::TrainConfig config;
    if (!args.print_config) warn_if_alone_in_allocation(world);
    const std::optional<Requeued> requeued = requeued_run(args, flags, world);
    const std::string resume_from =
        requeued && requeued->checkpointed ? requeued->run.string() : args.resume;
    if (!resume_from.empty()) {
      resume = train::find_resume_point(resume_from, world);
      const checkpoint::Checkpoint* checkpoint = &resume->checkpoint;
      const train::TrainConfig saved = train::TrainConfig::from_json(
          checkpoint->train_config, (resume->dir() / "manifest.json").string());
      // A config file given with --resume counts as its keys given as flags (flags win).
      train::ConfigValues values;
      if (!args.config_file.empty()) {
        values = train::TrainConfig::values_of(read_json_file(args.config_file), args.config_file);
      }
      values.insert(values.end(), flags.begin(), flags.end());
      config = saved.resumed(values, checkpoint->step);
      // The run goes on where it was told, never into the directory the manifest recorded
      // (which is the original's when resuming a copy).
      if (!gives(values, "out_dir")) {
        check(resume->run_dir.has_value(),
              resume->dir().string() +
                  " is not inside a run directory (<run>/checkpoints/step_N): give --out");
        config.out_dir = resume->run_dir->string();
      }
      resumed_run = resume->run_dir;
      if (world.rank() == 0 && !args.print_config) {
        std::printf("resuming from %s%s at step %lld\n", resume->dir().c_str(),
                    resume->memory ? " (a memory checkpoint)" : "",
                    static_cast<long long>(checkpoint->step));
      }
    } else {
      if (!args.config_file.empty()) {
        config = train::TrainConfig::from_json(read_json_file(args.config_file), args.config_file);
      }
      config.apply(flags);
    }
    config.validate("training config");
    if (args.print_config) {
      if (world.rank() == 0) std::printf("%s\n", config.to_json().dump(2).c_str());
      return 0;
    }
    sweep_abandoned_memory_copies(config.out_dir);
    const model::ModelConfig model =
        resume ? resume->checkpoint.model : model::load_model_config(config.model);
    // A resumed run's parameters are read, never initialised first.
    train::Trainer trainer(
        config, model, world,
        resume ? train::InitialState::kRestoredLater : train::InitialState::kFromSeed);
    if (resume) train::restore_resume_point(trainer, *resume, world);
    trainer.set_restarts(args.restarts);
    // Taken once every input has been checked (so bad input leaves nothing on disk) and before
    // anything is written. Rank 0 writes the run directory, so rank 0 owns it.
    std::optional<train::RunDirectory> run_dir;
    // A requeued job's directory is its own run's, checkpointed or not.
    if (world.rank() == 0) {
      run_dir.emplace(config.out_dir, requeued ? requeued->run : resumed_run);
      // A stop killed before its checkpoint was complete: say what this run continues from.
      if (const auto stop = train::read_stop_record(config.out_dir); stop && !stop->saved) {
        std::printf("the last run was %s\n", train::describe_stop(*stop).c_str());
      }
      std::error_code ignored;
      fs::remove(train::stop_record_path(config.out_dir), ignored);
    }
    root = world.rank() == 0;
    try {
      return trainer.run();
    } catch (const train::Diverged& e) {
      diverged = e.what();  // every rank stopped at the same step: no abort
      said = world.size() > 1;
      if (said) {
        // Said once, by rank 0, before any rank exits: mpirun ends the whole job, rank 0 included,
        // as soon as one rank exits with a non-zero status.
        if (root) {
          std::fprintf(stderr, "error: %s\n", diverged.c_str());
          std::fflush(stderr);
        }
        world.barrier();
      }
      return 0;
    }
  });
  // After MPI_Finalize, which every rank reaches together.
  if (!diverged.empty()) {
    if (root && !said) throw Error(diverged);  // one rank: said by main
    throw ExitStatus{1};
  }
  if (stop_signal != 0) throw ExitStatus{128 + stop_signal};
}

void run_eval(const std::string& checkpoint_path, const std::string& data, int samples,
              int micro_batch, int seq_len, int threads, const device::BackendChoice& choice) {
  with_mpi([&](comm::Communicator& world) {
    check(world.size() == 1, "eval runs on one rank");
    const device::Device device = device::open_device(choice, device::local_rank());
    const fs::path dir = checkpoint::resolve_checkpoint(checkpoint_path);
    checkpoint::Checkpoint checkpoint = checkpoint::load_checkpoint(dir, /*with_optimizer=*/false);
    if (seq_len == 0) {
      seq_len = train::TrainConfig::from_json(checkpoint.train_config, dir.string()).seq_len;
    }
    const auto plan = plan::uniform_plan(checkpoint.model, 1, 1, 1, micro_batch, micro_batch);
    runtime::EngineOptions options;
    options.seq_len = seq_len;
    options.threads = train::resolve_threads(threads, 1);
    options.make_backend = device.make_backend;
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
    check(std::isfinite(loss), "checkpoint " + dir.string() + " on " + data +
                                   ": the mean loss is " + std::to_string(loss) + " over " +
                                   std::to_string(count) +
                                   " sequences, not a number a model can have: its weights hold "
                                   "non-finite values or overflow");
    std::printf(
        "checkpoint %s (step %lld) on %s: mean loss %.6f over %d sequences of %d tokens%s\n",
        dir.c_str(), static_cast<long long>(checkpoint.step), data.c_str(), loss, count, seq_len,
        device.kind == device::BackendKind::kCpu ? "" : (" on " + device.description).c_str());
  });
}

}  // namespace

void add_corpus_options(CLI::App& command, data::CorpusOptions& corpus) {
  corpus.inputs = {"/usr/share/games/fortunes"};
  corpus.document_separator = "%";
  command
      .add_option("--input", corpus.inputs,
                  "Files or directories: plain text or JSON Lines, plain or gzip/xz/zstd "
                  "compressed (told from the content)")
      ->capture_default_str();
  command
      .add_option_function<std::string>(
          "--format",
          [&corpus](const std::string& name) { corpus.format = data::parse_input_format(name); },
          "auto (JSON Lines where a file's text starts with \"{\"), text or jsonl")
      ->check(CLI::IsMember({"auto", "text", "jsonl"}))
      ->default_str("auto");
  command.add_option("--json-key", corpus.json_key, "JSON Lines: the key holding the text")
      ->capture_default_str();
  command
      .add_option("--separator", corpus.document_separator,
                  "Plain text: a line equal to this ends a document (\"\": one file, one "
                  "document)")
      ->capture_default_str();
  command.add_flag("--skip-bad", corpus.skip_bad,
                   "Leave out and count bad documents (not JSON, no key, not a string, not "
                   "UTF-8) instead of stopping at the first");
  command
      .add_option_function<int64_t>(
          "--max-document-mb",
          [&corpus](int64_t mb) {
            check(mb > 0 && mb <= (int64_t{1} << 20),
                  "--max-document-mb must be in [1, 1048576], got " + std::to_string(mb));
            corpus.max_document_bytes = mb << 20;
          },
          "Largest document (or line) in MiB; a larger one stops the run")
      ->default_str(std::to_string(corpus.max_document_bytes >> 20));
}

namespace {

// train: the training config from --config (or the demo), the field flags on top.
void add_train_command(CLI::App& app) {
  auto train_args = std::make_shared<TrainArgs>();
  auto* train_cmd = app.add_subcommand("train",
                                       "Train a model (default: the demo model on the "
                                       "fortunes corpus prepared by prepare-data)");
  train_cmd
      ->add_option("--config", train_args->config_file,
                   "Training config JSON (default: built-in demo)")
      ->check(CLI::ExistingFile);
  train_cmd->add_option("--resume", train_args->resume,
                        "Continue from a checkpoint, or the latest one of a run directory (which "
                        "it then goes on writing, unless --out says otherwise)");
  train_cmd->add_flag("--print-config", train_args->print_config,
                      "Print the training config this command would run with, and exit");
  train_cmd
      ->add_option("--restarts", train_args->restarts,
                   "Restarts of this job so far, shown in the step lines (set by malleus launch)")
      ->check(CLI::NonNegativeNumber);
  train_args->overrides.add_to(*train_cmd);
  train_cmd->callback([train_args] { run_train(*train_args); });
}

// Prints what prepare-data did: counts, files passed over, bad documents left out.
void print_prepare_summary(const data::PrepareSummary& s, const data::PrepareOptions& options,
                           double seconds) {
  std::printf(
      "prepared %lld documents from %lld files: %lld train tokens, %lld val tokens in %zu "
      "shards under %s (%s)\n",
      static_cast<long long>(s.documents), static_cast<long long>(s.files),
      static_cast<long long>(s.train_tokens), static_cast<long long>(s.val_tokens), s.shards.size(),
      options.output_dir.c_str(), options.tokenizer->describe().c_str());
  std::printf("read %s of text in %s (%.1f MB/s) on %s\n",
              format_bytes(static_cast<double>(s.text_bytes)).c_str(),
              format_duration(seconds).c_str(),
              seconds > 0 ? static_cast<double>(s.text_bytes) / 1e6 / seconds : 0.0,
              format_counted(options.threads, "tokenizing thread").c_str());
  if (s.bad_documents > 0) {
    std::printf("left out %s (--skip-bad): %s\n",
                format_counted(s.bad_documents, "bad document").c_str(), s.bad_summary.c_str());
  }
  if (!s.skipped.empty()) {
    // Grouped by reason ("path (reason)"), each with its first file.
    std::vector<std::pair<std::string, std::pair<long long, std::string>>> reasons;
    for (const auto& entry : s.skipped) {
      const size_t open = entry.rfind(" (");
      const std::string reason = open == std::string::npos ? "" : entry.substr(open + 2);
      auto it = std::find_if(reasons.begin(), reasons.end(),
                             [&](const auto& r) { return r.first == reason; });
      if (it == reasons.end()) {
        reasons.push_back({reason, {1, entry.substr(0, open)}});
      } else {
        ++it->second.first;
      }
    }
    std::printf("passed over %s:",
                format_counted(static_cast<long long>(s.skipped.size()), "input file").c_str());
    for (size_t i = 0; i < reasons.size(); ++i) {
      const auto& [reason, count_first] = reasons[i];
      std::printf("%s %lld (%s e.g. %s", i == 0 ? "" : ",", count_first.first, reason.c_str(),
                  count_first.second.c_str());
    }
    std::printf("\n");
  }
}

// prepare-data: a corpus into token shards.
void add_prepare_data_command(CLI::App& app) {
  struct PrepareArgs {
    data::PrepareOptions options;
    std::string tokenizer = "byte";
    int threads = 0;
  };
  auto args = std::make_shared<PrepareArgs>();
  data::PrepareOptions& prepare = args->options;
  prepare.output_dir = "data/fortunes";
  auto* prepare_cmd = app.add_subcommand("prepare-data", "Tokenize a corpus into token shards");
  add_corpus_options(*prepare_cmd, prepare);
  prepare_cmd->add_option("--output", prepare.output_dir, "Output directory")
      ->capture_default_str();
  prepare_cmd
      ->add_option("--val-fraction", prepare.val_fraction, "Share of documents for validation")
      ->check(CLI::Range(0.0, 0.5))
      ->capture_default_str();
  prepare_cmd->add_option("--shard-tokens", prepare.shard_tokens, "Maximum tokens per shard")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  prepare_cmd
      ->add_option("--tokenizer", args->tokenizer,
                   "\"byte\" or a SentencePiece .model file (e.g. from train-tokenizer)")
      ->capture_default_str();
  prepare_cmd
      ->add_option("--threads", args->threads,
                   "Tokenizing threads (0: all cores); the shards are the same for any")
      ->check(CLI::NonNegativeNumber);
  prepare_cmd
      ->add_option("--progress-seconds", prepare.progress_seconds,
                   "Seconds between progress lines on stderr")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  prepare_cmd->callback([args] {
    data::PrepareOptions& options = args->options;
    options.tokenizer = tokenizer::load_tokenizer(args->tokenizer);
    options.threads = args->threads > 0
                          ? args->threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    options.on_progress = [](const data::PrepareProgress& p) {
      std::fprintf(stderr, "prepare-data: %s\n", data::format_progress(p).c_str());
    };
    const auto start = std::chrono::steady_clock::now();
    const data::PrepareSummary s = data::prepare_data(options);
    print_prepare_summary(
        s, options,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  });
}

// eval: a checkpoint's mean loss on token shards.
void add_eval_command(CLI::App& app) {
  struct EvalArgs {
    std::string checkpoint, data = "data/fortunes/val_*.bin";
    int samples = 1 << 30, micro_batch = 8, seq_len = 0, threads = 0;
    BackendArgs backend;
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
  add_backend_options(*eval_cmd, eval_args->backend);
  eval_cmd->callback([eval_args] {
    run_eval(eval_args->checkpoint, eval_args->data, eval_args->samples, eval_args->micro_batch,
             eval_args->seq_len, eval_args->threads, eval_args->backend.choice());
  });
}

// export: a checkpoint as a Hugging Face directory.
void add_export_command(CLI::App& app) {
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
    const fs::path dir = checkpoint::resolve_checkpoint(export_args->checkpoint);
    hf::export_hf(checkpoint::load_checkpoint(dir, /*with_optimizer=*/false), export_args->output);
    std::printf("exported %s to %s\n", dir.c_str(), export_args->output.c_str());
  });
}

// models: the built-in presets, one line each.
void add_models_command(CLI::App& app) {
  app.add_subcommand("models", "List the built-in model presets")->callback([] {
    std::printf("%-12s %10s %7s %7s %6s %5s %7s %7s\n", "preset", "params", "layers", "hidden",
                "heads", "kv", "ffn", "vocab");
    for (const auto& name : model::model_preset_names()) {
      const auto c = model::load_model_config(name);
      std::printf("%-12s %10s %7d %7d %6d %5d %7d %7d\n", name.c_str(),
                  format_count(static_cast<double>(c.num_parameters())).c_str(), c.num_layers,
                  c.hidden_size, c.num_heads, c.num_kv_heads, c.ffn_hidden_size, c.vocab_size);
    }
  });
}

}  // namespace

void add_training_commands(CLI::App& app) {
  add_train_command(app);
  add_prepare_data_command(app);
  add_eval_command(app);
  add_export_command(app);
  add_models_command(app);
}

}  // namespace malleus::cli
