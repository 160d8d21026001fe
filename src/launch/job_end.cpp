#include "launch/job_end.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "common/proc_stat.h"
#include "watchdog/watchdog.h"

namespace malleus::launch {

namespace fs = std::filesystem;

namespace {

// The parent pid of every process (from /proc/<pid>/stat: "pid (comm) state ppid ...", comm
// possibly holding spaces and parentheses).
std::map<pid_t, pid_t> parents() {
  std::map<pid_t, pid_t> parent;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::vector<std::string> fields = proc_stat_fields((entry.path() / "stat").string());
    if (fields.size() < 2 || fields[0] == "Z") continue;  // ended meanwhile, or a zombie already
    parent[static_cast<pid_t>(std::stol(name))] =
        static_cast<pid_t>(std::strtol(fields[1].c_str(), nullptr, 10));
  }
  return parent;
}

// Open MPI's session directories of killed processes: <tmp>/ompi.<host>.<uid>/pid.<pid>.
void remove_session_dirs(const std::vector<pid_t>& killed) {
  const char* tmp = std::getenv("TMPDIR");
  const fs::path base = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
  char suffix_text[32];  // ".<uid>" (snprintf: GCC 12 warns wrongly about "." + to_string)
  std::snprintf(suffix_text, sizeof suffix_text, ".%u", static_cast<unsigned>(::getuid()));
  const std::string suffix = suffix_text;
  std::error_code ec;
  for (const auto& top : fs::directory_iterator(base, ec)) {
    const std::string name = top.path().filename().string();
    if (name.rfind("ompi.", 0) != 0 || name.size() < suffix.size() ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
      continue;
    }
    for (pid_t pid : killed) {
      std::error_code ignored;
      fs::remove_all(top.path() / ("pid." + std::to_string(pid)), ignored);
    }
  }
}

}  // namespace

std::optional<std::string> job_abort_sign(const std::string& output) {
  static const char* const kSigns[] = {
      "exited on signal",                         // a rank killed
      "the job has been aborted",                 // a rank returned a non-zero status
      "exited with non-zero status",              // ... in other words
      "lost communication with a remote daemon",  // a host gone
      "daemon has unexpectedly failed",
  };
  std::istringstream lines(output);
  std::string line;
  while (std::getline(lines, line)) {
    for (const char* sign : kSigns) {
      if (line.find(sign) != std::string::npos) return line;
    }
  }
  return std::nullopt;
}

std::vector<pid_t> process_tree(pid_t root) {
  const std::map<pid_t, pid_t> parent = parents();
  if (!parent.count(root)) return {};
  std::vector<pid_t> tree = {root};
  // Breadth first: every process whose parent is in the tree already.
  for (size_t next = 0; next < tree.size(); ++next) {
    for (const auto& [pid, ppid] : parent) {
      if (ppid == tree[next]) tree.push_back(pid);
    }
  }
  return tree;
}

std::vector<pid_t> kill_process_tree(pid_t root) {
  // Stopped processes cannot fork: stop what is there until a look finds nothing new, so that the
  // kill below reaches every process (a killed parent's children would go to init, out of sight).
  std::set<pid_t> stopped;
  for (int round = 0; round < 20; ++round) {
    bool found = false;
    for (pid_t pid : process_tree(root)) {
      if (stopped.insert(pid).second) {
        ::kill(pid, SIGSTOP);
        found = true;
      }
    }
    if (!found) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::vector<pid_t> killed;
  for (pid_t pid : stopped) {
    if (::kill(pid, SIGKILL) == 0) killed.push_back(pid);
  }
  remove_session_dirs(killed);
  return killed;
}

std::vector<UnendedRank> ranks_beating_since(const fs::path& run_dir, int world_size,
                                             double since) {
  std::vector<UnendedRank> running;
  const auto heartbeats = watchdog::read_heartbeats(run_dir, world_size);
  for (const auto& h : heartbeats) {
    if (h && h->beat > since) running.push_back({h->rank, h->pid, h->host, h->beat});
  }
  return running;
}

std::string describe(const std::vector<UnendedRank>& ranks) {
  std::string text;
  for (const UnendedRank& r : ranks) {
    text += (text.empty() ? "" : "; ") + ("rank " + std::to_string(r.rank) + " (pid " +
                                          std::to_string(r.pid) + " on " + r.host + ")");
  }
  return text;
}

}  // namespace malleus::launch
