// What this machine can give a process, for checks made before a run allocates anything
// ("asked for X, Y fit").
#pragma once

#include <cstdint>

namespace malleus {

// Bytes of memory a new allocation can still get: the kernel's MemAvailable, or less when a
// cgroup (container) memory limit leaves less. 0 when neither can be read.
int64_t available_memory_bytes();

}  // namespace malleus
