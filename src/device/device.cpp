#include "device/device.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <optional>
#include <set>

#include "common/error.h"

#if defined(MALLEUS_HAVE_CUDA)
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_device.h"
#endif

namespace malleus::device {

namespace {

// A non-negative integer, or nothing (not a number, a sign, trailing text, too large).
std::optional<int> index_of(const std::string& text) {
  if (text.empty() || text.size() > 9) return std::nullopt;
  int value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + (c - '0');
  }
  return value;
}

#if defined(MALLEUS_HAVE_CUDA)
Device open_cuda(const BackendChoice& choice, int local_rank) {
  const backend::CudaMath math = [&] {
    try {
      return backend::parse_cuda_math(choice.cuda_math);
    } catch (const Error& e) {
      throw Error(std::string("--cuda-math: ") + e.what());
    }
  }();
  const backend::CudaDevices found = backend::cuda_devices();
  check(found.count > 0, "--backend cuda: no CUDA device found on this node (" + found.why + ")");
  const int index = pick_device(choice.devices, local_rank, found.count);
  backend::cuda_use_device(index);
  Device device;
  device.kind = BackendKind::kCuda;
  device.index = index;
  device.description = "cuda device " + std::to_string(index) + " (" + backend::cuda_device_name() +
                       "), " + backend::cuda_math_name(math) + " math";
  device.memory = backend::cuda_device_memory(index);
  device.make_backend = [index, math, memory = device.memory](int /*threads*/) {
    backend::cuda_use_device(index);  // the thread that makes the backend computes with it
    std::unique_ptr<backend::Backend<float>> made = backend::make_cuda_backend(math);
    // A backend that knows its own memory keeps it (the CUDA backend's bf16 buffers are handles
    // that only it resolves, storage_map.h); the device's plain copies serve the others.
    if (!made->device_memory()) made->set_device_memory(memory);
    made->set_region_timer(backend::make_cuda_event_timer());
    return made;
  };
  return device;
}
#endif

}  // namespace

BackendKind parse_backend_kind(const std::string& text, const std::string& what) {
  if (text == "cpu") return BackendKind::kCpu;
  if (text == "cuda") return BackendKind::kCuda;
  throw Error(what + ": \"" + text + "\" is not a backend (cpu or cuda)");
}

const char* backend_kind_name(BackendKind kind) {
  return kind == BackendKind::kCuda ? "cuda" : "cpu";
}

std::vector<int> parse_devices(const std::string& text, const std::string& what) {
  std::vector<int> devices;
  if (text.empty()) return devices;
  std::set<int> seen;
  size_t begin = 0;
  while (true) {
    const size_t end = std::min(text.find(',', begin), text.size());
    const std::string entry = text.substr(begin, end - begin);
    const std::optional<int> index = index_of(entry);
    check(index.has_value(), what + " \"" + text + "\": \"" + entry +
                                 "\" is not a device index (a list such as 0,1 of integers "
                                 "from 0)");
    check(seen.insert(*index).second,
          what + " \"" + text + "\": device " + entry + " is listed twice");
    devices.push_back(*index);
    if (end == text.size()) break;
    begin = end + 1;
  }
  return devices;
}

std::string devices_text(const std::vector<int>& devices) {
  std::string text;
  for (int d : devices) {
    if (!text.empty()) text += ',';
    text += std::to_string(d);
  }
  return text;
}

int local_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"}) {
    const char* value = std::getenv(name);
    if (value == nullptr) continue;
    const std::optional<int> rank = index_of(value);
    check(rank.has_value(), std::string("the environment's ") + name + "=\"" + value +
                                "\" is not a local rank (an integer from 0)");
    return *rank;
  }
  return 0;
}

int pick_device(const std::vector<int>& devices, int local_rank, int device_count) {
  check(device_count > 0, "--backend cuda: no CUDA device found on this node");
  check(local_rank >= 0, "local rank " + std::to_string(local_rank) + " is negative");
  const std::string have =
      std::to_string(device_count) + " CUDA device" +
      (device_count == 1 ? " (index 0)"
                         : "s (indices 0 to " + std::to_string(device_count - 1) + ")");
  for (int d : devices) {
    check(d < device_count, "--devices " + devices_text(devices) + ": device " + std::to_string(d) +
                                " is not on this node, which has " + have);
  }
  if (devices.empty()) return local_rank % device_count;
  return devices[static_cast<size_t>(local_rank) % devices.size()];
}

bool built_with_cuda() {
#if defined(MALLEUS_HAVE_CUDA)
  return true;
#else
  return false;
#endif
}

Device open_device(const BackendChoice& choice, int local_rank) {
  if (choice.kind == BackendKind::kCuda) {
#if defined(MALLEUS_HAVE_CUDA)
    return open_cuda(choice, local_rank);
#else
    (void)local_rank;
    throw Error(
        "--backend cuda: this malleus was built without CUDA; build it with "
        "-DMALLEUS_BUILD_CUDA=ON (cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release "
        "-DMALLEUS_BUILD_CUDA=ON; docs/cuda.md)");
#endif
  }
  Device device;
  device.description = "cpu";
  device.make_backend = [](int threads) { return backend::make_cpu_backend<float>(threads); };
  return device;
}

}  // namespace malleus::device
