// Loading a checkpoint of either form (checkpoint.h): one reader, on one process or on every rank
// of a job.
#include <memory>
#include <string>
#include <system_error>

#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_detail.h"
#include "comm/communicator.h"
#include "common/error.h"

namespace malleus::checkpoint {

namespace {

using namespace detail;

// What a load reads of a checkpoint's data besides its header and tokenizer.
enum class Buffers {
  kWhole,       // every buffer, whatever the form: one process holds the whole model
  kSingleFile,  // a single-file checkpoint's; a sharded one's are left to each rank to read
};

// The one reader: the header, the buffers `buffers` asks for, and the tokenizer (read once).
Checkpoint read_checkpoint(const CheckpointIndex& index, bool with_optimizer, Buffers buffers) {
  if (!index.sharded()) {
    Checkpoint checkpoint = read_single_file(index, with_optimizer);
    checkpoint.tokenizer = tokenizer::load_saved_tokenizer(index.dir());
    return checkpoint;
  }
  check(!with_optimizer || index.has_optimizer(),
        "checkpoint " + index.dir().string() +
            ": has no optimizer state (its pieces hold parameters only)");
  Checkpoint checkpoint = index.header();
  if (buffers == Buffers::kWhole) {
    // The whole model on this process: the sharded reader with the full layout as the shard.
    const model::ParameterLayout full(checkpoint.model);
    const auto total = static_cast<size_t>(full.total_size());
    checkpoint.params.assign(total, 0.0f);
    std::vector<float*> targets{checkpoint.params.data()};
    if (with_optimizer) {
      checkpoint.adam_m.assign(total, 0.0f);
      checkpoint.adam_v.assign(total, 0.0f);
      targets.push_back(checkpoint.adam_m.data());
      targets.push_back(checkpoint.adam_v.data());
    }
    index.read(full, targets);
  }
  checkpoint.tokenizer = tokenizer::load_saved_tokenizer(index.dir());
  return checkpoint;
}

// Rank 0's error, if any, thrown on every rank.
void agree_on_root_error(comm::Communicator& world, std::string error) {
  if (world.size() > 1) error = world.broadcast_text(error, 0);
  if (!error.empty()) throw Error(error);
}

}  // namespace

Checkpoint load_checkpoint(const fs::path& dir_arg, bool with_optimizer) {
  const fs::path dir = normalized(dir_arg);
  const std::string where = "checkpoint " + dir.string();
  std::error_code ec;
  check(fs::is_directory(dir, ec), where + ": not a checkpoint: no such directory");
  check(fs::is_regular_file(dir / kManifest, ec), where + ": not a checkpoint: no manifest.json");
  return read_checkpoint(CheckpointIndex(dir), with_optimizer, Buffers::kWhole);
}

Checkpoint load_checkpoint(const fs::path& dir, comm::Communicator& world, bool with_optimizer) {
  // Rank 0 reads the manifest and sends its text: no rank opens a checkpoint's files before
  // rank 0 has found it complete. Every rank then verifies the text itself.
  std::string text, error;
  if (world.rank() == 0) {
    try {
      text = CheckpointIndex(dir).manifest_text();
    } catch (const Error& e) {
      error = e.what();
    }
  }
  agree_on_root_error(world, error);
  if (world.size() > 1) text = world.broadcast_text(text, 0);
  auto index = std::make_shared<const CheckpointIndex>(dir, text);
  Checkpoint checkpoint;
  error.clear();
  if (world.rank() == 0) {
    try {
      checkpoint = read_checkpoint(*index, with_optimizer, Buffers::kSingleFile);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  agree_on_root_error(world, error);
  if (world.rank() != 0) checkpoint = index->header();
  if (index->sharded()) checkpoint.sharded = index;
  return checkpoint;
}

}  // namespace malleus::checkpoint
