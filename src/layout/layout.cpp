#include "layout/layout.h"

#include <algorithm>
#include <map>
#include <unordered_map>

#include "common/error.h"

namespace malleus::layout {

Layout plan_layout(const plan::Plan& plan, const model::ModelConfig& model) {
  Layout layout;
  layout.shards.resize(static_cast<size_t>(plan.world_size));
  layout.replica_group.assign(static_cast<size_t>(plan.world_size), -1);
  int group = 0;
  for (const auto& pipeline : plan.pipelines) {
    for (size_t s = 0; s < pipeline.stages.size(); ++s) {
      const plan::Stage& stage = pipeline.stages[s];
      int head = 0, ffn = 0, vocab = 0;
      for (size_t t = 0; t < stage.ranks.size(); ++t) {
        model::ShardSpec shard;
        shard.layer_begin = stage.layer_begin;
        shard.layer_end = stage.layer_end;
        shard.has_embedding = s == 0;
        shard.has_head = s + 1 == pipeline.stages.size();
        shard.head_begin = head;
        shard.heads = stage.heads[t];
        shard.ffn_begin = ffn;
        shard.ffn = stage.ffn[t];
        shard.vocab_begin = vocab;
        shard.vocab = stage.vocab[t];
        head += shard.heads;
        ffn += shard.ffn;
        vocab += shard.vocab;
        shard.validate(model);
        const auto r = static_cast<size_t>(stage.ranks[t]);
        layout.shards[r] = shard;
        layout.replica_group[r] = group;
      }
      ++group;
    }
  }
  return layout;
}

Layout single_owner_layout(const model::ModelConfig& model, int world_size, int owner) {
  check(owner >= 0 && owner < world_size, "owner rank outside the world");
  Layout layout;
  layout.shards.resize(static_cast<size_t>(world_size));
  layout.replica_group.assign(static_cast<size_t>(world_size), -1);
  layout.shards[static_cast<size_t>(owner)] = model::ShardSpec::full(model);
  layout.replica_group[static_cast<size_t>(owner)] = 0;
  return layout;
}

std::vector<std::optional<model::ParameterLayout>> local_layouts(const model::ModelConfig& model,
                                                                 const Layout& layout) {
  std::vector<std::optional<model::ParameterLayout>> locals(layout.shards.size());
  for (size_t r = 0; r < layout.shards.size(); ++r) {
    if (layout.shards[r]) locals[r].emplace(model, *layout.shards[r]);
  }
  return locals;
}

namespace {

// Extent of a tensor along its split axis, and the range a local tensor covers on it.
int64_t axis_extent(const model::TensorSpec& full) {
  return full.shard_axis == model::ShardAxis::kColumns ? full.full_shape[1] : full.full_shape[0];
}
int64_t local_extent(const model::TensorSpec& local) {
  return local.shard_axis == model::ShardAxis::kColumns ? local.shape[1] : local.shape[0];
}

}  // namespace

const Holder* find_holder(const std::vector<Holder>& holders, int rank) {
  for (const Holder& h : holders) {
    if (h.rank == rank) return &h;
  }
  return nullptr;
}

namespace {

// A holder of part of a full tensor in one layout: [begin, end) along its split axis.
struct Span {
  int64_t begin, end;
  Holder holder;
};
using TensorSpans = std::vector<std::vector<Span>>;  // per layout

// For every full tensor and layout: (rank, group, local tensor, [begin, end)) of each holder.
std::vector<TensorSpans> holder_spans(const model::ModelConfig& model,
                                      const model::ParameterLayout& full,
                                      const std::vector<const Layout*>& layouts) {
  std::unordered_map<std::string, int> full_index;
  for (size_t i = 0; i < full.tensors().size(); ++i) {
    full_index[full.tensors()[i].name] = static_cast<int>(i);
  }
  // What a shard holds of each tensor. Ranks with the same shard (data-parallel replicas) share
  // one entry: building a rank's ParameterLayout is most of the cost for large plans.
  struct LocalSpan {
    int full, tensor;  // full-model and local tensor index
    int64_t begin, end;
  };
  std::map<std::vector<int>, std::vector<LocalSpan>> by_shard;
  auto spans_of = [&](const model::ShardSpec& shard) -> const std::vector<LocalSpan>& {
    const std::vector<int> key{shard.layer_begin, shard.layer_end,  shard.has_embedding,
                               shard.has_head,    shard.head_begin, shard.heads,
                               shard.ffn_begin,   shard.ffn,        shard.vocab_begin,
                               shard.vocab};
    auto [it, added] = by_shard.try_emplace(key);
    if (added) {
      const model::ParameterLayout local(model, shard);
      for (size_t t = 0; t < local.tensors().size(); ++t) {
        const auto& spec = local.tensors()[t];
        it->second.push_back({full_index.at(spec.name), static_cast<int>(t), spec.shard_begin,
                              spec.shard_begin + local_extent(spec)});
      }
    }
    return it->second;
  };
  std::vector<TensorSpans> spans(full.tensors().size(), TensorSpans(layouts.size()));
  for (size_t li = 0; li < layouts.size(); ++li) {
    const Layout& layout = *layouts[li];
    check(layout.world_size() == layouts[0]->world_size(),
          "layouts of different world sizes cannot be refined together");
    for (size_t r = 0; r < layout.shards.size(); ++r) {
      if (!layout.shards[r]) continue;
      for (const LocalSpan& local : spans_of(*layout.shards[r])) {
        spans[static_cast<size_t>(local.full)][li].push_back(
            {local.begin, local.end,
             Holder{static_cast<int>(r), layout.replica_group[r], local.tensor}});
      }
    }
  }
  return spans;
}

// Full tensor `f` cut at every holder's bounds: the pieces some layout holds, with their holders
// in each layout (by rank), onto `pieces`.
void refine_tensor(const model::ParameterLayout& full, size_t f, const TensorSpans& spans,
                   std::vector<RefinedPiece>* pieces) {
  std::vector<int64_t> cuts{0, axis_extent(full.tensors()[f])};
  for (const auto& per_layout : spans) {
    for (const Span& s : per_layout) {
      cuts.push_back(s.begin);
      cuts.push_back(s.end);
    }
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  for (size_t c = 0; c + 1 < cuts.size(); ++c) {
    RefinedPiece piece{{static_cast<int>(f), cuts[c], cuts[c + 1]}, 0, 1, {}};
    piece.elements = piece_elements(full, piece.piece);
    const model::TensorSpec& spec = full.tensors()[f];
    if (spec.full_shape.size() > 1) {
      piece.row_elements = spec.shard_axis == model::ShardAxis::kColumns
                               ? piece.piece.end - piece.piece.begin
                               : spec.full_shape[1];
    }
    bool held = false;
    for (const auto& per_layout : spans) {
      std::vector<Holder> holders;
      for (const Span& s : per_layout) {
        if (s.begin <= piece.piece.begin && piece.piece.end <= s.end) holders.push_back(s.holder);
      }
      std::sort(holders.begin(), holders.end(),
                [](const Holder& a, const Holder& b) { return a.rank < b.rank; });
      held = held || !holders.empty();
      piece.holders.push_back(std::move(holders));
    }
    if (held) pieces->push_back(std::move(piece));
  }
}

}  // namespace

std::vector<RefinedPiece> common_refinement(const model::ModelConfig& model,
                                            const std::vector<const Layout*>& layouts) {
  check(!layouts.empty(), "common refinement of no layouts");
  const model::ParameterLayout full(model);
  const std::vector<TensorSpans> spans = holder_spans(model, full, layouts);
  std::vector<RefinedPiece> pieces;
  for (size_t f = 0; f < spans.size(); ++f) refine_tensor(full, f, spans[f], &pieces);
  return pieces;
}

int64_t piece_elements(const model::ParameterLayout& full, const Piece& piece) {
  const auto& t = full.tensor(piece.tensor);
  const int64_t length = piece.end - piece.begin;
  if (t.full_shape.size() == 1) return length;
  return length * (t.shard_axis == model::ShardAxis::kColumns ? t.full_shape[0] : t.full_shape[1]);
}

model::TensorSpec piece_tensor(const model::TensorSpec& full, const Piece& piece, int64_t offset) {
  model::TensorSpec spec = full;
  const int64_t length = piece.end - piece.begin;
  if (full.full_shape.size() == 1) {
    spec.shape = {length};
  } else if (full.shard_axis == model::ShardAxis::kColumns) {
    spec.shape = {full.full_shape[0], length};
  } else {
    spec.shape = {length, full.full_shape[1]};
  }
  spec.shard_begin = piece.begin;
  spec.offset = offset;
  spec.size = length *
              (spec.shape.size() > 1
                   ? (full.shard_axis == model::ShardAxis::kColumns ? spec.shape[0] : spec.shape[1])
                   : 1);
  return spec;
}

std::optional<Piece> overlap(const Piece& piece, const model::TensorSpec& local) {
  const int64_t begin = std::max(piece.begin, local.shard_begin);
  const int64_t end = std::min(piece.end, local.shard_begin + local_extent(local));
  if (begin >= end) return std::nullopt;
  return Piece{piece.tensor, begin, end};
}

int64_t Block::axis_begin() const {
  return spec.shard_axis == model::ShardAxis::kColumns ? spec.shard_begin : row_begin;
}

int64_t Block::axis_end() const {
  return spec.shard_axis == model::ShardAxis::kColumns ? spec.shard_begin + spec.shape[1] : row_end;
}

namespace {

// The block of a local tensor: all of its rows (of its columns, when column-sharded).
Block tensor_block(int full_tensor, const model::TensorSpec& spec) {
  Block block{full_tensor, spec, 0, spec.full_shape[0]};
  if (spec.shard_axis != model::ShardAxis::kColumns) {
    block.row_begin = spec.shard_begin;
    block.row_end = spec.shard_begin + spec.shape[0];
  }
  return block;
}

}  // namespace

std::vector<Blocks> layout_blocks(const model::ModelConfig& model, const Layout& layout) {
  const model::ParameterLayout full(model);
  std::unordered_map<std::string, int> full_index;
  for (size_t i = 0; i < full.tensors().size(); ++i) {
    full_index[full.tensors()[i].name] = static_cast<int>(i);
  }
  std::vector<Blocks> blocks(layout.shards.size());
  const auto locals = local_layouts(model, layout);
  for (size_t r = 0; r < locals.size(); ++r) {
    if (!locals[r]) continue;
    for (const model::TensorSpec& spec : locals[r]->tensors()) {
      blocks[r].push_back(tensor_block(full_index.at(spec.name), spec));
    }
  }
  return blocks;
}

Blocks local_blocks(const model::ParameterLayout& full, const model::ParameterLayout& local) {
  Blocks blocks;
  for (const model::TensorSpec& spec : local.tensors()) {
    const model::TensorSpec& whole_tensor = full.find(spec.name);
    blocks.push_back(tensor_block(static_cast<int>(&whole_tensor - full.tensors().data()), spec));
  }
  return blocks;
}

std::optional<BlockPart> overlap(const Block& a, const Block& b) {
  if (a.tensor != b.tensor) return std::nullopt;
  const int64_t begin = std::max(a.axis_begin(), b.axis_begin());
  const int64_t end = std::min(a.axis_end(), b.axis_end());
  if (begin >= end) return std::nullopt;
  BlockPart part;
  part.part = {a.tensor, begin, end};
  if (a.spec.shard_axis == model::ShardAxis::kColumns) {
    part.row_begin = std::max(a.row_begin, b.row_begin);
    part.row_end = std::min(a.row_end, b.row_end);
    if (part.row_begin >= part.row_end) return std::nullopt;
    part.elements = (end - begin) * (part.row_end - part.row_begin);
  } else {
    part.elements = (end - begin) * (a.spec.full_shape.size() > 1 ? a.spec.full_shape[1] : 1);
  }
  return part;
}

BlockPart whole(const Block& block) {
  return *overlap(block, block);
}

model::TensorSpec rows_view(const model::TensorSpec& spec, int64_t row_begin, int64_t row_end) {
  if (row_begin < 0) return spec;
  model::TensorSpec view = spec;
  view.offset += row_begin * spec.shape[1];
  view.shape[0] = row_end - row_begin;
  view.size = view.shape[0] * view.shape[1];
  return view;
}

Block packed_block(const model::TensorSpec& full, const BlockPart& part) {
  Block block;
  block.tensor = part.part.tensor;
  if (full.shard_axis == model::ShardAxis::kColumns) {
    // All rows described, placed so that row i lies where the buffer keeps it.
    const int64_t width = part.part.end - part.part.begin;
    block.spec = piece_tensor(full, part.part, -part.row_begin * width);
    block.row_begin = part.row_begin;
    block.row_end = part.row_end;
  } else {
    block.spec = piece_tensor(full, part.part);
    block.row_begin = part.part.begin;
    block.row_end = part.part.end;
  }
  return block;
}

std::vector<int> balanced_owners(const std::vector<RefinedPiece>& pieces) {
  std::map<int, int64_t> given;  // elements per rank so far
  std::vector<int> owners;
  owners.reserve(pieces.size());
  for (const RefinedPiece& p : pieces) {
    check(!p.holders.empty() && !p.holders[0].empty(), "balanced_owners: a piece nobody holds");
    int best = p.holders[0].front().rank;
    for (const Holder& h : p.holders[0]) {
      if (given[h.rank] < given[best]) best = h.rank;  // holders are sorted by rank
    }
    given[best] += p.elements;
    owners.push_back(best);
  }
  return owners;
}

PieceRuns piece_runs(const model::TensorSpec& local, const Piece& piece) {
  const int64_t from = piece.begin - local.shard_begin, length = piece.end - piece.begin;
  if (local.shard_axis == model::ShardAxis::kColumns) {
    const int64_t rows = local.shape[0], cols = local.shape[1];
    return {local.offset + from, length, rows, cols};
  }
  const int64_t row = local.shape.size() > 1 ? local.shape[1] : 1;
  return {local.offset + from * row, length * row, 1, length * row};
}

template <typename T>
void pack_piece(const T* local_buffer, const model::TensorSpec& local, const Piece& piece, T* out,
                const DeviceMemory* memory) {
  const PieceRuns runs = piece_runs(local, piece);
  if (memory != nullptr) {
    memory->to_host(out, local_buffer + runs.offset, size_t(runs.length) * sizeof(T),
                    size_t(runs.rows), size_t(runs.stride) * sizeof(T));
    return;
  }
  for (int64_t r = 0; r < runs.rows; ++r) {
    std::copy_n(local_buffer + runs.offset + r * runs.stride, runs.length, out + r * runs.length);
  }
}

template <typename T>
void unpack_piece(const T* in, const model::TensorSpec& local, const Piece& piece, T* local_buffer,
                  const DeviceMemory* memory) {
  const PieceRuns runs = piece_runs(local, piece);
  if (memory != nullptr) {
    memory->from_host(local_buffer + runs.offset, in, size_t(runs.length) * sizeof(T),
                      size_t(runs.rows), size_t(runs.stride) * sizeof(T));
    return;
  }
  for (int64_t r = 0; r < runs.rows; ++r) {
    std::copy_n(in + r * runs.length, runs.length, local_buffer + runs.offset + r * runs.stride);
  }
}

template <typename T>
void pack_piece(backend::Backend<T>& backend, const T* local_buffer, const model::TensorSpec& local,
                const Piece& piece, T* out) {
  const PieceRuns runs = piece_runs(local, piece);
  backend.copy_rows(out, local_buffer + runs.offset,
                    {.count = size_t(runs.length),
                     .rows = size_t(runs.rows),
                     .source_stride = size_t(runs.stride),
                     .destination_stride = size_t(runs.length)});
}

template <typename T>
void unpack_piece(backend::Backend<T>& backend, const T* in, const model::TensorSpec& local,
                  const Piece& piece, T* local_buffer) {
  const PieceRuns runs = piece_runs(local, piece);
  backend.copy_rows(local_buffer + runs.offset, in,
                    {.count = size_t(runs.length),
                     .rows = size_t(runs.rows),
                     .source_stride = size_t(runs.length),
                     .destination_stride = size_t(runs.stride)});
}

std::optional<int64_t> contiguous_offset(const model::TensorSpec& local, const Piece& piece) {
  const int64_t from = piece.begin - local.shard_begin, length = piece.end - piece.begin;
  if (local.shard_axis == model::ShardAxis::kColumns) {
    const int64_t rows = local.shape[0], cols = local.shape[1];
    if (rows != 1 && length != cols) return std::nullopt;  // a strided run of columns
    return local.offset + from;
  }
  const int64_t row = local.shape.size() > 1 ? local.shape[1] : 1;
  return local.offset + from * row;
}

template <typename T>
void pack_block_part(const T* buffer, const Block& block, const BlockPart& part, T* out,
                     const DeviceMemory* memory) {
  pack_piece(buffer, rows_view(block.spec, part.row_begin, part.row_end), part.part, out, memory);
}

template <typename T>
void unpack_block_part(const T* in, const Block& block, const BlockPart& part, T* buffer,
                       const DeviceMemory* memory) {
  unpack_piece(in, rows_view(block.spec, part.row_begin, part.row_end), part.part, buffer, memory);
}

template void pack_block_part<float>(const float*, const Block&, const BlockPart&, float*,
                                     const DeviceMemory*);
template void unpack_block_part<float>(const float*, const Block&, const BlockPart&, float*,
                                       const DeviceMemory*);
template void pack_piece<float>(const float*, const model::TensorSpec&, const Piece&, float*,
                                const DeviceMemory*);
template void pack_piece<double>(const double*, const model::TensorSpec&, const Piece&, double*,
                                 const DeviceMemory*);
template void unpack_piece<float>(const float*, const model::TensorSpec&, const Piece&, float*,
                                  const DeviceMemory*);
template void unpack_piece<double>(const double*, const model::TensorSpec&, const Piece&, double*,
                                   const DeviceMemory*);
template void pack_piece<float>(backend::Backend<float>&, const float*, const model::TensorSpec&,
                                const Piece&, float*);
template void unpack_piece<float>(backend::Backend<float>&, const float*, const model::TensorSpec&,
                                  const Piece&, float*);

}  // namespace malleus::layout
