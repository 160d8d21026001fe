#include "train/run_log.h"

#include <cstdio>

#include "common/files.h"
#include "common/format.h"
#include "common/json.h"

namespace malleus::train {

void record_step_figures(const runtime::StepResult& r, StepStats* out) {
  StepStats& stats = *out;
  for (size_t i = 0; i < r.measurements.size(); i += 2)
    stats.compute_s.push_back(r.measurements[i]);
  using backend::MemoryKind;
  stats.peak_memory_bytes = r.peak_memory_total;
  const std::pair<std::vector<double>*, MemoryKind> kinds[] = {
      {&stats.peak_parameters_bytes, MemoryKind::kParameters},
      {&stats.peak_gradients_bytes, MemoryKind::kGradients},
      {&stats.peak_optimizer_bytes, MemoryKind::kOptimizer},
      {&stats.peak_activations_bytes, MemoryKind::kActivations},
      {&stats.peak_workspace_bytes, MemoryKind::kWorkspace},
      {&stats.peak_communication_bytes, MemoryKind::kCommunication}};
  for (const auto& [field, kind] : kinds) {
    for (const auto& figures : r.peak_memory) field->push_back(double(figures[kind]));
  }
  for (size_t i = 0; i < r.recompute_ahead_measurements.size(); i += 2) {
    if (r.recompute_ahead_measurements[i] <= 0) continue;
    // Some rank recomputed ahead: every rank's figures.
    for (size_t k = 0; k < r.recompute_ahead_measurements.size(); k += 2) {
      stats.recompute_ahead_s.push_back(r.recompute_ahead_measurements[k]);
      stats.recompute_overlapped_s.push_back(r.recompute_ahead_measurements[k + 1]);
    }
    break;
  }
}

void announce(const std::filesystem::path& out, const model::ModelConfig& mc,
              const TrainConfig& config, const RunHeader& header) {
  const runtime::CoreSharing& cores = *header.cores;
  std::printf(
      "model %s: %s parameters (%d layers, hidden %d, %d heads / %d kv, ffn %d, vocab %d)\n"
      "data %s: %s tokens; global batch %d × %d tokens (micro-batches of %d)\n"
      "plan on %s × %s: %s\n"
      "cores: %s\n",
      mc.name.c_str(), format_count(static_cast<double>(mc.num_parameters())).c_str(),
      mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.ffn_hidden_size,
      mc.vocab_size, config.train_data.c_str(),
      format_count(static_cast<double>(header.train_tokens)).c_str(), config.global_batch_size,
      config.seq_len, config.micro_batch_size, format_counted(header.world_size, "rank").c_str(),
      format_counted(header.threads, "thread").c_str(), header.plan_text.c_str(),
      cores.summary.c_str());
  if (!header.devices.empty()) std::printf("%s\n", header.devices.c_str());
  std::fflush(stdout);
  Json ranks = Json::array();
  for (size_t r = 0; r < cores.pids.size(); ++r) {
    ranks.push_back({{"rank", r}, {"pid", cores.pids[r]}, {"cpus", cores.cpus[r]}});
  }
  write_file_atomic(out / "ranks.json", Json{{"ranks", ranks}}.dump(2) + "\n");
}

void log_step(StepStats s, double eta, const std::string& plan_text, int64_t steps, int restarts,
              metrics::MetricsLog& metrics) {
  s.eta_s = eta;
  s.plan = plan_text;
  std::string rates;
  for (double r : s.rates) {
    char text[16];
    std::snprintf(text, sizeof text, rates.empty() ? "%.1f" : " %.1f", r);
    rates += text;
  }
  const std::string restarts_text =
      restarts > 0 ? " | restarts " + std::to_string(restarts) : std::string();
  // Links between nodes, when measured: " | links 1.0 9.6" (one rate per node).
  std::string links;
  for (double r : s.link_rates) {
    char text[16];
    std::snprintf(text, sizeof text, links.empty() ? " | links %.1f" : " %.1f", r);
    links += text;
  }
  std::printf(
      "step %5lld/%lld | loss %.4f | lr %.2e | grad norm %.3f | %s tok/s | %.3f s | ETA %s | %s | "
      "rates %s%s%s\n",
      static_cast<long long>(s.step), static_cast<long long>(steps), s.loss, s.lr, s.grad_norm,
      format_count(s.tokens_per_s).c_str(), s.step_time_s, format_duration(eta).c_str(),
      plan_text.c_str(), rates.c_str(), links.c_str(), restarts_text.c_str());
  metrics.write(static_cast<const metrics::StepRecord&>(s));
  if (s.replan) {
    std::printf("%s\n", metrics::describe(*s.replan).c_str());
    metrics.write(*s.replan);
  }
  if (s.switch_background) {
    const runtime::BackgroundStats& b = *s.switch_background;
    std::printf(
        "switch finished in step %lld: %s of Adam moments moved in the background (%s between "
        "micro-batches, %s waiting before the update; memory %s above before/after)\n",
        static_cast<long long>(s.step), format_bytes(static_cast<double>(b.bytes_received)).c_str(),
        format_duration(b.poll_seconds).c_str(), format_duration(b.wait_seconds).c_str(),
        format_bytes(static_cast<double>(b.peak_extra_bytes)).c_str());
  }
  std::fflush(stdout);
}

}  // namespace malleus::train
