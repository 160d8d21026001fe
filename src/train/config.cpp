#include "train/config.h"

#include <cstdio>
#include <cstdlib>
#include <map>
#include <type_traits>

#include "common/error.h"
#include "elastic/stragglers.h"

namespace malleus::train {

namespace {

template <typename T>
using Limits = std::function<void(const T& value, const std::string& what)>;

template <typename T>
std::string shown(const T& value) {
  if constexpr (std::is_floating_point_v<T>) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", static_cast<double>(value));
    return text;
  } else {
    return std::to_string(value);
  }
}

// A float as the shortest decimal that reads back as the same float (1e-08, not the double
// nearest the float, 9.99999993922529e-09): what config files and --print-config show.
double shortest_decimal(float value) {
  char text[32];
  for (int digits = 6; digits < 9; ++digits) {
    std::snprintf(text, sizeof text, "%.*g", digits, static_cast<double>(value));
    if (std::strtof(text, nullptr) == value) return std::strtod(text, nullptr);
  }
  std::snprintf(text, sizeof text, "%.9g", static_cast<double>(value));
  return std::strtod(text, nullptr);
}

template <typename T>
Limits<T> positive() {
  return [](const T& v, const std::string& what) {
    check(v > 0, what + " must be positive (got " + shown(v) + ")");
  };
}
template <typename T>
Limits<T> not_negative() {
  return [](const T& v, const std::string& what) {
    check(v >= 0, what + " must not be negative (got " + shown(v) + ")");
  };
}
template <typename T>
Limits<T> at_least(T low) {
  return [low](const T& v, const std::string& what) {
    check(v >= low, what + " must be at least " + shown(low) + " (got " + shown(v) + ")");
  };
}
// [low, high], or [low, high) when `high_open`.
Limits<float> within(float low, float high, bool high_open) {
  return [=](const float& v, const std::string& what) {
    check(v >= low && (high_open ? v < high : v <= high),
          what + " must be in [" + shown(low) + ", " + shown(high) + (high_open ? ")" : "]") +
              " (got " + shown(v) + ")");
  };
}
Limits<std::string> non_empty() {
  return [](const std::string& v, const std::string& what) {
    check(!v.empty(), what + " must not be empty");
  };
}
// Each entry parses as RANK:RATE:FROM-TO: a syntax error is found before any file is read. Ranks
// beyond the world are checked by the trainer, which knows the world size.
Limits<std::vector<std::string>> straggler_specs() {
  return [](const std::vector<std::string>& specs, const std::string& what) {
    for (const auto& spec : specs) {
      try {
        elastic::StragglerSchedule().add(spec);
      } catch (const Error& e) {
        throw Error(what + ": " + e.what());
      }
    }
  };
}

Limits<std::string> backend_kind() {
  return [](const std::string& v, const std::string& what) { device::parse_backend_kind(v, what); };
}
Limits<std::string> device_list() {
  return [](const std::string& v, const std::string& what) { device::parse_devices(v, what); };
}

template <typename T>
const char* type_name() {
  if constexpr (std::is_same_v<T, std::string> || std::is_same_v<T, std::vector<std::string>>) {
    return "TEXT";
  } else if constexpr (std::is_floating_point_v<T>) {
    return "FLOAT";
  } else {
    return "INT";
  }
}

template <typename T>
ConfigField field(T TrainConfig::*member, const char* key, const char* flag, OnResume on_resume,
                  const char* help, Limits<T> limits = {}) {
  ConfigField f;
  f.key = key;
  f.flag = flag;
  f.help = help;
  f.type_name = type_name<T>();
  f.on_resume = on_resume;
  if constexpr (std::is_same_v<T, bool>) {
    f.kind = ConfigField::Kind::kSwitch;
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    f.kind = ConfigField::Kind::kList;
  }
  f.read = [member, limits](TrainConfig& c, const Json& value, const std::string& what) {
    T v = json_to<T>(value, what);
    if (limits) limits(v, what);
    c.*member = std::move(v);
  };
  f.write = [member](const TrainConfig& c) {
    if constexpr (std::is_same_v<T, float>) {
      return Json(shortest_decimal(c.*member));
    } else {
      return Json(c.*member);
    }
  };
  f.check = [member, limits](const TrainConfig& c, const std::string& what) {
    if (limits) limits(c.*member, what);
  };
  f.from_texts = [](const std::vector<std::string>& texts, const std::string& what) -> Json {
    if constexpr (std::is_same_v<T, std::vector<std::string>>) {
      return Json(texts);
    } else {
      check(!texts.empty(), what + " needs a value");
      const std::string& text = texts.back();
      if constexpr (std::is_same_v<T, std::string>) {
        return Json(text);
      } else if constexpr (std::is_same_v<T, bool>) {
        check(text == "true" || text == "false", what + ": \"" + text + "\" is not true or false");
        return Json(text == "true");
      } else {
        // The JSON number grammar, so that a flag and a config file accept the same numbers;
        // json_to then applies the same strictness to both.
        const Json number = Json::parse(text, nullptr, /*allow_exceptions=*/false);
        check(number.is_number(), what + ": \"" + text + "\" is not a number");
        return number;
      }
    }
  };
  return f;
}

using P = OnResume;
using C = TrainConfig;

// What is trained, on which data, in which batches, for how long.
std::vector<ConfigField> run_fields() {
  return {
      field(&C::model, "model", "--model", P::kFixed, "Model preset or JSON file", non_empty()),
      field(&C::train_data, "train_data", "--train-data", P::kHonoured,
            "Training shards (file or wildcard pattern)", non_empty()),
      field(&C::val_data, "val_data", "--val-data", P::kHonoured,
            "Validation shards; \"\" disables evaluation"),
      field(&C::seq_len, "seq_len", "--seq-len", P::kFixed, "Tokens per sequence", positive<int>()),
      field(&C::micro_batch_size, "micro_batch_size", "--micro-batch", P::kResharded,
            "Sequences per micro-batch", positive<int>()),
      field(&C::global_batch_size, "global_batch_size", "--global-batch", P::kFixed,
            "Sequences per optimizer step (a multiple of the micro-batch)", positive<int>()),
      field(&C::steps, "steps", "--steps", P::kHonoured, "Total optimizer steps of the run",
            positive<int64_t>()),
      field(&C::seed, "seed", "--seed", P::kFixed, "Seed of initialisation and data order"),
  };
}

// AdamW and its learning-rate schedule.
std::vector<ConfigField> optimizer_fields() {
  return {
      field(&C::lr, "lr", "--lr", P::kHonoured, "Peak learning rate", positive<float>()),
      field(&C::min_lr_ratio, "min_lr_ratio", "--min-lr-ratio", P::kHonoured,
            "Final learning rate of the cosine decay, as a fraction of the peak",
            within(0, 1, false)),
      field(&C::warmup_steps, "warmup_steps", "--warmup-steps", P::kHonoured,
            "Linear learning-rate warmup steps", not_negative<int64_t>()),
      field(&C::weight_decay, "weight_decay", "--weight-decay", P::kHonoured, "AdamW weight decay",
            not_negative<float>()),
      field(&C::beta1, "beta1", "--beta1", P::kHonoured, "AdamW beta1", within(0, 1, true)),
      field(&C::beta2, "beta2", "--beta2", P::kHonoured, "AdamW beta2", within(0, 1, true)),
      field(&C::adam_eps, "adam_eps", "--adam-eps", P::kHonoured, "AdamW epsilon",
            positive<float>()),
      field(&C::grad_clip, "grad_clip", "--grad-clip", P::kHonoured,
            "Clip the global gradient norm to this (0: no clipping)", not_negative<float>()),
  };
}

// Evaluation, checkpoints and the run directory.
std::vector<ConfigField> output_fields() {
  return {
      field(&C::eval_every, "eval_every", "--eval-every", P::kHonoured,
            "Evaluate every N steps (0: only at the end)", not_negative<int64_t>()),
      field(&C::eval_samples, "eval_samples", "--eval-samples", P::kHonoured,
            "Validation sequences per evaluation", positive<int>()),
      field(&C::checkpoint_every, "checkpoint_every", "--checkpoint-every", P::kHonoured,
            "Checkpoint every N steps (0: only at the end)", not_negative<int64_t>()),
      field(&C::keep_checkpoints, "keep_checkpoints", "--keep-checkpoints", P::kHonoured,
            "Keep the newest N disk checkpoints, removing older ones after each save (0: keep "
            "all; the latest, any with a `keep` file and any being read always stay)",
            not_negative<int>()),
      field(&C::async_checkpoints, "async_checkpoints", "--async-checkpoints", P::kHonoured,
            "Write checkpoints in the background; the step waits only for a copy in memory "
            "(--no-async-checkpoints: the step waits for the files)"),
      field(&C::memory_checkpoints, "memory_checkpoints", "--memory-checkpoints", P::kHonoured,
            "Keep a copy of each rank's checkpoint shard in a peer's host memory, for restarts "
            "after a lost rank (--no-memory-checkpoints: disk checkpoints only)"),
      field(&C::memory_checkpoint_every, "memory_checkpoint_every", "--memory-checkpoint-every",
            P::kHonoured,
            "Memory checkpoint every N steps (0: chosen from the measured cost of a save)",
            not_negative<int64_t>()),
      field(&C::out_dir, "out_dir", "--out", P::kHonoured,
            "Run directory: metrics.jsonl and checkpoints/ (resuming: the resumed run's)",
            non_empty()),
  };
}

// Threads, recomputation and the parallel plan.
std::vector<ConfigField> parallel_fields() {
  return {
      field(&C::threads, "threads", "--threads", P::kHonoured,
            "Compute threads per rank (0: the node's cores shared among its ranks)",
            not_negative<int>()),
      field(&C::backend, "backend", "--backend", P::kHonoured,
            "What each rank computes on: cpu, or cuda (one GPU per rank by its local rank; "
            "needs a build with -DMALLEUS_BUILD_CUDA=ON)",
            backend_kind()),
      field(&C::devices, "devices", "--devices", P::kHonoured,
            "CUDA devices the ranks of a node take in turn, e.g. 0,1 (\"\": every device); "
            "ranks may share one",
            device_list()),
      field(&C::cuda_math, "cuda_math", "--cuda-math", P::kHonoured,
            "How the CUDA backend multiplies: exact (fp32), tf32 or bf16 tensor cores",
            non_empty()),
      field(&C::shifted_recompute, "shifted_recompute", "--shifted-recompute", P::kHonoured,
            "Recompute a micro-batch's activations while its gradient is on its way on every "
            "recomputing stage before the last (--no-shifted-recompute: only where the plan "
            "says recompute_ahead, in the backward elsewhere)"),
      field(&C::plan, "plan", "--plan", P::kResharded,
            "Parallel plan file (docs/plan-format.md); \"auto\": the planner's plan for the "
            "job's ranks; \"\": the uniform plan of --dp/--tp/--pp"),
      field(&C::distributed_optimizer, "distributed_optimizer", "--distributed-optimizer",
            P::kResharded,
            "Split Adam moments and the update among the ranks holding the same parameters "
            "(ZeRO-1), where some are held by two or more (--no-distributed-optimizer: every "
            "holder keeps whole moments)"),
      field(&C::dp, "dp", "--dp", P::kResharded,
            "Pipelines of the uniform plan (0: as many as the ranks allow)", not_negative<int>()),
      field(&C::tp, "tp", "--tp", P::kResharded, "Tensor-parallel degree of the uniform plan",
            positive<int>()),
      field(&C::pp, "pp", "--pp", P::kResharded, "Pipeline stages of the uniform plan",
            positive<int>()),
      field(&C::tp_subpipeline, "tp_subpipeline", "--tp-subpipeline", P::kHonoured,
            "Sub-pipelined tensor parallelism: overlap one half-micro-batch's TP all-reduce with "
            "the other half's compute (--no-tp-subpipeline: whole micro-batches)"),
  };
}

// The controller: re-planning around slow ranks and links, and live migration.
std::vector<ConfigField> elastic_fields() {
  return {
      field(&C::replan, "replan", "--replan", P::kHonoured,
            "Re-plan around slow ranks (--no-replan keeps the starting plan)"),
      field(&C::replan_links, "replan_links", "--replan-links", P::kHonoured,
            "Re-plan around slow links between hosts too (--no-replan-links: links are measured "
            "and logged, the controller plans as if they were healthy)"),
      field(&C::cluster, "cluster", "--cluster", P::kHonoured,
            "Cluster preset or file the controller plans for", non_empty()),
      field(&C::profile, "profile", "--profile", P::kHonoured,
            "Measured layer times (malleus profile) for the controller"),
      field(&C::monitor_window, "monitor_window", "--monitor-window", P::kHonoured,
            "Steps in the straggler monitor's sliding median", at_least(1)),
      field(&C::replan_horizon, "replan_horizon", "--replan-horizon", P::kHonoured,
            "Steps over which a re-plan's gain must pay for its migration", at_least(1)),
      field(&C::migration_bucket_bytes, "migration_bucket_bytes", "--migration-bucket-bytes",
            P::kHonoured,
            "Bytes a live migration may hold per rank above max(its memory before, after): the "
            "state moves band by band within this",
            positive<int64_t>()),
      field(&C::overlap_switch, "overlap_switch", "--overlap-switch", P::kHonoured,
            "Move the Adam moments of a switch while the new plan's first step computes "
            "(--no-overlap-switch: everything moves before it)"),
      field(&C::migration_overlap_bytes, "migration_overlap_bytes", "--migration-overlap-bytes",
            P::kHonoured,
            "Old Adam moments a rank may still hold during the new plan's first step (the rest "
            "moves before it)",
            not_negative<int64_t>()),
  };
}

// Injected stragglers, and the watchdog that ends a hung job.
std::vector<ConfigField> fault_fields() {
  return {
      field(&C::stragglers, "stragglers", "--straggler", P::kHonoured,
            "Inject a straggler: RANK:RATE:FROM-TO (steps, inclusive); repeatable",
            straggler_specs()),
      field(&C::straggler_trace, "straggler_trace", "--straggler-trace", P::kHonoured,
            "Injected straggler trace (JSON)"),
      field(&C::watchdog, "watchdog", "--watchdog", P::kHonoured,
            "End a hung job, naming the ranks that did not arrive (several ranks only)"),
      field(&C::watchdog_floor_s, "watchdog_floor_s", "--watchdog-floor", P::kHonoured,
            "Seconds a step, evaluation or checkpoint may always take before it counts as hung",
            positive<float>()),
      field(&C::watchdog_multiple, "watchdog_multiple", "--watchdog-multiple", P::kHonoured,
            "... or this many times its median duration so far, if longer", at_least(1.0f)),
      field(&C::watchdog_cut_after_s, "watchdog_cut_after_s", "--watchdog-cut-after", P::kHonoured,
            "Seconds no probe between two hosts may connect before the watchdog calls their link "
            "cut and leaves the hosts on its far side out",
            positive<float>()),
      field(&C::watchdog_network, "watchdog_network", "--watchdog-network", P::kHonoured,
            "The job's network for the watchdog's probes: CIDR ranges or interface names, "
            "comma-separated (default: Open MPI's btl_tcp_if_include, else every interface)"),

  };
}

// Every field, section by section: the order of `train --help`'s flags.
std::vector<ConfigField> make_fields() {
  std::vector<ConfigField> fields;
  for (auto section : {run_fields, optimizer_fields, output_fields, parallel_fields, elastic_fields,
                       fault_fields}) {
    for (ConfigField& f : section()) fields.push_back(std::move(f));
  }
  return fields;
}

std::string key_in(const std::string& source, const std::string& key) {
  return source + ": key \"" + key + "\"";
}

}  // namespace

const std::vector<ConfigField>& TrainConfig::fields() {
  static const std::vector<ConfigField> table = make_fields();
  return table;
}

ConfigValues TrainConfig::values_of(const Json& json, const std::string& source) {
  JsonReader reader(json, source);  // refuses anything but an object
  ConfigValues values;
  for (const ConfigField& f : fields()) {
    if (reader.has(f.key))
      values.push_back({&f, reader.optional<Json>(f.key, {}), key_in(source, f.key)});
  }
  reader.finish();  // unknown keys
  return values;
}

void TrainConfig::apply(const ConfigValues& values) {
  for (const ConfigValue& v : values) v.field->read(*this, v.value, v.what);
}

void TrainConfig::validate(const std::string& source) const {
  for (const ConfigField& f : fields()) f.check(*this, key_in(source, f.key));
  check(global_batch_size % micro_batch_size == 0,
        source + ": \"global_batch_size\" (" + std::to_string(global_batch_size) +
            ") must be a multiple of \"micro_batch_size\" (" + std::to_string(micro_batch_size) +
            ")");
}

TrainConfig TrainConfig::from_json(const Json& json, const std::string& source) {
  TrainConfig c;
  c.apply(values_of(json, source));
  c.validate(source);
  return c;
}

device::BackendChoice TrainConfig::backend_choice() const {
  return {device::parse_backend_kind(backend, "\"backend\""),
          device::parse_devices(devices, "\"devices\""), cuda_math};
}

Json TrainConfig::to_json() const {
  Json json = Json::object();
  for (const ConfigField& f : fields()) json[f.key] = f.write(*this);
  return json;
}

TrainConfig TrainConfig::resumed(const ConfigValues& values, int64_t checkpoint_step) const {
  TrainConfig c = *this;
  const ConfigValue* steps_value = nullptr;
  // A checkpoint at step 0 (an import, say) has made no progress that a new sequence length,
  // batch or data order would break: only its model is fixed.
  const auto fixed = [&](const ConfigField& f) {
    return f.on_resume == OnResume::kFixed && (checkpoint_step > 0 || f.key == "model");
  };
  for (const ConfigValue& v : values) {
    if (fixed(*v.field)) {
      // Compared in the field's own type, so 16 and 16.0 or "tiny" given twice are equal.
      TrainConfig asked = c;
      v.field->read(asked, v.value, v.what);
      const Json wanted = v.field->write(asked), kept = v.field->write(*this);
      check(wanted == kept, v.what + " is " + wanted.dump() + ", but the checkpoint's " +
                                v.field->key + " is " + kept.dump() +
                                ": a resumed run keeps its model, sequence length, global batch "
                                "and seed (start a new run to change them)");
    }
    v.field->read(c, v.value, v.what);
    if (v.field->key == "steps") steps_value = &v;
  }
  if (steps_value != nullptr) {
    check(c.steps > checkpoint_step, steps_value->what + " is " + std::to_string(c.steps) +
                                         ", but the checkpoint is already at step " +
                                         std::to_string(checkpoint_step) +
                                         ": give more steps than that to train further");
  } else {
    check(c.steps > checkpoint_step,
          "the checkpoint is at step " + std::to_string(checkpoint_step) + ", the run's last (" +
              "\"steps\" is " + std::to_string(c.steps) + "): give --steps above " +
              std::to_string(checkpoint_step) + " to train further");
  }
  return c;
}

}  // namespace malleus::train
