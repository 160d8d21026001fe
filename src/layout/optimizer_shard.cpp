#include "layout/optimizer_shard.h"

#include <algorithm>

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
      for (int64_t i = 0; i <= members; ++i) chunk.bounds.push_back(chunk.elements * i / members);
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

}  // namespace malleus::layout
