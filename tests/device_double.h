// A test double of a GPU backend, for checking on the CPU every path that moves a device's memory
// (tests/test_device_mpi.cpp): the CPU backend's arithmetic, on memory the host may not touch.
//
// Its memory lies in one arena of its own whose pages are inaccessible (PROT_NONE) except while
// one of its calls runs. A read or write of that memory from anywhere else (MPI, packing on the
// host, a checkpoint) faults (SIGSEGV). And every pointer one of its calls is given must lie in
// the arena (or be null where the interface allows it): host memory handed to a "device"
// operation throws, naming the call, as it would crash a GPU. Its device_memory() copies to and
// from the host as a GPU's does, and tells its pointers apart; it is not CUDA, so the
// communicator always stages it.
//
// Every Backend operation is forwarded here: a change of the interface (backend.h) needs the same
// change below, which the compiler asks for.
#pragma once

#include <cstdint>
#include <memory>

#include "backend/backend.h"
#include "common/device_memory.h"

namespace malleus::testing {

// A backend of the double; all of them share one arena and one DeviceMemory per process.
std::unique_ptr<backend::Backend<float>> make_device_double(int threads);
std::shared_ptr<const DeviceMemory> device_double_memory();
// Bytes the arena holds now (allocated and not released), for leak checks.
int64_t device_double_bytes();

}  // namespace malleus::testing
