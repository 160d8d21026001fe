// Everything that defines a training run besides the model shape: data, batch, optimizer, LR
// schedule, logging and checkpointing. Read from a JSON file (configs/train/*.json) with strict
// keys; the command line may override single fields.
//
// Each field is declared twice only: as a member below and as one row of the field table
// (TrainConfig::fields(), config.cpp), which gives its JSON key, command-line flag, help, limits
// and resume policy. Reading and writing JSON, the `train` command's flags and what a resumed run
// does with a field given again all come from that table.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/json.h"
#include "device/device.h"

namespace malleus::train {

struct TrainConfig;

// What a resumed run does with a field given again (as a flag or in --config).
enum class OnResume {
  kHonoured,   // takes effect from the checkpoint's step on (length, output, logging, optimizer
               // hyperparameters, threads, straggler tolerance and injection)
  kResharded,  // the parallel plan: the checkpoint is resharded to the new one
  kFixed,      // the model, the data order or the batch: must equal the checkpoint's value
               // (at step 0, as after an import, only the model is fixed)
};

// One row of the field table.
struct ConfigField {
  enum class Kind {
    kValue,   // one value; a flag given twice takes the last
    kSwitch,  // a bool: `--flag` / `--no-flag`
    kList,    // a list of strings: the flag is repeated, once per element
  };
  std::string key;   // in JSON
  std::string flag;  // on the command line, e.g. "--seq-len"
  std::string help;
  std::string type_name;  // for help: TEXT, INT, FLOAT
  Kind kind = Kind::kValue;
  OnResume on_resume = OnResume::kHonoured;

  // Sets the field from a JSON value, converted strictly (common/json.h) and checked against the
  // field's limits; errors start with `what` (a file's key, or the flag).
  std::function<void(TrainConfig&, const Json& value, const std::string& what)> read;
  std::function<Json(const TrainConfig&)> write;
  // Checks the field's limits (as read() does), for configs built in code.
  std::function<void(const TrainConfig&, const std::string& what)> check;
  // The JSON value of the flag's command-line texts: the last text of a value (a number must
  // parse as one), all texts of a list, "true"/"false" of a switch.
  std::function<Json(const std::vector<std::string>& texts, const std::string& what)> from_texts;
};

// A value for one field, and where it came from (for messages): `f.json: key "steps"`, `--steps`.
struct ConfigValue {
  const ConfigField* field = nullptr;
  Json value;
  std::string what;
};
using ConfigValues = std::vector<ConfigValue>;

struct TrainConfig {
  std::string model = "demo";  // preset name or model JSON file
  std::string train_data = "data/fortunes/train_*.bin";
  std::string val_data = "data/fortunes/val_*.bin";  // empty: no evaluation
  int seq_len = 256;
  int micro_batch_size = 2;
  int global_batch_size = 16;  // sequences per optimizer step; a multiple of micro_batch_size
  int64_t steps = 300;
  uint64_t seed = 1234;  // parameter init and data order

  // AdamW with linear warmup then cosine decay to min_lr_ratio × lr.
  float lr = 2e-3f;
  float min_lr_ratio = 0.1f;
  int64_t warmup_steps = 30;
  float weight_decay = 0.1f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float adam_eps = 1e-8f;
  float grad_clip = 1.0f;  // global gradient-norm clip; 0 disables

  int64_t eval_every = 100;  // steps; 0 disables periodic evaluation
  int eval_samples = 64;     // validation sequences per evaluation (capped at the split's size)
  int64_t checkpoint_every = 100;  // steps; 0: only at the end
  // Disk checkpoints kept: the newest N (and the latest, any marked with a `keep` file, any being
  // read; checkpoint/retention.h); 0 keeps every one.
  int keep_checkpoints = 0;
  // Write checkpoints in the background: the saving step waits only for the copy of each rank's
  // pieces to host memory (checkpoint/checkpoint_writer.h).
  bool async_checkpoints = true;
  // In-memory redundant checkpoints (checkpoint/memory_checkpoint.h): every
  // memory_checkpoint_every steps each rank's shard is copied into a peer's host memory, which a
  // restart by malleus launch reads instead of the disk. 0: the interval is chosen from the
  // measured cost of a save, as the fewest steps that keep it under kMemoryCheckpointBudget of
  // the training time (Checkpointing::save_to_memory, train/checkpointing.h).
  bool memory_checkpoints = true;
  int64_t memory_checkpoint_every = 0;
  // ZeRO-1: Adam moments and the update split among each parameter piece's holders
  // (runtime::EngineOptions::distributed_optimizer).
  bool distributed_optimizer = true;
  std::string out_dir = "runs/demo";  // metrics.jsonl and checkpoints/
  int threads = 0;  // per rank; 0: the machine's cores shared among the ranks on it
  // What each rank computes on (device/device.h): "cpu" or "cuda"; with cuda, the devices the
  // ranks of a node take in turn ("0,1"; "": every device) and how cuBLAS multiplies.
  std::string backend = "cpu";
  std::string devices;
  std::string cuda_math = "bf16";
  // Every stage that recomputes activations, other than the last, recomputes a micro-batch's
  // forward while its gradient is on its way (runtime::EngineOptions::shifted_recompute); off,
  // only the stages the plan marks (plan::Stage::recompute_ahead, where the planner found the
  // memory for it).
  bool shifted_recompute = false;

  // The parallel plan: a plan file (docs/plan-format.md), "auto" for the planner's plan on the
  // job's ranks (train/trainer.h), or else the uniform dp × tp × pp plan (dp = 0: as many
  // pipelines as the ranks allow).
  std::string plan;
  int dp = 0, tp = 1, pp = 1;
  // Sub-pipelined tensor parallelism (model/transformer.h, runtime/engine.h): each micro-batch
  // runs as two parts inside a tensor-parallel block so that one part's all-reduce overlaps the
  // other's compute. Off by default: on CPU ranks it does not pay (docs/performance.md).
  bool tp_subpipeline = false;

  // Straggler tolerance: re-plan when the monitored rates move (elastic/controller.h), planning
  // for the cluster preset `cluster` with one device per rank.
  bool replan = true;
  bool replan_links = true;  // the controller plans for measured link rates (several hosts)
  std::string cluster = "cpu-local";
  // A `malleus profile` file: the controller's cost model then uses these measured layer times
  // instead of the cluster's peak × MFU (scaled by each rank's share of the cores when more ranks
  // than cores run on this machine).
  std::string profile;
  int monitor_window = 3;   // steps in the monitor's sliding median
  int replan_horizon = 50;  // steps over which a re-plan's gain must pay for its migration
  // A migration's extra memory per rank, over max(before, after), stays under this
  // (runtime::EngineOptions::migration_bucket_bytes).
  int64_t migration_bucket_bytes = int64_t{64} << 20;
  // The overlapped switch (runtime::Engine::switch_to): the Adam moments move while the new plan's
  // first step computes; false: the synchronous switch (Engine::migrate). The old moments a rank
  // may still hold during that step (EngineOptions::migration_overlap_bytes).
  bool overlap_switch = true;
  int64_t migration_overlap_bytes = int64_t{256} << 20;
  // Injected stragglers for experiments: "RANK:RATE:FROM-TO" entries and/or a trace file.
  std::vector<std::string> stragglers;
  std::string straggler_trace;

  // Hang detection on several ranks (watchdog/watchdog.h): a step, evaluation or checkpoint that
  // takes longer than max(watchdog_floor_s, watchdog_multiple × its median so far) ends the job,
  // naming the ranks that did not arrive, or the hosts cut off: those its probes over the job's
  // network (watchdog_network: CIDR ranges or interface names; "": Open MPI's btl_tcp_if_include,
  // else every interface) could not reach for watchdog_cut_after_s.
  bool watchdog = true;
  float watchdog_floor_s = 120.0f;
  float watchdog_multiple = 10.0f;
  float watchdog_cut_after_s = 3.0f;
  std::string watchdog_network;

  int64_t tokens_per_step() const { return int64_t{global_batch_size} * seq_len; }
  // backend, devices and cuda_math as device::open_device takes them.
  device::BackendChoice backend_choice() const;

  bool operator==(const TrainConfig&) const = default;

  // The field table, in the order of the members above.
  static const std::vector<ConfigField>& fields();
  // The values a JSON object gives, in table order; an unknown key is refused, naming `source`.
  static ConfigValues values_of(const Json& json, const std::string& source);
  // Sets each value's field (strictly converted and range-checked, naming the value's origin).
  void apply(const ConfigValues& values);

  // Every field's limits, then the rules between fields; errors name `source`.
  void validate(const std::string& source) const;
  // The defaults with the object's keys applied, then validated.
  static TrainConfig from_json(const Json& json, const std::string& source);
  Json to_json() const;

  // The config of a run resumed from a checkpoint whose config is *this and whose step is
  // `checkpoint_step`, with `values` given again: kHonoured and kResharded fields take the new
  // value; a kFixed field given a different value is refused, naming both values; and the run
  // must have steps left (steps > checkpoint_step). Throws Error.
  TrainConfig resumed(const ConfigValues& values, int64_t checkpoint_step) const;
};

}  // namespace malleus::train
