// The schema of metrics.jsonl: one field list per record kind, each (key, member, required). The
// writer and the reader of metrics.cpp walk these lists, and so does whatever else shows a record
// by its keys (the Python binding's Decision), so a key is spelled here and nowhere else.
#pragma once

#include <tuple>

#include "metrics/metrics.h"

namespace malleus::metrics {

template <typename Record, typename T>
struct Field {
  constexpr Field(const char* k, T Record::*m, bool r = false) : key(k), member(m), required(r) {}
  const char* key;
  T Record::*member;
  bool required;
};

constexpr auto fields(const StepRecord*) {
  using R = StepRecord;
  return std::tuple{
      Field<R, int64_t>{"step", &R::step, true},
      Field<R, double>{"loss", &R::loss},
      Field<R, double>{"lr", &R::lr},
      Field<R, double>{"grad_norm", &R::grad_norm},
      Field<R, double>{"tokens_per_s", &R::tokens_per_s},
      Field<R, double>{"step_time_s", &R::step_time_s},
      Field<R, double>{"eta_s", &R::eta_s},
      Field<R, int64_t>{"consumed_samples", &R::consumed_samples},
      Field<R, std::string>{"plan", &R::plan},
      Field<R, std::vector<double>>{"rates", &R::rates},
      Field<R, std::vector<double>>{"injected", &R::injected},
      Field<R, std::vector<double>>{"compute_s", &R::compute_s},
      Field<R, std::vector<double>>{"link_rates", &R::link_rates},
      Field<R, std::vector<double>>{"link_s", &R::link_s},
      Field<R, double>{"monitor_overhead_s", &R::monitor_overhead_s},
      Field<R, std::vector<double>>{"peak_memory_bytes", &R::peak_memory_bytes},
      Field<R, std::vector<double>>{"peak_parameters_bytes", &R::peak_parameters_bytes},
      Field<R, std::vector<double>>{"peak_gradients_bytes", &R::peak_gradients_bytes},
      Field<R, std::vector<double>>{"peak_optimizer_bytes", &R::peak_optimizer_bytes},
      Field<R, std::vector<double>>{"peak_activations_bytes", &R::peak_activations_bytes},
      Field<R, std::vector<double>>{"peak_workspace_bytes", &R::peak_workspace_bytes},
      Field<R, std::vector<double>>{"peak_communication_bytes", &R::peak_communication_bytes},
      Field<R, std::vector<double>>{"recompute_ahead_s", &R::recompute_ahead_s},
      Field<R, std::vector<double>>{"recompute_overlapped_s", &R::recompute_overlapped_s}};
}

constexpr auto fields(const EvalRecord*) {
  using R = EvalRecord;
  return std::tuple{Field<R, int64_t>{"step", &R::step, true},
                    Field<R, double>{"val_loss", &R::val_loss, true}};
}

constexpr auto fields(const ReplanRecord*) {
  using R = ReplanRecord;
  return std::tuple{
      Field<R, int64_t>{"step", &R::step, true},
      Field<R, std::vector<double>>{"rates", &R::rates},
      Field<R, std::vector<double>>{"link_rates", &R::link_rates},
      Field<R, std::string>{"old_plan", &R::old_plan},
      Field<R, std::string>{"new_plan", &R::new_plan},
      Field<R, std::string>{"reason", &R::reason},
      Field<R, std::string>{"search", &R::search},
      Field<R, bool>{"held", &R::held},
      Field<R, double>{"predicted_old_s", &R::predicted_old_s},
      Field<R, double>{"predicted_new_s", &R::predicted_new_s},
      Field<R, double>{"predicted_gain_s", &R::predicted_gain_s},
      Field<R, double>{"predicted_migration_s", &R::predicted_migration_s},
      Field<R, int64_t>{"horizon_steps", &R::horizon_steps},
      Field<R, double>{"planning_s", &R::planning_s},
      Field<R, int64_t>{"bytes_moved", &R::bytes_moved},
      Field<R, double>{"migration_s", &R::migration_s},
      Field<R, int64_t>{"migration_peak_extra_bytes", &R::migration_peak_extra_bytes},
      Field<R, int64_t>{"migration_bucket_bytes", &R::migration_bucket_bytes},
      Field<R, int64_t>{"migration_background_bytes", &R::migration_background_bytes}};
}

constexpr auto fields(const RestartRecord*) {
  using R = RestartRecord;
  return std::tuple{Field<R, int64_t>{"step", &R::step, true},
                    Field<R, int64_t>{"restart", &R::restart, true},
                    Field<R, int64_t>{"failed_at_step", &R::failed_at_step},
                    Field<R, int64_t>{"steps_lost", &R::steps_lost},
                    Field<R, std::string>{"reason", &R::reason},
                    Field<R, std::string>{"detail", &R::detail},
                    Field<R, std::vector<int64_t>>{"lost_ranks", &R::lost_ranks},
                    Field<R, int64_t>{"ranks_before", &R::ranks_before},
                    Field<R, int64_t>{"ranks_after", &R::ranks_after},
                    Field<R, double>{"failed_at", &R::failed_at},
                    Field<R, std::vector<std::string>>{"cut_off_hosts", &R::cut_off_hosts},
                    Field<R, std::string>{"ended_by", &R::ended_by},
                    Field<R, std::vector<int64_t>>{"unended_ranks", &R::unended_ranks},
                    Field<R, std::string>{"unended", &R::unended}};
}

}  // namespace malleus::metrics
