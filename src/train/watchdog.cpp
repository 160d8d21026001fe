#include "train/watchdog.h"

#include <cstdio>

namespace malleus::train {

namespace fs = std::filesystem;

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
