#include "layout/grad_sync_plan.h"

#include <algorithm>
#include <map>

namespace malleus::layout {

GradSyncPlan plan_grad_sync(const model::ModelConfig& model, const Layout& layout) {
  GradSyncPlan plan;
  plan.pieces = common_refinement(model, {&layout});
  std::map<std::vector<int>, GradSyncGroup> groups;
  for (size_t p = 0; p < plan.pieces.size(); ++p) {
    const auto& holders = plan.pieces[p].holders[0];
    if (holders.size() < 2) continue;
    std::vector<int> ranks;
    for (const Holder& h : holders) ranks.push_back(h.rank);
    GradSyncGroup& group = groups[ranks];
    group.ranks = ranks;
    group.pieces.push_back(static_cast<int>(p));
    group.elements += plan.pieces[p].elements;
  }
  for (auto& [ranks, group] : groups) plan.groups.push_back(std::move(group));
  return plan;
}

bool contributes(const RefinedPiece& piece, int rank) {
  const auto& holders = piece.holders[0];
  const Holder* mine = find_holder(holders, rank);
  // Contribute unless a lower rank of the same replica group holds the piece too.
  return mine != nullptr && std::none_of(holders.begin(), holders.end(), [&](const Holder& other) {
           return other.rank < rank && other.replica_group == mine->replica_group;
         });
}

int norm_owner(const RefinedPiece& piece) {
  return piece.holders[0].front().rank;
}

}  // namespace malleus::layout
