// The hang watchdog (watchdog/watchdog.h) under the names the trainer uses, and its start on every
// rank of a job.
#pragma once

#include <filesystem>
#include <optional>

#include "comm/communicator.h"
#include "watchdog/watchdog.h"

namespace malleus::train {

using watchdog::hang_report_path;
using watchdog::Watchdog;
using watchdog::WatchdogOptions;

// Collective: hang detection for the run in `run_dir` on every rank of `world`, in `*watchdog`,
// once rank 0 has cleared the previous run's heartbeats (the barrier keeps the others from
// writing theirs before rank 0 has taken the run directory, run_directory.h, and cleared it).
// Rank 0 says so on stdout.
void start_watchdog(const std::filesystem::path& run_dir, const comm::Communicator& world,
                    WatchdogOptions options, std::optional<Watchdog>* watchdog);

}  // namespace malleus::train
