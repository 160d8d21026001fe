#include "model/recompute.h"

namespace malleus::model {

const char* recompute_mode_name(RecomputeMode mode) {
  switch (mode) {
    case RecomputeMode::kNone:
      return "none";
    case RecomputeMode::kSelective:
      return "selective";
    case RecomputeMode::kFull:
      return "full";
  }
  return "unknown";
}

std::optional<RecomputeMode> parse_recompute_mode(std::string_view name) {
  for (RecomputeMode mode :
       {RecomputeMode::kNone, RecomputeMode::kSelective, RecomputeMode::kFull}) {
    if (name == recompute_mode_name(mode)) return mode;
  }
  return std::nullopt;
}

}  // namespace malleus::model
