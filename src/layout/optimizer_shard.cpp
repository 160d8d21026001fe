#include "layout/optimizer_shard.h"

#include <algorithm>

#include "plan/cost_model.h"

namespace malleus::layout {

std::vector<std::pair<size_t, size_t>> pack_chunks(const GradSyncPlan& sync,
                                                   const std::vector<int>& pieces,
                                                   double chunk_elements) {
  std::vector<std::pair<size_t, size_t>> chunks;
  for (size_t begin = 0, end = 0; begin < pieces.size(); begin = end) {
    int64_t elements = 0;
    for (end = begin; end < pieces.size(); ++end) {
      const int64_t next = sync.pieces[static_cast<size_t>(pieces[end])].elements;
      if (end > begin && double(elements + next) > chunk_elements) break;
      elements += next;
    }
    chunks.emplace_back(begin, end);
  }
  return chunks;
}

namespace {

// The chunk cut into `members` near-equal slices at whole rows of its pieces: each bound is the
// row boundary nearest to the even cut, never before the previous bound.
std::vector<int64_t> row_aligned_bounds(const GradSyncPlan& sync, const ShardChunk& chunk,
                                        int64_t members) {
  std::vector<int64_t> bounds{0};
  size_t k = 0;    // the piece the next even cut falls in
  int64_t at = 0;  // where it starts in the chunk
  for (int64_t i = 1; i < members; ++i) {
    const int64_t even = chunk.elements * i / members;
    while (k < chunk.pieces.size() &&
           at + sync.pieces[static_cast<size_t>(chunk.pieces[k])].elements <= even) {
      at += sync.pieces[static_cast<size_t>(chunk.pieces[k++])].elements;
    }
    int64_t bound = even;
    if (k < chunk.pieces.size()) {
      const int64_t row = sync.pieces[static_cast<size_t>(chunk.pieces[k])].row_elements;
      bound = at + (even - at + row / 2) / row * row;
    }
    bounds.push_back(std::max(bounds.back(), bound));
  }
  bounds.push_back(chunk.elements);
  return bounds;
}

}  // namespace

OptimizerShard optimizer_shard(const GradSyncPlan& sync, int rank, double chunk_elements) {
  OptimizerShard shard;
  auto add_chunks = [&](int group, const std::vector<int>& pieces, const std::vector<int>& ranks) {
    const auto me = std::find(ranks.begin(), ranks.end(), rank);
    if (me == ranks.end()) return;
    const int64_t members = static_cast<int64_t>(ranks.size());
    for (const auto& [begin, end] : pack_chunks(sync, pieces, chunk_elements)) {
      ShardChunk chunk;
      chunk.group = group;
      chunk.pieces.assign(pieces.begin() + long(begin), pieces.begin() + long(end));
      for (int p : chunk.pieces) chunk.elements += sync.pieces[static_cast<size_t>(p)].elements;
      chunk.bounds = row_aligned_bounds(sync, chunk, members);
      chunk.member = static_cast<int>(me - ranks.begin());
      chunk.shard_offset = shard.elements;
      shard.elements += chunk.slice_elements();
      shard.chunks.push_back(std::move(chunk));
    }
  };
  for (size_t g = 0; g < sync.groups.size(); ++g) {
    add_chunks(static_cast<int>(g), sync.groups[g].pieces, sync.groups[g].ranks);
  }
  std::vector<int> alone;
  for (size_t p = 0; p < sync.pieces.size(); ++p) {
    const auto& holders = sync.pieces[p].holders[0];
    if (holders.size() == 1 && holders[0].rank == rank) alone.push_back(static_cast<int>(p));
  }
  add_chunks(-1, alone, {rank});
  return shard;
}

Blocks shard_blocks(const model::ParameterLayout& full, const GradSyncPlan& sync,
                    const OptimizerShard& shard) {
  Blocks blocks;
  for (const ShardChunk& chunk : shard.chunks) {
    int64_t at = 0;  // the piece's start in the chunk
    for (int p : chunk.pieces) {
      const RefinedPiece& piece = sync.pieces[static_cast<size_t>(p)];
      const int64_t lo = std::max(at, chunk.slice_begin());
      const int64_t hi = std::min(at + piece.elements, chunk.slice_end());
      if (lo < hi) {
        // Rows [first, last) of the piece, at `offset` in the shard.
        const int64_t first = (lo - at) / piece.row_elements, last = (hi - at) / piece.row_elements;
        const int64_t offset = chunk.shard_offset + (lo - chunk.slice_begin());
        const model::TensorSpec& spec = full.tensor(piece.piece.tensor);
        Block block;
        block.tensor = piece.piece.tensor;
        if (spec.shard_axis == model::ShardAxis::kColumns) {
          block.spec = piece_tensor(spec, piece.piece, offset - first * piece.row_elements);
          block.row_begin = first;
          block.row_end = last;
        } else {
          const Piece rows{piece.piece.tensor, piece.piece.begin + first, piece.piece.begin + last};
          block.spec = piece_tensor(spec, rows, offset);
          block.row_begin = rows.begin;
          block.row_end = rows.end;
        }
        blocks.push_back(std::move(block));
      }
      at += piece.elements;
    }
  }
  return blocks;
}

std::vector<Blocks> moment_blocks(const model::ModelConfig& model, const Layout& layout,
                                  const GradSyncPlan* sync) {
  if (sync == nullptr) return layout_blocks(model, layout);
  const model::ParameterLayout full(model);
  std::vector<Blocks> blocks(layout.shards.size());
  for (size_t r = 0; r < blocks.size(); ++r) {
    if (!layout.shards[r]) continue;
    blocks[r] = shard_blocks(
        full, *sync, optimizer_shard(*sync, static_cast<int>(r), plan::kGradSyncChunkElements));
  }
  return blocks;
}

}  // namespace malleus::layout
