// Sharded checkpoints (format version 4, and version 3 read): one file per rank holding the pieces
// it owns, and the manifest that says where each piece lies (checkpoint/checkpoint.h describes the
// format).
#include <fcntl.h>
#include <signal.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <tuple>
#include <unordered_map>

#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_detail.h"
#include "checkpoint/retention.h"
#include "common/checksum.h"
#include "common/error.h"
#include "common/files.h"
#include "common/host_pages.h"

namespace malleus::checkpoint {

using namespace detail;

namespace {

const std::vector<std::string> kBufferNames{"params", "adam_m", "adam_v"};

int64_t axis_extent(const model::TensorSpec& full) {
  return full.shard_axis == model::ShardAxis::kColumns ? full.full_shape[1] : full.full_shape[0];
}

const char* kKindNames[] = {"params", "moments"};

bool column_sharded(const model::TensorSpec& full) {
  return full.shard_axis == model::ShardAxis::kColumns;
}

std::string piece_text(const std::string& tensor, const layout::Piece& piece) {
  return "tensor \"" + tensor + "\" [" + std::to_string(piece.begin) + ", " +
         std::to_string(piece.end) + ")";
}

std::string part_text(const std::string& tensor, const layout::BlockPart& part) {
  std::string text = piece_text(tensor, part.part);
  if (part.row_begin >= 0) {
    text += " rows [" + std::to_string(part.row_begin) + ", " + std::to_string(part.row_end) + ")";
  }
  return text;
}

// A piece of the full model along its split axis as a part: all its rows.
layout::BlockPart piece_part(const model::ParameterLayout& full, const layout::Piece& piece) {
  layout::BlockPart part{piece, -1, -1, layout::piece_elements(full, piece)};
  const model::TensorSpec& spec = full.tensor(piece.tensor);
  if (column_sharded(spec)) {
    part.row_begin = 0;
    part.row_end = spec.full_shape[0];
  }
  return part;
}

// A test hook standing for a rank that dies while writing (tests/test_cli_mpi.cpp): with
// MALLEUS_FAULT_DIE_IN_SAVE=<rank>, that rank kills itself (SIGKILL, no clean-up of any kind)
// halfway through writing its file. The commit must then leave the previous checkpoint `latest`.
bool dies_in_save(int rank) {
  const char* value = std::getenv("MALLEUS_FAULT_DIE_IN_SAVE");
  return value != nullptr && *value != '\0' && std::to_string(rank) == value;
}

}  // namespace

std::string shard_file_name(int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank_%05d.bin", rank);
  return name;
}

fs::path temporary_dir(const fs::path& dir, int64_t pid) {
  return with_suffix(normalized(dir), ".tmp." + std::to_string(pid));
}

std::vector<OwnedPiece> owned_pieces(const std::vector<layout::RefinedPiece>& refinement,
                                     int rank) {
  const std::vector<int> owners = layout::balanced_owners(refinement);
  std::vector<OwnedPiece> mine;
  for (size_t i = 0; i < refinement.size(); ++i) {
    if (owners[i] != rank) continue;
    mine.push_back(
        {refinement[i].piece, layout::find_holder(refinement[i].holders[0], rank)->local_tensor});
  }
  return mine;
}

std::vector<SavedKind> saved_state(const model::ModelConfig& model,
                                   const std::vector<layout::RefinedPiece>& refinement, int rank,
                                   const model::ParameterLayout& local, const float* params,
                                   const layout::Blocks* moment_blocks, const float* adam_m,
                                   const float* adam_v, bool moments_split) {
  const model::ParameterLayout full(model);
  const layout::Blocks blocks = layout::local_blocks(full, local);
  std::vector<SavedKind> state(moment_blocks != nullptr ? 2 : 1);
  state[0] = {StateKind::kParams, {params}, {}};
  if (moment_blocks != nullptr && moments_split) {
    // The optimizer shard gives every element one owner already, in near-equal slices cut at
    // rows: the moments all of it, as it lies, and the parameters the same rows (a large piece,
    // such as the embedding, is then written by all its holders, not by one).
    std::unordered_map<int, size_t> local_block;  // by full-model tensor
    for (size_t i = 0; i < blocks.size(); ++i) local_block[blocks[i].tensor] = i;
    state[1] = {StateKind::kMoments, {adam_m, adam_v}, {}};
    for (const layout::Block& block : *moment_blocks) {
      const layout::BlockPart part = layout::whole(block);
      state[0].parts.push_back({blocks[local_block.at(block.tensor)], part});
      state[1].parts.push_back({block, part});
    }
    return state;
  }
  const std::vector<OwnedPiece> owned = owned_pieces(refinement, rank);
  for (const OwnedPiece& p : owned) {
    state[0].parts.push_back(
        {blocks[static_cast<size_t>(p.local_tensor)], piece_part(full, p.piece)});
  }
  if (moment_blocks == nullptr) return state;
  state[1] = {StateKind::kMoments, {adam_m, adam_v}, {}};
  {
    check(moment_blocks->size() == blocks.size(),
          "saved_state: whole moments must be laid out like the parameters");
    for (const OwnedPiece& p : owned) {
      state[1].parts.push_back(
          {(*moment_blocks)[static_cast<size_t>(p.local_tensor)], piece_part(full, p.piece)});
    }
  }
  return state;
}

int64_t snapshot_elements(const std::vector<SavedKind>& state) {
  int64_t elements = 0;
  for (const SavedKind& kind : state) {
    for (const OwnedPart& p : kind.parts) elements += p.part.elements * kind_buffers(kind.kind);
  }
  return elements;
}

ShardSnapshot snapshot_shard(int rank, const std::vector<SavedKind>& state, ShardSnapshot reuse) {
  ShardSnapshot snapshot;
  snapshot.rank = rank;
  for (const SavedKind& kind : state) {
    check(kind.buffers.size() == static_cast<size_t>(kind_buffers(kind.kind)),
          "snapshot_shard: " + std::string(kKindNames[static_cast<int>(kind.kind)]) + " take " +
              std::to_string(kind_buffers(kind.kind)) + " buffers, not " +
              std::to_string(kind.buffers.size()));
    for (const OwnedPart& p : kind.parts) snapshot.pieces.push_back({kind.kind, p.part});
  }
  const auto needed = static_cast<size_t>(snapshot_elements(state));
  snapshot.data = reuse.data.size() >= needed ? std::move(reuse.data) : PageBuffer<float>(needed);
  float* cursor = snapshot.data.data();
  for (const SavedKind& kind : state) {
    for (const OwnedPart& p : kind.parts) {
      for (const float* buffer : kind.buffers) {
        layout::pack_block_part(buffer, p.block, p.part, cursor);
        cursor += p.part.elements;
      }
    }
  }
  return snapshot;
}

namespace {

// A piece's entry in a shard file's manifest entry: what it is, where it lies, its buffers' sums.
Json piece_entry(const ShardSnapshot::Piece& piece, int64_t offset, Json sums) {
  Json entry = {{"state", kKindNames[static_cast<int>(piece.kind)]},
                {"tensor", piece.part.part.tensor},
                {"begin", piece.part.part.begin},
                {"end", piece.part.part.end}};
  if (piece.part.row_begin >= 0) {
    entry["rows"] = std::vector<int64_t>{piece.part.row_begin, piece.part.row_end};
  }
  entry["offset"] = offset;
  entry["xxh3"] = std::move(sums);
  return entry;
}

// Visits each buffer of each piece of `snapshot` in file order: (data, bytes), then the piece's
// entry is made from their checksums. Returns the file's manifest entry.
template <typename OnBuffer, typename BeforePiece>
Json visit_shard(const ShardSnapshot& snapshot, OnBuffer&& on_buffer, BeforePiece&& before_piece) {
  Json pieces = Json::array();
  int64_t offset = 0;
  const float* cursor = snapshot.data.data();
  for (size_t i = 0; i < snapshot.pieces.size(); ++i) {
    before_piece(i);
    const ShardSnapshot::Piece& piece = snapshot.pieces[i];
    const int buffers = kind_buffers(piece.kind);
    Json sums = Json::array();
    const auto bytes = static_cast<size_t>(piece.part.elements) * sizeof(float);
    for (int b = 0; b < buffers; ++b) {
      on_buffer(cursor, bytes);
      sums.push_back(checksum_hex(cursor, bytes));
      cursor += piece.part.elements;
    }
    pieces.push_back(piece_entry(piece, offset, std::move(sums)));
    offset += static_cast<int64_t>(bytes) * buffers;
  }
  return Json{{"file", shard_file_name(snapshot.rank)}, {"bytes", offset}, {"pieces", pieces}};
}

}  // namespace

Json write_shard(const fs::path& dir, const ShardSnapshot& snapshot) {
  const bool die = dies_in_save(snapshot.rank);
  AtomicFile file(dir / shard_file_name(snapshot.rank));
  Json entry = visit_shard(
      snapshot, [&](const float* data, size_t bytes) { file.write(data, bytes); },
      [&](size_t i) {
        if (die && i == snapshot.pieces.size() / 2) ::raise(SIGKILL);
      });
  if (die) ::raise(SIGKILL);
  file.commit();
  return entry;
}

Json shard_entry(const ShardSnapshot& snapshot) {
  return visit_shard(
      snapshot, [](const float*, size_t) {}, [](size_t) {});
}

int64_t shard_bytes(const ShardSnapshot& snapshot) {
  int64_t bytes = 0;
  for (const ShardSnapshot::Piece& piece : snapshot.pieces) {
    bytes += piece.part.elements * kind_buffers(piece.kind) * int64_t{sizeof(float)};
  }
  return bytes;
}

std::string sharded_manifest_text(const Checkpoint& header, const std::vector<Json>& shards,
                                  bool with_moments, const std::string& where) {
  const size_t buffers = with_moments ? 3 : 1;
  const model::ParameterLayout full(header.model);
  Json tensors = Json::array();
  for (const auto& t : full.tensors())
    tensors.push_back({{"name", t.name}, {"shape", t.full_shape}});
  Json files = Json::object();
  for (const Json& shard : shards) {
    Json pieces = shard.at("pieces");
    // Tensor indices become names: the manifest describes itself without the model's order.
    for (Json& p : pieces) p["tensor"] = full.tensor(p["tensor"].get<int>()).name;
    files[shard.at("file").get<std::string>()] = {{"bytes", shard.at("bytes")}, {"pieces", pieces}};
  }
  Json manifest = manifest_head(kShardedVersion, header, std::move(tensors));
  manifest["buffers"] =
      std::vector<std::string>(kBufferNames.begin(), kBufferNames.begin() + buffers);
  manifest["files"] = std::move(files);
  return sealed_manifest_text(manifest, where);
}

void commit_sharded_checkpoint(const fs::path& tmp, const fs::path& dir_arg,
                               const Checkpoint& header, const std::vector<Json>& shards,
                               bool with_moments) {
  const fs::path dir = normalized(dir_arg);
  const std::string where = "checkpoint " + dir.string();
  const std::string text = sharded_manifest_text(header, shards, with_moments, where);
  // Refuses a layout with a gap or an overlap before it becomes a checkpoint.
  const CheckpointIndex verified(tmp, text);
  if (header.tokenizer) tokenizer::save_tokenizer(*header.tokenizer, tmp);
  // Written last: a directory with a manifest is a complete checkpoint.
  write_file_atomic(tmp / kManifest, text);
  move_into_place(tmp, dir, where);
}

namespace {

void check_buffer_names(const std::vector<std::string>& buffers, const std::string& source) {
  check(buffers.size() == 1 || buffers.size() == 3, source + ": \"buffers\" lists " +
                                                        std::to_string(buffers.size()) +
                                                        " buffers, expected 1 or 3");
  for (size_t b = 0; b < buffers.size(); ++b) {
    check(buffers[b] == kBufferNames[b], source + ": buffer " + std::to_string(b) + " is \"" +
                                             buffers[b] + "\", expected \"" + kBufferNames[b] +
                                             "\"");
  }
}

// The manifest's "tensors" checked against the model's: each tensor's index by name.
std::unordered_map<std::string, int> tensor_index(const Json& tensors,
                                                  const model::ParameterLayout& full,
                                                  const std::string& source) {
  check(tensors.is_array() && tensors.size() == full.tensors().size(),
        source + ": \"tensors\" must list the model's " + std::to_string(full.tensors().size()) +
            " tensors");
  std::unordered_map<std::string, int> index;
  for (size_t i = 0; i < full.tensors().size(); ++i) {
    const auto& spec = full.tensors()[i];
    JsonReader entry(tensors[i], source + " tensors[" + std::to_string(i) + "]");
    const auto name = entry.required<std::string>("name");
    const auto shape = entry.required<std::vector<int64_t>>("shape");
    entry.finish();
    check(name == spec.name && shape == spec.full_shape,
          source + ": tensor " + std::to_string(i) + " is \"" + name + "\" " + shape_text(shape) +
              ", but the model config expects \"" + spec.name + "\" " +
              shape_text(spec.full_shape));
    index[spec.name] = static_cast<int>(i);
  }

  return index;
}

}  // namespace

CheckpointIndex::CheckpointIndex(const fs::path& dir)
    : CheckpointIndex(dir, [&] {
        const fs::path d = normalized(dir);
        std::error_code ec;
        check(fs::is_regular_file(d / kManifest, ec),
              "checkpoint " + d.string() + ": not a checkpoint: no manifest.json");
        return std::make_shared<const CheckpointReadLock>(d);
      }()) {}

CheckpointIndex::CheckpointIndex(const fs::path& dir,
                                 std::shared_ptr<const CheckpointReadLock> lock)
    : CheckpointIndex(dir, lock->manifest_text()) {
  lock_ = std::move(lock);
}

CheckpointIndex::CheckpointIndex(const fs::path& dir, const std::string& manifest_text)
    : dir_(normalized(dir)), text_(manifest_text) {
  // Held while this index lives, so retention leaves the checkpoint alone (retention.h). A
  // manifest not written yet (a save verifying its pieces first) has nothing to lock.
  std::error_code ec;
  if (fs::is_regular_file(dir_ / kManifest, ec)) {
    lock_ = std::make_shared<const CheckpointReadLock>(dir_);
  }
  const std::string where = "checkpoint " + dir_.string();
  const std::string source = where + ": manifest.json";
  manifest_ = verified_manifest(text_, source, &version_);
  JsonReader reader(manifest_, source);
  header_ = read_manifest_header(reader, source);
  const Json files = reader.required<Json>("files");
  const Json tensors = reader.required<Json>("tensors");
  if (!sharded()) {
    // The single-file form: load_checkpoint checks and reads the rest.
    has_optimizer_ = files.is_object() && files.contains("optimizer.bin");
    return;
  }
  const auto buffers = reader.required<std::vector<std::string>>("buffers");
  reader.finish();
  check_buffer_names(buffers, source);
  has_optimizer_ = buffers.size() == 3;
  const model::ParameterLayout full(header_.model);
  const std::unordered_map<std::string, int> index = tensor_index(tensors, full, source);
  for (auto& kind : pieces_) kind.assign(full.tensors().size(), {});
  check(files.is_object() && !files.empty(), source + ": \"files\" must be a non-empty object");
  for (const auto& [file, entry_json] : files.items()) {
    read_file_entry(file, entry_json, index, full, buffers.size(), source);
  }
  // Every element of each kind stored exactly once: each tensor's pieces, in axis order, tile it;
  // pieces of a column-sharded tensor over the same columns tile its rows.
  for (int k = 0; k < (has_optimizer_ ? 2 : 1); ++k) {
    for (size_t t = 0; t < pieces_[k].size(); ++t) {
      check_tiling(pieces_[k][t], full.tensor(static_cast<int>(t)), k, source);
    }
  }
}

// One file's entry of the manifest: its pieces, each checked and filed by kind and tensor.
void CheckpointIndex::read_file_entry(const std::string& file, const Json& entry_json,
                                      const std::unordered_map<std::string, int>& index,
                                      const model::ParameterLayout& full, size_t buffer_count,
                                      const std::string& source) {
  const std::string file_source = source + " files \"" + file + "\"";
  check(file.size() == shard_file_name(0).size() && file.rfind("rank_", 0) == 0 &&
            file.find('/') == std::string::npos,
        file_source + ": not a shard file name (rank_NNNNN.bin)");
  JsonReader entry(entry_json, file_source);
  const auto bytes = entry.required<int64_t>("bytes");
  const Json pieces = entry.required<Json>("pieces");
  entry.finish();
  check(pieces.is_array(), file_source + ": \"pieces\" must be an array");
  int64_t offset = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const std::string piece_source = file_source + " pieces[" + std::to_string(i) + "]";
    ManifestPiece piece = read_piece(pieces[i], piece_source, index, full);
    StoredPiece& stored = piece.stored;
    stored.file = file;
    check(stored.offset == offset, piece_source + ": at byte offset " +
                                       std::to_string(stored.offset) + ", expected " +
                                       std::to_string(offset));
    const size_t expected_sums =
        version_ > kShardedVersion3 ? size_t(kind_buffers(piece.kind)) : buffer_count;
    check(stored.xxh3.size() == expected_sums,
          piece_source + ": " + std::to_string(stored.xxh3.size()) + " checksums for " +
              std::to_string(expected_sums) + " buffers");
    const int64_t piece_bytes = stored.part.elements * int64_t{sizeof(float)};
    offset += piece_bytes * static_cast<int64_t>(expected_sums);
    const size_t t = static_cast<size_t>(stored.part.part.tensor);
    if (version_ == kShardedVersion3 && has_optimizer_) {
      // The moments follow the parameters.
      StoredPiece moments = stored;
      moments.offset += piece_bytes;
      moments.xxh3 = {stored.xxh3[1], stored.xxh3[2]};
      stored.xxh3.resize(1);
      pieces_[1][t].push_back(std::move(moments));
    }
    pieces_[static_cast<int>(piece.kind)][t].push_back(std::move(stored));
  }
  check(offset == bytes, file_source + ": its pieces take " + std::to_string(offset) +
                             " bytes, but \"bytes\" says " + std::to_string(bytes));
  file_bytes_[file] = bytes;
}

// One piece of a file's entry: its kind, tensor, extent along the tensor's axis (and rows, for a
// column-sharded tensor), offset and checksums; checked to lie within the tensor.
CheckpointIndex::ManifestPiece CheckpointIndex::read_piece(
    const Json& piece_json, const std::string& piece_source,
    const std::unordered_map<std::string, int>& index, const model::ParameterLayout& full) const {
  JsonReader p(piece_json, piece_source);
  ManifestPiece piece;
  StoredPiece& stored = piece.stored;
  // Version 3 stores every piece's parameters and both moments together; version 4 each kind as
  // pieces of its own.
  if (version_ > kShardedVersion3) {
    const auto state = p.required<std::string>("state");
    check(state == kKindNames[0] || (state == kKindNames[1] && has_optimizer_),
          p.source() + ": \"state\" is \"" + state + "\", expected \"params\"" +
              (has_optimizer_ ? " or \"moments\"" : " (the manifest lists no moments)"));
    piece.kind = state == kKindNames[0] ? StateKind::kParams : StateKind::kMoments;
  }
  const auto tensor = p.required<std::string>("tensor");
  stored.part.part.begin = p.required<int64_t>("begin");
  stored.part.part.end = p.required<int64_t>("end");
  std::optional<std::vector<int64_t>> rows;
  if (version_ > kShardedVersion3) rows = p.optional<std::vector<int64_t>>("rows", {});
  stored.offset = p.required<int64_t>("offset");
  stored.xxh3 = p.required<std::vector<std::string>>("xxh3");
  p.finish();
  const auto found = index.find(tensor);
  check(found != index.end(), p.source() + ": the model has no tensor \"" + tensor + "\"");
  stored.part.part.tensor = found->second;
  const auto& spec = full.tensor(stored.part.part.tensor);
  check(0 <= stored.part.part.begin && stored.part.part.begin < stored.part.part.end &&
            stored.part.part.end <= axis_extent(spec),
        p.source() + ": " + piece_text(tensor, stored.part.part) + " is outside the tensor");
  stored.part = piece_part(full, stored.part.part);
  if (rows && !rows->empty()) {
    check(column_sharded(spec), p.source() + ": \"rows\" given for tensor \"" + tensor +
                                    "\", which is not split by columns");
    check(rows->size() == 2 && 0 <= (*rows)[0] && (*rows)[0] < (*rows)[1] &&
              (*rows)[1] <= spec.full_shape[0],
          p.source() + ": \"rows\" must be [first, end) within the tensor's " +
              std::to_string(spec.full_shape[0]) + " rows");
    stored.part.row_begin = (*rows)[0];
    stored.part.row_end = (*rows)[1];
    stored.part.elements =
        (stored.part.part.end - stored.part.part.begin) * (stored.part.row_end - (*rows)[0]);
  }
  return piece;
}

// A kind's pieces of one tensor, sorted into axis order (then row order), tile it exactly.
void CheckpointIndex::check_tiling(std::vector<StoredPiece>& list, const model::TensorSpec& spec,
                                   int k, const std::string& source) {
  std::sort(list.begin(), list.end(), [](const StoredPiece& a, const StoredPiece& b) {
    return std::pair(a.part.part.begin, a.part.row_begin) <
           std::pair(b.part.part.begin, b.part.row_begin);
  });
  const std::string what = std::string(" (") + kKindNames[k] + ", ";
  int64_t next = 0;
  for (size_t i = 0; i < list.size();) {
    const StoredPiece& first = list[i];
    check(first.part.part.begin == next,
          source + ": " + part_text(spec.name, first.part) + what + first.file + ") " +
              (first.part.part.begin < next ? "overlaps" : "leaves a gap before") +
              " the piece before it");
    size_t j = i + 1;
    if (column_sharded(spec)) {
      int64_t row = 0;
      for (j = i; j < list.size() && list[j].part.part.begin == first.part.part.begin; ++j) {
        const StoredPiece& p = list[j];
        check(p.part.part.end == first.part.part.end && p.part.row_begin == row,
              source + ": " + part_text(spec.name, p.part) + what + p.file + ") " +
                  (p.part.part.end != first.part.part.end || p.part.row_begin < row
                       ? "overlaps"
                       : "leaves a gap before") +
                  " the piece before it");
        row = p.part.row_end;
      }
      check(row == spec.full_shape[0], source + ": " + piece_text(spec.name, first.part.part) +
                                           what + first.file + ") is stored only up to row " +
                                           std::to_string(row) + " of " +
                                           std::to_string(spec.full_shape[0]));
    }
    next = first.part.part.end;
    i = j;
  }
  check(next == axis_extent(spec), source + ": tensor \"" + spec.name + "\" (" + kKindNames[k] +
                                       ") is stored only up to " + std::to_string(next) + " of " +
                                       std::to_string(axis_extent(spec)));
}

namespace {

// One stored buffer of one piece that a rank needs: where it lies, and where it goes.
struct Region {
  const std::string* file = nullptr;
  int64_t offset = 0, bytes = 0;  // in the file
  StateKind kind = StateKind::kParams;
  size_t buffer = 0;                     // of its kind: params; adam_m, adam_v
  const layout::Block* block = nullptr;  // where the rank keeps it
  float* destination = nullptr;          // the buffer `block` lies in
  const model::TensorSpec* full = nullptr;
  layout::BlockPart stored, part;  // the stored piece, and the part of it held here
  const std::string* xxh3 = nullptr;
  // Where its bytes go verbatim in the rank's buffer, when they do (the whole stored piece is
  // held here and lies there as one run): read straight there. Else null: read into a staging
  // buffer, then unpacked.
  float* direct = nullptr;
  int64_t staged_at = 0;  // else: its offset in its span's staging buffer, in elements
};

// Regions next to each other in one file, read front to back.
struct Span {
  size_t first = 0, last = 0;  // regions [first, last)
  int64_t offset = 0, bytes = 0;
  int64_t staged = 0;  // elements of its regions read into staging
};

// Spans are at most this long (a region longer than that alone), which bounds the staging of the
// regions that are not read straight into place.
constexpr int64_t kSpanBytes = int64_t{32} << 20;
// One read: large enough for the disk's sequential speed, small enough that its bytes are still
// in the cache when they are checksummed (4 MiB read and checksummed at once ran at 92 % of a
// plain sequential read on the test VM, 32 MiB at 86 %), in at most this many parts (IOV_MAX is
// 1024 on Linux).
constexpr int64_t kReadBytes = int64_t{4} << 20;
constexpr size_t kReadParts = 512;

// A file open for reading, closed with the object.
class ReadOnlyFile {
 public:
  ReadOnlyFile() = default;
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;
  ~ReadOnlyFile() {
    if (fd >= 0) ::close(fd);
  }
  int fd = -1;
};

// The regions, in file order, grouped into spans: runs of adjacent regions of one file, up to
// kSpanBytes, read together (each region's place in the span's staging set).
std::vector<Span> group_spans(std::vector<Region>& regions) {
  std::vector<Span> spans;
  for (size_t i = 0; i < regions.size(); ++i) {
    Region& r = regions[i];
    const int64_t staged = r.direct ? 0 : r.bytes / int64_t{sizeof(float)};
    if (!spans.empty()) {
      Span& span = spans.back();
      if (*regions[span.first].file == *r.file && span.offset + span.bytes == r.offset &&
          span.bytes + r.bytes <= kSpanBytes) {
        r.staged_at = span.staged;
        span.bytes += r.bytes;
        span.staged += staged;
        span.last = i + 1;
        continue;
      }
    }
    spans.push_back({i, i + 1, r.offset, r.bytes, staged});
  }

  return spans;
}

// Each file of the spans opened once, its size checked against the manifest before anything is
// read.
std::map<std::string, ReadOnlyFile> open_files(const fs::path& dir, const std::string& where,
                                               const std::vector<Region>& regions,
                                               const std::vector<Span>& spans,
                                               const std::map<std::string, int64_t>& file_bytes) {
  std::map<std::string, ReadOnlyFile> files;
  for (const Span& span : spans) {
    const std::string& name = *regions[span.first].file;
    if (files.count(name) > 0) continue;
    const fs::path path = dir / name;
    std::error_code ec;
    check(fs::is_regular_file(path, ec), where + ": " + name + " is missing");
    const auto size = static_cast<int64_t>(fs::file_size(path, ec));
    check(!ec, where + ": cannot stat " + name + ": " + ec.message());
    const int64_t expected = file_bytes.at(name);
    check(size >= expected, where + ": " + name + " is truncated: " + std::to_string(size) +
                                " bytes, manifest says " + std::to_string(expected));
    check(size == expected, where + ": " + name + " has trailing data: " + std::to_string(size) +
                                " bytes, manifest says " + std::to_string(expected));
    ReadOnlyFile& file = files[name];
    file.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    check(file.fd >= 0, where + ": cannot open " + name + ": " + std::strerror(errno));
    ::posix_fadvise(file.fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  }

  return files;
}

// Reads the spans' regions into place, checking each against its checksum; returns the bytes read.
int64_t read_spans(const std::string& where, const std::vector<Region>& regions,
                   const std::vector<Span>& spans,
                   const std::map<std::string, ReadOnlyFile>& files) {
  // Staging only for the regions that cannot go straight to their place: one buffer, as large as
  // the most any span stages, allocated only if some span needs it.
  int64_t most_staged = 0;
  for (const Span& span : spans) most_staged = std::max(most_staged, span.staged);
  const PageBuffer<float> staging(static_cast<size_t>(most_staged));
  auto destination = [&](const Region& r) {
    return reinterpret_cast<char*>(r.direct != nullptr ? r.direct : staging.data() + r.staged_at);
  };
  // A region whose bytes are all in: checked against the manifest, then put in place.
  std::vector<float> cut;
  auto finish = [&](const Region& r, const std::string& actual) {
    const std::string buffer_name = kBufferNames[r.kind == StateKind::kParams ? 0 : 1 + r.buffer];
    check(actual == *r.xxh3, where + ": " + *r.file +
                                 " is corrupt: " + part_text(r.full->name, r.stored) + " (" +
                                 buffer_name + ") has checksum " + actual + ", expected " +
                                 *r.xxh3 + " (from manifest.json)");
    const auto* stored = reinterpret_cast<const float*>(destination(r));
    if (r.direct != nullptr) {
      // Already in place.
    } else if (r.part.elements == r.stored.elements) {
      layout::unpack_block_part(stored, *r.block, r.part, r.destination);
    } else {
      // Only part of the stored piece is held here (another plan's cuts): cut it out.
      cut.resize(static_cast<size_t>(r.part.elements));
      layout::pack_block_part(stored, layout::packed_block(*r.full, r.stored), r.part, cut.data());
      layout::unpack_block_part(cut.data(), *r.block, r.part, r.destination);
    }
  };

  // Each span front to back, in reads of kReadBytes; each read's bytes go into their regions'
  // checksums at once, while they are still in the cache (checksumming a span after reading
  // all of it would fetch it from memory a second time). The kernel reads ahead of us
  // (POSIX_FADV_SEQUENTIAL), so the disk does not wait for the checksums meanwhile. The pages a
  // read lands in are faulted in first, from here (common/host_pages.h says why).
  int64_t bytes_read = 0;
  for (const Span& span : spans) {
    const std::string& name = *regions[span.first].file;
    const int fd = files.at(name).fd;
    size_t region = span.first;  // the region being read, and how much of it is in
    int64_t region_done = 0;
    auto sum = std::make_unique<Checksum>();
    for (int64_t done = 0; done < span.bytes;) {
      std::vector<iovec> parts;
      int64_t wanted = 0;
      for (size_t i = region; i < span.last && wanted < kReadBytes && parts.size() < kReadParts;
           ++i) {
        const int64_t from = i == region ? region_done : 0;
        const int64_t take = std::min(regions[i].bytes - from, kReadBytes - wanted);
        parts.push_back({destination(regions[i]) + from, static_cast<size_t>(take)});
        wanted += take;
      }
      for (const iovec& part : parts) prefault_for_overwrite(part.iov_base, part.iov_len);
      const ssize_t n = ::preadv(fd, parts.data(), static_cast<int>(parts.size()),
                                 static_cast<off_t>(span.offset + done));
      if (n < 0 && errno == EINTR) continue;
      check(n >= 0, where + ": cannot read " + name + ": " + std::strerror(errno));
      check(n > 0, where + ": cannot read " + name + " (it shrank while reading)");
      done += n;
      for (int64_t left = n; left > 0;) {
        const Region& r = regions[region];
        const int64_t step = std::min(left, r.bytes - region_done);
        sum->update(destination(r) + region_done, static_cast<size_t>(step));
        region_done += step;
        left -= step;
        if (region_done == r.bytes) {
          finish(r, sum->hex());
          bytes_read += r.bytes;
          sum = std::make_unique<Checksum>();
          ++region;
          region_done = 0;
        }
      }
    }
  }
  return bytes_read;
}

}  // namespace

void CheckpointIndex::check_files() const {
  const std::string where = "checkpoint " + dir_.string();
  check(sharded(), where + ": CheckpointIndex::check_files checks sharded checkpoints only");
  for (const auto& [name, expected] : file_bytes_) {
    std::error_code ec;
    check(fs::is_regular_file(dir_ / name, ec), where + ": " + name + " is missing");
    const auto size = static_cast<int64_t>(fs::file_size(dir_ / name, ec));
    check(!ec && size == expected, where + ": " + name + " has " + std::to_string(size) +
                                       " bytes, manifest says " + std::to_string(expected));
  }
}

int64_t CheckpointIndex::read(const model::ParameterLayout& local,
                              const std::vector<float*>& buffers) const {
  check(buffers.size() == 1 || buffers.size() == 3,
        "checkpoint " + dir_.string() + ": read parameters, or parameters and both Adam moments");
  const layout::Blocks blocks = layout::local_blocks(model::ParameterLayout(header_.model), local);
  const StateTarget params{&blocks, {buffers[0]}};
  if (buffers.size() == 1) return read(params);
  const StateTarget moments{&blocks, {buffers[1], buffers[2]}};
  return read(params, &moments);
}

int64_t CheckpointIndex::read(const StateTarget& params, const StateTarget* moments) const {
  const std::string where = "checkpoint " + dir_.string();
  check(sharded(), where + ": CheckpointIndex::read reads sharded checkpoints only");
  check(moments == nullptr || has_optimizer_,
        where + ": has no optimizer state (its pieces hold parameters only)");
  const model::ParameterLayout full(header_.model);

  // Every stored buffer of every piece that overlaps what this rank holds, in file order, so
  // each file is read front to back in large sequential reads.
  std::vector<Region> regions;
  for (const StateKind kind : {StateKind::kParams, StateKind::kMoments}) {
    const StateTarget* target = kind == StateKind::kParams ? &params : moments;
    if (target == nullptr || target->blocks == nullptr) continue;
    check(target->buffers.size() == size_t(kind_buffers(kind)),
          where + ": " + kKindNames[static_cast<int>(kind)] + " are read into " +
              std::to_string(kind_buffers(kind)) + " buffers, not " +
              std::to_string(target->buffers.size()));
    for (const layout::Block& block : *target->blocks) {
      const model::TensorSpec& spec = full.tensor(block.tensor);
      for (const StoredPiece& p :
           pieces_[static_cast<int>(kind)][static_cast<size_t>(block.tensor)]) {
        const std::optional<layout::BlockPart> part =
            layout::overlap(layout::packed_block(spec, p.part), block);
        if (!part) continue;
        const int64_t bytes = p.part.elements * int64_t{sizeof(float)};
        const std::optional<int64_t> run =
            part->elements == p.part.elements
                ? layout::contiguous_offset(
                      layout::rows_view(block.spec, part->row_begin, part->row_end), part->part)
                : std::nullopt;
        for (size_t b = 0; b < target->buffers.size(); ++b) {
          float* buffer = target->buffers[b];
          regions.push_back({&p.file, p.offset + static_cast<int64_t>(b) * bytes, bytes, kind, b,
                             &block, buffer, &spec, p.part, *part, &p.xxh3[b],
                             run ? buffer + *run : nullptr});
        }
      }
    }
  }
  std::sort(regions.begin(), regions.end(), [](const Region& a, const Region& b) {
    return std::tie(*a.file, a.offset) < std::tie(*b.file, b.offset);
  });
  const std::vector<Span> spans = group_spans(regions);
  const std::map<std::string, ReadOnlyFile> files =
      open_files(dir_, where, regions, spans, file_bytes_);
  return read_spans(where, regions, spans, files);
}

}  // namespace malleus::checkpoint
