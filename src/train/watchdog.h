// Hang detection inside a job. A rank that stops (SIGSTOP, a host that froze, a stuck driver)
// leaves every other rank waiting in a collective forever; MPI notices nothing because no process
// exited. While a Watchdog lives, a thread of each rank
//
// - writes the rank's heartbeat (step, phase, when the phase began, when it last beat) into
//   <run>/heartbeats/rank_<r>.json every `beat_interval` seconds, and
// - checks whether the rank's current phase (a training step, an evaluation, a checkpoint) has
//   lasted longer than max(floor, multiple × the median of that phase's earlier durations). If so,
//   it reads every rank's heartbeat, names the ranks that did not arrive — a heartbeat that went
//   stale (the process is not running) or a rank still in an earlier phase —, writes that
//   diagnosis to <run>/hang.json (the first rank to get there wins) and to stderr, and ends its
//   process with kHangExitCode, which makes mpirun end the others.
//
// `malleus launch` reads hang.json to exclude the named ranks when it restarts the job. Ranks on
// several hosts need the run directory on a shared file system and clocks in step (NTP) for the
// heartbeats to be compared; a rank whose heartbeat is missing is named as missing.
#pragma once

#include <pthread.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "common/json.h"

namespace malleus::train {

// The exit status of a rank whose watchdog found the job hung (distinct from errors, 1, and
// signals, 128 + n).
inline constexpr int kHangExitCode = 87;

struct WatchdogOptions {
  double floor_s = 120;  // no phase is called hung sooner than this
  double multiple = 10;  // ... nor sooner than this many times its median duration so far
  // 0: derived from the floor (a tenth of it, within 0.1–1 s).
  double beat_interval_s = 0;
};

// One rank's heartbeat as written to its file. Times are seconds since the Unix epoch.
struct Heartbeat {
  int rank = 0;
  int64_t pid = 0;
  std::string host;
  int64_t step = 0;   // the step the phase belongs to (a training step: the one being made)
  std::string phase;  // "step", "eval", "checkpoint"
  double phase_since = 0;
  double beat = 0;
  Json to_json() const;
  static Heartbeat from_json(const Json& json, const std::string& source);
};

// Who did not arrive, from every rank's heartbeat (nullopt: no heartbeat file) at time `now`.
// A heartbeat older than `stale_after_s` names its rank as not running; of the running ranks,
// those in an earlier (step, phase) than the furthest one are named as behind. When nobody can be
// named (every rank alive at the same point), lost_ranks is empty.
struct HangDiagnosis {
  std::vector<int> lost_ranks;
  std::string message;  // one line: what was waited for, who did not arrive
  Json ranks;           // per rank: status ("stale", "missing", "behind", "waiting"), heartbeat
};
HangDiagnosis diagnose_hang(const std::vector<std::optional<Heartbeat>>& heartbeats, double now,
                            double stale_after_s);

// The files of a run directory the watchdog writes.
std::filesystem::path heartbeat_dir(const std::filesystem::path& run_dir);
std::filesystem::path hang_report_path(const std::filesystem::path& run_dir);

class Watchdog {
 public:
  // Starts the thread. Rank 0 should call clear() first, before every rank starts. The calling
  // thread is the one whose stack a hang report shows (common/stack_dump.h).
  Watchdog(const std::filesystem::path& run_dir, int rank, int world_size, WatchdogOptions options);
  ~Watchdog();  // stops the thread
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // The rank now works on `phase` of `step`; the previous phase, if any, ended now.
  void enter(const std::string& phase, int64_t step);
  // The limit a phase runs under now (for the header line and tests).
  double limit_s(const std::string& phase) const;
  const WatchdogOptions& options() const { return options_; }

  // Removes a previous run's heartbeats and hang report (rank 0, before the ranks start).
  static void clear(const std::filesystem::path& run_dir);

 private:
  using Clock = std::chrono::steady_clock;
  void loop();
  void beat();
  double limit_locked(const std::string& phase) const;
  [[noreturn]] void report_hang(double waited_s, double limit_s);

  std::filesystem::path run_dir_;
  int rank_, world_size_;
  WatchdogOptions options_;
  std::string host_;

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::string phase_;  // empty: not in a watched phase yet
  int64_t step_ = 0;
  Clock::time_point phase_start_;
  double phase_since_unix_ = 0;
  std::map<std::string, std::vector<double>> durations_;  // the latest of each phase, newest last
  pthread_t training_thread_{};  // the thread that made the watchdog: its stack goes in a report
  std::thread thread_;
};

// Collective: hang detection for the run in `run_dir` on every rank of `world`, in `*watchdog`,
// once rank 0 has cleared the previous run's heartbeats (the barrier keeps the others from
// writing theirs before rank 0 has taken the run directory, run_directory.h, and cleared it).
// Rank 0 says so on stdout.
void start_watchdog(const std::filesystem::path& run_dir, const comm::Communicator& world,
                    WatchdogOptions options, std::optional<Watchdog>* watchdog);

}  // namespace malleus::train
