#include "elastic/stragglers.h"

#include <algorithm>
#include <limits>
#include <map>

#include "common/error.h"
#include "common/json.h"

namespace malleus::elastic {

namespace {

int64_t parse_int(const std::string& text, const std::string& spec) {
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  check(used == text.size() && !text.empty(),
        "straggler \"" + spec + "\": \"" + text + "\" is not a whole number");
  return value;
}

}  // namespace

void StragglerSchedule::add(const std::string& spec) {
  const std::string usage = " (expected RANK:RATE:FROM-TO, e.g. 2:3:20-80)";
  const size_t a = spec.find(':'), b = spec.find(':', a == std::string::npos ? a : a + 1);
  check(a != std::string::npos && b != std::string::npos,
        "straggler \"" + spec + "\" is malformed" + usage);
  Window w{};
  const int64_t rank = parse_int(spec.substr(0, a), spec);
  check(rank >= 0 && rank <= std::numeric_limits<int>::max(),
        "straggler \"" + spec + "\": rank " + std::to_string(rank) + " is not a rank");
  w.rank = static_cast<int>(rank);
  try {
    w.rate = std::stod(spec.substr(a + 1, b - a - 1));
  } catch (const std::exception&) {
    throw Error("straggler \"" + spec + "\": the rate is not a number" + usage);
  }
  const std::string steps = spec.substr(b + 1);
  const size_t dash = steps.find('-');
  w.from = parse_int(steps.substr(0, dash), spec);
  w.to = dash == std::string::npos || dash + 1 == steps.size()
             ? std::numeric_limits<int64_t>::max()
             : parse_int(steps.substr(dash + 1), spec);
  check(w.rate >= 1 && w.rate <= kMaxRate, "straggler \"" + spec + "\": the rate must be in [1, " +
                                               std::to_string(static_cast<int>(kMaxRate)) +
                                               "] (1 = healthy)");
  check(w.from >= 1 && w.to >= w.from,
        "straggler \"" + spec + "\": the steps must be a range FROM-TO with 1 <= FROM <= TO");
  windows_.push_back(w);
}

void StragglerSchedule::add_trace(const std::string& path) {
  const Json trace = read_json_file(path);
  JsonReader r(trace, path);
  const Json events = r.required<Json>("events");
  r.finish();
  check(events.is_array(), path + ": \"events\" must be a list");
  // Each event holds until the next event that mentions the same rank.
  std::map<int, std::vector<std::pair<int64_t, double>>> changes;
  for (size_t i = 0; i < events.size(); ++i) {
    JsonReader e(events[i], path + ": event " + std::to_string(i));
    const auto step = e.required<int64_t>("step");
    const Json rates = e.required<Json>("rates");
    e.finish();
    check(step >= 1, e.source() + ": \"step\" must be at least 1");
    check(rates.is_object(), e.source() + ": \"rates\" must map ranks to rates");
    for (const auto& [rank_text, rate] : rates.items()) {
      check(rate.is_number() && rate.get<double>() >= 1 && rate.get<double>() <= kMaxRate,
            e.source() + ": rank " + rank_text + " has rate " + rate.dump() +
                ", which must be a number in [1, " + std::to_string(static_cast<int>(kMaxRate)) +
                "]");
      const int64_t rank = parse_int(rank_text, path);
      check(rank >= 0 && rank <= std::numeric_limits<int>::max(),
            e.source() + ": \"" + rank_text + "\" is not a rank");
      changes[static_cast<int>(rank)].emplace_back(step, rate.get<double>());
    }
  }
  for (auto& [rank, list] : changes) {
    std::sort(list.begin(), list.end());
    for (size_t i = 0; i < list.size(); ++i) {
      const int64_t end =
          i + 1 < list.size() ? list[i + 1].first - 1 : std::numeric_limits<int64_t>::max();
      if (end >= list[i].first) windows_.push_back({rank, list[i].second, list[i].first, end});
    }
  }
}

double StragglerSchedule::rate(int rank, int64_t step) const {
  double rate = 1;
  for (const Window& w : windows_) {
    if (w.rank == rank && step >= w.from && step <= w.to) rate = w.rate;
  }
  return rate;
}

int StragglerSchedule::highest_rank() const {
  int highest = -1;
  for (const Window& w : windows_) highest = std::max(highest, w.rank);
  return highest;
}

std::vector<double> StragglerSchedule::rates(int world_size, int64_t step) const {
  std::vector<double> r(static_cast<size_t>(world_size));
  for (int i = 0; i < world_size; ++i) r[static_cast<size_t>(i)] = rate(i, step);
  return r;
}

}  // namespace malleus::elastic
