// How a run ends early, on every rank together: on a stop signal (train/stop_signal.h) any rank
// received, with the checkpoint of the step every rank finished and the stop record around it;
// or on a step whose loss or gradient norm is not finite, keeping the last committed checkpoint
// and saving nothing of that step. Both leave no save in flight and no memory copy behind.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>

#include "comm/communicator.h"
#include "common/error.h"
#include "train/checkpointing.h"

namespace malleus::train {

// The run stopped at a step whose loss or gradient norm was not finite.
class Diverged : public Error {
 public:
  using Error::Error;
};

// Where a run stops: its ranks, its checkpoints, its directory and how far it got.
struct RunEnd {
  const comm::Communicator& world;
  Checkpointing& checkpoints;
  std::filesystem::path out;  // the run directory
  int64_t step = 0;           // the step every rank finished
  int64_t steps = 0;          // the run's length
};

// Collective: the stop signal any rank received, or 0.
int agreed_stop_signal(const comm::Communicator& world);

// Collective, after stop signal `signal`: <run>/stop.json names the step being saved; `save`
// (null when the step's checkpoint was saved already) starts its checkpoint; once committed, the
// record says so, the memory copies go and every rank returns together (mpirun ends the job as
// soon as one rank exits with a non-zero status).
void stop_with_checkpoint(const RunEnd& end, int signal, const std::function<void()>& save);

// Collective, at a step `step` whose loss or gradient norm is not finite (every rank sees the
// same, from the step's all-reduce): the save in flight, of an earlier step, is committed, the
// memory copies go, and every rank throws Diverged naming the step, the figures and the last
// checkpoint to continue from.
[[noreturn]] void stop_diverged(const RunEnd& end, double loss, double grad_norm);

}  // namespace malleus::train
