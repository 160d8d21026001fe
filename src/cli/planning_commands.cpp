// plan, simulate, profile, experiments, clusters: the planner, the cost model and the simulator
// on the command line, with machine-readable output (--json) for scripts.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>

#include "backend/backend.h"
#include "cli/commands.h"
#include "common/error.h"
#include "common/files.h"
#include "common/format.h"
#include "common/json.h"
#include "common/stats.h"
#include "model/config.h"
#include "model/transformer.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"
#include "plan/plan.h"
#include "plan/planner.h"
#include "replan/replan.h"
#include "sim/experiments.h"
#include "sim/scenario.h"
#include "sim/simulator.h"
#include "train/setup.h"

namespace malleus::cli {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// What plan and simulate share: the cluster, model, rates, batch and optional profile.
struct SetupArgs {
  std::string cluster, model, rates, link_rates, profile, base;
  int nodes = 0, global_batch = 64, micro_batch = 1, seq_len = 0;
  bool json = false, shifted_recompute = false, tp_subpipeline = false;

  void add_to(CLI::App& app, bool need_cluster) {
    auto* c = app.add_option("--cluster", cluster,
                             "Cluster preset (see `malleus clusters`) or JSON file");
    auto* m = app.add_option("--model", model, "Model preset or JSON file");
    if (need_cluster) c->required(), m->required();
    app.add_option("--nodes", nodes, "Override the cluster's node count")
        ->check(CLI::PositiveNumber);
    app.add_option("--rates", rates,
                   "Straggle rates: inline JSON '{\"3\": 2, \"17\": \"inf\"}' or a JSON file "
                   "(device → rate; missing = 1)");
    app.add_option("--link-rates", link_rates,
                   "How many times slower each node's inter-node link is: inline JSON '{\"1\": "
                   "10}' or a JSON file (node → rate ≥ 1; missing = 1)");
    app.add_option("--global-batch", global_batch, "Sequences per optimizer step")
        ->capture_default_str();
    app.add_option("--micro-batch", micro_batch, "Sequences per micro-batch")
        ->capture_default_str();
    app.add_option("--seq-len", seq_len, "Tokens per sequence (default: the model's maximum)");
    app.add_option("--profile", profile, "Measured per-layer times (from `malleus profile`)");
    app.add_option("--base", base,
                   "The baselines' uniform shape, e.g. dp2,tp8,pp4 (default: the best uniform "
                   "shape of a healthy cluster)");
    app.add_flag("--json", json, "Print one JSON object instead of text");
    app.add_flag("--shifted-recompute,!--no-shifted-recompute", shifted_recompute,
                 "The runtime recomputes ahead of the gradient (the training option of that "
                 "name): memory and time with it");
    app.add_flag("--tp-subpipeline,!--no-tp-subpipeline", tp_subpipeline,
                 "Predict sub-pipelined tensor parallelism (the training option of that name)");
  }

  plan::CostModel cost_model() const {
    plan::ClusterSpec c = plan::load_cluster(cluster);
    if (nodes > 0) c.nodes = nodes;
    if (!link_rates.empty()) {
      c.link_rates = plan::parse_rates(link_rates, c.nodes);
      c.validate("--link-rates");
    }
    const model::ModelConfig m = model::load_model_config(model);
    plan::BatchConfig batch{global_batch, micro_batch, seq_len > 0 ? seq_len : m.max_seq_len};
    batch.validate("command line");
    std::optional<plan::Profile> p;
    if (!profile.empty()) p = plan::Profile::from_json(read_json_file(profile), profile);
    plan::CostModel cost(m, c, batch, p);
    cost.set_shifted_recompute(shifted_recompute);
    cost.set_tp_subpipeline(tp_subpipeline);
    return cost;
  }
  plan::Shape shape() const { return base.empty() ? plan::Shape{} : plan::Shape::parse(base); }
};

double max_memory(const plan::Prediction& p) {
  double m = 0;
  for (double b : p.memory_bytes) m = std::max(m, b);
  return m;
}

void run_plan(const SetupArgs& args, const std::string& strategy_name, const std::string& current,
              const std::string& out) {
  const plan::CostModel cost = args.cost_model();
  const int N = cost.cluster().num_devices();
  plan::PlanRequest req;
  req.rates = plan::parse_rates(args.rates, N);
  req.base = args.shape();
  if (!current.empty()) {
    req.current = plan::Plan::from_json(read_json_file(current), cost.model(), current);
    plan::validate(*req.current, cost.model(), current);
  }
  plan::PlannerOptions options = replan::with_migration_tie_break({}, cost);
  options.refine = sim::simulator_evaluator(cost);
  const auto strategy = plan::make_strategy(strategy_name, options);
  const plan::PlanResult r = strategy->plan(cost, req);
  const sim::SimResult simulated = sim::simulate(cost, r.plan, req.rates);
  write_file_atomic(out, r.plan.to_json().dump(2) + "\n");
  const double gb = cost.batch().global_batch;
  if (args.json) {
    const Json j = {{"strategy", r.strategy},
                    {"plan_file", out},
                    {"summary", r.plan.summary()},
                    {"predicted_iteration_s", r.prediction.iteration_time},
                    {"simulated_iteration_s", simulated.iteration_time},
                    {"samples_per_s", gb / simulated.iteration_time},
                    {"grad_sync_s", r.prediction.grad_sync_time},
                    {"optimizer_s", r.prediction.optimizer_time},
                    {"planning_s", r.planning_seconds},
                    {"max_memory_gib", max_memory(r.prediction) / kGiB},
                    {"fits", r.prediction.fits},
                    {"restart", r.restart},
                    {"note", r.note},
                    {"plan", r.plan.to_json()}};
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("strategy %s: %s\n", r.strategy.c_str(), r.plan.summary().c_str());
  std::printf("predicted iteration %.4f s (cost model), %.4f s (simulated): %.3f samples/s\n",
              r.prediction.iteration_time, simulated.iteration_time, gb / simulated.iteration_time);
  std::printf("  pipelines %.4f s, gradient sync %.4f s, optimizer %.4f s; peak memory %s%s\n",
              r.prediction.pipeline_time, r.prediction.grad_sync_time, r.prediction.optimizer_time,
              format_bytes(max_memory(r.prediction)).c_str(),
              r.prediction.fits ? "" : " (does NOT fit)");
  std::printf("  planned in %.3f s%s%s\n", r.planning_seconds, r.note.empty() ? "" : "; ",
              r.note.c_str());
  std::printf("wrote %s\n", out.c_str());
}

void run_simulate_plan(const SetupArgs& args, const std::string& plan_file) {
  const plan::CostModel cost = args.cost_model();
  const int N = cost.cluster().num_devices();
  const plan::Rates rates = plan::parse_rates(args.rates, N);
  const plan::Plan p = plan::Plan::from_json(read_json_file(plan_file), cost.model(), plan_file);
  plan::validate(p, cost.model(), plan_file);
  check(p.world_size <= N, plan_file + ": the plan is for " + std::to_string(p.world_size) +
                               " devices, the cluster has " + std::to_string(N));
  check(p.global_batch() == cost.batch().global_batch,
        plan_file + ": the plan's global batch is " + std::to_string(p.global_batch()) +
            ", --global-batch is " + std::to_string(cost.batch().global_batch));
  // The plan as written, recomputation included: what `malleus train --plan` would run.
  const sim::SimResult r = sim::simulate(cost, p, rates, /*choose_recompute=*/false);
  const plan::Prediction pred = cost.predict(p, rates, /*choose_recompute=*/false);
  const double gb = cost.batch().global_batch;
  if (args.json) {
    Json devices = Json::array();
    for (size_t d = 0; d < r.devices.size(); ++d) {
      const auto& dev = r.devices[d];
      devices.push_back(
          {{"device", d},
           {"used", dev.used},
           {"busy_s", dev.busy_s},
           {"idle_s", dev.idle_s},
           {"utilisation", dev.used && r.iteration_time > 0 && std::isfinite(r.iteration_time)
                               ? dev.busy_s / r.iteration_time
                               : 0.0},
           {"memory_gib", dev.memory_bytes / kGiB},
           {"peak_in_flight", dev.peak_in_flight}});
    }
    const Json j = {{"simulated_iteration_s", r.iteration_time},
                    {"predicted_iteration_s", pred.iteration_time},
                    {"samples_per_s", std::isfinite(r.iteration_time) ? gb / r.iteration_time : 0},
                    {"pipeline_s", r.pipeline_times},
                    {"grad_sync_s", r.grad_sync_time},
                    {"optimizer_s", r.optimizer_time},
                    {"mean_utilisation", r.mean_utilisation()},
                    {"fits", r.fits},
                    {"problem", r.problem},
                    {"devices", devices}};
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("plan %s: %s\n", plan_file.c_str(), p.summary().c_str());
  std::printf(
      "simulated iteration %.4f s (cost model %.4f s): %.3f samples/s, mean utilisation "
      "%.1f%%\n",
      r.iteration_time, pred.iteration_time,
      std::isfinite(r.iteration_time) ? gb / r.iteration_time : 0.0, 100 * r.mean_utilisation());
  if (!r.problem.empty()) std::printf("  problem: %s\n", r.problem.c_str());
  std::printf("%7s %5s %6s %10s %10s %7s %10s\n", "device", "node", "rate", "busy s", "idle s",
              "util", "memory");
  for (size_t d = 0; d < r.devices.size(); ++d) {
    const auto& dev = r.devices[d];
    const double rate = d < rates.size() ? rates[d] : 1.0;
    if (!dev.used) {
      std::printf("%7zu %5d %6.2f %10s %10s %7s %10s\n", d, cost.cluster().node_of(int(d)), rate,
                  "idle", "-", "-", "-");
      continue;
    }
    std::printf("%7zu %5d %6.2f %10.4f %10.4f %6.1f%% %10s\n", d, cost.cluster().node_of(int(d)),
                rate, dev.busy_s, dev.idle_s, 100 * dev.busy_s / r.iteration_time,
                format_bytes(dev.memory_bytes).c_str());
  }
}

void run_scenario_command(const std::string& file, const std::string& svg, bool json) {
  const sim::Scenario sc = sim::load_scenario(file);
  const sim::ScenarioResult r = sim::run_scenario(sc);
  const std::string svg_path = svg.empty() ? sc.name + ".svg" : svg;
  write_file_atomic(svg_path, sim::render_svg(r));
  if (json) {
    Json j = sim::result_to_json(r);
    j["svg"] = svg_path;
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("%s", sim::render_table(r).c_str());
    std::printf("wrote %s\n", svg_path.c_str());
  }
}

// ---- experiments ---------------------------------------------------------------------------

// The report is sim's (sim/experiments.h); here only where it goes.
void write_experiments(const sim::ExperimentsRequest& request) {
  const sim::ExperimentsReport report = sim::run_experiments(request);
  write_file_atomic(request.out, report.markdown);
  std::printf("%s", report.console.c_str());
  std::printf("wrote %s\n", request.out.c_str());
}

// ---- profile -------------------------------------------------------------------------------

// Times forward and backward of the model with one and with two layers; the difference is one
// layer, the rest is embedding + head + loss.
void run_profile(const std::string& model_name, int micro_batch, int seq_len, int threads,
                 int repeats, const std::string& out, const device::BackendChoice& choice) {
  const device::Device device = device::open_device(choice, device::local_rank());
  model::ModelConfig base = model::load_model_config(model_name);
  if (seq_len <= 0) seq_len = base.max_seq_len;
  check(seq_len <= base.max_seq_len, "--seq-len " + std::to_string(seq_len) +
                                         " exceeds the model's " +
                                         std::to_string(base.max_seq_len));
  // --threads 0 (the default) is every core of the machine, as its help says; more threads
  // than CPUs are refused naming the value, as `train` refuses them.
  check(threads >= 0, "--threads must not be negative (got " + std::to_string(threads) + ")");
  auto backend = device.make_backend(train::resolve_threads(threads, 1));
  // The backend's own timer: the host's clock on the CPU, the device's events on a GPU.
  backend::RegionTimer& timer = backend->region_timer();
  const size_t tokens = static_cast<size_t>(micro_batch) * static_cast<size_t>(seq_len);
  std::mt19937 rng(1);
  std::uniform_int_distribution<int32_t> token(0, base.vocab_size - 1);
  std::vector<int32_t> inputs(tokens), targets(tokens);
  for (auto& t : inputs) t = token(rng);
  for (auto& t : targets) t = token(rng);
  double fwd[2], bwd[2];
  for (int layers = 1; layers <= 2; ++layers) {
    model::ModelConfig c = base;
    c.num_layers = layers;
    model::Transformer<float> m(c, *backend, micro_batch, seq_len);
    m.init_parameters(1);
    m.zero_grads();
    m.forward(inputs.data(), targets.data());  // warm-up
    m.backward(1.0f / static_cast<float>(tokens));
    std::vector<double> f, b;
    for (int i = 0; i < repeats; ++i) {
      timer.begin();
      m.forward(inputs.data(), targets.data());
      f.push_back(timer.elapsed());
      timer.begin();
      m.backward(1.0f / static_cast<float>(tokens));
      b.push_back(timer.elapsed());
    }
    fwd[layers - 1] = median(f);
    bwd[layers - 1] = median(b);
  }
  plan::Profile p;
  p.device = device.kind == device::BackendKind::kCpu
                 ? "cpu (" + std::to_string(backend->num_threads()) + " threads)"
                 : device.description;
  p.model = base.name;
  p.threads = backend->num_threads();
  p.micro_batch = micro_batch;
  p.seq_len = seq_len;
  // Noise can make the 2-layer run look barely slower; keep every time positive.
  p.layer_forward_s = std::max(fwd[1] - fwd[0], 1e-3 * fwd[1]);
  p.layer_backward_s = std::max(bwd[1] - bwd[0], 1e-3 * bwd[1]);
  p.head_forward_s = std::max(fwd[0] - p.layer_forward_s, 1e-3 * fwd[0]);
  p.head_backward_s = std::max(bwd[0] - p.layer_backward_s, 1e-3 * bwd[0]);
  plan::ClusterSpec any;  // FLOP counts do not depend on the cluster
  any.peak_flops = 1;
  const plan::CostModel cost(base, any, plan::BatchConfig{micro_batch, micro_batch, seq_len});
  p.layer_forward_flops_per_s = cost.layer_forward_flops() / p.layer_forward_s;
  p.layer_backward_flops_per_s = 2 * cost.layer_forward_flops() / p.layer_backward_s;
  p.head_flops_per_s = 3 * cost.head_forward_flops() / (p.head_forward_s + p.head_backward_s);
  write_file_atomic(out, p.to_json().dump(2) + "\n");
  std::printf("profile of %s (micro-batch %d, seq %d, %d threads), median of %d:\n",
              base.name.c_str(), micro_batch, seq_len, p.threads, repeats);
  std::printf("  layer forward %.3f ms (%.2f GFLOP/s), backward %.3f ms (%.2f GFLOP/s)\n",
              1e3 * p.layer_forward_s, p.layer_forward_flops_per_s / 1e9, 1e3 * p.layer_backward_s,
              p.layer_backward_flops_per_s / 1e9);
  std::printf("  embedding + head + loss forward %.3f ms, backward %.3f ms (%.2f GFLOP/s)\n",
              1e3 * p.head_forward_s, 1e3 * p.head_backward_s, p.head_flops_per_s / 1e9);
  std::printf("wrote %s\n", out.c_str());
}

// plan: the fastest plan for a cluster, written as JSON.
void add_plan_command(CLI::App& app) {
  struct PlanArgs {
    SetupArgs setup;
    std::string strategy = "malleus", current, out = "plan.json";
  };
  auto plan_args = std::make_shared<PlanArgs>();
  auto* plan_cmd = app.add_subcommand(
      "plan", "Choose the fastest plan for a cluster whose devices straggle; write it as JSON");
  plan_args->setup.add_to(*plan_cmd, true);
  plan_cmd
      ->add_option("--strategy", plan_args->strategy,
                   "malleus | uniform | drop-slow | uneven-microbatches | uneven-layers")
      ->capture_default_str();
  plan_cmd->add_option("--current", plan_args->current,
                       "The running plan; ties are broken toward it (less migration)");
  plan_cmd->add_option("--out", plan_args->out, "Plan file to write")->capture_default_str();
  plan_cmd->callback([plan_args] {
    run_plan(plan_args->setup, plan_args->strategy, plan_args->current, plan_args->out);
  });
}

// simulate: one iteration of a plan, or a scenario against every strategy.
void add_simulate_command(CLI::App& app) {
  struct SimArgs {
    SetupArgs setup;
    std::string plan, scenario, svg;
  };
  auto sim_args = std::make_shared<SimArgs>();
  auto* sim_cmd = app.add_subcommand(
      "simulate",
      "Simulate one iteration of a plan (--plan), or a straggler trace against every strategy "
      "(--scenario)");
  sim_args->setup.add_to(*sim_cmd, false);
  sim_cmd->add_option("--plan", sim_args->plan, "Plan file (with --cluster, --model)");
  sim_cmd->add_option("--scenario", sim_args->scenario, "Scenario file (configs/scenarios)");
  sim_cmd->add_option("--svg", sim_args->svg, "Chart of a scenario (default: <name>.svg)");
  sim_cmd->callback([sim_args] {
    const auto& a = *sim_args;
    check(a.plan.empty() != a.scenario.empty(), "simulate: give --plan or --scenario (one)");
    if (!a.scenario.empty()) {
      run_scenario_command(a.scenario, a.svg, a.setup.json);
      return;
    }
    check(!a.setup.cluster.empty() && !a.setup.model.empty(),
          "simulate --plan needs --cluster and --model");
    run_simulate_plan(a.setup, a.plan);
  });
}

// experiments: scenarios against every strategy, as a markdown table.
void add_experiments_command(CLI::App& app) {
  auto exp_args = std::make_shared<sim::ExperimentsRequest>();
  exp_args->out = "bench/results/experiments.md";
  exp_args->svg_dir = "bench/results/figures";
  auto* exp_cmd = app.add_subcommand(
      "experiments", "Run scenarios against every strategy and write the markdown table");
  exp_cmd->add_option("--scenarios", exp_args->files, "Scenario files")->required();
  exp_cmd->add_option("--scale-scenarios", exp_args->scale_files,
                      "Scenarios at thousands of devices: their own section (strategies and "
                      "planning times)");
  exp_cmd->add_option("--out", exp_args->out, "Markdown file")->capture_default_str();
  exp_cmd->add_option("--svg-dir", exp_args->svg_dir, "Charts (\"\": none)")->capture_default_str();
  exp_cmd->add_option("--jobs", exp_args->jobs, "Scenarios simulated at once")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  exp_cmd->callback([exp_args] { write_experiments(*exp_args); });
}

// profile: this machine's per-layer times for the cost model.
void add_profile_command(CLI::App& app) {
  struct ProfileArgs {
    std::string model = "demo", out = "profile.json";
    int micro_batch = 1, seq_len = 0, threads = 0, repeats = 5;
    BackendArgs backend;
  };
  auto prof = std::make_shared<ProfileArgs>();
  auto* prof_cmd = app.add_subcommand(
      "profile", "Measure this machine's per-layer forward/backward times for the cost model");
  prof_cmd->add_option("--model", prof->model, "Model preset or JSON file")->capture_default_str();
  prof_cmd->add_option("--micro-batch", prof->micro_batch, "Sequences per micro-batch")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  prof_cmd->add_option("--seq-len", prof->seq_len, "Tokens per sequence (default: the model's)");
  prof_cmd->add_option("--threads", prof->threads, "Compute threads (0: all cores)");
  prof_cmd->add_option("--repeats", prof->repeats, "Timed runs (median)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  prof_cmd->add_option("--out", prof->out, "Profile file to write")->capture_default_str();
  add_backend_options(*prof_cmd, prof->backend);
  prof_cmd->callback([prof] {
    run_profile(prof->model, prof->micro_batch, prof->seq_len, prof->threads, prof->repeats,
                prof->out, prof->backend.choice());
  });
}

// clusters: the built-in presets, one line each.
void add_clusters_command(CLI::App& app) {
  app.add_subcommand("clusters", "List the built-in cluster presets")->callback([] {
    // The name column as wide as the longest name, and three significant digits, so that the
    // CPU presets' 0.045 TFLOPS does not read as 0.0.
    const std::vector<std::string> names = plan::cluster_preset_names();
    int width = 6;
    for (const auto& name : names) width = std::max(width, static_cast<int>(name.size()));
    std::printf("%-*s %6s %8s %10s %8s %11s %11s\n", width, "preset", "nodes", "per node", "memory",
                "TFLOPS", "intra GB/s", "inter GB/s");
    for (const auto& name : names) {
      const plan::ClusterSpec c = plan::load_cluster(name);
      std::printf("%-*s %6d %8d %10s %8.3g %11.3g %11.3g\n", width, name.c_str(), c.nodes,
                  c.devices_per_node, format_bytes(c.memory_bytes).c_str(), c.flops() / 1e12,
                  c.intra_node_bandwidth / 1e9, c.inter_node_bandwidth / 1e9);
    }
  });
}

}  // namespace

void add_planning_commands(CLI::App& app) {
  add_plan_command(app);
  add_simulate_command(app);
  add_experiments_command(app);
  add_profile_command(app);
  add_clusters_command(app);
}

}  // namespace malleus::cli
