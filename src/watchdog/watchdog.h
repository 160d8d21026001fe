// Hang and partition detection inside a job. A rank that stops (SIGSTOP, a host that froze, a
// stuck driver) leaves every other rank waiting in a collective forever; so does a host whose link
// went down; MPI notices neither, because no process exited. While a Watchdog lives, a thread of
// each rank
//
// - writes the rank's heartbeat (step, phase, when the phase began, when it last beat, where its
//   probe listener is) into <run>/heartbeats/rank_<r>.json every `beat_interval` seconds and
//   as each phase begins (so the others, and a test that acts in a phase, see it at once);
// - checks whether the rank's current phase (a training step, a migration, an evaluation, a
//   checkpoint) has lasted longer than its limit, max(floor, multiple × the median of that
//   phase's earlier durations). From half the limit on, the leader rank of each host (its
//   lowest) probes the other hosts' leaders over the job's network (watchdog/probe.h) and writes
//   what it found into its heartbeat;
// - at the limit, judges from every rank's heartbeat (watchdog/partition.h):
//   - a link no probe crossed for `cut_after_s`: the hosts on the far side of it are cut off; they
//     are named with their ranks (a partition);
//   - a link whose probes fail but not for `cut_after_s` yet: it waits, at most that long;
//   - a link that was down in this phase and came back: the phase gets twice as long again as it
//     has waited, once (TCP resends on a timeout that doubles, so a connection that stalled for T
//     resumes within about T of the link's return, and a collective's connections may resume one
//     after another);
//   - else the ranks that did not arrive: a heartbeat that went stale (the process is not
//     running) or a rank still in an earlier phase; or nobody, when all wait at the same point.
//     A rank still in an earlier phase is waited for until that phase's own limit (its watchdog
//     names it then), so a straggling step is not blamed on the checkpoint that waits for it.
//   It writes that diagnosis to <run>/hang.json (the first rank to get there wins) and to stderr,
//   and ends its process with kHangExitCode, which makes mpirun end the others; the others' own
//   threads also end their ranks within a beat once hang.json is there (for ranks on a host mpirun
//   cannot reach).
//
// `malleus launch` reads hang.json to leave the named ranks (and cut-off hosts) out when it
// restarts the job. Ranks on several hosts need the run directory on a shared file system and
// clocks in step (NTP) for the heartbeats to be compared; a rank whose heartbeat is missing is
// named as missing.
#pragma once

#include <pthread.h>
#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/json.h"
#include "watchdog/partition.h"
#include "watchdog/probe.h"

namespace malleus::watchdog {

// The exit status of a rank whose watchdog found the job hung (distinct from errors, 1, and
// signals, 128 + n).
inline constexpr int kHangExitCode = 87;

struct WatchdogOptions {
  double floor_s = 120;  // no phase is called hung sooner than this
  double multiple = 10;  // ... nor sooner than this many times its median duration so far
  // 0: derived from the floor (a tenth of it, within 0.1–1 s).
  double beat_interval_s = 0;
  double cut_after_s = 3;  // a link no probe crossed for this long is cut
  // The job's network, for the probes (watchdog/probe.h's job_addresses); "": job_network().
  std::string network = "";
};

// One rank's heartbeat as written to its file. Times are seconds since the Unix epoch.
struct Heartbeat {
  int rank = 0;
  int64_t pid = 0;
  std::string host;
  int64_t step = 0;   // the step the phase belongs to (a training step: the one being made)
  std::string phase;  // "step", "migration", "eval", "checkpoint"
  double phase_since = 0;
  double beat = 0;
  std::vector<Endpoint> probe;         // where its probe listener is reached
  std::map<std::string, Reach> reach;  // a host leader's probes of the other hosts (overdue phase)
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
// Until when (Unix seconds) a rank should wait for the ranks `d` names as behind: each is given
// until its own phase reaches its limit (`limit_of(phase)`), when its own watchdog judges it. A
// rank that waits in a later phase (a checkpoint's collective after a straggling step) is not
// the one to call the job hung while the rank it waits for is within its own limit. 0: some rank
// `d` names is not merely behind (stale, missing), or none is named.
double behind_ranks_due(const HangDiagnosis& d,
                        const std::vector<std::optional<Heartbeat>>& heartbeats,
                        const std::function<double(const std::string&)>& limit_of);
// The ranks on the hosts `p` cuts off, named with their hosts (a rank without a heartbeat is on no
// known host and not named).
HangDiagnosis diagnose_partition(const std::vector<std::optional<Heartbeat>>& heartbeats,
                                 const Partition& p);

// The files of a run directory the watchdog writes.
std::filesystem::path heartbeat_dir(const std::filesystem::path& run_dir);
std::filesystem::path hang_report_path(const std::filesystem::path& run_dir);
// The heartbeats of ranks 0..world_size-1 in `run_dir` (nullopt: no file, or one not readable).
std::vector<std::optional<Heartbeat>> read_heartbeats(const std::filesystem::path& run_dir,
                                                      int world_size);

// The hosts of a job, rank 0's first, from its ranks' heartbeats.
std::vector<std::string> job_hosts(const std::vector<std::optional<Heartbeat>>& heartbeats);
// The other hosts' leaders' probe endpoints (a host's leader: its lowest rank), for the leader of
// `rank`'s host, and for another rank of it whose heartbeat is in another phase or step than its
// leader's: a rank held in a step whose leader moved on to the next phase (a collective's last
// bytes to it still in flight on a link that drops them) probes for its host, as the leader's own
// phase is not overdue. Empty for any other rank.
std::map<std::string, std::vector<Endpoint>> probe_targets(
    const std::vector<std::optional<Heartbeat>>& heartbeats, int rank);
// For each host, the report of its lowest rank that probed (the leader's, or one held where the
// leader is not), among the heartbeats that are not older than `stale_after_s`.
std::vector<HostReport> leader_reports(const std::vector<std::optional<Heartbeat>>& heartbeats,
                                       double now, double stale_after_s);

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
  // At the limit: ends the process naming who is to blame, or returns to wait longer.
  void judge(double waited_s, double limit_s);
  void start_probing();
  // The training thread's stack and what the kernel says of it, for stderr.
  std::string training_thread_report() const;
  // Once another rank wrote hang.json: ends this process too (a host mpirun cannot reach).
  [[noreturn]] void end_after_verdict();
  // `details`: stale_after_s and the partition's findings, for hang.json.
  [[noreturn]] void report_hang(double waited_s, double limit_s, const HangDiagnosis& d,
                                const Json& details);

  std::filesystem::path run_dir_;
  int rank_, world_size_;
  WatchdogOptions options_;
  std::string host_;
  std::unique_ptr<Prober> prober_;  // none where this host has no address on the job's network

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  bool beat_due_ = false;  // a phase began since the last beat
  std::string phase_;      // empty: not in a watched phase yet
  int64_t step_ = 0;
  Clock::time_point phase_start_;
  double phase_since_unix_ = 0;
  bool probing_ = false;         // this phase's probes were started
  double extended_limit_s_ = 0;  // a healed link's extension of this phase's limit (0: none)
  std::map<std::string, std::vector<double>> durations_;  // the latest of each phase, newest last
  pthread_t training_thread_{};  // the thread that made the watchdog: its stack goes in a report
  pid_t training_tid_ = 0;       // the same thread, as the kernel names it
  std::thread thread_;
};

}  // namespace malleus::watchdog
