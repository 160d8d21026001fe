#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <thread>

#include "common/error.h"
#include "train/metrics.h"

namespace malleus::train {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

AdamWConfig adamw_config(const TrainConfig& c) {
  return {c.beta1, c.beta2, c.adam_eps, c.weight_decay};
}

}  // namespace

int resolve_threads(int configured) {
  if (configured > 0) return configured;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

Trainer::Trainer(const TrainConfig& config, const model::ModelConfig& model_config)
    : config_(config),
      backend_(backend::make_cpu_backend<float>(resolve_threads(config.threads))),
      model_(model_config, *backend_, config.micro_batch_size, config.seq_len),
      optimizer_(*backend_, model_.layout(), adamw_config(config)),
      schedule_{config.lr, config.min_lr_ratio, config.warmup_steps, config.steps},
      train_data_(config.train_data, model_config.vocab_size),
      sampler_(train_data_, config.seq_len, config.seed),
      inputs_(static_cast<size_t>(model_.tokens_per_micro_batch())),
      targets_(inputs_.size()) {
  config_.validate("training config");
  model_.init_parameters(config.seed);
}

void Trainer::restore(const Checkpoint& checkpoint) {
  check(checkpoint.model.to_json() == model_.config().to_json(),
        "checkpoint model " + checkpoint.model.to_json().dump() +
            " differs from the configured model " + model_.config().to_json().dump());
  const size_t total = static_cast<size_t>(model_.layout().total_size());
  check(checkpoint.params.size() == total && checkpoint.adam_m.size() == total &&
            checkpoint.adam_v.size() == total,
        "checkpoint buffers do not match the model layout (need optimizer state to resume)");
  backend_->copy_from_host(model_.params(), checkpoint.params.data(), total);
  backend_->copy_from_host(optimizer_.first_moment(), checkpoint.adam_m.data(), total);
  backend_->copy_from_host(optimizer_.second_moment(), checkpoint.adam_v.data(), total);
  step_ = checkpoint.step;
  consumed_samples_ = checkpoint.consumed_samples;
  optimizer_.set_steps_done(checkpoint.step);
}

Checkpoint Trainer::snapshot() {
  const size_t total = static_cast<size_t>(model_.layout().total_size());
  Checkpoint c;
  c.model = model_.config();
  c.train_config = config_.to_json();
  c.step = step_;
  c.consumed_samples = consumed_samples_;
  c.params.resize(total);
  c.adam_m.resize(total);
  c.adam_v.resize(total);
  backend_->copy_to_host(c.params.data(), model_.params(), total);
  backend_->copy_to_host(c.adam_m.data(), optimizer_.first_moment(), total);
  backend_->copy_to_host(c.adam_v.data(), optimizer_.second_moment(), total);
  return c;
}

StepStats Trainer::train_step() {
  const auto start = Clock::now();
  const int micro = config_.micro_batch_size, seq = config_.seq_len;
  // Every token of the global batch weighs 1/tokens, so the accumulated gradient is that of the
  // global-batch mean loss however the batch is cut into micro-batches.
  const float loss_scale = 1.0f / static_cast<float>(config_.tokens_per_step());
  model_.zero_grads();
  double loss_sum = 0;
  for (int m = 0; m < config_.grad_accum_steps(); ++m) {
    for (int b = 0; b < micro; ++b) {
      const int64_t index = consumed_samples_ + int64_t{m} * micro + b;
      sampler_.sample(index, inputs_.data() + int64_t{b} * seq, targets_.data() + int64_t{b} * seq);
    }
    loss_sum += model_.forward(inputs_.data(), targets_.data());
    model_.backward(loss_scale);
  }
  consumed_samples_ += config_.global_batch_size;

  const auto total = static_cast<size_t>(model_.layout().total_size());
  const double grad_norm = std::sqrt(backend_->sum_squares(model_.grads(), total));
  const double clip_scale = (config_.grad_clip > 0 && grad_norm > config_.grad_clip)
                                ? config_.grad_clip / grad_norm
                                : 1.0;
  const double lr = schedule_.at(step_);
  optimizer_.step(model_.params(), model_.grads(), static_cast<float>(lr),
                  static_cast<float>(clip_scale));
  ++step_;

  StepStats stats;
  stats.step = step_;
  stats.loss = loss_sum / static_cast<double>(config_.tokens_per_step());
  stats.lr = lr;
  stats.grad_norm = grad_norm;
  stats.step_time_s = seconds_since(start);
  stats.tokens_per_s = static_cast<double>(config_.tokens_per_step()) / stats.step_time_s;
  check(std::isfinite(stats.loss), "loss became " + std::to_string(stats.loss) + " at step " +
                                       std::to_string(step_) + ": training diverged");
  return stats;
}

double evaluate_loss(model::Transformer<float>& model, const data::TokenDataset& dataset,
                     int max_samples) {
  const int micro = model.micro_batch(), seq = model.seq_len();
  // A fixed seed: evaluation sees the same windows whatever the training seed.
  data::Sampler sampler(dataset, seq, /*seed=*/0);
  const int64_t count = std::min<int64_t>(max_samples, sampler.windows_per_epoch());
  std::vector<int32_t> inputs(static_cast<size_t>(micro) * seq), targets(inputs.size());
  double loss_sum = 0;
  for (int64_t first = 0; first < count; first += micro) {
    // A last partial micro-batch is filled up with samples that are then left out of the mean.
    for (int b = 0; b < micro; ++b) {
      sampler.sample((first + b) % count, inputs.data() + int64_t{b} * seq,
                     targets.data() + int64_t{b} * seq);
    }
    model.forward(inputs.data(), targets.data());
    const std::vector<float> losses = model.token_losses();
    const int64_t valid = std::min<int64_t>(micro, count - first);
    for (int64_t i = 0; i < valid * seq; ++i) loss_sum += losses[static_cast<size_t>(i)];
  }
  return loss_sum / static_cast<double>(count * seq);
}

double Trainer::evaluate(const std::string& pattern, int max_samples) {
  data::TokenDataset dataset(pattern, model_.config().vocab_size);
  return evaluate_loss(model_, dataset, max_samples);
}

void Trainer::save(const std::filesystem::path& root) {
  const auto start = Clock::now();
  const auto dir = checkpoint_dir(root, step_);
  std::filesystem::create_directories(root);
  save_checkpoint(dir, snapshot());
  mark_latest(root, dir);
  std::printf("saved checkpoint %s (%s)\n", dir.c_str(),
              format_duration(seconds_since(start)).c_str());
}

void Trainer::run() {
  const std::filesystem::path out(config_.out_dir);
  const auto checkpoints = out / "checkpoints";
  MetricsLog metrics(out / "metrics.jsonl");
  std::optional<data::TokenDataset> val_data;
  if (!config_.val_data.empty()) val_data.emplace(config_.val_data, model_.config().vocab_size);

  const auto& mc = model_.config();
  std::printf(
      "model %s: %s parameters (%d layers, hidden %d, %d heads / %d kv, ffn %d, vocab %d)\n"
      "data %s: %s tokens; global batch %d × %d tokens (%d micro-batches of %d); %d threads\n",
      mc.name.c_str(), format_count(static_cast<double>(mc.num_parameters())).c_str(),
      mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.ffn_hidden_size,
      mc.vocab_size, config_.train_data.c_str(),
      format_count(static_cast<double>(train_data_.num_tokens())).c_str(),
      config_.global_batch_size, config_.seq_len, config_.grad_accum_steps(),
      config_.micro_batch_size, backend_->num_threads());
  std::fflush(stdout);

  double recent_step_time = 0;  // exponential moving average, for the ETA
  while (step_ < config_.steps) {
    const StepStats s = train_step();
    recent_step_time =
        recent_step_time == 0 ? s.step_time_s : 0.9 * recent_step_time + 0.1 * s.step_time_s;
    const double eta = recent_step_time * static_cast<double>(config_.steps - step_);
    std::printf(
        "step %5lld/%lld | loss %.4f | lr %.2e | grad norm %.3f | %s tok/s | %.3f s | ETA %s\n",
        static_cast<long long>(s.step), static_cast<long long>(config_.steps), s.loss, s.lr,
        s.grad_norm, format_count(s.tokens_per_s).c_str(), s.step_time_s,
        format_duration(eta).c_str());
    std::fflush(stdout);
    metrics.write({{"step", s.step},
                   {"loss", s.loss},
                   {"lr", s.lr},
                   {"grad_norm", s.grad_norm},
                   {"tokens_per_s", s.tokens_per_s},
                   {"step_time_s", s.step_time_s},
                   {"eta_s", eta},
                   {"consumed_samples", consumed_samples_}});

    const bool last = step_ == config_.steps;
    if (val_data && ((config_.eval_every > 0 && step_ % config_.eval_every == 0) || last)) {
      const double val_loss = evaluate_loss(model_, *val_data, config_.eval_samples);
      std::printf("eval  %5lld | val loss %.4f (%.3f bits/token)\n", static_cast<long long>(step_),
                  val_loss, val_loss / std::log(2.0));
      metrics.write({{"step", step_}, {"val_loss", val_loss}});
    }
    if ((config_.checkpoint_every > 0 && step_ % config_.checkpoint_every == 0) || last) {
      save(checkpoints);
    }
  }
}

}  // namespace malleus::train
