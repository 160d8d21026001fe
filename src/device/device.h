// Which backend a rank computes on: the CPU, or one CUDA device of its node. What `malleus train`,
// `eval`, `generate` and `profile` select with --backend, --devices and --cuda-math; the engine is
// given the factory made here (runtime::EngineOptions::make_backend).
//
// A rank takes the device of its place among the ranks of its node (its local rank, from the
// launcher's environment): devices[local_rank % devices.size()], so several ranks may share one
// device (how a one-GPU machine runs multi-rank plans).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace malleus::device {

enum class BackendKind { kCpu, kCuda };

struct BackendChoice {
  BackendKind kind = BackendKind::kCpu;
  // CUDA device indices the ranks of a node take in turn; empty: every device the node has.
  std::vector<int> devices;
  // How the CUDA backend multiplies (backend::parse_cuda_math's names); unused on the CPU.
  std::string cuda_math = "bf16";
};

// "cpu" or "cuda"; anything else throws naming `what` (a flag or a config key) and the value.
BackendKind parse_backend_kind(const std::string& text, const std::string& what);
const char* backend_kind_name(BackendKind kind);
// "0,2,3" → {0, 2, 3}; "" → {} (every device). Throws naming `what` for an entry that is not a
// non-negative integer, or one listed twice.
std::vector<int> parse_devices(const std::string& text, const std::string& what);
std::string devices_text(const std::vector<int>& devices);

// This process's index among the ranks of its node, from the launcher: OMPI_COMM_WORLD_LOCAL_RANK
// (Open MPI), SLURM_LOCALID (srun), MPI_LOCALRANKID (MPICH's Hydra); 0 when none is set (one
// process started by hand). A value that is not a non-negative integer throws naming the variable.
int local_rank();

// The device of local rank `local_rank` on a node with `device_count` devices: devices[local_rank
// % size], or local_rank % device_count when `devices` is empty. Throws when the node has no
// device, or `devices` names one it does not have (the message names --devices).
int pick_device(const std::vector<int>& devices, int local_rank, int device_count);

// Whether this binary holds the CUDA backend (built with -DMALLEUS_BUILD_CUDA=ON).
bool built_with_cuda();

// A backend for this rank, ready to be made as often as the engine needs one (a live migration
// makes a new engine): the factory, and what it computes on, for the log.
struct Device {
  backend::BackendFactory make_backend;
  BackendKind kind = BackendKind::kCpu;
  int index = -1;  // the CUDA device; -1 on the CPU
  // How the host and MPI reach the device's memory; null on the CPU. The factory gives it to each
  // backend that has no DeviceMemory of its own (Backend::device_memory): a backend that sets its
  // own (one whose buffers only it can resolve) keeps it.
  std::shared_ptr<const DeviceMemory> memory;
  std::string description;  // "cpu", "cuda device 0 (NVIDIA H100 80GB HBM3), bf16 math"
};

// Checks up front that `choice` can be served on this rank (a binary with CUDA, a device, the
// listed index present, a known math mode), selects the device, and returns the factory. Throws
// naming the option otherwise. `local_rank` picks the device (see pick_device).
Device open_device(const BackendChoice& choice, int local_rank);

}  // namespace malleus::device
