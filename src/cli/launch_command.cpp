// launch: a training job under the supervisor that restarts it after lost ranks
// (launch/supervisor.h); clean-memory: a run's memory copies removed from this host.
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <memory>
#include <sstream>

#include "checkpoint/memory_checkpoint.h"
#include "cli/commands.h"
#include "common/error.h"
#include "common/format.h"
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

// Words of a one-word option value ("--a --b=c" -> --a, --b=c).
std::vector<std::string> words_of(const std::string& text) {
  std::vector<std::string> words;
  std::istringstream in(text);
  for (std::string word; in >> word;) words.push_back(word);
  return words;
}

// --launcher: "auto" is srun inside a Slurm allocation (SLURM_JOB_ID set) unless a hostfile is
// given, mpirun elsewhere.
launch::Launcher resolve_launcher(const std::string& name, const std::string& hostfile) {
  const char* job = std::getenv("SLURM_JOB_ID");
  const bool in_slurm = job != nullptr && *job != '\0';
  if (name == "srun" || (name == "auto" && in_slurm && hostfile.empty())) {
    check(hostfile.empty(),
          "--hostfile is for mpirun: under srun the nodes come from the Slurm "
          "allocation (give --launcher mpirun to use the hostfile)");
    return launch::Launcher::kSrun;
  }
  return launch::Launcher::kMpirun;
}

}  // namespace

void add_launch_command(CLI::App& app) {
  struct Args {
    launch::LaunchOptions options;
    std::string mpirun_args, srun_args, launcher = "auto";
  };
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand(
      "launch",
      "Run `train` under mpirun (or srun, in a Slurm allocation) and restart it from its latest "
      "checkpoint on the devices left when ranks are lost (killed, or hung as the watchdog "
      "finds): malleus launch --np 4 -- train <arguments>");
  cmd->add_option("--np", args->options.np,
                  "Ranks (default: every slot of the hostfile, or every task of the Slurm "
                  "allocation)")
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
  cmd->add_option("--exit-grace", args->options.exit_grace_s,
                  "Seconds mpirun gets to end a failed job (a rank hung, cut off or killed) before "
                  "the supervisor ends mpirun and its local ranks itself")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--start-timeout", args->options.start_timeout_s,
                  "Seconds a job may print nothing after its start before it is ended and not "
                  "restarted (a host mpirun cannot reach); 0: no limit")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--launcher", args->launcher,
                  "What starts the ranks: srun (inside a Slurm allocation: its nodes and tasks, "
                  "docs/slurm.md), mpirun, or auto (srun where SLURM_JOB_ID is set and no "
                  "--hostfile is given, else mpirun)")
      ->check(CLI::IsMember({"auto", "mpirun", "srun"}))
      ->capture_default_str();
  cmd->add_option("--srun", args->options.srun, "The srun to start jobs with")
      ->capture_default_str();
  cmd->add_option("--srun-args", args->srun_args,
                  "Extra arguments for srun, in one word, after malleus's own (which they "
                  "override): --srun-args='--mpi=pmix_v4 --cpu-bind=cores'");
  cmd->add_option("command", args->options.command, "-- train <arguments>")->required();
  cmd->callback([args] {
    args->options.mpirun_args = words_of(args->mpirun_args);
    args->options.srun_args = words_of(args->srun_args);
    args->options.launcher = resolve_launcher(args->launcher, args->options.hostfile);
    args->options.binary = own_binary();
    const int status = launch::supervise(args->options);
    if (status != 0) throw ExitStatus{status};
  });
}

void add_clean_memory_command(CLI::App& app) {
  auto runs = std::make_shared<std::vector<std::string>>();
  auto abandoned = std::make_shared<bool>(false);
  auto* cmd = app.add_subcommand(
      "clean-memory",
      "Remove the memory copies of runs (checkpoints kept in /dev/shm or "
      "$MALLEUS_MEMORY_CHECKPOINT_DIR) from this host: malleus clean-memory RUN_DIR...");
  cmd->add_option("run_dirs", *runs, "Run directories whose copies go");
  cmd->add_flag("--abandoned", *abandoned,
                "Also every copy of yours whose run's processes are all gone (docs/recovery.md)");
  cmd->callback([runs, abandoned] {
    check(!runs->empty() || *abandoned, "give the run directories, or --abandoned");
    for (const std::string& run : *runs) {
      const std::filesystem::path root = checkpoint::memory_checkpoint_root(run);
      // Another user's folder of that name: the error names it and its owner.
      const std::optional<std::filesystem::path> mine = checkpoint::private_memory_root(run);
      if (!mine) {
        std::printf("%s: no memory copies on %s (%s)\n", run.c_str(),
                    checkpoint::host_name().c_str(), root.c_str());
        continue;
      }
      const int64_t bytes = checkpoint::folder_bytes(*mine);
      checkpoint::remove_memory_checkpoints(run);
      std::printf("%s: removed %s (%s of memory) on %s\n", run.c_str(), mine->c_str(),
                  format_bytes(static_cast<double>(bytes)).c_str(),
                  checkpoint::host_name().c_str());
    }
    if (*abandoned) {
      for (const std::string& line : checkpoint::remove_abandoned_memory_copies({})) {
        std::printf("%s\n", line.c_str());
      }
    }
  });
}

}  // namespace malleus::cli
