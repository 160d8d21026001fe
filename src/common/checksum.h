// Content checksums for checkpoints (xxHash XXH3-64), as 16 hex digits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace malleus {

// Incremental XXH3-64 so large buffers can be hashed while they are written.
class Checksum {
 public:
  Checksum();
  ~Checksum();
  Checksum(const Checksum&) = delete;
  Checksum& operator=(const Checksum&) = delete;
  void update(const void* data, size_t bytes);
  std::string hex() const;

 private:
  void* state_;
};

std::string checksum_hex(const void* data, size_t bytes);

}  // namespace malleus
