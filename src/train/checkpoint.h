// Checkpoints: a directory holding manifest.json (format version, model config, training config,
// progress, one entry per tensor, each data file's size and XXH3 checksum, and the manifest's
// own checksum, so that no edit of it goes unnoticed), params.bin and optimizer.bin (Adam first
// and second moments), and the tokenizer the model was trained with when it is known
// (tokenizer_meta.json, tokenizer.model: tokenizer::save_tokenizer). Tensors are stored by name,
// unpadded, in ParameterLayout order, so a reader can slice any tensor out of a checkpoint
// without knowing how it was trained (what resharding to another parallel plan needs).
//
// Saving is atomic: everything is written into "<dir>.tmp.<pid>" and renamed to <dir> only when
// complete; an older checkpoint with the same name is replaced only then.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
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

// XXH3 of the manifest's canonical text (nlohmann's compact dump), the manifest's own checksum
// field left out: what "manifest_xxh3" holds.
std::string manifest_checksum(const Json& manifest);

// Cleans up after saves that died midway in the checkpoint root `root`: "*.tmp.<pid>" entries
// of processes that no longer run are removed, and a "*.old.<pid>" checkpoint (moved aside to be
// replaced) goes back into place when its replacement never arrived, else is removed. Returns
// what it did, one line per entry.
std::vector<std::string> clean_stale_temporaries(const std::filesystem::path& root);

// <root>/step_00000100
std::filesystem::path checkpoint_dir(const std::filesystem::path& root, int64_t step);
// What a command's checkpoint argument names: a checkpoint directory, or a run directory or
// checkpoint root whose latest checkpoint is meant; and the run directory it belongs to, if any.
struct CheckpointSource {
  std::filesystem::path checkpoint;
  std::optional<std::filesystem::path> run_dir;  // none for a checkpoint outside a run directory
};
// Throws Error naming the path when it is none of these.
CheckpointSource locate_checkpoint(const std::filesystem::path& given);
inline std::filesystem::path resolve_checkpoint(const std::filesystem::path& given) {
  return locate_checkpoint(given).checkpoint;
}
// Writes <root>/latest (atomically) naming the given checkpoint directory.
void mark_latest(const std::filesystem::path& root, const std::filesystem::path& dir);
// The checkpoint named by <root>/latest, if any.
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& root);

}  // namespace malleus::train
