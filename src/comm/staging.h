// Device memory handed to the communicator: a backend whose memory the host and MPI may not touch
// (a GPU's) registers it here (register_device_memory), and from then on every Communicator call
// given a pointer into it stages the bytes through a host buffer: copied out of the device before
// MPI reads them, and back once MPI has written them (for a nonblocking call, when its Request
// completes). Where the MPI library is CUDA-aware and the memory is a CUDA device's, MPI gets the
// device pointer itself. One process drives one device, so the registry is the process's.
//
// Host buffers come from a pool of the memory's own host allocations (pinned for a GPU), kept
// for reuse: the pool holds at most what the calls in flight at once have needed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/device_memory.h"

namespace malleus::comm {

// Idempotent (the same memory registered twice counts once).
void register_device_memory(std::shared_ptr<const DeviceMemory> memory);
// The registered memory that holds `data`, or null (host memory).
const DeviceMemory* device_memory_of(const void* data);

// Whether the MPI library reads and writes CUDA device memory itself: MPIX_Query_cuda_support()
// where Open MPI's mpi-ext.h offers it (compiled with CUDA support), false otherwise.
// MALLEUS_MPI_CUDA_AWARE=0 in the environment forces staging, =1 forces direct use (an MPI that
// is CUDA-aware without saying so through mpi-ext.h).
bool mpi_cuda_aware();
// How `memory` reaches MPI, for the log: "staged through pinned host memory (...)" or "passed to
// MPI directly (CUDA-aware MPI)".
std::string transport_text(const DeviceMemory& memory);

// Bytes copied between device memory and staging buffers so far, both ways (for tests and logs).
int64_t staged_bytes();

// MPI's view of one buffer of a call: the buffer itself when it is host memory (or MPI takes the
// device's directly), else a host copy from the pool, filled from the device when MPI reads the
// buffer (kIn) and copied back by finish() when MPI writes it (kOut). Move-only; the destructor
// returns the copy to the pool without copying back.
class StagedBuffer {
 public:
  enum Direction { kIn = 1, kOut = 2, kInOut = 3 };
  StagedBuffer() = default;
  StagedBuffer(const void* data, size_t bytes, Direction direction);
  ~StagedBuffer();
  StagedBuffer(StagedBuffer&& other) noexcept;
  StagedBuffer& operator=(StagedBuffer&& other) noexcept;
  StagedBuffer(const StagedBuffer&) = delete;
  StagedBuffer& operator=(const StagedBuffer&) = delete;

  // The pointer to give MPI.
  void* mpi() const { return host_ != nullptr ? host_ : const_cast<void*>(data_); }
  bool staged() const { return host_ != nullptr; }
  // Once MPI is done with the buffer: for kOut, the host copy's bytes into the device buffer.
  // Idempotent.
  void finish();

 private:
  void release() noexcept;
  const void* data_ = nullptr;
  size_t bytes_ = 0, capacity_ = 0;
  Direction direction_ = kIn;
  const DeviceMemory* memory_ = nullptr;
  void* host_ = nullptr;
  bool finished_ = false;
};

}  // namespace malleus::comm
