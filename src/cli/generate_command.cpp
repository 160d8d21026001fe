// generate: text from a checkpoint, printed as it is sampled.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "backend/backend.h"
#include "checkpoint/checkpoint.h"
#include "cli/commands.h"
#include "common/error.h"
#include "model/config.h"
#include "model/generation.h"
#include "tokenizer/text_stream.h"
#include "train/setup.h"

namespace malleus::cli {

namespace {

struct GenerateArgs {
  std::string checkpoint, untrained, prompt, tokenizer;
  uint64_t init_seed = 1234;
  model::SamplingOptions sampling;
  int context = 0, threads = 1;
  bool ignore_eos = false, no_cache = false;
  BackendArgs backend;
};

// Ranks this process was started among by mpirun (OpenMPI, or any PMI launcher); 1 otherwise.
int launched_ranks() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    if (const char* value = std::getenv(name)) return std::max(1, std::atoi(value));
  }
  return 1;
}

void run_generate(const GenerateArgs& args) {
  check(launched_ranks() == 1,
        "generate runs on one rank; start it without mpirun (the checkpoint does not depend on "
        "the plan it was trained under)");
  check(args.checkpoint.empty() != args.untrained.empty(),
        "generate: give either --checkpoint or --untrained");
  const device::Device device = device::open_device(args.backend.choice(), device::local_rank());
  checkpoint::Checkpoint checkpoint;
  std::filesystem::path dir;
  if (!args.checkpoint.empty()) {
    dir = checkpoint::resolve_checkpoint(args.checkpoint);
    checkpoint = checkpoint::load_checkpoint(dir, /*with_optimizer=*/false);
  } else {
    // What training starts from: the same initialisation `train --seed` gives.
    dir = "untrained " + args.untrained;
    checkpoint.model = model::load_model_config(args.untrained);
  }
  std::shared_ptr<const tokenizer::Tokenizer> tok = checkpoint.tokenizer;
  if (!args.tokenizer.empty()) {
    const auto given = tokenizer::load_tokenizer(args.tokenizer);
    check(!tok || tokenizer::same_tokenizer(*tok, *given),
          "--tokenizer " + args.tokenizer + " is not the " + (tok ? tok->describe() : "") +
              " that checkpoint " + dir.string() + " was trained with");
    tok = given;
  }
  check(tok != nullptr, (args.untrained.empty() ? "checkpoint " + dir.string()
                                                : "an untrained model (--untrained)") +
                            " records no tokenizer (its data came without one): give --tokenizer "
                            "byte or a SentencePiece .model file");
  const model::ModelConfig& config = checkpoint.model;
  check(tok->vocab_size() <= config.vocab_size,
        "the " + tok->describe() + " has more tokens than the model's vocab_size " +
            std::to_string(config.vocab_size));
  const int context = args.context > 0 ? args.context : config.max_seq_len;
  check(context <= config.max_seq_len, "--context " + std::to_string(context) +
                                           " exceeds the model's max_seq_len " +
                                           std::to_string(config.max_seq_len));

  auto backend = device.make_backend(train::resolve_threads(args.threads, 1));
  model::Transformer<float> model(config, *backend, 1, context);
  if (checkpoint.params.empty()) {
    model.init_parameters(args.init_seed);
  } else {
    backend->copy_from_host(model.params(), checkpoint.params.data(), checkpoint.params.size());
  }

  model::SamplingOptions sampling = args.sampling;
  const int32_t eos = tok->special_tokens().eos;
  if (eos >= 0 && !args.ignore_eos) sampling.stop_tokens.push_back(eos);
  const std::vector<int32_t> prompt = tokenizer::encode_prompt(*tok, args.prompt);

  // encode_prompt starts the prompt with bos or eos where the tokenizer has one.
  const tokenizer::SpecialTokens special = tok->special_tokens();
  const long start_tokens = special.bos >= 0 || special.eos >= 0 ? 1 : 0;
  tokenizer::TextStream stream(*tok, {prompt.begin() + start_tokens, prompt.end()},
                               [](std::string_view text) {
                                 std::fwrite(text.data(), 1, text.size(), stdout);
                                 std::fflush(stdout);
                               });
  const auto start = std::chrono::steady_clock::now();
  const model::Generation out = model::generate(
      model, prompt, sampling,
      [&](int32_t token) {
        if (token != eos || args.ignore_eos) stream.add(token);
      },
      !args.no_cache);
  stream.finish();  // text still waiting for the rest of a character that never came
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const char* why = out.stop == model::StopReason::kStopToken     ? "end of text"
                    : out.stop == model::StopReason::kContextFull ? "context full"
                                                                  : "token limit";
  std::printf("\n");
  std::fflush(stdout);  // the text before the statistics when both go to one terminal or pipe
  const std::string on =
      device.kind == device::BackendKind::kCpu ? "" : "; on " + device.description;
  std::fprintf(stderr, "[%zu tokens in %.2f s, %.1f tokens/s, %s; %s, step %lld%s]\n",
               out.tokens.size(), seconds, static_cast<double>(out.tokens.size()) / seconds, why,
               tok->kind().c_str(), static_cast<long long>(checkpoint.step), on.c_str());
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  args->sampling.max_new_tokens = 200;
  auto* cmd = app.add_subcommand(
      "generate", "Sample text from a checkpoint, with a key/value cache (one rank)");
  cmd->add_option("--checkpoint", args->checkpoint, "Checkpoint, or run directory");
  cmd->add_option("--untrained", args->untrained,
                  "Instead of a checkpoint: a model preset or file as training initialises it "
                  "(needs --tokenizer)");
  cmd->add_option("--init-seed", args->init_seed, "Initialisation seed for --untrained")
      ->capture_default_str();
  cmd->add_option("--prompt", args->prompt, "Text to continue (default: a new document)");
  cmd->add_option("--max-tokens", args->sampling.max_new_tokens, "New tokens at most")
      ->capture_default_str();
  cmd->add_option("--temperature", args->sampling.temperature, "Softmax temperature; 0: greedy")
      ->capture_default_str();
  cmd->add_option("--top-k", args->sampling.top_k, "Sample among the k most likely (0: all)")
      ->capture_default_str();
  cmd->add_option("--top-p", args->sampling.top_p,
                  "Sample among the most likely tokens holding this probability mass")
      ->capture_default_str();
  cmd->add_option("--seed", args->sampling.seed, "Seed of the sampler")->capture_default_str();
  cmd->add_option("--tokenizer", args->tokenizer,
                  "\"byte\" or a SentencePiece .model, for checkpoints that record none");
  cmd->add_option("--context", args->context, "Positions kept (default: the model's max_seq_len)");
  cmd->add_option("--threads", args->threads, "Compute threads (0: all cores)")
      ->capture_default_str();
  add_backend_options(*cmd, args->backend);
  cmd->add_flag("--ignore-eos", args->ignore_eos, "Go on past the end-of-text token");
  cmd->add_flag("--no-cache", args->no_cache,
                "Recompute the whole sequence for every token (for comparison)");
  cmd->callback([args] { run_generate(*args); });
}

}  // namespace malleus::cli
