// Small, portable hashes for deriving seeds. std::hash and the standard distributions are
// implementation-defined; seeds and data order must be the same with every standard library, or
// runs could not be resumed or compared across machines.
#pragma once

#include <cstdint>
#include <string_view>

namespace malleus {

// SplitMix64's finalizer: nearby inputs give unrelated outputs.
inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// FNV-1a over the bytes of a string.
inline uint64_t hash_text(std::string_view text) {
  uint64_t h = 1469598103934665603ull;
  for (char c : text) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

}  // namespace malleus
