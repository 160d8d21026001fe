#include "train/stop_signal.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>

#include <csignal>
#include <cstring>

namespace malleus::train {

namespace {

constexpr int kSignals[] = {SIGTERM, SIGINT, SIGUSR1};

volatile std::sig_atomic_t g_received = 0;
struct sigaction g_previous[sizeof kSignals / sizeof kSignals[0]];

// Async-signal-safe: only a store to a sig_atomic_t.
void record(int signal) {
  if (g_received == 0) g_received = signal;
}

}  // namespace

StopSignals::StopSignals() {
  g_received = 0;
  struct sigaction action;
  std::memset(&action, 0, sizeof action);
  action.sa_handler = record;
  sigemptyset(&action.sa_mask);
  // SA_RESETHAND: the handler runs once; the same signal again ends the process.
  // No SA_RESTART: a write blocked on a pipe no one reads (a terminated mpirun stops forwarding
  // output, and the ranks' stdout fills up) returns, so the rank gets to its stop. Regular-file
  // I/O is not interrupted by signals, and MPI retries its own interrupted calls.
  action.sa_flags = SA_RESETHAND;
  for (size_t i = 0; i < sizeof kSignals / sizeof kSignals[0]; ++i) {
    ::sigaction(kSignals[i], &action, &g_previous[i]);
  }
}

StopSignals::~StopSignals() {
  for (size_t i = 0; i < sizeof kSignals / sizeof kSignals[0]; ++i) {
    ::sigaction(kSignals[i], &g_previous[i], nullptr);
  }
}

void StopSignals::unblock_output() {
  for (int fd : {1, 2}) {
    struct stat st;
    if (::fstat(fd, &st) != 0 || !(S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode))) continue;
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags >= 0) ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  }
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

}  // namespace malleus::train
