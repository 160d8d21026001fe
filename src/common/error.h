// The one exception type malleus throws for bad input and failed I/O. Its message names the
// file, key or value at fault; the CLI prints it and exits non-zero.
#pragma once

#include <stdexcept>
#include <string>

namespace malleus {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Throws Error(message) when `condition` is false.
inline void check(bool condition, const std::string& message) {
  if (!condition) throw Error(message);
}

}  // namespace malleus
