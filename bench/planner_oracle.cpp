// Writes the planner's quality oracle: for a set of straggler situations (bench/
// planner_situations.h), the iteration time the planner predicts for the plan it chooses (the cost
// model's, default PlannerOptions) and that plan's summary. Planner.MatchesTheRecordedOracle
// (tests/test_planner.cpp) holds a later planner to these times. The file in tests/data was
// written by the planner of issue 25's start (commit 7c18043):
//   build/bench/planner_oracle tests/data/planner_oracle.json
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/planner_situations.h"
#include "common/files.h"
#include "common/json.h"
#include "model/config.h"
#include "plan/cost_model.h"
#include "plan/planner.h"

using namespace malleus;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: planner_oracle OUT.json\n");
    return 2;
  }
  struct Set {
    std::string model;
    int nodes;
    std::vector<std::string> patterns;  // empty: all
  };
  const std::vector<Set> sets = {
      {"llama-70b", 8, {}},
      {"llama-70b", 32, {}},
      {"llama-70b", 128, {}},
      {"llama-70b", 512, {"3 slow (2x, 3x, 5x)", "one gone"}},
      {"llama-32b", 8, {"3 slow (2x, 3x, 5x)", "node 2x + one gone"}},
      {"llama-110b", 8, {"3 slow (2x, 3x, 5x)", "node 2x + one gone"}},
  };
  Json situations = Json::array();
  for (const Set& set : sets) {
    plan::ClusterSpec cluster = plan::load_cluster("a800-8x8");
    cluster.nodes = set.nodes;
    const model::ModelConfig model = model::load_model_config(set.model);
    const plan::BatchConfig batch{16 * set.nodes, 1, 4096};
    const plan::CostModel cost(model, cluster, batch);
    for (const auto& pattern : bench::rate_patterns(cluster.num_devices())) {
      bool wanted = set.patterns.empty();
      for (const auto& p : set.patterns) wanted = wanted || p == pattern.name;
      if (!wanted) continue;
      const auto start = std::chrono::steady_clock::now();
      const plan::PlanResult r =
          plan::make_strategy("malleus")->plan(cost, {pattern.rates, plan::Shape{}, std::nullopt});
      const double took =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::fprintf(stderr, "%s %d devices %s: %.6f s predicted, planned in %.2f s\n",
                   set.model.c_str(), cluster.num_devices(), pattern.name.c_str(),
                   r.prediction.iteration_time, took);
      situations.push_back({{"model", set.model},
                            {"cluster", "a800-8x8"},
                            {"nodes", set.nodes},
                            {"global_batch", batch.global_batch},
                            {"micro_batch", batch.micro_batch},
                            {"seq_len", batch.seq_len},
                            {"pattern", pattern.name},
                            {"rates", plan::rates_to_json(pattern.rates)},
                            {"iteration_s", r.prediction.iteration_time},
                            {"summary", r.plan.summary()},
                            {"planning_s", took}});
    }
  }
  write_file_atomic(argv[1], Json{{"generated_by", "build/bench/planner_oracle OUT.json"},
                                  {"situations", situations}}
                                     .dump(1) +
                                 "\n");
  return 0;
}
