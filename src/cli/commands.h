// Each family of subcommands registers itself on the `malleus` app; a subcommand's callback does
// its work and throws malleus::Error on bad input (main prints it and exits non-zero), or
// ExitStatus.
#pragma once

#include <CLI/CLI.hpp>

#include "data/corpus.h"
#include "device/device.h"

namespace malleus::cli {

// Ends the program with this exit status, its message already printed: e.g. a training run
// stopped by a signal exits with 128 + the signal, after saving a checkpoint.
struct ExitStatus {
  int code = 1;
};

// The corpus a command reads (prepare-data, train-tokenizer): --input, --format, --json-key,
// --separator, --skip-bad and --max-document-mb, with the built-in default of Debian's fortunes,
// one fortune per document.
void add_corpus_options(CLI::App& command, data::CorpusOptions& corpus);

// What eval, generate and profile compute on (train has the same flags from its config's fields):
// --backend, --devices, --cuda-math; choice() checks them.
struct BackendArgs {
  std::string backend = "cpu", devices, cuda_math = device::BackendChoice().cuda_math;
  device::BackendChoice choice() const;
};
void add_backend_options(CLI::App& command, BackendArgs& args);

// train, prepare-data, eval, export, models
void add_training_commands(CLI::App& app);
// plan, simulate, profile, experiments, clusters
void add_planning_commands(CLI::App& app);
// report
void add_report_command(CLI::App& app);
// generate
void add_generate_command(CLI::App& app);
// import
void add_import_command(CLI::App& app);
// train-tokenizer
void add_tokenizer_command(CLI::App& app);
// launch
void add_launch_command(CLI::App& app);
// clean-memory
void add_clean_memory_command(CLI::App& app);

}  // namespace malleus::cli
