#include "train/stop_signal.h"

#include <signal.h>

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
  // SA_RESTART: system calls interrupted by the signal (reads, MPI's polling) carry on.
  action.sa_flags = SA_RESETHAND | SA_RESTART;
  for (size_t i = 0; i < sizeof kSignals / sizeof kSignals[0]; ++i) {
    ::sigaction(kSignals[i], &action, &g_previous[i]);
  }
}

StopSignals::~StopSignals() {
  for (size_t i = 0; i < sizeof kSignals / sizeof kSignals[0]; ++i) {
    ::sigaction(kSignals[i], &g_previous[i], nullptr);
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
