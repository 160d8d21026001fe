// Memory the host may not read or write directly (a GPU's): how bytes move between it and host
// memory. A backend whose memory is not the host's says so with one of these
// (backend::Backend::device_memory()); the communicator then stages such memory through host
// buffers around every MPI call (comm/staging.h), and the runtime packs, migrates and checkpoints
// it through these copies. Host memory needs none: a null DeviceMemory means "the host's".
#pragma once

#include <cstddef>
#include <string>

namespace malleus {

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  // For messages and the log: "CUDA device 0".
  virtual std::string name() const = 0;
  // Whether an MPI library that is CUDA-aware may be handed this memory directly.
  virtual bool is_cuda() const = 0;
  // Whether `data` lies in this memory.
  virtual bool holds(const void* data) const = 0;
  // `rows` rows of `row_bytes` bytes each, between device rows `device_pitch` bytes apart and host
  // rows laid end to end. Synchronous: the copy follows the device's work issued before it, and
  // the bytes are in place when the call returns.
  virtual void to_host(void* host, const void* device, size_t row_bytes, size_t rows,
                       size_t device_pitch) const = 0;
  virtual void from_host(void* device, const void* host, size_t row_bytes, size_t rows,
                         size_t device_pitch) const = 0;
  // Host memory the device copies to and from fastest (pinned for a GPU); the heap by default.
  virtual void* allocate_host(size_t bytes) const;
  virtual void release_host(void* data) const;

  // One contiguous run.
  void to_host(void* host, const void* device, size_t bytes) const {
    to_host(host, device, bytes, 1, bytes);
  }
  void from_host(void* device, const void* host, size_t bytes) const {
    from_host(device, host, bytes, 1, bytes);
  }
};

}  // namespace malleus
