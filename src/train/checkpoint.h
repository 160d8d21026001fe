// Checkpoints: a directory holding manifest.json (format version, model config, training config,
// progress, one entry per tensor, and each data file's size and XXH3 checksum), params.bin and
// optimizer.bin (Adam first and second moments), and the tokenizer the model was trained with when
// it is known (tokenizer_meta.json, tokenizer.model: tokenizer::save_tokenizer). Tensors are stored
// by name, unpadded, in ParameterLayout order, so a reader can slice any tensor out of a checkpoint
// without knowing how it was trained (what resharding to another parallel plan needs).
//
// Saving is atomic: everything is written into "<dir>.tmp.<pid>" and renamed to <dir> only when
// complete; an older checkpoint with the same name is replaced only then.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <vector>

#include "common/json.h"
#include "model/config.h"
#include "tokenizer/tokenizer.h"

namespace malleus::train {

struct Checkpoint {
  model::ModelConfig model;
  Json train_config;             // TrainConfig::to_json() of the run that wrote it
  int64_t step = 0;              // optimizer steps done
  int64_t consumed_samples = 0;  // data position: samples drawn from the sampler so far
  // Flat buffers in model::ParameterLayout(model) order (padded layout, total_size() elements).
  std::vector<float> params;
  std::vector<float> adam_m;  // empty when saved/loaded without optimizer state
  std::vector<float> adam_v;
  std::shared_ptr<const tokenizer::Tokenizer> tokenizer;  // null: not known
};

void save_checkpoint(const std::filesystem::path& dir, const Checkpoint& checkpoint);

// Verifies manifest, sizes and checksums before returning; throws Error naming the checkpoint and
// the file at fault if anything is missing, truncated or corrupt.
Checkpoint load_checkpoint(const std::filesystem::path& dir, bool with_optimizer = true);

// <root>/step_00000100
std::filesystem::path checkpoint_dir(const std::filesystem::path& root, int64_t step);
// A checkpoint directory, or a run directory / checkpoint root whose latest checkpoint is meant.
// Throws Error naming the path when it is neither.
std::filesystem::path resolve_checkpoint(const std::filesystem::path& path);
// Writes <root>/latest (atomically) naming the given checkpoint directory.
void mark_latest(const std::filesystem::path& root, const std::filesystem::path& dir);
// The checkpoint named by <root>/latest, if any.
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& root);

}  // namespace malleus::train
