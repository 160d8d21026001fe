#include "launch/slurm.h"

#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "common/error.h"
#include "common/slurm_lists.h"

namespace malleus::launch {

namespace {

// A whole number from a variable, or an Error naming it.
int whole_number(const std::string& name, const std::string& value) {
  const std::vector<int> n = expand_counts(value, name);
  check(n.size() == 1, name + " \"" + value + "\" is not a whole number");
  return n[0];
}

// The value of `key=` in a line of `scontrol show ... -o` output: up to the next space, or for
// `to_end` (free text such as Reason=) up to the end of the line.
std::optional<std::string> field(const std::string& line, const std::string& key,
                                 bool to_end = false) {
  const std::string token = key + "=";
  size_t at = line.rfind(token, 0) == 0 ? 0 : line.find(" " + token);
  if (at == std::string::npos) return std::nullopt;
  at += line[at] == ' ' ? token.size() + 1 : token.size();
  const size_t end = to_end ? line.size() : line.find(' ', at);
  return line.substr(at, end == std::string::npos ? std::string::npos : end - at);
}

std::string quoted(const std::string& word) {
  std::string text = "'";
  for (char c : word) text += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return text + "'";
}

}  // namespace

int Allocation::tasks() const {
  return std::accumulate(nodes.begin(), nodes.end(), 0,
                         [](int sum, const Host& h) { return sum + h.slots; });
}

std::optional<Allocation> slurm_allocation(const Environment& get_env) {
  const Environment get = get_env ? get_env : [](const char* name) { return std::getenv(name); };
  const char* job_id = get("SLURM_JOB_ID");
  if (job_id == nullptr || *job_id == '\0') return std::nullopt;
  Allocation a;
  a.job_id = job_id;
  const char* list_name = get("SLURM_JOB_NODELIST") ? "SLURM_JOB_NODELIST" : "SLURM_NODELIST";
  const char* list = get(list_name);
  check(list != nullptr, "inside Slurm job " + a.job_id +
                             " but neither SLURM_JOB_NODELIST nor SLURM_NODELIST is set");
  const std::vector<std::string> names = expand_hostlist(list, list_name);
  std::vector<int> tasks;
  if (const char* per_node = get("SLURM_TASKS_PER_NODE")) {
    tasks = expand_counts(per_node, "SLURM_TASKS_PER_NODE");
    check(tasks.size() == names.size(), "SLURM_TASKS_PER_NODE \"" + std::string(per_node) +
                                            "\" gives " + std::to_string(tasks.size()) +
                                            " nodes, but " + list_name + " \"" + list +
                                            "\" names " + std::to_string(names.size()));
  } else if (const char* each = get("SLURM_NTASKS_PER_NODE")) {
    tasks.assign(names.size(), whole_number("SLURM_NTASKS_PER_NODE", each));
  } else {
    throw Error("inside Slurm job " + a.job_id +
                " but neither SLURM_TASKS_PER_NODE nor SLURM_NTASKS_PER_NODE is set");
  }
  std::set<std::string> seen;
  for (size_t i = 0; i < names.size(); ++i) {
    check(seen.insert(names[i]).second,
          std::string(list_name) + " \"" + list + "\" names " + names[i] + " twice");
    check(tasks[i] >= 1, "SLURM_TASKS_PER_NODE gives node " + names[i] + " no task");
    a.nodes.push_back({names[i], tasks[i]});
  }
  return a;
}

int slurm_restart_count(const Environment& get_env) {
  const char* value = get_env ? get_env("SLURM_RESTART_COUNT") : std::getenv("SLURM_RESTART_COUNT");
  return value == nullptr || *value == '\0' ? 0 : whole_number("SLURM_RESTART_COUNT", value);
}

std::map<std::string, NodeState> parse_node_states(const std::string& output) {
  std::map<std::string, NodeState> nodes;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    const auto name = field(line, "NodeName");
    const auto state = field(line, "State");
    if (!name || !state) continue;
    NodeState node{*state, field(line, "Reason", true).value_or("")};
    // Free text runs to the end of the line, but for fields printed after it where set.
    for (const char* later : {" Comment=", " Extra="}) {
      if (const size_t at = node.reason.find(later); at != std::string::npos) {
        node.reason.erase(at);
      }
    }
    // "[root@2026-11-27T10:40:48]": who set the reason, and when.
    static const std::regex stamp(R"( \[[^\]]*@[^\]]*\]$)");
    node.reason = std::regex_replace(node.reason, stamp, "");
    nodes[*name] = node;
  }
  return nodes;
}

std::string unusable_because(const std::string& state) {
  std::vector<std::string> parts;
  std::istringstream words(state);
  for (std::string part; std::getline(words, part, '+');) parts.push_back(part);
  std::vector<std::string> why;
  for (const std::string& part : parts) {
    if (part == "DOWN") why.emplace_back("down");
    if (part == "DRAIN" || part == "DRAINED" || part == "DRAINING") why.emplace_back("drained");
    if (part == "FAIL" || part == "FAILING") why.emplace_back("failing");
    if (part == "NOT_RESPONDING") why.emplace_back("not responding");
    if (part == "FUTURE" || part == "INVAL") why.emplace_back("not in service");
    if (part.rfind("POWER", 0) == 0) why.emplace_back("powered down");
    if (part.rfind("REBOOT", 0) == 0) why.emplace_back("to be rebooted");
  }
  std::string text;
  for (const std::string& w : why) {
    if (text.find(w) == std::string::npos) text += (text.empty() ? "" : ", ") + w;
  }
  return text;
}

std::optional<std::vector<std::string>> parse_job_nodes(const std::string& output) {
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    const auto nodes = field(line, "NodeList");
    if (nodes && !nodes->empty() && *nodes != "(null)") {
      return expand_hostlist(*nodes, "scontrol show job's NodeList");
    }
  }
  return std::nullopt;
}

std::vector<int> srun_killed_ranks(const std::string& output, std::string* detail) {
  // "srun: error: node2: tasks 2-3: Killed", "srun: error: node1: task 0: Segmentation fault";
  // "...: Exited with exit code 1" is an exit, not a kill.
  static const std::regex task_line(R"(^srun: error: (\S+): tasks? ([0-9,-]+): (.+)$)");
  std::vector<int> ranks;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    // srun ending the step for what it saw: what it reports after that, it did itself.
    if (line.find("Job step aborted") != std::string::npos ||
        line.find("Terminating StepId") != std::string::npos ||
        line.find("forcing job termination") != std::string::npos) {
      break;
    }
    std::smatch m;
    if (!std::regex_match(line, m, task_line)) continue;
    const std::string how = m[3];
    if (how.rfind("Exited with exit code", 0) == 0 || how == "Terminated" || how == "Interrupt" ||
        how == "User defined signal 1") {
      continue;
    }
    for (const std::string& r : expand_hostlist("[" + m[2].str() + "]", "srun's task list")) {
      ranks.push_back(std::stoi(r));
    }
    if (detail != nullptr) *detail += (detail->empty() ? "" : "; ") + line;
  }
  return ranks;
}

std::optional<std::string> run_scontrol(const std::vector<std::string>& args) {
  // scontrol waits for slurmctld up to its MessageTimeout; `timeout` bounds it whatever that is.
  std::string command = "timeout 60 scontrol";
  for (const std::string& a : args) command += " " + quoted(a);
  command += " 2>&1";
  std::FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return std::nullopt;
  std::string output;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) output.append(buffer, n);
  const int status = ::pclose(pipe);
  if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return std::nullopt;
  return output;
}

SlurmNodes::SlurmNodes(Allocation allocation, Scontrol scontrol, double settle_s)
    : allocation_(std::move(allocation)), scontrol_(std::move(scontrol)), settle_s_(settle_s) {}

std::map<std::string, NodeState> SlurmNodes::settled_states(const std::string& names) {
  const auto start = std::chrono::steady_clock::now();
  for (bool said = false;;) {
    const auto output = scontrol_({"show", "node", "-o", names});
    if (!output) {
      std::printf(
          "launch: warning: cannot ask Slurm about the nodes (scontrol show node "
          "failed): using every node of the allocation\n");
      return {};
    }
    auto states = parse_node_states(*output);
    std::string waiting;
    for (const auto& [name, node] : states) {
      if (unusable_because(node.state) == "not responding")
        waiting += (waiting.empty() ? "" : ", ") + name;
    }
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waiting.empty() || waited >= settle_s_) return states;
    if (!said) {
      std::printf("launch: waiting up to %.0f s for Slurm to hear from %s again\n", settle_s_,
                  waiting.c_str());
      std::fflush(stdout);
      said = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
}

std::vector<Host> SlurmNodes::usable() {
  std::string names;
  for (const Host& h : allocation_.nodes) names += (names.empty() ? "" : ",") + h.name;
  std::optional<std::set<std::string>> held;
  if (const auto job = scontrol_({"show", "job", "-o", allocation_.job_id})) {
    if (const auto nodes = parse_job_nodes(*job)) held.emplace(nodes->begin(), nodes->end());
  }
  const auto states = settled_states(names);
  std::map<std::string, std::string> left_out;
  std::vector<Host> hosts;
  for (const Host& h : allocation_.nodes) {
    std::string why;
    if (held && !held->count(h.name)) {
      why = "no longer in job " + allocation_.job_id + "'s allocation";
    } else if (const auto it = states.find(h.name); it != states.end()) {
      why = unusable_because(it->second.state);
      if (!why.empty()) {
        why += " (Slurm state " + it->second.state +
               (it->second.reason.empty() ? "" : ", reason \"" + it->second.reason + "\"") + ")";
      }
    }
    if (why.empty()) {
      hosts.push_back(h);
      if (left_out_.count(h.name)) {
        std::printf("launch: node %s is usable again\n", h.name.c_str());
      }
    } else {
      left_out[h.name] = why;
      const auto before = left_out_.find(h.name);
      if (before == left_out_.end() || before->second != why) {
        std::printf("launch: node %s left out: %s\n", h.name.c_str(), why.c_str());
      }
    }
  }
  std::fflush(stdout);
  left_out_ = std::move(left_out);
  return hosts;
}

std::vector<std::string> srun_command(const std::string& srun,
                                      const std::vector<std::string>& extra,
                                      const std::vector<std::string>& ranks,
                                      const std::vector<std::string>& program) {
  std::string nodelist;
  std::set<std::string> nodes;
  for (const std::string& node : ranks) {
    nodelist += (nodelist.empty() ? "" : ",") + node;
    nodes.insert(node);
  }
  std::vector<std::string> argv = {srun,
                                   "--mpi=pmix",
                                   "--kill-on-bad-exit=1",
                                   "--distribution=arbitrary",
                                   "--nodes=" + std::to_string(nodes.size()),
                                   "--ntasks=" + std::to_string(ranks.size()),
                                   "--nodelist=" + nodelist};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.insert(argv.end(), program.begin(), program.end());
  return argv;
}

}  // namespace malleus::launch
