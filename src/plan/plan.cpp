#include "plan/plan.h"

#include <algorithm>
#include <numeric>
#include <set>

#include "common/error.h"

namespace malleus::plan {

namespace {

std::string range_text(int begin, int end) {
  std::string text = "[";  // appended piece by piece: GCC 12 warns falsely on "lit" + string
  text += std::to_string(begin);
  text += ", ";
  text += std::to_string(end);
  return text + ")";
}

std::string where(const std::string& source, size_t pipeline, size_t stage) {
  return source + ": pipeline " + std::to_string(pipeline) + " stage " + std::to_string(stage);
}

int sum(const std::vector<int>& v) {
  return std::accumulate(v.begin(), v.end(), 0);
}

void check_shares(const std::vector<int>& shares, size_t ranks, int total, int granularity,
                  const char* what, const std::string& at) {
  check(shares.size() == ranks, at + ": \"" + what + "\" lists " + std::to_string(shares.size()) +
                                    " shares for " + std::to_string(ranks) + " ranks");
  for (int s : shares) {
    // Every rank of a group takes part in every layer's collectives, so each needs some work.
    check(s > 0, at + ": \"" + what + "\" share " + std::to_string(s) + " must be positive");
    check(s % granularity == 0, at + ": \"" + what + "\" share " + std::to_string(s) +
                                    " is not a multiple of " + std::to_string(granularity) +
                                    " (heads go in whole KV groups)");
  }
  check(sum(shares) == total, at + ": \"" + what + "\" shares sum to " +
                                  std::to_string(sum(shares)) + ", the model has " +
                                  std::to_string(total));
}

}  // namespace

int Plan::global_batch() const {
  int total = 0;
  for (const auto& p : pipelines) total += p.micro_batches * micro_batch_size;
  return total;
}

std::vector<int> Plan::idle_ranks() const {
  std::vector<bool> used(static_cast<size_t>(std::max(world_size, 0)), false);
  for (const auto& p : pipelines) {
    for (const auto& s : p.stages) {
      for (int r : s.ranks) {
        if (r >= 0 && r < world_size) used[static_cast<size_t>(r)] = true;
      }
    }
  }
  std::vector<int> idle;
  for (int r = 0; r < world_size; ++r) {
    if (!used[static_cast<size_t>(r)]) idle.push_back(r);
  }
  return idle;
}

std::string Plan::summary() const {
  std::string text =
      std::to_string(pipelines.size()) + (pipelines.size() == 1 ? " pipeline:" : " pipelines:");
  for (const auto& p : pipelines) {
    text += " [pp";
    text += std::to_string(p.stages.size());
    text += " tp";
    for (size_t s = 0; s < p.stages.size(); ++s) {
      if (s > 0) text += ",";
      text += std::to_string(p.stages[s].tp());
    }
    text += " m";
    text += std::to_string(p.micro_batches);
    // Recomputation, when any stage has some: per stage "-", "s<layers>" or "f<layers>", with
    // ">" when the stage recomputes ahead of its gradient.
    bool recomputes = false;
    for (const auto& s : p.stages) recomputes = recomputes || s.recompute.layers > 0;
    if (recomputes) {
      text += " rc ";
      for (size_t s = 0; s < p.stages.size(); ++s) {
        const model::Recompute& r = p.stages[s].recompute;
        text += s > 0 ? "," : "";
        if (r.mode == model::RecomputeMode::kNone || r.layers == 0) {
          text += "-";
        } else {
          text += r.mode == model::RecomputeMode::kFull ? "f" : "s";
          text += std::to_string(r.layers);
          if (p.stages[s].recompute_ahead) text += ">";
        }
      }
    }
    text += "]";
  }
  const auto idle = idle_ranks();
  if (!idle.empty()) {
    text += " idle";
    for (int r : idle) {
      text += ' ';
      text += std::to_string(r);
    }
  }
  return text;
}

Json Plan::to_json() const {
  Json pipes = Json::array();
  for (const auto& p : pipelines) {
    Json stages = Json::array();
    for (const auto& s : p.stages) {
      Json stage = {{"layers", {s.layer_begin, s.layer_end}},
                    {"ranks", s.ranks},
                    {"heads", s.heads},
                    {"ffn", s.ffn},
                    {"vocab", s.vocab}};
      if (s.recompute.mode != model::RecomputeMode::kNone) {
        stage["recompute"] = model::recompute_mode_name(s.recompute.mode);
        stage["recompute_layers"] = s.recompute.layers;
      }
      if (s.recompute_ahead) stage["recompute_ahead"] = true;
      stages.push_back(std::move(stage));
    }
    pipes.push_back({{"micro_batches", p.micro_batches}, {"stages", stages}});
  }
  return {{"world_size", world_size}, {"micro_batch_size", micro_batch_size}, {"pipelines", pipes}};
}

Plan Plan::from_json(const Json& json, const model::ModelConfig& model, const std::string& source) {
  JsonReader r(json, source);
  Plan plan;
  plan.world_size = r.required<int>("world_size");
  plan.micro_batch_size = r.optional<int>("micro_batch_size", 1);
  const Json pipes = r.required<Json>("pipelines");
  r.finish();
  check(pipes.is_array(), source + ": \"pipelines\" must be a list");
  const int group = model.num_heads / model.num_kv_heads;
  for (size_t i = 0; i < pipes.size(); ++i) {
    JsonReader pr(pipes[i], source + ": pipeline " + std::to_string(i));
    Pipeline p;
    p.micro_batches = pr.required<int>("micro_batches");
    const Json stages = pr.required<Json>("stages");
    pr.finish();
    check(stages.is_array(), pr.source() + ": \"stages\" must be a list");
    for (size_t j = 0; j < stages.size(); ++j) {
      JsonReader sr(stages[j], where(source, i, j));
      Stage s;
      const auto layers = sr.required<std::vector<int>>("layers");
      check(layers.size() == 2, sr.source() + ": \"layers\" must be [begin, end)");
      s.layer_begin = layers[0];
      s.layer_end = layers[1];
      s.ranks = sr.required<std::vector<int>>("ranks");
      check(!s.ranks.empty(), sr.source() + ": \"ranks\" is empty");
      const int tp = s.tp();
      s.heads = sr.optional("heads", even_shares(model.num_heads, tp, group));
      s.ffn = sr.optional("ffn", even_shares(model.ffn_hidden_size, tp));
      s.vocab = sr.optional("vocab", even_shares(model.vocab_size, tp));
      const auto mode = sr.optional<std::string>("recompute", "none");
      const auto parsed = model::parse_recompute_mode(mode);
      check(parsed.has_value(), sr.source() + ": \"recompute\" is \"" + mode +
                                    "\"; expected \"none\", \"selective\" or \"full\"");
      s.recompute.mode = *parsed;
      s.recompute.layers = sr.optional<int>(
          "recompute_layers", s.recompute.mode == model::RecomputeMode::kNone ? 0 : s.num_layers());
      s.recompute_ahead = sr.optional<bool>("recompute_ahead", false);
      sr.finish();
      p.stages.push_back(std::move(s));
    }
    plan.pipelines.push_back(std::move(p));
  }
  return plan;
}

void validate(const Plan& plan, const model::ModelConfig& model, const std::string& source) {
  check(plan.world_size > 0, source + ": \"world_size\" must be positive");
  check(plan.micro_batch_size > 0, source + ": \"micro_batch_size\" must be positive");
  check(!plan.pipelines.empty(), source + ": the plan has no pipelines");
  const int group = model.num_heads / model.num_kv_heads;
  std::vector<std::string> rank_owner(static_cast<size_t>(plan.world_size));
  for (size_t i = 0; i < plan.pipelines.size(); ++i) {
    const Pipeline& p = plan.pipelines[i];
    const std::string at_pipe = source + ": pipeline " + std::to_string(i);
    check(p.micro_batches >= 1, at_pipe + ": \"micro_batches\" must be at least 1 (got " +
                                    std::to_string(p.micro_batches) + ")");
    check(!p.stages.empty(), at_pipe + " has no stages");
    int next_layer = 0;
    for (size_t j = 0; j < p.stages.size(); ++j) {
      const Stage& s = p.stages[j];
      const std::string at = where(source, i, j);
      check(s.layer_begin == next_layer && s.layer_end > s.layer_begin,
            at + ": layers " + range_text(s.layer_begin, s.layer_end) +
                " must be a non-empty range starting at layer " + std::to_string(next_layer) +
                " (every layer exactly once, in order)");
      next_layer = s.layer_end;
      check(!s.ranks.empty(), at + ": no ranks");
      for (int r : s.ranks) {
        check(r >= 0 && r < plan.world_size, at + ": rank " + std::to_string(r) +
                                                 " is outside the world of " +
                                                 std::to_string(plan.world_size) + " ranks");
        std::string& owner = rank_owner[static_cast<size_t>(r)];
        check(owner.empty(), at + ": rank " + std::to_string(r) + " is already used by " +
                                 (owner.empty() ? std::string() : owner));
        owner = "pipeline " + std::to_string(i) + " stage " + std::to_string(j);
      }
      if (s.recompute.mode == model::RecomputeMode::kNone) {
        check(s.recompute.layers == 0, at + ": \"recompute_layers\" is " +
                                           std::to_string(s.recompute.layers) +
                                           " but \"recompute\" is \"none\"");
      } else {
        check(s.recompute.layers >= 0 && s.recompute.layers <= s.num_layers(),
              at + ": \"recompute_layers\" is " + std::to_string(s.recompute.layers) +
                  ", the stage has " + std::to_string(s.num_layers()) + " layers");
      }
      if (s.recompute_ahead) {
        check(s.recompute.mode != model::RecomputeMode::kNone && s.recompute.layers > 0,
              at + ": \"recompute_ahead\" is true but the stage recomputes no layer");
        check(j + 1 < p.stages.size(),
              at + ": \"recompute_ahead\" is true on the last stage, which has no gradient to "
                   "wait for");
      }
      check_shares(s.heads, s.ranks.size(), model.num_heads, group, "heads", at);
      check_shares(s.ffn, s.ranks.size(), model.ffn_hidden_size, 1, "ffn", at);
      check_shares(s.vocab, s.ranks.size(), model.vocab_size, 1, "vocab", at);
    }
    check(next_layer == model.num_layers, at_pipe + ": layers " +
                                              range_text(next_layer, model.num_layers) +
                                              " are not covered by any stage (the model has " +
                                              std::to_string(model.num_layers) + " layers)");
  }
}

void validate(const Plan& plan, const model::ModelConfig& model, int world_size, int global_batch,
              const std::string& source) {
  validate(plan, model, source);
  check(plan.world_size == world_size, source + ": the plan is for " +
                                           std::to_string(plan.world_size) +
                                           " ranks but the job has " + std::to_string(world_size));
  check(plan.global_batch() == global_batch, source + ": micro-batches × micro-batch size sum to " +
                                                 std::to_string(plan.global_batch()) +
                                                 " sequences, the global batch is " +
                                                 std::to_string(global_batch));
}

std::vector<int> even_shares(int total, int parts, int granularity) {
  check(parts > 0 && granularity > 0, "even_shares: parts and granularity must be positive");
  const int units = total / granularity;
  std::vector<int> shares(static_cast<size_t>(parts));
  for (int i = 0; i < parts; ++i) {
    shares[static_cast<size_t>(i)] = (units / parts + (i < units % parts ? 1 : 0)) * granularity;
  }
  return shares;
}

Plan uniform_plan(const model::ModelConfig& model, int dp, int tp, int pp, int global_batch,
                  int micro_batch_size, int world_size) {
  check(dp > 0 && tp > 0 && pp > 0, "dp, tp and pp must be positive");
  check(pp <= model.num_layers, "pp=" + std::to_string(pp) + " exceeds the model's " +
                                    std::to_string(model.num_layers) + " layers");
  check(micro_batch_size > 0 && global_batch % micro_batch_size == 0,
        "global batch " + std::to_string(global_batch) + " is not a multiple of micro-batch size " +
            std::to_string(micro_batch_size));
  const int micro_batches = global_batch / micro_batch_size;
  check(micro_batches >= dp, "global batch " + std::to_string(global_batch) + " gives " +
                                 std::to_string(micro_batches) +
                                 " micro-batches, fewer than dp=" + std::to_string(dp));
  const int group = model.num_heads / model.num_kv_heads;
  check(model.num_kv_heads >= tp, "tp=" + std::to_string(tp) + " exceeds the model's " +
                                      std::to_string(model.num_kv_heads) + " KV heads");
  Plan plan;
  plan.world_size = world_size > 0 ? world_size : dp * tp * pp;
  check(plan.world_size >= dp * tp * pp,
        "dp × tp × pp = " + std::to_string(dp) + " × " + std::to_string(tp) + " × " +
            std::to_string(pp) + " = " + std::to_string(dp * tp * pp) +
            " ranks exceed the world of " + std::to_string(plan.world_size));
  plan.micro_batch_size = micro_batch_size;
  const auto layers = even_shares(model.num_layers, pp);
  const auto batches = even_shares(micro_batches, dp);
  for (int d = 0; d < dp; ++d) {
    Pipeline p;
    p.micro_batches = batches[static_cast<size_t>(d)];
    int begin = 0;
    for (int s = 0; s < pp; ++s) {
      Stage stage;
      stage.layer_begin = begin;
      stage.layer_end = begin + layers[static_cast<size_t>(s)];
      begin = stage.layer_end;
      for (int t = 0; t < tp; ++t) stage.ranks.push_back((d * pp + s) * tp + t);
      stage.heads = even_shares(model.num_heads, tp, group);
      stage.ffn = even_shares(model.ffn_hidden_size, tp);
      stage.vocab = even_shares(model.vocab_size, tp);
      p.stages.push_back(std::move(stage));
    }
    plan.pipelines.push_back(std::move(p));
  }
  validate(plan, model, "uniform plan");
  return plan;
}

}  // namespace malleus::plan
