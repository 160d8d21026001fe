// Training configs for the tests: one training on the synthetic corpus, and one in which every
// field differs from its default, for the tests that must cover every field of the table (round
// trips through JSON and the command line, the resume sweep).
#pragma once

#include <filesystem>
#include <string>

#include "common/json.h"
#include "train/config.h"

namespace malleus::testing {

// Trains `model` on the corpus write_synthetic_corpus(dir / "data") writes, on one thread, into
// dir / run, without validation data; each test sets its batch, steps and rates.
inline train::TrainConfig synthetic_corpus_config(const std::filesystem::path& dir,
                                                  const std::string& model,
                                                  const std::string& run = "run") {
  train::TrainConfig c;
  c.model = model;
  c.train_data = (dir / "data" / "train_*.bin").string();
  c.val_data = "";
  c.threads = 1;
  c.out_dir = (dir / run).string();
  return c;
}

// By JSON key. Valid (TrainConfig::validate passes) but never run: the files it names need not
// exist. The model differs from the tests' checkpoints' ("tiny") as well as from the default.
inline Json every_field_changed() {
  return Json{{"model", "my-model.json"},
              {"train_data", "other/train_*.bin"},
              {"val_data", ""},
              {"seq_len", 32},
              {"micro_batch_size", 4},
              {"global_batch_size", 32},
              {"steps", 77},
              {"seed", 99},
              {"lr", 0.0005},
              {"min_lr_ratio", 0.5},
              {"warmup_steps", 7},
              {"weight_decay", 0.01},
              {"beta1", 0.8},
              {"beta2", 0.99},
              {"adam_eps", 1e-6},
              {"grad_clip", 0.5},
              {"eval_every", 9},
              {"eval_samples", 16},
              {"checkpoint_every", 11},
              {"keep_checkpoints", 4},
              {"async_checkpoints", false},
              {"memory_checkpoints", false},
              {"memory_checkpoint_every", 3},
              {"distributed_optimizer", false},
              {"out_dir", "runs/other"},
              {"threads", 1},
              {"backend", "cuda"},
              {"devices", "1,0"},
              {"cuda_math", "tf32"},
              {"shifted_recompute", true},
              {"plan", "p.json"},
              {"dp", 2},
              {"tp", 2},
              {"pp", 2},
              {"tp_subpipeline", true},
              {"replan", false},
              {"replan_links", false},
              {"cluster", "a800-4x8"},
              {"profile", "profile.json"},
              {"monitor_window", 5},
              {"replan_horizon", 20},
              {"migration_bucket_bytes", 1048576},
              {"overlap_switch", false},
              {"migration_overlap_bytes", 2097152},
              {"stragglers", {"1:2:3-4", "2:3:5-"}},
              {"straggler_trace", "trace.json"},
              {"watchdog", false},
              {"watchdog_floor_s", 30},
              {"watchdog_multiple", 4},
              {"watchdog_cut_after_s", 5},
              {"watchdog_network", "198.18.13.0/24,eth1"}};
}

// Quotes a command-line argument for the shell.
inline std::string shell_quoted(const std::string& text) {
  std::string quoted = "'";
  for (char c : text) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

// The flags of `train` that set field `f` to `value` (a JSON value of that field).
inline std::string flags_for(const train::ConfigField& f, const Json& value) {
  switch (f.kind) {
    case train::ConfigField::Kind::kSwitch:
      return value.get<bool>() ? f.flag : "--no-" + f.flag.substr(2);
    case train::ConfigField::Kind::kList: {
      std::string flags;
      for (const Json& element : value) {
        flags +=
            (flags.empty() ? "" : " ") + f.flag + " " + shell_quoted(element.get<std::string>());
      }
      return flags;
    }
    case train::ConfigField::Kind::kValue:
      break;
  }
  return f.flag + " " + shell_quoted(value.is_string() ? value.get<std::string>() : value.dump());
}

}  // namespace malleus::testing
