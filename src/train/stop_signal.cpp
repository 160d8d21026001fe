#include "train/stop_signal.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <termios.h>

#include <cerrno>
#include <csignal>
#include <cstring>

#include "common/files.h"
#include "common/json.h"

namespace malleus::train {

namespace {

constexpr int kSignals[] = {SIGTERM, SIGINT, SIGUSR1};

volatile std::sig_atomic_t g_received = 0;
struct sigaction g_previous[sizeof kSignals / sizeof kSignals[0]];
struct sigaction g_previous_wake;
// The thread that made the StopSignals: the one that trains and writes the output.
pthread_t g_main;

// Sent to the main thread when a stop signal reached another one, only to interrupt a call it is
// blocked in (its handler does nothing; no SA_RESTART).
int wake_signal() {
  return SIGRTMIN + 5;
}
void wake(int) {}

// Whether `fd` is a terminal other than this process's controlling one: mpirun gives each rank's
// stdout a pseudo-terminal of its own (the rank has no controlling terminal), which stops being
// read like a pipe. A user's own terminal is read while it shows the stop. Async-signal-safe:
// tcgetattr and tcgetpgrp.
bool foreign_terminal(int fd) {
  struct termios mode;
  return ::tcgetattr(fd, &mode) == 0 && ::tcgetpgrp(fd) < 0;
}

// stdout and stderr non-blocking where they are pipes, sockets or a terminal no one may be
// reading (foreign_terminal). Async-signal-safe: fstat, fcntl and foreign_terminal only.
void unblock_unread_output() {
  for (int fd : {1, 2}) {
    struct stat st;
    if (::fstat(fd, &st) != 0) continue;
    if (!S_ISFIFO(st.st_mode) && !S_ISSOCK(st.st_mode) &&
        !(S_ISCHR(st.st_mode) && foreign_terminal(fd))) {
      continue;
    }
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags >= 0) ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  }
}

// Async-signal-safe: a store to a sig_atomic_t, and for SIGTERM and SIGINT unblock_unread_output().
void record(int signal) {
  const int saved_errno = errno;
  if (g_received == 0) g_received = signal;
  // mpirun stops reading its ranks' output as soon as it is terminated or interrupted, seconds
  // before it passes SIGTERM on, so a rank's output pipe (stderr) or pseudo-terminal (stdout)
  // may be full by then. Were it made non-blocking only on the way out, a line written after the
  // signal and before that (the step's own line) would block forever once the pipe filled, and
  // the kill would come before the checkpoint (CliMpi.SignalsToMpirunStopTheJobWithACheckpointSlow
  // failed so, rarely). A write already blocked when the signal comes returns EINTR, or the count
  // it wrote (no SA_RESTART); stdio then writes the rest, which must not block again (the same
  // test failed so, 2 times in 50, while stdout's pseudo-terminal was left blocking).
  if (signal == SIGTERM || signal == SIGINT) unblock_unread_output();
  // The kernel gives a process's signal to any thread not blocking it: MPI's, OpenMP's, the
  // watchdog's. A write the main thread is blocked in would then not return (its O_NONBLOCK comes
  // too late for a write already waiting), and the kill would come before the checkpoint (the
  // signal test failed so under a loaded ctest). pthread_kill is async-signal-safe.
  if (!pthread_equal(pthread_self(), g_main)) pthread_kill(g_main, wake_signal());
  errno = saved_errno;
}

}  // namespace

StopSignals::StopSignals() {
  g_received = 0;
  g_main = pthread_self();
  struct sigaction wakes;
  std::memset(&wakes, 0, sizeof wakes);
  wakes.sa_handler = wake;
  sigemptyset(&wakes.sa_mask);
  ::sigaction(wake_signal(), &wakes, &g_previous_wake);
  struct sigaction action;
  std::memset(&action, 0, sizeof action);
  action.sa_handler = record;
  sigemptyset(&action.sa_mask);
  // No SA_RESTART: a write blocked on a pipe no one reads (a terminated mpirun stops forwarding
  // output, and the ranks' stdout fills up) returns, so the rank gets to its stop. Regular-file
  // I/O is not interrupted by signals, and MPI retries its own interrupted calls.
  // SIGINT with SA_RESETHAND: a second Ctrl-C ends the process at once. SIGTERM and SIGUSR1 are
  // recorded however often they come: a rank can get each from more than one launcher (Slurm's
  // step and mpirun's kill sequence both send SIGTERM), and a second one must not end the save
  // the first one started; the launcher's SIGKILL ends a stop that takes too long.
  for (size_t i = 0; i < sizeof kSignals / sizeof kSignals[0]; ++i) {
    action.sa_flags = kSignals[i] == SIGINT ? SA_RESETHAND : 0;
    ::sigaction(kSignals[i], &action, &g_previous[i]);
  }
}

StopSignals::~StopSignals() {
  for (size_t i = 0; i < sizeof kSignals / sizeof kSignals[0]; ++i) {
    ::sigaction(kSignals[i], &g_previous[i], nullptr);
  }
  ::sigaction(wake_signal(), &g_previous_wake, nullptr);
}

void StopSignals::unblock_output() {
  unblock_unread_output();
}

int StopSignals::received() {
  return g_received;
}

std::string StopSignals::name(int signal) {
  switch (signal) {
    case SIGTERM:
      return "SIGTERM";
    case SIGINT:
      return "SIGINT";
    case SIGUSR1:
      return "SIGUSR1";
    default:
      return "signal " + std::to_string(signal);
  }
}

int StopSignals::number(const std::string& name) {
  for (const int signal : kSignals) {
    if (StopSignals::name(signal) == name) return signal;
  }
  return 0;
}

std::filesystem::path stop_record_path(const std::filesystem::path& run_dir) {
  return run_dir / "stop.json";
}

void write_stop_record(const std::filesystem::path& run_dir, const StopRecord& r) {
  const Json record = {{"signal", r.signal},
                       {"step", r.step},
                       {"checkpoint", r.checkpoint},
                       {"saved", r.saved},
                       {"previous", r.previous}};
  write_file_atomic(stop_record_path(run_dir), record.dump(2) + "\n");
}

std::optional<StopRecord> read_stop_record(const std::filesystem::path& run_dir) {
  try {
    const Json j = Json::parse(read_file(stop_record_path(run_dir)));
    StopRecord r;
    r.signal = j.at("signal").get<std::string>();
    r.step = j.at("step").get<int64_t>();
    r.checkpoint = j.at("checkpoint").get<std::string>();
    r.saved = j.at("saved").get<bool>();
    r.previous = j.at("previous").get<std::string>();
    return r;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::string describe_stop(const StopRecord& r) {
  const std::string stopped = "stopped by " + r.signal + " after step " + std::to_string(r.step);
  if (r.saved) return stopped + "; its checkpoint is " + r.checkpoint;
  return stopped + ", but killed before its checkpoint (" + r.checkpoint +
         ") was complete; the latest complete checkpoint on disk is " +
         (r.previous.empty() ? std::string("none") : r.previous);
}

}  // namespace malleus::train
