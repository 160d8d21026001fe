// Layouts and their common refinement: the one piece of algebra behind gradient sync across
// unlike pipelines, live migration between plans and checkpoint resharding (DESIGN.md, "One
// algebra for three jobs").
//
// A layout says which shard of the model (model::ShardSpec) every rank holds. Every parameter
// tensor is split along one axis (rows, or columns for row-parallel weights) or replicated. Cut
// every tensor at every shard boundary that any of a set of layouts has: each resulting piece is
// held by some ranks in each layout.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "backend/backend.h"
#include "common/device_memory.h"
#include "model/config.h"
#include "model/parameters.h"
#include "plan/plan.h"

namespace malleus::layout {

struct Layout {
  // shards[r]: what rank r holds, or nothing (an idle rank).
  std::vector<std::optional<model::ShardSpec>> shards;
  // Ranks with the same replica group hold identical copies of the tensors they share (the ranks
  // of one tensor-parallel group: their replicated norms, computed identically). -1: none.
  std::vector<int> replica_group;

  int world_size() const { return static_cast<int>(shards.size()); }
};

// The layout of a plan: each stage's ranks hold its layers with their head / FFN / vocabulary
// shares (in rank order within the group); each stage is a replica group.
Layout plan_layout(const plan::Plan& plan, const model::ModelConfig& model);
// Rank `owner` holds the whole model, the others nothing: the layout of a checkpoint.
Layout single_owner_layout(const model::ModelConfig& model, int world_size, int owner);

// Rows [begin, end) of tensor `tensor` (its index in the full model's ParameterLayout), or
// columns for column-sharded tensors. 1-D tensors count their elements as rows.
struct Piece {
  int tensor = 0;
  int64_t begin = 0, end = 0;
};

struct Holder {
  int rank = 0;
  int replica_group = -1;
  int local_tensor = 0;  // index in the rank's own ParameterLayout
};

struct RefinedPiece {
  Piece piece;
  int64_t elements = 0;  // piece_elements of the piece
  // Elements of one of its rows (first axis of the full tensor; 1 for 1-D tensors), as pack_piece
  // lays it out: whole rows are the unit the distributed optimizer's slices are cut at.
  int64_t row_elements = 1;
  std::vector<std::vector<Holder>> holders;  // holders[i]: who holds it in layouts[i], by rank
};

// The entry of `rank` among one layout's holders of a piece, or null if it holds none of it.
const Holder* find_holder(const std::vector<Holder>& holders, int rank);

// The common refinement of `layouts` (all of the same world size), in tensor order, then axis
// order. Pieces nobody holds are left out.
std::vector<RefinedPiece> common_refinement(const model::ModelConfig& model,
                                            const std::vector<const Layout*>& layouts);

// Each rank's own parameter layout under `layout` (nullopt for ranks holding nothing).
std::vector<std::optional<model::ParameterLayout>> local_layouts(const model::ModelConfig& model,
                                                                 const Layout& layout);

// Elements of a piece.
int64_t piece_elements(const model::ParameterLayout& full, const Piece& piece);

// A buffer holding exactly `piece` of tensor `full` (as pack_piece writes it) described as a
// tensor of its own, at `offset` in that buffer: pieces cut out of pieces (a checkpoint's stored
// pieces read into a rank's shard under another plan) use the same pack_piece / unpack_piece.
model::TensorSpec piece_tensor(const model::TensorSpec& full, const Piece& piece,
                               int64_t offset = 0);
// The part of `piece` that `local` (a tensor of some rank's layout, the same full tensor) holds,
// if any.
std::optional<Piece> overlap(const Piece& piece, const model::TensorSpec& local);

// A part of a full tensor that a rank holds in one kind of its flat buffers (parameters, or Adam
// moments, whole or in its optimizer shard): `spec` says where it lies, as pack_piece and
// unpack_piece read it, and rows [row_begin, row_end) of the full tensor (its first axis; the
// elements of a 1-D tensor) are held. For tensors split by rows these are the rows of `spec`. A
// column-sharded block may hold only some rows of its columns: `spec` then describes all the
// rows, placed so that row i lies where the block keeps it (its offset may be negative), and only
// rows [row_begin, row_end) of it may be read or written.
struct Block {
  int tensor = 0;  // in the full model's ParameterLayout
  model::TensorSpec spec;
  int64_t row_begin = 0, row_end = 0;
  // The range it holds along the tensor's split axis (columns of a column-sharded tensor).
  int64_t axis_begin() const;
  int64_t axis_end() const;
};
using Blocks = std::vector<Block>;

// Each rank's local layout under `layout` as blocks, one per local tensor in its order (empty for
// ranks holding nothing).
std::vector<Blocks> layout_blocks(const model::ModelConfig& model, const Layout& layout);
// One rank's local layout `local` as blocks, one per local tensor in its order; `full` is the
// model's whole ParameterLayout.
Blocks local_blocks(const model::ParameterLayout& full, const model::ParameterLayout& local);

// The part of a full tensor that two blocks of it both hold: `part` along the tensor's split
// axis and, for a column-sharded tensor, rows [row_begin, row_end) of those columns (for other
// tensors the rows are part's own range, and row_begin = row_end = -1).
struct BlockPart {
  Piece part;
  int64_t row_begin = -1, row_end = -1;
  int64_t elements = 0;
};
std::optional<BlockPart> overlap(const Block& a, const Block& b);
// Everything `block` holds, as a part.
BlockPart whole(const Block& block);
// `spec` seen as only rows [row_begin, row_end) of it (a column-sharded block's; for row_begin < 0
// it is returned as it is): what pack_piece / unpack_piece then read and write of a part.
model::TensorSpec rows_view(const model::TensorSpec& spec, int64_t row_begin, int64_t row_end);
// A contiguous buffer holding exactly `part` of `full` (tensor `part.part.tensor` of the model),
// as pack_block_part writes it, described as a block: parts cut out of parts (a checkpoint's
// stored pieces read into another plan's blocks) use the same pack and unpack.
Block packed_block(const model::TensorSpec& full, const BlockPart& part);
// Copies `part` (which `block` holds) between a buffer laid out with `block` and a contiguous one
// in host memory; `memory` is where `buffer` lies (null: host memory; see pack_piece).
template <typename T>
void pack_block_part(const T* buffer, const Block& block, const BlockPart& part, T* out,
                     const DeviceMemory* memory = nullptr);
template <typename T>
void unpack_block_part(const T* in, const Block& block, const BlockPart& part, T* buffer,
                       const DeviceMemory* memory = nullptr);

// One owner for every piece of a one-layout refinement (holders[0]): the holder with the fewest
// elements given so far, lowest rank on ties, so that every holder of replicated state gets
// about the same share. What a sharded checkpoint has each rank write.
std::vector<int> balanced_owners(const std::vector<RefinedPiece>& pieces);

// A piece as it lies in a flat buffer laid out by `local`: `rows` runs of `length` elements, the
// first at `offset`, each `stride` elements after the one before (one run for a row piece or a
// replicated tensor, one per row for a column piece). pack_piece lays the runs end to end.
struct PieceRuns {
  int64_t offset = 0, length = 0, rows = 1, stride = 0;
};
PieceRuns piece_runs(const model::TensorSpec& local, const Piece& piece);

// Copies a piece between a rank's flat buffer (laid out by `local`) and a contiguous buffer in
// host memory. `memory` says where the flat buffer lies: null for host memory, else a device's
// (a backend's device_memory()), reached through its copies, one per piece.
template <typename T>
void pack_piece(const T* local_buffer, const model::TensorSpec& local, const Piece& piece, T* out,
                const DeviceMemory* memory = nullptr);
template <typename T>
void unpack_piece(const T* in, const model::TensorSpec& local, const Piece& piece, T* local_buffer,
                  const DeviceMemory* memory = nullptr);
// The same with both buffers in `backend`'s memory, by its copies (one per run): what the engine
// packs gradients and parameters with, so that a GPU's never leave the device to be packed.
template <typename T>
void pack_piece(backend::Backend<T>& backend, const T* local_buffer, const model::TensorSpec& local,
                const Piece& piece, T* out);
template <typename T>
void unpack_piece(backend::Backend<T>& backend, const T* in, const model::TensorSpec& local,
                  const Piece& piece, T* local_buffer);
// Where `piece` lies in a flat buffer laid out by `local` when it lies there as one run, in the
// order pack_piece writes it (row pieces, replicated tensors, column pieces as wide as the local
// tensor): its offset in elements. Then pack_piece / unpack_piece are one copy, and a reader can
// put a stored piece's bytes straight where they belong, without a copy at all.
std::optional<int64_t> contiguous_offset(const model::TensorSpec& local, const Piece& piece);

}  // namespace malleus::layout
