// import: a Hugging Face LlamaForCausalLM directory becomes a malleus checkpoint.
#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "train/checkpoint.h"
#include "train/import.h"

namespace malleus::cli {

void add_import_command(CLI::App& app) {
  struct ImportArgs {
    std::string input, output;
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
  cmd->callback([args] {
    const train::ImportResult result = train::import_hf(args->input);
    for (const auto& ignored : result.ignored) std::printf("ignored %s\n", ignored.c_str());
    train::save_checkpoint(args->output, result.checkpoint);
    const auto& model = result.checkpoint.model;
    std::printf("imported %s (%s weights, %lld parameters, %s) into %s\n", args->input.c_str(),
                result.dtype.c_str(), static_cast<long long>(model.num_parameters()),
                result.checkpoint.tokenizer ? result.checkpoint.tokenizer->describe().c_str()
                                            : "no tokenizer.model",
                args->output.c_str());
  });
}

}  // namespace malleus::cli
