// The `malleus` command: one binary, one subcommand per job.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "cli/commands.h"
#include "common/error.h"

int main(int argc, char** argv) {
  CLI::App app{"malleus: hybrid-parallel, straggler-tolerant LLM training"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "malleus 0.1.0");
  malleus::cli::add_training_commands(app);
  malleus::cli::add_planning_commands(app);
  malleus::cli::add_report_command(app);
  malleus::cli::add_generate_command(app);
  malleus::cli::add_import_command(app);
  malleus::cli::add_tokenizer_command(app);
  try {
    app.parse(argc, argv);  // runs the chosen subcommand's callback
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
