// --backend, --devices and --cuda-math of the commands that compute outside `train`. The commands
// call choice() before they read anything, so a bad value is reported first.
#include "cli/commands.h"
#include "common/error.h"

namespace malleus::cli {

device::BackendChoice BackendArgs::choice() const {
  return {device::parse_backend_kind(backend, "--backend"),
          device::parse_devices(devices, "--devices"), cuda_math};
}

void add_backend_options(CLI::App& command, BackendArgs& args) {
  command
      .add_option("--backend", args.backend,
                  "What to compute on: cpu, or cuda (a build with -DMALLEUS_BUILD_CUDA=ON)")
      ->capture_default_str();
  command.add_option("--devices", args.devices,
                     "CUDA devices the ranks of a node take in turn, e.g. 0,1 (default: every "
                     "device)");
  command
      .add_option("--cuda-math", args.cuda_math,
                  "How the CUDA backend multiplies: exact (fp32), tf32 or bf16 tensor cores")
      ->capture_default_str();
}

}  // namespace malleus::cli
