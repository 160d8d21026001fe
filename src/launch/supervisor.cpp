#include "launch/supervisor.h"

#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/memory_checkpoint.h"
#include "checkpoint/memory_folder.h"
#include "common/error.h"
#include "common/files.h"
#include "common/format.h"
#include "launch/job_end.h"
#include "launch/slurm.h"
#include "metrics/metrics.h"
#include "train/resume.h"
#include "train/setup.h"
#include "train/stop_signal.h"
#include "watchdog/watchdog.h"

namespace malleus::launch {

namespace fs = std::filesystem;

namespace {

std::string one_decimal(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", seconds);
  return text;
}

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string joined(const std::vector<int>& values, const std::string& separator = ",") {
  std::string text;
  for (int v : values) text += (text.empty() ? "" : separator) + std::to_string(v);
  return text;
}

std::string shell_words(const std::vector<std::string>& words) {
  std::string text;
  for (const auto& w : words) {
    const bool plain = !w.empty() && w.find_first_of(" \t'\"$*?\\") == std::string::npos;
    text += (text.empty() ? "" : " ") + (plain ? w : "'" + w + "'");
  }
  return text;
}

// A child process in a process group of its own (Ctrl-C in a terminal reaches the supervisor
// only, which then stops the job cleanly), its stdout and stderr on pipes.
struct Child {
  pid_t pid = -1;
  int out = -1, err = -1;
};

Child spawn(const std::vector<std::string>& argv) {
  int out[2], err[2];
  check(::pipe(out) == 0 && ::pipe(err) == 0,
        std::string("cannot create pipes: ") + std::strerror(errno));
  const pid_t pid = ::fork();
  check(pid >= 0, std::string("cannot fork: ") + std::strerror(errno));
  if (pid == 0) {
    ::setpgid(0, 0);
    ::dup2(out[1], 1);
    ::dup2(err[1], 2);
    for (int fd : {out[0], out[1], err[0], err[1]}) ::close(fd);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    std::fprintf(stderr, "error: cannot run %s: %s\n", args[0], std::strerror(errno));
    std::_Exit(127);
  }
  ::close(out[1]);
  ::close(err[1]);
  return {pid, out[0], err[0]};
}

// The exit status of a finished child: its code, or 128 + the signal that ended it.
int wait_status(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) throw Error(std::string("waitpid: ") + std::strerror(errno));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Forwards the child's output to ours until both pipes close, keeping the last `keep` bytes of
// it; `on_output` sees every chunk (and whether it came on stdout). A stop signal to the supervisor
// is passed on to the child once, as SIGUSR1 (which mpirun forwards to every rank: they checkpoint
// and stop). `on_tick` runs every 200 ms; once it returns true (the job was ended), the pipes get
// kDrainS more seconds to close (a process out of reach may hold them open).
struct Forwarded {
  std::string tail;
  bool stop_forwarded = false;
};
constexpr double kDrainS = 2;
template <typename OnOutput, typename OnTick>
Forwarded forward(const Child& child, size_t keep, OnOutput&& on_output, OnTick&& on_tick) {
  Forwarded f;
  pollfd fds[2] = {{child.out, POLLIN, 0}, {child.err, POLLIN, 0}};
  int open = 2;
  char buffer[65536];
  std::optional<double> drain_until;
  while (open > 0) {
    if (!f.stop_forwarded && train::StopSignals::received() != 0) {
      ::kill(child.pid, SIGUSR1);
      f.stop_forwarded = true;
    }
    if (!drain_until && on_tick()) drain_until = unix_now() + kDrainS;
    if (drain_until && unix_now() > *drain_until) break;
    const int ready = ::poll(fds, 2, 200);
    if (ready < 0 && errno != EINTR) throw Error(std::string("poll: ") + std::strerror(errno));
    for (int i = 0; i < 2 && ready > 0; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      const ssize_t n = ::read(fds[i].fd, buffer, sizeof buffer);
      if (n <= 0) {
        if (n < 0 && errno == EINTR) continue;
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open;
        continue;
      }
      const std::string chunk(buffer, static_cast<size_t>(n));
      std::FILE* to = i == 0 ? stdout : stderr;
      std::fwrite(chunk.data(), 1, chunk.size(), to);
      std::fflush(to);
      on_output(chunk, i == 0);
      f.tail += chunk;
      if (f.tail.size() > keep) f.tail.erase(0, f.tail.size() - keep);
    }
  }
  for (int fd : {fds[0].fd, fds[1].fd}) {
    if (fd >= 0) ::close(fd);
  }
  return f;
}

// The run's config as `malleus train` resolves it (file, flags, checkpoint): its --print-config.
Json resolved_config(const LaunchOptions& o) {
  std::vector<std::string> argv = {o.binary};
  argv.insert(argv.end(), o.command.begin(), o.command.end());
  argv.push_back("--print-config");
  const Child child = spawn(argv);
  std::string output, errors;
  char buffer[65536];
  for (int fd : {child.out, child.err}) {
    ssize_t n;
    while ((n = ::read(fd, buffer, sizeof buffer)) > 0 || (n < 0 && errno == EINTR)) {
      if (n > 0) (fd == child.out ? output : errors).append(buffer, static_cast<size_t>(n));
    }
    ::close(fd);
  }
  const int status = wait_status(child.pid);
  if (status != 0) {
    throw Error("the training command is not valid (" + shell_words(o.command) +
                "): " + (errors.empty() ? output : errors));
  }
  const size_t start = output.find('{');
  check(start != std::string::npos, "malleus train --print-config printed no config: " + output);
  return parse_json(output.substr(start), "malleus train --print-config");
}

// The last step the job logged in metrics.jsonl (0: none).
int64_t last_logged_step(const fs::path& metrics) {
  std::ifstream in(metrics);
  std::string line;
  int64_t step = 0;
  while (std::getline(in, line)) {
    try {
      const auto record = metrics::parse_record(Json::parse(line), metrics.string());
      if (record) {
        if (const auto* s = std::get_if<metrics::StepRecord>(&*record)) step = s->step;
      }
    } catch (const std::exception&) {
      // a line this reader does not understand says nothing about progress
    }
  }
  return step;
}

// The command line of a restart: the original, resuming from the run directory under the
// planner's plan for the ranks that are left.
std::vector<std::string> restart_command(const std::vector<std::string>& command,
                                         const std::string& run_dir, int restarts) {
  std::vector<std::string> args;
  for (size_t i = 0; i < command.size(); ++i) {
    const std::string& a = command[i];
    if (a == "--resume" || a == "--restarts") {
      ++i;  // and its value
      continue;
    }
    if (a.rfind("--resume=", 0) == 0 || a.rfind("--restarts=", 0) == 0) continue;
    args.push_back(a);
  }
  for (const char* a : {"--resume", run_dir.c_str(), "--plan", train::kPlannerPlan}) {
    args.emplace_back(a);
  }
  args.push_back("--restarts");
  args.push_back(std::to_string(restarts));
  return args;
}

// The devices jobs may run on: the hostfile's slots (or np local ones, or the tasks of the Slurm
// allocation on the nodes Slurm still lets us use), less the lost ones.
class Devices {
 public:
  explicit Devices(const LaunchOptions& o) : hostfile_(o.hostfile) {
    if (o.launcher == Launcher::kSrun) {
      from_allocation(o);
      return;
    }
    if (hostfile_.empty()) {
      check(o.np > 0, "give --np or --hostfile");
      listed_ = {{"localhost", o.np}};
    } else {
      reread();
    }
    int slots = 0;
    for (const Host& h : listed_) slots += h.slots;
    wanted_ = o.np > 0 ? o.np : slots;
    check(wanted_ <= slots, "--np " + std::to_string(o.np) + " is more than the " +
                                std::to_string(slots) + " slots of " + o.hostfile);
  }

  // The device of each rank of the next job: host names, in the order mpirun fills the slots.
  std::vector<std::string> next_job() const {
    std::vector<std::string> ranks;
    for (const Host& h : listed_) {
      const auto it = excluded_.find(h.name);
      const int free = h.slots - (it == excluded_.end() ? 0 : it->second);
      for (int s = 0; s < free && static_cast<int>(ranks.size()) < wanted_; ++s) {
        ranks.push_back(h.name);
      }
    }
    return ranks;
  }

  // A lost rank's device; not counted against a node Slurm has left out (all of it is out, and
  // if it comes back, it comes back whole).
  void exclude(const std::string& host) {
    if (slurm_ && slurm_->left_out().count(host)) return;
    ++excluded_[host];
  }

  // The nodes left out under Slurm and why ("; node3 left out: drained (...)"), for the record.
  std::string left_out_note() const {
    std::string note;
    if (!slurm_) return note;
    for (const auto& [node, why] : slurm_->left_out()) note += "; " + node + " left out: " + why;
    return note;
  }

  // Reads the hostfile again; a changed one is the operator's new list, so earlier exclusions
  // are forgotten and a host listed again comes back. Under Slurm, asks which nodes are left.
  void reread() {
    if (slurm_) {
      listed_ = slurm_->usable();
      return;
    }
    if (hostfile_.empty()) return;
    const std::string text = read_file(hostfile_);
    if (text == text_) return;
    listed_ = parse_hostfile(text, hostfile_);
    if (!text_.empty() && !excluded_.empty()) {
      std::printf("launch: %s changed: every host it lists is used again\n", hostfile_.c_str());
    }
    text_ = text;
    excluded_.clear();
  }

  const std::string& hostfile() const { return hostfile_; }

 private:
  void from_allocation(const LaunchOptions& o) {
    const std::optional<Allocation> allocation = slurm_allocation();
    check(allocation.has_value(),
          "--launcher srun starts jobs in a Slurm allocation, but SLURM_JOB_ID is not set: run "
          "malleus launch in an sbatch script or under salloc");
    const int tasks = allocation->tasks();
    wanted_ = o.np > 0 ? o.np : tasks;
    check(wanted_ <= tasks, "--np " + std::to_string(o.np) + " is more than the " +
                                std::to_string(tasks) + " tasks of Slurm job " +
                                allocation->job_id + " (SLURM_TASKS_PER_NODE)");
    slurm_.emplace(*allocation);
    listed_ = slurm_->usable();
  }

  std::optional<SlurmNodes> slurm_;
  std::string hostfile_, text_;
  std::vector<Host> listed_;
  std::map<std::string, int> excluded_;
  int wanted_ = 0;
};

// A temporary directory for the hostfiles of the jobs, removed at the end. Its name holds this
// supervisor's pid and start time (malleus-launch-PID-START-XXXXXX), so that one a killed
// supervisor left (SIGKILL, SIGHUP, a second Ctrl-C) is removed by the next supervisor on the host:
// a folder of the effective user whose named process is not running.
class ScratchDir {
 public:
  ScratchDir() {
    const fs::path tmp = fs::temp_directory_path();
    remove_abandoned(tmp);
    const checkpoint::HostProcess me = checkpoint::this_process();
    std::string pattern = (tmp / (std::string(kPrefix) + std::to_string(me.pid) + "-" +
                                  std::to_string(me.start) + "-XXXXXX"))
                              .string();
    check(::mkdtemp(pattern.data()) != nullptr,
          std::string("cannot create a temporary directory: ") + std::strerror(errno));
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  static constexpr const char* kPrefix = "malleus-launch-";

  // Never throws: a folder it cannot judge or remove is left alone.
  static void remove_abandoned(const fs::path& tmp) {
    std::vector<fs::path> gone;
    std::error_code ec;
    for (fs::directory_iterator it(tmp, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      checkpoint::HostProcess owner;
      char tail[16] = {};
      long long pid = 0, start = 0;
      if (name.rfind(kPrefix, 0) != 0 || std::sscanf(name.c_str() + std::strlen(kPrefix),
                                                     "%lld-%lld-%15s", &pid, &start, tail) != 3) {
        continue;  // not a supervisor's, or one from before names held the pid
      }
      owner.pid = pid;
      owner.start = start;
      struct stat st;
      if (::lstat(it->path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) ||
          st.st_uid != ::geteuid() || checkpoint::is_running(owner)) {
        continue;
      }
      gone.push_back(it->path());
    }
    for (const fs::path& dir : gone) {
      std::error_code removed;
      fs::remove_all(dir, removed);
      if (!removed) std::printf("launch: removed %s: its supervisor is gone\n", dir.c_str());
    }
  }

  fs::path path_;
};

// How one job ended: mpirun's status and output, and whether the supervisor had to end it.
struct JobEnd {
  Forwarded forwarded;
  int status = 0;
  double ended_at = 0;  // Unix time
  std::string ended_by = "mpirun";
  std::vector<UnendedRank> unended;  // ranks still running after the supervisor ended the job
};

// Watches a running job for the signs that it failed (job_end.h): the watchdog's hang.json, or
// mpirun's word that it is aborting the job. mpirun then gets `grace_s` to end the job; after that
// the supervisor ends mpirun's whole process tree itself.
class FailureWatch {
 public:
  FailureWatch(fs::path hang_path, const LaunchOptions& o, pid_t job)
      : hang_path_(std::move(hang_path)),
        grace_s_(o.exit_grace_s),
        start_timeout_s_(o.start_timeout_s),
        job_(job),
        started_at_(unix_now()) {}

  void on_output(const std::string& chunk, bool is_stdout) {
    printed_ = printed_ || is_stdout;
    if (seen_at_) return;
    const std::string text = carry_ + chunk;  // a sign split between two chunks
    if (const auto sign = job_abort_sign(text)) note("mpirun's \"" + *sign + "\"");
    carry_ = text.substr(text.size() > 200 ? text.size() - 200 : 0);
  }

  // Called every 200 ms: true once the job was ended here.
  bool tick() {
    if (ended_at_) return true;
    std::error_code ec;
    if (!seen_at_ && fs::exists(hang_path_, ec)) note("the watchdog's " + hang_path_.string());
    if (!seen_at_ && !printed_ && start_timeout_s_ > 0 &&
        unix_now() - started_at_ > start_timeout_s_) {
      // mpirun waits without limit for a daemon it cannot reach; so may ssh. No grace: it had its
      // time.
      did_not_start_ = true;
      note("nothing printed within " + one_decimal(start_timeout_s_) + " s of its start");
      seen_at_ = unix_now() - grace_s_;
    }
    if (!seen_at_ || unix_now() - *seen_at_ < grace_s_) return false;
    ended_at_ = unix_now();
    const size_t killed = kill_process_tree(job_).size();
    std::printf(
        "launch: the job failed (%s) and mpirun had not ended it %.1f s later (--exit-grace): "
        "ended it (%zu process%s on this host)\n",
        sign_.c_str(), *ended_at_ - *seen_at_, killed, killed == 1 ? "" : "es");
    std::fflush(stdout);
    return true;
  }

  std::optional<double> ended_at() const { return ended_at_; }
  bool did_not_start() const { return did_not_start_; }

 private:
  void note(const std::string& sign) {
    seen_at_ = unix_now();
    sign_ = sign;
  }

  const fs::path hang_path_;
  const double grace_s_, start_timeout_s_;
  const pid_t job_;
  const double started_at_;
  bool printed_ = false, did_not_start_ = false;
  std::string carry_, sign_;
  std::optional<double> seen_at_, ended_at_;
};

// One supervision: the jobs it starts, one after another, and what it remembers between them.
class Supervisor {
 public:
  explicit Supervisor(const LaunchOptions& o)
      : o_(o),
        devices_(o),
        config_(resolved_config(o)),
        run_dir_(config_.at("out_dir").get<std::string>()),
        command_(o.command),
        started_at_(unix_now()) {
    // The jobs' ranks name this process in their memory copies' owner record; copies of other
    // runs whose processes are all gone are removed now (checkpoint/memory_folder.h).
    ::setenv("MALLEUS_SUPERVISOR", checkpoint::supervisor_text().c_str(), 1);
    for (const std::string& line :
         checkpoint::remove_abandoned_memory_copies(checkpoint::memory_checkpoint_root(run_dir_))) {
      std::printf("launch: %s\n", line.c_str());
    }
    std::fflush(stdout);
  }

  // Runs jobs until one finishes, stops or fails, or a restart is refused (Error). When it gives
  // up, says where the run's memory copies are left.
  int run() {
    try {
      const int status = run_jobs();
      if (status != 0) report_memory_left();
      return status;
    } catch (const Error&) {
      report_memory_left();
      throw;
    }
  }

 private:
  int run_jobs() {
    for (int attempt = 0;; ++attempt) {
      const std::vector<std::string> ranks = devices_.next_job();
      last_hosts_ = std::set<std::string>(ranks.begin(), ranks.end());
      const int n = static_cast<int>(ranks.size());
      check(n >= o_.min_ranks, "launch: " + format_counted(n, "device") +
                                   " left, fewer than --min-ranks " + std::to_string(o_.min_ranks) +
                                   ": not starting the job");
      const JobEnd job = run_job(job_argv(ranks, attempt), attempt == 0, n);
      failed_job_ended_ = job.ended_at;
      const Outcome outcome = classify(job.status, job.forwarded.tail, take_hang_report());
      if (const std::optional<int> code = ended(outcome, job.forwarded, job.status)) return *code;
      if (const std::optional<int> code = restart(outcome, ranks, job)) return *code;
    }
  }

  // After the supervisor gave up: where the run's memory copies stay, what they hold, and the
  // command that removes them (on stderr, after the error or the job's status).
  void report_memory_left() const {
    const std::optional<checkpoint::MemoryCopiesHeld> here =
        checkpoint::memory_copies_held(run_dir_);
    std::set<std::string> elsewhere = last_hosts_;
    elsewhere.erase("localhost");
    elsewhere.erase(checkpoint::host_name());
    if (!here && elsewhere.empty()) return;
    std::string where;
    if (here) {
      where = here->root.string() + " on " + checkpoint::host_name() + " (" +
              format_bytes(static_cast<double>(here->bytes)) + " of memory)";
    }
    if (!elsewhere.empty()) {
      std::string hosts;
      for (const std::string& h : elsewhere) hosts += (hosts.empty() ? "" : ", ") + h;
      where += std::string(where.empty() ? "" : ", and ") + "on " + hosts +
               " in their own memory (" + checkpoint::memory_checkpoint_base().string() + ")";
    }
    std::fprintf(
        stderr,
        "launch: the run's memory copies stay in %s; malleus clean-memory %s removes them%s "
        "(else the next malleus train or launch on that host removes them, once "
        "this run's processes are gone)\n",
        where.c_str(), run_dir_.c_str(), elsewhere.empty() ? "" : ", run on each host");
    std::fflush(stderr);
  }

  // mpirun's command line for a job on `ranks` (a device per rank).
  std::vector<std::string> job_argv(const std::vector<std::string>& ranks, int attempt) const {
    if (o_.launcher == Launcher::kSrun) {
      std::vector<std::string> program = {o_.binary};
      program.insert(program.end(), command_.begin(), command_.end());
      return srun_command(o_.srun, o_.srun_args, ranks, program);
    }
    std::vector<std::string> argv = {o_.mpirun};
    if (!devices_.hostfile().empty()) {
      // The slots left on each host, in the hostfile's order (mpirun fills them in order, so
      // rank r runs on ranks[r]).
      std::map<std::string, int> slots;
      std::vector<std::string> order;
      for (const auto& host : ranks) {
        if (slots[host]++ == 0) order.push_back(host);
      }
      std::string text;
      for (const auto& host : order) text += host + " slots=" + std::to_string(slots[host]) + "\n";
      const fs::path hostfile = scratch_.path() / ("hosts." + std::to_string(attempt));
      write_file_atomic(hostfile, text);
      argv.insert(argv.end(), {"--hostfile", hostfile.string()});
    }
    argv.insert(argv.end(), {"-np", std::to_string(ranks.size())});
    // Every rank, on every host, learns who supervises it: the owner record of its memory copies
    // names this process, so that they outlive the job until the restart (memory_folder.h).
    argv.insert(argv.end(), {"-x", "MALLEUS_SUPERVISOR"});
    argv.insert(argv.end(), o_.mpirun_args.begin(), o_.mpirun_args.end());
    argv.push_back(o_.binary);
    argv.insert(argv.end(), command_.begin(), command_.end());
    return argv;
  }

  // Runs one job of `n` ranks to its end, forwarding its output, and ends it itself when mpirun
  // does not end it within the grace period after it failed (FailureWatch); after a restart, says
  // when its first step came.
  JobEnd run_job(const std::vector<std::string>& argv, bool first_job, int n) const {
    std::printf("launch: %s\n", shell_words(argv).c_str());
    std::fflush(stdout);
    // A report no job of this supervision wrote (an earlier run's) is not this job's failure.
    std::error_code ec;
    if (first_job) fs::remove(watchdog::hang_report_path(run_dir_), ec);
    const Child child = spawn(argv);
    FailureWatch watch(watchdog::hang_report_path(run_dir_), o_, child.pid);
    bool first_step_seen = first_job;
    std::string line_start = "\n";  // the stdout seen so far ends here (for "step " at a line)
    JobEnd job;
    const auto on_output = [&](const std::string& chunk, bool is_stdout) {
      watch.on_output(chunk, is_stdout);
      if (first_step_seen || !is_stdout) return;
      const std::string text = line_start + chunk;
      if (text.find("\nstep ") != std::string::npos) {
        first_step_seen = true;
        std::printf("launch: first step of restart %d, %.1f s after the failed job ended\n",
                    restarts_, unix_now() - failed_job_ended_);
        std::fflush(stdout);
      }
      line_start = text.substr(text.size() > 8 ? text.size() - 8 : 0);
    };
    job.forwarded = forward(child, 1 << 20, on_output, [&] { return watch.tick(); });
    job.status = wait_status(child.pid);
    job.ended_at = unix_now();
    if (const std::optional<double> ended_at = watch.ended_at()) {
      job.ended_by = "launch";
      job.unended = still_running(n, *ended_at);
    }
    check(!watch.did_not_start(),
          "launch: the job printed nothing within " + one_decimal(o_.start_timeout_s) +
              " s of its start (--start-timeout): mpirun may be waiting for a host it cannot "
              "reach; ended it, not restarting");
    return job;
  }

  // The ranks of a job the supervisor ended that beat again after it did (on hosts out of its
  // reach), named on stderr. A heartbeat comes at least once a second (watchdog/watchdog.h).
  std::vector<UnendedRank> still_running(int n, double ended_at) const {
    const double wait_s = ended_at + 1.5 - unix_now();
    if (wait_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(wait_s));
    std::vector<UnendedRank> unended = ranks_beating_since(run_dir_, n, ended_at);
    if (!unended.empty()) {
      std::fprintf(stderr,
                   "launch: warning: could not end %s: still running on a host this one cannot "
                   "reach (its own watchdog ends it; else end it there)\n",
                   describe(unended).c_str());
    }
    return unended;
  }

  // The watchdog's report, kept as hang-<restart>.json (the next job clears hang.json).
  std::optional<Json> take_hang_report() const {
    std::optional<Json> hang_report;
    const fs::path hang_path = watchdog::hang_report_path(run_dir_);
    if (fs::exists(hang_path)) {
      try {
        hang_report = parse_json(read_file(hang_path), hang_path.string());
        std::error_code ec;
        fs::rename(hang_path, run_dir_ / ("hang-" + std::to_string(restarts_ + 1) + ".json"), ec);
      } catch (const Error& e) {
        std::fprintf(stderr, "launch: warning: %s\n", e.what());
      }
    }
    return hang_report;
  }

  // The last line of a run that finished, whatever ended its job: "launch: the run finished
  // [after N restarts]". Returns the exit status, 0.
  int finished() const {
    std::printf("launch: the run finished%s\n",
                restarts_ == 0 ? "" : (" after " + format_counted(restarts_, "restart")).c_str());
    return 0;
  }

  // The exit status when the job ended for good (finished, stopped, failed); nothing when ranks
  // were lost.
  std::optional<int> ended(const Outcome& outcome, const Forwarded& forwarded, int status) const {
    if (outcome.kind == Outcome::Kind::kFinished) return finished();
    if (forwarded.stop_forwarded || outcome.kind == Outcome::Kind::kStopped) {
      // Which step the stop saved, and where, as the job recorded it (its own lines may be lost).
      const std::optional<train::StopRecord> stop = train::read_stop_record(run_dir_);
      if (stop) std::printf("launch: the job %s\n", train::describe_stop(*stop).c_str());
      // A stop that saved its checkpoint ends every rank with 128 + its signal (138 for Slurm's
      // SIGUSR1, which a batch script reads to requeue). srun may still report a SIGTERM (143):
      // the first rank to exit makes it end the others, though they had saved and were exiting.
      const int signal = stop && stop->saved ? train::StopSignals::number(stop->signal) : 0;
      const int code = signal > 0 ? 128 + signal : (status == 0 ? 1 : status);
      std::printf(
          "launch: the job was stopped (exit status %d%s); continue with: malleus launch "
          "... -- %s\n",
          code,
          signal == 0 || code == status ? ""
                                        : ("; its launcher reported " + std::to_string(status) +
                                           ", ending ranks that were exiting")
                                              .c_str(),
          shell_words(restart_command(o_.command, run_dir_, 0)).c_str());
      return code;
    }
    if (outcome.kind == Outcome::Kind::kFailed) {
      // Its error lines were forwarded already.
      if (const std::optional<int64_t> last = last_step_saved_since_start()) {
        // Failed once the run was complete: a rank that crashed in MPI_Finalize (seen with Open
        // MPI 4's TCP transport, a SEGV the sanitizer turns into exit status 1). As a rank lost
        // there is, it ends as a finished run does (restart()).
        std::fprintf(stderr,
                     "launch: warning: the job failed (%s) after the run's last step (%lld) was "
                     "saved\n",
                     outcome.reason.c_str(), static_cast<long long>(*last));
        return finished();
      }
      std::fprintf(stderr, "launch: the job failed (%s) without losing a rank: not restarting it\n",
                   outcome.reason.c_str());
      return status;
    }
    return std::nullopt;
  }

  // The step of the run's newest checkpoint on disk when it is the run's last step and a job of
  // this supervision wrote it (not a run finished before, in the same directory), else nothing.
  std::optional<int64_t> last_step_saved_since_start() const {
    const std::optional<fs::path> latest = checkpoint::latest_checkpoint(run_dir_ / "checkpoints");
    if (!latest) return std::nullopt;
    const int64_t step = checkpoint::checkpoint_dir_step(*latest).value_or(0);
    struct stat info {};
    if (step < config_.at("steps").get<int64_t>() || ::stat(latest->c_str(), &info) != 0 ||
        static_cast<double>(info.st_mtim.tv_sec) +
                1e-9 * static_cast<double>(info.st_mtim.tv_nsec) <
            started_at_) {
      return std::nullopt;
    }
    return step;
  }

  // After ranks were lost: the next job's command, resuming from the latest checkpoint on the
  // devices left (recorded in metrics.jsonl and on stdout). Returns 0 when the run had already
  // finished; throws Error when no restart can be made.
  std::optional<int> restart(const Outcome& outcome, const std::vector<std::string>& ranks,
                             const JobEnd& job) {
    const int n = static_cast<int>(ranks.size());
    std::vector<int> lost;
    for (int r : outcome.lost_ranks) {
      if (r >= 0 && r < n) lost.push_back(r);
    }
    const std::string who = lost.empty() ? std::string("no rank could be named")
                                         : (lost.size() == 1 ? "rank " : "ranks ") +
                                               joined(lost, ", ") + " " + outcome.reason;
    const int64_t failed_at_step = last_logged_step(run_dir_ / "metrics.jsonl");
    const std::set<std::string> hosts(ranks.begin(), ranks.end());
    const int64_t from = restart_step(
        who, failed_at_step,
        hosts.size() > 1 ? train::MemoryHosts::kSeveral : train::MemoryHosts::kThisHost);
    if (from >= config_.at("steps").get<int64_t>()) {
      // Lost after its last step was saved (while the job was ending, e.g. in MPI_Finalize):
      // nothing is left to do, and the run ends as a finished one does.
      std::printf("launch: %s after the run's last step (%lld) was saved\n", who.c_str(),
                  static_cast<long long>(from));
      return finished();
    }
    check(!(restarted_from_ == from && last_reason_ == outcome.reason),
          "launch: " + who + " again before the run checkpointed past step " +
              std::to_string(from) + ": the same failure repeats, not restarting (" +
              outcome.detail + ")");
    check(restarts_ < o_.max_restarts, "launch: " + who + " after " +
                                           format_counted(restarts_, "restart") +
                                           ", the most --max-restarts allows: not restarting");
    // A hostfile changed since the last exclusions brings those devices back; the ones just lost
    // are out either way.
    devices_.reread();
    for (int r : lost) devices_.exclude(ranks[static_cast<size_t>(r)]);
    const int left = static_cast<int>(devices_.next_job().size());
    check(left >= o_.min_ranks,
          "launch: " + who + "; " + format_counted(left, "device") +
              " left, fewer than --min-ranks " + std::to_string(o_.min_ranks) +
              ": not restarting (the run can be continued from its checkpoint of step " +
              std::to_string(from) + " with malleus launch ... -- train --resume " +
              run_dir_.string() + " once devices are back)");
    ++restarts_;
    metrics::RestartRecord record;
    record.step = from;
    record.restart = restarts_;
    record.failed_at_step = failed_at_step;
    record.steps_lost = std::max<int64_t>(0, failed_at_step - from);
    record.reason = outcome.reason;
    record.detail = outcome.detail + devices_.left_out_note();
    for (int r : lost) record.lost_ranks.push_back(r);
    record.ranks_before = n;
    record.ranks_after = left;
    record.failed_at = job.ended_at;
    record.cut_off_hosts = outcome.cut_off_hosts;
    record.ended_by = job.ended_by;
    for (const UnendedRank& r : job.unended) record.unended_ranks.push_back(r.rank);
    record.unended = describe(job.unended);
    report_restart(record, who);
    restarted_from_ = from;
    last_reason_ = outcome.reason;
    command_ = restart_command(o_.command, run_dir_.string(), restarts_);
    return std::nullopt;
  }

  // The step of the latest complete checkpoint, on disk or in memory (Error when there is none);
  // on several hosts, this host's memory copy counts though other hosts hold some of its files.
  int64_t restart_step(const std::string& who, int64_t failed_at_step,
                       train::MemoryHosts hosts) const {
    const std::optional<int64_t> step = train::restart_step(run_dir_, hosts);
    check(step.has_value(),
          "launch: " + who + " at step " + std::to_string(failed_at_step) +
              ", before the run's first checkpoint: nothing to restart from (checkpoint more "
              "often: --checkpoint-every)");
    return *step;
  }

  void report_restart(const metrics::RestartRecord& record, const std::string& who) const {
    metrics::MetricsLog(run_dir_ / "metrics.jsonl").write(record);
    std::printf(
        "restart %lld at step %lld: %s; resuming from the checkpoint of step %lld on %s (%s "
        "lost)\n",
        static_cast<long long>(record.restart), static_cast<long long>(record.failed_at_step),
        who.c_str(), static_cast<long long>(record.step),
        format_counted(record.ranks_after, "rank").c_str(),
        format_counted(record.steps_lost, "step").c_str());
    if (!record.detail.empty()) std::printf("  (%s)\n", record.detail.c_str());
    std::fflush(stdout);
  }

  const LaunchOptions& o_;
  Devices devices_;
  const Json config_;
  const fs::path run_dir_;
  ScratchDir scratch_;
  train::StopSignals stop_signals_;
  std::vector<std::string> command_;
  const double started_at_;  // unix time
  int restarts_ = 0;
  std::optional<int64_t> restarted_from_;  // the checkpoint step of the last restart
  std::string last_reason_;
  double failed_job_ended_ = 0;       // when the last failed job ended (Unix time)
  std::set<std::string> last_hosts_;  // of the last job
};

}  // namespace

std::vector<Host> parse_hostfile(const std::string& text, const std::string& source) {
  std::vector<Host> hosts;
  std::istringstream lines(text);
  std::string line;
  for (int number = 1; std::getline(lines, line); ++number) {
    if (const size_t hash = line.find('#'); hash != std::string::npos) line.erase(hash);
    std::istringstream words(line);
    std::string word;
    if (!(words >> word)) continue;
    Host host{word, 1};
    const std::string where = source + ":" + std::to_string(number);
    while (words >> word) {
      const size_t eq = word.find('=');
      const std::string key = word.substr(0, eq);
      const std::string value = eq == std::string::npos ? "" : word.substr(eq + 1);
      if (key == "slots" || key == "max_slots") {
        char* end = nullptr;
        const long n = std::strtol(value.c_str(), &end, 10);
        check(!value.empty() && *end == '\0' && n >= 1 && n <= 1 << 20,
              where + ": \"" + word + "\" must give a positive whole number of slots");
        if (key == "slots") host.slots = static_cast<int>(n);
      } else {
        throw Error(where + ": \"" + word + "\" is not understood (expected slots=N)");
      }
    }
    hosts.push_back(host);
  }
  check(!hosts.empty(), source + " lists no hosts");
  return hosts;
}

Outcome classify(int status, const std::string& output, const std::optional<Json>& hang_report) {
  Outcome o;
  if (status == 0) {
    o.kind = Outcome::Kind::kFinished;
    return o;
  }
  if (hang_report) {
    o.kind = Outcome::Kind::kLost;
    JsonReader r(*hang_report, "hang report");
    o.lost_ranks = r.optional<std::vector<int>>("lost_ranks", {});
    o.cut_off_hosts = r.optional<std::vector<std::string>>("cut_off_hosts", {});
    o.reason = o.cut_off_hosts.empty() ? "hung" : "cut off";
    o.detail = r.optional<std::string>("message", "");
    return o;
  }
  // Open MPI 4: "mpirun noticed that process rank 3 with PID 1234 on node n0 exited on signal 9
  // (Killed)." A stop signal delivered twice kills too, but that was meant as a stop.
  static const std::regex killed(
      R"(process rank (\d+) with PID (\d+) on node (\S+) exited on signal (\d+))");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), killed);
       it != std::sregex_iterator(); ++it) {
    const int rank = std::stoi((*it)[1]);
    const int signal = std::stoi((*it)[4]);
    if (signal == SIGTERM || signal == SIGINT || signal == SIGUSR1) continue;
    if (std::find(o.lost_ranks.begin(), o.lost_ranks.end(), rank) == o.lost_ranks.end()) {
      o.lost_ranks.push_back(rank);
      o.detail += (o.detail.empty() ? "" : "; ") + it->str();
    }
  }
  // srun: "srun: error: node2: task 2: Killed".
  if (o.lost_ranks.empty()) o.lost_ranks = srun_killed_ranks(output, &o.detail);
  if (!o.lost_ranks.empty()) {
    o.kind = Outcome::Kind::kLost;
    o.reason = "killed";
    return o;
  }
  if (status == 128 + SIGTERM || status == 128 + SIGINT || status == 128 + SIGUSR1) {
    o.kind = Outcome::Kind::kStopped;
    o.reason = "stopped (exit status " + std::to_string(status) + ")";
    return o;
  }
  o.kind = Outcome::Kind::kFailed;
  o.reason = "exit status " + std::to_string(status);
  // The job's own error lines say more than the status.
  std::istringstream lines(output);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind("error:", 0) == 0 && o.detail.find(line) == std::string::npos) {
      o.detail += (o.detail.empty() ? "" : "\n") + line;
    }
  }
  return o;
}

int supervise(const LaunchOptions& o) {
  check(!o.command.empty() && o.command.front() == "train",
        "malleus launch runs `train`: give `-- train <arguments>`");
  check(o.min_ranks >= 1, "--min-ranks must be at least 1");
  check(o.max_restarts >= 0, "--max-restarts must not be negative");
  return Supervisor(o).run();
}

}  // namespace malleus::launch
