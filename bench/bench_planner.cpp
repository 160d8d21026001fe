// Planning time of the malleus planner (with the simulator re-ranking its best candidates, as the
// CLI runs it) on 64- and 1024-device A800 clusters, under several straggler patterns. Prints the
// median, min and max over repeated runs. Targets (issue #4): < 1 s at 64, < 10 s at 1024.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "common/stats.h"
#include "model/config.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"
#include "plan/planner.h"
#include "sim/scenario.h"

using namespace malleus;

namespace {

struct Case {
  std::string name;
  plan::Rates rates;
};

std::vector<Case> cases(int devices) {
  std::vector<Case> out;
  out.push_back({"healthy", plan::Rates(static_cast<size_t>(devices), 1.0)});
  plan::Rates one(static_cast<size_t>(devices), 1.0);
  one[3] = 5.0;
  out.push_back({"one 5x", one});
  plan::Rates node(static_cast<size_t>(devices), 1.0);
  for (int d = 8; d < 16; ++d) node[static_cast<size_t>(d)] = 2.0;
  node[1] = std::numeric_limits<double>::infinity();
  out.push_back({"node 2x + one gone", node});
  // 5% of devices slow at random rates in [1.5, 10].
  std::mt19937 rng(42);
  plan::Rates mixed(static_cast<size_t>(devices), 1.0);
  std::uniform_int_distribution<int> pick(0, devices - 1);
  std::uniform_real_distribution<double> rate(1.5, 10.0);
  for (int i = 0; i < std::max(2, devices / 20); ++i) {
    mixed[static_cast<size_t>(pick(rng))] = rate(rng);
  }
  out.push_back({"5% mixed slow", mixed});
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 5;
  const model::ModelConfig model = model::load_model_config("llama-70b");
  std::printf("%-8s %-22s %10s %10s %10s %8s  %s\n", "devices", "rates", "median s", "min s",
              "max s", "target", "plan");
  for (auto [nodes, batch] : {std::pair{8, 64}, std::pair{128, 1024}}) {
    plan::ClusterSpec cluster = plan::load_cluster("a800-8x8");
    cluster.nodes = nodes;
    const plan::CostModel cost(model, cluster, plan::BatchConfig{batch, 1, 4096});
    plan::PlannerOptions options;
    options.refine = sim::simulator_evaluator(cost);
    const auto planner = plan::make_strategy("malleus", options);
    const double target = cluster.num_devices() <= 64 ? 1.0 : 10.0;
    for (const Case& c : cases(cluster.num_devices())) {
      std::vector<double> times;
      std::string summary;
      for (int i = 0; i < repeats; ++i) {
        const auto start = std::chrono::steady_clock::now();
        const plan::PlanResult r = planner->plan(cost, {c.rates, plan::Shape{}, std::nullopt});
        times.push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        summary = r.plan.summary();
      }
      if (summary.size() > 60) summary = summary.substr(0, 57) + "...";
      std::printf("%-8d %-22s %10.3f %10.3f %10.3f %7.0fs  %s\n", cluster.num_devices(),
                  c.name.c_str(), median(times), *std::min_element(times.begin(), times.end()),
                  *std::max_element(times.begin(), times.end()), target, summary.c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}
