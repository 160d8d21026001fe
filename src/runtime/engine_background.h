// The state of an overlapped switch still under way (Engine::switch_to, engine_switch.cpp): for
// the engine's own source files only.
#pragma once

#include <memory>
#include <vector>

#include "layout/staged_redistribution.h"
#include "runtime/engine.h"

namespace malleus::runtime {

// The old engine, holding only its Adam moments, and the move of what it still has to send.
struct Engine::Background {
  std::unique_ptr<Engine> old;
  std::vector<layout::StateKind> kinds;  // what the old moments' and the new ones' blocks are
  std::unique_ptr<layout::BackgroundRedistribution<float>> move;
  int64_t total_before = 0, total_after = 0;  // this rank's ledger, before and after the switch
  BackgroundStats stats;
};

}  // namespace malleus::runtime
