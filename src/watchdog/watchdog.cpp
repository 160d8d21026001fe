#include "watchdog/watchdog.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <tuple>

#include "common/error.h"
#include "common/files.h"
#include "common/stack_dump.h"
#include "common/stats.h"

namespace malleus::watchdog {

namespace fs = std::filesystem;

namespace {

constexpr size_t kDurationsKept = 10;  // per phase, for its median

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The order of the phases within one step: a rank in an earlier one is behind.
int phase_order(const std::string& phase) {
  if (phase == "step") return 0;
  if (phase == "migration") return 1;  // after a step, when its controller re-planned
  if (phase == "eval") return 2;
  if (phase == "checkpoint") return 3;
  return -1;
}

// "step 7", "the evaluation after step 7", "the checkpoint of step 7".
std::string describe(const std::string& phase, int64_t step) {
  const std::string n = std::to_string(step);
  if (phase == "eval") return "the evaluation after step " + n;
  if (phase == "migration") return "the migration after step " + n;
  if (phase == "checkpoint") return "the checkpoint of step " + n;
  if (phase == "step") return "step " + n;
  return phase + " (step " + n + ")";
}

std::string one_decimal(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", seconds);
  return text;
}

// Replaces `path` with `text` by rename, without fsync: a heartbeat only matters while the job
// runs, and a second of disk latency per beat would make it lie. Returns false on failure.
bool replace_file(const fs::path& path, const std::string& text) {
  const fs::path temp = path.string() + ".tmp";
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  const bool written = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  return written && ::rename(temp.c_str(), path.c_str()) == 0;
}

fs::path heartbeat_file(const fs::path& run_dir, int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank_%05d.json", rank);
  return heartbeat_dir(run_dir) / name;
}

}  // namespace

Json Heartbeat::to_json() const {
  Json json = {{"rank", rank}, {"pid", pid},     {"host", host},
               {"step", step}, {"phase", phase}, {"phase_since", phase_since},
               {"beat", beat}};
  if (!probe.empty()) {
    json["probe"] = Json::array();
    for (const Endpoint& e : probe) json["probe"].push_back(e.text());
  }
  if (!reach.empty()) {
    json["reach"] = Json::object();
    for (const auto& [other, r] : reach) {
      json["reach"][other] = {{"since", r.since},         {"last_ok", r.last_ok},
                              {"last_fail", r.last_fail}, {"probes", r.probes},
                              {"failures", r.failures},   {"spells", r.spells}};
    }
  }
  return json;
}

Heartbeat Heartbeat::from_json(const Json& json, const std::string& source) {
  JsonReader reader(json, source);
  Heartbeat h;
  h.rank = reader.required<int>("rank");
  h.pid = reader.required<int64_t>("pid");
  h.host = reader.required<std::string>("host");
  h.step = reader.required<int64_t>("step");
  h.phase = reader.required<std::string>("phase");
  h.phase_since = reader.required<double>("phase_since");
  h.beat = reader.required<double>("beat");
  for (const auto& e : reader.optional<std::vector<std::string>>("probe", {})) {
    h.probe.push_back(Endpoint::parse(e, source + ": key \"probe\""));
  }
  const Json reach = reader.optional<Json>("reach", Json::object());
  check(reach.is_object(), source + ": key \"reach\" must be an object");
  for (const auto& [other, value] : reach.items()) {
    JsonReader r(value, source + ": key \"reach\"." + other);
    h.reach[other] = {r.required<double>("since"),     r.required<double>("last_ok"),
                      r.required<double>("last_fail"), r.required<int64_t>("probes"),
                      r.required<int64_t>("failures"), r.required<int64_t>("spells")};
    r.finish();
  }
  reader.finish();
  return h;
}

fs::path heartbeat_dir(const fs::path& run_dir) {
  return run_dir / "heartbeats";
}

fs::path hang_report_path(const fs::path& run_dir) {
  return run_dir / "hang.json";
}

std::vector<std::optional<Heartbeat>> read_heartbeats(const fs::path& run_dir, int world_size) {
  std::vector<std::optional<Heartbeat>> heartbeats(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) {
    const fs::path file = heartbeat_file(run_dir, r);
    try {
      heartbeats[static_cast<size_t>(r)] =
          Heartbeat::from_json(parse_json(read_file(file), file.string()), file.string());
    } catch (const Error&) {
      // missing or unreadable: named as missing
    }
  }
  return heartbeats;
}

std::vector<std::string> job_hosts(const std::vector<std::optional<Heartbeat>>& heartbeats) {
  std::vector<std::string> hosts;
  for (const auto& h : heartbeats) {
    if (h && std::find(hosts.begin(), hosts.end(), h->host) == hosts.end()) {
      hosts.push_back(h->host);
    }
  }
  return hosts;
}

std::map<std::string, std::vector<Endpoint>> probe_targets(
    const std::vector<std::optional<Heartbeat>>& heartbeats, int rank) {
  // Each host's leader: its lowest rank with a heartbeat that says where it listens.
  std::map<std::string, const Heartbeat*> leaders;
  for (const auto& h : heartbeats) {
    if (h && !h->probe.empty() && !leaders.count(h->host)) leaders[h->host] = &*h;
  }
  std::map<std::string, std::vector<Endpoint>> targets;
  const auto own = std::find_if(heartbeats.begin(), heartbeats.end(),
                                [&](const auto& h) { return h && h->rank == rank; });
  if (own == heartbeats.end() || !leaders.count((*own)->host)) return targets;
  const Heartbeat& leader = *leaders.at((*own)->host);
  // The leader probes for its host; another rank only while the leader is not held where it is
  // (it finished the step and waits in the next phase, which is not overdue).
  const bool leads = leader.rank == rank;
  if (!leads && leader.phase == (*own)->phase && leader.step == (*own)->step) return targets;
  for (const auto& [host, other] : leaders) {
    if (host != (*own)->host) targets[host] = other->probe;
  }
  return targets;
}

std::vector<HostReport> leader_reports(const std::vector<std::optional<Heartbeat>>& heartbeats,
                                       double now, double stale_after_s) {
  std::vector<HostReport> reports;
  for (const auto& h : heartbeats) {
    if (!h || h->reach.empty() || now - h->beat > stale_after_s) continue;
    const bool known = std::any_of(reports.begin(), reports.end(),
                                   [&](const HostReport& r) { return r.host == h->host; });
    if (!known) reports.push_back({h->host, h->reach});
  }
  return reports;
}

HangDiagnosis diagnose_partition(const std::vector<std::optional<Heartbeat>>& heartbeats,
                                 const Partition& p) {
  HangDiagnosis d;
  d.ranks = Json::array();
  for (const auto& h : heartbeats) {
    if (!h) continue;
    const bool cut = std::find(p.cut_off.begin(), p.cut_off.end(), h->host) != p.cut_off.end();
    if (cut) d.lost_ranks.push_back(h->rank);
    d.ranks.push_back(
        {{"rank", h->rank}, {"status", cut ? "cut off" : "waiting"}, {"heartbeat", h->to_json()}});
  }
  std::sort(d.lost_ranks.begin(), d.lost_ranks.end());
  std::string ranks;
  for (int r : d.lost_ranks) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  d.message =
      p.message() + ": " + (d.lost_ranks.size() == 1 ? "rank " : "ranks ") + ranks + " left out";
  return d;
}

HangDiagnosis diagnose_hang(const std::vector<std::optional<Heartbeat>>& heartbeats, double now,
                            double stale_after_s) {
  HangDiagnosis d;
  d.ranks = Json::array();
  // The furthest point any running rank has reached.
  std::optional<std::tuple<int64_t, int>> furthest;
  std::string furthest_text;
  for (const auto& h : heartbeats) {
    if (!h || now - h->beat > stale_after_s) continue;
    const auto at = std::make_tuple(h->step, phase_order(h->phase));
    if (!furthest || at > *furthest) {
      furthest = at;
      furthest_text = describe(h->phase, h->step);
    }
  }
  std::string named;
  for (size_t r = 0; r < heartbeats.size(); ++r) {
    const auto& h = heartbeats[r];
    const int rank = static_cast<int>(r);
    Json entry = {{"rank", rank}};
    std::string why;
    if (!h) {
      entry["status"] = "missing";
      why = "no heartbeat";
    } else {
      entry["heartbeat"] = h->to_json();
      const double age = now - h->beat;
      entry["heartbeat_age_s"] = age;
      const std::string where = describe(h->phase, h->step);
      if (age > stale_after_s) {
        entry["status"] = "stale";
        why = "no heartbeat for " + one_decimal(age) + " s (pid " + std::to_string(h->pid) +
              " on " + h->host + " is not running), last in " + where;
      } else if (furthest && std::make_tuple(h->step, phase_order(h->phase)) < *furthest) {
        entry["status"] = "behind";
        why = "still in " + where + " (for " + one_decimal(now - h->phase_since) + " s)";
      } else {
        entry["status"] = "waiting";
      }
    }
    if (!why.empty()) {
      d.lost_ranks.push_back(rank);
      named += (named.empty() ? "" : "; ") + ("rank " + std::to_string(rank) + ": " + why);
    }
    d.ranks.push_back(std::move(entry));
  }
  if (d.lost_ranks.empty()) {
    d.message = "every rank is alive and at " +
                (furthest ? furthest_text : std::string("the same point")) +
                ": a collective that never completed, no rank to blame";
  } else {
    d.message = "did not arrive: " + named;
  }
  return d;
}

double behind_ranks_due(const HangDiagnosis& d,
                        const std::vector<std::optional<Heartbeat>>& heartbeats,
                        const std::function<double(const std::string&)>& limit_of) {
  double due = 0;
  for (int rank : d.lost_ranks) {
    const auto& h = heartbeats[static_cast<size_t>(rank)];
    if (!h || d.ranks[static_cast<size_t>(rank)].value("status", "") != "behind") return 0;
    due = std::max(due, h->phase_since + limit_of(h->phase));
  }
  return due;
}

Watchdog::Watchdog(const fs::path& run_dir, int rank, int world_size, WatchdogOptions options)
    : run_dir_(run_dir), rank_(rank), world_size_(world_size), options_(options) {
  if (options_.beat_interval_s <= 0) {
    options_.beat_interval_s = std::clamp(options_.floor_s / 10, 0.1, 1.0);
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  host_ = host;
  std::error_code ec;
  fs::create_directories(heartbeat_dir(run_dir_), ec);
  check(!ec, "cannot create " + heartbeat_dir(run_dir_).string() + ": " + ec.message());
  const std::string network = options_.network.empty() ? job_network() : options_.network;
  std::vector<std::string> addresses = job_addresses(network);  // Error: a malformed network
  if (!addresses.empty()) {
    try {
      prober_ = std::make_unique<Prober>(std::move(addresses));
    } catch (const Error& e) {
      // Without probes a partition is judged by the other hosts' probes, or not at all.
      std::fprintf(stderr, "warning: [rank %d] %s\n", rank_, e.what());
    }
  }
  phase_since_unix_ = unix_now();
  phase_start_ = Clock::now();
  training_thread_ = ::pthread_self();
  training_tid_ = ::gettid();
  prepare_stack_dumps();
  beat();
  thread_ = std::thread([this] { loop(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void Watchdog::clear(const fs::path& run_dir) {
  std::error_code ec;
  fs::remove_all(heartbeat_dir(run_dir), ec);
  fs::remove(hang_report_path(run_dir), ec);
}

void Watchdog::enter(const std::string& phase, int64_t step) {
  bool stop_probing = false;
  {
    std::lock_guard lock(mutex_);
    const auto now = Clock::now();
    if (!phase_.empty()) {
      auto& kept = durations_[phase_];
      kept.push_back(std::chrono::duration<double>(now - phase_start_).count());
      if (kept.size() > kDurationsKept) kept.erase(kept.begin());
    }
    phase_ = phase;
    step_ = step;
    phase_start_ = now;
    phase_since_unix_ = unix_now();
    stop_probing = probing_;
    probing_ = false;
    extended_limit_s_ = 0;
    beat_due_ = true;
  }
  wake_.notify_all();
  if (stop_probing && prober_) prober_->set_targets({});
}

double Watchdog::limit_s(const std::string& phase) const {
  std::lock_guard lock(mutex_);
  return limit_locked(phase);
}

double Watchdog::limit_locked(const std::string& phase) const {
  const auto it = durations_.find(phase);
  if (it == durations_.end() || it->second.empty()) return options_.floor_s;
  return std::max(options_.floor_s, options_.multiple * median(it->second));
}

void Watchdog::beat() {
  Heartbeat h;
  {
    std::lock_guard lock(mutex_);
    h.step = step_;
    h.phase = phase_.empty() ? "start" : phase_;
    h.phase_since = phase_since_unix_;
  }
  h.rank = rank_;
  h.pid = ::getpid();
  h.host = host_;
  if (prober_) {
    h.probe = prober_->endpoints();
    h.reach = prober_->reach();
  }
  h.beat = unix_now();
  // A beat that cannot be written is not fatal: the rank then looks stale to the others only if
  // they find the job hung for another reason.
  replace_file(heartbeat_file(run_dir_, rank_), h.to_json().dump() + "\n");
}

// This rank's probes of the other hosts, if it leads its host (watchdog/probe.h).
void Watchdog::start_probing() {
  if (!prober_) return;
  prober_->set_targets(probe_targets(read_heartbeats(run_dir_, world_size_), rank_));
}

void Watchdog::loop() {
  const auto interval = std::chrono::duration<double>(options_.beat_interval_s);
  auto last_tick = Clock::now();
  std::unique_lock lock(mutex_);
  while (true) {
    // Every interval, and as soon as a phase begins.
    wake_.wait_for(lock, interval, [this] { return stopping_ || beat_due_; });
    if (stopping_) break;
    beat_due_ = false;
    const auto now = Clock::now();
    const double gap = std::chrono::duration<double>(now - last_tick).count();
    last_tick = now;
    // Time this process did not run at all (it was stopped, or its host froze) does not count
    // against the others: it was the one that kept them waiting.
    if (gap > 5 * options_.beat_interval_s) {
      phase_start_ += std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(gap - options_.beat_interval_s));
    }
    const std::string phase = phase_;
    const double waited = std::chrono::duration<double>(now - phase_start_).count();
    const double limit = limit_locked(phase);
    const double deadline = std::max(limit, extended_limit_s_);
    const bool start = !phase.empty() && !probing_ && waited > limit / 2;
    probing_ = probing_ || start;
    lock.unlock();
    if (start) start_probing();
    beat();
    // Another rank judged the job hung: this one is done too, within a beat of the verdict,
    // wherever mpirun can no longer reach it (a host cut off that still sees the run directory).
    std::error_code ec;
    if (fs::exists(hang_report_path(run_dir_), ec)) end_after_verdict();
    if (!phase.empty() && waited > deadline) judge(waited, limit);
    lock.lock();
  }
}

// Stale: well past the beat interval, and more than half the limit, so that a rank the scheduler
// delayed is not mistaken for one that stopped.
void Watchdog::judge(double waited_s, double limit_s) {
  const double now = unix_now();
  const double stale_after = std::max(3 * options_.beat_interval_s, limit_s / 2);
  const auto heartbeats = read_heartbeats(run_dir_, world_size_);
  const Partition p =
      find_partition(job_hosts(heartbeats), leader_reports(heartbeats, now, stale_after), now,
                     options_.cut_after_s);
  const Json partition = {{"stale_after_s", stale_after},
                          {"partition",
                           {{"kept", p.kept},
                            {"cut_off", p.cut_off},
                            {"cut", p.cut},
                            {"lossy", p.lossy},
                            {"failing", p.failing},
                            {"healed", p.healed}}}};
  if (p.partitioned()) report_hang(waited_s, limit_s, diagnose_partition(heartbeats, p), partition);
  if (!p.failing.empty()) return;  // cut, or not: known within cut_after_s
  if (!p.healed.empty()) {
    std::lock_guard lock(mutex_);
    if (extended_limit_s_ == 0) {
      // Each of the collective's stalled connections resumes within about the outage of the
      // link's return, and they may resume one after another: twice as long again.
      extended_limit_s_ = 3 * waited_s;
      std::fprintf(
          stderr,
          "warning: [rank %d] watchdog: %s has taken %s s, over its limit of %s s, but the "
          "link %s went down and came back: waiting until %s s\n",
          rank_, describe(phase_, step_).c_str(), one_decimal(waited_s).c_str(),
          one_decimal(limit_s).c_str(), p.healed.front().c_str(),
          one_decimal(extended_limit_s_).c_str());
      std::fflush(stderr);
      return;
    }
  }
  const HangDiagnosis d = diagnose_hang(heartbeats, now, stale_after);
  // Ranks still in an earlier phase, alive and within that phase's limit: not late yet.
  const double due = behind_ranks_due(
      d, heartbeats, [this](const std::string& phase) { return this->limit_s(phase); });
  if (now < due) return;
  if (d.lost_ranks.empty() && !p.healed.empty()) {
    // Given more time and still held, every rank alive at the same point: the links whose probes
    // failed in this phase (they drop packets, or flap) are what holds it.
    const Partition q =
        find_partition(job_hosts(heartbeats), leader_reports(heartbeats, now, stale_after), now,
                       options_.cut_after_s, /*healed_is_cut=*/true);
    if (q.partitioned()) {
      Json details = partition;
      details["partition"]["cut_off"] = q.cut_off;
      details["partition"]["kept"] = q.kept;
      details["partition"]["lossy"] = q.lossy;
      report_hang(waited_s, limit_s, diagnose_partition(heartbeats, q), details);
    }
  }
  report_hang(waited_s, limit_s, d, partition);
}

std::string Watchdog::training_thread_report() const {
  return stack_of(training_thread_) + kernel_state_of(training_tid_);
}

void Watchdog::end_after_verdict() {
  // Where this rank's training thread waits, as report_hang prints it.
  const std::string stack = training_thread_report();
  std::fprintf(stderr, "[rank %d] watchdog: the training thread's stack:\n%s", rank_,
               stack.c_str());
  std::fprintf(stderr,
               "error: [rank %d] watchdog: another rank found the job hung (%s): this rank ends "
               "too\n",
               rank_, hang_report_path(run_dir_).c_str());
  std::fflush(stderr);
  std::fflush(stdout);
  std::_Exit(kHangExitCode);
}

void Watchdog::report_hang(double waited_s, double limit_s, const HangDiagnosis& d,
                           const Json& details) {
  const fs::path path = hang_report_path(run_dir_);
  std::string phase;
  int64_t step = 0;
  {
    std::lock_guard lock(mutex_);
    phase = phase_;
    step = step_;
  }
  const std::string waited = "watchdog: " + describe(phase, step) + " has taken " +
                             one_decimal(waited_s) + " s, over its limit of " +
                             one_decimal(limit_s) + " s";
  // Where this rank's training thread waits (common/stack_dump.h): with every rank's, the call
  // the job is stuck in; and the kernel's view of it (in a system call, or denied its core).
  const std::string stack = training_thread_report();
  std::fprintf(stderr, "[rank %d] watchdog: the training thread's stack:\n%s", rank_,
               stack.c_str());
  std::error_code ec;
  if (fs::exists(path, ec)) {
    // Another rank named the culprits first (and mpirun may since have woken a stopped one).
    std::fprintf(stderr, "error: [rank %d] %s; see %s\n", rank_, waited.c_str(), path.c_str());
    std::fflush(stderr);
    std::_Exit(kHangExitCode);
  }
  const std::string message = waited + "; " + d.message;
  Json report = {{"detected_by", rank_},
                 {"step", step},
                 {"phase", phase},
                 {"waited_s", waited_s},
                 {"limit_s", limit_s},
                 {"lost_ranks", d.lost_ranks},
                 {"message", message},
                 {"ranks", d.ranks},
                 {"stack", stack},
                 {"time", unix_now()},
                 {"cut_off_hosts", details["partition"]["cut_off"]}};
  report.update(details);
  // The first rank to get here writes the report: link() does not replace an existing file.
  const fs::path temp = path.string() + ".tmp." + std::to_string(::getpid());
  const std::string text = report.dump(2) + "\n";
  bool first = false;
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd >= 0) {
    const bool written =
        ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) &&
        ::fsync(fd) == 0;
    ::close(fd);
    first = written && ::link(temp.c_str(), path.c_str()) == 0;
    ::unlink(temp.c_str());
  }
  std::fprintf(stderr, "error: [rank %d] %s%s\n", rank_, message.c_str(),
               first ? (" (written to " + path.string() + ")").c_str() : "");
  std::fflush(stderr);
  std::fflush(stdout);
  std::_Exit(kHangExitCode);
}

}  // namespace malleus::watchdog
