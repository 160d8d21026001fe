#include "train/config.h"

namespace malleus::train {

void TrainConfig::validate(const std::string& source) const {
  auto require = [&](bool ok, const std::string& what) { check(ok, source + ": " + what); };
  require(!model.empty(), "\"model\" must name a preset or a file");
  require(!train_data.empty(), "\"train_data\" must name shard files");
  require(seq_len > 0, "\"seq_len\" must be positive (got " + std::to_string(seq_len) + ")");
  require(micro_batch_size > 0, "\"micro_batch_size\" must be positive");
  require(global_batch_size > 0 && global_batch_size % micro_batch_size == 0,
          "\"global_batch_size\" (" + std::to_string(global_batch_size) +
              ") must be a positive multiple of \"micro_batch_size\" (" +
              std::to_string(micro_batch_size) + ")");
  require(steps > 0, "\"steps\" must be positive");
  require(lr > 0, "\"lr\" must be positive");
  require(min_lr_ratio >= 0 && min_lr_ratio <= 1, "\"min_lr_ratio\" must be in [0, 1]");
  require(warmup_steps >= 0, "\"warmup_steps\" must not be negative");
  require(weight_decay >= 0, "\"weight_decay\" must not be negative");
  require(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, "betas must be in [0, 1)");
  require(adam_eps > 0, "\"adam_eps\" must be positive");
  require(grad_clip >= 0, "\"grad_clip\" must not be negative");
  require(eval_every >= 0 && checkpoint_every >= 0, "intervals must not be negative");
  require(eval_samples > 0, "\"eval_samples\" must be positive");
  require(!out_dir.empty(), "\"out_dir\" must not be empty");
  require(threads >= 0, "\"threads\" must not be negative");
  require(monitor_window >= 1, "\"monitor_window\" must be at least 1");
  require(replan_horizon >= 1, "\"replan_horizon\" must be at least 1");
  require(dp >= 0 && tp >= 1 && pp >= 1,
          "\"dp\" must be >= 0 (0: automatic), \"tp\" and \"pp\" >= 1");
}

TrainConfig TrainConfig::from_json(const Json& json, const std::string& source) {
  JsonReader r(json, source);
  TrainConfig c;
  c.model = r.optional("model", c.model);
  c.train_data = r.optional("train_data", c.train_data);
  c.val_data = r.optional("val_data", c.val_data);
  c.seq_len = r.optional("seq_len", c.seq_len);
  c.micro_batch_size = r.optional("micro_batch_size", c.micro_batch_size);
  c.global_batch_size = r.optional("global_batch_size", c.global_batch_size);
  c.steps = r.optional("steps", c.steps);
  c.seed = r.optional("seed", c.seed);
  c.lr = r.optional("lr", c.lr);
  c.min_lr_ratio = r.optional("min_lr_ratio", c.min_lr_ratio);
  c.warmup_steps = r.optional("warmup_steps", c.warmup_steps);
  c.weight_decay = r.optional("weight_decay", c.weight_decay);
  c.beta1 = r.optional("beta1", c.beta1);
  c.beta2 = r.optional("beta2", c.beta2);
  c.adam_eps = r.optional("adam_eps", c.adam_eps);
  c.grad_clip = r.optional("grad_clip", c.grad_clip);
  c.eval_every = r.optional("eval_every", c.eval_every);
  c.eval_samples = r.optional("eval_samples", c.eval_samples);
  c.checkpoint_every = r.optional("checkpoint_every", c.checkpoint_every);
  c.out_dir = r.optional("out_dir", c.out_dir);
  c.threads = r.optional("threads", c.threads);
  c.plan = r.optional("plan", c.plan);
  c.dp = r.optional("dp", c.dp);
  c.tp = r.optional("tp", c.tp);
  c.pp = r.optional("pp", c.pp);
  c.replan = r.optional("replan", c.replan);
  c.cluster = r.optional("cluster", c.cluster);
  c.profile = r.optional("profile", c.profile);
  c.monitor_window = r.optional("monitor_window", c.monitor_window);
  c.replan_horizon = r.optional("replan_horizon", c.replan_horizon);
  c.stragglers = r.optional("stragglers", c.stragglers);
  c.straggler_trace = r.optional("straggler_trace", c.straggler_trace);
  r.finish();
  c.validate(source);
  return c;
}

Json TrainConfig::to_json() const {
  return Json{{"model", model},
              {"train_data", train_data},
              {"val_data", val_data},
              {"seq_len", seq_len},
              {"micro_batch_size", micro_batch_size},
              {"global_batch_size", global_batch_size},
              {"steps", steps},
              {"seed", seed},
              {"lr", lr},
              {"min_lr_ratio", min_lr_ratio},
              {"warmup_steps", warmup_steps},
              {"weight_decay", weight_decay},
              {"beta1", beta1},
              {"beta2", beta2},
              {"adam_eps", adam_eps},
              {"grad_clip", grad_clip},
              {"eval_every", eval_every},
              {"eval_samples", eval_samples},
              {"checkpoint_every", checkpoint_every},
              {"out_dir", out_dir},
              {"threads", threads},
              {"plan", plan},
              {"dp", dp},
              {"tp", tp},
              {"pp", pp},
              {"replan", replan},
              {"cluster", cluster},
              {"profile", profile},
              {"monitor_window", monitor_window},
              {"replan_horizon", replan_horizon},
              {"stragglers", stragglers},
              {"straggler_trace", straggler_trace}};
}

}  // namespace malleus::train
