// The layout algebra: common refinement, gradient-sync groups and redistribution plans, checked
// element by element against brute force on a small model.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "layout/grad_sync_plan.h"
#include "layout/migration.h"
#include "layout/optimizer_shard.h"
#include "layout/redistribution.h"
#include "layout/staged_redistribution.h"
#include "test_models.h"

using namespace malleus;
using malleus::testing::layout_model;

namespace {

plan::Plan parse(const std::string& text) {
  return plan::Plan::from_json(Json::parse(text), layout_model(), "test");
}

// The local layout of a rank holding FFN columns 2-4 of 6 in every layer: column-sharded tensors
// (down_proj [8, 3] of [8, 6]) next to row-sharded and replicated ones.
model::ParameterLayout ffn_columns_2_to_4() {
  model::ShardSpec shard = model::ShardSpec::full(layout_model());
  shard.ffn_begin = 2;
  shard.ffn = 3;
  return model::ParameterLayout(layout_model(), shard);
}

// A parameter buffer for `local` whose element i holds i, so a copied element tells where from.
std::vector<float> numbered_buffer(const model::ParameterLayout& local) {
  std::vector<float> buffer(static_cast<size_t>(local.total_size()));
  for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = float(i);
  return buffer;
}

// 4 ranks: pipeline 0 = [layers 0-1 on tp2 {0,1} (heads 2/2, ffn 4/2, vocab 5/6)], [layer 2 on
// {2}]; pipeline 1 = everything on rank 3.
const char* kPlanA = R"({"world_size": 4, "pipelines": [
  {"micro_batches": 1, "stages": [
    {"layers": [0, 2], "ranks": [0, 1], "heads": [2, 2], "ffn": [4, 2], "vocab": [5, 6]},
    {"layers": [2, 3], "ranks": [2]}]},
  {"micro_batches": 1, "stages": [{"layers": [0, 3], "ranks": [3]}]}]})";
// The same 4 ranks re-planned: one pipeline tp2 {3,1} (ffn 1/5) then {0}, rank 2 idle.
const char* kPlanB = R"({"world_size": 4, "pipelines": [
  {"micro_batches": 2, "stages": [
    {"layers": [0, 1], "ranks": [3, 1], "heads": [2, 2], "ffn": [1, 5], "vocab": [3, 8]},
    {"layers": [1, 3], "ranks": [0]}]}]})";

// Element-level ownership: (tensor, row or column index) -> holder ranks.
std::map<std::pair<int, int64_t>, std::set<int>> element_holders(const layout::Layout& l) {
  const auto model = layout_model();
  const model::ParameterLayout full(model);
  std::map<std::string, int> index;
  for (size_t i = 0; i < full.tensors().size(); ++i) index[full.tensors()[i].name] = int(i);
  std::map<std::pair<int, int64_t>, std::set<int>> holders;
  const auto locals = layout::local_layouts(model, l);
  for (size_t r = 0; r < locals.size(); ++r) {
    if (!locals[r]) continue;
    for (const auto& t : locals[r]->tensors()) {
      const bool columns = t.shard_axis == model::ShardAxis::kColumns;
      const int64_t extent = columns ? t.shape[1] : t.shape[0];
      for (int64_t i = 0; i < extent; ++i)
        holders[{index[t.name], t.shard_begin + i}].insert(int(r));
    }
  }
  return holders;
}

}  // namespace

TEST(Layout, RefinementPiecesHaveOneHolderPerPipeline) {
  const auto model = layout_model();
  const auto layout = layout::plan_layout(parse(kPlanA), model);
  const model::ParameterLayout full(model);
  const auto pieces = layout::common_refinement(model, {&layout});
  for (const auto& piece : pieces) {
    const auto& spec = full.tensor(piece.piece.tensor);
    std::set<int> pipelines;  // ranks 0-2 are pipeline 0, rank 3 pipeline 1
    for (const auto& h : piece.holders[0]) pipelines.insert(h.rank == 3 ? 1 : 0);
    EXPECT_EQ(pipelines.size(), 2u) << spec.name;
    if (spec.shard_axis != model::ShardAxis::kReplicated && spec.layer != 2) {
      EXPECT_EQ(piece.holders[0].size(), 2u) << spec.name;  // one TP rank + rank 3
    }
  }
  // Pieces tile every tensor exactly.
  std::map<int, int64_t> covered;
  for (const auto& p : pieces) covered[p.piece.tensor] += layout::piece_elements(full, p.piece);
  for (size_t t = 0; t < full.tensors().size(); ++t)
    EXPECT_EQ(covered[int(t)], full.tensor(int(t)).size);
}

TEST(Layout, GradSyncCountsEachPipelineOnceAndEachElementOnceInTheNorm) {
  const auto model = layout_model();
  const auto layout = layout::plan_layout(parse(kPlanA), model);
  const auto sync = layout::plan_grad_sync(model, layout);
  for (const auto& piece : sync.pieces) {
    int contributors = 0;
    for (const auto& h : piece.holders[0]) contributors += layout::contributes(piece, h.rank);
    EXPECT_EQ(contributors, 2);  // two pipelines
    EXPECT_EQ(layout::norm_owner(piece), piece.holders[0].front().rank);
  }
  // Replicated norms of layers 0-1 are held by {0, 1, 3}: one group; rank 1 does not contribute.
  bool found = false;
  for (const auto& g : sync.groups) found = found || g.ranks == std::vector<int>{0, 1, 3};
  EXPECT_TRUE(found);
  for (size_t i = 1; i < sync.groups.size(); ++i)
    EXPECT_LT(sync.groups[i - 1].ranks, sync.groups[i].ranks);
}

// The distributed optimizer's layout: every element of every holder set's packed chunks is owned
// by exactly one member, slices are cut at whole rows of the pieces, each cut within half a row of
// the even cut, and a rank's shard is its slices end to end, as blocks of rows; with small chunks
// too (a chunk limit below the larger pieces).
TEST(Layout, OptimizerShardOwnsEachElementOnce) {
  const auto model = layout_model();
  const auto layout = layout::plan_layout(parse(kPlanA), model);
  const auto sync = layout::plan_grad_sync(model, layout);
  for (const double chunk_elements : {1e9, 300.0}) {
    std::map<std::pair<int, std::vector<int>>, std::vector<int64_t>> owned;  // elements per member
    std::map<int, int64_t> group_elements;
    for (int rank = 0; rank < layout.world_size(); ++rank) {
      const auto shard = layout::optimizer_shard(sync, rank, chunk_elements);
      int64_t offset = 0;
      for (const auto& chunk : shard.chunks) {
        EXPECT_EQ(chunk.shard_offset, offset);
        offset += chunk.slice_elements();
        ASSERT_GE(chunk.group, 0);  // two pipelines: no piece has a single holder
        const auto& group = sync.groups[size_t(chunk.group)];
        EXPECT_EQ(group.ranks[size_t(chunk.member)], rank);
        EXPECT_EQ(chunk.bounds.front(), 0);
        EXPECT_EQ(chunk.bounds.back(), chunk.elements);
        const auto members = int64_t(group.ranks.size());
        for (size_t i = 1; i + 1 < chunk.bounds.size(); ++i) {
          const int64_t bound = chunk.bounds[i];
          EXPECT_LE(chunk.bounds[i - 1], bound);
          int64_t at = 0;  // the piece the bound falls in, and its row
          for (int p : chunk.pieces) {
            const auto& piece = sync.pieces[size_t(p)];
            if (bound < at + piece.elements) {
              EXPECT_EQ((bound - at) % piece.row_elements, 0) << "bound " << bound;
              EXPECT_LE(std::abs(bound - chunk.elements * int64_t(i) / members),
                        piece.row_elements / 2 + 1);
              break;
            }
            at += piece.elements;
          }
        }
        int64_t sum = 0;
        for (int p : chunk.pieces) sum += sync.pieces[size_t(p)].elements;
        EXPECT_EQ(sum, chunk.elements);
        EXPECT_TRUE(double(chunk.elements) <= chunk_elements || chunk.pieces.size() == 1);
        owned[{chunk.group, chunk.pieces}].push_back(chunk.slice_elements());
      }
      EXPECT_EQ(shard.elements, offset);
      // The blocks of rows tile the shard, each inside the rank's own tensors.
      int64_t covered = 0;
      for (const auto& block : layout::shard_blocks(model::ParameterLayout(model), sync, shard)) {
        const int64_t rows = block.row_end - block.row_begin;
        const auto& spec = block.spec;
        const bool columns = spec.shard_axis == model::ShardAxis::kColumns;
        const int64_t row = columns ? spec.shape[1] : (spec.shape.size() > 1 ? spec.shape[1] : 1);
        EXPECT_EQ(columns ? spec.offset + block.row_begin * row : spec.offset, covered);
        EXPECT_GT(rows, 0);
        covered += rows * row;
      }
      EXPECT_EQ(covered, shard.elements);
    }
    for (const auto& [key, slices] : owned) {
      const auto& group = sync.groups[size_t(key.first)];
      EXPECT_EQ(slices.size(), group.ranks.size());  // every member took its slice
      int64_t total = 0, expected = 0;
      for (int64_t s : slices) total += s;
      for (int p : key.second) expected += sync.pieces[size_t(p)].elements;
      EXPECT_EQ(total, expected);
      group_elements[key.first] += total;
    }
    for (size_t g = 0; g < sync.groups.size(); ++g) {
      EXPECT_EQ(group_elements[int(g)], sync.groups[g].elements) << "group " << g;
    }
  }
}

TEST(Layout, RedistributionMovesExactlyTheElementsNewHoldersLack) {
  const auto model = layout_model();
  const model::ParameterLayout full(model);
  const auto a = layout::plan_layout(parse(kPlanA), model);
  const auto b = layout::plan_layout(parse(kPlanB), model);
  const auto plan = layout::plan_redistribution(model, a, b);

  // Brute force: for every element, every new holder that did not hold it must receive it.
  const auto before = element_holders(a), after = element_holders(b);
  int64_t lower_bound = 0;
  for (const auto& [element, holders] : after) {
    const auto& spec = full.tensor(element.first);
    const int64_t per_index =
        spec.full_shape.size() == 1
            ? 1
            : (spec.shard_axis == model::ShardAxis::kColumns ? spec.full_shape[0]
                                                             : spec.full_shape[1]);
    const auto it = before.find(element);
    for (int r : holders) {
      if (it == before.end() || !it->second.count(r)) lower_bound += per_index;
    }
  }
  EXPECT_EQ(plan.elements_moved(), lower_bound);
  EXPECT_GT(lower_bound, 0);
  for (const auto& t : plan.transfers) EXPECT_NE(t.source, t.destination);
  // Nothing is sent to a rank that is idle in the new layout (rank 2).
  for (const auto& t : plan.transfers) EXPECT_NE(t.destination, 2);
  // Every piece reaches every new holder exactly once.
  std::map<std::pair<int, int>, int> received;
  for (const auto* list : {&plan.transfers, &plan.local_copies}) {
    for (const auto& t : *list) {
      for (const auto& m : t.moves) ++received[{m.piece, t.destination}];
    }
  }
  for (size_t p = 0; p < plan.pieces.size(); ++p) {
    for (const auto& h : plan.pieces[p].holders[1]) EXPECT_EQ((received[{int(p), h.rank}]), 1);
  }
}

TEST(Layout, CheckpointLayoutGathersAndScattersEverything) {
  const auto model = layout_model();
  const model::ParameterLayout full(model);
  const auto a = layout::plan_layout(parse(kPlanA), model);
  const auto root = layout::single_owner_layout(model, 4, 0);
  const auto gather = layout::plan_redistribution(model, a, root);
  for (const auto& t : gather.transfers) EXPECT_EQ(t.destination, 0);
  int64_t total = 0;
  for (const auto* list : {&gather.transfers, &gather.local_copies}) {
    for (const auto& t : *list) total += t.elements;
  }
  EXPECT_EQ(total, full.num_parameters());
  const auto scatter = layout::plan_redistribution(model, root, a);
  for (const auto& t : scatter.transfers) EXPECT_EQ(t.source, 0);
}

TEST(Layout, PackAndUnpackColumnSlices) {
  const model::ParameterLayout local = ffn_columns_2_to_4();
  const auto& down = local.find("model.layers.0.mlp.down_proj.weight");  // [8, 3] of [8, 6]
  const std::vector<float> buffer = numbered_buffer(local);
  const layout::Piece piece{0, 3, 5};  // columns 3-4 of the full tensor: local columns 1-2
  std::vector<float> packed(16);
  layout::pack_piece(buffer.data(), down, piece, packed.data());
  for (int64_t r = 0; r < 8; ++r) {
    EXPECT_EQ(packed[size_t(r * 2)], buffer[size_t(down.offset + r * 3 + 1)]);
    EXPECT_EQ(packed[size_t(r * 2 + 1)], buffer[size_t(down.offset + r * 3 + 2)]);
  }
  std::vector<float> back(buffer.size(), -1.0f);
  layout::unpack_piece(packed.data(), down, piece, back.data());
  EXPECT_EQ(back[size_t(down.offset + 3 + 1)], buffer[size_t(down.offset + 3 + 1)]);
  EXPECT_EQ(back[size_t(down.offset + 3)], -1.0f);  // column 0 of the slice untouched
}

// A piece lies in a rank's buffer as one run, in pack_piece's order, exactly when its copy is one
// copy: rows of a row-sharded tensor, a replicated tensor, a column piece as wide as the local
// part.
TEST(Layout, ContiguousOffsetIsWherePackPieceCopiesFromInOneRun) {
  const auto model = layout_model();
  const model::ParameterLayout local = ffn_columns_2_to_4();
  const std::vector<float> buffer = numbered_buffer(local);
  const model::ParameterLayout full(model);
  int runs = 0;
  for (const auto& t : local.tensors()) {
    const int index = static_cast<int>(&full.find(t.name) - full.tensors().data());
    const int64_t extent = t.shard_axis == model::ShardAxis::kColumns ? t.shape[1] : t.shape[0];
    // The whole local part, and its last row or column alone.
    for (const layout::Piece piece :
         {layout::Piece{index, t.shard_begin, t.shard_begin + extent},
          layout::Piece{index, t.shard_begin + extent - 1, t.shard_begin + extent}}) {
      const auto elements = static_cast<size_t>(layout::piece_elements(full, piece));
      std::vector<float> packed(elements);
      layout::pack_piece(buffer.data(), t, piece, packed.data());
      const std::optional<int64_t> at = layout::contiguous_offset(t, piece);
      const bool strided = t.shard_axis == model::ShardAxis::kColumns &&
                           piece.end - piece.begin < extent && t.shape[0] > 1;
      ASSERT_EQ(at.has_value(), !strided)
          << t.name << " [" << piece.begin << ", " << piece.end << ")";
      if (!at) continue;
      ++runs;
      EXPECT_TRUE(std::equal(packed.begin(), packed.end(), buffer.begin() + *at)) << t.name;
    }
  }
  EXPECT_GT(runs, 0);
  // down_proj [8, 3] of [8, 6]: one column of three is strided, all three are one run.
  const auto& down = local.find("model.layers.0.mlp.down_proj.weight");
  EXPECT_FALSE(layout::contiguous_offset(down, {0, 3, 4}).has_value());
  EXPECT_EQ(layout::contiguous_offset(down, {0, 2, 5}), down.offset);
}

// A migration run band by band (layout/staged_redistribution.h): every element still reaches
// every new holder exactly once, every rank's old and new state is covered by its band parts,
// and the order keeps each rank's predicted extra memory under the bucket, also when two ranks
// trade pipeline stages (one must give back before the other can take).
TEST(Layout, StagedRedistributionCoversEverythingWithinTheBucket) {
  const auto model = layout_model();
  const model::ParameterLayout full(model);
  // Rank 0 holds the first stage and rank 1 the second, then the other way round.
  const char* kForward = R"({"world_size": 4, "pipelines": [
    {"micro_batches": 2, "stages": [{"layers": [0, 2], "ranks": [0]},
                                    {"layers": [2, 3], "ranks": [1]}]},
    {"micro_batches": 2, "stages": [{"layers": [0, 3], "ranks": [2, 3], "heads": [2, 2],
                                     "ffn": [3, 3], "vocab": [4, 7]}]}]})";
  const char* kSwapped = R"({"world_size": 4, "pipelines": [
    {"micro_batches": 2, "stages": [{"layers": [0, 2], "ranks": [1]},
                                    {"layers": [2, 3], "ranks": [0]}]},
    {"micro_batches": 2, "stages": [{"layers": [0, 3], "ranks": [3, 2], "heads": [2, 2],
                                     "ffn": [1, 5], "vocab": [8, 3]}]}]})";
  const std::vector<std::pair<const char*, const char*>> pairs = {
      {kPlanA, kPlanB}, {kPlanB, kPlanA}, {kForward, kSwapped}, {kSwapped, kPlanA}};
  constexpr int kBuffers = 3, kElementBytes = 4;
  for (const int64_t bucket : {int64_t{1} << 10, int64_t{4} << 10, int64_t{64} << 20}) {
    for (const auto& [from_text, to_text] : pairs) {
      const auto a = layout::plan_layout(parse(from_text), model);
      const auto b = layout::plan_layout(parse(to_text), model);
      const auto plan = layout::plan_redistribution(model, a, b);
      const auto staged =
          layout::stage_redistribution(model, plan, a, b, bucket, kBuffers, kElementBytes);
      SCOPED_TRACE("bucket " + std::to_string(bucket));
      EXPECT_EQ(staged.chunk_elements,
                std::max<int64_t>(1, bucket / (4 * kBuffers * kElementBytes)));

      // Every (piece, new holder) receives the piece's elements exactly once over all bands.
      std::map<std::pair<int, int>, int64_t> received;
      std::map<int, int64_t> old_parts, new_parts;
      int64_t moved = 0;
      for (const auto& band : staged.bands) {
        for (const auto& m : band.moves) {
          const model::TensorSpec& spec = full.tensor(m.part.tensor);
          const int64_t rows = m.row_begin < 0 ? 1 : m.row_end - m.row_begin;
          if (m.row_begin >= 0) {
            EXPECT_EQ(spec.shard_axis, model::ShardAxis::kColumns);
          }
          EXPECT_EQ(m.elements, rows * layout::piece_elements(full, m.part) /
                                    (m.row_begin < 0 ? 1 : spec.full_shape[0]));
          EXPECT_LE(m.elements,
                    std::max(staged.chunk_elements,
                             spec.full_shape.size() > 1 ? spec.full_shape[1] : int64_t{1}));
          // Which refined piece it came from: the one of that tensor containing the part.
          for (size_t p = 0; p < plan.pieces.size(); ++p) {
            const auto& piece = plan.pieces[p].piece;
            if (piece.tensor == m.part.tensor && piece.begin <= m.part.begin &&
                m.part.end <= piece.end) {
              received[{int(p), m.destination}] += m.elements;
            }
          }
          if (m.source != m.destination) moved += m.elements;
        }
        for (const auto& p : band.old_parts) old_parts[p.rank] += p.count;
        for (const auto& p : band.new_parts) new_parts[p.rank] += p.count;
      }
      EXPECT_EQ(moved, plan.elements_moved());
      for (size_t p = 0; p < plan.pieces.size(); ++p) {
        for (const auto& h : plan.pieces[p].holders[1]) {
          EXPECT_EQ((received[{int(p), h.rank}]), plan.pieces[p].elements);
        }
      }
      // The band parts cover each rank's tensors (not the alignment gaps between them).
      const auto old_locals = layout::local_layouts(model, a);
      const auto new_locals = layout::local_layouts(model, b);
      for (int r = 0; r < 4; ++r) {
        int64_t old_size = 0, new_size = 0;
        if (old_locals[size_t(r)]) {
          for (const auto& t : old_locals[size_t(r)]->tensors()) old_size += t.size;
        }
        if (new_locals[size_t(r)]) {
          for (const auto& t : new_locals[size_t(r)]->tensors()) new_size += t.size;
        }
        EXPECT_EQ(old_parts[r], old_size) << "rank " << r;
        EXPECT_EQ(new_parts[r], new_size) << "rank " << r;
        EXPECT_LE(staged.predicted_extra_bytes[size_t(r)], bucket) << "rank " << r;
      }
    }
  }
  // With a small bucket the stage trade interleaves: bands do not run in tensor order.
  const auto a = layout::plan_layout(parse(kForward), model);
  const auto b = layout::plan_layout(parse(kSwapped), model);
  const auto staged = layout::stage_redistribution(model, layout::plan_redistribution(model, a, b),
                                                   a, b, 1 << 10, kBuffers, kElementBytes);
  bool reordered = false;
  for (size_t i = 1; i < staged.bands.size(); ++i) {
    reordered = reordered || staged.bands[i].tensor < staged.bands[i - 1].tensor;
  }
  EXPECT_TRUE(reordered);
}

// With the distributed optimizer a migration moves Adam's moments as a layout of their own: from
// each rank's optimizer shard (blocks of rows of its holder sets' chunks) to the new plan's
// shards, or whole where a plan of one pipeline keeps them whole, in the same bands as the
// parameters. Every block of either kind on the new side receives each of its elements exactly
// once, from a rank whose old block of that kind holds it; the band parts cover every block; and
// the order keeps each rank's predicted extra memory under the bucket.
TEST(Layout, StagedRedistributionMovesOptimizerShardsWithinTheBucket) {
  const auto model = layout_model();
  // Two pipelines: tp2 with uneven shares next to two stages.
  const char* kPlanC = R"({"world_size": 4, "pipelines": [
    {"micro_batches": 1, "stages": [{"layers": [0, 3], "ranks": [2, 1], "heads": [2, 2],
                                     "ffn": [1, 5], "vocab": [7, 4]}]},
    {"micro_batches": 1, "stages": [{"layers": [0, 1], "ranks": [3]},
                                    {"layers": [1, 3], "ranks": [0]}]}]})";
  const std::vector<std::pair<const char*, const char*>> pairs = {
      {kPlanA, kPlanC}, {kPlanC, kPlanA}, {kPlanA, kPlanB}, {kPlanB, kPlanC}};
  for (const int64_t bucket : {int64_t{1} << 10, int64_t{64} << 20}) {
    for (const auto& [from_text, to_text] : pairs) {
      const plan::Plan from_plan = parse(from_text), to_plan = parse(to_text);
      const auto a = layout::plan_layout(from_plan, model);
      const auto b = layout::plan_layout(to_plan, model);
      std::optional<layout::GradSyncPlan> sync_a, sync_b;
      if (layout::splits_moments(from_plan, true)) sync_a = layout::plan_grad_sync(model, a);
      if (layout::splits_moments(to_plan, true)) sync_b = layout::plan_grad_sync(model, b);
      const auto kinds = layout::migrated_state(model, a, sync_a ? &*sync_a : nullptr, b,
                                                sync_b ? &*sync_b : nullptr);
      const auto staged = layout::stage_redistribution(
          model, layout::plan_redistribution(model, a, b), kinds, bucket);
      SCOPED_TRACE(std::string(from_text) + " -> " + to_text + ", bucket " +
                   std::to_string(bucket));
      auto size_of = [](const layout::Block& block) {
        const auto& spec = block.spec;
        const int64_t row = spec.shard_axis == model::ShardAxis::kColumns
                                ? spec.shape[1]
                                : (spec.shape.size() > 1 ? spec.shape[1] : 1);
        return (block.row_end - block.row_begin) * row;
      };
      auto holds = [](const layout::Block& block, const layout::BandMove& m) {
        const int64_t first = m.row_begin < 0 ? m.part.begin : m.row_begin;
        const int64_t last = m.row_begin < 0 ? m.part.end : m.row_end;
        return block.tensor == m.part.tensor && block.axis_begin() <= m.part.begin &&
               m.part.end <= block.axis_end() && block.row_begin <= first && last <= block.row_end;
      };
      // (kind, rank, block) → elements received, and band parts per (kind, rank).
      std::map<std::tuple<int, int, int>, int64_t> received;
      std::map<std::pair<int, int>, int64_t> old_parts, new_parts;
      int moved_moments = 0;
      for (const auto& band : staged.bands) {
        for (const auto& m : band.moves) {
          const auto& kind = kinds[size_t(m.kind)];
          EXPECT_TRUE(holds(kind.from[size_t(m.source)][size_t(m.source_block)], m));
          EXPECT_TRUE(holds(kind.to[size_t(m.destination)][size_t(m.destination_block)], m));
          received[{m.kind, m.destination, m.destination_block}] += m.elements;
          moved_moments += m.kind == 1 && m.source != m.destination;
        }
        for (const auto& p : band.old_parts) old_parts[{p.kind, p.rank}] += p.count;
        for (const auto& p : band.new_parts) new_parts[{p.kind, p.rank}] += p.count;
      }
      EXPECT_GT(moved_moments, 0);
      int64_t moment_elements = 0;
      for (int k = 0; k < 2; ++k) {
        for (int r = 0; r < 4; ++r) {
          int64_t old_size = 0, new_size = 0;
          for (const auto& block : kinds[size_t(k)].from[size_t(r)]) old_size += size_of(block);
          const auto& blocks = kinds[size_t(k)].to[size_t(r)];
          for (size_t i = 0; i < blocks.size(); ++i) {
            new_size += size_of(blocks[i]);
            EXPECT_EQ((received[{k, r, int(i)}]), size_of(blocks[i])) << "kind " << k;
          }
          EXPECT_EQ((old_parts[{k, r}]), old_size) << "kind " << k << " rank " << r;
          EXPECT_EQ((new_parts[{k, r}]), new_size) << "kind " << k << " rank " << r;
          if (k == 1) moment_elements += new_size;
        }
      }
      // Split moments: each element of the model once per holder set (one per pipeline) would be
      // every pipeline's; once over all ranks is what the shards hold. Whole: every holder's
      // copy.
      int64_t params = 0;
      for (int r = 0; r < 4; ++r) {
        for (const auto& block : kinds[0].to[size_t(r)]) params += size_of(block);
      }
      if (sync_b) {
        EXPECT_LT(moment_elements, params);
      } else {
        EXPECT_EQ(moment_elements, params);
      }
      for (int r = 0; r < 4; ++r) {
        EXPECT_LE(staged.predicted_extra_bytes[size_t(r)], bucket) << "rank " << r;
      }
    }
  }
}
