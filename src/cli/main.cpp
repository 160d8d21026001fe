// The `malleus` command: one binary, one subcommand per job.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <new>
#include <string>

#include "cli/commands.h"
#include "common/error.h"

namespace {

// The first argument, when it is neither an option nor a subcommand: CLI11 would take
// `malleus generat --help` for the top-level help and exit 0, so a misspelt subcommand is caught
// here, by name.
void check_subcommand_name(const CLI::App& app, int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') return;
  const std::string name = argv[1];
  std::string known;
  for (const CLI::App* sub : app.get_subcommands({})) {
    if (sub->check_name(name)) return;
    known += (known.empty() ? "" : ", ") + sub->get_name();
  }
  throw malleus::Error("unknown subcommand \"" + name + "\" (the subcommands are: " + known + ")");
}

}  // namespace

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
  malleus::cli::add_launch_command(app);
  malleus::cli::add_clean_memory_command(app);
  try {
    check_subcommand_name(app, argc, argv);
    app.parse(argc, argv);  // runs the chosen subcommand's callback
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const malleus::cli::ExitStatus& e) {
    return e.code;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "error: out of memory: the run needs more memory than this machine could give "
                 "it (use more ranks, a plan that shards the model further, a smaller model, "
                 "micro-batch or sequence length)\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
