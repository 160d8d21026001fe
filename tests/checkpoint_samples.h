// Checkpoints filled with random values, and the assertions the checkpoint and Hugging Face
// tests share (tests/test_checkpoint.cpp, tests/test_hf.cpp).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "common/error.h"
#include "common/json.h"
#include "model/config.h"
#include "model/parameters.h"
#include "test_util.h"

namespace malleus::testing::checkpoints {

namespace fs = std::filesystem;
using checkpoint::Checkpoint;

using TempDir = malleus::testing::ScratchDir;

// Random values in every tensor, zero in the alignment gaps (the files store no padding, so only
// zero gaps survive a round trip bit for bit).
inline std::vector<float> random_buffer(const model::ParameterLayout& layout, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> buffer(static_cast<size_t>(layout.total_size()), 0.0f);
  for (const auto& t : layout.tensors()) {
    for (int64_t i = 0; i < t.size; ++i) buffer[static_cast<size_t>(t.offset + i)] = normal(rng);
  }
  return buffer;
}

inline Checkpoint make_checkpoint(uint32_t seed, bool with_optimizer = true) {
  Checkpoint c;
  c.model = model::load_model_config("tiny");
  const model::ParameterLayout layout(c.model);
  c.train_config =
      Json{{"lr", 3e-4}, {"global_batch", 8}, {"note", "seed " + std::to_string(seed)}};
  c.step = 100 + seed;
  c.consumed_samples = 800 + 8 * int64_t{seed};
  c.params = random_buffer(layout, seed);
  if (with_optimizer) {
    c.adam_m = random_buffer(layout, seed + 1000);
    c.adam_v = random_buffer(layout, seed + 2000);
    for (float& v : c.adam_v) v = v * v;
  }
  return c;
}

inline bool bit_identical(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline void expect_same(const Checkpoint& expected, const Checkpoint& actual, bool with_optimizer) {
  EXPECT_EQ(actual.model.to_json(), expected.model.to_json());
  EXPECT_EQ(actual.train_config, expected.train_config);
  EXPECT_EQ(actual.step, expected.step);
  EXPECT_EQ(actual.consumed_samples, expected.consumed_samples);
  EXPECT_TRUE(bit_identical(actual.params, expected.params));
  if (with_optimizer) {
    EXPECT_TRUE(bit_identical(actual.adam_m, expected.adam_m));
    EXPECT_TRUE(bit_identical(actual.adam_v, expected.adam_v));
  } else {
    EXPECT_TRUE(actual.adam_m.empty());
    EXPECT_TRUE(actual.adam_v.empty());
  }
}

// The one error_of (test_util.h): "" when nothing is thrown, so callers check what it contains.
using malleus::testing::error_of;

#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "message: " << (text)

// Entries of `dir` other than the expected ones: leftovers such as "*.tmp.<pid>" or "*.old.<pid>".
inline std::vector<std::string> leftovers(const fs::path& dir,
                                          const std::vector<std::string>& expected) {
  std::vector<std::string> extra;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (std::find(expected.begin(), expected.end(), name) == expected.end()) extra.push_back(name);
  }
  return extra;
}

}  // namespace malleus::testing::checkpoints
