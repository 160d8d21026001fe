// import: a Hugging Face LlamaForCausalLM directory becomes a malleus checkpoint.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "checkpoint/checkpoint.h"
#include "cli/commands.h"
#include "common/error.h"
#include "hf/import.h"

namespace malleus::cli {

namespace {

// Like `train`, which refuses a run directory that holds a run: an existing --output is replaced
// only when asked (--force), and only if it is a checkpoint (or empty), never another directory.
void check_output(const std::filesystem::path& output, bool force) {
  std::error_code ec;
  if (!std::filesystem::exists(output, ec)) return;
  const bool empty =
      std::filesystem::is_directory(output, ec) &&
      std::filesystem::directory_iterator(output, ec) == std::filesystem::directory_iterator();
  if (empty) return;
  const bool checkpoint = std::filesystem::is_regular_file(output / "manifest.json", ec);
  check(checkpoint, "import: --output " + output.string() +
                        " exists and is not a checkpoint: choose another --output (or remove it)");
  check(force, "import: --output " + output.string() +
                   " is a checkpoint already: give --force to replace it, or choose another "
                   "--output");
}

}  // namespace

void add_import_command(CLI::App& app) {
  struct ImportArgs {
    std::string input, output;
    bool force = false;
  };
  auto args = std::make_shared<ImportArgs>();
  auto* cmd = app.add_subcommand(
      "import",
      "Turn a Hugging Face LlamaForCausalLM directory into a checkpoint (train --resume continues "
      "from its weights with a fresh optimizer)");
  cmd->add_option("--input", args->input,
                  "Directory with config.json and model.safetensors (or a sharded index)")
      ->required();
  cmd->add_option("--output", args->output, "Checkpoint directory to write")->required();
  cmd->add_flag("--force", args->force, "Replace --output if it is a checkpoint already");
  cmd->callback([args] {
    check_output(args->output, args->force);
    // Read and checked whole before anything is written; the checkpoint is then written beside
    // --output and renamed into place (save_checkpoint), so a failure leaves --output as it was.
    const hf::ImportResult result = hf::import_hf(args->input);
    for (const auto& ignored : result.ignored) std::printf("ignored %s\n", ignored.c_str());
    checkpoint::save_checkpoint(args->output, result.checkpoint);
    const auto& model = result.checkpoint.model;
    std::printf("imported %s (%s weights, %lld parameters, %s) into %s\n", args->input.c_str(),
                result.dtype.c_str(), static_cast<long long>(model.num_parameters()),
                result.checkpoint.tokenizer ? result.checkpoint.tokenizer->describe().c_str()
                                            : "no tokenizer.model",
                args->output.c_str());
  });
}

}  // namespace malleus::cli
