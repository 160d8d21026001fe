#include "train/stopping.h"

#include <cmath>
#include <cstdio>
#include <string>

#include "checkpoint/checkpoint.h"
#include "train/stop_signal.h"

namespace malleus::train {

int agreed_stop_signal(const comm::Communicator& world) {
  return static_cast<int>(world.all_reduce_max(static_cast<double>(StopSignals::received())));
}

void stop_with_checkpoint(const RunEnd& end, int signal, const std::function<void()>& save) {
  StopSignals::unblock_output();
  const bool root = end.world.rank() == 0;
  const std::filesystem::path checkpoints = end.out / "checkpoints";
  // Which step is being saved and where, on disk before the save: the kill may come first.
  StopRecord record{StopSignals::name(signal), end.step,
                    checkpoint::checkpoint_dir(checkpoints, end.step).string(), false, ""};
  if (root) {
    try {
      if (const auto latest = checkpoint::latest_checkpoint(checkpoints)) {
        record.previous = latest->string();
      }
    } catch (const Error&) {
      // a `latest` that names nothing: no complete checkpoint to name
    }
    write_stop_record(end.out, record);
    std::fprintf(stderr, "stopping on %s after step %lld: saving its checkpoint into %s\n",
                 record.signal.c_str(), static_cast<long long>(end.step),
                 record.checkpoint.c_str());
  }
  if (save) save();
  end.checkpoints.finish();
  if (root) {
    record.saved = true;
    write_stop_record(end.out, record);
  }
  end.checkpoints.clear_memory();  // the checkpoint of this step supersedes them
  if (root) {
    std::printf("stopped by %s after step %lld of %lld; continue with: malleus train --resume %s\n",
                record.signal.c_str(), static_cast<long long>(end.step),
                static_cast<long long>(end.steps), end.out.c_str());
    std::fflush(stdout);
  }
  end.world.barrier();
}

void stop_diverged(const RunEnd& end, double loss, double grad_norm) {
  // The save in flight holds an earlier step's state (the update waited for its copy): commit it.
  end.checkpoints.finish();
  char figures[128];
  std::snprintf(figures, sizeof figures, "the %s is not finite (loss %g, gradient norm %g)",
                std::isfinite(loss) ? "gradient norm" : "loss", loss, grad_norm);
  const auto& last = end.checkpoints.last_saved();
  const std::string resume =
      last ? "the last checkpoint, " + last->dir.string() +
                 ", is intact: continue from it with malleus train --resume " + end.out.string() +
                 " (with a lower --lr or a --grad-clip)"
           : "this run saved no checkpoint";
  end.checkpoints.clear_memory();  // the run is over: its last checkpoint is where to go on from
  end.world.barrier();             // no rank leaves while another still commits
  throw Diverged("step " + std::to_string(end.step) + " of " + std::to_string(end.steps) + ": " +
                 figures + "; training stopped without updating the model or saving this step; " +
                 resume);
}

}  // namespace malleus::train
