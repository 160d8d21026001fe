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
//
// That single-file form (format version 2) is what one process writes (import, tests); runs on
// several ranks write sharded checkpoints (version 4, below). load_checkpoint reads both.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/host_pages.h"
#include "common/json.h"
#include "layout/layout.h"
#include "model/config.h"
#include "model/parameters.h"
#include "tokenizer/tokenizer.h"

namespace malleus::comm {
class Communicator;
}

namespace malleus::checkpoint {

class CheckpointIndex;

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
  // A sharded checkpoint read by every rank for itself (the collective load_checkpoint): the
  // buffers above stay empty and each rank reads its own part through this index.
  std::shared_ptr<const CheckpointIndex> sharded;
};

void save_checkpoint(const std::filesystem::path& dir, const Checkpoint& checkpoint);

// Loading, either form (checkpoint/load.cpp: one reader for both, which reads the tokenizer once).
// Verifies manifest, sizes and checksums before returning; throws Error naming the checkpoint and
// the file at fault if anything is missing, truncated or corrupt.
//
// On one process: the whole checkpoint, its buffers read whatever its form.
Checkpoint load_checkpoint(const std::filesystem::path& dir, bool with_optimizer = true);
// Collective over `world`: every rank gets the checkpoint's config and progress (rank 0 reads
// manifest.json, verifies it and sends its text, so that no rank opens a checkpoint's files before
// rank 0 has found it complete; every rank verifies the text too). A single-file checkpoint's
// buffers and the tokenizer are read on rank 0 only (the trainer scatters the buffers); a sharded
// checkpoint's buffers are left to each rank to read for itself, the part it needs
// (Checkpoint::sharded). Throws the same Error on every rank if the checkpoint is bad.
Checkpoint load_checkpoint(const std::filesystem::path& dir, comm::Communicator& world,
                           bool with_optimizer = true);

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
// The step in a name checkpoint_dir gives (step_00000100: 100); nothing for another name (a
// checkpoint made by import, a temporary).
std::optional<int64_t> checkpoint_dir_step(const std::filesystem::path& dir);
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

// ---- Sharded checkpoints (format version 4; version 3 still loads) ----
//
// Each rank writes only the pieces of the model state it owns, into one file of its own,
// rank_NNNNN.bin; manifest.json describes where every piece lies. The state is of two kinds,
// each laid out its own way on a rank (layout::Block): parameters in the rank's local layout, and
// Adam moments there too or, with the distributed optimizer, in its optimizer shard
// (layout/optimizer_shard.h).
//
// - Adam moments kept whole: the pieces of the common refinement of the run's layout
//   (layout::common_refinement), each given to one of its holders (layout::balanced_owners), so
//   that every element is written exactly once and replicated state is spread over its holders;
//   the parameters the same pieces by the same owners.
// - Adam moments split among holders (ZeRO-1): every block of a rank's optimizer shard, written
//   by that rank, since the shard already gives each element one owner, in near-equal slices of
//   whole rows; nothing is gathered. The parameters the same rows by the same rank, so that a
//   large piece (the embedding) is written by all its holders and every rank writes about the
//   same bytes. A piece of a column-sharded tensor may then hold only some rows of its columns
//   ("rows" in the manifest).
//
// One file per rank rather than per piece: a rank writes one sequential stream (what a disk is
// fastest at) and the checkpoint has as many files as ranks, not thousands (a 70B model has ~10^4
// pieces under tensor parallelism); the manifest gives every piece's byte offset, so a reader
// still seeks straight to the pieces it needs.
//
// A stored piece is its parameters, or its Adam first then second moment, each packed as
// layout::pack_block_part writes it, each with its own XXH3 in the manifest: a reader checks
// exactly the bytes it reads. (Version 3 stored every piece's parameters and both moments
// together, by the parameters' owner; it is read as those two kinds.)
//
// Commit across ranks (checkpoint/checkpoint_writer.h): every rank writes its file into the same
// temporary directory "<dir>.tmp.<pid of rank 0>"; once all report success, rank 0 writes
// manifest.json last, renames the directory into place and only then updates `latest`. A rank
// that dies while writing leaves only the temporary directory (removed by clean_stale_temporaries)
// and the previous checkpoint `latest`.

// The kinds of state, in the order a rank saves and reads them.
enum class StateKind { kParams = 0, kMoments = 1 };
// Buffers of each kind: parameters; Adam first and second moments.
inline int kind_buffers(StateKind kind) {
  return kind == StateKind::kParams ? 1 : 2;
}

// A part of a rank's state it writes: `part` of `block`, the block of its buffers holding it.
struct OwnedPart {
  layout::Block block;
  layout::BlockPart part;
};

// One kind of a rank's state as a save reads it: its buffers (one, or both moments; laid out
// alike) and the parts of it this rank writes.
struct SavedKind {
  StateKind kind = StateKind::kParams;
  std::vector<const float*> buffers;
  std::vector<OwnedPart> parts;
};

// What `rank` writes of its state, its parameters laid out by `local`, and when `moment_blocks`
// is given its Adam moments `adam_m`, `adam_v` kept there: the pieces it owns (owned_pieces of
// `refinement`, the common refinement of the run's layout) of both when `moments_split` is false
// (the blocks are then those of `local`); else every block of its optimizer shard, of both.
std::vector<SavedKind> saved_state(const model::ModelConfig& model,
                                   const std::vector<layout::RefinedPiece>& refinement, int rank,
                                   const model::ParameterLayout& local, const float* params,
                                   const layout::Blocks* moment_blocks, const float* adam_m,
                                   const float* adam_v, bool moments_split);

// The parts a rank owns, copied out of its live buffers: what the writer of an asynchronous save
// works from while training goes on (the copy is all the training step waits for).
struct ShardSnapshot {
  struct Piece {
    StateKind kind = StateKind::kParams;
    layout::BlockPart part;
  };
  int rank = 0;
  std::vector<Piece> pieces;
  // Per piece in order: each buffer of its kind in turn; may be larger than they need (reused).
  // Not a std::vector: zero-filling gigabytes only to overwrite them would lengthen the step's
  // stall; and huge pages make its first touch and the write() out of it cheaper.
  PageBuffer<float> data;
};

// The floats a snapshot of `state` copies (each part once per buffer of its kind): what a save
// keeps in host memory (the trainer's memory check counts it before anything is allocated).
int64_t snapshot_elements(const std::vector<SavedKind>& state);

// `reuse`: an earlier snapshot whose memory is taken over when large enough (a save after the
// first then faults in no fresh pages while the step waits).
ShardSnapshot snapshot_shard(int rank, const std::vector<SavedKind>& state,
                             ShardSnapshot reuse = {});

// A piece of the parameters a rank writes: `piece` of the full model, found in the rank's own
// local tensor `local_tensor`.
struct OwnedPiece {
  layout::Piece piece;
  int local_tensor = 0;
};

// The parameter pieces `rank` owns in a sharded checkpoint of `layout`'s state: `refinement` is
// the common refinement of that one layout (ParallelState::grad_sync().pieces).
std::vector<OwnedPiece> owned_pieces(const std::vector<layout::RefinedPiece>& refinement, int rank);

// The file a rank writes: "rank_00003.bin".
std::string shard_file_name(int rank);

// Writes <dir>/shard_file_name(rank) from a snapshot (fsynced before it returns) and returns its
// manifest entry: its size and, for each piece, where it lies and each buffer's checksum.
Json write_shard(const std::filesystem::path& dir, const ShardSnapshot& snapshot);

// The manifest entry write_shard returns, without writing anything (the checksums computed).
Json shard_entry(const ShardSnapshot& snapshot);
// The bytes of the file a snapshot is written as.
int64_t shard_bytes(const ShardSnapshot& snapshot);

// The sealed manifest.json text of a sharded checkpoint: `header`'s model, config and progress,
// and `shards`, the write_shard entries of its files; `where` names it in errors.
std::string sharded_manifest_text(const Checkpoint& header, const std::vector<Json>& shards,
                                  bool with_moments, const std::string& where);

// The temporary directory a save of `dir` writes into before the commit: "<dir>.tmp.<pid>",
// `pid` being the committing process's.
std::filesystem::path temporary_dir(const std::filesystem::path& dir, int64_t pid);

// Rank 0's half of the commit, once every rank's write_shard returned: checks that the files'
// pieces cover every tensor exactly once (each kind), writes the tokenizer and manifest.json into
// `tmp` (manifest last) and moves `tmp` to `dir` (an older checkpoint of that name is replaced
// only then). `header` gives the model, config and progress (its buffers are not used).
// `with_moments`: whether the pieces include the Adam moments.
void commit_sharded_checkpoint(const std::filesystem::path& tmp, const std::filesystem::path& dir,
                               const Checkpoint& header, const std::vector<Json>& shards,
                               bool with_moments);

// Where a rank keeps one kind of its state, to be read into: the blocks its buffers hold (one
// buffer for parameters, two for the moments, laid out alike).
struct StateTarget {
  const layout::Blocks* blocks = nullptr;
  std::vector<float*> buffers;
};

// A checkpoint's manifest, parsed and verified (its own checksum, the model's tensors, and for a
// sharded one that its pieces tile every tensor exactly once), without reading any data.
//
// While it lives, an index holds a shared lock on the checkpoint's manifest.json (when there is
// one): retention (checkpoint/retention.h) does not remove a checkpoint being read.
class CheckpointReadLock;
class CheckpointIndex {
 public:
  explicit CheckpointIndex(const std::filesystem::path& dir);
  // From manifest.json's text as another rank read it (every rank then verifies it itself).
  CheckpointIndex(const std::filesystem::path& dir, const std::string& manifest_text);

  const std::filesystem::path& dir() const { return dir_; }
  const std::string& manifest_text() const { return text_; }
  const Json& manifest() const { return manifest_; }  // verified
  bool sharded() const { return version_ >= 3; }
  bool has_optimizer() const { return has_optimizer_; }
  // Model, training config and progress; no buffers, no tokenizer.
  const Checkpoint& header() const { return header_; }

  // Sharded checkpoints: fills the parameters (`params`) and, when given, the Adam moments
  // (`moments`) with what their blocks hold, reading only the stored pieces that overlap them,
  // each checked against its checksum. Returns the bytes read. Throws Error naming the file at
  // fault if one is missing, truncated or corrupt.
  int64_t read(const StateTarget& params, const StateTarget* moments = nullptr) const;
  // The same for buffers laid out by `local`: parameters, then both Adam moments if three are
  // given.
  int64_t read(const model::ParameterLayout& local, const std::vector<float*>& buffers) const;
  // Sharded checkpoints: throws Error naming the first file the manifest lists that is missing
  // or not of its size (what read() checks of the files it opens, for all of them, reading
  // nothing).
  void check_files() const;
  // Sharded checkpoints: every file the manifest lists, with its size in bytes.
  const std::map<std::string, int64_t>& file_bytes() const { return file_bytes_; }

 private:
  struct StoredPiece {
    std::string file;
    layout::BlockPart part;
    int64_t offset = 0;             // bytes into the file
    std::vector<std::string> xxh3;  // per buffer of its kind
  };
  // The constructor's parts: one file's pieces from the manifest, and one kind's pieces of a
  // tensor checked to tile it.
  void read_file_entry(const std::string& file, const Json& entry,
                       const std::unordered_map<std::string, int>& index,
                       const model::ParameterLayout& full, size_t buffer_count,
                       const std::string& source);
  // A piece of a file's entry, read and checked against the model, and the kind it holds.
  struct ManifestPiece {
    StoredPiece stored;
    StateKind kind = StateKind::kParams;
  };
  ManifestPiece read_piece(const Json& piece, const std::string& piece_source,
                           const std::unordered_map<std::string, int>& index,
                           const model::ParameterLayout& full) const;
  static void check_tiling(std::vector<StoredPiece>& pieces, const model::TensorSpec& spec,
                           int kind, const std::string& source);

  CheckpointIndex(const std::filesystem::path& dir, std::shared_ptr<const CheckpointReadLock> lock);

  std::filesystem::path dir_;
  std::shared_ptr<const CheckpointReadLock> lock_;
  std::string text_;
  int64_t version_ = 0;
  bool has_optimizer_ = false;
  Checkpoint header_;
  Json manifest_;
  // Per kind, per full-model tensor; in axis order, then row order.
  std::vector<std::vector<StoredPiece>> pieces_[2];
  std::map<std::string, int64_t> file_bytes_;
};

}  // namespace malleus::checkpoint
