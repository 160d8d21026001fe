// safetensors files (Hugging Face's tensor format): an 8-byte little-endian header length, a JSON
// header giving each tensor's dtype, shape and byte range, then the raw data. One module for both
// directions: export writes, import (and the tests) read.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace malleus::hf {

// A tensor to write: float32 data in row-major order.
struct TensorRef {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;
};

// Writes the tensors, in the order given, as F32 (atomically), with metadata {"format": "pt"}
// and the data 8-byte aligned.
void write_safetensors(const std::filesystem::path& path, const std::vector<TensorRef>& tensors);

struct SafetensorsTensor {
  std::string dtype;  // as stored: "F32", "BF16" or "F16"
  std::vector<int64_t> shape;
  std::vector<float> data;  // converted to float32 (exactly: every BF16 and F16 value is a float)
};

// Reads every tensor of a file. Throws Error naming the file (and the tensor) for a malformed
// header, out-of-range offsets, a shape that disagrees with its bytes, or another dtype.
std::map<std::string, SafetensorsTensor> read_safetensors(const std::filesystem::path& path);

}  // namespace malleus::hf
