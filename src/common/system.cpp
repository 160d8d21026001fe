#include "common/system.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

namespace malleus {

namespace {

// "MemAvailable:   12345 kB" from /proc/meminfo, in bytes; 0 if absent.
int64_t meminfo_available() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string key;
    int64_t kib = 0;
    if (fields >> key >> kib && key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

// The cgroup v2 limit minus what the cgroup already uses; int64 max when there is no limit.
int64_t cgroup_headroom() {
  std::ifstream max_file("/sys/fs/cgroup/memory.max"),
      current_file("/sys/fs/cgroup/memory.current");
  std::string max_text;
  int64_t current = 0;
  if (!(max_file >> max_text) || max_text == "max" || !(current_file >> current)) {
    return std::numeric_limits<int64_t>::max();
  }
  try {
    return std::max<int64_t>(0, std::stoll(max_text) - current);
  } catch (const std::exception&) {
    return std::numeric_limits<int64_t>::max();
  }
}

}  // namespace

int64_t available_memory_bytes() {
  const int64_t available = meminfo_available();
  const int64_t headroom = cgroup_headroom();
  if (available == 0) return headroom == std::numeric_limits<int64_t>::max() ? 0 : headroom;
  return std::min(available, headroom);
}

}  // namespace malleus
