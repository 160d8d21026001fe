#include "runtime/step_exchange.h"

#include <cstdint>
#include <string>
#include <type_traits>

#include "common/error.h"

namespace malleus::runtime {

namespace {

// Visits every field in packing order with `field(double&)`, for packing and unpacking alike.
template <typename Exchange, typename Field>
void visit_fields(Exchange& exchange, Field&& field) {
  field(exchange.loss_sum);
  field(exchange.norm_squares);
  for (auto& rank : exchange.ranks) {
    field(rank.compute_seconds);
    field(rank.flops);
  }
  for (auto& rank : exchange.ranks) {
    field(rank.link_seconds);
    field(rank.link_bytes);
  }
  for (auto& rank : exchange.ranks) {
    for (auto& bytes : rank.peak_memory.bytes) field(bytes);
    field(rank.peak_memory_total);
  }
  for (auto& rank : exchange.ranks) {
    field(rank.recompute_ahead_seconds);
    field(rank.recompute_overlapped_seconds);
  }
}

}  // namespace

std::vector<double> StepExchange::pack() const {
  std::vector<double> packed;
  packed.reserve(2 + ranks.size() * kRankFields);
  visit_fields(*this, [&](const auto& value) { packed.push_back(static_cast<double>(value)); });
  return packed;
}

void StepExchange::unpack(const std::vector<double>& packed) {
  check(packed.size() == 2 + ranks.size() * kRankFields,
        "a step's exchanged figures hold " + std::to_string(packed.size()) + " values, expected " +
            std::to_string(2 + ranks.size() * kRankFields));
  size_t at = 0;
  visit_fields(*this, [&](auto& value) {
    value = static_cast<std::remove_reference_t<decltype(value)>>(packed[at++]);
  });
}

}  // namespace malleus::runtime
