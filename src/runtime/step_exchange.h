// What one training step's single all-reduce carries: the loss and the squared gradient norm,
// summed over ranks, and every rank's own measurements for the monitors (compute time and FLOPs,
// link probe, peak memory, recomputation issued ahead), each rank filling only its own slots (the
// others zero) so the sum hands every rank everyone's figures and monitoring costs no extra
// round of communication.
#pragma once

#include <cstddef>
#include <vector>

#include "backend/memory.h"

namespace malleus::runtime {

struct StepExchange {
  // One rank's measurements (StepResult describes each).
  struct RankFigures {
    double compute_seconds = 0, flops = 0;
    double link_seconds = 0, link_bytes = 0;
    backend::MemoryFigures peak_memory;
    double peak_memory_total = 0;
    double recompute_ahead_seconds = 0, recompute_overlapped_seconds = 0;
  };

  explicit StepExchange(size_t rank_count) : ranks(rank_count) {}

  double loss_sum = 0;             // over the tokens of the global batch
  double norm_squares = 0;         // Σ g² over the elements a rank counts
  std::vector<RankFigures> ranks;  // by rank

  // The figures as one vector of doubles, and back (the same size: 2 + ranks × kRankFields).
  // Field by field over all ranks: loss sum, squared norm, then every rank's compute time and
  // FLOPs, every rank's link time and bytes, every rank's peak memory by kind and in total, every
  // rank's recomputation ahead and its part overlapped.
  std::vector<double> pack() const;
  void unpack(const std::vector<double>& packed);
  static constexpr size_t kRankFields = 2 + 2 + backend::kMemoryKinds + 1 + 2;
};

}  // namespace malleus::runtime
