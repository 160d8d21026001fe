// launch: a training job under the supervisor that restarts it after lost ranks
// (launch/supervisor.h).
#include <unistd.h>

#include <climits>
#include <memory>
#include <sstream>

#include "cli/commands.h"
#include "common/error.h"
#include "launch/supervisor.h"

namespace malleus::cli {

namespace {

// This executable, for the ranks to run.
std::string own_binary() {
  char path[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof path - 1);
  check(n > 0, "cannot find the malleus executable (/proc/self/exe)");
  return std::string(path, static_cast<size_t>(n));
}

}  // namespace

void add_launch_command(CLI::App& app) {
  struct Args {
    launch::LaunchOptions options;
    std::string mpirun_args;
  };
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand(
      "launch",
      "Run `train` under mpirun and restart it from its latest checkpoint on the devices left "
      "when ranks are lost (killed, or hung as the watchdog finds): malleus launch --np 4 -- "
      "train <arguments>");
  cmd->add_option("--np", args->options.np, "Ranks (default: every slot of the hostfile)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--hostfile", args->options.hostfile,
                  "Open MPI hostfile (\"host slots=N\" lines); read again at every restart, "
                  "and a changed one brings excluded hosts back")
      ->check(CLI::ExistingFile);
  cmd->add_option("--min-ranks", args->options.min_ranks,
                  "Stop with an error rather than run on fewer ranks")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--max-restarts", args->options.max_restarts, "Restarts at most")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--mpirun", args->options.mpirun, "The mpirun to start jobs with")
      ->capture_default_str();
  cmd->add_option("--mpirun-args", args->mpirun_args,
                  "Extra arguments for mpirun, in one word: --mpirun-args='--oversubscribe'");
  cmd->add_option("command", args->options.command, "-- train <arguments>")->required();
  cmd->callback([args] {
    std::istringstream words(args->mpirun_args);
    for (std::string word; words >> word;) args->options.mpirun_args.push_back(word);
    args->options.binary = own_binary();
    const int status = launch::supervise(args->options);
    if (status != 0) throw ExitStatus{status};
  });
}

}  // namespace malleus::cli
