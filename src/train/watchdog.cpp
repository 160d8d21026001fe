#include "train/watchdog.h"

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

namespace malleus::train {

namespace fs = std::filesystem;

namespace {

constexpr size_t kDurationsKept = 10;  // per phase, for its median

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The order of the phases within one step: a rank in an earlier one is behind.
int phase_order(const std::string& phase) {
  if (phase == "step") return 0;
  if (phase == "eval") return 1;
  if (phase == "checkpoint") return 2;
  return -1;
}

// "step 7", "the evaluation after step 7", "the checkpoint of step 7".
std::string describe(const std::string& phase, int64_t step) {
  const std::string n = std::to_string(step);
  if (phase == "eval") return "the evaluation after step " + n;
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
  return {{"rank", rank}, {"pid", pid},     {"host", host},
          {"step", step}, {"phase", phase}, {"phase_since", phase_since},
          {"beat", beat}};
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
  reader.finish();
  return h;
}

fs::path heartbeat_dir(const fs::path& run_dir) {
  return run_dir / "heartbeats";
}

fs::path hang_report_path(const fs::path& run_dir) {
  return run_dir / "hang.json";
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
  phase_since_unix_ = unix_now();
  phase_start_ = Clock::now();
  training_thread_ = ::pthread_self();
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
  h.beat = unix_now();
  // A beat that cannot be written is not fatal: the rank then looks stale to the others only if
  // they find the job hung for another reason.
  replace_file(heartbeat_file(run_dir_, rank_), h.to_json().dump() + "\n");
}

void Watchdog::loop() {
  const auto interval = std::chrono::duration<double>(options_.beat_interval_s);
  auto last_tick = Clock::now();
  std::unique_lock lock(mutex_);
  while (!wake_.wait_for(lock, interval, [this] { return stopping_; })) {
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
    lock.unlock();
    beat();
    if (!phase.empty() && waited > limit) report_hang(waited, limit);
    lock.lock();
  }
}

void Watchdog::report_hang(double waited_s, double limit_s) {
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
  // the job is stuck in.
  const std::string stack = stack_of(training_thread_);
  std::fprintf(stderr, "[rank %d] watchdog: the training thread's stack:\n%s", rank_,
               stack.c_str());
  std::error_code ec;
  if (fs::exists(path, ec)) {
    // Another rank named the culprits first (and mpirun may since have woken a stopped one).
    std::fprintf(stderr, "error: [rank %d] %s; see %s\n", rank_, waited.c_str(), path.c_str());
    std::fflush(stderr);
    std::_Exit(kHangExitCode);
  }
  std::vector<std::optional<Heartbeat>> heartbeats(static_cast<size_t>(world_size_));
  for (int r = 0; r < world_size_; ++r) {
    const fs::path file = heartbeat_file(run_dir_, r);
    try {
      heartbeats[static_cast<size_t>(r)] =
          Heartbeat::from_json(parse_json(read_file(file), file.string()), file.string());
    } catch (const Error&) {
      // missing or unreadable: named as missing
    }
  }
  // Stale: well past the beat interval, and more than half the limit, so that a rank the
  // scheduler delayed is not mistaken for one that stopped.
  const double stale_after = std::max(3 * options_.beat_interval_s, limit_s / 2);
  const HangDiagnosis d = diagnose_hang(heartbeats, unix_now(), stale_after);
  const std::string message = waited + "; " + d.message;
  const Json report = {{"detected_by", rank_},
                       {"step", step},
                       {"phase", phase},
                       {"waited_s", waited_s},
                       {"limit_s", limit_s},
                       {"stale_after_s", stale_after},
                       {"lost_ranks", d.lost_ranks},
                       {"message", message},
                       {"ranks", d.ranks},
                       {"stack", stack},
                       {"time", unix_now()}};
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

void start_watchdog(const fs::path& run_dir, const comm::Communicator& world,
                    WatchdogOptions options, std::optional<Watchdog>* watchdog) {
  if (world.rank() == 0) Watchdog::clear(run_dir);
  world.barrier();
  watchdog->emplace(run_dir, world.rank(), world.size(), options);
  if (world.rank() == 0) {
    std::printf(
        "watchdog: a step, evaluation or checkpoint over max(%g s, %g × its median) ends the "
        "job, naming the ranks that did not arrive (%s)\n",
        options.floor_s, options.multiple, hang_report_path(run_dir).c_str());
    std::fflush(stdout);
  }
}

}  // namespace malleus::train
